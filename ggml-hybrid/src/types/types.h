/* The tensor type table: one row per type, as in ggml. Block layouts are byte-identical
 * to GGUF/ggml (so files written by the gguf package and llama.cpp load):
 *   F32, F16 (IEEE half), BF16 (upper half of f32),
 *   Q8_0: { fp16 d; int8 qs[32] }               x = d * q
 *   Q4_0: { fp16 d; uint8 qs[16] }              x = d * (nibble - 8); element j < 16 is
 *          the low nibble of qs[j], element j + 16 the high nibble of qs[j]. */
#ifndef GH_TYPES_H
#define GH_TYPES_H

#include "core/common.h"

#define QK8_0 32
#define QK4_0 32

typedef struct { uint16_t d; int8_t  qs[QK8_0]; } block_q8_0;
typedef struct { uint16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;

float gh_fp16_to_fp32(uint16_t h);
uint16_t gh_fp32_to_fp16(float f);
float gh_bf16_to_fp32(uint16_t h);
uint16_t gh_fp32_to_bf16(float f); /* round to nearest even, NaN kept quiet */

/* Dot product of one weight row (type of the row) with one activation row already
 * converted to the type's vec_dot_type: *s = sum_i w[i] * x[i] over n elements. */
typedef void (*gh_vec_dot_fn)(int64_t n, float * s, const void * w, const void * x);
typedef void (*gh_to_float_fn)(const void * src, float * dst, int64_t n);
typedef void (*gh_from_float_fn)(const float * src, void * dst, int64_t n);

typedef struct {
    const char *     name;
    int64_t          block_size;   /* elements per block */
    size_t           type_size;    /* bytes per block */
    bool             is_quantized;
    gh_to_float_fn   to_float;     /* dequantize a row */
    gh_from_float_fn from_float;   /* quantize a row (reference) */
    int              vec_dot_type; /* type activations are converted to before dot: F32
                                    * for F32/F16, BF16 for BF16, and for Q4_0/Q8_0 the
                                    * internal GH_TYPE_Q8_X4 (simd/kernels.h), which
                                    * gh_type_traits_get does not know: size buffers
                                    * with gh_row_size(vec_dot_type, n) */
    gh_from_float_fn from_float_x; /* fast conversion of activations to vec_dot_type;
                                    * NULL when vec_dot_type is F32 (use x as it is) */
    gh_vec_dot_fn    vec_dot;      /* best kernel for the current SIMD level */
} gh_type_traits;

/* NULL for an unknown type id (untrusted: comes from files). */
const gh_type_traits * gh_type_traits_get(int type);
bool gh_type_valid(int type);
/* Bytes of n elements of type; 0 if n is not a multiple of the block size. */
size_t gh_row_size(int type, int64_t n);

/* Called once (and by gh_simd_set) to point the table at the kernels for `level`. */
void gh_types_select_kernels(int level);

#endif
