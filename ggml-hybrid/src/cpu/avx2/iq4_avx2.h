/* The AVX2 dot kernels of IQ4_NL, MXFP4 (x Q8_X4) and IQ4_XS (x Q8_K)
 * (kernels_iq4_avx2.c), for their rows in the AVX2 dot table (kernels_avx2.c). The
 * shapes are cpu/kernels.h's: gemm (a tile of at most 4 rows), vec_dot, dot4. */
#ifndef GH_CPU_AVX2_IQ4_H
#define GH_CPU_AVX2_IQ4_H

#include "cpu/kernels.h"
#include "types/iq4.h"

/* Tokens of an IQ4_NL prompt tile and of an IQ4_XS row pass (the table's nt for both):
 * 8, where Q4_0's tiles take 6 and the K-quants' passes 4. Their levels cost a sign and a
 * second maddubs per 32 values, so the tile unpacks more per token; spread over 8 tokens,
 * 128-token matmuls (SmolLM2 shapes, 1 thread, CPU time) ran IQ4_XS 0.91x and IQ4_NL
 * 0.96x the time of 4 and 6 tokens (docs/BENCHMARKS.md, "IQ4 prompt tiles"). MXFP4 keeps
 * Q4_0's 6. */
#define GH_IQ4_AVX2_NT 8
/* IQ4_NL's prompt tile (kernels_iq4_avx2.c): rows and most tokens (decode, gathered rows
 * and prompts under 8 tokens: its four-row tile) */
#define GH_NL8_AVX2_MR 8
#define GH_NL8_AVX2_NT 64

void gh_avx2_gemm_iq4_nl(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                         float * y, int64_t ldy);
void gh_avx2_vec_dot_iq4_nl(int64_t n, float * s, const void * w, const void * x);
void gh_avx2_dot4_iq4_nl(int64_t n, const void * const * rows, const void * const * pf, const void * x,
                         float * y);

void gh_avx2_gemm_mxfp4(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                        float * y, int64_t ldy);
void gh_avx2_vec_dot_mxfp4(int64_t n, float * s, const void * w, const void * x);
void gh_avx2_dot4_mxfp4(int64_t n, const void * const * rows, const void * const * pf, const void * x,
                        float * y);

void gh_avx2_gemm_iq4_xs(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                         float * y, int64_t ldy);
void gh_avx2_vec_dot_iq4_xs(int64_t n, float * s, const void * w, const void * x);
void gh_avx2_dot4_iq4_xs(int64_t n, const void * const * rows, const void * const * pf, const void * x,
                         float * y);

#endif
