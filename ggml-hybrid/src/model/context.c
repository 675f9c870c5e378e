/* Contexts: the KV cache, the activation buffers and the thread pool a forward pass runs in. */
#include "model/model.h"
#include "model/placement.h"
#include "ffn/exec.h"
#include "ffn/moe.h"
#include "ffn/strategy.h"
#include "ffn/auto_mode.h"
#include "core/tap.h"
#include "types/types.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* --------------------------------------------------------------- contexts -- */

gh_context_params gh_context_default_params(void) {
    gh_context_params p = { .n_ctx = 0, .n_batch = 512, .n_threads = 0,
                            .cache_type = GH_TYPE_F16 };
    return p;
}

static int default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int) GH_MIN(n, 64);
}

#define GH_MAX_THREADS 512
/* the most tokens a context holds (n_ctx) */
#define GH_MAX_CTX (1 << 20)

void gh_context_free(gh_context * c) {
    if (!c) return;
    gh_threadpool_free(c->tp);
    gh_ffn_state_free(c->ffn);
    gh_stats_free(&c->stats);
    gh_moe_state_free(c->moe);
    gh_aligned_free(c->in_ids);
    gh_aligned_free(c->in_a);
    gh_aligned_free(c->in_qkv);
    if (c->stream) c->model->hy->b->ops->stream_free(c->stream);
    if (c->k_cache) for (int il = 0; il < c->model->hp.n_layer; il++) gh_aligned_free(c->k_cache[il]);
    if (c->v_cache) for (int il = 0; il < c->model->hp.n_layer; il++) gh_aligned_free(c->v_cache[il]);
    free(c->k_cache);
    free(c->v_cache);
    gh_aligned_free(c->k_cur);
    gh_aligned_free(c->v_cur);
    gh_model * m = c->model;
    gh_aligned_free(c->x);
    gh_aligned_free(c->xb);
    gh_aligned_free(c->xb2);
    gh_aligned_free(c->xb3);
    gh_aligned_free(c->q);
    gh_aligned_free(c->att);
    gh_aligned_free(c->rope);
    gh_aligned_free(c->hb);
    gh_aligned_free(c->hb2);
    gh_aligned_free(c->mm_scratch);
    gh_aligned_free(c->logits);
    gh_aligned_free((void *) c->head_w.data);
    free(c->head_ids);
    free(c->head_tmp);
    free(c->skip);
    free(c);
    gh_model_free(m); /* the context's reference */
}

static gh_status check_threads(int32_t n) {
    if (n < 0 || n > GH_MAX_THREADS) {
        return gh_fail(GH_ERR_INVALID_ARG, "n_threads must be between 1 and %d (0 = all cores), got %d",
                       GH_MAX_THREADS, n);
    }
    return GH_OK;
}

static size_t max_scratch(const gh_model * m, int64_t n_tokens) {
    size_t s = gh_matmul_scratch_size(&m->output, n_tokens);
    for (int il = 0; il < m->hp.n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        const gh_weight * ws[] = { &L->wq, &L->wk, &L->wv, &L->wo, &L->gate, &L->up, &L->down };
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
            s = GH_MAX(s, gh_matmul_scratch_size(ws[i], n_tokens));
        }
    }
    return s;
}

gh_status gh_context_new(gh_model * m, const gh_context_params * p, gh_context ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_new: out is NULL");
    *out = NULL;
    if (!m) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_new: model is NULL");
    gh_context_params dp = gh_context_default_params();
    if (!p) p = &dp;
    const gh_hparams * hp = &m->hp;
    /* n_ctx = 0 takes the training context, which a file may state as anything up to
     * INT32_MAX (model.c saturates it): what is allocated is bounded here either way */
    if (p->n_ctx < 0 || p->n_ctx > GH_MAX_CTX) {
        return gh_fail(GH_ERR_INVALID_ARG, "n_ctx must be between 1 and %d, got %d", GH_MAX_CTX, p->n_ctx);
    }
    if (p->n_ctx == 0 && hp->n_ctx_train > GH_MAX_CTX) {
        return gh_fail(GH_ERR_INVALID_ARG, "n_ctx = 0 asks for the model's training context "
                       "(%s.context_length = %d%s tokens), more than the %d a context can hold: "
                       "pass a smaller n_ctx", m->arch->name, hp->n_ctx_train,
                       hp->n_ctx_train == INT32_MAX ? " or more" : "", GH_MAX_CTX);
    }
    const int32_t n_ctx = p->n_ctx > 0 ? p->n_ctx : hp->n_ctx_train;
    if (hp->n_pos && n_ctx > hp->n_pos - hp->pos_offset) {
        return gh_fail(GH_ERR_INVALID_ARG, "n_ctx = %d exceeds the %d positions this %s model has "
                       "learned (position_embd.weight)", n_ctx, hp->n_pos - hp->pos_offset,
                       m->arch->name);
    }
    if (p->n_batch < 0) return gh_fail(GH_ERR_INVALID_ARG, "n_batch must be >= 0, got %d", p->n_batch);
    gh_status st = check_threads(p->n_threads);
    if (st) return st;
    if ((st = gh_kv_cache_type_check(p->cache_type, hp->head_dim))) return st;
    int32_t n_batch = p->n_batch > 0 ? GH_MIN(p->n_batch, n_ctx) : n_ctx;
    int n_threads = p->n_threads > 0 ? p->n_threads : default_threads();

    gh_context * c = calloc(1, sizeof *c);
    if (!c) return gh_fail(GH_ERR_OOM, "out of memory");
    c->model = m;
    atomic_fetch_add(&m->refs, 1);
    c->n_ctx = n_ctx;
    c->n_batch = n_batch;
    c->tp = gh_threadpool_new(n_threads);
    if (!c->tp) { gh_context_free(c); return GH_ERR_OOM; }

    const size_t d = hp->n_embd, dq = (size_t) hp->n_head * hp->head_dim,
                 dkv = (size_t) hp->n_head_kv * hp->head_dim, ff = hp->n_ff, nb = n_batch;
    bool ok = true;
    c->cache_type = p->cache_type;
    c->kv_row = gh_row_size(p->cache_type, (int64_t) dkv);
    if (c->cache_type != GH_TYPE_F32) c->kv_store = gh_type_traits_get(c->cache_type)->from_float;
    c->k_cache = calloc((size_t) hp->n_layer, sizeof(void *));
    c->v_cache = calloc((size_t) hp->n_layer, sizeof(void *));
    ok = c->k_cache && c->v_cache;
    for (int il = 0; ok && il < hp->n_layer; il++) {
        c->k_cache[il] = gh_aligned_alloc((size_t) n_ctx * c->kv_row);
        c->v_cache[il] = gh_aligned_alloc((size_t) n_ctx * c->kv_row);
        ok = c->k_cache[il] && c->v_cache[il];
    }
    if (ok) { /* F32 caches too: a batched decode (gh_eval_batch) stores through them */
        c->k_cur = gh_aligned_alloc(nb * dkv * sizeof(float));
        c->v_cur = gh_aligned_alloc(nb * dkv * sizeof(float));
        ok = c->k_cur && c->v_cur;
    }
    if (ok) {
        c->x = gh_aligned_alloc(nb * d * sizeof(float));
        c->xb = gh_aligned_alloc(nb * d * sizeof(float));
        c->xb2 = gh_aligned_alloc(nb * d * sizeof(float));
        c->xb3 = gh_aligned_alloc(nb * d * sizeof(float));
        c->q = gh_aligned_alloc(nb * dq * sizeof(float));
        c->att = gh_aligned_alloc(nb * dq * sizeof(float));
        /* with sliding-window layers whose RoPE differs (Gemma 3: its own base, unscaled), the
         * local layers' angles follow the global ones'; otherwise they share them (gpt-oss:
         * YaRN in both) */
        const size_t n_rope = nb * (size_t) hp->head_dim;
        const bool own_swa = hp->swa && (hp->rope_theta_swa != hp->rope_theta ||
                                         hp->rope_freq_scale_swa != hp->rope_freq_scale);
        c->rope = gh_aligned_alloc((own_swa ? 2 : 1) * n_rope * sizeof(float));
        c->rope_swa = own_swa && c->rope ? c->rope + n_rope : NULL;
        c->hb = gh_aligned_alloc(nb * ff * sizeof(float));
        c->hb2 = gh_aligned_alloc(nb * ff * sizeof(float));
        c->mm_scratch = gh_aligned_alloc(max_scratch(m, nb));
        c->logits_cap = 1;
        c->logits = gh_aligned_alloc((size_t) hp->n_vocab * sizeof(float));
        c->ffn = gh_ffn_state_new(m, n_batch);
        gh_ffn_auto_choice ch;  /* `auto`: the file's mode where estimated faster than dense */
        c->ffn_mode = gh_ffn_auto_mode(m, gh_simd_get(), &ch) ? GH_FFN_DENSE : ch.mode;
        c->sparse_batch = GH_SPARSE_BATCH_MAX_DEFAULT;
        /* a mixture's leading dense layers run dense in every mode: its tokens are
         * counted at the first layer with experts */
        const bool stats_ok = gh_stats_init(&c->stats, hp->n_layer, hp->n_expert ? hp->n_dense_lead : 0) == GH_OK;
        c->tap.stats = &c->stats;
        const size_t nin = GH_MAX(d, dq);
        c->in_ids = gh_aligned_alloc(nin * sizeof(int32_t));
        c->in_a = gh_aligned_alloc(nin * sizeof(float));
        c->in_qkv = gh_aligned_alloc((dq + 2 * dkv) * sizeof(float));
        c->input_sparse = m->info.has_input_sparsity != 0;
        ok = c->x && c->xb && c->xb2 && c->xb3 && c->q && c->att && c->rope && c->hb && c->hb2 &&
             c->mm_scratch && c->logits && c->ffn && stats_ok && c->in_ids && c->in_a && c->in_qkv;
    }
    if (ok && hp->n_expert) {
        c->moe = gh_moe_state_new(m, n_batch);
        ok = c->moe != NULL;
    }
    if (!ok) {
        gh_context_free(c);
        return gh_fail(GH_ERR_OOM, "out of memory allocating a context of %d tokens", n_ctx);
    }
    if (m->hy && (st = gh_hybrid_stream_new(m, &c->stream))) {
        gh_context_free(c);
        return st;
    }
    *out = c;
    return GH_OK;
}

gh_status gh_ctx_enter(gh_context * c, const char * what) {
    int idle = 0;
    if (atomic_compare_exchange_strong(&c->busy, &idle, 1)) return GH_OK;
    return gh_fail(GH_ERR_BUSY, "%s: this context is running a call on another thread; give each "
                   "thread its own context (contexts can share one model)", what);
}

void gh_ctx_leave(gh_context * c) { atomic_store(&c->busy, 0); }

int32_t gh_context_n_ctx(const gh_context * c) { return c ? c->n_ctx : 0; }
int32_t gh_context_n_past(const gh_context * c) { return c ? c->n_past : 0; }
int32_t gh_context_cache_type(const gh_context * c) { return c ? c->cache_type : -1; }

static gh_status set_threads(gh_context * c, int32_t n_threads) {
    gh_status st = check_threads(n_threads);
    if (st) return st;
    int n = n_threads > 0 ? n_threads : default_threads();
    if (n == gh_threadpool_n_threads(c->tp)) return GH_OK;
    gh_threadpool * tp = gh_threadpool_new(n);
    if (!tp) return GH_ERR_OOM; /* message set by the pool */
    gh_threadpool_free(c->tp);
    c->tp = tp;
    return GH_OK;
}

gh_status gh_context_set_threads(gh_context * c, int32_t n_threads) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_set_threads");
    if (st) return st;
    st = set_threads(c, n_threads);
    gh_ctx_leave(c);
    return st;
}

gh_status gh_context_truncate(gh_context * c, int32_t n_past) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_truncate");
    if (st) return st;
    if (n_past < 0 || n_past > c->n_past) {
        st = gh_fail(GH_ERR_RANGE, "cannot truncate to %d: the cache holds %d tokens", n_past,
                     c->n_past);
    } else c->n_past = n_past;
    gh_ctx_leave(c);
    return st;
}

/* ------------------------------------------------------------------ states -- */

/* A saved state: a fixed header, then per layer the keys of the first n_tokens positions
 * and then their values (kv_row bytes each, the cache's own layout), then a checksum of
 * everything before it. Host byte order: a state is for this machine's contexts (a
 * prompt cache, a slot saved to disk), not an interchange format. */
#define STATE_MAGIC "GHKV"
#define STATE_VERSION 1u
enum { STATE_HEADER = 40, STATE_TAIL = 8 };

typedef struct {
    char     magic[4];
    uint32_t version;
    uint64_t model_id;   /* model_fingerprint of the model that made it */
    int32_t  n_layer;
    int32_t  n_kv_dim;   /* n_head_kv * head_dim */
    int32_t  cache_type;
    int32_t  n_tokens;
    uint64_t kv_row;     /* bytes of one position's keys (or values) of one layer */
} state_header;
_Static_assert(sizeof(state_header) == STATE_HEADER, "state header layout");

/* A 64-bit hash: FNV-1a's prime on 8-byte words, in four independent lanes (word i goes to
 * lane i % 4, so the multiplies overlap: a state of tens of MB is hashed at memory speed),
 * the lanes then folded in order. Each step is a bijection of its lane for a given word
 * and injective in the word for a given lane, so changing any one word (or the length)
 * changes the result. */
static uint64_t hash_step(uint64_t h, uint64_t w) {
    h = (h ^ w) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_bytes(uint64_t h, const void * data, size_t n) {
    const uint8_t * p = data;
    const uint64_t len = n;
    uint64_t lane[4] = { h, h ^ 1, h ^ 2, h ^ 3 };
    for (; n >= 32; p += 32, n -= 32) {
        uint64_t w[4];
        memcpy(w, p, 32);
        for (int k = 0; k < 4; k++) lane[k] = hash_step(lane[k], w[k]);
    }
    h = hash_step(hash_step(hash_step(lane[0], lane[1]), lane[2]), lane[3]);
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = hash_step(h, w);
    }
    for (; n; p++, n--) h = (h ^ *p) * 0x100000001b3ull;
    return hash_step(h, len);
}

static uint64_t hash_i64(uint64_t h, int64_t v) { return hash_bytes(h, &v, sizeof v); }

/* The model's identity: its architecture, shape and a sample of the weights the cache is
 * made from (the first key and value row of every layer, 16 token embedding rows spread
 * over the vocabulary, the output norm): two files differ here unless their weights agree
 * there, and it costs a few kilobytes to read. */
static uint64_t model_fingerprint(const gh_model * m) {
    const gh_hparams * hp = &m->hp;
    uint64_t h = hash_bytes(0xcbf29ce484222325ull, m->arch->name, strlen(m->arch->name));
    const int64_t dims[] = { hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv, hp->head_dim,
                             hp->n_ff, hp->n_vocab, hp->n_expert };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) h = hash_i64(h, dims[i]);
    for (int il = 0; il < hp->n_layer; il++) {
        const gh_weight * ws[] = { &m->layers[il].wk, &m->layers[il].wv };
        for (int k = 0; k < 2; k++) {
            h = hash_i64(h, ws[k]->type);
            if (ws[k]->data && ws[k]->rows > 0) {
                h = hash_bytes(h, ws[k]->data, gh_row_size(ws[k]->type, ws[k]->cols));
            }
        }
    }
    if (m->embd && hp->n_vocab > 0) {
        for (int64_t i = 0; i < 16; i++) {
            const int64_t row = i * (hp->n_vocab - 1) / 15;
            h = hash_bytes(h, m->embd + (size_t) row * m->embd_row_bytes, m->embd_row_bytes);
        }
    }
    if (m->output_norm) h = hash_bytes(h, m->output_norm, (size_t) hp->n_embd * sizeof(float));
    return h;
}

static uint64_t state_bytes(const gh_context * c, int32_t n_tokens) {
    return STATE_HEADER + 2ull * (uint64_t) c->model->hp.n_layer * (uint64_t) n_tokens * c->kv_row +
           STATE_TAIL;
}

gh_status gh_context_state_size(const gh_context * c, int32_t n_tokens, uint64_t * size) {
    if (!c || !size) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_state_size: context or size is NULL");
    if (n_tokens < 0 || n_tokens > c->n_ctx) {
        return gh_fail(GH_ERR_RANGE, "a state of %d tokens: the context holds at most %d", n_tokens,
                       c->n_ctx);
    }
    *size = state_bytes(c, n_tokens);
    return GH_OK;
}

gh_status gh_context_state_save(gh_context * c, int32_t n_tokens, void * buf, uint64_t size,
                                uint64_t * written) {
    if (written) *written = 0;
    if (!c || !buf) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_state_save: context or buffer is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_state_save");
    if (st) return st;
    const uint64_t need = n_tokens >= 0 ? state_bytes(c, n_tokens) : 0;
    if (n_tokens < 0 || n_tokens > c->n_past) {
        st = gh_fail(GH_ERR_RANGE, "cannot save %d tokens: the cache holds %d", n_tokens, c->n_past);
    } else if (size < need) {
        st = gh_fail(GH_ERR_INVALID_ARG, "the buffer has %llu bytes, a state of %d tokens needs %llu",
                     (unsigned long long) size, n_tokens, (unsigned long long) need);
    } else {
        const gh_hparams * hp = &c->model->hp;
        state_header hd = { .version = STATE_VERSION, .model_id = model_fingerprint(c->model),
                            .n_layer = hp->n_layer, .n_kv_dim = hp->n_head_kv * hp->head_dim,
                            .cache_type = c->cache_type, .n_tokens = n_tokens, .kv_row = c->kv_row };
        memcpy(hd.magic, STATE_MAGIC, 4);
        uint8_t * p = buf;
        memcpy(p, &hd, STATE_HEADER);
        p += STATE_HEADER;
        const size_t n_bytes = (size_t) n_tokens * c->kv_row;
        for (int il = 0; il < hp->n_layer; il++) {
            memcpy(p, c->k_cache[il], n_bytes);
            p += n_bytes;
            memcpy(p, c->v_cache[il], n_bytes);
            p += n_bytes;
        }
        const uint64_t sum = hash_bytes(0xcbf29ce484222325ull, buf, (size_t) (need - STATE_TAIL));
        memcpy(p, &sum, STATE_TAIL);
        if (written) *written = need;
    }
    gh_ctx_leave(c);
    return st;
}

/* Checks a state against the context it would go into; GH_OK with its token count. */
static gh_status state_check(const gh_context * c, const uint8_t * buf, uint64_t size,
                             int32_t * n_tokens) {
    state_header hd;
    if (size < STATE_HEADER + STATE_TAIL) {
        return gh_fail(GH_ERR_FORMAT, "not a context state: %llu bytes, less than its header",
                       (unsigned long long) size);
    }
    memcpy(&hd, buf, STATE_HEADER);
    if (memcmp(hd.magic, STATE_MAGIC, 4) != 0) {
        return gh_fail(GH_ERR_FORMAT, "not a context state (its first bytes are not \"GHKV\")");
    }
    if (hd.version != STATE_VERSION) {
        return gh_fail(GH_ERR_UNSUPPORTED, "a context state of version %u; this runtime reads "
                       "version %u", hd.version, STATE_VERSION);
    }
    const gh_hparams * hp = &c->model->hp;
    if (hd.model_id != model_fingerprint(c->model) || hd.n_layer != hp->n_layer ||
        hd.n_kv_dim != hp->n_head_kv * hp->head_dim) {
        return gh_fail(GH_ERR_INVALID_ARG, "the state was saved from another model (%d layers, "
                       "key width %d, identity %016llx; this context's model: %d, %d, %016llx)",
                       hd.n_layer, hd.n_kv_dim, (unsigned long long) hd.model_id, hp->n_layer,
                       hp->n_head_kv * hp->head_dim,
                       (unsigned long long) model_fingerprint(c->model));
    }
    if (hd.cache_type != c->cache_type || hd.kv_row != c->kv_row) {
        const char * a = gh_type_name(hd.cache_type), * b = gh_type_name(c->cache_type);
        return gh_fail(GH_ERR_INVALID_ARG, "the state's KV cache is %s, this context's %s: make "
                       "the context with the cache type the state was saved from",
                       a ? a : "of an unknown type", b ? b : "?");
    }
    if (hd.n_tokens < 0 || hd.n_tokens > c->n_ctx) {
        return gh_fail(GH_ERR_RANGE, "the state holds %d tokens, more than this context's %d",
                       hd.n_tokens, c->n_ctx);
    }
    const uint64_t need = state_bytes(c, hd.n_tokens);
    if (size != need) {
        return gh_fail(GH_ERR_FORMAT, "the state of %d tokens should be %llu bytes, got %llu "
                       "(truncated or padded)", hd.n_tokens, (unsigned long long) need,
                       (unsigned long long) size);
    }
    uint64_t sum;
    memcpy(&sum, buf + need - STATE_TAIL, STATE_TAIL);
    if (sum != hash_bytes(0xcbf29ce484222325ull, buf, (size_t) (need - STATE_TAIL))) {
        return gh_fail(GH_ERR_FORMAT, "the state is corrupt (its checksum does not match)");
    }
    *n_tokens = hd.n_tokens;
    return GH_OK;
}

gh_status gh_context_state_load(gh_context * c, const void * buf, uint64_t size, int32_t * n_tokens) {
    if (n_tokens) *n_tokens = 0;
    if (!c || !buf) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_state_load: context or buffer is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_state_load");
    if (st) return st;
    int32_t n = 0;
    if (!(st = state_check(c, buf, size, &n))) {
        const uint8_t * p = (const uint8_t *) buf + STATE_HEADER;
        const size_t n_bytes = (size_t) n * c->kv_row;
        for (int il = 0; il < c->model->hp.n_layer; il++) {
            memcpy(c->k_cache[il], p, n_bytes);
            p += n_bytes;
            memcpy(c->v_cache[il], p, n_bytes);
            p += n_bytes;
        }
        c->n_past = n;
        c->n_logit_rows = 0; /* the logits were of other tokens: evaluate one for new ones */
        if (n_tokens) *n_tokens = n;
    }
    gh_ctx_leave(c);
    return st;
}

/* ----------------------------------------------- FFN mode, input sparsity, stats -- */

static gh_status set_ffn_mode(gh_context * c, int32_t mode) {
    const gh_ffn_strategy * s = gh_ffn_strategy_of(mode);
    if (!s) {
        return gh_fail(GH_ERR_INVALID_ARG, "unknown FFN mode %d (%s)", mode, gh_ffn_mode_list());
    }
    gh_status st = s->check ? s->check(c->model, true) : GH_OK;
    if (st) return st;
    c->ffn_mode = mode;
    return GH_OK;
}

gh_status gh_context_set_ffn_mode(gh_context * c, int32_t mode) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_set_ffn_mode");
    if (st) return st;
    st = set_ffn_mode(c, mode);
    gh_ctx_leave(c);
    return st;
}

int32_t gh_context_get_ffn_mode(const gh_context * c) {
    return c ? c->ffn_mode : GH_FFN_DENSE;
}

gh_status gh_context_set_sparse_batch(gh_context * c, int32_t n_max) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    if (n_max < 0) return gh_fail(GH_ERR_INVALID_ARG, "sparse batch limit must be >= 0, got %d", n_max);
    gh_status st = gh_ctx_enter(c, "gh_context_set_sparse_batch");
    if (st) return st;
    c->sparse_batch = n_max;
    gh_ctx_leave(c);
    return GH_OK;
}

int32_t gh_context_get_sparse_batch(const gh_context * c) {
    return c ? c->sparse_batch : 0;
}

/* ------------------------------------------------------------------ drafting -- */

static gh_status set_head_rows(gh_context * c, const int32_t * ids, int32_t n) {
    const gh_weight * w = &c->model->output;
    const int32_t nv = c->model->hp.n_vocab;
    if (n < 0 || n > nv) {
        return gh_fail(GH_ERR_INVALID_ARG, "head rows: n = %d outside [0, n_vocab = %d]", n, nv);
    }
    if (n > 0 && !ids) return gh_fail(GH_ERR_INVALID_ARG, "head rows: ids is NULL with n = %d", n);
    if (n == 0) {
        c->head_rows_on = false;
        return GH_OK;
    }
    if (n == c->n_head_ids && memcmp(ids, c->head_ids, (size_t) n * sizeof *ids) == 0) {
        c->head_rows_on = true; /* the rows copied last time */
        return GH_OK;
    }
    uint8_t * seen = calloc((size_t) nv, 1);
    if (!seen) return gh_fail(GH_ERR_OOM, "out of memory for the head rows' check");
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= nv) {
            free(seen);
            return gh_fail(GH_ERR_RANGE, "head rows: id %d at index %d is outside the vocabulary "
                           "[0, %d)", ids[i], i, nv);
        }
        if (seen[ids[i]]++) {
            free(seen);
            return gh_fail(GH_ERR_INVALID_ARG, "head rows: id %d is given twice (index %d)",
                           ids[i], i);
        }
    }
    free(seen);
    int32_t * nid = malloc((size_t) n * sizeof *nid);
    float * tmp = malloc((size_t) n * sizeof *tmp);
    char * rows = gh_aligned_alloc((size_t) n * w->row_bytes);
    if (!nid || !tmp || !rows) {
        free(nid);
        free(tmp);
        gh_aligned_free(rows);
        return gh_fail(GH_ERR_OOM, "out of memory for %d head rows", n);
    }
    for (int32_t i = 0; i < n; i++) {
        nid[i] = ids[i];
        memcpy(rows + (size_t) i * w->row_bytes,
               (const char *) w->data + (size_t) ids[i] * w->row_bytes, w->row_bytes);
    }
    gh_aligned_free((void *) c->head_w.data);
    free(c->head_ids);
    free(c->head_tmp);
    c->head_ids = nid;
    c->head_tmp = tmp;
    c->n_head_ids = n;
    c->head_rows_on = true;
    c->head_w = (gh_weight) { .type = w->type, .rows = n, .cols = w->cols, .data = rows,
                              .row_bytes = w->row_bytes };
    return GH_OK;
}

gh_status gh_context_set_head_rows(gh_context * c, const int32_t * ids, int32_t n) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_set_head_rows");
    if (st) return st;
    st = set_head_rows(c, ids, n);
    gh_ctx_leave(c);
    return st;
}

int32_t gh_context_get_head_rows(const gh_context * c) {
    return c && c->head_rows_on ? c->n_head_ids : 0;
}

gh_status gh_context_set_layer_skip(gh_context * c, const uint8_t * skip, int32_t n) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    const int32_t nl = c->model->hp.n_layer;
    if (skip && n != nl) {
        return gh_fail(GH_ERR_INVALID_ARG, "layer skip: %d flags given for a model of %d layers",
                       n, nl);
    }
    uint8_t * s = NULL;
    int32_t k = 0;
    for (int32_t i = 0; skip && i < nl; i++) k += skip[i] != 0;
    if (k) {
        s = malloc((size_t) nl);
        if (!s) return gh_fail(GH_ERR_OOM, "out of memory for the layer skip flags");
        for (int32_t i = 0; i < nl; i++) s[i] = skip[i] != 0;
    }
    gh_status st = gh_ctx_enter(c, "gh_context_set_layer_skip");
    if (st) {
        free(s);
        return st;
    }
    free(c->skip);
    c->skip = s;
    c->n_skip = k;
    gh_ctx_leave(c);
    return GH_OK;
}

int32_t gh_context_get_layer_skip(const gh_context * c) {
    return c ? c->n_skip : 0;
}

gh_status gh_context_set_input_sparse(gh_context * c, int32_t on) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    if (on != 0 && on != 1) return gh_fail(GH_ERR_INVALID_ARG, "input sparsity is 0 (off) or 1 (on), got %d", on);
    if (on && !c->model->info.has_input_sparsity) {
        return gh_fail(GH_ERR_UNSUPPORTED,
                       "input-sparse projections need the transposed attention and head weights "
                       "and their calibrated input thresholds (blk.N.attn_qkv_t.weight, "
                       "blk.N.attn_qkv_in_thr, ...), but the file has none: convert the model "
                       "with --input-sparsity S");
    }
    gh_status st = gh_ctx_enter(c, "gh_context_set_input_sparse");
    if (st) return st;
    c->input_sparse = on != 0;
    gh_ctx_leave(c);
    return GH_OK;
}

int32_t gh_context_get_input_sparse(const gh_context * c) {
    return c && c->input_sparse ? 1 : 0;
}

gh_status gh_context_reset_stats(gh_context * c) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    gh_status st = gh_ctx_enter(c, "gh_context_reset_stats");
    if (st) return st;
    gh_stats_reset(&c->stats);
    gh_moe_reset_stats(c->moe);
    gh_ctx_leave(c);
    return GH_OK;
}

gh_status gh_context_get_stats(const gh_context * c, gh_context_stats * out,
                               double * layer_density, int32_t n_layer) {
    if (!c || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_context_get_stats: NULL argument");
    const gh_stats * s = &c->stats;
    const gh_model_info * hp = &c->model->info;
    if (layer_density && n_layer < hp->n_layer) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_context_get_stats: layer_density holds %d values, "
                       "the model has %d layers", n_layer, hp->n_layer);
    }
    memset(out, 0, sizeof *out);
    out->n_layer = hp->n_layer;
    out->ffn_mode = c->ffn_mode;
    out->n_tokens = s->n_tokens;
    out->n_sparse_tokens = s->n_sparse_tokens;
    out->n_active = s->n_active;
    out->n_up_rows = s->n_up_rows;
    out->n_down_rows = s->n_down_rows;
    /* a layer's neurons: its FFN's, or a mixture's selected experts' (the leading dense
     * layers run dense, counted by no selection) */
    const gh_hparams * mp = &c->model->hp;
    const double width = mp->n_expert ? (double) mp->n_expert_used * mp->n_ff_exp : (double) hp->n_ff;
    const int n_sel_layers = mp->n_expert ? hp->n_layer - mp->n_dense_lead : hp->n_layer;
    const double denom = (double) s->n_sparse_tokens * n_sel_layers * width;
    out->density = denom > 0 ? (double) s->n_active / denom : 0.0;
    out->bytes_attention = s->bytes[GH_STAGE_ATTENTION];
    out->bytes_predictor = s->bytes[GH_STAGE_PREDICTOR];
    out->bytes_ffn = s->bytes[GH_STAGE_FFN];
    out->bytes_head = s->bytes[GH_STAGE_OTHER];
    const double total = out->bytes_attention + out->bytes_predictor + out->bytes_ffn +
                         out->bytes_head;
    out->bytes_per_token = s->n_tokens > 0 ? total / (double) s->n_tokens : 0.0;
    out->t_attention = s->t[GH_STAGE_ATTENTION];
    out->t_predictor = s->t[GH_STAGE_PREDICTOR];
    out->t_ffn = s->t[GH_STAGE_FFN];
    out->t_total = s->t_total;
    out->t_other = GH_MAX(0.0, s->t_total - out->t_attention - out->t_predictor - out->t_ffn);
    out->n_active_device = s->n_active_device;
    out->n_active_cpu = s->n_active - s->n_active_device;
    out->bytes_device = s->bytes_device;
    out->bytes_uploaded = s->bytes_up;
    out->bytes_downloaded = s->bytes_down;
    out->t_device = s->t_device;
    out->t_cpu_ffn = s->t_cpu_ffn;
    out->t_wait = s->t_wait;
    gh_moe_get_stats(c->moe, &out->n_expert_runs_device, &out->n_expert_runs_cpu,
                     &out->n_cache_hits, &out->n_cache_misses, &out->bytes_cache_uploaded);
    out->n_attn_inputs = s->n_attn_in;
    out->n_attn_inputs_used = s->n_attn_used;
    out->n_head_inputs = s->n_head_in;
    out->n_head_inputs_used = s->n_head_used;
    out->attn_input_density = s->n_attn_in ? (double) s->n_attn_used / (double) s->n_attn_in : 0.0;
    out->head_input_density = s->n_head_in ? (double) s->n_head_used / (double) s->n_head_in : 0.0;
    if (layer_density) {
        for (int il = 0; il < hp->n_layer; il++) {
            layer_density[il] = s->n_sparse_tokens > 0
                ? (double) s->layer_active[il] / ((double) s->n_sparse_tokens * width) : 0.0;
        }
    }
    return GH_OK;
}
