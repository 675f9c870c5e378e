/* Sparse FFN (sparse.c): the predictor, gate/up row-dots over a list of neurons, and
 * the per-token sparse feed-forward of a layer with its statistics.
 *
 * One token's FFN in the sparse modes:
 *   predict      ph = relu(fc1 . x); score = fc2 . ph; active = { i : score_i >= thr }
 *   sparse GLU   for each active i: g_i = gate_i . x, u_i = up_i . x, a_i = act(g_i, u_i)
 *                (biases added; an ungated FFN has its up rows as "gate" and u_i = 1)
 *   sparse down  y = sum_{active i, a_i != 0} a_i * down_t[i] + b_down   (gh_matmul_t_list)
 * The oracle mode computes gate densely instead of predicting and takes as active the
 * neurons whose activation is nonzero, which gives the dense result (tests). */
#ifndef GH_SPARSE_H
#define GH_SPARSE_H

#include "core/common.h"
#include "cpu/ops.h"
#include "core/threadpool.h"

/* Batches of at most this many tokens run the sparse FFN token by token; larger ones
 * (prompts) run dense, since a batch needs the union of its tokens' neurons. Measured:
 * README "Sparse FFN". gh_context_set_sparse_batch changes it per context. */
#define GH_SPARSE_BATCH_MAX_DEFAULT 4

/* Predictor: ph = relu(fc1 . x) [fc1->rows], score = fc2 . ph [fc2->rows]; writes the
 * neurons with score >= threshold to active[] in ascending order and returns how many.
 * scratch: gh_sparse_predict_scratch_size bytes, 64-byte aligned. */
size_t gh_sparse_predict_scratch_size(const gh_weight * fc1, const gh_weight * fc2);
int64_t gh_sparse_predict(gh_threadpool * tp, const gh_weight * fc1, const gh_weight * fc2,
                          const float * x, float threshold, float * ph, float * score,
                          int32_t * active, void * scratch);

/* An FFN's activation input: act (gh_act) with FATReLU's threshold act_t, the gate rows
 * (for an ungated FFN: its up rows), the up rows multiplied in (NULL: ungated), biases. */
typedef struct {
    int               act;
    float             act_t;
    const gh_weight * gate, * up;
    const float *     gate_b, * up_b;
} gh_glu_spec;

/* Sparse GLU over the list ids[0..n) (any order; ids < gate->rows): a[k] = act(g, u) for
 * neuron ids[k], with g = gate_g[ids[k]] when gate_g is given (the oracle computed gate
 * densely, bias included) else gate[ids[k]] . x + gate_b, and u = up[ids[k]] . x + up_b
 * (u = 1 when ungated). With a ReLU-family activation (relu, drelu, fatrelu) a neuron whose
 * g <= its cut has a = 0 and its up row is not read.
 * gc, uc: [n] scratch for the compact g and u; xq: gh_sparse_glu_scratch_size bytes.
 * Threads split the list in contiguous chunks of equal length. If up_rows_read is not
 * NULL it receives the number of up rows read. */
size_t gh_sparse_glu_scratch_size(const gh_weight * gate, const gh_weight * up);
void gh_sparse_glu(gh_threadpool * tp, const gh_glu_spec * f, const float * x,
                   const float * gate_g, const int32_t * ids, int64_t n, float * a, float * gc,
                   float * uc, void * xq, int64_t * up_rows_read);

/* The down projection over the list: gh_matmul_t_list (ops.h, axpy.c). */

/* ---- the per-context state (model.c holds a pointer to it) ---- */

struct gh_context;
struct gh_model;
typedef struct gh_sparse_state gh_sparse_state;

/* NULL on out-of-memory (message set). */
gh_sparse_state * gh_sparse_state_new(const struct gh_model * m);
void gh_sparse_state_free(gh_sparse_state * s);

/* Whether the FFN of a batch of n tokens runs through gh_sparse_ffn (mode is not dense,
 * n <= the context's sparse batch limit and the FFN's input and mask are not being
 * profiled). */
bool gh_sparse_applies(const struct gh_context * c, int32_t n);
/* Whether the projections of a batch of n tokens run input-sparse (the context has it on,
 * the FFN runs sparse or gate for the batch). */
bool gh_input_sparse_applies(const struct gh_context * c, int32_t n);
/* One token's FFN of layer il in the context's mode: y = FFN(x) (x already normed; resid:
 * the residual stream x was normed from, which PowerInfer's predictors read). */
void gh_sparse_ffn(struct gh_context * c, int il, const float * x, const float * resid, float * y);

/* Statistics hooks of the forward pass (stage times in seconds, weight bytes read). */
typedef enum { GH_STAGE_ATTENTION, GH_STAGE_PREDICTOR, GH_STAGE_FFN, GH_STAGE_OTHER,
               GH_STAGE_COUNT } gh_stage;
double gh_now(void);  /* monotonic seconds */
void gh_stats_add(struct gh_context * c, gh_stage stage, double seconds, double bytes);
/* A device call: its time on the device's clock, the CPU's wait for it, activation bytes
 * sent and received, and weight bytes the device read. */
void gh_stats_device(struct gh_context * c, double device_s, double wait_s, double up_bytes,
                     double down_bytes, double weight_bytes);
/* A dense FFN pass over n tokens: counts its weight bytes (down_t: only rows that some
 * token's activation needs, found from h = [n][n_ff] activations). */
void gh_stats_dense_ffn(struct gh_context * c, int il, int32_t n, const float * h);
/* After each forward call: n tokens and the call's seconds (the head counts its own bytes,
 * as a stage: gh_stats_add GH_STAGE_OTHER). */
void gh_stats_tokens(struct gh_context * c, int32_t n, double seconds);
/* Input-sparse projections: n_in input channels seen, n_used of them used, by the attention
 * (head false) or the head. */
void gh_stats_inputs(struct gh_context * c, bool head, int64_t n_in, int64_t n_used);

#endif
