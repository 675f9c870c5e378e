/* AVX2 kernels (AVX2, FMA, F16C): the same register tiles as the AVX-512 file with
 * 8-wide registers.
 *
 *   F32  x F32 : FMA;   F16 x F32: vcvtph2ps + FMA;   BF16 x BF16: shift to f32 + FMA
 *   Q4_0 x Q8_X4: maddubs of the unsigned nibbles with the activation bytes, minus 8
 *                 times the activation block sum (carried by Q8_X4)
 *   Q8_0 x Q8_X4: maddubs of |w| with sign(w) * x
 * One 256-bit register holds half a Q8_X4 group: two blocks, one per 128-bit lane. */
#pragma GCC target("avx2,fma,f16c")

#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define GH_INLINE static inline __attribute__((always_inline))
#define MAXR 4
#define MAXT 4

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

GH_INLINE void tile_f(const int MR, const int NT, const int kind, int64_t n, const void * w,
                      size_t ws, const void * x, size_t xs, float * y, int64_t ldy) {
    const size_t wsz = kind == W_F32 ? 4 : 2;  /* bytes per weight */
    const size_t xsz = kind == W_BF16 ? 2 : 4; /* bytes per activation */
    __m256 acc[MAXR][MAXT];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_ps();

    const char * wb = w;
    const char * xb = x;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 wv[MAXR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) wv[r] = load_w(kind, wb + r * ws + i * wsz);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const __m256 xv = load_x(kind, xb + t * xs + i * xsz);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    if (i < n) { /* the last n % 8 values, through zero-padded copies */
        const size_t k = (size_t) (n - i);
        _Alignas(32) char wt[MAXR][32] = { { 0 } };
        _Alignas(32) char xt[MAXT][32] = { { 0 } };
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) memcpy(wt[r], wb + r * ws + i * wsz, k * wsz);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) memcpy(xt[t], xb + t * xs + i * xsz, k * xsz);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const __m256 xv = load_x(kind, xt[t]);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) acc[r][t] = _mm256_fmadd_ps(load_w(kind, wt[r]), xv, acc[r][t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) y[t * ldy + r] = hsum(acc[r][t]);
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

/* ------------------------------------------------------------------ Q4_0, Q8_0 */

/* Two blocks of one weight row (blocks 2h and 2h+1 of a group): bytes of values
 * 0..15 and 16..31 (block per lane) and the scales (4 per lane). Missing blocks
 * (past the row's end) are zero. */
typedef struct {
    __m256i lo, hi;
    __m256  d;
} wpair;

GH_INLINE __m128i load16(const void * p, bool present) {
    return present ? _mm_loadu_si128((const __m128i *) p) : _mm_setzero_si128();
}

GH_INLINE float scale(const uint16_t * d, bool present) {
    return present ? _cvtsh_ss(*d) : 0.0f;
}

GH_INLINE wpair unpack_q4_0(const block_q4_0 * b, int k) {
    const __m256i q = _mm256_set_m128i(load16(b[1].qs, k > 1), load16(b[0].qs, k > 0));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    wpair p;
    p.lo = _mm256_and_si256(q, m4);
    p.hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    p.d = _mm256_set_m128(_mm_set1_ps(scale(&b[1].d, k > 1)), _mm_set1_ps(scale(&b[0].d, k > 0)));
    return p;
}

GH_INLINE wpair unpack_q8_0(const block_q8_0 * b, int k) {
    wpair p;
    p.lo = _mm256_set_m128i(load16(b[1].qs, k > 1), load16(b[0].qs, k > 0));
    p.hi = _mm256_set_m128i(load16(b[1].qs + 16, k > 1), load16(b[0].qs + 16, k > 0));
    p.d = _mm256_set_m128(_mm_set1_ps(scale(&b[1].d, k > 1)), _mm_set1_ps(scale(&b[0].d, k > 0)));
    return p;
}

GH_INLINE void tile_q(const int MR, const int NT, const bool is_q4, int64_t n, const void * w,
                      size_t ws, const void * x, size_t xs, float * y, int64_t ldy) {
    __m256 acc[MAXR][MAXT];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_ps();

    const int64_t nb = n / 32;
    const size_t bs = is_q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const __m256i ones = _mm256_set1_epi16(1);
    const char * wb = w;
    const char * xb = x;
    for (int64_t b = 0; b < nb; b += 2) {   /* two blocks: half of a Q8_X4 group */
        const int k = (int) GH_MIN(2, nb - b);
        const int64_t g = b / 4, h = (b / 2) % 2;
        wpair u[MAXR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const void * p = wb + r * ws + b * bs;
            u[r] = is_q4 ? unpack_q4_0(p, k) : unpack_q8_0(p, k);
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const block_q8_x4 * xg = (const block_q8_x4 *) (xb + t * xs) + g;
            const __m256i xa = _mm256_loadu_si256((const __m256i *) (xg->qa + 32 * h));
            const __m256i xc = _mm256_loadu_si256((const __m256i *) (xg->qb + 32 * h));
            const __m256 dx = _mm256_loadu_ps(xg->d + 8 * h);
            /* -8 * block sum, in one lane per block */
            const __m256i corr = is_q4 ? _mm256_blend_epi32(_mm256_setzero_si256(),
                _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *) (xg->nsum + 8 * h)), 3), 0x11)
                                       : _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) {
                __m256i s;
                if (is_q4) {
                    const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(u[r].lo, xa),
                                                         _mm256_maddubs_epi16(u[r].hi, xc));
                    s = _mm256_add_epi32(_mm256_madd_epi16(p16, ones), corr);
                } else {
                    const __m256i pa = _mm256_maddubs_epi16(_mm256_abs_epi8(u[r].lo), _mm256_sign_epi8(xa, u[r].lo));
                    const __m256i pb = _mm256_maddubs_epi16(_mm256_abs_epi8(u[r].hi), _mm256_sign_epi8(xc, u[r].hi));
                    s = _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones));
                }
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(u[r].d, dx), acc[r][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) y[t * ldy + r] = hsum(acc[r][t]);
}

/* ------------------------------------------------------------------ dispatch */

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

DEFINE_GEMM(gemm_f32, 4, 2, tile_f, W_F32,)
DEFINE_GEMM(gemm_f16, 4, 2, tile_f, W_F16,)
DEFINE_GEMM(gemm_bf16, 4, 2, tile_f, W_BF16,)
DEFINE_GEMM(gemm_q8_0, 2, 2, tile_q, false,)
DEFINE_GEMM(gemm_q4_0, 2, 2, tile_q, true,)

#define DEFINE_DOT(name, gemm)                                                  \
    static void name(int64_t n, float * s, const void * w, const void * x) {    \
        gemm(n, w, 0, 1, x, 0, 1, s, 1);                                        \
    }

DEFINE_DOT(vec_dot_f32, gemm_f32)
DEFINE_DOT(vec_dot_f16, gemm_f16)
DEFINE_DOT(vec_dot_bf16, gemm_bf16)
DEFINE_DOT(vec_dot_q8_0, gemm_q8_0)
DEFINE_DOT(vec_dot_q4_0, gemm_q4_0)

bool gh_kernels_avx2(int type, gh_kernel_set * ks) {
    switch (type) {
        case GH_TYPE_F32:  *ks = (gh_kernel_set) { vec_dot_f32, NULL, gemm_f32, 4, 2, 4, NULL }; return true;
        case GH_TYPE_F16:  *ks = (gh_kernel_set) { vec_dot_f16, NULL, gemm_f16, 4, 2, 4, NULL }; return true;
        case GH_TYPE_BF16: *ks = (gh_kernel_set) { vec_dot_bf16, bf16_from_float_x, gemm_bf16, 4, 2, 4, NULL }; return true;
        case GH_TYPE_Q8_0: *ks = (gh_kernel_set) { vec_dot_q8_0, gh_quantize_row_q8_x4_ref, gemm_q8_0, 2, 2, 4, NULL }; return true;
        case GH_TYPE_Q4_0: *ks = (gh_kernel_set) { vec_dot_q4_0, gh_quantize_row_q8_x4_ref, gemm_q4_0, 2, 2, 4, NULL }; return true;
        default: return false;
    }
}
