/* Scalar reference kernels: the ground truth the SIMD kernels are tested against.
 * Plain loops, double accumulators for the float types, exact integer dots per block
 * for the quantized types. */
#include "cpu/kernels.h"
#include "types/iq4.h"
#include "types/iqlat.h"

#include <math.h>
#include <string.h>

/* ---- activation conversions ---- */

/* round(v) as an int8 code, clamped to +-127: a finite activation's code is within it
 * already; a non-finite one (NaN, or a row that overflowed: the output is NaN either way)
 * must not reach the float-to-int conversion, which is undefined for it. */
static inline int8_t q8_code(float v) { return (int8_t) roundf(fminf(127.0f, fmaxf(-127.0f, v))); }

static void bf16_from_float_x(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = gh_fp32_to_bf16(src[i]);
}

/* Q8_0-style quantization of an activation row into the Q8_X4 layout (see kernels.h). */
void gh_quantize_row_q8_x4_ref(const float * x, void * dst, int64_t n) {
    const int64_t nb = n / QK8_0;
    const int64_t ng = (nb + 3) / 4;
    block_q8_x4 * g = dst;
    memset(g, 0, (size_t) ng * sizeof *g);
    for (int64_t b = 0; b < nb; b++) {
        block_q8_x4 * y = &g[b / 4];
        const int i = (int) (b % 4);
        const float * xb = x + b * QK8_0;
        float amax = 0.0f;
        bool nan = false;
        for (int j = 0; j < QK8_0; j++) {
            amax = fmaxf(amax, fabsf(xb[j]));
            nan |= xb[j] != xb[j];
        }
        const float d = nan ? NAN : amax / 127.0f;  /* a NaN makes its block's results NaN */
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            int8_t q0 = q8_code(xb[j] * id);
            int8_t q1 = q8_code(xb[j + 16] * id);
            y->qa[16 * i + j] = q0;
            y->qb[16 * i + j] = q1;
            sum += q0 + q1;
        }
        for (int j = 0; j < 4; j++) {
            y->nsum[4 * i + j] = -sum;
            y->d[4 * i + j] = d;
        }
    }
}

/* Q8_K: one scale per 256 values (d = amax / 127, q = round(x / d)) and the sums of
 * each 16 values. */
void gh_quantize_row_q8_K_ref(const float * x, void * dst, int64_t n) {
    block_q8_K * y = dst;
    for (int64_t b = 0; b < n / QK_K; b++, x += QK_K) {
        float amax = 0.0f;
        bool nan = false;
        for (int j = 0; j < QK_K; j++) {
            amax = fmaxf(amax, fabsf(x[j]));
            nan |= x[j] != x[j];
        }
        const float d = nan ? NAN : amax / 127.0f;  /* a NaN makes its block's results NaN */
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = d;
        for (int j = 0; j < QK_K; j++) y[b].qs[j] = q8_code(x[j] * id);
        for (int k = 0; k < QK_K / 16; k++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += y[b].qs[16 * k + j];
            y[b].bsums[k] = (int16_t) sum;
        }
    }
}

/* Activation value j (< 32) of block i (< 4) of a Q8_X4 group. */
static inline int q8_x4_at(const block_q8_x4 * g, int i, int j) {
    return j < 16 ? g->qa[16 * i + j] : g->qb[16 * i + j - 16];
}

/* ---- dots: one weight row . one activation row ---- */

static void vec_dot_f32(int64_t n, float * s, const void * w, const void * x) {
    const float * a = w;
    const float * b = x;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double) a[i] * b[i];
    *s = (float) sum;
}

static void vec_dot_f16_f32(int64_t n, float * s, const void * w, const void * x) {
    const uint16_t * a = w;
    const float * b = x;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double) gh_fp16_to_fp32(a[i]) * b[i];
    *s = (float) sum;
}

static void vec_dot_bf16_bf16(int64_t n, float * s, const void * w, const void * x) {
    const uint16_t * a = w;
    const uint16_t * b = x;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double) gh_bf16_to_fp32(a[i]) * gh_bf16_to_fp32(b[i]);
    *s = (float) sum;
}

static void vec_dot_q8_0_q8_x4(int64_t n, float * s, const void * w, const void * x) {
    const block_q8_0 * a = w;
    const block_q8_x4 * g = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        const block_q8_x4 * y = &g[b / 4];
        const int i = (int) (b % 4);
        int isum = 0;
        for (int j = 0; j < QK8_0; j++) isum += a[b].qs[j] * q8_x4_at(y, i, j);
        sum += (double) gh_fp16_to_fp32(a[b].d) * y->d[4 * i] * isum;
    }
    *s = (float) sum;
}

static void vec_dot_q4_0_q8_x4(int64_t n, float * s, const void * w, const void * x) {
    const block_q4_0 * a = w;
    const block_q8_x4 * g = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK4_0; b++) {
        const block_q8_x4 * y = &g[b / 4];
        const int i = (int) (b % 4);
        int isum = 0;
        for (int j = 0; j < QK4_0 / 2; j++) {
            isum += ((a[b].qs[j] & 0x0f) - 8) * q8_x4_at(y, i, j);
            isum += ((a[b].qs[j] >> 4) - 8) * q8_x4_at(y, i, j + 16);
        }
        sum += (double) gh_fp16_to_fp32(a[b].d) * y->d[4 * i] * isum;
    }
    *s = (float) sum;
}

/* The other 32-value block types against Q8_X4: a block's integer values q (zero point
 * taken out) and its scale d and min m (x = d q + m; m = 0 for the symmetric types); the
 * min meets the activations' block sum. */
typedef void (*block32_fn)(const uint8_t * b, int * q, float * d, float * m);

static void block32_q4_1(const uint8_t * p, int * q, float * d, float * m) {
    const block_q4_1 * b = (const block_q4_1 *) p;
    for (int j = 0; j < 16; j++) {
        q[j] = b->qs[j] & 0x0f;
        q[j + 16] = b->qs[j] >> 4;
    }
    *d = gh_fp16_to_fp32(b->d);
    *m = gh_fp16_to_fp32(b->m);
}

static void block32_q5_0(const uint8_t * p, int * q, float * d, float * m) {
    const block_q5_0 * b = (const block_q5_0 *) p;
    for (int j = 0; j < 32; j++) q[j] = gh_q5_value(b->qs, b->qh, j) - 16;
    *d = gh_fp16_to_fp32(b->d);
    *m = 0.0f;
}

static void block32_q5_1(const uint8_t * p, int * q, float * d, float * m) {
    const block_q5_1 * b = (const block_q5_1 *) p;
    for (int j = 0; j < 32; j++) q[j] = gh_q5_value(b->qs, b->qh, j);
    *d = gh_fp16_to_fp32(b->d);
    *m = gh_fp16_to_fp32(b->m);
}

static inline void vec_dot_b32(block32_fn unpack, size_t bs, int64_t n, float * s, const void * w,
                               const void * x) {
    const block_q8_x4 * g = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / 32; b++) {
        const block_q8_x4 * y = &g[b / 4];
        const int i = (int) (b % 4);
        int q[32];
        float d, m;
        unpack((const uint8_t *) w + b * bs, q, &d, &m);
        int isum = 0;
        for (int j = 0; j < 32; j++) isum += q[j] * q8_x4_at(y, i, j);
        sum += (double) d * y->d[4 * i] * isum - (double) m * y->d[4 * i] * y->nsum[4 * i];
    }
    *s = (float) sum;
}

static void vec_dot_q4_1_q8_x4(int64_t n, float * s, const void * w, const void * x) {
    vec_dot_b32(block32_q4_1, sizeof(block_q4_1), n, s, w, x);
}
static void vec_dot_q5_0_q8_x4(int64_t n, float * s, const void * w, const void * x) {
    vec_dot_b32(block32_q5_0, sizeof(block_q5_0), n, s, w, x);
}
static void vec_dot_q5_1_q8_x4(int64_t n, float * s, const void * w, const void * x) {
    vec_dot_b32(block32_q5_1, sizeof(block_q5_1), n, s, w, x);
}

/* ---- IQ4_NL, MXFP4 (against Q8_X4) and IQ4_XS (against Q8_K): levels from the types'
 * int8 tables (types/iq4.h), then the integer dot ---- */

static void block32_iq4_nl(const uint8_t * p, int * q, float * d, float * m) {
    const block_iq4_nl * b = (const block_iq4_nl *) p;
    for (int j = 0; j < 16; j++) {
        q[j] = gh_kvalues_iq4nl[b->qs[j] & 0x0f];
        q[j + 16] = gh_kvalues_iq4nl[b->qs[j] >> 4];
    }
    *d = gh_fp16_to_fp32(b->d);
    *m = 0.0f;
}

static void block32_mxfp4(const uint8_t * p, int * q, float * d, float * m) {
    const block_mxfp4 * b = (const block_mxfp4 *) p;
    for (int j = 0; j < 16; j++) {
        q[j] = gh_kvalues_mxfp4[b->qs[j] & 0x0f];
        q[j + 16] = gh_kvalues_mxfp4[b->qs[j] >> 4];
    }
    *d = gh_e8m0_to_fp32_half(b->e);
    *m = 0.0f;
}

static void vec_dot_iq4_nl_q8_x4(int64_t n, float * s, const void * w, const void * x) {
    vec_dot_b32(block32_iq4_nl, sizeof(block_iq4_nl), n, s, w, x);
}
static void vec_dot_mxfp4_q8_x4(int64_t n, float * s, const void * w, const void * x) {
    vec_dot_b32(block32_mxfp4, sizeof(block_mxfp4), n, s, w, x);
}

static void vec_dot_iq4_xs_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq4_xs * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const uint8_t * q = a[b].qs + 16 * ib;
            const int8_t * v = y[b].qs + 32 * ib;
            int dot = 0;
            for (int j = 0; j < 16; j++) {
                dot += gh_kvalues_iq4nl[q[j] & 0x0f] * v[j] + gh_kvalues_iq4nl[q[j] >> 4] * v[j + 16];
            }
            isum += gh_iq4_xs_scale(&a[b], ib) * dot;
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * isum;
    }
    *s = (float) sum;
}

#if GH_IQ_GRIDS
/* ---- the IQ lattice types against Q8_K (types/iqlat.h): per 8-value group the integer
 * dot of the grid point (signed) with the activations, times the sub-block's integer
 * scale; IQ2's (2s + 1) / 8 and IQ3_XXS's (2s + 1) / 4 applied once per block; IQ1's
 * delta through the activations' sums ---- */

/* sum_j grid[j] * (+-1 by bit j of signs) * q[j] over 8 values. */
static inline int dot8_signed(uint64_t g, unsigned signs, const int8_t * q) {
    int sum = 0;
    for (int j = 0; j < 8; j++) sum += gh_grid8_u(g, j) * ((signs >> j) & 1 ? -q[j] : q[j]);
    return sum;
}

static void vec_dot_iq2_xxs_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq2_xxs * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        const uint8_t * q = (const uint8_t *) a[b].qs;
        int isum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const uint32_t a1 = gh_le32(q + 8 * ib + 4);
            int dot = 0;
            for (int k = 0; k < 4; k++) {
                dot += dot8_signed(gh_iq2xxs_grid[q[8 * ib + k]], gh_iq2_ksigns[(a1 >> (7 * k)) & 127],
                                   y[b].qs + 32 * ib + 8 * k);
            }
            isum += (int) (2 * (a1 >> 28) + 1) * dot;
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * isum * 0.125;
    }
    *s = (float) sum;
}

static void vec_dot_iq2_xs_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq2_xs * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0;
        for (int l = 0; l < QK_K / 8; l += 2) {
            const int sc = (a[b].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0x0f;
            int dot = 0;
            for (int h = 0; h < 2; h++) {
                const uint16_t v = a[b].qs[l + h];
                dot += dot8_signed(gh_iq2xs_grid[v & 511], gh_iq2_ksigns[v >> 9], y[b].qs + 8 * (l + h));
            }
            isum += (2 * sc + 1) * dot;
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * isum * 0.125;
    }
    *s = (float) sum;
}

static void vec_dot_iq2_s_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq2_s * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0;
        for (int l = 0; l < QK_K / 8; l += 2) {
            const int sc = (a[b].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0x0f;
            int dot = 0;
            for (int h = 0; h < 2; h++) {
                const int m = l + h;
                const int idx = a[b].qs[m] | (((a[b].qh[m / 4] >> (2 * (m % 4))) & 3) << 8);
                dot += dot8_signed(gh_iq2s_grid[idx], a[b].qs[32 + m], y[b].qs + 8 * m);
            }
            isum += (2 * sc + 1) * dot;
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * isum * 0.125;
    }
    *s = (float) sum;
}

/* A 4-value IQ3 grid point's two halves as one 8-value point (byte j of the pair). */
static inline uint64_t pair4(uint32_t lo, uint32_t hi) { return (uint64_t) lo | (uint64_t) hi << 32; }

static void vec_dot_iq3_xxs_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq3_xxs * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        const uint8_t * q = a[b].qs;
        int isum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const uint32_t aux = gh_le32(q + QK_K / 4 + 4 * ib);
            int dot = 0;
            for (int k = 0; k < 4; k++) {
                const uint64_t g = pair4(gh_iq3xxs_grid[q[8 * ib + 2 * k]], gh_iq3xxs_grid[q[8 * ib + 2 * k + 1]]);
                dot += dot8_signed(g, gh_iq2_ksigns[(aux >> (7 * k)) & 127], y[b].qs + 32 * ib + 8 * k);
            }
            isum += (int) (2 * (aux >> 28) + 1) * dot;
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * isum * 0.25;
    }
    *s = (float) sum;
}

static void vec_dot_iq3_s_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq3_s * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const int sc = (a[b].scales[ib / 2] >> (4 * (ib % 2))) & 0x0f;
            int dot = 0;
            for (int k = 0; k < 4; k++) {
                const int m = 8 * ib + 2 * k;
                const int i0 = a[b].qs[m] | (((a[b].qh[m / 8] >> (m % 8)) & 1) << 8);
                const int i1 = a[b].qs[m + 1] | (((a[b].qh[m / 8] >> ((m + 1) % 8)) & 1) << 8);
                dot += dot8_signed(pair4(gh_iq3s_grid[i0], gh_iq3s_grid[i1]), a[b].signs[4 * ib + k],
                                   y[b].qs + 32 * ib + 8 * k);
            }
            isum += (2 * sc + 1) * dot;
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * isum;
    }
    *s = (float) sum;
}

/* sum_j grid[j] * q[j] over 8 values of an IQ1 point (-1, 0, 1). */
static inline int dot8_iq1(uint64_t g, const int8_t * q) {
    int sum = 0;
    for (int j = 0; j < 8; j++) sum += gh_grid8_s(g, j) * q[j];
    return sum;
}

/* IQ1: dl * (grid + delta) . q = dl * (grid . q + delta * sum q); delta = +-1/8, so the
 * block keeps sum (2s + 1) grid . q and sum (2s + 1) (+-1) sum q apart, exact integers. */
static void vec_dot_iq1_s_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq1_s * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0, dsum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const unsigned qh = a[b].qh[ib];
            const int ls = (int) (2 * ((qh >> 12) & 7) + 1);
            int dot = 0;
            for (int k = 0; k < 4; k++) {
                dot += dot8_iq1(gh_iq1s_grid[a[b].qs[4 * ib + k] | (((qh >> (3 * k)) & 7) << 8)],
                                y[b].qs + 32 * ib + 8 * k);
            }
            const int qsum = y[b].bsums[2 * ib] + y[b].bsums[2 * ib + 1];
            isum += ls * dot;
            dsum += ls * (qh & 0x8000 ? -qsum : qsum);
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * (isum + 0.125 * dsum);
    }
    *s = (float) sum;
}

static void vec_dot_iq1_m_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_iq1_m * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0, dsum = 0;
        for (int l = 0; l < QK_K / 8; l++) {
            const unsigned h = (a[b].qh[l / 2] >> (4 * (l % 2))) & 0x0f;
            const int ls = 2 * gh_iq1_m_scale(&a[b], l / 2) + 1;
            const int8_t * v = y[b].qs + 8 * l;
            int qsum = 0;
            for (int j = 0; j < 8; j++) qsum += v[j];
            isum += ls * dot8_iq1(gh_iq1s_grid[a[b].qs[l] | ((h & 7) << 8)], v);
            dsum += ls * (h & 8 ? -qsum : qsum);
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(gh_iq1_m_d(&a[b])) * (isum + 0.125 * dsum);
    }
    *s = (float) sum;
}
#endif

/* K-quants against Q8_K: exact integer sums per block, the mins (zero point) through
 * the activations' 16-value sums. */
static void vec_dot_q4_K_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_q4_K * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            gh_k4_scale_min(a[b].scales, j, &sc, &m);
            const uint8_t * q = a[b].qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            int dot = 0;
            for (int l = 0; l < 32; l++) dot += ((q[l] >> shift) & 0x0f) * y[b].qs[32 * j + l];
            isum += sc * dot;
            msum += m * (y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
        }
        sum += (double) y[b].d * ((double) gh_fp16_to_fp32(a[b].d) * isum -
                                  (double) gh_fp16_to_fp32(a[b].dmin) * msum);
    }
    *s = (float) sum;
}

static void vec_dot_q5_K_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_q5_K * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            gh_k4_scale_min(a[b].scales, j, &sc, &m);
            const uint8_t * q = a[b].qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            int dot = 0;
            for (int l = 0; l < 32; l++) {
                const int v = ((q[l] >> shift) & 0x0f) | (((a[b].qh[l] >> j) & 1) << 4);
                dot += v * y[b].qs[32 * j + l];
            }
            isum += sc * dot;
            msum += m * (y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
        }
        sum += (double) y[b].d * ((double) gh_fp16_to_fp32(a[b].d) * isum -
                                  (double) gh_fp16_to_fp32(a[b].dmin) * msum);
    }
    *s = (float) sum;
}

static void vec_dot_q6_K_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_q6_K * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0;
        for (int v = 0; v < QK_K; v++) {
            const int h = v / 128, g = (v % 128) / 32, l = v % 32;
            const int lo = (a[b].ql[64 * h + l + 32 * (g & 1)] >> (4 * (g >> 1))) & 0x0f;
            const int hi = (a[b].qh[32 * h + l] >> (2 * g)) & 3;
            isum += a[b].scales[v / 16] * (lo | (hi << 4)) * y[b].qs[v];
        }
        int zsum = 0; /* the zero point 32 */
        for (int j = 0; j < QK_K / 16; j++) zsum += a[b].scales[j] * y[b].bsums[j];
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * (isum - 32 * zsum);
    }
    *s = (float) sum;
}

/* Q2_K, Q3_K against Q8_K: per sub-block of 16 an exact integer dot; Q2_K's mins through
 * the activations' 16-value sums, as Q4_K's. */
static void vec_dot_q2_K_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_q2_K * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0, msum = 0;
        for (int j = 0; j < 16; j++) {
            int dot = 0;
            for (int l = 0; l < 16; l++) dot += gh_k2_low(a[b].qs, 16 * j + l) * y[b].qs[16 * j + l];
            isum += (a[b].scales[j] & 0x0f) * dot;
            msum += (a[b].scales[j] >> 4) * y[b].bsums[j];
        }
        sum += (double) y[b].d * ((double) gh_fp16_to_fp32(a[b].d) * isum -
                                  (double) gh_fp16_to_fp32(a[b].dmin) * msum);
    }
    *s = (float) sum;
}

static void vec_dot_q3_K_q8_K(int64_t n, float * s, const void * w, const void * x) {
    const block_q3_K * a = w;
    const block_q8_K * y = x;
    double sum = 0.0;
    for (int64_t b = 0; b < n / QK_K; b++) {
        int isum = 0;
        for (int j = 0; j < 16; j++) {
            int dot = 0;
            for (int l = 0; l < 16; l++) {
                const int v = 16 * j + l;
                const int q = gh_k2_low(a[b].qs, v) - (((a[b].hmask[v & 31] >> (v >> 5)) & 1) ? 0 : 4);
                dot += q * y[b].qs[v];
            }
            isum += (gh_k3_scale(a[b].scales, j) - 32) * dot;
        }
        sum += (double) y[b].d * gh_fp16_to_fp32(a[b].d) * isum;
    }
    *s = (float) sum;
}

/* ---- tiles: loops of dots ---- */

#define DEFINE_GEMM(name, dot)                                                              \
    static void name(int64_t n, const void * w, size_t w_stride, int nr, const void * x,  \
                     size_t x_stride, int nt, float * y, int64_t ldy) {                   \
        for (int t = 0; t < nt; t++) {                                                     \
            for (int r = 0; r < nr; r++) {                                                 \
                dot(n, &y[t * ldy + r], (const char *) w + r * w_stride,                   \
                    (const char *) x + t * x_stride);                                      \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_GEMM(gemm_f32, vec_dot_f32)
DEFINE_GEMM(gemm_f16, vec_dot_f16_f32)
DEFINE_GEMM(gemm_bf16, vec_dot_bf16_bf16)
DEFINE_GEMM(gemm_q8_0, vec_dot_q8_0_q8_x4)
DEFINE_GEMM(gemm_q4_0, vec_dot_q4_0_q8_x4)
DEFINE_GEMM(gemm_q4_1, vec_dot_q4_1_q8_x4)
DEFINE_GEMM(gemm_q5_0, vec_dot_q5_0_q8_x4)
DEFINE_GEMM(gemm_q5_1, vec_dot_q5_1_q8_x4)
DEFINE_GEMM(gemm_q4_K, vec_dot_q4_K_q8_K)
DEFINE_GEMM(gemm_q5_K, vec_dot_q5_K_q8_K)
DEFINE_GEMM(gemm_q6_K, vec_dot_q6_K_q8_K)
DEFINE_GEMM(gemm_q2_K, vec_dot_q2_K_q8_K)
DEFINE_GEMM(gemm_q3_K, vec_dot_q3_K_q8_K)
DEFINE_GEMM(gemm_iq4_nl, vec_dot_iq4_nl_q8_x4)
DEFINE_GEMM(gemm_iq4_xs, vec_dot_iq4_xs_q8_K)
DEFINE_GEMM(gemm_mxfp4, vec_dot_mxfp4_q8_x4)
#if GH_IQ_GRIDS
DEFINE_GEMM(gemm_iq2_xxs, vec_dot_iq2_xxs_q8_K)
DEFINE_GEMM(gemm_iq2_xs, vec_dot_iq2_xs_q8_K)
DEFINE_GEMM(gemm_iq2_s, vec_dot_iq2_s_q8_K)
DEFINE_GEMM(gemm_iq3_xxs, vec_dot_iq3_xxs_q8_K)
DEFINE_GEMM(gemm_iq3_s, vec_dot_iq3_s_q8_K)
DEFINE_GEMM(gemm_iq1_s, vec_dot_iq1_s_q8_K)
DEFINE_GEMM(gemm_iq1_m, vec_dot_iq1_m_q8_K)
#endif

#define DOT_ROW(dot, from_x, tile) GH_DOT_ROW(dot, from_x, tile, 1, 1, 1, NULL)

const gh_kernel_set gh_dot_rows_scalar[GH_TYPE_COUNT] = {
    [GH_TYPE_F32]  = DOT_ROW(vec_dot_f32, NULL, gemm_f32),
    [GH_TYPE_F16]  = DOT_ROW(vec_dot_f16_f32, NULL, gemm_f16),
    [GH_TYPE_BF16] = DOT_ROW(vec_dot_bf16_bf16, bf16_from_float_x, gemm_bf16),
    [GH_TYPE_Q8_0] = DOT_ROW(vec_dot_q8_0_q8_x4, gh_quantize_row_q8_x4_ref, gemm_q8_0),
    [GH_TYPE_Q4_0] = DOT_ROW(vec_dot_q4_0_q8_x4, gh_quantize_row_q8_x4_ref, gemm_q4_0),
    [GH_TYPE_Q4_1] = DOT_ROW(vec_dot_q4_1_q8_x4, gh_quantize_row_q8_x4_ref, gemm_q4_1),
    [GH_TYPE_Q5_0] = DOT_ROW(vec_dot_q5_0_q8_x4, gh_quantize_row_q8_x4_ref, gemm_q5_0),
    [GH_TYPE_Q5_1] = DOT_ROW(vec_dot_q5_1_q8_x4, gh_quantize_row_q8_x4_ref, gemm_q5_1),
    [GH_TYPE_Q4_K] = DOT_ROW(vec_dot_q4_K_q8_K, gh_quantize_row_q8_K_ref, gemm_q4_K),
    [GH_TYPE_Q5_K] = DOT_ROW(vec_dot_q5_K_q8_K, gh_quantize_row_q8_K_ref, gemm_q5_K),
    [GH_TYPE_Q6_K] = DOT_ROW(vec_dot_q6_K_q8_K, gh_quantize_row_q8_K_ref, gemm_q6_K),
    [GH_TYPE_Q2_K] = DOT_ROW(vec_dot_q2_K_q8_K, gh_quantize_row_q8_K_ref, gemm_q2_K),
    [GH_TYPE_Q3_K] = DOT_ROW(vec_dot_q3_K_q8_K, gh_quantize_row_q8_K_ref, gemm_q3_K),
    [GH_TYPE_IQ4_NL] = DOT_ROW(vec_dot_iq4_nl_q8_x4, gh_quantize_row_q8_x4_ref, gemm_iq4_nl),
    [GH_TYPE_IQ4_XS] = DOT_ROW(vec_dot_iq4_xs_q8_K, gh_quantize_row_q8_K_ref, gemm_iq4_xs),
    [GH_TYPE_MXFP4]  = DOT_ROW(vec_dot_mxfp4_q8_x4, gh_quantize_row_q8_x4_ref, gemm_mxfp4),
#if GH_IQ_GRIDS
    [GH_TYPE_IQ2_XXS] = DOT_ROW(vec_dot_iq2_xxs_q8_K, gh_quantize_row_q8_K_ref, gemm_iq2_xxs),
    [GH_TYPE_IQ2_XS]  = DOT_ROW(vec_dot_iq2_xs_q8_K, gh_quantize_row_q8_K_ref, gemm_iq2_xs),
    [GH_TYPE_IQ2_S]   = DOT_ROW(vec_dot_iq2_s_q8_K, gh_quantize_row_q8_K_ref, gemm_iq2_s),
    [GH_TYPE_IQ3_XXS] = DOT_ROW(vec_dot_iq3_xxs_q8_K, gh_quantize_row_q8_K_ref, gemm_iq3_xxs),
    [GH_TYPE_IQ3_S]   = DOT_ROW(vec_dot_iq3_s_q8_K, gh_quantize_row_q8_K_ref, gemm_iq3_s),
    [GH_TYPE_IQ1_S]   = DOT_ROW(vec_dot_iq1_s_q8_K, gh_quantize_row_q8_K_ref, gemm_iq1_s),
    [GH_TYPE_IQ1_M]   = DOT_ROW(vec_dot_iq1_m_q8_K, gh_quantize_row_q8_K_ref, gemm_iq1_m),
#endif
};
