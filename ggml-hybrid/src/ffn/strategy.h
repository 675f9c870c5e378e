/* FFN strategies: how a sparse FFN mode chooses a token's active neurons. A strategy only
 * SELECTS (a predictor, a threshold on the gate, the exact mask, all of them); the one
 * executor (exec.c) then computes gate/up over the list and down_t's axpy, splitting it
 * between the device's hot neurons and the CPU. So a strategy never sees a placement, and
 * the backends never see a strategy: they are given the list.
 *
 * Adding a strategy: a file ffn/strategy_<name>.c defining one gh_ffn_strategy, its row in
 * the registry (strategy.c) and its mode id in the public header (GH_FFN_*). */
#ifndef GH_FFN_STRATEGY_H
#define GH_FFN_STRATEGY_H

#include "core/common.h"

struct gh_context;
struct gh_model;
struct gh_layer;

/* Buffers a selection may use, sized for the model's largest layer. */
typedef struct {
    float * ph;      /* predictor hidden [max h] */
    float * score;   /* predictor output [n_ff] */
    void *  scratch; /* converted activations (gh_sparse_predict_scratch_size) */
} gh_ffn_select_bufs;

/* What a selection sees: one token of one FFN: layer il's, or one of its experts' (an
 * expert viewed as a layer: its gate/up/down_t rows and its gate threshold; moe.c). */
typedef struct {
    struct gh_context *     c;
    int                     il;
    const struct gh_layer * L;      /* the FFN: its rows (L->gate.rows neurons), thresholds */
    int32_t                 expert; /* the expert L views, or -1 (the layer's own FFN) */
    const float *           x;      /* the FFN's (normed) input */
    const float *           resid;  /* the residual stream x was normed from */
    const float *           g;      /* needs_gate: the dense gate by neuron id, bias included */
    const gh_ffn_select_bufs * b;
} gh_ffn_select_in;

typedef struct {
    const char * name;   /* "dense", "sparse", ... (the public mode's name) */
    int32_t      mode;   /* its GH_FFN_* id: the registry row it sits in */
    /* The executor computes the dense gate first and hands it to select; the listed
     * neurons' activations then use those gates (no gate row is read twice). */
    bool         needs_gate;
    /* The attention's and head's projections may run input-sparse under it (the oracle is
     * the dense result by definition: its inputs stay whole). */
    bool         input_sparse;
    /* The FFN itself may run input-sparse (input_ffn.h) with the context's input sparsity
     * on: the gate's threshold is on the activation, which input sparsity preserves. */
    bool         input_ffn;
    /* GH_OK when the model can run it, else the reason (message set when report is true:
     * choosing a context's default mode asks quietly). NULL: always. */
    gh_status (*check)(const struct gh_model * m, bool report);
    /* Whether the strategy can select in one FFN unit (an expert: the gate strategy needs
     * the expert's own threshold, which the file keeps only where it pays); a unit it
     * cannot runs dense. NULL: every unit (check covers the layers). */
    bool (*unit_ok)(const struct gh_layer * L);
    /* Writes the active neurons in ascending order to ids and how many to *n; returns a
     * device error (a selection that runs on the device: the sparse predictor). NULL: the
     * dense pass (forward.c's matmuls), which is no selection. */
    gh_status (*select)(const gh_ffn_select_in * in, int32_t * ids, int64_t * n);
} gh_ffn_strategy;

/* The registry (strategy.c): the strategy of a mode, NULL for an unknown one. */
const gh_ffn_strategy * gh_ffn_strategy_of(int32_t mode);
/* The mode a new context starts in: the first of the registry's default order that the
 * model can run. */
int32_t gh_ffn_default_mode(const struct gh_model * m);
/* "0 dense, 1 sparse, 2 oracle, 3 gate": the modes, for messages. */
const char * gh_ffn_mode_list(void);

/* Shared by the strategies' checks: every layer has the transposed down projection the
 * executor's list path needs (a mixture: its experts', ffn_down_exps_t), and, with pred, a
 * predictor (message names the mode; experts have none). */
gh_status gh_ffn_check_layers(const struct gh_model * m, const char * mode, bool pred, bool report);

#endif
