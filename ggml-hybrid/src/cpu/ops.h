/* CPU ops used by the forward pass. Weight tensors are rows x cols, rows contiguous. */
#ifndef GH_OPS_H
#define GH_OPS_H

#include "core/common.h"
#include "core/threadpool.h"

typedef struct {
    int         type;     /* gh_type */
    int64_t     rows;     /* ne[1]: output features */
    int64_t     cols;     /* ne[0]: input features (contiguous) */
    const void* data;
    size_t      row_bytes;
} gh_weight;

/* Scratch the matmul needs to convert activations to the weight's vec_dot_type:
 * at least gh_matmul_scratch_size(w, n_tokens) bytes, 64-byte aligned. */
size_t gh_matmul_scratch_size(const gh_weight * w, int64_t n_tokens);

/* y[t][r] = W[r] . x[t]; x is [n_tokens][cols], y is [n_tokens][rows] (row stride
 * ldy floats, so a caller can write into a wider buffer). Threads split rows. */
void gh_matmul(gh_threadpool * tp, const gh_weight * w, const float * x, int64_t n_tokens,
               float * y, int64_t ldy, void * scratch);

/* Several matmuls of the same x: ys[i] = ws[i] x, each as gh_matmul would compute it,
 * bit for bit. Weights of one type and width (up to 4) run as one pool job, x converted
 * once and one wait for the threads; otherwise one after another. */
void gh_matmul_multi(gh_threadpool * tp, const gh_weight * const * ws, int nw, const float * x,
                     int64_t n_tokens, float * const * ys, const int64_t * ldys, void * scratch);

/* Transposed matmul (axpy.c): y[t][c] = sum_r h[t][r] * W[r][c] for c < w->cols, the
 * down projection through ffn_down_t (W row r = neuron r's output vector). h is
 * [n_tokens] rows of ldh floats (>= w->rows), y [n_tokens] rows of ldy floats
 * (overwritten). Threads split y's columns in block-aligned chunks and each sweeps
 * every row for its columns (no reduction, so results do not depend on the thread
 * count); rows whose h is zero are skipped. A batch of up to 16 tokens gives each token
 * what it gets alone (n_tokens 1), bit for bit (axpy.c, AXPY_EXACT_MAX). */
void gh_matmul_t(gh_threadpool * tp, const gh_weight * w, const float * h, int64_t n_tokens,
                 int64_t ldh, float * y, int64_t ldy);

/* The same for one token over a list of rows (the sparse FFN): y[c] = sum_k a[k] *
 * W[ids[k]][c] for c < w->cols, terms with a[k] == 0 skipped, y overwritten; ids in any
 * order (sorted reads W in order), each < w->rows. gh_matmul_t of one token equals this
 * with the ids of its nonzero h, ascending, bit for bit. */
void gh_matmul_t_list(gh_threadpool * tp, const gh_weight * w, const int32_t * ids,
                      const float * a, int64_t n, float * y);
/* Input-sparse matvec, the projections' sparse path: the inputs i with |x[i]| > thr[i]
 * (thr NULL: x[i] != 0), gathered in ascending order into ids / a (w->rows capacity), then
 * their rows of w (rows = input channels, a transposed projection) summed into y (w->cols,
 * overwritten) by gh_matmul_t_list. Returns the number of inputs used. */
int64_t gh_matvec_t_sparse(gh_threadpool * tp, const gh_weight * w, const float * x,
                           const float * thr, int32_t * ids, float * a, float * y);

void gh_rmsnorm(const float * x, const float * w, int64_t n, float eps, float * y);
/* b may be NULL (no bias). */
void gh_layernorm(const float * x, const float * w, const float * b, int64_t n, float eps,
                  float * y);
/* cs[0..head_dim/2) = cos and cs[head_dim/2..head_dim) = sin of position pos's angles
 * (see gh_op_rope for freq_scale and freq_div): made once per token of a forward pass and
 * used by q and k of every layer. */
void gh_rope_angles(int head_dim, int32_t pos, float theta, float freq_scale,
                    const float * freq_div, float * cs);
/* Rotates the first n_rot dims of each of the n_head heads of x by the angles cs of
 * gh_rope_angles(n_rot, ...) (n_rot = head_dim: the whole head). */
void gh_rope(float * x, int n_head, int head_dim, int n_rot, const float * cs, int neox);
/* x[i] = c tanh(x[i] / c): soft-capping (Gemma 2's final logits), c > 0. */
void gh_softcap(float * x, int64_t n, float c);
/* gpt-oss's sigmoid gain in its clamped SwiGLU (GH_ACT_SWIGLU_OAI): swiglu_alpha of the
 * released configs, a constant in llama.cpp; the converter refuses other values. */
#define GH_SWIGLU_OAI_ALPHA 1.702f
/* out = act(gate) * up, or act(gate) when up is NULL; t: FATReLU's threshold, the clamped
 * SwiGLU's limit. */
void gh_glu(int act, float t, const float * gate, const float * up, float * out, int64_t n);
/* Causal attention over a KV cache; see gh_op_attention. Threads split tiles of the
 * query heads that share a kv head (times a few tokens), so each K/V row is read once per
 * GQA group; scores (and, for an F16/Q8_0 cache, f32 tiles of a block of its rows) live
 * on the stack, so no scratch is needed. */
void gh_attention(gh_threadpool * tp, const float * q, const void * k, const void * v,
                  int kv_type, float * out, int64_t n_tokens, int64_t n_past, int n_head,
                  int n_head_kv, int head_dim);
/* The same with the options some architectures add (Gemma): the scores' scale (instead of
 * 1/sqrt(head_dim)), soft-capping of the scaled scores (c tanh(s / c); 0: none) and a
 * sliding window (a query at position p sees the keys at p - window + 1 .. p; 0: all). */
typedef struct {
    float   scale;
    float   softcap;
    int64_t window;
    const float * sinks;  /* [n_head] a logit per query head that joins its softmax's
                           * denominator only (gpt-oss's attention sinks); NULL: none */
} gh_attn_opts;
void gh_attention_ex(gh_threadpool * tp, const float * q, const void * k, const void * v,
                     int kv_type, float * out, int64_t n_tokens, int64_t n_past, int n_head,
                     int n_head_kv, int head_dim, const gh_attn_opts * o);
/* GH_OK if a KV cache of kv_type (f32, f16, q8_0) can hold heads of head_dim values, else
 * GH_ERR_UNSUPPORTED with the reason. */
gh_status gh_kv_cache_type_check(int kv_type, int head_dim);

#endif
