/* The mixture-of-experts FFN (see moe.h): router, top-k, experts grouped by the tokens
 * that chose them, the shared expert, and the per-layer selection counts.
 *
 * Every matrix product goes through gh_matmul / gh_matmul_multi on a view of the expert's
 * rows (gh_expert), so every weight type of the kernel table works and the threads split
 * each expert's rows as they split a dense weight's. Each output row is a sum over the
 * token's experts in ascending expert id, the same for any batch split and thread count. */
#include "ffn/moe.h"
#include "core/stats.h"
#include "model/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct gh_moe_state {
    int32_t   n_batch, n_expert, k, n_layer;
    float *   probs;   /* [n_batch][n_expert] router logits, then probabilities */
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
};

void gh_moe_state_free(gh_moe_state * s) {
    if (!s) return;
    gh_aligned_free(s->probs);
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
    free(s);
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
    if (!s->probs || !s->sel || !s->sel_w || !s->start || !s->fill || !s->tok || !s->tok_w ||
        !s->xg || !s->hg || !s->hu || !s->yg || !s->scratch || !s->counts) {
        gh_moe_state_free(s);
        gh_fail(GH_ERR_OOM, "out of memory for the expert buffers of a %d-token batch", n_batch);
        return NULL;
    }
    return s;
}

void gh_moe_reset_stats(gh_moe_state * s) {
    if (s) memset(s->counts, 0, (size_t) s->n_layer * (size_t) s->n_expert * sizeof(int64_t));
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

/* The k largest of the probabilities p [n] (destroyed: a chosen one is marked -1, below
 * any probability), largest first, the lower id among equals (torch.topk's order on a CPU
 * for ties); a NaN is never larger, and a token whose probabilities are all NaN gets the
 * lowest ids (its output is NaN either way). */
static void top_k(float * p, int32_t n, int32_t k, int32_t * sel, float * w) {
    for (int32_t j = 0; j < k; j++) {
        int32_t best = -1;
        float bv = -0.5f;
        for (int32_t e = 0; e < n; e++) {
            if (p[e] > bv) {
                bv = p[e];
                best = e;
            }
        }
        if (best < 0) {
            for (int32_t e = 0; e < n && best < 0; e++) if (p[e] != -1.0f) best = e;
            bv = p[best];
        }
        sel[j] = best;
        w[j] = bv;
        p[best] = -1.0f;
    }
}

/* rows[t] += b for cnt rows of len values (b NULL: nothing). */
static void add_rows(float * rows, const float * b, int32_t cnt, int64_t len) {
    for (int32_t t = 0; b && t < cnt; t++) {
        float * r = rows + (int64_t) t * len;
        for (int64_t i = 0; i < len; i++) r[i] += b[i];
    }
}

/* One expert (or the shared one) over cnt token rows x [cnt][d]: y [cnt][d] =
 * down(act(gate x + gb, up x + ub)) + db, the biases NULL where the model has none.
 * Returns the weight bytes read (the biases, f32 copies of 2 ff + d values, are not counted:
 * under 0.3% of a gpt-oss expert's MXFP4 bytes). */
static double run_expert(gh_context * c, gh_moe_state * s, const gh_weight * g, const gh_weight * u,
                         const gh_weight * dn, const float * gb, const float * ub, const float * db,
                         const float * x, int32_t cnt, float * y) {
    const gh_hparams * hp = &c->model->hp;
    const int64_t ff = g->rows;
    const gh_weight * ws[2] = { g, u };
    float * ys[2] = { s->hg, s->hu };
    const int64_t ld[2] = { ff, ff };
    gh_matmul_multi(c->tp, ws, 2, x, cnt, ys, ld, s->scratch);
    add_rows(s->hg, gb, cnt, ff);
    add_rows(s->hu, ub, cnt, ff);
    gh_glu(hp->ffn_act, hp->act_threshold, s->hg, s->hu, s->hg, (int64_t) cnt * ff);
    gh_matmul(c->tp, dn, s->hg, cnt, y, hp->n_embd, s->scratch);
    add_rows(y, db, cnt, hp->n_embd);
    return (double) g->rows * g->row_bytes + (double) u->rows * u->row_bytes +
           (double) dn->rows * dn->row_bytes;
}

/* Expert e's row of a [n_expert][len] bias (NULL: none). */
static const float * expert_bias(const float * b, int32_t e, int64_t len) {
    return b ? b + (int64_t) e * len : NULL;
}

void gh_moe_ffn(gh_context * c, int il, int32_t n) {
    const gh_model * m = c->model;
    const gh_hparams * hp = &m->hp;
    const gh_moe_layer * M = &m->layers[il].moe;
    gh_moe_state * s = c->moe;
    const int32_t ne = hp->n_expert, k = hp->n_expert_used;
    const int64_t d = hp->n_embd;
    const float * x = c->xb;
    float * y = c->xb2;
    if (c->prof_x) {
        memcpy(c->prof_x + il * c->prof_x_stride + (int64_t) c->prof_t0 * d, x,
               (size_t) n * d * sizeof(float));
    }

    /* route: every token's k experts and weights */
    gh_matmul(c->tp, &M->router, x, n, s->probs, ne, s->scratch);
    add_rows(s->probs, M->router_b, n, ne);
    double bytes = (double) M->router.rows * M->router.row_bytes;
    for (int32_t t = 0; t < n; t++) {
        float * p = s->probs + (int64_t) t * ne, * w = s->sel_w + (int64_t) t * k;
        softmax(p, ne);
        top_k(p, ne, k, s->sel + (int64_t) t * k, w);
        float sum = 0.0f;
        for (int32_t j = 0; j < k; j++) sum += w[j];
        const float f = (hp->expert_norm ? 1.0f / sum : 1.0f) * hp->expert_scale;
        for (int32_t j = 0; j < k; j++) w[j] *= f;
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

    /* each chosen expert once over its tokens: its rows are read once per batch */
    memset(y, 0, (size_t) n * d * sizeof(float));
    int64_t * counts = s->counts + (int64_t) il * ne;
    for (int32_t e = 0; e < ne; e++) {
        const int32_t first = s->start[e], cnt = s->start[e + 1] - first;
        if (cnt == 0) continue;
        counts[e] += cnt;
        const float * xe = x;
        if (cnt < n) {
            for (int32_t j = 0; j < cnt; j++) {
                memcpy(s->xg + (int64_t) j * d, x + (int64_t) s->tok[first + j] * d, (size_t) d * sizeof(float));
            }
            xe = s->xg;
        }
        const gh_weight g = gh_expert(&M->gate_exps, e), u = gh_expert(&M->up_exps, e),
                        dn = gh_expert(&M->down_exps, e);
        const int64_t ff = M->gate_exps.rows;
        bytes += run_expert(c, s, &g, &u, &dn, expert_bias(M->gate_exps_b, e, ff),
                            expert_bias(M->up_exps_b, e, ff), expert_bias(M->down_exps_b, e, d), xe,
                            cnt, s->yg);
        for (int32_t j = 0; j < cnt; j++) {
            float * yt = y + (int64_t) s->tok[first + j] * d;
            const float * ye = s->yg + (int64_t) j * d;
            const float w = s->tok_w[first + j];
            for (int64_t i = 0; i < d; i++) yt[i] += w * ye[i];
        }
    }

    /* the shared expert: every token, scaled by its sigmoid gate */
    if (M->gate_shexp.rows) {
        bytes += run_expert(c, s, &M->gate_shexp, &M->up_shexp, &M->down_shexp, NULL, NULL, NULL, x,
                            n, s->yg);
        for (int32_t t = 0; t < n; t++) {
            const float * xt = x + (int64_t) t * d;
            float g = 1.0f;
            if (M->shexp_gate) {
                float a = 0.0f;
                for (int64_t i = 0; i < d; i++) a += M->shexp_gate[i] * xt[i];
                g = 1.0f / (1.0f + expf(-a));
            }
            float * yt = y + (int64_t) t * d;
            const float * ys = s->yg + (int64_t) t * d;
            for (int64_t i = 0; i < d; i++) yt[i] += g * ys[i];
        }
        bytes += (double) d * sizeof(float);
    }
    gh_stats_add(&c->stats, GH_STAGE_FFN, 0.0, bytes);
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
