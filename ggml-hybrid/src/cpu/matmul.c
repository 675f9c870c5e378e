/* Matrix multiplication y[t][r] = W[r] . x[t] over the type's register-tile kernels.
 *
 * 1. The activations are converted once per call into the weight type's vec_dot_type
 *    (Q8_X4 for the quantized types, BF16 for BF16; F32 and F16 use x as it is).
 * 2. Threads split the output rows in contiguous chunks. Each thread walks its chunk
 *    in blocks of rows small enough to stay in L2, and for each block runs every
 *    token tile over it, so a weight byte comes from memory once per call however many
 *    tokens there are. Decode (one token) is one long stream of mr-row tiles.
 * 3. gh_matmul_multi runs the matmuls of several weights that read the same x (q, k and
 *    v; gate and up) as one job: x is converted once and the threads wait once. */
#include <stdatomic.h>
#include "cpu/ops.h"
#include "types/types.h"
#include "cpu/kernels.h"

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

#define GH_MATMUL_MAX_W 4 /* weights one job may carry (q, k, v; gate, up) */

/* One weight of a job: its rows are split in work items numbered after the previous
 * weight's. */
typedef struct {
    const gh_weight * w;
    float *           y;
    int64_t           ldy;
    int64_t           chunk;      /* rows per work item, a multiple of the tile height */
    int64_t           first_item; /* number of the weight's first work item */
} matmul_part;

typedef struct {
    matmul_part           part[GH_MATMUL_MAX_W];
    int                   n_part;
    int64_t               n_items;
    const gh_kernel_set * ks;
    const float *         x;
    int64_t               n_tokens;
    int64_t               cols;
    char *                xq;         /* converted activations (or x itself) */
    size_t                xq_stride;
    atomic_llong          next_item;
} matmul_job;

static void convert_task(void * arg, int ith, int nth) {
    matmul_job * job = arg;
    const int64_t per = (job->n_tokens + nth - 1) / nth;
    const int64_t t0 = per * ith, t1 = GH_MIN(job->n_tokens, t0 + per);
    for (int64_t t = t0; t < t1; t++) {
        job->ks->from_float_x(job->x + t * job->cols, job->xq + t * job->xq_stride, job->cols);
    }
}

/* Threads claim work items from a shared counter rather than owning a fixed share:
 * when the machine is busier than the pool (another process, a descheduled worker), the
 * threads that do run take over the stalled one's rows instead of waiting a time slice
 * for it. Items are long enough to keep the kernels' linear prefetch effective.
 * (Items that shrink towards the end of a job, to even out when the threads finish,
 * measured no faster in decode.) */
static void matmul_task(void * arg, int ith, int nth) {
    matmul_job * job = arg;
    const gh_kernel_set * ks = job->ks;
    const int64_t mr = job->n_tokens == 1 ? ks->mr1 : ks->mr, nt = ks->nt;
    (void) ith;
    (void) nth;

    for (;;) {
        const int64_t item = atomic_fetch_add_explicit(&job->next_item, 1, memory_order_relaxed);
        if (item >= job->n_items) break;
        int p = 0;
        while (p + 1 < job->n_part && item >= job->part[p + 1].first_item) p++;
        const matmul_part * P = &job->part[p];
        const gh_weight * w = P->w;
        const char * wd = w->data;
        const int64_t r_begin = (item - P->first_item) * P->chunk;
        const int64_t r_end = GH_MIN(w->rows, r_begin + P->chunk);
        /* balanced token tiles (5 tokens at nt 4: 3 + 2, not 4 + 1): a lone last token
         * would run the prompt kernel at one token, which reads the rows again for it
         * alone (measured: SmolLM2 Q8_0, 5 tokens 14.5 ms against 6.1 ms for 3) */
        const int64_t n_tiles = (job->n_tokens + nt - 1) / nt;
        const int64_t tw = (job->n_tokens + n_tiles - 1) / n_tiles;
        for (int64_t t = 0; t < job->n_tokens; t += tw) {
            const int tn = (int) GH_MIN(tw, job->n_tokens - t);
            const char * xt = job->xq + t * job->xq_stride;
            float * yt = P->y + t * P->ldy;
            for (int64_t r = r_begin; r < r_end; r += mr) {
                const int rn = (int) GH_MIN(mr, r_end - r);
                ks->gemm(w->cols, wd + r * w->row_bytes, w->row_bytes, rn, xt, job->xq_stride,
                         tn, yt + r, P->ldy);
            }
        }
    }
}

void gh_matmul_multi(gh_threadpool * tp, const gh_weight * const * ws, int nw, const float * x,
                     int64_t n_tokens, float * const * ys, const int64_t * ldys, void * scratch) {
    /* one converted x serves the job only if every weight reads it the same way */
    bool share = nw <= GH_MATMUL_MAX_W;
    for (int i = 1; i < nw && share; i++) share = ws[i]->type == ws[0]->type && ws[i]->cols == ws[0]->cols;
    if (!share) {
        for (int i = 0; i < nw; i++) gh_matmul_multi(tp, &ws[i], 1, x, n_tokens, &ys[i], &ldys[i], scratch);
        return;
    }
    const gh_weight * w0 = ws[0];
    const gh_type_traits * tt = gh_type_traits_get(w0->type);
    matmul_job job = {
        .n_part = nw, .ks = gh_kernels_get(w0->type), .x = x, .n_tokens = n_tokens,
        .cols = w0->cols,
    };
    if (tt->vec_dot_type == GH_TYPE_F32) {
        job.xq = (char *) x;
        job.xq_stride = (size_t) w0->cols * sizeof(float);
    } else {
        job.xq = scratch;
        job.xq_stride = xq_stride(tt->vec_dot_type, w0->cols);
        /* A few tokens convert in less time than waking the pool costs. */
        if (n_tokens * w0->cols <= GH_MATMUL_CONVERT_INLINE) convert_task(&job, 0, 1);
        else gh_threadpool_run(tp, convert_task, &job);
    }
    /* Decode: a few work items per thread and weight. Prompts: items sized so the rows
     * stay in L2 while every token tile passes over them, and at least two per thread and
     * weight: at 2 threads SmolLM2's 576-row q and o (592 rows of L2 block) were one item
     * each, which one thread ran while the other waited. */
    const int nth = gh_threadpool_n_threads(tp);
    const int64_t mr = n_tokens == 1 ? job.ks->mr1 : job.ks->mr;
    int64_t n_items = 0;
    for (int i = 0; i < nw; i++) {
        const gh_weight * w = ws[i];
        int64_t chunk = n_tokens == 1 ? (w->rows + 4 * nth - 1) / (4 * nth)
                                      : (int64_t) (GH_MATMUL_L2_BLOCK / w->row_bytes);
        if (n_tokens > 1 && nth > 1) chunk = GH_MIN(chunk, (w->rows + 2 * nth - 1) / (2 * nth));
        chunk = GH_MAX(mr, (chunk + mr - 1) / mr * mr);
        job.part[i] = (matmul_part) { .w = w, .y = ys[i], .ldy = ldys[i], .chunk = chunk,
                                      .first_item = n_items };
        n_items += (w->rows + chunk - 1) / chunk;
    }
    job.n_items = n_items;
    atomic_init(&job.next_item, 0);
    gh_threadpool_run(tp, matmul_task, &job);
}

void gh_matmul(gh_threadpool * tp, const gh_weight * w, const float * x, int64_t n_tokens,
               float * y, int64_t ldy, void * scratch) {
    gh_matmul_multi(tp, &w, 1, x, n_tokens, &y, &ldy, scratch);
}

/* ---- public entry point ---- */

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

    gh_threadpool * tp;
    bool kept;
    if (gh_op_pool_acquire(n_threads, &tp, &kept)) {
        gh_aligned_free(scratch);
        return GH_ERR_OOM; /* message set by gh_threadpool_new */
    }
    gh_matmul(tp, &wt, x, n_tokens, y, rows, scratch);
    gh_op_pool_release(tp, kept);
    gh_aligned_free(scratch);
    return GH_OK;
}
