/* Mixture-of-experts FFN (moe.c): the router, top-k selection and the selected experts'
 * SwiGLU FFNs through the same kernels as dense weights, plus a shared expert where the
 * architecture has one.
 *
 * One layer over n tokens x (already normed), l = router . x + router_b [n_expert]:
 *   softmax gating:  p = softmax(l); E = the n_expert_used experts with the largest p
 *   sigmoid gating:  p = sigmoid(l); E = the n_expert_used largest p + exp_probs_b among the
 *                    experts of the n_group_used groups whose two best p + exp_probs_b sum
 *                    highest (DeepSeek-V3's router; one group: all experts)
 *   (ties: the lower id)
 *   w_e    = p_e (/ sum_{E} p when hp.expert_norm) * hp.expert_scale
 *   y      = sum_{e in E} w_e * (down_e(act(gate_e x + gb_e, up_e x + ub_e)) + db_e)
 *          (+ sigmoid(shexp_gate . x) * down_sh(act(gate_sh x) * up_sh x); without a
 *          shexp_gate (glm4moe, dots1) the shared experts are added unweighted)
 * Expert weights live in llama.cpp's 3-D tensors [n_expert][rows][cols]: expert e's matrix
 * is rows e*rows .. of the 2-D view (gh_expert), so each expert's rows are read in place,
 * in every type the kernel table has. A batch is grouped by expert: each selected expert
 * runs once over the tokens that chose it, so its rows are read once per batch, and a
 * decode step reads only its k experts' bytes. */
#ifndef GH_MOE_H
#define GH_MOE_H

#include "ffn/experts.h"

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
 * sparse batch of tokens per sequence) and a layer with ffn_down_exps_t each token's
 * selected experts run through the FFN executor as one more user of the strategies
 * (gh_sparse_ffn_unit on the expert viewed as a layer): the strategy selects the expert's
 * active neurons, the executor reads their up rows and down_t rows only, and on a device
 * splits them as a dense layer's: the expert's hot neurons placed there (model/placement.c)
 * run on the device, the rest on the CPU.
 * On a device, a shared expert placed there (model/placement.c) has its gate and up
 * enqueued before the CPU runs its experts, its down after; its output is added after the
 * routed experts' sum, as on the CPU. Returns a device error (of the router, the device's
 * experts or shared expert, or the expert cache's refill), which ends the layer. */
gh_status gh_moe_ffn(struct gh_context * c, int il, int32_t n, bool sparse);

struct gh_layer;
/* Expert e of M (ff neurons, d outputs) viewed as a layer (model.h): its gate, up and
 * down_t rows, biases, predictor and gate threshold, for the FFN strategies, the executor
 * and the placement of its hot neurons (model/placement.c). */
void gh_expert_view(const gh_moe_layer * M, int32_t e, int64_t ff, int64_t d, struct gh_layer * V);

#endif
