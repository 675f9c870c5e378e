/* The AVX-512 dot kernels kept in files of their own, for their rows in the AVX-512 dot
 * table (kernels_avx512.c, which gives them its Q8_X4 / Q8_K activation conversions):
 *   Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 x Q8_X4 (kernels_b32_avx512.c): four-row tiles of
 *     up to GH_B32_AVX512_NT tokens (IQ4_NL prompts: 16 rows x up to GH_NL16_AVX512_NT);
 *   Q2_K, Q3_K, IQ4_XS x Q8_K (kernels_k2_avx512.c): one row at a time, tiles of 1 x
 *     GH_K2_AVX512_NT tokens (IQ4_XS prompts: 16 rows x up to GH_NL16_AVX512_NT).
 * The shapes are cpu/kernels.h's: gemm, vec_dot, dot4. */
#ifndef GH_CPU_AVX512_KERNELS_H
#define GH_CPU_AVX512_KERNELS_H

#include "cpu/kernels.h"

#define GH_B32_AVX512_NT 8 /* tokens of a prompt tile */
#define GH_K2_AVX512_NT 4
/* The IQ4 prompt tiles over rows rearranged per call (IQ4_NL: kernels_b32_avx512.c,
 * IQ4_XS: kernels_k2_avx512.c): rows and most tokens */
#define GH_NL16_AVX512_MR 16
#define GH_NL16_AVX512_NT 64

#define GH_AVX512_DOT_DECL(sfx)                                                                     \
    void gh_avx512_gemm_##sfx(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                              int nt, float * y, int64_t ldy);                                     \
    void gh_avx512_vec_dot_##sfx(int64_t n, float * s, const void * w, const void * x);            \
    void gh_avx512_dot4_##sfx(int64_t n, const void * const * rows, const void * const * pf,       \
                              const void * x, float * y);

GH_AVX512_DOT_DECL(q4_1)
GH_AVX512_DOT_DECL(q5_0)
GH_AVX512_DOT_DECL(q5_1)
GH_AVX512_DOT_DECL(iq4_nl)
GH_AVX512_DOT_DECL(mxfp4)
GH_AVX512_DOT_DECL(q2_K)
GH_AVX512_DOT_DECL(q3_K)
GH_AVX512_DOT_DECL(iq4_xs)

#endif
