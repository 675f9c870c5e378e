/* A K-quant block taken apart for the axpy kernels (included by avx2/axpy_avx2.c and
 * avx512/axpy_avx512.c; AVX2 code, which the AVX-512 functions inline too):
 *   q[i]  the quant of value i (0..15 Q4_K, 0..31 Q5_K, 0..63 Q6_K), one byte each, made
 *         with 32-byte operations (a Q5_K bit or Q6_K high pair is shifted into place in
 *         the byte domain, 32 values per instruction, instead of once per widened vector);
 *   f[j], g[j]  sub-block j's value = f[j] * q + g[j], the row's scale s folded in (Q4_K,
 *         Q5_K: f = s d sc, g = -s dmin m, 8 sub-blocks of 32; Q6_K: f = s d sc, g = -32 f,
 *         16 of 16, so that f q + g = f (q - 32) exactly; Q2_K: q 0..3, f = s d (sc & 15),
 *         g = -s dmin (sc >> 4), 16 of 16; Q3_K: q 0..7 (hmask's bit as bit 2),
 *         f = s d (sc - 32), g = -4 f, 16 of 16).
 * The kernels then widen q from memory (vpmovzxbd) and spend one FMA per vector. */
#ifndef GH_KQ_UNPACK_H
#define GH_KQ_UNPACK_H

#include "cpu/kernels.h"
#include "types/types.h"

#include <immintrin.h>
#include <string.h>

#define KQ_INLINE static inline __attribute__((always_inline))

enum { KQ4, KQ5, KQ6, KQ2, KQ3 };

KQ_INLINE size_t kq_bytes(const int kind) {
    switch (kind) {
        case KQ4: return sizeof(block_q4_K);
        case KQ5: return sizeof(block_q5_K);
        case KQ2: return sizeof(block_q2_K);
        case KQ3: return sizeof(block_q3_K);
        default:  return sizeof(block_q6_K);
    }
}

/* Values per sub-block: 32 (Q4_K, Q5_K), 16 (Q6_K, Q2_K, Q3_K). */
KQ_INLINE int kq_sub_len(const int kind) { return kind == KQ4 || kind == KQ5 ? 32 : 16; }

KQ_INLINE void kq_factors(const int kind, const uint8_t * b, float s, float * f, float * g) {
    if (kind == KQ2) {
        const block_q2_K * q = (const block_q2_K *) b;
        const __m128i sc = _mm_loadu_si128((const __m128i *) q->scales), m4 = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(sc, m4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
        const __m256 ds = _mm256_set1_ps(s * _cvtsh_ss(q->d)), dm = _mm256_set1_ps(-s * _cvtsh_ss(q->dmin));
        _mm256_storeu_ps(f, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))));
        _mm256_storeu_ps(f + 8, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))));
        _mm256_storeu_ps(g, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))));
        _mm256_storeu_ps(g + 8, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))));
        return;
    }
    if (kind == KQ3) {
        const block_q3_K * q = (const block_q3_K *) b;
        const float sd = s * _cvtsh_ss(q->d);
        for (int j = 0; j < 16; j++) {
            f[j] = sd * (float) (gh_k3_scale(q->scales, j) - 32);
            g[j] = -4.0f * f[j];
        }
        return;
    }
    if (kind == KQ6) {
        const block_q6_K * q = (const block_q6_K *) b;
        const __m256 ds = _mm256_set1_ps(s * _cvtsh_ss(q->d)), m32 = _mm256_set1_ps(-32.0f);
        const __m128i sc = _mm_loadu_si128((const __m128i *) q->scales);
        const __m256 f0 = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        const __m256 f1 = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        _mm256_storeu_ps(f, f0);
        _mm256_storeu_ps(f + 8, f1);
        _mm256_storeu_ps(g, _mm256_mul_ps(m32, f0));
        _mm256_storeu_ps(g + 8, _mm256_mul_ps(m32, f1));
        return;
    }
    uint16_t dh, dmh;
    memcpy(&dh, b, 2);
    memcpy(&dmh, b + 2, 2);
    uint32_t sm[4];
    gh_k4_scales_mins(b + 4, sm);
    const __m128i v = _mm_loadu_si128((const __m128i *) sm);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    _mm256_storeu_ps(f, _mm256_mul_ps(_mm256_set1_ps(s * _cvtsh_ss(dh)), sc));
    _mm256_storeu_ps(g, _mm256_mul_ps(_mm256_set1_ps(-s * _cvtsh_ss(dmh)), m));
}

/* Bit 4 of sub-block j's Q5_K values: bit j of each qh byte moved to bit 4. The 16-bit
 * shifts carry bits across bytes, but only into bits the mask drops. */
#define KQ5_BIT4(hb, j) _mm256_and_si256((j) <= 4 ? _mm256_slli_epi16(hb, 4 - (j)) : _mm256_srli_epi16(hb, (j) - 4), \
                                         _mm256_set1_epi8(0x10))

KQ_INLINE void kq_unpack(const int kind, const uint8_t * b, uint8_t * restrict q) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (kind == KQ2 || kind == KQ3) { /* value 128h + 32g + l: bits 2g of qs[32h + l] */
        const uint8_t * qs = kind == KQ3 ? ((const block_q3_K *) b)->qs : ((const block_q2_K *) b)->qs;
        const __m256i m3 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
        const __m256i hm = kind == KQ3 ? _mm256_loadu_si256((const __m256i *) ((const block_q3_K *) b)->hmask)
                                       : _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *) (qs + 32 * h));
            for (int g = 0; g < 4; g++) {
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(x, 2 * g), m3);
                if (kind == KQ3) { /* bit 4h + g of hmask[l] to bit 2 (16-bit shifts: the mask drops the rest) */
                    const int k = 4 * h + g;
                    const __m256i hk = k < 2 ? _mm256_slli_epi16(hm, 2 - k) : _mm256_srli_epi16(hm, k - 2);
                    v = _mm256_or_si256(v, _mm256_and_si256(hk, b2));
                }
                _mm256_storeu_si256((__m256i *) (q + 128 * h + 32 * g), v);
            }
        }
        return;
    }
    if (kind == KQ6) {
        const block_q6_K * x = (const block_q6_K *) b;
        const __m256i m30 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * h));
            const __m256i hi = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * h + 32));
            const __m256i hh = _mm256_loadu_si256((const __m256i *) (x->qh + 32 * h));
            __m256i * o = (__m256i *) (q + 128 * h);
            _mm256_storeu_si256(o, _mm256_or_si256(_mm256_and_si256(lo, m4),
                                                   _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30)));
            _mm256_storeu_si256(o + 1, _mm256_or_si256(_mm256_and_si256(hi, m4),
                                                       _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30)));
            _mm256_storeu_si256(o + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
                                                       _mm256_and_si256(hh, m30)));
            _mm256_storeu_si256(o + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
                                                       _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30)));
        }
        return;
    }
    const uint8_t * qs = b + 4 + K_SCALE_SIZE + (kind == KQ5 ? QK_K / 8 : 0);
    __m256i lo[4], hi[4];
    for (int c = 0; c < 4; c++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *) (qs + 32 * c));
        lo[c] = _mm256_and_si256(x, m4);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
    }
    if (kind == KQ5) {
        const __m256i hb = _mm256_loadu_si256((const __m256i *) (b + 4 + K_SCALE_SIZE));
        lo[0] = _mm256_or_si256(lo[0], KQ5_BIT4(hb, 0));
        hi[0] = _mm256_or_si256(hi[0], KQ5_BIT4(hb, 1));
        lo[1] = _mm256_or_si256(lo[1], KQ5_BIT4(hb, 2));
        hi[1] = _mm256_or_si256(hi[1], KQ5_BIT4(hb, 3));
        lo[2] = _mm256_or_si256(lo[2], KQ5_BIT4(hb, 4));
        hi[2] = _mm256_or_si256(hi[2], KQ5_BIT4(hb, 5));
        lo[3] = _mm256_or_si256(lo[3], KQ5_BIT4(hb, 6));
        hi[3] = _mm256_or_si256(hi[3], KQ5_BIT4(hb, 7));
    }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_si256((__m256i *) (q + 64 * c), lo[c]);
        _mm256_storeu_si256((__m256i *) (q + 64 * c + 32), hi[c]);
    }
}

#endif
