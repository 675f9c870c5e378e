/* The int8 forms of the transposed matmul (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), their shared parts (included by
 * avx2/axpy_avx2.c and avx512/axpy_avx512.c; AVX2 code, which the AVX-512 functions
 * inline too).
 *
 * y[c] += sum_k s_k D_k,b q_k,c over a group of 16 rows, per block b of 32 columns (Q4_0:
 * D = d, q - 8 for q; the K-quants: D = d sc of the sub-block, 16 columns in Q6_K's, the
 * quants centred, the rest in floats, see axpy_avx2.c): the 16 products c_k = s_k D_k,b of a block are quantized to int8 against their
 * largest, m_k = round(127 c_k / M_b), so a block's sum is M_b / 127 * sum_k m_k q_k, an
 * integer sum of unsigned nibbles times signed bytes (vpmaddubsw, vpdpbusd; the offset as
 * the bias -8 sum_k m_k). That is the activation quantization of the int8 dots (Q8
 * blocks, here of 16 rows instead of 32 values): errors up to M_b / 254 per row and value,
 * ~0.5% of a sum (nRMS) on random data. The true sums of 4-bit quants are within
 * 16 * 127 * 8 < 2^15, so int16 sums may wrap on the way (two's-complement adds) and still
 * end exact, and int32 sums are the same integers (Q5_K's and Q6_K's bounds: axpy_avx2.c). */
#ifndef GH_AXPY_INT8_H
#define GH_AXPY_INT8_H

#include "types/types.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define Q4I_INLINE static inline __attribute__((always_inline))

/* s times the eight scales at d + i (f32 == 0: fp16 scales; 1: floats). */
Q4I_INLINE __m256 scaled8(float s, const void * d, ptrdiff_t i, const int f32) {
    const __m256 v = f32 ? _mm256_loadu_ps((const float *) d + i)
                         : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const uint16_t *) d + i)));
    return _mm256_mul_ps(v, _mm256_set1_ps(s));
}

/* The int8 factors of 8 blocks from j: the rows' scales D[k * ld + j ..] (fp16, or floats
 * with f32) times s[k], quantized per block against their largest (scale[j ..] = M_b / 127,
 * NaN where a product is not finite; bias[j ..] = -off sum_k m_k, the quants' offset, unless
 * bias is NULL; off: the quants' offset, 8 for 4-bit quants), the m_k packed for the kernel:
 * quads == 0, mp[p * ld + j ..] = (m_2p, m_2p+1) as the bytes of a word (int16_t); quads == 1,
 * mp[p * ld + j ..] = (m_4p .. m_4p+3) as the bytes of a dword (int32_t). With bias_hi the
 * bias is split by rows: bias gets rows 0..7's, bias_hi rows 8..15's (Q6_K's two int16 sums). */
Q4I_INLINE void int8_factors8_off(const float * s, const void * d, const int f32, int ld, int j, void * mp,
                                  const int quads, float * scale, int32_t * bias, const int off,
                                  int32_t * bias_hi) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    /* two sweeps over the rows (the products made twice) rather than sixteen live
     * vectors, which would spill: the max in two chains, then the int8 values */
    __m256 mx[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };
    __m256 bad = _mm256_setzero_ps();
    for (int k = 0; k < 16; k++) {
        const __m256 a = _mm256_and_ps(scaled8(s[k], d, k * ld + j, f32), absm);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* inf or NaN */
        mx[k & 1] = _mm256_max_ps(mx[k & 1], a);
    }
    const __m256 top = _mm256_max_ps(mx[0], mx[1]);
    const __m256 live = _mm256_andnot_ps(bad, _mm256_cmp_ps(top, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256 inv = _mm256_and_ps(live, _mm256_div_ps(_mm256_set1_ps(127.0f), top));
    _mm256_storeu_ps(scale + j, _mm256_blendv_ps(_mm256_div_ps(top, _mm256_set1_ps(127.0f)),
                                                 _mm256_set1_ps(NAN), bad));
    __m256i msum = _mm256_setzero_si256(), mlow = msum;
    const __m256i lo8 = _mm256_set1_epi32(0xff);
    for (int k = 0; k < 16; k += 4) {
        if (k == 8) mlow = msum;
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k], d, k * ld + j, f32), inv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k + 1], d, (k + 1) * ld + j, f32), inv));
        const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k + 2], d, (k + 2) * ld + j, f32), inv));
        const __m256i f = _mm256_cvtps_epi32(_mm256_mul_ps(scaled8(s[k + 3], d, (k + 3) * ld + j, f32), inv));
        msum = _mm256_add_epi32(msum, _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(e, f)));
        const __m256i w0 = _mm256_or_si256(_mm256_and_si256(a, lo8), _mm256_slli_epi32(_mm256_and_si256(b, lo8), 8));
        const __m256i w1 = _mm256_or_si256(_mm256_and_si256(e, lo8), _mm256_slli_epi32(_mm256_and_si256(f, lo8), 8));
        if (quads) {
            _mm256_storeu_si256((__m256i *) ((int32_t *) mp + (k / 4) * ld + j),
                                _mm256_or_si256(w0, _mm256_slli_epi32(w1, 16)));
        } else {
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(w0, w1), 0xd8);
            _mm_storeu_si128((__m128i *) ((int16_t *) mp + (k / 2) * ld + j), _mm256_castsi256_si128(w));
            _mm_storeu_si128((__m128i *) ((int16_t *) mp + (k / 2 + 1) * ld + j), _mm256_extracti128_si256(w, 1));
        }
    }
    const __m256i moff = _mm256_set1_epi32(-off);
    if (bias_hi) {
        _mm256_storeu_si256((__m256i *) (bias + j), _mm256_mullo_epi32(mlow, moff));
        _mm256_storeu_si256((__m256i *) (bias_hi + j), _mm256_mullo_epi32(_mm256_sub_epi32(msum, mlow), moff));
    } else if (bias) {
        _mm256_storeu_si256((__m256i *) (bias + j), _mm256_mullo_epi32(msum, moff));
    }
}

/* The 4-bit quants' factors (offset 8, one bias). */
Q4I_INLINE void int8_factors8(const float * s, const void * d, const int f32, int ld, int j, void * mp,
                              const int quads, float * scale, int32_t * bias) {
    int8_factors8_off(s, d, f32, ld, j, mp, quads, scale, bias, 8, NULL);
}

/* The two unpacked vectors of a pair of rows' block (the nibbles at q of rows a and b,
 * interleaved byte by byte: u[0] holds values 0..7 | 16..23, u[1] 8..15 | 24..31). */
Q4I_INLINE void q4_0_pair(const uint8_t * qa, const uint8_t * qb, __m256i * u) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i nib = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4); /* lane 0: low nibbles, 1: high */
    const __m256i xa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) qa));
    const __m256i xb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) qb));
    const __m256i va = _mm256_and_si256(_mm256_srlv_epi32(xa, nib), m4); /* values 0..31 */
    const __m256i vb = _mm256_and_si256(_mm256_srlv_epi32(xb, nib), m4);
    u[0] = _mm256_unpacklo_epi8(va, vb);
    u[1] = _mm256_unpackhi_epi8(va, vb);
}

/* yv[0..4) (32 values of y) += g (unless NULL) then + scale * the int16 sums lo, hi in
 * q4_0_pair's order, widened: y in registers across a batch's groups. */
Q4I_INLINE void int8_acc32(__m256 * yv, float scale, const float * g, __m256i lo, __m256i hi) {
    const __m256 sc = _mm256_set1_ps(scale);
    if (g) {
        for (int i = 0; i < 4; i++) yv[i] = _mm256_add_ps(yv[i], _mm256_set1_ps(*g));
    }
    yv[0] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo))), yv[0]);
    yv[1] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi))), yv[1]);
    yv[2] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo, 1))), yv[2]);
    yv[3] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi, 1))), yv[3]);
}

/* The same on y[0..32) in memory (the one-token forms). */
Q4I_INLINE void int8_store32(float scale, const float * g, __m256i lo, __m256i hi, float * yb) {
    __m256 yv[4];
    for (int i = 0; i < 4; i++) yv[i] = _mm256_loadu_ps(yb + 8 * i);
    int8_acc32(yv, scale, g, lo, hi);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(yb + 8 * i, yv[i]);
}

/* Q4_0's and Q4_1's batch forms: the fp16 words at byte off of blocks i0 .. i0 + nb8 (nc of
 * them present; blocks bs bytes apart) of ng groups of 16 rows (nk present) into
 * d[g][k][0..nb8), 0 where absent (off 0: the scales d; Q4_1's mins m: 2). */
Q4I_INLINE void q4_0_batch_scales(const void * const * row, int nk, int ng, int64_t i0, int nc, int nb8,
                                  size_t bs, size_t off, uint16_t * d) {
    for (int k = 0; k < ng * 16; k++) {
        const uint8_t * b = k < nk ? (const uint8_t *) row[k] + i0 * bs + off : NULL;
        for (int i = 0; i < nb8; i++) {
            if (b && i < nc) memcpy(&d[k * nb8 + i], b + i * bs, 2);
            else d[k * nb8 + i] = 0;
        }
    }
}

/* Q4_1 (x = d q + m = d (q - 8) + (8 d + m)): the part outside the centred nibbles, which
 * the int8 sums leave out, per block of 8 from j: g[j ..] = sum_k s_k (8 d_k + m_k) in
 * floats, rows k in order (d, m: fp16 [16][ld]). */
Q4I_INLINE void q4_1_g8(const float * s, const uint16_t * d, const uint16_t * m, int ld, int j, float * g) {
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < 16; k++) {
        const __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (d + k * ld + j)));
        const __m256 mk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (m + k * ld + j)));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s[k]), _mm256_fmadd_ps(_mm256_set1_ps(8.0f), dk, mk), acc);
    }
    _mm256_storeu_ps(g + j, acc);
}

/* Group g's 16 activations of one token of a batch call (ht: its row of h; rows past nk: 0). */
Q4I_INLINE void batch_s16(const float * ht, const int32_t * hc, int nk, int g, float * s) {
    for (int k = 0; k < 16; k++) s[k] = 16 * g + k < nk ? ht[hc[16 * g + k]] : 0.0f;
}

/* One token's factors for every group of a batch call (ht: its row of h; per group g, d at
 * d + g * 16 * nb8, mp at mp + g * 8 * nb8 (pairs, int16) or g * 4 * nb8 (quads, int32),
 * scale and bias at g * nb8; with m (Q4_1's mins, as d) the g of q4_1_g8 at gq + g * nb8);
 * rows past nk have s = 0. nb8: 8 blocks (one call of each). */
Q4I_INLINE void q4_0_batch_factors(const float * ht, const int32_t * hc, int nk, int ng, int nb8,
                                   const uint16_t * d, void * mp, const int quads, float * scale,
                                   int32_t * bias, const uint16_t * m, float * gq) {
    for (int g = 0; g < ng; g++) {
        float s[16];
        batch_s16(ht, hc, nk, g, s);
        void * mpg = quads ? (void *) ((int32_t *) mp + g * 4 * nb8) : (void *) ((int16_t *) mp + g * 8 * nb8);
        int8_factors8(s, d + g * 16 * nb8, 0, nb8, 0, mpg, quads, scale + g * nb8, bias + g * nb8);
        if (m) q4_1_g8(s, d + g * 16 * nb8, m + g * 16 * nb8, nb8, 0, gq + g * nb8);
    }
}

#endif
