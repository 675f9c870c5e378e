/* CPU kernels per type and SIMD level (internal). types.c owns the table of the kernels
 * selected for the current level; the matmul reads it through gh_kernels_get().
 *
 * Every weight type has one kernel shape, a register tile ("gemm"): it computes
 *     y[t * ldy + r] = W[r] . X[t]      for r < nr, t < nt
 * with W rows `w_stride` bytes apart (in the weight's type) and X rows `x_stride`
 * bytes apart (already converted to the type's vec_dot_type). nr <= mr and nt <= nt
 * of the kernel set, or nt == 1 and nr <= mr1. A 1 x 1 tile is the vec_dot of the type table. */
#ifndef GH_KERNELS_H
#define GH_KERNELS_H

#include "types/types.h"

#include <string.h>

/* Internal activation type for Q4_0 and Q8_0 weights (never in files; gh_type_valid
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

typedef void (*gh_gemm_fn)(int64_t n, const void * w, size_t w_stride, int nr,
                           const void * x, size_t x_stride, int nt, float * y, int64_t ldy);

/* Four gathered rows, one token (the sparse row-dots): y[r] = rows[r] . x for r < 4, each
 * row's value computed exactly as the type's four-row decode tile computes it (so it does
 * not depend on the other three rows: a short list pads with repeats). While it runs it
 * prefetches the rows pf[0..4) (the tile after next, say) into L2, a slice per step. */
typedef void (*gh_dot4_fn)(int64_t n, const void * const * rows, const void * const * pf,
                           const void * x, float * y);

typedef struct {
    gh_vec_dot_fn    vec_dot;
    gh_from_float_fn from_float_x;  /* NULL when vec_dot_type is F32 (no conversion) */
    gh_gemm_fn       gemm;
    int              mr;            /* max rows of a tile */
    int              nt;            /* max tokens of a tile */
    int              mr1;           /* max rows of a one-token tile (decode) */
    gh_dot4_fn       dot4;          /* gathered four-row tile, or NULL (vec_dot per row) */
} gh_kernel_set;

/* The kernels for `type` at the current SIMD level (initialises SIMD on first use);
 * NULL for a type without kernels. */
const gh_kernel_set * gh_kernels_get(int type);

/* Fill *ks with this level's kernels for `type`; false if the level has none for it
 * (the caller keeps the lower level's). */
bool gh_kernels_scalar(int type, gh_kernel_set * ks);
bool gh_kernels_avx2(int type, gh_kernel_set * ks);
bool gh_kernels_avx512(int type, gh_kernel_set * ks);

/* Detect the CPU once (thread-safe) and select the kernels; called by every entry
 * point that uses the kernel table. */
void gh_simd_ensure_init(void);

/* The eight 6-bit scales and mins of a Q4_K/Q5_K block (gh_k4_scale_min for j = 0..7)
 * at once, as bytes: sub-block j's scale is byte j of sm[0..2), its min byte j of sm[2..4)
 * (little-endian words of the 12 scale bytes: the low 6 bits of bytes 0..3 / 4..7 are
 * sub-blocks 0..3's scales / mins, bytes 8..11 the low nibbles of 4..7's, whose top two
 * bits sit in the top bits of bytes 0..3 / 4..7). */
static inline void gh_k4_scales_mins(const uint8_t * q, uint32_t sm[4]) {
    uint32_t w[3];
    memcpy(w, q, sizeof(w));
    sm[0] = w[0] & 0x3f3f3f3fu;
    sm[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    sm[2] = w[1] & 0x3f3f3f3fu;
    sm[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
}

/* Scalar helpers shared by the kernel files. */
void gh_quantize_row_q8_x4_ref(const float * x, void * y, int64_t n);
void gh_quantize_row_q8_K_ref(const float * x, void * y, int64_t n);

#endif
