/* The FFN's row kernels over a list of neurons (rows.c), which every strategy and the
 * executor (exec.c) share:
 *   predict      ph = relu(fc1 . x); score = fc2 . ph; active = { i : score_i >= thr }
 *   sparse GLU   for each listed i: g_i = gate_i . x, u_i = up_i . x, a_i = act(g_i, u_i)
 *                (biases added; an ungated FFN has its up rows as "gate" and u_i = 1)
 *   row-dots     out_k = w[ids_k] . x
 * The down projection over a list, y = sum_k a_k * down_t[ids_k], is gh_matmul_t_list
 * (cpu/ops.h, cpu/axpy.c). */
#ifndef GH_FFN_ROWS_H
#define GH_FFN_ROWS_H

#include "core/common.h"
#include "cpu/ops.h"
#include "core/threadpool.h"

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
 * neuron ids[k], with g = gate_g[ids[k]] when gate_g is given (computed before, bias
 * included) else gate[ids[k]] . x + gate_b, and u = up[ids[k]] . x + up_b (u = 1 when
 * ungated). With a ReLU-family activation (relu, drelu, fatrelu) a neuron whose g <= its
 * cut has a = 0 and its up row is not read.
 * gc, uc: [n] scratch for the compact g and u; xq: gh_sparse_glu_scratch_size bytes.
 * Threads split the list in contiguous chunks of equal length. If up_rows_read is not
 * NULL it receives the number of up rows read. */
size_t gh_sparse_glu_scratch_size(const gh_weight * gate, const gh_weight * up);
void gh_sparse_glu(gh_threadpool * tp, const gh_glu_spec * f, const float * x,
                   const float * gate_g, const int32_t * ids, int64_t n, float * a, float * gc,
                   float * uc, void * xq, int64_t * up_rows_read);

/* out[k] = w[ids[k]] . x for k < n (xq: gh_matmul_scratch_size(w, 1) bytes for the
 * converted x). */
void gh_list_rows_dot(gh_threadpool * tp, const gh_weight * w, const float * x,
                      const int32_t * ids, int64_t n, float * out, void * xq);

/* The most tokens one union call takes (a bit each in the membership masks). */
#define GH_UNION_MAX 64

/* Gate/up for n (<= GH_UNION_MAX) tokens over the union of their lists: ids[0..nu) the
 * union (ascending), tm[k] with bit t set when token t lists ids[k]. For each token t and
 * position k whose bit is set: gc[t * ld + k] = g (gate_g[t * ld_g + ids[k]] when gate_g
 * is given, else gate[ids[k]] . x_t + gate_b), uc[t * ld + k] = u as gh_sparse_glu computes
 * it (a ReLU-family g at or below its cut leaves u = 0, its up row unread); elsewhere 0.
 * x: [n][cols]. xq: n slices of xq_stride >= gh_sparse_glu_scratch_size bytes (64-byte
 * aligned). The activation is the caller's, on each token's own list.
 *
 * Each block of UNION_BLOCK union rows is dotted with every token while it is in cache, so
 * a row is read from memory once for the batch. A value is gh_sparse_glu's for the same
 * token bit for bit where the type has the gathered four-row tile (dot4: one kernel per
 * row whatever its neighbours; every type the AVX2 and AVX-512 tables give one); without
 * it runs of consecutive rows take the multi-row tile, whose grouping follows the list, so
 * a value may differ by the rounding of the dot's summation order. *up_rows_read (may be
 * NULL): up-row dots summed over the tokens. */
void gh_union_glu_rows(gh_threadpool * tp, const gh_glu_spec * f, const float * x, int n,
                       const float * gate_g, int64_t ld_g, const int32_t * ids,
                       const uint64_t * tm, int64_t nu, float * gc, float * uc, int64_t ld,
                       void * xq, size_t xq_stride, int64_t * up_rows_read);

#endif
