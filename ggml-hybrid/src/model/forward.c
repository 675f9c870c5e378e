/* The forward pass: a batch of tokens through the blocks the architecture describes
 * (model/arch.h), and the eval entry points. */
#include "model/model.h"
#include "model/placement.h"
#include "ffn/exec.h"
#include "ffn/moe.h"
#include "types/types.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Token t's position: the next free row of its context's cache. The batch's tokens are
 * c's own, t rows after n_past, or, in a batch of several contexts (gh_eval_batch_ex:
 * c->seq set), row t of context seq[t]'s own run of tokens, at seq_pos[t]. */
static int32_t token_pos(const gh_context * c, int32_t t) {
    return c->seq ? c->seq_pos[t] : c->n_past + t;
}

/* In a batch of several contexts: the rows t..end-1 that are context seq[t]'s (a context's
 * tokens are consecutive rows); returns end. */
static int32_t seq_run_end(const gh_context * c, int32_t t, int32_t n) {
    int32_t e = t + 1;
    while (e < n && c->seq[e] == c->seq[t]) e++;
    return e;
}

/* x[t] = token_embd[tokens[t]] (times embd_scale: Gemma) (+ position_embd[pos + offset]
 * for learned positions). */
static void embed(const gh_context * c, const int32_t * tokens, int32_t n, float * x, float * tmp) {
    const gh_model * m = c->model;
    const gh_type_traits * tr = gh_type_traits_get(m->embd_type);
    const int64_t d = m->hp.n_embd;
    for (int32_t t = 0; t < n; t++) {
        tr->to_float(m->embd + (size_t) tokens[t] * m->embd_row_bytes, x + t * d, d);
        if (m->hp.embd_scale != 1.0f) {
            for (int64_t i = 0; i < d; i++) x[t * d + i] *= m->hp.embd_scale;
        }
    }
    if (!m->pos) return;
    const gh_type_traits * tp = gh_type_traits_get(m->pos_type);
    for (int32_t t = 0; t < n; t++) {
        const int64_t row = token_pos(c, t) + m->hp.pos_offset; /* < n_pos: n_ctx bounds it */
        tp->to_float(m->pos + (size_t) row * m->pos_row_bytes, tmp, d);
        for (int64_t i = 0; i < d; i++) x[t * d + i] += tmp[i];
    }
}

static void add_inplace(float * restrict a, const float * restrict b, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] += b[i];
}

/* y[t] += b for n rows of length len (b NULL: nothing). */
static void add_bias(float * y, const float * b, int32_t n, int64_t len, int64_t ld) {
    if (!b) return;
    for (int32_t t = 0; t < n; t++) add_inplace(y + t * ld, b, len);
}

/* y[t] = norm(x[t]) of the model's kind, for n rows. */
static void norm_rows(const gh_hparams * hp, const float * w, const float * b, const float * x,
                      int32_t n, float * y) {
    const int64_t d = hp->n_embd;
    for (int32_t t = 0; t < n; t++) {
        if (hp->norm == GH_NORM_LAYER) gh_layernorm(x + t * d, w, b, d, hp->norm_eps, y + t * d);
        else gh_rmsnorm(x + t * d, w, d, hp->norm_eps, y + t * d);
    }
}

/* A sublayer's input: norm(x) with the weights w, or x itself where the block has no
 * input norm (w NULL: OLMo 2). */
static void sublayer_input(const gh_hparams * hp, const float * w, const float * b, const float * x,
                           int32_t n, float * y) {
    if (w) norm_rows(hp, w, b, x, n, y);
    else memcpy(y, x, (size_t) n * hp->n_embd * sizeof(float));
}

/* A sublayer's output y, normed in place when the block has output norms (w: OLMo 2's
 * post_attention_norm / post_ffw_norm), before it is added to the residual stream. */
static void sublayer_output(const gh_hparams * hp, const float * w, const float * b, float * y,
                            int32_t n) {
    if (w) norm_rows(hp, w, b, y, n, y);
}

static double weight_bytes(const gh_weight * w) { return (double) w->rows * (double) w->row_bytes; }

/* The input-sparse projection of n token rows x [n][w->rows] through the transposed w into
 * y [n][ldy] (w->cols values each): per token only the rows of the inputs above thr.
 * Returns the weight bytes read and counts the inputs (head: the head's stage). */
static double sparse_proj(gh_context * c, const gh_weight * w, const float * thr, const float * x,
                          int32_t n, float * y, int64_t ldy, bool head) {
    int64_t used = 0;
    for (int32_t t = 0; t < n; t++) {
        used += gh_matvec_t_sparse(c->tp, w, x + (int64_t) t * w->rows, thr, c->in_ids, c->in_a,
                                   y + (int64_t) t * ldy);
    }
    gh_tap_count(&c->tap, GH_TAP_INPUTS, -1, head ? GH_STAGE_OTHER : GH_STAGE_ATTENTION,
                 (int64_t) n * w->rows, used);
    return (double) used * (double) w->row_bytes;
}

/* One projection site (q/k/v together, o, or the head): k <= 3 weights of the same input x
 * [n][in], outputs y[i] [n][ld[i]]. The one branch every site takes: on the device (dev,
 * one async matmul per weight and one sync), input-sparse through the transposed copy t
 * (the k weights' columns side by side: a used input's row covers all k outputs) with the
 * thresholds thr, or dense (one pool job for the k weights). Adds the weight bytes read to
 * *bytes; returns a device error (the outputs are then not to be read). */
typedef struct {
    int                k;
    const gh_weight *  w[3];
    const gh_dweight * dev[3];   /* NULL: not on the device */
    const gh_weight *  t;        /* NULL: no input-sparse copy */
    const float *      thr;
    float *            y[3];
    int64_t            ld[3];
    bool               head;     /* its used inputs count as the head's */
} proj_site;

static gh_status project(gh_context * c, const proj_site * s, const float * x, int32_t n,
                         bool insp, double * bytes) {
    if (s->dev[0]) {
        gh_status st = GH_OK;
        for (int i = 0; i < s->k && !st; i++) st = gh_hybrid_matmul_async(c, s->dev[i], x, n, s->y[i]);
        for (int i = 0; i < s->k; i++) *bytes += weight_bytes(s->w[i]);
        return gh_hybrid_sync(c, st);
    } else if (insp && s->t) {
        if (s->k == 1) {
            *bytes += sparse_proj(c, s->t, s->thr, x, n, s->y[0], s->ld[0], s->head);
            return GH_OK;
        }
        /* one token at a time into c->in_qkv, then split into the k outputs */
        const int64_t in = s->t->rows;
        for (int32_t r = 0; r < n; r++) {
            *bytes += sparse_proj(c, s->t, s->thr, x + (int64_t) r * in, 1, c->in_qkv, s->t->cols,
                                  s->head);
            int64_t off = 0;
            for (int i = 0; i < s->k; i++) {
                memcpy(s->y[i] + (int64_t) r * s->ld[i], c->in_qkv + off, (size_t) s->ld[i] * sizeof(float));
                off += s->ld[i];
            }
        }
    } else {
        for (int i = 0; i < s->k; i++) *bytes += weight_bytes(s->w[i]);
        if (s->k == 1) gh_matmul(c->tp, s->w[0], x, n, s->y[0], s->ld[0], c->mm_scratch);
        else gh_matmul_multi(c->tp, s->w, s->k, x, n, s->y, s->ld, c->mm_scratch);
    }
    return GH_OK;
}

/* RMSNorm in place of n rows of `heads` heads of hd values each (ld apart): each head on
 * its own with the shared weights w [hd] (per_head), or each row as a whole with w
 * [heads·hd]. */
static void qk_norm_rows(float * y, const float * w, int32_t n, int64_t ld, int heads, int64_t hd,
                         bool per_head, float eps) {
    for (int32_t t = 0; t < n; t++) {
        float * row = y + (int64_t) t * ld;
        if (!per_head) {
            gh_rmsnorm(row, w, heads * hd, eps, row);
            continue;
        }
        for (int h = 0; h < heads; h++) gh_rmsnorm(row + h * hd, w, hd, eps, row + h * hd);
    }
}

/* Row `row` of layer il's cache of c = k, v (f32, dkv values each) in the cache's type. */
static void store_kv(const gh_context * c, int il, int32_t row, const float * k, const float * v,
                     int64_t dkv) {
    uint8_t * kdst = (uint8_t *) c->k_cache[il] + (size_t) row * c->kv_row;
    uint8_t * vdst = (uint8_t *) c->v_cache[il] + (size_t) row * c->kv_row;
    if (c->kv_store) {
        c->kv_store(k, kdst, dkv);
        c->kv_store(v, vdst, dkv);
    } else { /* F32 */
        memcpy(kdst, k, (size_t) dkv * sizeof(float));
        memcpy(vdst, v, (size_t) dkv * sizeof(float));
    }
}

/* Attention of layer il over the normed input c->xb: q, k, v (+ biases, RoPE) into the
 * cache, causal attention, output projection (+ bias) into out [n][n_embd]; input-sparse
 * projections when `insp` (and the layer's thresholds are not all 0). Adds the weight
 * bytes read to *bytes; returns a device error. */
static gh_status attention(gh_context * c, int il, int32_t n, float * out, bool insp,
                           double * bytes) {
    const gh_model * m = c->model;
    const gh_hparams * hp = &m->hp;
    const gh_layer * L = &m->layers[il];
    const int64_t d = hp->n_embd, hd = hp->head_dim, dq = (int64_t) hp->n_head * hd,
                  dkv = (int64_t) hp->n_head_kv * hd;
    const int32_t p0 = c->n_past;
    /* this batch's k and v: straight into an F32 cache, else made in f32 and stored (so
     * too in a batched decode, whose tokens go to the caches of their own contexts) */
    const bool kv_f32 = c->cache_type == GH_TYPE_F32 && !c->seq;
    float * kc = kv_f32 ? (float *) c->k_cache[il] + (int64_t) p0 * dkv : c->k_cur;
    float * vc = kv_f32 ? (float *) c->v_cache[il] + (int64_t) p0 * dkv : c->v_cur;
    const gh_dlayer * D = m->hy ? &m->hy->layers[il] : NULL;
    gh_tap_buf(&c->tap, GH_TAP_ATTN_IN, il, n, c->xb, NULL);
    /* a layer whose attention is on the device runs it densely there */
    const bool dev_att = D && D->att;
    const proj_site qkv = {
        .k = 3, .w = { &L->wq, &L->wk, &L->wv },
        .dev = { dev_att ? &D->wq : NULL, dev_att ? &D->wk : NULL, dev_att ? &D->wv : NULL },
        .t = L->qkv_on ? &L->qkv_t : NULL, .thr = L->thr_qkv,
        .y = { c->q, kc, vc }, .ld = { dq, dkv, dkv },
    };
    gh_status st = project(c, &qkv, c->xb, n, insp, bytes);
    if (st) return st;
    add_bias(c->q, L->bq, n, dq, dq);
    add_bias(kc, L->bk, n, dkv, dkv);
    add_bias(vc, L->bv, n, dkv, dkv);
    if (hp->qk_norm != GH_QK_NORM_NONE) {
        const bool per_head = hp->qk_norm == GH_QK_NORM_HEAD;
        qk_norm_rows(c->q, L->q_norm, n, dq, hp->n_head, hd, per_head, hp->norm_eps);
        qk_norm_rows(kc, L->k_norm, n, dkv, hp->n_head_kv, hd, per_head, hp->norm_eps);
    }
    /* NoPE layers (SmolLM3's every 4th) attend by content alone; local (sliding-window)
     * layers rotate with their own angles */
    const bool nope = hp->nope_every > 0 && (il + 1) % hp->nope_every == 0;
    const bool local = hp->swa && hp->swa[il];
    if (hp->rope != GH_ROPE_NONE && !nope) {
        const int neox = hp->rope == GH_ROPE_NEOX;
        const float * cs = local && c->rope_swa ? c->rope_swa : c->rope;
        for (int32_t t = 0; t < n; t++) {
            gh_rope(c->q + t * dq, hp->n_head, (int) hd, hp->n_rot, cs + t * hd, neox);
            gh_rope(kc + (int64_t) t * dkv, hp->n_head_kv, (int) hd, hp->n_rot, cs + t * hd, neox);
        }
    }
    /* the full cache is kept for local layers too: they are interleaved with global ones,
     * which need it, and the window is a mask */
    const gh_attn_opts ao = { .scale = hp->attn_scale, .softcap = hp->attn_softcap,
                              .window = local ? hp->n_swa : 0, .sinks = L->sinks };
    if (c->seq) {
        /* a batch of several contexts: each context's run of tokens joins its own cache
         * after its n_past and attends causally over it (the context's cache type) */
        for (int32_t t = 0, e; t < n; t = e) {
            e = seq_run_end(c, t, n);
            const gh_context * s = c->seq[t];
            for (int32_t r = t; r < e; r++) {
                store_kv(s, il, c->seq_pos[r], kc + (int64_t) r * dkv, vc + (int64_t) r * dkv, dkv);
            }
            gh_attention_ex(c->tp, c->q + t * dq, s->k_cache[il], s->v_cache[il], s->cache_type,
                            c->att + t * dq, e - t, c->seq_pos[t], hp->n_head, hp->n_head_kv,
                            (int) hd, &ao);
        }
    } else {
        if (!kv_f32) {
            for (int32_t t = 0; t < n; t++) {
                store_kv(c, il, p0 + t, kc + (int64_t) t * dkv, vc + (int64_t) t * dkv, dkv);
            }
        }
        gh_attention_ex(c->tp, c->q, c->k_cache[il], c->v_cache[il], c->cache_type, c->att, n, p0,
                        hp->n_head, hp->n_head_kv, (int) hd, &ao);
    }
    gh_tap_buf(&c->tap, GH_TAP_ATTN_OUT_IN, il, n, c->att, NULL);
    const proj_site o = {
        .k = 1, .w = { &L->wo }, .dev = { dev_att ? &D->wo : NULL }, .t = L->o_on ? &L->wo_t : NULL,
        .thr = L->thr_o, .y = { out }, .ld = { d },
    };
    st = project(c, &o, c->att, n, insp, bytes);
    if (st) return st;
    add_bias(out, L->bo, n, d, d);
    return GH_OK;
}

/* The dense FFN of layer il over c->xb into c->xb2 (its input, gate and activation shown
 * to the tap). */
static void ffn_dense(gh_context * c, int il, int32_t n) {
    const gh_model * m = c->model;
    const gh_hparams * hp = &m->hp;
    const gh_layer * L = &m->layers[il];
    const int64_t d = hp->n_embd, ff = hp->n_ff;
    gh_tap_buf(&c->tap, GH_TAP_FFN_IN, il, n, c->xb, NULL);
    if (hp->gated) {
        const gh_weight * ws[2] = { &L->gate, &L->up };
        float * ys[2] = { c->hb, c->hb2 };
        const int64_t ld[2] = { ff, ff };
        gh_matmul_multi(c->tp, ws, 2, c->xb, n, ys, ld, c->mm_scratch);
        add_bias(c->hb2, L->up_b, n, ff, ff);
    } else {
        gh_matmul(c->tp, &L->gate, c->xb, n, c->hb, ff, c->mm_scratch);
    }
    add_bias(c->hb, L->gate_b, n, ff, ff);
    gh_tap_buf(&c->tap, GH_TAP_FFN_GATE, il, n, c->hb, hp->gated ? c->hb2 : NULL);
    gh_glu(hp->ffn_act, hp->act_threshold, c->hb, hp->gated ? c->hb2 : NULL, c->hb,
           (int64_t) n * ff);
    gh_tap_buf(&c->tap, GH_TAP_FFN_ACT, il, n, c->hb, NULL);
    if (L->has_down_t) gh_matmul_t(c->tp, &L->down_t, c->hb, n, ff, c->xb2, d);
    else gh_matmul(c->tp, &L->down, c->hb, n, c->xb2, d, c->mm_scratch);
    add_bias(c->xb2, L->down_b, n, d, d);
    gh_tap_bytes(&c->tap, GH_STAGE_FFN, gh_dense_ffn_bytes(c, il, n, c->hb));
}

/* Runs n tokens (n <= n_batch) at positions n_past.. (or, with c->seq set, each context's
 * run of tokens after its own n_past: gh_eval_batch_ex); writes logits for no token, the
 * last token (to row 0; with c->seq set, the last token of each context, to rows 0, 1, ..
 * in the contexts' order) or every token (to rows row0..row0+n-1).
 *
 * Sequential block: x += attn(norm1(x)); x += ffn(norm2(x)).
 * Parallel block:   x += attn(norm1(x)) + ffn(norm2(x) or norm1(x)), both of the same x.
 * Without input norms a sublayer reads x itself; with output norms (post_norms) each
 * sublayer's output is normed before it is added: x += post_norm1(attn(..)), and so on.
 * The FFN's residual input (the x its norm reads) is what a PowerInfer predictor reads.
 * A device error ends the pass and is returned (gh_eval reports it and puts n_past back). */
static gh_status forward(gh_context * c, const int32_t * tokens, int32_t n, int which, int32_t row0) {
    const gh_model * m = c->model;
    const gh_hparams * hp = &m->hp;
    const int64_t d = hp->n_embd, hd = hp->head_dim;

    /* a batch of contexts runs the FFN its first context runs its own tokens with
     * (gh_eval_batch_ex checked that every context runs its tokens alike) */
    const int32_t k0 = c->seq ? seq_run_end(c, 0, n) : n;
    /* (a mixture's experts take the sparse path inside gh_moe_ffn) */
    const bool sparse_ffn = !hp->n_expert && gh_sparse_applies(c, k0);
    const bool sparse_moe = hp->n_expert && gh_sparse_applies(c, k0);
    const bool insp = gh_input_sparse_applies(c, k0);
    embed(c, tokens, n, c->x, c->xb);
    if (hp->rope != GH_ROPE_NONE) {
        for (int32_t t = 0; t < n; t++) {
            gh_rope_angles(hp->n_rot, token_pos(c, t), hp->rope_theta, hp->rope_freq_scale,
                           hp->rope_freqs, c->rope + t * hd);
            /* YaRN's attention factor scales cos and sin (q.k by its square), as
             * transformers' rotary embedding does */
            for (int64_t i = 0; hp->rope_attn_factor != 1.0f && i < hd; i++)
                c->rope[t * hd + i] *= hp->rope_attn_factor;
            if (c->rope_swa) {
                gh_rope_angles(hp->n_rot, token_pos(c, t), hp->rope_theta_swa,
                               hp->rope_freq_scale_swa, NULL, c->rope_swa + t * hd);
            }
        }
    }
    gh_tap_mark(&c->tap); /* embedding the tokens is no stage's */
    for (int il = 0; il < hp->n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        if (c->skip && c->skip[il]) continue; /* a draft's skipped layer: x passes through */
        sublayer_input(hp, L->attn_norm, L->attn_norm_b, c->x, n, c->xb);
        /* the FFN's input: parallel blocks norm the x the attention read (xb already holds
         * norm1(x) when there is no second norm) and add the attention's output after the
         * FFN; sequential ones norm the updated x */
        float * att_out = hp->parallel ? c->xb3 : c->xb2;
        double att_bytes = 0.0;
        gh_status st = attention(c, il, n, att_out, insp, &att_bytes);
        if (st) return st;
        sublayer_output(hp, L->post_attn_norm, L->post_attn_norm_b, att_out, n);
        if (hp->parallel) {
            if (L->ffn_norm) norm_rows(hp, L->ffn_norm, L->ffn_norm_b, c->x, n, c->xb);
        } else {
            add_inplace(c->x, c->xb2, (int64_t) n * d);
            sublayer_input(hp, L->ffn_norm, L->ffn_norm_b, c->x, n, c->xb);
        }
        gh_tap_stage(&c->tap, GH_STAGE_ATTENTION, att_bytes);

        /* the sparse FFN: each token its own active rows (a batched decode's over their
         * union), its stages (the predictor's apart from the FFN's) and bytes its own */
        if (sparse_ffn) st = gh_sparse_ffn_batch(c, il, n, c->xb, c->x, c->xb2);
        else if (hp->n_expert && il >= hp->n_dense_lead) st = gh_moe_ffn(c, il, n, sparse_moe);
        else ffn_dense(c, il, n);
        if (st) return st;
        sublayer_output(hp, L->post_ffn_norm, L->post_ffn_norm_b, c->xb2, n);
        if (hp->parallel) add_inplace(c->x, c->xb3, (int64_t) n * d);
        add_inplace(c->x, c->xb2, (int64_t) n * d);
        gh_tap_stage(&c->tap, GH_STAGE_FFN, 0.0);
    }

    if (!c->seq) c->n_past += n; /* a batch's contexts: gh_eval_batch_ex */
    if (gh_tap_wants(&c->tap, GH_TAP_HEAD_IN)) {
        /* every token's head input (the logits stay the last token's) */
        norm_rows(hp, m->output_norm, m->output_norm_b, c->x, n, c->xb);
        gh_tap_buf(&c->tap, GH_TAP_HEAD_IN, -1, n, c->xb, NULL);
    }
    if (which == GH_LOGITS_NONE) return GH_OK;
    /* head: only the rows whose logits are kept (in a batch of several contexts, the last
     * row of each context's run), gathered into xb */
    int32_t nt;
    if (which == GH_LOGITS_LAST && c->seq) {
        nt = 0;
        for (int32_t t = 0; t < n; t = seq_run_end(c, t, n)) {
            const int32_t last = seq_run_end(c, t, n) - 1;
            norm_rows(hp, m->output_norm, m->output_norm_b, c->x + (int64_t) last * d, 1,
                      c->xb + (int64_t) nt++ * d);
        }
    } else {
        const int32_t t0 = which == GH_LOGITS_ALL ? 0 : n - 1;
        nt = n - t0;
        norm_rows(hp, m->output_norm, m->output_norm_b, c->x + (int64_t) t0 * d, nt, c->xb);
    }
    float * logits = c->logits + (size_t) row0 * hp->n_vocab;
    if (c->head_rows_on) {
        /* a draft's head: its rows' logits (computed into the front of each logits row),
         * scattered to their ids, every other logit -inf */
        const int32_t k = c->n_head_ids;
        gh_matmul(c->tp, &c->head_w, c->xb, nt, logits, hp->n_vocab, c->mm_scratch);
        for (int32_t t = 0; t < nt; t++) {
            float * row = logits + (size_t) t * hp->n_vocab;
            memcpy(c->head_tmp, row, (size_t) k * sizeof(float));
            for (int32_t v = 0; v < hp->n_vocab; v++) row[v] = -INFINITY;
            for (int32_t i = 0; i < k; i++) row[c->head_ids[i]] = c->head_tmp[i];
        }
        if (hp->final_softcap > 0) {
            for (int32_t t = 0; t < nt; t++) {
                float * row = logits + (size_t) t * hp->n_vocab;
                for (int32_t i = 0; i < k; i++) {
                    gh_softcap(row + c->head_ids[i], 1, hp->final_softcap);
                }
            }
        }
        gh_tap_bytes(&c->tap, GH_STAGE_OTHER, (double) k * (double) c->head_w.row_bytes);
        return GH_OK;
    }
    const bool dev_head = m->hy && m->hy->head;
    const proj_site head = {
        .k = 1, .w = { &m->output }, .dev = { dev_head ? &m->hy->output : NULL },
        .t = m->head_on ? &m->output_t : NULL, .thr = m->thr_head, .y = { logits },
        .ld = { hp->n_vocab }, .head = true,
    };
    double bytes = 0.0;
    const gh_status st = project(c, &head, c->xb, nt, insp, &bytes);
    if (st) return st;
    if (hp->final_softcap > 0) gh_softcap(logits, (int64_t) nt * hp->n_vocab, hp->final_softcap);
    /* its time is in t_other (the rest of t_total), its bytes the head's */
    gh_tap_bytes(&c->tap, GH_STAGE_OTHER, bytes);
    return GH_OK;
}

gh_status gh_forward_batch(gh_context * c, const int32_t * tokens, int32_t n, int which,
                           int32_t row0) {
    gh_tap_begin(&c->tap);
    const gh_status st = forward(c, tokens, n, which, row0);
    gh_tap_end(&c->tap, n);
    return st;
}

gh_status gh_eval_tokens(gh_context * c, const int32_t * tokens, int32_t n_tokens,
                         int32_t logits_all) {
    if (!tokens || n_tokens <= 0) return gh_fail(GH_ERR_INVALID_ARG, "gh_eval: no tokens given");
    const int32_t n_vocab = c->model->hp.n_vocab;
    for (int32_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return gh_fail(GH_ERR_RANGE, "token id %d at index %d is outside the vocabulary [0, %d)",
                           tokens[i], i, n_vocab);
        }
    }
    if ((int64_t) c->n_past + n_tokens > c->n_ctx) {
        return gh_fail(GH_ERR_RANGE,
                       "context full: %d tokens cached + %d new > n_ctx = %d; create the context "
                       "with a larger n_ctx or truncate it",
                       c->n_past, n_tokens, c->n_ctx);
    }
    const int32_t rows = logits_all ? n_tokens : 1;
    if (rows > c->logits_cap) {
        float * l = gh_aligned_alloc((size_t) rows * n_vocab * sizeof(float));
        if (!l) return gh_fail(GH_ERR_OOM, "out of memory for %d rows of logits", rows);
        gh_aligned_free(c->logits);
        c->logits = l;
        c->logits_cap = rows;
    }
    const int32_t n_past0 = c->n_past;
    for (int32_t i = 0; i < n_tokens; i += c->n_batch) {
        const int32_t n = GH_MIN(c->n_batch, n_tokens - i);
        const int which = logits_all ? GH_LOGITS_ALL
                          : i + n == n_tokens ? GH_LOGITS_LAST : GH_LOGITS_NONE;
        const gh_status st = gh_forward_batch(c, tokens + i, n, which, logits_all ? i : 0);
        if (st) {
            /* a device op failed: these tokens are not in the cache, and no logits */
            c->n_past = n_past0;
            c->n_logit_rows = 0;
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", gh_last_error());
            return gh_fail(st, "device '%s' failed during gh_eval (the context is "
                           "back at %d tokens): %s", c->model->hy->info.device, n_past0, msg);
        }
    }
    c->n_logit_rows = rows;
    return GH_OK;
}

gh_status gh_eval(gh_context * c, const int32_t * tokens, int32_t n_tokens, int32_t logits_all) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_eval");
    if (st) return st;
    st = gh_eval_tokens(c, tokens, n_tokens, logits_all);
    gh_ctx_leave(c);
    return st;
}

const float * gh_get_logits(const gh_context * c, int32_t i) {
    if (!c || c->n_logit_rows == 0) return NULL;
    if (i < 0) i = c->n_logit_rows - 1;
    if (i >= c->n_logit_rows) return NULL;
    return c->logits + (size_t) i * c->model->hp.n_vocab;
}

int32_t gh_n_logit_rows(const gh_context * c) { return c ? c->n_logit_rows : 0; }
