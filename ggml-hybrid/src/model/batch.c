/* Batches of several contexts (gh_eval_batch_ex): each context's next tokens (a decode
 * token, or a chunk of a prompt) in one forward pass, the engine of the server's
 * continuous batching. The pass is forward.c's own (gh_forward_batch) over the token rows
 * of every context together; only the attention tells the rows apart, each context's run of
 * rows joining and reading its own KV cache (gh_context.seq, .seq_pos). So a feature of the
 * forward pass (an architecture, a block kind) needs no change here. */
#include "model/model.h"
#include "model/placement.h"
#include "ffn/exec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Context i's token count (n_tokens NULL: one each, gh_eval_batch). */
static int32_t count_of(const int32_t * n_tokens, int32_t i) { return n_tokens ? n_tokens[i] : 1; }

/* What must hold before anything changes (contexts not yet claimed: the checks read only
 * what a call on another thread does not write, and are repeated for the mode under the
 * claim). *total = the batch's token rows. */
static gh_status check_batch(gh_context * const * ctxs, int32_t n, const int32_t * n_tokens,
                             const int32_t * tokens, int32_t * total) {
    if (!ctxs || !tokens || n <= 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: no contexts or tokens given (n = %d)", n);
    }
    const gh_context * c0 = ctxs[0];
    if (!c0) return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: context 0 is NULL");
    int64_t rows = 0;
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
                               "same context; give each context's tokens as one run", j, i);
            }
        }
        if (count_of(n_tokens, i) < 1) {
            return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: context %d is given %d tokens; "
                           "each context of a batch takes at least 1", i, count_of(n_tokens, i));
        }
        rows += count_of(n_tokens, i);
    }
    if (rows > c0->n_batch) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_batch: %lld tokens in all, but context 0 "
                       "(whose buffers the pass uses) takes batches of at most n_batch = %d "
                       "tokens", (long long) rows, c0->n_batch);
    }
    const int32_t n_vocab = c0->model->hp.n_vocab;
    for (int32_t t = 0; t < (int32_t) rows; t++) {
        if (tokens[t] < 0 || tokens[t] >= n_vocab) {
            return gh_fail(GH_ERR_RANGE, "token id %d at index %d is outside the vocabulary "
                           "[0, %d)", tokens[t], t, n_vocab);
        }
    }
    *total = (int32_t) rows;
    return GH_OK;
}

/* Checks that need the contexts claimed (their cache position and mode are stable). */
static gh_status check_claimed(gh_context * const * ctxs, int32_t n, const int32_t * n_tokens) {
    for (int32_t i = 0; i < n; i++) {
        const gh_context * c = ctxs[i];
        const int32_t k = count_of(n_tokens, i);
        if ((int64_t) c->n_past + k > c->n_ctx) {
            return gh_fail(GH_ERR_RANGE, "context full: context %d holds %d tokens of n_ctx = %d, "
                           "no room for its %d more", i, c->n_past, c->n_ctx, k);
        }
        if (n > 1 && (c->head_rows_on || c->n_skip)) {
            return gh_fail(GH_ERR_UNSUPPORTED, "gh_eval_batch: context %d drafts (head rows %d, "
                           "layers skipped %d); a drafting context runs alone (gh_eval)", i,
                           gh_context_get_head_rows(c), c->n_skip);
        }
        /* the pass runs one FFN for every row (in a sparse mode each row selecting its own
         * neurons): each context must evaluate its tokens as it would alone, as context 0 */
        const gh_context * c0 = ctxs[0];
        const int32_t k0 = count_of(n_tokens, 0);
        const bool s0 = gh_sparse_applies(c0, k0), s = gh_sparse_applies(c, k);
        if (s != s0 || (s && (c->ffn_mode != c0->ffn_mode ||
                              gh_input_sparse_applies(c, k) != gh_input_sparse_applies(c0, k0)))) {
            return gh_fail(GH_ERR_UNSUPPORTED, "gh_eval_batch: context %d evaluates its %d tokens "
                           "through FFN mode %d (%s, input sparsity %d), but context 0 its %d "
                           "through mode %d (%s, %d); a batch runs one FFN (set the contexts "
                           "alike)", i, k, c->ffn_mode, s ? "sparse" : "dense",
                           gh_input_sparse_applies(c, k), k0, c0->ffn_mode,
                           s0 ? "sparse" : "dense", gh_input_sparse_applies(c0, k0));
        }
    }
    return GH_OK;
}

/* The logit rows context i must hold: its own (all its tokens' or its last one's); context
 * 0's buffer receives the pass's rows of every context. */
static int32_t rows_needed(int32_t i, int32_t n, const int32_t * n_tokens, int32_t total,
                           int32_t logits_all) {
    if (i == 0) return logits_all ? total : n;
    return logits_all ? count_of(n_tokens, i) : 1;
}

/* Makes every context's logits hold its rows before anything changes: the new buffers are
 * all allocated first (into fresh [n]), so running out of memory leaves every context as it
 * was. The rows' old values are not kept: the pass overwrites them. */
static gh_status reserve_logits(gh_context * const * ctxs, int32_t n, const int32_t * n_tokens,
                                int32_t total, int32_t logits_all, float ** fresh) {
    const int32_t n_vocab = ctxs[0]->model->hp.n_vocab;
    gh_status st = GH_OK;
    for (int32_t i = 0; i < n; i++) {
        const int32_t need = rows_needed(i, n, n_tokens, total, logits_all);
        fresh[i] = NULL;
        if (need <= ctxs[i]->logits_cap || st) continue;
        fresh[i] = gh_aligned_alloc((size_t) need * n_vocab * sizeof(float));
        if (!fresh[i]) st = gh_fail(GH_ERR_OOM, "out of memory for %d rows of logits", need);
    }
    for (int32_t i = 0; i < n; i++) {
        if (!fresh[i]) continue;
        if (st) {
            gh_aligned_free(fresh[i]);
            continue;
        }
        gh_aligned_free(ctxs[i]->logits);
        ctxs[i]->logits = fresh[i];
        ctxs[i]->logits_cap = rows_needed(i, n, n_tokens, total, logits_all);
    }
    return st;
}

static gh_status run_batch(gh_context * const * ctxs, int32_t n, const int32_t * n_tokens,
                           const int32_t * tokens, int32_t total, int32_t logits_all) {
    gh_context * w = ctxs[0]; /* lends the pass its buffers, threads and device stream */
    const size_t n_vocab = (size_t) w->model->hp.n_vocab;
    /* each row's context and position, and the contexts' new logit buffers (a few bytes
     * per token, once per pass) */
    gh_context ** seq = malloc((size_t) total * sizeof *seq + (size_t) n * sizeof(float *) +
                               (size_t) total * sizeof(int32_t));
    if (!seq) return gh_fail(GH_ERR_OOM, "out of memory for a batch of %d tokens", total);
    float ** fresh = (float **) (seq + total);
    int32_t * pos = (int32_t *) (fresh + n);
    gh_status st = reserve_logits(ctxs, n, n_tokens, total, logits_all, fresh);
    if (st) {
        free(seq);
        return st;
    }
    for (int32_t i = 0, t = 0; i < n; i++) {
        for (int32_t j = 0; j < count_of(n_tokens, i); j++, t++) {
            seq[t] = ctxs[i];
            pos[t] = ctxs[i]->n_past + j;
        }
    }
    w->seq = seq;
    w->seq_pos = pos;
    st = gh_forward_batch(w, tokens, total, logits_all ? GH_LOGITS_ALL : GH_LOGITS_LAST, 0);
    w->seq = NULL;
    w->seq_pos = NULL;
    free(seq);
    if (st) {
        /* a device op failed: no context's position moved, so no token is in a cache */
        for (int32_t i = 0; i < n; i++) ctxs[i]->n_logit_rows = 0;
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", gh_last_error());
        return gh_fail(st, "device '%s' failed during gh_eval_batch (no context "
                       "changed): %s", w->model->hy->info.device, msg);
    }
    /* the pass's rows are in w->logits in the contexts' order (each context's last row, or
     * all of its rows); context 0's come first, so they are already in place */
    for (int32_t i = 0, row = 0; i < n; i++) {
        gh_context * c = ctxs[i];
        const int32_t k = logits_all ? count_of(n_tokens, i) : 1;
        if (i > 0) memcpy(c->logits, w->logits + row * n_vocab, k * n_vocab * sizeof(float));
        row += k;
        c->n_logit_rows = k;
        c->n_past += count_of(n_tokens, i);
    }
    return GH_OK;
}

gh_status gh_eval_batch_ex(gh_context * const * ctxs, int32_t n, const int32_t * n_tokens,
                           const int32_t * tokens, int32_t logits_all) {
    int32_t total = 0;
    gh_status st = check_batch(ctxs, n, n_tokens, tokens, &total);
    if (st) return st;
    int32_t claimed = 0;
    while (claimed < n && !(st = gh_ctx_enter(ctxs[claimed], "gh_eval_batch"))) claimed++;
    if (!st) st = check_claimed(ctxs, n, n_tokens);
    if (!st) st = run_batch(ctxs, n, n_tokens, tokens, total, logits_all);
    while (claimed > 0) gh_ctx_leave(ctxs[--claimed]);
    return st;
}

gh_status gh_eval_batch(gh_context * const * ctxs, int32_t n, const int32_t * tokens) {
    return gh_eval_batch_ex(ctxs, n, NULL, tokens, 0);
}
