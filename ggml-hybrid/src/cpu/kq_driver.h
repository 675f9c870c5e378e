/* The K-quant tile driver, one copy for every ISA folder: the row loop of the K-quants'
 * (and AVX-512 IQ4_XS's) dot kernels against Q8_K, which is the same whatever the vector
 * width. The including file defines, before it includes this:
 *   KNT         the most tokens of a tile (its k_row keeps KNT accumulators),
 *   K_PF_BYTES  the software prefetch distance along the row stream,
 *   k_row(NT, kind, n, w, pf, x, xs, y, ldy)  one row against NT tokens (NT a constant:
 *               1..KNT), the ISA's kernel, prefetching pf on the way; y[t * ldy] = the
 *               token t's sum;
 * and gets gemm_k, dot4_k and KQ_DEFINE(LINK, gemm, vec_dot, dot4, KIND), which defines
 * the table's three functions of a kind (LINK: static, or nothing for the ones another
 * file's table names).
 *
 * Rows are read one after the other (one linear stream, prefetched K_PF_BYTES ahead) and
 * every block is unpacked once for the tokens of a tile; a row's sum for a token does not
 * depend on the tile it ran in, so a batch equals its tokens one by one, bit for bit
 * (tests/ops/test_types_matmul.py). */
#ifndef GH_CPU_KQ_DRIVER_H
#define GH_CPU_KQ_DRIVER_H

#include <stddef.h>
#include <stdint.h>

/* Rows one after the other; tokens in tiles of KNT (the last tile the rest). */
static inline __attribute__((always_inline)) void
gemm_k(const int kind, int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs,
       int nt, float * y, int64_t ldy) {
    for (int r = 0; r < nr; r++) {
        const uint8_t * wr = (const uint8_t *) w + r * ws;
        for (int t = 0; t < nt; t += KNT) {
            const char * xt = (const char *) x + t * xs;
            float * yt = y + t * ldy + r;
            switch (GH_MIN(KNT, nt - t)) {
                case 1: k_row(1, kind, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 2: k_row(2, kind, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 3: k_row(3, kind, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                default: k_row(4, kind, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
            }
        }
    }
}

/* Four gathered rows: each the same one-row sum as the dense decode (so a listed row's
 * value is the matvec's), prefetching the rows pf[] along. */
static inline __attribute__((always_inline)) void
dot4_k(const int kind, int64_t n, const void * const * rows, const void * const * pf, const void * x,
       float * y) {
    for (int r = 0; r < 4; r++) k_row(1, kind, n, rows[r], pf[r], x, 0, y + r, 1);
}

#define KQ_DEFINE(LINK, gemm, vec_dot, dot4, KIND)                                              \
    LINK void gemm(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs,    \
                   int nt, float * y, int64_t ldy) {                                            \
        gemm_k(KIND, n, w, ws, nr, x, xs, nt, y, ldy);                                          \
    }                                                                                           \
    LINK void vec_dot(int64_t n, float * s, const void * w, const void * x) {                  \
        gemm_k(KIND, n, w, 0, 1, x, 0, 1, s, 1);                                                \
    }                                                                                           \
    LINK void dot4(int64_t n, const void * const * rows, const void * const * pf, const void * x, \
                   float * y) {                                                                 \
        dot4_k(KIND, n, rows, pf, x, y);                                                        \
    }

#endif
