/* The FFN's row kernels over a list of neurons (rows.h): the predictor, the gate/up
 * row-dots of the listed neurons with their activation, and the plain row-dots of a list.
 * The down projection over the list (gh_matmul_t_list) lives with the other axpy code in
 * cpu/axpy.c.
 *
 * Work split: the row-dots split the LIST in contiguous chunks of equal length (every
 * listed neuron costs the same two row reads, while the listed neurons are not spread
 * evenly over the rows); the down projection splits the output columns. Each output value
 * is computed by exactly one thread in a fixed order, so results do not depend on the
 * thread count and nothing needs reducing. */
#include "ffn/rows.h"
#include "cpu/kernels.h"
#include "types/types.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Below this many bytes of rows a call runs on the calling thread alone: waking the
 * pool costs more than the work. */
#define GH_SPARSE_INLINE_BYTES (24 * 1024)

/* ------------------------------------------------------------------ predictor -- */

size_t gh_sparse_predict_scratch_size(const gh_weight * fc1, const gh_weight * fc2) {
    return GH_MAX(gh_matmul_scratch_size(fc1, 1), gh_matmul_scratch_size(fc2, 1));
}

int64_t gh_sparse_predict(gh_threadpool * tp, const gh_weight * fc1, const gh_weight * fc2,
                          const float * x, float threshold, float * ph, float * score,
                          int32_t * active, void * scratch) {
    gh_matmul(tp, fc1, x, 1, ph, fc1->rows, scratch);
    for (int64_t i = 0; i < fc1->rows; i++) ph[i] = ph[i] > 0.0f ? ph[i] : 0.0f;
    gh_matmul(tp, fc2, ph, 1, score, fc2->rows, scratch);
    /* branch-free: whether a score passes is unpredictable, and a branch per neuron cost
     * ~7 us per layer in mispredictions */
    int64_t n = 0;
    for (int64_t i = 0; i < fc2->rows; i++) {
        active[n] = (int32_t) i;
        n += score[i] >= threshold; /* NaN: inactive */
    }
    return n;
}

/* ---------------------------------------------------------------- sparse GLU -- */

size_t gh_sparse_glu_scratch_size(const gh_weight * gate, const gh_weight * up) {
    /* gate's and up's converted x, one after the other (64-byte aligned) */
    return ((gh_matmul_scratch_size(gate, 1) + 63) & ~(size_t) 63) +
           (up ? gh_matmul_scratch_size(up, 1) : 0);
}

#define GLU_GROUP 16 /* list positions a multi-row dot may span; chunks start at multiples of
                      * it (also keeps gh_glu's vector/tail split the same per element) */

typedef struct {
    const gh_weight *     w;
    const gh_kernel_set * ks;
    const void *          xq;  /* x in the weight's vec_dot_type */
} dot_src;

typedef struct {
    dot_src         gate, up;
    const float *   gate_g;
    const float *   gate_b, * up_b;
    const int32_t * ids;
    int64_t         n;
    int             act;
    float           act_t;
    bool            gated;
    bool            skip_up;   /* relu family: g <= cut gives a = 0 whatever u is */
    float           cut;
    float *         a, * gc, * uc;
    atomic_llong    up_rows;
} glu_job;

#ifndef GLU_PF_TILES
#define GLU_PF_TILES 2 /* dot4: prefetch the rows of the tile this many tiles ahead */
#endif
#define GLU_QCAP 32    /* list positions queued ahead (power of two > 4 * (GLU_PF_TILES + 1)) */

/* out[k] = W[ids[k]] . x for k in [k0, k1) where use == NULL or use[k] > cut, and
 * tm == NULL or tm[k] has a bit of bit (else out[k] = 0). Returns the number of rows read.
 *
 * With the type's gathered four-row tile (dot4): where every position is computed (no use,
 * no tm) the tiles are the positions four by four; otherwise the positions to compute are
 * queued ahead and each tile takes the next four. A short last tile repeats its last row;
 * while a tile runs it prefetches the rows of the tile GLU_PF_TILES ahead, a slice per
 * step (farther, in bytes, or only rows' first lines measured no better: docs/BENCHMARKS.md,
 * "The gathered rows per byte read"). Every value comes from the same kernel whatever its
 * neighbours, so it does not depend on where a thread's chunk starts. Without dot4: runs of consecutive ids go through the
 * type's multi-row tile, never crossing a multiple of GLU_GROUP list positions (threads
 * start their chunks at such multiples), each other row through vec_dot. */
static int64_t rows_dot(const dot_src * src, const int32_t * ids, const float * use, float cut,
                        const uint64_t * tm, uint64_t bit, int64_t k0, int64_t k1, float * out) {
#define ROW_IN(k) ((!use || use[k] > cut) && (!tm || (tm[k] & bit)))
    const gh_weight * w = src->w;
    const char * wd = w->data;
    int64_t n_read = 0;
    if (src->ks->dot4 && !use && !tm) {
        /* every position is computed (the gate rows; the up rows unless a ReLU-family g
         * skips them): the tiles are the positions four by four, the same tiles and
         * prefetches the queue below forms, without its bookkeeping (a tenth of the time
         * of an L2-resident call) */
        const size_t rb = w->row_bytes;
        for (int64_t k = k0; k < k1; k += 4) {
            const int nr = (int) GH_MIN(4, k1 - k);
            const void * rows[4];
            const void * pf[4];
            for (int r = 0; r < 4; r++) {
                rows[r] = wd + (size_t) ids[k + GH_MIN(r, nr - 1)] * rb;
                const int64_t j = k + 4 * GLU_PF_TILES + r;
                pf[r] = j < k1 ? wd + (size_t) ids[j] * rb : rows[r];
            }
            float y[4];
            src->ks->dot4(w->cols, rows, pf, src->xq, y);
            for (int r = 0; r < nr; r++) out[k + r] = y[r];
        }
        return k1 - k0;
    }
    if (src->ks->dot4) {
        int64_t q[GLU_QCAP];
        int64_t head = 0, tail = 0; /* queued positions q[head..tail) (mod GLU_QCAP) */
        int64_t scan = k0;
        const int64_t ahead = 4 * (GLU_PF_TILES + 1);
        for (;;) {
            while (tail - head < ahead && scan < k1) {
                if (!ROW_IN(scan)) out[scan] = 0.0f;
                else q[tail++ % GLU_QCAP] = scan;
                scan++;
            }
            if (head == tail) break;
            const int nr = (int) GH_MIN(4, tail - head);
            const void * rows[4];
            const void * pf[4];
            int64_t pos[4];
            for (int r = 0; r < 4; r++) {
                pos[r] = q[(head + GH_MIN(r, nr - 1)) % GLU_QCAP];
                rows[r] = wd + (size_t) ids[pos[r]] * w->row_bytes;
                const int64_t j = head + 4 * GLU_PF_TILES + r;
                pf[r] = j < tail ? wd + (size_t) ids[q[j % GLU_QCAP]] * w->row_bytes : rows[r];
            }
            float y[4];
            src->ks->dot4(w->cols, rows, pf, src->xq, y);
            for (int r = 0; r < nr; r++) out[pos[r]] = y[r];
            head += nr;
            n_read += nr;
        }
        return n_read;
    }
    const int mr = src->ks->mr1;
    for (int64_t k = k0; k < k1;) {
        if (!ROW_IN(k)) {
            out[k++] = 0.0f;
            continue;
        }
        const int64_t g_end = GH_MIN(k1, (k / GLU_GROUP + 1) * GLU_GROUP);
        int rn = 1;
        while (rn < mr && k + rn < g_end && ids[k + rn] == ids[k] + rn &&
               ROW_IN(k + rn)) {
            rn++;
        }
        const char * row = wd + (size_t) ids[k] * w->row_bytes;
        /* the rows are scattered: the hardware prefetcher cannot guess the next one, so
         * fetch the next listed row while this run computes */
        if (k + rn < k1) {
            const char * next = wd + (size_t) ids[k + rn] * w->row_bytes;
            for (size_t o = 0; o < w->row_bytes; o += 64) __builtin_prefetch(next + o, 0, 3);
        }
        if (rn == 1) src->ks->vec_dot(w->cols, out + k, row, src->xq);
        else src->ks->gemm(w->cols, row, w->row_bytes, rn, src->xq, 0, 1, out + k, 1);
        n_read += rn;
        k += rn;
    }
    return n_read;
}
#undef ROW_IN

static void glu_task(void * arg, int ith, int nth) {
    glu_job * job = arg;
    /* chunk bounds on multiples of GLU_GROUP (see rows_dot) */
    const int64_t g = GLU_GROUP;
    const int64_t k0 = GH_MIN(job->n, job->n * ith / nth / g * g);
    const int64_t k1 = ith == nth - 1 ? job->n : GH_MIN(job->n, job->n * (ith + 1) / nth / g * g);
    if (k0 >= k1) return;
    if (job->gate_g) {
        /* the oracle's dense gate, bias included */
        for (int64_t k = k0; k < k1; k++) job->gc[k] = job->gate_g[job->ids[k]];
    } else {
        rows_dot(&job->gate, job->ids, NULL, 0.0f, NULL, 0, k0, k1, job->gc);
        if (job->gate_b) for (int64_t k = k0; k < k1; k++) job->gc[k] += job->gate_b[job->ids[k]];
    }
    int64_t nu = 0;
    if (job->gated) {
        nu = rows_dot(&job->up, job->ids, job->skip_up ? job->gc : NULL, job->cut, NULL, 0, k0, k1,
                      job->uc);
        if (job->up_b) {
            for (int64_t k = k0; k < k1; k++) {
                if (!job->skip_up || job->gc[k] > job->cut) job->uc[k] += job->up_b[job->ids[k]];
            }
        }
    }
    gh_glu(job->act, job->act_t, job->gc + k0, job->gated ? job->uc + k0 : NULL, job->a + k0,
           k1 - k0);
    atomic_fetch_add_explicit(&job->up_rows, nu, memory_order_relaxed);
}

/* x converted to w's vec_dot_type in buf (or x itself when that type is f32). */
static dot_src make_src(const gh_weight * w, const float * x, void * buf) {
    dot_src s = { .w = w, .ks = gh_kernels_get(w->type), .xq = x };
    if (s.ks->from_float_x) {
        s.ks->from_float_x(x, buf, w->cols);
        s.xq = buf;
    }
    return s;
}

typedef struct {
    dot_src         src;
    const int32_t * ids;
    int64_t         n;
    float *         out;
} rows_job;

static void rows_task(void * arg, int ith, int nth) {
    rows_job * job = arg;
    const int64_t g = GLU_GROUP; /* chunk bounds as glu_task's */
    const int64_t k0 = GH_MIN(job->n, job->n * ith / nth / g * g);
    const int64_t k1 = ith == nth - 1 ? job->n : GH_MIN(job->n, job->n * (ith + 1) / nth / g * g);
    if (k0 < k1) rows_dot(&job->src, job->ids, NULL, 0.0f, NULL, 0, k0, k1, job->out);
}

/* out[k] = w[ids[k]] . x for k < n (xq: scratch for the converted x). */
void gh_list_rows_dot(gh_threadpool * tp, const gh_weight * w, const float * x,
                      const int32_t * ids, int64_t n, float * out, void * xq) {
    if (n <= 0) return;
    rows_job job = { .src = make_src(w, x, xq), .ids = ids, .n = n, .out = out };
    if (!tp || (double) n * (double) w->row_bytes < GH_SPARSE_INLINE_BYTES) rows_task(&job, 0, 1);
    else gh_threadpool_run(tp, rows_task, &job);
}

void gh_sparse_glu(gh_threadpool * tp, const gh_glu_spec * f, const float * x,
                   const float * gate_g, const int32_t * ids, int64_t n, float * a, float * gc,
                   float * uc, void * xq, int64_t * up_rows_read) {
    const int act = f->act;
    glu_job job = {
        .gate_g = gate_g, .gate_b = f->gate_b, .up_b = f->up_b, .ids = ids, .n = n,
        .act = act, .act_t = f->act_t, .gated = f->up != NULL,
        .skip_up = act == GH_ACT_RELU || act == GH_ACT_DRELU || act == GH_ACT_FATRELU,
        .cut = act == GH_ACT_FATRELU ? f->act_t : 0.0f, .a = a, .gc = gc, .uc = uc,
    };
    atomic_init(&job.up_rows, 0);
    char * buf = xq;
    const gh_weight * gate = f->gate, * up = f->up;
    if (!gate_g) job.gate = make_src(gate, x, buf);
    const size_t off = (gh_matmul_scratch_size(gate, 1) + 63) & ~(size_t) 63;
    if (!up) {
        /* ungated: nothing multiplies in */
    } else if (!gate_g && gate->type == up->type) {
        job.up = job.gate; /* same vec_dot_type: convert once */
        job.up.w = up;
    } else {
        job.up = make_src(up, x, buf + off);
    }
    if (n > 0) {
        const double bytes = (double) n * (double) (gate->row_bytes + (up ? up->row_bytes : 0));
        if (!tp || bytes < GH_SPARSE_INLINE_BYTES) glu_task(&job, 0, 1);
        else gh_threadpool_run(tp, glu_task, &job);
    }
    if (up_rows_read) *up_rows_read = atomic_load(&job.up_rows);
}


/* ------------------------------------------------- several tokens' lists at once -- */

#define UNION_BLOCK 64 /* union positions whose gate and up rows stay in cache while every
                        * token is dotted with them (64 rows of each: ~150 KB in F16 at
                        * 576 columns, within L2) */

typedef struct {
    dot_src         gate[GH_UNION_MAX], up[GH_UNION_MAX];
    int             n;
    const float *   gate_g;
    int64_t         ld_g;
    const float *   gate_b, * up_b;
    const int32_t * ids;
    const uint64_t * tm;
    int64_t         nu, ld;
    bool            gated, skip_up;
    float           cut;
    float *         gc, * uc;
    atomic_llong    up_rows;
} union_job;

static void union_task(void * arg, int ith, int nth) {
    union_job * job = arg;
    const int64_t g = GLU_GROUP; /* chunk bounds as glu_task's */
    const int64_t k0 = GH_MIN(job->nu, job->nu * ith / nth / g * g);
    const int64_t k1 = ith == nth - 1 ? job->nu : GH_MIN(job->nu, job->nu * (ith + 1) / nth / g * g);
    const int32_t * ids = job->ids;
    const uint64_t * tm = job->tm;
    int64_t nu = 0;
    for (int64_t b0 = k0; b0 < k1; b0 += UNION_BLOCK) {
        const int64_t b1 = GH_MIN(k1, b0 + UNION_BLOCK);
        for (int t = 0; t < job->n; t++) {
            const uint64_t bit = (uint64_t) 1 << t;
            float * gc = job->gc + (int64_t) t * job->ld, * uc = job->uc + (int64_t) t * job->ld;
            if (job->gate_g) {
                const float * gg = job->gate_g + (int64_t) t * job->ld_g;
                for (int64_t k = b0; k < b1; k++) gc[k] = (tm[k] & bit) ? gg[ids[k]] : 0.0f;
            } else {
                rows_dot(&job->gate[t], ids, NULL, 0.0f, tm, bit, b0, b1, gc);
                if (job->gate_b) {
                    for (int64_t k = b0; k < b1; k++) if (tm[k] & bit) gc[k] += job->gate_b[ids[k]];
                }
            }
            if (!job->gated) continue;
            /* a non-member's gc is 0, which no ReLU-family cut passes (cut >= 0) */
            nu += rows_dot(&job->up[t], ids, job->skip_up ? gc : NULL, job->cut, tm, bit, b0, b1, uc);
            if (job->up_b) {
                for (int64_t k = b0; k < b1; k++) {
                    if ((tm[k] & bit) && (!job->skip_up || gc[k] > job->cut)) uc[k] += job->up_b[ids[k]];
                }
            }
        }
    }
    atomic_fetch_add_explicit(&job->up_rows, nu, memory_order_relaxed);
}

void gh_union_glu_rows(gh_threadpool * tp, const gh_glu_spec * f, const float * x, int n,
                       const float * gate_g, int64_t ld_g, const int32_t * ids,
                       const uint64_t * tm, int64_t nu, float * gc, float * uc, int64_t ld,
                       void * xq, size_t xq_stride, int64_t * up_rows_read) {
    const int act = f->act;
    union_job jb, * job = &jb; /* ~3 KB of sources on the caller's stack */
    *job = (union_job) {
        .n = n, .gate_g = gate_g, .ld_g = ld_g, .gate_b = f->gate_b, .up_b = f->up_b,
        .ids = ids, .tm = tm, .nu = nu, .ld = ld, .gated = f->up != NULL,
        .skip_up = act == GH_ACT_RELU || act == GH_ACT_DRELU || act == GH_ACT_FATRELU,
        .cut = act == GH_ACT_FATRELU ? f->act_t : 0.0f, .gc = gc, .uc = uc,
    };
    atomic_init(&job->up_rows, 0);
    const gh_weight * gate = f->gate, * up = f->up;
    const size_t off = (gh_matmul_scratch_size(gate, 1) + 63) & ~(size_t) 63;
    for (int t = 0; t < n; t++) {
        char * buf = (char *) xq + (size_t) t * xq_stride;
        const float * xt = x + (int64_t) t * gate->cols;
        if (!gate_g) job->gate[t] = make_src(gate, xt, buf);
        if (!up) continue;
        if (!gate_g && gate->type == up->type) {
            job->up[t] = job->gate[t]; /* same vec_dot_type: convert once */
            job->up[t].w = up;
        } else {
            job->up[t] = make_src(up, xt, buf + off);
        }
    }
    if (nu > 0) {
        const double bytes = (double) nu * (double) (gate->row_bytes + (up ? up->row_bytes : 0));
        if (!tp || bytes < GH_SPARSE_INLINE_BYTES) union_task(job, 0, 1);
        else gh_threadpool_run(tp, union_task, job);
    }
    if (up_rows_read) *up_rows_read = atomic_load(&job->up_rows);
}
