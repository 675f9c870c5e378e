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
 * small buffer and then added into every token whose activation is nonzero. */
#include "ops.h"
#include "types.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(GH_X86)
#include <immintrin.h>
#endif

#define AXPY_SEG 256  /* batch path: columns per segment (floats) */
#define AXPY_RB  32   /* batch path: rows dequantized at once (AXPY_RB * AXPY_SEG floats) */

/* y[0..n) += s * row, the row in `type` starting at a block boundary (n a multiple of
 * the block size). */
typedef void (*axpy_fn)(int64_t n, float s, const void * row, float * y);

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

static axpy_fn axpy_for(int type) {
    switch (type) {
        case GH_TYPE_F32:  return axpy_f32;
        case GH_TYPE_F16:  return axpy_f16;
        case GH_TYPE_BF16: return axpy_bf16;
        case GH_TYPE_Q8_0: return axpy_q8_0;
        case GH_TYPE_Q4_0: return axpy_q4_0;
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
    axpy_fn           axpy;
    const int32_t *   active;   /* batch path: rows with a nonzero h for some token */
    int64_t           n_active;
} matmul_t_job;

/* Byte offset of column c (a multiple of the block size) within a row. */
static size_t col_offset(const gh_type_traits * tt, int64_t c) {
    return (size_t) (c / tt->block_size) * tt->type_size;
}

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
        const size_t off = col_offset(tt, c0);
        for (int64_t r = 0; r < w->rows; r++) {
            const float s = job->h[r];
            if (s != 0.0f) job->axpy(c1 - c0, s, wd + r * w->row_bytes + off, job->y + c0);
        }
        return;
    }

    float buf[AXPY_RB * AXPY_SEG];
    for (int64_t cs = c0; cs < c1; cs += AXPY_SEG) {
        const int64_t n = GH_MIN((int64_t) AXPY_SEG, c1 - cs);
        const size_t off = col_offset(tt, cs);
        for (int64_t k0 = 0; k0 < job->n_active; k0 += AXPY_RB) {
            const int64_t nk = GH_MIN((int64_t) AXPY_RB, job->n_active - k0);
            const int32_t * rows = job->active + k0;
            for (int64_t k = 0; k < nk; k++) {
                tt->to_float(wd + rows[k] * w->row_bytes + off, buf + k * AXPY_SEG, n);
            }
            for (int64_t t = 0; t < job->n_tokens; t++) {
                const float * ht = job->h + t * job->ldh;
                float * yt = job->y + t * job->ldy + cs;
                for (int64_t k = 0; k < nk; k++) {
                    const float s = ht[rows[k]];
                    if (s != 0.0f) axpy_f32(n, s, buf + k * AXPY_SEG, yt);
                }
            }
        }
    }
}

void gh_matmul_t(gh_threadpool * tp, const gh_weight * w, const float * h, int64_t n_tokens,
                 int64_t ldh, float * y, int64_t ldy) {
    matmul_t_job job = {
        .w = w, .h = h, .n_tokens = n_tokens, .ldh = ldh, .y = y, .ldy = ldy,
        .axpy = axpy_for(w->type),
    };
    int32_t * active = NULL;
    if (n_tokens > 1) {
        /* The rows some token needs, found once for all threads. */
        active = malloc((size_t) w->rows * sizeof(int32_t));
        if (!active) {
            /* No memory for the list: one token at a time (that path allocates nothing). */
            for (int64_t t = 0; t < n_tokens; t++) {
                gh_matmul_t(tp, w, h + t * ldh, 1, ldh, y + t * ldy, ldy);
            }
            return;
        }
        for (int64_t r = 0; r < w->rows; r++) {
            int64_t t = 0;
            while (t < n_tokens && h[t * ldh + r] == 0.0f) t++;
            if (t < n_tokens) active[job.n_active++] = (int32_t) r;
        }
    }
    job.active = active;
    gh_threadpool_run(tp, matmul_t_task, &job);
    free(active);
}

/* ---- public entry point (tests, benchmarks) ---- */

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
    gh_threadpool * tp = NULL;
    if (n_threads > 1 && !(tp = gh_threadpool_new(n_threads))) return GH_ERR_OOM;
    gh_matmul_t(tp, &wt, h, n_tokens, rows, y, cols);
    gh_threadpool_free(tp);
    return GH_OK;
}
