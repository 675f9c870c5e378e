/* What the strategies' checks share (strategy.h: gh_ffn_check_layers), apart from the
 * registry that lists the strategies, so that nothing runs back up to it. */
#include "ffn/strategy.h"
#include "model/model.h"

gh_status gh_ffn_check_layers(const gh_model * m, const char * mode, bool pred, bool report) {
    /* a mixture's first layer with experts speaks for every such layer (the load checked
     * it); the leading dense layers (glm4moe, dots1) run their dense FFN in every mode */
    const int l0 = m->hp.n_expert ? m->hp.n_dense_lead : 0;
    if (m->hp.n_expert && pred && !m->layers[l0].moe.has_pred) {
        return !report ? GH_ERR_UNSUPPORTED
             : gh_fail(GH_ERR_UNSUPPORTED, "the %s FFN needs predictors, and this mixture-of-experts "
                       "model's experts have none (%d experts per layer, no blk.N.ffn_exp_fc1): use "
                       "the gate or oracle mode, or convert ReLU-family experts with --sparse "
                       "--expert-predictors", mode, m->hp.n_expert);
    }
    for (int il = l0; il < m->hp.n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        if (m->hp.n_expert) {
            if (!L->moe.has_down_t) {
                return !report ? GH_ERR_UNSUPPORTED
                     : gh_fail(GH_ERR_UNSUPPORTED, "the %s FFN of a mixture of experts needs the "
                               "experts' transposed down projection, but layer %d has none "
                               "(blk.%d.ffn_down_exps_t.weight): convert the model with --sparsity S "
                               "(or --sparse for ReLU-family experts)", mode, il, il);
            }
            continue;
        }
        if (!L->has_down_t) {
            return !report ? GH_ERR_UNSUPPORTED
                 : gh_fail(GH_ERR_UNSUPPORTED, "the %s FFN needs the transposed down projection, "
                           "but layer %d has none (blk.%d.ffn_down_t.weight): convert the model "
                           "with --sparse", mode, il, il);
        }
        if (pred && !L->has_pred) {
            return !report ? GH_ERR_UNSUPPORTED
                 : gh_fail(GH_ERR_UNSUPPORTED, "the %s FFN needs a predictor in every layer, but "
                           "layer %d has none (blk.%d.fc1.weight, blk.%d.fc2.weight): convert "
                           "the model with --sparse", mode, il, il, il);
        }
    }
    return GH_OK;
}
