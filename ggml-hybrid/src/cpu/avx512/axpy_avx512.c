/* AVX-512 axpy kernels of the transposed matmul (axpy.c picks them when the SIMD level is
 * AVX-512): y[0..n) += s * row, and the four-row form y += s0*r0 + s1*r1 + s2*r2 + s3*r3
 * (one load and store of y per four rows). Rows start at a block boundary; n is a
 * multiple of the block size (quantized types) or any length (float types: masked tail).
 * The four-row forms add the rows in order 0, 1, 2, 3 into y, like the AVX2 and scalar
 * kernels, so the SIMD levels agree up to FMA rounding. */
#include "cpu/ops.h"
#include "types/types.h"

#if defined(GH_X86)
#include <immintrin.h>

#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

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

/* ---- quantized types: one 32-value block = two vectors of 16 ---- */

/* Block i of four quantized rows b[0..4) times s[0..4), added to y[0..32): the step the
 * four-row forms share, with and without prefetch. */
#define AXPY_QUANT_BLOCK4(VALS)                                                             \
    do {                                                                                    \
        __m512 a0 = _mm512_loadu_ps(y), a1 = _mm512_loadu_ps(y + 16);                       \
        for (int k = 0; k < 4; k++) {                                                       \
            const __m512 ds = _mm512_set1_ps(s[k] * _cvtsh_ss(b[k][i].d));                  \
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
AVX512_FN static inline __m512 i8_to_ps(__m128i q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

#define DEFINE_AXPY_QUANT(name, block_t, VALS)                                              \
    AVX512_FN static void name(int64_t n, float s, const void * row, float * restrict y) { \
        const block_t * b = row;                                                            \
        for (int64_t i = 0; i < n / 32; i++, y += 32) {                                     \
            const __m512 ds = _mm512_set1_ps(s * _cvtsh_ss(b[i].d));                        \
            __m128i lo, hi;                                                                 \
            VALS(&b[i], &lo, &hi);                                                          \
            _mm512_storeu_ps(y, _mm512_fmadd_ps(ds, i8_to_ps(lo), _mm512_loadu_ps(y)));      \
            _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(ds, i8_to_ps(hi), _mm512_loadu_ps(y + 16))); \
        }                                                                                   \
    }                                                                                       \
    AVX512_FN static void name##_4(int64_t n, const float * s, const void * const * row,   \
                                   float * restrict y) {                                    \
        const block_t * b[4] = { row[0], row[1], row[2], row[3] };                          \
        for (int64_t i = 0; i < n / 32; i++, y += 32) {                                     \
            AXPY_QUANT_BLOCK4(VALS);                                                        \
        }                                                                                   \
    }

/* Four rows per pass with prefetch: every fourth block prefetches those four blocks'
 * bytes of the pf rows (Q4_0: 72 bytes, their first and last byte cover their lines;
 * Q8_0: 136 bytes, the middle line too). The sums are those of name##_4. */
#define DEFINE_AXPY_QUANT_PF(name, block_t, VALS)                                           \
    AVX512_FN static void name##_4pf(int64_t n, const float * s, const void * const * row, \
                                     const void * const * pf, float * restrict y) {         \
        const block_t * b[4] = { row[0], row[1], row[2], row[3] };                          \
        const size_t bs = sizeof(block_t);                                                  \
        for (int64_t i = 0; i < n / 32; i++, y += 32) {                                     \
            if ((i & 3) == 0) {                                                             \
                for (int k = 0; k < 4; k++) {                                               \
                    _mm_prefetch((const char *) pf[k] + i * bs, _MM_HINT_T1);               \
                    if (bs > 64) _mm_prefetch((const char *) pf[k] + i * bs + 64, _MM_HINT_T1); \
                    _mm_prefetch((const char *) pf[k] + (i + 4) * bs - 1, _MM_HINT_T1);     \
                }                                                                           \
            }                                                                               \
            AXPY_QUANT_BLOCK4(VALS);                                                        \
        }                                                                                   \
    }

DEFINE_AXPY_QUANT_PF(axpy_q4_0_avx512, block_q4_0, q4_0_vals)

DEFINE_AXPY_QUANT_PF(axpy_q8_0_avx512, block_q8_0, q8_0_vals)

DEFINE_AXPY_QUANT(axpy_q8_0_avx512, block_q8_0, q8_0_vals)
DEFINE_AXPY_QUANT(axpy_q4_0_avx512, block_q4_0, q4_0_vals)

gh_axpy_fn gh_axpy_avx512(int type) {
    switch (type) {
        case GH_TYPE_F32:  return axpy_f32_avx512;
        case GH_TYPE_F16:  return axpy_f16_avx512;
        case GH_TYPE_BF16: return axpy_bf16_avx512;
        case GH_TYPE_Q8_0: return axpy_q8_0_avx512;
        case GH_TYPE_Q4_0: return axpy_q4_0_avx512;
        default:           return NULL;
    }
}

gh_axpy4_fn gh_axpy4_avx512(int type) {
    switch (type) {
        case GH_TYPE_F32:  return axpy_f32_avx512_4;
        case GH_TYPE_F16:  return axpy_f16_avx512_4;
        case GH_TYPE_BF16: return axpy_bf16_avx512_4;
        case GH_TYPE_Q8_0: return axpy_q8_0_avx512_4;
        case GH_TYPE_Q4_0: return axpy_q4_0_avx512_4;
        default:           return NULL;
    }
}

gh_axpy4pf_fn gh_axpy4pf_avx512(int type) {
    switch (type) {
        case GH_TYPE_F32:  return axpy_f32_avx512_4pf;
        case GH_TYPE_F16:  return axpy_f16_avx512_4pf;
        case GH_TYPE_BF16: return axpy_bf16_avx512_4pf;
        case GH_TYPE_Q8_0: return axpy_q8_0_avx512_4pf;
        case GH_TYPE_Q4_0: return axpy_q4_0_avx512_4pf;
        default:           return NULL;
    }
}

#else

gh_axpy4pf_fn gh_axpy4pf_avx512(int type) { (void) type; return NULL; }
gh_axpy_fn gh_axpy_avx512(int type) { (void) type; return NULL; }
gh_axpy4_fn gh_axpy4_avx512(int type) { (void) type; return NULL; }

#endif
