/* AVX2 axpy kernels of the transposed matmul: one row and four rows for every type (the
 * 32-value block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 through one body over
 * the type; the K-quants Q4_K, Q5_K, Q6_K, Q2_K, Q3_K through another; IQ4_XS), the
 * sixteen-row int8 forms of Q8_0, Q4_0, Q4_1 and the K-quants (one token and a batch), and the F32
 * row's dense-block tiles; the table of them is at the end.
 *
 * K-quants: y[0..n) += s * row and the four-row forms, rows starting at a block boundary,
 * n a multiple of 256. Each block is taken apart once (avx2/kq_unpack.h: its quants as bytes, its sub-blocks'
 * f and g with the row's scale folded in), then per 8 values one widening load, one
 * conversion and one FMA. The one-row form adds f q + g (the dequantized value times s)
 * to y; the four-row forms start each vector from y plus the four rows' g and add f_k q_k
 * for k = 0..3, so they differ from four one-row calls by rounding only. The forms with
 * and without prefetch share one body and agree bit for bit. */
#include "cpu/kernels.h"
#include "types/iq4.h"

#include "cpu/avx2/kq_unpack.h"
#include "cpu/avx2/axpy_int8.h"
#include "cpu/avx2/iqlat_avx2.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

/* (the file is built with the AVX2 level's flags: CMakeLists.txt) */
#define AVX2_FN
#define AVX2_INLINE AVX2_FN static inline __attribute__((always_inline))

/* ---- float types and the 32-value block types: one row and four rows ---- */

AVX2_FN static void axpy_f32_avx2(int64_t n, float s, const void * row, float * restrict y) {
    const float * x = row;
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 y0 = _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i));
        __m256 y1 = _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8));
        _mm256_storeu_ps(y + i, y0);
        _mm256_storeu_ps(y + i + 8, y1);
    }
    for (; i < n; i++) y[i] += s * x[i];
}

AVX2_FN static void axpy_f16_avx2(int64_t n, float s, const void * row, float * restrict y) {
    const uint16_t * x = row;
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i)));
        __m256 x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i + 8)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vs, x0, _mm256_loadu_ps(y + i)));
        _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(vs, x1, _mm256_loadu_ps(y + i + 8)));
    }
    for (; i < n; i++) y[i] += s * gh_fp16_to_fp32(x[i]);
}

AVX2_FN static void axpy_bf16_avx2(int64_t n, float s, const void * row, float * restrict y) {
    const uint16_t * x = row;
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) (x + i)));
        __m256 xf = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vs, xf, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) y[i] += s * gh_bf16_to_fp32(x[i]);
}

/* The AVX2 four-row forms: y[0..n) += s[0] * row[0] + ... + s[3] * row[3], rows added in
 * order 0..3 per vector of y. Each is one inline body with and without prefetch (pf NULL:
 * none; else the same column range of the rows pf[0..4) into L2, a slice per step), so
 * the two forms sum bit for bit alike. */

AVX2_INLINE __m256 ld8_f32(const void * p, int64_t i) { return _mm256_loadu_ps((const float *) p + i); }
AVX2_INLINE __m256 ld8_f16(const void * p, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const uint16_t *) p + i)));
}
AVX2_INLINE __m256 ld8_bf16(const void * p, int64_t i) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) ((const uint16_t *) p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
AVX2_INLINE float ld1_f32(const void * p, int64_t i) { return ((const float *) p)[i]; }
AVX2_INLINE float ld1_f16(const void * p, int64_t i) { return gh_fp16_to_fp32(((const uint16_t *) p)[i]); }
AVX2_INLINE float ld1_bf16(const void * p, int64_t i) { return gh_bf16_to_fp32(((const uint16_t *) p)[i]); }

/* A float type's four-row forms from its row of loads (8 values, one value) and bytes per
 * value, as the AVX-512 file's DEFINE_AXPY_FLOAT. */
#define DEFINE_AXPY4_FLOAT_AVX2(name, LD8, LD1, WSZ)                                        \
    AVX2_INLINE void name##_body(int64_t n, const float * s, const void * const * row,     \
                                 const void * const * pf, float * restrict y) {             \
        const __m256 vs[4] = { _mm256_set1_ps(s[0]), _mm256_set1_ps(s[1]), _mm256_set1_ps(s[2]), \
                               _mm256_set1_ps(s[3]) };                                     \
        const size_t wsz = (WSZ);                                                           \
        int64_t i = 0;                                                                      \
        for (; i + 8 <= n; i += 8) {                                                        \
            if (pf && ((i * wsz) & 63) == 0) {                                              \
                for (int k = 0; k < 4; k++) _mm_prefetch((const char *) pf[k] + i * wsz, _MM_HINT_T1); \
            }                                                                               \
            __m256 acc = _mm256_loadu_ps(y + i);                                            \
            for (int k = 0; k < 4; k++) acc = _mm256_fmadd_ps(vs[k], LD8(row[k], i), acc);  \
            _mm256_storeu_ps(y + i, acc);                                                   \
        }                                                                                   \
        for (; i < n; i++) {                                                                \
            for (int k = 0; k < 4; k++) y[i] += s[k] * LD1(row[k], i);                      \
        }                                                                                   \
    }                                                                                       \
    AVX2_FN static void name(int64_t n, const float * s, const void * const * row,         \
                             float * restrict y) {                                         \
        name##_body(n, s, row, NULL, y);                                                    \
    }                                                                                       \
    AVX2_FN static void name##pf(int64_t n, const float * s, const void * const * row,     \
                                 const void * const * pf, float * restrict y) {             \
        name##_body(n, s, row, pf, y);                                                      \
    }

DEFINE_AXPY4_FLOAT_AVX2(axpy4_f32_avx2, ld8_f32, ld1_f32, 4)
DEFINE_AXPY4_FLOAT_AVX2(axpy4_f16_avx2, ld8_f16, ld1_f16, 2)
DEFINE_AXPY4_FLOAT_AVX2(axpy4_bf16_avx2, ld8_bf16, ld1_bf16, 2)

/* Block i's four scales times s, ds[k] = s[k] * d_k: one conversion for the four rows (the
 * products are the scalar s[k] * fp16_to_fp32(d) exactly). */
AVX2_INLINE void block_scales4(const float * s, uint16_t d0, uint16_t d1, uint16_t d2, uint16_t d3,
                               float * ds) {
    const __m128i h = _mm_cvtsi64_si128((long long) (d0 | (uint64_t) d1 << 16 | (uint64_t) d2 << 32 |
                                                     (uint64_t) d3 << 48));
    _mm_storeu_ps(ds, _mm_mul_ps(_mm_cvtph_ps(h), _mm_loadu_ps(s)));
}

/* The 32-value block types' layouts, a row each: Q8_0 { d, qs[32] }, Q4_0 { d, qs[16] },
 * Q4_1 { d, m, qs[16] }, Q5_0 { d, qh[4], qs[16] }, Q5_1 { d, m, qh[4], qs[16] },
 * IQ4_NL { d, qs[16] }, MXFP4 { e, qs[16] } (the scale 2^(e - 128), every other scale an
 * fp16 d at byte 0). The bodies below take the type as a GH_TYPE_* constant at every call,
 * so its row's fields fold to constants and the branches away (the Q8_0 and Q4_0 instances
 * are the instructions they were before the others came). */
typedef struct {
    size_t bytes;           /* a block's */
    size_t qs, qh;          /* where its quants are, and (bits 5) the words of fifth bits */
    int bits;               /* 8: int8 quants; 4: nibbles (Q4_0: less 8); 5: nibbles and a qh bit */
    bool min;               /* x = d q + m, m the fp16 word after d (Q4_1, Q5_1) */
    bool e8m0;              /* the scale an E8M0 exponent (MXFP4), else an fp16 d */
    bool mid;               /* prefetch_blocks4 adds the middle lines (all but Q4_0: the IQ kinds'
                             * 68..72 bytes of four blocks may span three lines too) */
    const int8_t * levels;  /* IQ4_NL, MXFP4: every value a level of this 16-entry table */
} b32_layout;

static const b32_layout b32_rows[GH_TYPE_COUNT] = {
    [GH_TYPE_Q8_0]   = { sizeof(block_q8_0), offsetof(block_q8_0, qs), 0, 8, false, false, true, NULL },
    [GH_TYPE_Q4_0]   = { sizeof(block_q4_0), offsetof(block_q4_0, qs), 0, 4, false, false, false, NULL },
    [GH_TYPE_Q4_1]   = { sizeof(block_q4_1), offsetof(block_q4_1, qs), 0, 4, true, false, true, NULL },
    [GH_TYPE_Q5_0]   = { sizeof(block_q5_0), offsetof(block_q5_0, qs), offsetof(block_q5_0, qh), 5, false, false,
                         true, NULL },
    [GH_TYPE_Q5_1]   = { sizeof(block_q5_1), offsetof(block_q5_1, qs), offsetof(block_q5_1, qh), 5, true, false,
                         true, NULL },
    [GH_TYPE_IQ4_NL] = { sizeof(block_iq4_nl), offsetof(block_iq4_nl, qs), 0, 4, false, false, true,
                         gh_kvalues_iq4nl },
    [GH_TYPE_MXFP4]  = { sizeof(block_mxfp4), offsetof(block_mxfp4, qs), 0, 4, false, true, true, gh_kvalues_mxfp4 },
};

/* The scale of the block at b. */
AVX2_INLINE float b32_scale(const int type, const uint8_t * b) {
    if (b32_rows[type].e8m0) return gh_e8m0_to_fp32_half(b[0]);
    uint16_t d;
    memcpy(&d, b, 2);
    return _cvtsh_ss(d);
}

/* The levels of the 16 nibble bytes at qs (table: the type's 16 int8 levels) as int32:
 * v[0], v[1] values 0..15 (the low nibbles), v[2], v[3] values 16..31 (the high ones). */
AVX2_INLINE void iq4_levels_i32(__m128i table, const uint8_t * qs, __m256i v[4]) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i q = _mm_loadu_si128((const __m128i *) qs);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
    v[0] = _mm256_cvtepi8_epi32(lo);
    v[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
    v[2] = _mm256_cvtepi8_epi32(hi);
    v[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
}
GH_STATIC_ASSERT(offsetof(block_q4_1, m) == 2 && offsetof(block_q5_1, m) == 2, "min after d");

/* Every fourth block prefetches those four blocks' bytes of the pf rows: their first and
 * last byte cover Q4_0's 72 bytes' lines, `mid` adds the lines at +64 (the 80..96 bytes of
 * Q4_1, Q5_0, Q5_1) and +128 (Q8_0's 136 bytes, up to four lines: without the middle ones
 * every scattered row missed on them; docs/BENCHMARKS.md). */
AVX2_INLINE void prefetch_blocks4(const void * const * pf, int64_t i, size_t bs, bool mid) {
    for (int k = 0; k < 4; k++) {
        _mm_prefetch((const char *) pf[k] + i * bs, _MM_HINT_T1);
        if (mid) for (size_t o = 64; o < 4 * bs - 1; o += 64) _mm_prefetch((const char *) pf[k] + i * bs + o, _MM_HINT_T1);
        _mm_prefetch((const char *) pf[k] + (i + 4) * bs - 1, _MM_HINT_T1);
    }
}

/* The values of a block (b: its first byte) widened straight from memory (the loads fold
 * into vpmovzxbd / vpmovsxbd, two or four per block instead of a load, shifts and four
 * register widenings on the shuffle port): v[j] = values 8j..8j+7 as int32, the zero point
 * taken out (Q4_0 8, Q5_0 16; not the min of Q4_1, Q5_1). The nibble types: bytes 0..7 and
 * 8..15 widened once each give values 0..15 (low nibbles) and 16..31 (high nibbles); Q5's
 * fifth bit of value 8j + l is bit 8j + l of the qh word, picked per lane by a mask. */
AVX2_INLINE void block_i32(const int type, const uint8_t * b, __m256i v[4]) {
    const b32_layout L = b32_rows[type];
    if (L.levels) { /* the levels, looked up */
        iq4_levels_i32(_mm_loadu_si128((const __m128i *) L.levels), b + L.qs, v);
    } else if (L.bits == 8) {
        for (int j = 0; j < 4; j++) v[j] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (b + 2 + 8 * j)));
    } else if (L.bits == 4 && !L.min) {
        const uint8_t * qs = b + L.qs;
        const __m256i m4 = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) qs));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 8)));
        v[0] = _mm256_sub_epi32(_mm256_and_si256(b0, m4), eight);
        v[1] = _mm256_sub_epi32(_mm256_and_si256(b1, m4), eight);
        v[2] = _mm256_sub_epi32(_mm256_srli_epi32(b0, 4), eight);
        v[3] = _mm256_sub_epi32(_mm256_srli_epi32(b1, 4), eight);
    } else {
        const uint8_t * qs = b + L.qs;
        const __m256i m4 = _mm256_set1_epi32(0x0f);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) qs));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 8)));
        v[0] = _mm256_and_si256(b0, m4);
        v[1] = _mm256_and_si256(b1, m4);
        v[2] = _mm256_srli_epi32(b0, 4);
        v[3] = _mm256_srli_epi32(b1, 4);
        if (L.bits == 5) {
            uint32_t h;
            memcpy(&h, b + L.qh, 4);
            const __m256i hv = _mm256_set1_epi32((int) h);
            const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            for (int j = 0; j < 4; j++) {
                const __m256i bit = _mm256_slli_epi32(lane, 8 * j); /* a constant */
                const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(hv, bit), bit);
                v[j] = L.min ? _mm256_or_si256(v[j], _mm256_and_si256(set, _mm256_set1_epi32(16)))
                                            /* Q5_0: q - 16 = nibble - 16 where the bit is clear */
                                            : _mm256_add_epi32(v[j], _mm256_andnot_si256(set, _mm256_set1_epi32(-16)));
            }
        }
    }
}

/* One row: y[0..32) += s * d * (a block's values) (+ s * m for Q4_1, Q5_1), per block. */
AVX2_INLINE void axpy_quant_avx2(const int type, int64_t n, float s, const void * row, float * restrict y) {
    const size_t bs = b32_rows[type].bytes;
    const uint8_t * b = row;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const __m256 ds = _mm256_set1_ps(s * b32_scale(type, b + i * bs));
        __m256i v[4];
        block_i32(type, b + i * bs, v);
        if (b32_rows[type].min) {
            uint16_t m;
            memcpy(&m, b + i * bs + 2, 2);
            const __m256 ms = _mm256_set1_ps(s * _cvtsh_ss(m));
            for (int j = 0; j < 4; j++) {
                const __m256 t = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(v[j]), ms);
                _mm256_storeu_ps(y + 8 * j, _mm256_add_ps(_mm256_loadu_ps(y + 8 * j), t));
            }
            continue;
        }
        for (int j = 0; j < 4; j++) {
            _mm256_storeu_ps(y + 8 * j, _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(v[j]), _mm256_loadu_ps(y + 8 * j)));
        }
    }
}

#define DEFINE_AXPY_B32_AVX2(name, TYPE)                                                     \
    AVX2_FN static void name(int64_t n, float s, const void * row, float * restrict y) {     \
        axpy_quant_avx2(TYPE, n, s, row, y);                                                 \
    }

DEFINE_AXPY_B32_AVX2(axpy_q8_0_avx2, GH_TYPE_Q8_0)
DEFINE_AXPY_B32_AVX2(axpy_q4_0_avx2, GH_TYPE_Q4_0)
DEFINE_AXPY_B32_AVX2(axpy_q4_1_avx2, GH_TYPE_Q4_1)
DEFINE_AXPY_B32_AVX2(axpy_q5_0_avx2, GH_TYPE_Q5_0)
DEFINE_AXPY_B32_AVX2(axpy_q5_1_avx2, GH_TYPE_Q5_1)
DEFINE_AXPY_B32_AVX2(axpy_iq4_nl_avx2, GH_TYPE_IQ4_NL)
DEFINE_AXPY_B32_AVX2(axpy_mxfp4_avx2, GH_TYPE_MXFP4)

/* Four rows: each vector of y starts from y plus the four rows' s * m (Q4_1, Q5_1), then
 * adds s_k d_k q_k for k = 0..3. */
AVX2_INLINE void axpy4_quant_avx2(const int type, int64_t n, const float * s, const void * const * row,
                                  const void * const * pf, float * restrict y) {
    const size_t bs = b32_rows[type].bytes;
    const bool mid = b32_rows[type].mid;
    const uint8_t * b[4] = { row[0], row[1], row[2], row[3] };
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        if (pf && (i & 3) == 0) prefetch_blocks4(pf, i, bs, mid);
        float ds[4];
        if (b32_rows[type].e8m0) {
            for (int k = 0; k < 4; k++) ds[k] = s[k] * b32_scale(type, b[k] + i * bs);
        } else {
            uint16_t d[4];
            for (int k = 0; k < 4; k++) memcpy(&d[k], b[k] + i * bs, 2);
            block_scales4(s, d[0], d[1], d[2], d[3], ds);
        }
        __m256 acc[4] = { _mm256_loadu_ps(y), _mm256_loadu_ps(y + 8), _mm256_loadu_ps(y + 16),
                          _mm256_loadu_ps(y + 24) };
        if (b32_rows[type].min) {
            uint16_t m[4];
            for (int k = 0; k < 4; k++) memcpy(&m[k], b[k] + i * bs + 2, 2);
            float ms[4];
            block_scales4(s, m[0], m[1], m[2], m[3], ms);
            const __m256 g = _mm256_set1_ps((ms[0] + ms[1]) + (ms[2] + ms[3]));
            for (int j = 0; j < 4; j++) acc[j] = _mm256_add_ps(acc[j], g);
        }
        for (int k = 0; k < 4; k++) {
            const __m256 vd = _mm256_broadcast_ss(&ds[k]);
            __m256i v[4];
            block_i32(type, b[k] + i * bs, v);
            for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(v[j]), acc[j]);
        }
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + 8 * j, acc[j]);
    }
}

#define DEFINE_AXPY4_AVX2(name, BODY, ARG)                                                   \
    AVX2_FN static void name(int64_t n, const float * s, const void * const * row,         \
                             float * restrict y) {                                         \
        BODY(ARG, n, s, row, NULL, y);                                                      \
    }                                                                                       \
    AVX2_FN static void name##pf(int64_t n, const float * s, const void * const * row,     \
                                 const void * const * pf, float * restrict y) {             \
        BODY(ARG, n, s, row, pf, y);                                                        \
    }

DEFINE_AXPY4_AVX2(axpy4_q8_0_avx2, axpy4_quant_avx2, GH_TYPE_Q8_0)
DEFINE_AXPY4_AVX2(axpy4_q4_0_avx2, axpy4_quant_avx2, GH_TYPE_Q4_0)
DEFINE_AXPY4_AVX2(axpy4_q4_1_avx2, axpy4_quant_avx2, GH_TYPE_Q4_1)
DEFINE_AXPY4_AVX2(axpy4_q5_0_avx2, axpy4_quant_avx2, GH_TYPE_Q5_0)
DEFINE_AXPY4_AVX2(axpy4_q5_1_avx2, axpy4_quant_avx2, GH_TYPE_Q5_1)
DEFINE_AXPY4_AVX2(axpy4_iq4_nl_avx2, axpy4_quant_avx2, GH_TYPE_IQ4_NL)
DEFINE_AXPY4_AVX2(axpy4_mxfp4_avx2, axpy4_quant_avx2, GH_TYPE_MXFP4)

/* ---- K-quants ---- */

AVX2_INLINE __m256 ld8q(const uint8_t * q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) q)));
}

AVX2_INLINE void axpy_kq(const int kind, int64_t n, float s, const void * row, float * restrict y) {
    const size_t bs = kq_bytes(kind);
    const int sub = kq_sub_len(kind);
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        const uint8_t * b = (const uint8_t *) row + i * bs;
        uint8_t q[QK_K];
        float f[16], g[16];
        kq_factors(kind, b, s, f, g);
        kq_unpack(kind, b, q);
        for (int j = 0; j < QK_K / sub; j++) {
            const __m256 fj = _mm256_broadcast_ss(&f[j]), gj = _mm256_broadcast_ss(&g[j]);
            for (int p = sub * j; p < sub * (j + 1); p += 8) {
                _mm256_storeu_ps(y + p, _mm256_add_ps(_mm256_loadu_ps(y + p), _mm256_fmadd_ps(fj, ld8q(q + p), gj)));
            }
        }
    }
}

AVX2_INLINE void axpy4_kq(const int kind, int64_t n, const float * s, const void * const * row,
                          const void * const * pf, float * restrict y) {
    const size_t bs = kq_bytes(kind);
    const int sub = kq_sub_len(kind), nsub = QK_K / sub;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        if (pf) {
            for (int r = 0; r < 4; r++)
                for (size_t o = 0; o < bs + 63; o += 64)
                    _mm_prefetch((const char *) pf[r] + i * bs + GH_MIN(o, bs - 1), _MM_HINT_T1);
        }
        uint8_t q[4][QK_K];
        float f[4][16], g[4][16], gs[16];
        for (int r = 0; r < 4; r++) {
            const uint8_t * b = (const uint8_t *) row[r] + i * bs;
            kq_factors(kind, b, s[r], f[r], g[r]);
            kq_unpack(kind, b, q[r]);
        }
        for (int j = 0; j < nsub; j += 8) {
            const __m256 g01 = _mm256_add_ps(_mm256_loadu_ps(g[0] + j), _mm256_loadu_ps(g[1] + j));
            const __m256 g23 = _mm256_add_ps(_mm256_loadu_ps(g[2] + j), _mm256_loadu_ps(g[3] + j));
            _mm256_storeu_ps(gs + j, _mm256_add_ps(g01, g23));
        }
        for (int j = 0; j < nsub; j++) {
            const __m256 f0 = _mm256_broadcast_ss(&f[0][j]), f1 = _mm256_broadcast_ss(&f[1][j]);
            const __m256 f2 = _mm256_broadcast_ss(&f[2][j]), f3 = _mm256_broadcast_ss(&f[3][j]);
            const __m256 gj = _mm256_broadcast_ss(&gs[j]);
            for (int p = sub * j; p < sub * (j + 1); p += 8) {
                __m256 acc = _mm256_add_ps(_mm256_loadu_ps(y + p), gj);
                acc = _mm256_fmadd_ps(f0, ld8q(q[0] + p), acc);
                acc = _mm256_fmadd_ps(f1, ld8q(q[1] + p), acc);
                acc = _mm256_fmadd_ps(f2, ld8q(q[2] + p), acc);
                acc = _mm256_fmadd_ps(f3, ld8q(q[3] + p), acc);
                _mm256_storeu_ps(y + p, acc);
            }
        }
    }
}

#define DEFINE_KQ_AVX2(name, kind)                                                           \
    AVX2_FN static void name(int64_t n, float s, const void * row, float * restrict y) {     \
        axpy_kq(kind, n, s, row, y);                                                         \
    }                                                                                        \
    AVX2_FN static void name##_4(int64_t n, const float * s, const void * const * row,      \
                                 float * restrict y) {                                       \
        axpy4_kq(kind, n, s, row, NULL, y);                                                  \
    }                                                                                        \
    AVX2_FN static void name##_4pf(int64_t n, const float * s, const void * const * row,    \
                                   const void * const * pf, float * restrict y) {            \
        axpy4_kq(kind, n, s, row, pf, y);                                                    \
    }

DEFINE_KQ_AVX2(axpy_q4_K_avx2, KQ4)
DEFINE_KQ_AVX2(axpy_q5_K_avx2, KQ5)
DEFINE_KQ_AVX2(axpy_q6_K_avx2, KQ6)
DEFINE_KQ_AVX2(axpy_q2_K_avx2, KQ2)
DEFINE_KQ_AVX2(axpy_q3_K_avx2, KQ3)

/* ---- Q4_0 and Q4_1, sixteen rows per pass in int8 (the decode list's groups of 16) ----
 *
 * The arithmetic: avx2/axpy_int8.h. The float form (axpy.c) widens every nibble to a float
 * and spends an FMA on it; here the nibbles of two rows, interleaved, meet a pair
 * (m_k, m_k+1) in one vpmaddubsw, and the int16 sums of the 16 rows are widened and
 * converted once per block.
 *
 * Per chunk of CHUNK_BLOCKS blocks: the rows' scales are copied out (which also brings
 * the chunk's bytes into L1 for the pass after), the m_k and M_b of 8 blocks at a time are
 * made in vertical vector operations across the 16 rows, then the pass adds the rows. A
 * non-finite product makes its block's outputs NaN (the float form's inf - inf or NaN). */
#define CHUNK_BLOCKS 32

/* Q4_1 the same way: x = d q + m = d (q - 8) + (8 d + m), the centred nibbles through the
 * int8 sums as Q4_0's (bias -8 sum_k m_k) and the rest, g = sum_k s_k (8 d_k + m_k), one
 * float per block added before them (q4_1_g8), as the K-quants' mins (below). `type`:
 * GH_TYPE_Q4_0 or GH_TYPE_Q4_1, a constant at every call. */
AVX2_INLINE void axpy16_q4(const int type, int64_t n, const float * s, const void * const * row,
                           const void * const * pf, float * restrict y) {
    const bool q41 = type == GH_TYPE_Q4_1;
    const size_t bs = q41 ? sizeof(block_q4_1) : sizeof(block_q4_0);
    const size_t qs = q41 ? offsetof(block_q4_1, qs) : offsetof(block_q4_0, qs);
    const int64_t nb = n / QK4_0;
    for (int64_t i0 = 0; i0 < nb; i0 += CHUNK_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) CHUNK_BLOCKS, nb - i0);
        uint16_t d[16][CHUNK_BLOCKS];      /* the rows' block scales, fp16 */
        uint16_t m[16][CHUNK_BLOCKS];      /* Q4_1: their mins */
        int16_t mp[8][CHUNK_BLOCKS];       /* (m_2p, m_2p+1) as the bytes of one word */
        float scale[CHUNK_BLOCKS];         /* M_b / 127 */
        int32_t bias[CHUNK_BLOCKS];        /* -8 sum_k m_k */
        float g[CHUNK_BLOCKS];             /* Q4_1: sum_k s_k (8 d_k + m_k) */
        for (int k = 0; k < 16; k++) {
            const uint8_t * b = (const uint8_t *) row[k] + i0 * bs;
            for (int i = 0; i < nc; i++) memcpy(&d[k][i], b + i * bs, 2);
            for (int i = nc; i < CHUNK_BLOCKS; i++) d[k][i] = 0;
            if (q41) {
                for (int i = 0; i < nc; i++) memcpy(&m[k][i], b + i * bs + 2, 2);
                for (int i = nc; i < CHUNK_BLOCKS; i++) m[k][i] = 0;
            }
            if (pf) {
                const char * p = (const char *) pf[k] + i0 * bs;
                for (size_t o = 0; o < (size_t) nc * bs; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
                _mm_prefetch(p + (size_t) nc * bs - 1, _MM_HINT_T1);
            }
        }
        for (int j = 0; j < nc; j += 8) {
            int8_factors8(s, &d[0][0], 0, CHUNK_BLOCKS, j, &mp[0][0], 0, scale, bias);
            if (q41) q4_1_g8(s, &d[0][0], &m[0][0], CHUNK_BLOCKS, j, g);
        }
        float * yb = y + i0 * QK4_0;
        for (int i = 0; i < nc; i++, yb += QK4_0) {
            const size_t off = (size_t) (i0 + i) * bs + qs;
            __m256i lo = _mm256_set1_epi16((int16_t) bias[i]), hi = lo;
            for (int k = 0; k < 16; k += 2) {
                __m256i u[2];
                q4_0_pair((const uint8_t *) row[k] + off, (const uint8_t *) row[k + 1] + off, u);
                const __m256i pair = _mm256_set1_epi16(mp[k / 2][i]);
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[0], pair));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u[1], pair));
            }
            int8_store32(scale[i], q41 ? &g[i] : NULL, lo, hi, yb);
        }
    }
}

AVX2_FN static void axpy16_q4_0_avx2(int64_t n, const float * s, const void * const * row,
                                     const void * const * pf, float * restrict y) {
    axpy16_q4(GH_TYPE_Q4_0, n, s, row, pf, y);
}
AVX2_FN static void axpy16_q4_1_avx2(int64_t n, const float * s, const void * const * row,
                                     const void * const * pf, float * restrict y) {
    axpy16_q4(GH_TYPE_Q4_1, n, s, row, pf, y);
}

/* The batch form (gh_matmul16_fn): per chunk of 8 blocks the rows' nibbles are unpacked
 * once into pairs and their scales copied out, then every token makes its own factors
 * (int8_factors8 and Q4_1's g, as the one-token form does) and runs the pass over the
 * unpacked pairs. The up to four groups of a call meet each 32 values of y in one load and
 * store, added group after group: a token's sums are those of axpy16_q4 over the same
 * groups in order, bit for bit, and y stays in L1 across them (the unpacked rows, 16 KB,
 * too). Rows past nk are padding with scale 0 and product 0. */
#define BATCH_BLOCKS 8

AVX2_INLINE void matmul16_q4(const int type, int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                             const int32_t * hc, int nk, const void * const * row, float * y, int64_t ldy) {
    const bool q41 = type == GH_TYPE_Q4_1;
    const size_t bs = q41 ? sizeof(block_q4_1) : sizeof(block_q4_0);
    const size_t qs = q41 ? offsetof(block_q4_1, qs) : offsetof(block_q4_0, qs);
    const int64_t nb = n / QK4_0;
    const int ng = (nk + 15) / 16;
    static const uint8_t zero[QK4_0 / 2];
    for (int64_t i0 = 0; i0 < nb; i0 += BATCH_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) BATCH_BLOCKS, nb - i0);
        uint16_t d[4][16][BATCH_BLOCKS], m[4][16][BATCH_BLOCKS];
        __m256i u[4][BATCH_BLOCKS][8][2];
        q4_0_batch_scales(row, nk, ng, i0, nc, BATCH_BLOCKS, bs, 0, &d[0][0][0]);
        if (q41) q4_0_batch_scales(row, nk, ng, i0, nc, BATCH_BLOCKS, bs, 2, &m[0][0][0]);
        for (int g = 0; g < ng; g++) {
            for (int i = 0; i < nc; i++) {
                const size_t off = (size_t) (i0 + i) * bs + qs;
                for (int k = 16 * g; k < 16 * g + 16; k += 2) {
                    q4_0_pair(k < nk ? (const uint8_t *) row[k] + off : zero,
                              k + 1 < nk ? (const uint8_t *) row[k + 1] + off : zero, u[g][i][(k % 16) / 2]);
                }
            }
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * ht = h + t * ldh;
            int16_t mp[4][8][BATCH_BLOCKS];
            float scale[4][BATCH_BLOCKS], gq[4][BATCH_BLOCKS];
            int32_t bias[4][BATCH_BLOCKS];
            q4_0_batch_factors(ht, hc, nk, ng, BATCH_BLOCKS, &d[0][0][0], &mp[0][0][0], 0, &scale[0][0], &bias[0][0],
                               q41 ? &m[0][0][0] : NULL, &gq[0][0]);
            float * yb = y + t * ldy + i0 * QK4_0;
            for (int i = 0; i < nc; i++, yb += QK4_0) {
                __m256 yv[4];
                for (int v = 0; v < 4; v++) yv[v] = _mm256_loadu_ps(yb + 8 * v);
                for (int g = 0; g < ng; g++) {
                    __m256i lo = _mm256_set1_epi16((int16_t) bias[g][i]), hi = lo;
                    for (int p = 0; p < 8; p++) {
                        const __m256i pair = _mm256_set1_epi16(mp[g][p][i]);
                        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[g][i][p][0], pair));
                        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u[g][i][p][1], pair));
                    }
                    int8_acc32(yv, scale[g][i], q41 ? &gq[g][i] : NULL, lo, hi);
                }
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(yb + 8 * v, yv[v]);
            }
        }
    }
}

AVX2_FN static void matmul16_q4_0_avx2(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                       const int32_t * hc, int nk, const void * const * row,
                                       float * y, int64_t ldy) {
    matmul16_q4(GH_TYPE_Q4_0, n, n_tokens, h, ldh, hc, nk, row, y, ldy);
}
AVX2_FN static void matmul16_q4_1_avx2(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                       const int32_t * hc, int nk, const void * const * row,
                                       float * y, int64_t ldy) {
    matmul16_q4(GH_TYPE_Q4_1, n, n_tokens, h, ldh, hc, nk, row, y, ldy);
}

/* ---- Q8_0, sixteen rows per pass in int8: one token and a batch ----
 *
 * The factors are Q4_0's (int8_factors8: m_k = round(127 s_k d_k / M_b)), the quants
 * signed bytes: a block's sum S = sum_k m_k q_k reaches 16 * 127 * 128, past int16, so
 * the rows meet in quads (q8_quads: dword c of a vector holds four rows' column c, one
 * vector of 8 columns per quad and 8 columns) and each quad's sum is taken to int32
 * at once: vpmaddubsw of |q| (unsigned; q = -128 gives 128) with m signed by q's sign
 * (|m| <= 127, so no byte wraps), at most 2 * 128 * 127 per int16, then vpmaddwd by 1.
 * S is exact, as are the VNNI batch form's sums (avx512/axpy_avx512.c), and y += (M_b / 127) S
 * alike, so the batch forms at both levels agree with this one bit for bit (which the
 * AVX-512 level runs too: measured faster from DRAM than a VNNI version). */

/* Quad j's rows' columns of the block at off, transposed: v[0] columns 0..3 | 16..19,
 * v[1] 4..7 | 20..23, v[2] 8..11 | 24..27, v[3] 12..15 | 28..31 (dword = rows 4j..4j+3). */
AVX2_INLINE void q8_quads(const uint8_t * const * q, __m256i * v) {
    const __m256i a = _mm256_loadu_si256((const __m256i *) q[0]), b = _mm256_loadu_si256((const __m256i *) q[1]);
    const __m256i c = _mm256_loadu_si256((const __m256i *) q[2]), d = _mm256_loadu_si256((const __m256i *) q[3]);
    const __m256i ab0 = _mm256_unpacklo_epi8(a, b), ab1 = _mm256_unpackhi_epi8(a, b);
    const __m256i cd0 = _mm256_unpacklo_epi8(c, d), cd1 = _mm256_unpackhi_epi8(c, d);
    v[0] = _mm256_unpacklo_epi16(ab0, cd0);
    v[1] = _mm256_unpackhi_epi16(ab0, cd0);
    v[2] = _mm256_unpacklo_epi16(ab1, cd1);
    v[3] = _mm256_unpackhi_epi16(ab1, cd1);
}

/* acc[0..4) (q8_quads' order) += the quad's int32 sums against mj (the dword of its m). */
AVX2_INLINE void q8_quad_dot(__m256i * acc, const __m256i * v, __m256i mj) {
    const __m256i one = _mm256_set1_epi16(1);
    for (int c = 0; c < 4; c++) {
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(v[c]), _mm256_sign_epi8(mj, v[c]));
        acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(p, one));
    }
}

/* yv[0..4) (32 values of y) += scale * the sums acc in q8_quads' order. */
AVX2_INLINE void q8_acc32(__m256 * yv, float scale, const __m256i * acc) {
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256i c0 = _mm256_permute2x128_si256(acc[0], acc[1], 0x20), c1 = _mm256_permute2x128_si256(acc[2], acc[3], 0x20);
    const __m256i c2 = _mm256_permute2x128_si256(acc[0], acc[1], 0x31), c3 = _mm256_permute2x128_si256(acc[2], acc[3], 0x31);
    yv[0] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(c0), yv[0]);
    yv[1] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(c1), yv[1]);
    yv[2] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(c2), yv[2]);
    yv[3] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(c3), yv[3]);
}

AVX2_FN static void axpy16_q8_0_avx2(int64_t n, const float * s, const void * const * row,
                                     const void * const * pf, float * restrict y) {
    const size_t bs = sizeof(block_q8_0), qs = offsetof(block_q8_0, qs);
    const int64_t nb = n / QK8_0;
    for (int64_t i0 = 0; i0 < nb; i0 += CHUNK_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) CHUNK_BLOCKS, nb - i0);
        uint16_t d[16][CHUNK_BLOCKS];
        int32_t mq[4][CHUNK_BLOCKS];  /* (m_4p .. m_4p+3) as the bytes of a dword */
        float scale[CHUNK_BLOCKS];
        for (int k = 0; k < 16; k++) {
            const uint8_t * b = (const uint8_t *) row[k] + i0 * bs;
            for (int i = 0; i < nc; i++) memcpy(&d[k][i], b + i * bs, 2);
            for (int i = nc; i < CHUNK_BLOCKS; i++) d[k][i] = 0;
            if (pf) _mm_prefetch((const char *) pf[k] + i0 * bs, _MM_HINT_T1);
        }
        for (int j = 0; j < nc; j += 8) int8_factors8_off(s, &d[0][0], 0, CHUNK_BLOCKS, j, &mq[0][0], 1, scale, NULL, 0, NULL);
        float * yb = y + i0 * QK8_0;
        for (int i = 0; i < nc; i++, yb += QK8_0) {
            const size_t off = (size_t) (i0 + i) * bs + qs;
            if (pf) {
                /* the next rows' block, spread over the pass (a block's last byte: every
                 * line of the segment is some block's last line or the first block's):
                 * Q8_0's chunk is 17 KB of 16 rows, which in one burst at the chunk's
                 * start ran the whole down_t from DRAM at 0.7x the float forms */
                for (int k = 0; k < 16; k++) _mm_prefetch((const char *) pf[k] + off - qs + bs - 1, _MM_HINT_T1);
            }
            __m256i acc[4] = { _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                               _mm256_setzero_si256() };
            for (int j = 0; j < 4; j++) {
                const uint8_t * q[4];
                for (int r = 0; r < 4; r++) q[r] = (const uint8_t *) row[4 * j + r] + off;
                __m256i v[4];
                q8_quads(q, v);
                q8_quad_dot(acc, v, _mm256_set1_epi32(mq[j][i]));
            }
            __m256 yv[4];
            for (int v = 0; v < 4; v++) yv[v] = _mm256_loadu_ps(yb + 8 * v);
            q8_acc32(yv, scale[i], acc);
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(yb + 8 * v, yv[v]);
        }
    }
}

/* The batch form: per chunk of 8 blocks the groups' quads transposed once (16 KB), then
 * per token its factors (as the one-token form's) and the pass, the groups added in order
 * into y in registers: a token's sums are axpy16_q8_0_avx2's over the same groups, bit for
 * bit. Rows past nk are padding (scale 0, quants 0). */
AVX2_FN static void matmul16_q8_0_avx2(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                       const int32_t * hc, int nk, const void * const * row,
                                       float * y, int64_t ldy) {
    const size_t bs = sizeof(block_q8_0), qs = offsetof(block_q8_0, qs);
    const int64_t nb = n / QK8_0;
    const int ng = (nk + 15) / 16;
    static const uint8_t zero[QK8_0];
    for (int64_t i0 = 0; i0 < nb; i0 += BATCH_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) BATCH_BLOCKS, nb - i0);
        uint16_t d[4][16][BATCH_BLOCKS];
        __m256i u[4][BATCH_BLOCKS][4][4];  /* group, block, quad, q8_quads' vectors */
        q4_0_batch_scales(row, nk, ng, i0, nc, BATCH_BLOCKS, bs, 0, &d[0][0][0]);
        for (int g = 0; g < ng; g++) {
            for (int i = 0; i < nc; i++) {
                const size_t off = (size_t) (i0 + i) * bs + qs;
                for (int j = 0; j < 4; j++) {
                    const uint8_t * q[4];
                    for (int r = 0; r < 4; r++) {
                        const int k = 16 * g + 4 * j + r;
                        q[r] = k < nk ? (const uint8_t *) row[k] + off : zero;
                    }
                    q8_quads(q, u[g][i][j]);
                }
            }
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * ht = h + t * ldh;
            int32_t mq[4][4][BATCH_BLOCKS];
            float scale[4][BATCH_BLOCKS];
            for (int g = 0; g < ng; g++) {
                float s[16];
                batch_s16(ht, hc, nk, g, s);
                int8_factors8_off(s, &d[g][0][0], 0, BATCH_BLOCKS, 0, &mq[g][0][0], 1, scale[g], NULL, 0, NULL);
            }
            float * yb = y + t * ldy + i0 * QK8_0;
            for (int i = 0; i < nc; i++, yb += QK8_0) {
                __m256 yv[4];
                for (int v = 0; v < 4; v++) yv[v] = _mm256_loadu_ps(yb + 8 * v);
                for (int g = 0; g < ng; g++) {
                    __m256i acc[4] = { _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                       _mm256_setzero_si256() };
                    for (int j = 0; j < 4; j++) q8_quad_dot(acc, u[g][i][j], _mm256_set1_epi32(mq[g][j][i]));
                    q8_acc32(yv, scale[g][i], acc);
                }
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(yb + 8 * v, yv[v]);
            }
        }
    }
}

/* ---- The K-quants, sixteen rows per pass in int8: one token and a batch ----
 *
 * As Q4_0's forms per sub-block, on the quants as bytes (avx2/kq_unpack.h): the factors are
 * the 16 products c_k = s_k d_k sc_k,j (int8_factors8_off over 8 sub-blocks at a time).
 * The quants are unsigned with an offset or a min: sum_k c_k q_k = sum_k c_k (q_k - off)
 * + off sum_k c_k (off: Q4_K 8, Q5_K 16, Q6_K 32), and only the first, centred, part takes
 * the int8 rounding (the bias -off sum_k m_k), which halves its error against rounding
 * c_k q_k (Q4_K: 1.3% -> 0.5% nRMS on random rows); the second and the mins' term
 * sum_k s_k (-dmin_k m_k,j) are one float per sub-block (gs), added with the block's sum
 * (Q6_K's f (q - 32) is all of its value: no gs). The pass takes a chunk of 32 values,
 * rows 2p and 2p+1 interleaved in u[p] (q4_0_pair's order: values 0..7 | 16..23, 8..15 |
 * 24..31). Q4_K's and Q5_K's sums stay within 16 * 127 * 16 < 2^15 and run in one int16
 * sum; Q6_K's sub-blocks are 16 values, so a chunk holds two (the factor pair differs by
 * lane), and its sums reach 16 * 127 * 32: rows 0..7 and 8..15 run in two int16 sums (each
 * within 2^15), widened and added in int32. */
AVX2_INLINE int kq_int8_off(const int kind) { return kind == KQ4 ? 8 : kind == KQ5 ? 16 : 32; }

/* Chunk c's 8 interleaved row pairs of two rows' quant bytes qa, qb. */
AVX2_INLINE void kq_int8_pairs(const uint8_t * qa, const uint8_t * qb, int c, __m256i * u) {
    const __m256i xa = _mm256_loadu_si256((const __m256i *) (qa + 32 * c));
    const __m256i xb = _mm256_loadu_si256((const __m256i *) (qb + 32 * c));
    u[0] = _mm256_unpacklo_epi8(xa, xb);
    u[1] = _mm256_unpackhi_epi8(xa, xb);
}

/* Two words broadcast by lane: w[0] in the low 128 bits, w[1] in the high (Q6_K's pair of
 * sub-blocks in one chunk). */
AVX2_INLINE __m256i kq_int8_lanes16(const int16_t * w) {
    int32_t v;
    memcpy(&v, w, 4);
    const __m256i sel = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(v), sel);
}

/* yv (chunk c's 32 values of y) += one group's sums: u its 8 row pairs, mp[p * 16 + j] the
 * factor pairs of sub-block j, scale / bias / bias_hi / gs per sub-block (gs NULL: Q6_K). */
AVX2_INLINE void kq_int8_chunk(const int kind, const __m256i (*u)[2], const int16_t * mp, int c,
                               const float * scale, const int32_t * bias, const int32_t * bias_hi,
                               const float * gs, __m256 * yv) {
    if (kind != KQ6) {
        __m256i lo = _mm256_set1_epi16((int16_t) bias[c]), hi = lo;
        for (int p = 0; p < 8; p++) {
            const __m256i pair = _mm256_set1_epi16(mp[p * 16 + c]);
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[p][0], pair));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u[p][1], pair));
        }
        int8_acc32(yv, scale[c], &gs[c], lo, hi);
        return;
    }
    const int16_t b0[2] = { (int16_t) bias[2 * c], (int16_t) bias[2 * c + 1] };
    const int16_t b1[2] = { (int16_t) bias_hi[2 * c], (int16_t) bias_hi[2 * c + 1] };
    __m256i l0 = kq_int8_lanes16(b0), h0 = l0, l1 = kq_int8_lanes16(b1), h1 = l1;
    for (int p = 0; p < 4; p++) {
        const __m256i pa = kq_int8_lanes16(mp + p * 16 + 2 * c), pb = kq_int8_lanes16(mp + (p + 4) * 16 + 2 * c);
        l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(u[p][0], pa));
        h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(u[p][1], pa));
        l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(u[p + 4][0], pb));
        h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(u[p + 4][1], pb));
    }
#define KQ6_W(a, b, half) _mm256_cvtepi32_ps(_mm256_add_epi32(                              \
        _mm256_cvtepi16_epi32(half ? _mm256_extracti128_si256(a, 1) : _mm256_castsi256_si128(a)), \
        _mm256_cvtepi16_epi32(half ? _mm256_extracti128_si256(b, 1) : _mm256_castsi256_si128(b))))
    const __m256 s0 = _mm256_set1_ps(scale[2 * c]), s1 = _mm256_set1_ps(scale[2 * c + 1]);
    yv[0] = _mm256_fmadd_ps(s0, KQ6_W(l0, l1, 0), yv[0]);
    yv[1] = _mm256_fmadd_ps(s0, KQ6_W(h0, h1, 0), yv[1]);
    yv[2] = _mm256_fmadd_ps(s1, KQ6_W(l0, l1, 1), yv[2]);
    yv[3] = _mm256_fmadd_ps(s1, KQ6_W(h0, h1, 1), yv[3]);
#undef KQ6_W
}

/* A row's factors for the int8 forms: D[j] = d sc of sub-block j, G[j] = off D[j] + g[j]
 * (the part of f q + g outside the centred quants; 0 for Q6_K); zeros for a padding row. */
AVX2_INLINE void kq_int8_row(const int kind, const uint8_t * b, float * D, float * G) {
    if (!b) {
        memset(D, 0, 16 * sizeof(float));
        memset(G, 0, 16 * sizeof(float));
        return;
    }
    kq_factors(kind, b, 1.0f, D, G);
    const __m256 off = _mm256_set1_ps((float) kq_int8_off(kind));
    for (int j = 0; j < QK_K / kq_sub_len(kind); j += 8)
        _mm256_storeu_ps(G + j, _mm256_fmadd_ps(off, _mm256_loadu_ps(D + j), _mm256_loadu_ps(G + j)));
}

/* One group's factors of a super-block from the 16 rows' D, G [16][16] and s. */
AVX2_INLINE void kq_int8_factors(const int kind, const float * s, const float * D, const float * G,
                                 int16_t * mp, float * scale, int32_t * bias, int32_t * bias_hi, float * gs) {
    const int nsub = QK_K / kq_sub_len(kind);
    for (int j = 0; j < nsub; j += 8) {
        int8_factors8_off(s, D, 1, 16, j, mp, 0, scale, bias, kq_int8_off(kind), kind == KQ6 ? bias_hi : NULL);
        if (kind == KQ6) continue;
        __m256 g = _mm256_setzero_ps();
        for (int k = 0; k < 16; k++) g = _mm256_fmadd_ps(_mm256_set1_ps(s[k]), _mm256_loadu_ps(G + 16 * k + j), g);
        _mm256_storeu_ps(gs + j, g);
    }
}

AVX2_INLINE void axpy16_kq(const int kind, int64_t n, const float * s, const void * const * row,
                           const void * const * pf, float * restrict y) {
    const size_t bs = kq_bytes(kind);
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float D[16][16], G[16][16], scale[16], gs[16];
        uint8_t q[16][QK_K];
        int16_t mp[8][16];
        int32_t bias[16], bias_hi[16];
        for (int k = 0; k < 16; k++) {
            const uint8_t * b = (const uint8_t *) row[k] + i * bs;
            kq_int8_row(kind, b, D[k], G[k]);
            kq_unpack(kind, b, q[k]);
            if (pf) {
                const char * p = (const char *) pf[k] + i * bs;
                for (size_t o = 0; o < bs; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
                _mm_prefetch(p + bs - 1, _MM_HINT_T1);
            }
        }
        kq_int8_factors(kind, s, &D[0][0], &G[0][0], &mp[0][0], scale, bias, bias_hi, gs);
        for (int c = 0; c < QK_K / 32; c++) {
            __m256i u[8][2];
            for (int p = 0; p < 8; p++) kq_int8_pairs(q[2 * p], q[2 * p + 1], c, u[p]);
            __m256 yv[4];
            for (int v = 0; v < 4; v++) yv[v] = _mm256_loadu_ps(y + 32 * c + 8 * v);
            kq_int8_chunk(kind, (const __m256i (*)[2]) u, &mp[0][0], c, scale, bias, bias_hi, gs, yv);
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(y + 32 * c + 8 * v, yv[v]);
        }
    }
}

/* The batch form: per super-block the up to four groups' rows unpacked once into pairs (16 KB)
 * and their D, G made, then per token the factors and the pass, groups added in order into y
 * in registers, as kq_int8_chunk does for one token: a token's sums are axpy16_kq's over
 * the same groups, bit for bit. Rows past nk are padding (scale 0, quants 0). */
AVX2_INLINE void matmul16_kq(const int kind, int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                             const int32_t * hc, int nk, const void * const * row, float * y, int64_t ldy) {
    const size_t bs = kq_bytes(kind);
    const int ng = (nk + 15) / 16;
    for (int64_t i = 0; i < n / QK_K; i++) {
        float D[4][16][16], G[4][16][16];
        __m256i u[4][QK_K / 32][8][2];
        for (int g = 0; g < ng; g++) {
            for (int p = 0; p < 8; p++) {
                uint8_t q[2][QK_K];
                for (int r = 0; r < 2; r++) {
                    const int k = 16 * g + 2 * p + r;
                    const uint8_t * b = k < nk ? (const uint8_t *) row[k] + i * bs : NULL;
                    kq_int8_row(kind, b, D[g][2 * p + r], G[g][2 * p + r]);
                    if (b) kq_unpack(kind, b, q[r]);
                    else memset(q[r], 0, QK_K);
                }
                for (int c = 0; c < QK_K / 32; c++) kq_int8_pairs(q[0], q[1], c, u[g][c][p]);
            }
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * ht = h + t * ldh;
            int16_t mp[4][8][16];
            float scale[4][16], gs[4][16];
            int32_t bias[4][16], bias_hi[4][16];
            for (int g = 0; g < ng; g++) {
                float s[16];
                batch_s16(ht, hc, nk, g, s);
                kq_int8_factors(kind, s, &D[g][0][0], &G[g][0][0], &mp[g][0][0], scale[g], bias[g], bias_hi[g], gs[g]);
            }
            float * yb = y + t * ldy + i * QK_K;
            for (int c = 0; c < QK_K / 32; c++, yb += 32) {
                __m256 yv[4];
                for (int v = 0; v < 4; v++) yv[v] = _mm256_loadu_ps(yb + 8 * v);
                for (int g = 0; g < ng; g++)
                    kq_int8_chunk(kind, (const __m256i (*)[2]) u[g][c], &mp[g][0][0], c, scale[g], bias[g],
                                  bias_hi[g], gs[g], yv);
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(yb + 8 * v, yv[v]);
            }
        }
    }
}

#define DEFINE_KQ_INT8_AVX2(type, kind)                                                        \
    AVX2_FN static void axpy16_##type##_avx2(int64_t n, const float * s, const void * const * row, \
                                             const void * const * pf, float * restrict y) {    \
        axpy16_kq(kind, n, s, row, pf, y);                                                     \
    }                                                                                          \
    AVX2_FN static void matmul16_##type##_avx2(int64_t n, int64_t n_tokens, const float * h,   \
                                               int64_t ldh, const int32_t * hc, int nk,        \
                                               const void * const * row, float * y, int64_t ldy) { \
        matmul16_kq(kind, n, n_tokens, h, ldh, hc, nk, row, y, ldy);                           \
    }

DEFINE_KQ_INT8_AVX2(q4_K, KQ4)
DEFINE_KQ_INT8_AVX2(q5_K, KQ5)
DEFINE_KQ_INT8_AVX2(q6_K, KQ6)

/* ---- the F32 row's dense-block tiles (gh_tiles_fn) ----
 *
 * A dense block of the batch path (most activations nonzero: SwiGLU prompts) in register
 * tiles of 4 tokens x 16 columns: the block's dequantized rows stream through while the
 * tile's sums stay in registers, so each weight value is loaded once per 4 tokens and y
 * once per block, where the axpy loop loads and stores y once per (row, token). Each y
 * value goes through the same FMAs in the same row order as in the axpy loop (a zero
 * activation's FMA adds nothing), so the results are the same bit for bit: a batch equals
 * its tokens run one by one. */
AVX2_FN static void tiles_f32_avx2(int64_t n_tokens, const float * h, int64_t ldh, const int32_t * rows,
                                   int64_t nk, const float * buf, int64_t ldb, int64_t n, float * y,
                                   int64_t ldy) {
    float hk[64 * 4];
    for (int64_t t0 = 0; t0 < n_tokens; t0 += 4) {
        const int ntt = (int) GH_MIN((int64_t) 4, n_tokens - t0);
        for (int64_t k = 0; k < nk; k++) {
            for (int t = 0; t < 4; t++) hk[k * 4 + t] = t < ntt ? h[(t0 + t) * ldh + rows[k]] : 0.0f;
        }
        int64_t c = 0;
        for (; c + 16 <= n; c += 16) {
            __m256 acc[4][2];
            for (int t = 0; t < 4; t++) {  /* the tokens past the batch's end are never stored */
                const float * yt = y + (t0 + GH_MIN(t, ntt - 1)) * ldy + c;
                acc[t][0] = _mm256_loadu_ps(yt);
                acc[t][1] = _mm256_loadu_ps(yt + 8);
            }
            for (int64_t k = 0; k < nk; k++) {
                const __m256 b0 = _mm256_loadu_ps(buf + k * ldb + c);
                const __m256 b1 = _mm256_loadu_ps(buf + k * ldb + c + 8);
                for (int t = 0; t < 4; t++) {
                    const __m256 a = _mm256_broadcast_ss(hk + k * 4 + t);
                    acc[t][0] = _mm256_fmadd_ps(a, b0, acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(a, b1, acc[t][1]);
                }
            }
            for (int t = 0; t < ntt; t++) {
                float * yt = y + (t0 + t) * ldy + c;
                _mm256_storeu_ps(yt, acc[t][0]);
                _mm256_storeu_ps(yt + 8, acc[t][1]);
            }
        }
        for (; c < n; c++) {  /* the last few columns of a row that is not a multiple of 16 */
            for (int t = 0; t < ntt; t++) {
                float * yc = y + (t0 + t) * ldy + c;
                for (int64_t k = 0; k < nk; k++) {
                    const float a = hk[k * 4 + t];
                    if (a != 0.0f) *yc += a * buf[k * ldb + c];  /* as the axpy's tail */
                }
            }
        }
    }
}

/* ---- IQ4_XS: one row and four rows ----
 * Per sub-block of 32 values: the levels looked up (iq4_levels_i32, as IQ4_NL's) and
 * y += f level, f = s d (ls - 32) (the row's scale folded in); four rows add f_k level_k
 * for k = 0..3 into each vector of y. */
AVX2_INLINE void axpy_iq4_xs_rows(const int nr, int64_t n, const float * s, const void * const * row,
                                  const void * const * pf, float * restrict y) {
    const __m128i table = _mm_loadu_si128((const __m128i *) gh_kvalues_iq4nl);
    const size_t bs = sizeof(block_iq4_xs);
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        if (pf) {
            for (int r = 0; r < nr; r++)
                for (size_t o = 0; o < bs + 63; o += 64)
                    _mm_prefetch((const char *) pf[r] + i * bs + GH_MIN(o, bs - 1), _MM_HINT_T1);
        }
        const block_iq4_xs * b[4];
        float f[4][QK_K / 32];
        for (int r = 0; r < nr; r++) {
            b[r] = (const block_iq4_xs *) row[r] + i;
            const float sd = s[r] * _cvtsh_ss(b[r]->d);
            for (int ib = 0; ib < QK_K / 32; ib++) f[r][ib] = sd * (float) gh_iq4_xs_scale(b[r], ib);
        }
        for (int ib = 0; ib < QK_K / 32; ib++) {
            float * yb = y + 32 * ib;
            __m256 acc[4];
            for (int j = 0; j < 4; j++) acc[j] = _mm256_loadu_ps(yb + 8 * j);
            for (int r = 0; r < nr; r++) {
                __m256i v[4];
                iq4_levels_i32(table, b[r]->qs + 16 * ib, v);
                const __m256 fr = _mm256_set1_ps(f[r][ib]);
                for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(fr, _mm256_cvtepi32_ps(v[j]), acc[j]);
            }
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(yb + 8 * j, acc[j]);
        }
    }
}

AVX2_FN static void axpy_iq4_xs_avx2(int64_t n, float s, const void * row, float * restrict y) {
    axpy_iq4_xs_rows(1, n, &s, &row, NULL, y);
}
DEFINE_AXPY4_AVX2(axpy4_iq4_xs_avx2, axpy_iq4_xs_rows, 4)

/* ---- the AVX2 rows of the axpy family (cpu/kernels.h) ---- */

const gh_kernel_set gh_axpy_rows_avx2[GH_TYPE_COUNT] = {
    [GH_TYPE_F32]  = { .axpy = axpy_f32_avx2, .axpy4 = axpy4_f32_avx2, .axpy4pf = axpy4_f32_avx2pf,
                       .tiles = tiles_f32_avx2 },
    [GH_TYPE_F16]  = { .axpy = axpy_f16_avx2, .axpy4 = axpy4_f16_avx2, .axpy4pf = axpy4_f16_avx2pf },
    [GH_TYPE_BF16] = { .axpy = axpy_bf16_avx2, .axpy4 = axpy4_bf16_avx2, .axpy4pf = axpy4_bf16_avx2pf },
    [GH_TYPE_Q8_0] = { .axpy = axpy_q8_0_avx2, .axpy4 = axpy4_q8_0_avx2, .axpy4pf = axpy4_q8_0_avx2pf,
                       .axpy16 = axpy16_q8_0_avx2, .matmul16 = matmul16_q8_0_avx2 },
    [GH_TYPE_Q4_0] = { .axpy = axpy_q4_0_avx2, .axpy4 = axpy4_q4_0_avx2, .axpy4pf = axpy4_q4_0_avx2pf,
                       .axpy16 = axpy16_q4_0_avx2, .matmul16 = matmul16_q4_0_avx2 },
    [GH_TYPE_Q4_1] = { .axpy = axpy_q4_1_avx2, .axpy4 = axpy4_q4_1_avx2, .axpy4pf = axpy4_q4_1_avx2pf,
                       .axpy16 = axpy16_q4_1_avx2, .matmul16 = matmul16_q4_1_avx2 },
    [GH_TYPE_Q5_0] = { .axpy = axpy_q5_0_avx2, .axpy4 = axpy4_q5_0_avx2, .axpy4pf = axpy4_q5_0_avx2pf },
    [GH_TYPE_Q5_1] = { .axpy = axpy_q5_1_avx2, .axpy4 = axpy4_q5_1_avx2, .axpy4pf = axpy4_q5_1_avx2pf },
    [GH_TYPE_Q4_K] = { .axpy = axpy_q4_K_avx2, .axpy4 = axpy_q4_K_avx2_4, .axpy4pf = axpy_q4_K_avx2_4pf,
                       .axpy16 = axpy16_q4_K_avx2, .matmul16 = matmul16_q4_K_avx2 },
    [GH_TYPE_Q5_K] = { .axpy = axpy_q5_K_avx2, .axpy4 = axpy_q5_K_avx2_4, .axpy4pf = axpy_q5_K_avx2_4pf,
                       .axpy16 = axpy16_q5_K_avx2, .matmul16 = matmul16_q5_K_avx2 },
    [GH_TYPE_Q6_K] = { .axpy = axpy_q6_K_avx2, .axpy4 = axpy_q6_K_avx2_4, .axpy4pf = axpy_q6_K_avx2_4pf,
                       .axpy16 = axpy16_q6_K_avx2, .matmul16 = matmul16_q6_K_avx2 },
    [GH_TYPE_Q2_K] = { .axpy = axpy_q2_K_avx2, .axpy4 = axpy_q2_K_avx2_4, .axpy4pf = axpy_q2_K_avx2_4pf },
    [GH_TYPE_Q3_K] = { .axpy = axpy_q3_K_avx2, .axpy4 = axpy_q3_K_avx2_4, .axpy4pf = axpy_q3_K_avx2_4pf },
    [GH_TYPE_IQ4_NL] = { .axpy = axpy_iq4_nl_avx2, .axpy4 = axpy4_iq4_nl_avx2, .axpy4pf = axpy4_iq4_nl_avx2pf },
    [GH_TYPE_IQ4_XS] = { .axpy = axpy_iq4_xs_avx2, .axpy4 = axpy4_iq4_xs_avx2, .axpy4pf = axpy4_iq4_xs_avx2pf },
    [GH_TYPE_MXFP4]  = { .axpy = axpy_mxfp4_avx2, .axpy4 = axpy4_mxfp4_avx2, .axpy4pf = axpy4_mxfp4_avx2pf },
#if GH_IQ_GRIDS
    /* the IQ lattice types: one-row forms in kernels_iqlat_avx2.c */
    [GH_TYPE_IQ2_XXS] = { .axpy = gh_avx2_axpy_iq2_xxs },
    [GH_TYPE_IQ2_XS]  = { .axpy = gh_avx2_axpy_iq2_xs },
    [GH_TYPE_IQ2_S]   = { .axpy = gh_avx2_axpy_iq2_s },
    [GH_TYPE_IQ3_XXS] = { .axpy = gh_avx2_axpy_iq3_xxs },
    [GH_TYPE_IQ3_S]   = { .axpy = gh_avx2_axpy_iq3_s },
    [GH_TYPE_IQ1_S]   = { .axpy = gh_avx2_axpy_iq1_s },
    [GH_TYPE_IQ1_M]   = { .axpy = gh_avx2_axpy_iq1_m },
#endif
};
