/* The tensor type table: one row per type, as in ggml. Block layouts are byte-identical
 * to GGUF/ggml (so files written by the gguf package and llama.cpp load):
 *   F32, F16 (IEEE half), BF16 (upper half of f32),
 *   Q8_0: { fp16 d; int8 qs[32] }               x = d * q
 *   Q4_0: { fp16 d; uint8 qs[16] }              x = d * (nibble - 8); element j < 16 is
 *          the low nibble of qs[j], element j + 16 the high nibble of qs[j].
 *   Q4_1: { fp16 d, m; uint8 qs[16] }           x = d * nibble + m (nibbles as Q4_0)
 *   Q5_0: { fp16 d; uint8 qh[4]; uint8 qs[16] } x = d * (q - 16), q = nibble | bit j of
 *          the little-endian word qh << 4 (element j < 32)
 *   Q5_1: { fp16 d, m; uint8 qh[4]; uint8 qs[16] }  x = d * q + m, q as Q5_0's
 * K-quants: super-blocks of QK_K = 256 values.
 *   Q4_K: { fp16 d, dmin; uint8 scales[12]; uint8 qs[128] }        144 bytes
 *          8 sub-blocks of 32: x = d * sc[j] * q - dmin * m[j], q = 0..15, sc and m
 *          6-bit, packed in scales[] (gh_k4_scale_min); sub-block 2c is the low nibbles
 *          of qs[32c .. 32c + 32), sub-block 2c + 1 their high nibbles.
 *   Q5_K: { fp16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128] }   176 bytes
 *          as Q4_K with q = 0..31: bit 4 of value l of sub-block j is bit j of qh[l].
 *   Q6_K: { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d }   210 bytes
 *          16 sub-blocks of 16: x = d * scales[j] * (q - 32), q = 0..63. Half h (128
 *          values) takes ql[64h ..], qh[32h ..]: value 32g + l (g < 4, l < 32) has low
 *          bits ql[64h + l + 32 (g & 1)] >> 4 (g >> 1) and high bits qh[32h + l] >> 2g.
 *   Q2_K: { uint8 scales[16]; uint8 qs[64]; fp16 d, dmin }        84 bytes
 *          16 sub-blocks of 16: x = d * (scales[j] & 15) * q - dmin * (scales[j] >> 4),
 *          q = 0..3. Half h (128 values) takes qs[32h ..]: value 128h + 32g + l (g < 4,
 *          l < 32) is (qs[32h + l] >> 2g) & 3 (so sub-block j = v / 16 as Q6_K's).
 *   Q3_K: { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d }   110 bytes
 *          16 sub-blocks of 16: x = d * (sc[j] - 32) * (q - 4), sc 6-bit (gh_k3_scale),
 *          q = 0..7: its low two bits as Q2_K's, bit 2 of value v is bit v / 32 of
 *          hmask[v % 32] (set: q - 4 = 0..3; clear: -4..-1). */
#ifndef GH_TYPES_H
#define GH_TYPES_H

#include "core/common.h"

#define QK8_0 32
#define QK4_0 32

typedef struct { uint16_t d; int8_t  qs[QK8_0]; } block_q8_0;
typedef struct { uint16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1;

#define QK_K 256
#define K_SCALE_SIZE 12

typedef struct { uint16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; } block_q4_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t  scales[K_SCALE_SIZE];
    uint8_t  qh[QK_K / 8];
    uint8_t  qs[QK_K / 2];
} block_q5_K;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_K;
typedef struct { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d, dmin; } block_q2_K;
typedef struct { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; } block_q3_K;
#ifdef __cplusplus /* the CUDA backend includes this header */
#define GH_STATIC_ASSERT static_assert
#else
#define GH_STATIC_ASSERT _Static_assert
#endif
GH_STATIC_ASSERT(sizeof(block_q4_1) == 20, "block_q4_1 layout");
GH_STATIC_ASSERT(sizeof(block_q5_0) == 22, "block_q5_0 layout");
GH_STATIC_ASSERT(sizeof(block_q5_1) == 24, "block_q5_1 layout");
GH_STATIC_ASSERT(sizeof(block_q4_K) == 144, "block_q4_K layout");
GH_STATIC_ASSERT(sizeof(block_q5_K) == 176, "block_q5_K layout");
GH_STATIC_ASSERT(sizeof(block_q6_K) == 210, "block_q6_K layout");
GH_STATIC_ASSERT(sizeof(block_q2_K) == 84, "block_q2_K layout");
GH_STATIC_ASSERT(sizeof(block_q3_K) == 110, "block_q3_K layout");

/* Internal activation type of the 32-value block weights (Q4_0, Q8_0, ...) (never in files; gh_type_valid
 * says no, gh_type_traits_get returns NULL for it; gh_row_size knows its size).
 * A row is quantized like Q8_0 (per 32 values: d = amax / 127, q = round(x / d)), then
 * stored in groups of four blocks (128 values), laid out for 128-bit-lane SIMD:
 * lane i of qa/qb is block i's first/second 16 values. Rows are padded with zero
 * blocks to a multiple of 128 values. */
#define GH_TYPE_Q8_X4 1000
#define QK8_X4 128

typedef struct {
    int8_t  qa[64];    /* bytes 16i..16i+15: block i, values 0..15 */
    int8_t  qb[64];    /* bytes 16i..16i+15: block i, values 16..31 */
    int32_t nsum[16];  /* lanes 4i..4i+3: -sum(q) of block i */
    float   d[16];     /* lanes 4i..4i+3: scale of block i */
} block_q8_x4;

/* Internal activation type of the K-quant weights (ggml's Q8_K layout and id; never a
 * weight: gh_type_valid says no). Per 256 values: d = amax / 127, q = round(x / d) (as
 * Q8_0), and the sums of each 16 consecutive q, which carry the K-quants' per-sub-block
 * mins (Q4_K, Q5_K) and zero point (Q6_K) at one multiply per sub-block. */
#define GH_TYPE_Q8_K 15

typedef struct {
    float   d;
    int8_t  qs[QK_K];
    int16_t bsums[QK_K / 16];
} block_q8_K;
GH_STATIC_ASSERT(sizeof(block_q8_K) == 292, "block_q8_K layout");

/* The 5-bit value j (< 32) of a Q5_0/Q5_1 block from its nibbles and high bits. */
static inline int gh_q5_value(const uint8_t * qs, const uint8_t * qh, int j) {
    const uint32_t h = (uint32_t) qh[0] | (uint32_t) qh[1] << 8 | (uint32_t) qh[2] << 16 |
                       (uint32_t) qh[3] << 24;
    const int lo = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
    return lo | (int) ((h >> j) & 1u) << 4;
}

/* Scale and min (6 bits each) of sub-block j < 8 of a Q4_K/Q5_K block: bytes 0..3 hold
 * the scales of sub-blocks 0..3 in their low 6 bits, bytes 4..7 the mins; sub-blocks 4..7
 * keep their low 4 bits in bytes 8..11 (scale low nibble, min high nibble) and their top
 * 2 bits in the spare top bits of bytes 0..3 (scales) and 4..7 (mins). */
static inline void gh_k4_scale_min(const uint8_t * q, int j, uint8_t * sc, uint8_t * m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t) ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t) ((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* The 6-bit scale (0..63, stored + 32) of sub-block j < 16 of a Q3_K block: its low four
 * bits are the low nibble of scales[j] (j < 8) or the high nibble of scales[j - 8], its top
 * two bits bits 2 (j / 4) .. 2 (j / 4) + 1 of scales[8 + j % 4]. */
static inline int gh_k3_scale(const uint8_t * s, int j) {
    const int lo = j < 8 ? (s[j] & 0x0f) : (s[j - 8] >> 4);
    return lo | (((s[8 + (j & 3)] >> (2 * (j >> 2))) & 3) << 4);
}

/* The 2-bit part of value v < 256 of a Q2_K/Q3_K block's qs[64]. */
static inline int gh_k2_low(const uint8_t * qs, int v) {
    return (qs[32 * (v >> 7) + (v & 31)] >> (2 * ((v >> 5) & 3))) & 3;
}

float gh_fp16_to_fp32(uint16_t h);
uint16_t gh_fp32_to_fp16(float f);
float gh_bf16_to_fp32(uint16_t h);
uint16_t gh_fp32_to_bf16(float f); /* round to nearest even, NaN kept quiet */

/* Dot product of one weight row (type of the row) with one activation row already
 * converted to the type's vec_dot_type: *s = sum_i w[i] * x[i] over n elements. */
typedef void (*gh_vec_dot_fn)(int64_t n, float * s, const void * w, const void * x);
typedef void (*gh_to_float_fn)(const void * src, float * dst, int64_t n);
typedef void (*gh_from_float_fn)(const float * src, void * dst, int64_t n);

/* ggml's type ids are below this (the table is indexed by id). */
#define GH_TYPE_COUNT 42

/* A row of the type table: the layout of a type (ggml's ids, names and block sizes, for
 * every type a GGUF file can hold) and, for the types this runtime reads, its reference
 * conversions. The kernels are cpu/'s table (cpu/kernels.h). */
typedef struct {
    const char *     name;
    int64_t          block_size;   /* elements per block */
    size_t           type_size;    /* bytes per block */
    bool             is_quantized;
    gh_to_float_fn   to_float;     /* dequantize a row; NULL: a type this runtime does not read */
    gh_from_float_fn from_float;   /* quantize a row (reference); NULL for a type read
                                    * but not written (the IQ lattice types) */
    int              vec_dot_type; /* type activations are converted to before dot: F32
                                    * for F32/F16, BF16 for BF16, for the 32-value block
                                    * types the internal GH_TYPE_Q8_X4 and for the
                                    * K-quants the internal GH_TYPE_Q8_K (cpu/kernels.h),
                                    * which gh_type_traits_get does not know: size buffers
                                    * with gh_row_size(vec_dot_type, n) */
} gh_type_traits;

/* The row of a type this runtime reads; NULL for any other id (untrusted: comes from
 * files). */
const gh_type_traits * gh_type_traits_get(int type);
/* The row of any type ggml defines (its name, block and bytes), read or not; NULL for an
 * id ggml does not use. */
const gh_type_traits * gh_type_layout(int type);
bool gh_type_valid(int type);
/* Bytes of n elements of type; 0 if n is not a multiple of the block size. */
size_t gh_row_size(int type, int64_t n);
/* "f32, f16, ... and i32": the names of the types this runtime reads (from the table),
 * for messages. */
const char * gh_types_read_list(void);

/* The layouts of the non-linear types are their own headers, included where they are
 * read: types/iq4.h (IQ4_NL, IQ4_XS, MXFP4), types/iqlat.h (the IQ lattice types). */

#endif
