/* AVX-512 dot kernels of Q2_K, Q3_K and IQ4_XS against Q8_K; their rows are in the
 * AVX-512 dot table (kernels_avx512.c, which gives them its Q8_K conversion).
 *
 * The AVX2 scheme (avx2/kernels_avx2.c "Q2_K and Q3_K", avx2/kernels_iq4_avx2.c
 * "IQ4_XS") at 64 values per register: one row at a time (one linear stream), every block
 * unpacked once for the KNT tokens of a tile (a row's value does not depend on the tile:
 * a batch equals its tokens bit for bit), the integer sums exact, only the float order
 * differing from the scalar reference.
 *   Q2_K, Q3_K: register k = values 64k .. 64k + 63 (sub-blocks 4k .. 4k + 3 of 16, as
 *     Q6_K's in kernels_avx512.c): the 2-bit fields of 32 qs bytes, two per register
 *     (a per-half 16-bit shift), Q3_K's hmask bit as a masked add of 4; one maddubs of the
 *     unsigned values (<= 7) with the activation bytes and one madd by the sub-block
 *     scales (vpermw of the 16 scale words); Q2_K's mins and Q3_K's zero point 4 from the
 *     activations' 16-value sums (one madd per block).
 *   IQ4_XS: register c = sub-blocks 2c, 2c + 1 (values 64c .. 64c + 63): the nibbles of 32
 *     qs bytes, low and high per 128-bit lane, looked up in the level table biased by 128
 *     (unsigned 1..241) for vpdpbusd, times the sub-block scale (vpmulld), and the bias
 *     taken out as 128 times the sub-block's activation sum times its scale; a block's
 *     sum totalled exactly into the row's one float chain. Prompts of 8 or more tokens: a
 *     16-row tile over rows rearranged per call (xs16_tile, below), the same sums. */
#include "cpu/avx512/kernels_avx512.h"
#include "types/iq4.h"
#include "cpu/prefetch.h"

#include <immintrin.h>
#include <string.h>

#define GH_INLINE static inline __attribute__((always_inline))
#define KNT GH_K2_AVX512_NT
#define K_PF_BYTES 1024 /* software prefetch distance along the row stream (as the K-quants') */

GH_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* word w of register k: sub-block 4k + w / 8 (16 values = 8 words of maddubs pairs) */
static const uint16_t K16_SC_IDX[4][32] __attribute__((aligned(64))) = {
#define E(a) a, a, a, a, a, a, a, a
    { E(0), E(1), E(2), E(3) }, { E(4), E(5), E(6), E(7) }, { E(8), E(9), E(10), E(11) },
    { E(12), E(13), E(14), E(15) },
#undef E
};

/* Q3_K's 16 scales (sc - 32, signed) as bytes from the 12 packed bytes (gh_k3_scale):
 * low nibbles of bytes 0..7 then their high nibbles; top two bits 2 (j / 4) of byte 8 + j % 4. */
GH_INLINE __m128i k3_scales(const uint8_t * p) {
    uint32_t top;
    memcpy(&top, p + 8, 4);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i l8 = _mm_loadl_epi64((const __m128i *) p);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(l8, m4), _mm_and_si128(_mm_srli_epi16(l8, 4), m4));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int) top), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

/* One Q2_K (is_q3 false) or Q3_K row against NT tokens' Q8_K rows (token t at x + t * xs):
 * y[t * ldy]. */
GH_INLINE void k2_row(const int NT, const bool is_q3, int64_t n, const uint8_t * w, const uint8_t * pf,
                      const char * x, size_t xs, float * y, int64_t ldy) {
    const size_t bs = is_q3 ? sizeof(block_q3_K) : sizeof(block_q2_K);
    __m512 acc[KNT];
    __m256 macc[KNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        acc[t] = _mm512_setzero_ps();
        macc[t] = _mm256_setzero_ps();
    }
    const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    /* register 2h: fields 0 (values 128h + 0..31) and 1 (+ 32..63) of qs[32h ..]; 2h + 1:
     * fields 2 and 3 */
    const __m512i sh_a = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t * b = w + i * bs;
        _mm_prefetch((const char *) pf + i * bs, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + 64, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + bs - 1, GH_PF_HINT);
        const uint8_t * qs = is_q3 ? ((const block_q3_K *) b)->qs : ((const block_q2_K *) b)->qs;
        __m512i v[4];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (qs + 32 * h)));
            v[2 * h] = _mm512_and_si512(_mm512_srlv_epi16(q, sh_a), m3);
            v[2 * h + 1] = _mm512_and_si512(_mm512_srlv_epi16(q, sh_b), m3);
        }
        __m256i sc16, m16 = _mm256_setzero_si256();
        float d, dmin = 0.0f;
        if (is_q3) {
            const block_q3_K * bq = (const block_q3_K *) b;
            /* bit 2k of hmask[l] is bit 2 of register k's value l, bit 2k + 1 of value 32 + l */
            const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) bq->hmask));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char) (1 << (2 * k))),
                                                        _mm256_set1_epi8((char) (1 << (2 * k + 1))), 1);
                v[k] = _mm512_mask_add_epi8(v[k], _mm512_test_epi8_mask(hm, bits), v[k], four);
            }
            sc16 = _mm256_cvtepi8_epi16(k3_scales(bq->scales));
            d = _cvtsh_ss(bq->d);
        } else {
            const block_q2_K * bq = (const block_q2_K *) b;
            const __m128i s8 = _mm_loadu_si128((const __m128i *) bq->scales), m4 = _mm_set1_epi8(0x0f);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s8, m4));
            m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), m4));
            d = _cvtsh_ss(bq->d);
            dmin = _cvtsh_ss(bq->dmin);
        }
        __m512i sc[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            sc[k] = _mm512_permutexvar_epi16(_mm512_load_si512(K16_SC_IDX[k]), _mm512_zextsi256_si512(sc16));
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512i a = _mm512_loadu_si512(yb->qs + 64 * k);
                s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(v[k], a), sc[k]));
            }
            const __m256i bsums = _mm256_loadu_si256((const __m256i *) yb->bsums);
            if (is_q3) { /* - 4 * sum_j scale_j * bsums_j */
                s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 2)));
            } else { /* the mins: - dmin * sum_j m_j * bsums_j */
                macc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * yb->d), _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, m16)),
                                          macc[t]);
            }
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * yb->d), _mm512_cvtepi32_ps(s), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = _mm512_reduce_add_ps(acc[t]) - hsum256(macc[t]);
}

/* One IQ4_XS row against NT tokens. A block's integer sum is totalled exactly and added
 * to the row's one float chain, fma(d_w d_x, total, acc), as the 16-row prompt tile
 * (xs16_tile) adds it in its row's lane: the same values in every tile. */
GH_INLINE void xs_row(const int NT, int64_t n, const uint8_t * w, const uint8_t * pf, const char * x, size_t xs,
                      float * y, int64_t ldy) {
    const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) gh_kvalues_iq4nl)),
                                           _mm512_set1_epi8((char) 0x80));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    /* 128-bit lanes: bytes 0..15, 0..15, 16..31, 16..31 of 32 qs bytes; their low nibbles
     * in lanes 0 and 2, the high ones in 1 and 3 */
    const __m512i lanes = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    const __m256i sh16 = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i shift = _mm512_inserti64x4(_mm512_castsi256_si512(sh16), sh16, 1);
    const __m256i shl = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i shh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m128 acc[KNT];
    /* blocks are totalled in pairs (one reduction for two): the even block's sum waits */
    __m512i pend[KNT];
    float pscale[KNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        acc[t] = _mm_setzero_ps();
        pend[t] = _mm512_setzero_si512();
        pscale[t] = 0.0f;
    }
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_iq4_xs * b = (const block_iq4_xs *) w + i;
        _mm_prefetch((const char *) pf + i * sizeof *b, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * sizeof *b + 64, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * sizeof *b + sizeof *b - 1, GH_PF_HINT);
        const float d = _cvtsh_ss(b->d);
        /* the eight scales ls - 32 (gh_iq4_xs_scale) as dwords */
        uint32_t sl;
        memcpy(&sl, b->scales_l, 4);
        const __m256i lo4 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int) sl), shl), _mm256_set1_epi32(15));
        const __m256i hi2 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b->scales_h), shh), _mm256_set1_epi32(3));
        const __m256i s32 = _mm256_sub_epi32(_mm256_or_si256(lo4, _mm256_slli_epi32(hi2, 4)), _mm256_set1_epi32(32));
        /* words 2ib and 2ib + 1: scale ib (|scale| <= 32), for the bias against the bsums */
        const __m256i sc16 = _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s32, 16));
        __m512i lv[4], sc[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i q = _mm512_permutexvar_epi64(lanes, _mm512_castsi256_si512(
                                                                  _mm256_loadu_si256((const __m256i *) (b->qs + 32 * c))));
            lv[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srlv_epi16(q, shift), m4));
            /* dwords of lanes 0, 1: scale 2c; of lanes 2, 3: scale 2c + 1 */
            sc[c] = _mm512_permutexvar_epi32(_mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1),
                                             _mm512_castsi256_si512(s32));
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[c], _mm512_loadu_si512(yb->qs + 64 * c));
                s = _mm512_add_epi32(s, _mm512_mullo_epi32(dp, sc[c]));
            }
            /* - 128 * sum_ib scale_ib * (the sub-block's activation sum) */
            const __m256i z = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) yb->bsums), sc16);
            s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(_mm256_slli_epi32(z, 7)));
            /* the block's exact total into the row's one chain (xs16_tile's order) */
            if (i % 2 == 0) {
                pend[t] = s;
                pscale[t] = d * yb->d;
                continue;
            }
            /* totals of the pending block (lane 0) and this one (lane 1) */
            const __m512i r1 = _mm512_add_epi32(_mm512_unpacklo_epi32(pend[t], s), _mm512_unpackhi_epi32(pend[t], s));
            const __m512i r2 = _mm512_add_epi32(r1, _mm512_shuffle_epi32(r1, _MM_PERM_BADC));
            const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(r2), _mm512_extracti64x4_epi64(r2, 1));
            const __m128 f = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
            acc[t] = _mm_fmadd_ss(_mm_set_ss(pscale[t]), f, acc[t]);
            acc[t] = _mm_fmadd_ss(_mm_set_ss(d * yb->d), _mm_movehdup_ps(f), acc[t]);
        }
    }
    if ((n / QK_K) % 2) {
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            acc[t] = _mm_fmadd_ss(_mm_set_ss(pscale[t]), _mm_cvtsi32_ss(_mm_setzero_ps(), _mm512_reduce_add_epi32(pend[t])),
                                  acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = _mm_cvtss_f32(acc[t]);
}

enum { K_Q2, K_Q3, K_XS };

GH_INLINE void k_row(const int NT, const int kind, int64_t n, const uint8_t * w, const uint8_t * pf,
                     const char * x, size_t xs, float * y, int64_t ldy) {
    if (kind == K_XS) xs_row(NT, n, w, pf, x, xs, y, ldy);
    else k2_row(NT, kind == K_Q3, n, w, pf, x, xs, y, ldy);
}

#include "cpu/kq_driver.h"

/* (exported: kernels_avx512.c's dot table names them) */
#define DEFINE_K(sfx, KIND) \
    KQ_DEFINE(, gh_avx512_gemm_##sfx, gh_avx512_vec_dot_##sfx, gh_avx512_dot4_##sfx, KIND)

DEFINE_K(q2_K, K_Q2)
DEFINE_K(q3_K, K_Q3)
/* IQ4_XS: decode, gathered rows and prompts under XS16_MIN_T tokens run the row pass */
static void gemm_xs_rows(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt, float * y,
                         int64_t ldy) {
    gemm_k(K_XS, n, w, ws, nr, x, xs, nt, y, ldy);
}
void gh_avx512_vec_dot_iq4_xs(int64_t n, float * s, const void * w, const void * x) {
    gemm_k(K_XS, n, w, 0, 1, x, 0, 1, s, 1);
}
void gh_avx512_dot4_iq4_xs(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_k(K_XS, n, rows, pf, x, y);
}

/* ------------------------------------------------------------------ IQ4_XS prompts */

/* IQ4_XS's prompt tile: 16 rows x up to GH_NL16_AVX512_NT tokens, the activations
 * broadcast (kernels_b32_avx512.c's IQ4_NL tile with 256-value blocks). The row pass
 * above unpacks a block for 4 tokens and multiplies 64 values of a row per vpdpbusd;
 * here a chunk of the 16 rows' blocks is rearranged once per call into an L1 buffer
 * (xs16_block: step k of sub-block j holds each row's levels + 128 of values
 * 32j + 4k .. + 3 in its lane), and every token's 4-byte activation groups are broadcast
 * into vpdpbusd against it: lane r of a sub-block's sum is row r's, scaled by the row's
 * sub-block scale (vpmulld), the bias out as 128 times the sub-block's activation sum.
 * A block's exact total goes into the row's chain as xs_row adds it: the same values. */
#define XS16_T 4
#define XS16_CB 4 /* blocks per rearranged chunk (17 KB of buffer) */
#define XS16_MIN_T 8

typedef struct {
    __m512i q[8][8]; /* sub-block j, step k: lane r = row r's levels + 128 of values 32j + 4k.. */
    __m512i sc[8];   /* lane r: row r's scale of sub-block j (ls - 32) */
    __m512  d;       /* lane r: row r's d */
} xs16_block;

static void xs16_rearrange(const uint8_t * w, __m512i off, int64_t b0, int nbk, xs16_block * buf) {
    const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) gh_kvalues_iq4nl)),
                                           _mm512_set1_epi8((char) 0x80));
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi32(3), m15 = _mm512_set1_epi32(15);
    for (int j = 0; j < nbk; j++) {
        const uint8_t * p = w + (b0 + j) * sizeof(block_iq4_xs);
        const __m512i dh = _mm512_i32gather_epi32(off, p, 1);     /* d | scales_h << 16 */
        const __m512i sl = _mm512_i32gather_epi32(off, p + 4, 1); /* scales_l */
        buf[j].d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh));
        const __m512i sh = _mm512_srli_epi32(dh, 16);
#pragma GCC unroll 8
        for (int ib = 0; ib < 8; ib++) { /* gh_iq4_xs_scale */
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * ib), m15);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(sh, 2 * ib), m3);
            buf[j].sc[ib] = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
        }
#pragma GCC unroll 8
        for (int ib = 0; ib < 8; ib++) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) { /* qs bytes 16 ib + 4k..: values 4k.. (low nibbles), 16 + 4k.. (high) */
                const __m512i q = _mm512_i32gather_epi32(off, p + offsetof(block_iq4_xs, qs) + 16 * ib + 4 * k, 1);
                buf[j].q[ib][k] = _mm512_shuffle_epi8(table, _mm512_and_si512(q, m4));
                buf[j].q[ib][4 + k] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
            }
        }
    }
}

/* TT tokens (token t's Q8_K row at x + t * xs) over nbk rearranged blocks from block b0. */
GH_INLINE void xs16_pass(const int TT, const xs16_block * buf, int64_t b0, int nbk, const char * x, size_t xs,
                         __m512 * acc) {
    __m512 a[XS16_T];
#pragma GCC unroll 4
    for (int t = 0; t < TT; t++) a[t] = acc[t];
    for (int j = 0; j < nbk; j++) {
        const xs16_block * B = buf + j;
        __m512i tot[XS16_T];
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) tot[t] = _mm512_setzero_si512();
        for (int ib = 0; ib < 8; ib++) {
            __m512i s[XS16_T];
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++) {
                const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + b0 + j;
                s[t] = _mm512_set1_epi32(-128 * ((int) yb->bsums[2 * ib] + yb->bsums[2 * ib + 1]));
            }
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i wq = B->q[ib][k];
#pragma GCC unroll 4
                for (int t = 0; t < TT; t++) {
                    const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + b0 + j;
                    int32_t v;
                    memcpy(&v, yb->qs + 32 * ib + 4 * k, 4);
                    s[t] = _mm512_dpbusd_epi32(s[t], wq, _mm512_set1_epi32(v));
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++) tot[t] = _mm512_add_epi32(tot[t], _mm512_mullo_epi32(s[t], B->sc[ib]));
        }
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + b0 + j;
            a[t] = _mm512_fmadd_ps(_mm512_mul_ps(B->d, _mm512_set1_ps(yb->d)), _mm512_cvtepi32_ps(tot[t]), a[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TT; t++) acc[t] = a[t];
}

static void xs16_tile(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt, float * y,
                      int64_t ldy) {
    _Alignas(64) xs16_block buf[XS16_CB];
    _Alignas(64) __m512 acc[GH_NL16_AVX512_NT];
    int32_t offs[GH_NL16_AVX512_MR];
    for (int r = 0; r < GH_NL16_AVX512_MR; r++) offs[r] = (int32_t) ((size_t) GH_MIN(r, nr - 1) * ws);
    const __m512i off = _mm512_loadu_si512(offs);
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    const int64_t nb = n / QK_K;
    for (int64_t b0 = 0; b0 < nb; b0 += XS16_CB) {
        const int nbk = (int) GH_MIN(XS16_CB, nb - b0);
        xs16_rearrange(w, off, b0, nbk, buf);
        int t = 0;
        for (; t + XS16_T <= nt; t += XS16_T) xs16_pass(XS16_T, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t);
        switch (nt - t) {
            case 1: xs16_pass(1, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            case 2: xs16_pass(2, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            case 3: xs16_pass(3, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            default: break;
        }
    }
    for (int t = 0; t < nt; t++) {
        _Alignas(64) float o[GH_NL16_AVX512_MR];
        _mm512_store_ps(o, acc[t]);
        memcpy(y + t * ldy, o, (size_t) nr * sizeof(float));
    }
}

/* Prompts of at least XS16_MIN_T tokens: the 16-row tile; fewer: the row pass. */
void gh_avx512_gemm_iq4_xs(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                           float * y, int64_t ldy) {
    if (nt >= XS16_MIN_T) xs16_tile(n, w, ws, nr, x, xs, nt, y, ldy);
    else gemm_xs_rows(n, w, ws, nr, x, xs, nt, y, ldy);
}
