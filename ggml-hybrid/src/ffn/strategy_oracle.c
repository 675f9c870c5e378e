/* The oracle FFN: the exact active set from the dense gate (ReLU family: g above the
 * activation's cut; other activations are not sparse, so every neuron). It gives the
 * dense result and is the reference the predictors are measured against (tests). */
#include "ffn/strategy.h"
#include "model/model.h"

static gh_status check(const gh_model * m, bool report) {
    return gh_ffn_check_layers(m, "oracle", false, report);
}

static gh_status select_ids(const gh_ffn_select_in * in, int32_t * ids, int64_t * n_out) {
    const gh_hparams * hp = &in->c->model->hp;
    const int act = hp->ffn_act;
    const bool relu = act == GH_ACT_RELU || act == GH_ACT_DRELU || act == GH_ACT_FATRELU;
    const float cut = act == GH_ACT_FATRELU ? hp->act_threshold : 0.0f;
    const float * g = in->g;
    int64_t n = 0;
    for (int64_t i = 0; i < in->L->gate.rows; i++) {
        if (!relu || g[i] > cut) ids[n++] = (int32_t) i;
    }
    *n_out = n;
    return GH_OK;
}

const gh_ffn_strategy gh_ffn_oracle = {
    .name = "oracle", .mode = GH_FFN_ORACLE, .needs_gate = true,
    .check = check, .select = select_ids,
};
