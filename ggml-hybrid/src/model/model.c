/* Loading a model from GGUF: the table-driven loader. The architecture (model/arch.h) says
 * which keys and tensors to read; everything optional (biases, fused QKV, a second norm)
 * is taken when the file has it and checked for shape. */
#include "model/model.h"
#include "model/placement.h"
#include "types/types.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- loading -- */

static gh_status get_u32_req(const gh_gguf * g, const char * key, uint32_t * out) {
    bool err = false;
    if (gh_gguf_get_u32(g, key, out, &err)) return GH_OK;
    if (err) return GH_ERR_FORMAT;
    return gh_fail(GH_ERR_FORMAT, "missing required key '%s'", key);
}

static gh_status get_u32_opt(const gh_gguf * g, const char * key, uint32_t * out, uint32_t def) {
    bool err = false;
    if (gh_gguf_get_u32(g, key, out, &err)) return GH_OK;
    if (err) return GH_ERR_FORMAT;
    *out = def;
    return GH_OK;
}

static gh_status get_f32_opt(const gh_gguf * g, const char * key, float * out, float def) {
    bool err = false;
    if (gh_gguf_get_f32(g, key, out, &err)) return GH_OK;
    if (err) return GH_ERR_FORMAT;
    *out = def;
    return GH_OK;
}

/* A count or size key: read as u32 (or `def` when absent and not required) and bounded
 * to [lo, hi], so no later int32 arithmetic can see a negative or absurd value; the
 * message names the key, its value and the bound. */
static gh_status get_count(const gh_gguf * g, const char * key, bool required, uint32_t def,
                           uint32_t lo, uint32_t hi, uint32_t * out) {
    gh_status st = required ? get_u32_req(g, key, out) : get_u32_opt(g, key, out, def);
    if (st) return st;
    if (*out < lo || *out > hi) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %u is out of range (must be %u to %u)", key, *out,
                       lo, hi);
    }
    return GH_OK;
}

/* Finds a tensor and checks its shape: ne0 x ne1 (ne1 = 0 for a vector). */
static gh_status find_tensor(const gh_model * m, const char * name, int64_t ne0, int64_t ne1,
                             bool required, const gh_gguf_tensor ** out) {
    const gh_gguf * g = m->gguf;
    const gh_hparams * hp = &m->hp;
    const char * a = m->arch->name;
    const gh_gguf_tensor * t = gh_gguf_find_tensor(g, name);
    *out = t;
    if (!t) {
        return required ? gh_fail(GH_ERR_FORMAT, "missing tensor '%s'", name) : GH_OK;
    }
    bool ok = t->ne[0] == ne0 && (ne1 ? t->ne[1] == ne1 : t->ne[1] == 1) &&
              t->ne[2] == 1 && t->ne[3] == 1;
    if (!ok) {
        char want[48];
        if (ne1) snprintf(want, sizeof want, "%lld, %lld", (long long) ne0, (long long) ne1);
        else snprintf(want, sizeof want, "%lld", (long long) ne0);
        /* the keys the expected shape comes from, by name, so a key that lies is found */
        return gh_fail(GH_ERR_FORMAT,
                       "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%s] "
                       "from the model's hyper-parameters (%s.embedding_length = %d, "
                       "%s.attention.head_count = %d and head_count_kv = %d of head size %d, "
                       "%s.feed_forward_length = %d, %d tokens in token_embd.weight)",
                       name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                       (long long) t->ne[3], want, a, hp->n_embd, a, hp->n_head, hp->n_head_kv,
                       hp->head_dim, a, hp->n_ff, hp->n_vocab);
    }
    return GH_OK;
}

static gh_status load_weight(const gh_model * m, const char * name, int64_t cols, int64_t rows,
                             gh_weight * w) {
    const gh_gguf_tensor * t;
    gh_status st = find_tensor(m, name, cols, rows, true, &t);
    if (st) return st;
    if (!gh_type_valid(t->type)) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s': type %s cannot hold a weight matrix", name,
                       gh_type_name(t->type));
    }
    w->type = t->type;
    w->rows = rows;
    w->cols = cols;
    w->data = t->data;
    w->row_bytes = gh_row_size(t->type, cols);
    return GH_OK;
}

/* ---- warnings: non-fatal findings of the loader (gh_model_warnings) ---- */

#define GH_MAX_WARNINGS_BYTES 16384  /* a file full of bad tensors gets a bounded report */

static void add_warning(gh_model * m, const char * fmt, ...) {
    char line[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    const size_t old = m->warnings ? strlen(m->warnings) : 0, add = strlen(line);
    if (old + add + 2 > GH_MAX_WARNINGS_BYTES) return;
    char * w = realloc(m->warnings, old + add + 2);
    if (!w) return;
    memcpy(w + old, line, add);
    w[old + add] = '\n';
    w[old + add + 1] = '\0';
    m->warnings = w;
}

static int64_t count_nonfinite(const float * v, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !isfinite(v[i]);
    return bad;
}

static void warn_nonfinite(gh_model * m, const char * name, int64_t bad, int64_t n) {
    if (bad) {
        add_warning(m, "tensor '%.96s': %lld of %lld values are NaN or Inf", name, (long long) bad,
                    (long long) n);
    }
}

static gh_status own(gh_model * m, void * p) {
    if (m->n_owned == m->cap_owned) {
        const int cap = m->cap_owned ? 2 * m->cap_owned : 64;
        void ** o = realloc(m->owned, (size_t) cap * sizeof *o);
        if (!o) {
            free(p);
            return gh_fail(GH_ERR_OOM, "out of memory");
        }
        m->owned = o;
        m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = p;
    return GH_OK;
}

/* Norm and bias vectors are tiny: keep an f32 copy whatever their stored type, and check
 * it for NaN/Inf (free: the values are converted anyway). A missing optional vector gives
 * *out = NULL. */
static gh_status load_vec(gh_model * m, const char * name, int64_t n, bool required, float ** out) {
    const gh_gguf_tensor * t;
    *out = NULL;
    gh_status st = find_tensor(m, name, n, 0, required, &t);
    if (st || !t) return st;
    const gh_type_traits * tr = gh_type_traits_get(t->type);
    if (!tr || n % tr->block_size) {
        return gh_fail(GH_ERR_UNSUPPORTED, "tensor '%s': type %s unsupported for a vector", name,
                       gh_type_name(t->type));
    }
    float * v = malloc((size_t) n * sizeof(float));
    if (!v) return gh_fail(GH_ERR_OOM, "out of memory loading '%s'", name);
    if ((st = own(m, v))) return st;
    tr->to_float(t->data, v, n);
    *out = v;
    warn_nonfinite(m, name, count_nonfinite(v, n), n);
    return GH_OK;
}

static gh_status load_vector(gh_model * m, const char * name, int64_t n, float ** out) {
    return load_vec(m, name, n, true, out);
}

static int parse_act(const char * s) {
    if (!strcmp(s, "silu") || !strcmp(s, "swiglu")) return GH_ACT_SILU;
    if (!strcmp(s, "relu") || !strcmp(s, "reglu")) return GH_ACT_RELU;
    if (!strcmp(s, "drelu")) return GH_ACT_DRELU;
    if (!strcmp(s, "gelu") || !strcmp(s, "geglu")) return GH_ACT_GELU;
    if (!strcmp(s, "gelu_erf")) return GH_ACT_GELU_ERF;
    if (!strcmp(s, "fatrelu")) return GH_ACT_FATRELU;
    if (!strcmp(s, "swiglu_oai")) return GH_ACT_SWIGLU_OAI;
    return -1;
}

static gh_status load_attention_keys(gh_model * m);

/* "<arch>.<suffix>" */
#define AKEY(suffix) (snprintf(key, sizeof key, "%s." suffix, arch->name), key)

/* The mixture-of-experts keys (llama.cpp's names; docs/FORMAT.md "Mixture of experts"):
 * expert_count (> 0: the FFN is a mixture; required by a MoE architecture, refused by one
 * without that form), expert_used_count, the experts' width expert_feed_forward_length
 * (default feed_forward_length, as llama.cpp's llama and olmoe read it), the shared
 * expert's expert_shared_feed_forward_length (default feed_forward_length; DeepSeek-V3's
 * form: expert_shared_count experts of the routed width, 0 or absent: none),
 * expert_weights_norm (default: the architecture's rule), expert_weights_scale (0 or
 * absent: none), expert_gating_func (1 = softmax, 2 = sigmoid; default the architecture's),
 * expert_group_count / expert_group_used_count (the sigmoid router's group limit; default 1:
 * none) and leading_dense_block_count (dense-FFN layers first, of n_layer). */
static gh_status load_expert_hparams(gh_model * m, uint32_t n_ff, uint32_t n_layer) {
    const gh_gguf * g = m->gguf;
    const gh_arch * arch = m->arch;
    gh_hparams * hp = &m->hp;
    char key[128];
    gh_status st;
    uint32_t n_expert, n_used, ff_exp, ff_sh = 0, gating, n_group = 1, n_group_used = 1, n_lead = 0;
    if ((st = get_count(g, AKEY("expert_count"), false, 0, 0, 4096, &n_expert))) return st;
    if (n_expert > 0 && arch->moe == GH_MOE_NONE) {
        return gh_fail(GH_ERR_UNSUPPORTED, "key '%s' = %u: architecture '%s' has no "
                       "mixture-of-experts form here (experts run for: llama (Mixtral), "
                       "qwen2moe, qwen3moe, olmoe, gpt-oss, glm4moe, dots1)", AKEY("expert_count"),
                       n_expert, arch->name);
    }
    if (n_expert == 0) {
        if (arch->moe == GH_MOE_REQUIRED) {
            return gh_fail(GH_ERR_FORMAT, "missing required key '%s' (architecture '%s' is a "
                           "mixture of experts; it must be > 0)", AKEY("expert_count"), arch->name);
        }
        return GH_OK;
    }
    if ((st = get_count(g, AKEY("expert_used_count"), true, 0, 1, n_expert, &n_used))) return st;
    if ((st = get_count(g, AKEY("expert_feed_forward_length"), false, n_ff, 1, 1u << 24, &ff_exp)))
        return st;
    if (arch->shexp_by_count) {
        uint32_t n_shared;
        if ((st = get_count(g, AKEY("expert_shared_count"), false, 0, 0, 64, &n_shared))) return st;
        if ((st = get_count(g, AKEY("expert_shared_feed_forward_length"), false, n_shared * ff_exp, 0,
                            1u << 24, &ff_sh))) return st;
    } else if (arch->shared_expert &&
               (st = get_count(g, AKEY("expert_shared_feed_forward_length"), false, n_ff, 1, 1u << 24,
                               &ff_sh))) {
        return st;
    }
    if ((st = get_u32_opt(g, AKEY("expert_gating_func"), &gating,
                          arch->expert_gating ? (uint32_t) arch->expert_gating : GH_GATING_SOFTMAX)))
        return st;
    /* an architecture whose router llama.cpp fixes (softmax) reads no other value; one that
     * names its gating (glm4moe, dots1) runs either */
    if (!arch->expert_gating && gating != GH_GATING_SOFTMAX) {
        return gh_fail(GH_ERR_UNSUPPORTED, "key '%s' = %u: only the softmax router (1) is supported "
                       "for architecture '%s'", AKEY("expert_gating_func"), gating, arch->name);
    }
    if (gating != GH_GATING_SOFTMAX && gating != GH_GATING_SIGMOID) {
        return gh_fail(GH_ERR_UNSUPPORTED, "key '%s' = %u: only the softmax (1) and sigmoid (2) "
                       "routers are supported", AKEY("expert_gating_func"), gating);
    }
    if ((st = get_count(g, AKEY("expert_group_count"), false, 1, 1, n_expert, &n_group))) return st;
    if ((st = get_count(g, AKEY("expert_group_used_count"), false, n_group, 1, n_group, &n_group_used)))
        return st;
    if (n_expert % n_group || (n_group > 1 && n_expert / n_group < 2)) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %u: the %u experts (%s.expert_count) must split into "
                       "groups of equal size, at least 2 (a group is scored by its two best experts)",
                       AKEY("expert_group_count"), n_group, n_expert, arch->name);
    }
    if (n_used > n_group_used * (n_expert / n_group)) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %u is more than the %u experts of the %u groups "
                       "kept (%s.expert_group_used_count)", AKEY("expert_used_count"), n_used,
                       n_group_used * (n_expert / n_group), n_group_used, arch->name);
    }
    if (arch->dense_lead &&
        (st = get_count(g, AKEY("leading_dense_block_count"), false, 0, 0, n_layer, &n_lead))) {
        return st;
    }
    bool norm = arch->expert_norm, err = false;
    if (!gh_gguf_get_bool(g, AKEY("expert_weights_norm"), &norm, &err) && err) return GH_ERR_FORMAT;
    float scale;
    if ((st = get_f32_opt(g, AKEY("expert_weights_scale"), &scale, 0.0f))) return st;
    if (!isfinite(scale) || scale < 0.0f) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %g (must be finite and >= 0; 0: no scaling)",
                       AKEY("expert_weights_scale"), scale);
    }
    hp->n_expert = (int32_t) n_expert;
    hp->n_expert_used = (int32_t) n_used;
    hp->n_ff_exp = (int32_t) ff_exp;
    hp->n_ff_shexp = (int32_t) ff_sh;
    hp->expert_norm = norm;
    hp->expert_scale = scale == 0.0f ? 1.0f : scale;
    hp->expert_gating = (int32_t) gating;
    hp->n_expert_groups = (int32_t) n_group;
    hp->n_group_used = (int32_t) n_group_used;
    hp->n_dense_lead = (int32_t) n_lead;
    return GH_OK;
}

/* YaRN RoPE scaling (rope.scaling.factor, rope.scaling.original_context_length, optional
 * rope.scaling.yarn_beta_fast / yarn_beta_slow / yarn_attn_factor, llama.cpp's keys and
 * defaults 32, 1, 1): per frequency i the inverse frequency blends the interpolated
 * 1 / (factor base^(2i/d)) and the original 1 / base^(2i/d) by a linear ramp between the
 * correction dims of beta_fast and beta_slow rotations over the original context (as
 * transformers' _compute_yarn_parameters, in float), stored as rope_freqs divisors; cos and
 * sin are scaled by attn_factor (0.1 ln(factor) + 1). The ramp's ends are rounded
 * (floor / ceil, llama.cpp's and transformers' default) unless the architecture says
 * (gpt-oss: its reference does not round). */
static gh_status load_yarn(gh_model * m, uint32_t head_dim) {
    const gh_gguf * g = m->gguf;
    const gh_arch * arch = m->arch;
    gh_hparams * hp = &m->hp;
    char key[128];
    gh_status st;
    float factor, beta_fast, beta_slow, attn;
    uint32_t orig;
    if ((st = get_f32_opt(g, AKEY("rope.scaling.factor"), &factor, 0.0f))) return st;
    if (!(factor >= 1.0f) || isinf(factor)) {
        return gh_fail(GH_ERR_FORMAT, "YaRN RoPE scaling needs %s.rope.scaling.factor >= 1 (got %g)",
                       arch->name, factor);
    }
    if ((st = get_count(g, AKEY("rope.scaling.original_context_length"), true, 0, 1, UINT32_MAX, &orig)))
        return st;
    if ((st = get_f32_opt(g, AKEY("rope.scaling.yarn_beta_fast"), &beta_fast, 32.0f))) return st;
    if ((st = get_f32_opt(g, AKEY("rope.scaling.yarn_beta_slow"), &beta_slow, 1.0f))) return st;
    if ((st = get_f32_opt(g, AKEY("rope.scaling.yarn_attn_factor"), &attn, 1.0f))) return st;
    if (!(beta_fast > 0) || !(beta_slow > 0) || !(attn > 0) || isinf(beta_fast) || isinf(beta_slow) ||
        isinf(attn)) {
        return gh_fail(GH_ERR_FORMAT, "YaRN RoPE scaling: %s.rope.scaling.yarn_beta_fast (%g), "
                       "yarn_beta_slow (%g) and yarn_attn_factor (%g) must be finite and > 0",
                       arch->name, beta_fast, beta_slow, attn);
    }
    const int half = (int) head_dim / 2;
    float * div = malloc((size_t) half * sizeof(float));
    if (!div) return gh_fail(GH_ERR_OOM, "out of memory");
    if ((st = own(m, div))) return st;
    const double base = hp->rope_theta, dim = head_dim;
    /* the dimension at which a frequency turns n_rot times over the original context */
    double lo = dim * log(orig / (beta_fast * 2 * 3.14159265358979323846)) / (2 * log(base));
    double hi = dim * log(orig / (beta_slow * 2 * 3.14159265358979323846)) / (2 * log(base));
    if (!arch->yarn_exact) {
        lo = floor(lo);
        hi = ceil(hi);
    }
    lo = GH_MAX(lo, 0.0);
    hi = GH_MIN(hi, dim - 1);
    if (lo == hi) hi += 0.001;
    for (int i = 0; i < half; i++) {
        const float pos_freq = powf((float) base, (float) (2 * i) / (float) head_dim);
        const float extra = 1.0f / pos_freq, inter = 1.0f / (factor * pos_freq);
        float ramp = (float) (((double) i - lo) / (hi - lo));
        ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
        const float keep = 1.0f - ramp; /* the share of the original frequency */
        const float inv = inter * (1.0f - keep) + extra * keep;
        /* gh_rope_angles divides its own 1 / base^(2i/d) by this: inv again, to a rounding */
        div[i] = (float) ((double) (1.0f / powf((float) base, (float) (2 * i) / (float) head_dim)) / inv);
    }
    hp->rope_freqs = div;
    hp->rope_attn_factor = attn * (factor > 1.0f ? 0.1f * logf(factor) + 1.0f : 1.0f);
    return GH_OK;
}

/* The clamped SwiGLU's limit: {arch}.swiglu_clamp_exp (llama.cpp's key: one f32, or one per
 * layer, which must then be equal here), else 7 (the released gpt-oss models', which
 * llama.cpp's files do not carry). */
static gh_status load_swiglu_limit(gh_model * m, uint32_t n_layer) {
    const gh_gguf * g = m->gguf;
    const gh_arch * arch = m->arch;
    char key[128];
    float t = 7.0f;
    const gh_gguf_kv * kv = gh_gguf_find_kv(g, AKEY("swiglu_clamp_exp"));
    if (kv && kv->type == GH_GGUF_ARRAY) {
        if (kv->arr_type != GH_GGUF_FLOAT32 || kv->arr_n != n_layer) {
            return gh_fail(GH_ERR_FORMAT, "key '%s' must be an f32 or an array of %u f32 (one per "
                           "layer), not an array of %llu %s", key, n_layer,
                           (unsigned long long) kv->arr_n, gh_gguf_vtype_name(kv->arr_type));
        }
        memcpy(&t, kv->arr_data, sizeof t);
        for (uint32_t il = 1; il < n_layer; il++) {
            float v;
            memcpy(&v, kv->arr_data + (size_t) il * sizeof v, sizeof v);
            if (v != t) {
                return gh_fail(GH_ERR_UNSUPPORTED, "key '%s': layer %u's limit %g differs from layer "
                               "0's %g (one limit for every layer is supported)", key, il, v, t);
            }
        }
    } else {
        gh_status st = get_f32_opt(g, key, &t, 7.0f);
        if (st) return st;
    }
    if (!isfinite(t) || !(t > 0)) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %g (the clamped SwiGLU's limit must be finite and "
                       "> 0)", key, t);
    }
    m->hp.act_threshold = t;
    return GH_OK;
}

static gh_status load_hparams(gh_model * m) {
    const gh_gguf * g = m->gguf;
    gh_hparams * hp = &m->hp;
    const char * name = gh_gguf_get_str(g, "general.architecture");
    if (!name) return gh_fail(GH_ERR_FORMAT, "missing key 'general.architecture'");
    const gh_arch * arch = gh_arch_find(name);
    if (!arch) {
        return gh_fail(GH_ERR_UNSUPPORTED,
                       "unsupported architecture '%.64s' (general.architecture; supported: %s)",
                       name, gh_arch_names());
    }
    m->arch = arch;
    char key[128];

    /* Every count and size key is bounded here, by name; the tensors' shapes are checked
     * against them as each tensor is loaded, and the layers present against block_count in
     * check_layers. The bounds are far above any real model (Llama-3-405B: 126 layers,
     * n_embd 16384, n_ff 53248, 128 heads) and keep products of two of them within int64. */
    uint32_t n_embd, n_layer, n_ff, n_head, n_head_kv, n_ctx_train, head_dim, rope_dim;
    gh_status st;
    if ((st = get_count(g, AKEY("embedding_length"), true, 0, 1, 1u << 20, &n_embd))) return st;
    if ((st = get_count(g, AKEY("block_count"), true, 0, 1, 4096, &n_layer))) return st;
    uint32_t n_nextn = 0; /* GLM-4.5's prediction layers: blk.N past the model's own, unread */
    if (arch->nextn &&
        (st = get_count(g, AKEY("nextn_predict_layers"), false, 0, 0, n_layer - 1, &n_nextn))) {
        return st;
    }
    n_layer -= n_nextn;
    m->hp.n_nextn = (int32_t) n_nextn;
    if ((st = get_count(g, AKEY("feed_forward_length"), true, 0, 1, 1u << 24, &n_ff))) return st;
    if ((st = get_count(g, AKEY("attention.head_count"), true, 0, 1, 4096, &n_head))) return st;
    if ((st = get_count(g, AKEY("attention.head_count_kv"), false, n_head, 1, n_head, &n_head_kv)))
        return st;
    if (n_head % n_head_kv != 0) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %u does not divide %s.attention.head_count = %u "
                       "(each KV head serves a whole group of query heads)", AKEY("attention.head_count_kv"),
                       n_head_kv, arch->name, n_head);
    }
    /* Any positive u32 is a legal training context (files with 1M-token contexts exist);
     * the runtime keeps it as an int32 saturated at INT32_MAX, never negative, and a context
     * allocates only what its n_ctx asks for (gh_context_new bounds that). */
    if ((st = get_count(g, AKEY("context_length"), false, 2048, 1, UINT32_MAX, &n_ctx_train)))
        return st;
    if ((st = load_expert_hparams(m, n_ff, n_layer))) return st;
    const bool has_key_len = gh_gguf_find_kv(g, AKEY("attention.key_length"));
    if (n_embd % n_head != 0 && !has_key_len) {
        return gh_fail(GH_ERR_FORMAT,
                       "%s.embedding_length = %u is not divisible by %s.attention.head_count = %u "
                       "(and the file has no %s.attention.key_length giving the head size)",
                       arch->name, n_embd, arch->name, n_head, arch->name);
    }
    if ((st = get_u32_opt(g, AKEY("attention.key_length"), &head_dim, n_embd / n_head))) return st;
    uint32_t v_dim;
    if ((st = get_u32_opt(g, AKEY("attention.value_length"), &v_dim, head_dim))) return st;
    if (head_dim == 0 || head_dim % 2 || head_dim > 1024 || v_dim != head_dim) {
        return gh_fail(GH_ERR_UNSUPPORTED, "unsupported head size %u (value size %u; %s.attention."
                       "key_length / value_length, or embedding_length / head_count; supported: "
                       "even, 2 to 1024, equal)", head_dim, v_dim, arch->name);
    }

    hp->norm = arch->norm;
    float eps;
    if (arch->norm == GH_NORM_RMS) {
        if ((st = get_f32_opt(g, AKEY("attention.layer_norm_rms_epsilon"), &eps, 1e-5f))) return st;
    } else if ((st = get_f32_opt(g, AKEY("attention.layer_norm_epsilon"), &eps, 1e-5f))) {
        return st;
    }
    if (!(eps > 0 && eps < 1)) return gh_fail(GH_ERR_FORMAT, "bad norm epsilon %g", eps);

    hp->rope = arch->rope;
    hp->nope_every = arch->nope_every;
    hp->n_rot = (int32_t) head_dim;
    hp->rope_theta = 10000.0f;
    hp->rope_freq_scale = 1.0f;
    hp->rope_attn_factor = 1.0f;
    if (arch->rope != GH_ROPE_NONE) {
        if ((st = get_u32_opt(g, AKEY("rope.dimension_count"), &rope_dim, head_dim))) return st;
        if (rope_dim != head_dim && !arch->partial_rope) {
            return gh_fail(GH_ERR_UNSUPPORTED, "partial rotary embeddings (%s.rope.dimension_count "
                           "= %u of %u head dims) are not supported for architecture '%s'",
                           arch->name, rope_dim, head_dim, arch->name);
        }
        if (rope_dim == 0 || rope_dim % 2 || rope_dim > head_dim) {
            return gh_fail(GH_ERR_FORMAT, "key '%s.rope.dimension_count' = %u (must be even, 2 to the "
                           "head size %u)", arch->name, rope_dim, head_dim);
        }
        hp->n_rot = (int32_t) rope_dim;
        float theta;
        if ((st = get_f32_opt(g, AKEY("rope.freq_base"), &theta, 10000.0f))) return st;
        if (!(theta > 1) || isinf(theta)) return gh_fail(GH_ERR_FORMAT, "bad rope base %g", theta);
        hp->rope_theta = theta;
        const char * scaling = gh_gguf_get_str(g, AKEY("rope.scaling.type"));
        if (scaling && !strcmp(scaling, "linear")) {
            float factor;
            if ((st = get_f32_opt(g, AKEY("rope.scaling.factor"), &factor, 0.0f))) return st;
            if (!(factor > 0) || isinf(factor)) {
                return gh_fail(GH_ERR_FORMAT, "linear RoPE scaling needs %s.rope.scaling.factor > 0 "
                               "(got %g)", arch->name, factor);
            }
            hp->rope_freq_scale = 1.0f / factor;
        } else if (scaling && !strcmp(scaling, "yarn")) {
            if (rope_dim != head_dim) {
                return gh_fail(GH_ERR_UNSUPPORTED, "YaRN RoPE scaling over part of the head (%s.rope."
                               "dimension_count = %u of %u) is not supported", arch->name, rope_dim,
                               head_dim);
            }
            if ((st = load_yarn(m, head_dim))) return st;
        } else if (scaling && strcmp(scaling, "none") != 0) {
            return gh_fail(GH_ERR_UNSUPPORTED, "RoPE scaling '%.32s' (%s.rope.scaling.type) is not "
                           "supported (supported: none, linear, yarn, and Llama-3's "
                           "rope_freqs.weight)", scaling, arch->name);
        }
    }

    const char * act = gh_gguf_get_str(g, "powerinfer.ffn_activation");
    if (act) {
        int a = parse_act(act);
        if (a < 0) {
            return gh_fail(GH_ERR_UNSUPPORTED,
                           "unknown FFN activation '%.32s' in powerinfer.ffn_activation "
                           "(known: silu, relu, drelu, gelu, gelu_erf, fatrelu, swiglu_oai)", act);
        }
        hp->ffn_act = a;
        hp->act_from_file = true;
    } else {
        /* PowerInfer's sparse files are ReLU models (ReluLLaMA, ReluFalcon, OPT) and name no
         * activation: its llama FFN is ReGLU */
        hp->ffn_act = g->pwri ? GH_ACT_RELU : arch->default_act;
        hp->act_from_file = false;
    }
    if (hp->ffn_act == GH_ACT_FATRELU) {
        const char * tk = "powerinfer.ffn_act_threshold";
        float t;
        if (!gh_gguf_find_kv(g, tk)) {
            return gh_fail(GH_ERR_FORMAT, "powerinfer.ffn_activation is fatrelu but the file has no "
                           "%s (its threshold)", tk);
        }
        if ((st = get_f32_opt(g, tk, &t, 0.0f))) return st;
        if (!isfinite(t) || t < 0) return gh_fail(GH_ERR_FORMAT, "%s is %g (must be finite, >= 0)", tk, t);
        hp->act_threshold = t;
    }
    if (hp->ffn_act == GH_ACT_SWIGLU_OAI) {
        if ((st = load_swiglu_limit(m, n_layer))) return st;
    }
    hp->gated = arch->gated;
    hp->qk_norm = arch->qk_norm;
    if (arch->qk_norm_optional && !gh_gguf_find_tensor(g, "blk.0.attn_q_norm.weight")) {
        hp->qk_norm = GH_QK_NORM_NONE;
    }
    hp->post_norms = arch->post_norms;
    if (!hp->gated && (hp->ffn_act == GH_ACT_DRELU || hp->ffn_act == GH_ACT_SWIGLU_OAI)) {
        return gh_fail(GH_ERR_UNSUPPORTED, "powerinfer.ffn_activation is %s, which needs a gated "
                       "FFN, but architecture '%s' has none", act, arch->name);
    }


    hp->n_embd = (int32_t) n_embd;
    hp->n_layer = (int32_t) n_layer;
    hp->n_ff = (int32_t) n_ff;
    hp->n_head = (int32_t) n_head;
    hp->n_head_kv = (int32_t) n_head_kv;
    hp->head_dim = (int32_t) head_dim;
    hp->n_ctx_train = (int32_t) GH_MIN(n_ctx_train, (uint32_t) INT32_MAX);
    hp->norm_eps = eps;
    return load_attention_keys(m);
}

/* A soft-capping key: absent -> def; present: finite and >= 0 (0: no cap). */
static gh_status get_softcap(const gh_gguf * g, const char * key, float def, float * out) {
    gh_status st = get_f32_opt(g, key, out, def);
    if (st) return st;
    if (!isfinite(*out) || *out < 0) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %g (must be finite and >= 0; 0: no cap)", key, *out);
    }
    return GH_OK;
}

/* The attention's scale, soft-caps and sliding windows (Gemma; model/arch.h), after the
 * counts: every other architecture gets scale 1/sqrt(head_dim), no caps, no windows (its
 * attention.sliding_window, which llama.cpp's llama files may carry, is not applied). */
static gh_status load_attention_keys(gh_model * m) {
    const gh_gguf * g = m->gguf;
    const gh_arch * arch = m->arch;
    gh_hparams * hp = &m->hp;
    char key[128];
    gh_status st;
    hp->embd_scale = arch->scale_embd ? sqrtf((float) hp->n_embd) : 1.0f;
    /* the 27B's rule where the file has no attention.scale: llama.cpp's, which has no key */
    const bool by_embd = arch->scale_by_embd_layers && hp->n_layer == arch->scale_by_embd_layers;
    float scale = 1.0f / sqrtf((float) (by_embd ? hp->n_embd / hp->n_head : hp->head_dim));
    if ((st = get_f32_opt(g, AKEY("attention.scale"), &scale, scale))) return st;
    if (!isfinite(scale) || !(scale > 0)) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %g (must be finite and > 0)", key, scale);
    }
    hp->attn_scale = scale;
    if ((st = get_softcap(g, AKEY("attn_logit_softcapping"), arch->attn_softcap, &hp->attn_softcap)))
        return st;
    if ((st = get_softcap(g, AKEY("final_logit_softcapping"), arch->final_softcap, &hp->final_softcap)))
        return st;

    hp->rope_theta_swa = hp->rope_theta;
    hp->rope_freq_scale_swa = hp->rope_freq_scale;
    if (!arch->swa_pattern) return GH_OK;
    uint32_t n_swa;
    if ((st = get_u32_opt(g, AKEY("attention.sliding_window"), &n_swa, (uint32_t) arch->n_swa_default)))
        return st;
    if (n_swa == 0) return GH_OK; /* no window: every layer global (llama.cpp's reading too) */
    hp->n_swa = (int32_t) GH_MIN(n_swa, (uint32_t) INT32_MAX);
    uint8_t * swa = calloc((size_t) hp->n_layer, 1);
    if (!swa) return gh_fail(GH_ERR_OOM, "out of memory");
    if ((st = own(m, swa))) return st;
    hp->swa = swa;
    /* which layers are local: the pattern key as a period (layer il local iff il % n < n - 1)
     * or one bool per layer (llama.cpp's two forms), else the architecture's period */
    const gh_gguf_kv * kv = gh_gguf_find_kv(g, AKEY("attention.sliding_window_pattern"));
    if (kv && kv->type == GH_GGUF_ARRAY) {
        if (kv->arr_type != GH_GGUF_BOOL || kv->arr_n != (uint64_t) hp->n_layer) {
            return gh_fail(GH_ERR_FORMAT, "key '%s' must be a period (uint32) or an array of %d "
                           "bools (one per layer), not an array of %llu %s", key, hp->n_layer,
                           (unsigned long long) kv->arr_n, gh_gguf_vtype_name(kv->arr_type));
        }
        for (int il = 0; il < hp->n_layer; il++) swa[il] = kv->arr_data[il] != 0;
    } else {
        uint32_t period;
        if ((st = get_count(g, key, false, (uint32_t) arch->swa_pattern, 0, 1u << 16, &period)))
            return st;
        /* period 0: every layer local (llama.cpp's reading) */
        for (int il = 0; il < hp->n_layer; il++)
            swa[il] = period == 0 || (uint32_t) il % period < period - 1;
    }
    /* local layers' RoPE: their own base unscaled (Gemma 3), or the global one's */
    float base = arch->rope_base_swa ? arch->rope_base_swa : hp->rope_theta;
    if ((st = get_f32_opt(g, AKEY("rope.freq_base_swa"), &base, base))) return st;
    if (!(base > 1) || isinf(base)) {
        return gh_fail(GH_ERR_FORMAT, "bad local-layer rope base %g (%s)", base, key);
    }
    hp->rope_theta_swa = base;
    if (arch->rope_base_swa) hp->rope_freq_scale_swa = 1.0f;
    return GH_OK;
}
#undef AKEY

/* The public view of the hyper-parameters (gh_model_info). */
static void fill_info(gh_model * m) {
    const gh_hparams * hp = &m->hp;
    gh_model_info * in = &m->info;
    snprintf(in->arch, sizeof in->arch, "%s", m->arch->name);
    in->n_vocab = hp->n_vocab;
    in->n_ctx_train = hp->n_ctx_train;
    in->n_embd = hp->n_embd;
    in->n_layer = hp->n_layer;
    in->n_head = hp->n_head;
    in->n_head_kv = hp->n_head_kv;
    in->head_dim = hp->head_dim;
    in->n_ff = hp->n_ff;
    in->ffn_act = hp->ffn_act;
    in->act_from_file = hp->act_from_file;
    in->bos_id = hp->bos_id;
    in->eos_id = hp->eos_id;
    in->rms_eps = hp->norm_eps;
    in->rope_theta = hp->rope_theta;
    in->n_expert = hp->n_expert;
    in->n_expert_used = hp->n_expert_used;
    in->n_ff_exp = hp->n_ff_exp;
    in->n_ff_shexp = hp->n_ff_shexp;
    in->expert_norm = hp->expert_norm;
}

/* ---- sparse extension: powerinfer.* keys and the optional per-layer tensors ----
 * Names and meanings: python/powerinfer_cpp/format.py and docs/FORMAT.md. */

#define GH_FORMAT_VERSION 1 /* newest powerinfer.format_version this runtime reads */

static gh_status load_sparse_keys(gh_model * m) {
    const gh_gguf * g = m->gguf;
    uint32_t ver;
    float thr;
    gh_status st;
    if ((st = get_u32_opt(g, "powerinfer.format_version", &ver, 0))) return st;
    if (ver > GH_FORMAT_VERSION) {
        return gh_fail(GH_ERR_UNSUPPORTED,
                       "powerinfer.format_version is %u but this runtime reads versions up to %d: "
                       "upgrade powerinfer-cpp to load this file", ver, GH_FORMAT_VERSION);
    }
    /* PowerInfer's files name the threshold powerinfer.sparse_threshold */
    const char * tkey = g->pwri ? "powerinfer.sparse_threshold" : "powerinfer.sparse.threshold";
    if ((st = get_f32_opt(g, tkey, &thr, 0.0f))) return st;
    if (!isfinite(thr)) return gh_fail(GH_ERR_FORMAT, "%s is %g (must be finite)", tkey, thr);
    m->info.sparse_threshold = thr;
    m->hp.pred_residual = g->pwri; /* PowerInfer's predictors read the residual stream */
    return GH_OK;
}

/* act(g) of the FFN's activation for one value (the gate alone, up = 1; dReLU's gate
 * factor is relu(g), which gh_glu computes only with an up operand). */
static float act1(int act, float t_act, float g) {
    float y;
    gh_glu(act == GH_ACT_DRELU ? GH_ACT_RELU : act, t_act, &g, NULL, &y, 1);
    return y;
}

/* The cut points of |act(g)| > t (see gh_layer): act is increasing above its minimum g_min
 * (SiLU -1.28, GELU -0.75; ReLU family: flat at 0 below 0), so one cut above g_min, and
 * two below it when act(g_min) < -t. Found by bisection in float. */
static void gate_cuts(int act, float t_act, float t, float * cut, float * lo_cut, float * hi_cut) {
    float a = -20.0f, b = 0.0f; /* g_min by ternary search (act is unimodal below 0) */
    for (int k = 0; k < 200; k++) {
        const float m1 = a + (b - a) / 3.0f, m2 = b - (b - a) / 3.0f;
        if (act1(act, t_act, m1) <= act1(act, t_act, m2)) b = m2; else a = m1;
    }
    const float g_min = 0.5f * (a + b);
    float lo = g_min, hi = 1e4f;  /* act(lo) <= t < act(hi) */
    for (int k = 0; k < 200 && lo < hi; k++) {
        const float mid = 0.5f * (lo + hi);
        if (mid == lo || mid == hi) break;
        if (act1(act, t_act, mid) > t) hi = mid; else lo = mid;
    }
    *cut = lo;   /* g > lo  <=>  act(g) > t on the increasing side */
    *lo_cut = *hi_cut = 0.0f;
    if (act1(act, t_act, g_min) < -t) {
        float l0 = -1e4f, l1 = g_min;  /* decreasing: act(l0) >= -t > act(l1) */
        for (int k = 0; k < 200; k++) {
            const float mid = 0.5f * (l0 + l1);
            if (mid == l0 || mid == l1) break;
            if (act1(act, t_act, mid) < -t) l1 = mid; else l0 = mid;
        }
        float h0 = g_min, h1 = 0.0f;   /* increasing: act(h0) < -t <= act(h1) */
        for (int k = 0; k < 200; k++) {
            const float mid = 0.5f * (h0 + h1);
            if (mid == h0 || mid == h1) break;
            if (act1(act, t_act, mid) < -t) h0 = mid; else h1 = mid;
        }
        *lo_cut = l0;
        *hi_cut = h1;
    }
}

/* powerinfer.sparse.gate_threshold: f32[n_layer], each finite and >= 0. */
static gh_status load_gate_thresholds(gh_model * m) {
    const gh_gguf * g = m->gguf;
    const char * key = "powerinfer.sparse.gate_threshold";
    const int64_t i = gh_gguf_find_key(g, key);
    if (i < 0) return GH_OK;
    int32_t et;
    const int64_t n = gh_gguf_kv_arr(g, i, &et);
    if (n < 0 || et != 6) return gh_fail(GH_ERR_FORMAT, "%s must be an array of f32", key);
    if (n != m->hp.n_layer) {
        return gh_fail(GH_ERR_FORMAT, "%s has %lld values but the model has %d layers", key,
                       (long long) n, m->hp.n_layer);
    }
    const void * data;
    uint64_t nbytes;
    gh_status st = gh_gguf_kv_arr_data(g, i, &data, &nbytes);
    if (st) return st;
    for (int il = 0; il < m->hp.n_layer; il++) {
        float t;
        memcpy(&t, (const uint8_t *) data + (size_t) il * 4, 4);
        if (!isfinite(t) || t < 0.0f)
            return gh_fail(GH_ERR_FORMAT, "%s[%d] is %g (must be finite and >= 0)", key, il, t);
        gh_layer * L = &m->layers[il];
        L->has_gate_thr = true;
        L->gate_thr = t;
        gate_cuts(m->hp.ffn_act, m->hp.act_threshold, t, &L->gate_cut, &L->gate_lo, &L->gate_hi);
    }
    m->info.has_gate_threshold = 1;
    return GH_OK;
}

static int32_t rd_i32(const void * base, int64_t i) {
    int32_t v;
    memcpy(&v, (const uint8_t *) base + i * 4, 4); /* the data need not be 4-aligned */
    return v;
}

/* A 1-D tensor of `type` (i32 or f32) and n elements (n < 0: any length). */
static gh_status check_1d(const gh_gguf_tensor * t, int type, int64_t n, const char * what) {
    if (t->type != type) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' must be %s, not %s",
                       t->name, type == GH_TYPE_I32 ? "i32" : "f32", gh_type_name(t->type));
    }
    if (t->ne[1] != 1 || t->ne[2] != 1 || t->ne[3] != 1 || (n >= 0 && t->ne[0] != n)) {
        return gh_fail(GH_ERR_FORMAT,
                       "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected a vector of %lld "
                       "(%s)", t->name, (long long) t->ne[0], (long long) t->ne[1],
                       (long long) t->ne[2], (long long) t->ne[3], (long long) n, what);
    }
    return GH_OK;
}

/* The down projection (ffn_down or ffn_down_t, exactly one), the predictor (fc1 and
 * fc2, both or neither), neuron frequencies and the GPU index of layer il, checked for
 * consistency: a bad file fails here with the tensor named, never later. */
static gh_status load_ffn_down_and_sparse(gh_model * m, int il, gh_layer * L) {
    const gh_gguf * g = m->gguf;
    const int64_t d = m->hp.n_embd, ff = m->hp.n_ff;
    char down[96], down_t[96], n1[96], n2[96];
    gh_status st;

    snprintf(down, sizeof down, "blk.%d.ffn_down.weight", il);
    snprintf(down_t, sizeof down_t, "blk.%d.ffn_down_t.weight", il);
    const bool has_down = gh_gguf_find_tensor(g, down) != NULL;
    L->has_down_t = gh_gguf_find_tensor(g, down_t) != NULL;
    if (has_down && L->has_down_t) {
        return gh_fail(GH_ERR_FORMAT, "layer %d has both '%s' and '%s' (a layer has exactly one "
                       "down projection)", il, down, down_t);
    }
    if (!has_down && !L->has_down_t) {
        return gh_fail(GH_ERR_FORMAT, "missing tensor '%s' (or its transposed form '%s')", down,
                       down_t);
    }
    if (L->has_down_t) {
        /* [ne0 = n_embd, ne1 = n_ff]: row i is neuron i's output vector */
        if ((st = load_weight(m, down_t, d, ff, &L->down_t))) return st;
        m->info.has_down_t++;
    } else if ((st = load_weight(m, down, ff, d, &L->down))) {
        return st;
    }

    /* predictor: score = fc2 . relu(fc1 . x), fc1 [ne0 = n_embd, ne1 = h], fc2 [h, n_ff] */
    snprintf(n1, sizeof n1, "blk.%d.fc1.weight", il);
    snprintf(n2, sizeof n2, "blk.%d.fc2.weight", il);
    const gh_gguf_tensor * fc1 = gh_gguf_find_tensor(g, n1), * fc2 = gh_gguf_find_tensor(g, n2);
    if (!fc1 != !fc2) {
        return gh_fail(GH_ERR_FORMAT, "predictor of layer %d: tensor '%s' without '%s'", il,
                       fc1 ? n1 : n2, fc1 ? n2 : n1);
    }
    if (fc1) {
        const int64_t h = fc1->ne[1];
        if (fc1->ne[0] != d || h < 1 || h > (1 << 24) || fc1->ne[2] != 1 || fc1->ne[3] != 1) {
            return gh_fail(GH_ERR_FORMAT, "predictor tensor '%s' has shape [%lld, %lld, %lld, %lld], "
                           "expected [n_embd = %lld, h] with h >= 1", n1, (long long) fc1->ne[0],
                           (long long) fc1->ne[1], (long long) fc1->ne[2], (long long) fc1->ne[3],
                           (long long) d);
        }
        if (fc2->ne[0] != h || fc2->ne[1] != ff || fc2->ne[2] != 1 || fc2->ne[3] != 1) {
            return gh_fail(GH_ERR_FORMAT, "predictor tensor '%s' has shape [%lld, %lld, %lld, %lld], "
                           "expected [h = %lld (rows of '%s'), n_ff = %lld]", n2,
                           (long long) fc2->ne[0], (long long) fc2->ne[1], (long long) fc2->ne[2],
                           (long long) fc2->ne[3], (long long) h, n1, (long long) ff);
        }
        if ((st = load_weight(m, n1, d, h, &L->fc1))) return st;
        if ((st = load_weight(m, n2, h, ff, &L->fc2))) return st;
        L->has_pred = true;
        m->info.has_predictor++;
    }

    /* neuron activation frequencies: f32 [n_ff], fractions of profiled tokens in [0, 1] */
    snprintf(n1, sizeof n1, "blk.%d.ffn_freq", il);
    const gh_gguf_tensor * fq = gh_gguf_find_tensor(g, n1);
    if (fq) {
        if ((st = check_1d(fq, GH_TYPE_F32, ff, "n_ff activation frequencies"))) return st;
        for (int64_t i = 0; i < ff; i++) {
            float v;
            memcpy(&v, (const uint8_t *) fq->data + i * 4, 4);
            if (!(v >= 0.0f && v <= 1.0f)) {
                return gh_fail(GH_ERR_FORMAT, "tensor '%s': frequency of neuron %lld is %g (must "
                               "be in [0, 1])", n1, (long long) i, v);
            }
        }
    }

    /* GPU index: gpu_idx i32 [n_ff] 0/1; gpu_bucket i32 [n_hot] = the sorted ids of the
     * neurons gpu_idx marks (absent when there are none) */
    snprintf(n1, sizeof n1, "blk.%d.gpu_idx", il);
    snprintf(n2, sizeof n2, "blk.%d.gpu_bucket", il);
    const gh_gguf * gx = m->gpuidx ? m->gpuidx : g; /* PowerInfer keeps it in a side file */
    const gh_gguf_tensor * gi = gh_gguf_find_tensor(gx, n1), * gb = gh_gguf_find_tensor(gx, n2);
    if (gb && !gi) return gh_fail(GH_ERR_FORMAT, "tensor '%s' without '%s'", n2, n1);
    if (!gi) return GH_OK;
    if ((st = check_1d(gi, GH_TYPE_I32, ff, "a 0/1 flag per FFN neuron"))) return st;
    L->gpu_idx = malloc((size_t) ff);
    if (!L->gpu_idx) return gh_fail(GH_ERR_OOM, "out of memory loading '%s'", n1);
    int64_t n_hot = 0;
    for (int64_t i = 0; i < ff; i++) {
        const int32_t v = rd_i32(gi->data, i);
        if (v != 0 && v != 1) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s': entry %lld is %d (must be 0 or 1)", n1,
                           (long long) i, v);
        }
        L->gpu_idx[i] = (uint8_t) v;
        n_hot += v;
    }
    if (!gb) {
        if (n_hot) {
            return gh_fail(GH_ERR_FORMAT, "'%s' marks %lld neurons for the GPU but tensor '%s' is "
                           "missing", n1, (long long) n_hot, n2);
        }
        return GH_OK;
    }
    if ((st = check_1d(gb, GH_TYPE_I32, gb->ne[0], "sorted hot neuron ids"))) return st;
    if (gb->ne[0] != n_hot) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' holds %lld ids but '%s' marks %lld neurons",
                       n2, (long long) gb->ne[0], n1, (long long) n_hot);
    }
    L->gpu_bucket = malloc((size_t) GH_MAX(n_hot, 1) * sizeof(int32_t));
    if (!L->gpu_bucket) return gh_fail(GH_ERR_OOM, "out of memory loading '%s'", n2);
    for (int64_t k = 0; k < n_hot; k++) {
        const int32_t id = rd_i32(gb->data, k);
        if (id < 0 || id >= ff) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s': entry %lld is neuron %d, outside [0, %lld)",
                           n2, (long long) k, id, (long long) ff);
        }
        if (k > 0 && id <= L->gpu_bucket[k - 1]) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s' is not sorted and unique: entry %lld (%d) "
                           "follows %d", n2, (long long) k, id, L->gpu_bucket[k - 1]);
        }
        if (!L->gpu_idx[id]) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s' lists neuron %d, which '%s' does not mark",
                           n2, id, n1);
        }
        L->gpu_bucket[k] = id;
    }
    L->n_hot = (int32_t) n_hot;
    return GH_OK;
}

/* One input-sparse site: the transposed weight `wname` [in rows][out cols] and its
 * thresholds `tname` f32 [in] (each finite and >= 0), both or neither; *found says which. */
static gh_status load_sparse_site(gh_model * m, const char * wname, const char * tname,
                                  int64_t in, int64_t out, gh_weight * w, float ** thr, bool * on,
                                  bool * found) {
    const gh_gguf * g = m->gguf;
    const gh_gguf_tensor * tw = gh_gguf_find_tensor(g, wname), * tt = gh_gguf_find_tensor(g, tname);
    *found = tw != NULL;
    if (!tw && !tt) return GH_OK;
    if (!tw || !tt) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' without '%s' (an input-sparse projection needs "
                       "both its transposed weight and its input thresholds)", tw ? wname : tname,
                       tw ? tname : wname);
    }
    gh_status st = load_weight(m, wname, out, in, w);
    if (st) return st;
    if ((st = check_1d(tt, GH_TYPE_F32, in, "a threshold per input channel"))) return st;
    if ((st = load_vector(m, tname, in, thr))) return st;
    *on = false;
    for (int64_t i = 0; i < in; i++) {
        const float t = (*thr)[i];
        if (!isfinite(t) || t < 0.0f) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s': entry %lld is %g (must be finite and >= 0)",
                           tname, (long long) i, t);
        }
        *on |= t > 0.0f;
    }
    return GH_OK;
}

/* Input sparsity (docs/FORMAT.md "Input sparsity"): per layer attn_qkv_t + attn_qkv_in_thr
 * and attn_output_t + attn_output_in_thr, and output_t + output_in_thr; every site of every
 * layer and the head, or none of them. */
static gh_status load_input_sparse(gh_model * m) {
    const gh_hparams * hp = &m->hp;
    const int64_t d = hp->n_embd, dq = (int64_t) hp->n_head * hp->head_dim,
                  dkv = (int64_t) hp->n_head_kv * hp->head_dim;
    char wn[96], tn[96];
    int n_found = 0, n_sites = 2 * hp->n_layer + 1;
    gh_status st;
    bool f;
    for (int il = 0; il < hp->n_layer; il++) {
        gh_layer * L = &m->layers[il];
        snprintf(wn, sizeof wn, "blk.%d.attn_qkv_t.weight", il);
        snprintf(tn, sizeof tn, "blk.%d.attn_qkv_in_thr", il);
        if ((st = load_sparse_site(m, wn, tn, d, dq + 2 * dkv, &L->qkv_t, &L->thr_qkv, &L->qkv_on, &f)))
            return st;
        n_found += f;
        bool f2;
        snprintf(wn, sizeof wn, "blk.%d.attn_output_t.weight", il);
        snprintf(tn, sizeof tn, "blk.%d.attn_output_in_thr", il);
        if ((st = load_sparse_site(m, wn, tn, dq, d, &L->wo_t, &L->thr_o, &L->o_on, &f2))) return st;
        n_found += f2;
        L->has_in_sparse = f && f2;
    }
    if ((st = load_sparse_site(m, "output_t.weight", "output_in_thr", d, hp->n_vocab, &m->output_t,
                               &m->thr_head, &m->head_on, &f))) return st;
    n_found += f;
    if (n_found && n_found != n_sites) {
        return gh_fail(GH_ERR_FORMAT, "the file has %d of the %d input-sparse projections "
                       "(attn_qkv_t and attn_output_t in each of %d layers, and output_t): a "
                       "file has all of them or none", n_found, n_sites, hp->n_layer);
    }
    m->info.has_input_sparsity = n_found > 0;
    return GH_OK;
}

/* Input sparsity of the FFN (docs/FORMAT.md "Input sparsity"; the runtime's path is
 * ffn/input_ffn.c): per layer ffn_gate_up_t + ffn_in_thr (the gate and up inputs) and
 * ffn_down_in_thr (the down projection's input h = act(g) * u, over ffn_down_t's rows); each
 * group in every layer or none, on top of the attention's input sparsity and the transposed
 * down projection. */
static gh_status load_ffn_input_sparse(gh_model * m) {
    const gh_hparams * hp = &m->hp;
    const int64_t d = hp->n_embd, ff = hp->n_ff;
    char wn[96], tn[96];
    int n_in = 0, n_down = 0;
    gh_status st;
    for (int il = 0; il < hp->n_layer; il++) {
        gh_layer * L = &m->layers[il];
        bool f;
        snprintf(wn, sizeof wn, "blk.%d.ffn_gate_up_t.weight", il);
        snprintf(tn, sizeof tn, "blk.%d.ffn_in_thr", il);
        if ((st = load_sparse_site(m, wn, tn, d, hp->gated ? 2 * ff : ff, &L->gate_up_t, &L->thr_ffn_in,
                                   &L->ffn_in_on, &f))) return st;
        L->has_ffn_in = f;
        n_in += f;
        snprintf(tn, sizeof tn, "blk.%d.ffn_down_in_thr", il);
        const gh_gguf_tensor * tt = gh_gguf_find_tensor(m->gguf, tn);
        if (!tt) continue;
        if ((st = check_1d(tt, GH_TYPE_F32, ff, "a threshold per down_t row"))) return st;
        if ((st = load_vector(m, tn, ff, &L->thr_down_in))) return st;
        L->down_in_on = false;
        for (int64_t i = 0; i < ff; i++) {
            const float t = L->thr_down_in[i];
            if (!isfinite(t) || t < 0.0f) {
                return gh_fail(GH_ERR_FORMAT, "tensor '%s': entry %lld is %g (must be finite and >= 0)",
                               tn, (long long) i, t);
            }
            L->down_in_on |= t > 0.0f;
        }
        L->has_down_in = true;
        n_down++;
    }
    if (!n_in && !n_down) return GH_OK;
    if ((n_in && n_in != hp->n_layer) || (n_down && n_down != hp->n_layer)) {
        return gh_fail(GH_ERR_FORMAT, "the file has ffn_gate_up_t in %d and ffn_down_in_thr in %d of its "
                       "%d layers: each is in every layer or in none", n_in, n_down, hp->n_layer);
    }
    if (!m->info.has_input_sparsity) {
        return gh_fail(GH_ERR_FORMAT, "the FFN's input-sparse tensors (ffn_gate_up_t, ffn_down_in_thr) "
                       "need the attention's and head's (attn_qkv_t, ..., output_t), which the file lacks");
    }
    for (int il = 0; il < hp->n_layer; il++) {
        if (!m->layers[il].has_down_t) {
            return gh_fail(GH_ERR_FORMAT, "the FFN's input sparsity needs the transposed down projection, "
                           "but layer %d has none (blk.%d.ffn_down_t.weight)", il, il);
        }
    }
    return GH_OK;
}

/* The attention weights of layer il: attn_q/k/v, or attn_qkv viewed as its three row
 * ranges (q heads, k heads, v heads), each with an optional bias; attn_output (+ bias). */
static gh_status load_attention(gh_model * m, int il, gh_layer * L) {
    const gh_hparams * hp = &m->hp;
    const int64_t d = hp->n_embd, dq = (int64_t) hp->n_head * hp->head_dim,
                  dkv = (int64_t) hp->n_head_kv * hp->head_dim;
    char name[96];
    gh_status st;
#define BLK(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, il), name)
    if (m->arch->fused_qkv) {
        gh_weight qkv;
        if ((st = load_weight(m, BLK("attn_qkv.weight"), d, dq + 2 * dkv, &qkv))) return st;
        L->wq = L->wk = L->wv = qkv;
        L->wq.rows = dq;
        L->wk.rows = L->wv.rows = dkv;
        L->wk.data = (const uint8_t *) qkv.data + (size_t) dq * qkv.row_bytes;
        L->wv.data = (const uint8_t *) qkv.data + (size_t) (dq + dkv) * qkv.row_bytes;
        float * b;
        if ((st = load_vec(m, BLK("attn_qkv.bias"), dq + 2 * dkv, false, &b))) return st;
        if (b) {
            L->bq = b;
            L->bk = b + dq;
            L->bv = b + dq + dkv;
        }
    } else {
        if ((st = load_weight(m, BLK("attn_q.weight"), d, dq, &L->wq))) return st;
        if ((st = load_weight(m, BLK("attn_k.weight"), d, dkv, &L->wk))) return st;
        if ((st = load_weight(m, BLK("attn_v.weight"), d, dkv, &L->wv))) return st;
        if ((st = load_vec(m, BLK("attn_q.bias"), dq, false, &L->bq))) return st;
        if ((st = load_vec(m, BLK("attn_k.bias"), dkv, false, &L->bk))) return st;
        if ((st = load_vec(m, BLK("attn_v.bias"), dkv, false, &L->bv))) return st;
    }
    if ((st = load_weight(m, BLK("attn_output.weight"), dq, d, &L->wo))) return st;
    if ((st = load_vec(m, BLK("attn_output.bias"), d, false, &L->bo))) return st;
    if (hp->qk_norm == GH_QK_NORM_NONE && m->arch->qk_norm_optional &&
        gh_gguf_find_tensor(m->gguf, BLK("attn_q_norm.weight"))) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' but layer 0 has no q/k norms: every layer has them "
                       "or none does", name);
    }
    if (hp->qk_norm != GH_QK_NORM_NONE) {
        /* per head: one weight vector every head shares; over the projection: one per row */
        const bool per_head = hp->qk_norm == GH_QK_NORM_HEAD;
        if ((st = load_vector(m, BLK("attn_q_norm.weight"), per_head ? hp->head_dim : dq, &L->q_norm)))
            return st;
        if ((st = load_vector(m, BLK("attn_k_norm.weight"), per_head ? hp->head_dim : dkv, &L->k_norm)))
            return st;
    }
    if (m->arch->attn_sinks) {
        if (!gh_gguf_find_tensor(m->gguf, BLK("attn_sinks.weight"))) {
            return gh_fail(GH_ERR_FORMAT, "missing tensor '%s' (architecture '%s' has a learned "
                           "attention sink per head: [%d] logits)", name, m->arch->name, hp->n_head);
        }
        if ((st = load_vector(m, name, hp->n_head, &L->sinks))) return st;
    }
#undef BLK
    return GH_OK;
}

/* A norm: weight, and its bias for LayerNorm (optional: a file may leave it out). */
static gh_status load_norm(gh_model * m, const char * base, bool required, float ** w, float ** b) {
    char name[96];
    const int64_t d = m->hp.n_embd;
    snprintf(name, sizeof name, "%s.weight", base);
    gh_status st = load_vec(m, name, d, required, w);
    if (st || !*w) return st;
    *b = NULL;
    if (m->hp.norm != GH_NORM_LAYER) return GH_OK;
    snprintf(name, sizeof name, "%s.bias", base);
    return load_vec(m, name, d, false, b);
}

/* A 3-D expert tensor [n_expert][rows][cols] (ne = cols, rows, n_expert), viewed as expert
 * 0's matrix (gh_expert gives expert e's); the keys its shape comes from are named. */
static gh_status load_experts(const gh_model * m, const char * name, int64_t cols, int64_t rows,
                              gh_weight * w) {
    const gh_hparams * hp = &m->hp;
    const char * a = m->arch->name;
    const gh_gguf_tensor * t = gh_gguf_find_tensor(m->gguf, name);
    if (!t) {
        return gh_fail(GH_ERR_FORMAT, "missing tensor '%s' (the %d experts of a mixture-of-experts "
                       "layer as one 3-D tensor, llama.cpp's layout)", name, hp->n_expert);
    }
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != hp->n_expert || t->ne[3] != 1) {
        return gh_fail(GH_ERR_FORMAT,
                       "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %d] "
                       "from the model's hyper-parameters (%s.embedding_length = %d, "
                       "%s.expert_feed_forward_length = %d (or feed_forward_length), "
                       "%s.expert_count = %d)", name, (long long) t->ne[0], (long long) t->ne[1],
                       (long long) t->ne[2], (long long) t->ne[3], (long long) cols,
                       (long long) rows, hp->n_expert, a, hp->n_embd, a, hp->n_ff_exp, a,
                       hp->n_expert);
    }
    if (!gh_type_valid(t->type)) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s': type %s cannot hold a weight matrix", name,
                       gh_type_name(t->type));
    }
    *w = (gh_weight) { .type = t->type, .rows = rows, .cols = cols, .data = t->data,
                       .row_bytes = gh_row_size(t->type, cols) };
    return GH_OK;
}

/* An expert bias: [n1][n0] f32-convertible values (n1 0: a vector of n0), kept as an f32
 * copy; absent: NULL, or an error naming it when the architecture requires it. */
static gh_status load_expert_bias(gh_model * m, const char * name, int64_t n0, int64_t n1,
                                  bool required, float ** out) {
    *out = NULL;
    const gh_gguf_tensor * t = gh_gguf_find_tensor(m->gguf, name);
    if (!t) {
        if (!required) return GH_OK;
        return gh_fail(GH_ERR_FORMAT, "missing tensor '%s' (architecture '%s' has biased routers "
                       "and experts)", name, m->arch->name);
    }
    if (t->ne[0] != n0 || t->ne[1] != (n1 ? n1 : 1) || t->ne[2] != 1 || t->ne[3] != 1) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected "
                       "[%lld, %lld] (the experts' width or embedding_length, %s.expert_count)",
                       name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                       (long long) t->ne[3], (long long) n0, (long long) (n1 ? n1 : 1), m->arch->name);
    }
    const gh_type_traits * tr = gh_type_traits_get(t->type);
    const int64_t n = n0 * (n1 ? n1 : 1);
    if (!tr || !tr->to_float || n0 % tr->block_size) {
        return gh_fail(GH_ERR_UNSUPPORTED, "tensor '%s': type %s unsupported for a bias", name,
                       gh_type_name(t->type));
    }
    float * v = malloc((size_t) n * sizeof(float));
    if (!v) return gh_fail(GH_ERR_OOM, "out of memory loading '%s'", name);
    gh_status st = own(m, v);
    if (st) return st;
    /* row by row: a row is whole blocks (n0 % block_size == 0) */
    const size_t rb = gh_row_size(t->type, n0);
    for (int64_t r = 0; r < (n1 ? n1 : 1); r++) tr->to_float((const uint8_t *) t->data + r * rb, v + r * n0, n0);
    warn_nonfinite(m, name, count_nonfinite(v, n), n);
    *out = v;
    return GH_OK;
}

/* blk.N.ffn_exp_gate_thr (docs/FORMAT.md "Sparse experts"): f32 [n_expert], each expert's
 * gate threshold t >= 0 (|act(g)| > t: active), or a negative value for an expert that
 * keeps none (it runs dense); every layer has it or none does, and it needs the experts'
 * transposed down projection. Solved into cut points as a layer's threshold is. */
static gh_status load_expert_gate_thresholds(gh_model * m, int il, gh_moe_layer * M) {
    char name[64];
    snprintf(name, sizeof name, "blk.%d.ffn_exp_gate_thr", il);
    const gh_gguf_tensor * t = gh_gguf_find_tensor(m->gguf, name);
    const int32_t ne = m->hp.n_expert;
    const int l0 = m->hp.n_dense_lead; /* the first layer with experts decides */
    const bool want = il == l0 || m->layers[l0].moe.gate_cuts != NULL;
    if (!t) {
        if (il > l0 && want) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s' is missing: blk.%d.ffn_exp_gate_thr gives layer "
                           "%d's experts gate thresholds, so every layer needs them", name, l0, l0);
        }
        return GH_OK;
    }
    if (!want) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' gives layer %d's experts gate thresholds but "
                       "'blk.%d.ffn_exp_gate_thr' is missing: every layer needs them", name, il, l0);
    }
    if (!M->has_down_t) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' gives the experts gate thresholds but layer %d "
                       "has no 'blk.%d.ffn_down_exps_t.weight' (the sparse experts' down "
                       "projection)", name, il, il);
    }
    gh_status st = check_1d(t, GH_TYPE_F32, ne, "one gate threshold per expert");
    if (st) return st;
    M->gate_cuts = malloc((size_t) ne * 4 * sizeof(float));
    if (!M->gate_cuts || (st = own(m, M->gate_cuts))) {
        return M->gate_cuts ? st : gh_fail(GH_ERR_OOM, "out of memory");
    }
    for (int32_t e = 0; e < ne; e++) {
        float v, * c = M->gate_cuts + 4 * (size_t) e;
        memcpy(&v, (const uint8_t *) t->data + 4 * (size_t) e, 4);
        if (!isfinite(v)) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s': expert %d's threshold is %g (must be finite)",
                           name, e, (double) v);
        }
        c[0] = v < 0.0f ? -1.0f : v;
        if (v >= 0.0f) gate_cuts(m->hp.ffn_act, m->hp.act_threshold, v, &c[1], &c[2], &c[3]);
        else c[1] = c[2] = c[3] = 0.0f;
    }
    if (il == m->hp.n_layer - 1) m->info.has_gate_threshold = 1;
    return GH_OK;
}

/* blk.N.ffn_exp_fc1 / ffn_exp_fc2 (docs/FORMAT.md "Sparse experts"): each expert's
 * predictor, [n_expert][h][n_embd] and [n_expert][n_ff_exp][h] (h the layer's own); both or
 * neither, in every layer or none, and only beside the sparse experts' ffn_down_exps_t. */
static gh_status load_expert_predictors(gh_model * m, int il, gh_moe_layer * M) {
    const gh_hparams * hp = &m->hp;
    char n1[64], n2[64];
    snprintf(n1, sizeof n1, "blk.%d.ffn_exp_fc1.weight", il);
    snprintf(n2, sizeof n2, "blk.%d.ffn_exp_fc2.weight", il);
    const gh_gguf_tensor * f1 = gh_gguf_find_tensor(m->gguf, n1), * f2 = gh_gguf_find_tensor(m->gguf, n2);
    if (!f1 != !f2) {
        return gh_fail(GH_ERR_FORMAT, "the experts' predictor of layer %d: tensor '%s' without '%s'",
                       il, f1 ? n1 : n2, f1 ? n2 : n1);
    }
    const int l0 = hp->n_dense_lead; /* the first layer with experts decides */
    const bool want = il == l0 || m->layers[l0].moe.has_pred;
    if (!f1) {
        if (il > l0 && want) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s' is missing: layer %d's experts have predictors "
                           "(blk.%d.ffn_exp_fc1.weight), so every layer needs them", n1, l0, l0);
        }
        return GH_OK;
    }
    if (!want) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' gives layer %d's experts predictors but "
                       "'blk.%d.ffn_exp_fc1.weight' is missing: every layer needs them", n1, il, l0);
    }
    if (!M->has_down_t) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' gives the experts predictors but layer %d has no "
                       "'blk.%d.ffn_down_exps_t.weight' (the sparse experts' down projection)",
                       n1, il, il);
    }
    const int64_t d = hp->n_embd, ff = hp->n_ff_exp, h = f1->ne[1];
    if (f1->ne[0] != d || h < 1 || h > (1 << 24) || f1->ne[2] != hp->n_expert || f1->ne[3] != 1) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected "
                       "[n_embd = %lld, h, n_expert = %d] with h >= 1", n1, (long long) f1->ne[0],
                       (long long) f1->ne[1], (long long) f1->ne[2], (long long) f1->ne[3],
                       (long long) d, hp->n_expert);
    }
    if (f2->ne[0] != h || f2->ne[1] != ff || f2->ne[2] != hp->n_expert || f2->ne[3] != 1) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected "
                       "[h = %lld (of '%s'), n_ff_exp = %lld, n_expert = %d]", n2,
                       (long long) f2->ne[0], (long long) f2->ne[1], (long long) f2->ne[2],
                       (long long) f2->ne[3], (long long) h, n1, (long long) ff, hp->n_expert);
    }
    const gh_gguf_tensor * ts[2] = { f1, f2 };
    gh_weight * ws[2] = { &M->fc1_exps, &M->fc2_exps };
    const int64_t cols[2] = { d, h }, rows[2] = { h, ff };
    for (int i = 0; i < 2; i++) {
        if (!gh_type_valid(ts[i]->type)) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s': type %s cannot hold a weight matrix",
                           i ? n2 : n1, gh_type_name(ts[i]->type));
        }
        *ws[i] = (gh_weight) { .type = ts[i]->type, .rows = rows[i], .cols = cols[i],
                               .data = ts[i]->data, .row_bytes = gh_row_size(ts[i]->type, cols[i]) };
    }
    M->has_pred = true;
    return GH_OK;
}

/* The hot neurons of layer il's sparse experts on the device (docs/FORMAT.md "Hot neurons of
 * experts"): blk.N.ffn_exp_hot_count i32 [n_expert], each expert's count in [0, n_ff_exp],
 * and blk.N.ffn_exp_hot i32 [their sum], each expert's ids ascending, experts in order
 * (omitted when the sum is 0); every expert layer has the record or none does. From the GPU
 * index side file when there is one. */
static gh_status load_expert_hot(gh_model * m, int il, gh_moe_layer * M) {
    const gh_hparams * hp = &m->hp;
    const gh_gguf * gx = m->gpuidx ? m->gpuidx : m->gguf;
    const int32_t ne = hp->n_expert;
    const int64_t ff = hp->n_ff_exp;
    char nc[96], ni[96];
    snprintf(nc, sizeof nc, "blk.%d.ffn_exp_hot_count", il);
    snprintf(ni, sizeof ni, "blk.%d.ffn_exp_hot", il);
    const gh_gguf_tensor * tc = gh_gguf_find_tensor(gx, nc), * ti = gh_gguf_find_tensor(gx, ni);
    const int lead = hp->n_dense_lead;
    const bool first_has = il > lead && m->layers[lead].moe.hot_off;
    if (!tc) {
        if (ti) return gh_fail(GH_ERR_FORMAT, "tensor '%s' without '%s' (each expert's count of hot "
                               "neurons)", ni, nc);
        if (first_has) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s' is missing: blk.%d.ffn_exp_hot_count places "
                           "layer %d's hot neurons of experts, so every layer needs its record", nc,
                           lead, lead);
        }
        return GH_OK;
    }
    if (il > lead && !first_has) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' places layer %d's hot neurons of experts but "
                       "'blk.%d.ffn_exp_hot_count' is missing: every layer needs its record", nc, il,
                       lead);
    }
    if (!M->has_down_t) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s': hot neurons of experts need the experts' sparse "
                       "form (blk.%d.ffn_down_exps_t), which the file does not have", nc, il);
    }
    gh_status st = check_1d(tc, GH_TYPE_I32, ne, "each expert's count of hot neurons");
    if (st) return st;
    M->hot_off = malloc((size_t) (ne + 1) * sizeof(int64_t));
    if (!M->hot_off || (st = own(m, M->hot_off))) {
        return M->hot_off ? st : gh_fail(GH_ERR_OOM, "out of memory");
    }
    M->hot_off[0] = 0;
    for (int32_t e = 0; e < ne; e++) {
        const int32_t v = rd_i32(tc->data, e);
        if (v < 0 || v > ff) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s': expert %d's count is %d (must be in [0, %lld], "
                           "the expert's neurons)", nc, e, v, (long long) ff);
        }
        M->hot_off[e + 1] = M->hot_off[e] + v;
    }
    const int64_t total = M->hot_off[ne];
    if (total == 0) {
        if (ti && (st = check_1d(ti, GH_TYPE_I32, 0, "no ids: the counts sum to 0"))) return st;
        return GH_OK;
    }
    if (!ti) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' is missing: '%s' counts %lld hot neurons", ni, nc,
                       (long long) total);
    }
    if (ti->type != GH_TYPE_I32 || ti->ne[1] != 1 || ti->ne[2] != 1 || ti->ne[3] != 1 || ti->ne[0] != total) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' has %lld %s values, but '%s' counts %lld hot neurons "
                       "(an i32 vector of that many ids)", ni,
                       (long long) (ti->ne[0] * ti->ne[1] * ti->ne[2] * ti->ne[3]),
                       gh_type_name(ti->type), nc, (long long) total);
    }
    M->hot_ids = malloc((size_t) total * sizeof(int32_t));
    if (!M->hot_ids || (st = own(m, M->hot_ids))) {
        return M->hot_ids ? st : gh_fail(GH_ERR_OOM, "out of memory");
    }
    for (int32_t e = 0; e < ne; e++) {
        for (int64_t k = M->hot_off[e]; k < M->hot_off[e + 1]; k++) {
            const int32_t id = rd_i32(ti->data, k);
            if (id < 0 || id >= ff) {
                return gh_fail(GH_ERR_FORMAT, "tensor '%s': expert %d's hot neuron %lld is %d, out of "
                               "range [0, %lld)", ni, e, (long long) (k - M->hot_off[e]), id,
                               (long long) ff);
            }
            if (k > M->hot_off[e] && id <= M->hot_ids[k - 1]) {
                return gh_fail(GH_ERR_FORMAT, "tensor '%s': expert %d's hot neuron ids must ascend, "
                               "but %d follows %d", ni, e, id, M->hot_ids[k - 1]);
            }
            M->hot_ids[k] = id;
        }
    }
    return GH_OK;
}

/* Layer il's mixture of experts (ffn/moe.h): the router ffn_gate_inp, the experts'
 * ffn_{gate,up,down}_exps and, where the architecture has one, the shared expert
 * ffn_{gate,up,down}_shexp with its gate vector ffn_gate_inp_shexp. A dense FFN tensor in
 * such a layer is refused: the file would mean something this runtime does not run. */
static gh_status load_moe(gh_model * m, int il, gh_layer * L) {
    const gh_hparams * hp = &m->hp;
    const int64_t d = hp->n_embd, ff = hp->n_ff_exp, fs = hp->n_ff_shexp;
    gh_moe_layer * M = &L->moe;
    char name[96];
    gh_status st;
#define BLK(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, il), name)
    static const char * const dense[] = { "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
                                          "ffn_down_t.weight", "fc1.weight" };
    for (size_t i = 0; i < sizeof dense / sizeof dense[0]; i++) {
        snprintf(name, sizeof name, "blk.%d.%s", il, dense[i]);
        if (gh_gguf_find_tensor(m->gguf, name)) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s' in a mixture-of-experts layer (%s.expert_count "
                           "= %d): its FFN is the experts (ffn_*_exps)", name, m->arch->name,
                           hp->n_expert);
        }
    }
    const gh_gguf_tensor * r = gh_gguf_find_tensor(m->gguf, BLK("ffn_gate_inp.weight"));
    if (r && (r->ne[0] != d || r->ne[1] != hp->n_expert || r->ne[2] != 1 || r->ne[3] != 1)) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' (the router) has shape [%lld, %lld, %lld, %lld], "
                       "expected [%lld, %d] (%s.embedding_length, %s.expert_count)", name,
                       (long long) r->ne[0], (long long) r->ne[1], (long long) r->ne[2],
                       (long long) r->ne[3], (long long) d, hp->n_expert, m->arch->name,
                       m->arch->name);
    }
    if ((st = load_weight(m, name, d, hp->n_expert, &M->router))) return st;
    if ((st = load_experts(m, BLK("ffn_gate_exps.weight"), d, ff, &M->gate_exps))) return st;
    if ((st = load_experts(m, BLK("ffn_up_exps.weight"), d, ff, &M->up_exps))) return st;
    /* the down projection: llama.cpp's ffn_down_exps, or its transposed form (the sparse
     * experts' ffn_down_exps_t, docs/FORMAT.md "Sparse experts"), exactly one of them */
    const bool has_dn = gh_gguf_find_tensor(m->gguf, BLK("ffn_down_exps.weight")) != NULL;
    M->has_down_t = gh_gguf_find_tensor(m->gguf, BLK("ffn_down_exps_t.weight")) != NULL;
    if (has_dn && M->has_down_t) {
        return gh_fail(GH_ERR_FORMAT, "layer %d has both 'blk.%d.ffn_down_exps.weight' and "
                       "'blk.%d.ffn_down_exps_t.weight' (a layer's experts have exactly one down "
                       "projection)", il, il, il);
    }
    if (M->has_down_t) {
        if ((st = load_experts(m, BLK("ffn_down_exps_t.weight"), d, ff, &M->down_exps_t))) return st;
        m->info.has_down_t++;
    } else if ((st = load_experts(m, BLK("ffn_down_exps.weight"), ff, d, &M->down_exps))) {
        return st;
    }
    if ((st = load_expert_gate_thresholds(m, il, M))) return st;
    if ((st = load_expert_predictors(m, il, M))) return st;
    /* the biases: [n_expert] for the router, [n_expert][rows] for each expert tensor */
    const bool req = m->arch->expert_biases;
    if ((st = load_expert_bias(m, BLK("ffn_gate_inp.bias"), hp->n_expert, 0, req, &M->router_b)))
        return st;
    if ((st = load_expert_bias(m, BLK("ffn_gate_exps.bias"), ff, hp->n_expert, req, &M->gate_exps_b)))
        return st;
    if ((st = load_expert_bias(m, BLK("ffn_up_exps.bias"), ff, hp->n_expert, req, &M->up_exps_b)))
        return st;
    if ((st = load_expert_bias(m, BLK("ffn_down_exps.bias"), d, hp->n_expert, req, &M->down_exps_b)))
        return st;
    /* the sigmoid router's selection bias (e_score_correction_bias) */
    if (!gh_gguf_find_tensor(m->gguf, BLK("exp_probs_b.bias")) && m->arch->exp_probs_b) {
        return gh_fail(GH_ERR_FORMAT, "missing tensor '%s' (architecture '%s' chooses its experts by "
                       "sigmoid score plus this bias: [%d] values)", name, m->arch->name, hp->n_expert);
    }
    if ((st = load_expert_bias(m, name, hp->n_expert, 0, false, &M->probs_b))) return st;
    if (m->arch->shared_expert || (m->arch->shexp_by_count && fs > 0)) {
        if ((st = load_weight(m, BLK("ffn_gate_shexp.weight"), d, fs, &M->gate_shexp))) return st;
        if ((st = load_weight(m, BLK("ffn_up_shexp.weight"), d, fs, &M->up_shexp))) return st;
        if ((st = load_weight(m, BLK("ffn_down_shexp.weight"), fs, d, &M->down_shexp))) return st;
    }
    if (m->arch->shared_expert) {
        if ((st = load_vector(m, BLK("ffn_gate_inp_shexp.weight"), d, &M->shexp_gate))) return st;
    } else if (gh_gguf_find_tensor(m->gguf, BLK("ffn_gate_inp_shexp.weight"))) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s': architecture '%s' adds its shared experts "
                       "unweighted (no sigmoid gate)", name, m->arch->name);
    }
    /* the expert placement data (docs/FORMAT.md "Expert placement"), from the GPU index side
     * file when there is one, as the neuron index is */
    const gh_gguf * gx = m->gpuidx ? m->gpuidx : m->gguf;
    const int32_t ne = hp->n_expert;
    const gh_gguf_tensor * tf = gh_gguf_find_tensor(gx, BLK("ffn_exp_freq"));
    if (tf) {
        if ((st = check_1d(tf, GH_TYPE_F32, ne, "the selection frequency of each expert"))) return st;
        M->freq = malloc((size_t) ne * sizeof(float));
        if (!M->freq || (st = own(m, M->freq))) return M->freq ? st : gh_fail(GH_ERR_OOM, "out of memory");
        for (int32_t e = 0; e < ne; e++) {
            float v;
            memcpy(&v, (const uint8_t *) tf->data + 4 * (size_t) e, 4);
            if (!(v >= 0.0f && v <= 1.0f)) {
                return gh_fail(GH_ERR_FORMAT, "tensor '%s': expert %d's frequency is %g (must be "
                               "in [0, 1])", tf->name, e, (double) v);
            }
            M->freq[e] = v;
        }
    }
    const gh_gguf_tensor * tg = gh_gguf_find_tensor(gx, BLK("ffn_exp_gpu"));
    if (tg) {
        if ((st = check_1d(tg, GH_TYPE_I32, ne, "a 0/1 flag per expert"))) return st;
        M->on_gpu = malloc((size_t) ne);
        if (!M->on_gpu || (st = own(m, M->on_gpu))) {
            return M->on_gpu ? st : gh_fail(GH_ERR_OOM, "out of memory");
        }
        for (int32_t e = 0; e < ne; e++) {
            const int32_t v = rd_i32(tg->data, e);
            if (v != 0 && v != 1) {
                return gh_fail(GH_ERR_FORMAT, "tensor '%s': expert %d's entry is %d (must be 0 "
                               "or 1)", tg->name, e, v);
            }
            M->on_gpu[e] = (int8_t) v;
        }
    } else if (il > hp->n_dense_lead && m->layers[hp->n_dense_lead].moe.on_gpu) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' is missing: blk.%d.ffn_exp_gpu places layer %d's "
                       "experts, so every layer needs its expert placement", name, hp->n_dense_lead,
                       hp->n_dense_lead);
    }
    if (il > hp->n_dense_lead && !m->layers[hp->n_dense_lead].moe.on_gpu && M->on_gpu) {
        return gh_fail(GH_ERR_FORMAT, "tensor '%s' places layer %d's experts but "
                       "'blk.%d.ffn_exp_gpu' is missing: every layer needs its expert placement",
                       tg->name, il, hp->n_dense_lead);
    }
    return load_expert_hot(m, il, M);
#undef BLK
}

/* Layer il's norms and FFN up/gate (the down projection and the sparse extension:
 * load_ffn_down_and_sparse). The block is parallel when the architecture says so and the
 * file has no blk.N.ffn_norm; the FFN then reads attn_norm_2(x) if present, else attn_norm(x). */
static gh_status load_block(gh_model * m, int il, gh_layer * L) {
    const gh_gguf * g = m->gguf;
    const int64_t d = m->hp.n_embd, ff = m->hp.n_ff;
    char name[96], base[64];
    gh_status st;
    /* without input norms (OLMo 2) the sublayers read x: attn_norm / ffn_norm are not read */
    const bool pre = !m->arch->no_pre_norms;
    snprintf(base, sizeof base, "blk.%d.attn_norm", il);
    if (pre && (st = load_norm(m, base, true, &L->attn_norm, &L->attn_norm_b))) return st;
    if ((st = load_attention(m, il, L))) return st;
    snprintf(base, sizeof base, "blk.%d.%s", il, m->arch->ffn_norm ? m->arch->ffn_norm : "ffn_norm");
    const bool sequential = !m->hp.parallel;
    if (pre && (st = load_norm(m, base, sequential, &L->ffn_norm, &L->ffn_norm_b))) return st;
    if (m->hp.post_norms) {
        snprintf(base, sizeof base, "blk.%d.post_attention_norm", il);
        if ((st = load_norm(m, base, true, &L->post_attn_norm, &L->post_attn_norm_b))) return st;
        snprintf(base, sizeof base, "blk.%d.post_ffw_norm", il);
        if ((st = load_norm(m, base, true, &L->post_ffn_norm, &L->post_ffn_norm_b))) return st;
    }
    if (!sequential) {
        if (L->ffn_norm) {
            return gh_fail(GH_ERR_FORMAT, "layer %d has tensor '%s.weight' but layer 0 has none: "
                           "every layer of a block layout has the same norms", il, base);
        }
        snprintf(base, sizeof base, "blk.%d.attn_norm_2", il);
        float * n2, * n2_b;
        if ((st = load_norm(m, base, il > 0 && m->layers[0].ffn_norm, &n2, &n2_b))) return st;
        if (n2) {
            /* llama.cpp's two-norm layout (Falcon-40B): attn_norm_2 is the attention's input
             * norm and attn_norm the FFN's */
            L->ffn_norm = L->attn_norm;
            L->ffn_norm_b = L->attn_norm_b;
            L->attn_norm = n2;
            L->attn_norm_b = n2_b;
        }
    }
    if (m->hp.n_expert && il >= m->hp.n_dense_lead) return load_moe(m, il, L);
    if (m->hp.n_expert) {
        /* a leading dense layer of a mixture (leading_dense_block_count) has no experts */
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", il);
        if (gh_gguf_find_tensor(g, name)) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s' in layer %d, a dense layer (%s."
                           "leading_dense_block_count = %d): its FFN is ffn_gate/up/down", name, il,
                           m->arch->name, m->hp.n_dense_lead);
        }
    }
#define BLK(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, il), name)
    if (m->arch->fused_gate_up) {
        /* one matrix of 2 n_ff rows: gate's, then up's */
        gh_weight gu;
        if ((st = load_weight(m, BLK("ffn_up.weight"), d, 2 * ff, &gu))) return st;
        L->gate = L->up = gu;
        L->gate.rows = L->up.rows = ff;
        L->up.data = (const uint8_t *) gu.data + (size_t) ff * gu.row_bytes;
    } else if (m->hp.gated) {
        if ((st = load_weight(m, BLK("ffn_gate.weight"), d, ff, &L->gate))) return st;
        if ((st = load_vec(m, BLK("ffn_gate.bias"), ff, false, &L->gate_b))) return st;
        if ((st = load_weight(m, BLK("ffn_up.weight"), d, ff, &L->up))) return st;
        if ((st = load_vec(m, BLK("ffn_up.bias"), ff, false, &L->up_b))) return st;
    } else {
        /* down(act(up x + b)): the activation reads up, which takes the gate's place */
        if (gh_gguf_find_tensor(g, BLK("ffn_gate.weight"))) {
            return gh_fail(GH_ERR_FORMAT, "tensor '%s': architecture '%s' has an ungated FFN "
                           "(up and down only)", name, m->arch->name);
        }
        if ((st = load_weight(m, BLK("ffn_up.weight"), d, ff, &L->gate))) return st;
        if ((st = load_vec(m, BLK("ffn_up.bias"), ff, false, &L->gate_b))) return st;
        L->up = (gh_weight) { .type = L->gate.type };
    }
    if ((st = load_vec(m, BLK("ffn_down.bias"), d, false, &L->down_b))) return st;
#undef BLK
    return load_ffn_down_and_sparse(m, il, L);
}

/* rope_freqs.weight: f32 [head_dim / 2] frequency divisors (Llama-3's RoPE scaling as
 * llama.cpp stores it), each finite and > 0. */
static gh_status load_rope_freqs(gh_model * m) {
    const gh_gguf_tensor * t = gh_gguf_find_tensor(m->gguf, "rope_freqs.weight");
    if (!t) return GH_OK;
    if (m->hp.rope == GH_ROPE_NONE) {
        return gh_fail(GH_ERR_FORMAT, "tensor 'rope_freqs.weight': architecture '%s' has no RoPE",
                       m->arch->name);
    }
    if (m->hp.n_rot != m->hp.head_dim) {
        return gh_fail(GH_ERR_UNSUPPORTED, "tensor 'rope_freqs.weight' with RoPE over part of the head "
                       "(%s.rope.dimension_count = %d of %d) is not supported", m->arch->name,
                       m->hp.n_rot, m->hp.head_dim);
    }
    if (m->hp.rope_freqs) {
        return gh_fail(GH_ERR_FORMAT, "tensor 'rope_freqs.weight' in a file with YaRN RoPE scaling "
                       "(%s.rope.scaling.type): the two scalings exclude each other", m->arch->name);
    }
    const int64_t n = m->hp.head_dim / 2;
    gh_status st = check_1d(t, GH_TYPE_F32, n, "head_dim / 2 RoPE frequency divisors");
    if (st) return st;
    if ((st = load_vector(m, "rope_freqs.weight", n, &m->hp.rope_freqs))) return st;
    for (int64_t i = 0; i < n; i++) {
        const float f = m->hp.rope_freqs[i];
        if (!(f > 0.0f) || isinf(f)) {
            return gh_fail(GH_ERR_FORMAT, "tensor 'rope_freqs.weight': entry %lld is %g (must be "
                           "finite and > 0)", (long long) i, f);
        }
    }
    return GH_OK;
}

/* A token id key (bos, eos): absent, or negative / 0xFFFFFFFF ("none", as some writers
 * store it), gives -1; any other value must index the vocabulary. */
static gh_status token_id_key(const gh_gguf * g, const char * key, int32_t n_vocab, int32_t * out) {
    *out = -1;
    const int64_t i = gh_gguf_find_key(g, key);
    if (i < 0) return GH_OK;
    int64_t v;
    if (gh_gguf_kv_int(g, i, &v) != GH_OK) {
        return gh_fail(GH_ERR_FORMAT, "key '%s': expected an integer token id, found %s", key,
                       gh_gguf_vtype_name(gh_gguf_find_kv(g, key)->type));
    }
    if (v < 0 || v == (int64_t) UINT32_MAX) return GH_OK;
    if (v >= n_vocab) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %lld is outside the vocabulary: token_embd.weight "
                       "has %d rows", key, (long long) v, n_vocab);
    }
    *out = (int32_t) v;
    return GH_OK;
}

/* The vocabulary is token_embd's rows; the keys that also state it must agree: the
 * architecture's vocab_size, the tokenizer's token list (a token without an embedding row
 * would index past it; fewer tokens than rows is padding, which is legal), bos and eos. */
static gh_status check_vocab(gh_model * m) {
    const gh_gguf * g = m->gguf;
    gh_hparams * hp = &m->hp;
    char key[128];
    snprintf(key, sizeof key, "%s.vocab_size", m->arch->name);
    uint32_t nv;
    gh_status st = get_u32_opt(g, key, &nv, (uint32_t) hp->n_vocab);
    if (st) return st;
    if (nv != (uint32_t) hp->n_vocab) {
        return gh_fail(GH_ERR_FORMAT, "key '%s' = %u but token_embd.weight has %d rows", key, nv,
                       hp->n_vocab);
    }
    const int64_t n_tok = gh_gguf_get_arr_n(g, "tokenizer.ggml.tokens");
    if (n_tok > hp->n_vocab) {
        return gh_fail(GH_ERR_FORMAT, "key 'tokenizer.ggml.tokens' has %lld tokens but "
                       "token_embd.weight has only %d rows", (long long) n_tok, hp->n_vocab);
    }
    if ((st = token_id_key(g, "tokenizer.ggml.bos_token_id", hp->n_vocab, &hp->bos_id))) return st;
    return token_id_key(g, "tokenizer.ggml.eos_token_id", hp->n_vocab, &hp->eos_id);
}

/* Layer index of a tensor name "blk.<N>.<rest>" (N decimal, saturated at INT32_MAX), or
 * -1 for a name outside the blocks. */
static int64_t layer_of(const char * name) {
    if (strncmp(name, "blk.", 4) != 0) return -1;
    const char * p = name + 4;
    int64_t n = 0;
    if (*p < '0' || *p > '9') return -1;
    for (; *p >= '0' && *p <= '9'; p++) n = GH_MIN(n * 10 + (*p - '0'), (int64_t) INT32_MAX);
    return *p == '.' ? n : -1;
}

/* block_count against the blk.N tensors of a file: a layer past it would be silently left
 * out (a smaller, wrong model), and a layer below it with no tensor at all is a file cut
 * short (said here by the key, before the loader misses its first tensor). */
static gh_status check_layers(const gh_model * m, const gh_gguf * g, const char * what) {
    const int n_layer = m->hp.n_layer;
    uint8_t * seen = calloc((size_t) n_layer, 1);
    if (!seen) return gh_fail(GH_ERR_OOM, "out of memory");
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const int64_t il = layer_of(g->tensors[i].name);
        if (il >= n_layer && il < n_layer + m->hp.n_nextn) continue; /* nextn_predict_layers' */
        if (il >= n_layer) {
            free(seen);
            return gh_fail(GH_ERR_FORMAT, "key '%s.block_count' = %d but %s has tensor '%.96s' of "
                           "layer %lld", m->arch->name, n_layer + m->hp.n_nextn, what,
                           g->tensors[i].name, (long long) il);
        }
        if (il >= 0) seen[il] = 1;
    }
    int missing = -1;
    for (int il = 0; il < n_layer && missing < 0; il++) if (!seen[il]) missing = il;
    free(seen);
    if (missing >= 0 && g == m->gguf) {
        return gh_fail(GH_ERR_FORMAT, "key '%s.block_count' = %d but the file has no tensors of "
                       "layer %d (blk.%d.*)", m->arch->name, n_layer + m->hp.n_nextn, missing, missing);
    }
    return GH_OK;
}

static gh_status load_tensors(gh_model * m) {
    const gh_gguf * g = m->gguf;
    gh_hparams * hp = &m->hp;
    const int64_t d = hp->n_embd;
    gh_status st;

    const gh_gguf_tensor * te = gh_gguf_find_tensor(g, "token_embd.weight");
    if (!te) return gh_fail(GH_ERR_FORMAT, "missing tensor 'token_embd.weight'");
    if (te->ne[1] < 1 || te->ne[1] > (1 << 24)) {
        return gh_fail(GH_ERR_FORMAT, "token_embd.weight: bad vocabulary size %lld",
                       (long long) te->ne[1]);
    }
    hp->n_vocab = (int32_t) te->ne[1];
    if ((st = find_tensor(m, "token_embd.weight", d, hp->n_vocab, true, &te))) return st;
    if ((st = check_vocab(m))) return st;
    if ((st = check_layers(m, g, "the file"))) return st;
    if (m->gpuidx && (st = check_layers(m, m->gpuidx, "its GPU index file"))) return st;
    m->embd_type = te->type;
    m->embd = te->data;
    m->embd_row_bytes = gh_row_size(te->type, d);
    if (m->embd_row_bytes == 0 || !gh_type_traits_get(te->type)) {
        return gh_fail(GH_ERR_FORMAT, "token_embd.weight: type %s cannot hold rows of %lld elements",
                       gh_type_name(te->type), (long long) d);
    }
    if (m->arch->learned_pos) {
        const gh_gguf_tensor * tp = gh_gguf_find_tensor(g, "position_embd.weight");
        if (!tp) return gh_fail(GH_ERR_FORMAT, "missing tensor 'position_embd.weight'");
        const int64_t np = tp->ne[1];
        if (np <= m->arch->pos_offset || np > (1 << 24)) {
            return gh_fail(GH_ERR_FORMAT, "position_embd.weight: %lld rows (needs more than the "
                           "offset %d)", (long long) np, m->arch->pos_offset);
        }
        if ((st = find_tensor(m, "position_embd.weight", d, np, true, &tp))) return st;
        m->pos_type = tp->type;
        m->pos = tp->data;
        m->pos_row_bytes = gh_row_size(tp->type, d);
        if (m->pos_row_bytes == 0 || !gh_type_traits_get(tp->type)) {
            return gh_fail(GH_ERR_FORMAT, "position_embd.weight: type %s cannot hold rows of %lld "
                           "elements", gh_type_name(tp->type), (long long) d);
        }
        hp->n_pos = (int32_t) np;
        hp->pos_offset = m->arch->pos_offset;
        /* a context can hold no more positions than the table has */
        hp->n_ctx_train = GH_MIN(hp->n_ctx_train, hp->n_pos - hp->pos_offset);
    }

    if ((st = load_norm(m, "output_norm", true, &m->output_norm, &m->output_norm_b))) return st;
    const gh_gguf_tensor * out;
    if ((st = find_tensor(m, "output.weight", d, hp->n_vocab, false, &out))) return st;
    m->info.tied_output = out == NULL;
    if ((st = load_weight(m, out ? "output.weight" : "token_embd.weight", d, hp->n_vocab,
                          &m->output))) return st;
    if ((st = load_rope_freqs(m))) return st;
    if ((st = load_sparse_keys(m))) return st;

    /* the block layout is the file's: sequential when it has ffn_norm (Falcon variants) */
    hp->parallel = m->arch->parallel && !gh_gguf_find_tensor(g, "blk.0.ffn_norm.weight");
    m->layers = calloc((size_t) hp->n_layer, sizeof *m->layers);
    if (!m->layers) return gh_fail(GH_ERR_OOM, "out of memory");
    for (int il = 0; il < hp->n_layer; il++) {
        if ((st = load_block(m, il, &m->layers[il]))) return st;
    }
    if ((st = load_gate_thresholds(m))) return st;
    if ((st = load_input_sparse(m))) return st;
    if ((st = load_ffn_input_sparse(m))) return st;
    const gh_layer * Lw = &m->layers[hp->n_layer - 1]; /* past any leading dense layers */
    m->info.weight_type = hp->n_expert ? Lw->moe.gate_exps.type : m->layers[0].gate.type;

    int64_t n_params = 0, n_bytes = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const gh_gguf_tensor * t = &g->tensors[i];
        n_params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        n_bytes += (int64_t) t->nbytes;
    }
    m->info.n_params = n_params;
    m->info.n_bytes = n_bytes;
    return GH_OK;
}

/* Drops one reference; the last one frees. Contexts hold one each, so a model freed
 * before its contexts (garbage collectors pick any order) lives until the last goes. */
void gh_model_free(gh_model * m) {
    if (!m) return;
    if (atomic_fetch_sub(&m->refs, 1) > 1) return;
    if (m->layers) {
        for (int il = 0; il < m->hp.n_layer; il++) {
            free(m->layers[il].gpu_idx);
            free(m->layers[il].gpu_bucket);
        }
        free(m->layers);
    }
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->warnings);
    gh_hybrid_free(m->hy);
    gh_gguf_close(m->gguf);
    free(m);
}

const char * gh_model_warnings(const gh_model * m) {
    return m && m->warnings ? m->warnings : "";
}

gh_status gh_model_check_weights(gh_model * m, int64_t * n_bad) {
    if (!m) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_check_weights: model is NULL");
    const gh_gguf * g = m->gguf;
    int64_t bad_tensors = 0;
    enum { CHUNK = 4096 };  /* elements; a multiple of every block size */
    float buf[CHUNK];
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const gh_gguf_tensor * t = &g->tensors[i];
        const gh_type_traits * tr = gh_type_traits_get(t->type);
        if (!tr || t->ne[0] % tr->block_size) continue;  /* not a type the model reads */
        /* rows are contiguous without padding: the tensor is one run of blocks */
        const int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        const uint8_t * data = t->data;
        int64_t bad = 0;
        for (int64_t e = 0; e < n; e += CHUNK) {
            const int64_t k = GH_MIN((int64_t) CHUNK, n - e);
            tr->to_float(data + gh_row_size(t->type, e), buf, k);
            bad += count_nonfinite(buf, k);
        }
        if (bad) {
            warn_nonfinite(m, t->name, bad, n);
            bad_tensors++;
        }
    }
    if (n_bad) *n_bad = bad_tensors;
    return GH_OK;
}

static gh_status model_load(const char * path, int load, gh_model ** out);

gh_model_params gh_model_default_params(void) {
    gh_model_params p = { .device = NULL, .vram_budget = -1, .reset_gpu_index = 0,
                          .load = GH_LOAD_AUTO };
    return p;
}

gh_status gh_model_load_ex(const char * path, const gh_model_params * p, gh_model ** out) {
    gh_status st = model_load(path, p ? p->load : GH_LOAD_AUTO, out);
    if (st || !p) return st;
    st = gh_hybrid_place(*out, p);
    if (st) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", gh_last_error());
        gh_model_free(*out);
        *out = NULL;
        return gh_fail(st, "%s: placing the model on device '%s': %s", path, p->device, msg);
    }
    return GH_OK;
}

/* A GPU index side file "<model>.generated.gpuidx" (PowerInfer's layout: a GGUF of
 * architecture generic.gpu_index with blk.N.gpu_idx and blk.N.gpu_bucket; `place` writes
 * ours the same way) replaces the index inside the file. Ours record the model's size, so
 * a side file left from another conversion is refused rather than used. */
static gh_status open_gpuidx(gh_model * m, const char * path) {
    char side[4096];
    m->index_budget = -1;
    if ((size_t) snprintf(side, sizeof side, "%s.generated.gpuidx", path) >= sizeof side ||
        access(side, F_OK) != 0) {
        int64_t fb;
        const int64_t ki = gh_gguf_find_key(m->gguf, "powerinfer.gpu.vram_budget");
        if (ki >= 0 && gh_gguf_kv_int(m->gguf, ki, &fb) == GH_OK) m->index_budget = fb;
        return GH_OK;
    }
    gh_status st = gh_gguf_open(side, &m->gpuidx);
    if (st) return st; /* the reader named the file */
    const char * a = gh_gguf_get_str(m->gpuidx, "general.architecture");
    if (a && strcmp(a, "generic.gpu_index") != 0) {
        return gh_fail(GH_ERR_FORMAT, "GPU index file '%.200s' has architecture '%.64s', not "
                       "generic.gpu_index", side, a);
    }
    int64_t want = -1;
    const int64_t km = gh_gguf_find_key(m->gpuidx, "powerinfer.gpu.model_bytes");
    if (km >= 0 && (gh_gguf_kv_int(m->gpuidx, km, &want) != GH_OK || (uint64_t) want != m->gguf->size)) {
        return gh_fail(GH_ERR_FORMAT, "GPU index file '%.200s' was made for a model file of %lld "
                       "bytes, not this one's %llu: re-run `python -m powerinfer_cpp.place` or "
                       "delete it", side, (long long) want, (unsigned long long) m->gguf->size);
    }
    int64_t fb;
    int64_t ki = gh_gguf_find_key(m->gpuidx, "powerinfer.gpu.vram_budget");
    if (ki < 0) ki = gh_gguf_find_key(m->gpuidx, "split.vram_capacity"); /* PowerInfer's */
    if (ki >= 0 && gh_gguf_kv_int(m->gpuidx, ki, &fb) == GH_OK) m->index_budget = fb;
    /* (a longer path is cut: the name is for messages and device_info only) */
    snprintf(m->index_file, sizeof m->index_file, "%.*s", (int) sizeof m->index_file - 1, side);
    return GH_OK;
}

/* The loader proper, over an opened image (owned by the model from here on). path: the
 * file it came from, which names its GPU index side file, or NULL for a memory image. */
static gh_status model_from_gguf(gh_gguf * g, const char * path, const char * label,
                                 gh_model ** out) {
    gh_model * m = calloc(1, sizeof *m);
    if (!m) {
        gh_gguf_close(g);
        return gh_fail(GH_ERR_OOM, "out of memory");
    }
    atomic_init(&m->refs, 1);
    m->gguf = g;
    m->index_budget = -1;
    gh_status st = load_hparams(m);
    if (!st && path) st = open_gpuidx(m, path);
    if (!st) st = load_tensors(m);
    if (!st) fill_info(m);
    /* the side file's index is copied into the layers */
    gh_gguf_close(m->gpuidx);
    m->gpuidx = NULL;
    if (st) {
        /* Prefix the file name so the user knows which file is bad. */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", gh_last_error());
        gh_fail(st, "%s: %s", label, msg);
        gh_model_free(m);
        return st;
    }
    *out = m;
    return GH_OK;
}

static gh_status model_load(const char * path, int load, gh_model ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_load: out is NULL");
    *out = NULL;
    if (!path) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_load: path is NULL");
    gh_gguf * g = NULL;
    gh_status st = gh_gguf_open_ex(path, load, &g);
    if (st) return st; /* the reader named the file */
    return model_from_gguf(g, path, path, out);
}

gh_status gh_model_load_memory(const void * data, size_t size, gh_model ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_load_memory: out is NULL");
    *out = NULL;
    gh_gguf * g = NULL;
    gh_status st = gh_gguf_open_memory(data, size, &g);
    if (st) return st;
    return model_from_gguf(g, NULL, "<memory image>", out);
}

gh_status gh_model_load(const char * path, gh_model ** out) {
    return model_load(path, GH_LOAD_AUTO, out);
}

int32_t gh_model_load_mode(const gh_model * m) {
    return m ? gh_gguf_load_mode(m->gguf) : GH_LOAD_MMAP;
}

gh_status gh_model_info_get(const gh_model * m, gh_model_info * out) {
    if (!m || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_info_get: NULL argument");
    *out = m->info;
    return GH_OK;
}
