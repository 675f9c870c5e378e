/* Scalar axpy kernels of the transposed matmul (the reference the SIMD forms are tested
 * against; the compiler vectorizes these for the baseline ISA): one row at a time. The
 * four- and sixteen-row forms exist only at the SIMD levels. */
#include "cpu/kernels.h"
#include "types/iqlat.h" /* GH_IQ_GRIDS: whether the lattice rows are built */

#include <string.h>

static void axpy_f32(int64_t n, float s, const void * row, float * restrict y) {
    const float * restrict x = row;
    for (int64_t i = 0; i < n; i++) y[i] += s * x[i];
}

static void axpy_f16(int64_t n, float s, const void * row, float * restrict y) {
    const uint16_t * x = row;
    for (int64_t i = 0; i < n; i++) y[i] += s * gh_fp16_to_fp32(x[i]);
}

static void axpy_bf16(int64_t n, float s, const void * row, float * restrict y) {
    const uint16_t * x = row;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t) x[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        y[i] += s * f;
    }
}

static void axpy_q8_0(int64_t n, float s, const void * row, float * restrict y) {
    const block_q8_0 * b = row;
    for (int64_t i = 0; i < n / QK8_0; i++, y += QK8_0) {
        const float ds = s * gh_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK8_0; j++) y[j] += ds * (float) b[i].qs[j];
    }
}

static void axpy_q4_0(int64_t n, float s, const void * row, float * restrict y) {
    const block_q4_0 * b = row;
    for (int64_t i = 0; i < n / QK4_0; i++, y += QK4_0) {
        const float ds = s * gh_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] += ds * (float) ((b[i].qs[j] & 0x0f) - 8);
            y[j + QK4_0 / 2] += ds * (float) ((b[i].qs[j] >> 4) - 8);
        }
    }
}

/* The other types: a block's values from the type table's dequantizer, then added. */
static inline void axpy_blocks(int type, int64_t n, float s, const void * row, float * restrict y) {
    const gh_type_traits * tt = gh_type_traits_get(type);
    const int64_t bn = tt->block_size;
    float v[QK_K];
    for (int64_t i = 0; i < n / bn; i++, y += bn) {
        tt->to_float((const char *) row + i * tt->type_size, v, bn);
        for (int64_t j = 0; j < bn; j++) y[j] += s * v[j];
    }
}

#define DEFINE_AXPY_BLOCKS(name, type)                                                      \
    static void name(int64_t n, float s, const void * row, float * restrict y) {            \
        axpy_blocks(type, n, s, row, y);                                                     \
    }

DEFINE_AXPY_BLOCKS(axpy_q4_1, GH_TYPE_Q4_1)
DEFINE_AXPY_BLOCKS(axpy_q5_0, GH_TYPE_Q5_0)
DEFINE_AXPY_BLOCKS(axpy_q5_1, GH_TYPE_Q5_1)
DEFINE_AXPY_BLOCKS(axpy_q4_K, GH_TYPE_Q4_K)
DEFINE_AXPY_BLOCKS(axpy_q5_K, GH_TYPE_Q5_K)
DEFINE_AXPY_BLOCKS(axpy_q6_K, GH_TYPE_Q6_K)
DEFINE_AXPY_BLOCKS(axpy_q2_K, GH_TYPE_Q2_K)
DEFINE_AXPY_BLOCKS(axpy_q3_K, GH_TYPE_Q3_K)
DEFINE_AXPY_BLOCKS(axpy_iq4_nl, GH_TYPE_IQ4_NL)
DEFINE_AXPY_BLOCKS(axpy_iq4_xs, GH_TYPE_IQ4_XS)
DEFINE_AXPY_BLOCKS(axpy_mxfp4, GH_TYPE_MXFP4)
#if GH_IQ_GRIDS
DEFINE_AXPY_BLOCKS(axpy_iq2_xxs, GH_TYPE_IQ2_XXS)
DEFINE_AXPY_BLOCKS(axpy_iq2_xs, GH_TYPE_IQ2_XS)
DEFINE_AXPY_BLOCKS(axpy_iq2_s, GH_TYPE_IQ2_S)
DEFINE_AXPY_BLOCKS(axpy_iq3_xxs, GH_TYPE_IQ3_XXS)
DEFINE_AXPY_BLOCKS(axpy_iq3_s, GH_TYPE_IQ3_S)
DEFINE_AXPY_BLOCKS(axpy_iq1_s, GH_TYPE_IQ1_S)
DEFINE_AXPY_BLOCKS(axpy_iq1_m, GH_TYPE_IQ1_M)
#endif

const gh_kernel_set gh_axpy_rows_scalar[GH_TYPE_COUNT] = {
    [GH_TYPE_F32]  = { .axpy = axpy_f32 },
    [GH_TYPE_F16]  = { .axpy = axpy_f16 },
    [GH_TYPE_BF16] = { .axpy = axpy_bf16 },
    [GH_TYPE_Q8_0] = { .axpy = axpy_q8_0 },
    [GH_TYPE_Q4_0] = { .axpy = axpy_q4_0 },
    [GH_TYPE_Q4_1] = { .axpy = axpy_q4_1 },
    [GH_TYPE_Q5_0] = { .axpy = axpy_q5_0 },
    [GH_TYPE_Q5_1] = { .axpy = axpy_q5_1 },
    [GH_TYPE_Q4_K] = { .axpy = axpy_q4_K },
    [GH_TYPE_Q5_K] = { .axpy = axpy_q5_K },
    [GH_TYPE_Q6_K] = { .axpy = axpy_q6_K },
    [GH_TYPE_Q2_K] = { .axpy = axpy_q2_K },
    [GH_TYPE_Q3_K] = { .axpy = axpy_q3_K },
    [GH_TYPE_IQ4_NL] = { .axpy = axpy_iq4_nl },
    [GH_TYPE_IQ4_XS] = { .axpy = axpy_iq4_xs },
    [GH_TYPE_MXFP4]  = { .axpy = axpy_mxfp4 },
#if GH_IQ_GRIDS
    [GH_TYPE_IQ2_XXS] = { .axpy = axpy_iq2_xxs },
    [GH_TYPE_IQ2_XS]  = { .axpy = axpy_iq2_xs },
    [GH_TYPE_IQ2_S]   = { .axpy = axpy_iq2_s },
    [GH_TYPE_IQ3_XXS] = { .axpy = axpy_iq3_xxs },
    [GH_TYPE_IQ3_S]   = { .axpy = axpy_iq3_s },
    [GH_TYPE_IQ1_S]   = { .axpy = axpy_iq1_s },
    [GH_TYPE_IQ1_M]   = { .axpy = axpy_iq1_m },
#endif
};
