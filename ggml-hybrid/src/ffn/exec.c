/* The FFN executor (exec.h): the strategy selects, this computes. Written once for every
 * strategy and placement:
 *   gate     (strategies that need it) the dense gate: the device's hot rows and the CPU's
 *            cold rows at once, or the CPU's matmul when nothing is on the device
 *   select   the strategy's id list (ascending)
 *   split    the listed neurons the device holds go to its hot_ffn, the others to the CPU
 *   compute  device part enqueued, CPU part (gate/up rows, then down_t's axpy over the
 *            neurons that came out nonzero), sync, merge, the down bias once. */
#include "ffn/exec.h"
#include "ffn/strategy.h"
#include "ffn/rows.h"
#include "ffn/input_ffn.h"
#include "model/model.h"
#include "model/placement.h"
#include "core/tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct gh_ffn_state {
    gh_ffn_select_bufs sel; /* ph, score, scratch */
    /* buffers for one token, sized for the largest layer */
    float *   g_dense;     /* the dense gate by neuron id [n_ff] */
    float *   a, * gc, * uc;  /* compact activation, gate, up [n_ff] */
    int32_t * ids;         /* active list [n_ff] */
    float *   gu;          /* input-sparse FFN: gate then up outputs [2 n_ff] */
    int32_t * down_ids;    /* the list's neurons with a nonzero activation [n_ff] */
    float *   down_a;      /* and their activations [n_ff] */
    /* the split: the device's listed rows (compacted) and their gates, its partial output,
     * the CPU's neurons, the device's dense gate */
    int32_t * hot_rows;    /* [n_ff] */
    float *   hot_g;       /* [n_ff] */
    float *   y_dev;       /* [n_embd] */
    int32_t * cold;        /* [n_ff] */
    float *   g_hot;       /* [n_ff] */
    /* batched decode (gh_sparse_ffn_batch), for up to nbu = min(n_batch, GH_UNION_MAX)
     * tokens: their dense gates by id, gate and up over the union [nbu][n_ff], each
     * neuron's token mask, the union's ids and masks, the tokens' converted inputs */
    int32_t   nbu;
    float *   bg, * bgc, * buc;
    uint64_t * tm, * utm;
    int32_t * uids;
    void *    bxq;
    size_t    bxq_stride;
};

void gh_ffn_state_free(gh_ffn_state * s) {
    if (!s) return;
    gh_aligned_free(s->sel.ph);
    gh_aligned_free(s->sel.score);
    gh_aligned_free(s->sel.scratch);
    gh_aligned_free(s->g_dense);
    gh_aligned_free(s->a);
    gh_aligned_free(s->gc);
    gh_aligned_free(s->uc);
    gh_aligned_free(s->ids);
    gh_aligned_free(s->down_ids);
    gh_aligned_free(s->gu);
    gh_aligned_free(s->down_a);
    gh_aligned_free(s->hot_rows);
    gh_aligned_free(s->hot_g);
    gh_aligned_free(s->y_dev);
    gh_aligned_free(s->cold);
    gh_aligned_free(s->g_hot);
    gh_aligned_free(s->bg);
    gh_aligned_free(s->bgc);
    gh_aligned_free(s->buc);
    gh_aligned_free(s->tm);
    gh_aligned_free(s->utm);
    gh_aligned_free(s->uids);
    gh_aligned_free(s->bxq);
    free(s);
}

gh_ffn_state * gh_ffn_state_new(const gh_model * m, int32_t n_batch) {
    gh_ffn_state * s = calloc(1, sizeof *s);
    if (!s) { gh_fail(GH_ERR_OOM, "out of memory"); return NULL; }
    /* a mixture's experts run through the same buffers (gh_sparse_ffn_unit) */
    const int64_t ff = GH_MAX(m->hp.n_ff, m->hp.n_ff_exp);
    int64_t h = 1;
    size_t scratch = 64, glu = 64;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        const gh_moe_layer * M = &L->moe;
        if (M->has_down_t) {
            glu = GH_MAX(glu, gh_sparse_glu_scratch_size(&M->gate_exps, &M->up_exps));
            scratch = GH_MAX(scratch, gh_matmul_scratch_size(&M->gate_exps, 1));
        }
        if (M->has_pred) {
            h = GH_MAX(h, M->fc1_exps.rows);
            scratch = GH_MAX(scratch, gh_sparse_predict_scratch_size(&M->fc1_exps, &M->fc2_exps));
        }
        glu = GH_MAX(glu, gh_sparse_glu_scratch_size(&L->gate, m->hp.gated ? &L->up : NULL));
        scratch = GH_MAX(scratch, glu);
        scratch = GH_MAX(scratch, gh_matmul_scratch_size(&L->gate, 1));
        if (L->has_pred) {
            h = GH_MAX(h, L->fc1.rows);
            scratch = GH_MAX(scratch, gh_sparse_predict_scratch_size(&L->fc1, &L->fc2));
        }
    }
    const size_t fb = (size_t) ff * sizeof(float), ib = (size_t) ff * sizeof(int32_t);
    s->sel.ph = gh_aligned_alloc((size_t) h * sizeof(float));
    s->sel.score = gh_aligned_alloc(fb);
    s->sel.scratch = gh_aligned_alloc(scratch);
    s->g_dense = gh_aligned_alloc(fb);
    s->a = gh_aligned_alloc(fb);
    s->gc = gh_aligned_alloc(fb);
    s->uc = gh_aligned_alloc(fb);
    s->ids = gh_aligned_alloc(ib);
    s->down_ids = gh_aligned_alloc(ib);
    s->gu = gh_aligned_alloc(2 * fb);
    s->down_a = gh_aligned_alloc(fb);
    s->hot_rows = gh_aligned_alloc(ib);
    s->hot_g = gh_aligned_alloc(fb);
    s->y_dev = gh_aligned_alloc((size_t) m->hp.n_embd * sizeof(float));
    s->cold = gh_aligned_alloc(ib);
    s->g_hot = gh_aligned_alloc(fb);
    s->nbu = GH_MAX(1, GH_MIN(n_batch, GH_UNION_MAX));
    s->bg = gh_aligned_alloc((size_t) s->nbu * fb);
    s->bgc = gh_aligned_alloc((size_t) s->nbu * fb);
    s->buc = gh_aligned_alloc((size_t) s->nbu * fb);
    s->tm = gh_aligned_alloc((size_t) ff * sizeof(uint64_t));
    s->utm = gh_aligned_alloc((size_t) ff * sizeof(uint64_t));
    s->uids = gh_aligned_alloc(ib);
    s->bxq_stride = (glu + 63) & ~(size_t) 63;
    s->bxq = gh_aligned_alloc((size_t) s->nbu * s->bxq_stride);
    if (!s->bg || !s->bgc || !s->buc || !s->tm || !s->utm || !s->uids || !s->bxq ||
        !s->sel.ph || !s->sel.score || !s->sel.scratch || !s->g_dense || !s->a || !s->gc ||
        !s->uc || !s->ids || !s->down_ids || !s->gu || !s->down_a || !s->hot_rows ||
        !s->hot_g || !s->y_dev || !s->cold || !s->g_hot) {
        gh_ffn_state_free(s);
        gh_fail(GH_ERR_OOM, "out of memory for the sparse FFN buffers");
        return NULL;
    }
    return s;
}

bool gh_sparse_applies(const gh_context * c, int32_t n) {
    const gh_ffn_strategy * st = gh_ffn_strategy_of(c->ffn_mode);
    /* the FFN's recording (its input, the true mask) is of the dense FFN; the projections'
     * inputs are recorded on either path, so that one profile pass in the sparse modes gives
     * each input-sparse site the inputs it sees there (input_eval.refit) */
    return st && st->select && n <= c->sparse_batch && !gh_tap_wants(&c->tap, GH_TAP_FFN_IN) &&
           !gh_tap_wants(&c->tap, GH_TAP_FFN_GATE) && !gh_tap_wants(&c->tap, GH_TAP_FFN_ACT);
}

bool gh_input_sparse_applies(const gh_context * c, int32_t n) {
    return c->input_sparse && gh_sparse_applies(c, n) &&
           gh_ffn_strategy_of(c->ffn_mode)->input_sparse;
}

/* The dense gate by neuron id into s->g_dense (bias included): the device's hot rows
 * while the CPU does the cold ones, or the CPU's matmul over every row. Adds the weight
 * bytes read to *bytes; returns a device error. */
static gh_status dense_gate(gh_context * c, const gh_layer * L, const gh_dsplit * D,
                            const float * x, double * bytes) {
    gh_ffn_state * s = c->ffn;
    const int64_t ff = L->gate.rows;
    if (D && D->hot.n_hot > 0) {
        const int64_t nh = D->hot.n_hot;
        gh_status st = gh_hybrid_matmul_async(c, &D->hot.gate, x, 1, s->g_hot);
        gh_list_rows_dot(c->tp, &L->gate, x, D->cold, D->n_cold, s->gc, s->sel.scratch);
        for (int64_t k = 0; k < D->n_cold; k++) {
            const int32_t i = D->cold[k];
            s->g_dense[i] = s->gc[k] + (L->gate_b ? L->gate_b[i] : 0.0f);
        }
        st = gh_hybrid_sync(c, st);
        if (st) return st;
        for (int64_t k = 0; k < nh; k++) {
            const int32_t i = D->bucket[k];
            s->g_dense[i] = s->g_hot[k] + (L->gate_b ? L->gate_b[i] : 0.0f);
        }
        *bytes += (double) D->n_cold * (double) L->gate.row_bytes;
        /* the device's rows: in its bytes (gh_hybrid_matmul_async), and the FFN's */
        *bytes += (double) nh * (double) D->hot.gate.row_bytes;
        return GH_OK;
    }
    gh_matmul(c->tp, &L->gate, x, 1, s->g_dense, ff, s->sel.scratch);
    if (L->gate_b) for (int64_t i = 0; i < ff; i++) s->g_dense[i] += L->gate_b[i];
    *bytes += (double) ff * (double) L->gate.row_bytes;
    return GH_OK;
}

/* gate/up and down over the neurons ids[0..n) on the CPU (y overwritten), the gates from
 * gate_g (by neuron id) when given; returns the weight bytes read and counts the rows. */
static double cpu_part(gh_context * c, const gh_layer * L, const float * x, const float * gate_g,
                       const int32_t * ids, int64_t n, float * y) {
    gh_ffn_state * s = c->ffn;
    int64_t n_up = 0;
    const gh_hparams * hp = &c->model->hp;
    const gh_glu_spec f = { .act = hp->ffn_act, .act_t = hp->act_threshold, .gate = &L->gate,
                            .up = hp->gated ? &L->up : NULL, .gate_b = L->gate_b, .up_b = L->up_b };
    gh_sparse_glu(c->tp, &f, x, gate_g, ids, n, s->a, s->gc, s->uc, s->sel.scratch, &n_up);
    /* the down rows of the neurons that came out nonzero, compacted (branch-free: ~30%
     * of a low-threshold list is zero), so that the axpy neither visits nor prefetches
     * the rows it skips */
    int64_t n_down = 0;
    /* input sparsity of the down projection (input-sparse FFN strategies): |a| > thr */
    const float * td = c->input_sparse && gh_ffn_strategy_of(c->ffn_mode)->input_ffn &&
                       L->down_in_on ? L->thr_down_in : NULL;
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
    gh_tap_count(&c->tap, GH_TAP_ROWS, -1, GH_STAGE_FFN, n_up, n_down);
    return (gate_g ? 0.0 : (double) n * (double) L->gate.row_bytes) +
           (double) n_up * (double) L->up.row_bytes + (double) n_down * (double) L->down_t.row_bytes;
}

/* The list ids[0..n) computed into y (overwritten, down bias not added): the device
 * takes the neurons it holds, the CPU the rest, then sync and merge. Adds the weight
 * bytes read to *bytes; *n_dev = the device's neurons; returns a device error. */
static gh_status execute(gh_context * c, const gh_layer * L, const gh_dsplit * D,
                         const float * x, const float * gate_g, const int32_t * ids, int64_t n,
                         float * y, double * bytes, int64_t * n_dev) {
    *n_dev = 0;
    if (!D || D->hot.n_hot == 0) {
        *bytes += cpu_part(c, L, x, gate_g, ids, n, y);
        return GH_OK;
    }
    gh_ffn_state * s = c->ffn;
    int64_t n_hot = 0, n_cold = 0;
    for (int64_t k = 0; k < n; k++) {
        const int32_t r = D->row_of[ids[k]];
        if (r >= 0) {
            s->hot_rows[n_hot] = r;
            if (gate_g) s->hot_g[n_hot] = gate_g[ids[k]];
            n_hot++;
        } else {
            s->cold[n_cold++] = ids[k];
        }
    }
    const gh_backend_ops * ops = c->model->hy->b->ops;
    gh_status st = GH_OK;
    if (n_hot) {
        st = ops->hot_ffn(c->stream, &D->hot, x, s->hot_rows, gate_g ? s->hot_g : NULL, n_hot,
                          s->y_dev, NULL);
    }
    const double tc = gh_now();
    *bytes += cpu_part(c, L, x, gate_g, s->cold, n_cold, y);
    const double tw = gh_now();
    gh_tap_ev ev = { .point = GH_TAP_DEVICE, .il = -1, .cpu = tw - tc };
    if (n_hot) {
        double dev = 0.0;
        if (!st) st = ops->sync(c->stream, &dev);
        const double rows_b = (double) n_hot * (double) ((gate_g ? 0 : D->hot.gate.row_bytes) +
                              D->hot.up.row_bytes + D->hot.down_t.row_bytes);
        ev.seconds = dev;
        ev.wait = gh_now() - tw;
        ev.up = (double) (L->gate.cols * 4 + n_hot * (gate_g ? 8 : 4));
        ev.down = (double) L->down_t.cols * 4;
        ev.bytes = rows_b;
        *bytes += rows_b;
        if (!st) for (int64_t j = 0; j < L->down_t.cols; j++) y[j] += s->y_dev[j];
    }
    gh_tap_emit(&c->tap, &ev);
    *n_dev = n_hot;
    return st;
}

/* The FFN with input sparsity on its inputs (input_ffn.h): gate and up through
 * gate_up_t, the down rows by |h|; counts the down rows as the layer's active neurons. */
static void input_sparse_ffn(gh_context * c, int il, const gh_layer * L, const float * x, float * y) {
    gh_ffn_state * s = c->ffn;
    const gh_hparams * hp = &c->model->hp;
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
    gh_tap_stage(&c->tap, GH_STAGE_FFN, bytes);
    gh_tap_count(&c->tap, GH_TAP_ROWS, -1, GH_STAGE_FFN, 0, n_down);
    gh_tap_count(&c->tap, GH_TAP_SELECT, il, GH_STAGE_FFN, n_down, 0);
}

/* One token's FFN of the unit L (layer il's FFN, or one of its experts viewed as a layer;
 * split with the device by D, NULL: CPU only) in the context's mode: y = FFN(x), the down bias
 * added. Adds the weight bytes read to *bytes; *n_active, *n_dev: the listed neurons, the
 * device's; returns a device error (of the gate, the selection or the split). A layer's
 * call counts the FFN stage's time (a selection that reads weights of its own times
 * itself: the predictor's stage). */
static gh_status unit_ffn(gh_context * c, int il, const gh_layer * L, int32_t expert,
                          const gh_dsplit * D, const float * x, const float * resid, float * y,
                          double * bytes, int64_t * n_active, int64_t * n_dev) {
    const gh_ffn_strategy * st = gh_ffn_strategy_of(c->ffn_mode);
    gh_ffn_state * s = c->ffn;
    gh_status err = st->needs_gate ? dense_gate(c, L, D, x, bytes) : GH_OK;
    if (err) return err;
    const float * gate_g = st->needs_gate ? s->g_dense : NULL;
    const gh_ffn_select_in in = { .c = c, .il = il, .L = L, .expert = expert, .x = x,
                                  .resid = resid, .g = gate_g, .b = &s->sel };
    int64_t n = 0;
    err = st->select(&in, s->ids, &n);
    if (err) return err;
    /* a layer's selection that reads weights of its own times itself (the predictor's
     * stage), the others' time is no stage's; a gate computed here is the FFN's. An
     * expert's time is its layer's (forward.c times the whole mixture): no mark. */
    if (expert < 0 && !st->needs_gate) gh_tap_mark(&c->tap);
    err = execute(c, L, D, x, gate_g, s->ids, n, y, bytes, n_dev);
    if (err) return err;
    if (L->down_b) for (int64_t j = 0; j < L->down_t.cols; j++) y[j] += L->down_b[j];
    *n_active = n;
    return GH_OK;
}

gh_status gh_sparse_ffn(gh_context * c, int il, const float * x, const float * resid, float * y) {
    const gh_model * m = c->model;
    const gh_layer * L = &m->layers[il];
    const gh_dsplit * D = m->hy ? &m->hy->layers[il].ffn : NULL;
    const bool split = D && D->hot.n_hot > 0;
    const gh_ffn_strategy * st = gh_ffn_strategy_of(c->ffn_mode);
    /* gate and up input-sparse (a layer whose FFN input thresholds are all 0 keeps the row
     * path, so a file at level 0 computes what the strategy alone does) */
    if (st->input_ffn && c->input_sparse && L->ffn_in_on && !split) {
        input_sparse_ffn(c, il, L, x, y);
        return GH_OK;
    }
    int64_t n = 0, n_dev = 0;
    double bytes = 0.0;
    const gh_status err = unit_ffn(c, il, L, -1, D, x, resid, y, &bytes, &n, &n_dev);
    if (err) return err;
    gh_tap_stage(&c->tap, GH_STAGE_FFN, bytes);
    gh_tap_count(&c->tap, GH_TAP_SELECT, il, GH_STAGE_FFN, n, n_dev);
    return GH_OK;
}

gh_status gh_sparse_ffn_unit(gh_context * c, int il, const gh_layer * L, int32_t expert,
                             const gh_dsplit * D, const float * x, float * y, double * bytes,
                             int64_t * n_active, int64_t * n_dev) {
    return unit_ffn(c, il, L, expert, D, x, x, y, bytes, n_active, n_dev);
}

/* Batched decode's FFN of tokens from different sequences (gh_eval_batch): each token
 * selects its own neurons; gate and up are computed over the union of the lists, each
 * union row read from memory once for all the tokens (gh_union_glu_rows), or, past the
 * density cut, by the dense matmuls; then each token takes its OWN neurons' values, in
 * its own list's order, and runs the activation and the down axpy over them exactly as
 * gh_sparse_ffn does, so a neuron outside its list contributes exactly zero. */

/* Union density above which gate and up run as dense matmuls over the n tokens instead
 * of gathered rows. Gathered rows run at 1.15-1.45x a streamed row dot's time per byte,
 * and at worst at half the streamed rate (docs/BENCHMARKS.md: "gathered up rows",
 * "gathered at half the streamed rate"), so at a union of half the rows or more the
 * gathered path can only lose; below it, it reads fewer bytes at any of those rates. */
#define GH_UNION_DENSE_CUT 0.5

static gh_status batch_union(gh_context * c, int il, int32_t n, const float * x,
                             const float * resid, float * y) {
    const gh_model * m = c->model;
    const gh_hparams * hp = &m->hp;
    const gh_layer * L = &m->layers[il];
    const gh_ffn_strategy * st = gh_ffn_strategy_of(c->ffn_mode);
    gh_ffn_state * s = c->ffn;
    const int64_t d = hp->n_embd, ff = hp->n_ff;
    double bytes = 0.0;
    /* the dense gate of every token: one matmul reads the gate once */
    if (st->needs_gate) {
        gh_matmul(c->tp, &L->gate, x, n, s->bg, ff, c->mm_scratch);
        if (L->gate_b) {
            for (int32_t t = 0; t < n; t++) {
                for (int64_t i = 0; i < ff; i++) s->bg[(int64_t) t * ff + i] += L->gate_b[i];
            }
        }
        bytes += (double) ff * (double) L->gate.row_bytes;
    }
    /* each token's own selection, as a bit per neuron */
    memset(s->tm, 0, (size_t) ff * sizeof(uint64_t));
    for (int32_t t = 0; t < n; t++) {
        const gh_ffn_select_in in = { .c = c, .il = il, .L = L, .expert = -1, .x = x + t * d,
                                      .resid = resid + t * d,
                                      .g = st->needs_gate ? s->bg + (int64_t) t * ff : NULL,
                                      .b = &s->sel };
        int64_t nt = 0;
        const gh_status err = st->select(&in, s->ids, &nt);
        if (err) return err;
        const uint64_t bit = (uint64_t) 1 << t;
        for (int64_t k = 0; k < nt; k++) s->tm[s->ids[k]] |= bit;
        gh_tap_count(&c->tap, GH_TAP_SELECT, il, GH_STAGE_FFN, nt, 0);
    }
    if (!st->needs_gate) gh_tap_mark(&c->tap); /* as in gh_sparse_ffn */
    int64_t nu = 0;
    for (int64_t i = 0; i < ff; i++) {
        s->uids[nu] = (int32_t) i;
        s->utm[nu] = s->tm[i];
        nu += s->tm[i] != 0;
    }
    const int act = hp->ffn_act;
    const bool skip_up = act == GH_ACT_RELU || act == GH_ACT_DRELU || act == GH_ACT_FATRELU;
    const float cut = act == GH_ACT_FATRELU ? hp->act_threshold : 0.0f;
    const gh_glu_spec f = { .act = act, .act_t = hp->act_threshold, .gate = &L->gate,
                            .up = hp->gated ? &L->up : NULL, .gate_b = L->gate_b, .up_b = L->up_b };
    const bool dense = (double) nu > GH_UNION_DENSE_CUT * (double) ff;
    /* gc / uc of token t at union position k: [t * ld + k]; the dense path's positions
     * are the neurons themselves */
    const int64_t ld = ff;
    const float * gsrc; /* where token t's gates of the union positions are */
    int64_t n_up = 0;
    if (dense) {
        if (st->needs_gate) {
            if (hp->gated) gh_matmul(c->tp, &L->up, x, n, s->buc, ff, c->mm_scratch);
            gsrc = s->bg;
        } else {
            const gh_weight * ws[2] = { &L->gate, &L->up };
            float * ys[2] = { s->bgc, s->buc };
            const int64_t lds[2] = { ff, ff };
            gh_matmul_multi(c->tp, ws, hp->gated ? 2 : 1, x, n, ys, lds, c->mm_scratch);
            for (int32_t t = 0; t < n; t++) {
                float * g = s->bgc + (int64_t) t * ff;
                if (L->gate_b) for (int64_t i = 0; i < ff; i++) g[i] += L->gate_b[i];
            }
            bytes += (double) ff * (double) L->gate.row_bytes;
            gsrc = s->bgc;
        }
        if (hp->gated && L->up_b) {
            for (int32_t t = 0; t < n; t++) {
                float * u = s->buc + (int64_t) t * ff;
                for (int64_t i = 0; i < ff; i++) u[i] += L->up_b[i];
            }
        }
        if (hp->gated) bytes += (double) ff * (double) L->up.row_bytes;
    } else {
        gh_union_glu_rows(c->tp, &f, x, n, st->needs_gate ? s->bg : NULL, ff, s->uids, s->utm, nu,
                          s->bgc, s->buc, ld, s->bxq, s->bxq_stride, &n_up);
        gsrc = s->bgc;
        /* each union row read once (the tokens' other reads of it hit the cache) */
        bytes += (double) nu * (double) ((st->needs_gate ? 0 : L->gate.row_bytes) +
                                         (hp->gated ? L->up.row_bytes : 0));
    }
    const float * td = c->input_sparse && st->input_ffn && L->down_in_on ? L->thr_down_in : NULL;
    for (int32_t t = 0; t < n; t++) {
        const uint64_t bit = (uint64_t) 1 << t;
        const int64_t n_pos = dense ? ff : nu;
        const float * gt = gsrc + (int64_t) t * ld;
        const float * ut = s->buc + (int64_t) t * ld;
        /* the token's own list, in its order, with the values gh_sparse_glu gives it */
        int64_t nt = 0;
        for (int64_t k = 0; k < n_pos; k++) {
            const int32_t i = dense ? (int32_t) k : s->uids[k];
            if (!(s->tm[i] & bit)) continue;
            const float g = dense || !st->needs_gate ? gt[k] : s->bg[(int64_t) t * ff + i];
            s->ids[nt] = i;
            s->gc[nt] = g;
            s->uc[nt] = !hp->gated || (skip_up && !(g > cut)) ? 0.0f : ut[k];
            nt++;
        }
        /* the dense path's up rows: counted as gh_sparse_glu reads them */
        if (dense && hp->gated) for (int64_t k = 0; k < nt; k++) n_up += !skip_up || s->gc[k] > cut;
        gh_glu(act, hp->act_threshold, s->gc, hp->gated ? s->uc : NULL, s->a, nt);
        int64_t n_down = 0;
        for (int64_t k = 0; k < nt; k++) {
            s->down_ids[n_down] = s->ids[k];
            s->down_a[n_down] = s->a[k];
            n_down += td ? fabsf(s->a[k]) > td[s->ids[k]] : s->a[k] != 0.0f;
        }
        float * yt = y + t * d;
        gh_matmul_t_list(c->tp, &L->down_t, s->down_ids, s->down_a, n_down, yt);
        if (L->down_b) for (int64_t j = 0; j < d; j++) yt[j] += L->down_b[j];
        gh_tap_count(&c->tap, GH_TAP_ROWS, -1, GH_STAGE_FFN, 0, n_down);
        bytes += (double) n_down * (double) L->down_t.row_bytes;
    }
    gh_tap_count(&c->tap, GH_TAP_ROWS, -1, GH_STAGE_FFN, n_up, 0);
    gh_tap_stage(&c->tap, GH_STAGE_FFN, bytes);
    return GH_OK;
}

gh_status gh_sparse_ffn_batch(gh_context * c, int il, int32_t n, const float * x,
                              const float * resid, float * y) {
    const gh_model * m = c->model;
    const int64_t d = m->hp.n_embd;
    const gh_layer * L = &m->layers[il];
    const gh_dsplit * D = m->hy ? &m->hy->layers[il].ffn : NULL;
    const gh_ffn_strategy * st = gh_ffn_strategy_of(c->ffn_mode);
    /* one token at a time: a single token, a prompt's few tokens (one sequence: the
     * decode's own path), a layer split with the device (its hot_ffn takes one token) or
     * the input-sparse FFN (one token's kernels) */
    if (n == 1 || !c->seq || (D && D->hot.n_hot > 0) ||
        (st->input_ffn && c->input_sparse && L->ffn_in_on)) {
        for (int32_t t = 0; t < n; t++) {
            const gh_status err = gh_sparse_ffn(c, il, x + t * d, resid + t * d, y + t * d);
            if (err) return err;
        }
        return GH_OK;
    }
    for (int32_t t0 = 0; t0 < n; t0 += c->ffn->nbu) {
        const int32_t nt = GH_MIN(c->ffn->nbu, n - t0);
        const gh_status err = batch_union(c, il, nt, x + t0 * d, resid + t0 * d, y + t0 * d);
        if (err) return err;
    }
    return GH_OK;
}

double gh_dense_ffn_bytes(const gh_context * c, int il, int32_t n, const float * h) {
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
    return bytes;
}
