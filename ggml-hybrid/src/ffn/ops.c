/* The FFN's row kernels as ops on raw buffers, for the tests (ggml-hybrid.h:
 * gh_op_sparse_*): each checks its arguments, wraps the buffers as weights and runs the
 * kernel the executor runs. */
#include "ffn/rows.h"
#include "types/types.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------- ops on raw buffers (tests) -- */

static gh_status check_matrix(const char * fn, const char * what, int type, const void * w,
                              int64_t rows, int64_t cols) {
    if (!gh_type_valid(type)) return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown type %d for %s", fn, type, what);
    if (!w) return gh_fail(GH_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
    if (rows <= 0 || cols <= 0 || rows > INT32_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %s has %lld x %lld elements", fn, what,
                       (long long) rows, (long long) cols);
    }
    if (cols % gh_type_block_size(type)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %s's row length %lld is not a multiple of %s's "
                       "block size %lld", fn, what, (long long) cols, gh_type_name(type),
                       (long long) gh_type_block_size(type));
    }
    uint64_t bytes;
    if (!gh_mul_ok((uint64_t) rows, gh_row_size(type, cols), &bytes) || bytes > (uint64_t) PTRDIFF_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %s's size overflows", fn, what);
    }
    return GH_OK;
}

static gh_status check_ids(const char * fn, const int32_t * ids, int64_t n, int64_t rows) {
    if (n < 0) return gh_fail(GH_ERR_INVALID_ARG, "%s: negative list length %lld", fn, (long long) n);
    if (n > 0 && !ids) return gh_fail(GH_ERR_INVALID_ARG, "%s: ids is NULL", fn);
    for (int64_t k = 0; k < n; k++) {
        if (ids[k] < 0 || ids[k] >= rows) {
            return gh_fail(GH_ERR_RANGE, "%s: ids[%lld] = %d is outside [0, %lld)", fn,
                           (long long) k, ids[k], (long long) rows);
        }
    }
    return GH_OK;
}

/* *tp: NULL for one thread; *cached: whether it is the kept pool (op_pool_release). */
static gh_status op_pool(const char * fn, int n_threads, gh_threadpool ** tp, bool * cached) {
    if (n_threads < 1 || n_threads > 512) {
        *tp = NULL;
        *cached = false;
        return gh_fail(GH_ERR_INVALID_ARG, "%s: n_threads %d out of range [1, 512]", fn, n_threads);
    }
    return (gh_status) gh_op_pool_acquire(n_threads, tp, cached);
}

static void op_pool_release(gh_threadpool * tp, bool cached) { gh_op_pool_release(tp, cached); }

static gh_weight make_weight(int type, const void * w, int64_t rows, int64_t cols) {
    gh_weight wt = { .type = type, .rows = rows, .cols = cols, .data = w,
                     .row_bytes = gh_row_size(type, cols) };
    return wt;
}

gh_status gh_op_sparse_predict(int fc1_type, const void * fc1, int fc2_type, const void * fc2,
                               int64_t n_embd, int64_t h, int64_t n_ff, const float * x,
                               float threshold, int32_t * active, int64_t * n_active,
                               float * score, int n_threads) {
    static const char fn[] = "gh_op_sparse_predict";
    gh_status st;
    if ((st = check_matrix(fn, "fc1", fc1_type, fc1, h, n_embd))) return st;
    if ((st = check_matrix(fn, "fc2", fc2_type, fc2, n_ff, h))) return st;
    if (!x || !active || !n_active) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    gh_weight w1 = make_weight(fc1_type, fc1, h, n_embd), w2 = make_weight(fc2_type, fc2, n_ff, h);
    float * ph = gh_aligned_alloc((size_t) h * sizeof(float));
    float * sc = score ? score : gh_aligned_alloc((size_t) n_ff * sizeof(float));
    void * scratch = gh_aligned_alloc(GH_MAX(gh_sparse_predict_scratch_size(&w1, &w2), 64));
    gh_threadpool * tp = NULL;
    bool cached = false;
    st = !ph || !sc || !scratch ? gh_fail(GH_ERR_OOM, "%s: out of memory", fn)
                                : op_pool(fn, n_threads, &tp, &cached);
    if (!st) *n_active = gh_sparse_predict(tp, &w1, &w2, x, threshold, ph, sc, active, scratch);
    if (!st) op_pool_release(tp, cached);
    gh_aligned_free(ph);
    if (sc != score) gh_aligned_free(sc);
    gh_aligned_free(scratch);
    return st;
}

gh_status gh_op_sparse_glu(int type, const void * gate, const void * up, int64_t rows,
                           int64_t cols, int act, float act_t, const float * x,
                           const int32_t * ids, int64_t n, float * a, int n_threads) {
    static const char fn[] = "gh_op_sparse_glu";
    gh_status st;
    if ((st = check_matrix(fn, "gate", type, gate, rows, cols))) return st;
    if (up && (st = check_matrix(fn, "up", type, up, rows, cols))) return st;
    if (act < GH_ACT_SILU || act > GH_ACT_FATRELU) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown activation %d", fn, act);
    }
    if (act == GH_ACT_DRELU && !up) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: dReLU needs up (it has no ungated form)", fn);
    }
    if (!isfinite(act_t)) return gh_fail(GH_ERR_INVALID_ARG, "%s: threshold must be finite", fn);
    if ((st = check_ids(fn, ids, n, rows))) return st;
    if (!x || (n > 0 && !a)) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    gh_weight wg = make_weight(type, gate, rows, cols), wu = make_weight(type, up, rows, cols);
    const gh_glu_spec f = { .act = act, .act_t = act_t, .gate = &wg, .up = up ? &wu : NULL };
    const size_t nb = (size_t) GH_MAX(n, 1) * sizeof(float);
    float * gc = gh_aligned_alloc(nb), * uc = gh_aligned_alloc(nb);
    void * xq = gh_aligned_alloc(GH_MAX(gh_sparse_glu_scratch_size(&wg, f.up), 64));
    gh_threadpool * tp = NULL;
    bool cached = false;
    st = !gc || !uc || !xq ? gh_fail(GH_ERR_OOM, "%s: out of memory", fn)
                           : op_pool(fn, n_threads, &tp, &cached);
    if (!st) gh_sparse_glu(tp, &f, x, NULL, ids, n, a, gc, uc, xq, NULL);
    if (!st) op_pool_release(tp, cached);
    gh_aligned_free(gc);
    gh_aligned_free(uc);
    gh_aligned_free(xq);
    return st;
}

gh_status gh_op_sparse_down(int type, const void * w, int64_t rows, int64_t cols,
                            const int32_t * ids, const float * a, int64_t n, float * y,
                            int n_threads) {
    static const char fn[] = "gh_op_sparse_down";
    gh_status st;
    if ((st = check_matrix(fn, "w", type, w, rows, cols))) return st;
    if ((st = check_ids(fn, ids, n, rows))) return st;
    if (!y || (n > 0 && !a)) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    gh_weight wt = make_weight(type, w, rows, cols);
    gh_threadpool * tp = NULL;
    bool cached;
    if ((st = op_pool(fn, n_threads, &tp, &cached))) return st;
    gh_matmul_t_list(tp, &wt, ids, a, n, y);
    op_pool_release(tp, cached);
    return GH_OK;
}

gh_status gh_op_sparse_glu_union(int type, const void * gate, const void * up, int64_t rows,
                                 int64_t cols, int act, float act_t, const float * x, int32_t n,
                                 const uint8_t * mask, float * a, int n_threads) {
    static const char fn[] = "gh_op_sparse_glu_union";
    gh_status st;
    if ((st = check_matrix(fn, "gate", type, gate, rows, cols))) return st;
    if (up && (st = check_matrix(fn, "up", type, up, rows, cols))) return st;
    if (act < GH_ACT_SILU || act > GH_ACT_FATRELU) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown activation %d", fn, act);
    }
    if (act == GH_ACT_DRELU && !up) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: dReLU needs up (it has no ungated form)", fn);
    }
    if (!isfinite(act_t)) return gh_fail(GH_ERR_INVALID_ARG, "%s: threshold must be finite", fn);
    if (n < 1 || n > GH_UNION_MAX) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %d tokens, not in [1, %d]", fn, n, GH_UNION_MAX);
    }
    if (!x || !mask || !a) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    gh_weight wg = make_weight(type, gate, rows, cols), wu = make_weight(type, up, rows, cols);
    const gh_glu_spec f = { .act = act, .act_t = act_t, .gate = &wg, .up = up ? &wu : NULL };
    const size_t stride = (GH_MAX(gh_sparse_glu_scratch_size(&wg, f.up), 64) + 63) & ~(size_t) 63;
    const size_t fb = (size_t) n * (size_t) rows * sizeof(float);
    uint64_t * tm = gh_aligned_alloc((size_t) rows * sizeof(uint64_t));
    uint64_t * utm = gh_aligned_alloc((size_t) rows * sizeof(uint64_t));
    int32_t * uids = gh_aligned_alloc((size_t) rows * sizeof(int32_t));
    float * gc = gh_aligned_alloc(fb), * uc = gh_aligned_alloc(fb);
    float * cg = gh_aligned_alloc((size_t) rows * sizeof(float));
    float * cu = gh_aligned_alloc((size_t) rows * sizeof(float));
    float * ca = gh_aligned_alloc((size_t) rows * sizeof(float));
    void * xq = gh_aligned_alloc((size_t) n * stride);
    gh_threadpool * tp = NULL;
    bool cached = false;
    st = !tm || !utm || !uids || !gc || !uc || !cg || !cu || !ca || !xq
             ? gh_fail(GH_ERR_OOM, "%s: out of memory", fn) : op_pool(fn, n_threads, &tp, &cached);
    if (!st) {
        /* the union and each neuron's tokens */
        int64_t nu = 0;
        for (int64_t i = 0; i < rows; i++) {
            tm[i] = 0;
            for (int32_t t = 0; t < n; t++) if (mask[(int64_t) t * rows + i]) tm[i] |= (uint64_t) 1 << t;
            uids[nu] = (int32_t) i;
            utm[nu] = tm[i];
            nu += tm[i] != 0;
        }
        gh_union_glu_rows(tp, &f, x, n, NULL, 0, uids, utm, nu, gc, uc, rows, xq, stride, NULL);
        /* each token's own list, in its order, through the activation (the executor's
         * batch path, ffn/exec.c) */
        const bool skip_up = act == GH_ACT_RELU || act == GH_ACT_DRELU || act == GH_ACT_FATRELU;
        const float cut = act == GH_ACT_FATRELU ? act_t : 0.0f;
        for (int32_t t = 0; t < n; t++) {
            float * at = a + (int64_t) t * rows;
            for (int64_t i = 0; i < rows; i++) at[i] = 0.0f;
            int64_t m = 0;
            for (int64_t k = 0; k < nu; k++) {
                if (!(utm[k] & ((uint64_t) 1 << t))) continue;
                const float g = gc[(int64_t) t * rows + k];
                cg[m] = g;
                cu[m] = !up || (skip_up && !(g > cut)) ? 0.0f : uc[(int64_t) t * rows + k];
                m++;
            }
            gh_glu(act, act_t, cg, up ? cu : NULL, ca, m);
            m = 0;
            for (int64_t k = 0; k < nu; k++) {
                if (utm[k] & ((uint64_t) 1 << t)) at[uids[k]] = ca[m++];
            }
        }
        op_pool_release(tp, cached);
    }
    gh_aligned_free(tm);
    gh_aligned_free(utm);
    gh_aligned_free(uids);
    gh_aligned_free(gc);
    gh_aligned_free(uc);
    gh_aligned_free(cg);
    gh_aligned_free(cu);
    gh_aligned_free(ca);
    gh_aligned_free(xq);
    return st;
}
