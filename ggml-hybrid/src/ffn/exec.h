/* The FFN executor (exec.c): one token's FFN in a sparse mode. The context's strategy
 * (strategy.h) selects the active neurons into an id list; the executor computes gate/up
 * over the list and down_t's axpy, with the layer's one hot/cold split: the device takes
 * the listed neurons it holds, the CPU the rest, then sync and merge. Its per-context
 * buffers are a gh_ffn_state (model.h holds a pointer to it). */
#ifndef GH_FFN_EXEC_H
#define GH_FFN_EXEC_H

#include "core/common.h"

/* Batches of at most this many tokens run the sparse FFN token by token; larger ones
 * (prompts) run dense, since a batch needs the union of its tokens' neurons. Measured:
 * README "Sparse FFN". gh_context_set_sparse_batch changes it per context. */
#define GH_SPARSE_BATCH_MAX_DEFAULT 4

struct gh_context;
struct gh_model;
struct gh_layer;
typedef struct gh_ffn_state gh_ffn_state;
typedef struct gh_dsplit gh_dsplit; /* model/placement.h */

/* NULL on out-of-memory (message set). */
/* n_batch: the context's largest batch (the batched decode's buffers hold
 * min(n_batch, GH_UNION_MAX) tokens). */
gh_ffn_state * gh_ffn_state_new(const struct gh_model * m, int32_t n_batch);
void gh_ffn_state_free(gh_ffn_state * s);

/* Whether the FFN of a batch of n tokens runs through the executor (the mode selects,
 * n <= the context's sparse batch limit and the FFN's input and mask are not being
 * profiled). */
bool gh_sparse_applies(const struct gh_context * c, int32_t n);
/* Whether the projections of a batch of n tokens run input-sparse (the context has it on,
 * the FFN runs through the executor and its strategy allows it). */
bool gh_input_sparse_applies(const struct gh_context * c, int32_t n);
/* One token's FFN of layer il in the context's mode: y = FFN(x) (x already normed; resid:
 * the residual stream x was normed from, which PowerInfer's predictors read). Returns a
 * device error (of the device's gate, predictor or hot rows; y is then not to be read). */
gh_status gh_sparse_ffn(struct gh_context * c, int il, const float * x, const float * resid,
                        float * y);
/* One token's FFN of the unit L in the context's mode (moe.c: one expert of layer il
 * viewed as a layer, `expert` its id): the strategy's list, gate/up over it and down_t's
 * axpy, y overwritten, L's down bias added; with D (the expert's hot neurons on the
 * device, model/placement.h; NULL: none) the same hot/cold split as a dense layer's. Adds
 * the weight bytes read to *bytes (the caller counts them), puts the listed neurons in
 * *n_active and the device's share of them in *n_dev; returns a device error. */
gh_status gh_sparse_ffn_unit(struct gh_context * c, int il, const struct gh_layer * L,
                             int32_t expert, const gh_dsplit * D, const float * x, float * y,
                             double * bytes, int64_t * n_active, int64_t * n_dev);
/* The FFN of n tokens (rows of x, resid and y) in the context's mode: in a batched
 * decode (c->seq: tokens of different sequences) each token selects its own neurons and
 * gate/up run once over the union of the lists (dense matmuls past a union density of
 * GH_UNION_DENSE_CUT, exec.c), each token's activation and down_t axpy over its own list,
 * so each token's y is what gh_sparse_ffn gives it alone (bit for bit where the gathered
 * and the dense gate/up kernels agree; rows.h). Otherwise token by token. Returns the
 * first device error, which ends the layer. */
gh_status gh_sparse_ffn_batch(struct gh_context * c, int il, int32_t n, const float * x,
                              const float * resid, float * y);
/* The weight bytes a dense FFN pass over n tokens of layer il reads (down_t: only rows
 * that some token's activation needs, found from h = [n][n_ff] activations). */
double gh_dense_ffn_bytes(const struct gh_context * c, int il, int32_t n, const float * h);

#endif
