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
 * count); rows whose h is zero are skipped. */
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

/* AVX-512 axpy kernels (axpy_avx512.c): y[0..n) += s * row, and four rows at once;
 * NULL for a type without one. */
typedef void (*gh_axpy_fn)(int64_t n, float s, const void * row, float * y);
typedef void (*gh_axpy4_fn)(int64_t n, const float * s, const void * const * row, float * y);
gh_axpy_fn gh_axpy_avx512(int type);
gh_axpy4_fn gh_axpy4_avx512(int type);
/* The four-row form that also prefetches the same column range of the rows pf[0..4) into
 * L2, a slice per step (scattered list rows stream in while these are added); the sums
 * are those of the gh_axpy4_fn, bit for bit. NULL where the level has none. */
typedef void (*gh_axpy4pf_fn)(int64_t n, const float * s, const void * const * row,
                              const void * const * pf, float * y);
gh_axpy4pf_fn gh_axpy4pf_avx512(int type);
/* The K-quants' AVX2 axpy kernels (avx2/axpy_avx2.c), the same three forms; NULL for
 * the other types (axpy.c has theirs). */
gh_axpy_fn gh_axpy_kq_avx2(int type);
gh_axpy4_fn gh_axpy4_kq_avx2(int type);
gh_axpy4pf_fn gh_axpy4pf_kq_avx2(int type);
/* Sixteen rows at once, y[0..n) += s[0] * row[0] + ... + s[15] * row[15], with the
 * rows pf[0..16) prefetched (pf may be NULL): the decode list's groups of 16, in int8
 * (avx2/axpy_avx2.c: the scaled rows are quantized like the int8 dots' activations, so
 * the sums differ from the float forms' by that rounding). NULL for a type without one. */
typedef void (*gh_axpy16_fn)(int64_t n, const float * s, const void * const * row,
                             const void * const * pf, float * y);
gh_axpy16_fn gh_axpy16_avx2(int type);
/* The batch form of up to four groups of 16 rows (avx2/axpy_avx2.c): for t < n_tokens,
 * y[t * ldy + 0..n) += sum_{k < nk} h[t * ldh + hc[k]] * row[k][0..n), nk <= 64, each token's
 * sums those of the gh_axpy16_fn over the rows 16 at a time in order (the last group padded
 * as if with rows whose h is 0). A prompt's dense blocks of the transposed matmul. NULL for
 * a type without one. */
typedef void (*gh_matmul16_fn)(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                               const int32_t * hc, int nk, const void * const * row, float * y,
                               int64_t ldy);
gh_matmul16_fn gh_matmul16_avx2(int type);
/* The same in VNNI (avx512/axpy_avx512.c), equal to the AVX2 form bit for bit. */
gh_matmul16_fn gh_matmul16_avx512(int type);

void gh_rmsnorm(const float * x, const float * w, int64_t n, float eps, float * y);
/* b may be NULL (no bias). */
void gh_layernorm(const float * x, const float * w, const float * b, int64_t n, float eps,
                  float * y);
/* cs[0..head_dim/2) = cos and cs[head_dim/2..head_dim) = sin of position pos's angles
 * (see gh_op_rope for freq_scale and freq_div): made once per token of a forward pass and
 * used by q and k of every layer. */
void gh_rope_angles(int head_dim, int32_t pos, float theta, float freq_scale,
                    const float * freq_div, float * cs);
void gh_rope(float * x, int n_head, int head_dim, const float * cs, int neox);
/* out = act(gate) * up, or act(gate) when up is NULL; t: FATReLU's threshold. */
void gh_glu(int act, float t, const float * gate, const float * up, float * out, int64_t n);
/* Causal attention over a KV cache; see gh_op_attention. Threads split tiles of the
 * query heads that share a kv head (times a few tokens), so each K/V row is read once per
 * GQA group; scores (and, for an F16/Q8_0 cache, f32 tiles of a block of its rows) live
 * on the stack, so no scratch is needed. */
void gh_attention(gh_threadpool * tp, const float * q, const void * k, const void * v,
                  int kv_type, float * out, int64_t n_tokens, int64_t n_past, int n_head,
                  int n_head_kv, int head_dim);
/* GH_OK if a KV cache of kv_type (f32, f16, q8_0) can hold heads of head_dim values, else
 * GH_ERR_UNSUPPORTED with the reason. */
gh_status gh_kv_cache_type_check(int kv_type, int head_dim);

#endif
