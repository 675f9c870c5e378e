/* The AVX2 dot kernels of the IQ lattice types x Q8_K (kernels_iqlat_avx2.c), for their
 * rows in the AVX2 dot table (kernels_avx2.c). The shapes are cpu/kernels.h's: gemm (a
 * tile of at most 4 rows x 4 tokens, each value the row's vec_dot, so a batch equals its
 * tokens bit for bit) and vec_dot; and the one-row axpy of the transposed matmul, for their
 * rows in the AVX2 axpy table (axpy_avx2.c). */
#ifndef GH_CPU_AVX2_IQLAT_H
#define GH_CPU_AVX2_IQLAT_H

#include "cpu/kernels.h"
#include "types/iqlat.h"

#if GH_IQ_GRIDS
#define GH_IQLAT_AVX2_DECL(T)                                                                         \
    void gh_avx2_vec_dot_##T(int64_t n, float * s, const void * w, const void * x);                   \
    void gh_avx2_gemm_##T(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                          int nt, float * y, int64_t ldy);                                     \
    void gh_avx2_axpy_##T(int64_t n, float s, const void * row, float * y);
GH_IQLAT_AVX2_DECL(iq2_xxs)
GH_IQLAT_AVX2_DECL(iq2_xs)
GH_IQLAT_AVX2_DECL(iq2_s)
GH_IQLAT_AVX2_DECL(iq3_xxs)
GH_IQLAT_AVX2_DECL(iq3_s)
GH_IQLAT_AVX2_DECL(iq1_s)
GH_IQLAT_AVX2_DECL(iq1_m)
#undef GH_IQLAT_AVX2_DECL
#endif

#endif
