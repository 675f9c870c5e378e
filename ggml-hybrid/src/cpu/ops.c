/* Dense CPU ops of the forward pass: RMSNorm, RoPE, gated activations (GLU) and causal
 * attention with GQA over a KV cache.
 *
 * Each op has a scalar reference path; the hot inner loops (exp for the softmax and the
 * sigmoid, the q.k dot and the p*v accumulation) also have AVX2+FMA and AVX-512 versions
 * compiled with target attributes and chosen per call from the SIMD level (gh_simd_get,
 * so tests can force the scalar path and compare).
 *
 * Numerics follow Hugging Face transformers (float32) where that matters for logits:
 * RoPE frequencies are computed the way HF computes them in float32, RMSNorm sums in
 * double, softmax subtracts the row max. */
#include "cpu/ops.h"
#include "types/types.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OPS_X86 1
#else
#define OPS_X86 0
#endif

/* ------------------------------------------------------------------------------------
 * SIMD level
 * ---------------------------------------------------------------------------------- */

/* The level the kernels of this file use: the selected level (cpu/simd.c), never above
 * what this CPU can run. */
static int ops_simd_level(void) { return gh_simd_get(); }

/* ------------------------------------------------------------------------------------
 * Scalar kernels (the reference)
 * ---------------------------------------------------------------------------------- */

static float dot_scalar(const float * a, const float * b, int n) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i + 0] * b[i + 0];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

/* y += a * x */
static void axpy_scalar(float * y, float a, const float * x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* s[i] = exp(s[i] - max); returns the sum. */
static float exp_sum_scalar(float * s, int64_t n, float max) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return (float) sum;
}

/* out = g * sigmoid(g * (a + b*g^2)) * u: SiLU with a = 1, b = 0; GELU (tanh form,
 * since 0.5 * (1 + tanh(z)) = sigmoid(2z)) with a = 2*sqrt(2/pi), b = a * 0.044715.
 * up == NULL: u = 1 (an ungated FFN). */
static void sigmoid_glu_scalar(const float * gate, const float * up, float * out, int64_t n,
                               float a, float b) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        float z = g * (a + b * g * g);
        out[i] = g / (1.0f + expf(-z)) * (up ? up[i] : 1.0f);
    }
}

/* out = gelu(g) * u with the exact (erf) GELU; up == NULL: u = 1. */
static void gelu_erf_glu_scalar(const float * gate, const float * up, float * out, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = 0.5f * gate[i] * (1.0f + erff(gate[i] * 0.70710678118654752f)) * (up ? up[i] : 1.0f);
}

/* A row of F16 / Q8_0 to f32 (the KV cache's rows, a block of keys at a time); the SIMD
 * forms give the same values (one rounding of d * q). */
static void f16_to_f32_scalar(const void * src, float * dst, int64_t n) {
    const uint16_t * h = src;
    for (int64_t i = 0; i < n; i++) dst[i] = gh_fp16_to_fp32(h[i]);
}

static void q8_0_to_f32_scalar(const void * src, float * dst, int64_t n) {
    const block_q8_0 * b = src;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int k = 0; k < QK8_0; k++) dst[i * QK8_0 + k] = d * (float) b[i].qs[k];
    }
}

/* ------------------------------------------------------------------------------------
 * AVX2 + FMA and AVX-512 kernels
 *
 * exp(x): x = n*ln2 + r with |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial
 * (truncation error < 6e-9 relative), times 2^n. Inputs are clamped to [-104, 89], where
 * the result has already underflowed to 0 / overflowed to inf, so the polynomial never
 * sees a huge r and the tails come out as 0 and inf like expf's (the sigmoid of a very
 * negative input is then exactly 0). Measured relative error vs double exp: ~1.5e-7.
 * ---------------------------------------------------------------------------------- */

#define EXP_LO     (-104.0f)
#define EXP_HI     89.0f
#define LOG2E      1.44269504088896341f
#define LN2_HI     0.693145751953125f        /* ln2 with its low mantissa bits zeroed */
#define LN2_LO     1.42860682030941723e-06f  /* ln2 - LN2_HI */
#define EXP_C2     (1.0f / 2.0f)
#define EXP_C3     (1.0f / 6.0f)
#define EXP_C4     (1.0f / 24.0f)
#define EXP_C5     (1.0f / 120.0f)
#define EXP_C6     (1.0f / 720.0f)
#define EXP_C7     (1.0f / 5040.0f)

/* 1 + erf(x) for the SIMD exact GELU: erfc(|x|) ~= t P(t) exp(-x^2), t = 1 / (1 + p|x|)
 * (Abramowitz & Stegun 7.1.26, |error in erf| < 1.5e-7), then 1 + erf(x) = erfc(|x|) for
 * x < 0 (no cancellation: the negative tail keeps its relative accuracy) and
 * 2 - erfc(|x|) for x >= 0. */
#define ERF_P  0.3275911f
#define ERF_A1 0.254829592f
#define ERF_A2 (-0.284496736f)
#define ERF_A3 1.421413741f
#define ERF_A4 (-1.453152027f)
#define ERF_A5 1.061405429f

#if OPS_X86

/* ---- AVX2 ---- */

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C7);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n for n in [-150, 129] as 2^n1 * 2^n2, both factors normal floats, so that the
     * products round to subnormals, 0 or inf correctly. */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 e2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, e1), e2);
}

AVX2 static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static float dot_avx2(const float * a, const float * b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum_avx2(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

AVX2 static void axpy_avx2(float * y, float a, const float * x, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

AVX2 static float exp_sum_avx2(float * s, int64_t n, float max) {
    __m256 vmax = _mm256_set1_ps(max);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmax));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum_avx2(acc);
    for (; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return sum;
}

AVX2 static void sigmoid_glu_avx2(const float * gate, const float * up, float * out, int64_t n,
                                  float a, float b) {
    __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 z = _mm256_mul_ps(g, _mm256_fmadd_ps(vb, _mm256_mul_ps(g, g), va));
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), z));
        __m256 y = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, up ? _mm256_mul_ps(y, _mm256_loadu_ps(up + i)) : y);
    }
    sigmoid_glu_scalar(gate + i, up ? up + i : NULL, out + i, n - i, a, b);
}

AVX2 static void gelu_erf_glu_avx2(const float * gate, const float * up, float * out, int64_t n) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    const __m256 sgn = _mm256_set1_ps(-0.0f), rs2 = _mm256_set1_ps(0.70710678118654752f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 x = _mm256_mul_ps(g, rs2);
        const __m256 ax = _mm256_andnot_ps(sgn, x);
        const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(ERF_P), ax, one));
        __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(ERF_A5), t, _mm256_set1_ps(ERF_A4));
        p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(ERF_A3));
        p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(ERF_A2));
        p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(ERF_A1));
        p = _mm256_mul_ps(p, t);
        const __m256 ec = _mm256_mul_ps(p, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(ax, ax))));
        const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 onep = _mm256_blendv_ps(_mm256_sub_ps(two, ec), ec, neg);
        const __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, g), onep);
        _mm256_storeu_ps(out + i, up ? _mm256_mul_ps(y, _mm256_loadu_ps(up + i)) : y);
    }
    gelu_erf_glu_scalar(gate + i, up ? up + i : NULL, out + i, n - i);
}

/* ---- AVX-512 ---- */

#define AVX512 __attribute__((target("avx512f,avx2,fma")))

AVX512 static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C7);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask16(int64_t rem) {
    return (__mmask16) ((1u << rem) - 1u);
}

AVX512 static float dot_avx512(const float * a, const float * b, int n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

AVX512 static void axpy_avx512(float * y, float a, const float * x, int n) {
    __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

AVX512 static float exp_sum_avx512(float * s, int64_t n, float max) {
    __m512 vmax = _mm512_set1_ps(max);
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmax));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vmax));
        _mm512_mask_storeu_ps(s + i, m, e);
        acc = _mm512_mask_add_ps(acc, m, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

AVX512 static void sigmoid_glu_avx512(const float * gate, const float * up, float * out, int64_t n,
                                      float a, float b) {
    __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b), one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16) 0xffff : tail_mask16(n - i);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        __m512 z = _mm512_mul_ps(g, _mm512_fmadd_ps(vb, _mm512_mul_ps(g, g), va));
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), z));
        __m512 y = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(out + i, m, up ? _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, up + i)) : y);
    }
}

AVX512 static void gelu_erf_glu_avx512(const float * gate, const float * up, float * out, int64_t n) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
    const __m512 rs2 = _mm512_set1_ps(0.70710678118654752f);
    int64_t i = 0;
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16) 0xffff : tail_mask16(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        const __m512 x = _mm512_mul_ps(g, rs2);
        const __m512 ax = _mm512_abs_ps(x);
        const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(ERF_P), ax, one));
        __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(ERF_A5), t, _mm512_set1_ps(ERF_A4));
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(ERF_A3));
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(ERF_A2));
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(ERF_A1));
        p = _mm512_mul_ps(p, t);
        const __m512 ec = _mm512_mul_ps(p, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(ax, ax))));
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 onep = _mm512_mask_blend_ps(neg, _mm512_sub_ps(two, ec), ec);
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(half, g), onep);
        _mm512_mask_storeu_ps(out + i, m, up ? _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, up + i)) : y);
    }
}

/* Attention rows of head size D (a multiple of 16, at most 128), one query at a time
 * against keys [j0, j1) of one kv head: the query (or its output row) stays in registers
 * for the whole block, the key/value rows come from L1/L2 (the tile's other queries read
 * the same rows). Scores go eight keys at a time, their eight dot products reduced
 * together; each score's sums run in the same order for every query and thread. */
AVX512 static inline __m256 hsum8_avx512(const __m512 a[8]) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) {
        r[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

__attribute__((always_inline, target("avx512f,avx2,fma")))
static inline void att_scores_d(const int D, const float * q, const float * kbase, int64_t stride,
                                int64_t j0, int64_t j1, float scale, float * sc) {
    __m512 qv[8];
    for (int c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    int64_t jj = j0;
    for (; jj + 8 <= j1; jj += 8) {
        __m512 acc[8];
        for (int r = 0; r < 8; r++) {
            const float * kr = kbase + (jj + r) * stride;
            acc[r] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
            for (int c = 1; c < D / 16; c++) acc[r] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc[r]);
        }
        _mm256_storeu_ps(sc + (jj - j0), _mm256_mul_ps(hsum8_avx512(acc), _mm256_set1_ps(scale)));
    }
    for (; jj < j1; jj++) {
        const float * kr = kbase + jj * stride;
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
        for (int c = 1; c < D / 16; c++) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
        sc[jj - j0] = _mm512_reduce_add_ps(acc) * scale;
    }
}

__attribute__((always_inline, target("avx512f,avx2,fma")))
static inline void att_values_d(const int D, float * o, const float * p, const float * vbase,
                                int64_t stride, int64_t j0, int64_t j1) {
    __m512 ov[8];
    for (int c = 0; c < D / 16; c++) ov[c] = _mm512_loadu_ps(o + 16 * c);
    for (int64_t jj = j0; jj < j1; jj++) {
        const float * vr = vbase + jj * stride;
        const __m512 pv = _mm512_set1_ps(p[jj - j0]);
        for (int c = 0; c < D / 16; c++) ov[c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vr + 16 * c), ov[c]);
    }
    for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(o + 16 * c, ov[c]);
}

AVX512 static void att_scores_64(const float * q, const float * k, int64_t stride, int64_t j0,
                                 int64_t j1, float scale, float * sc) {
    att_scores_d(64, q, k, stride, j0, j1, scale, sc);
}
AVX512 static void att_scores_128(const float * q, const float * k, int64_t stride, int64_t j0,
                                  int64_t j1, float scale, float * sc) {
    att_scores_d(128, q, k, stride, j0, j1, scale, sc);
}
AVX512 static void att_values_64(float * o, const float * p, const float * v, int64_t stride,
                                 int64_t j0, int64_t j1) {
    att_values_d(64, o, p, v, stride, j0, j1);
}
AVX512 static void att_values_128(float * o, const float * p, const float * v, int64_t stride,
                                  int64_t j0, int64_t j1) {
    att_values_d(128, o, p, v, stride, j0, j1);
}

/* The AVX2 forms of the per-query block kernels below (att_scores_d / att_values_d):
 * sixteen ymm registers cannot hold a 128-value query and its accumulators, so scores go
 * four keys at a time with the query re-read from L1 per chunk (five loads per four FMAs,
 * where a dot per key does eight), and values go in halves of 64 output values held in
 * eight registers over the block's keys. */
__attribute__((always_inline, target("avx2,fma")))
static inline void att_scores_d_avx2(const int D, const float * q, const float * kbase,
                                     int64_t stride, int64_t j0, int64_t j1, float scale,
                                     float * sc) {
    int64_t jj = j0;
    for (; jj + 4 <= j1; jj += 4) {
        const float * k0 = kbase + jj * stride, * k1 = k0 + stride, * k2 = k1 + stride,
                    * k3 = k2 + stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int c = 0; c < D; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + c);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + c), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + c), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + c), a3);
        }
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(sc + (jj - j0), _mm_mul_ps(r, _mm_set1_ps(scale)));
    }
    for (; jj < j1; jj++) {
        const float * kr = kbase + jj * stride;
        __m256 a = _mm256_setzero_ps();
        for (int c = 0; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(kr + c), a);
        sc[jj - j0] = hsum_avx2(a) * scale;
    }
}

__attribute__((always_inline, target("avx2,fma")))
static inline void att_values_d_avx2(const int D, float * o, const float * p, const float * vbase,
                                     int64_t stride, int64_t j0, int64_t j1) {
    for (int h = 0; h < D; h += 64) {
        __m256 ov[8];
        for (int c = 0; c < 8; c++) ov[c] = _mm256_loadu_ps(o + h + 8 * c);
        for (int64_t jj = j0; jj < j1; jj++) {
            const float * vr = vbase + jj * stride + h;
            const __m256 pv = _mm256_set1_ps(p[jj - j0]);
            for (int c = 0; c < 8; c++) ov[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * c), ov[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + h + 8 * c, ov[c]);
    }
}

AVX2 static void att_scores_64_avx2(const float * q, const float * k, int64_t stride, int64_t j0,
                                    int64_t j1, float scale, float * sc) {
    att_scores_d_avx2(64, q, k, stride, j0, j1, scale, sc);
}
AVX2 static void att_scores_128_avx2(const float * q, const float * k, int64_t stride, int64_t j0,
                                     int64_t j1, float scale, float * sc) {
    att_scores_d_avx2(128, q, k, stride, j0, j1, scale, sc);
}
AVX2 static void att_values_64_avx2(float * o, const float * p, const float * v, int64_t stride,
                                    int64_t j0, int64_t j1) {
    att_values_d_avx2(64, o, p, v, stride, j0, j1);
}
AVX2 static void att_values_128_avx2(float * o, const float * p, const float * v, int64_t stride,
                                     int64_t j0, int64_t j1) {
    att_values_d_avx2(128, o, p, v, stride, j0, j1);
}

__attribute__((target("avx2,fma,f16c")))
static void f16_to_f32_avx2(const void * src, float * dst, int64_t n) {
    const uint16_t * h = src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (h + i))));
    for (; i < n; i++) dst[i] = gh_fp16_to_fp32(h[i]);
}

AVX2 static void q8_0_to_f32_avx2(const void * src, float * dst, int64_t n) {
    const block_q8_0 * b = src;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const __m256 d = _mm256_set1_ps(gh_fp16_to_fp32(b[i].d));
        for (int k = 0; k < QK8_0; k += 8) {
            const __m128i q = _mm_loadl_epi64((const __m128i *) (b[i].qs + k));
            _mm256_storeu_ps(dst + i * QK8_0 + k,
                             _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        }
    }
}

AVX512 static void q8_0_to_f32_avx512(const void * src, float * dst, int64_t n) {
    const block_q8_0 * b = src;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const __m512 d = _mm512_set1_ps(gh_fp16_to_fp32(b[i].d));
        for (int k = 0; k < QK8_0; k += 16) {
            const __m128i q = _mm_loadu_si128((const __m128i *) (b[i].qs + k));
            _mm512_storeu_ps(dst + i * QK8_0 + k,
                             _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
        }
    }
}

AVX512 static void f16_to_f32_avx512(const void * src, float * dst, int64_t n) {
    const uint16_t * h = src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (h + i))));
    for (; i < n; i++) dst[i] = gh_fp16_to_fp32(h[i]);
}

#endif /* OPS_X86 */

/* The kernels for one SIMD level. */
typedef struct {
    float (*dot)(const float * a, const float * b, int n);
    void  (*axpy)(float * y, float a, const float * x, int n);
    float (*exp_sum)(float * s, int64_t n, float max);
    void  (*sigmoid_glu)(const float * gate, const float * up, float * out, int64_t n,
                         float a, float b);
    void  (*gelu_erf_glu)(const float * gate, const float * up, float * out, int64_t n);
    void  (*f16_to_f32)(const void * src, float * dst, int64_t n);
    void  (*q8_0_to_f32)(const void * src, float * dst, int64_t n);
} ops_kernels;

/* A query's scores (sc[jj - j0] = scale * q . k_jj) and value sums (o += sum p[jj - j0] *
 * v_jj) over keys [j0, j1) of one kv head, rows `stride` floats apart, for one head size;
 * NULL where the SIMD level has none for it (attn_unit then calls dot / axpy per key). */
typedef void (*att_scores_fn)(const float * q, const float * k, int64_t stride, int64_t j0,
                              int64_t j1, float scale, float * sc);
typedef void (*att_values_fn)(float * o, const float * p, const float * v, int64_t stride,
                              int64_t j0, int64_t j1);

static void att_kernels_get(int head_dim, att_scores_fn * scores, att_values_fn * values) {
    *scores = NULL;
    *values = NULL;
#if OPS_X86
    const int level = ops_simd_level();
    if (level >= GH_SIMD_AVX512) {
        if (head_dim == 64) { *scores = att_scores_64; *values = att_values_64; }
        if (head_dim == 128) { *scores = att_scores_128; *values = att_values_128; }
    } else if (level >= GH_SIMD_AVX2) {
        if (head_dim == 64) { *scores = att_scores_64_avx2; *values = att_values_64_avx2; }
        if (head_dim == 128) { *scores = att_scores_128_avx2; *values = att_values_128_avx2; }
    }
#else
    (void) head_dim;
#endif
}

static ops_kernels ops_kernels_get(void) {
    ops_kernels k = { dot_scalar, axpy_scalar, exp_sum_scalar, sigmoid_glu_scalar,
                      gelu_erf_glu_scalar, f16_to_f32_scalar, q8_0_to_f32_scalar };
#if OPS_X86
    int level = ops_simd_level();
    if (level >= GH_SIMD_AVX512) {
        k = (ops_kernels) { dot_avx512, axpy_avx512, exp_sum_avx512, sigmoid_glu_avx512,
                            gelu_erf_glu_avx512, f16_to_f32_avx512, q8_0_to_f32_avx512 };
    } else if (level >= GH_SIMD_AVX2) {
        k = (ops_kernels) { dot_avx2, axpy_avx2, exp_sum_avx2, sigmoid_glu_avx2,
                            gelu_erf_glu_avx2, f16_to_f32_avx2, q8_0_to_f32_avx2 };
    }
#endif
    return k;
}

/* ------------------------------------------------------------------------------------
 * RMSNorm
 * ---------------------------------------------------------------------------------- */

void gh_rmsnorm(const float * x, const float * w, int64_t n, float eps, float * y) {
    /* Sum of squares in double (four independent chains): exact enough that the
     * rounding of the result is the only float error left. (An AVX-512 form, eight
     * doubles at a time, measured 1.8x slower per 2048-float row than this loop as the
     * compiler builds it.) */
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double) x[i + 0] * x[i + 0];
        s1 += (double) x[i + 1] * x[i + 1];
        s2 += (double) x[i + 2] * x[i + 2];
        s3 += (double) x[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += (double) x[i] * x[i];
    double mean = ((s0 + s1) + (s2 + s3)) / (double) n;
    float scale = (float) (1.0 / sqrt(mean + (double) eps));
    /* Same order as HF: (x * rsqrt(var + eps)) * w. */
    for (i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

void gh_layernorm(const float * x, const float * w, const float * b, int64_t n, float eps,
                  float * y) {
    /* mean and variance in double (two passes), then HF's order: (x - mean) * rsqrt(var +
     * eps) * w + b */
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += x[i];
    const float mean = (float) (sum / (double) n);
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double) x[i] - (double) mean;
        ss += d * d;
    }
    const float scale = (float) (1.0 / sqrt(ss / (double) n + (double) eps));
    if (b) {
        for (int64_t i = 0; i < n; i++) y[i] = ((x[i] - mean) * scale) * w[i] + b[i];
    } else {
        for (int64_t i = 0; i < n; i++) y[i] = ((x[i] - mean) * scale) * w[i];
    }
}

/* ------------------------------------------------------------------------------------
 * RoPE
 * ---------------------------------------------------------------------------------- */

void gh_rope_angles(int head_dim, int32_t pos, float theta, float freq_scale,
                    const float * freq_div, float * cs) {
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        /* As HF computes it in float32: inv_freq = 1 / base^(2i/d), scaled (linear: by
         * 1 / factor; Llama-3: divided per dimension), angle = pos * inv_freq. */
        float inv_freq = 1.0f / powf(theta, (float) (2 * i) / (float) head_dim);
        if (freq_div) inv_freq /= freq_div[i];
        inv_freq *= freq_scale;
        float angle = (float) pos * inv_freq;
        cs[i] = cosf(angle);
        cs[half + i] = sinf(angle);
    }
}

void gh_rope(float * x, int n_head, int head_dim, int n_rot, const float * cs, int neox) {
    const int half = n_rot / 2;
    /* The pair (i, i + half) for NeoX, (2i, 2i + 1) for the GGUF llama layout, within the
     * first n_rot dims of each head (the rest pass through: partial rotary embeddings). */
    const int stride = neox ? 1 : 2;
    const int offset = neox ? half : 1;
    for (int i = 0; i < half; i++) {
        const float c = cs[i], s = cs[half + i];
        for (int h = 0; h < n_head; h++) {
            float * p = x + (int64_t) h * head_dim + (int64_t) i * stride;
            float x0 = p[0], x1 = p[offset];
            p[0]      = x0 * c - x1 * s;
            p[offset] = x1 * c + x0 * s;
        }
    }
}

void gh_softcap(float * x, int64_t n, float c) {
    const float inv = 1.0f / c;
    for (int64_t i = 0; i < n; i++) x[i] = c * tanhf(x[i] * inv);
}

/* ------------------------------------------------------------------------------------
 * Gated activations
 * ---------------------------------------------------------------------------------- */

#define GELU_A 1.5957691216057308f /* 2 * sqrt(2 / pi) */
#define GELU_B (GELU_A * 0.044715f)

void gh_glu(int act, float t, const float * gate, const float * up, float * out, int64_t n) {
    if (!up) {
        /* an ungated FFN: act(gate) alone (the "gate" is the up projection there) */
        switch (act) {
        case GH_ACT_SILU:
            ops_kernels_get().sigmoid_glu(gate, NULL, out, n, 1.0f, 0.0f);
            break;
        case GH_ACT_GELU:
            ops_kernels_get().sigmoid_glu(gate, NULL, out, n, GELU_A, GELU_B);
            break;
        case GH_ACT_RELU:
            for (int64_t i = 0; i < n; i++) out[i] = gate[i] > 0.0f ? gate[i] : 0.0f;
            break;
        case GH_ACT_FATRELU:
            for (int64_t i = 0; i < n; i++) out[i] = gate[i] > t ? gate[i] : 0.0f;
            break;
        case GH_ACT_GELU_ERF:
            ops_kernels_get().gelu_erf_glu(gate, NULL, out, n);
            break;
        default:
            break; /* validated by the loader (dReLU needs a gate and an up) */
        }
        return;
    }
    switch (act) {
    case GH_ACT_SILU:
        ops_kernels_get().sigmoid_glu(gate, up, out, n, 1.0f, 0.0f);
        break;
    case GH_ACT_GELU:
        ops_kernels_get().sigmoid_glu(gate, up, out, n, GELU_A, GELU_B);
        break;
    case GH_ACT_RELU:
        for (int64_t i = 0; i < n; i++) out[i] = (gate[i] > 0.0f ? gate[i] : 0.0f) * up[i];
        break;
    case GH_ACT_FATRELU:
        for (int64_t i = 0; i < n; i++) out[i] = (gate[i] > t ? gate[i] : 0.0f) * up[i];
        break;
    case GH_ACT_DRELU:
        for (int64_t i = 0; i < n; i++)
            out[i] = (gate[i] > 0.0f ? gate[i] : 0.0f) * (up[i] > 0.0f ? up[i] : 0.0f);
        break;
    case GH_ACT_GELU_ERF:
        ops_kernels_get().gelu_erf_glu(gate, up, out, n);
        break;
    case GH_ACT_SWIGLU_OAI:
        /* in float, as transformers' GptOssExperts: the gate clamped above, up on both sides,
         * up shifted by 1; alpha is the released models' constant (llama.cpp fixes it too) */
        for (int64_t i = 0; i < n; i++) {
            const float g = gate[i] < t ? gate[i] : t;
            const float u = up[i] < -t ? -t : up[i] > t ? t : up[i];
            out[i] = (u + 1.0f) * (g / (1.0f + expf(-GH_SWIGLU_OAI_ALPHA * g)));
        }
        break;
    default:
        break; /* validated by callers */
    }
}

/* ------------------------------------------------------------------------------------
 * Attention
 * ---------------------------------------------------------------------------------- */

/* Work unit: a tile of query rows that share one kv head -- the n_head / n_head_kv
 * heads of a GQA group, times a few consecutive tokens -- at most ATT_MAX_Q rows. The
 * keys are walked in blocks of ATT_BLOCK: each k and v row is loaded once per block and
 * used by every query row of the tile (while it is in L1), so the cache is read from
 * memory once per group instead of once per query head. Softmax is the online
 * (running max / running sum) form, exact up to rounding.
 *
 * Every query row is computed by the same sequence of operations whatever tile or thread
 * it lands in (block boundaries are fixed multiples of ATT_BLOCK), so results do not
 * depend on the thread count.
 *
 * A cache in F16 or Q8_0 is read a block at a time: the block's K and V rows of the kv
 * head are converted into f32 tiles on the stack, and the same score/value kernels run
 * over the tiles. The conversion is paid once per tile of queries (the whole GQA group),
 * and the bytes read from memory -- what bounds decode at long contexts -- halve (F16)
 * or drop to 34/128 (Q8_0). */
#define ATT_MAX_Q     16
#define ATT_BLOCK     64
#define ATT_PREFETCH  4   /* rows ahead */

static inline void prefetch_row(const float * p, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}
/* Into L2 only: rows a page apart share L1 sets, a whole block would not stay in L1. */
static inline void prefetch_row_l2(const float * p, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 1);
}

typedef struct {
    const float * q;
    const uint8_t * k, * v;   /* cache rows of n_head_kv * head_dim values, kv_row bytes apart */
    size_t        kv_row;     /* bytes per cache row */
    size_t        kv_head;    /* bytes per kv head within a row */
    gh_to_float_fn to_float;  /* converts a cache row slice to f32; NULL for an F32 cache */
    float *       out;
    int64_t       n_tokens, n_past;
    int           n_head, n_head_kv, head_dim;
    int           group;      /* query heads per kv head */
    int           sub;        /* heads per tile (group split when it exceeds ATT_MAX_Q) */
    int           tile_t;     /* tokens per tile */
    int64_t       n_tt;       /* token tiles */
    int64_t       n_units;
    float         scale;      /* q.k times this */
    float         softcap;    /* scores -> c tanh(scores / c) (0: none) */
    int64_t       window;     /* a query at position p sees keys (p - window, p] (0: [0, p]) */
    const float * sinks;      /* [n_head] per-head logits in the denominator only (NULL: none) */
    ops_kernels   kern;
    att_scores_fn scores;     /* per-query block kernels for this head size, or NULL */
    att_values_fn values;
    atomic_llong  next;       /* next unit to take */
} attn_job;

static void attn_unit(const attn_job * j, int64_t unit) {
    const int d = j->head_dim;
    const int64_t kv_stride = (int64_t) j->n_head_kv * d;
    const float scale = j->scale;
    const int n_sub = j->group / j->sub;

    /* Unit -> (token tile, kv head, head subgroup); the last token tiles first: they
     * attend over the most keys, so taking them first balances the tail. */
    const int64_t tt = j->n_tt - 1 - unit / ((int64_t) j->n_head_kv * n_sub);
    const int64_t rest = unit % ((int64_t) j->n_head_kv * n_sub);
    const int kh = (int) (rest / n_sub);
    const int h0 = kh * j->group + (int) (rest % n_sub) * j->sub;
    const int64_t t0 = tt * j->tile_t;
    const int64_t t1 = GH_MIN(t0 + j->tile_t, j->n_tokens);

    const float * qr[ATT_MAX_Q];
    float *       orow[ATT_MAX_Q];
    int64_t       beg[ATT_MAX_Q], lim[ATT_MAX_Q];   /* keys [beg, lim) are visible */
    float         m[ATT_MAX_Q], l[ATT_MAX_Q];
    float         sc[ATT_MAX_Q][ATT_BLOCK];
    int           head[ATT_MAX_Q];
    int nq = 0;
    for (int64_t t = t0; t < t1; t++) {
        for (int h = h0; h < h0 + j->sub; h++) {
            int64_t row = (t * j->n_head + h) * (int64_t) d;
            qr[nq] = j->q + row;
            orow[nq] = j->out + row;
            head[nq] = h;
            lim[nq] = j->n_past + t + 1;
            beg[nq] = j->window > 0 ? GH_MAX(0, lim[nq] - j->window) : 0;
            m[nq] = -INFINITY;
            l[nq] = 0.0f;
            for (int c = 0; c < d; c++) orow[nq][c] = 0.0f;
            nq++;
        }
    }
    const int64_t n_kv = j->n_past + t1; /* the last token of the tile sees the most */
    const uint8_t * kh_bytes = j->k + (size_t) kh * j->kv_head;
    const uint8_t * vh_bytes = j->v + (size_t) kh * j->kv_head;
    /* An F32 cache is read in place (rows kv_stride floats apart, key jj at row jj); another
     * type through the tiles (rows d floats apart, key jj at row jj - j0). The same score and
     * value code runs over either. */
    float ktile[j->to_float ? ATT_BLOCK * d : 1];
    float vtile[j->to_float ? ATT_BLOCK * d : 1];
    const float * kbase = j->to_float ? ktile : (const float *) kh_bytes;
    const float * vbase = j->to_float ? vtile : (const float *) vh_bytes;
    const int64_t ks = j->to_float ? d : kv_stride;
    /* the in-place cache's rows of one kv head are n_head_kv * head_dim floats apart (often a
     * page): the hardware prefetcher does not follow them, so they are fetched by hand */
    const bool pf = !j->to_float;

    /* a sliding window: the blocks before the first key any query of the tile sees are
     * skipped (the first token's window starts first); blocks stay fixed multiples of
     * ATT_BLOCK so that a row's result does not depend on its tile */
    const int64_t first = beg[0] - beg[0] % ATT_BLOCK;
    for (int64_t j0 = first; j0 < n_kv; j0 += ATT_BLOCK) {
        const int64_t j1 = GH_MIN(j0 + ATT_BLOCK, n_kv);
        const int64_t off = j->to_float ? j0 : 0;
        if (j->to_float) {
            for (int64_t jj = j0; jj < j1; jj++) {
                const size_t r = (size_t) jj * j->kv_row;
                if (jj + ATT_BLOCK < n_kv) {  /* the next block's rows, a block ahead */
                    __builtin_prefetch(kh_bytes + r + ATT_BLOCK * j->kv_row, 0, 1);
                    __builtin_prefetch(vh_bytes + r + ATT_BLOCK * j->kv_row, 0, 1);
                }
                j->to_float(kh_bytes + r, ktile + (jj - j0) * d, d);
                j->to_float(vh_bytes + r, vtile + (jj - j0) * d, d);
            }
        }
        /* scores */
        if (j->scores) {
            for (int64_t jj = j0; pf && jj < j1; jj++) {
                prefetch_row(kbase + jj * ks, d);
                prefetch_row_l2(vbase + jj * ks, d);
            }
            for (int i = 0; i < nq; i++) {
                const int64_t b = GH_MAX(j0, beg[i]), e = GH_MIN(j1, lim[i]);
                if (e > b) j->scores(qr[i], kbase, ks, b - off, e - off, scale, sc[i] + (b - j0));
            }
        } else for (int64_t jj = j0; jj < j1; jj++) {
            const float * kr = kbase + (jj - off) * ks;
            if (pf) {
                if (jj + ATT_PREFETCH < n_kv) prefetch_row(kr + ATT_PREFETCH * ks, d);
                prefetch_row_l2(vbase + jj * ks, d); /* for this block's value pass */
            }
            for (int i = 0; i < nq; i++) {
                if (jj >= beg[i] && jj < lim[i]) sc[i][jj - j0] = j->kern.dot(qr[i], kr, d) * scale;
            }
        }
        /* online softmax update over each query's visible keys [b, e) of the block, whose
         * scores are at sc[i] + (b - j0) */
        for (int i = 0; i < nq; i++) {
            const int64_t b = GH_MAX(j0, beg[i]);
            const int64_t nb = GH_MIN(j1, lim[i]) - b;
            if (nb <= 0) continue;
            float * s = sc[i] + (b - j0);
            if (j->softcap > 0) {
                const float c = j->softcap, inv = 1.0f / c;
                for (int64_t jj = 0; jj < nb; jj++) s[jj] = c * tanhf(s[jj] * inv);
            }
            float bm = s[0];
            for (int64_t jj = 1; jj < nb; jj++) bm = s[jj] > bm ? s[jj] : bm;
            if (bm > m[i]) {
                if (m[i] != -INFINITY) {
                    float c = expf(m[i] - bm);
                    l[i] *= c;
                    for (int e = 0; e < d; e++) orow[i][e] *= c;
                }
                m[i] = bm;
            }
            l[i] += j->kern.exp_sum(s, nb, m[i]);
        }
        /* weighted values */
        if (j->values) {
            for (int i = 0; i < nq; i++) {
                const int64_t b = GH_MAX(j0, beg[i]), e = GH_MIN(j1, lim[i]);
                if (e > b) j->values(orow[i], sc[i] + (b - j0), vbase, ks, b - off, e - off);
            }
        } else for (int64_t jj = j0; jj < j1; jj++) {
            const float * vr = vbase + (jj - off) * ks;
            if (pf && jj + ATT_PREFETCH < j1) prefetch_row(vr + ATT_PREFETCH * ks, d);
            for (int i = 0; i < nq; i++) {
                if (jj >= beg[i] && jj < lim[i]) j->kern.axpy(orow[i], sc[i][jj - j0], vr, d);
            }
        }
    }
    /* an attention sink: one more logit in the softmax with no value (the max taken over
     * it too, as transformers does, so a large sink cannot overflow the sum) */
    for (int i = 0; j->sinks && i < nq; i++) {
        const float s = j->sinks[head[i]];
        if (s > m[i]) {
            const float c = expf(m[i] - s);
            l[i] *= c;
            for (int e = 0; e < d; e++) orow[i][e] *= c;
            m[i] = s;
        }
        l[i] += expf(s - m[i]);
    }
    for (int i = 0; i < nq; i++) {
        float inv = 1.0f / l[i];
        for (int e = 0; e < d; e++) orow[i][e] *= inv;
    }
}

static void attn_task(void * arg, int ith, int nth) {
    attn_job * j = arg;
    /* Units are taken dynamically: cores may be shared with other work. */
    for (;;) {
        int64_t u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (u >= j->n_units) break;
        attn_unit(j, u);
    }
}

void gh_attention(gh_threadpool * tp, const float * q, const void * k, const void * v,
                  int kv_type, float * out, int64_t n_tokens, int64_t n_past, int n_head,
                  int n_head_kv, int head_dim) {
    const gh_attn_opts o = { .scale = 1.0f / sqrtf((float) head_dim) };
    gh_attention_ex(tp, q, k, v, kv_type, out, n_tokens, n_past, n_head, n_head_kv, head_dim, &o);
}

void gh_attention_ex(gh_threadpool * tp, const float * q, const void * k, const void * v,
                     int kv_type, float * out, int64_t n_tokens, int64_t n_past, int n_head,
                     int n_head_kv, int head_dim, const gh_attn_opts * o) {
    attn_job j = {
        .q = q, .k = k, .v = v, .out = out,
        .scale = o->scale, .softcap = o->softcap, .window = o->window, .sinks = o->sinks,
        .kv_row = gh_row_size(kv_type, (int64_t) n_head_kv * head_dim),
        .kv_head = gh_row_size(kv_type, head_dim),
        .n_tokens = n_tokens, .n_past = n_past,
        .n_head = n_head, .n_head_kv = n_head_kv, .head_dim = head_dim,
        .kern = ops_kernels_get(),
    };
    att_kernels_get(head_dim, &j.scores, &j.values);
    if (kv_type == GH_TYPE_F16) j.to_float = j.kern.f16_to_f32;
    else if (kv_type == GH_TYPE_Q8_0) j.to_float = j.kern.q8_0_to_f32;
    j.group = n_head / n_head_kv;
    /* The largest divisor of the group that fits a tile. */
    j.sub = GH_MIN(j.group, ATT_MAX_Q);
    while (j.group % j.sub != 0) j.sub--;
    j.tile_t = ATT_MAX_Q / j.sub;
    /* Keep enough units for the threads in decode-sized batches. */
    int nth = gh_threadpool_n_threads(tp);
    while (j.tile_t > 1 && ((n_tokens + j.tile_t - 1) / j.tile_t) * n_head_kv * (j.group / j.sub) < 4 * nth)
        j.tile_t /= 2;
    j.n_tt = (n_tokens + j.tile_t - 1) / j.tile_t;
    j.n_units = j.n_tt * n_head_kv * (j.group / j.sub);
    atomic_init(&j.next, 0);
    gh_threadpool_run(tp, attn_task, &j);
}

/* ------------------------------------------------------------------------------------
 * Public wrappers (validate, then call the ops above)
 * ---------------------------------------------------------------------------------- */

gh_status gh_op_rmsnorm(const float * x, const float * w, int64_t n, int64_t n_rows,
                        float eps, float * y) {
    if (!x || !w || !y) return gh_fail(GH_ERR_INVALID_ARG, "rmsnorm: x, w and y must not be NULL");
    if (n <= 0 || n_rows <= 0)
        return gh_fail(GH_ERR_INVALID_ARG, "rmsnorm: n (%lld) and n_rows (%lld) must be positive",
                       (long long) n, (long long) n_rows);
    uint64_t total;
    if (!gh_mul_ok((uint64_t) n, (uint64_t) n_rows, &total) || total > (uint64_t) INT64_MAX / sizeof(float))
        return gh_fail(GH_ERR_INVALID_ARG, "rmsnorm: n * n_rows overflows");
    if (!(eps >= 0.0f) || isinf(eps))
        return gh_fail(GH_ERR_INVALID_ARG, "rmsnorm: eps (%g) must be finite and >= 0", (double) eps);
    for (int64_t r = 0; r < n_rows; r++) gh_rmsnorm(x + r * n, w, n, eps, y + r * n);
    return GH_OK;
}

gh_status gh_op_layernorm(const float * x, const float * w, const float * b, int64_t n,
                          int64_t n_rows, float eps, float * y) {
    if (!x || !w || !y) return gh_fail(GH_ERR_INVALID_ARG, "layernorm: x, w and y must not be NULL");
    if (n <= 0 || n_rows <= 0)
        return gh_fail(GH_ERR_INVALID_ARG, "layernorm: n (%lld) and n_rows (%lld) must be positive",
                       (long long) n, (long long) n_rows);
    uint64_t total;
    if (!gh_mul_ok((uint64_t) n, (uint64_t) n_rows, &total) || total > (uint64_t) INT64_MAX / sizeof(float))
        return gh_fail(GH_ERR_INVALID_ARG, "layernorm: n * n_rows overflows");
    if (!(eps >= 0.0f) || isinf(eps))
        return gh_fail(GH_ERR_INVALID_ARG, "layernorm: eps (%g) must be finite and >= 0", (double) eps);
    for (int64_t r = 0; r < n_rows; r++) gh_layernorm(x + r * n, w, b, n, eps, y + r * n);
    return GH_OK;
}

gh_status gh_op_rope(float * x, int64_t n_tokens, int n_head, int head_dim,
                     const int32_t * pos, float theta, float freq_scale,
                     const float * freq_div, int neox) {
    if (!x || !pos) return gh_fail(GH_ERR_INVALID_ARG, "rope: x and pos must not be NULL");
    if (n_tokens <= 0 || n_head <= 0 || head_dim <= 0)
        return gh_fail(GH_ERR_INVALID_ARG,
                       "rope: n_tokens (%lld), n_head (%d) and head_dim (%d) must be positive",
                       (long long) n_tokens, n_head, head_dim);
    if (head_dim % 2 != 0)
        return gh_fail(GH_ERR_INVALID_ARG, "rope: head_dim (%d) must be even", head_dim);
    if (!(theta > 0.0f) || isinf(theta))
        return gh_fail(GH_ERR_INVALID_ARG, "rope: theta (%g) must be finite and > 0", (double) theta);
    if (!(freq_scale > 0.0f) || isinf(freq_scale))
        return gh_fail(GH_ERR_INVALID_ARG, "rope: freq_scale (%g) must be finite and > 0",
                       (double) freq_scale);
    for (int i = 0; freq_div && i < head_dim / 2; i++) {
        if (!(freq_div[i] > 0.0f) || isinf(freq_div[i]))
            return gh_fail(GH_ERR_INVALID_ARG, "rope: freq_div[%d] (%g) must be finite and > 0", i,
                           (double) freq_div[i]);
    }
    if (neox != 0 && neox != 1)
        return gh_fail(GH_ERR_INVALID_ARG, "rope: neox (%d) must be 0 or 1", neox);
    uint64_t row, total;
    if (!gh_mul_ok((uint64_t) n_head, (uint64_t) head_dim, &row) ||
        !gh_mul_ok(row, (uint64_t) n_tokens, &total) || total > (uint64_t) INT64_MAX / sizeof(float))
        return gh_fail(GH_ERR_INVALID_ARG, "rope: n_tokens * n_head * head_dim overflows");
    for (int64_t t = 0; t < n_tokens; t++) {
        if (pos[t] < 0)
            return gh_fail(GH_ERR_INVALID_ARG, "rope: pos[%lld] = %d is negative",
                           (long long) t, (int) pos[t]);
    }
    float * cs = malloc((size_t) head_dim * sizeof(float));
    if (!cs) return gh_fail(GH_ERR_OOM, "rope: out of memory");
    for (int64_t t = 0; t < n_tokens; t++) {
        gh_rope_angles(head_dim, pos[t], theta, freq_scale, freq_div, cs);
        gh_rope(x + t * (int64_t) row, n_head, head_dim, head_dim, cs, neox);
    }
    free(cs);
    return GH_OK;
}

gh_status gh_op_glu(int act, float t, const float * gate, const float * up, float * out,
                    int64_t n) {
    if (act < GH_ACT_SILU || act > GH_ACT_SWIGLU_OAI)
        return gh_fail(GH_ERR_INVALID_ARG, "glu: unknown activation %d", act);
    if ((act == GH_ACT_DRELU || act == GH_ACT_SWIGLU_OAI) && !up)
        return gh_fail(GH_ERR_INVALID_ARG, "glu: %s needs up (it has no ungated form)",
                       act == GH_ACT_DRELU ? "dReLU" : "the clamped SwiGLU");
    if (!isfinite(t)) return gh_fail(GH_ERR_INVALID_ARG, "glu: threshold (%g) must be finite", (double) t);
    if (!gate || !out) return gh_fail(GH_ERR_INVALID_ARG, "glu: gate and out must not be NULL");
    if (n <= 0) return gh_fail(GH_ERR_INVALID_ARG, "glu: n (%lld) must be positive", (long long) n);
    gh_glu(act, t, gate, up, out, n);
    return GH_OK;
}

gh_status gh_kv_cache_type_check(int kv_type, int head_dim) {
    if (kv_type != GH_TYPE_F32 && kv_type != GH_TYPE_F16 && kv_type != GH_TYPE_Q8_0) {
        const gh_type_traits * tt = gh_type_traits_get(kv_type);
        return gh_fail(GH_ERR_UNSUPPORTED, "KV cache type %s is not supported (use f32, f16 or q8_0)",
                       tt ? tt->name : "unknown");
    }
    if (kv_type == GH_TYPE_Q8_0 && head_dim % QK8_0 != 0)
        return gh_fail(GH_ERR_UNSUPPORTED, "a q8_0 KV cache needs a head size that is a multiple "
                       "of %d, not %d; use f16", QK8_0, head_dim);
    return GH_OK;
}

gh_status gh_op_attention(const float * q, const float * k, const float * v, float * out,
                          int64_t n_tokens, int64_t n_past, int n_head, int n_head_kv,
                          int head_dim, int n_threads) {
    return gh_op_attention_kv(GH_TYPE_F32, q, k, v, out, n_tokens, n_past, n_head, n_head_kv,
                              head_dim, n_threads);
}

gh_status gh_op_attention_kv(int kv_type, const float * q, const void * k, const void * v,
                             float * out, int64_t n_tokens, int64_t n_past, int n_head,
                             int n_head_kv, int head_dim, int n_threads) {
    if (head_dim <= 0)
        return gh_fail(GH_ERR_INVALID_ARG, "attention: head_dim (%d) must be positive", head_dim);
    return gh_op_attention_ext(kv_type, q, k, v, out, n_tokens, n_past, n_head, n_head_kv,
                               head_dim, n_threads, 1.0f / sqrtf((float) head_dim), 0.0f, 0, NULL);
}

gh_status gh_op_attention_ext(int kv_type, const float * q, const void * k, const void * v,
                              float * out, int64_t n_tokens, int64_t n_past, int n_head,
                              int n_head_kv, int head_dim, int n_threads, float scale,
                              float softcap, int64_t window, const float * sinks) {
    if (!isfinite(scale) || !(scale > 0))
        return gh_fail(GH_ERR_INVALID_ARG, "attention: scale (%g) must be finite and > 0", (double) scale);
    if (!isfinite(softcap) || softcap < 0)
        return gh_fail(GH_ERR_INVALID_ARG, "attention: softcap (%g) must be finite and >= 0 (0: none)",
                       (double) softcap);
    if (window < 0)
        return gh_fail(GH_ERR_INVALID_ARG, "attention: window (%lld) must be >= 0 (0: none)",
                       (long long) window);
    if (!q || !k || !v || !out)
        return gh_fail(GH_ERR_INVALID_ARG, "attention: q, k, v and out must not be NULL");
    if (n_tokens <= 0 || n_head <= 0 || n_head_kv <= 0 || head_dim <= 0)
        return gh_fail(GH_ERR_INVALID_ARG,
                       "attention: n_tokens (%lld), n_head (%d), n_head_kv (%d) and head_dim (%d) "
                       "must be positive", (long long) n_tokens, n_head, n_head_kv, head_dim);
    if (n_past < 0)
        return gh_fail(GH_ERR_INVALID_ARG, "attention: n_past (%lld) must be >= 0", (long long) n_past);
    if (n_head % n_head_kv != 0)
        return gh_fail(GH_ERR_INVALID_ARG, "attention: n_head (%d) is not a multiple of n_head_kv (%d)",
                       n_head, n_head_kv);
    for (int h = 0; sinks && h < n_head; h++) {
        if (!isfinite(sinks[h]))
            return gh_fail(GH_ERR_INVALID_ARG, "attention: sink %d (%g) must be finite", h, (double) sinks[h]);
    }
    if (n_threads <= 0)
        return gh_fail(GH_ERR_INVALID_ARG, "attention: n_threads (%d) must be positive", n_threads);
    uint64_t n_kv_total, q_elems, kv_elems;
    if (!gh_add_ok((uint64_t) n_past, (uint64_t) n_tokens, &n_kv_total) ||
        !gh_mul_ok(n_tokens, (uint64_t) n_head * (uint64_t) head_dim, &q_elems) ||
        !gh_mul_ok(n_kv_total, (uint64_t) n_head_kv * (uint64_t) head_dim, &kv_elems) ||
        q_elems > (uint64_t) INT64_MAX / sizeof(float) || kv_elems > (uint64_t) INT64_MAX / sizeof(float))
        return gh_fail(GH_ERR_INVALID_ARG, "attention: sizes overflow");
    gh_status st = gh_kv_cache_type_check(kv_type, head_dim);
    if (st) return st;

    gh_threadpool * tp;
    bool kept;
    if (gh_op_pool_acquire(n_threads, &tp, &kept)) return GH_ERR_OOM; /* message set */
    const gh_attn_opts o = { .scale = scale, .softcap = softcap, .window = window, .sinks = sinks };
    gh_attention_ex(tp, q, k, v, kv_type, out, n_tokens, n_past, n_head, n_head_kv, head_dim, &o);
    gh_op_pool_release(tp, kept);
    return GH_OK;
}
