/* AVX2 kernels (AVX2, FMA, F16C only: no AVX-VNNI or AVX-512, which Zen 2/3 lack).
 *
 *   F32  x F32 : FMA;   F16 x F32: vcvtph2ps + FMA;   BF16 x BF16: shift to f32 + FMA
 *   Q4_0 x Q8_X4: maddubs of the unsigned nibbles with the activation bytes, minus 8
 *                 times the activation block sum (carried by Q8_X4)
 *   Q8_0 x Q8_X4: maddubs of |w| with sign(w) * x
 *   Q4_1, Q5_0, Q5_1 x Q8_X4: as Q4_0 (Q5: the fifth bit expanded to bytes; Q5_0's zero
 *                 point 16 as Q4_0's 8; the min of Q4_1 / Q5_1 times the block sum in float)
 * One 256-bit register holds half a Q8_X4 group: two blocks, one per 128-bit lane.
 *
 * The quantized types run four rows at a time for any number of tokens (q_half_r4): the
 * integer sums of the four rows are transposed into one register (lane 4i + r: block i,
 * row r) before they are converted and scaled, so the float work, the activation terms
 * and the scales are handled once for four rows. Per token, a four-row Q4_0 tile of one
 * half group is 8 maddubs and 4 madd against ~20 other instructions (Q8_0: 8 madd and 8
 * sign); the weights are unpacked once per tile and used for every token. A short tile repeats its last row
 * (rows do not interact), so a row's value is the same in every tile it can land in: at
 * a matrix's edge, in a gathered sparse tile (dot4), at any thread count.
 *
 * Decode tiles prefetch the rows of the tile GH_PF_TILES ahead into L2 as one linear
 * stream (the four rows of a tile are four short streams the hardware prefetcher picks
 * up late); the gathered tiles prefetch the rows they are given, a slice per step. */

#include "cpu/avx2/k4_scales.h"
#include "cpu/avx2/iq4_avx2.h"
#include "cpu/avx2/iqlat_avx2.h"
#include "cpu/prefetch.h"
#include "cpu/kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define GH_INLINE static inline __attribute__((always_inline))
#define MAXR 4
#define MAXT 6  /* tokens of a float tile */
/* Prompt tiles (docs/BENCHMARKS.md, "AVX2 kernels"): float 3 rows x 4 tokens (12
 * accumulators + 3 weight vectors + x fill the 16 registers; 4 x 2 converts a weight
 * vector per 2 FMAs), quantized 4 rows x 12 tokens (the weights' unpacking spread over
 * more tokens; the compiler reloads some of them from L1). 12 tokens against 6: SmolLM2's
 * shapes at 128 tokens 1.03-1.22x the GFLOP/s (docs/BENCHMARKS.md, "AVX2 F16 chunks and
 * the quantized prompt tile"); each token's sums do not depend on the tile's width. */
#define F_MR 3
#define F_NT 4
#define QNT 12
#define GH_MIN_I(a, b) ((a) < (b) ? (a) : (b))

GH_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ------------------------------------------------------------------ F32, F16, BF16 */

enum { W_F32, W_F16, W_BF16 };

GH_INLINE __m256 bf16x8(const uint16_t * p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* 8 weights of the kind, as f32. */
GH_INLINE __m256 load_w(const int kind, const void * p) {
    switch (kind) {
        case W_F16:  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
        case W_BF16: return bf16x8(p);
        default:     return _mm256_loadu_ps(p);
    }
}

/* 8 activations: bf16 for BF16 weights, else f32. */
GH_INLINE __m256 load_x(const int kind, const void * p) {
    return kind == W_BF16 ? bf16x8(p) : _mm256_loadu_ps(p);
}


/* One step of tile_f: the 8 values at i of every row and token into the accumulator set
 * `set` (acc[r][t + set]; set 1 only in a one-token F16 tile), with the step's prefetch. */
GH_INLINE void tile_f_step(const int MR, const int NT, const int kind, const int pfm, const int set,
                           int64_t i, const char * const * wr, const char * const * pf,
                           const char * xb, size_t xs, const char ** pl, const char ** pend,
                           __m256 acc[MAXR][MAXT]) {
    const size_t wsz = kind == W_F32 ? 4 : 2;  /* bytes per weight */
    const size_t xsz = kind == W_BF16 ? 2 : 4; /* bytes per activation */
    if (pfm == PF_LINEAR) { /* MR * 8 weights' bytes of the stream per step */
        *pend += MR * 8 * wsz;
        for (; *pl < *pend; *pl += 64) _mm_prefetch(*pl, GH_PF_HINT);
    } else if (pfm == PF_ROWS && ((i * wsz) & 63) == 0) {
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) _mm_prefetch(pf[r] + i * wsz, GH_PF_HINT);
    }
    __m256 wv[MAXR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) wv[r] = load_w(kind, wr[r] + i * wsz);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const __m256 xv = load_x(kind, xb + t * xs + i * xsz);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) acc[r][t + set] = _mm256_fmadd_ps(wv[r], xv, acc[r][t + set]);
    }
}

/* The last n % 8 values (k of them) at i, through zero-padded copies, into set `set`. */
GH_INLINE void tile_f_tail(const int MR, const int NT, const int kind, const int set, int64_t i,
                           size_t k, const char * const * wr, const char * xb, size_t xs,
                           __m256 acc[MAXR][MAXT]) {
    const size_t wsz = kind == W_F32 ? 4 : 2;
    const size_t xsz = kind == W_BF16 ? 2 : 4;
    _Alignas(32) char wt[MAXR][32] = { { 0 } };
    _Alignas(32) char xt[MAXT][32] = { { 0 } };
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) memcpy(wt[r], wr[r] + i * wsz, k * wsz);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) memcpy(xt[t], xb + t * xs + i * xsz, k * xsz);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const __m256 xv = load_x(kind, xt[t]);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) acc[r][t + set] = _mm256_fmadd_ps(load_w(kind, wt[r]), xv, acc[r][t + set]);
    }
}

/* An F16 prompt tile's set p (tile_f): its blocks of four steps, and the tail if it is
 * the set's. */
GH_INLINE void tile_f16_set(const int MR, const int NT, const int p, int64_t S, size_t k,
                            const char * const * wr, const char * xb, size_t xs,
                            __m256 acc[MAXR][MAXT]) {
    int64_t b0 = 4 * p;
    for (; b0 + 4 <= S; b0 += 8) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) tile_f_step(MR, NT, W_F16, PF_NONE, 0, 8 * (b0 + j), wr, NULL, xb, xs, NULL, NULL, acc);
    }
    for (int64_t s = b0; s < S; s++) tile_f_step(MR, NT, W_F16, PF_NONE, 0, 8 * s, wr, NULL, xb, xs, NULL, NULL, acc);
    if (k && ((S / 4) & 1) == p) tile_f_tail(MR, NT, W_F16, 0, 8 * S, k, wr, xb, xs, acc);
}

/* y[t * ldy + r] = W[r] . X[t]: rows at wr[r], 8 values per step, the last n % 8 through
 * zero-padded copies. F32 and BF16: one accumulator per row and token. F16: two sets,
 * steps 4b..4b+3 (one cache line of the row) into set b & 1 (the tail, step S, by its
 * block), y = hsum(set 0 + set 1): an F16 row's sum is then two chains of FMAs, so one row
 * alone keeps up with the memory and decode can read F16 rows one after another as a
 * single stream (gh_dot_row_avx2_f16_streamed); with one chain it was latency-bound
 * (docs/BENCHMARKS.md, "AVX2 F16 decode"). A one-token tile holds both sets (2 MR
 * registers); a wider one has no registers for them and runs set 0's blocks, then set 1's,
 * over the same rows: the same FMAs per lane in the same order, so every form of an F16 row
 * (decode, gathered, prompt tile, any thread count) gives the same bits. (The second pass
 * costs the prompt: 1536-column rows 1.2x the time, their x no longer in L1 for it.) */
GH_INLINE void tile_f(const int MR, const int NT, const int kind, const int pfm, int64_t n,
                      const char * const * wr, const char * const * pf, const void * x,
                      size_t xs, float * y, int64_t ldy) {
    const bool two = kind == W_F16;   /* two accumulator sets */
    const int64_t S = n / 8;          /* full steps */
    const size_t k = (size_t) (n - 8 * S); /* the tail's values */
    __m256 acc[MAXR][MAXT];
    const char * xb = x;
    const char * pl = pfm == PF_LINEAR ? pf[0] : NULL; /* next line to prefetch */
    const char * pend = pl;                            /* end of the stream's bytes so far */
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < MAXT; t++) acc[r][t] = _mm256_setzero_ps(); /* (unused ones: dead) */
    if (!two) {
        for (int64_t s = 0; s < S; s++) tile_f_step(MR, NT, kind, pfm, 0, 8 * s, wr, pf, xb, xs, &pl, &pend, acc);
        if (k) tile_f_tail(MR, NT, kind, 0, 8 * S, k, wr, xb, xs, acc);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++)
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) y[t * ldy + r] = hsum(acc[r][t]);
        return;
    }
    /* F16: step s (the tail is step S) into set (s / 4) & 1: four steps (one cache line of
     * each row) to a set, then four to the other */
    if (NT == 1) { /* both sets in registers: acc[r][0] and acc[r][1] */
        int64_t s = 0;
        for (; s + 8 <= S; s += 8) {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) tile_f_step(MR, NT, kind, pfm, 0, 8 * (s + j), wr, pf, xb, xs, &pl, &pend, acc);
#pragma GCC unroll 4
            for (int j = 4; j < 8; j++) tile_f_step(MR, NT, kind, pfm, 1, 8 * (s + j), wr, pf, xb, xs, &pl, &pend, acc);
        }
        for (const int64_t e = GH_MIN_I(S, s + 4); s < e; s++) {
            tile_f_step(MR, NT, kind, pfm, 0, 8 * s, wr, pf, xb, xs, &pl, &pend, acc);
        }
        for (; s < S; s++) tile_f_step(MR, NT, kind, pfm, 1, 8 * s, wr, pf, xb, xs, &pl, &pend, acc);
        if (k) {
            if ((S / 4) & 1) tile_f_tail(MR, NT, kind, 1, 8 * S, k, wr, xb, xs, acc);
            else tile_f_tail(MR, NT, kind, 0, 8 * S, k, wr, xb, xs, acc);
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        return;
    }
    /* several tokens: no registers for both sets; set 0's blocks of four steps, then set
     * 1's (each line of the rows and of x is still read once) */
    tile_f16_set(MR, NT, 0, S, k, wr, xb, xs, acc);
    __m256 set0[MAXR][MAXT];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            set0[r][t] = acc[r][t];
            acc[r][t] = _mm256_setzero_ps();
        }
    tile_f16_set(MR, NT, 1, S, k, wr, xb, xs, acc);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) y[t * ldy + r] = hsum(_mm256_add_ps(set0[r][t], acc[r][t]));
}

/* The rows of a dense tile; decode prefetches the tile GH_PF_TILES ahead. */
GH_INLINE void tile_f_dense(const int MR, const int NT, const int kind, int64_t n, const void * w,
                            size_t ws, const void * x, size_t xs, float * y, int64_t ldy) {
    const char * wr[MAXR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) wr[r] = (const char *) w + r * ws;
    const char * pf[1] = { (const char *) w + GH_PF_TILES * MR * ws };
    tile_f(MR, NT, kind, NT == 1 ? PF_LINEAR : PF_NONE, n, wr, pf, x, xs, y, ldy);
}

static void bf16_from_float_x(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    int64_t i = 0;
    const __m256i round = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *) (src + i));
        /* round to nearest even: v + 0x7fff + ((v >> 16) & 1), then >> 16 */
        __m256i r = _mm256_add_epi32(v, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(v, 16), one)));
        r = _mm256_srli_epi32(r, 16);
        /* NaN: keep the upper half, set the quiet bit */
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, absmask), inf);
        __m256i qn = _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(64));
        r = _mm256_blendv_epi8(r, qn, nan);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *) (d + i), packed);
    }
    for (; i < n; i++) d[i] = gh_fp32_to_bf16(src[i]);
}

/* ------------------------------------------------------------------ Q8_X4 activations */

/* roundf (half away from zero) of 8 floats, as the scalar reference does. */
GH_INLINE __m256i round_away(__m256 v) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
    const __m256 up = _mm256_cmp_ps(f, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, sign));
    /* clamped to the int8 codes (a non-finite activation converts to INT_MIN): as the
     * scalar reference, see avx512's round_away */
    const __m256i q = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, one)));
    return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

/* gh_quantize_row_q8_x4_ref, byte for byte. */
static void q8_x4_from_float_x(const float * x, void * dst, int64_t n) {
    const int64_t nb = n / QK8_0;
    const int64_t ng = (nb + 3) / 4;
    block_q8_x4 * g = dst;
    if (nb % 4) memset(&g[ng - 1], 0, sizeof *g);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        block_q8_x4 * yg = &g[b / 4];
        const int i = (int) (b % 4);
        const float * xb = x + b * QK8_0;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q), _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                                       _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q), _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
        /* (max drops a NaN: the reference's NaN block scale, from a separate test) */
        const float d = _mm256_movemask_ps(un) ? NAN : _mm_cvtss_f32(m4) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = round_away(_mm256_mul_ps(v[k], vid));
        /* dwords of the packed bytes: lane 0 holds values 0-3, 8-11, 16-19, 24-27, lane 1
         * the others; `order` puts them back in sequence */
        const __m256i p = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm_storeu_si128((__m128i *) &yg->qa[16 * i], _mm256_castsi256_si128(p));
        _mm_storeu_si128((__m128i *) &yg->qb[16 * i], _mm256_extracti128_si256(p, 1));
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        const int sum = _mm_cvtsi128_si32(s4);
        for (int j = 0; j < 4; j++) {
            yg->nsum[4 * i + j] = -sum;
            yg->d[4 * i + j] = d;
        }
    }
}

/* ------------------------------------------------------------------ 32-value block types
 *
 * Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 against Q8_X4 run one tile; the block kind is a
 * compile-time parameter (an enum constant at every call, so its branches fold away and
 * the Q8_0 and Q4_0 instances are the instructions they were before the other kinds).
 * The bytes of a block:
 *   Q8_0 { d, qs[32] } 34;  Q4_0 { d, qs[16] } 18;  Q4_1 { d, m, qs[16] } 20;
 *   Q5_0 { d, qh[4], qs[16] } 22;  Q5_1 { d, m, qh[4], qs[16] } 24.
 * The 4- and 5-bit values go through maddubs unsigned (Q5: the nibble plus 16 times bit j
 * of the qh word, expanded to bytes); a zero point (Q4_0 8, Q5_0 16) is that times the
 * activation block sum, added to the integer sums; the min of Q4_1 and Q5_1 (x = d q + m)
 * adds m d_x sum(a) per block in float (its fp16 m loaded like the scales). */

enum { B_Q8_0, B_Q4_0, B_Q4_1, B_Q5_0, B_Q5_1 };

GH_INLINE size_t b_bytes(const int kind) {
    switch (kind) {
        case B_Q4_0: return sizeof(block_q4_0);
        case B_Q4_1: return sizeof(block_q4_1);
        case B_Q5_0: return sizeof(block_q5_0);
        case B_Q5_1: return sizeof(block_q5_1);
        default:     return sizeof(block_q8_0);
    }
}

/* offset of the quants (qs) in a block */
GH_INLINE size_t b_qs(const int kind) {
    switch (kind) {
        case B_Q4_1: return offsetof(block_q4_1, qs);
        case B_Q5_0: return offsetof(block_q5_0, qs);
        case B_Q5_1: return offsetof(block_q5_1, qs);
        default:     return 2;  /* after d: Q8_0, Q4_0 */
    }
}

GH_INLINE bool b_is_q5(const int kind) { return kind == B_Q5_0 || kind == B_Q5_1; }
GH_INLINE size_t b_qh(const int kind) { return kind == B_Q5_1 ? offsetof(block_q5_1, qh) : offsetof(block_q5_0, qh); }
/* Q4_1 and Q5_1 carry a min, both at byte 2 */
GH_INLINE bool b_has_min(const int kind) { return kind == B_Q4_1 || kind == B_Q5_1; }
GH_STATIC_ASSERT(offsetof(block_q4_1, m) == 2 && offsetof(block_q5_1, m) == 2, "min after d");

/* Two consecutive blocks of one weight row, unpacked: the unsigned maddubs operands for
 * values 0..15 (a) and 16..31 (b) of each block (lane i: block i), and for Q8_0 the signed
 * bytes whose signs go onto the activations (sa, sb). */
typedef struct {
    __m256i a, b, sa, sb;
} wpair;

GH_INLINE __m256i load2x16(const uint8_t * p0, const uint8_t * p1) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) p0)),
                                   _mm_loadu_si128((const __m128i *) p1), 1);
}

/* p: the first block of the pair */
GH_INLINE wpair unpack_pair(const int kind, const uint8_t * p) {
    wpair u;
    const size_t bs = b_bytes(kind);
    if (kind != B_Q8_0) {
        const __m256i q = load2x16(p + b_qs(kind), p + bs + b_qs(kind));
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        u.a = _mm256_and_si256(q, m4);
        u.b = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        u.sa = u.sb = _mm256_setzero_si256();
        if (b_is_q5(kind)) {
            /* bit j of block i's qh word (bytes 0..3 of lane i; the 16 bytes read from qh
             * stay inside the block) to 16 in byte j of a (j < 16) or j - 16 of b: qh byte
             * j / 8 copied to 8 bytes, one bit of each kept, cmpeq makes it 0xff */
            const __m256i h = load2x16(p + b_qh(kind), p + bs + b_qh(kind));
            const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201ull);
            const __m256i ca = _mm256_setr_epi64x(0, 0x0101010101010101ll, 0, 0x0101010101010101ll);
            const __m256i cb = _mm256_setr_epi64x(0x0202020202020202ll, 0x0303030303030303ll,
                                                  0x0202020202020202ll, 0x0303030303030303ll);
            const __m256i s16 = _mm256_set1_epi8(0x10);
            const __m256i ha = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, ca), bit), bit);
            const __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, cb), bit), bit);
            u.a = _mm256_or_si256(u.a, _mm256_and_si256(ha, s16));
            u.b = _mm256_or_si256(u.b, _mm256_and_si256(hb, s16));
        }
    } else {
        u.sa = load2x16(p + 2, p + sizeof(block_q8_0) + 2);
        u.sb = load2x16(p + 18, p + sizeof(block_q8_0) + 18);
        u.a = _mm256_abs_epi8(u.sa);
        u.b = _mm256_abs_epi8(u.sb);
    }
    return u;
}

/* A row's pair against the activations' half group (xa, xc): int32 lanes 0..3 sum to
 * block 0's dot, lanes 4..7 to block 1's (no overflow: |products| <= 128 * 127 per pair of
 * values in maddubs, and the 4/5-bit kinds' two maddubs sum to at most 4 * 31 * 127). */
GH_INLINE __m256i pair_dot(const int kind, const wpair * u, __m256i xa, __m256i xc) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (kind != B_Q8_0) {
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u->a, xa),
                                                  _mm256_maddubs_epi16(u->b, xc)), ones);
    }
    const __m256i pa = _mm256_maddubs_epi16(u->a, _mm256_sign_epi8(xa, u->sa));
    const __m256i pb = _mm256_maddubs_epi16(u->b, _mm256_sign_epi8(xc, u->sb));
    return _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones));
}

/* Lanes 4i + r = the sum of lanes 4i..4i+3 of s_r (per 128-bit lane: rows 0..3). */
GH_INLINE __m256i transpose_sum4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
    const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(s0, s1), _mm256_unpackhi_epi32(s0, s1));
    const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(s2, s3), _mm256_unpackhi_epi32(s2, s3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

/* The fp16 words of four blocks bs bytes apart, words 0..3. */
GH_INLINE __m128i scales4(const uint8_t * p, size_t bs) {
    uint16_t d[4];
    for (int k = 0; k < 4; k++) memcpy(&d[k], p + k * bs, 2);
    const uint64_t v = d[0] | (uint64_t) d[1] << 16 | (uint64_t) d[2] << 32 | (uint64_t) d[3] << 48;
    return _mm_cvtsi64_si128((long long) v);
}

/* dw[h], lane 4i + r: row r's scale of block 2h + i of the group at p[r] (the min: p[r]
 * pointing at the group's first m). */
GH_INLINE void scales_r4(const uint8_t * const * p, size_t bs, __m256 dw[2]) {
    const __m128i a = _mm_unpacklo_epi16(scales4(p[0], bs), scales4(p[1], bs));
    const __m128i b = _mm_unpacklo_epi16(scales4(p[2], bs), scales4(p[3], bs));
    dw[0] = _mm256_cvtph_ps(_mm_unpacklo_epi32(a, b));
    dw[1] = _mm256_cvtph_ps(_mm_unpackhi_epi32(a, b));
}

/* acc (lane 4i + r: row r) += the four rows' pairs u against half h of group xg; dw the
 * rows' scales, dm their mins (Q4_1, Q5_1). */
GH_INLINE __m256 q_half_r4(const int kind, const wpair * u, const block_q8_x4 * xg, int h,
                           __m256 dw, __m256 dm, __m256 acc) {
    const __m256i xa = _mm256_loadu_si256((const __m256i *) (xg->qa + 32 * h));
    const __m256i xc = _mm256_loadu_si256((const __m256i *) (xg->qb + 32 * h));
    __m256i s = transpose_sum4(pair_dot(kind, &u[0], xa, xc), pair_dot(kind, &u[1], xa, xc),
                               pair_dot(kind, &u[2], xa, xc), pair_dot(kind, &u[3], xa, xc));
    const __m256i nsum = _mm256_loadu_si256((const __m256i *) (xg->nsum + 8 * h));
    if (kind == B_Q4_0 || kind == B_Q5_0) { /* the zero point 8 (16): + 8 (16) * (-block sum) */
        s = _mm256_add_epi32(s, _mm256_slli_epi32(nsum, kind == B_Q4_0 ? 3 : 4));
    }
    const __m256 xd = _mm256_loadu_ps(xg->d + 8 * h);
    const __m256 scale = _mm256_mul_ps(dw, xd);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
    if (b_has_min(kind)) { /* + m d_x sum(a) = - m (d_x nsum) */
        acc = _mm256_fnmadd_ps(dm, _mm256_mul_ps(xd, _mm256_cvtepi32_ps(nsum)), acc);
    }
    return acc;
}

/* One group of four blocks of the rows p[0..4) against NT tokens' groups (token t's at
 * xg + t * xs bytes). */
GH_INLINE void q_group_r4(const int NT, const int kind, const uint8_t * const * p,
                          const char * xg, size_t xs, __m256 * acc) {
    const size_t bs = b_bytes(kind);
    __m256 dw[2], dm[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };
    scales_r4(p, bs, dw);
    if (b_has_min(kind)) {
        const uint8_t * pm[4] = { p[0] + 2, p[1] + 2, p[2] + 2, p[3] + 2 };
        scales_r4(pm, bs, dm);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        wpair u[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) u[r] = unpack_pair(kind, p[r] + 2 * h * bs);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            acc[t] = q_half_r4(kind, u, (const block_q8_x4 *) (xg + t * xs), h, dw[h], dm[h], acc[t]);
        }
    }
}

/* A row's last 1..3 blocks copied into zeroed whole groups: zero blocks add exactly 0 (their
 * scale and min are 0), and nothing past the rows is read. */
GH_INLINE void q_tail_r4(const int NT, const int kind, const uint8_t * const * p,
                         size_t avail, const char * xg, size_t xs, __m256 * acc) {
    _Alignas(32) uint8_t tb[4][4 * sizeof(block_q8_0)]; /* the largest block */
    memset(tb, 0, sizeof tb);
    const uint8_t * tp[4];
    for (int r = 0; r < 4; r++) {
        memcpy(tb[r], p[r], avail);
        tp[r] = tb[r];
    }
    q_group_r4(NT, kind, tp, xg, xs, acc);
}

/* y[t][r] (4 floats per token) = rows[r] . X[t] for NT tokens (X[t] at x + t * xs). pfm:
 * PF_LINEAR prefetches bytes from pf[0] on (4 groups' worth per group), PF_ROWS each
 * group's bytes of the rows pf[0..4). */
GH_INLINE void tile_q_r4(const int NT, const int kind, const int pfm, int64_t n,
                         const uint8_t * const * rows, const void * const * pf, const void * x,
                         size_t xs, float (*y)[4]) {
    __m256 acc[QNT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    const int64_t nb = n / 32;
    const int64_t ng_full = nb / 4;
    const size_t bs = b_bytes(kind);
    const size_t gb = 4 * bs; /* bytes of a row's group */
    const char * xb = x;
    const char * pl = pfm == PF_LINEAR ? pf[0] : NULL;
    for (int64_t g = 0; g < ng_full; g++) {
        if (pfm == PF_LINEAR) {
#pragma GCC unroll 8
            for (size_t k = 0; k < 4 * gb; k += 64) _mm_prefetch(pl + k, GH_PF_HINT);
            pl += 4 * gb;
        } else if (pfm == PF_ROWS) { /* first and last byte cover a Q4_0 group's lines (72
                                      * bytes); the larger groups (80..136) the middle too
                                      * (Q8_0's 136 bytes span up to four lines) */
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const char * q = (const char *) pf[r] + g * gb;
                _mm_prefetch(q, GH_PF_HINT);
                if (kind != B_Q4_0) _mm_prefetch(q + 64, GH_PF_HINT);
                if (gb > 129) _mm_prefetch(q + 128, GH_PF_HINT);
                _mm_prefetch(q + gb - 1, GH_PF_HINT);
                /* Q8_0: the next group of this row from L2 into L1 (first and last byte):
                 * scattered rows at 10-50% density read 1.2-1.4x faster cold
                 * (docs/BENCHMARKS.md, "The gathered rows per byte read"); no gain for the
                 * 4-bit kinds */
                if (kind == B_Q8_0) {
                    _mm_prefetch((const char *) rows[r] + (g + 1) * gb, _MM_HINT_T0);
                    _mm_prefetch((const char *) rows[r] + (g + 2) * gb - 1, _MM_HINT_T0);
                }
            }
        }
        const uint8_t * p[4] = { rows[0] + g * gb, rows[1] + g * gb, rows[2] + g * gb, rows[3] + g * gb };
        q_group_r4(NT, kind, p, xb + g * sizeof(block_q8_x4), xs, acc);
    }
    if (nb % 4) {
        const int64_t g = ng_full;
        gh_tail_prefetch(pfm, pl, pf, g * gb, (size_t) (nb % 4) * bs);
        const uint8_t * p[4] = { rows[0] + g * gb, rows[1] + g * gb, rows[2] + g * gb, rows[3] + g * gb };
        q_tail_r4(NT, kind, p, (size_t) (nb % 4) * bs, xb + g * sizeof(block_q8_x4), xs, acc);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        _mm_storeu_ps(y[t], s);
    }
}

GH_INLINE void gemm_q(const int kind, int64_t n, const void * w, size_t ws, int nr,
                      const void * x, size_t xs, int nt, float * y, int64_t ldy) {
    const uint8_t * rows[4];
    for (int r = 0; r < 4; r++) rows[r] = (const uint8_t *) w + (size_t) GH_MIN(r, nr - 1) * ws;
    float out[QNT][4];
    if (nt == 1) {
        const void * pf[1] = { (const uint8_t *) w + GH_PF_TILES * 4 * ws };
        tile_q_r4(1, kind, PF_LINEAR, n, rows, pf, x, xs, out);
        for (int r = 0; r < nr; r++) y[r] = out[0][r];
        return;
    }
    for (int t = 0; t < nt; t += QNT) {
        const char * xt = (const char *) x + t * xs;
        const int tn = GH_MIN(QNT, nt - t);
        switch (tn) {
            case 1: tile_q_r4(1, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 2: tile_q_r4(2, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 3: tile_q_r4(3, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 4: tile_q_r4(4, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 5: tile_q_r4(5, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 6: tile_q_r4(6, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 7: tile_q_r4(7, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 8: tile_q_r4(8, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 9: tile_q_r4(9, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 10: tile_q_r4(10, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            case 11: tile_q_r4(11, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
            default: tile_q_r4(12, kind, PF_NONE, n, rows, NULL, xt, xs, out); break;
        }
        for (int k = 0; k < tn; k++)
            for (int r = 0; r < nr; r++) y[(t + k) * ldy + r] = out[k][r];
    }
}

/* Per kind: the tile; the vec_dot, a four-row tile of one repeated row (off the hot paths:
 * the sparse row-dots take dot4); and the gathered four-row tile (kernels.h, gh_dot4_fn:
 * the decode tile with a pointer per row, so each value equals the dense decode tile's). */
#define DEFINE_GEMM_Q(sfx, KIND)                                                              \
    static void gemm_##sfx(int64_t n, const void * w, size_t ws, int nr, const void * x,     \
                           size_t xs, int nt, float * y, int64_t ldy) {                      \
        gemm_q(KIND, n, w, ws, nr, x, xs, nt, y, ldy);                                        \
    }                                                                                         \
    static void vec_dot_##sfx(int64_t n, float * s, const void * w, const void * x) {        \
        gemm_q(KIND, n, w, 0, 1, x, 0, 1, s, 1);                                              \
    }                                                                                         \
    static void dot4_##sfx(int64_t n, const void * const * rows, const void * const * pf,    \
                           const void * x, float * y) {                                       \
        tile_q_r4(1, KIND, PF_ROWS, n, (const uint8_t * const *) rows, pf, x, 0, (float (*)[4]) y); \
    }

DEFINE_GEMM_Q(q8_0, B_Q8_0)
DEFINE_GEMM_Q(q4_0, B_Q4_0)
DEFINE_GEMM_Q(q4_1, B_Q4_1)
DEFINE_GEMM_Q(q5_0, B_Q5_0)
DEFINE_GEMM_Q(q5_1, B_Q5_1)

/* ------------------------------------------------------------------ gathered rows */

/* Four rows at arbitrary addresses, one token (kernels.h, gh_dot4_fn): the decode tiles
 * with a pointer per row, so each value equals the dense decode tile's. */
GH_INLINE void dot4_f(const int kind, int64_t n, const void * const * rows,
                      const void * const * pf, const void * x, float * y) {
    tile_f(4, 1, kind, PF_ROWS, n, (const char * const *) rows, (const char * const *) pf, x, 0, y, 1);
}

static void dot4_f32(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_f(W_F32, n, rows, pf, x, y);
}
static void dot4_f16(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_f(W_F16, n, rows, pf, x, y);
}
static void dot4_bf16(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_f(W_BF16, n, rows, pf, x, y);
}
/* the quantized types' dot4: DEFINE_GEMM_Q */

/* ------------------------------------------------------------------ dispatch */

/* Float types: a full MR x NT tile, or edge tiles: nt == 1 with up to MR rows (decode),
 * else one row at a time with up to NT tokens. */
#define DEFINE_GEMM_F(name, MR, NT, KIND)                                                     \
    static void name(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                     int nt, float * y, int64_t ldy) {                                        \
        if (nr == MR && nt == NT) { tile_f_dense(MR, NT, KIND, n, w, ws, x, xs, y, ldy); return; } \
        if (nt == 1) {                                                                        \
            switch (nr) {                                                                     \
                case 4: tile_f_dense(4, 1, KIND, n, w, ws, x, xs, y, ldy); return;            \
                case 3: tile_f_dense(3, 1, KIND, n, w, ws, x, xs, y, ldy); return;            \
                case 2: tile_f_dense(2, 1, KIND, n, w, ws, x, xs, y, ldy); return;            \
                default: tile_f_dense(1, 1, KIND, n, w, ws, x, xs, y, ldy); return;           \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < nr; r++) {                                                        \
            const char * wr = (const char *) w + r * ws;                                      \
            for (int t = 0; t < nt; t += 4) {                                                 \
                const char * xt = (const char *) x + t * xs;                                  \
                float * yt = y + t * ldy + r;                                                 \
                switch (nt - t) {                                                             \
                    case 1: tile_f_dense(1, 1, KIND, n, wr, ws, xt, xs, yt, ldy); break;      \
                    case 2: tile_f_dense(1, 2, KIND, n, wr, ws, xt, xs, yt, ldy); break;      \
                    case 3: tile_f_dense(1, 3, KIND, n, wr, ws, xt, xs, yt, ldy); break;      \
                    default: tile_f_dense(1, 4, KIND, n, wr, ws, xt, xs, yt, ldy); break;     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_GEMM_F(gemm_f32, F_MR, F_NT, W_F32)
DEFINE_GEMM_F(gemm_f16, F_MR, F_NT, W_F16)

/* F16 decode on AMD parts (simd.c selects it): the rows one after another, each one
 * stream with its two chains (tile_f), no software prefetch: the hardware prefetcher
 * follows one linear stream, where the interleaved four-row tile is four short streams
 * that it picks up late (Zen 4, SmolLM2's F16 weights from DRAM, 1 thread: 27.9 against
 * 25.4 GB/s; docs/BENCHMARKS.md, "AVX2 F16 decode"); rows of up to F16_ROW_MAX_N values,
 * as AVX-512's streamed rows (5632 columns: 15 GB/s streamed). The same sums as the tile. */
#define F16_ROW_MAX_N 2730 /* x (4n bytes) and the row (2n) in half of a 32 KiB L1d, as AVX-512's */
static void gemm_f16_streamed(int64_t n, const void * w, size_t ws, int nr, const void * x,
                              size_t xs, int nt, float * y, int64_t ldy) {
    if (nt != 1 || n > F16_ROW_MAX_N) { /* longer rows: the weight stream evicts x every row */
        gemm_f16(n, w, ws, nr, x, xs, nt, y, ldy);
        return;
    }
    for (int r = 0; r < nr; r++) {
        const char * wr[1] = { (const char *) w + r * ws };
        tile_f(1, 1, W_F16, PF_NONE, n, wr, NULL, x, 0, y + r, 1);
    }
}
DEFINE_GEMM_F(gemm_bf16, F_MR, F_NT, W_BF16)

#define DEFINE_DOT(name, gemm)                                                  \
    static void name(int64_t n, float * s, const void * w, const void * x) {    \
        gemm(n, w, 0, 1, x, 0, 1, s, 1);                                        \
    }

DEFINE_DOT(vec_dot_f32, gemm_f32)
DEFINE_DOT(vec_dot_f16, gemm_f16)
DEFINE_DOT(vec_dot_bf16, gemm_bf16)
/* the quantized types' vec_dot: DEFINE_GEMM_Q */

/* ------------------------------------------------------------------ K-quants x Q8_K
 *
 * One row at a time (rows are read in order: one linear stream), each block's weights
 * unpacked once for every token of the tile (KNT tokens). Per 32 values: one maddubs of
 * the unsigned weights (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63: |pair sums| <= 2 * 63 * 127,
 * no int16 overflow) with the activation bytes, one madd by the sub-block scale; the
 * block's int32 sums are converted once per block. The mins (Q4_K, Q5_K) and the zero
 * point 32 (Q6_K) come from the activations' 16-value sums: one madd per block. */

#define KNT 4
#define K_PF_BYTES 1024 /* software prefetch distance along the row stream */

/* The 256 weights of a block as 8 vectors of 32 unsigned bytes, vector j = sub-block j
 * (Q4_K, Q5_K), and the sub-block scales as int16 words. */
GH_INLINE void k4_unpack(const bool is_q5, const uint8_t * qs, const uint8_t * qh, __m256i v[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i hb = is_q5 ? _mm256_loadu_si256((const __m256i *) qh) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *) (qs + 32 * c));
        v[2 * c] = _mm256_and_si256(q, m4);
        v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (is_q5) { /* bit j of qh to bit 4 (16-bit shifts: what crosses bytes is masked off) */
            const __m256i s16 = _mm256_set1_epi8(16);
            const __m256i h0 = c < 2 ? _mm256_slli_epi16(hb, 4 - 2 * c) : _mm256_srli_epi16(hb, 2 * c - 4);
            const __m256i h1 = c < 2 ? _mm256_slli_epi16(hb, 3 - 2 * c) : _mm256_srli_epi16(hb, 2 * c - 3);
            v[2 * c] = _mm256_or_si256(v[2 * c], _mm256_and_si256(h0, s16));
            v[2 * c + 1] = _mm256_or_si256(v[2 * c + 1], _mm256_and_si256(h1, s16));
        }
    }
}

/* One Q4_K/Q5_K row against NT tokens' Q8_K rows (token t at x + t * xs): y[t * ldy]. */
GH_INLINE void k4_row(const int NT, const bool is_q5, int64_t n, const uint8_t * w, const uint8_t * pf,
                      const char * x, size_t xs, float * y, int64_t ldy) {
    const size_t bs = is_q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    __m256 acc[KNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t * b = w + i * bs;
        _mm_prefetch((const char *) pf + i * bs, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + 64, GH_PF_HINT);
        /* Q5_K's 176 bytes span four lines when a block starts past a line's 16th byte */
        if (bs > 128) _mm_prefetch((const char *) pf + i * bs + 128, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + bs - 1, GH_PF_HINT);
        uint16_t dh, dmh;
        memcpy(&dh, b, 2);
        memcpy(&dmh, b + 2, 2);
        const float d = _cvtsh_ss(dh), dmin = _cvtsh_ss(dmh);
        const __m128i sm = k4_scales_mins(b + 4);
        const __m256i m16 = k4_mins16(sm);
        __m256i v[8];
        k4_unpack(is_q5, b + 4 + K_SCALE_SIZE + (is_q5 ? QK_K / 8 : 0), b + 4 + K_SCALE_SIZE, v);
        /* scale j into every word: one byte shuffle each (a broadcast would take three) */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        __m256i sc[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) sc[j] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short) (0x0100 * (2 * j + 1) + 2 * j)));
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *) (yb->qs + 32 * j));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(v[j], a), sc[j]));
            }
            /* the mins in the same vector: - dmin * sum_j m_j * (the sub-block's activation sum) */
            const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) yb->bsums), m16);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * yb->d), _mm256_cvtepi32_ps(s), acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * yb->d), _mm256_cvtepi32_ps(ms), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum(acc[t]);
}

/* The scales of 16 sub-blocks of 16 (Q6_K, Q2_K, Q3_K; sc16: word j = sub-block j's) for
 * the value vectors of 32: vector j holds 2j's in its low lane, 2j + 1's in its high lane. */
GH_INLINE void k16_scales(const __m256i sc16, __m256i sc[8]) {
    const __m256i s_lo = _mm256_permute4x64_epi64(sc16, 0x44), s_hi = _mm256_permute4x64_epi64(sc16, 0xee);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const int k = 2 * (j & 3);
        const __m256i ctrl = _mm256_setr_epi8(
            2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1,
            2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1,
            2 * k + 2, 2 * k + 3, 2 * k + 2, 2 * k + 3, 2 * k + 2, 2 * k + 3, 2 * k + 2, 2 * k + 3,
            2 * k + 2, 2 * k + 3, 2 * k + 2, 2 * k + 3, 2 * k + 2, 2 * k + 3, 2 * k + 2, 2 * k + 3);
        sc[j] = _mm256_shuffle_epi8(j < 4 ? s_lo : s_hi, ctrl);
    }
}

/* One Q6_K row against NT tokens. */
GH_INLINE void k6_row(const int NT, int64_t n, const uint8_t * w, const uint8_t * pf, const char * x,
                      size_t xs, float * y, int64_t ldy) {
    const size_t bs = sizeof(block_q6_K);
    __m256 acc[KNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_q6_K * b = (const block_q6_K *) (w + i * bs);
        _mm_prefetch((const char *) pf + i * bs, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + 64, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + 128, GH_PF_HINT);
        /* 210 bytes span five lines when a block starts in a line's last 17 bytes */
        _mm_prefetch((const char *) pf + i * bs + 192, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + bs - 1, GH_PF_HINT);
        const float d = _cvtsh_ss(b->d);
        __m256i v[8]; /* 32 values each: vector 4h + g = half h, group g */
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *) (b->ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *) (b->ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *) (b->qh + 32 * h));
            v[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
            v[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
            v[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
            v[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
        }
        /* scales: vector j holds sub-block 2j's scale in words 0..7, 2j + 1's in 8..15 */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) b->scales));
        __m256i sc[8];
        k16_scales(sc16, sc);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *) (yb->qs + 32 * j));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(v[j], a), sc[j]));
            }
            /* - 32 * sum_j scale_j * bsums_j */
            const __m256i z = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) yb->bsums), sc16);
            s = _mm256_sub_epi32(s, _mm256_slli_epi32(z, 5));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * yb->d), _mm256_cvtepi32_ps(s), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum(acc[t]);
}

/* Q2_K and Q3_K: 16 sub-blocks of 16, laid out as Q6_K's (vector 4h + g of 32 values =
 * half h, group g = sub-blocks 2 (4h + g) and 2 (4h + g) + 1, one per 128-bit lane), so the
 * scales go to the words as Q6_K's. Q2_K: the 2-bit values 0..3 and 4-bit scales; its
 * mins from the bsums (one madd), as Q4_K's. Q3_K: the values as unsigned 0..7 (the high
 * bit of hmask shifted in, as Q5_K's fifth bit), the 6-bit signed scales decoded in the
 * vector unit, and the zero point 4 from the bsums, as Q6_K's 32. maddubs pairs are at
 * most 2 * 7 * 127: no int16 overflow. */

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

/* One Q2_K (is_q3 false) or Q3_K row against NT tokens. */
GH_INLINE void k2_row(const int NT, const bool is_q3, int64_t n, const uint8_t * w, const uint8_t * pf,
                      const char * x, size_t xs, float * y, int64_t ldy) {
    const size_t bs = is_q3 ? sizeof(block_q3_K) : sizeof(block_q2_K);
    __m256 acc[KNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t * b = w + i * bs;
        _mm_prefetch((const char *) pf + i * bs, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + bs - 1, GH_PF_HINT);
        const uint8_t * qs = is_q3 ? ((const block_q3_K *) b)->qs : ((const block_q2_K *) b)->qs;
        __m256i v[8];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *) (qs + 32 * h));
            v[4 * h + 0] = _mm256_and_si256(q, m3);
            v[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 2), m3);
            v[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m3);
            v[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(q, 6), m3);
        }
        __m256i sc16, m16 = _mm256_setzero_si256();
        float d, dmin = 0.0f;
        if (is_q3) {
            const block_q3_K * bq = (const block_q3_K *) b;
            /* bit k of hmask[l] is bit 2 of vector k's value l */
            const __m256i hm = _mm256_loadu_si256((const __m256i *) bq->hmask);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i hk = k < 2 ? _mm256_slli_epi16(hm, 2 - k) : _mm256_srli_epi16(hm, k - 2);
                v[k] = _mm256_or_si256(v[k], _mm256_and_si256(hk, b2));
            }
            sc16 = _mm256_cvtepi8_epi16(k3_scales(bq->scales));
            d = _cvtsh_ss(bq->d);
        } else {
            const block_q2_K * bq = (const block_q2_K *) b;
            const __m128i s8 = _mm_loadu_si128((const __m128i *) bq->scales);
            const __m128i m4 = _mm_set1_epi8(0x0f);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s8, m4));
            m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), m4));
            d = _cvtsh_ss(bq->d);
            dmin = _cvtsh_ss(bq->dmin);
        }
        __m256i sc[8];
        k16_scales(sc16, sc);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *) (yb->qs + 32 * j));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(v[j], a), sc[j]));
            }
            const __m256i bsums = _mm256_loadu_si256((const __m256i *) yb->bsums);
            if (is_q3) { /* - 4 * sum_j scale_j * bsums_j */
                s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 2));
            } else { /* the mins: - dmin * sum_j m_j * bsums_j */
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * yb->d), _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, m16)),
                                         acc[t]);
            }
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * yb->d), _mm256_cvtepi32_ps(s), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum(acc[t]);
}

enum { K_Q4, K_Q5, K_Q6, K_Q2, K_Q3 };

GH_INLINE void k_row(const int NT, const int kind, int64_t n, const uint8_t * w, const uint8_t * pf,
                     const char * x, size_t xs, float * y, int64_t ldy) {
    if (kind == K_Q6) k6_row(NT, n, w, pf, x, xs, y, ldy);
    else if (kind == K_Q2 || kind == K_Q3) k2_row(NT, kind == K_Q3, n, w, pf, x, xs, y, ldy);
    else k4_row(NT, kind == K_Q5, n, w, pf, x, xs, y, ldy);
}

#include "cpu/kq_driver.h"

#define DEFINE_K(sfx, KIND) KQ_DEFINE(static, gemm_##sfx, vec_dot_##sfx, dot4_##sfx, KIND)

DEFINE_K(q4_K, K_Q4)
DEFINE_K(q5_K, K_Q5)
DEFINE_K(q6_K, K_Q6)
DEFINE_K(q2_K, K_Q2)
DEFINE_K(q3_K, K_Q3)

/* Q8_K activations: gh_quantize_row_q8_K_ref, byte for byte (the rounding of round_away,
 * the same d and 1 / d). */
static void q8_K_from_float_x(const float * x, void * dst, int64_t n) {
    block_q8_K * yb = dst;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < n / QK_K; b++, x += QK_K) {
        __m256 m = _mm256_setzero_ps(), un = _mm256_setzero_ps();
        for (int k = 0; k < QK_K; k += 8) {
            const __m256 v = _mm256_loadu_ps(x + k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
            un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm256_movemask_ps(un) ? NAN : _mm_cvtss_f32(m4) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        yb[b].d = d;
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int k = 0; k < QK_K; k += 32) {
            __m256i q[4];
            for (int j = 0; j < 4; j++) q[j] = round_away(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * j), vid));
            const __m256i p = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
            _mm256_storeu_si256((__m256i *) (yb[b].qs + k), p);
            /* 16-value sums: q[0] + q[1] (values k..k+15) and q[2] + q[3] */
            for (int h = 0; h < 2; h++) {
                const __m256i s8 = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
                yb[b].bsums[k / 16 + h] = (int16_t) _mm_cvtsi128_si32(s4);
            }
        }
    }
}

/* ------------------------------------------------------------------ the table */

/* The AVX2 rows of the dot family (cpu/kernels.h). */
const gh_kernel_set gh_dot_rows_avx2[GH_TYPE_COUNT] = {
    [GH_TYPE_F32]  = GH_DOT_ROW(vec_dot_f32, NULL, gemm_f32, F_MR, F_NT, 4, dot4_f32),
    [GH_TYPE_F16]  = GH_DOT_ROW(vec_dot_f16, NULL, gemm_f16, F_MR, F_NT, 4, dot4_f16),
    [GH_TYPE_BF16] = GH_DOT_ROW(vec_dot_bf16, bf16_from_float_x, gemm_bf16, F_MR, F_NT, 4, dot4_bf16),
    [GH_TYPE_Q8_0] = GH_DOT_ROW(vec_dot_q8_0, q8_x4_from_float_x, gemm_q8_0, 4, QNT, 4, dot4_q8_0),
    [GH_TYPE_Q4_0] = GH_DOT_ROW(vec_dot_q4_0, q8_x4_from_float_x, gemm_q4_0, 4, QNT, 4, dot4_q4_0),
    [GH_TYPE_Q4_1] = GH_DOT_ROW(vec_dot_q4_1, q8_x4_from_float_x, gemm_q4_1, 4, QNT, 4, dot4_q4_1),
    [GH_TYPE_Q5_0] = GH_DOT_ROW(vec_dot_q5_0, q8_x4_from_float_x, gemm_q5_0, 4, QNT, 4, dot4_q5_0),
    [GH_TYPE_Q5_1] = GH_DOT_ROW(vec_dot_q5_1, q8_x4_from_float_x, gemm_q5_1, 4, QNT, 4, dot4_q5_1),
    [GH_TYPE_Q4_K] = GH_DOT_ROW(vec_dot_q4_K, q8_K_from_float_x, gemm_q4_K, 4, KNT, 4, dot4_q4_K),
    [GH_TYPE_Q5_K] = GH_DOT_ROW(vec_dot_q5_K, q8_K_from_float_x, gemm_q5_K, 4, KNT, 4, dot4_q5_K),
    [GH_TYPE_Q6_K] = GH_DOT_ROW(vec_dot_q6_K, q8_K_from_float_x, gemm_q6_K, 4, KNT, 4, dot4_q6_K),
    [GH_TYPE_Q2_K] = GH_DOT_ROW(vec_dot_q2_K, q8_K_from_float_x, gemm_q2_K, 4, KNT, 4, dot4_q2_K),
    [GH_TYPE_Q3_K] = GH_DOT_ROW(vec_dot_q3_K, q8_K_from_float_x, gemm_q3_K, 4, KNT, 4, dot4_q3_K),
    /* the non-linear 4-bit types: kernels in kernels_iq4_avx2.c */
    /* IQ4_NL prompts: 8 rows x up to 64 tokens (the rows rearranged per call) */
    [GH_TYPE_IQ4_NL] = GH_DOT_ROW(gh_avx2_vec_dot_iq4_nl, q8_x4_from_float_x, gh_avx2_gemm_iq4_nl, GH_NL8_AVX2_MR,
                                  GH_NL8_AVX2_NT, 4, gh_avx2_dot4_iq4_nl),
    /* MXFP4 (its tile: kernels_iq4_avx2.c) keeps the driver's 6 tokens, not measured at 12 */
    [GH_TYPE_MXFP4]  = GH_DOT_ROW(gh_avx2_vec_dot_mxfp4, q8_x4_from_float_x, gh_avx2_gemm_mxfp4, 4, 6, 4,
                                  gh_avx2_dot4_mxfp4),
    [GH_TYPE_IQ4_XS] = GH_DOT_ROW(gh_avx2_vec_dot_iq4_xs, q8_K_from_float_x, gh_avx2_gemm_iq4_xs, 4, GH_IQ4_AVX2_NT, 4,
                                  gh_avx2_dot4_iq4_xs),
#if GH_IQ_GRIDS
    /* the IQ lattice types: kernels in kernels_iqlat_avx2.c (tiles of row dots) */
#define IQLAT_ROW(T) GH_DOT_ROW(gh_avx2_vec_dot_##T, q8_K_from_float_x, gh_avx2_gemm_##T, 4, KNT, 4, NULL)
    [GH_TYPE_IQ2_XXS] = IQLAT_ROW(iq2_xxs),
    [GH_TYPE_IQ2_XS]  = IQLAT_ROW(iq2_xs),
    [GH_TYPE_IQ2_S]   = IQLAT_ROW(iq2_s),
    [GH_TYPE_IQ3_XXS] = IQLAT_ROW(iq3_xxs),
    [GH_TYPE_IQ3_S]   = IQLAT_ROW(iq3_s),
    [GH_TYPE_IQ1_S]   = IQLAT_ROW(iq1_s),
    [GH_TYPE_IQ1_M]   = IQLAT_ROW(iq1_m),
#undef IQLAT_ROW
#endif
};

/* F16 decode with its rows read one after another (simd.c: on AMD parts; see
 * gemm_f16_streamed). */
const gh_kernel_set gh_dot_row_avx2_f16_streamed = GH_DOT_ROW(vec_dot_f16, NULL, gemm_f16_streamed, F_MR,
                                                              F_NT, 4, dot4_f16);
