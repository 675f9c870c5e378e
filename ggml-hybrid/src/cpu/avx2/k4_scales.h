/* The Q4_K/Q5_K block scales and mins decoded in the vector unit, shared by the AVX2 and
 * AVX-512 dot kernels (both files are compiled with -mavx2; include only from those). */
#ifndef GH_K4_SCALES_H
#define GH_K4_SCALES_H

#include <immintrin.h>
#include <stdint.h>

/* The 6-bit scales (bytes 0..7) and mins (bytes 8..15) of a Q4_K/Q5_K block, in the
 * vector unit: with a, b, c the words of the 12 scale bytes, [a & 3f.., (c & 0f..) |
 * ((a >> 2) & 30..), b & 3f.., ((c >> 4) & 0f..) | ((b >> 2) & 30..)] (gh_k4_scale_min's
 * rule). The load reads four bytes past the scales, inside the block. */
static inline __attribute__((always_inline)) __m128i k4_scales_mins(const uint8_t * q) {
    const __m128i v = _mm_loadu_si128((const __m128i *) q);
    const __m128i t1 = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)); /* a, c, b, c */
    const __m128i t2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)); /* a, a, b, b */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(t1, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(t2, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/* The mins (bytes 8..15 of sm) as 16 words, min j in words 2j and 2j + 1: one madd with a
 * token's 16 bsums gives the 8 sums min_j * (bsums[2j] + bsums[2j + 1]). */
static inline __attribute__((always_inline)) __m256i k4_mins16(__m128i sm) {
    const __m128i m = _mm_srli_si128(sm, 8);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
}

#endif
