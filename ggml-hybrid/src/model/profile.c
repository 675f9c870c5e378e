/* Profiling (gh_eval_profile) and embeddings (gh_eval_embd): gh_eval with an observer on
 * the context's tap (core/tap.h) that copies the buffers it is shown into the caller's
 * arrays. The forward pass knows nothing of either. */
#include "model/model.h"

#include <string.h>

/* The caller's arrays (ggml-hybrid.h's gh_profile_bufs, strides resolved) and the first
 * token of the current batch within the call. */
typedef struct {
    gh_profile_bufs b;
    int64_t         d, dq, ff;
    int             act;
    float           cut;   /* FATReLU's threshold, else 0 */
    int32_t         t0;
} profiler;

/* Whether act(g, u) is zero exactly when g <= the cut (ReLU family): its mask reads the
 * pre-activation gate (and up, for dReLU); the others read the activation's output. */
static bool relu_family(int act) {
    return act == GH_ACT_RELU || act == GH_ACT_DRELU || act == GH_ACT_FATRELU;
}

static void copy_rows(float * dst, int64_t stride, int il, int32_t t0, int64_t width,
                      const gh_tap_ev * ev) {
    memcpy(dst + il * stride + (int64_t) t0 * width, ev->buf, (size_t) ev->n * width * sizeof(float));
}

/* Which neurons of the batch's n tokens are active: from the gate before the activation
 * (pre) or from the activation (post). */
static void record_mask(profiler * p, const gh_tap_ev * ev, bool pre) {
    const int64_t ff = p->ff;
    for (int32_t t = 0; t < ev->n; t++) {
        uint8_t * mk = p->b.mask + ev->il * p->b.mask_stride + (int64_t) (p->t0 + t) * ff;
        const float * g = ev->buf + t * ff;
        if (!pre) {
            for (int64_t i = 0; i < ff; i++) mk[i] = g[i] != 0.0f;
        } else if (p->act == GH_ACT_DRELU) {
            const float * u = ev->buf2 + t * ff;
            for (int64_t i = 0; i < ff; i++) mk[i] = g[i] > 0.0f && u[i] > 0.0f;
        } else {
            for (int64_t i = 0; i < ff; i++) mk[i] = g[i] > p->cut;
        }
    }
}

static void observe(void * user, const gh_tap_ev * ev) {
    profiler * p = user;
    switch (ev->point) {
    case GH_TAP_ATTN_IN: copy_rows(p->b.attn_in, p->b.attn_in_stride, ev->il, p->t0, p->d, ev); break;
    case GH_TAP_ATTN_OUT_IN:
        copy_rows(p->b.attn_out_in, p->b.attn_out_in_stride, ev->il, p->t0, p->dq, ev);
        break;
    case GH_TAP_FFN_IN: copy_rows(p->b.ffn_in, p->b.ffn_in_stride, ev->il, p->t0, p->d, ev); break;
    case GH_TAP_FFN_GATE: if (relu_family(p->act)) record_mask(p, ev, true); break;
    case GH_TAP_FFN_ACT: if (!relu_family(p->act)) record_mask(p, ev, false); break;
    case GH_TAP_HEAD_IN: copy_rows(p->b.head_in, 0, 0, p->t0, p->d, ev); break;
    case GH_TAP_TOKENS: p->t0 += ev->n; break; /* the next batch's rows follow */
    default: break;
    }
}

/* gh_eval_tokens on a claimed context with the profiler p on its tap. */
static gh_status eval_observed(gh_context * c, const int32_t * tokens, int32_t n_tokens,
                               profiler * p) {
    const gh_hparams * hp = &c->model->hp;
    p->d = hp->n_embd;
    p->dq = (int64_t) hp->n_head * hp->head_dim;
    p->ff = hp->n_ff;
    p->act = hp->ffn_act;
    p->cut = hp->ffn_act == GH_ACT_FATRELU ? hp->act_threshold : 0.0f;
    p->t0 = 0;
    const unsigned wants = (p->b.attn_in ? 1u << GH_TAP_ATTN_IN : 0u) |
                           (p->b.attn_out_in ? 1u << GH_TAP_ATTN_OUT_IN : 0u) |
                           (p->b.ffn_in ? 1u << GH_TAP_FFN_IN : 0u) |
                           (p->b.mask ? 1u << GH_TAP_FFN_GATE | 1u << GH_TAP_FFN_ACT : 0u) |
                           (p->b.head_in ? 1u << GH_TAP_HEAD_IN : 0u);
    gh_tap_set(&c->tap, observe, p, wants);
    const gh_status st = gh_eval_tokens(c, tokens, n_tokens, 0);
    gh_tap_set(&c->tap, NULL, NULL, 0u);
    return st;
}

gh_status gh_eval_embd(gh_context * c, const int32_t * tokens, int32_t n_tokens, float * out) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_embd: out is NULL");
    gh_status st = gh_ctx_enter(c, "gh_eval_embd");
    if (st) return st;
    /* the head's input of every token is what profiling's head_in records */
    profiler p = { .b = { .head_in = out } };
    st = eval_observed(c, tokens, n_tokens, &p);
    gh_ctx_leave(c);
    return st;
}

gh_status gh_eval_profile(gh_context * c, const int32_t * tokens, int32_t n_tokens,
                          const gh_profile_bufs * out) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_eval_profile: out is NULL");
    const gh_hparams * hp = &c->model->hp;
    const int64_t d = hp->n_embd, ff = hp->n_ff, dq = (int64_t) hp->n_head * hp->head_dim;
    const int64_t nt = GH_MAX(n_tokens, 0);
    profiler p = { .b = *out };
    gh_profile_bufs * b = &p.b;
    if (b->ffn_in_stride == 0) b->ffn_in_stride = nt * d;
    if (b->mask_stride == 0) b->mask_stride = nt * ff;
    if (b->attn_in_stride == 0) b->attn_in_stride = nt * d;
    if (b->attn_out_in_stride == 0) b->attn_out_in_stride = nt * dq;
    if (b->ffn_in_stride < nt * d || b->mask_stride < nt * ff || b->attn_in_stride < nt * d ||
        b->attn_out_in_stride < nt * dq) {
        return gh_fail(GH_ERR_INVALID_ARG,
                       "gh_eval_profile: layer strides (%lld, %lld, %lld, %lld) are smaller than "
                       "one layer's data (%lld inputs, %lld mask bytes, %lld attention inputs, "
                       "%lld attention outputs)", (long long) b->ffn_in_stride,
                       (long long) b->mask_stride, (long long) b->attn_in_stride,
                       (long long) b->attn_out_in_stride, (long long) (nt * d),
                       (long long) (nt * ff), (long long) (nt * d), (long long) (nt * dq));
    }
    if (b->mask && hp->n_expert) {
        return gh_fail(GH_ERR_UNSUPPORTED, "gh_eval_profile: a mixture-of-experts model (%d experts "
                       "per layer) has no neuron mask of one FFN to record; pass mask = NULL",
                       hp->n_expert);
    }
    gh_status st = gh_ctx_enter(c, "gh_eval_profile");
    if (st) return st;
    st = eval_observed(c, tokens, n_tokens, &p);
    gh_ctx_leave(c);
    return st;
}
