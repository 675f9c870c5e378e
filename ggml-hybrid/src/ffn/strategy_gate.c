/* The gate FFN (gate-magnitude sparsity, no predictor): the dense gate, and the neurons
 * whose |act(g)| exceeds the layer's calibrated threshold are active, tested as cut points
 * on g solved once at load (model.h: g > gate_cut, or gate_lo < g < gate_hi). */
#include "ffn/strategy.h"
#include "model/model.h"

static gh_status check(const gh_model * m, bool report) {
    if (!m->hp.n_expert && !m->info.has_gate_threshold) {
        return !report ? GH_ERR_UNSUPPORTED
             : gh_fail(GH_ERR_UNSUPPORTED, "the gate FFN needs calibrated gate thresholds "
                       "(powerinfer.sparse.gate_threshold), but the file has none: convert the "
                       "model with --sparsity S");
    }
    return gh_ffn_check_layers(m, "gate", false, report);
}

static int64_t select_ids(const gh_ffn_select_in * in, int32_t * ids) {
    const gh_layer * L = &in->c->model->layers[in->il];
    const int64_t ff = in->c->model->hp.n_ff;
    const float * g = in->g;
    /* branch-free: the list is a prefix sum */
    const float cut = L->gate_cut, lo = L->gate_lo, hi = L->gate_hi;
    int64_t n = 0;
    for (int64_t i = 0; i < ff; i++) {
        ids[n] = (int32_t) i;
        n += (g[i] > cut) | ((g[i] > lo) & (g[i] < hi));
    }
    return n;
}

const gh_ffn_strategy gh_ffn_gate = {
    .name = "gate", .mode = GH_FFN_GATE, .needs_gate = true, .input_sparse = true,
    .input_ffn = true, .check = check, .select = select_ids,
};
