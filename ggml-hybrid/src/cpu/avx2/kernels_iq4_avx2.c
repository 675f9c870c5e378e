/* AVX2 dot kernels of the non-linear 4-bit types (types/iq4.h); their rows are in the
 * AVX2 dot table (kernels_avx2.c, which also gives them its Q8_X4 / Q8_K activation
 * conversions). AVX-512 has rows of its own for them (avx512/kernels_b32_avx512.c,
 * avx512/kernels_k2_avx512.c).
 *
 * Every level is an int8, so the nibbles are looked up in the 16-byte level table with
 * one vpshufb per 32 values and the dot is Q8_0's: maddubs of |level| with
 * sign(level) * x (|pair sums| <= 2 * 127 * 127, no int16 overflow), madd by 1 (or by the
 * sub-block scale).
 *
 *   IQ4_NL, MXFP4 x Q8_X4: four rows at a time for any number of tokens, as Q4_0's tiles
 *     (kernels_avx2.c): a 256-bit register holds two blocks, the four rows' int32 sums
 *     are transposed into one register (lane 4i + r: block i, row r) and scaled once
 *     (IQ4_NL: fp16 d; MXFP4: 2^(e - 128) from the e8m0 byte), short tiles repeat their
 *     last row so a row's value does not depend on its tile. IQ4_NL prompts of 8 or more
 *     tokens: an 8-row tile over rows rearranged per call (nl8_tile), the same sums.
 *   IQ4_XS x Q8_K: one row at a time (one linear stream), each 256-value block's levels
 *     looked up once for up to KNT tokens, the signed 6-bit scales through madd (xs_row).
 * The four-row and IQ4_XS prompt shapes take GH_IQ4_AVX2_NT tokens (iq4_avx2.h). */
#include "cpu/avx2/iq4_avx2.h"
#include "cpu/prefetch.h"

#include <immintrin.h>
#include <string.h>

#define GH_INLINE static inline __attribute__((always_inline))
#define QNT GH_IQ4_AVX2_NT  /* most tokens of a prompt tile (MXFP4's table entry: 6) */
#define KNT GH_IQ4_AVX2_NT  /* tokens of an IQ4_XS row pass */
#define K_PF_BYTES 1024

enum { IQ_NL, IQ_MX };

GH_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

GH_INLINE __m256i level_table(const int kind) {
    const int8_t * k = kind == IQ_MX ? gh_kvalues_mxfp4 : gh_kvalues_iq4nl;
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) k));
}

/* ------------------------------------------------------------------ IQ4_NL, MXFP4 x Q8_X4 */

GH_INLINE size_t block_bytes(const int kind) { return kind == IQ_MX ? sizeof(block_mxfp4) : sizeof(block_iq4_nl); }

/* Two consecutive blocks of a row as levels: values 0..15 (sa) and 16..31 (sb) of each
 * block (lane i: block i), and their magnitudes (a, b). */
typedef struct {
    __m256i a, b, sa, sb;
} lpair;

GH_INLINE lpair unpack_pair(const int kind, const int mags, __m256i table, const uint8_t * p) {
    const size_t bs = block_bytes(kind), off = bs - 16; /* qs are the last 16 bytes */
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) (p + off))),
                                              _mm_loadu_si128((const __m128i *) (p + bs + off)), 1);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    lpair u;
    u.sa = _mm256_shuffle_epi8(table, _mm256_and_si256(q, m4));
    u.sb = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
    if (mags) {
        u.a = _mm256_abs_epi8(u.sa);
        u.b = _mm256_abs_epi8(u.sb);
    }
    return u;
}

/* The same dot with the activations' magnitudes as maddubs' unsigned side (ax, cx: |xa|,
 * |xc|, once per token for the four rows) and the levels signed by them: the same pair
 * products l x, so the same sums bit for bit. A decode tile (one token) takes it: it
 * drops the rows' magnitudes (8 vpabsb per pair of blocks) for the token's (2). */
GH_INLINE __m256i pair_dot_x(const int kind, const lpair * u, __m256i xa, __m256i xc, __m256i ax, __m256i cx) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i pa = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(u->sa, xa));
    const __m256i pb = _mm256_maddubs_epi16(cx, _mm256_sign_epi8(u->sb, xc));
    if (kind == IQ_MX) return _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones);
    return _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones));
}

/* int32 lanes 0..3 sum to block 0's dot, 4..7 to block 1's. IQ4_NL widens each maddubs
 * on its own (two of its sums, up to 2 * 127 * 127 each, would overflow an int16);
 * MXFP4's levels (|l| <= 12) let the two add as int16 first (<= 4 * 12 * 127). */
GH_INLINE __m256i pair_dot(const int kind, const lpair * u, __m256i xa, __m256i xc) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i pa = _mm256_maddubs_epi16(u->a, _mm256_sign_epi8(xa, u->sa));
    const __m256i pb = _mm256_maddubs_epi16(u->b, _mm256_sign_epi8(xc, u->sb));
    if (kind == IQ_MX) return _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones);
    return _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones));
}

/* Lanes 4i + r = the sum of lanes 4i..4i+3 of s_r. */
GH_INLINE __m256i transpose_sum4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
    const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(s0, s1), _mm256_unpackhi_epi32(s0, s1));
    const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(s2, s3), _mm256_unpackhi_epi32(s2, s3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

/* dw[h], lane 4i + r: row r's scale of block 2h + i of the group at p[r], for h < nh (the
 * blocks past 2 nh are not read). */
GH_INLINE void scales_r4(const int kind, const uint8_t * const * p, const int nh, __m256 dw[2]) {
    const size_t bs = block_bytes(kind);
    if (kind == IQ_NL) {
        uint16_t d[4][4];
        for (int r = 0; r < 4; r++)
            for (int k = 0; k < 2 * nh; k++) memcpy(&d[r][k], p[r] + k * bs, 2);
        for (int h = 0; h < nh; h++) {
            const __m128i v = _mm_setr_epi16((short) d[0][2 * h], (short) d[1][2 * h], (short) d[2][2 * h],
                                             (short) d[3][2 * h], (short) d[0][2 * h + 1], (short) d[1][2 * h + 1],
                                             (short) d[2][2 * h + 1], (short) d[3][2 * h + 1]);
            dw[h] = _mm256_cvtph_ps(v);
        }
        return;
    }
    /* e8m0: 2^(e - 128), e < 2 the subnormals 0x00200000 << e (gh_e8m0_to_fp32_half) */
    for (int h = 0; h < nh; h++) {
        const __m256i e = _mm256_setr_epi32(p[0][2 * h * bs], p[1][2 * h * bs], p[2][2 * h * bs], p[3][2 * h * bs],
                                            p[0][(2 * h + 1) * bs], p[1][(2 * h + 1) * bs], p[2][(2 * h + 1) * bs],
                                            p[3][(2 * h + 1) * bs]);
        const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        dw[h] = _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, is_small));
    }
}

/* One group of four blocks of the rows p[0..4) against NT tokens' Q8_X4 groups: its first
 * nh pairs of blocks (2: all; a row's last group may have 1). */
GH_INLINE void group_r4(const int NT, const int kind, const uint8_t * const * p, const char * xg,
                        size_t xs, __m256 * acc, const int nh) {
    const size_t bs = block_bytes(kind);
    const __m256i table = level_table(kind);
    __m256 dw[2];
    scales_r4(kind, p, nh, dw);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        if (h >= nh) break;
        lpair u[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) u[r] = unpack_pair(kind, NT > 1, table, p[r] + 2 * h * bs);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const block_q8_x4 * x = (const block_q8_x4 *) (xg + t * xs);
            const __m256i xa = _mm256_loadu_si256((const __m256i *) (x->qa + 32 * h));
            const __m256i xc = _mm256_loadu_si256((const __m256i *) (x->qb + 32 * h));
            __m256i s;
            if (NT == 1) {
                const __m256i ax = _mm256_abs_epi8(xa), cx = _mm256_abs_epi8(xc);
                s = transpose_sum4(pair_dot_x(kind, &u[0], xa, xc, ax, cx), pair_dot_x(kind, &u[1], xa, xc, ax, cx),
                                   pair_dot_x(kind, &u[2], xa, xc, ax, cx), pair_dot_x(kind, &u[3], xa, xc, ax, cx));
            } else {
                s = transpose_sum4(pair_dot(kind, &u[0], xa, xc), pair_dot(kind, &u[1], xa, xc),
                                   pair_dot(kind, &u[2], xa, xc), pair_dot(kind, &u[3], xa, xc));
            }
            const __m256 scale = _mm256_mul_ps(dw[h], _mm256_loadu_ps(x->d + 8 * h));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[t]);
        }
    }
}

/* y[t][r] = rows[r] . X[t] for NT tokens; a zero block adds 0 (its levels are 0 (MXFP4) or
 * its scale is (IQ4_NL)). */
GH_INLINE void tile_r4(const int NT, const int kind, const int pfm, int64_t n, const uint8_t * const * rows,
                       const void * const * pf, const void * x, size_t xs, float (*y)[4]) {
    __m256 acc[QNT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    const int64_t nb = n / 32, ng_full = nb / 4;
    const size_t gb = 4 * block_bytes(kind);
    const char * xb = x;
    const char * pl = pfm == PF_LINEAR ? pf[0] : NULL;
    for (int64_t g = 0; g < ng_full; g++) {
        if (pfm == PF_LINEAR) {
#pragma GCC unroll 8
            for (size_t k = 0; k < 4 * gb; k += 64) _mm_prefetch(pl + k, GH_PF_HINT);
            pl += 4 * gb;
        } else if (pfm == PF_ROWS) {
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const char * q = (const char *) pf[r] + g * gb;
                _mm_prefetch(q, GH_PF_HINT);
                _mm_prefetch(q + gb - 1, GH_PF_HINT);
            }
        }
        const uint8_t * p[4] = { rows[0] + g * gb, rows[1] + g * gb, rows[2] + g * gb, rows[3] + g * gb };
        group_r4(NT, kind, p, xb + g * sizeof(block_q8_x4), xs, acc, 2);
    }
    /* A row's last 1..3 blocks: the pairs that hold them (a pair of zero blocks would add
     * +0 to sums that start at +0 and so are never -0: skipping it changes no bit); an odd
     * block is paired with a zeroed copy. */
    if (nb % 4) {
        const int64_t g = ng_full;
        const int nv = (int) (nb % 4), nh = (nv + 1) / 2;
        const size_t bs = block_bytes(kind);
        gh_tail_prefetch(pfm, pl, pf, g * gb, (size_t) nv * bs);
        const uint8_t * tp[4] = { rows[0] + g * gb, rows[1] + g * gb, rows[2] + g * gb, rows[3] + g * gb };
        _Alignas(32) uint8_t tb[4][4 * sizeof(block_iq4_nl)];
        if (nv % 2) {
            for (int r = 0; r < 4; r++) {
                memcpy(tb[r], tp[r], (size_t) nv * bs);
                memset(tb[r] + nv * bs, 0, bs);
                tp[r] = tb[r];
            }
        }
        group_r4(NT, kind, tp, xb + g * sizeof(block_q8_x4), xs, acc, nh);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        _mm_storeu_ps(y[t], _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1)));
    }
}

GH_INLINE void gemm_r4(const int kind, int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs,
                       int nt, float * y, int64_t ldy) {
    const uint8_t * rows[4];
    for (int r = 0; r < 4; r++) rows[r] = (const uint8_t *) w + (size_t) GH_MIN(r, nr - 1) * ws;
    float out[QNT][4];
    if (nt == 1) { /* decode: prefetch the tile GH_PF_TILES ahead as one stream */
        const void * pf[1] = { (const uint8_t *) w + GH_PF_TILES * 4 * ws };
        tile_r4(1, kind, PF_LINEAR, n, rows, pf, x, xs, out);
        for (int r = 0; r < nr; r++) y[r] = out[0][r];
        return;
    }
    for (int t = 0; t < nt; t += QNT) {
        const char * xt = (const char *) x + t * xs;
        const int tn = GH_MIN(QNT, nt - t);
        switch (tn) {
            case 1: tile_r4(1, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 2: tile_r4(2, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 3: tile_r4(3, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 4: tile_r4(4, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 5: tile_r4(5, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 6: tile_r4(6, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 7: tile_r4(7, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            default: tile_r4(8, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
        }
        for (int k = 0; k < tn; k++)
            for (int r = 0; r < nr; r++) y[(t + k) * ldy + r] = out[k][r];
    }
}

#define DEFINE_R4(sfx, KIND)                                                                        \
    void gh_avx2_gemm_##sfx(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                            int nt, float * y, int64_t ldy) {                                       \
        gemm_r4(KIND, n, w, ws, nr, x, xs, nt, y, ldy);                                            \
    }                                                                                               \
    void gh_avx2_vec_dot_##sfx(int64_t n, float * s, const void * w, const void * x) {             \
        gemm_r4(KIND, n, w, 0, 1, x, 0, 1, s, 1);                                                   \
    }                                                                                               \
    void gh_avx2_dot4_##sfx(int64_t n, const void * const * rows, const void * const * pf,          \
                            const void * x, float * y) {                                            \
        tile_r4(1, KIND, PF_ROWS, n, (const uint8_t * const *) rows, pf, x, 0, (float (*)[4]) y);   \
    }

DEFINE_R4(mxfp4, IQ_MX)

/* ------------------------------------------------------------------ IQ4_NL prompts */

/* IQ4_NL's prompt tile: 8 rows x up to GH_NL8_AVX2_NT tokens, the activations broadcast
 * (avx512/kernels_b32_avx512.c's 16-row tile at AVX2 width). The four-row tile above
 * transposes four rows' int32 sums per token and pair of blocks, and its 16 registers of
 * unpacked levels leave none for the token loop (it spills). Here a chunk of the 8 rows'
 * blocks is rearranged once per call into an L1 buffer (nl8_block: step k holds each
 * row's levels of values 4k..4k+3, and their magnitudes, in lane r), and every token's
 * 4-byte activation groups are broadcast against it: sign, maddubs, madd per step, lane r
 * the row's sum, nothing moved between lanes.
 *
 * The sums are the four-row tile's bit for bit (decode, gathered rows and short prompts
 * still run it): the same exact integer per block and row, scaled by the same product
 * (row scale x activation scale), added into two chains per row by block parity (the
 * four-row tile's lanes 4i + r), y = c0 + c1, and a row's blocks past the last padded to a
 * group of four with zero-scale blocks as its tail does. */
#define NL8_T 4    /* tokens per register pass */
#define NL8_CB 32  /* blocks per rearranged chunk (17 KB of buffer), a multiple of 4 */
#define NL8_MIN_T 12 /* fewer tokens: the four-row tile (8 tokens ran 1.1x its time, 16 0.95-0.97x) */

typedef struct {
    __m256i q[8];  /* step k: lane r = row r's levels of values 4k..4k+3 */
    __m256i aq[8]; /* their magnitudes */
    __m256  d;     /* lane r: row r's scale */
} nl8_block;

static void nl8_rearrange(const uint8_t * w, const int32_t * offs, int64_t b0, int nbk, int64_t nb, nl8_block * buf) {
    const __m256i table = level_table(IQ_NL), m4 = _mm256_set1_epi8(0x0f);
    const __m256i off = _mm256_loadu_si256((const __m256i *) offs);
    for (int j = 0; j < nbk; j++) {
        const int64_t b = b0 + j;
        if (b >= nb) {
            memset(&buf[j], 0, sizeof buf[j]);
            continue;
        }
        const uint8_t * p = w + b * sizeof(block_iq4_nl);
        uint16_t d[GH_NL8_AVX2_MR];
        for (int r = 0; r < GH_NL8_AVX2_MR; r++) memcpy(&d[r], p + offs[r], 2);
        buf[j].d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) d));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) { /* qs bytes 4k..4k+3: values 4k.. (low nibbles), 16 + 4k.. (high) */
            const __m256i q = _mm256_i32gather_epi32((const int *) (p + 2 + 4 * k), off, 1);
            const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, m4));
            const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
            buf[j].q[k] = lo;
            buf[j].q[4 + k] = hi;
            buf[j].aq[k] = _mm256_abs_epi8(lo);
            buf[j].aq[4 + k] = _mm256_abs_epi8(hi);
        }
    }
}

/* TT tokens over nbk rearranged blocks from block b0 (a multiple of 4): acc[t][i] += the
 * blocks of parity i. */
GH_INLINE void nl8_pass(const int TT, const nl8_block * buf, int64_t b0, int nbk, const char * x, size_t xs,
                        __m256 (*acc)[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < nbk; j += 4) {
        const size_t go = (size_t) ((b0 + j) / 4) * sizeof(block_q8_x4);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const nl8_block * B = buf + j + i;
            __m256i s[NL8_T];
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++) s[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i aw = B->aq[k];
#pragma GCC unroll 4
                for (int t = 0; t < TT; t++) {
                    const block_q8_x4 * xb = (const block_q8_x4 *) (x + t * xs + go);
                    int32_t v;
                    memcpy(&v, (k < 4 ? xb->qa : xb->qb) + 16 * i + 4 * (k & 3), 4);
                    const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(v), B->q[k]);
                    s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++) {
                const block_q8_x4 * xb = (const block_q8_x4 *) (x + t * xs + go);
                acc[t][i & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]),
                                                _mm256_mul_ps(B->d, _mm256_set1_ps(xb->d[4 * i])), acc[t][i & 1]);
            }
        }
    }
}

static void nl8_tile(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt, float * y,
                     int64_t ldy) {
    _Alignas(32) nl8_block buf[NL8_CB];
    _Alignas(32) __m256 acc[GH_NL8_AVX2_NT][2];
    int32_t offs[GH_NL8_AVX2_MR];
    for (int r = 0; r < GH_NL8_AVX2_MR; r++) offs[r] = (int32_t) ((size_t) GH_MIN(r, nr - 1) * ws);
    for (int t = 0; t < nt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const int64_t nb = n / 32, nbp = (nb + 3) / 4 * 4;
    for (int64_t b0 = 0; b0 < nbp; b0 += NL8_CB) {
        const int nbk = (int) GH_MIN(NL8_CB, nbp - b0);
        nl8_rearrange(w, offs, b0, nbk, nb, buf);
        int t = 0;
        for (; t + NL8_T <= nt; t += NL8_T) nl8_pass(NL8_T, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t);
        switch (nt - t) {
            case 1: nl8_pass(1, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            case 2: nl8_pass(2, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            case 3: nl8_pass(3, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            default: break;
        }
    }
    for (int t = 0; t < nt; t++) {
        _Alignas(32) float o[GH_NL8_AVX2_MR];
        _mm256_store_ps(o, _mm256_add_ps(acc[t][0], acc[t][1]));
        memcpy(y + t * ldy, o, (size_t) nr * sizeof(float));
    }
}

/* Prompts of at least NL8_MIN_T tokens: the 8-row tile; fewer (and decode): the four-row
 * tile, four rows at a time (the same sums). */
void gh_avx2_gemm_iq4_nl(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                         float * y, int64_t ldy) {
    if (nt >= NL8_MIN_T) {
        nl8_tile(n, w, ws, nr, x, xs, nt, y, ldy);
        return;
    }
    for (int r = 0; r < nr; r += 4)
        gemm_r4(IQ_NL, n, (const uint8_t *) w + (size_t) r * ws, ws, GH_MIN(4, nr - r), x, xs, nt, y + r, ldy);
}
void gh_avx2_vec_dot_iq4_nl(int64_t n, float * s, const void * w, const void * x) {
    gemm_r4(IQ_NL, n, w, 0, 1, x, 0, 1, s, 1);
}
void gh_avx2_dot4_iq4_nl(int64_t n, const void * const * rows, const void * const * pf, const void * x,
                         float * y) {
    tile_r4(1, IQ_NL, PF_ROWS, n, (const uint8_t * const *) rows, pf, x, 0, (float (*)[4]) y);
}

/* ------------------------------------------------------------------ IQ4_XS x Q8_K */

/* One IQ4_XS row against NT tokens' Q8_K rows (token t at x + t * xs): y[t * ldy]. A
 * 32-byte load of the nibbles of sub-blocks 2c, 2c + 1 looks up, per 128-bit lane, one
 * sub-block's values 0..15 (lo) and 16..31 (hi); the activations are loaded in the same
 * arrangement (two 16-byte halves), so one scale vector (sub-block 2c's scale in the low
 * lane, 2c + 1's in the high) serves both: no cross-lane shuffle of the weights, 4 scale
 * shuffles per block. */
GH_INLINE __m256i load_halves(const int8_t * lo, const int8_t * hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) lo)),
                                   _mm_loadu_si128((const __m128i *) hi), 1);
}

GH_INLINE void xs_row(const int NT, int64_t n, const uint8_t * w, const uint8_t * pf, const char * x, size_t xs,
                      float * y, int64_t ldy) {
    const __m256i table = level_table(IQ_NL), m4 = _mm256_set1_epi8(0x0f);
    const __m256i shl = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i shh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m256 acc[KNT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_iq4_xs * b = (const block_iq4_xs *) w + i;
        _mm_prefetch((const char *) pf + i * sizeof *b, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * sizeof *b + 64, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * sizeof *b + sizeof *b - 1, GH_PF_HINT);
        const float d = _cvtsh_ss(b->d);
        /* the eight scales ls - 32 (gh_iq4_xs_scale) as words, then per pair c a vector
         * of sub-block 2c's scale (low lane) and 2c + 1's (high lane) */
        uint32_t sl;
        memcpy(&sl, b->scales_l, 4);
        const __m256i lo4 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int) sl), shl), _mm256_set1_epi32(15));
        const __m256i hi2 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b->scales_h), shh), _mm256_set1_epi32(3));
        const __m256i s32 = _mm256_sub_epi32(_mm256_or_si256(lo4, _mm256_slli_epi32(hi2, 4)), _mm256_set1_epi32(32));
        const __m256i s16 = _mm256_broadcastsi128_si256(
            _mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1)));
        __m256i lo[4], hi[4], alo[4], ahi[4], sc[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const char k = (char) (4 * c);
            sc[c] = _mm256_shuffle_epi8(s16, _mm256_setr_epi8(k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1,
                                                              k, k + 1, k, k + 1, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3,
                                                              k + 2, k + 3, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3,
                                                              k + 2, k + 3));
            const __m256i q = _mm256_loadu_si256((const __m256i *) (b->qs + 32 * c));
            lo[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(q, m4));
            hi[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
            alo[c] = _mm256_abs_epi8(lo[c]);
            ahi[c] = _mm256_abs_epi8(hi[c]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const int8_t * q8 = yb->qs + 64 * c;
                const __m256i xl = load_halves(q8, q8 + 32), xh = load_halves(q8 + 16, q8 + 48);
                const __m256i pl = _mm256_maddubs_epi16(alo[c], _mm256_sign_epi8(xl, lo[c]));
                const __m256i ph = _mm256_maddubs_epi16(ahi[c], _mm256_sign_epi8(xh, hi[c]));
                s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(pl, sc[c]), _mm256_madd_epi16(ph, sc[c])));
            }
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * yb->d), _mm256_cvtepi32_ps(s), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum(acc[t]);
}

GH_INLINE void xs_rows(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                       float * y, int64_t ldy) {
    for (int r = 0; r < nr; r++) {
        const uint8_t * wr = (const uint8_t *) w + r * ws;
        for (int t = 0; t < nt; t += KNT) {
            const char * xt = (const char *) x + t * xs;
            float * yt = y + t * ldy + r;
            switch (GH_MIN(KNT, nt - t)) {
                case 1: xs_row(1, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 2: xs_row(2, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 3: xs_row(3, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 4: xs_row(4, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 5: xs_row(5, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 6: xs_row(6, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                case 7: xs_row(7, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
                default: xs_row(8, n, wr, wr + K_PF_BYTES, xt, xs, yt, ldy); break;
            }
        }
    }
}

void gh_avx2_gemm_iq4_xs(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                         float * y, int64_t ldy) {
    xs_rows(n, w, ws, nr, x, xs, nt, y, ldy);
}

void gh_avx2_vec_dot_iq4_xs(int64_t n, float * s, const void * w, const void * x) {
    xs_rows(n, w, 0, 1, x, 0, 1, s, 1);
}

/* Four gathered rows: each the one-row sum of the dense decode. */
void gh_avx2_dot4_iq4_xs(int64_t n, const void * const * rows, const void * const * pf, const void * x,
                         float * y) {
    for (int r = 0; r < 4; r++) xs_row(1, n, rows[r], pf[r], x, 0, y + r, 1);
}
