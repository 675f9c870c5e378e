/* Input sparsity of the FFN (TEAL on the FFN's two inputs), one token (input_ffn.c):
 *   gate, up   g|u = sum over inputs i with |x_i| > thr_in_i of x_i * gate_up_t[i]
 *              (the transposed gate and up side by side: the projections' column path,
 *              gh_matvec_t_sparse), biases added
 *   down       h = act(g, u); y = sum over j with |h_j| > thr_down_j of h_j * down_t[j]
 *              (gh_matmul_t_list over the kept rows: the sparse FFN's down path with a
 *              selection on the down projection's own input instead of a predictor)
 * thr_in NULL: every nonzero input (the dense result up to the order of the sums); thr_down
 * NULL: every nonzero h_j. Used by the gate FFN mode when the context runs input-sparse and
 * the layer's FFN input thresholds are not all 0 (ffn/exec.c); the gate's own thresholds
 * are then unused: the down rows are chosen by |h|, which reads the up value the gate
 * criterion guesses. A layer with only down thresholds keeps the gate mode's selection and
 * skips the down rows whose |h| does not pass (exec.c cpu_part). */
#ifndef GH_INPUT_FFN_H
#define GH_INPUT_FFN_H

#include "core/common.h"
#include "core/threadpool.h"
#include "cpu/ops.h"

typedef struct {
    const gh_weight * gate_up_t;   /* [n_embd rows][n_ff (x2 gated) cols] */
    const gh_weight * down_t;      /* [n_ff rows][n_embd cols] */
    const float *     thr_in;      /* [n_embd] or NULL */
    const float *     thr_down;    /* [n_ff] or NULL */
    const float *     gate_b, * up_b;
    int               act;
    float             act_t;
    bool              gated;
} gh_ffn_in_spec;

/* Scratch of one call: in_ids / in_a [n_embd], gu [gate_up_t->cols], a / down_a [n_ff],
 * down_ids [n_ff]. */
typedef struct {
    int32_t * in_ids;
    float *   in_a;
    float *   gu;
    float *   a;
    int32_t * down_ids;
    float *   down_a;
} gh_ffn_in_scratch;

/* y [n_embd] = the FFN of x [n_embd] (overwritten, down bias not added); *n_in, *n_down: the
 * inputs and down rows used. Returns the weight bytes read. */
double gh_ffn_input_sparse(gh_threadpool * tp, const gh_ffn_in_spec * f, const float * x, float * y,
                           const gh_ffn_in_scratch * w, int64_t * n_in, int64_t * n_down);

/* The down rows of h [n] kept by thr (|h_j| > thr_j; thr NULL: h_j != 0), ascending, into
 * ids / a; returns how many (branch-free). Also the gate mode's selection of its down rows. */
int64_t gh_select_down(const float * h, const float * thr, int64_t n, int32_t * ids, float * a);

#endif
