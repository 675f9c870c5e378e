/* A layer's expert weights as the file holds them (llama.cpp's 3-D tensors) and expert
 * e's view of one: the data that the MoE FFN (moe.c) runs and the placement
 * (model/placement.c) uploads, apart from either, so that neither reaches into the other
 * for it. */
#ifndef GH_FFN_EXPERTS_H
#define GH_FFN_EXPERTS_H

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
    /* each expert's predictor (blk.N.ffn_exp_fc{1,2}, docs/FORMAT.md "Sparse experts"; the
     * sparse FFN mode's score = fc2 . relu(fc1 . x), active where >= the file's threshold),
     * expert 0's fc1 [h][n_embd] and fc2 [n_ff_exp][h]; has_pred false: none */
    bool      has_pred;
    gh_weight fc1_exps, fc2_exps;
    float *   router_b;                       /* [n_expert] (NULL: none; so the rest) */
    float *   probs_b;                        /* exp_probs_b [n_expert]: added to the scores
                                               * that choose the experts, not to their weights */
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
    /* sparse experts' hot neurons on the device (blk.N.ffn_exp_hot_count / ffn_exp_hot,
     * docs/FORMAT.md "Hot neurons of experts"; model-owned, NULL where the file has none):
     * expert e's ascending neuron ids are hot_ids[hot_off[e] .. hot_off[e + 1]) */
    int64_t * hot_off;                        /* [n_expert + 1] */
    int32_t * hot_ids;
} gh_moe_layer;

/* Expert e's matrix of a 3-D expert tensor viewed as expert 0 (rows contiguous, experts
 * one after another). */
static inline gh_weight gh_expert(const gh_weight * w, int32_t e) {
    gh_weight v = *w;
    v.data = (const uint8_t *) w->data + (size_t) e * (size_t) w->rows * w->row_bytes;
    return v;
}

#endif
