/* The sparse feed-forward: predictor, gate/up row-dots over the active list, and the
 * per-token FFN of the sparse and oracle modes with its statistics (see sparse.h).
 * The down projection over the list (gh_matmul_t_list) lives with the other axpy code
 * in axpy.c.
 *
 * Work split: the row-dots split the ACTIVE LIST in contiguous chunks of equal length
 * (every active neuron costs the same two row reads, while the active neurons are not
 * spread evenly over the rows); the down projection splits the output columns. Each
 * output value is computed by exactly one thread in a fixed order, so results do not
 * depend on the thread count and nothing needs reducing. */
#include "ffn/sparse.h"
#include "ffn/input_ffn.h"
#include "model/model.h"
#include "backend/hybrid.h"
#include "cpu/kernels.h"
#include "types/types.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Below this many bytes of rows a call runs on the calling thread alone: waking the
 * pool costs more than the work. */
#define GH_SPARSE_INLINE_BYTES (24 * 1024)

double gh_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

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

/* out[k] = W[ids[k]] . x for k in [k0, k1) where use == NULL or use[k] > cut (else
 * out[k] = 0). Returns the number of rows read.
 *
 * With the type's gathered four-row tile (dot4): the positions to compute are queued
 * ahead; each tile takes the next four (a short last tile repeats its last row) and, while
 * it runs, prefetches the rows of the tile GLU_PF_TILES ahead, a slice per step. Every
 * value comes from the same kernel whatever its neighbours, so it does not depend on
 * where a thread's chunk starts. Without dot4: runs of consecutive ids go through the
 * type's multi-row tile, never crossing a multiple of GLU_GROUP list positions (threads
 * start their chunks at such multiples), each other row through vec_dot. */
static int64_t rows_dot(const dot_src * src, const int32_t * ids, const float * use, float cut,
                        int64_t k0, int64_t k1, float * out) {
    const gh_weight * w = src->w;
    const char * wd = w->data;
    int64_t n_read = 0;
    if (src->ks->dot4) {
        int64_t q[GLU_QCAP];
        int64_t head = 0, tail = 0; /* queued positions q[head..tail) (mod GLU_QCAP) */
        int64_t scan = k0;
        const int64_t ahead = 4 * (GLU_PF_TILES + 1);
        for (;;) {
            while (tail - head < ahead && scan < k1) {
                if (use && !(use[scan] > cut)) out[scan] = 0.0f;
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
        if (use && !(use[k] > cut)) {
            out[k++] = 0.0f;
            continue;
        }
        const int64_t g_end = GH_MIN(k1, (k / GLU_GROUP + 1) * GLU_GROUP);
        int rn = 1;
        while (rn < mr && k + rn < g_end && ids[k + rn] == ids[k] + rn &&
               (!use || use[k + rn] > cut)) {
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
        rows_dot(&job->gate, job->ids, NULL, 0.0f, k0, k1, job->gc);
        if (job->gate_b) for (int64_t k = k0; k < k1; k++) job->gc[k] += job->gate_b[job->ids[k]];
    }
    int64_t nu = 0;
    if (job->gated) {
        nu = rows_dot(&job->up, job->ids, job->skip_up ? job->gc : NULL, job->cut, k0, k1, job->uc);
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
    if (k0 < k1) rows_dot(&job->src, job->ids, NULL, 0.0f, k0, k1, job->out);
}

/* out[k] = w[ids[k]] . x for k < n (xq: scratch for the converted x). */
static void list_rows_dot(gh_threadpool * tp, const gh_weight * w, const float * x,
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

/* ------------------------------------------------------ per-context state -- */

struct gh_sparse_state {
    int32_t   mode;        /* gh_ffn_mode */
    int32_t   batch_max;   /* batches of up to this many tokens run sparse */
    /* buffers for one token, sized for the largest layer */
    float *   ph;          /* predictor hidden [max h] */
    float *   score;       /* predictor output [n_ff] */
    float *   g_dense;     /* oracle: dense gate [n_ff] */
    float *   a, * gc, * uc;  /* compact activation, gate, up [n_ff] */
    int32_t * ids;         /* active list [n_ff] */
    float *   gu;          /* input-sparse FFN: gate then up outputs [2 n_ff] */
    int32_t * down_ids;    /* the list's neurons with a nonzero activation [n_ff] */
    float *   down_a;      /* and their activations [n_ff] */
    void *    scratch;     /* converted activations */
    /* hybrid: the split of the active list and the device's partial output */
    int32_t * hot_rows;    /* compacted device rows of the hot active neurons [n_ff] */
    int32_t * cold;        /* the CPU's active neurons [n_ff] */
    float *   y_dev;       /* [n_embd] */
    /* statistics since the last reset */
    double    t[GH_STAGE_COUNT];
    double    bytes[GH_STAGE_COUNT];  /* OTHER = the output head */
    double    t_total;
    int64_t   n_tokens, n_sparse_tokens, n_active, n_up_rows, n_down_rows;
    int64_t * layer_active;  /* [n_layer] active neurons summed over sparse tokens */
    int64_t   n_active_device;
    int64_t   n_attn_in, n_attn_used, n_head_in, n_head_used; /* input-sparse projections */
    double    bytes_device, bytes_up, bytes_down, t_device, t_cpu_ffn, t_wait;
};

void gh_sparse_state_free(gh_sparse_state * s) {
    if (!s) return;
    gh_aligned_free(s->ph);
    gh_aligned_free(s->score);
    gh_aligned_free(s->g_dense);
    gh_aligned_free(s->a);
    gh_aligned_free(s->gc);
    gh_aligned_free(s->uc);
    gh_aligned_free(s->ids);
    gh_aligned_free(s->down_ids);
    gh_aligned_free(s->gu);
    gh_aligned_free(s->down_a);
    gh_aligned_free(s->scratch);
    gh_aligned_free(s->hot_rows);
    gh_aligned_free(s->cold);
    gh_aligned_free(s->y_dev);
    free(s->layer_active);
    free(s);
}

static bool all_layers(const gh_model * m, bool pred) {
    for (int il = 0; il < m->hp.n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        if (!L->has_down_t || (pred && !L->has_pred)) return false;
    }
    return true;
}

gh_sparse_state * gh_sparse_state_new(const gh_model * m) {
    gh_sparse_state * s = calloc(1, sizeof *s);
    if (!s) { gh_fail(GH_ERR_OOM, "out of memory"); return NULL; }
    const int64_t ff = m->hp.n_ff;
    int64_t h = 1;
    size_t scratch = 64;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        scratch = GH_MAX(scratch, gh_sparse_glu_scratch_size(&L->gate, m->hp.gated ? &L->up : NULL));
        scratch = GH_MAX(scratch, gh_matmul_scratch_size(&L->gate, 1));
        if (L->has_pred) {
            h = GH_MAX(h, L->fc1.rows);
            scratch = GH_MAX(scratch, gh_sparse_predict_scratch_size(&L->fc1, &L->fc2));
        }
    }
    s->mode = all_layers(m, true) ? GH_FFN_SPARSE
            : all_layers(m, false) && m->info.has_gate_threshold ? GH_FFN_GATE : GH_FFN_DENSE;
    s->batch_max = GH_SPARSE_BATCH_MAX_DEFAULT;
    const size_t fb = (size_t) ff * sizeof(float);
    s->ph = gh_aligned_alloc((size_t) h * sizeof(float));
    s->score = gh_aligned_alloc(fb);
    s->g_dense = gh_aligned_alloc(fb);
    s->a = gh_aligned_alloc(fb);
    s->gc = gh_aligned_alloc(fb);
    s->uc = gh_aligned_alloc(fb);
    s->ids = gh_aligned_alloc((size_t) ff * sizeof(int32_t));
    s->down_ids = gh_aligned_alloc((size_t) ff * sizeof(int32_t));
    s->gu = gh_aligned_alloc(2 * fb);
    s->down_a = gh_aligned_alloc(fb);
    s->scratch = gh_aligned_alloc(scratch);
    s->layer_active = calloc((size_t) m->hp.n_layer, sizeof(int64_t));
    s->hot_rows = gh_aligned_alloc((size_t) ff * sizeof(int32_t));
    s->cold = gh_aligned_alloc((size_t) ff * sizeof(int32_t));
    s->y_dev = gh_aligned_alloc((size_t) m->hp.n_embd * sizeof(float));
    if (!s->ph || !s->score || !s->g_dense || !s->a || !s->gc || !s->uc || !s->ids ||
        !s->down_ids || !s->down_a || !s->gu ||
        !s->scratch || !s->layer_active || !s->hot_rows || !s->cold || !s->y_dev) {
        gh_sparse_state_free(s);
        gh_fail(GH_ERR_OOM, "out of memory for the sparse FFN buffers");
        return NULL;
    }
    return s;
}

bool gh_sparse_applies(const gh_context * c, int32_t n) {
    const gh_sparse_state * s = c->sparse;
    /* the FFN's recording (its input, the true mask) is of the dense FFN; the projections'
     * inputs are recorded on either path, so that one profile pass in the sparse modes gives
     * each input-sparse site the inputs it sees there (input_eval.refit) */
    return s && s->mode != GH_FFN_DENSE && n <= s->batch_max && !c->prof_x && !c->prof_mask;
}

bool gh_input_sparse_applies(const gh_context * c, int32_t n) {
    /* oracle is the dense result by definition: its inputs stay whole */
    return c->input_sparse && gh_sparse_applies(c, n) && c->sparse->mode != GH_FFN_ORACLE;
}

/* The predictor on the device: score comes back, the threshold is applied here. */
static int64_t predict_device(gh_context * c, const gh_dlayer * D, const float * x, float thr) {
    gh_sparse_state * s = c->sparse;
    const gh_backend_ops * ops = c->model->hy->b->ops;
    gh_status st = ops->predict(c->stream, &D->fc1, &D->fc2, x, s->score);
    const double tw = gh_now();
    double dev = 0.0;
    if (!st) st = ops->sync(c->stream, &dev);
    gh_stats_device(c, dev, gh_now() - tw, (double) D->fc1.cols * 4, (double) D->fc2.rows * 4,
                    (double) (D->fc1.rows * D->fc1.row_bytes + D->fc2.rows * D->fc2.row_bytes));
    if (st) {
        c->dev_status = st;
        return 0;
    }
    int64_t n = 0;
    for (int64_t i = 0; i < D->fc2.rows; i++) {
        if (s->score[i] >= thr) s->ids[n++] = (int32_t) i;
    }
    return n;
}

/* gate/up and down over the neurons ids[0..n) on the CPU (y overwritten); returns the
 * weight bytes read and counts the rows. */
static double cpu_part(gh_context * c, const gh_layer * L, const float * x, const float * gate_g,
                       const int32_t * ids, int64_t n, float * y) {
    gh_sparse_state * s = c->sparse;
    int64_t n_up = 0;
    const gh_hparams * hp = &c->model->hp;
    const gh_glu_spec f = { .act = hp->ffn_act, .act_t = hp->act_threshold, .gate = &L->gate,
                            .up = hp->gated ? &L->up : NULL, .gate_b = L->gate_b, .up_b = L->up_b };
    gh_sparse_glu(c->tp, &f, x, gate_g, ids, n, s->a, s->gc, s->uc, s->scratch, &n_up);
    /* the down rows of the neurons that came out nonzero, compacted (branch-free: ~30%
     * of a low-threshold list is zero), so that the axpy neither visits nor prefetches
     * the rows it skips */
    int64_t n_down = 0;
    /* input sparsity of the down projection (the gate mode, input-sparse): |a| > thr */
    const float * td = c->input_sparse && s->mode == GH_FFN_GATE && L->down_in_on ? L->thr_down_in : NULL;
    if (td) {
        for (int64_t k = 0; k < n; k++) {
            s->down_ids[n_down] = ids[k];
            s->down_a[n_down] = s->a[k];
            n_down += fabsf(s->a[k]) > td[ids[k]];
        }
    } else {
        for (int64_t k = 0; k < n; k++) {
            s->down_ids[n_down] = ids[k];
            s->down_a[n_down] = s->a[k];
            n_down += s->a[k] != 0.0f;
        }
    }
    gh_matmul_t_list(c->tp, &L->down_t, s->down_ids, s->down_a, n_down, y);
    s->n_up_rows += n_up;
    s->n_down_rows += n_down;
    return (double) n_up * (double) L->up.row_bytes + (double) n_down * (double) L->down_t.row_bytes;
}

/* The gate mode on a layer with hot neurons: each side computes the gate of its own
 * neurons and thresholds it, the device then up/down of its active ones while the CPU does
 * the same for its cold ones, and the device's part is added to y (overwritten). Returns the
 * active neurons, *n_dev of them on the device; adds the weight bytes read to *bytes. */
static int64_t gate_split(gh_context * c, const gh_layer * L, const gh_dlayer * D,
                          const float * x, float * y, int64_t * n_dev, double * bytes) {
    gh_sparse_state * s = c->sparse;
    const gh_backend_ops * ops = c->model->hy->b->ops;
    const int64_t nh = D->hot.n_hot;
    for (int64_t k = 0; k < nh; k++) s->hot_rows[k] = (int32_t) k;
    int64_t nz = 0;
    gh_status st = ops->hot_ffn(c->stream, &D->hot_gate, x, s->hot_rows, nh, s->y_dev, &nz);
    const double tc = gh_now();
    list_rows_dot(c->tp, &L->gate, x, D->cold, D->n_cold, s->gc, s->scratch);
    /* the CPU-only path's test on the cold gates (bias included), and g by neuron id for
     * cpu_part */
    const float cut = L->gate_cut, lo = L->gate_lo, hi = L->gate_hi;
    int64_t n = 0;
    for (int64_t k = 0; k < D->n_cold; k++) {
        const int32_t i = D->cold[k];
        const float g = s->gc[k] + (L->gate_b ? L->gate_b[i] : 0.0f);
        s->g_dense[i] = g;
        s->cold[n] = i;
        n += (g > cut) | ((g > lo) & (g < hi));
    }
    *bytes += (double) D->n_cold * (double) L->gate.row_bytes +
              cpu_part(c, L, x, s->g_dense, s->cold, n, y);
    const double tw = gh_now();
    s->t_cpu_ffn += tw - tc;
    double dev = 0.0;
    if (!st) st = ops->sync(c->stream, &dev);
    if (st) nz = 0;
    const double rows_b = (double) nh * (double) D->hot.gate.row_bytes +
                          (double) nz * (double) (D->hot.up.row_bytes + D->hot.down_t.row_bytes);
    gh_stats_device(c, dev, gh_now() - tw, (double) (L->gate.cols * 4 + nh * 4),
                    (double) L->down_t.cols * 4 + 8, rows_b);
    *bytes += rows_b;
    if (st) c->dev_status = st;
    else for (int64_t j = 0; j < L->down_t.cols; j++) y[j] += s->y_dev[j];
    *n_dev = nz;
    return n + nz;
}

/* The gate mode's FFN with input sparsity on its inputs (input_ffn.h): gate and up through
 * gate_up_t, the down rows by |h|; counts the down rows as the layer's active neurons. */
static void input_sparse_ffn(gh_context * c, int il, const gh_layer * L, const float * x, float * y) {
    gh_sparse_state * s = c->sparse;
    const gh_hparams * hp = &c->model->hp;
    const double t0 = gh_now();
    const gh_ffn_in_spec f = { .gate_up_t = &L->gate_up_t, .down_t = &L->down_t,
                               .thr_in = L->ffn_in_on ? L->thr_ffn_in : NULL,
                               .thr_down = L->down_in_on ? L->thr_down_in : NULL,
                               .gate_b = L->gate_b, .up_b = L->up_b, .act = hp->ffn_act,
                               .act_t = hp->act_threshold, .gated = hp->gated };
    const gh_ffn_in_scratch w = { .in_ids = c->in_ids, .in_a = c->in_a, .gu = s->gu, .a = s->a,
                                  .down_ids = s->down_ids, .down_a = s->down_a };
    int64_t n_in = 0, n_down = 0;
    const double bytes = gh_ffn_input_sparse(c->tp, &f, x, y, &w, &n_in, &n_down);
    if (L->down_b) for (int64_t j = 0; j < L->down_t.cols; j++) y[j] += L->down_b[j];
    gh_stats_add(c, GH_STAGE_FFN, gh_now() - t0, bytes);
    s->n_down_rows += n_down;
    s->n_active += n_down;
    s->layer_active[il] += n_down;
    if (il == 0) s->n_sparse_tokens++;
}

void gh_sparse_ffn(gh_context * c, int il, const float * x, const float * resid, float * y) {
    const gh_model * m = c->model;
    const gh_layer * L = &m->layers[il];
    const gh_dlayer * D = m->hy ? &m->hy->layers[il] : NULL;
    gh_sparse_state * s = c->sparse;
    /* gate and up input-sparse (a layer whose FFN input thresholds are all 0 keeps the gate
     * mode's row path, so a file at level 0 computes what the gate mode does) */
    if (s->mode == GH_FFN_GATE && c->input_sparse && L->ffn_in_on && !(D && D->hot.n_hot > 0)) {
        input_sparse_ffn(c, il, L, x, y);
        return;
    }
    const int64_t ff = m->hp.n_ff;
    const int act = m->hp.ffn_act;
    const double t0 = gh_now();
    int64_t n = 0;
    const float * gate_g = NULL;
    double ffn_bytes = 0.0;
    double t1 = t0;
    const bool split_gate = s->mode == GH_FFN_GATE && D && D->hot.n_hot > 0;
    if (split_gate) {
        /* each side computes its own neurons' gate (gate_split) */
    } else if (s->mode == GH_FFN_SPARSE) {
        const float * px = m->hp.pred_residual ? resid : x;
        if (D && D->pred) {
            n = predict_device(c, D, px, m->info.sparse_threshold);
        } else {
            n = gh_sparse_predict(c->tp, &L->fc1, &L->fc2, px, m->info.sparse_threshold, s->ph,
                                  s->score, s->ids, s->scratch);
        }
        t1 = gh_now();
        gh_stats_add(c, GH_STAGE_PREDICTOR, t1 - t0,
                     (double) (L->fc1.rows * L->fc1.row_bytes + L->fc2.rows * L->fc2.row_bytes));
        ffn_bytes += (double) n * (double) L->gate.row_bytes;
    } else {
        /* oracle: the exact active set from the dense gate (relu family: g > 0; other
         * activations are not sparse, so every neuron); gate: the calibrated threshold */
        gh_matmul(c->tp, &L->gate, x, 1, s->g_dense, ff, s->scratch);
        if (L->gate_b) for (int64_t i = 0; i < ff; i++) s->g_dense[i] += L->gate_b[i];
        const float * g = s->g_dense;
        if (s->mode == GH_FFN_GATE) {
            /* |act(g)| > t as cut points on g (branch-free: the list is a prefix sum) */
            const float cut = L->gate_cut, lo = L->gate_lo, hi = L->gate_hi;
            for (int64_t i = 0; i < ff; i++) {
                s->ids[n] = (int32_t) i;
                n += (g[i] > cut) | ((g[i] > lo) & (g[i] < hi));
            }
        } else {
            const bool relu = act == GH_ACT_RELU || act == GH_ACT_DRELU || act == GH_ACT_FATRELU;
            const float cut = act == GH_ACT_FATRELU ? m->hp.act_threshold : 0.0f;
            for (int64_t i = 0; i < ff; i++) {
                if (!relu || g[i] > cut) s->ids[n++] = (int32_t) i;
            }
        }
        gate_g = s->g_dense;
        ffn_bytes += (double) ff * (double) L->gate.row_bytes;
    }
    int64_t n_hot = 0;
    if (split_gate) {
        n = gate_split(c, L, D, x, y, &n_hot, &ffn_bytes);
    } else if (D && D->hot.n_hot > 0) {
        /* neuron split: hot rows on the device while the CPU does the cold ones */
        int64_t n_cold = 0;
        for (int64_t k = 0; k < n; k++) {
            const int32_t r = D->row_of[s->ids[k]];
            if (r >= 0) s->hot_rows[n_hot++] = r;
            else s->cold[n_cold++] = s->ids[k];
        }
        const gh_backend_ops * ops = m->hy->b->ops;
        gh_status st = GH_OK;
        if (n_hot) st = ops->hot_ffn(c->stream, &D->hot, x, s->hot_rows, n_hot, s->y_dev, NULL);
        const double tc = gh_now();
        ffn_bytes += cpu_part(c, L, x, gate_g, s->cold, n_cold, y);
        const double tw = gh_now();
        s->t_cpu_ffn += tw - tc;
        if (n_hot) {
            double dev = 0.0;
            if (!st) st = ops->sync(c->stream, &dev);
            const double rows_b = (double) n_hot * (double) (D->hot.gate.row_bytes +
                                  D->hot.up.row_bytes + D->hot.down_t.row_bytes);
            gh_stats_device(c, dev, gh_now() - tw, (double) (L->gate.cols * 4 + n_hot * 4),
                            (double) L->down_t.cols * 4, rows_b);
            ffn_bytes += rows_b;
            if (st) {
                c->dev_status = st;
            } else {
                for (int64_t j = 0; j < L->down_t.cols; j++) y[j] += s->y_dev[j];
            }
        }
    } else {
        ffn_bytes += cpu_part(c, L, x, gate_g, s->ids, n, y);
    }
    if (L->down_b) for (int64_t j = 0; j < L->down_t.cols; j++) y[j] += L->down_b[j];
    gh_stats_add(c, GH_STAGE_FFN, gh_now() - t1, ffn_bytes);
    s->n_active += n;
    s->n_active_device += n_hot;
    s->layer_active[il] += n;
    if (il == 0) s->n_sparse_tokens++;
}

/* ---------------------------------------------------------------- statistics -- */

void gh_stats_add(gh_context * c, gh_stage stage, double seconds, double bytes) {
    gh_sparse_state * s = c->sparse;
    if (!s) return;
    s->t[stage] += seconds;
    s->bytes[stage] += bytes;
}

void gh_stats_device(gh_context * c, double device_s, double wait_s, double up_bytes,
                     double down_bytes, double weight_bytes) {
    gh_sparse_state * s = c->sparse;
    if (!s) return;
    s->t_device += device_s;
    s->t_wait += wait_s;
    s->bytes_up += up_bytes;
    s->bytes_down += down_bytes;
    s->bytes_device += weight_bytes;
}

void gh_stats_dense_ffn(gh_context * c, int il, int32_t n, const float * h) {
    if (!c->sparse) return;
    const gh_layer * L = &c->model->layers[il];
    const int64_t ff = c->model->hp.n_ff;
    double bytes = (double) (L->gate.rows * L->gate.row_bytes + L->up.rows * L->up.row_bytes);
    if (L->has_down_t) {
        int64_t rows = 0; /* gh_matmul_t reads the rows some token needs */
        for (int64_t r = 0; r < ff; r++) {
            int32_t t = 0;
            while (t < n && h[(int64_t) t * ff + r] == 0.0f) t++;
            rows += t < n;
        }
        bytes += (double) rows * (double) L->down_t.row_bytes;
    } else {
        bytes += (double) (L->down.rows * L->down.row_bytes);
    }
    c->sparse->bytes[GH_STAGE_FFN] += bytes;
}

void gh_stats_tokens(gh_context * c, int32_t n, double seconds) {
    gh_sparse_state * s = c->sparse;
    if (!s) return;
    s->n_tokens += n;
    s->t_total += seconds;
}

void gh_stats_inputs(gh_context * c, bool head, int64_t n_in, int64_t n_used) {
    gh_sparse_state * s = c->sparse;
    if (!s) return;
    if (head) {
        s->n_head_in += n_in;
        s->n_head_used += n_used;
    } else {
        s->n_attn_in += n_in;
        s->n_attn_used += n_used;
    }
}

/* ---------------------------------------------------------------- public API -- */

static gh_status set_ffn_mode(gh_context * c, int32_t mode) {
    if (mode != GH_FFN_DENSE && mode != GH_FFN_SPARSE && mode != GH_FFN_ORACLE &&
        mode != GH_FFN_GATE) {
        return gh_fail(GH_ERR_INVALID_ARG, "unknown FFN mode %d (0 dense, 1 sparse, 2 oracle, "
                       "3 gate)", mode);
    }
    static const char * const names[] = { "dense", "sparse", "oracle", "gate" };
    const gh_model * m = c->model;
    if (mode != GH_FFN_DENSE && m->hp.n_expert) {
        return gh_fail(GH_ERR_UNSUPPORTED, "the %s FFN mode is not available for mixture-of-experts "
                       "models yet (%d experts per layer): their experts run dense", names[mode],
                       m->hp.n_expert);
    }
    if (mode == GH_FFN_GATE && !m->info.has_gate_threshold) {
        return gh_fail(GH_ERR_UNSUPPORTED,
                       "the gate FFN needs calibrated gate thresholds "
                       "(powerinfer.sparse.gate_threshold), but the file has none: convert "
                       "the model with --sparsity S");
    }
    for (int il = 0; mode != GH_FFN_DENSE && il < m->hp.n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        if (!L->has_down_t) {
            return gh_fail(GH_ERR_UNSUPPORTED,
                           "the %s FFN needs the transposed down projection, but layer %d has none "
                           "(blk.%d.ffn_down_t.weight): convert the model with --sparse",
                           names[mode], il, il);
        }
        if (mode == GH_FFN_SPARSE && !L->has_pred) {
            return gh_fail(GH_ERR_UNSUPPORTED,
                           "the sparse FFN needs a predictor in every layer, but layer %d has none "
                           "(blk.%d.fc1.weight, blk.%d.fc2.weight): convert the model with --sparse",
                           il, il, il);
        }
    }
    c->sparse->mode = mode;
    return GH_OK;
}

gh_status gh_context_set_ffn_mode(gh_context * c, int32_t mode) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_set_ffn_mode");
    if (st) return st;
    st = set_ffn_mode(c, mode);
    gh_ctx_leave(c);
    return st;
}

int32_t gh_context_get_ffn_mode(const gh_context * c) {
    return c && c->sparse ? c->sparse->mode : GH_FFN_DENSE;
}

gh_status gh_context_set_sparse_batch(gh_context * c, int32_t n_max) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    if (n_max < 0) return gh_fail(GH_ERR_INVALID_ARG, "sparse batch limit must be >= 0, got %d", n_max);
    gh_status st = gh_ctx_enter(c, "gh_context_set_sparse_batch");
    if (st) return st;
    c->sparse->batch_max = n_max;
    gh_ctx_leave(c);
    return GH_OK;
}

int32_t gh_context_get_sparse_batch(const gh_context * c) {
    return c && c->sparse ? c->sparse->batch_max : 0;
}

gh_status gh_context_set_input_sparse(gh_context * c, int32_t on) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    if (on != 0 && on != 1) return gh_fail(GH_ERR_INVALID_ARG, "input sparsity is 0 (off) or 1 (on), got %d", on);
    if (on && !c->model->info.has_input_sparsity) {
        return gh_fail(GH_ERR_UNSUPPORTED,
                       "input-sparse projections need the transposed attention and head weights "
                       "and their calibrated input thresholds (blk.N.attn_qkv_t.weight, "
                       "blk.N.attn_qkv_in_thr, ...), but the file has none: convert the model "
                       "with --input-sparsity S");
    }
    gh_status st = gh_ctx_enter(c, "gh_context_set_input_sparse");
    if (st) return st;
    c->input_sparse = on != 0;
    gh_ctx_leave(c);
    return GH_OK;
}

int32_t gh_context_get_input_sparse(const gh_context * c) {
    return c && c->input_sparse ? 1 : 0;
}

gh_status gh_context_reset_stats(gh_context * c) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_reset_stats");
    if (st) return st;
    gh_sparse_state * s = c->sparse;
    memset(s->t, 0, sizeof s->t);
    memset(s->bytes, 0, sizeof s->bytes);
    s->t_total = 0.0;
    s->n_tokens = s->n_sparse_tokens = s->n_active = s->n_up_rows = s->n_down_rows = 0;
    s->n_active_device = 0;
    s->n_attn_in = s->n_attn_used = s->n_head_in = s->n_head_used = 0;
    s->bytes_device = s->bytes_up = s->bytes_down = s->t_device = s->t_cpu_ffn = s->t_wait = 0.0;
    memset(s->layer_active, 0, (size_t) c->model->hp.n_layer * sizeof(int64_t));
    gh_moe_reset_stats(c->moe);
    gh_ctx_leave(c);
    return GH_OK;
}

gh_status gh_context_get_stats(const gh_context * c, gh_context_stats * out,
                               double * layer_density, int32_t n_layer) {
    if (!c || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_get_stats: NULL argument");
    const gh_sparse_state * s = c->sparse;
    const gh_model_info * hp = &c->model->info;
    if (layer_density && n_layer < hp->n_layer) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_context_get_stats: layer_density holds %d values, "
                       "the model has %d layers", n_layer, hp->n_layer);
    }
    memset(out, 0, sizeof *out);
    out->n_layer = hp->n_layer;
    out->ffn_mode = s->mode;
    out->n_tokens = s->n_tokens;
    out->n_sparse_tokens = s->n_sparse_tokens;
    out->n_active = s->n_active;
    out->n_up_rows = s->n_up_rows;
    out->n_down_rows = s->n_down_rows;
    const double denom = (double) s->n_sparse_tokens * hp->n_layer * hp->n_ff;
    out->density = denom > 0 ? (double) s->n_active / denom : 0.0;
    out->bytes_attention = s->bytes[GH_STAGE_ATTENTION];
    out->bytes_predictor = s->bytes[GH_STAGE_PREDICTOR];
    out->bytes_ffn = s->bytes[GH_STAGE_FFN];
    out->bytes_head = s->bytes[GH_STAGE_OTHER];
    const double total = out->bytes_attention + out->bytes_predictor + out->bytes_ffn +
                         out->bytes_head;
    out->bytes_per_token = s->n_tokens > 0 ? total / (double) s->n_tokens : 0.0;
    out->t_attention = s->t[GH_STAGE_ATTENTION];
    out->t_predictor = s->t[GH_STAGE_PREDICTOR];
    out->t_ffn = s->t[GH_STAGE_FFN];
    out->t_total = s->t_total;
    out->t_other = GH_MAX(0.0, s->t_total - out->t_attention - out->t_predictor - out->t_ffn);
    out->n_active_device = s->n_active_device;
    out->n_active_cpu = s->n_active - s->n_active_device;
    out->bytes_device = s->bytes_device;
    out->bytes_uploaded = s->bytes_up;
    out->bytes_downloaded = s->bytes_down;
    out->t_device = s->t_device;
    out->t_cpu_ffn = s->t_cpu_ffn;
    out->t_wait = s->t_wait;
    gh_moe_get_stats(c->moe, &out->n_expert_runs_device, &out->n_expert_runs_cpu,
                     &out->n_cache_hits, &out->n_cache_misses, &out->bytes_cache_uploaded);
    out->n_attn_inputs = s->n_attn_in;
    out->n_attn_inputs_used = s->n_attn_used;
    out->n_head_inputs = s->n_head_in;
    out->n_head_inputs_used = s->n_head_used;
    out->attn_input_density = s->n_attn_in ? (double) s->n_attn_used / (double) s->n_attn_in : 0.0;
    out->head_input_density = s->n_head_in ? (double) s->n_head_used / (double) s->n_head_in : 0.0;
    if (layer_density) {
        for (int il = 0; il < hp->n_layer; il++) {
            layer_density[il] = s->n_sparse_tokens > 0
                ? (double) s->layer_active[il] / ((double) s->n_sparse_tokens * hp->n_ff) : 0.0;
        }
    }
    return GH_OK;
}

/* ------------------------------------------------- ops on raw buffers (tests) -- */

static gh_status check_matrix(const char * fn, const char * what, int type, const void * w,
                              int64_t rows, int64_t cols) {
    if (!gh_type_valid(type)) return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown type %d for %s", fn, type, what);
    if (!w) return gh_fail(GH_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
    if (rows <= 0 || cols <= 0 || rows > INT32_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %s has %lld x %lld elements", fn, what,
                       (long long) rows, (long long) cols);
    }
    if (cols % gh_type_block_size(type)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %s's row length %lld is not a multiple of %s's "
                       "block size %lld", fn, what, (long long) cols, gh_type_name(type),
                       (long long) gh_type_block_size(type));
    }
    uint64_t bytes;
    if (!gh_mul_ok((uint64_t) rows, gh_row_size(type, cols), &bytes) || bytes > (uint64_t) PTRDIFF_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %s's size overflows", fn, what);
    }
    return GH_OK;
}

static gh_status check_ids(const char * fn, const int32_t * ids, int64_t n, int64_t rows) {
    if (n < 0) return gh_fail(GH_ERR_INVALID_ARG, "%s: negative list length %lld", fn, (long long) n);
    if (n > 0 && !ids) return gh_fail(GH_ERR_INVALID_ARG, "%s: ids is NULL", fn);
    for (int64_t k = 0; k < n; k++) {
        if (ids[k] < 0 || ids[k] >= rows) {
            return gh_fail(GH_ERR_RANGE, "%s: ids[%lld] = %d is outside [0, %lld)", fn,
                           (long long) k, ids[k], (long long) rows);
        }
    }
    return GH_OK;
}

/* *tp: NULL for one thread; *cached: whether it is the kept pool (op_pool_release). */
static gh_status op_pool(const char * fn, int n_threads, gh_threadpool ** tp, bool * cached) {
    if (n_threads < 1 || n_threads > 512) {
        *tp = NULL;
        *cached = false;
        return gh_fail(GH_ERR_INVALID_ARG, "%s: n_threads %d out of range [1, 512]", fn, n_threads);
    }
    return (gh_status) gh_op_pool_acquire(n_threads, tp, cached);
}

static void op_pool_release(gh_threadpool * tp, bool cached) { gh_op_pool_release(tp, cached); }

static gh_weight make_weight(int type, const void * w, int64_t rows, int64_t cols) {
    gh_weight wt = { .type = type, .rows = rows, .cols = cols, .data = w,
                     .row_bytes = gh_row_size(type, cols) };
    return wt;
}

gh_status gh_op_sparse_predict(int fc1_type, const void * fc1, int fc2_type, const void * fc2,
                               int64_t n_embd, int64_t h, int64_t n_ff, const float * x,
                               float threshold, int32_t * active, int64_t * n_active,
                               float * score, int n_threads) {
    static const char fn[] = "gh_op_sparse_predict";
    gh_status st;
    if ((st = check_matrix(fn, "fc1", fc1_type, fc1, h, n_embd))) return st;
    if ((st = check_matrix(fn, "fc2", fc2_type, fc2, n_ff, h))) return st;
    if (!x || !active || !n_active) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    gh_weight w1 = make_weight(fc1_type, fc1, h, n_embd), w2 = make_weight(fc2_type, fc2, n_ff, h);
    float * ph = gh_aligned_alloc((size_t) h * sizeof(float));
    float * sc = score ? score : gh_aligned_alloc((size_t) n_ff * sizeof(float));
    void * scratch = gh_aligned_alloc(GH_MAX(gh_sparse_predict_scratch_size(&w1, &w2), 64));
    gh_threadpool * tp = NULL;
    bool cached = false;
    st = !ph || !sc || !scratch ? gh_fail(GH_ERR_OOM, "%s: out of memory", fn)
                                : op_pool(fn, n_threads, &tp, &cached);
    if (!st) *n_active = gh_sparse_predict(tp, &w1, &w2, x, threshold, ph, sc, active, scratch);
    if (!st) op_pool_release(tp, cached);
    gh_aligned_free(ph);
    if (sc != score) gh_aligned_free(sc);
    gh_aligned_free(scratch);
    return st;
}

gh_status gh_op_sparse_glu(int type, const void * gate, const void * up, int64_t rows,
                           int64_t cols, int act, float act_t, const float * x,
                           const int32_t * ids, int64_t n, float * a, int n_threads) {
    static const char fn[] = "gh_op_sparse_glu";
    gh_status st;
    if ((st = check_matrix(fn, "gate", type, gate, rows, cols))) return st;
    if (up && (st = check_matrix(fn, "up", type, up, rows, cols))) return st;
    if (act < GH_ACT_SILU || act > GH_ACT_FATRELU) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown activation %d", fn, act);
    }
    if (act == GH_ACT_DRELU && !up) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: dReLU needs up (it has no ungated form)", fn);
    }
    if (!isfinite(act_t)) return gh_fail(GH_ERR_INVALID_ARG, "%s: threshold must be finite", fn);
    if ((st = check_ids(fn, ids, n, rows))) return st;
    if (!x || (n > 0 && !a)) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    gh_weight wg = make_weight(type, gate, rows, cols), wu = make_weight(type, up, rows, cols);
    const gh_glu_spec f = { .act = act, .act_t = act_t, .gate = &wg, .up = up ? &wu : NULL };
    const size_t nb = (size_t) GH_MAX(n, 1) * sizeof(float);
    float * gc = gh_aligned_alloc(nb), * uc = gh_aligned_alloc(nb);
    void * xq = gh_aligned_alloc(GH_MAX(gh_sparse_glu_scratch_size(&wg, f.up), 64));
    gh_threadpool * tp = NULL;
    bool cached = false;
    st = !gc || !uc || !xq ? gh_fail(GH_ERR_OOM, "%s: out of memory", fn)
                           : op_pool(fn, n_threads, &tp, &cached);
    if (!st) gh_sparse_glu(tp, &f, x, NULL, ids, n, a, gc, uc, xq, NULL);
    if (!st) op_pool_release(tp, cached);
    gh_aligned_free(gc);
    gh_aligned_free(uc);
    gh_aligned_free(xq);
    return st;
}

gh_status gh_op_sparse_down(int type, const void * w, int64_t rows, int64_t cols,
                            const int32_t * ids, const float * a, int64_t n, float * y,
                            int n_threads) {
    static const char fn[] = "gh_op_sparse_down";
    gh_status st;
    if ((st = check_matrix(fn, "w", type, w, rows, cols))) return st;
    if ((st = check_ids(fn, ids, n, rows))) return st;
    if (!y || (n > 0 && !a)) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    gh_weight wt = make_weight(type, w, rows, cols);
    gh_threadpool * tp = NULL;
    bool cached;
    if ((st = op_pool(fn, n_threads, &tp, &cached))) return st;
    gh_matmul_t_list(tp, &wt, ids, a, n, y);
    op_pool_release(tp, cached);
    return GH_OK;
}
