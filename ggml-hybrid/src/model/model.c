/* Loading a LLaMA-family model from GGUF and running its forward pass on the CPU. */
#include "model/model.h"
#include "backend/hybrid.h"
#include "ffn/sparse.h"
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

/* Finds a tensor and checks its shape: ne0 x ne1 (ne1 = 0 for a vector). */
static gh_status find_tensor(const gh_gguf * g, const char * name, int64_t ne0, int64_t ne1,
                             bool required, const gh_gguf_tensor ** out) {
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
        return gh_fail(GH_ERR_FORMAT,
                       "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%s] "
                       "from the model's hyper-parameters",
                       name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                       (long long) t->ne[3], want);
    }
    return GH_OK;
}

static gh_status load_weight(const gh_gguf * g, const char * name, int64_t cols, int64_t rows,
                             gh_weight * w) {
    const gh_gguf_tensor * t;
    gh_status st = find_tensor(g, name, cols, rows, true, &t);
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

/* Norm vectors are tiny: keep an f32 copy whatever their stored type, and check it for
 * NaN/Inf (free: the values are converted anyway). */
static gh_status load_vector(gh_model * m, const char * name, int64_t n, float ** out) {
    const gh_gguf * g = m->gguf;
    const gh_gguf_tensor * t;
    gh_status st = find_tensor(g, name, n, 0, true, &t);
    if (st) return st;
    const gh_type_traits * tr = gh_type_traits_get(t->type);
    if (!tr || n % tr->block_size) {
        return gh_fail(GH_ERR_UNSUPPORTED, "tensor '%s': type %d unsupported for a vector", name,
                       t->type);
    }
    float * v = malloc((size_t) n * sizeof(float));
    if (!v) return gh_fail(GH_ERR_OOM, "out of memory loading '%s'", name);
    tr->to_float(t->data, v, n);
    *out = v;
    warn_nonfinite(m, name, count_nonfinite(v, n), n);
    return GH_OK;
}

static int parse_act(const char * s) {
    if (!strcmp(s, "silu") || !strcmp(s, "swiglu")) return GH_ACT_SILU;
    if (!strcmp(s, "relu") || !strcmp(s, "reglu")) return GH_ACT_RELU;
    if (!strcmp(s, "drelu")) return GH_ACT_DRELU;
    if (!strcmp(s, "gelu") || !strcmp(s, "geglu")) return GH_ACT_GELU;
    if (!strcmp(s, "gelu_erf")) return GH_ACT_GELU_ERF;
    return -1;
}

static gh_status load_hparams(gh_model * m) {
    const gh_gguf * g = m->gguf;
    gh_model_info * hp = &m->info;
    const char * arch = gh_gguf_get_str(g, "general.architecture");
    if (!arch) return gh_fail(GH_ERR_FORMAT, "missing key 'general.architecture'");
    /* Mistral and Qwen2-without-bias are llama-shaped; only llama is written by our
     * converter and by llama.cpp's for these families. */
    if (strcmp(arch, "llama") != 0) {
        return gh_fail(GH_ERR_UNSUPPORTED,
                       "unsupported architecture '%.64s' (supported: llama — LLaMA, Mistral and "
                       "other llama-shaped models converted with powerinfer_cpp.convert)", arch);
    }
    snprintf(hp->arch, sizeof hp->arch, "%s", arch);

    uint32_t n_embd, n_layer, n_ff, n_head, n_head_kv, n_ctx_train, head_dim, rope_dim;
    gh_status st;
    if ((st = get_u32_req(g, "llama.embedding_length", &n_embd))) return st;
    if ((st = get_u32_req(g, "llama.block_count", &n_layer))) return st;
    if ((st = get_u32_req(g, "llama.feed_forward_length", &n_ff))) return st;
    if ((st = get_u32_req(g, "llama.attention.head_count", &n_head))) return st;
    if ((st = get_u32_opt(g, "llama.attention.head_count_kv", &n_head_kv, n_head))) return st;
    if ((st = get_u32_opt(g, "llama.context_length", &n_ctx_train, 2048))) return st;
    if (n_embd == 0 || n_embd > (1u << 20) || n_layer == 0 || n_layer > 4096 || n_ff == 0 ||
        n_ff > (1u << 24) || n_head == 0 || n_head > 4096 || n_head_kv == 0 ||
        n_head % n_head_kv != 0 || n_ctx_train == 0) {
        return gh_fail(GH_ERR_FORMAT,
                       "inconsistent hyper-parameters: n_embd=%u n_layer=%u n_ff=%u n_head=%u "
                       "n_head_kv=%u n_ctx=%u",
                       n_embd, n_layer, n_ff, n_head, n_head_kv, n_ctx_train);
    }
    if (n_embd % n_head != 0 && !gh_gguf_find_kv(g, "llama.attention.key_length")) {
        return gh_fail(GH_ERR_FORMAT,
                       "n_embd=%u is not divisible by n_head=%u (and the file has no "
                       "llama.attention.key_length giving the head size)", n_embd, n_head);
    }
    if ((st = get_u32_opt(g, "llama.attention.key_length", &head_dim, n_embd / n_head))) return st;
    uint32_t v_dim;
    if ((st = get_u32_opt(g, "llama.attention.value_length", &v_dim, head_dim))) return st;
    if ((st = get_u32_opt(g, "llama.rope.dimension_count", &rope_dim, head_dim))) return st;
    if (head_dim == 0 || head_dim % 2 || head_dim > 1024 || v_dim != head_dim) {
        return gh_fail(GH_ERR_UNSUPPORTED, "unsupported head size %u (value size %u)", head_dim,
                       v_dim);
    }
    if (rope_dim != head_dim) {
        return gh_fail(GH_ERR_UNSUPPORTED, "partial rotary embeddings (%u of %u dims) unsupported",
                       rope_dim, head_dim);
    }
    const char * scaling = gh_gguf_get_str(g, "llama.rope.scaling.type");
    if (scaling && strcmp(scaling, "none") != 0) {
        return gh_fail(GH_ERR_UNSUPPORTED, "RoPE scaling '%.32s' is not supported yet", scaling);
    }
    float eps, theta;
    if ((st = get_f32_opt(g, "llama.attention.layer_norm_rms_epsilon", &eps, 1e-5f))) return st;
    if ((st = get_f32_opt(g, "llama.rope.freq_base", &theta, 10000.0f))) return st;
    if (!(eps > 0 && eps < 1) || !(theta > 1) || isinf(theta)) {
        return gh_fail(GH_ERR_FORMAT, "bad rms epsilon %g or rope base %g", eps, theta);
    }

    const char * act = gh_gguf_get_str(g, "powerinfer.ffn_activation");
    if (act) {
        int a = parse_act(act);
        if (a < 0) {
            return gh_fail(GH_ERR_UNSUPPORTED,
                           "unknown FFN activation '%.32s' in powerinfer.ffn_activation "
                           "(known: silu, relu, drelu, gelu, gelu_erf)", act);
        }
        hp->ffn_act = a;
        hp->act_from_file = 1;
    } else {
        hp->ffn_act = GH_ACT_SILU; /* what llama.cpp assumes for the llama architecture */
        hp->act_from_file = 0;
    }

    uint32_t tok;
    bool err = false;
    hp->bos_id = gh_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &tok, &err) ? (int32_t) tok : -1;
    hp->eos_id = gh_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &tok, &err) ? (int32_t) tok : -1;

    hp->n_embd = (int32_t) n_embd;
    hp->n_layer = (int32_t) n_layer;
    hp->n_ff = (int32_t) n_ff;
    hp->n_head = (int32_t) n_head;
    hp->n_head_kv = (int32_t) n_head_kv;
    hp->head_dim = (int32_t) head_dim;
    hp->n_ctx_train = (int32_t) n_ctx_train;
    hp->rms_eps = eps;
    hp->rope_theta = theta;
    return GH_OK;
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
    if ((st = get_f32_opt(g, "powerinfer.sparse.threshold", &thr, 0.0f))) return st;
    if (!isfinite(thr)) {
        return gh_fail(GH_ERR_FORMAT, "powerinfer.sparse.threshold is %g (must be finite)", thr);
    }
    m->info.sparse_threshold = thr;
    return GH_OK;
}

/* act(g) of the FFN's activation for one value (the gate alone, up = 1). */
static float act1(int act, float g) {
    const float one = 1.0f;
    float y;
    gh_glu(act, &g, &one, &y, 1);
    return y;
}

/* The cut points of |act(g)| > t (see gh_layer): act is increasing above its minimum g_min
 * (SiLU -1.28, GELU -0.75; ReLU family: flat at 0 below 0), so one cut above g_min, and
 * two below it when act(g_min) < -t. Found by bisection in float. */
static void gate_cuts(int act, float t, gh_layer * L) {
    float a = -20.0f, b = 0.0f; /* g_min by ternary search (act is unimodal below 0) */
    for (int k = 0; k < 200; k++) {
        const float m1 = a + (b - a) / 3.0f, m2 = b - (b - a) / 3.0f;
        if (act1(act, m1) <= act1(act, m2)) b = m2; else a = m1;
    }
    const float g_min = 0.5f * (a + b);
    float lo = g_min, hi = 1e4f;  /* act(lo) <= t < act(hi) */
    for (int k = 0; k < 200 && lo < hi; k++) {
        const float mid = 0.5f * (lo + hi);
        if (mid == lo || mid == hi) break;
        if (act1(act, mid) > t) hi = mid; else lo = mid;
    }
    L->gate_cut = lo;   /* g > lo  <=>  act(g) > t on the increasing side */
    L->gate_lo = L->gate_hi = 0.0f;
    if (act1(act, g_min) < -t) {
        float l0 = -1e4f, l1 = g_min;  /* decreasing: act(l0) >= -t > act(l1) */
        for (int k = 0; k < 200; k++) {
            const float mid = 0.5f * (l0 + l1);
            if (mid == l0 || mid == l1) break;
            if (act1(act, mid) < -t) l1 = mid; else l0 = mid;
        }
        float h0 = g_min, h1 = 0.0f;   /* increasing: act(h0) < -t <= act(h1) */
        for (int k = 0; k < 200; k++) {
            const float mid = 0.5f * (h0 + h1);
            if (mid == h0 || mid == h1) break;
            if (act1(act, mid) < -t) h0 = mid; else h1 = mid;
        }
        L->gate_lo = l0;
        L->gate_hi = h1;
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
    if (n != m->info.n_layer) {
        return gh_fail(GH_ERR_FORMAT, "%s has %lld values but the model has %d layers", key,
                       (long long) n, m->info.n_layer);
    }
    const void * data;
    uint64_t nbytes;
    gh_status st = gh_gguf_kv_arr_data(g, i, &data, &nbytes);
    if (st) return st;
    for (int il = 0; il < m->info.n_layer; il++) {
        float t;
        memcpy(&t, (const uint8_t *) data + (size_t) il * 4, 4);
        if (!isfinite(t) || t < 0.0f)
            return gh_fail(GH_ERR_FORMAT, "%s[%d] is %g (must be finite and >= 0)", key, il, t);
        gh_layer * L = &m->layers[il];
        L->has_gate_thr = true;
        L->gate_thr = t;
        gate_cuts(m->info.ffn_act, t, L);
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
    const int64_t d = m->info.n_embd, ff = m->info.n_ff;
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
        if ((st = load_weight(g, down_t, d, ff, &L->down_t))) return st;
        m->info.has_down_t++;
    } else if ((st = load_weight(g, down, ff, d, &L->down))) {
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
        if ((st = load_weight(g, n1, d, h, &L->fc1))) return st;
        if ((st = load_weight(g, n2, h, ff, &L->fc2))) return st;
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
    const gh_gguf_tensor * gi = gh_gguf_find_tensor(g, n1), * gb = gh_gguf_find_tensor(g, n2);
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

static gh_status load_tensors(gh_model * m) {
    const gh_gguf * g = m->gguf;
    gh_model_info * hp = &m->info;
    const int64_t d = hp->n_embd, dq = (int64_t) hp->n_head * hp->head_dim,
                  dkv = (int64_t) hp->n_head_kv * hp->head_dim, ff = hp->n_ff;
    gh_status st;

    const gh_gguf_tensor * te = gh_gguf_find_tensor(g, "token_embd.weight");
    if (!te) return gh_fail(GH_ERR_FORMAT, "missing tensor 'token_embd.weight'");
    if (te->ne[1] < 1 || te->ne[1] > (1 << 24)) {
        return gh_fail(GH_ERR_FORMAT, "token_embd.weight: bad vocabulary size %lld",
                       (long long) te->ne[1]);
    }
    hp->n_vocab = (int32_t) te->ne[1];
    if ((st = find_tensor(g, "token_embd.weight", d, hp->n_vocab, true, &te))) return st;
    m->embd_type = te->type;
    m->embd = te->data;
    m->embd_row_bytes = gh_row_size(te->type, d);
    if (m->embd_row_bytes == 0) {
        return gh_fail(GH_ERR_FORMAT, "token_embd.weight: row of %lld elements does not fit type %s",
                       (long long) d, gh_type_name(te->type));
    }

    if ((st = load_vector(m, "output_norm.weight", d, &m->output_norm))) return st;
    const gh_gguf_tensor * out;
    if ((st = find_tensor(g, "output.weight", d, hp->n_vocab, false, &out))) return st;
    hp->tied_output = out == NULL;
    if ((st = load_weight(g, out ? "output.weight" : "token_embd.weight", d, hp->n_vocab,
                          &m->output))) return st;

    /* llama.cpp's Llama-3.1+ files carry the rope scaling as per-dimension frequency
     * factors; computing without them would be silently wrong at every position */
    if (gh_gguf_find_tensor(g, "rope_freqs.weight")) {
        return gh_fail(GH_ERR_UNSUPPORTED, "tensor 'rope_freqs.weight' (RoPE frequency factors, "
                       "as Llama-3.1 files store their rope scaling) is not supported yet");
    }
    if ((st = load_sparse_keys(m))) return st;
    m->layers = calloc((size_t) hp->n_layer, sizeof *m->layers);
    if (!m->layers) return gh_fail(GH_ERR_OOM, "out of memory");
    char name[96];
#define BLK(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, il), name)
    for (int il = 0; il < hp->n_layer; il++) {
        gh_layer * L = &m->layers[il];
        if ((st = load_vector(m, BLK("attn_norm.weight"), d, &L->attn_norm))) return st;
        if ((st = load_weight(g, BLK("attn_q.weight"), d, dq, &L->wq))) return st;
        if ((st = load_weight(g, BLK("attn_k.weight"), d, dkv, &L->wk))) return st;
        if ((st = load_weight(g, BLK("attn_v.weight"), d, dkv, &L->wv))) return st;
        if ((st = load_weight(g, BLK("attn_output.weight"), dq, d, &L->wo))) return st;
        if ((st = load_vector(m, BLK("ffn_norm.weight"), d, &L->ffn_norm))) return st;
        if ((st = load_weight(g, BLK("ffn_gate.weight"), d, ff, &L->gate))) return st;
        if ((st = load_weight(g, BLK("ffn_up.weight"), d, ff, &L->up))) return st;
        if ((st = load_ffn_down_and_sparse(m, il, L))) return st;
    }
#undef BLK
    if ((st = load_gate_thresholds(m))) return st;
    hp->weight_type = m->layers[0].gate.type;

    int64_t n_params = 0, n_bytes = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const gh_gguf_tensor * t = &g->tensors[i];
        n_params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        n_bytes += (int64_t) t->nbytes;
    }
    hp->n_params = n_params;
    hp->n_bytes = n_bytes;
    return GH_OK;
}

/* Drops one reference; the last one frees. Contexts hold one each, so a model freed
 * before its contexts (garbage collectors pick any order) lives until the last goes. */
void gh_model_free(gh_model * m) {
    if (!m) return;
    if (atomic_fetch_sub(&m->refs, 1) > 1) return;
    if (m->layers) {
        for (int il = 0; il < m->info.n_layer; il++) {
            free(m->layers[il].attn_norm);
            free(m->layers[il].ffn_norm);
            free(m->layers[il].gpu_idx);
            free(m->layers[il].gpu_bucket);
        }
        free(m->layers);
    }
    free(m->output_norm);
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

gh_status gh_model_device_info(const gh_model * m, gh_device_info * out) {
    if (!m || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_device_info: NULL argument");
    if (m->hy) {
        *out = m->hy->info;
        return GH_OK;
    }
    memset(out, 0, sizeof *out);
    snprintf(out->device, sizeof out->device, "cpu");
    out->file_budget = -1;
    out->n_neurons = (int64_t) m->info.n_layer * m->info.n_ff;
    return GH_OK;
}

static gh_status model_load(const char * path, int load, gh_model ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_load: out is NULL");
    *out = NULL;
    if (!path) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_load: path is NULL");
    gh_model * m = calloc(1, sizeof *m);
    if (!m) return gh_fail(GH_ERR_OOM, "out of memory");
    atomic_init(&m->refs, 1);
    gh_status st = gh_gguf_open_ex(path, load, &m->gguf);
    if (!st) st = load_hparams(m);
    if (!st) st = load_tensors(m);
    if (st) {
        if (m->gguf) {
            /* Prefix the file name so the user knows which file is bad. */
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", gh_last_error());
            gh_fail(st, "%s: %s", path, msg);
        }
        gh_model_free(m);
        return st;
    }
    *out = m;
    return GH_OK;
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

void gh_context_free(gh_context * c) {
    if (!c) return;
    gh_threadpool_free(c->tp);
    gh_sparse_state_free(c->sparse);
    if (c->stream) c->model->hy->b->ops->stream_free(c->stream);
    if (c->k_cache) for (int il = 0; il < c->model->info.n_layer; il++) gh_aligned_free(c->k_cache[il]);
    if (c->v_cache) for (int il = 0; il < c->model->info.n_layer; il++) gh_aligned_free(c->v_cache[il]);
    free(c->k_cache);
    free(c->v_cache);
    gh_aligned_free(c->k_cur);
    gh_aligned_free(c->v_cur);
    gh_model * m = c->model;
    gh_aligned_free(c->x);
    gh_aligned_free(c->xb);
    gh_aligned_free(c->xb2);
    gh_aligned_free(c->q);
    gh_aligned_free(c->att);
    gh_aligned_free(c->rope);
    gh_aligned_free(c->hb);
    gh_aligned_free(c->hb2);
    gh_aligned_free(c->mm_scratch);
    gh_aligned_free(c->logits);
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
    for (int il = 0; il < m->info.n_layer; il++) {
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
    const gh_model_info * hp = &m->info;
    int32_t n_ctx = p->n_ctx > 0 ? p->n_ctx : hp->n_ctx_train;
    if (p->n_ctx < 0 || n_ctx > (1 << 20)) {
        return gh_fail(GH_ERR_INVALID_ARG, "n_ctx must be between 1 and %d, got %d", 1 << 20, p->n_ctx);
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
    if (ok && c->cache_type != GH_TYPE_F32) {
        c->k_cur = gh_aligned_alloc(nb * dkv * sizeof(float));
        c->v_cur = gh_aligned_alloc(nb * dkv * sizeof(float));
        ok = c->k_cur && c->v_cur;
    }
    if (ok) {
        c->x = gh_aligned_alloc(nb * d * sizeof(float));
        c->xb = gh_aligned_alloc(nb * d * sizeof(float));
        c->xb2 = gh_aligned_alloc(nb * d * sizeof(float));
        c->q = gh_aligned_alloc(nb * dq * sizeof(float));
        c->att = gh_aligned_alloc(nb * dq * sizeof(float));
        c->rope = gh_aligned_alloc(nb * (size_t) hp->head_dim * sizeof(float));
        c->hb = gh_aligned_alloc(nb * ff * sizeof(float));
        c->hb2 = gh_aligned_alloc(nb * ff * sizeof(float));
        c->mm_scratch = gh_aligned_alloc(max_scratch(m, nb));
        c->logits_cap = 1;
        c->logits = gh_aligned_alloc((size_t) hp->n_vocab * sizeof(float));
        c->sparse = gh_sparse_state_new(m);
        ok = c->x && c->xb && c->xb2 && c->q && c->att && c->rope && c->hb && c->hb2 &&
             c->mm_scratch && c->logits && c->sparse;
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

/* ---------------------------------------------------------- forward pass -- */

static void embed(const gh_model * m, const int32_t * tokens, int64_t n, float * x) {
    const gh_type_traits * tr = gh_type_traits_get(m->embd_type);
    const int64_t d = m->info.n_embd;
    for (int64_t t = 0; t < n; t++) {
        tr->to_float(m->embd + (size_t) tokens[t] * m->embd_row_bytes, x + t * d, d);
    }
}

static void add_inplace(float * restrict a, const float * restrict b, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] += b[i];
}

enum { LOGITS_NONE, LOGITS_LAST, LOGITS_ALL };

/* Profiling (gh_eval_profile): which neurons of n tokens are active. ReGLU/dReLU read
 * the pre-activation gate (and up) before the GLU; the others read its output. */
static void profile_mask(gh_context * c, int il, int32_t n, const float * gate, const float * up,
                         bool post_glu) {
    const int64_t ff = c->model->info.n_ff;
    const int act = c->model->info.ffn_act;
    for (int32_t t = 0; t < n; t++) {
        uint8_t * mk = c->prof_mask + il * c->prof_mask_stride + (int64_t) (c->prof_t0 + t) * ff;
        const float * g = gate + t * ff, * u = up + t * ff;
        if (post_glu) {
            for (int64_t i = 0; i < ff; i++) mk[i] = g[i] != 0.0f;
        } else if (act == GH_ACT_DRELU) {
            for (int64_t i = 0; i < ff; i++) mk[i] = g[i] > 0.0f && u[i] > 0.0f;
        } else {
            for (int64_t i = 0; i < ff; i++) mk[i] = g[i] > 0.0f;
        }
    }
}

/* Runs n tokens (n <= n_batch) at positions n_past..; writes logits for no token, the
 * last token (to row 0) or every token (to rows row0..row0+n-1). */
static void forward_batch(gh_context * c, const int32_t * tokens, int32_t n, int which,
                          int32_t row0) {
    const gh_model * m = c->model;
    const gh_model_info * hp = &m->info;
    const int64_t d = hp->n_embd, hd = hp->head_dim, dq = (int64_t) hp->n_head * hd,
                  dkv = (int64_t) hp->n_head_kv * hd, ff = hp->n_ff;
    const int32_t p0 = c->n_past;

    const bool sparse_ffn = gh_sparse_applies(c, n);
    embed(m, tokens, n, c->x);
    for (int32_t t = 0; t < n; t++) gh_rope_angles((int) hd, p0 + t, hp->rope_theta, c->rope + t * hd);
    for (int il = 0; il < hp->n_layer; il++) {
        const gh_layer * L = &m->layers[il];
        /* this batch's k and v: straight into an F32 cache, else made in f32 and stored */
        const bool kv_f32 = c->cache_type == GH_TYPE_F32;
        float * kc = kv_f32 ? (float *) c->k_cache[il] + (int64_t) p0 * dkv : c->k_cur;
        float * vc = kv_f32 ? (float *) c->v_cache[il] + (int64_t) p0 * dkv : c->v_cur;

        /* attention */
        const double t_att = gh_now();
        for (int32_t t = 0; t < n; t++) gh_rmsnorm(c->x + t * d, L->attn_norm, d, hp->rms_eps, c->xb + t * d);
        const gh_dlayer * D = m->hy ? &m->hy->layers[il] : NULL;
        if (D && D->att) {
            gh_hybrid_matmul_async(c, &D->wq, c->xb, n, c->q);
            gh_hybrid_matmul_async(c, &D->wk, c->xb, n, kc);
            gh_hybrid_matmul_async(c, &D->wv, c->xb, n, vc);
            gh_hybrid_sync(c);
        } else {
            const gh_weight * ws[3] = { &L->wq, &L->wk, &L->wv };
            float * ys[3] = { c->q, kc, vc };
            const int64_t ld[3] = { dq, dkv, dkv };
            gh_matmul_multi(c->tp, ws, 3, c->xb, n, ys, ld, c->mm_scratch);
        }
        for (int32_t t = 0; t < n; t++) {
            gh_rope(c->q + t * dq, hp->n_head, (int) hd, c->rope + t * hd, 0);
            gh_rope(kc + (int64_t) t * dkv, hp->n_head_kv, (int) hd, c->rope + t * hd, 0);
        }
        if (!kv_f32) {
            const gh_from_float_fn store = c->kv_store;
            uint8_t * kdst = (uint8_t *) c->k_cache[il] + (size_t) p0 * c->kv_row;
            uint8_t * vdst = (uint8_t *) c->v_cache[il] + (size_t) p0 * c->kv_row;
            for (int32_t t = 0; t < n; t++) {
                store(kc + (int64_t) t * dkv, kdst + (size_t) t * c->kv_row, dkv);
                store(vc + (int64_t) t * dkv, vdst + (size_t) t * c->kv_row, dkv);
            }
        }
        gh_attention(c->tp, c->q, c->k_cache[il], c->v_cache[il], c->cache_type, c->att, n, p0,
                     hp->n_head, hp->n_head_kv, (int) hd);
        if (D && D->att) {
            gh_hybrid_matmul_async(c, &D->wo, c->att, n, c->xb2);
            gh_hybrid_sync(c);
        } else gh_matmul(c->tp, &L->wo, c->att, n, c->xb2, d, c->mm_scratch);
        add_inplace(c->x, c->xb2, (int64_t) n * d);
        const double t_ffn = gh_now();
        gh_stats_add(c, GH_STAGE_ATTENTION, t_ffn - t_att,
                     (double) (L->wq.rows * L->wq.row_bytes + L->wk.rows * L->wk.row_bytes +
                               L->wv.rows * L->wv.row_bytes + L->wo.rows * L->wo.row_bytes));

        /* feed-forward */
        for (int32_t t = 0; t < n; t++) gh_rmsnorm(c->x + t * d, L->ffn_norm, d, hp->rms_eps, c->xb + t * d);
        if (sparse_ffn) {
            /* one token at a time: predictor (or exact mask) -> active rows only; it
             * counts its own times and bytes (the predictor's apart from the FFN's) */
            const double t_norm = gh_now();
            for (int32_t t = 0; t < n; t++) gh_sparse_ffn(c, il, c->xb + t * d, c->xb2 + t * d);
            const double t_add = gh_now();
            add_inplace(c->x, c->xb2, (int64_t) n * d);
            gh_stats_add(c, GH_STAGE_FFN, (t_norm - t_ffn) + (gh_now() - t_add), 0.0);
            continue;
        }
        if (c->prof_x) {
            memcpy(c->prof_x + il * c->prof_x_stride + (int64_t) c->prof_t0 * d, c->xb,
                   (size_t) n * d * sizeof(float));
        }
        const gh_weight * ws[2] = { &L->gate, &L->up };
        float * ys[2] = { c->hb, c->hb2 };
        const int64_t ld[2] = { ff, ff };
        gh_matmul_multi(c->tp, ws, 2, c->xb, n, ys, ld, c->mm_scratch);
        const bool relu_family = hp->ffn_act == GH_ACT_RELU || hp->ffn_act == GH_ACT_DRELU;
        if (c->prof_mask && relu_family) profile_mask(c, il, n, c->hb, c->hb2, false);
        gh_glu(hp->ffn_act, c->hb, c->hb2, c->hb, (int64_t) n * ff);
        if (c->prof_mask && !relu_family) profile_mask(c, il, n, c->hb, NULL, true);
        if (L->has_down_t) gh_matmul_t(c->tp, &L->down_t, c->hb, n, ff, c->xb2, d);
        else gh_matmul(c->tp, &L->down, c->hb, n, c->xb2, d, c->mm_scratch);
        add_inplace(c->x, c->xb2, (int64_t) n * d);
        gh_stats_dense_ffn(c, il, n, c->hb);
        gh_stats_add(c, GH_STAGE_FFN, gh_now() - t_ffn, 0.0);
    }

    c->n_past += n;
    if (which == LOGITS_NONE) return;
    /* head: only the rows whose logits are kept */
    const int32_t t0 = which == LOGITS_ALL ? 0 : n - 1;
    const int32_t nt = n - t0;
    for (int32_t t = t0; t < n; t++) gh_rmsnorm(c->x + t * d, m->output_norm, d, hp->rms_eps, c->xb + (t - t0) * d);
    float * logits = c->logits + (size_t) row0 * hp->n_vocab;
    if (m->hy && m->hy->head) {
        gh_hybrid_matmul_async(c, &m->hy->output, c->xb, nt, logits);
        gh_hybrid_sync(c);
    } else gh_matmul(c->tp, &m->output, c->xb, nt, logits, hp->n_vocab, c->mm_scratch);
}

static gh_status eval_tokens(gh_context * c, const int32_t * tokens, int32_t n_tokens,
                             int32_t logits_all) {
    if (!tokens || n_tokens <= 0) return gh_fail(GH_ERR_INVALID_ARG, "gh_eval: no tokens given");
    const int32_t n_vocab = c->model->info.n_vocab;
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
    c->dev_status = GH_OK;
    for (int32_t i = 0; i < n_tokens; i += c->n_batch) {
        const int32_t n = GH_MIN(c->n_batch, n_tokens - i);
        const int which = logits_all ? LOGITS_ALL : i + n == n_tokens ? LOGITS_LAST : LOGITS_NONE;
        c->prof_t0 = i;
        const double t0 = gh_now();
        forward_batch(c, tokens + i, n, which, logits_all ? i : 0);
        gh_stats_tokens(c, n, which != LOGITS_NONE, gh_now() - t0);
        if (c->dev_status) {
            /* a device op failed: these tokens are not in the cache, and no logits */
            c->n_past = n_past0;
            c->n_logit_rows = 0;
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", gh_last_error());
            return gh_fail(c->dev_status, "device '%s' failed during gh_eval (the context is "
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
    st = eval_tokens(c, tokens, n_tokens, logits_all);
    gh_ctx_leave(c);
    return st;
}

const float * gh_get_logits(const gh_context * c, int32_t i) {
    if (!c || c->n_logit_rows == 0) return NULL;
    if (i < 0) i = c->n_logit_rows - 1;
    if (i >= c->n_logit_rows) return NULL;
    return c->logits + (size_t) i * c->model->info.n_vocab;
}

int32_t gh_n_logit_rows(const gh_context * c) { return c ? c->n_logit_rows : 0; }

gh_status gh_eval_profile(gh_context * c, const int32_t * tokens, int32_t n_tokens,
                          float * ffn_in, int64_t ffn_in_stride,
                          uint8_t * mask, int64_t mask_stride) {
    if (!c) return gh_fail(GH_ERR_INVALID_ARG, "context is NULL");
    const int64_t d = c->model->info.n_embd, ff = c->model->info.n_ff;
    const int64_t nt = GH_MAX(n_tokens, 0);
    if (ffn_in_stride == 0) ffn_in_stride = nt * d;
    if (mask_stride == 0) mask_stride = nt * ff;
    if (ffn_in_stride < nt * d || mask_stride < nt * ff) {
        return gh_fail(GH_ERR_INVALID_ARG,
                       "gh_eval_profile: layer strides (%lld, %lld) are smaller than one layer's "
                       "data (%lld inputs, %lld mask bytes)", (long long) ffn_in_stride,
                       (long long) mask_stride, (long long) (nt * d), (long long) (nt * ff));
    }
    gh_status st = gh_ctx_enter(c, "gh_eval_profile");
    if (st) return st;
    c->prof_x = ffn_in;
    c->prof_x_stride = ffn_in_stride;
    c->prof_mask = mask;
    c->prof_mask_stride = mask_stride;
    st = eval_tokens(c, tokens, n_tokens, 0);
    c->prof_x = NULL;
    c->prof_mask = NULL;
    c->prof_t0 = 0;
    gh_ctx_leave(c);
    return st;
}
