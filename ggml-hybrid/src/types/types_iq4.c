/* IQ4_NL, IQ4_XS and MXFP4 (layouts: types/iq4.h): the dequantizers (bit for bit those of
 * gguf.quants: the same float products in the same order) and the reference quantizers.
 *
 * MXFP4's quantizer is ggml's (and gguf.quants'): e = floor(log2(amax)) - 2 + 127, so the
 * block's largest value lands on level 4..8 of the doubled e2m1 values, then each value
 * takes the level nearest it (the first on a tie). gguf.quants has no IQ4_NL / IQ4_XS
 * quantizer; ours fits each 32-value block's scale by least squares over a search of
 * candidate scales (the block's largest value put on or near either end level, as
 * llama.cpp's search does, unweighted: no importance matrix), then every value takes the
 * level nearest it at the stored (fp16 / 6-bit) scale. Its error on Gaussian rows is in
 * tests/ops/test_types_matmul.py (IQ4_NRMSE). */
#include "types/iq4.h"

#include <math.h>

const int8_t gh_kvalues_iq4nl[16] = { -127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113 };
const int8_t gh_kvalues_mxfp4[16] = { 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12 };

/* ---- dequantizers ---- */

void gh_iq4_nl_to_float(const void * src, float * dst, int64_t n) {
    const block_iq4_nl * b = src;
    for (int64_t i = 0; i < n / 32; i++, dst += 32) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float) gh_kvalues_iq4nl[b[i].qs[j] & 0x0f];
            dst[j + 16] = d * (float) gh_kvalues_iq4nl[b[i].qs[j] >> 4];
        }
    }
}

void gh_iq4_xs_to_float(const void * src, float * dst, int64_t n) {
    const block_iq4_xs * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++, dst += 32) {
            const float dl = d * (float) gh_iq4_xs_scale(&b[i], ib);
            const uint8_t * q = b[i].qs + 16 * ib;
            for (int j = 0; j < 16; j++) {
                dst[j] = dl * (float) gh_kvalues_iq4nl[q[j] & 0x0f];
                dst[j + 16] = dl * (float) gh_kvalues_iq4nl[q[j] >> 4];
            }
        }
    }
}

void gh_mxfp4_to_float(const void * src, float * dst, int64_t n) {
    const block_mxfp4 * b = src;
    for (int64_t i = 0; i < n / 32; i++, dst += 32) {
        const float d = gh_e8m0_to_fp32_half(b[i].e);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float) gh_kvalues_mxfp4[b[i].qs[j] & 0x0f];
            dst[j + 16] = d * (float) gh_kvalues_mxfp4[b[i].qs[j] >> 4];
        }
    }
}

/* ---- IQ4_NL / IQ4_XS quantizers ---- */

#define IQ4_REFIT 2 /* rounds of (levels at the stored scale, least-squares scale of them) */
#define IQ4_NTRY 7 /* candidate scales per end: the largest value at end level + -7..7 */

/* The index of the IQ4 level nearest v (v in level units). */
static inline int iq4_nearest(float v) {
    const int8_t * k = gh_kvalues_iq4nl;
    if (!(v > k[0])) return 0;
    if (v >= k[15]) return 15;
    int lo = 0, hi = 15; /* k[lo] < v < k[hi] (or v == k[lo]) */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (v < k[mid]) hi = mid;
        else lo = mid;
    }
    return v - k[lo] < k[hi] - v ? lo : hi;
}

/* The scale s of 32 values (x ~ s * level): the least-squares scale of the best of the
 * candidate assignments (largest value at either end level, +-IQ4_NTRY); 0 for a zero block. */
static float iq4_fit(const float * x) {
    float amax = 0.0f, xmax = 0.0f;
    for (int j = 0; j < 32; j++) {
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            xmax = x[j];
        }
    }
    if (!(amax > 0.0f) || !isfinite(amax)) return 0.0f;
    double best_d = xmax / (double) gh_kvalues_iq4nl[0], best = -1.0;
    for (int end = 0; end < 2; end++) {
        for (int t = -IQ4_NTRY; t <= IQ4_NTRY; t++) {
            const float id = (float) ((end ? gh_kvalues_iq4nl[15] : gh_kvalues_iq4nl[0]) + t) / xmax;
            double sqx = 0.0, sq2 = 0.0;
            for (int j = 0; j < 32; j++) {
                const double q = gh_kvalues_iq4nl[iq4_nearest(id * x[j])];
                sqx += q * x[j];
                sq2 += q * q;
            }
            /* the squared error at the LS scale is sum x^2 - sqx^2 / sq2 */
            if (sq2 > 0.0 && sqx * sqx > best * sq2) {
                best = sqx * sqx / sq2;
                best_d = sqx / sq2;
            }
        }
    }
    return (float) best_d;
}

/* The nibbles of 32 values at the stored scale s (qs[j]: values j and j + 16); returns
 * the least-squares scale of those levels (a refit for the next round). */
static float iq4_pack(const float * x, float s, uint8_t * qs) {
    const float is = s != 0.0f ? 1.0f / s : 0.0f;
    int L[32];
    double sqx = 0.0, sq2 = 0.0;
    for (int j = 0; j < 32; j++) {
        L[j] = iq4_nearest(x[j] * is);
        sqx += (double) gh_kvalues_iq4nl[L[j]] * x[j];
        sq2 += (double) gh_kvalues_iq4nl[L[j]] * gh_kvalues_iq4nl[L[j]];
    }
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t) (L[j] | L[j + 16] << 4);
    return s != 0.0f ? (float) (sqx / sq2) : 0.0f;
}

void gh_iq4_nl_from_float(const float * src, void * dst, int64_t n) {
    block_iq4_nl * b = dst;
    for (int64_t i = 0; i < n / 32; i++, src += 32) {
        float d = iq4_fit(src);
        for (int it = 0; it < IQ4_REFIT; it++) {
            b[i].d = gh_fp32_to_fp16(d);
            d = iq4_pack(src, gh_fp16_to_fp32(b[i].d), b[i].qs);
        }
    }
}

/* The squared error of 32 values at levels nearest them at scale s. */
static double iq4_err(const float * x, float s) {
    const float is = s != 0.0f ? 1.0f / s : 0.0f;
    double e = 0.0;
    for (int j = 0; j < 32; j++) {
        const double r = x[j] - (double) (s * (float) gh_kvalues_iq4nl[iq4_nearest(x[j] * is)]);
        e += r * r;
    }
    return e;
}

/* The 6-bit scale l (-32..31) of a sub-block of fitted scale s at super-block scale d. */
static inline int iq4_xs_l(float s, float id) {
    const long l = lrintf(s * id);
    return (int) (l < -32 ? -32 : l > 31 ? 31 : l);
}

/* Each sub-block's scale s fitted as IQ4_NL's; the super-block scale d from a few
 * candidates around -s_max / 32 (s_max the s of largest magnitude, which gets -32, the
 * end of the signed 6-bit range) and +s_max / 31, each sub-block at round(s / d): the
 * candidate of least squared error over the block. */
#define IQ4_XS_NTRY 8

void gh_iq4_xs_from_float(const float * src, void * dst, int64_t n) {
    block_iq4_xs * b = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K) {
        float s[QK_K / 32], smax = 0.0f;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            s[ib] = iq4_fit(src + 32 * ib);
            if (fabsf(s[ib]) > fabsf(smax)) smax = s[ib];
        }
        uint16_t best_h = gh_fp32_to_fp16(-smax / 32.0f);
        double best = -1.0;
        for (int end = 0; end < 2 && smax != 0.0f; end++) {
            for (int k = 0; k < IQ4_XS_NTRY; k++) {
                const float top = end ? 31.0f - 0.5f * (float) k : -32.0f + 0.5f * (float) k;
                const uint16_t h = gh_fp32_to_fp16(smax / top);
                const float d = gh_fp16_to_fp32(h);
                const float id = d != 0.0f ? 1.0f / d : 0.0f;
                double e = 0.0;
                for (int ib = 0; ib < QK_K / 32 && (best < 0.0 || e < best); ib++) {
                    e += iq4_err(src + 32 * ib, d * (float) iq4_xs_l(s[ib], id));
                }
                if (best < 0.0 || e < best) {
                    best = e;
                    best_h = h;
                }
            }
        }
        b[i].d = best_h;
        const float d = gh_fp16_to_fp32(b[i].d);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].scales_h = 0;
        memset(b[i].scales_l, 0, sizeof b[i].scales_l);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const int l = iq4_xs_l(s[ib], id);
            const int ls = l + 32;
            b[i].scales_l[ib / 2] |= (uint8_t) ((ls & 0x0f) << (4 * (ib % 2)));
            b[i].scales_h |= (uint16_t) ((ls >> 4) << (2 * ib));
            iq4_pack(src + 32 * ib, d * (float) l, b[i].qs + 16 * ib);
        }
    }
}

/* ---- MXFP4 quantizer (ggml's / gguf.quants') ---- */

void gh_mxfp4_from_float(const float * src, void * dst, int64_t n) {
    block_mxfp4 * b = dst;
    for (int64_t i = 0; i < n / 32; i++, src += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(src[j]));
        /* (amax below 2^-125 would give a negative exponent: clamped to 0, where ggml's
         * cast to uint8 is undefined and numpy's wraps around) */
        const float ef = amax > 0.0f && isfinite(amax) ? floorf(log2f(amax)) - 2.0f + 127.0f : 0.0f;
        b[i].e = (uint8_t) (ef < 0.0f ? 0.0f : ef > 255.0f ? 255.0f : ef);
        const float d = gh_e8m0_to_fp32_half(b[i].e);
        int L[32];
        for (int j = 0; j < 32; j++) {
            int best = 0;
            float err = fabsf(d * (float) gh_kvalues_mxfp4[0] - src[j]);
            for (int k = 1; k < 16; k++) {
                const float e = fabsf(d * (float) gh_kvalues_mxfp4[k] - src[j]);
                if (e < err) {
                    err = e;
                    best = k;
                }
            }
            L[j] = best;
        }
        for (int j = 0; j < 16; j++) b[i].qs[j] = (uint8_t) (L[j] | L[j + 16] << 4);
    }
}
