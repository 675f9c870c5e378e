/* Batched decode (gh_eval_batch): the next token of each of several contexts of one model
 * in one forward pass, the engine of the server's continuous batching. The pass is
 * forward.c's own (gh_forward_batch) over n token rows; only the attention tells the rows
 * apart, each row joining and reading its own context's KV cache (gh_context.seq). So a
 * feature of the forward pass (an architecture, a block kind) needs no change here. */
#include "model/model.h"
#include "backend/hybrid.h"
#include "ffn/exec.h"

#include <stdio.h>
#include <string.h>

/* What must hold before anything changes (contexts not yet claimed: the checks read only
 * what a call on another thread does not write, and are repeated for the mode under the
 * claim). */
static gh_status check_batch(gh_context * const * ctxs, int32_t n, const int32_t * tokens) {
    if (!ctxs || !tokens || n <= 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: no contexts or tokens given (n = %d)", n);
    }
    const gh_context * c0 = ctxs[0];
    if (!c0) return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: context 0 is NULL");
    if (n > c0->n_batch) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: %d contexts, but context 0 (whose "
                       "buffers the pass uses) takes batches of at most n_batch = %d tokens",
                       n, c0->n_batch);
    }
    const int32_t n_vocab = c0->model->hp.n_vocab;
    for (int32_t i = 0; i < n; i++) {
        const gh_context * c = ctxs[i];
        if (!c) return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: context %d is NULL", i);
        if (c->model != c0->model) {
            return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: context %d is of another model "
                           "than context 0; a batch runs one model's weights", i);
        }
        for (int32_t j = 0; j < i; j++) {
            if (ctxs[j] == c) {
                return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: contexts %d and %d are the "
                               "same context; a batch takes one token per context", j, i);
            }
        }
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return gh_fail(GH_ERR_RANGE, "token id %d at index %d is outside the vocabulary "
                           "[0, %d)", tokens[i], i, n_vocab);
        }
    }
    return GH_OK;
}

/* Checks that need the contexts claimed (their cache position and mode are stable). */
static gh_status check_claimed(gh_context * const * ctxs, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        const gh_context * c = ctxs[i];
        if (c->n_past + 1 > c->n_ctx) {
            return gh_fail(GH_ERR_RANGE, "context full: context %d holds %d tokens of n_ctx = %d, "
                           "no room for its next token", i, c->n_past, c->n_ctx);
        }
        /* the pass runs context 0's FFN mode for every row (each row selecting its own
         * neurons): the others must decode alone as it does */
        const gh_context * c0 = ctxs[0];
        if (c->ffn_mode != c0->ffn_mode || gh_sparse_applies(c, 1) != gh_sparse_applies(c0, 1) ||
            gh_input_sparse_applies(c, 1) != gh_input_sparse_applies(c0, 1)) {
            return gh_fail(GH_ERR_UNSUPPORTED, "gh_eval_batch: context %d decodes with FFN mode %d, "
                           "sparse batch %d, input sparsity %d, but context 0 with %d, %d, %d; a "
                           "batch runs one FFN mode (set the contexts alike)", i, c->ffn_mode,
                           c->sparse_batch > 0, c->input_sparse, c0->ffn_mode,
                           c0->sparse_batch > 0, c0->input_sparse);
        }
    }
    return GH_OK;
}

static gh_status run_batch(gh_context * const * ctxs, int32_t n, const int32_t * tokens) {
    gh_context * w = ctxs[0]; /* lends the pass its buffers, threads and device stream */
    const int32_t n_vocab = w->model->hp.n_vocab;
    if (n > w->logits_cap) {
        float * l = gh_aligned_alloc((size_t) n * n_vocab * sizeof(float));
        if (!l) return gh_fail(GH_ERR_OOM, "out of memory for %d rows of logits", n);
        gh_aligned_free(w->logits);
        w->logits = l;
        w->logits_cap = n;
    }
    w->dev_status = GH_OK;
    w->seq = ctxs;
    const double t0 = gh_now();
    gh_forward_batch(w, tokens, n, GH_LOGITS_ALL, 0);
    w->seq = NULL;
    gh_stats_tokens(&w->stats, n, gh_now() - t0);
    if (w->dev_status) {
        /* a device op failed: no context's position moved, so no token is in a cache */
        for (int32_t i = 0; i < n; i++) ctxs[i]->n_logit_rows = 0;
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", gh_last_error());
        return gh_fail(w->dev_status, "device '%s' failed during gh_eval_batch (no context "
                       "changed): %s", w->model->hy->info.device, msg);
    }
    for (int32_t i = 0; i < n; i++) {
        gh_context * c = ctxs[i];
        /* row i is context i's; context 0's is already its row 0 */
        if (i > 0) memcpy(c->logits, w->logits + (size_t) i * n_vocab, (size_t) n_vocab * sizeof(float));
        c->n_logit_rows = 1;
        c->n_past += 1;
    }
    return GH_OK;
}

gh_status gh_eval_batch(gh_context * const * ctxs, int32_t n, const int32_t * tokens) {
    gh_status st = check_batch(ctxs, n, tokens);
    if (st) return st;
    int32_t claimed = 0;
    while (claimed < n && !(st = gh_ctx_enter(ctxs[claimed], "gh_eval_batch"))) claimed++;
    if (!st) st = check_claimed(ctxs, n);
    if (!st) st = run_batch(ctxs, n, tokens);
    while (claimed > 0) gh_ctx_leave(ctxs[--claimed]);
    return st;
}
