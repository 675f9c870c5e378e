/* The gate FFN (gate-magnitude sparsity, no predictor): the dense gate, and the neurons
 * whose |act(g)| exceeds the layer's calibrated threshold are active, tested as cut points
 * on g solved once at load (model.h: g > gate_cut, or gate_lo < g < gate_hi). */
#include "ffn/strategy.h"
#include "model/model.h"

static gh_status check(const gh_model * m, bool report) {
    if (!m->info.has_gate_threshold) {
        return !report ? GH_ERR_UNSUPPORTED
             : gh_fail(GH_ERR_UNSUPPORTED, "the gate FFN needs calibrated gate thresholds (%s), "
                       "but the file has none: convert the model with --sparsity S",
                       m->hp.n_expert ? "blk.N.ffn_exp_gate_thr, one per expert"
                                      : "powerinfer.sparse.gate_threshold");
    }
    return gh_ffn_check_layers(m, "gate", false, report);
}

static gh_status select_ids(const gh_ffn_select_in * in, int32_t * ids, int64_t * n_out) {
    const gh_layer * L = in->L;
    const int64_t ff = L->gate.rows;
    const float * g = in->g;
    /* branch-free: the list is a prefix sum */
    const float cut = L->gate_cut, lo = L->gate_lo, hi = L->gate_hi;
    int64_t n = 0;
    for (int64_t i = 0; i < ff; i++) {
        ids[n] = (int32_t) i;
        n += (g[i] > cut) | ((g[i] > lo) & (g[i] < hi));
    }
    *n_out = n;
    return GH_OK;
}

static bool unit_ok(const gh_layer * L) { return L->has_gate_thr; }

const gh_ffn_strategy gh_ffn_gate = {
    .name = "gate", .mode = GH_FFN_GATE, .needs_gate = true, .input_sparse = true,
    .input_ffn = true, .check = check, .unit_ok = unit_ok, .select = select_ids,
};
