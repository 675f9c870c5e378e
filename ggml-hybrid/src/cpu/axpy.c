/* The transposed matmul: y[t][c] = sum_r h[t][r] * W[r][c], i.e. a sum of W's rows
 * scaled by h. It is how the down projection runs through ffn_down_t, where row r is
 * neuron r's output vector, stored contiguously: a neuron whose activation is zero (most
 * of them in a ReLU FFN) costs nothing, not even a read of its weights.
 *
 * Threads split y's columns in contiguous chunks aligned to the weight's block size and
 * each sweeps every row for its own columns, so no two threads write the same output
 * and there is nothing to reduce; every y[t][c] sums its rows in the same order however
 * many threads there are.
 *
 * Decode (one token): each active row's segment is dequantized and accumulated in one
 * pass (a fused axpy per type). Batches: a block of rows is dequantized once into a
 * small buffer and then added into every token whose activation is nonzero, or, when most
 * of the block's activations are nonzero (a SwiGLU prompt), multiplied in register tiles
 * (Q4_0 and the K-quants: in the int8 groups of 16 rows of the decode form, each token's
 * factors its own). */
#include "cpu/ops.h"
#include "types/types.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(GH_X86)
#include <immintrin.h>
#endif

#define AXPY_SEG 256  /* batch path: columns per segment (floats) */
#define AXPY_RB  32   /* batch path: rows dequantized at once (AXPY_RB * AXPY_SEG floats) */
#ifndef AXPY_PF_GROUPS
#define AXPY_PF_GROUPS 2 /* list path, in-kernel prefetch: groups of four rows ahead */
#endif
#define AXPY_PF_ROWS 8   /* list path, no in-kernel prefetch: rows ahead */

/* y[0..n) += s * row, the row in `type` starting at a block boundary (n a multiple of
 * the block size). */
typedef void (*axpy_fn)(int64_t n, float s, const void * row, float * y);
/* y[0..n) += s[0] * row[0] + ... + s[3] * row[3]: four rows per pass over y (decode). */
typedef void (*axpy4_fn)(int64_t n, const float * s, const void * const * row, float * y);

/* ---- scalar (the compiler vectorizes these for the baseline ISA) ---- */

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

/* K-quants: a block's values from the type's dequantizer, then added. */
static inline void axpy_k_blocks(gh_to_float_fn to_float, size_t bs, int64_t n, float s, const void * row,
                                 float * restrict y) {
    float v[QK_K];
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        to_float((const char *) row + i * bs, v, QK_K);
        for (int j = 0; j < QK_K; j++) y[j] += s * v[j];
    }
}

static void axpy_q4_K(int64_t n, float s, const void * row, float * restrict y) {
    axpy_k_blocks(gh_type_traits_get(GH_TYPE_Q4_K)->to_float, sizeof(block_q4_K), n, s, row, y);
}
static void axpy_q5_K(int64_t n, float s, const void * row, float * restrict y) {
    axpy_k_blocks(gh_type_traits_get(GH_TYPE_Q5_K)->to_float, sizeof(block_q5_K), n, s, row, y);
}
static void axpy_q6_K(int64_t n, float s, const void * row, float * restrict y) {
    axpy_k_blocks(gh_type_traits_get(GH_TYPE_Q6_K)->to_float, sizeof(block_q6_K), n, s, row, y);
}

/* ---- AVX2 + FMA + F16C (compiled for those ISAs here, used only when the SIMD level
 * selected at run time is AVX2 or higher) ---- */

#if defined(GH_X86)
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

AVX2_FN static void axpy_f32_avx2(int64_t n, float s, const void * row, float * restrict y) {
    const float * x = row;
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 y0 = _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i));
        __m256 y1 = _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8));
        _mm256_storeu_ps(y + i, y0);
        _mm256_storeu_ps(y + i + 8, y1);
    }
    for (; i < n; i++) y[i] += s * x[i];
}

AVX2_FN static void axpy_f16_avx2(int64_t n, float s, const void * row, float * restrict y) {
    const uint16_t * x = row;
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i)));
        __m256 x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i + 8)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vs, x0, _mm256_loadu_ps(y + i)));
        _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(vs, x1, _mm256_loadu_ps(y + i + 8)));
    }
    for (; i < n; i++) y[i] += s * gh_fp16_to_fp32(x[i]);
}

AVX2_FN static void axpy_bf16_avx2(int64_t n, float s, const void * row, float * restrict y) {
    const uint16_t * x = row;
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) (x + i)));
        __m256 xf = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vs, xf, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) y[i] += s * gh_bf16_to_fp32(x[i]);
}

#endif

#if defined(GH_X86)
/* The AVX2 four-row forms: y[0..n) += s[0] * row[0] + ... + s[3] * row[3], rows added in
 * order 0..3 per vector of y. Each is one inline body with and without prefetch (pf NULL:
 * none; else the same column range of the rows pf[0..4) into L2, a slice per step), so
 * the two forms sum bit for bit alike. */
#define AVX2_INLINE AVX2_FN static inline __attribute__((always_inline))

AVX2_INLINE __m256 ld8_f32(const void * p, int64_t i) { return _mm256_loadu_ps((const float *) p + i); }
AVX2_INLINE __m256 ld8_f16(const void * p, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const uint16_t *) p + i)));
}
AVX2_INLINE __m256 ld8_bf16(const void * p, int64_t i) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) ((const uint16_t *) p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
AVX2_INLINE float ld1(int kind, const void * p, int64_t i) {
    switch (kind) {
        case GH_TYPE_F16:  return gh_fp16_to_fp32(((const uint16_t *) p)[i]);
        case GH_TYPE_BF16: return gh_bf16_to_fp32(((const uint16_t *) p)[i]);
        default:           return ((const float *) p)[i];
    }
}

AVX2_INLINE void axpy4_float_avx2(const int kind, int64_t n, const float * s, const void * const * row,
                                  const void * const * pf, float * restrict y) {
    const size_t wsz = kind == GH_TYPE_F32 ? 4 : 2;
    const __m256 vs[4] = { _mm256_set1_ps(s[0]), _mm256_set1_ps(s[1]), _mm256_set1_ps(s[2]),
                           _mm256_set1_ps(s[3]) };
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (pf && ((i * wsz) & 63) == 0) {
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *) pf[k] + i * wsz, _MM_HINT_T1);
        }
        __m256 acc = _mm256_loadu_ps(y + i);
        for (int k = 0; k < 4; k++) {
            const __m256 w = kind == GH_TYPE_F16 ? ld8_f16(row[k], i)
                           : kind == GH_TYPE_BF16 ? ld8_bf16(row[k], i) : ld8_f32(row[k], i);
            acc = _mm256_fmadd_ps(vs[k], w, acc);
        }
        _mm256_storeu_ps(y + i, acc);
    }
    for (; i < n; i++) {
        for (int k = 0; k < 4; k++) y[i] += s[k] * ld1(kind, row[k], i);
    }
}

/* Block i's four scales times s, ds[k] = s[k] * d_k: one conversion for the four rows (the
 * products are the scalar s[k] * fp16_to_fp32(d) exactly). */
AVX2_INLINE void block_scales4(const float * s, uint16_t d0, uint16_t d1, uint16_t d2, uint16_t d3,
                               float * ds) {
    const __m128i h = _mm_cvtsi64_si128((long long) (d0 | (uint64_t) d1 << 16 | (uint64_t) d2 << 32 |
                                                     (uint64_t) d3 << 48));
    _mm_storeu_ps(ds, _mm_mul_ps(_mm_cvtph_ps(h), _mm_loadu_ps(s)));
}

/* Every fourth block prefetches those four blocks' bytes of the pf rows (Q4_0: 72 bytes,
 * their first and last byte cover their lines; Q8_0: 136 bytes, the middle line too). */
AVX2_INLINE void prefetch_blocks4(const void * const * pf, int64_t i, size_t bs) {
    for (int k = 0; k < 4; k++) {
        _mm_prefetch((const char *) pf[k] + i * bs, _MM_HINT_T1);
        if (bs > 64) _mm_prefetch((const char *) pf[k] + i * bs + 64, _MM_HINT_T1);
        _mm_prefetch((const char *) pf[k] + (i + 4) * bs - 1, _MM_HINT_T1);
    }
}

/* The values of a block widened straight from memory (the loads fold into vpmovzxbd /
 * vpmovsxbd, two or four per block instead of a load, shifts and four register widenings
 * on the shuffle port): v[j] = values 8j..8j+7 as int32. Q4_0: bytes 0..7 and 8..15 widened
 * once each give values 0..15 (low nibbles) and 16..31 (high nibbles). */
AVX2_INLINE void block_i32(const bool is_q4, const uint8_t * qs, __m256i v[4]) {
    if (is_q4) {
        const __m256i m4 = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) qs));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 8)));
        v[0] = _mm256_sub_epi32(_mm256_and_si256(b0, m4), eight);
        v[1] = _mm256_sub_epi32(_mm256_and_si256(b1, m4), eight);
        v[2] = _mm256_sub_epi32(_mm256_srli_epi32(b0, 4), eight);
        v[3] = _mm256_sub_epi32(_mm256_srli_epi32(b1, 4), eight);
    } else {
        for (int j = 0; j < 4; j++) v[j] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 8 * j)));
    }
}

/* One row: y[0..32) += s * d * (a block's values), per block. */
AVX2_INLINE void axpy_quant_avx2(const bool is_q4, int64_t n, float s, const void * row, float * restrict y) {
    const size_t bs = is_q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const uint8_t * b = row;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        uint16_t d;
        memcpy(&d, b + i * bs, 2);
        const __m256 ds = _mm256_set1_ps(s * _cvtsh_ss(d));
        __m256i v[4];
        block_i32(is_q4, b + i * bs + 2, v);
        for (int j = 0; j < 4; j++) {
            _mm256_storeu_ps(y + 8 * j, _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(v[j]), _mm256_loadu_ps(y + 8 * j)));
        }
    }
}

AVX2_FN static void axpy_q8_0_avx2(int64_t n, float s, const void * row, float * restrict y) {
    axpy_quant_avx2(false, n, s, row, y);
}
AVX2_FN static void axpy_q4_0_avx2(int64_t n, float s, const void * row, float * restrict y) {
    axpy_quant_avx2(true, n, s, row, y);
}

AVX2_INLINE void axpy4_quant_avx2(const bool is_q4, int64_t n, const float * s, const void * const * row,
                                  const void * const * pf, float * restrict y) {
    const size_t bs = is_q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const uint8_t * b[4] = { row[0], row[1], row[2], row[3] };
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        if (pf && (i & 3) == 0) prefetch_blocks4(pf, i, bs);
        uint16_t d[4];
        for (int k = 0; k < 4; k++) memcpy(&d[k], b[k] + i * bs, 2);
        float ds[4];
        block_scales4(s, d[0], d[1], d[2], d[3], ds);
        __m256 acc[4] = { _mm256_loadu_ps(y), _mm256_loadu_ps(y + 8), _mm256_loadu_ps(y + 16),
                          _mm256_loadu_ps(y + 24) };
        for (int k = 0; k < 4; k++) {
            const __m256 vd = _mm256_broadcast_ss(&ds[k]);
            __m256i v[4];
            block_i32(is_q4, b[k] + i * bs + 2, v);
            for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(v[j]), acc[j]);
        }
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + 8 * j, acc[j]);
    }
}

#define DEFINE_AXPY4_AVX2(name, BODY, ARG)                                                   \
    AVX2_FN static void name(int64_t n, const float * s, const void * const * row,         \
                             float * restrict y) {                                         \
        BODY(ARG, n, s, row, NULL, y);                                                      \
    }                                                                                       \
    AVX2_FN static void name##pf(int64_t n, const float * s, const void * const * row,     \
                                 const void * const * pf, float * restrict y) {             \
        BODY(ARG, n, s, row, pf, y);                                                        \
    }

DEFINE_AXPY4_AVX2(axpy4_f32_avx2, axpy4_float_avx2, GH_TYPE_F32)
DEFINE_AXPY4_AVX2(axpy4_f16_avx2, axpy4_float_avx2, GH_TYPE_F16)
DEFINE_AXPY4_AVX2(axpy4_bf16_avx2, axpy4_float_avx2, GH_TYPE_BF16)
DEFINE_AXPY4_AVX2(axpy4_q8_0_avx2, axpy4_quant_avx2, false)
DEFINE_AXPY4_AVX2(axpy4_q4_0_avx2, axpy4_quant_avx2, true)

static gh_axpy4pf_fn axpy4pf_avx2(int type) {
    switch (type) {
        case GH_TYPE_F32:  return axpy4_f32_avx2pf;
        case GH_TYPE_F16:  return axpy4_f16_avx2pf;
        case GH_TYPE_BF16: return axpy4_bf16_avx2pf;
        case GH_TYPE_Q8_0: return axpy4_q8_0_avx2pf;
        case GH_TYPE_Q4_0: return axpy4_q4_0_avx2pf;
        default:           return gh_axpy4pf_kq_avx2(type);
    }
}
#endif

/* The sixteen-row form at this level, or NULL (groups of four). */
static gh_axpy16_fn axpy16_for(int type) {
#if defined(GH_X86)
    if (gh_simd_get() >= GH_SIMD_AVX2) return gh_axpy16_avx2(type);
#endif
    (void) type;
    return NULL;
}

/* NULL: no four-row kernel at this level (the caller runs the one-row axpy 4 times). */
static axpy4_fn axpy4_for(int type) {
#if defined(GH_X86)
    if (gh_simd_get() >= GH_SIMD_AVX512 && gh_axpy4_avx512(type)) return gh_axpy4_avx512(type);
    if (gh_simd_get() >= GH_SIMD_AVX2) {
        switch (type) {
            case GH_TYPE_F32:  return axpy4_f32_avx2;
            case GH_TYPE_F16:  return axpy4_f16_avx2;
            case GH_TYPE_BF16: return axpy4_bf16_avx2;
            case GH_TYPE_Q8_0: return axpy4_q8_0_avx2;
            case GH_TYPE_Q4_0: return axpy4_q4_0_avx2;
            default:           return gh_axpy4_kq_avx2(type);
        }
    }
#endif
    (void) type;
    return NULL;
}

static axpy_fn axpy_for(int type) {
#if defined(GH_X86)
    if (gh_simd_get() >= GH_SIMD_AVX512 && gh_axpy_avx512(type)) return gh_axpy_avx512(type);
    if (gh_simd_get() >= GH_SIMD_AVX2) {
        switch (type) {
            case GH_TYPE_F32:  return axpy_f32_avx2;
            case GH_TYPE_F16:  return axpy_f16_avx2;
            case GH_TYPE_BF16: return axpy_bf16_avx2;
            case GH_TYPE_Q8_0: return axpy_q8_0_avx2;
            case GH_TYPE_Q4_0: return axpy_q4_0_avx2;
            case GH_TYPE_Q4_K:
            case GH_TYPE_Q5_K:
            case GH_TYPE_Q6_K: return gh_axpy_kq_avx2(type);
            default:           break;
        }
    }
#endif
    switch (type) {
        case GH_TYPE_F32:  return axpy_f32;
        case GH_TYPE_F16:  return axpy_f16;
        case GH_TYPE_BF16: return axpy_bf16;
        case GH_TYPE_Q8_0: return axpy_q8_0;
        case GH_TYPE_Q4_0: return axpy_q4_0;
        case GH_TYPE_Q4_K: return axpy_q4_K;
        case GH_TYPE_Q5_K: return axpy_q5_K;
        case GH_TYPE_Q6_K: return axpy_q6_K;
        default:           return NULL;
    }
}

/* ---- the threaded op ---- */

typedef struct {
    const gh_weight * w;
    const float *     h;
    int64_t           n_tokens, ldh;
    float *           y;
    int64_t           ldy;
    axpy_fn           axpy;      /* the weight type's axpy */
    axpy_fn           axpy_f;    /* f32 axpy (batch path: accumulates dequantized rows) */
    axpy4_fn          axpy4;     /* the weight type's four-row axpy, or NULL */
    gh_axpy4pf_fn     axpy4pf;   /* list path: the four-row axpy with prefetch, or NULL */
    gh_axpy16_fn      axpy16;    /* one token: the sixteen-row form, or NULL */
    gh_matmul16_fn    mm16;      /* batch path: dense groups of sixteen rows in int8, or NULL */
    bool              tiles;    /* batch path: dense blocks in AVX2 register tiles */
    const int32_t *   active;   /* batch path: rows with a nonzero h for some token */
    const int32_t *   nzc;      /* batch path: per active row, the tokens whose h is nonzero */
    const int32_t *   ids;      /* list path (gh_matmul_t_list): rows ids[k] scaled by a[k] */
    const float *     a;
    int64_t           n_ids;
    int64_t           n_active;
} matmul_t_job;

/* Byte offset of column c (a multiple of the block size) within a row. */
static size_t col_offset(const gh_type_traits * tt, int64_t c) {
    return (size_t) (c / tt->block_size) * tt->type_size;
}

#if defined(GH_X86)
/* A dense block of the batch path (most activations nonzero: SwiGLU prompts) in register
 * tiles of 4 tokens x 16 columns: the block's dequantized rows stream through while the
 * tile's sums stay in registers, so each weight value is loaded once per 4 tokens and y
 * once per block, where the axpy loop loads and stores y once per (row, token). Each y
 * value goes through the same FMAs in the same row order as in the axpy loop (a zero
 * activation's FMA adds nothing), so the results are the same bit for bit: a batch equals
 * its tokens run one by one. */
__attribute__((target("avx2,fma")))
static void block_tiles_avx2(const matmul_t_job * job, const float * buf, const int32_t * rows, int64_t nk,
                             int64_t n, int64_t cs) {
    float hk[AXPY_RB * 4];
    for (int64_t t0 = 0; t0 < job->n_tokens; t0 += 4) {
        const int ntt = (int) GH_MIN((int64_t) 4, job->n_tokens - t0);
        for (int64_t k = 0; k < nk; k++) {
            for (int t = 0; t < 4; t++) {
                hk[k * 4 + t] = t < ntt ? job->h[(t0 + t) * job->ldh + rows[k]] : 0.0f;
            }
        }
        int64_t c = 0;
        for (; c + 16 <= n; c += 16) {
            __m256 acc[4][2];
            for (int t = 0; t < 4; t++) {  /* the tokens past the batch's end are never stored */
                const float * yt = job->y + (t0 + GH_MIN(t, ntt - 1)) * job->ldy + cs + c;
                acc[t][0] = _mm256_loadu_ps(yt);
                acc[t][1] = _mm256_loadu_ps(yt + 8);
            }
            for (int64_t k = 0; k < nk; k++) {
                const __m256 b0 = _mm256_loadu_ps(buf + k * AXPY_SEG + c);
                const __m256 b1 = _mm256_loadu_ps(buf + k * AXPY_SEG + c + 8);
                for (int t = 0; t < 4; t++) {
                    const __m256 a = _mm256_broadcast_ss(hk + k * 4 + t);
                    acc[t][0] = _mm256_fmadd_ps(a, b0, acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(a, b1, acc[t][1]);
                }
            }
            for (int t = 0; t < ntt; t++) {
                float * yt = job->y + (t0 + t) * job->ldy + cs + c;
                _mm256_storeu_ps(yt, acc[t][0]);
                _mm256_storeu_ps(yt + 8, acc[t][1]);
            }
        }
        for (; c < n; c++) {  /* the last few columns of a row that is not a multiple of 16 */
            for (int t = 0; t < ntt; t++) {
                float * yc = job->y + (t0 + t) * job->ldy + cs + c;
                for (int64_t k = 0; k < nk; k++) {
                    const float a = hk[k * 4 + t];
                    if (a != 0.0f) *yc += a * buf[k * AXPY_SEG + c];  /* as the axpy's tail */
                }
            }
        }
    }
}
#endif

static void matmul_t_task(void * arg, int ith, int nth) {
    const matmul_t_job * job = arg;
    const gh_weight * w = job->w;
    const gh_type_traits * tt = gh_type_traits_get(w->type);
    const int64_t align = GH_MAX(tt->block_size, 16); /* 16 floats: one cache line of y */

    int64_t per = (w->cols + nth - 1) / nth;
    per = (per + align - 1) / align * align;
    const int64_t c0 = GH_MIN(w->cols, per * ith), c1 = GH_MIN(w->cols, c0 + per);
    if (c0 >= c1) return;
    for (int64_t t = 0; t < job->n_tokens; t++) {
        memset(job->y + t * job->ldy + c0, 0, (size_t) (c1 - c0) * sizeof(float));
    }
    const char * wd = w->data;

    if (job->n_tokens == 1) {
        /* Active rows in groups of sixteen where the type has that form, else of four (one
         * pass over y per group), then the rest of four and one, in row order (list path:
         * in list order). The grouping depends on the list alone, so the dense form and the
         * list form of one token sum alike, whatever the thread count. */
        const size_t off = col_offset(tt, c0);
        const int gsize = job->axpy16 ? 16 : 4;
        float s[16];
        const void * rows[16];
        int k = 0;
        const int64_t n_rows = job->ids ? job->n_ids : w->rows;
        const size_t seg = col_offset(tt, c1 - c0 + tt->block_size - 1);
        for (int64_t i = 0; i < n_rows; i++) {
            const int64_t r = job->ids ? job->ids[i] : i;
            const float hr = job->ids ? job->a[i] : job->h[r];
            if (hr == 0.0f) continue;
            s[k] = hr;
            rows[k] = wd + r * w->row_bytes + off;
            if (job->ids && !job->axpy4pf && !job->axpy16 && i + AXPY_PF_ROWS < n_rows) {
                /* list rows are scattered: fetch this column range of a row ahead (into
                 * L2: into L1 they would evict the rows being added) */
                const char * next = wd + job->ids[i + AXPY_PF_ROWS] * w->row_bytes + off;
                for (size_t o = 0; o < seg; o += 64) __builtin_prefetch(next + o, 0, 2);
            }
            if (++k < gsize) continue;
            k = 0;
            if (job->axpy16) {
                /* the kernel prefetches the next sixteen rows of the list (past the end:
                 * the last row again) */
                const void * pf[16];
                if (job->ids) {
                    for (int j = 0; j < 16; j++) {
                        pf[j] = wd + job->ids[GH_MIN(n_rows - 1, i + 1 + j)] * w->row_bytes + off;
                    }
                }
                job->axpy16(c1 - c0, s, rows, job->ids ? pf : NULL, job->y + c0);
            } else if (job->axpy4pf) {
                /* the kernel prefetches the rows of the group AXPY_PF_GROUPS ahead (by list
                 * position; past the end: the last row again) */
                const void * pf[4];
                for (int j = 0; j < 4; j++) {
                    const int64_t ip = GH_MIN(n_rows - 1, i + 1 + 4 * (AXPY_PF_GROUPS - 1) + j);
                    pf[j] = wd + job->ids[ip] * w->row_bytes + off;
                }
                job->axpy4pf(c1 - c0, s, rows, pf, job->y + c0);
            } else if (job->axpy4) {
                job->axpy4(c1 - c0, s, rows, job->y + c0);
            } else {
                for (int j = 0; j < 4; j++) job->axpy(c1 - c0, s[j], rows[j], job->y + c0);
            }
        }
        int j = 0;
        for (; job->axpy4 && j + 4 <= k; j += 4) job->axpy4(c1 - c0, s + j, rows + j, job->y + c0);
        for (; j < k; j++) job->axpy(c1 - c0, s[j], rows[j], job->y + c0);
        return;
    }

    float buf[AXPY_RB * AXPY_SEG];
    /* blocks of rows: four int8 groups of 16 where the type has that form */
    const int64_t rb = job->mm16 ? 64 : AXPY_RB;
    for (int64_t cs = c0; cs < c1; cs += AXPY_SEG) {
        const int64_t n = GH_MIN((int64_t) AXPY_SEG, c1 - cs);
        const size_t off = col_offset(tt, cs);
        for (int64_t k0 = 0; k0 < job->n_active; k0 += rb) {
            const int64_t nk = GH_MIN(rb, job->n_active - k0);
            const int32_t * rows = job->active + k0;
            bool dense = false;  /* mostly nonzero (a SwiGLU prompt): the tiles or int8 groups */
            if (job->nzc) {
                int64_t nz = 0;
                for (int64_t k = 0; k < nk; k++) nz += job->nzc[k0 + k];
                dense = nz * 4 > job->n_tokens * nk;
            }
            if (dense && job->mm16) {
                const void * rp[64];
                for (int64_t k = 0; k < nk; k++) rp[k] = wd + rows[k] * w->row_bytes + off;
                job->mm16(n, job->n_tokens, job->h, job->ldh, rows, (int) nk, rp, job->y + cs, job->ldy);
                continue;
            }
            for (int64_t j0 = 0; j0 < nk; j0 += AXPY_RB) {  /* (an int8 block: in parts) */
                const int64_t nj = GH_MIN((int64_t) AXPY_RB, nk - j0);
                const int32_t * rj = rows + j0;
                /* dequantize: 0 + 1 * x is exact, and the axpy is the fastest converter */
                memset(buf, 0, (size_t) nj * AXPY_SEG * sizeof(float));
                for (int64_t k = 0; k < nj; k++) {
                    job->axpy(n, 1.0f, wd + rj[k] * w->row_bytes + off, buf + k * AXPY_SEG);
                }
#if defined(GH_X86)
                if (dense && job->tiles) {
                    block_tiles_avx2(job, buf, rj, nj, n, cs);
                    continue;
                }
#endif
                /* (a ReLU FFN's block is mostly zeros: only its nonzero (token, row) pairs) */
                for (int64_t t = 0; t < job->n_tokens; t++) {
                    const float * ht = job->h + t * job->ldh;
                    float * yt = job->y + t * job->ldy + cs;
                    for (int64_t k = 0; k < nj; k++) {
                        const float s = ht[rj[k]];
                        if (s != 0.0f) job->axpy_f(n, s, buf + k * AXPY_SEG, yt);
                    }
                }
            }
        }
    }
}

void gh_matmul_t_list(gh_threadpool * tp, const gh_weight * w, const int32_t * ids,
                      const float * a, int64_t n, float * y) {
    matmul_t_job job = {
        .w = w, .n_tokens = 1, .y = y, .ldy = w->cols, .axpy = axpy_for(w->type),
        .axpy4 = axpy4_for(w->type), .axpy16 = axpy16_for(w->type), .ids = ids, .a = a, .n_ids = n,
    };
#if defined(GH_X86)
    if (gh_simd_get() >= GH_SIMD_AVX512) job.axpy4pf = gh_axpy4pf_avx512(w->type);
    /* (the K-quants' AVX2 forms serve the AVX-512 level too: axpy4_for picks them) */
    if (!job.axpy4pf && gh_simd_get() >= GH_SIMD_AVX2) job.axpy4pf = axpy4pf_avx2(w->type);
#endif
    gh_threadpool_run(tp, matmul_t_task, &job);
}

void gh_matmul_t(gh_threadpool * tp, const gh_weight * w, const float * h, int64_t n_tokens,
                 int64_t ldh, float * y, int64_t ldy) {
    matmul_t_job job = {
        .w = w, .h = h, .n_tokens = n_tokens, .ldh = ldh, .y = y, .ldy = ldy,
        .axpy = axpy_for(w->type), .axpy_f = axpy_for(GH_TYPE_F32), .axpy4 = axpy4_for(w->type),
        .axpy16 = n_tokens == 1 ? axpy16_for(w->type) : NULL,
#if defined(GH_X86)
        .tiles = gh_simd_get() >= GH_SIMD_AVX2,
#endif
    };
#if defined(GH_X86)
    /* (the K-quants' AVX2 forms serve the AVX-512 level too) */
    if (n_tokens > 1 && gh_simd_get() >= GH_SIMD_AVX512) job.mm16 = gh_matmul16_avx512(w->type);
    if (n_tokens > 1 && !job.mm16 && gh_simd_get() >= GH_SIMD_AVX2) job.mm16 = gh_matmul16_avx2(w->type);
#endif
    int32_t * active = NULL;
    if (n_tokens > 1) {
        /* The rows some token needs, and (for the dense blocks' choice) how many, found once
         * for all threads. */
        active = malloc((size_t) w->rows * 2 * sizeof(int32_t));
        if (!active) {
            /* No memory for the list: one token at a time (that path allocates nothing). */
            for (int64_t t = 0; t < n_tokens; t++) {
                gh_matmul_t(tp, w, h + t * ldh, 1, ldh, y + t * ldy, ldy);
            }
            return;
        }
        if (job.tiles || job.mm16) {
            /* the counts first (token by token, in h's order); the active rows follow from them */
            int32_t * cnt = active + w->rows;
            memset(cnt, 0, (size_t) w->rows * sizeof(int32_t));
            for (int64_t t = 0; t < n_tokens; t++) {
                for (int64_t r = 0; r < w->rows; r++) cnt[r] += h[t * ldh + r] != 0.0f;
            }
            /* in place: r >= n_active, so cnt[r] is read before cnt[n_active] is written */
            for (int64_t r = 0; r < w->rows; r++) {
                if (cnt[r]) {
                    active[job.n_active] = (int32_t) r;
                    cnt[job.n_active++] = cnt[r];
                }
            }
            job.nzc = cnt;
        } else {
            for (int64_t r = 0; r < w->rows; r++) {
                int64_t t = 0;
                while (t < n_tokens && h[t * ldh + r] == 0.0f) t++;
                if (t < n_tokens) active[job.n_active++] = (int32_t) r;
            }
        }
    }
    job.active = active;
    gh_threadpool_run(tp, matmul_t_task, &job);
    free(active);
}

int64_t gh_matvec_t_sparse(gh_threadpool * tp, const gh_weight * w, const float * x,
                           const float * thr, int32_t * ids, float * a, float * y) {
    /* branch-free: whether an input passes is as unpredictable as a neuron's gate */
    int64_t n = 0;
    if (thr) {
        for (int64_t i = 0; i < w->rows; i++) {
            ids[n] = (int32_t) i;
            a[n] = x[i];
            n += fabsf(x[i]) > thr[i]; /* NaN: unused */
        }
    } else {
        for (int64_t i = 0; i < w->rows; i++) {
            ids[n] = (int32_t) i;
            a[n] = x[i];
            n += x[i] != 0.0f;
        }
    }
    gh_matmul_t_list(tp, w, ids, a, n, y);
    return n;
}

/* ---- public entry points (tests, benchmarks) ---- */

gh_status gh_op_matmul_t(int type, const void * w, int64_t rows, int64_t cols, const float * h,
                         int64_t n_tokens, float * y, int n_threads) {
    if (!axpy_for(type)) return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul_t: unknown type %d", type);
    if (rows <= 0 || cols <= 0 || n_tokens <= 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul_t: sizes must be positive (rows %lld, cols "
                       "%lld, n_tokens %lld)", (long long) rows, (long long) cols, (long long) n_tokens);
    }
    if (cols % gh_type_block_size(type)) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul_t: cols %lld is not a multiple of %s's "
                       "block size %lld", (long long) cols, gh_type_name(type),
                       (long long) gh_type_block_size(type));
    }
    if (!w || !h || !y) return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul_t: NULL buffer");
    if (n_threads < 1 || n_threads > 512) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul_t: n_threads %d out of range [1, 512]",
                       n_threads);
    }
    uint64_t wbytes, hbytes, ybytes;
    if (!gh_mul_ok((uint64_t) rows, gh_row_size(type, cols), &wbytes) ||
        !gh_mul_ok((uint64_t) n_tokens * sizeof(float), (uint64_t) rows, &hbytes) ||
        !gh_mul_ok((uint64_t) n_tokens * sizeof(float), (uint64_t) cols, &ybytes) ||
        wbytes > (uint64_t) PTRDIFF_MAX || hbytes > (uint64_t) PTRDIFF_MAX ||
        ybytes > (uint64_t) PTRDIFF_MAX || rows > INT32_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul_t: sizes overflow");
    }
    gh_weight wt = { .type = type, .rows = rows, .cols = cols, .data = w,
                     .row_bytes = gh_row_size(type, cols) };
    gh_threadpool * tp;
    bool kept;
    if (gh_op_pool_acquire(n_threads, &tp, &kept)) return GH_ERR_OOM; /* message set */
    gh_matmul_t(tp, &wt, h, n_tokens, rows, y, cols);
    gh_op_pool_release(tp, kept);
    return GH_OK;
}

gh_status gh_op_sparse_cols(int type, const void * w, int64_t rows, int64_t cols,
                            const float * x, const float * thr, float * y, int64_t * n_used,
                            int n_threads) {
    static const char fn[] = "gh_op_sparse_cols";
    if (!axpy_for(type)) return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown type %d", fn, type);
    if (rows <= 0 || cols <= 0 || rows > INT32_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: bad sizes (rows %lld, cols %lld)", fn,
                       (long long) rows, (long long) cols);
    }
    if (cols % gh_type_block_size(type)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: cols %lld is not a multiple of %s's block size "
                       "%lld", fn, (long long) cols, gh_type_name(type),
                       (long long) gh_type_block_size(type));
    }
    if (!w || !x || !y) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    if (n_threads < 1 || n_threads > 512) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: n_threads %d out of range [1, 512]", fn, n_threads);
    }
    uint64_t wbytes;
    if (!gh_mul_ok((uint64_t) rows, gh_row_size(type, cols), &wbytes) ||
        wbytes > (uint64_t) PTRDIFF_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: sizes overflow", fn);
    }
    int32_t * ids = malloc((size_t) rows * sizeof(int32_t));
    float * a = malloc((size_t) rows * sizeof(float));
    if (!ids || !a) {
        free(ids);
        free(a);
        return gh_fail(GH_ERR_OOM, "%s: out of memory", fn);
    }
    gh_weight wt = { .type = type, .rows = rows, .cols = cols, .data = w,
                     .row_bytes = gh_row_size(type, cols) };
    gh_threadpool * tp;
    bool kept;
    if (gh_op_pool_acquire(n_threads, &tp, &kept)) {
        free(ids);
        free(a);
        return GH_ERR_OOM; /* message set */
    }
    const int64_t n = gh_matvec_t_sparse(tp, &wt, x, thr, ids, a, y);
    gh_op_pool_release(tp, kept);
    if (n_used) *n_used = n;
    free(ids);
    free(a);
    return GH_OK;
}
