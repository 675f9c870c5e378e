/* The registry of FFN strategies (strategy.h): one row per mode. */
#include "ffn/strategy.h"
#include "model/model.h"

extern const gh_ffn_strategy gh_ffn_dense, gh_ffn_sparse, gh_ffn_oracle, gh_ffn_gate;

static const gh_ffn_strategy * const registry[] = {
    [GH_FFN_DENSE] = &gh_ffn_dense,
    [GH_FFN_SPARSE] = &gh_ffn_sparse,
    [GH_FFN_ORACLE] = &gh_ffn_oracle,
    [GH_FFN_GATE] = &gh_ffn_gate,
};
#define N_MODES ((int32_t) (sizeof registry / sizeof registry[0]))

/* a new context's mode: the first the file can run (a file converted with predictors
 * decodes through them, one with gate thresholds through the gate; else dense) */
static const int32_t default_order[] = { GH_FFN_SPARSE, GH_FFN_GATE, GH_FFN_DENSE };

const gh_ffn_strategy * gh_ffn_strategy_of(int32_t mode) {
    return mode >= 0 && mode < N_MODES ? registry[mode] : NULL;
}

int32_t gh_ffn_default_mode(const gh_model * m) {
    for (size_t i = 0; i < sizeof default_order / sizeof default_order[0]; i++) {
        const gh_ffn_strategy * s = registry[default_order[i]];
        if (!s->check || s->check(m, false) == GH_OK) return s->mode;
    }
    return GH_FFN_DENSE;
}

const char * gh_ffn_mode_list(void) { return "0 dense, 1 sparse, 2 oracle, 3 gate"; }
