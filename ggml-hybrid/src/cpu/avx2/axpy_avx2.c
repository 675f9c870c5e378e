/* AVX2 axpy kernels of the K-quants (axpy.c's table picks them at the AVX2 level; the
 * other types' AVX2 axpy forms are in axpy.c): y[0..n) += s * row and the four-row forms,
 * rows starting at a block boundary, n a multiple of 256.
 *
 * Each block is taken apart once (avx2/kq_unpack.h: its quants as bytes, its sub-blocks'
 * f and g with the row's scale folded in), then per 8 values one widening load, one
 * conversion and one FMA. The one-row form adds f q + g (the dequantized value times s)
 * to y; the four-row forms start each vector from y plus the four rows' g and add f_k q_k
 * for k = 0..3, so they differ from four one-row calls by rounding only. The forms with
 * and without prefetch share one body and agree bit for bit. */
#include "cpu/ops.h"
#include "types/types.h"

#if defined(GH_X86)
#include "cpu/avx2/kq_unpack.h"

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE AVX2_FN static inline __attribute__((always_inline))

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

gh_axpy_fn gh_axpy_kq_avx2(int type) {
    switch (type) {
        case GH_TYPE_Q4_K: return axpy_q4_K_avx2;
        case GH_TYPE_Q5_K: return axpy_q5_K_avx2;
        case GH_TYPE_Q6_K: return axpy_q6_K_avx2;
        default:           return NULL;
    }
}

gh_axpy4_fn gh_axpy4_kq_avx2(int type) {
    switch (type) {
        case GH_TYPE_Q4_K: return axpy_q4_K_avx2_4;
        case GH_TYPE_Q5_K: return axpy_q5_K_avx2_4;
        case GH_TYPE_Q6_K: return axpy_q6_K_avx2_4;
        default:           return NULL;
    }
}

gh_axpy4pf_fn gh_axpy4pf_kq_avx2(int type) {
    switch (type) {
        case GH_TYPE_Q4_K: return axpy_q4_K_avx2_4pf;
        case GH_TYPE_Q5_K: return axpy_q5_K_avx2_4pf;
        case GH_TYPE_Q6_K: return axpy_q6_K_avx2_4pf;
        default:           return NULL;
    }
}

#else

gh_axpy_fn gh_axpy_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy4_fn gh_axpy4_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy4pf_fn gh_axpy4pf_kq_avx2(int type) { (void) type; return NULL; }

#endif
