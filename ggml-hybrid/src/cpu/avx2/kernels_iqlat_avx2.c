/* AVX2 dot kernels of the IQ lattice types against Q8_K (layouts: types/iqlat.h); their
 * rows are in the AVX2 dot table (kernels_avx2.c). Per 32 values (one register):
 *   the grid points gathered from the generated codebooks by index (four 8-byte points,
 *   or eight 4-byte IQ3 points), the signs as +-1 bytes (IQ2_XXS / IQ2_XS / IQ3_XXS: the
 *   7-bit index's expanded pattern gh_iq2_signs64; IQ2_S / IQ3_S: their sign bits
 *   expanded) applied to the activations with vpsignb, then maddubs of the unsigned grid
 *   levels (<= 62: a pair of products stays below 2^15) with the signed activations, and
 *   madd with the sub-block scales' integer form (2s + 1) into int32;
 *   IQ1_S / IQ1_M: the values times 8 are 8 * grid + (+-1) (grid -1, 0, 1; delta +-1/8),
 *   |.| <= 9, so one signed byte dot per 32 values carries the delta too.
 * The integer sums equal the scalar rows' (cpu/scalar/kernels_scalar.c); a super-block's
 * sum is scaled in float (d * y.d) and accumulated in float, the constant factor (1/8,
 * 1/4) applied once at the end.
 *
 * The axpy (y += s * row, the down_t and input-sparse column form): per 8 values the
 * point's bytes widened to floats, the sign bits flipped in, one FMA by s times the
 * sub-block's float scale (as the dequantizer computes it: d * (1/2 + s) / 4, ...). */
#include "cpu/avx2/iqlat_avx2.h"

#if GH_IQ_GRIDS
#include <immintrin.h>

#define GH_INLINE static inline __attribute__((always_inline))

GH_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 sign bits (bit j % 8 of byte j / 8: value j) as bytes: -1 where set, +1 where clear. */
GH_INLINE __m256i signs_from_bits(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bitm = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int) bits), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bitm), bitm);
    return _mm256_or_si256(v, _mm256_set1_epi8(1));
}

/* sum over 32 values of level * sign * q as 16 int16 pair sums (levels unsigned, <= 62). */
GH_INLINE __m256i dot32(__m256i levels, __m256i signs, const int8_t * q) {
    const __m256i q8 = _mm256_loadu_si256((const __m256i *) q);
    return _mm256_maddubs_epi16(levels, _mm256_sign_epi8(q8, signs));
}

GH_INLINE __m256i points8(const uint64_t * grid, int i0, int i1, int i2, int i3) {
    return _mm256_set_epi64x((long long) grid[i3], (long long) grid[i2], (long long) grid[i1], (long long) grid[i0]);
}

GH_INLINE __m256i signs7(uint32_t a) {
    return _mm256_set_epi64x((long long) gh_iq2_signs64[(a >> 21) & 127], (long long) gh_iq2_signs64[(a >> 14) & 127],
                             (long long) gh_iq2_signs64[(a >> 7) & 127], (long long) gh_iq2_signs64[a & 127]);
}

/* A tile of rows x tokens, each value its row's vec_dot (bit for bit a token's decode). */
#define DEFINE_GEMM(T)                                                                              \
    void gh_avx2_gemm_##T(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                          int nt, float * y, int64_t ldy) {                                         \
        for (int t = 0; t < nt; t++) {                                                              \
            for (int r = 0; r < nr; r++) {                                                          \
                gh_avx2_vec_dot_##T(n, &y[t * ldy + r], (const char *) w + r * ws,                  \
                                    (const char *) x + t * xs);                                     \
            }                                                                                       \
        }                                                                                           \
    }

/* ------------------------------------------------------------------ IQ2_XXS */

void gh_avx2_vec_dot_iq2_xxs(int64_t n, float * s, const void * w, const void * x) {
    const block_iq2_xxs * a = w;
    const block_q8_K * y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        const uint8_t * q = (const uint8_t *) a[b].qs;
        const int8_t * v = y[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++, v += 32) {
            const uint32_t a1 = gh_le32(q + 8 * ib + 4);
            const __m256i p = dot32(points8(gh_iq2xxs_grid, q[8 * ib], q[8 * ib + 1], q[8 * ib + 2], q[8 * ib + 3]),
                                    signs7(a1), v);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16((short) (2 * (a1 >> 28) + 1))));
        }
        const float d = y[b].d * gh_fp16_to_fp32(a[b].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = 0.125f * hsum_ps(acc);
}
DEFINE_GEMM(iq2_xxs)

/* ------------------------------------------------------------------ IQ2_XS, IQ2_S */

/* The two 16-value scales (2s + 1) of 32 values: int16 lanes 0..7 the first, 8..15 the
 * second (maddubs' pair sums of values 0..15 sit in lanes 0..7). */
GH_INLINE __m256i scales16(uint8_t sc) {
    return _mm256_set_m128i(_mm_set1_epi16((short) (2 * (sc >> 4) + 1)), _mm_set1_epi16((short) (2 * (sc & 15) + 1)));
}

void gh_avx2_vec_dot_iq2_xs(int64_t n, float * s, const void * w, const void * x) {
    const block_iq2_xs * a = w;
    const block_q8_K * y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        const uint16_t * q = a[b].qs;
        const int8_t * v = y[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++, q += 4, v += 32) {
            const __m256i lv = points8(gh_iq2xs_grid, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511);
            const __m256i sg = _mm256_set_epi64x((long long) gh_iq2_signs64[q[3] >> 9], (long long) gh_iq2_signs64[q[2] >> 9],
                                                 (long long) gh_iq2_signs64[q[1] >> 9], (long long) gh_iq2_signs64[q[0] >> 9]);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(dot32(lv, sg, v), scales16(a[b].scales[ib])));
        }
        const float d = y[b].d * gh_fp16_to_fp32(a[b].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = 0.125f * hsum_ps(acc);
}
DEFINE_GEMM(iq2_xs)

void gh_avx2_vec_dot_iq2_s(int64_t n, float * s, const void * w, const void * x) {
    const block_iq2_s * a = w;
    const block_q8_K * y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        const uint8_t * q = a[b].qs;
        const int8_t * v = y[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++, v += 32) {
            const int h = a[b].qh[ib];
            const uint8_t * g = q + 4 * ib;
            const __m256i lv = points8(gh_iq2s_grid, g[0] | (h & 3) << 8, g[1] | (h & 12) << 6,
                                       g[2] | (h & 48) << 4, g[3] | (h & 192) << 2);
            const __m256i sg = signs_from_bits(gh_le32(q + 32 + 4 * ib));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(dot32(lv, sg, v), scales16(a[b].scales[ib])));
        }
        const float d = y[b].d * gh_fp16_to_fp32(a[b].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = 0.125f * hsum_ps(acc);
}
DEFINE_GEMM(iq2_s)

/* ------------------------------------------------------------------ IQ3_XXS, IQ3_S */

void gh_avx2_vec_dot_iq3_xxs(int64_t n, float * s, const void * w, const void * x) {
    const block_iq3_xxs * a = w;
    const block_q8_K * y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        const uint8_t * q = a[b].qs;
        const int8_t * v = y[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++, v += 32) {
            const uint8_t * g = q + 8 * ib;
            const uint32_t aux = gh_le32(q + QK_K / 4 + 4 * ib);
            const __m256i lv = _mm256_set_epi32((int) gh_iq3xxs_grid[g[7]], (int) gh_iq3xxs_grid[g[6]],
                                                (int) gh_iq3xxs_grid[g[5]], (int) gh_iq3xxs_grid[g[4]],
                                                (int) gh_iq3xxs_grid[g[3]], (int) gh_iq3xxs_grid[g[2]],
                                                (int) gh_iq3xxs_grid[g[1]], (int) gh_iq3xxs_grid[g[0]]);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(dot32(lv, signs7(aux), v),
                                                            _mm256_set1_epi16((short) (2 * (aux >> 28) + 1))));
        }
        const float d = y[b].d * gh_fp16_to_fp32(a[b].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = 0.25f * hsum_ps(acc);
}
DEFINE_GEMM(iq3_xxs)

void gh_avx2_vec_dot_iq3_s(int64_t n, float * s, const void * w, const void * x) {
    const block_iq3_s * a = w;
    const block_q8_K * y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        const int8_t * v = y[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++, v += 32) {
            const uint8_t * g = a[b].qs + 8 * ib;
            const int h = a[b].qh[ib];
#define P(j) (int) gh_iq3s_grid[g[j] | ((h >> (j)) & 1) << 8]
            const __m256i lv = _mm256_set_epi32(P(7), P(6), P(5), P(4), P(3), P(2), P(1), P(0));
#undef P
            const int sc = (a[b].scales[ib / 2] >> (4 * (ib % 2))) & 15;
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(dot32(lv, signs_from_bits(gh_le32(a[b].signs + 4 * ib)), v),
                                                            _mm256_set1_epi16((short) (2 * sc + 1))));
        }
        const float d = y[b].d * gh_fp16_to_fp32(a[b].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = hsum_ps(acc);
}
DEFINE_GEMM(iq3_s)

/* ------------------------------------------------------------------ IQ1_S, IQ1_M */

/* 8 (grid + delta) of four 8-value points as bytes: 8 * grid (vpsignb of 8 by the grid's
 * -1 / 0 / 1) plus the points' delta signs dl (+-1 per 8 bytes). */
GH_INLINE __m256i iq1_values8(__m256i grid, __m256i dl) {
    return _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), grid), dl);
}

/* sum of 32 signed byte products w * q (|w| <= 9) as 16 int16 pair sums. */
GH_INLINE __m256i sdot32(__m256i wv, const int8_t * q) {
    const __m256i q8 = _mm256_loadu_si256((const __m256i *) q);
    return _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(q8, wv));
}

void gh_avx2_vec_dot_iq1_s(int64_t n, float * s, const void * w, const void * x) {
    const block_iq1_s * a = w;
    const block_q8_K * y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        const int8_t * v = y[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++, v += 32) {
            const unsigned qh = a[b].qh[ib];
            const uint8_t * g = a[b].qs + 4 * ib;
            const __m256i gr = points8(gh_iq1s_grid, g[0] | (qh & 7) << 8, g[1] | ((qh >> 3) & 7) << 8,
                                       g[2] | ((qh >> 6) & 7) << 8, g[3] | ((qh >> 9) & 7) << 8);
            const __m256i wv = iq1_values8(gr, _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sdot32(wv, v),
                                                            _mm256_set1_epi16((short) (2 * ((qh >> 12) & 7) + 1))));
        }
        const float d = y[b].d * gh_fp16_to_fp32(a[b].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = 0.125f * hsum_ps(acc);
}
DEFINE_GEMM(iq1_s)

void gh_avx2_vec_dot_iq1_m(int64_t n, float * s, const void * w, const void * x) {
    const block_iq1_m * a = w;
    const block_q8_K * y = x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        const int8_t * v = y[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++, v += 32) {
            const uint8_t * g = a[b].qs + 4 * ib;
            const unsigned h0 = a[b].qh[2 * ib], h1 = a[b].qh[2 * ib + 1];
            const __m256i gr = points8(gh_iq1s_grid, g[0] | (h0 & 7) << 8, g[1] | ((h0 >> 4) & 7) << 8,
                                       g[2] | (h1 & 7) << 8, g[3] | ((h1 >> 4) & 7) << 8);
            /* delta -1/8 (bytes of -1) where bit 3 of the point's nibble is set, else +1/8 */
            const __m256i dl = _mm256_set_epi64x(h1 & 0x80 ? -1LL : 0x0101010101010101LL,
                                                 h1 & 0x08 ? -1LL : 0x0101010101010101LL,
                                                 h0 & 0x80 ? -1LL : 0x0101010101010101LL,
                                                 h0 & 0x08 ? -1LL : 0x0101010101010101LL);
            const __m256i sc = _mm256_set_m128i(_mm_set1_epi16((short) (2 * gh_iq1_m_scale(&a[b], 2 * ib + 1) + 1)),
                                                _mm_set1_epi16((short) (2 * gh_iq1_m_scale(&a[b], 2 * ib) + 1)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sdot32(iq1_values8(gr, dl), v), sc));
        }
        const float d = y[b].d * gh_fp16_to_fp32(gh_iq1_m_d(&a[b]));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = 0.125f * hsum_ps(acc);
}
DEFINE_GEMM(iq1_m)

/* ------------------------------------------------------------------ axpy */

/* y[0..8) += c * level * sign over one 8-value point (unsigned level bytes, sign bits). */
GH_INLINE void axpy8u(float * y, __m256 c, uint64_t g, unsigned signs) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long) g)));
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i neg = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int) signs), bits), bits);
    const __m256 sv = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(neg, 31)));
    _mm256_storeu_ps(y, _mm256_fmadd_ps(c, sv, _mm256_loadu_ps(y)));
}

/* y[0..8) += c * (grid + delta) over one IQ1 point (signed level bytes -1, 0, 1). */
GH_INLINE void axpy8_iq1(float * y, __m256 c, uint64_t g, float delta) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128((long long) g)));
    _mm256_storeu_ps(y, _mm256_fmadd_ps(c, _mm256_add_ps(v, _mm256_set1_ps(delta)), _mm256_loadu_ps(y)));
}

void gh_avx2_axpy_iq2_xxs(int64_t n, float s, const void * row, float * y) {
    const block_iq2_xxs * b = row;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        const uint8_t * q = (const uint8_t *) b[i].qs;
        for (int ib = 0; ib < QK_K / 32; ib++, y += 32) {
            const uint32_t a1 = gh_le32(q + 8 * ib + 4);
            const __m256 c = _mm256_set1_ps(s * (d * (0.5f + (float) (a1 >> 28)) * 0.25f));
            for (int k = 0; k < 4; k++) {
                axpy8u(y + 8 * k, c, gh_iq2xxs_grid[q[8 * ib + k]], gh_iq2_ksigns[(a1 >> (7 * k)) & 127]);
            }
        }
    }
}

void gh_avx2_axpy_iq2_xs(int64_t n, float s, const void * row, float * y) {
    const block_iq2_xs * b = row;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK_K / 8; l += 2, y += 16) {
            const int sc = (b[i].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0x0f;
            const __m256 c = _mm256_set1_ps(s * (d * (0.5f + (float) sc) * 0.25f));
            axpy8u(y, c, gh_iq2xs_grid[b[i].qs[l] & 511], gh_iq2_ksigns[b[i].qs[l] >> 9]);
            axpy8u(y + 8, c, gh_iq2xs_grid[b[i].qs[l + 1] & 511], gh_iq2_ksigns[b[i].qs[l + 1] >> 9]);
        }
    }
}

void gh_avx2_axpy_iq2_s(int64_t n, float s, const void * row, float * y) {
    const block_iq2_s * b = row;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK_K / 8; l += 2, y += 16) {
            const int sc = (b[i].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0x0f;
            const __m256 c = _mm256_set1_ps(s * (d * (0.5f + (float) sc) * 0.25f));
            for (int h = 0; h < 2; h++) {
                const int m = l + h;
                const int idx = b[i].qs[m] | (((b[i].qh[m / 4] >> (2 * (m % 4))) & 3) << 8);
                axpy8u(y + 8 * h, c, gh_iq2s_grid[idx], b[i].qs[32 + m]);
            }
        }
    }
}

/* Two 4-value IQ3 points as one 8-value point. */
GH_INLINE uint64_t pair4(uint32_t lo, uint32_t hi) { return (uint64_t) lo | (uint64_t) hi << 32; }

void gh_avx2_axpy_iq3_xxs(int64_t n, float s, const void * row, float * y) {
    const block_iq3_xxs * b = row;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        const uint8_t * q = b[i].qs;
        for (int ib = 0; ib < QK_K / 32; ib++, y += 32) {
            const uint32_t a = gh_le32(q + QK_K / 4 + 4 * ib);
            const __m256 c = _mm256_set1_ps(s * (d * (0.5f + (float) (a >> 28)) * 0.5f));
            for (int k = 0; k < 4; k++) {
                axpy8u(y + 8 * k, c, pair4(gh_iq3xxs_grid[q[8 * ib + 2 * k]], gh_iq3xxs_grid[q[8 * ib + 2 * k + 1]]),
                       gh_iq2_ksigns[(a >> (7 * k)) & 127]);
            }
        }
    }
}

void gh_avx2_axpy_iq3_s(int64_t n, float s, const void * row, float * y) {
    const block_iq3_s * b = row;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++, y += 32) {
            const __m256 c = _mm256_set1_ps(s * (d * (float) (1 + 2 * ((b[i].scales[ib / 2] >> (4 * (ib % 2))) & 0x0f))));
            const int h = b[i].qh[ib];
            for (int k = 0; k < 4; k++) {
                const int m = 8 * ib + 2 * k;
                const uint32_t g0 = gh_iq3s_grid[b[i].qs[m] | ((h >> (2 * k)) & 1) << 8];
                const uint32_t g1 = gh_iq3s_grid[b[i].qs[m + 1] | ((h >> (2 * k + 1)) & 1) << 8];
                axpy8u(y + 8 * k, c, pair4(g0, g1), b[i].signs[4 * ib + k]);
            }
        }
    }
}

void gh_avx2_axpy_iq1_s(int64_t n, float s, const void * row, float * y) {
    const block_iq1_s * b = row;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const unsigned qh = b[i].qh[ib];
            const __m256 c = _mm256_set1_ps(s * (d * (float) (2 * ((qh >> 12) & 7) + 1)));
            const float delta = qh & 0x8000 ? -0.125f : 0.125f;
            for (int k = 0; k < 4; k++, y += 8) {
                axpy8_iq1(y, c, gh_iq1s_grid[b[i].qs[4 * ib + k] | (((qh >> (3 * k)) & 7) << 8)], delta);
            }
        }
    }
}

void gh_avx2_axpy_iq1_m(int64_t n, float s, const void * row, float * y) {
    const block_iq1_m * b = row;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(gh_iq1_m_d(&b[i]));
        for (int l = 0; l < QK_K / 8; l++, y += 8) {
            const unsigned h = (b[i].qh[l / 2] >> (4 * (l % 2))) & 0x0f;
            const __m256 c = _mm256_set1_ps(s * (d * (float) (2 * gh_iq1_m_scale(&b[i], l / 2) + 1)));
            axpy8_iq1(y, c, gh_iq1s_grid[b[i].qs[l] | ((h & 7) << 8)], h & 8 ? -0.125f : 0.125f);
        }
    }
}
#endif
