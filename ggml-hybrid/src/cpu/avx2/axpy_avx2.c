/* AVX2 axpy kernels of the K-quants, and Q4_0's sixteen-row int8 form (at the end; axpy.c
 * picks them at the AVX2 level, and has the other types' AVX2 axpy forms).
 *
 * K-quants: y[0..n) += s * row and the four-row forms, rows starting at a block boundary,
 * n a multiple of 256. Each block is taken apart once (avx2/kq_unpack.h: its quants as bytes, its sub-blocks'
 * f and g with the row's scale folded in), then per 8 values one widening load, one
 * conversion and one FMA. The one-row form adds f q + g (the dequantized value times s)
 * to y; the four-row forms start each vector from y plus the four rows' g and add f_k q_k
 * for k = 0..3, so they differ from four one-row calls by rounding only. The forms with
 * and without prefetch share one body and agree bit for bit. */
#include "cpu/ops.h"
#include "types/types.h"

#if defined(GH_X86)
#include "cpu/avx2/kq_unpack.h"

#include <math.h>
#include <string.h>

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

/* ---- Q4_0, sixteen rows per pass in int8 (the decode list's groups of 16) ----
 *
 * y[c] += sum_k s_k d_k,b (q_k,c - 8) over the 16 rows, per block b of 32 columns. The
 * float form (axpy.c) widens every nibble to a float and spends an FMA on it; here the 16
 * products c_k = s_k d_k,b of a block are quantized to int8 against their largest,
 * m_k = round(127 c_k / M_b), so a block's sum is M_b / 127 * sum_k m_k (q_k - 8): the
 * nibbles of two rows, interleaved, meet a pair (m_k, m_k+1) in one vpmaddubsw, and the
 * int16 sums of the 16 rows are widened and converted once. That is the activation
 * quantization of the int8 dots (Q8 blocks, here of 16 rows instead of 32 values):
 * errors up to M_b / 254 per row and value, ~0.5% of a sum (nRMS) on random data.
 * The true sum is within 16 * 127 * 8 < 2^15, so the int16 sums may wrap on the way
 * (two's-complement adds) and still end exact.
 *
 * Per chunk of CHUNK_BLOCKS blocks: the rows' scales are copied out (which also brings
 * the chunk's bytes into L1 for the pass after), the m_k and M_b of 8 blocks at a time are
 * made in vertical vector operations across the 16 rows, then the pass adds the rows. A
 * non-finite product makes its block's outputs NaN (the float form's inf - inf or NaN). */
#define CHUNK_BLOCKS 32

/* s times the eight fp16 scales at d. */
AVX2_INLINE __m256 scaled8(float s, const uint16_t * d) {
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) d)), _mm256_set1_ps(s));
}

AVX2_INLINE void axpy16_q4_0(int64_t n, const float * s, const void * const * row, const void * const * pf,
                             float * restrict y) {
    const size_t bs = sizeof(block_q4_0);
    const int64_t nb = n / QK4_0;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i nib = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4); /* lane 0: low nibbles, 1: high */
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    for (int64_t i0 = 0; i0 < nb; i0 += CHUNK_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) CHUNK_BLOCKS, nb - i0);
        uint16_t d[16][CHUNK_BLOCKS];      /* the rows' block scales, fp16 */
        int16_t mp[8][CHUNK_BLOCKS];       /* (m_2p, m_2p+1) as the bytes of one word */
        float scale[CHUNK_BLOCKS];         /* M_b / 127 */
        int32_t bias[CHUNK_BLOCKS];        /* -8 sum_k m_k */
        for (int k = 0; k < 16; k++) {
            const uint8_t * b = (const uint8_t *) row[k] + i0 * bs;
            for (int i = 0; i < nc; i++) memcpy(&d[k][i], b + i * bs, 2);
            for (int i = nc; i < CHUNK_BLOCKS; i++) d[k][i] = 0;
            if (pf) {
                const char * p = (const char *) pf[k] + i0 * bs;
                for (size_t o = 0; o < (size_t) nc * bs; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
                _mm_prefetch(p + (size_t) nc * bs - 1, _MM_HINT_T1);
            }
        }
        for (int j = 0; j < nc; j += 8) {
            /* two sweeps over the rows (the products made twice) rather than sixteen live
             * vectors, which would spill: the max in two chains, then the int8 values */
            __m256 mx[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };
            __m256 bad = _mm256_setzero_ps();
            for (int k = 0; k < 16; k++) {
                const __m256 a = _mm256_and_ps(scaled8(s[k], &d[k][j]), absm);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* inf or NaN */
                mx[k & 1] = _mm256_max_ps(mx[k & 1], a);
            }
            const __m256 top = _mm256_max_ps(mx[0], mx[1]);
            const __m256 live = _mm256_andnot_ps(bad, _mm256_cmp_ps(top, _mm256_setzero_ps(), _CMP_GT_OQ));
            const __m256 inv = _mm256_and_ps(live, _mm256_div_ps(_mm256_set1_ps(127.0f), top));
            _mm256_storeu_ps(scale + j, _mm256_blendv_ps(_mm256_div_ps(top, _mm256_set1_ps(127.0f)),
                                                         _mm256_set1_ps(NAN), bad));
            __m256i msum = _mm256_setzero_si256();
            const __m256i lo8 = _mm256_set1_epi32(0xff);
            for (int k = 0; k < 16; k += 4) {
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k], &d[k][j]), inv));
                const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k + 1], &d[k + 1][j]), inv));
                const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k + 2], &d[k + 2][j]), inv));
                const __m256i f = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k + 3], &d[k + 3][j]), inv));
                msum = _mm256_add_epi32(msum, _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(e, f)));
                const __m256i w0 = _mm256_or_si256(_mm256_and_si256(a, lo8), _mm256_slli_epi32(_mm256_and_si256(b, lo8), 8));
                const __m256i w1 = _mm256_or_si256(_mm256_and_si256(e, lo8), _mm256_slli_epi32(_mm256_and_si256(f, lo8), 8));
                const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(w0, w1), 0xd8);
                _mm_storeu_si128((__m128i *) &mp[k / 2][j], _mm256_castsi256_si128(w));
                _mm_storeu_si128((__m128i *) &mp[k / 2 + 1][j], _mm256_extracti128_si256(w, 1));
            }
            _mm256_storeu_si256((__m256i *) (bias + j), _mm256_mullo_epi32(msum, _mm256_set1_epi32(-8)));
        }
        float * yb = y + i0 * QK4_0;
        for (int i = 0; i < nc; i++, yb += QK4_0) {
            const size_t off = (size_t) (i0 + i) * bs + 2;
            __m256i lo = _mm256_set1_epi16((int16_t) bias[i]), hi = lo;
            for (int k = 0; k < 16; k += 2) {
                const __m256i xa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) ((const uint8_t *) row[k] + off)));
                const __m256i xb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) ((const uint8_t *) row[k + 1] + off)));
                const __m256i va = _mm256_and_si256(_mm256_srlv_epi32(xa, nib), m4); /* values 0..31 */
                const __m256i vb = _mm256_and_si256(_mm256_srlv_epi32(xb, nib), m4);
                const __m256i pair = _mm256_set1_epi16(mp[k / 2][i]);
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(va, vb), pair));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(va, vb), pair));
            }
            /* lo: values 0..7 | 16..23, hi: 8..15 | 24..31 */
            const __m256 sc = _mm256_set1_ps(scale[i]);
            const __m256i v0 = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo));
            const __m256i v1 = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi));
            const __m256i v2 = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo, 1));
            const __m256i v3 = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi, 1));
            _mm256_storeu_ps(yb, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(v0), _mm256_loadu_ps(yb)));
            _mm256_storeu_ps(yb + 8, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(v1), _mm256_loadu_ps(yb + 8)));
            _mm256_storeu_ps(yb + 16, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(v2), _mm256_loadu_ps(yb + 16)));
            _mm256_storeu_ps(yb + 24, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(v3), _mm256_loadu_ps(yb + 24)));
        }
    }
}

AVX2_FN static void axpy16_q4_0_avx2(int64_t n, const float * s, const void * const * row,
                                     const void * const * pf, float * restrict y) {
    axpy16_q4_0(n, s, row, pf, y);
}

gh_axpy16_fn gh_axpy16_avx2(int type) {
    return type == GH_TYPE_Q4_0 ? axpy16_q4_0_avx2 : NULL;
}

#else

gh_axpy_fn gh_axpy_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy4_fn gh_axpy4_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy4pf_fn gh_axpy4pf_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy16_fn gh_axpy16_avx2(int type) { (void) type; return NULL; }

#endif
