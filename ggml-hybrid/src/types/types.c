/* The tensor type table, fp16/bf16 conversions and the reference (scalar) quantizers.
 * The Q8_0/Q4_0/BF16 quantizers are byte-identical to ggml's reference ones (and to
 * gguf-py's gguf.quants, which the tests check against); the K-quant ones are our own
 * (gguf.quants has none), as accurate as ggml's (docs/BENCHMARKS.md, "K-quant kernels"),
 * and every dequantizer equals gguf.quants.dequantize bit for bit. */
#include "types/types.h"
#include "types/iq4.h"
#include "types/iqlat.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---- fp16 / bf16 ---- */

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float gh_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t) (h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000 | (mant << 13));   /* inf, NaN */
    if (exp == 0) {                                                       /* zero, subnormal */
        float v = (float) mant * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t gh_fp32_to_fp16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t) ((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return sign | 0x7e00 | (uint16_t) ((ax >> 13) & 0x3ff); /* NaN, quiet */
    if (ax >= 0x477ff000) return sign | 0x7c00;     /* rounds to (or is) infinity */
    if (ax < 0x38800000) {                          /* below the smallest normal half */
        /* |f| + 0.5 puts |f| / 2^-24, rounded to nearest even, in the low mantissa bits. */
        float v = bits_f32(ax) + 0.5f;
        return sign | (uint16_t) (f32_bits(v) - 0x3f000000u);
    }
    /* Normal: rebias the exponent and round the mantissa to nearest even. */
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
    return sign | (uint16_t) ((r - 0x38000000u) >> 13);
}

float gh_bf16_to_fp32(uint16_t h) { return bits_f32((uint32_t) h << 16); }

uint16_t gh_fp32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t) ((x >> 16) | 64); /* quiet NaN */
    return (uint16_t) ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* ---- reference conversions of whole rows ---- */

static void f32_to_float(const void * src, float * dst, int64_t n) {
    memcpy(dst, src, (size_t) n * sizeof(float));
}

static void f32_from_float(const float * src, void * dst, int64_t n) {
    memcpy(dst, src, (size_t) n * sizeof(float));
}

static void f16_to_float(const void * src, float * dst, int64_t n) {
    const uint16_t * s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = gh_fp16_to_fp32(s[i]);
}

static void f16_from_float(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = gh_fp32_to_fp16(src[i]);
}

static void bf16_to_float(const void * src, float * dst, int64_t n) {
    const uint16_t * s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = gh_bf16_to_fp32(s[i]);
}

static void bf16_from_float(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = gh_fp32_to_bf16(src[i]);
}

static void q8_0_to_float(const void * src, float * dst, int64_t n) {
    const block_q8_0 * b = src;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        float d = gh_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK8_0; j++) dst[i * QK8_0 + j] = d * (float) b[i].qs[j];
    }
}

/* d = amax / 127, q = round(x / d) (rounded half away from zero, as roundf). */
static void q8_0_from_float(const float * src, void * dst, int64_t n) {
    block_q8_0 * b = dst;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        const float * x = src + i * QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = gh_fp32_to_fp16(d);
        for (int j = 0; j < QK8_0; j++) b[i].qs[j] = (int8_t) roundf(x[j] * id);
    }
}

static void q4_0_to_float(const void * src, float * dst, int64_t n) {
    const block_q4_0 * b = src;
    for (int64_t i = 0; i < n / QK4_0; i++) {
        float d = gh_fp16_to_fp32(b[i].d);
        float * y = dst + i * QK4_0;
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = d * (float) ((b[i].qs[j] & 0x0f) - 8);
            y[j + QK4_0 / 2] = d * (float) ((b[i].qs[j] >> 4) - 8);
        }
    }
}

/* The value of largest magnitude (first one on ties), sign kept, maps to -8:
 * d = max / -8, q = min(15, trunc(x / d + 8.5)). */
static void q4_0_from_float(const float * src, void * dst, int64_t n) {
    block_q4_0 * b = dst;
    for (int64_t i = 0; i < n / QK4_0; i++) {
        const float * x = src + i * QK4_0;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK4_0; j++) {
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = gh_fp32_to_fp16(d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            const float x0 = x[j] * id;
            const float x1 = x[j + QK4_0 / 2] * id;
            const uint8_t q0 = (uint8_t) GH_MIN(15, (int8_t) (x0 + 8.5f));
            const uint8_t q1 = (uint8_t) GH_MIN(15, (int8_t) (x1 + 8.5f));
            b[i].qs[j] = (uint8_t) (q0 | (q1 << 4));
        }
    }
}

/* ---- K-quants (QK_K = 256 per block; layouts in types.h) ---- */

/* The float order of each value is gguf.quants.dequantize's: (d * sc) * q - (dmin * m),
 * so the values are bit-identical to it. */
static void q4_K_to_float(const void * src, float * dst, int64_t n) {
    const block_q4_K * b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = gh_fp16_to_fp32(b[i].d), dmin = gh_fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            gh_k4_scale_min(b[i].scales, j, &sc, &m);
            const float dl = d * (float) sc, ml = dmin * (float) m;
            const uint8_t * q = b[i].qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) dst[32 * j + l] = dl * (float) ((q[l] >> shift) & 0x0f) - ml;
        }
    }
}

static void q5_K_to_float(const void * src, float * dst, int64_t n) {
    const block_q5_K * b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = gh_fp16_to_fp32(b[i].d), dmin = gh_fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            gh_k4_scale_min(b[i].scales, j, &sc, &m);
            const float dl = d * (float) sc, ml = dmin * (float) m;
            const uint8_t * q = b[i].qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) {
                const int v = ((q[l] >> shift) & 0x0f) | (((b[i].qh[l] >> j) & 1) << 4);
                dst[32 * j + l] = dl * (float) v - ml;
            }
        }
    }
}

/* Value v < 256 of a Q6_K block, 0..63 (see types.h). */
static inline int q6_K_at(const block_q6_K * b, int v) {
    const int h = v / 128, g = (v % 128) / 32, l = v % 32;
    const int lo = (b->ql[64 * h + l + 32 * (g & 1)] >> (4 * (g >> 1))) & 0x0f;
    const int hi = (b->qh[32 * h + l] >> (2 * g)) & 3;
    return lo | (hi << 4);
}

static void q6_K_to_float(const void * src, float * dst, int64_t n) {
    const block_q6_K * b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK_K / 16; j++) {
            const float dl = d * (float) b[i].scales[j];
            for (int l = 0; l < 16; l++) dst[16 * j + l] = dl * (float) (q6_K_at(&b[i], 16 * j + l) - 32);
        }
    }
}

/* The quantizers choose, per sub-block, the scale (and min) of least squared error
 * weighted by w_i = rms(x) + |x_i|, which leans towards the large values, over a
 * small set of candidate grids each refitted by least squares; then the sub-block
 * scales are themselves quantized (6 bits against the block's fp16 d; 8 bits for Q6_K)
 * and the values are requantized against the scales as stored, so the rounding of the
 * scales is absorbed by the values. */

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }
static inline int round_int(float v) { return (int) lrintf(v); }

static void k_weights(const float * x, int n, float * w) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float rms = sqrtf(ss / (float) n);
    for (int i = 0; i < n; i++) w[i] = rms + fabsf(x[i]);
}

/* x[0..n) ~ scale * q + mn, q = 0..nmax, mn <= 0. Returns the scale (>= 0), *neg_min = -mn. */
static float fit_scale_min(const float * x, const float * w, int n, int nmax, float * neg_min) {
    float xmin = x[0], xmax = x[0];
    for (int i = 1; i < n; i++) {
        xmin = fminf(xmin, x[i]);
        xmax = fmaxf(xmax, x[i]);
    }
    if (xmin > 0.0f) xmin = 0.0f;
    if (xmax <= xmin) {
        *neg_min = -xmin;
        return 0.0f;
    }
    float best_scale = (xmax - xmin) / (float) nmax, best_mn = xmin, best_err = INFINITY;
    for (int k = -10; k <= 10; k++) {
        const float iscale = ((float) nmax + 0.1f * (float) k) / (xmax - xmin);
        double sw = 0, sq = 0, sqq = 0, sx = 0, sqx = 0;
        int q[QK_K];
        for (int i = 0; i < n; i++) {
            q[i] = clampi(round_int(iscale * (x[i] - xmin)), 0, nmax);
            sw += w[i];
            sq += w[i] * q[i];
            sqq += (double) w[i] * q[i] * q[i];
            sx += w[i] * x[i];
            sqx += (double) w[i] * q[i] * x[i];
        }
        const double det = sw * sqq - sq * sq;
        if (det <= 0) continue;
        double scale = (sw * sqx - sq * sx) / det, mn = (sqq * sx - sq * sqx) / det;
        if (mn > 0) {
            mn = 0;
            scale = sqx / sqq;
        }
        if (scale <= 0) continue;
        double err = 0;
        for (int i = 0; i < n; i++) {
            const double e = scale * q[i] + mn - x[i];
            err += w[i] * e * e;
        }
        if (err < best_err) {
            best_err = (float) err;
            best_scale = (float) scale;
            best_mn = (float) mn;
        }
    }
    *neg_min = -best_mn;
    return best_scale;
}

/* x[0..n) ~ scale * q, q = -nq..nq-1 (either sign of the scale; n <= 16). */
static float fit_scale_sym(const float * x, const float * w, int n, int nq) {
    float amax = 0.0f, mx = 0.0f;
    for (int i = 0; i < n; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            mx = x[i];
        }
    }
    if (amax == 0.0f) return 0.0f;
    float best = mx / -(float) nq, best_err = INFINITY;
    for (int side = 0; side < 2; side++) {
        for (int k = -9; k <= 9; k++) {
            const float iscale = side == 0 ? -((float) nq + 0.1f * (float) k) / mx
                                           : ((float) (nq - 1) + 0.1f * (float) k) / mx;
            double sqx = 0, sqq = 0;
            int q[16];
            for (int i = 0; i < n; i++) {
                q[i] = clampi(round_int(iscale * x[i]), -nq, nq - 1);
                sqx += (double) w[i] * q[i] * x[i];
                sqq += (double) w[i] * q[i] * q[i];
            }
            if (sqq <= 0) continue;
            const double scale = sqx / sqq;
            double err = 0;
            for (int i = 0; i < n; i++) {
                const double e = scale * q[i] - x[i];
                err += w[i] * e * e;
            }
            if (err < best_err) {
                best_err = (float) err;
                best = (float) scale;
            }
        }
    }
    return best;
}

/* The shared part of Q4_K and Q5_K: d, dmin and the packed 6-bit scales and mins of a
 * block, and its values q[0..256) (0..nmax) against them as stored. */
static void quantize_k4_block(const float * x, int nmax, uint16_t * d_out, uint16_t * dmin_out,
                              uint8_t * scales, uint8_t * q) {
    float w[32], sub_scale[8], sub_min[8], max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 8; j++) {
        k_weights(x + 32 * j, 32, w);
        sub_scale[j] = fit_scale_min(x + 32 * j, w, 32, nmax, &sub_min[j]);
        max_scale = fmaxf(max_scale, sub_scale[j]);
        max_min = fmaxf(max_min, sub_min[j]);
    }
    *d_out = gh_fp32_to_fp16(max_scale / 63.0f);
    *dmin_out = gh_fp32_to_fp16(max_min / 63.0f);
    const float d = gh_fp16_to_fp32(*d_out), dmin = gh_fp16_to_fp32(*dmin_out);
    const float id = d > 0.0f ? 1.0f / d : 0.0f, idmin = dmin > 0.0f ? 1.0f / dmin : 0.0f;
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; j++) {
        sc[j] = (uint8_t) clampi(round_int(sub_scale[j] * id), 0, 63);
        m[j] = (uint8_t) clampi(round_int(sub_min[j] * idmin), 0, 63);
    }
    memset(scales, 0, K_SCALE_SIZE);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            scales[j] |= sc[j];
            scales[j + 4] |= m[j];
        } else {
            scales[j + 4] = (uint8_t) ((sc[j] & 0x0f) | ((m[j] & 0x0f) << 4));
            scales[j - 4] |= (uint8_t) ((sc[j] >> 4) << 6);
            scales[j] |= (uint8_t) ((m[j] >> 4) << 6);
        }
    }
    for (int j = 0; j < 8; j++) {
        const float dl = d * (float) sc[j], ml = dmin * (float) m[j];
        const float idl = dl > 0.0f ? 1.0f / dl : 0.0f;
        for (int l = 0; l < 32; l++) q[32 * j + l] = (uint8_t) clampi(round_int((x[32 * j + l] + ml) * idl), 0, nmax);
    }
}

static void q4_K_from_float(const float * src, void * dst, int64_t n) {
    block_q4_K * b = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K) {
        uint8_t q[QK_K];
        quantize_k4_block(src, 15, &b[i].d, &b[i].dmin, b[i].scales, q);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) b[i].qs[32 * c + l] = (uint8_t) (q[64 * c + l] | (q[64 * c + 32 + l] << 4));
    }
}

static void q5_K_from_float(const float * src, void * dst, int64_t n) {
    block_q5_K * b = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K) {
        uint8_t q[QK_K];
        quantize_k4_block(src, 31, &b[i].d, &b[i].dmin, b[i].scales, q);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * c + l] = (uint8_t) ((q[64 * c + l] & 0x0f) | ((q[64 * c + 32 + l] & 0x0f) << 4));
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) b[i].qh[l] |= (uint8_t) (((q[32 * j + l] >> 4) & 1) << j);
    }
}

static void q6_K_from_float(const float * src, void * dst, int64_t n) {
    block_q6_K * b = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K) {
        float w[16], sub[16], amax = 0.0f;
        for (int j = 0; j < 16; j++) {
            k_weights(src + 16 * j, 16, w);
            sub[j] = fit_scale_sym(src + 16 * j, w, 16, 32);
            amax = fmaxf(amax, fabsf(sub[j]));
        }
        b[i].d = gh_fp32_to_fp16(amax / 127.0f);
        const float d = gh_fp16_to_fp32(b[i].d);
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[QK_K];
        for (int j = 0; j < 16; j++) {
            b[i].scales[j] = (int8_t) clampi(round_int(sub[j] * id), -127, 127);
            const float dl = d * (float) b[i].scales[j];
            const float idl = dl != 0.0f ? 1.0f / dl : 0.0f;
            for (int l = 0; l < 16; l++) q[16 * j + l] = (uint8_t) (clampi(round_int(src[16 * j + l] * idl), -32, 31) + 32);
        }
        for (int h = 0; h < 2; h++) {
            const uint8_t * qq = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                b[i].ql[64 * h + l] = (uint8_t) ((qq[l] & 0x0f) | ((qq[64 + l] & 0x0f) << 4));
                b[i].ql[64 * h + 32 + l] = (uint8_t) ((qq[32 + l] & 0x0f) | ((qq[96 + l] & 0x0f) << 4));
                b[i].qh[32 * h + l] = (uint8_t) ((qq[l] >> 4) | ((qq[32 + l] >> 4) << 2) |
                                                 ((qq[64 + l] >> 4) << 4) | ((qq[96 + l] >> 4) << 6));
            }
        }
    }
}

/* ---- Q2_K, Q3_K (16 sub-blocks of 16 values) ---- */

/* As Q4_K: (d * sc) * q - (dmin * m), gguf.quants.dequantize's float order. */
static void q2_K_to_float(const void * src, float * dst, int64_t n) {
    const block_q2_K * b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = gh_fp16_to_fp32(b[i].d), dmin = gh_fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < 16; j++) {
            const float dl = d * (float) (b[i].scales[j] & 0x0f), ml = dmin * (float) (b[i].scales[j] >> 4);
            for (int l = 0; l < 16; l++) dst[16 * j + l] = dl * (float) gh_k2_low(b[i].qs, 16 * j + l) - ml;
        }
    }
}

static inline int q3_K_at(const block_q3_K * b, int v) {
    return gh_k2_low(b->qs, v) - (((b->hmask[v & 31] >> (v >> 5)) & 1) ? 0 : 4);
}

/* (d * (sc - 32)) * (q - 4), gguf.quants.dequantize's float order. */
static void q3_K_to_float(const void * src, float * dst, int64_t n) {
    const block_q3_K * b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int j = 0; j < 16; j++) {
            const float dl = d * (float) (gh_k3_scale(b[i].scales, j) - 32);
            for (int l = 0; l < 16; l++) dst[16 * j + l] = dl * (float) q3_K_at(&b[i], 16 * j + l);
        }
    }
}

/* The 2-bit parts of q[0..256) into qs[64] (gh_k2_low's order). */
static void k2_pack(const uint8_t * q, uint8_t * qs) {
    memset(qs, 0, QK_K / 4);
    for (int v = 0; v < QK_K; v++) qs[32 * (v >> 7) + (v & 31)] |= (uint8_t) ((q[v] & 3) << (2 * ((v >> 5) & 3)));
}

/* Per sub-block the weighted least-squares scale and min (q = 0..3, fit_scale_min), then
 * both quantized to 4 bits against the block's d = max scale / 15, dmin = max min / 15, and
 * the values requantized against them as stored. */
static void q2_K_from_float(const float * src, void * dst, int64_t n) {
    block_q2_K * b = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K) {
        float w[16], sub_scale[16], sub_min[16], max_scale = 0.0f, max_min = 0.0f;
        for (int j = 0; j < 16; j++) {
            k_weights(src + 16 * j, 16, w);
            sub_scale[j] = fit_scale_min(src + 16 * j, w, 16, 3, &sub_min[j]);
            max_scale = fmaxf(max_scale, sub_scale[j]);
            max_min = fmaxf(max_min, sub_min[j]);
        }
        b[i].d = gh_fp32_to_fp16(max_scale / 15.0f);
        b[i].dmin = gh_fp32_to_fp16(max_min / 15.0f);
        const float d = gh_fp16_to_fp32(b[i].d), dmin = gh_fp16_to_fp32(b[i].dmin);
        const float id = d > 0.0f ? 1.0f / d : 0.0f, idmin = dmin > 0.0f ? 1.0f / dmin : 0.0f;
        uint8_t q[QK_K];
        for (int j = 0; j < 16; j++) {
            const int sc = clampi(round_int(sub_scale[j] * id), 0, 15);
            const int m = clampi(round_int(sub_min[j] * idmin), 0, 15);
            b[i].scales[j] = (uint8_t) (sc | (m << 4));
            const float dl = d * (float) sc, ml = dmin * (float) m;
            const float idl = dl > 0.0f ? 1.0f / dl : 0.0f;
            for (int l = 0; l < 16; l++) q[16 * j + l] = (uint8_t) clampi(round_int((src[16 * j + l] + ml) * idl), 0, 3);
        }
        k2_pack(q, b[i].qs);
    }
}

/* Per sub-block the weighted least-squares scale (q = -4..3, fit_scale_sym), the scales
 * quantized to 6 bits against d = (the scale of largest magnitude) / -32, the values
 * requantized against them as stored. */
static void q3_K_from_float(const float * src, void * dst, int64_t n) {
    block_q3_K * b = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K) {
        float w[16], sub[16], amax = 0.0f, smax = 0.0f;
        for (int j = 0; j < 16; j++) {
            k_weights(src + 16 * j, 16, w);
            sub[j] = fit_scale_sym(src + 16 * j, w, 16, 4);
            if (fabsf(sub[j]) > amax) {
                amax = fabsf(sub[j]);
                smax = sub[j];
            }
        }
        b[i].d = gh_fp32_to_fp16(smax / -32.0f);
        const float d = gh_fp16_to_fp32(b[i].d);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[QK_K];
        memset(b[i].scales, 0, sizeof b[i].scales);
        memset(b[i].hmask, 0, sizeof b[i].hmask);
        for (int j = 0; j < 16; j++) {
            const int sc = clampi(round_int(sub[j] * id), -32, 31);
            const int u = sc + 32;
            if (j < 8) b[i].scales[j] |= (uint8_t) (u & 0x0f);
            else b[i].scales[j - 8] |= (uint8_t) ((u & 0x0f) << 4);
            b[i].scales[8 + (j & 3)] |= (uint8_t) ((u >> 4) << (2 * (j >> 2)));
            const float dl = d * (float) sc;
            const float idl = dl != 0.0f ? 1.0f / dl : 0.0f;
            for (int l = 0; l < 16; l++) {
                const int v = 16 * j + l;
                q[v] = (uint8_t) (clampi(round_int(src[v] * idl), -4, 3) + 4);
                b[i].hmask[v & 31] |= (uint8_t) ((q[v] >> 2) << (v >> 5));
            }
        }
        k2_pack(q, b[i].qs);
    }
}

/* ---- Q4_1, Q5_0, Q5_1 (ggml's reference quantizers, as gguf.quants computes them) ---- */

static void q4_1_to_float(const void * src, float * dst, int64_t n) {
    const block_q4_1 * b = src;
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = gh_fp16_to_fp32(b[i].d), m = gh_fp16_to_fp32(b[i].m);
        float * y = dst + i * 32;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float) (b[i].qs[j] & 0x0f) + m;
            y[j + 16] = d * (float) (b[i].qs[j] >> 4) + m;
        }
    }
}

/* min and max of a block: d = (max - min) / 15, q = min(15, trunc((x - min) / d + 0.5)). */
static void q4_1_from_float(const float * src, void * dst, int64_t n) {
    block_q4_1 * b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        const float * x = src + i * 32;
        float min = x[0], max = x[0];
        for (int j = 1; j < 32; j++) {
            min = fminf(min, x[j]);
            max = fmaxf(max, x[j]);
        }
        const float d = (max - min) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = gh_fp32_to_fp16(d);
        b[i].m = gh_fp32_to_fp16(min);
        for (int j = 0; j < 16; j++) {
            const int q0 = GH_MIN(15, (int) ((x[j] - min) * id + 0.5f));
            const int q1 = GH_MIN(15, (int) ((x[j + 16] - min) * id + 0.5f));
            b[i].qs[j] = (uint8_t) (q0 | (q1 << 4));
        }
    }
}

static void q5_pack(const int * q, uint8_t * qs, uint8_t * qh) {
    uint32_t h = 0;
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t) ((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
    for (int j = 0; j < 32; j++) h |= (uint32_t) (q[j] >> 4) << j;
    for (int k = 0; k < 4; k++) qh[k] = (uint8_t) (h >> (8 * k));
}

static void q5_0_to_float(const void * src, float * dst, int64_t n) {
    const block_q5_0 * b = src;
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int j = 0; j < 32; j++) dst[i * 32 + j] = d * (float) (gh_q5_value(b[i].qs, b[i].qh, j) - 16);
    }
}

/* As Q4_0 with 32 levels: the value of largest magnitude maps to -16, d = max / -16,
 * q = min(31, trunc(x / d + 16.5)). */
static void q5_0_from_float(const float * src, void * dst, int64_t n) {
    block_q5_0 * b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        const float * x = src + i * 32;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 32; j++) {
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        const float d = max / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = gh_fp32_to_fp16(d);
        int q[32];
        for (int j = 0; j < 32; j++) q[j] = GH_MIN(31, (int) (x[j] * id + 16.5f));
        q5_pack(q, b[i].qs, b[i].qh);
    }
}

static void q5_1_to_float(const void * src, float * dst, int64_t n) {
    const block_q5_1 * b = src;
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = gh_fp16_to_fp32(b[i].d), m = gh_fp16_to_fp32(b[i].m);
        for (int j = 0; j < 32; j++) dst[i * 32 + j] = d * (float) gh_q5_value(b[i].qs, b[i].qh, j) + m;
    }
}

static void q5_1_from_float(const float * src, void * dst, int64_t n) {
    block_q5_1 * b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        const float * x = src + i * 32;
        float min = x[0], max = x[0];
        for (int j = 1; j < 32; j++) {
            min = fminf(min, x[j]);
            max = fmaxf(max, x[j]);
        }
        const float d = (max - min) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = gh_fp32_to_fp16(d);
        b[i].m = gh_fp32_to_fp16(min);
        int q[32];
        for (int j = 0; j < 32; j++) q[j] = GH_MIN(31, (int) ((x[j] - min) * id + 0.5f));
        q5_pack(q, b[i].qs, b[i].qh);
    }
}

/* ---- the table ---- */

#define ROW(nm, bs, sz, q, to, from, vdt) { nm, bs, sz, q, to, from, vdt }
#define LAYOUT(nm, bs, sz) { nm, bs, sz, true, NULL, NULL, 0 }

/* Indexed by ggml's type id. The rows with a to_float are the types this runtime reads;
 * the others name a type (and its block) so that a file holding one is refused by name. */
static const gh_type_traits k_types[GH_TYPE_COUNT] = {
    [GH_TYPE_F32]  = ROW("f32", 1, sizeof(float), false, f32_to_float, f32_from_float, GH_TYPE_F32),
    [GH_TYPE_F16]  = ROW("f16", 1, sizeof(uint16_t), false, f16_to_float, f16_from_float, GH_TYPE_F32),
    [GH_TYPE_BF16] = ROW("bf16", 1, sizeof(uint16_t), false, bf16_to_float, bf16_from_float, GH_TYPE_BF16),
    [GH_TYPE_Q8_0] = ROW("q8_0", QK8_0, sizeof(block_q8_0), true, q8_0_to_float, q8_0_from_float, GH_TYPE_Q8_X4),
    [GH_TYPE_Q4_0] = ROW("q4_0", QK4_0, sizeof(block_q4_0), true, q4_0_to_float, q4_0_from_float, GH_TYPE_Q8_X4),
    [GH_TYPE_Q4_1] = ROW("q4_1", 32, sizeof(block_q4_1), true, q4_1_to_float, q4_1_from_float, GH_TYPE_Q8_X4),
    [GH_TYPE_Q5_0] = ROW("q5_0", 32, sizeof(block_q5_0), true, q5_0_to_float, q5_0_from_float, GH_TYPE_Q8_X4),
    [GH_TYPE_Q5_1] = ROW("q5_1", 32, sizeof(block_q5_1), true, q5_1_to_float, q5_1_from_float, GH_TYPE_Q8_X4),
    [GH_TYPE_Q4_K] = ROW("Q4_K", QK_K, sizeof(block_q4_K), true, q4_K_to_float, q4_K_from_float, GH_TYPE_Q8_K),
    [GH_TYPE_Q5_K] = ROW("Q5_K", QK_K, sizeof(block_q5_K), true, q5_K_to_float, q5_K_from_float, GH_TYPE_Q8_K),
    [GH_TYPE_Q6_K] = ROW("Q6_K", QK_K, sizeof(block_q6_K), true, q6_K_to_float, q6_K_from_float, GH_TYPE_Q8_K),
    [GH_TYPE_Q2_K] = ROW("Q2_K", QK_K, sizeof(block_q2_K), true, q2_K_to_float, q2_K_from_float, GH_TYPE_Q8_K),
    [GH_TYPE_Q3_K] = ROW("Q3_K", QK_K, sizeof(block_q3_K), true, q3_K_to_float, q3_K_from_float, GH_TYPE_Q8_K),
    [GH_TYPE_IQ4_NL] = ROW("iq4_nl", 32, sizeof(block_iq4_nl), true, gh_iq4_nl_to_float, gh_iq4_nl_from_float, GH_TYPE_Q8_X4),
    [GH_TYPE_IQ4_XS] = ROW("iq4_xs", QK_K, sizeof(block_iq4_xs), true, gh_iq4_xs_to_float, gh_iq4_xs_from_float, GH_TYPE_Q8_K),
    [GH_TYPE_MXFP4]  = ROW("mxfp4", 32, sizeof(block_mxfp4), true, gh_mxfp4_to_float, gh_mxfp4_from_float, GH_TYPE_Q8_X4),
#if GH_IQ_GRIDS
    /* the lattice types: read, not written (no reference quantizer: types_iqlat.c) */
    [GH_TYPE_IQ2_XXS] = ROW("iq2_xxs", QK_K, sizeof(block_iq2_xxs), true, gh_iq2_xxs_to_float, NULL, GH_TYPE_Q8_K),
    [GH_TYPE_IQ2_XS]  = ROW("iq2_xs", QK_K, sizeof(block_iq2_xs), true, gh_iq2_xs_to_float, NULL, GH_TYPE_Q8_K),
    [GH_TYPE_IQ2_S]   = ROW("iq2_s", QK_K, sizeof(block_iq2_s), true, gh_iq2_s_to_float, NULL, GH_TYPE_Q8_K),
    [GH_TYPE_IQ3_XXS] = ROW("iq3_xxs", QK_K, sizeof(block_iq3_xxs), true, gh_iq3_xxs_to_float, NULL, GH_TYPE_Q8_K),
    [GH_TYPE_IQ3_S]   = ROW("iq3_s", QK_K, sizeof(block_iq3_s), true, gh_iq3_s_to_float, NULL, GH_TYPE_Q8_K),
    [GH_TYPE_IQ1_S]   = ROW("iq1_s", QK_K, sizeof(block_iq1_s), true, gh_iq1_s_to_float, NULL, GH_TYPE_Q8_K),
    [GH_TYPE_IQ1_M]   = ROW("iq1_m", QK_K, sizeof(block_iq1_m), true, gh_iq1_m_to_float, NULL, GH_TYPE_Q8_K),
#else
    /* built without their codebooks (iq_grids.h says why): refused by name */
    [GH_TYPE_IQ2_XXS] = LAYOUT("iq2_xxs", 256, 66), [GH_TYPE_IQ2_XS] = LAYOUT("iq2_xs", 256, 74),
    [GH_TYPE_IQ2_S] = LAYOUT("iq2_s", 256, 82), [GH_TYPE_IQ3_XXS] = LAYOUT("iq3_xxs", 256, 98),
    [GH_TYPE_IQ3_S] = LAYOUT("iq3_s", 256, 110), [GH_TYPE_IQ1_S] = LAYOUT("iq1_s", 256, 50),
    [GH_TYPE_IQ1_M] = LAYOUT("iq1_m", 256, 56),
#endif
    /* index tensors (gpu_idx, gpu_bucket): the loader reads them itself, never as a weight */
    [GH_TYPE_I32]  = { "I32", 1, 4, false, NULL, NULL, 0 },
    /* the rest of ggml's types (ids and blocks as gguf.constants.GGML_QUANT_SIZES) */
    [9] = LAYOUT("Q8_1", 32, 40),
    [15] = LAYOUT("Q8_K", 256, 292),
    [24] = { "I8", 1, 1, false, NULL, NULL, 0 }, [25] = { "I16", 1, 2, false, NULL, NULL, 0 },
    [27] = { "I64", 1, 8, false, NULL, NULL, 0 }, [28] = { "F64", 1, 8, false, NULL, NULL, 0 },
    [34] = LAYOUT("TQ1_0", 256, 54), [35] = LAYOUT("TQ2_0", 256, 66),
    [40] = LAYOUT("NVFP4", 64, 36), [41] = LAYOUT("Q1_0", 128, 18),
};

const gh_type_traits * gh_type_layout(int type) {
    if (type < 0 || type >= GH_TYPE_COUNT || !k_types[type].name) return NULL;
    return &k_types[type];
}

const gh_type_traits * gh_type_traits_get(int type) {
    const gh_type_traits * t = gh_type_layout(type);
    return t && t->to_float ? t : NULL;
}

bool gh_type_valid(int type) { return gh_type_traits_get(type) != NULL; }

size_t gh_row_size(int type, int64_t n) {
    if (n < 0) return 0;
    if (type == GH_TYPE_Q8_X4) {
        if (n % QK8_0) return 0;
        return (size_t) ((n + QK8_X4 - 1) / QK8_X4) * sizeof(block_q8_x4);
    }
    if (type == GH_TYPE_Q8_K) return n % QK_K ? 0 : (size_t) (n / QK_K) * sizeof(block_q8_K);
    const gh_type_traits * t = gh_type_traits_get(type);
    if (!t || n % t->block_size) return 0;
    return (size_t) (n / t->block_size) * t->type_size;
}

static char g_read_list[640];
static pthread_once_t g_read_list_once = PTHREAD_ONCE_INIT;

static void make_read_list(void) {
    size_t len = 0;
    for (int i = 0; i < GH_TYPE_COUNT; i++) {
        if (!gh_type_traits_get(i)) continue;
        len += (size_t) snprintf(g_read_list + len, sizeof g_read_list - len, "%s, ", k_types[i].name);
        if (len >= sizeof g_read_list) break;
    }
    if (len < sizeof g_read_list) len += (size_t) snprintf(g_read_list + len, sizeof g_read_list - len, "and I32 (index tensors)");
#if !GH_IQ_GRIDS
    /* the lattice types are known by name but this build has not their codebooks */
    if (len < sizeof g_read_list) {
        snprintf(g_read_list + len, sizeof g_read_list - len, "; not the IQ1/IQ2/IQ3 lattice types: %s",
                 GH_IQ_GRIDS_MISSING);
    }
#endif
}

const char * gh_types_read_list(void) {
    pthread_once(&g_read_list_once, make_read_list);
    return g_read_list;
}

/* ---- public API ---- */

size_t gh_type_row_size(int type, int64_t n) {
    return gh_type_valid(type) ? gh_row_size(type, n) : 0;
}

int64_t gh_type_block_size(int type) {
    const gh_type_traits * t = gh_type_traits_get(type);
    return t ? t->block_size : 0;
}

const char * gh_type_name(int type) {
    const gh_type_traits * t = gh_type_layout(type);
    return t ? t->name : "unknown";
}

static gh_status check_row_args(const char * fn, int type, const void * src, const void * dst,
                                int64_t n) {
    const gh_type_traits * t = gh_type_traits_get(type);
    if (!t) return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown tensor type %d", fn, type);
    if (n < 0) return gh_fail(GH_ERR_INVALID_ARG, "%s: negative length %lld", fn, (long long) n);
    if (n % t->block_size) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: length %lld is not a multiple of %s's block size %lld",
                       fn, (long long) n, t->name, (long long) t->block_size);
    }
    if (n > 0 && (!src || !dst)) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    return GH_OK;
}

gh_status gh_quantize_row(int type, const float * src, void * dst, int64_t n) {
    gh_status st = check_row_args("gh_quantize_row", type, src, dst, n);
    if (st != GH_OK) return st;
    if (!gh_type_traits_get(type)->from_float) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_quantize_row: %s is read but not written by this runtime "
                       "(no reference quantizer: llama.cpp's needs an importance matrix)",
                       gh_type_traits_get(type)->name);
    }
    if (n > 0) gh_type_traits_get(type)->from_float(src, dst, n);
    return GH_OK;
}

gh_status gh_dequantize_row(int type, const void * src, float * dst, int64_t n) {
    gh_status st = check_row_args("gh_dequantize_row", type, src, dst, n);
    if (st != GH_OK) return st;
    if (n > 0) gh_type_traits_get(type)->to_float(src, dst, n);
    return GH_OK;
}
