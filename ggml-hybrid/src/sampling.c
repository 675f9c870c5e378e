/* Token sampling: repetition penalty, temperature, top-k, top-p, min-p, seeded RNG.
 * Order follows Hugging Face's generate (penalty, temperature, top-k, top-p, min-p),
 * so a given seed reproduces the same tokens run after run. */
#include "core/common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int32_t id; float logit; float p; } gh_cand;

struct gh_sampler {
    gh_sampler_params p;
    int32_t   n_vocab;
    gh_cand * cand;     /* n_vocab */
    int32_t * history;  /* ring of the last repeat_last_n accepted tokens */
    int32_t   n_hist;
    int32_t   hist_pos;
    uint8_t * seen;     /* n_vocab flags, for applying the penalty once per token */
    uint64_t  rng;
};

gh_sampler_params gh_sampler_default_params(void) {
    gh_sampler_params p = { .temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                            .repeat_penalty = 1.0f, .repeat_last_n = 64, .seed = 0 };
    return p;
}

/* splitmix64: small, fast, and identical on every platform for a given seed. */
static uint64_t rng_next(uint64_t * s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_uniform(uint64_t * s) { return (double) (rng_next(s) >> 11) * 0x1.0p-53; }

gh_status gh_sampler_new(const gh_sampler_params * p, int32_t n_vocab, gh_sampler ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_sampler_new: out is NULL");
    *out = NULL;
    if (!p) return gh_fail(GH_ERR_INVALID_ARG, "gh_sampler_new: params are NULL");
    if (n_vocab <= 0) return gh_fail(GH_ERR_INVALID_ARG, "n_vocab must be positive, got %d", n_vocab);
    if (!(p->temperature >= 0) || !isfinite(p->temperature)) {
        return gh_fail(GH_ERR_INVALID_ARG, "temperature must be >= 0, got %g", p->temperature);
    }
    if (!(p->top_p > 0)) return gh_fail(GH_ERR_INVALID_ARG, "top_p must be > 0 (1 or more turns it off), got %g", p->top_p);
    if (!(p->min_p >= 0) || p->min_p > 1) {
        return gh_fail(GH_ERR_INVALID_ARG, "min_p must be in [0, 1], got %g", p->min_p);
    }
    if (!(p->repeat_penalty > 0) || !isfinite(p->repeat_penalty)) {
        return gh_fail(GH_ERR_INVALID_ARG, "repeat_penalty must be > 0, got %g", p->repeat_penalty);
    }
    if (p->repeat_last_n < 0 || p->repeat_last_n > (1 << 20)) {
        return gh_fail(GH_ERR_INVALID_ARG, "repeat_last_n must be in [0, 2^20], got %d", p->repeat_last_n);
    }
    gh_sampler * s = calloc(1, sizeof *s);
    if (!s) return gh_fail(GH_ERR_OOM, "out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    s->cand = malloc((size_t) n_vocab * sizeof *s->cand);
    s->seen = calloc((size_t) n_vocab, 1);
    s->history = malloc((size_t) GH_MAX(p->repeat_last_n, 1) * sizeof(int32_t));
    if (!s->cand || !s->seen || !s->history) {
        gh_sampler_free(s);
        return gh_fail(GH_ERR_OOM, "out of memory");
    }
    gh_sampler_reset(s);
    *out = s;
    return GH_OK;
}

void gh_sampler_free(gh_sampler * s) {
    if (!s) return;
    free(s->cand);
    free(s->seen);
    free(s->history);
    free(s);
}

void gh_sampler_reset(gh_sampler * s) {
    if (!s) return;
    s->n_hist = 0;
    s->hist_pos = 0;
    s->rng = s->p.seed;
}

void gh_sampler_accept(gh_sampler * s, int32_t token) {
    if (!s || s->p.repeat_last_n == 0) return;
    s->history[s->hist_pos] = token;
    s->hist_pos = (s->hist_pos + 1) % s->p.repeat_last_n;
    if (s->n_hist < s->p.repeat_last_n) s->n_hist++;
}

static int cmp_logit_desc(const void * a, const void * b) {
    float x = ((const gh_cand *) a)->logit, y = ((const gh_cand *) b)->logit;
    if (x > y) return -1;
    if (x < y) return 1;
    /* ties: lower id first, so the order (and thus sampling) is deterministic */
    return ((const gh_cand *) a)->id - ((const gh_cand *) b)->id;
}

/* Moves the k largest candidates to the front, sorted (quickselect, then sort k). */
static void partial_sort_desc(gh_cand * c, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        gh_cand pivot = c[lo + (hi - lo) / 2];
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (cmp_logit_desc(&c[i], &pivot) < 0) i++;
            while (cmp_logit_desc(&c[j], &pivot) > 0) j--;
            if (i <= j) { gh_cand t = c[i]; c[i] = c[j]; c[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j; else if (k - 1 >= i) lo = i; else break;
    }
    qsort(c, (size_t) k, sizeof *c, cmp_logit_desc);
}

static int32_t argmax(const float * logits, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++) if (logits[i] > logits[best]) best = i;
    return best;
}

/* The token `back` places before the newest of the penalty's window: the accepted history
 * followed by extra[0..n_extra) (drafted tokens not accepted yet), newest last. */
static int32_t window_token(const gh_sampler * s, const int32_t * extra, int32_t n_extra,
                            int32_t back) {
    if (back < n_extra) return extra[n_extra - 1 - back];
    back -= n_extra;
    const int32_t r = s->p.repeat_last_n;
    return s->history[((s->hist_pos - 1 - back) % r + r) % r];
}

/* Applies the penalty, temperature, top-k, top-p and min-p to logits as if `extra` had been
 * accepted after the history; leaves the kept candidates in s->cand[0..n) with their
 * unnormalised probabilities in .p (greedy: the one best token, p = 1) and returns n. */
static int32_t warp(gh_sampler * s, const float * logits, const int32_t * extra,
                    int32_t n_extra) {
    const int32_t nv = s->n_vocab;
    const gh_sampler_params * p = &s->p;
    const int32_t n_win = GH_MIN(s->n_hist + n_extra, p->repeat_last_n);
    const bool penalize = p->repeat_penalty != 1.0f && n_win > 0;
    gh_cand * c = s->cand;

    if (p->temperature <= 0 && !penalize) { /* greedy fast path: no copy */
        c[0].id = argmax(logits, nv);
        c[0].p = 1.0f;
        return 1;
    }
    for (int32_t i = 0; i < nv; i++) { c[i].id = i; c[i].logit = logits[i]; }
    if (penalize) {
        /* Each distinct token in the window is penalised once (CTRL-style). */
        for (int32_t i = 0; i < n_win; i++) {
            int32_t t = window_token(s, extra, n_extra, i);
            if (t < 0 || t >= nv || s->seen[t]) continue;
            s->seen[t] = 1;
            float l = c[t].logit;
            c[t].logit = l > 0 ? l / p->repeat_penalty : l * p->repeat_penalty;
        }
        for (int32_t i = 0; i < n_win; i++) {
            int32_t t = window_token(s, extra, n_extra, i);
            if (t >= 0 && t < nv) s->seen[t] = 0;
        }
    }
    if (p->temperature <= 0) {
        int32_t best = 0;
        for (int32_t i = 1; i < nv; i++) if (c[i].logit > c[best].logit) best = i;
        c[0] = c[best]; /* c[best].id == best: the copy above kept ids in place */
        c[0].p = 1.0f;
        return 1;
    }
    const float inv_t = 1.0f / p->temperature;
    for (int32_t i = 0; i < nv; i++) c[i].logit *= inv_t;

    int32_t n = nv;
    if (p->top_k > 0 && p->top_k < n) n = p->top_k;
    partial_sort_desc(c, nv, n);

    /* softmax over the kept candidates (sorted, so c[0] holds the max) */
    double sum = 0;
    for (int32_t i = 0; i < n; i++) { c[i].p = expf(c[i].logit - c[0].logit); sum += c[i].p; }
    for (int32_t i = 0; i < n; i++) c[i].p = (float) (c[i].p / sum);

    if (p->top_p < 1.0f) {
        double cum = 0;
        int32_t keep = n;
        for (int32_t i = 0; i < n; i++) {
            cum += c[i].p;
            if (cum >= p->top_p) { keep = i + 1; break; }
        }
        n = keep;
    }
    if (p->min_p > 0) {
        const float cut = p->min_p * c[0].p;
        int32_t keep = 1;
        while (keep < n && c[keep].p >= cut) keep++;
        n = keep;
    }
    return n;
}

gh_status gh_sampler_sample(gh_sampler * s, const float * logits, int32_t * out_token) {
    if (!s || !logits || !out_token) return gh_fail(GH_ERR_INVALID_ARG, "gh_sampler_sample: NULL argument");
    const int32_t n = warp(s, logits, NULL, 0);
    const gh_cand * c = s->cand;
    if (s->p.temperature <= 0) { /* greedy: no random number drawn */
        *out_token = c[0].id;
        return GH_OK;
    }
    double sum = 0;
    for (int32_t i = 0; i < n; i++) sum += c[i].p;
    double r = rng_uniform(&s->rng) * sum, acc = 0;
    int32_t pick = n - 1;
    for (int32_t i = 0; i < n; i++) {
        acc += c[i].p;
        if (r < acc) { pick = i; break; }
    }
    *out_token = c[pick].id;
    return GH_OK;
}

gh_status gh_sampler_probs(gh_sampler * s, const float * logits, const int32_t * extra,
                           int32_t n_extra, float * probs) {
    if (!s || !logits || !probs || (n_extra && !extra) || n_extra < 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_sampler_probs: NULL or negative argument");
    }
    const int32_t n = warp(s, logits, extra, n_extra);
    const gh_cand * c = s->cand;
    double sum = 0;
    for (int32_t i = 0; i < n; i++) sum += c[i].p;
    memset(probs, 0, (size_t) s->n_vocab * sizeof *probs);
    for (int32_t i = 0; i < n; i++) probs[c[i].id] = (float) (c[i].p / sum);
    return GH_OK;
}

double gh_sampler_random(gh_sampler * s) { return s ? rng_uniform(&s->rng) : 0.0; }
