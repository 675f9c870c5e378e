/* The sparse FFN (PowerInfer): a per-layer predictor scores every neuron from the
 * residual stream (or the normed input), and the neurons whose score passes the file's
 * threshold are active. The predictor runs on the device when the placement put it there
 * (the scores come back, the threshold is applied here). */
#include "ffn/strategy.h"
#include "ffn/rows.h"
#include "model/model.h"
#include "model/placement.h"
#include "core/tap.h"

static gh_status check(const gh_model * m, bool report) {
    return gh_ffn_check_layers(m, "sparse", true, report);
}

/* an expert runs through the predictor when it has one (every expert of a file with them) */
static bool unit_ok(const gh_layer * L) { return L->has_pred; }

/* The predictor on the device: the scores back, the ids above thr into ids, how many
 * into *n_out; returns a device error. */
static gh_status predict_device(gh_context * c, const gh_dlayer * D, const float * x, float thr,
                                float * score, int32_t * ids, int64_t * n_out) {
    const gh_backend_ops * ops = c->model->hy->b->ops;
    gh_status st = ops->predict(c->stream, &D->fc1, &D->fc2, x, score);
    const double tw = gh_now();
    double dev = 0.0;
    if (!st) st = ops->sync(c->stream, &dev);
    const gh_tap_ev ev = {
        .point = GH_TAP_DEVICE, .il = -1, .seconds = dev, .wait = gh_now() - tw,
        .up = (double) D->fc1.cols * 4, .down = (double) D->fc2.rows * 4,
        .bytes = (double) (D->fc1.rows * D->fc1.row_bytes + D->fc2.rows * D->fc2.row_bytes) };
    gh_tap_emit(&c->tap, &ev);
    if (st) return st;
    int64_t n = 0;
    for (int64_t i = 0; i < D->fc2.rows; i++) {
        if (score[i] >= thr) ids[n++] = (int32_t) i;
    }
    *n_out = n;
    return GH_OK;
}

static gh_status select_ids(const gh_ffn_select_in * in, int32_t * ids, int64_t * n) {
    gh_context * c = in->c;
    const gh_model * m = c->model;
    const gh_layer * L = in->L;  /* a layer, or an expert viewed as one (its own fc1, fc2) */
    /* the device holds a layer's predictor, never an expert's (sparse experts stay on the CPU) */
    const gh_dlayer * D = m->hy && !m->hp.n_expert ? &m->hy->layers[in->il] : NULL;
    const float * px = m->hp.pred_residual ? in->resid : in->x;
    gh_tap_mark(&c->tap); /* the predictor's stage starts here */
    gh_status st = GH_OK;
    if (D && D->pred) {
        st = predict_device(c, D, px, m->info.sparse_threshold, in->b->score, ids, n);
    } else {
        *n = gh_sparse_predict(c->tp, &L->fc1, &L->fc2, px, m->info.sparse_threshold, in->b->ph,
                               in->b->score, ids, in->b->scratch);
    }
    gh_tap_stage(&c->tap, GH_STAGE_PREDICTOR,
                 (double) (L->fc1.rows * L->fc1.row_bytes + L->fc2.rows * L->fc2.row_bytes));
    return st;
}

const gh_ffn_strategy gh_ffn_sparse = {
    .name = "sparse", .mode = GH_FFN_SPARSE, .input_sparse = true,
    .check = check, .unit_ok = unit_ok, .select = select_ids,
};
