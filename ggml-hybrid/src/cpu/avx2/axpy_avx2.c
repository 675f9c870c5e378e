/* AVX2 axpy kernels of the K-quants, and Q4_0's sixteen-row int8 forms, one token and a
 * batch (at the end; axpy.c picks them at the AVX2 level, and has the other types' AVX2
 * axpy forms).
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
#include "cpu/avx2/axpy_int8.h"

#include <math.h>
#include <stddef.h>
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
 * The arithmetic: avx2/axpy_int8.h. The float form (axpy.c) widens every nibble to a float
 * and spends an FMA on it; here the nibbles of two rows, interleaved, meet a pair
 * (m_k, m_k+1) in one vpmaddubsw, and the int16 sums of the 16 rows are widened and
 * converted once per block.
 *
 * Per chunk of CHUNK_BLOCKS blocks: the rows' scales are copied out (which also brings
 * the chunk's bytes into L1 for the pass after), the m_k and M_b of 8 blocks at a time are
 * made in vertical vector operations across the 16 rows, then the pass adds the rows. A
 * non-finite product makes its block's outputs NaN (the float form's inf - inf or NaN). */
#define CHUNK_BLOCKS 32

AVX2_INLINE void axpy16_q4_0(int64_t n, const float * s, const void * const * row, const void * const * pf,
                             float * restrict y) {
    const size_t bs = sizeof(block_q4_0);
    const int64_t nb = n / QK4_0;
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
        for (int j = 0; j < nc; j += 8) int8_factors8(s, &d[0][0], 0, CHUNK_BLOCKS, j, &mp[0][0], 0, scale, bias);
        float * yb = y + i0 * QK4_0;
        for (int i = 0; i < nc; i++, yb += QK4_0) {
            const size_t off = (size_t) (i0 + i) * bs + 2;
            __m256i lo = _mm256_set1_epi16((int16_t) bias[i]), hi = lo;
            for (int k = 0; k < 16; k += 2) {
                __m256i u[2];
                q4_0_pair((const uint8_t *) row[k] + off, (const uint8_t *) row[k + 1] + off, u);
                const __m256i pair = _mm256_set1_epi16(mp[k / 2][i]);
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[0], pair));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u[1], pair));
            }
            int8_store32(scale[i], NULL, lo, hi, yb);
        }
    }
}

AVX2_FN static void axpy16_q4_0_avx2(int64_t n, const float * s, const void * const * row,
                                     const void * const * pf, float * restrict y) {
    axpy16_q4_0(n, s, row, pf, y);
}

/* ---- Q4_K, sixteen rows per pass in int8 (the decode list's groups of 16) ----
 *
 * As Q4_0's form per sub-block of 32 values: its factors are the 16 products
 * c_k = s_k d_k sc_k,j (kq_factors with s = 1, then int8_factors8 over 8 sub-blocks at a
 * time). The quants q are unsigned (0..15) with a min: sum_k c_k q_k = sum_k c_k (q_k - 8)
 * + 8 sum_k c_k, and only the first, centred, part takes the int8 rounding (Q4_0's bias
 * -8 sum_k m_k), which halves its error against rounding c_k q_k (1.3% -> 0.5% nRMS on
 * random rows); the second and the mins' term sum_k s_k (-dmin_k m_k,j) are one float per
 * sub-block, added with the block's sum. A chunk is KCHUNK super-blocks. */
#define KCHUNK 4

AVX2_FN static void axpy16_q4_K_avx2(int64_t n, const float * s, const void * const * row,
                                     const void * const * pf, float * restrict y) {
    const size_t bs = sizeof(block_q4_K);
    const size_t qs = offsetof(block_q4_K, qs);
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t i0 = 0; i0 < nb; i0 += KCHUNK) {
        const int nc = (int) GH_MIN((int64_t) KCHUNK, nb - i0);
        float D[16][KCHUNK * 8];           /* d sc per row and sub-block */
        float G[16][KCHUNK * 8];           /* 8 d sc - dmin m */
        int16_t mp[8][KCHUNK * 8];         /* (m_2p, m_2p+1) as the bytes of one word */
        float scale[KCHUNK * 8], gs[KCHUNK * 8];
        int32_t bias[KCHUNK * 8];          /* -8 sum_k m_k */
        for (int k = 0; k < 16; k++) {
            const uint8_t * b = (const uint8_t *) row[k] + i0 * bs;
            for (int i = 0; i < KCHUNK; i++) {
                if (i < nc) {
                    kq_factors(KQ4, b + i * bs, 1.0f, &D[k][8 * i], &G[k][8 * i]);
                    _mm256_storeu_ps(&G[k][8 * i], _mm256_fmadd_ps(_mm256_set1_ps(8.0f), _mm256_loadu_ps(&D[k][8 * i]),
                                                                   _mm256_loadu_ps(&G[k][8 * i])));
                } else {
                    memset(&D[k][8 * i], 0, 8 * sizeof(float));
                    memset(&G[k][8 * i], 0, 8 * sizeof(float));
                }
            }
            if (pf) {
                const char * p = (const char *) pf[k] + i0 * bs;
                for (size_t o = 0; o < (size_t) nc * bs; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
                _mm_prefetch(p + (size_t) nc * bs - 1, _MM_HINT_T1);
            }
        }
        for (int j = 0; j < nc * 8; j += 8) {
            int8_factors8(s, &D[0][0], 1, KCHUNK * 8, j, &mp[0][0], 0, scale, bias);
            __m256 g = _mm256_setzero_ps();
            for (int k = 0; k < 16; k++) g = _mm256_fmadd_ps(_mm256_set1_ps(s[k]), _mm256_loadu_ps(&G[k][j]), g);
            _mm256_storeu_ps(gs + j, g);
        }
        float * yb = y + i0 * QK_K;
        for (int i = 0; i < nc; i++, yb += QK_K) {
            const size_t off = (size_t) (i0 + i) * bs + qs;
            for (int jp = 0; jp < 4; jp++) {
                const int j0 = 8 * i + 2 * jp, j1 = j0 + 1; /* sub-blocks: low and high nibbles */
                __m256i l0 = _mm256_set1_epi16((int16_t) bias[j0]), h0 = l0;
                __m256i l1 = _mm256_set1_epi16((int16_t) bias[j1]), h1 = l1;
                for (int p = 0; p < 8; p++) {
                    const __m256i xa = _mm256_loadu_si256((const __m256i *) ((const uint8_t *) row[2 * p] + off + 32 * jp));
                    const __m256i xb = _mm256_loadu_si256((const __m256i *) ((const uint8_t *) row[2 * p + 1] + off + 32 * jp));
                    const __m256i alo = _mm256_and_si256(xa, m4), ahi = _mm256_and_si256(_mm256_srli_epi16(xa, 4), m4);
                    const __m256i blo = _mm256_and_si256(xb, m4), bhi = _mm256_and_si256(_mm256_srli_epi16(xb, 4), m4);
                    const __m256i pa = _mm256_set1_epi16(mp[p][j0]), pb = _mm256_set1_epi16(mp[p][j1]);
                    l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(alo, blo), pa));
                    h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(alo, blo), pa));
                    l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(ahi, bhi), pb));
                    h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(ahi, bhi), pb));
                }
                int8_store32(scale[j0], &gs[j0], l0, h0, yb + 64 * jp);
                int8_store32(scale[j1], &gs[j1], l1, h1, yb + 64 * jp + 32);
            }
        }
    }
}

/* The batch form (gh_matmul16_fn): per chunk of 8 blocks the rows' nibbles are unpacked
 * once into pairs and their scales copied out, then every token makes its own factors
 * (int8_factors8, as the one-token form does) and runs the pass over the unpacked pairs.
 * The up to four groups of a call meet each 32 values of y in one load and store, added
 * group after group: a token's sums are those of axpy16_q4_0 over the same groups in
 * order, bit for bit, and y stays in L1 across them (the unpacked rows, 16 KB, too).
 * Rows past nk are padding with scale 0 and product 0. */
#define BATCH_BLOCKS 8

AVX2_FN static void matmul16_q4_0_avx2(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                       const int32_t * hc, int nk, const void * const * row,
                                       float * y, int64_t ldy) {
    const size_t bs = sizeof(block_q4_0);
    const int64_t nb = n / QK4_0;
    const int ng = (nk + 15) / 16;
    static const uint8_t zero[QK4_0 / 2];
    for (int64_t i0 = 0; i0 < nb; i0 += BATCH_BLOCKS) {
        const int nc = (int) GH_MIN((int64_t) BATCH_BLOCKS, nb - i0);
        uint16_t d[4][16][BATCH_BLOCKS];
        __m256i u[4][BATCH_BLOCKS][8][2];
        q4_0_batch_scales(row, nk, ng, i0, nc, BATCH_BLOCKS, &d[0][0][0]);
        for (int g = 0; g < ng; g++) {
            for (int i = 0; i < nc; i++) {
                const size_t off = (size_t) (i0 + i) * bs + 2;
                for (int k = 16 * g; k < 16 * g + 16; k += 2) {
                    q4_0_pair(k < nk ? (const uint8_t *) row[k] + off : zero,
                              k + 1 < nk ? (const uint8_t *) row[k + 1] + off : zero, u[g][i][(k % 16) / 2]);
                }
            }
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * ht = h + t * ldh;
            int16_t mp[4][8][BATCH_BLOCKS];
            float scale[4][BATCH_BLOCKS];
            int32_t bias[4][BATCH_BLOCKS];
            q4_0_batch_factors(ht, hc, nk, ng, BATCH_BLOCKS, &d[0][0][0], &mp[0][0][0], 0, &scale[0][0], &bias[0][0]);
            float * yb = y + t * ldy + i0 * QK4_0;
            for (int i = 0; i < nc; i++, yb += QK4_0) {
                __m256 yv[4];
                for (int v = 0; v < 4; v++) yv[v] = _mm256_loadu_ps(yb + 8 * v);
                for (int g = 0; g < ng; g++) {
                    __m256i lo = _mm256_set1_epi16((int16_t) bias[g][i]), hi = lo;
                    for (int p = 0; p < 8; p++) {
                        const __m256i pair = _mm256_set1_epi16(mp[g][p][i]);
                        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[g][i][p][0], pair));
                        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u[g][i][p][1], pair));
                    }
                    int8_acc32(yv, scale[g][i], NULL, lo, hi);
                }
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(yb + 8 * v, yv[v]);
            }
        }
    }
}

/* Q4_K's batch form: as Q4_0's, per super-block (8 sub-blocks: one factor vector), with
 * Q4_K's one-token arithmetic (axpy16_q4_K_avx2: the centred quants in int8, the rest a
 * float per sub-block), so a token's sums are that form's over the same groups, bit for bit. */
AVX2_FN static void matmul16_q4_K_avx2(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                                       const int32_t * hc, int nk, const void * const * row,
                                       float * y, int64_t ldy) {
    const size_t bs = sizeof(block_q4_K);
    const size_t qs = offsetof(block_q4_K, qs);
    const int64_t nb = n / QK_K;
    const int ng = (nk + 15) / 16;
    static const uint8_t zero[32];
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; i++) {
        float D[4][16][8], G[4][16][8];
        __m256i u[4][4][8][4]; /* group, sub-block pair, row pair, (low: 0..7|16..23, 8..15|24..31; high: the same) */
        for (int k = 0; k < ng * 16; k++) {
            float * dk = D[k / 16][k % 16], * gk = G[k / 16][k % 16];
            if (k < nk) {
                kq_factors(KQ4, (const uint8_t *) row[k] + i * bs, 1.0f, dk, gk);
                _mm256_storeu_ps(gk, _mm256_fmadd_ps(_mm256_set1_ps(8.0f), _mm256_loadu_ps(dk), _mm256_loadu_ps(gk)));
            } else {
                memset(dk, 0, 8 * sizeof(float));
                memset(gk, 0, 8 * sizeof(float));
            }
        }
        for (int g = 0; g < ng; g++) {
            for (int jp = 0; jp < 4; jp++) {
                for (int p = 0; p < 8; p++) {
                    const int ka = 16 * g + 2 * p, kb = ka + 1;
                    const uint8_t * qa = ka < nk ? (const uint8_t *) row[ka] + i * bs + qs + 32 * jp : zero;
                    const uint8_t * qb = kb < nk ? (const uint8_t *) row[kb] + i * bs + qs + 32 * jp : zero;
                    const __m256i xa = _mm256_loadu_si256((const __m256i *) qa), xb = _mm256_loadu_si256((const __m256i *) qb);
                    const __m256i alo = _mm256_and_si256(xa, m4), ahi = _mm256_and_si256(_mm256_srli_epi16(xa, 4), m4);
                    const __m256i blo = _mm256_and_si256(xb, m4), bhi = _mm256_and_si256(_mm256_srli_epi16(xb, 4), m4);
                    u[g][jp][p][0] = _mm256_unpacklo_epi8(alo, blo);
                    u[g][jp][p][1] = _mm256_unpackhi_epi8(alo, blo);
                    u[g][jp][p][2] = _mm256_unpacklo_epi8(ahi, bhi);
                    u[g][jp][p][3] = _mm256_unpackhi_epi8(ahi, bhi);
                }
            }
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * ht = h + t * ldh;
            int16_t mp[4][8][8];
            float scale[4][8], gs[4][8];
            int32_t bias[4][8];
            for (int g = 0; g < ng; g++) {
                float s[16];
                for (int k = 0; k < 16; k++) s[k] = 16 * g + k < nk ? ht[hc[16 * g + k]] : 0.0f;
                int8_factors8(s, &D[g][0][0], 1, 8, 0, &mp[g][0][0], 0, scale[g], bias[g]);
                __m256 gv = _mm256_setzero_ps();
                for (int k = 0; k < 16; k++) gv = _mm256_fmadd_ps(_mm256_set1_ps(s[k]), _mm256_loadu_ps(G[g][k]), gv);
                _mm256_storeu_ps(gs[g], gv);
            }
            float * yb = y + t * ldy + i * QK_K;
            for (int sb = 0; sb < 8; sb++, yb += 32) {
                const int jp = sb / 2, hv = 2 * (sb % 2);
                __m256 yv[4];
                for (int v = 0; v < 4; v++) yv[v] = _mm256_loadu_ps(yb + 8 * v);
                for (int g = 0; g < ng; g++) {
                    __m256i lo = _mm256_set1_epi16((int16_t) bias[g][sb]), hi = lo;
                    for (int p = 0; p < 8; p++) {
                        const __m256i pair = _mm256_set1_epi16(mp[g][p][sb]);
                        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(u[g][jp][p][hv], pair));
                        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(u[g][jp][p][hv + 1], pair));
                    }
                    int8_acc32(yv, scale[g][sb], &gs[g][sb], lo, hi);
                }
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(yb + 8 * v, yv[v]);
            }
        }
    }
}

gh_matmul16_fn gh_matmul16_avx2(int type) {
    switch (type) {
        case GH_TYPE_Q4_0: return matmul16_q4_0_avx2;
        case GH_TYPE_Q4_K: return matmul16_q4_K_avx2;
        default:           return NULL;
    }
}

gh_axpy16_fn gh_axpy16_avx2(int type) {
    switch (type) {
        case GH_TYPE_Q4_0: return axpy16_q4_0_avx2;
        case GH_TYPE_Q4_K: return axpy16_q4_K_avx2;
        default:           return NULL;
    }
}

#else

gh_axpy_fn gh_axpy_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy4_fn gh_axpy4_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy4pf_fn gh_axpy4pf_kq_avx2(int type) { (void) type; return NULL; }
gh_axpy16_fn gh_axpy16_avx2(int type) { (void) type; return NULL; }
gh_matmul16_fn gh_matmul16_avx2(int type) { (void) type; return NULL; }

#endif
