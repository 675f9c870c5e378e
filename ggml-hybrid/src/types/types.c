/* The tensor type table, fp16/bf16 conversions and the reference (scalar) quantizers.
 * Quantizers are byte-identical to ggml's reference ones (and to gguf-py's
 * gguf.quants, which the tests check against). */
#include "types/types.h"
#include "gguf/gguf.h"
#include "cpu/kernels.h"

#include <math.h>
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

/* ---- the table ---- */

enum { T_F32, T_F16, T_BF16, T_Q8_0, T_Q4_0, T_COUNT };

static gh_type_traits g_traits[T_COUNT] = {
    [T_F32] = { "f32", 1, sizeof(float), false, f32_to_float, f32_from_float,
                GH_TYPE_F32, NULL, NULL },
    [T_F16] = { "f16", 1, sizeof(uint16_t), false, f16_to_float, f16_from_float,
                GH_TYPE_F32, NULL, NULL },
    [T_BF16] = { "bf16", 1, sizeof(uint16_t), false, bf16_to_float, bf16_from_float,
                 GH_TYPE_BF16, NULL, NULL },
    [T_Q8_0] = { "q8_0", QK8_0, sizeof(block_q8_0), true, q8_0_to_float, q8_0_from_float,
                 GH_TYPE_Q8_X4, NULL, NULL },
    [T_Q4_0] = { "q4_0", QK4_0, sizeof(block_q4_0), true, q4_0_to_float, q4_0_from_float,
                 GH_TYPE_Q8_X4, NULL, NULL },
};

static const int g_type_ids[T_COUNT] = {
    [T_F32] = GH_TYPE_F32, [T_F16] = GH_TYPE_F16, [T_BF16] = GH_TYPE_BF16,
    [T_Q8_0] = GH_TYPE_Q8_0, [T_Q4_0] = GH_TYPE_Q4_0,
};

static gh_kernel_set g_kernels[T_COUNT];

static int type_index(int type) {
    switch (type) {
        case GH_TYPE_F32:  return T_F32;
        case GH_TYPE_F16:  return T_F16;
        case GH_TYPE_BF16: return T_BF16;
        case GH_TYPE_Q8_0: return T_Q8_0;
        case GH_TYPE_Q4_0: return T_Q4_0;
        default:           return -1;
    }
}

bool gh_type_valid(int type) { return type_index(type) >= 0; }

const gh_type_traits * gh_type_traits_get(int type) {
    int i = type_index(type);
    if (i < 0) return NULL;
    gh_simd_ensure_init();
    return &g_traits[i];
}

const gh_kernel_set * gh_kernels_get(int type) {
    int i = type_index(type);
    if (i < 0) return NULL;
    gh_simd_ensure_init();
    return &g_kernels[i];
}

size_t gh_row_size(int type, int64_t n) {
    if (n < 0) return 0;
    if (type == GH_TYPE_Q8_X4) {
        if (n % QK8_0) return 0;
        return (size_t) ((n + QK8_X4 - 1) / QK8_X4) * sizeof(block_q8_x4);
    }
    int i = type_index(type);
    if (i < 0 || n % g_traits[i].block_size) return 0;
    return (size_t) (n / g_traits[i].block_size) * g_traits[i].type_size;
}

void gh_types_select_kernels(int level) {
    for (int i = 0; i < T_COUNT; i++) {
        gh_kernel_set ks;
        gh_kernels_scalar(g_type_ids[i], &ks);
#if defined(GH_X86)
        gh_kernel_set k2;
        if (level >= GH_SIMD_AVX2 && gh_kernels_avx2(g_type_ids[i], &k2)) ks = k2;
        if (level >= GH_SIMD_AVX512 && gh_kernels_avx512(g_type_ids[i], &k2)) ks = k2;
#else
        (void) level;
#endif
        g_kernels[i] = ks;
        g_traits[i].vec_dot = ks.vec_dot;
        g_traits[i].from_float_x = ks.from_float_x;
    }
}

/* ---- public API ---- */

size_t gh_type_row_size(int type, int64_t n) {
    return gh_type_valid(type) ? gh_row_size(type, n) : 0;
}

int64_t gh_type_block_size(int type) {
    int i = type_index(type);
    return i < 0 ? 0 : g_traits[i].block_size;
}

const char * gh_type_name(int type) {
    int i = type_index(type);
    return i >= 0 ? g_traits[i].name : gh_ggml_type_name(type);
}

static gh_status check_row_args(const char * fn, int type, const void * src, const void * dst,
                                int64_t n) {
    int i = type_index(type);
    if (i < 0) return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown tensor type %d", fn, type);
    if (n < 0) return gh_fail(GH_ERR_INVALID_ARG, "%s: negative length %lld", fn, (long long) n);
    if (n % g_traits[i].block_size) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: length %lld is not a multiple of %s's block size %lld",
                       fn, (long long) n, g_traits[i].name, (long long) g_traits[i].block_size);
    }
    if (n > 0 && (!src || !dst)) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    return GH_OK;
}

gh_status gh_quantize_row(int type, const float * src, void * dst, int64_t n) {
    gh_status st = check_row_args("gh_quantize_row", type, src, dst, n);
    if (st != GH_OK) return st;
    if (n > 0) g_traits[type_index(type)].from_float(src, dst, n);
    return GH_OK;
}

gh_status gh_dequantize_row(int type, const void * src, float * dst, int64_t n) {
    gh_status st = check_row_args("gh_dequantize_row", type, src, dst, n);
    if (st != GH_OK) return st;
    if (n > 0) g_traits[type_index(type)].to_float(src, dst, n);
    return GH_OK;
}
