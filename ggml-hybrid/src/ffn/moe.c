/* The mixture-of-experts FFN (see moe.h): router, top-k, experts grouped by the tokens
 * that chose them, the shared expert, and the per-layer selection counts.
 *
 * Every matrix product goes through gh_matmul / gh_matmul_multi on a view of the expert's
 * rows (gh_expert), so every weight type of the kernel table works and the threads split
 * each expert's rows as they split a dense weight's. Each output row is a sum over the
 * token's experts in ascending expert id, the same for any batch split and thread count. */
#include "ffn/moe.h"
#include "core/tap.h"
#include "ffn/exec.h"
#include "ffn/strategy.h"
#include "model/placement.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct gh_moe_state {
    int32_t   n_batch, n_expert, k, n_layer;
    float *   probs;   /* [n_batch][n_expert] router logits, then probabilities */
    float *   choice;  /* [6 n_expert] one token's route scratch (route) */
    int32_t * sel;     /* [n_batch][k] each token's experts */
    float *   sel_w;   /* [n_batch][k] and their weights */
    int32_t * start;   /* [n_expert + 1] each expert's first entry in tok / tok_w */
    int32_t * fill;    /* [n_expert] */
    int32_t * tok;     /* [n_batch * k] tokens grouped by expert (ascending in a group) */
    float *   tok_w;   /* [n_batch * k] their weights for that expert */
    float *   xg;      /* [n_batch][n_embd] the inputs of one expert's tokens */
    float *   hg, * hu;/* [n_batch][max(n_ff_exp, n_ff_shexp)] gate (then activated), up */
    float *   yg;      /* [n_batch][n_embd] one expert's outputs */
    void *    scratch; /* gh_matmul scratch for n_batch tokens of any expert weight */
    int64_t * counts;  /* [n_layer][n_expert] selections since the last reset */
    int64_t * act;     /* [n_batch] one layer's active neurons per token in a sparse step */
    /* a model on a device (NULL / 0 otherwise): each (token, expert) entry's output, kept
     * until the merge so that the sum runs in expert order as on the CPU; the device
     * experts' gate and up outputs; where each expert of the current layer runs */
    float *   ye;      /* [n_batch * k][n_embd] */
    float *   hgd, * hud; /* [n_batch * k][n_ff_exp] */
    const gh_dexpert ** dev; /* [n_expert] the device copy an expert runs from, or NULL */
    /* a shared expert on the device: its gate and up outputs (then the activation) and its
     * down's, apart from hg / hu / yg, which the CPU's experts use meanwhile */
    float *   shg, * shu;  /* [n_batch][n_ff_shexp] */
    float *   shy;         /* [n_batch][n_embd] */
    /* the expert cache (hy->cache_slots slots of hy->slot_bytes): LRU over all layers */
    gh_backend * b;
    int32_t    n_slots;
    void **    slot_mem;   /* [n_slots] device memory */
    gh_dexpert * slot_w;   /* [n_slots] the expert a slot holds, as a device weight */
    int64_t *  slot_key;   /* [n_slots] layer * n_expert + expert, or -1 (empty) */
    uint64_t * slot_used;  /* [n_slots] the layer call that last used it (0: never) */
    int32_t *  slot_of;    /* [n_layer * n_expert] the slot holding an expert, or -1 */
    uint64_t   tick;       /* layer calls so far */
    int64_t    runs_dev, runs_cpu, hits, misses;
    double     bytes_cache;
};

void gh_moe_state_free(gh_moe_state * s) {
    if (!s) return;
    gh_aligned_free(s->probs);
    gh_aligned_free(s->choice);
    gh_aligned_free(s->sel);
    gh_aligned_free(s->sel_w);
    gh_aligned_free(s->start);
    gh_aligned_free(s->fill);
    gh_aligned_free(s->tok);
    gh_aligned_free(s->tok_w);
    gh_aligned_free(s->xg);
    gh_aligned_free(s->hg);
    gh_aligned_free(s->hu);
    gh_aligned_free(s->yg);
    gh_aligned_free(s->scratch);
    free(s->counts);
    free(s->act);
    gh_aligned_free(s->ye);
    gh_aligned_free(s->hgd);
    gh_aligned_free(s->hud);
    gh_aligned_free(s->shg);
    gh_aligned_free(s->shu);
    gh_aligned_free(s->shy);
    free(s->dev);
    for (int32_t i = 0; s->slot_mem && i < s->n_slots; i++) {
        if (s->slot_mem[i]) s->b->ops->free(s->b, s->slot_mem[i]);
    }
    free(s->slot_mem);
    free(s->slot_w);
    free(s->slot_key);
    free(s->slot_used);
    free(s->slot_of);
    free(s);
}

/* The device half's buffers and the expert cache of a context of a model on a device. */
static gh_status hybrid_state(const gh_model * m, gh_moe_state * s) {
    const gh_hparams * hp = &m->hp;
    const gh_hybrid * hy = m->hy;
    const size_t nk = (size_t) s->n_batch * (size_t) s->k, ne = (size_t) s->n_expert;
    s->ye = gh_aligned_alloc(nk * (size_t) hp->n_embd * sizeof(float));
    s->hgd = gh_aligned_alloc(nk * (size_t) hp->n_ff_exp * sizeof(float));
    s->hud = gh_aligned_alloc(nk * (size_t) hp->n_ff_exp * sizeof(float));
    s->dev = calloc(ne, sizeof *s->dev);
    if (!s->ye || !s->hgd || !s->hud || !s->dev) {
        return gh_fail(GH_ERR_OOM, "out of memory for the expert buffers of a %d-token batch",
                       s->n_batch);
    }
    if (hy->info.n_shexp_device > 0) {
        const size_t nb = (size_t) s->n_batch;
        s->shg = gh_aligned_alloc(nb * (size_t) hp->n_ff_shexp * sizeof(float));
        s->shu = gh_aligned_alloc(nb * (size_t) hp->n_ff_shexp * sizeof(float));
        s->shy = gh_aligned_alloc(nb * (size_t) hp->n_embd * sizeof(float));
        if (!s->shg || !s->shu || !s->shy) {
            return gh_fail(GH_ERR_OOM, "out of memory for the shared expert's buffers of a "
                           "%d-token batch", s->n_batch);
        }
    }
    if (!hy->cache_slots) return GH_OK;
    const int32_t n = hy->cache_slots;
    s->b = hy->b;
    s->slot_mem = calloc((size_t) n, sizeof *s->slot_mem);
    s->slot_w = calloc((size_t) n, sizeof *s->slot_w);
    s->slot_key = malloc((size_t) n * sizeof *s->slot_key);
    s->slot_used = calloc((size_t) n, sizeof *s->slot_used);
    s->slot_of = malloc((size_t) s->n_layer * ne * sizeof *s->slot_of);
    if (!s->slot_mem || !s->slot_w || !s->slot_key || !s->slot_used || !s->slot_of) {
        return gh_fail(GH_ERR_OOM, "out of memory");
    }
    s->n_slots = n;
    for (int32_t i = 0; i < n; i++) s->slot_key[i] = -1;
    for (size_t i = 0; i < (size_t) s->n_layer * ne; i++) s->slot_of[i] = -1;
    for (int32_t i = 0; i < n; i++) {
        gh_status st = hy->b->ops->alloc(hy->b, hy->slot_bytes, &s->slot_mem[i]);
        if (st) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", gh_last_error());
            return gh_fail(st, "the context's expert cache (%d experts of %.1f MiB) does not fit on "
                           "the device: %s", n, hy->slot_bytes / 1048576.0, msg);
        }
    }
    return GH_OK;
}

static size_t scratch_of(const gh_weight * w, int64_t n) {
    return w->rows ? gh_matmul_scratch_size(w, n) : 0;
}

gh_moe_state * gh_moe_state_new(const gh_model * m, int32_t n_batch) {
    const gh_hparams * hp = &m->hp;
    gh_moe_state * s = calloc(1, sizeof *s);
    if (!s) {
        gh_fail(GH_ERR_OOM, "out of memory");
        return NULL;
    }
    s->n_batch = n_batch;
    s->n_expert = hp->n_expert;
    s->k = hp->n_expert_used;
    s->n_layer = hp->n_layer;
    const size_t nb = (size_t) n_batch, ne = (size_t) hp->n_expert, k = (size_t) hp->n_expert_used,
                 d = (size_t) hp->n_embd, ff = (size_t) GH_MAX(hp->n_ff_exp, hp->n_ff_shexp);
    size_t scratch = 64;
    for (int il = 0; il < hp->n_layer; il++) {
        const gh_moe_layer * M = &m->layers[il].moe;
        const gh_weight * ws[] = { &M->router, &M->gate_exps, &M->up_exps, &M->down_exps,
                                   &M->gate_shexp, &M->up_shexp, &M->down_shexp };
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
            scratch = GH_MAX(scratch, scratch_of(ws[i], n_batch));
        }
    }
    s->probs = gh_aligned_alloc(nb * ne * sizeof(float));
    s->choice = gh_aligned_alloc(6 * ne * sizeof(float));
    s->sel = gh_aligned_alloc(nb * k * sizeof(int32_t));
    s->sel_w = gh_aligned_alloc(nb * k * sizeof(float));
    s->start = gh_aligned_alloc((ne + 1) * sizeof(int32_t));
    s->fill = gh_aligned_alloc(ne * sizeof(int32_t));
    s->tok = gh_aligned_alloc(nb * k * sizeof(int32_t));
    s->tok_w = gh_aligned_alloc(nb * k * sizeof(float));
    s->xg = gh_aligned_alloc(nb * d * sizeof(float));
    s->hg = gh_aligned_alloc(nb * ff * sizeof(float));
    s->hu = gh_aligned_alloc(nb * ff * sizeof(float));
    s->yg = gh_aligned_alloc(nb * d * sizeof(float));
    s->scratch = gh_aligned_alloc(scratch);
    s->counts = calloc((size_t) hp->n_layer * ne, sizeof(int64_t));
    s->act = calloc(nb, sizeof(int64_t));
    if (!s->probs || !s->choice || !s->sel || !s->sel_w || !s->start || !s->fill || !s->tok || !s->tok_w ||
        !s->xg || !s->hg || !s->hu || !s->yg || !s->scratch || !s->counts || !s->act) {
        gh_moe_state_free(s);
        gh_fail(GH_ERR_OOM, "out of memory for the expert buffers of a %d-token batch", n_batch);
        return NULL;
    }
    if (m->hy && hybrid_state(m, s)) {
        gh_moe_state_free(s);
        return NULL;
    }
    return s;
}

void gh_moe_reset_stats(gh_moe_state * s) {
    if (!s) return;
    memset(s->counts, 0, (size_t) s->n_layer * (size_t) s->n_expert * sizeof(int64_t));
    s->runs_dev = s->runs_cpu = s->hits = s->misses = 0;
    s->bytes_cache = 0.0;
}

void gh_moe_get_stats(const gh_moe_state * s, int64_t * runs_dev, int64_t * runs_cpu,
                      int64_t * hits, int64_t * misses, double * bytes_cache) {
    *runs_dev = s ? s->runs_dev : 0;
    *runs_cpu = s ? s->runs_cpu : 0;
    *hits = s ? s->hits : 0;
    *misses = s ? s->misses : 0;
    *bytes_cache = s ? s->bytes_cache : 0.0;
}

static void shared_expert(gh_context * c, int il, int32_t n, const gh_dexpert * S,
                          double * bytes_out);

/* Layer il's shared expert on the device, or NULL (none, or on the CPU). */
static const gh_dexpert * shexp_device(const gh_context * c, int il) {
    const gh_hybrid * hy = c->model->hy;
    const gh_dexpert * S = hy ? &hy->layers[il].shexp : NULL;
    return S && S->gate.data ? S : NULL;
}

/* A device shared expert over all n tokens, in two steps around the CPU's experts: its
 * gate and up are enqueued first, so the device runs them while the CPU runs its experts;
 * after a sync the activation (on the host, as for the routed device experts) and its
 * down are enqueued; after the next sync s->shy holds its output. Each returns the
 * enqueue's device error. */
static gh_status shexp_gate_up(gh_context * c, const gh_dexpert * S, int32_t n) {
    gh_moe_state * s = c->moe;
    const gh_status st = gh_hybrid_matmul_async(c, &S->gate, c->xb, n, s->shg);
    return st ? st : gh_hybrid_matmul_async(c, &S->up, c->xb, n, s->shu);
}

static gh_status shexp_down(gh_context * c, const gh_dexpert * S, int32_t n) {
    const gh_hparams * hp = &c->model->hp;
    gh_moe_state * s = c->moe;
    gh_glu(hp->ffn_act, hp->act_threshold, s->shg, s->shu, s->shg, (int64_t) n * S->gate.rows);
    return gh_hybrid_matmul_async(c, &S->down, s->shg, n, s->shy);
}

/* p = softmax(p) in place, in float as transformers' router computes it. */
static void softmax(float * p, int32_t n) {
    float mx = p[0];
    for (int32_t i = 1; i < n; i++) mx = p[i] > mx ? p[i] : mx;
    float sum = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    const float inv = 1.0f / sum;
    for (int32_t i = 0; i < n; i++) p[i] *= inv;
}

/* ---- torch.topk's choice among equal values -------------------------------------------
 * transformers' routers pick their experts with torch.topk, whose CPU kernel selects over
 * (value, index) pairs ordered by value alone (NaN first), with std::nth_element, or with
 * std::partial_sort when k * 64 <= n; which of several equal values make the cut is then
 * whatever those algorithms (GNU libstdc++'s introselect and heap select) leave in the first
 * k places. The functions below are those algorithms, written from their published
 * description, so that a tie is resolved as transformers resolves it (checked against torch
 * 2.13 on tie-heavy inputs, tests/model/test_moe_sigmoid.py). Only the set chosen matters:
 * each expert's weight is its own, and the outputs are summed in expert order. */
typedef struct { float v; int32_t i; } tk_pair;

/* x goes before y: larger, NaN largest of all */
static inline bool tk_before(tk_pair x, tk_pair y) {
    return (isnan(x.v) && !isnan(y.v)) || x.v > y.v;
}

static inline void tk_swap(tk_pair * a, tk_pair * b) {
    const tk_pair t = *a;
    *a = *b;
    *b = t;
}

static void tk_push_heap(tk_pair * q, int64_t hole, int64_t top, tk_pair v) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && tk_before(q[parent], v)) {
        q[hole] = q[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    q[hole] = v;
}

static void tk_adjust_heap(tk_pair * q, int64_t hole, int64_t len, tk_pair v) {
    const int64_t top = hole;
    int64_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (tk_before(q[child], q[child - 1])) child--;
        q[hole] = q[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        q[hole] = q[child - 1];
        hole = child - 1;
    }
    tk_push_heap(q, hole, top, v);
}

/* q[0..mid) := the mid first of q[0..n) in the heap's order (a heap whose top goes last) */
static void tk_heap_select(tk_pair * q, int64_t mid, int64_t n) {
    for (int64_t parent = (mid - 2) / 2; mid >= 2 && parent >= 0; parent--) {
        tk_adjust_heap(q, parent, mid, q[parent]);
    }
    for (int64_t i = mid; i < n; i++) {
        if (tk_before(q[i], q[0])) {
            const tk_pair v = q[i];
            q[i] = q[0];
            tk_adjust_heap(q, 0, mid, v);
        }
    }
}

/* the elements that go before q[nth] end up in q[0..nth) (introselect) */
static void tk_nth_element(tk_pair * q, int64_t nth, int64_t n) {
    int64_t first = 0, last = n, depth = 0;
    for (int64_t m = n; m > 1; m >>= 1) depth++;
    depth *= 2;
    while (last - first > 3) {
        if (depth == 0) {
            tk_heap_select(q + first, nth + 1 - first, last - first);
            tk_swap(&q[first], &q[nth]);
            return;
        }
        depth--;
        /* the median of q[first + 1], the middle and the last to q[first], the pivot */
        const int64_t a = first + 1, b = first + (last - first) / 2, c = last - 1;
        int64_t med;
        if (tk_before(q[a], q[b])) med = tk_before(q[b], q[c]) ? b : tk_before(q[a], q[c]) ? c : a;
        else med = tk_before(q[a], q[c]) ? a : tk_before(q[b], q[c]) ? c : b;
        tk_swap(&q[first], &q[med]);
        int64_t lo = first + 1, hi = last;
        for (;;) {
            while (tk_before(q[lo], q[first])) lo++;
            hi--;
            while (tk_before(q[first], q[hi])) hi--;
            if (!(lo < hi)) break;
            tk_swap(&q[lo], &q[hi]);
            lo++;
        }
        if (lo <= nth) first = lo;
        else last = lo;
    }
    /* insertion sort of the rest */
    for (int64_t i = first + 1; i < last; i++) {
        const tk_pair v = q[i];
        if (tk_before(v, q[first])) {
            memmove(q + first + 1, q + first, (size_t) (i - first) * sizeof *q);
            q[first] = v;
        } else {
            int64_t j = i;
            while (tk_before(v, q[j - 1])) {
                q[j] = q[j - 1];
                j--;
            }
            q[j] = v;
        }
    }
}

/* sel [k] := the ids torch.topk(v [n], k) returns, as a set (q: [n] scratch) */
static void topk_torch(const float * v, int32_t n, int32_t k, tk_pair * q, int32_t * sel) {
    for (int32_t i = 0; i < n; i++) q[i] = (tk_pair) { v[i], i };
    if ((int64_t) k * 64 <= n) tk_heap_select(q, k, n);
    else tk_nth_element(q, k - 1, n);
    for (int32_t j = 0; j < k; j++) sel[j] = q[j].i;
}

/* One token's route from its router logits p [n_expert] (destroyed): its k experts sel and
 * their weights w, as transformers' routers compute them.
 * Softmax gating: p = softmax(logits), the k largest p (largest first), weights p (/ their
 * sum when expert_norm) * expert_scale.
 * Sigmoid gating (DeepSeek-V3's router, glm4moe, dots1): s = sigmoid(logits) and the choice
 * by c = s + exp_probs_b; with groups, each group's score is the sum of its two largest c
 * (two equal values count twice), and only the n_group_used best groups' experts are
 * eligible (the rest c = -inf); the k largest eligible c; weights the unbiased s (/ (their
 * sum + 1e-20) when expert_norm) * expert_scale.
 * Either way ties resolve as torch.topk's (topk_torch), among the experts and among the
 * groups. choice: [6 n_expert] floats of scratch. */
static void route(const gh_hparams * hp, const gh_moe_layer * M, float * p, float * choice,
                  int32_t * sel, float * w) {
    const int32_t ne = hp->n_expert, k = hp->n_expert_used;
    if (hp->expert_gating == GH_GATING_SIGMOID) {
        const float * b = M->probs_b;
        for (int32_t e = 0; e < ne; e++) {
            p[e] = 1.0f / (1.0f + expf(-p[e]));
            choice[e] = b ? p[e] + b[e] : p[e];
        }
        const int32_t ng = hp->n_expert_groups, per = ne / GH_MAX(ng, 1);
        tk_pair * q = (tk_pair *) (choice + ne);
        if (ng > 1 && hp->n_group_used < ng) {
            /* each group's score: the sum of its two largest choices (values: no tie to
             * resolve); the n_group_used best groups stay, the others' experts are out */
            float * gs = choice + 3 * ne;
            int32_t * keep = (int32_t *) (choice + 4 * ne);
            uint8_t * kept = (uint8_t *) (choice + 5 * ne);
            memset(kept, 0, (size_t) ng);
            for (int32_t g = 0; g < ng; g++) {
                float a = -INFINITY, b2 = -INFINITY;
                for (int32_t e = g * per; e < (g + 1) * per; e++) {
                    const float v = choice[e];
                    if (v > a) { b2 = a; a = v; }
                    else if (v > b2) b2 = v;
                }
                gs[g] = a + b2;
            }
            topk_torch(gs, ng, hp->n_group_used, q, keep);
            for (int32_t j = 0; j < hp->n_group_used; j++) kept[keep[j]] = 1;
            for (int32_t g = 0; g < ng; g++) {
                for (int32_t e = g * per; !kept[g] && e < (g + 1) * per; e++) choice[e] = -INFINITY;
            }
        }
        /* the k largest choices; their unbiased scores are the weights */
        topk_torch(choice, ne, k, q, sel);
        for (int32_t j = 0; j < k; j++) w[j] = p[sel[j]];
        float sum = 0.0f;
        for (int32_t j = 0; j < k; j++) sum += w[j];
        for (int32_t j = 0; hp->expert_norm && j < k; j++) w[j] /= sum + 1e-20f;
        for (int32_t j = 0; j < k; j++) w[j] *= hp->expert_scale;
        return;
    }
    softmax(p, ne);
    /* transformers' softmax routers take torch.topk(probs, k) sorted: the set as topk_torch
     * resolves ties, largest first (equal values may come in any order: their sum is the
     * same), and sum the weights in that order */
    tk_pair * q = (tk_pair *) choice;
    topk_torch(p, ne, k, q, sel);
    for (int32_t j = 1; j < k; j++) {
        const int32_t e = sel[j];
        int32_t i = j;
        for (; i > 0 && p[sel[i - 1]] < p[e]; i--) sel[i] = sel[i - 1];
        sel[i] = e;
    }
    for (int32_t j = 0; j < k; j++) w[j] = p[sel[j]];
    float sum = 0.0f;
    for (int32_t j = 0; j < k; j++) sum += w[j];
    const float f = (hp->expert_norm ? 1.0f / sum : 1.0f) * hp->expert_scale;
    for (int32_t j = 0; j < k; j++) w[j] *= f;
}

/* rows[t] += b for cnt rows of len values (b NULL: nothing). */
static void add_rows(float * rows, const float * b, int32_t cnt, int64_t len) {
    for (int32_t t = 0; b && t < cnt; t++) {
        float * r = rows + (int64_t) t * len;
        for (int64_t i = 0; i < len; i++) r[i] += b[i];
    }
}

/* One expert (or the shared one) over cnt token rows x [cnt][d]: y [cnt][d] =
 * down(act(gate x + gb, up x + ub)) + db, the biases NULL where the model has none; the
 * down projection dn as llama.cpp stores it, or (dn_t) transposed, ffn_down_exps_t, whose
 * rows of a zero activation are skipped (gh_matmul_t).
 * Returns the weight bytes read (the biases, f32 copies of 2 ff + d values, are not counted:
 * under 0.3% of a gpt-oss expert's MXFP4 bytes). */
static double run_expert(gh_context * c, gh_moe_state * s, const gh_weight * g, const gh_weight * u,
                         const gh_weight * dn, bool dn_t, const float * gb, const float * ub,
                         const float * db, const float * x, int32_t cnt, float * y) {
    const gh_hparams * hp = &c->model->hp;
    const int64_t ff = g->rows;
    const gh_weight * ws[2] = { g, u };
    float * ys[2] = { s->hg, s->hu };
    const int64_t ld[2] = { ff, ff };
    gh_matmul_multi(c->tp, ws, 2, x, cnt, ys, ld, s->scratch);
    add_rows(s->hg, gb, cnt, ff);
    add_rows(s->hu, ub, cnt, ff);
    gh_glu(hp->ffn_act, hp->act_threshold, s->hg, s->hu, s->hg, (int64_t) cnt * ff);
    double down_bytes = (double) dn->rows * dn->row_bytes;
    if (dn_t) {
        gh_matmul_t(c->tp, dn, s->hg, cnt, ff, y, hp->n_embd);
        int64_t rows = 0; /* gh_matmul_t reads the rows some token's activation needs */
        for (int64_t r = 0; r < ff; r++) {
            int32_t t = 0;
            while (t < cnt && s->hg[(int64_t) t * ff + r] == 0.0f) t++;
            rows += t < cnt;
        }
        down_bytes = (double) rows * dn->row_bytes;
    } else {
        gh_matmul(c->tp, dn, s->hg, cnt, y, hp->n_embd, s->scratch);
    }
    add_rows(y, db, cnt, hp->n_embd);
    return (double) g->rows * g->row_bytes + (double) u->rows * u->row_bytes + down_bytes;
}

/* Expert e's down projection: llama.cpp's, or the transposed one. */
static gh_weight expert_down(const gh_moe_layer * M, int32_t e) {
    return M->has_down_t ? gh_expert(&M->down_exps_t, e) : gh_expert(&M->down_exps, e);
}

/* Expert e of M viewed as a layer (moe.h; model.h), for the FFN strategies and executor: its
 * gate, up and down_t rows, its biases and its gate threshold's cut points (none: an
 * expert the file keeps dense, or no thresholds). */
void gh_expert_view(const gh_moe_layer * M, int32_t e, int64_t ff, int64_t d, gh_layer * V) {
    memset(V, 0, sizeof *V);
    V->gate = gh_expert(&M->gate_exps, e);
    V->up = gh_expert(&M->up_exps, e);
    V->has_down_t = true;
    V->down_t = gh_expert(&M->down_exps_t, e);
    V->gate_b = M->gate_exps_b ? M->gate_exps_b + (int64_t) e * ff : NULL;
    V->up_b = M->up_exps_b ? M->up_exps_b + (int64_t) e * ff : NULL;
    V->down_b = M->down_exps_b ? M->down_exps_b + (int64_t) e * d : NULL;
    if (M->has_pred) {
        V->has_pred = true;
        V->fc1 = gh_expert(&M->fc1_exps, e);
        V->fc2 = gh_expert(&M->fc2_exps, e);
    }
    const float * cut = M->gate_cuts ? M->gate_cuts + 4 * (size_t) e : NULL;
    if (cut && cut[0] >= 0.0f) {
        V->has_gate_thr = true;
        V->gate_thr = cut[0];
        V->gate_cut = cut[1];
        V->gate_lo = cut[2];
        V->gate_hi = cut[3];
    }
}

/* Expert e's row of a [n_expert][len] bias (NULL: none). */
static const float * expert_bias(const float * b, int32_t e, int64_t len) {
    return b ? b + (int64_t) e * len : NULL;
}

/* Where expert e of layer il runs in this layer call, into *out: its placed copy, else the
 * cache's (refilled on a miss: the least recently used slot that this call is not using),
 * else NULL (the CPU). Counts the cache's hits, misses and uploaded bytes. Returns the
 * refill's device error (the slot then holds no expert, so a later call refills it). */
static gh_status device_copy(gh_context * c, int il, int32_t e, const gh_dexpert ** out) {
    gh_moe_state * s = c->moe;
    const gh_dlayer * D = &c->model->hy->layers[il];
    *out = NULL;
    if (D->exps && D->exps[e].gate.data) {
        *out = &D->exps[e];
        return GH_OK;
    }
    if (!s->n_slots) return GH_OK;
    const int64_t key = (int64_t) il * s->n_expert + e;
    int32_t slot = s->slot_of[key];
    if (slot >= 0) {
        s->hits++;
        s->slot_used[slot] = s->tick;
        *out = &s->slot_w[slot];
        return GH_OK;
    }
    s->misses++;
    for (int32_t i = 0; i < s->n_slots; i++) {
        if (s->slot_used[i] == s->tick) continue; /* this call's: in use */
        if (slot < 0 || s->slot_used[i] < s->slot_used[slot]) slot = i;
    }
    if (slot < 0) return GH_OK;
    if (s->slot_key[slot] >= 0) s->slot_of[s->slot_key[slot]] = -1;
    s->slot_key[slot] = -1;
    const gh_moe_layer * M = &c->model->layers[il].moe;
    gh_status st = gh_expert_upload(s->b, M, e, s->slot_mem[slot], &s->slot_w[slot]);
    if (st) return st;
    s->slot_key[slot] = key;
    s->slot_of[key] = slot;
    s->slot_used[slot] = s->tick;
    s->bytes_cache += (double) (M->gate_exps.rows * M->gate_exps.row_bytes +
                                M->up_exps.rows * M->up_exps.row_bytes +
                                M->down_exps.rows * M->down_exps.row_bytes);
    *out = &s->slot_w[slot];
    return GH_OK;
}

/* The routed experts of a model on a device (tokens already grouped): the device experts'
 * gate and up are enqueued, the CPU experts run meanwhile, then the device experts'
 * activation (host) and down; each (token, expert) output lands in s->ye and the merge
 * adds them in expert order, as the CPU-only loop does. S: the layer's shared expert on the
 * device, or NULL. Adds the weight bytes read to *bytes; returns a device error. */
static gh_status hybrid_experts(gh_context * c, int il, int32_t n, const gh_dexpert * S,
                                double * bytes) {
    const gh_model * m = c->model;
    const gh_hparams * hp = &m->hp;
    const gh_moe_layer * M = &m->layers[il].moe;
    gh_moe_state * s = c->moe;
    const int32_t ne = hp->n_expert;
    const int64_t d = hp->n_embd, ff = hp->n_ff_exp;
    const float * x = c->xb;
    int64_t * counts = s->counts + (int64_t) il * ne;
    s->tick++;
    bool any_dev = false;
    for (int32_t e = 0; e < ne; e++) {
        const int32_t first = s->start[e], cnt = s->start[e + 1] - first;
        s->dev[e] = NULL;
        if (cnt == 0) continue;
        counts[e] += cnt;
        const gh_status st = device_copy(c, il, e, &s->dev[e]);
        if (st) return st; /* nothing is enqueued yet */
        any_dev |= s->dev[e] != NULL;
    }
    /* the shared expert first: every token runs it */
    gh_status st = S ? shexp_gate_up(c, S, n) : GH_OK;
    /* the gathered inputs of one expert (the device copies them before returning); after
     * a failed enqueue nothing more is run, and the sync below waits for what was */
    for (int pass = 0; pass < 2 && !st; pass++) {
        for (int32_t e = 0; e < ne && !st; e++) {
            const int32_t first = s->start[e], cnt = s->start[e + 1] - first;
            if (cnt == 0 || (pass == 0) != (s->dev[e] != NULL)) continue;
            const float * xe = x;
            if (cnt < n) {
                for (int32_t j = 0; j < cnt; j++) {
                    memcpy(s->xg + (int64_t) j * d, x + (int64_t) s->tok[first + j] * d,
                           (size_t) d * sizeof(float));
                }
                xe = s->xg;
            }
            if (pass == 0) {
                st = gh_hybrid_matmul_async(c, &s->dev[e]->gate, xe, cnt, s->hgd + (int64_t) first * ff);
                if (!st) st = gh_hybrid_matmul_async(c, &s->dev[e]->up, xe, cnt, s->hud + (int64_t) first * ff);
                *bytes += (double) (M->gate_exps.rows * M->gate_exps.row_bytes +
                                    M->up_exps.rows * M->up_exps.row_bytes +
                                    M->down_exps.rows * M->down_exps.row_bytes);
                s->runs_dev++;
            } else {
                const gh_weight g = gh_expert(&M->gate_exps, e), u = gh_expert(&M->up_exps, e),
                                dn = expert_down(M, e);
                *bytes += run_expert(c, s, &g, &u, &dn, M->has_down_t, expert_bias(M->gate_exps_b, e, ff),
                                     expert_bias(M->up_exps_b, e, ff), expert_bias(M->down_exps_b, e, d),
                                     xe, cnt, s->ye + (int64_t) first * d);
                s->runs_cpu++;
            }
        }
    }
    if (any_dev || S) {
        st = gh_hybrid_sync(c, st);
        if (st) return st;
        if (S) st = shexp_down(c, S, n);
        for (int32_t e = 0; e < ne && !st; e++) {
            const int32_t first = s->start[e], cnt = s->start[e + 1] - first;
            if (cnt == 0 || !s->dev[e]) continue;
            float * h = s->hgd + (int64_t) first * ff, * hu = s->hud + (int64_t) first * ff;
            /* the biases and the activation on the host, as run_expert does them */
            add_rows(h, expert_bias(M->gate_exps_b, e, ff), cnt, ff);
            add_rows(hu, expert_bias(M->up_exps_b, e, ff), cnt, ff);
            gh_glu(hp->ffn_act, hp->act_threshold, h, hu, h, (int64_t) cnt * ff);
            st = gh_hybrid_matmul_async(c, &s->dev[e]->down, h, cnt, s->ye + (int64_t) first * d);
        }
        st = gh_hybrid_sync(c, st);
        if (st) return st;
        for (int32_t e = 0; e < ne; e++) {
            const int32_t first = s->start[e], cnt = s->start[e + 1] - first;
            if (cnt && s->dev[e]) {
                add_rows(s->ye + (int64_t) first * d, expert_bias(M->down_exps_b, e, d), cnt, d);
            }
        }
    }
    /* merge: each token's experts in ascending id */
    float * y = c->xb2;
    memset(y, 0, (size_t) n * d * sizeof(float));
    for (int32_t e = 0; e < ne; e++) {
        for (int32_t j = s->start[e]; j < s->start[e + 1]; j++) {
            float * yt = y + (int64_t) s->tok[j] * d;
            const float * ye = s->ye + (int64_t) j * d;
            const float w = s->tok_w[j];
            for (int64_t i = 0; i < d; i++) yt[i] += w * ye[i];
        }
    }
    return GH_OK;
}

gh_status gh_moe_ffn(gh_context * c, int il, int32_t n, bool sparse_mode) {
    const gh_model * m = c->model;
    const gh_hparams * hp = &m->hp;
    const gh_moe_layer * M = &m->layers[il].moe;
    gh_moe_state * s = c->moe;
    const int32_t ne = hp->n_expert, k = hp->n_expert_used;
    const int64_t d = hp->n_embd;
    const float * x = c->xb;
    float * y = c->xb2;
    gh_tap_buf(&c->tap, GH_TAP_FFN_IN, il, n, x, NULL);

    /* route: every token's k experts and weights */
    const gh_dweight * dr = c->model->hy ? &c->model->hy->layers[il].router : NULL;
    if (dr && dr->data) {
        gh_status st = gh_hybrid_matmul_async(c, dr, x, n, s->probs);
        st = gh_hybrid_sync(c, st);
        if (st) return st;
    } else {
        gh_matmul(c->tp, &M->router, x, n, s->probs, ne, s->scratch);
    }
    add_rows(s->probs, M->router_b, n, ne);
    double bytes = (double) M->router.rows * M->router.row_bytes;
    for (int32_t t = 0; t < n; t++) {
        route(hp, M, s->probs + (int64_t) t * ne, s->choice, s->sel + (int64_t) t * k,
              s->sel_w + (int64_t) t * k);
    }

    /* group by expert (counting sort; tokens stay ascending within an expert) */
    memset(s->start, 0, (size_t) (ne + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < (int64_t) n * k; i++) s->start[s->sel[i] + 1]++;
    for (int32_t e = 0; e < ne; e++) s->start[e + 1] += s->start[e];
    memcpy(s->fill, s->start, (size_t) ne * sizeof(int32_t));
    for (int32_t t = 0; t < n; t++) {
        for (int32_t j = 0; j < k; j++) {
            const int32_t e = s->sel[(int64_t) t * k + j], pos = s->fill[e]++;
            s->tok[pos] = t;
            s->tok_w[pos] = s->sel_w[(int64_t) t * k + j];
        }
    }

    /* a model on a device runs its placed and cached experts there; sparse experts take
     * the path below, the router and attention having run where the placement put them,
     * and in a sparse mode the hot neurons of each selected expert that the placement put
     * on the device run there (the executor's split); a dense pass (a prompt past the
     * sparse batch) runs them all on the CPU */
    const gh_dexpert * S = shexp_device(c, il);
    if (c->model->hy && !M->has_down_t) {
        const gh_status st = hybrid_experts(c, il, n, S, &bytes);
        if (st) return st;
        shared_expert(c, il, n, S, &bytes);
        gh_tap_bytes(&c->tap, GH_STAGE_FFN, bytes);
        return GH_OK;
    }

    /* each chosen expert once over its tokens: its rows are read once per batch; in a
     * sparse FFN mode (a decode step, a few tokens) each token's expert runs through the
     * strategy's list instead, an expert the strategy cannot select in (no threshold of
     * its own) dense */
    const gh_ffn_strategy * st = gh_ffn_strategy_of(c->ffn_mode);
    const bool sparse = M->has_down_t && sparse_mode;
    const gh_dsplit * hot = c->model->hy ? c->model->hy->layers[il].exp_hot : NULL;
    memset(y, 0, (size_t) n * d * sizeof(float));
    int64_t * counts = s->counts + (int64_t) il * ne;
    if (sparse) memset(s->act, 0, (size_t) n * sizeof(int64_t));
    if (S) { /* the device's part while the CPU runs the experts */
        const gh_status err = shexp_gate_up(c, S, n);
        if (err) return gh_hybrid_sync(c, err);
    }
    for (int32_t e = 0; e < ne; e++) {
        const int32_t first = s->start[e], cnt = s->start[e + 1] - first;
        if (cnt == 0) continue;
        counts[e] += cnt;
        const int64_t ff = M->gate_exps.rows;
        gh_layer V;
        if (sparse) gh_expert_view(M, e, ff, d, &V);
        if (sparse && (!st->unit_ok || st->unit_ok(&V))) {
            /* the expert's hot neurons on the device (model/placement.c), split by the executor */
            const gh_dsplit * H = hot && hot[e].hot.n_hot > 0 ? &hot[e] : NULL;
            for (int32_t j = 0; j < cnt; j++) {
                int64_t n_act = 0, n_dev = 0; /* (its up and down rows are in the statistics) */
                const gh_status err = gh_sparse_ffn_unit(c, il, &V, e, H,
                                                         x + (int64_t) s->tok[first + j] * d,
                                                         s->yg + (int64_t) j * d, &bytes, &n_act,
                                                         &n_dev);
                if (err) return S ? gh_hybrid_sync(c, err) : err;
                s->act[s->tok[first + j]] += n_act;
            }
        } else {
            /* an expert run dense: every neuron of it active for its tokens */
            for (int32_t j = 0; sparse && j < cnt; j++) s->act[s->tok[first + j]] += ff;
            const float * xe = x;
            if (cnt < n) {
                for (int32_t j = 0; j < cnt; j++) {
                    memcpy(s->xg + (int64_t) j * d, x + (int64_t) s->tok[first + j] * d, (size_t) d * sizeof(float));
                }
                xe = s->xg;
            }
            const gh_weight g = gh_expert(&M->gate_exps, e), u = gh_expert(&M->up_exps, e),
                            dn = expert_down(M, e);
            bytes += run_expert(c, s, &g, &u, &dn, M->has_down_t, expert_bias(M->gate_exps_b, e, ff),
                                expert_bias(M->up_exps_b, e, ff), expert_bias(M->down_exps_b, e, d), xe,
                                cnt, s->yg);
        }
        for (int32_t j = 0; j < cnt; j++) {
            float * yt = y + (int64_t) s->tok[first + j] * d;
            const float * ye = s->yg + (int64_t) j * d;
            const float w = s->tok_w[first + j];
            for (int64_t i = 0; i < d; i++) yt[i] += w * ye[i];
        }
    }

    if (S) {
        gh_status err = gh_hybrid_sync(c, GH_OK);
        if (!err) err = shexp_down(c, S, n);
        err = gh_hybrid_sync(c, err);
        if (err) return err;
    }
    shared_expert(c, il, n, S, &bytes);
    gh_tap_bytes(&c->tap, GH_STAGE_FFN, bytes);
    /* a sparse step's selections, one per token as a dense layer's sparse FFN counts them
     * (the statistics' n_sparse_tokens, density and layer densities; the selected experts'
     * neurons, the shared expert's not) */
    for (int32_t t = 0; sparse && t < n; t++) gh_tap_count(&c->tap, GH_TAP_SELECT, il, GH_STAGE_FFN, s->act[t], 0);
    return GH_OK;
}

/* the shared expert: every token, scaled by its sigmoid gate, added to c->xb2 (after the
 * routed experts' sum, on the CPU or the device alike); S: its device copy, whose output
 * is in s->shy already (shexp_down, synced), else it runs here on the CPU */
static void shared_expert(gh_context * c, int il, int32_t n, const gh_dexpert * S,
                          double * bytes_out) {
    const gh_moe_layer * M = &c->model->layers[il].moe;
    gh_moe_state * s = c->moe;
    const int64_t d = c->model->hp.n_embd;
    const float * x = c->xb;
    float * y = c->xb2;
    double bytes = 0.0;
    if (M->gate_shexp.rows) {
        const float * ysh = s->yg;
        if (S) {
            ysh = s->shy;
            bytes += (double) (M->gate_shexp.rows * M->gate_shexp.row_bytes +
                               M->up_shexp.rows * M->up_shexp.row_bytes +
                               M->down_shexp.rows * M->down_shexp.row_bytes);
        } else {
            bytes += run_expert(c, s, &M->gate_shexp, &M->up_shexp, &M->down_shexp, false, NULL,
                                NULL, NULL, x, n, s->yg);
        }
        for (int32_t t = 0; t < n; t++) {
            const float * xt = x + (int64_t) t * d;
            float g = 1.0f;
            if (M->shexp_gate) {
                float a = 0.0f;
                for (int64_t i = 0; i < d; i++) a += M->shexp_gate[i] * xt[i];
                g = 1.0f / (1.0f + expf(-a));
            }
            float * yt = y + (int64_t) t * d;
            const float * ys = ysh + (int64_t) t * d;
            for (int64_t i = 0; i < d; i++) yt[i] += g * ys[i];
        }
        bytes += (double) d * sizeof(float);
    }
    *bytes_out += bytes;
}

gh_status gh_context_get_expert_counts(const gh_context * c, int64_t * counts, int64_t n) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_get_expert_counts: context is NULL");
    const gh_hparams * hp = &c->model->hp;
    const int64_t need = (int64_t) hp->n_layer * hp->n_expert;
    if (need == 0) return GH_OK;
    if (!counts || n < need) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_context_get_expert_counts: counts holds %lld values, "
                       "the model has %d layers of %d experts (%lld)", (long long) (counts ? n : 0),
                       hp->n_layer, hp->n_expert, (long long) need);
    }
    memcpy(counts, c->moe->counts, (size_t) need * sizeof(int64_t));
    return GH_OK;
}
