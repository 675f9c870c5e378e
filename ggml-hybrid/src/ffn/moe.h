/* Mixture-of-experts FFN (moe.c): the router, top-k selection and the selected experts'
 * SwiGLU FFNs through the same kernels as dense weights, plus a shared expert where the
 * architecture has one.
 *
 * One layer over n tokens x (already normed):
 *   p      = softmax(router . x + router_b)             [n_expert]
 *   E      = the n_expert_used experts with the largest p (ties: the lower id)
 *   w_e    = p_e (/ sum_{E} p when hp.expert_norm) * hp.expert_scale
 *   y      = sum_{e in E} w_e * (down_e(act(gate_e x + gb_e, up_e x + ub_e)) + db_e)
 *          (+ sigmoid(shexp_gate . x) * down_sh(act(gate_sh x) * up_sh x))
 * Expert weights live in llama.cpp's 3-D tensors [n_expert][rows][cols]: expert e's matrix
 * is rows e*rows .. of the 2-D view (gh_expert), so each expert's rows are read in place,
 * in every type the kernel table has. A batch is grouped by expert: each selected expert
 * runs once over the tokens that chose it, so its rows are read once per batch, and a
 * decode step reads only its k experts' bytes. */
#ifndef GH_MOE_H
#define GH_MOE_H

#include "core/common.h"
#include "cpu/ops.h"

/* A layer's experts (model.h gh_layer.moe); rows 0 / NULL where absent. */
typedef struct {
    gh_weight router;                         /* ffn_gate_inp: [n_expert rows][n_embd] */
    gh_weight gate_exps, up_exps, down_exps;  /* expert 0 of ffn_{gate,up,down}_exps:
                                               * [n_ff_exp][n_embd], [n_embd][n_ff_exp] */
    /* the sparse form of the experts' down projection (docs/FORMAT.md "Sparse experts"):
     * ffn_down_exps_t in place of ffn_down_exps, expert 0's [n_ff_exp][n_embd] (row i =
     * neuron i's output vector), so a selected expert's down runs over its active neurons
     * (gh_matmul_t_list) and a dense pass through gh_matmul_t */
    bool      has_down_t;
    gh_weight down_exps_t;
    /* each expert's gate threshold (blk.N.ffn_exp_gate_thr; NULL: none) as its cut points,
     * [n_expert][4] = { t, cut, lo, hi } as gh_layer's gate_thr, gate_cut, gate_lo,
     * gate_hi; t < 0: the expert keeps no threshold and runs dense (model-owned) */
    float *   gate_cuts;
    float *   router_b;                       /* [n_expert] (NULL: none; so the rest) */
    float *   gate_exps_b, * up_exps_b;       /* [n_expert][n_ff_exp] (gpt-oss) */
    float *   down_exps_b;                    /* [n_expert][n_embd] */
    gh_weight gate_shexp, up_shexp, down_shexp; /* the shared expert (rows 0: none) */
    float *   shexp_gate;                     /* ffn_gate_inp_shexp [n_embd] (model-owned) */
    /* the expert placement data (model-owned; NULL where the file has none): each expert's
     * selection frequency, blk.N.ffn_exp_freq (the share of profiled tokens whose top-k
     * held it, in [0, 1]), and the offline placement, blk.N.ffn_exp_gpu (1 = on the
     * device) */
    float *   freq;
    int8_t *  on_gpu;
} gh_moe_layer;

/* Expert e's matrix of a 3-D expert tensor viewed as expert 0 (rows contiguous, experts
 * one after another). */
static inline gh_weight gh_expert(const gh_weight * w, int32_t e) {
    gh_weight v = *w;
    v.data = (const uint8_t *) w->data + (size_t) e * (size_t) w->rows * w->row_bytes;
    return v;
}

struct gh_context;
struct gh_model;
typedef struct gh_moe_state gh_moe_state;

/* The per-context buffers for batches of up to n_batch tokens and the selection counts;
 * NULL on out-of-memory (message set). Only for models with experts. */
gh_moe_state * gh_moe_state_new(const struct gh_model * m, int32_t n_batch);
void gh_moe_state_free(gh_moe_state * s);
/* Zeroes the selection counts (gh_context_reset_stats). */
void gh_moe_reset_stats(gh_moe_state * s);

/* The expert runs and the expert cache's counters (zeros for NULL; gh_context_get_stats). */
void gh_moe_get_stats(const gh_moe_state * s, int64_t * runs_dev, int64_t * runs_cpu,
                      int64_t * hits, int64_t * misses, double * bytes_cache);

/* The FFN of layer il over the n normed tokens in c->xb into c->xb2; counts its weight
 * bytes (router, the experts some token chose, the shared expert) in the FFN stage.
 * With sparse (the forward's gh_sparse_applies: a sparse FFN mode, at most the context's
 * sparse batch of tokens per sequence) and a layer with ffn_down_exps_t (whose experts
 * are all the CPU's, with or without a device) each token's selected experts run through the
 * FFN executor as one more user of the strategies (gh_sparse_ffn_unit on the expert
 * viewed as a layer): the strategy selects the expert's active
 * neurons, the executor reads their up rows and down_t rows only. */
void gh_moe_ffn(struct gh_context * c, int il, int32_t n, bool sparse);

#endif
