/* AVX-512 (VNNI, VBMI) dot kernels of Q4_1, Q5_0, Q5_1, IQ4_NL and MXFP4 against Q8_X4;
 * their rows are in the AVX-512 dot table (kernels_avx512.c). Q4_0 and Q8_0 keep their
 * own tiles there.
 *
 * One body over the block kind (a constant at every call: its branches fold away). The
 * four blocks of a row's group are gathered from their 17..24-byte blocks into one
 * register with one vpermt2b (lane i: block i's 16 quant bytes, the last 16 bytes of every
 * block) and split into unsigned bytes of values 0..15 (lo) and 16..31 (hi) of each block,
 * the operands of vpdpbusd against the activation bytes:
 *   Q4_1: the nibbles; its min (x = d q + m) meets the activation block sum in float, as
 *     the AVX2 tile does (m d_x sum(a) = -m d_x nsum);
 *   Q5_0, Q5_1: the nibble plus 16 where the qh word's bit is set (a masked byte add);
 *     Q5_0's zero point 16 is 16 times the activation block sum (Q8_X4 carries it), Q5_1's
 *     min as Q4_1's;
 *   IQ4_NL, MXFP4: the level + 128 (one vpshufb of the biased level table: 1..241 and
 *     116..140, unsigned), the bias 128 times the block sum (Q8_0's trick in
 *     kernels_avx512.c); scales fp16 d, MXFP4's e8m0 2^(e - 128).
 * Four rows at a time for any number of tokens, as the AVX2 tiles (kernels_avx2.c): the
 * four rows' int32 sums are transposed into one register (lane 4i + r: block i, row r)
 * before they are converted and scaled, and a short tile repeats its last row, so a row's
 * value is the same in a decode tile, a prompt tile of any width and a gathered tile
 * (dot4): a batch equals its tokens bit for bit. IQ4_NL prompts of 8 or more tokens run a
 * 16-row tile over rows rearranged per call instead (nl16_tile, below), the same sums. The integer sums are exact (|sum| <=
 * 32 * 255 * 127 per block); only the float order differs from the scalar reference. */
#include "cpu/avx512/kernels_avx512.h"
#include "types/iq4.h"

#include "cpu/prefetch.h"

#include <immintrin.h>
#include <string.h>

#define GH_INLINE static inline __attribute__((always_inline))
#define NT_MAX GH_B32_AVX512_NT

enum { B_Q4_1, B_Q5_0, B_Q5_1, B_IQ4_NL, B_MXFP4 };

GH_INLINE size_t b_bytes(const int kind) {
    switch (kind) {
        case B_Q4_1:   return sizeof(block_q4_1);
        case B_Q5_0:   return sizeof(block_q5_0);
        case B_Q5_1:   return sizeof(block_q5_1);
        case B_IQ4_NL: return sizeof(block_iq4_nl);
        default:       return sizeof(block_mxfp4);
    }
}
GH_INLINE bool b_has_min(const int kind) { return kind == B_Q4_1 || kind == B_Q5_1; }
GH_INLINE bool b_is_q5(const int kind) { return kind == B_Q5_0 || kind == B_Q5_1; }
GH_INLINE bool b_is_iq(const int kind) { return kind == B_IQ4_NL || kind == B_MXFP4; }
GH_INLINE size_t b_qh(const int kind) { return kind == B_Q5_1 ? offsetof(block_q5_1, qh) : offsetof(block_q5_0, qh); }
/* log2 of the multiple of the activation block sum to add back: Q5_0's zero point 16, the
 * level bias 128 of the IQ kinds; 0: none */
GH_INLINE int b_corr_shift(const int kind) { return kind == B_Q5_0 ? 4 : b_is_iq(kind) ? 7 : 0; }
GH_STATIC_ASSERT(offsetof(block_q4_1, m) == 2 && offsetof(block_q5_1, m) == 2, "min after d");
GH_STATIC_ASSERT(offsetof(block_q4_1, qs) == 4 && offsetof(block_q5_0, qs) == 6 && offsetof(block_q5_1, qs) == 8 &&
                 offsetof(block_iq4_nl, qs) == 2 && offsetof(block_mxfp4, qs) == 1, "qs: the last 16 bytes");

/* byte 16i + j of a gathered group: quant byte j of block i, at i bs + bs - 16 + j */
#define I16(b) (b), (b) + 1, (b) + 2, (b) + 3, (b) + 4, (b) + 5, (b) + 6, (b) + 7, (b) + 8, (b) + 9, \
               (b) + 10, (b) + 11, (b) + 12, (b) + 13, (b) + 14, (b) + 15
#define QS_IDX(bs) { I16((bs) - 16), I16(2 * (bs) - 16), I16(3 * (bs) - 16), I16(4 * (bs) - 16) }
static const uint8_t QS_IDX_TABLE[5][64] __attribute__((aligned(64))) = {
    [B_Q4_1] = QS_IDX(20), [B_Q5_0] = QS_IDX(22), [B_Q5_1] = QS_IDX(24), [B_IQ4_NL] = QS_IDX(18),
    [B_MXFP4] = QS_IDX(17),
};
#undef QS_IDX
#undef I16

/* The IQ kinds' levels + 128 (as bytes, unsigned), in every 128-bit lane. */
GH_INLINE __m512i level_table(const int kind) {
    if (!b_is_iq(kind)) return _mm512_setzero_si512();
    const int8_t * k = kind == B_MXFP4 ? gh_kvalues_mxfp4 : gh_kvalues_iq4nl;
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) k)),
                            _mm512_set1_epi8((char) 0x80));
}

typedef struct {
    __m512i lo, hi; /* lane i: block i's values 0..15, 16..31 as unsigned bytes */
} wgroup;

/* p: four whole blocks (4 bs bytes, 68..96: the second load is masked to the group). */
GH_INLINE wgroup unpack(const int kind, const uint8_t * p, __m512i table) {
    const size_t bs = b_bytes(kind);
    const __m512i a = _mm512_loadu_si512(p);
    const __m512i b = _mm512_maskz_loadu_epi8(((__mmask64) 1 << (4 * bs - 64)) - 1, p + 64);
    const __m512i q = _mm512_permutex2var_epi8(a, _mm512_load_si512(QS_IDX_TABLE[kind]), b);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    wgroup g;
    g.lo = _mm512_and_si512(q, m4);
    g.hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    if (b_is_iq(kind)) {
        g.lo = _mm512_shuffle_epi8(table, g.lo);
        g.hi = _mm512_shuffle_epi8(table, g.hi);
    }
    if (b_is_q5(kind)) { /* bit j of block i's qh word: value j's fifth bit (j < 16: lo) */
        uint64_t mlo = 0, mhi = 0;
        for (int i = 0; i < 4; i++) {
            uint32_t h;
            memcpy(&h, p + i * bs + b_qh(kind), 4);
            mlo |= (uint64_t) (h & 0xffffu) << (16 * i);
            mhi |= (uint64_t) (h >> 16) << (16 * i);
        }
        const __m512i s16 = _mm512_set1_epi8(16);
        g.lo = _mm512_mask_add_epi8(g.lo, (__mmask64) mlo, g.lo, s16);
        g.hi = _mm512_mask_add_epi8(g.hi, (__mmask64) mhi, g.hi, s16);
    }
    return g;
}

/* The fp16 words at off of the four blocks of p, bs bytes apart: words 0..3. */
GH_INLINE __m128i words4(const uint8_t * p, size_t bs) {
    uint16_t d[4];
    for (int k = 0; k < 4; k++) memcpy(&d[k], p + k * bs, 2);
    return _mm_cvtsi64_si128((long long) (d[0] | (uint64_t) d[1] << 16 | (uint64_t) d[2] << 32 | (uint64_t) d[3] << 48));
}

/* Lane 4i + r: the fp16 at byte off of row r's block i (the scale d, or the min m). */
GH_INLINE __m512 fp16_r4(const uint8_t * const * p, size_t bs, size_t off) {
    const __m128i a = _mm_unpacklo_epi16(words4(p[0] + off, bs), words4(p[1] + off, bs));
    const __m128i b = _mm_unpacklo_epi16(words4(p[2] + off, bs), words4(p[3] + off, bs));
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_unpackhi_epi32(a, b), _mm_unpacklo_epi32(a, b)));
}

/* Lane 4i + r: row r's block i's MXFP4 scale 2^(e - 128) (gh_e8m0_to_fp32_half: e < 2 the
 * subnormals 0x00200000 << e). */
GH_INLINE __m512 e8m0_r4(const uint8_t * const * p, size_t bs) {
    const __m512i e = _mm512_setr_epi32(p[0][0], p[1][0], p[2][0], p[3][0], p[0][bs], p[1][bs], p[2][bs], p[3][bs],
                                        p[0][2 * bs], p[1][2 * bs], p[2][2 * bs], p[3][2 * bs], p[0][3 * bs],
                                        p[1][3 * bs], p[2][3 * bs], p[3][3 * bs]);
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), big, small));
}

/* One group of four blocks of the rows p[0..4) against NT tokens' Q8_X4 groups (token t's
 * at xg + t * xs): acc[t], lane 4i + r, += row r's block i . token t's. */
GH_INLINE void group_r4(const int NT, const int kind, const uint8_t * const * p, const char * xg, size_t xs,
                        __m512i table, __m512 * acc) {
    const size_t bs = b_bytes(kind);
    const __m512 dw = kind == B_MXFP4 ? e8m0_r4(p, bs) : fp16_r4(p, bs, 0);
    const __m512 dm = b_has_min(kind) ? fp16_r4(p, bs, 2) : _mm512_setzero_ps();
    wgroup u[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) u[r] = unpack(kind, p[r], table);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const block_q8_x4 * x = (const block_q8_x4 *) (xg + t * xs);
        const __m512i xa = _mm512_loadu_si512(x->qa), xc = _mm512_loadu_si512(x->qb);
        const __m512i z = _mm512_setzero_si512();
        const __m512i s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, u[0].lo, xa), u[0].hi, xc);
        const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, u[1].lo, xa), u[1].hi, xc);
        const __m512i s2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, u[2].lo, xa), u[2].hi, xc);
        const __m512i s3 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, u[3].lo, xa), u[3].hi, xc);
        const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
        const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
        __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
        const __m512i nsum = _mm512_loadu_si512(x->nsum);
        if (b_corr_shift(kind)) s = _mm512_add_epi32(s, _mm512_slli_epi32(nsum, b_corr_shift(kind)));
        const __m512 xd = _mm512_loadu_ps(x->d);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, xd), acc[t]);
        if (b_has_min(kind)) acc[t] = _mm512_fnmadd_ps(dm, _mm512_mul_ps(xd, _mm512_cvtepi32_ps(nsum)), acc[t]);
    }
}

/* y[t][r] = rows[r] . X[t] for NT tokens (X[t] at x + t * xs); a row's last 1..3 blocks
 * through zeroed copies (a zero block adds 0: its scale is 0, or 2^-128 against the
 * activations' zero padding). */
GH_INLINE void tile_r4(const int NT, const int kind, const int pfm, int64_t n, const uint8_t * const * rows,
                       const void * const * pf, const void * x, size_t xs, float (*y)[4]) {
    __m512 acc[NT_MAX];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    const __m512i table = level_table(kind);
    const int64_t nb = n / 32, ng_full = nb / 4;
    const size_t gb = 4 * b_bytes(kind);
    const char * xb = x;
    const char * pl = pfm == PF_LINEAR ? pf[0] : NULL;
    for (int64_t g = 0; g < ng_full; g++) {
        if (pfm == PF_LINEAR) { /* four groups' bytes of the stream per group */
#pragma GCC unroll 8
            for (size_t k = 0; k < 4 * gb; k += 64) _mm_prefetch(pl + k, GH_PF_HINT);
            pl += 4 * gb;
        } else if (pfm == PF_ROWS) { /* a group's lines: its first, +64 and last byte */
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const char * q = (const char *) pf[r] + g * gb;
                _mm_prefetch(q, GH_PF_HINT);
                _mm_prefetch(q + 64, GH_PF_HINT);
                _mm_prefetch(q + gb - 1, GH_PF_HINT);
            }
        }
        const uint8_t * p[4] = { rows[0] + g * gb, rows[1] + g * gb, rows[2] + g * gb, rows[3] + g * gb };
        group_r4(NT, kind, p, xb + g * sizeof(block_q8_x4), xs, table, acc);
    }
    if (nb % 4) {
        const int64_t g = ng_full;
        gh_tail_prefetch(pfm, pl, pf, g * gb, (size_t) (nb % 4) * b_bytes(kind));
        /* the zeroed copies by two masked loads and stores a row (a memset and memcpy
         * here were 4% of AVX2's decode samples, 576 columns: 2 blocks after 16) */
        _Alignas(64) uint8_t tb[4][128]; /* >= 4 blocks of the largest (Q5_1: 96 bytes) */
        GH_STATIC_ASSERT(4 * sizeof(block_q5_1) <= 128, "tail copy");
        const size_t tail = (size_t) (nb % 4) * b_bytes(kind); /* <= 72 */
        const __mmask64 m0 = tail >= 64 ? ~(__mmask64) 0 : ((__mmask64) 1 << tail) - 1;
        const __mmask64 m1 = tail > 64 ? ((__mmask64) 1 << (tail - 64)) - 1 : 0;
        const uint8_t * tp[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t * src = rows[r] + g * gb;
            _mm512_store_si512(tb[r], _mm512_maskz_loadu_epi8(m0, src));
            _mm512_store_si512(tb[r] + 64, _mm512_maskz_loadu_epi8(m1, src + 64));
            tp[r] = tb[r];
        }
        group_r4(NT, kind, tp, xb + g * sizeof(block_q8_x4), xs, table, acc);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) { /* lanes 4i + r -> y[t][r] */
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1));
        _mm_storeu_ps(y[t], _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

GH_INLINE void gemm_r4(const int kind, int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs,
                       int nt, float * y, int64_t ldy) {
    const uint8_t * rows[4];
    for (int r = 0; r < 4; r++) rows[r] = (const uint8_t *) w + (size_t) GH_MIN(r, nr - 1) * ws;
    float out[NT_MAX][4];
    if (nt == 1) {
        const void * pf[1] = { (const uint8_t *) w + GH_PF_TILES * 4 * ws };
        tile_r4(1, kind, PF_LINEAR, n, rows, pf, x, xs, out);
        for (int r = 0; r < nr; r++) y[r] = out[0][r];
        return;
    }
    for (int t = 0; t < nt; t += NT_MAX) {
        const char * xt = (const char *) x + t * xs;
        const int tn = GH_MIN(NT_MAX, nt - t);
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

/* Per kind: the tile; the vec_dot (a tile of one repeated row, off the hot paths); the
 * gathered four-row tile (gh_dot4_fn: the decode tile with a pointer per row). */
#define DEFINE_B32(sfx, KIND)                                                                         \
    void gh_avx512_gemm_##sfx(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                              int nt, float * y, int64_t ldy) {                                       \
        gemm_r4(KIND, n, w, ws, nr, x, xs, nt, y, ldy);                                              \
    }                                                                                                 \
    void gh_avx512_vec_dot_##sfx(int64_t n, float * s, const void * w, const void * x) {             \
        gemm_r4(KIND, n, w, 0, 1, x, 0, 1, s, 1);                                                     \
    }                                                                                                 \
    void gh_avx512_dot4_##sfx(int64_t n, const void * const * rows, const void * const * pf,          \
                              const void * x, float * y) {                                            \
        tile_r4(1, KIND, PF_ROWS, n, (const uint8_t * const *) rows, pf, x, 0, (float (*)[4]) y);     \
    }

DEFINE_B32(q4_1, B_Q4_1)
DEFINE_B32(q5_0, B_Q5_0)
DEFINE_B32(q5_1, B_Q5_1)
DEFINE_B32(mxfp4, B_MXFP4)

/* ------------------------------------------------------------------ IQ4_NL prompts */

/* IQ4_NL's prompt tile: 16 rows x up to GH_NL16_AVX512_NT tokens, the activations
 * broadcast. The four-row tile above spends as many instructions moving sums between
 * lanes (the transpose of four rows' int32 sums, per token and group) as it spends in
 * vpdpbusd. Here the tile first rearranges a chunk of the 16 rows' blocks in an L1
 * buffer (nl16_block: step k of a block holds each row's biased levels of values
 * 4k..4k+3 in its lane, so lane r is row r), once per call; then every token's 4-byte
 * activation groups are broadcast from memory into vpdpbusd against it, and lane r of the
 * int32 sum is row r's block dot with nothing to move. The rearranging is paid once for up
 * to 64 tokens instead of per token.
 *
 * The sums are those of the four-row tile bit for bit (decode, gathered rows and short
 * prompts still run it): the same exact integer per block and row (levels + 128 against
 * the bytes, plus 128 times the block sum), converted and scaled by the same product
 * (row scale x activation scale), added into four chains per row by block mod 4 (the
 * four-row tile's lanes 4i + r), the chains combined as (c0 + c2) + (c1 + c3) and a row's
 * blocks past the last padded to a group of four with zero-scale blocks as its tail does. */
#define NL16_T 4   /* tokens per register pass: 16 accumulators + 4 sums */
#define NL16_CB 32 /* blocks per rearranged chunk (18 KB of buffer), a multiple of 4 */
#define NL16_MIN_T 16 /* fewer tokens: the four-row tile (8 tokens ran 1.2-1.3x its time, 16 0.93-1.06x) */

typedef struct {
    __m512i q[8]; /* step k: lane r = row r's levels + 128 of values 4k..4k+3 */
    __m512  d;    /* lane r: row r's scale */
} nl16_block;

/* Blocks b0 .. b0 + nbk of the 16 rows (row r at byte offset off[r] of w) into buf; the
 * blocks at and past nb are zero-scale padding (their sums meet zero activations). */
static void nl16_rearrange(const uint8_t * w, __m512i off, int64_t b0, int nbk, int64_t nb, nl16_block * buf) {
    const __m512i table = level_table(B_IQ4_NL), m4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < nbk; j++) {
        const int64_t b = b0 + j;
        if (b >= nb) {
            for (int k = 0; k < 8; k++) buf[j].q[k] = _mm512_setzero_si512();
            buf[j].d = _mm512_setzero_ps();
            continue;
        }
        const uint8_t * p = w + b * sizeof(block_iq4_nl);
        /* the word at byte 0 (d and qs[0..1]): its low half is the fp16 scale */
        const __m512i dq = _mm512_i32gather_epi32(off, p, 1);
        buf[j].d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dq));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) { /* qs bytes 4k..4k+3: values 4k.. (low nibbles), 16 + 4k.. (high) */
            const __m512i q = _mm512_i32gather_epi32(off, p + 2 + 4 * k, 1);
            buf[j].q[k] = _mm512_shuffle_epi8(table, _mm512_and_si512(q, m4));
            buf[j].q[4 + k] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
        }
    }
}

/* TT tokens (token t's Q8_X4 row at x + t * xs) over nbk rearranged blocks starting at
 * block b0 (a multiple of 4): acc[t][i] += chain i's blocks. */
GH_INLINE void nl16_pass(const int TT, const nl16_block * buf, int64_t b0, int nbk, const char * x, size_t xs,
                         __m512 (*acc)[4]) {
    __m512 a[NL16_T][4];
#pragma GCC unroll 4
    for (int t = 0; t < TT; t++)
        for (int i = 0; i < 4; i++) a[t][i] = acc[t][i];
    for (int j = 0; j < nbk; j += 4) {
        const size_t go = (size_t) ((b0 + j) / 4) * sizeof(block_q8_x4);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const nl16_block * B = buf + j + i;
            __m512i s[NL16_T];
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++) {
                const block_q8_x4 * xb = (const block_q8_x4 *) (x + t * xs + go);
                s[t] = _mm512_slli_epi32(_mm512_set1_epi32(xb->nsum[4 * i]), 7);
            }
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i wq = B->q[k];
#pragma GCC unroll 4
                for (int t = 0; t < TT; t++) {
                    const block_q8_x4 * xb = (const block_q8_x4 *) (x + t * xs + go);
                    int32_t v;
                    memcpy(&v, (k < 4 ? xb->qa : xb->qb) + 16 * i + 4 * (k & 3), 4);
                    s[t] = _mm512_dpbusd_epi32(s[t], wq, _mm512_set1_epi32(v));
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++) {
                const block_q8_x4 * xb = (const block_q8_x4 *) (x + t * xs + go);
                a[t][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(B->d, _mm512_set1_ps(xb->d[4 * i])),
                                          a[t][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TT; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = a[t][i];
}

static void nl16_tile(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt, float * y,
                      int64_t ldy) {
    _Alignas(64) nl16_block buf[NL16_CB];
    _Alignas(64) __m512 acc[GH_NL16_AVX512_NT][4];
    int32_t offs[GH_NL16_AVX512_MR];
    for (int r = 0; r < GH_NL16_AVX512_MR; r++) offs[r] = (int32_t) ((size_t) GH_MIN(r, nr - 1) * ws);
    const __m512i off = _mm512_loadu_si512(offs);
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_ps();
    const int64_t nb = n / 32, nbp = (nb + 3) / 4 * 4;
    for (int64_t b0 = 0; b0 < nbp; b0 += NL16_CB) {
        const int nbk = (int) GH_MIN(NL16_CB, nbp - b0);
        nl16_rearrange(w, off, b0, nbk, nb, buf);
        int t = 0;
        for (; t + NL16_T <= nt; t += NL16_T) nl16_pass(NL16_T, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t);
        switch (nt - t) {
            case 1: nl16_pass(1, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            case 2: nl16_pass(2, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            case 3: nl16_pass(3, buf, b0, nbk, (const char *) x + t * xs, xs, acc + t); break;
            default: break;
        }
    }
    for (int t = 0; t < nt; t++) {
        _Alignas(64) float o[GH_NL16_AVX512_MR];
        _mm512_store_ps(o, _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][2]), _mm512_add_ps(acc[t][1], acc[t][3])));
        memcpy(y + t * ldy, o, (size_t) nr * sizeof(float));
    }
}

/* Prompts of at least NL16_MIN_T tokens: the 16-row tile; fewer (and decode): the
 * four-row tile, four rows at a time (the same sums). */
void gh_avx512_gemm_iq4_nl(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, int nt,
                           float * y, int64_t ldy) {
    if (nt >= NL16_MIN_T) {
        nl16_tile(n, w, ws, nr, x, xs, nt, y, ldy);
        return;
    }
    for (int r = 0; r < nr; r += 4)
        gemm_r4(B_IQ4_NL, n, (const uint8_t *) w + (size_t) r * ws, ws, GH_MIN(4, nr - r), x, xs, nt, y + r, ldy);
}
void gh_avx512_vec_dot_iq4_nl(int64_t n, float * s, const void * w, const void * x) {
    gemm_r4(B_IQ4_NL, n, w, 0, 1, x, 0, 1, s, 1);
}
void gh_avx512_dot4_iq4_nl(int64_t n, const void * const * rows, const void * const * pf, const void * x,
                           float * y) {
    tile_r4(1, B_IQ4_NL, PF_ROWS, n, (const uint8_t * const *) rows, pf, x, 0, (float (*)[4]) y);
}
