/* Input sparsity of the FFN (see input_ffn.h), and its op on raw buffers for the tests. */
#include "ffn/input_ffn.h"
#include "types/types.h"

#include <math.h>
#include <stdlib.h>

int64_t gh_select_down(const float * h, const float * thr, int64_t n, int32_t * ids, float * a) {
    /* branch-free as the projections' input test: whether a row passes is unpredictable */
    int64_t k = 0;
    if (thr) {
        for (int64_t j = 0; j < n; j++) {
            ids[k] = (int32_t) j;
            a[k] = h[j];
            k += fabsf(h[j]) > thr[j]; /* NaN: skipped */
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            ids[k] = (int32_t) j;
            a[k] = h[j];
            k += h[j] != 0.0f;
        }
    }
    return k;
}

double gh_ffn_input_sparse(gh_threadpool * tp, const gh_ffn_in_spec * f, const float * x, float * y,
                           const gh_ffn_in_scratch * w, int64_t * n_in, int64_t * n_down) {
    const int64_t ff = f->down_t->rows;
    const int64_t ni = gh_matvec_t_sparse(tp, f->gate_up_t, x, f->thr_in, w->in_ids, w->in_a, w->gu);
    float * g = w->gu, * u = f->gated ? w->gu + ff : NULL;
    if (f->gate_b) for (int64_t j = 0; j < ff; j++) g[j] += f->gate_b[j];
    if (u && f->up_b) for (int64_t j = 0; j < ff; j++) u[j] += f->up_b[j];
    gh_glu(f->act, f->act_t, g, u, w->a, ff);
    const int64_t nd = gh_select_down(w->a, f->thr_down, ff, w->down_ids, w->down_a);
    gh_matmul_t_list(tp, f->down_t, w->down_ids, w->down_a, nd, y);
    if (n_in) *n_in = ni;
    if (n_down) *n_down = nd;
    return (double) ni * (double) f->gate_up_t->row_bytes + (double) nd * (double) f->down_t->row_bytes;
}

/* ---- the op on raw buffers (tests) ---- */

gh_status gh_op_ffn_input_sparse(int type, const void * gate_up_t, int down_type, const void * down_t,
                                 int64_t n_embd, int64_t n_ff, int32_t gated, int32_t act, float act_t,
                                 const float * x, const float * thr_in, const float * thr_down, float * y,
                                 int64_t * n_in, int64_t * n_down, int n_threads) {
    static const char fn[] = "gh_op_ffn_input_sparse";
    if (!gh_type_valid(type) || !gh_type_valid(down_type)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown weight type (%d, %d)", fn, type, down_type);
    }
    const int64_t cols = gated ? 2 * n_ff : n_ff;
    if (n_embd <= 0 || n_ff <= 0 || n_embd > INT32_MAX || n_ff > INT32_MAX / 2) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: sizes must be positive (n_embd %lld, n_ff %lld)", fn,
                       (long long) n_embd, (long long) n_ff);
    }
    if (cols % gh_type_block_size(type) || n_embd % gh_type_block_size(down_type)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: gate_up_t's rows (%lld) or down_t's rows (%lld) are not "
                       "whole blocks of their types", fn, (long long) cols, (long long) n_embd);
    }
    if (act < GH_ACT_SILU || act > GH_ACT_FATRELU || (act == GH_ACT_DRELU && !gated)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: activation %d is unknown or needs up", fn, act);
    }
    if (!gate_up_t || !down_t || !x || !y) return gh_fail(GH_ERR_INVALID_ARG, "%s: NULL buffer", fn);
    if (n_threads < 1 || n_threads > 512) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: n_threads %d out of range [1, 512]", fn, n_threads);
    }
    const gh_weight wg = { .type = type, .rows = n_embd, .cols = cols, .data = gate_up_t,
                           .row_bytes = gh_row_size(type, cols) };
    const gh_weight wd = { .type = down_type, .rows = n_ff, .cols = n_embd, .data = down_t,
                           .row_bytes = gh_row_size(down_type, n_embd) };
    const gh_ffn_in_spec f = { .gate_up_t = &wg, .down_t = &wd, .thr_in = thr_in, .thr_down = thr_down,
                               .act = act, .act_t = act_t, .gated = gated != 0 };
    gh_ffn_in_scratch w = {
        .in_ids = malloc((size_t) n_embd * sizeof(int32_t)), .in_a = malloc((size_t) n_embd * sizeof(float)),
        .gu = malloc((size_t) cols * sizeof(float)), .a = malloc((size_t) n_ff * sizeof(float)),
        .down_ids = malloc((size_t) n_ff * sizeof(int32_t)), .down_a = malloc((size_t) n_ff * sizeof(float)),
    };
    gh_status st = GH_OK;
    gh_threadpool * tp = NULL;
    bool kept = false;
    if (!w.in_ids || !w.in_a || !w.gu || !w.a || !w.down_ids || !w.down_a) {
        st = gh_fail(GH_ERR_OOM, "%s: out of memory", fn);
    } else if (gh_op_pool_acquire(n_threads, &tp, &kept)) {
        st = GH_ERR_OOM; /* message set */
    } else {
        gh_ffn_input_sparse(tp, &f, x, y, &w, n_in, n_down);
        gh_op_pool_release(tp, kept);
    }
    free(w.in_ids);
    free(w.in_a);
    free(w.gu);
    free(w.a);
    free(w.down_ids);
    free(w.down_a);
    return st;
}
