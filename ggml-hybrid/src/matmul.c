/* Matrix multiplication y[t][r] = W[r] . x[t] over the type's register-tile kernels.
 *
 * 1. The activations are converted once per call into the weight type's vec_dot_type
 *    (Q8_X4 for the quantized types, BF16 for BF16; F32 and F16 use x as it is).
 * 2. Threads split the output rows in contiguous chunks. Each thread walks its chunk
 *    in blocks of rows small enough to stay in L2, and for each block runs every
 *    token tile over it, so a weight byte comes from memory once per call however many
 *    tokens there are. Decode (one token) is one long stream of mr-row tiles. */
#include "ops.h"
#include "types.h"
#include "simd/kernels.h"

#include <pthread.h>
#include <string.h>

#define GH_MATMUL_L2_BLOCK (192 * 1024) /* bytes of weight rows a row block aims for */
#define GH_MATMUL_CONVERT_INLINE 16384  /* activation values converted by the caller alone */

static size_t xq_stride(int vec_dot_type, int64_t cols) {
    size_t bytes = gh_row_size(vec_dot_type, cols);
    return (bytes + 63) & ~(size_t) 63;
}

size_t gh_matmul_scratch_size(const gh_weight * w, int64_t n_tokens) {
    const gh_type_traits * tt = gh_type_traits_get(w->type);
    if (!tt || tt->vec_dot_type == GH_TYPE_F32 || n_tokens <= 0) return 0;
    return xq_stride(tt->vec_dot_type, w->cols) * (size_t) n_tokens;
}

typedef struct {
    const gh_weight *     w;
    const gh_kernel_set * ks;
    const float *         x;
    int64_t               n_tokens;
    float *               y;
    int64_t               ldy;
    char *                xq;         /* converted activations (or x itself) */
    size_t                xq_stride;
} matmul_job;

static void convert_task(void * arg, int ith, int nth) {
    matmul_job * job = arg;
    const int64_t per = (job->n_tokens + nth - 1) / nth;
    const int64_t t0 = per * ith, t1 = GH_MIN(job->n_tokens, t0 + per);
    for (int64_t t = t0; t < t1; t++) {
        job->ks->from_float_x(job->x + t * job->w->cols, job->xq + t * job->xq_stride,
                              job->w->cols);
    }
}

static void matmul_task(void * arg, int ith, int nth) {
    const matmul_job * job = arg;
    const gh_weight * w = job->w;
    const gh_kernel_set * ks = job->ks;
    const int64_t mr = job->n_tokens == 1 ? ks->mr1 : ks->mr, nt = ks->nt;

    /* Contiguous chunk of rows, a multiple of the tile height. */
    int64_t per = (w->rows + nth - 1) / nth;
    per = (per + mr - 1) / mr * mr;
    const int64_t r_begin = GH_MIN(w->rows, per * ith);
    const int64_t r_end = GH_MIN(w->rows, r_begin + per);

    int64_t block = job->n_tokens == 1 ? per : (int64_t) (GH_MATMUL_L2_BLOCK / w->row_bytes);
    block = GH_MAX(mr, block / mr * mr);

    const char * wd = w->data;
    for (int64_t rb = r_begin; rb < r_end; rb += block) {
        const int64_t rb_end = GH_MIN(r_end, rb + block);
        for (int64_t t = 0; t < job->n_tokens; t += nt) {
            const int tn = (int) GH_MIN(nt, job->n_tokens - t);
            const char * xt = job->xq + t * job->xq_stride;
            float * yt = job->y + t * job->ldy;
            for (int64_t r = rb; r < rb_end; r += mr) {
                const int rn = (int) GH_MIN(mr, rb_end - r);
                ks->gemm(w->cols, wd + r * w->row_bytes, w->row_bytes, rn, xt, job->xq_stride,
                         tn, yt + r, job->ldy);
            }
        }
    }
}

void gh_matmul(gh_threadpool * tp, const gh_weight * w, const float * x, int64_t n_tokens,
               float * y, int64_t ldy, void * scratch) {
    const gh_type_traits * tt = gh_type_traits_get(w->type);
    matmul_job job = {
        .w = w, .ks = gh_kernels_get(w->type), .x = x, .n_tokens = n_tokens, .y = y, .ldy = ldy,
    };
    if (tt->vec_dot_type == GH_TYPE_F32) {
        job.xq = (char *) x;
        job.xq_stride = (size_t) w->cols * sizeof(float);
    } else {
        job.xq = scratch;
        job.xq_stride = xq_stride(tt->vec_dot_type, w->cols);
        /* A few tokens convert in less time than waking the pool costs. */
        if (n_tokens * w->cols <= GH_MATMUL_CONVERT_INLINE) convert_task(&job, 0, 1);
        else gh_threadpool_run(tp, convert_task, &job);
    }
    gh_threadpool_run(tp, matmul_task, &job);
}

/* ---- public entry point ---- */

/* gh_op_matmul keeps one pool around so that repeated calls (tests, benchmarks) do not
 * pay for starting threads; a concurrent caller gets a pool of its own. */
static pthread_mutex_t g_pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static gh_threadpool * g_pool;

/* Join the kept pool's threads when the library is unloaded (Python's cffi closes it at
 * interpreter exit) or the process exits: a worker still spinning in unmapped code would
 * crash. */
__attribute__((destructor)) static void matmul_pool_fini(void) {
    if (pthread_mutex_trylock(&g_pool_mutex) != 0) return; /* a call is running: leave it */
    gh_threadpool_free(g_pool);
    g_pool = NULL;
    pthread_mutex_unlock(&g_pool_mutex);
}

gh_status gh_op_matmul(int type, const void * w, int64_t rows, int64_t cols, const float * x,
                       int64_t n_tokens, float * y, int n_threads) {
    if (!gh_type_valid(type)) return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul: unknown type %d", type);
    if (rows <= 0 || cols <= 0 || n_tokens <= 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul: sizes must be positive (rows %lld, cols %lld, n_tokens %lld)",
                       (long long) rows, (long long) cols, (long long) n_tokens);
    }
    if (cols % gh_type_block_size(type)) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul: cols %lld is not a multiple of %s's block size %lld",
                       (long long) cols, gh_type_name(type), (long long) gh_type_block_size(type));
    }
    if (!w || !x || !y) return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul: NULL buffer");
    if (n_threads < 1 || n_threads > 512) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul: n_threads %d out of range [1, 512]", n_threads);
    }
    uint64_t wbytes, xbytes, ybytes;
    if (!gh_mul_ok((uint64_t) rows, gh_row_size(type, cols), &wbytes) ||
        !gh_mul_ok((uint64_t) n_tokens * sizeof(float), (uint64_t) cols, &xbytes) ||
        !gh_mul_ok((uint64_t) n_tokens * sizeof(float), (uint64_t) rows, &ybytes) ||
        wbytes > (uint64_t) PTRDIFF_MAX || xbytes > (uint64_t) PTRDIFF_MAX ||
        ybytes > (uint64_t) PTRDIFF_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul: sizes overflow");
    }

    gh_weight wt = { .type = type, .rows = rows, .cols = cols, .data = w,
                     .row_bytes = gh_row_size(type, cols) };
    size_t scratch_size = gh_matmul_scratch_size(&wt, n_tokens);
    void * scratch = NULL;
    if (scratch_size && !(scratch = gh_aligned_alloc(scratch_size))) {
        return gh_fail(GH_ERR_OOM, "gh_op_matmul: cannot allocate %zu bytes of scratch", scratch_size);
    }

    gh_threadpool * tp = NULL;
    bool cached = n_threads > 1 && pthread_mutex_trylock(&g_pool_mutex) == 0;
    if (cached) {
        if (g_pool && gh_threadpool_n_threads(g_pool) != n_threads) {
            gh_threadpool_free(g_pool);
            g_pool = NULL;
        }
        if (!g_pool) g_pool = gh_threadpool_new(n_threads);
        tp = g_pool;
    } else if (n_threads > 1) {
        tp = gh_threadpool_new(n_threads);
    }
    if (n_threads > 1 && !tp) {
        if (cached) pthread_mutex_unlock(&g_pool_mutex);
        gh_aligned_free(scratch);
        return GH_ERR_OOM; /* message set by gh_threadpool_new */
    }

    gh_matmul(tp, &wt, x, n_tokens, y, rows, scratch);

    if (cached) pthread_mutex_unlock(&g_pool_mutex);
    else gh_threadpool_free(tp);
    gh_aligned_free(scratch);
    return GH_OK;
}
