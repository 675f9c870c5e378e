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
 * pass (a fused axpy per type). Batches of up to AXPY_EXACT_MAX tokens run each token's
 * decode sums (the same kernels in the same order: a batch equals its tokens one by one,
 * bit for bit, which speculative verification needs). Larger batches: a block of rows is
 * dequantized once into a small buffer and then added into every token whose activation
 * is nonzero, or, when most of the block's activations are nonzero (a SwiGLU prompt),
 * multiplied in register tiles (Q4_0 and the K-quants: in the int8 groups of 16 rows of
 * the decode form, each token's factors its own; with every row nonzero for every token
 * and whole groups those are the decode's sums at any batch size, so they serve the small
 * batches too). */
#include "cpu/ops.h"
#include "cpu/kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define AXPY_SEG 256  /* batch path: columns per segment (floats) */
#define AXPY_RB  32   /* batch path: rows dequantized at once (AXPY_RB * AXPY_SEG floats) */
#ifndef AXPY_PF_GROUPS
#define AXPY_PF_GROUPS 2 /* list path, in-kernel prefetch: groups of four rows ahead */
#endif
#define AXPY_PF_ROWS 8   /* list path, no in-kernel prefetch: rows ahead */
#define AXPY_EXACT_SEG 256 /* exact batch path: columns per segment (floats; a multiple of every block size) */
/* Batches of up to this many tokens sum as their tokens' decode (exact path, below). At
 * 16 it costs what the f32 tiles cost or less in F16 and, at AVX2, Q8_0; AVX-512 Q8_0 is
 * 1.4x faster at 2 tokens, even at 8 and 1.16x slower at 16 (the whole SmolLM2 gate file's
 * eval, docs/BENCHMARKS.md): 16 covers the default speculative verification (9 tokens)
 * and a server's decode steps of up to 16 slots. */
#define AXPY_EXACT_MAX 16

/* ---- the threaded op ---- */

typedef struct {
    const gh_weight * w;
    const float *     h;
    int64_t           n_tokens, ldh;
    float *           y;
    int64_t           ldy;
    gh_axpy_fn        axpy;      /* the weight type's axpy */
    gh_axpy_fn        axpy_f;    /* f32 axpy (batch path: accumulates dequantized rows) */
    gh_axpy4_fn       axpy4;     /* the weight type's four-row axpy, or NULL */
    gh_axpy4pf_fn     axpy4pf;   /* list path: the four-row axpy with prefetch, or NULL */
    gh_axpy16_fn      axpy16;    /* one token: the sixteen-row form, or NULL */
    gh_matmul16_fn    mm16;      /* batch path: dense groups of sixteen rows in int8, or NULL */
    gh_tiles_fn       tiles;     /* batch path: dense blocks in f32 register tiles, or NULL */
    const int32_t *   active;   /* batch path: rows with a nonzero h for some token */
    const int32_t *   nzc;      /* batch path: per active row, the tokens whose h is nonzero */
    const int32_t *   ids;      /* list path (gh_matmul_t_list): rows ids[k] scaled by a[k] */
    const float *     a;
    int64_t           n_ids;
    int64_t           n_active;
    bool              exact;       /* batch path: each token's decode sums (AXPY_EXACT_MAX) */
    bool              all_nonzero; /* every token's h is nonzero on every active row */
} matmul_t_job;

/* Byte offset of column c (a multiple of the block size) within a row. */
static size_t col_offset(const gh_type_traits * tt, int64_t c) {
    return (size_t) (c / tt->block_size) * tt->type_size;
}


/* One token's sums over the columns [c0, c1) (a multiple of the block size from a block
 * boundary, or the row's end): h the token's activations (list path: job->ids, job->a),
 * y its output row. The order of the terms of each y[c] depends on the token's nonzero
 * rows alone, not on c0 and c1. */
static void one_token(const matmul_t_job * job, const float * h, int64_t c0, int64_t c1, float * y) {
    const gh_weight * w = job->w;
    const gh_type_traits * tt = gh_type_traits_get(w->type);
    const char * wd = w->data;
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
        const float hr = job->ids ? job->a[i] : h[r];
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
            /* the kernel prefetches the next sixteen rows (of the list, or of the matrix;
             * past the end: the last row again). The whole matrix's rows need it too:
             * the kernel reads sixteen rows' segments block by block, more streams than
             * the hardware prefetcher follows (without it the full down_t axpy ran at
             * 0.16-0.34x the dense matmul's GB/s per byte; docs/BENCHMARKS.md) */
            const void * pf[16];
            for (int j = 0; j < 16; j++) {
                const int64_t ip = GH_MIN(n_rows - 1, i + 1 + j);
                pf[j] = wd + (job->ids ? job->ids[ip] : ip) * w->row_bytes + off;
            }
            job->axpy16(c1 - c0, s, rows, pf, y + c0);
        } else if (job->axpy4pf) {
            /* the kernel prefetches the rows of the group AXPY_PF_GROUPS ahead (by list
             * position; past the end: the last row again) */
            const void * pf[4];
            for (int j = 0; j < 4; j++) {
                const int64_t ip = GH_MIN(n_rows - 1, i + 1 + 4 * (AXPY_PF_GROUPS - 1) + j);
                pf[j] = wd + (job->ids ? job->ids[ip] : ip) * w->row_bytes + off;
            }
            job->axpy4pf(c1 - c0, s, rows, pf, y + c0);
        } else if (job->axpy4) {
            job->axpy4(c1 - c0, s, rows, y + c0);
        } else {
            for (int j = 0; j < 4; j++) job->axpy(c1 - c0, s[j], rows[j], y + c0);
        }
    }
    int j = 0;
    for (; job->axpy4 && j + 4 <= k; j += 4) job->axpy4(c1 - c0, s + j, rows + j, y + c0);
    for (; j < k; j++) job->axpy(c1 - c0, s[j], rows[j], y + c0);
}

/* Every token's sums over [c0, c1) where every token's h is nonzero on exactly the rows
 * job->active (a SwiGLU batch: the usual case): one_token's groups, each group's segment
 * added into every token in turn while it is in L1 (the first token's call prefetches
 * as decode's does); the sums are each token's one_token sums, bit for bit. */
static void tokens_nonzero(const matmul_t_job * job, int64_t c0, int64_t c1) {
    const gh_weight * w = job->w;
    const gh_type_traits * tt = gh_type_traits_get(w->type);
    const char * wd = w->data;
    const size_t off = col_offset(tt, c0);
    const int64_t n = c1 - c0, nt = job->n_tokens, na = job->n_active;
    const int gsize = job->axpy16 ? 16 : 4;
    const void * rows[16];
    float s[16];
    int64_t k0 = 0;
    for (; k0 + gsize <= na; k0 += gsize) {
        for (int j = 0; j < gsize; j++) rows[j] = wd + job->active[k0 + j] * w->row_bytes + off;
        const void * pf[4];
        if (!job->axpy16 && job->axpy4pf) {
            for (int j = 0; j < 4; j++) {
                const int64_t kp = GH_MIN(na - 1, k0 + 4 + 4 * (AXPY_PF_GROUPS - 1) + j);
                pf[j] = wd + job->active[kp] * w->row_bytes + off;
            }
        }
        for (int64_t t = 0; t < nt; t++) {
            const float * ht = job->h + t * job->ldh;
            float * yt = job->y + t * job->ldy + c0;
            for (int j = 0; j < gsize; j++) s[j] = ht[job->active[k0 + j]];
            if (job->axpy16) job->axpy16(n, s, rows, NULL, yt);
            else if (job->axpy4pf && (t == 0 || !job->axpy4)) job->axpy4pf(n, s, rows, pf, yt);
            else if (job->axpy4) job->axpy4(n, s, rows, yt);
            else for (int j = 0; j < 4; j++) job->axpy(n, s[j], rows[j], yt);
        }
    }
    /* the rest: fours, then ones (one_token's tail) */
    for (int64_t t = 0; t < nt; t++) {
        const float * ht = job->h + t * job->ldh;
        float * yt = job->y + t * job->ldy + c0;
        int64_t k = k0;
        for (; job->axpy4 && k + 4 <= na; k += 4) {
            for (int j = 0; j < 4; j++) {
                rows[j] = wd + job->active[k + j] * w->row_bytes + off;
                s[j] = ht[job->active[k + j]];
            }
            job->axpy4(n, s, rows, yt);
        }
        for (; k < na; k++) job->axpy(n, ht[job->active[k]], wd + job->active[k] * w->row_bytes + off, yt);
    }
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
        one_token(job, job->h, c0, c1, job->y);
        return;
    }
    if (job->exact) {
        /* each token's decode sums (one_token's order and kernels, so a batch's logits are
         * its tokens' one by one: speculative verification keeps plain decode's greedy
         * text), a segment of columns at a time so that its rows stay in cache from one
         * token to the next */
        for (int64_t cs = c0; cs < c1; cs += AXPY_EXACT_SEG) {
            const int64_t ce = GH_MIN(c1, cs + AXPY_EXACT_SEG);
            if (job->all_nonzero) {
                tokens_nonzero(job, cs, ce);
            } else {
                for (int64_t t = 0; t < job->n_tokens; t++) {
                    one_token(job, job->h + t * job->ldh, cs, ce, job->y + t * job->ldy);
                }
            }
        }
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
                if (dense && job->tiles) {
                    job->tiles(job->n_tokens, job->h, job->ldh, rj, nj, buf, AXPY_SEG, n, job->y + cs,
                               job->ldy);
                    continue;
                }
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
    const gh_kernel_set * ks = gh_kernels_get(w->type);
    matmul_t_job job = {
        .w = w, .n_tokens = 1, .y = y, .ldy = w->cols, .axpy = ks->axpy, .axpy4 = ks->axpy4,
        .axpy4pf = ks->axpy4pf, .axpy16 = ks->axpy16, .ids = ids, .a = a, .n_ids = n,
    };
    gh_threadpool_run(tp, matmul_t_task, &job);
}

void gh_matmul_t(gh_threadpool * tp, const gh_weight * w, const float * h, int64_t n_tokens,
                 int64_t ldh, float * y, int64_t ldy) {
    const gh_kernel_set * ks = gh_kernels_get(w->type);
    const bool exact = n_tokens > 1 && n_tokens <= AXPY_EXACT_MAX;
    matmul_t_job job = {
        .w = w, .h = h, .n_tokens = n_tokens, .ldh = ldh, .y = y, .ldy = ldy,
        .axpy = ks->axpy, .axpy_f = gh_kernels_get(GH_TYPE_F32)->axpy, .axpy4 = ks->axpy4,
        .axpy4pf = n_tokens == 1 || exact ? ks->axpy4pf : NULL,
        .axpy16 = n_tokens == 1 || exact ? ks->axpy16 : NULL,
        .tiles = gh_kernels_get(GH_TYPE_F32)->tiles,
        .exact = exact,
    };
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
        if (job.tiles || ks->matmul16 || job.exact) {
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
            job.all_nonzero = true;
            for (int64_t k = 0; k < job.n_active; k++) job.all_nonzero &= cnt[k] == n_tokens;
            if (ks->matmul16 && (!exact || (job.all_nonzero && job.n_active % 16 == 0))) {
                /* the int8 groups' batch form: with every token's h nonzero on every active
                 * row and whole groups of 16, each token's sums are its axpy16 decode's (at
                 * any n), and it unpacks each group once for all tokens (Q4_0 gate file,
                 * 16 tokens: 1.6x faster than axpy16 token by token) */
                job.exact = false;
                job.mm16 = ks->matmul16;
                job.axpy4pf = NULL;
                job.axpy16 = NULL;
            }
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
    if (!gh_kernels_get(type)) return gh_fail(GH_ERR_INVALID_ARG, "gh_op_matmul_t: unknown type %d", type);
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
    if (!gh_kernels_get(type)) return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown type %d", fn, type);
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
