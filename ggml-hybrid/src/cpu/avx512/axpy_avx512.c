/* AVX-512 axpy kernels of the transposed matmul (axpy.c picks them when the SIMD level is
 * AVX-512; every weight type, K-quants included): y[0..n) += s * row, and the four-row
 * form y += s0*r0 + s1*r1 + s2*r2 + s3*r3 (one load and store of y per four rows). Rows
 * start at a block boundary; n is a multiple of the block size (quantized types) or any
 * length (float types: masked tail). The four-row forms add the rows in order 0, 1, 2, 3
 * into y (the K-quants add the four rows' mins first, see below), like the AVX2 and
 * scalar kernels, so the SIMD levels agree up to rounding. */
#include "cpu/kernels.h"
#include "types/iq4.h"

#include <immintrin.h>
#include <stddef.h>

#include "cpu/avx2/kq_unpack.h"
#include "cpu/avx2/axpy_int8.h"

/* (the file is built with the AVX-512 level's flags: CMakeLists.txt) */
#define AVX512_FN

/* ---- float types: 16 values per vector, masked tail ---- */

AVX512_FN static inline __mmask16 tail_mask(int64_t r) { return (__mmask16) ((1u << r) - 1u); }

AVX512_FN static inline __m512 ld_f32(const void * p, int64_t i) {
    return _mm512_loadu_ps((const float *) p + i);
}
AVX512_FN static inline __m512 ld_f32_m(const void * p, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *) p + i);
}
AVX512_FN static inline __m512 ld_f16(const void * p, int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const uint16_t *) p + i)));
}
AVX512_FN static inline __m512 ld_f16_m(const void * p, int64_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *) p + i));
}
AVX512_FN static inline __m512 ld_bf16(const void * p, int64_t i) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *) ((const uint16_t *) p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
AVX512_FN static inline __m512 ld_bf16_m(const void * p, int64_t i, __mmask16 m) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *) p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

#define DEFINE_AXPY_FLOAT(name, LD, LDM)                                                    \
    AVX512_FN static void name(int64_t n, float s, const void * row, float * restrict y) { \
        const __m512 vs = _mm512_set1_ps(s);                                                \
        int64_t i = 0;                                                                      \
        for (; i + 32 <= n; i += 32) {                                                      \
            const __m512 x0 = LD(row, i), x1 = LD(row, i + 16);                             \
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(vs, x0, _mm512_loadu_ps(y + i)));        \
            _mm512_storeu_ps(y + i + 16, _mm512_fmadd_ps(vs, x1, _mm512_loadu_ps(y + i + 16))); \
        }                                                                                   \
        for (; i < n; i += 16) {                                                            \
            const __mmask16 m = n - i >= 16 ? (__mmask16) 0xffff : tail_mask(n - i);        \
            const __m512 x0 = LDM(row, i, m);                                               \
            _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(vs, x0, _mm512_maskz_loadu_ps(m, y + i))); \
        }                                                                                   \
    }                                                                                       \
    AVX512_FN static void name##_4(int64_t n, const float * s, const void * const * row,   \
                                   float * restrict y) {                                    \
        const __m512 s0 = _mm512_set1_ps(s[0]), s1 = _mm512_set1_ps(s[1]),                 \
                     s2 = _mm512_set1_ps(s[2]), s3 = _mm512_set1_ps(s[3]);                 \
        const void * r0 = row[0], * r1 = row[1], * r2 = row[2], * r3 = row[3];             \
        for (int64_t i = 0; i < n; i += 16) {                                               \
            const __mmask16 m = n - i >= 16 ? (__mmask16) 0xffff : tail_mask(n - i);        \
            __m512 acc = _mm512_maskz_loadu_ps(m, y + i);                                   \
            acc = _mm512_fmadd_ps(s0, LDM(r0, i, m), acc);                                  \
            acc = _mm512_fmadd_ps(s1, LDM(r1, i, m), acc);                                  \
            acc = _mm512_fmadd_ps(s2, LDM(r2, i, m), acc);                                  \
            acc = _mm512_fmadd_ps(s3, LDM(r3, i, m), acc);                                  \
            _mm512_mask_storeu_ps(y + i, m, acc);                                           \
        }                                                                                   \
    }

/* wsz: bytes per value; each 32-value step prefetches the step's bytes of the pf rows */
#define DEFINE_AXPY_FLOAT_PF(name, LD, LDM, wsz)                                            \
    AVX512_FN static void name##_4pf(int64_t n, const float * s, const void * const * row, \
                                     const void * const * pf, float * restrict y) {         \
        const __m512 s0 = _mm512_set1_ps(s[0]), s1 = _mm512_set1_ps(s[1]),                 \
                     s2 = _mm512_set1_ps(s[2]), s3 = _mm512_set1_ps(s[3]);                 \
        const void * r0 = row[0], * r1 = row[1], * r2 = row[2], * r3 = row[3];             \
        int64_t i = 0;                                                                      \
        for (; i + 32 <= n; i += 32) {                                                      \
            for (int k = 0; k < 4; k++) {                                                   \
                for (int o = 0; o < 32 * (wsz); o += 64)                                    \
                    _mm_prefetch((const char *) pf[k] + i * (wsz) + o, _MM_HINT_T1);        \
            }                                                                               \
            for (int j = 0; j < 32; j += 16) {                                              \
                __m512 acc = _mm512_loadu_ps(y + i + j);                                    \
                acc = _mm512_fmadd_ps(s0, LD(r0, i + j), acc);                              \
                acc = _mm512_fmadd_ps(s1, LD(r1, i + j), acc);                              \
                acc = _mm512_fmadd_ps(s2, LD(r2, i + j), acc);                              \
                acc = _mm512_fmadd_ps(s3, LD(r3, i + j), acc);                              \
                _mm512_storeu_ps(y + i + j, acc);                                           \
            }                                                                               \
        }                                                                                   \
        for (; i < n; i += 16) {                                                            \
            const __mmask16 m = n - i >= 16 ? (__mmask16) 0xffff : tail_mask(n - i);        \
            __m512 acc = _mm512_maskz_loadu_ps(m, y + i);                                   \
            acc = _mm512_fmadd_ps(s0, LDM(r0, i, m), acc);                                  \
            acc = _mm512_fmadd_ps(s1, LDM(r1, i, m), acc);                                  \
            acc = _mm512_fmadd_ps(s2, LDM(r2, i, m), acc);                                  \
            acc = _mm512_fmadd_ps(s3, LDM(r3, i, m), acc);                                  \
            _mm512_mask_storeu_ps(y + i, m, acc);                                           \
        }                                                                                   \
    }

DEFINE_AXPY_FLOAT_PF(axpy_f32_avx512, ld_f32, ld_f32_m, 4)
DEFINE_AXPY_FLOAT_PF(axpy_f16_avx512, ld_f16, ld_f16_m, 2)
DEFINE_AXPY_FLOAT_PF(axpy_bf16_avx512, ld_bf16, ld_bf16_m, 2)

DEFINE_AXPY_FLOAT(axpy_f32_avx512, ld_f32, ld_f32_m)
DEFINE_AXPY_FLOAT(axpy_f16_avx512, ld_f16, ld_f16_m)
DEFINE_AXPY_FLOAT(axpy_bf16_avx512, ld_bf16, ld_bf16_m)

/* ---- the 32-value block types: one block = two vectors of 16 ----
 *
 * VALS gives a block's 32 values as int8 (zero point taken out; Q4_1 0..15 and Q5_1 0..31
 * fit too); HAS_MIN (a constant: its branch folds away for the others) says the block
 * carries a min m (x = d q + m), MINF reads its fp16 bits. With a min, one row adds
 * s d q + s m (y + fma(ds, q, ms)), and four rows start from y + sum_k s_k m_k, as
 * avx2/axpy_avx2.c does. Q4_1 has no rows here: these forms of it measured 3-10% slower
 * than AVX2's (whose widening loads take its nibbles straight from memory), which the
 * selection keeps at this level; Q5_0 and Q5_1 gain ~20% here (the masked add of their
 * fifth bit against AVX2's four operations per 8 values). */
#define NO_MIN(b) 0
#define BLOCK_MIN(b) ((b)->m)  /* fp16 bits */
#define FP16_D(b) _cvtsh_ss((b)->d)                 /* the block scale */
#define E8M0_D(b) gh_e8m0_to_fp32_half((b)->e)      /* MXFP4's */

/* Block i of four quantized rows b[0..4) times s[0..4), added to y[0..32): the step the
 * four-row forms share, with and without prefetch. */
#define AXPY_QUANT_BLOCK4(VALS, HAS_MIN, MINF, SCALEF)                                              \
    do {                                                                                    \
        __m512 a0 = _mm512_loadu_ps(y), a1 = _mm512_loadu_ps(y + 16);                       \
        if (HAS_MIN) { /* the four m converted at once, s_k m_k summed (0 + 2) + (1 + 3) */ \
            const __m128i mh = _mm_setr_epi16((short) MINF(&b[0][i]), (short) MINF(&b[1][i]), \
                                              (short) MINF(&b[2][i]), (short) MINF(&b[3][i]), 0, 0, 0, 0); \
            __m128 ms = _mm_mul_ps(_mm_cvtph_ps(mh), _mm_loadu_ps(s));                      \
            ms = _mm_add_ps(ms, _mm_movehl_ps(ms, ms));                                     \
            const __m512 g = _mm512_broadcastss_ps(_mm_add_ss(ms, _mm_movehdup_ps(ms)));    \
            a0 = _mm512_add_ps(a0, g);                                                      \
            a1 = _mm512_add_ps(a1, g);                                                      \
        }                                                                                   \
        for (int k = 0; k < 4; k++) {                                                       \
            const __m512 ds = _mm512_set1_ps(s[k] * SCALEF(&b[k][i]));                  \
            __m128i lo, hi;                                                                 \
            VALS(&b[k][i], &lo, &hi);                                                       \
            a0 = _mm512_fmadd_ps(ds, i8_to_ps(lo), a0);                                     \
            a1 = _mm512_fmadd_ps(ds, i8_to_ps(hi), a1);                                     \
        }                                                                                   \
        _mm512_storeu_ps(y, a0);                                                            \
        _mm512_storeu_ps(y + 16, a1);                                                       \
    } while (0)

/* The 32 int8 values of a block as lo (0..15) and hi (16..31). */
AVX512_FN static inline void q8_0_vals(const block_q8_0 * b, __m128i * lo, __m128i * hi) {
    *lo = _mm_loadu_si128((const __m128i *) b->qs);
    *hi = _mm_loadu_si128((const __m128i *) (b->qs + 16));
}
AVX512_FN static inline void q4_0_vals(const block_q4_0 * b, __m128i * lo, __m128i * hi) {
    const __m128i m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i q = _mm_loadu_si128((const __m128i *) b->qs);
    *lo = _mm_sub_epi8(_mm_and_si128(q, m4), eight);
    *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), eight);
}
AVX512_FN static inline void nibbles(const uint8_t * qs, __m128i * lo, __m128i * hi) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i q = _mm_loadu_si128((const __m128i *) qs);
    *lo = _mm_and_si128(q, m4);
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
}
/* Q5: bit j of the qh word is value j's fifth bit, so its halves are the byte masks of
 * lo and hi (a masked add of 16) */
AVX512_FN static inline void add_bit5(const uint8_t * qh, __m128i * lo, __m128i * hi) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m128i sixteen = _mm_set1_epi8(16);
    *lo = _mm_mask_add_epi8(*lo, (__mmask16) h, *lo, sixteen);
    *hi = _mm_mask_add_epi8(*hi, (__mmask16) (h >> 16), *hi, sixteen);
}
AVX512_FN static inline void q5_0_vals(const block_q5_0 * b, __m128i * lo, __m128i * hi) {
    const __m128i sixteen = _mm_set1_epi8(16);
    nibbles(b->qs, lo, hi);
    *lo = _mm_sub_epi8(*lo, sixteen); /* the zero point 16, the fifth bit adds it back */
    *hi = _mm_sub_epi8(*hi, sixteen);
    add_bit5(b->qh, lo, hi);
}
AVX512_FN static inline void q5_1_vals(const block_q5_1 * b, __m128i * lo, __m128i * hi) {
    nibbles(b->qs, lo, hi);
    add_bit5(b->qh, lo, hi);
}
/* The levels (a 16-entry int8 table) of the 16 nibble bytes at qs: values 0..15 (lo) and
 * 16..31 (hi). */
AVX512_FN static inline void levels(const int8_t * table, const uint8_t * qs, __m128i * lo, __m128i * hi) {
    const __m128i t = _mm_loadu_si128((const __m128i *) table);
    nibbles(qs, lo, hi);
    *lo = _mm_shuffle_epi8(t, *lo);
    *hi = _mm_shuffle_epi8(t, *hi);
}
AVX512_FN static inline void iq4_nl_vals(const block_iq4_nl * b, __m128i * lo, __m128i * hi) {
    levels(gh_kvalues_iq4nl, b->qs, lo, hi);
}
AVX512_FN static inline void mxfp4_vals(const block_mxfp4 * b, __m128i * lo, __m128i * hi) {
    levels(gh_kvalues_mxfp4, b->qs, lo, hi);
}
AVX512_FN static inline __m512 i8_to_ps(__m128i q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

#define DEFINE_AXPY_QUANT(name, block_t, VALS, HAS_MIN, MINF, SCALEF)                               \
    AVX512_FN static void name(int64_t n, float s, const void * row, float * restrict y) { \
        const block_t * b = row;                                                            \
        for (int64_t i = 0; i < n / 32; i++, y += 32) {                                     \
            const __m512 ds = _mm512_set1_ps(s * SCALEF(&b[i]));                        \
            __m128i lo, hi;                                                                 \
            VALS(&b[i], &lo, &hi);                                                          \
            if (HAS_MIN) {                                                                  \
                const __m512 ms = _mm512_set1_ps(s * _cvtsh_ss(MINF(&b[i])));               \
                _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_fmadd_ps(ds, i8_to_ps(lo), ms))); \
                _mm512_storeu_ps(y + 16, _mm512_add_ps(_mm512_loadu_ps(y + 16), _mm512_fmadd_ps(ds, i8_to_ps(hi), ms))); \
                continue;                                                                   \
            }                                                                               \
            _mm512_storeu_ps(y, _mm512_fmadd_ps(ds, i8_to_ps(lo), _mm512_loadu_ps(y)));      \
            _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(ds, i8_to_ps(hi), _mm512_loadu_ps(y + 16))); \
        }                                                                                   \
    }                                                                                       \
    AVX512_FN static void name##_4(int64_t n, const float * s, const void * const * row,   \
                                   float * restrict y) {                                    \
        const block_t * b[4] = { row[0], row[1], row[2], row[3] };                          \
        for (int64_t i = 0; i < n / 32; i++, y += 32) {                                     \
            AXPY_QUANT_BLOCK4(VALS, HAS_MIN, MINF, SCALEF);                                         \
        }                                                                                   \
    }

/* Four rows per pass with prefetch: every fourth block prefetches those four blocks'
 * bytes of the pf rows (their first and last byte cover Q4_0's 72 bytes' lines; MID adds
 * the lines at +64 (the 88..96 bytes of Q5_0, Q5_1) and +128 (Q8_0's 136 bytes, up to four
 * lines: without the middle ones every scattered row missed on them, and the sparse down
 * ran at 0.2x the dense GB/s per byte; docs/BENCHMARKS.md). The sums are those of
 * name##_4. */
#define DEFINE_AXPY_QUANT_PF(name, block_t, VALS, HAS_MIN, MINF, SCALEF, MID)                      \
    AVX512_FN static void name##_4pf(int64_t n, const float * s, const void * const * row, \
                                     const void * const * pf, float * restrict y) {         \
        const block_t * b[4] = { row[0], row[1], row[2], row[3] };                          \
        const size_t bs = sizeof(block_t);                                                  \
        for (int64_t i = 0; i < n / 32; i++, y += 32) {                                     \
            if ((i & 3) == 0) {                                                             \
                for (int k = 0; k < 4; k++) {                                               \
                    _mm_prefetch((const char *) pf[k] + i * bs, _MM_HINT_T1);               \
                    if (MID) for (size_t o = 64; o < 4 * bs - 1; o += 64)                  \
                        _mm_prefetch((const char *) pf[k] + i * bs + o, _MM_HINT_T1);       \
                    _mm_prefetch((const char *) pf[k] + (i + 4) * bs - 1, _MM_HINT_T1);     \
                }                                                                           \
            }                                                                               \
            AXPY_QUANT_BLOCK4(VALS, HAS_MIN, MINF, SCALEF);                                         \
        }                                                                                   \
    }

DEFINE_AXPY_QUANT_PF(axpy_q4_0_avx512, block_q4_0, q4_0_vals, 0, NO_MIN, FP16_D, 0)

DEFINE_AXPY_QUANT_PF(axpy_q8_0_avx512, block_q8_0, q8_0_vals, 0, NO_MIN, FP16_D, 1)

DEFINE_AXPY_QUANT(axpy_q8_0_avx512, block_q8_0, q8_0_vals, 0, NO_MIN, FP16_D)
DEFINE_AXPY_QUANT(axpy_q4_0_avx512, block_q4_0, q4_0_vals, 0, NO_MIN, FP16_D)

DEFINE_AXPY_QUANT(axpy_q5_0_avx512, block_q5_0, q5_0_vals, 0, NO_MIN, FP16_D)
DEFINE_AXPY_QUANT(axpy_q5_1_avx512, block_q5_1, q5_1_vals, 1, BLOCK_MIN, FP16_D)
DEFINE_AXPY_QUANT_PF(axpy_q5_0_avx512, block_q5_0, q5_0_vals, 0, NO_MIN, FP16_D, 1)
DEFINE_AXPY_QUANT_PF(axpy_q5_1_avx512, block_q5_1, q5_1_vals, 1, BLOCK_MIN, FP16_D, 1)

/* IQ4_NL, MXFP4: the levels looked up (one vpshufb per 16 values); MXFP4's e8m0 scale.
 * (4 blocks are 68..72 bytes: MID, they may span three lines) */
DEFINE_AXPY_QUANT(axpy_iq4_nl_avx512, block_iq4_nl, iq4_nl_vals, 0, NO_MIN, FP16_D)
DEFINE_AXPY_QUANT(axpy_mxfp4_avx512, block_mxfp4, mxfp4_vals, 0, NO_MIN, E8M0_D)
DEFINE_AXPY_QUANT_PF(axpy_iq4_nl_avx512, block_iq4_nl, iq4_nl_vals, 0, NO_MIN, FP16_D, 1)
DEFINE_AXPY_QUANT_PF(axpy_mxfp4_avx512, block_mxfp4, mxfp4_vals, 0, NO_MIN, E8M0_D, 1)

/* ---- IQ4_XS: one row and four rows ----
 * Per sub-block of 32: the levels (IQ4_NL's table) and y += f level, f = s d (ls - 32),
 * 16 values per vector; four rows add f_k level_k for k = 0..3 into each vector of y. */
AVX512_FN static inline __attribute__((always_inline)) void
axpy_iq4_xs_rows(const int nr, int64_t n, const float * s, const void * const * row, const void * const * pf,
                 float * restrict y) {
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
            __m512 a0 = _mm512_loadu_ps(yb), a1 = _mm512_loadu_ps(yb + 16);
            for (int r = 0; r < nr; r++) {
                __m128i lo, hi;
                levels(gh_kvalues_iq4nl, b[r]->qs + 16 * ib, &lo, &hi);
                const __m512 fr = _mm512_set1_ps(f[r][ib]);
                a0 = _mm512_fmadd_ps(fr, i8_to_ps(lo), a0);
                a1 = _mm512_fmadd_ps(fr, i8_to_ps(hi), a1);
            }
            _mm512_storeu_ps(yb, a0);
            _mm512_storeu_ps(yb + 16, a1);
        }
    }
}

AVX512_FN static void axpy_iq4_xs_avx512(int64_t n, float s, const void * row, float * restrict y) {
    axpy_iq4_xs_rows(1, n, &s, &row, NULL, y);
}
AVX512_FN static void axpy_iq4_xs_avx512_4(int64_t n, const float * s, const void * const * row, float * restrict y) {
    axpy_iq4_xs_rows(4, n, s, row, NULL, y);
}
AVX512_FN static void axpy_iq4_xs_avx512_4pf(int64_t n, const float * s, const void * const * row,
                                              const void * const * pf, float * restrict y) {
    axpy_iq4_xs_rows(4, n, s, row, pf, y);
}

/* ---- K-quants: as avx2/axpy_avx2.c (the block taken apart once by kq_unpack.h; one row:
 * y + (f q + g); four rows: y + the rows' g, then f_k q_k for k = 0..3), 16 values per
 * vector: one widening load, one conversion and one FMA each. */

AVX512_FN static inline __m512 ld16q(const uint8_t * q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) q)));
}

AVX512_FN static inline __attribute__((always_inline)) void
axpy_kq(const int kind, int64_t n, float s, const void * row, float * restrict y) {
    const size_t bs = kq_bytes(kind);
    const int sub = kq_sub_len(kind);
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        const uint8_t * b = (const uint8_t *) row + i * bs;
        uint8_t q[QK_K];
        float f[16], g[16];
        kq_factors(kind, b, s, f, g);
        kq_unpack(kind, b, q);
        for (int j = 0; j < QK_K / sub; j++) {
            const __m512 fj = _mm512_set1_ps(f[j]), gj = _mm512_set1_ps(g[j]);
            for (int p = sub * j; p < sub * (j + 1); p += 16) {
                _mm512_storeu_ps(y + p, _mm512_add_ps(_mm512_loadu_ps(y + p), _mm512_fmadd_ps(fj, ld16q(q + p), gj)));
            }
        }
    }
}

AVX512_FN static inline __attribute__((always_inline)) void
axpy4_kq(const int kind, int64_t n, const float * s, const void * const * row, const void * const * pf,
         float * restrict y) {
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
        if (nsub == 16) {
            const __m512 g01 = _mm512_add_ps(_mm512_loadu_ps(g[0]), _mm512_loadu_ps(g[1]));
            const __m512 g23 = _mm512_add_ps(_mm512_loadu_ps(g[2]), _mm512_loadu_ps(g[3]));
            _mm512_storeu_ps(gs, _mm512_add_ps(g01, g23));
        } else {
            const __m256 g01 = _mm256_add_ps(_mm256_loadu_ps(g[0]), _mm256_loadu_ps(g[1]));
            const __m256 g23 = _mm256_add_ps(_mm256_loadu_ps(g[2]), _mm256_loadu_ps(g[3]));
            _mm256_storeu_ps(gs, _mm256_add_ps(g01, g23));
        }
        for (int j = 0; j < nsub; j++) {
            const __m512 f0 = _mm512_set1_ps(f[0][j]), f1 = _mm512_set1_ps(f[1][j]);
            const __m512 f2 = _mm512_set1_ps(f[2][j]), f3 = _mm512_set1_ps(f[3][j]);
            const __m512 gj = _mm512_set1_ps(gs[j]);
            for (int p = sub * j; p < sub * (j + 1); p += 16) {
                __m512 acc = _mm512_add_ps(_mm512_loadu_ps(y + p), gj);
                acc = _mm512_fmadd_ps(f0, ld16q(q[0] + p), acc);
                acc = _mm512_fmadd_ps(f1, ld16q(q[1] + p), acc);
                acc = _mm512_fmadd_ps(f2, ld16q(q[2] + p), acc);
                acc = _mm512_fmadd_ps(f3, ld16q(q[3] + p), acc);
                _mm512_storeu_ps(y + p, acc);
            }
        }
    }
}

#define DEFINE_AXPY_KQ(name, kind)                                                           \
    AVX512_FN static void name(int64_t n, float s, const void * row, float * restrict y) {   \
        axpy_kq(kind, n, s, row, y);                                                         \
    }                                                                                        \
    AVX512_FN static void name##_4(int64_t n, const float * s, const void * const * row,    \
                                   float * restrict y) {                                     \
        axpy4_kq(kind, n, s, row, NULL, y);                                                  \
    }                                                                                        \
    AVX512_FN static void name##_4pf(int64_t n, const float * s, const void * const * row,  \
                                     const void * const * pf, float * restrict y) {          \
        axpy4_kq(kind, n, s, row, pf, y);                                                    \
    }

DEFINE_AXPY_KQ(axpy_q4_K_avx512, KQ4)
DEFINE_AXPY_KQ(axpy_q5_K_avx512, KQ5)
DEFINE_AXPY_KQ(axpy_q6_K_avx512, KQ6)
DEFINE_AXPY_KQ(axpy_q2_K_avx512, KQ2)
DEFINE_AXPY_KQ(axpy_q3_K_avx512, KQ3)

/* ---- Q4_0's and Q4_1's batch forms in VNNI (gh_matmul16_fn) ----
 *
 * As the AVX2 form (avx2/axpy_avx2.c: the same factors, int8_factors8, per token and
 * group), with four rows per vpdpbusd: a quad of rows' block is transposed once (vpermb)
 * so that dword c holds the four rows' nibbles of column c, and meets the dword
 * (m_4p .. m_4p+3); the int32 sums are the AVX2 form's int16 ones (both exact), widened
 * and scaled alike, so the two levels agree bit for bit. */
#define AVX512_VNNI_FN
#define BATCH_BLOCKS 8

/* byte 4c + r of a quad's vector: byte c of row r (lane r as loaded) */
static const uint8_t quad_tr[64] = {
    0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
    6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
    12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63,
};

/* type: GH_TYPE_Q4_0 or GH_TYPE_Q4_1 (its g added before the block's sums, as AVX2's
 * int8_acc32 does), a constant at every call. */
static inline __attribute__((always_inline)) void
matmul16_q4(const int type, int64_t n, int64_t n_tokens, const float * h, int64_t ldh, const int32_t * hc, int nk,
            const void * const * row, float * y, int64_t ldy) {
    const bool q41 = type == GH_TYPE_Q4_1;
    const size_t bs = q41 ? sizeof(block_q4_1) : sizeof(block_q4_0);
    const size_t qs = q41 ? offsetof(block_q4_1, qs) : offsetof(block_q4_0, qs);
    const int64_t nb = n / QK4_0;
    const int ng = (nk + 15) / 16;
    static const uint8_t zero[QK4_0 / 2];
    const __m512i tr = _mm512_loadu_si512(quad_tr);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t i0 = 0; i0 < nb; i0 += BATCH_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) BATCH_BLOCKS, nb - i0);
        uint16_t d[4][16][BATCH_BLOCKS], m[4][16][BATCH_BLOCKS];
        __m512i u[4][BATCH_BLOCKS][4][2]; /* group, block, quad, columns 0..15 | 16..31 */
        q4_0_batch_scales(row, nk, ng, i0, nc, BATCH_BLOCKS, bs, 0, &d[0][0][0]);
        if (q41) q4_0_batch_scales(row, nk, ng, i0, nc, BATCH_BLOCKS, bs, 2, &m[0][0][0]);
        for (int g = 0; g < ng; g++) {
            for (int i = 0; i < nc; i++) {
                const size_t off = (size_t) (i0 + i) * bs + qs;
                for (int j = 0; j < 4; j++) {
                    const uint8_t * q[4];
                    for (int r = 0; r < 4; r++) {
                        const int k = 16 * g + 4 * j + r;
                        q[r] = k < nk ? (const uint8_t *) row[k] + off : zero;
                    }
                    __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *) q[0]));
                    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *) q[1]), 1);
                    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *) q[2]), 2);
                    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *) q[3]), 3);
                    x = _mm512_permutexvar_epi8(tr, x);
                    u[g][i][j][0] = _mm512_and_si512(x, m4);
                    u[g][i][j][1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
                }
            }
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * ht = h + t * ldh;
            int32_t mq[4][4][BATCH_BLOCKS];
            float scale[4][BATCH_BLOCKS], gq[4][BATCH_BLOCKS];
            int32_t bias[4][BATCH_BLOCKS];
            q4_0_batch_factors(ht, hc, nk, ng, BATCH_BLOCKS, &d[0][0][0], &mq[0][0][0], 1, &scale[0][0], &bias[0][0],
                               q41 ? &m[0][0][0] : NULL, &gq[0][0]);
            float * yb = y + t * ldy + i0 * QK4_0;
            for (int i = 0; i < nc; i++, yb += QK4_0) {
                __m512 y0 = _mm512_loadu_ps(yb), y1 = _mm512_loadu_ps(yb + 16);
                for (int g = 0; g < ng; g++) {
                    __m512i a0 = _mm512_set1_epi32(bias[g][i]), a1 = a0;
                    for (int j = 0; j < 4; j++) {
                        const __m512i mj = _mm512_set1_epi32(mq[g][j][i]);
                        a0 = _mm512_dpbusd_epi32(a0, u[g][i][j][0], mj);
                        a1 = _mm512_dpbusd_epi32(a1, u[g][i][j][1], mj);
                    }
                    if (q41) {
                        const __m512 gv = _mm512_set1_ps(gq[g][i]);
                        y0 = _mm512_add_ps(y0, gv);
                        y1 = _mm512_add_ps(y1, gv);
                    }
                    const __m512 sc = _mm512_set1_ps(scale[g][i]);
                    y0 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(a0), y0);
                    y1 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(a1), y1);
                }
                _mm512_storeu_ps(yb, y0);
                _mm512_storeu_ps(yb + 16, y1);
            }
        }
    }
}

AVX512_VNNI_FN static void matmul16_q4_0_avx512(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                              const int32_t * hc, int nk, const void * const * row,
                                              float * y, int64_t ldy) {
    matmul16_q4(GH_TYPE_Q4_0, n, n_tokens, h, ldh, hc, nk, row, y, ldy);
}
AVX512_VNNI_FN static void matmul16_q4_1_avx512(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                              const int32_t * hc, int nk, const void * const * row,
                                              float * y, int64_t ldy) {
    matmul16_q4(GH_TYPE_Q4_1, n, n_tokens, h, ldh, hc, nk, row, y, ldy);
}

/* ---- Q4_0's and Q4_1's one-token form in VNNI (gh_axpy16_fn) ----
 *
 * AVX2's axpy16_q4 (avx2/axpy_avx2.c: per chunk of blocks the rows' scales copied out and
 * the int8 factors made, then the pass) with the batch form's quads above: per block four
 * vpermb-transposed quads of rows, two vpdpbusd each, where AVX2 spends eight pairs of
 * broadcasts, shifts, unpacks, vpmaddubsw and adds, and the widening of its int16 sums.
 * The int32 sums are the same integers, scaled and added alike, so a token's result is
 * AVX2's and the batch form's (matmul16_q4) bit for bit: at 2048 columns from L2 AVX2's
 * form ran at ~12 GB/s, half the dense tile's rate (docs/BENCHMARKS.md). */
#define AXPY16_CHUNK 32

/* vpermt2b indices of 8 blocks' scales (bytes 0..15: d; Q4_1: 16..31 its m) */
static const uint8_t pick_q4_0[64] = {
    0, 1, 18, 19, 36, 37, 54, 55, 72, 73, 90, 91, 108, 109, 126, 127,
};
static const uint8_t pick_q4_1[64] = {
    0, 1, 20, 21, 40, 41, 60, 61, 64, 65, 84, 85, 104, 105, 124, 125,
    2, 3, 22, 23, 42, 43, 62, 63, 66, 67, 86, 87, 106, 107, 126, 127,
};

static inline __attribute__((always_inline)) void
axpy16_q4v(const int type, int64_t n, const float * s, const void * const * row, const void * const * pf,
           float * restrict y) {
    const bool q41 = type == GH_TYPE_Q4_1;
    const size_t bs = q41 ? sizeof(block_q4_1) : sizeof(block_q4_0);
    const size_t qs = q41 ? offsetof(block_q4_1, qs) : offsetof(block_q4_0, qs);
    const int64_t nb = n / QK4_0;
    const __m512i tr = _mm512_loadu_si512(quad_tr);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    /* 8 blocks' fp16 scales from a load at the first and one at hi_at: Q4_0's at bytes
     * 18 i (all within 128), Q4_1's d and m at 20 i and 20 i + 2, blocks 4..7 from 80 */
    const size_t hi_at = q41 ? 80 : 64;
    const __m512i pick = _mm512_loadu_si512(q41 ? pick_q4_1 : pick_q4_0);
    for (int64_t i0 = 0; i0 < nb; i0 += AXPY16_CHUNK) {
        const int nc = (int) GH_MIN((int64_t) AXPY16_CHUNK, nb - i0);
        uint16_t d[16][AXPY16_CHUNK], m[16][AXPY16_CHUNK];
        int32_t mq[4][AXPY16_CHUNK];  /* (m_4p .. m_4p+3) as the bytes of a dword */
        float scale[AXPY16_CHUNK], g[AXPY16_CHUNK];
        int32_t bias[AXPY16_CHUNK];
        for (int k = 0; k < 16; k++) {
            const uint8_t * b = (const uint8_t *) row[k] + i0 * bs;
            /* the scales (and mins) of 8 whole blocks at a time picked out of two loads,
             * the rest one by one, then the padding the factors expect (zeros) */
            int j = 0;
            for (; j + 8 <= nc; j += 8) {
                const uint8_t * p = b + j * bs;
                const __m512i v = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), pick,
                                                           _mm512_loadu_si512(p + hi_at));
                _mm_storeu_si128((__m128i *) &d[k][j], _mm512_castsi512_si128(v));
                if (q41) _mm_storeu_si128((__m128i *) &m[k][j], _mm512_extracti32x4_epi32(v, 1));
            }
            for (int i = j; i < nc; i++) memcpy(&d[k][i], b + i * bs, 2);
            for (int i = nc; i < AXPY16_CHUNK; i++) d[k][i] = 0;
            if (q41) {
                for (int i = j; i < nc; i++) memcpy(&m[k][i], b + i * bs + 2, 2);
                for (int i = nc; i < AXPY16_CHUNK; i++) m[k][i] = 0;
            }
            if (pf) {
                const char * p = (const char *) pf[k] + i0 * bs;
                for (size_t o = 0; o < (size_t) nc * bs; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
                _mm_prefetch(p + (size_t) nc * bs - 1, _MM_HINT_T1);
            }
        }
        for (int j = 0; j < nc; j += 8) {
            int8_factors8(s, &d[0][0], 0, AXPY16_CHUNK, j, &mq[0][0], 1, scale, bias);
            if (q41) q4_1_g8(s, &d[0][0], &m[0][0], AXPY16_CHUNK, j, g);
        }
        float * yb = y + i0 * QK4_0;
        for (int i = 0; i < nc; i++, yb += QK4_0) {
            const size_t off = (size_t) (i0 + i) * bs + qs;
            __m512i a0 = _mm512_set1_epi32(bias[i]), a1 = a0;
            for (int j = 0; j < 4; j++) {
                const uint8_t * const * q = (const uint8_t * const *) row + 4 * j;
                __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *) (q[0] + off)));
                x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *) (q[1] + off)), 1);
                x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *) (q[2] + off)), 2);
                x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *) (q[3] + off)), 3);
                x = _mm512_permutexvar_epi8(tr, x);
                const __m512i mj = _mm512_set1_epi32(mq[j][i]);
                a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(x, m4), mj);
                a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(x, 4), m4), mj);
            }
            __m512 y0 = _mm512_loadu_ps(yb), y1 = _mm512_loadu_ps(yb + 16);
            if (q41) {
                const __m512 gv = _mm512_set1_ps(g[i]);
                y0 = _mm512_add_ps(y0, gv);
                y1 = _mm512_add_ps(y1, gv);
            }
            const __m512 sc = _mm512_set1_ps(scale[i]);
            _mm512_storeu_ps(yb, _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(a0), y0));
            _mm512_storeu_ps(yb + 16, _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(a1), y1));
        }
    }
}

AVX512_VNNI_FN static void axpy16_q4_0_avx512(int64_t n, const float * s, const void * const * row,
                                             const void * const * pf, float * restrict y) {
    axpy16_q4v(GH_TYPE_Q4_0, n, s, row, pf, y);
}
AVX512_VNNI_FN static void axpy16_q4_1_avx512(int64_t n, const float * s, const void * const * row,
                                             const void * const * pf, float * restrict y) {
    axpy16_q4v(GH_TYPE_Q4_1, n, s, row, pf, y);
}

/* ---- Q8_0's batch form in VNNI (gh_matmul16_fn) ----
 *
 * AVX2's (avx2/axpy_avx2.c: the factors of Q4_0's, the exact int32 block sums
 * S = sum_k m_k q_k) with four rows per vpdpbusd: a quad's 32 columns in two vectors,
 * transposed by vpermt2b (dword c = the four rows' column c), the signed quants made
 * unsigned by q + 128 (xor 0x80) and the offset taken out in the bias -128 sum_k m_k
 * (int8_factors8_off). The sums are the same integers, scaled and added alike: a token's
 * result is AVX2's one-token form's bit for bit. That one-token form (axpy16_q8_0_avx2)
 * is also this level's: a VNNI version of it, the same quads, ran 1.2x faster from L2
 * (bench_kernels_ab.py dt hot) but read the whole down_t from DRAM at 0.59-0.63 of the
 * dense matmul's GB/s where AVX2's form ran at 0.62-0.78, and the id lists at 0.46-0.64
 * against 0.52-0.73 (bench_sparse_kernels.py, 2048 x 5632 and SmolLM2's shape, two
 * alternating runs; docs/BENCHMARKS.md, "Q8_0's int8 column forms"). */

/* vpermt2b indices of a quad's columns 16h .. 16h + 15 (h = 0, 1) from rows 0, 1 (the
 * first operand's 64 bytes) and 2, 3 (the second's): byte 4c + r <- row r's byte 16h + c */
static const uint8_t q8_quad_idx[2][64] = {
#define Q8_QI(h, c) 16 * (h) + (c), 32 + 16 * (h) + (c), 64 + 16 * (h) + (c), 96 + 16 * (h) + (c)
#define Q8_QH(h) Q8_QI(h, 0), Q8_QI(h, 1), Q8_QI(h, 2), Q8_QI(h, 3), Q8_QI(h, 4), Q8_QI(h, 5), Q8_QI(h, 6), \
                 Q8_QI(h, 7), Q8_QI(h, 8), Q8_QI(h, 9), Q8_QI(h, 10), Q8_QI(h, 11), Q8_QI(h, 12),        \
                 Q8_QI(h, 13), Q8_QI(h, 14), Q8_QI(h, 15)
    { Q8_QH(0) }, { Q8_QH(1) },
#undef Q8_QH
#undef Q8_QI
};

/* The quad of rows q[0..4)'s block at off: v[0] columns 0..15, v[1] 16..31 (dword c =
 * the four rows' column c), unsigned (q + 128). Two rows per vector, two vpermt2b. */
static inline __attribute__((always_inline)) void q8_quads_vnni(const uint8_t * const * q, size_t off,
                                                                const __m512i * idx, __m512i * v) {
    const __m512i flip = _mm512_set1_epi8((char) 0x80);
    const __m512i x01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (q[0] + off))),
                                           _mm256_loadu_si256((const __m256i *) (q[1] + off)), 1);
    const __m512i x23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (q[2] + off))),
                                           _mm256_loadu_si256((const __m256i *) (q[3] + off)), 1);
    v[0] = _mm512_xor_si512(_mm512_permutex2var_epi8(x01, idx[0], x23), flip);
    v[1] = _mm512_xor_si512(_mm512_permutex2var_epi8(x01, idx[1], x23), flip);
}

/* The batch form: the groups' quads of 8 blocks transposed once (16 KB), then per token
 * its factors and the pass, groups added in order into y in registers (as matmul16_q4). */
AVX512_VNNI_FN static void matmul16_q8_0_avx512(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                                const int32_t * hc, int nk, const void * const * row,
                                                float * y, int64_t ldy) {
    const size_t bs = sizeof(block_q8_0), qs = offsetof(block_q8_0, qs);
    const int64_t nb = n / QK8_0;
    const int ng = (nk + 15) / 16;
    static const uint8_t zero[sizeof(block_q8_0)];
    const __m512i idx[2] = { _mm512_loadu_si512(q8_quad_idx[0]), _mm512_loadu_si512(q8_quad_idx[1]) };
    for (int64_t i0 = 0; i0 < nb; i0 += BATCH_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) BATCH_BLOCKS, nb - i0);
        uint16_t d[4][16][BATCH_BLOCKS];
        __m512i u[4][BATCH_BLOCKS][4][2];
        q4_0_batch_scales(row, nk, ng, i0, nc, BATCH_BLOCKS, bs, 0, &d[0][0][0]);
        for (int g = 0; g < ng; g++) {
            for (int i = 0; i < nc; i++) {
                for (int j = 0; j < 4; j++) {
                    const uint8_t * q[4];
                    for (int r = 0; r < 4; r++) {
                        const int k = 16 * g + 4 * j + r;
                        q[r] = k < nk ? (const uint8_t *) row[k] + (size_t) (i0 + i) * bs : zero;
                    }
                    q8_quads_vnni(q, qs, idx, u[g][i][j]);
                }
            }
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * ht = h + t * ldh;
            int32_t mq[4][4][BATCH_BLOCKS], bias[4][BATCH_BLOCKS];
            float scale[4][BATCH_BLOCKS];
            for (int g = 0; g < ng; g++) {
                float s[16];
                batch_s16(ht, hc, nk, g, s);
                int8_factors8_off(s, &d[g][0][0], 0, BATCH_BLOCKS, 0, &mq[g][0][0], 1, scale[g], bias[g], 128, NULL);
            }
            float * yb = y + t * ldy + i0 * QK8_0;
            for (int i = 0; i < nc; i++, yb += QK8_0) {
                __m512 y0 = _mm512_loadu_ps(yb), y1 = _mm512_loadu_ps(yb + 16);
                for (int g = 0; g < ng; g++) {
                    __m512i a0 = _mm512_set1_epi32(bias[g][i]), a1 = a0;
                    for (int j = 0; j < 4; j++) {
                        const __m512i mj = _mm512_set1_epi32(mq[g][j][i]);
                        a0 = _mm512_dpbusd_epi32(a0, u[g][i][j][0], mj);
                        a1 = _mm512_dpbusd_epi32(a1, u[g][i][j][1], mj);
                    }
                    const __m512 sc = _mm512_set1_ps(scale[g][i]);
                    y0 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(a0), y0);
                    y1 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(a1), y1);
                }
                _mm512_storeu_ps(yb, y0);
                _mm512_storeu_ps(yb + 16, y1);
            }
        }
    }
}

/* ---- the F32 row's dense-block tiles (gh_tiles_fn) ----
 * As AVX2's (avx2/axpy_avx2.c): register tiles of 4 tokens x 32 columns (16 in the masked
 * tail), each y value through the same FMAs in the same row order as the f32 axpy, so a
 * batch's dense blocks sum as its tokens do, bit for bit. */
AVX512_FN static void tiles_f32_avx512(int64_t n_tokens, const float * h, int64_t ldh, const int32_t * rows,
                                       int64_t nk, const float * buf, int64_t ldb, int64_t n, float * y,
                                       int64_t ldy) {
    float hk[64 * 4];
    for (int64_t t0 = 0; t0 < n_tokens; t0 += 4) {
        const int ntt = (int) GH_MIN((int64_t) 4, n_tokens - t0);
        for (int64_t k = 0; k < nk; k++) {
            for (int t = 0; t < 4; t++) hk[k * 4 + t] = t < ntt ? h[(t0 + t) * ldh + rows[k]] : 0.0f;
        }
        int64_t c = 0;
        for (; c + 32 <= n; c += 32) {
            __m512 acc[4][2];
            for (int t = 0; t < 4; t++) { /* the tokens past the batch's end are never stored */
                const float * yt = y + (t0 + GH_MIN(t, ntt - 1)) * ldy + c;
                acc[t][0] = _mm512_loadu_ps(yt);
                acc[t][1] = _mm512_loadu_ps(yt + 16);
            }
            for (int64_t k = 0; k < nk; k++) {
                const __m512 b0 = _mm512_loadu_ps(buf + k * ldb + c);
                const __m512 b1 = _mm512_loadu_ps(buf + k * ldb + c + 16);
                for (int t = 0; t < 4; t++) {
                    const __m512 a = _mm512_set1_ps(hk[k * 4 + t]);
                    acc[t][0] = _mm512_fmadd_ps(a, b0, acc[t][0]);
                    acc[t][1] = _mm512_fmadd_ps(a, b1, acc[t][1]);
                }
            }
            for (int t = 0; t < ntt; t++) {
                float * yt = y + (t0 + t) * ldy + c;
                _mm512_storeu_ps(yt, acc[t][0]);
                _mm512_storeu_ps(yt + 16, acc[t][1]);
            }
        }
        for (; c < n; c += 16) {
            const __mmask16 m = n - c >= 16 ? (__mmask16) 0xffff : tail_mask(n - c);
            __m512 acc[4];
            for (int t = 0; t < 4; t++) acc[t] = _mm512_maskz_loadu_ps(m, y + (t0 + GH_MIN(t, ntt - 1)) * ldy + c);
            for (int64_t k = 0; k < nk; k++) {
                const __m512 b = _mm512_maskz_loadu_ps(m, buf + k * ldb + c);
                for (int t = 0; t < 4; t++) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(hk[k * 4 + t]), b, acc[t]);
            }
            for (int t = 0; t < ntt; t++) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + c, m, acc[t]);
        }
    }
}

/* ---- the AVX-512 rows of the axpy family (cpu/kernels.h; the K-quants' sixteen-row
 * forms and Q8_0's one-token one are AVX2's, which the selection keeps at this level) ---- */

#define AXPY_ROW(sfx) { .axpy = axpy_##sfx##_avx512, .axpy4 = axpy_##sfx##_avx512_4, \
                        .axpy4pf = axpy_##sfx##_avx512_4pf }

const gh_kernel_set gh_axpy_rows_avx512[GH_TYPE_COUNT] = {
    [GH_TYPE_F32]  = { .axpy = axpy_f32_avx512, .axpy4 = axpy_f32_avx512_4, .axpy4pf = axpy_f32_avx512_4pf,
                       .tiles = tiles_f32_avx512 },
    [GH_TYPE_F16]  = AXPY_ROW(f16),
    [GH_TYPE_BF16] = AXPY_ROW(bf16),
    [GH_TYPE_Q8_0] = { .axpy = axpy_q8_0_avx512, .axpy4 = axpy_q8_0_avx512_4,
                       .axpy4pf = axpy_q8_0_avx512_4pf, .matmul16 = matmul16_q8_0_avx512 },
    [GH_TYPE_Q4_0] = { .axpy = axpy_q4_0_avx512, .axpy4 = axpy_q4_0_avx512_4,
                       .axpy4pf = axpy_q4_0_avx512_4pf, .axpy16 = axpy16_q4_0_avx512,
                       .matmul16 = matmul16_q4_0_avx512 },
    /* Q4_1: the one-row and four-row forms are AVX2's (see above), the int8 forms these */
    [GH_TYPE_Q4_1] = { .axpy16 = axpy16_q4_1_avx512, .matmul16 = matmul16_q4_1_avx512 },
    [GH_TYPE_Q5_0] = AXPY_ROW(q5_0),
    [GH_TYPE_Q5_1] = AXPY_ROW(q5_1),
    [GH_TYPE_Q4_K] = AXPY_ROW(q4_K),
    [GH_TYPE_Q5_K] = AXPY_ROW(q5_K),
    [GH_TYPE_Q6_K] = AXPY_ROW(q6_K),
    [GH_TYPE_Q2_K] = AXPY_ROW(q2_K),
    [GH_TYPE_Q3_K] = AXPY_ROW(q3_K),
    [GH_TYPE_IQ4_NL] = AXPY_ROW(iq4_nl),
    [GH_TYPE_IQ4_XS] = AXPY_ROW(iq4_xs),
    [GH_TYPE_MXFP4]  = AXPY_ROW(mxfp4),
};
