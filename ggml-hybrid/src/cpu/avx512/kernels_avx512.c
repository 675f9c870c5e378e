/* AVX-512 kernels (F, BW, VL, DQ, VNNI, VBMI, BF16, GFNI; simd.c checks the CPU has them).
 *
 * Every type is a register tile of MR weight rows x NT tokens: the rows' data is loaded
 * (and unpacked) once per step and used for every token of the tile, the activations
 * once and used for every row. One tile function per type is written with MR and NT
 * as parameters and instantiated for fixed sizes (always_inline + constant arguments),
 * so the accumulators live in registers.
 *
 *   F32   x F32 : FMA
 *   F16   x F32 : vcvtph2ps + FMA
 *   BF16  x BF16: vdpbf16ps (32 products per instruction)
 *   Q8_0  x Q8_X4, Q4_0 x Q8_X4: vpdpbusd on four blocks per register (one block per
 *         128-bit lane). The weight bytes of four blocks are gathered from their 18- or
 *         34-byte blocks with vpermt2b; VNNI wants unsigned x signed, so Q4_0 uses the
 *         raw nibbles (0..15) and Q8_0 the bytes + 128, and the accumulator starts at
 *         -8 (-128) times the activation block sum, which Q8_X4 carries.
 *   Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 x Q8_X4: the same scheme, in kernels_b32_avx512.c;
 *   Q2_K, Q3_K, IQ4_XS x Q8_K: in kernels_k2_avx512.c (the K-quant scheme below).
 *
 * Tiles: 4 rows x 6 tokens for the float types, 4 x 4 for the quantized ones. Decode
 * (one token) runs 4-row tiles; the quantized ones transpose the four rows' block sums
 * into one register before scaling (q_step_r4). Decode tiles prefetch the rows of the
 * tile GH_PF_TILES ahead into L2, as one linear stream: a tile's rows are four short
 * streams (1-11 KB) that the hardware prefetcher picks up late.
 *
 * F16 decode with short rows (f16_row; AMD only, see f16_rows_streamed) is the exception:
 * it reads a tile's rows one after the other, without software prefetch, so the weights
 * are one linear stream that the hardware prefetcher follows across rows (AMD Zen 4, 1
 * thread, 2048 columns: 26-31
 * GB/s against 24-25 for the interleaved tile; the 22-layer bench model decodes ~12%
 * faster). It needs x and the row being read to stay in L1; with longer rows the f32 x
 * is evicted by the weight stream every row and the interleaved tile is faster (2048 x
 * 5632: 22 vs 17 GB/s). A row sums exactly as in the tile (one accumulator, 16 values
 * per step), so the values, and the gathered-row tile's equality with them, are kept.
 * Four accumulators per row were no faster and slower at some alignments of x. */

#include "cpu/avx2/k4_scales.h"
#include "cpu/avx512/kernels_avx512.h"
#include "cpu/kernels.h"
#include "cpu/prefetch.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define GH_INLINE static inline __attribute__((always_inline))
#define MAXR 4
#define MAXT 8

/* Loads `avail` bytes (clamped to 0..64) at p, zero-filling the rest, without reading
 * past them. */
GH_INLINE __m512i load_part(const uint8_t * p, int64_t avail) {
    if (avail >= 64) return _mm512_loadu_si512(p);
    if (avail <= 0) return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi8(((__mmask64) 1 << avail) - 1, p);
}

/* ------------------------------------------------------------------ F32, F16 */

GH_INLINE __m512 load_f32(const float * p, __mmask16 m, bool full) {
    return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}

GH_INLINE __m512 load_f16(const uint16_t * p, __mmask16 m, bool full) {
    __m256i h = full ? _mm256_loadu_si256((const __m256i *) p) : _mm256_maskz_loadu_epi16(m, p);
    return _mm512_cvtph_ps(h);
}

/* is_f16: weights are fp16 (else f32); activations are f32. */
GH_INLINE void tile_f(const int MR, const int NT, const bool is_f16, int64_t n, const void * w,
                      size_t ws, const void * x, size_t xs, float * y, int64_t ldy) {
    __m512 acc[MAXR][MAXT];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();

    const char * wb = w;
    const char * xb = x;
    const size_t wsz = is_f16 ? 2 : 4;
    const char * pf = wb + GH_PF_TILES * MR * ws; /* see tile_q_r4 */
    for (int64_t i = 0; i < n; i += 16) {
        const bool full = i + 16 <= n;
        const __mmask16 m = full ? 0xffff : (__mmask16) ((1u << (n - i)) - 1);
        if (NT == 1) {
#pragma GCC unroll 8
            for (size_t k = 0; k < MR * 16 * wsz; k += 64) _mm_prefetch(pf + k, GH_PF_HINT);
            pf += MR * 16 * wsz;
        }
        __m512 wv[MAXR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            wv[r] = is_f16 ? load_f16((const uint16_t *) (wb + r * ws) + i, m, full)
                           : load_f32((const float *) (wb + r * ws) + i, m, full);
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const __m512 xv = load_f32((const float *) (xb + t * xs) + i, m, full);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* ------------------------------------------------------------------ BF16 */

GH_INLINE void tile_bf16(const int MR, const int NT, int64_t n, const void * w, size_t ws,
                         const void * x, size_t xs, float * y, int64_t ldy) {
    __m512 acc[MAXR][MAXT];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();

    const char * wb = w;
    const char * xb = x;
    const char * pf = wb + GH_PF_TILES * MR * ws; /* see tile_q_r4 */
    for (int64_t i = 0; i < n; i += 32) {
        const bool full = i + 32 <= n;
        const __mmask32 m = full ? 0xffffffffu : (__mmask32) ((1ull << (n - i)) - 1);
        if (NT == 1) {
#pragma GCC unroll 8
            for (size_t k = 0; k < (size_t) MR * 64; k += 64) _mm_prefetch(pf + k, GH_PF_HINT);
            pf += MR * 64;
        }
        __m512bh wv[MAXR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const uint16_t * p = (const uint16_t *) (wb + r * ws) + i;
            wv[r] = (__m512bh) (full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p));
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const uint16_t * p = (const uint16_t *) (xb + t * xs) + i;
            const __m512bh xv = (__m512bh) (full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p));
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

static void bf16_from_float_x(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
        _mm512_storeu_si512(d + i, (__m512i) v);
    }
    for (; i < n; i++) d[i] = gh_fp32_to_bf16(src[i]);
}

/* ------------------------------------------------------------------ Q8_X4 activations */

/* roundf (half away from zero) of 16 floats, as the scalar reference does. */
GH_INLINE __m512i round_away(__m512 v) {
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_abs_ps(_mm512_sub_ps(v, t));
    const __mmask16 up = _mm512_cmp_ps_mask(f, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f),
                                    _mm512_and_ps(v, _mm512_castsi512_ps(_mm512_set1_epi32((int) 0x80000000u))));
    /* clamped to the int8 codes: a finite activation's code is within them already; a
     * non-finite one (a NaN or an overflowed row: the output is NaN either way) converts
     * to INT_MIN, whose sums would overflow; the scalar reference clamps alike */
    const __m512i q = _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, one));
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

static void q8_x4_from_float_x(const float * x, void * dst, int64_t n) {
    const int64_t nb = n / QK8_0;
    const int64_t ng = (nb + 3) / 4;
    block_q8_x4 * g = dst;
    if (nb % 4) memset(&g[ng - 1], 0, sizeof *g);
    for (int64_t b = 0; b < nb; b++) {
        block_q8_x4 * yg = &g[b / 4];
        const int i = (int) (b % 4);
        const __m512 v0 = _mm512_loadu_ps(x + b * QK8_0);
        const __m512 v1 = _mm512_loadu_ps(x + b * QK8_0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        /* (max drops a NaN: the reference's NaN block scale, from a separate test) */
        const bool nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        const float d = nan ? NAN : amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i q0 = round_away(_mm512_mul_ps(v0, vid));
        const __m512i q1 = round_away(_mm512_mul_ps(v1, vid));
        _mm_storeu_si128((__m128i *) &yg->qa[16 * i], _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *) &yg->qb[16 * i], _mm512_cvtepi32_epi8(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        yg->nsum[4 * i] = yg->nsum[4 * i + 1] = yg->nsum[4 * i + 2] = yg->nsum[4 * i + 3] = -sum;
        yg->d[4 * i] = yg->d[4 * i + 1] = yg->d[4 * i + 2] = yg->d[4 * i + 3] = d;
    }
}

/* ------------------------------------------------------------------ Q4_0, Q8_0 */

/* One weight row's group of four blocks, unpacked: unsigned bytes of values 0..15 of
 * each block (lane i = block i), of values 16..31, and the block scales (4 per lane). */
typedef struct {
    __m512i lo, hi;
    __m256i d;   /* fp16 */
    __m512i a;   /* Q4_0: the group's first 64 bytes (for q_step_r4) */
} wgroup;

/* Q4_0: block i's 16 bytes at 18i + 2 of the group; blocks 0..2 are read from the
 * group's first 64 bytes (a), block 3 from a 16-byte load at byte 56 (b). */
static const uint8_t Q4_QS_IDX[64] __attribute__((aligned(64))) = {
#define R(i) 18 * i + 2, 18 * i + 3, 18 * i + 4, 18 * i + 5, 18 * i + 6, 18 * i + 7, 18 * i + 8, 18 * i + 9, \
             18 * i + 10, 18 * i + 11, 18 * i + 12, 18 * i + 13, 18 * i + 14, 18 * i + 15, 18 * i + 16, 18 * i + 17
    R(0), R(1), R(2),
#undef R
    64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79,
};
static const uint16_t Q4_D_IDX[32] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 9, 9, 9, 9, 18, 18, 18, 18, 27, 27, 27, 27,
};
/* word 4i + r: block i's scale from row r's first 64 bytes (rows 0, 2: table a, 1, 3: b) */
static const uint16_t Q4_D4_IDX[32] __attribute__((aligned(64))) = {
    0, 32, 0, 32, 9, 41, 9, 41, 18, 50, 18, 50, 27, 59, 27, 59,
};
/* Q8_0: values 0..15 of block i at byte 34i + 2 of [a0 a1] (bytes 0..127 of the
 * group); values 16..31 at byte 34i + 18, read from [c0 c1] = bytes 8..135. */
static const uint8_t Q8_LO_IDX[64] __attribute__((aligned(64))) = {
#define R(i) 34 * i + 2, 34 * i + 3, 34 * i + 4, 34 * i + 5, 34 * i + 6, 34 * i + 7, 34 * i + 8, 34 * i + 9, \
             34 * i + 10, 34 * i + 11, 34 * i + 12, 34 * i + 13, 34 * i + 14, 34 * i + 15, 34 * i + 16, 34 * i + 17
    R(0), R(1), R(2), R(3)
#undef R
};
static const uint8_t Q8_HI_IDX[64] __attribute__((aligned(64))) = {
#define R(i) 34 * i + 10, 34 * i + 11, 34 * i + 12, 34 * i + 13, 34 * i + 14, 34 * i + 15, 34 * i + 16, 34 * i + 17, \
             34 * i + 18, 34 * i + 19, 34 * i + 20, 34 * i + 21, 34 * i + 22, 34 * i + 23, 34 * i + 24, 34 * i + 25
    R(0), R(1), R(2), R(3)
#undef R
};
static const uint16_t Q8_D_IDX[32] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 17, 17, 17, 17, 34, 34, 34, 34, 51, 51, 51, 51,
};

/* p: the group's first block; avail: bytes of the row left from p (>= one block). */
GH_INLINE wgroup unpack_q4_0(const uint8_t * p, int64_t avail) {
    __m512i a, b;
    if (avail >= 4 * (int64_t) sizeof(block_q4_0)) {
        a = _mm512_loadu_si512(p);
        b = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *) (p + 56)));
    } else {
        a = load_part(p, avail);
        b = _mm512_setzero_si512();
    }
    const __m512i q = _mm512_permutex2var_epi8(a, _mm512_load_si512(Q4_QS_IDX), b);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    wgroup g;
    g.lo = _mm512_and_si512(q, m4);
    /* bytes >> 4 in one instruction: a GF(2) affine map whose matrix moves bit i + 4
     * to bit i */
    g.hi = _mm512_gf2p8affine_epi64_epi8(q, _mm512_set1_epi64(0x1020408000000000ll), 0);
    g.d = _mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_load_si512(Q4_D_IDX), a));
    g.a = a;
    return g;
}

GH_INLINE wgroup unpack_q8_0(const uint8_t * p, int64_t avail) {
    __m512i a0, a1, c0, c1;
    if (avail >= 4 * (int64_t) sizeof(block_q8_0)) {
        a0 = _mm512_loadu_si512(p);
        a1 = _mm512_loadu_si512(p + 64);
        c0 = _mm512_loadu_si512(p + 8);
        c1 = _mm512_loadu_si512(p + 72);
    } else {
        a0 = load_part(p, avail);
        a1 = load_part(p + 64, avail - 64);
        c0 = load_part(p + 8, avail - 8);
        c1 = load_part(p + 72, avail - 72);
    }
    const __m512i bias = _mm512_set1_epi8((char) 0x80);
    wgroup g;
    g.lo = _mm512_xor_si512(_mm512_permutex2var_epi8(a0, _mm512_load_si512(Q8_LO_IDX), a1), bias);
    g.hi = _mm512_xor_si512(_mm512_permutex2var_epi8(c0, _mm512_load_si512(Q8_HI_IDX), c1), bias);
    g.d = _mm512_castsi512_si256(_mm512_permutex2var_epi16(a0, _mm512_load_si512(Q8_D_IDX), a1));
    return g;
}

/* acc[r][t] += W[r] . X[t] over group g, the weights already unpacked. */
GH_INLINE void q_step(const int MR, const int NT, const bool is_q4, const wgroup * u,
                      const char * xb, size_t xs, int64_t g, __m512 acc[MAXR][MAXT]) {
    __m512 dw[MAXR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) dw[r] = _mm512_cvtph_ps(u[r].d);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const block_q8_x4 * xg = (const block_q8_x4 *) (xb + t * xs) + g;
        /* -8 (-128) * block sum, in one lane per block */
        const __m512i nsum = _mm512_loadu_si512(xg->nsum);
        const __m512i corr = _mm512_maskz_slli_epi32(0x1111, nsum, is_q4 ? 3 : 7);
        const __m512i xa = _mm512_loadu_si512(xg->qa);
        const __m512i xc = _mm512_loadu_si512(xg->qb);
        const __m512 dx = _mm512_loadu_ps(xg->d);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            __m512i s = _mm512_dpbusd_epi32(corr, u[r].lo, xa);
            s = _mm512_dpbusd_epi32(s, u[r].hi, xc);
            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[r], dx), acc[r][t]);
        }
    }
}

/* Four rows, one token (decode): the per-block integer sums of the four rows are
 * transposed into one register (lane 4i + r: block i, row r) before they are scaled,
 * so the float work and the activation terms are done once for the four rows. */
GH_INLINE void q_step_r4(const bool is_q4, const wgroup * u, const block_q8_x4 * xg, __m512 * acc) {
    const __m512i s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0].lo, _mm512_loadu_si512(xg->qa)), u[0].hi, _mm512_loadu_si512(xg->qb));
    const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1].lo, _mm512_loadu_si512(xg->qa)), u[1].hi, _mm512_loadu_si512(xg->qb));
    const __m512i s2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[2].lo, _mm512_loadu_si512(xg->qa)), u[2].hi, _mm512_loadu_si512(xg->qb));
    const __m512i s3 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[3].lo, _mm512_loadu_si512(xg->qa)), u[3].hi, _mm512_loadu_si512(xg->qb));
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
    __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    s = _mm512_add_epi32(s, _mm512_slli_epi32(_mm512_loadu_si512(xg->nsum), is_q4 ? 3 : 7));
    /* fp16 scales, word 4i + r = row r's block i */
    __m256i d;
    if (is_q4) { /* straight from the rows' first 64 bytes, two rows per permute */
        const __m512i idx = _mm512_load_si512(Q4_D4_IDX);
        const __m512i d01 = _mm512_permutex2var_epi16(u[0].a, idx, u[1].a);
        const __m512i d23 = _mm512_permutex2var_epi16(u[2].a, idx, u[3].a);
        d = _mm512_castsi512_si256(_mm512_mask_blend_epi16(0xcccccccc, d01, d23));
    } else {
        d = _mm256_mask_blend_epi16(0x2222, u[0].d, u[1].d);
        d = _mm256_mask_blend_epi16(0x4444, d, u[2].d);
        d = _mm256_mask_blend_epi16(0x8888, d, u[3].d);
    }
    const __m512 scale = _mm512_mul_ps(_mm512_cvtph_ps(d), _mm512_loadu_ps(xg->d));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, *acc);
}

/* One step of a four-row quantized tile: a group of four blocks of each row p[r] (avail
 * bytes of it: a whole group, or what a row's last partial group holds) against the
 * activations' group xg. */
GH_INLINE void q_group_r4(const bool is_q4, const uint8_t * const * p, int64_t avail,
                          const block_q8_x4 * xg, __m512 * acc) {
    wgroup u[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) u[r] = is_q4 ? unpack_q4_0(p[r], avail) : unpack_q8_0(p[r], avail);
    q_step_r4(is_q4, u, xg, acc);
}

/* lanes 4i + r -> y[r] */
GH_INLINE void r4_store(__m512 acc, float * y) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(y, q);
}

/* Four rows, NT tokens: the one-token sums (q_step_r4) for each token (each group's rows unpacked once
 * for all of them), so a batch's logits equal its tokens' one by one bit for bit. Summing
 * otherwise (per lane in float, as q_step) differs by rounding that the activations' int8
 * codes then amplify: SmolLM2 Q8_0 batched against one-token logits were 2.2e-2 of their
 * range apart, and speculative verification changed greedy text. */
GH_INLINE void tile_q_r4n(const int NT, const bool is_q4, int64_t n, const void * w, size_t ws,
                          const void * x, size_t xs, float * y, int64_t ldy) {
    __m512 acc[MAXT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    const int64_t nb = n / 32;
    const size_t bs = is_q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const uint8_t * wb = w;
    const int64_t ng_full = nb / 4;
    /* the four rows are short streams the hardware prefetcher misses: tile_q_r4's linear
     * prefetch of the tiles GH_PF_TILES ahead (without it a 49152 x 576 Q8_0 head ran 2
     * tokens at 2.2x the time of one) */
    const uint8_t * pf = wb + GH_PF_TILES * 4 * ws;
    for (int64_t g = 0; g < ng_full; g++) {
#pragma GCC unroll 8
        for (size_t k = 0; k < 4 * 4 * bs; k += 64) _mm_prefetch((const char *) pf + k, GH_PF_HINT);
        pf += 4 * 4 * bs;
        /* a whole group's size as a constant: the unpacking's full-width loads */
        const uint8_t * p[4] = { wb + 4 * g * bs, wb + ws + 4 * g * bs, wb + 2 * ws + 4 * g * bs,
                                 wb + 3 * ws + 4 * g * bs };
        wgroup u[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) u[r] = is_q4 ? unpack_q4_0(p[r], 4 * (int64_t) bs) : unpack_q8_0(p[r], 4 * (int64_t) bs);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            q_step_r4(is_q4, u, (const block_q8_x4 *) ((const char *) x + t * xs) + g, &acc[t]);
        }
    }
    if (nb % 4) {
#pragma GCC unroll 8
        for (size_t k = 0; k < 4 * (size_t) (nb % 4) * bs; k += 64) _mm_prefetch((const char *) pf + k, GH_PF_HINT);
        const int64_t g = ng_full, avail = (nb % 4) * (int64_t) bs;
        const uint8_t * p[4] = { wb + 4 * g * bs, wb + ws + 4 * g * bs, wb + 2 * ws + 4 * g * bs,
                                 wb + 3 * ws + 4 * g * bs };
        wgroup u[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) u[r] = is_q4 ? unpack_q4_0(p[r], avail) : unpack_q8_0(p[r], avail);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            q_step_r4(is_q4, u, (const block_q8_x4 *) ((const char *) x + t * xs) + g, &acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) r4_store(acc[t], y + t * ldy);
}

/* Four rows, one token (decode): lane 4i + r holds row r's block i, the integer sums
 * reduced per block before they are scaled (q_step_r4). */
GH_INLINE void tile_q_r4(const bool is_q4, int64_t n, const void * w, size_t ws, const void * x,
                         float * y) {
    tile_q_r4n(1, is_q4, n, w, ws, x, 0, y, 0);
}

/* is_q4: Q4_0 weights (else Q8_0); the zero point is 8 (128) times the block sum. */
GH_INLINE void tile_q(const int MR, const int NT, const bool is_q4, int64_t n, const void * w,
                      size_t ws, const void * x, size_t xs, float * y, int64_t ldy) {
    if (MR == 4 && NT == 1) {
        tile_q_r4(is_q4, n, w, ws, x, y);
        return;
    }
    __m512 acc[MAXR][MAXT];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();

    const int64_t nb = n / 32;
    const int64_t ng_full = nb / 4;
    const size_t bs = is_q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const uint8_t * wb = w;
    const char * xb = x;
    for (int64_t g = 0; g < ng_full; g++) {
        wgroup u[MAXR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const uint8_t * p = wb + r * ws + 4 * g * bs;
            u[r] = is_q4 ? unpack_q4_0(p, 4 * sizeof(block_q4_0)) : unpack_q8_0(p, 4 * sizeof(block_q8_0));
        }
        q_step(MR, NT, is_q4, u, xb, xs, g, acc);
    }
    if (nb % 4) { /* a last group of 1..3 blocks; the activations are zero-padded */
        const int64_t g = ng_full;
        const int64_t avail = (nb % 4) * (int64_t) bs;
        wgroup u[MAXR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const uint8_t * p = wb + r * ws + 4 * g * bs;
            u[r] = is_q4 ? unpack_q4_0(p, avail) : unpack_q8_0(p, avail);
        }
        q_step(MR, NT, is_q4, u, xb, xs, g, acc);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* ------------------------------------------------------------------ F16 decode rows */

/* Longest F16 row that decode reads row by row (f16_row, see the top): x (4n bytes)
 * and the row (2n) within half of a 32 KiB L1d, so the weight lines streaming through
 * do not evict x. */
#define F16_ROW_MAX_N 2730

/* One row, one accumulator, 16 values per step: the sums of tile_f, one row at a time. */
GH_INLINE float f16_row(int64_t n, const uint16_t * w, const float * x) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (w + i))),
                              _mm512_loadu_ps(x + i), acc);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16) ((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(load_f16(w + i, m, false), load_f32(x + i, m, false), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* ------------------------------------------------------------------ gathered rows */

/* Four rows at arbitrary addresses, one token (kernels.h, gh_dot4_fn). The float form
 * accumulates like tile_f(4, 1) (16 values per step, one accumulator per row); the
 * quantized form is tile_q_r4 with a pointer per row. Each step prefetches the same
 * slice of the rows pf[] into L2, so the next rows of a scattered list stream in while
 * these are computed. */
GH_INLINE void dot4_f(const bool is_f16, int64_t n, const void * const * rows,
                      const void * const * pf, const void * x, float * y) {
    __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps() };
    const float * xf = x;
    const size_t wsz = is_f16 ? 2 : 4;
    const int64_t step = 64 / wsz; /* one cache line of each row per step */
    int64_t i = 0;
    for (; i + step <= n; i += step) {
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) _mm_prefetch((const char *) pf[r] + i * wsz, GH_PF_HINT);
#pragma GCC unroll 4
        for (int j = 0; j < step; j += 16) {
            const __m512 xv = _mm512_loadu_ps(xf + i + j);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const __m512 wv = is_f16 ? load_f16((const uint16_t *) rows[r] + i + j, 0xffff, true)
                                         : load_f32((const float *) rows[r] + i + j, 0xffff, true);
                acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
            }
        }
    }
    for (; i < n; i += 16) {
        const bool full = i + 16 <= n;
        const __mmask16 m = full ? 0xffff : (__mmask16) ((1u << (n - i)) - 1);
        const __m512 xv = load_f32(xf + i, m, full);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m512 wv = is_f16 ? load_f16((const uint16_t *) rows[r] + i, m, full)
                                     : load_f32((const float *) rows[r] + i, m, full);
            acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) y[r] = _mm512_reduce_add_ps(acc[r]);
}

GH_INLINE void dot4_q(const bool is_q4, int64_t n, const void * const * rows,
                      const void * const * pf, const void * x, float * y) {
    __m512 acc = _mm512_setzero_ps();
    const int64_t nb = n / 32;
    const int64_t ng_full = nb / 4;
    const size_t bs = is_q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const block_q8_x4 * xg = x;
    for (int64_t g = 0; g < ng_full; g++) {
        const size_t off = 4 * g * bs;
        /* a group is 72 (136) bytes of each row: its first and last byte cover Q4_0's
         * lines, Q8_0's up to four lines want +64 and +128 too */
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            _mm_prefetch((const char *) pf[r] + off, GH_PF_HINT);
            _mm_prefetch((const char *) pf[r] + off + 4 * bs - 1, GH_PF_HINT);
            if (!is_q4) _mm_prefetch((const char *) pf[r] + off + 64, GH_PF_HINT);
            if (!is_q4) _mm_prefetch((const char *) pf[r] + off + 128, GH_PF_HINT);
        }
        const uint8_t * p[4] = { (const uint8_t *) rows[0] + off, (const uint8_t *) rows[1] + off,
                                 (const uint8_t *) rows[2] + off, (const uint8_t *) rows[3] + off };
        /* Q8_0: the next group of these rows from L2 into L1 (its first and last byte):
         * scattered rows at 10-50% density read 1.1x faster cold (docs/BENCHMARKS.md, "The
         * gathered rows per byte read"); Q4_0, F16 and farther distances measured no gain */
        if (!is_q4) {
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                _mm_prefetch((const char *) p[r] + 4 * bs, _MM_HINT_T0);
                _mm_prefetch((const char *) p[r] + 8 * bs - 1, _MM_HINT_T0);
            }
        }
        q_group_r4(is_q4, p, 4 * (int64_t) bs, xg + g, &acc);
    }
    if (nb % 4) {
        const size_t off = 4 * ng_full * bs;
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) { /* the rows' last 1..3 blocks, as a full group's */
            _mm_prefetch((const char *) pf[r] + off, GH_PF_HINT);
            _mm_prefetch((const char *) pf[r] + off + (nb % 4) * bs - 1, GH_PF_HINT);
        }
        const uint8_t * p[4] = { (const uint8_t *) rows[0] + off, (const uint8_t *) rows[1] + off,
                                 (const uint8_t *) rows[2] + off, (const uint8_t *) rows[3] + off };
        q_group_r4(is_q4, p, (nb % 4) * (int64_t) bs, xg + ng_full, &acc);
    }
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(y, q);
}

static void dot4_f32(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_f(false, n, rows, pf, x, y);
}
static void dot4_f16(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_f(true, n, rows, pf, x, y);
}
/* BF16: tile_bf16(4, 1)'s sums (32 values per step, one accumulator per row) with a
 * pointer per row, the step's line of each pf row prefetched. */
static void dot4_bf16(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
    const uint16_t * xb = x;
    for (int64_t i = 0; i < n; i += 32) {
        const bool full = i + 32 <= n;
        const __mmask32 m = full ? 0xffffffffu : (__mmask32) ((1ull << (n - i)) - 1);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) _mm_prefetch((const char *) pf[r] + 2 * i, GH_PF_HINT);
        const __m512bh xv = (__m512bh) (full ? _mm512_loadu_si512(xb + i) : _mm512_maskz_loadu_epi16(m, xb + i));
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const uint16_t * p = (const uint16_t *) rows[r] + i;
            const __m512bh wv = (__m512bh) (full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p));
            acc[r] = _mm512_dpbf16_ps(acc[r], wv, xv);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) y[r] = _mm512_reduce_add_ps(acc[r]);
}
static void dot4_q8_0(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_q(false, n, rows, pf, x, y);
}
static void dot4_q4_0(int64_t n, const void * const * rows, const void * const * pf, const void * x, float * y) {
    dot4_q(true, n, rows, pf, x, y);
}

/* ------------------------------------------------------------------ dispatch */

/* A full MR x NT tile, or edge tiles: nt == 1 with up to MR rows (decode), else one
 * row at a time with up to NT tokens. */
#define DEFINE_GEMM(name, MR, NT, TILE, ...)                                                   \
    static void name(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                     int nt, float * y, int64_t ldy) {                                        \
        if (nr == MR && nt == NT) { TILE(MR, NT, __VA_ARGS__ n, w, ws, x, xs, y, ldy); return; } \
        if (nt == 1) {                                                                        \
            switch (nr) {                                                                     \
                case 4: TILE(4, 1, __VA_ARGS__ n, w, ws, x, xs, y, ldy); return;              \
                case 3: TILE(3, 1, __VA_ARGS__ n, w, ws, x, xs, y, ldy); return;              \
                case 2: TILE(2, 1, __VA_ARGS__ n, w, ws, x, xs, y, ldy); return;              \
                default: TILE(1, 1, __VA_ARGS__ n, w, ws, x, xs, y, ldy); return;             \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < nr; r++) {                                                        \
            const char * wr = (const char *) w + r * ws;                                      \
            for (int t = 0; t < nt; t += 4) {                                                 \
                const char * xt = (const char *) x + t * xs;                                  \
                float * yt = y + t * ldy + r;                                                 \
                switch (nt - t) {                                                             \
                    case 1: TILE(1, 1, __VA_ARGS__ n, wr, ws, xt, xs, yt, ldy); break;        \
                    case 2: TILE(1, 2, __VA_ARGS__ n, wr, ws, xt, xs, yt, ldy); break;        \
                    case 3: TILE(1, 3, __VA_ARGS__ n, wr, ws, xt, xs, yt, ldy); break;        \
                    default: TILE(1, 4, __VA_ARGS__ n, wr, ws, xt, xs, yt, ldy); break;       \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_GEMM(gemm_f32, 4, 6, tile_f, false,)
DEFINE_GEMM(gemm_f16_tiles, 4, 6, tile_f, true,)

static void gemm_f16(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs,
                     int nt, float * y, int64_t ldy) {
    if (nt == 1 && n <= F16_ROW_MAX_N) {
        for (int r = 0; r < nr; r++) y[r] = f16_row(n, (const uint16_t *) ((const char *) w + r * ws), x);
        return;
    }
    gemm_f16_tiles(n, w, ws, nr, x, xs, nt, y, ldy);
}
DEFINE_GEMM(gemm_bf16, 4, 6, tile_bf16,)
DEFINE_GEMM(gemm_q8_0_rows, 4, 4, tile_q, false,)
DEFINE_GEMM(gemm_q4_0_rows, 4, 4, tile_q, true,)

/* Four rows and any number of tokens through tile_q_r4's sums (see tile_q_r4n), so every
 * token of a batch gets the one-token result; fewer rows as DEFINE_GEMM does (its one-row
 * and multi-token paths sum alike). */
#define DEFINE_GEMM_Q(name, rows, is_q4)                                                       \
    static void name(int64_t n, const void * w, size_t ws, int nr, const void * x, size_t xs, \
                     int nt, float * y, int64_t ldy) {                                        \
        if (nr != 4 || nt == 1) { rows(n, w, ws, nr, x, xs, nt, y, ldy); return; }           \
        for (int t = 0; t < nt; t += MAXT) {                                                  \
            const void * xt = (const char *) x + t * xs;                                      \
            float * yt = y + t * ldy;                                                         \
            switch (nt - t) {                                                                 \
                case 1: tile_q_r4(is_q4, n, w, ws, xt, yt); break;                            \
                case 2: tile_q_r4n(2, is_q4, n, w, ws, xt, xs, yt, ldy); break;               \
                case 3: tile_q_r4n(3, is_q4, n, w, ws, xt, xs, yt, ldy); break;               \
                case 4: tile_q_r4n(4, is_q4, n, w, ws, xt, xs, yt, ldy); break;               \
                case 5: tile_q_r4n(5, is_q4, n, w, ws, xt, xs, yt, ldy); break;               \
                case 6: tile_q_r4n(6, is_q4, n, w, ws, xt, xs, yt, ldy); break;               \
                case 7: tile_q_r4n(7, is_q4, n, w, ws, xt, xs, yt, ldy); break;               \
                default: tile_q_r4n(MAXT, is_q4, n, w, ws, xt, xs, yt, ldy); break;           \
            }                                                                                 \
        }                                                                                     \
    }
DEFINE_GEMM_Q(gemm_q8_0, gemm_q8_0_rows, false)
DEFINE_GEMM_Q(gemm_q4_0, gemm_q4_0_rows, true)

#define DEFINE_DOT(name, gemm)                                                  \
    static void name(int64_t n, float * s, const void * w, const void * x) {    \
        gemm(n, w, 0, 1, x, 0, 1, s, 1);                                        \
    }

DEFINE_DOT(vec_dot_f32, gemm_f32)
DEFINE_DOT(vec_dot_f16, gemm_f16)
DEFINE_DOT(vec_dot_f16_tiles, gemm_f16_tiles)
DEFINE_DOT(vec_dot_bf16, gemm_bf16)
DEFINE_DOT(vec_dot_q8_0, gemm_q8_0)
DEFINE_DOT(vec_dot_q4_0, gemm_q4_0)

/* ------------------------------------------------------------------ K-quants x Q8_K
 *
 * The AVX2 scheme (cpu/avx2/kernels_avx2.c, "K-quants") at 64 values per register: two
 * sub-blocks (Q4_K, Q5_K) or four (Q6_K) per maddubs + madd, the sub-block scales spread
 * over the words by one vpermw. One row at a time, every block unpacked once for the KNT
 * tokens of a tile; the mins and Q6_K's zero point 32 through the activations' 16-value
 * sums. Integer sums equal the scalar reference's exactly; only the float order differs. */

#define KNT 4
#define K_PF_BYTES 1024

/* word w of register c: sub-block 2c + w / 16 (Q4_K, Q5_K); 4c + w / 8 (Q6_K) */
static const uint16_t K4_SC_IDX[4][32] __attribute__((aligned(64))) = {
#define H(a) a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a
    { H(0), H(1) }, { H(2), H(3) }, { H(4), H(5) }, { H(6), H(7) },
#undef H
};
static const uint16_t K6_SC_IDX[4][32] __attribute__((aligned(64))) = {
#define E(a) a, a, a, a, a, a, a, a
    { E(0), E(1), E(2), E(3) }, { E(4), E(5), E(6), E(7) }, { E(8), E(9), E(10), E(11) },
    { E(12), E(13), E(14), E(15) },
#undef E
};

GH_INLINE void k4_row(const int NT, const bool is_q5, int64_t n, const uint8_t * w, const uint8_t * pf,
                      const char * x, size_t xs, float * y, int64_t ldy) {
    const size_t bs = is_q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    __m512 acc[KNT];
    __m256 macc[KNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        acc[t] = _mm512_setzero_ps();
        macc[t] = _mm256_setzero_ps();
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f);
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
        const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
        const uint8_t * qs = b + 4 + K_SCALE_SIZE + (is_q5 ? QK_K / 8 : 0);
        __m512i v[4], sc[4];
        const __m512i hb = is_q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (b + 4 + K_SCALE_SIZE)))
                                 : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *) (qs + 32 * c));
            v[c] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), m4);
            if (is_q5) {
                const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char) (1 << (2 * c))),
                                                        _mm256_set1_epi8((char) (1 << (2 * c + 1))), 1);
                v[c] = _mm512_mask_add_epi8(v[c], _mm512_test_epi8_mask(hb, bits), v[c], _mm512_set1_epi8(16));
            }
            sc[c] = _mm512_permutexvar_epi16(_mm512_load_si512(K4_SC_IDX[c]), sc16);
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m512i a = _mm512_loadu_si512(yb->qs + 64 * c);
                s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(v[c], a), sc[c]));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * yb->d), _mm512_cvtepi32_ps(s), acc[t]);
            const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) yb->bsums), m16);
            macc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * yb->d), _mm256_cvtepi32_ps(ms), macc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        const __m256 m = macc[t];
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        y[t * ldy] = _mm512_reduce_add_ps(acc[t]) - _mm_cvtss_f32(h);
    }
}

GH_INLINE void k6_row(const int NT, int64_t n, const uint8_t * w, const uint8_t * pf, const char * x,
                      size_t xs, float * y, int64_t ldy) {
    const size_t bs = sizeof(block_q6_K);
    __m512 acc[KNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* high bits of values 0..31 | 32..63 of a half: qh << 4 | qh << 2; of 64..95 | 96..127:
     * qh | qh >> 2 (per 16-bit word; the masks drop what crosses bytes) */
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int64_t i = 0; i < n / QK_K; i++) {
        const block_q6_K * b = (const block_q6_K *) (w + i * bs);
        _mm_prefetch((const char *) pf + i * bs, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + 64, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + 128, GH_PF_HINT);
        /* 210 bytes span five lines when a block starts in a line's last 17 bytes */
        _mm_prefetch((const char *) pf + i * bs + 192, GH_PF_HINT);
        _mm_prefetch((const char *) pf + i * bs + bs - 1, GH_PF_HINT);
        const float d = _cvtsh_ss(b->d);
        const __m256i sc16y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) b->scales));
        const __m512i sc16 = _mm512_castsi256_si512(sc16y);
        __m512i v[4], sc[4]; /* register 2h + k: values 128h + 64k .. + 64 */
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512(b->ql + 64 * h);
            const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (b->qh + 32 * h)));
            v[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(hb, shl), m30));
            v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi16(hb, shr), m30));
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) sc[k] = _mm512_permutexvar_epi16(_mm512_load_si512(K6_SC_IDX[k]), sc16);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K * yb = (const block_q8_K *) (x + t * xs) + i;
            __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512i a = _mm512_loadu_si512(yb->qs + 64 * k);
                s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(v[k], a), sc[k]));
            }
            const __m256i z = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) yb->bsums), sc16y);
            s = _mm512_sub_epi32(s, _mm512_castsi256_si512(_mm256_slli_epi32(z, 5)));
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * yb->d), _mm512_cvtepi32_ps(s), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = _mm512_reduce_add_ps(acc[t]);
}

enum { K_Q4, K_Q5, K_Q6 };

GH_INLINE void k_row(const int NT, const int kind, int64_t n, const uint8_t * w, const uint8_t * pf,
                     const char * x, size_t xs, float * y, int64_t ldy) {
    if (kind == K_Q6) k6_row(NT, n, w, pf, x, xs, y, ldy);
    else k4_row(NT, kind == K_Q5, n, w, pf, x, xs, y, ldy);
}

#include "cpu/kq_driver.h"

#define DEFINE_K(sfx, KIND) KQ_DEFINE(static, gemm_##sfx, vec_dot_##sfx, dot4_##sfx, KIND)

DEFINE_K(q4_K, K_Q4)
DEFINE_K(q5_K, K_Q5)
DEFINE_K(q6_K, K_Q6)

/* Q8_K activations, byte for byte gh_quantize_row_q8_K_ref. */
static void q8_K_from_float_x(const float * x, void * dst, int64_t n) {
    block_q8_K * yb = dst;
    for (int64_t b = 0; b < n / QK_K; b++, x += QK_K) {
        __m512 m = _mm512_setzero_ps();
        __mmask16 un = 0;
        for (int k = 0; k < QK_K; k += 16) {
            const __m512 v = _mm512_loadu_ps(x + k);
            m = _mm512_max_ps(m, _mm512_abs_ps(v));
            un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        const float d = un ? NAN : _mm512_reduce_max_ps(m) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        yb[b].d = d;
        for (int k = 0; k < QK_K; k += 16) {
            const __m512i q = round_away(_mm512_mul_ps(_mm512_loadu_ps(x + k), vid));
            _mm_storeu_si128((__m128i *) (yb[b].qs + k), _mm512_cvtepi32_epi8(q));
            yb[b].bsums[k / 16] = (int16_t) _mm512_reduce_add_epi32(q);
        }
    }
}

/* ------------------------------------------------------------------ the table */

/* The AVX-512 rows of the dot family (cpu/kernels.h). F16 decode: the interleaved tile;
 * the selection takes gh_dot_row_avx512_f16_streamed (rows read one after another)
 * instead on AMD parts: measured faster on Zen 4 (26-31 against 24-25 GB/s) but 1.5-2.5x
 * slower than the tile on the Intel Xeon of docs/BENCHMARKS.md's AVX-512 runs (its
 * prefetcher does not follow the row stream). Both sum each row in the same order: same
 * values. */
const gh_kernel_set gh_dot_rows_avx512[GH_TYPE_COUNT] = {
    [GH_TYPE_F32]  = GH_DOT_ROW(vec_dot_f32, NULL, gemm_f32, 4, 6, 4, dot4_f32),
    [GH_TYPE_F16]  = GH_DOT_ROW(vec_dot_f16_tiles, NULL, gemm_f16_tiles, 4, 6, 4, dot4_f16),
    [GH_TYPE_BF16] = GH_DOT_ROW(vec_dot_bf16, bf16_from_float_x, gemm_bf16, 4, 6, 4, dot4_bf16),
    [GH_TYPE_Q8_0] = GH_DOT_ROW(vec_dot_q8_0, q8_x4_from_float_x, gemm_q8_0, 4, MAXT, 4, dot4_q8_0),
    [GH_TYPE_Q4_0] = GH_DOT_ROW(vec_dot_q4_0, q8_x4_from_float_x, gemm_q4_0, 4, MAXT, 4, dot4_q4_0),
    /* the other 32-value block types: kernels in kernels_b32_avx512.c */
#define B32_ROW(sfx) GH_DOT_ROW(gh_avx512_vec_dot_##sfx, q8_x4_from_float_x, gh_avx512_gemm_##sfx, 4, \
                                GH_B32_AVX512_NT, 4, gh_avx512_dot4_##sfx)
    [GH_TYPE_Q4_1] = B32_ROW(q4_1),
    [GH_TYPE_Q5_0] = B32_ROW(q5_0),
    [GH_TYPE_Q5_1] = B32_ROW(q5_1),
    /* IQ4_NL prompts: 16 rows x up to 64 tokens (the rows rearranged per call) */
    [GH_TYPE_IQ4_NL] = GH_DOT_ROW(gh_avx512_vec_dot_iq4_nl, q8_x4_from_float_x, gh_avx512_gemm_iq4_nl,
                                  GH_NL16_AVX512_MR, GH_NL16_AVX512_NT, 4, gh_avx512_dot4_iq4_nl),
    [GH_TYPE_MXFP4] = B32_ROW(mxfp4),
#undef B32_ROW
    [GH_TYPE_Q4_K] = GH_DOT_ROW(vec_dot_q4_K, q8_K_from_float_x, gemm_q4_K, 4, KNT, 4, dot4_q4_K),
    [GH_TYPE_Q5_K] = GH_DOT_ROW(vec_dot_q5_K, q8_K_from_float_x, gemm_q5_K, 4, KNT, 4, dot4_q5_K),
    [GH_TYPE_Q6_K] = GH_DOT_ROW(vec_dot_q6_K, q8_K_from_float_x, gemm_q6_K, 4, KNT, 4, dot4_q6_K),
    /* Q2_K, Q3_K, IQ4_XS: kernels in kernels_k2_avx512.c */
#define K2_ROW(sfx) GH_DOT_ROW(gh_avx512_vec_dot_##sfx, q8_K_from_float_x, gh_avx512_gemm_##sfx, 4, \
                               GH_K2_AVX512_NT, 4, gh_avx512_dot4_##sfx)
    [GH_TYPE_Q2_K] = K2_ROW(q2_K),
    [GH_TYPE_Q3_K] = K2_ROW(q3_K),
    /* IQ4_XS prompts: 16 rows x up to 64 tokens (the rows rearranged per call) */
    [GH_TYPE_IQ4_XS] = GH_DOT_ROW(gh_avx512_vec_dot_iq4_xs, q8_K_from_float_x, gh_avx512_gemm_iq4_xs,
                                  GH_NL16_AVX512_MR, GH_NL16_AVX512_NT, 4, gh_avx512_dot4_iq4_xs),
#undef K2_ROW
};

const gh_kernel_set gh_dot_row_avx512_f16_streamed = GH_DOT_ROW(vec_dot_f16, NULL, gemm_f16, 4, 6, 4, dot4_f16);
