/* Placing a model on a device under a VRAM budget (the runtime half of the offline
 * placement in python/powerinfer_cpp/sparse/placement.py: same priority, same greedy rule), the
 * neuron split of the FFN weights, and the device matmul the forward pass calls. */
#include "model/placement.h"
#include "model/model.h"
#include "ffn/moe.h"
#include "core/tap.h"
#include "types/types.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_MARGIN ((int64_t) 256 << 20) /* left free when the budget is "all" */
#define DEFAULT_GROUP 64
#define MIN_LAYER_SHARE 0.05 /* placement.py's default: a layer gets none or >= 5% */

static size_t wbytes(const gh_weight * w) { return (size_t) w->rows * w->row_bytes; }

static void note(gh_hybrid * hy, const char * fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(gh_hybrid * hy, const char * fmt, ...) {
    char * s = hy->info.note;
    const size_t used = strlen(s), cap = sizeof hy->info.note;
    if (used + 2 >= cap) return;
    if (used) { s[used] = ' '; s[used + 1] = 0; }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s + strlen(s), cap - strlen(s), fmt, ap);
    va_end(ap);
}

static gh_status dev_alloc(gh_hybrid * hy, size_t bytes, void ** out) {
    if (hy->n_bufs == hy->cap_bufs) {
        const int cap = hy->cap_bufs ? 2 * hy->cap_bufs : 64;
        void ** nb = realloc(hy->bufs, (size_t) cap * sizeof *nb);
        if (!nb) return gh_fail(GH_ERR_OOM, "out of memory");
        hy->bufs = nb;
        hy->cap_bufs = cap;
    }
    gh_status st = hy->b->ops->alloc(hy->b, bytes, out);
    if (st) return st;
    hy->bufs[hy->n_bufs++] = *out;
    hy->info.used_bytes += (int64_t) bytes;
    return GH_OK;
}

/* A whole weight to the device. */
static gh_status put(gh_hybrid * hy, const gh_weight * w, gh_dweight * dw) {
    dw->type = w->type;
    dw->rows = w->rows;
    dw->cols = w->cols;
    dw->row_bytes = w->row_bytes;
    gh_status st = dev_alloc(hy, wbytes(w), &dw->data);
    if (st) return st;
    return hy->b->ops->upload(hy->b, dw->data, w->data, wbytes(w));
}

/* The rows ids[0..n) of w, compacted, to the device (staged through tmp, >= n rows). */
static gh_status put_rows(gh_hybrid * hy, const gh_weight * w, const int32_t * ids, int64_t n,
                          uint8_t * tmp, gh_dweight * dw) {
    for (int64_t k = 0; k < n; k++) {
        memcpy(tmp + (size_t) k * w->row_bytes,
               (const uint8_t *) w->data + (size_t) ids[k] * w->row_bytes, w->row_bytes);
    }
    dw->type = w->type;
    dw->rows = n;
    dw->cols = w->cols;
    dw->row_bytes = w->row_bytes;
    gh_status st = dev_alloc(hy, (size_t) n * w->row_bytes, &dw->data);
    if (st) return st;
    return hy->b->ops->upload(hy->b, dw->data, tmp, (size_t) n * w->row_bytes);
}

/* (an ungated FFN's up has no rows: row_bytes 0) plus the biases' floats */
static int64_t neuron_bytes(const gh_layer * L) {
    return (int64_t) (L->gate.row_bytes + L->up.row_bytes + L->down_t.row_bytes) +
           4 * (!!L->gate_b + !!L->up_b);
}

/* A bias compacted to the hot neurons ids[0..n), on the device (NULL when b is). */
static gh_status put_bias(gh_hybrid * hy, const float * b, const int32_t * ids, int64_t n,
                          uint8_t * tmp, float ** out) {
    *out = NULL;
    if (!b) return GH_OK;
    float * t = (float *) tmp;
    for (int64_t k = 0; k < n; k++) t[k] = b[ids[k]];
    void * d;
    gh_status st = dev_alloc(hy, (size_t) n * sizeof(float), &d);
    if (st) return st;
    *out = d;
    return hy->b->ops->upload(hy->b, d, tmp, (size_t) n * sizeof(float));
}

/* ------------------------------------------------------------ device types -- */

/* The file's name of the tensor holding w's bytes (a fused tensor's for its views), or
 * NULL for a weight the loader made itself (a transposed copy). */
static const char * tensor_name(const gh_model * m, const gh_weight * w) {
    const uintptr_t p = (uintptr_t) w->data;
    for (uint64_t i = 0; m->gguf && i < m->gguf->n_tensors; i++) {
        const gh_gguf_tensor * t = &m->gguf->tensors[i];
        const uintptr_t a = (uintptr_t) t->data;
        if (p >= a && p - a < t->nbytes) return t->name;
    }
    return NULL;
}

static gh_status check_weight_type(const gh_model * m, const gh_hybrid * hy, int il,
                                   const char * role, const gh_weight * w) {
    if (hy->b->ops->reads_type(hy->b, w->type)) return GH_OK;
    char what[160];
    const char * name = tensor_name(m, w);
    if (name) snprintf(what, sizeof what, "tensor '%s'", name);
    else if (il >= 0) snprintf(what, sizeof what, "layer %d's %s", il, role);
    else snprintf(what, sizeof what, "the %s", role);
    return gh_backend_check_type(hy->b, hy->info.device, what, w->type,
                                 "load the model with device 'cpu', or convert it to a type the "
                                 "device reads (convert --outtype)");
}

/* Every weight the placement may give the device is of a type the device reads: a file
 * with one that is not is refused here, by tensor and type, before anything is uploaded
 * (whatever the budget: the weights a budget takes must not decide whether a file loads),
 * rather than at the first op. */
static gh_status check_types(const gh_model * m, const gh_hybrid * hy) {
    gh_status st = GH_OK;
    for (int il = 0; il < m->hp.n_layer && !st; il++) {
        const gh_layer * L = &m->layers[il];
        if ((st = check_weight_type(m, hy, il, "wq", &L->wq)) ||
            (st = check_weight_type(m, hy, il, "wk", &L->wk)) ||
            (st = check_weight_type(m, hy, il, "wv", &L->wv)) ||
            (st = check_weight_type(m, hy, il, "wo", &L->wo))) break;
        if (L->has_pred && ((st = check_weight_type(m, hy, il, "predictor fc1", &L->fc1)) ||
                            (st = check_weight_type(m, hy, il, "predictor fc2", &L->fc2)))) {
            break;
        }
        if (m->hp.n_expert && L->moe.router.rows) { /* (a leading dense layer has none) */
            const gh_moe_layer * M = &L->moe;
            if ((st = check_weight_type(m, hy, il, "router", &M->router)) ||
                (st = check_weight_type(m, hy, il, "experts' gate", &M->gate_exps)) ||
                (st = check_weight_type(m, hy, il, "experts' up", &M->up_exps)) ||
                (!M->has_down_t && (st = check_weight_type(m, hy, il, "experts' down", &M->down_exps))) ||
                (M->has_down_t && (st = check_weight_type(m, hy, il, "experts' down_t", &M->down_exps_t)))) {
                break;
            }
            if (M->gate_shexp.rows &&
                ((st = check_weight_type(m, hy, il, "shared expert's gate", &M->gate_shexp)) ||
                 (st = check_weight_type(m, hy, il, "shared expert's up", &M->up_shexp)) ||
                 (st = check_weight_type(m, hy, il, "shared expert's down", &M->down_shexp)))) {
                break;
            }
            continue;
        }
        /* the hot neurons' rows (only layers with down_t get any) */
        if (!L->has_down_t) continue;
        if ((st = check_weight_type(m, hy, il, "ffn gate", &L->gate)) ||
            (m->hp.gated && (st = check_weight_type(m, hy, il, "ffn up", &L->up))) ||
            (st = check_weight_type(m, hy, il, "ffn down_t", &L->down_t))) {
            break;
        }
    }
    if (!st) st = check_weight_type(m, hy, -1, "output head", &m->output);
    return st;
}

/* ------------------------------------------------------- greedy placement -- */

typedef struct {
    int32_t * order;  /* neurons by falling frequency (stable) */
    double *  gval;   /* frequency mass of each group */
    int64_t   n_groups, min_groups, k;  /* k: groups taken */
} layer_groups;

static const float * freq_of(const gh_model * m, int il) {
    char name[64];
    snprintf(name, sizeof name, "blk.%d.ffn_freq", il);
    const gh_gguf_tensor * t = gh_gguf_find_tensor(m->gguf, name);
    return t ? (const float *) t->data : NULL; /* validated at load: f32 [n_ff] in [0, 1] */
}

typedef struct { float f; int32_t id; } neuron_freq;

/* Falling frequency; ties by id, as numpy's stable argsort of -freq. */
static int by_freq(const void * a, const void * b) {
    const neuron_freq * x = a, * y = b;
    if (x->f != y->f) return x->f > y->f ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* hot[il] (ascending ids, n_hot[il]) for `left` bytes: repeatedly take the step with the
 * best frequency per byte that fits (a layer's next group, or its first block of
 * min_groups groups). Layers without ffn_down_t or frequencies get none. */
static gh_status greedy(const gh_model * m, int64_t left, int32_t ** hot, int64_t * n_hot) {
    const int nl = m->hp.n_layer;
    const int64_t ff = m->hp.n_ff;
    layer_groups * lg = calloc((size_t) nl, sizeof *lg);
    if (!lg) return gh_fail(GH_ERR_OOM, "out of memory");
    gh_status st = GH_OK;
    int64_t gs = DEFAULT_GROUP;
    const int64_t ki = gh_gguf_find_key(m->gguf, "powerinfer.gpu.group_size");
    int64_t v;
    if (ki >= 0 && gh_gguf_kv_int(m->gguf, ki, &v) == GH_OK && v >= 1 && v <= ff) gs = v;
    for (int il = 0; il < nl && !st; il++) {
        const float * f = freq_of(m, il);
        if (!f || !m->layers[il].has_down_t) continue;
        lg[il].order = malloc((size_t) ff * sizeof(int32_t));
        lg[il].n_groups = (ff + gs - 1) / gs;
        lg[il].gval = calloc((size_t) lg[il].n_groups, sizeof(double));
        if (!lg[il].order || !lg[il].gval) { st = gh_fail(GH_ERR_OOM, "out of memory"); break; }
        neuron_freq * nf = malloc((size_t) ff * sizeof *nf);
        if (!nf) { st = gh_fail(GH_ERR_OOM, "out of memory"); break; }
        for (int64_t i = 0; i < ff; i++) {
            memcpy(&nf[i].f, f + i, 4); /* the file's data need not be 4-aligned */
            nf[i].id = (int32_t) i;
        }
        qsort(nf, (size_t) ff, sizeof *nf, by_freq);
        for (int64_t i = 0; i < ff; i++) {
            lg[il].order[i] = nf[i].id;
            lg[il].gval[i / gs] += nf[i].f;
        }
        free(nf);
        int64_t mg = (int64_t) ceil(MIN_LAYER_SHARE * (double) ff / (double) gs);
        lg[il].min_groups = GH_MIN(lg[il].n_groups, GH_MAX(1, mg));
    }
    while (!st) {
        int best = -1;
        double best_d = -1.0;
        int64_t best_n = 0, best_b = 0;
        for (int il = 0; il < nl; il++) {
            layer_groups * g = &lg[il];
            if (!g->order || g->k >= g->n_groups) continue;
            const int64_t n = g->k > 0 ? 1 : g->min_groups;
            const int64_t last = GH_MIN(g->k + n, g->n_groups);
            const int64_t neurons = GH_MIN(last * gs, ff) - g->k * gs;
            const int64_t b = neurons * neuron_bytes(&m->layers[il]);
            if (b > left) continue;
            double val = 0.0;
            for (int64_t j = g->k; j < last; j++) val += g->gval[j];
            const double dens = b > 0 ? val / (double) b : INFINITY;
            if (dens > best_d) { best_d = dens; best = il; best_n = last - g->k; best_b = b; }
        }
        if (best < 0) break;
        lg[best].k += best_n;
        left -= best_b;
    }
    for (int il = 0; il < nl && !st; il++) {
        const int64_t n = lg[il].order ? GH_MIN(lg[il].k * gs, ff) : 0;
        n_hot[il] = n;
        if (!n) continue;
        hot[il] = malloc((size_t) n * sizeof(int32_t));
        if (!hot[il]) { st = gh_fail(GH_ERR_OOM, "out of memory"); break; }
        /* the first n of the frequency order, ascending: a bitmap pass keeps it O(n_ff) */
        uint8_t * mark = calloc((size_t) ff, 1);
        if (!mark) { st = gh_fail(GH_ERR_OOM, "out of memory"); break; }
        for (int64_t i = 0; i < n; i++) mark[lg[il].order[i]] = 1;
        int64_t k = 0;
        for (int64_t i = 0; i < ff; i++) if (mark[i]) hot[il][k++] = (int32_t) i;
        free(mark);
    }
    for (int il = 0; il < nl; il++) { free(lg[il].order); free(lg[il].gval); }
    free(lg);
    return st;
}

/* ---------------------------------------------------------------- experts -- */

/* One expert's bytes on the device (gate, up and down; the views are expert 0's). */
static int64_t expert_bytes(const gh_moe_layer * M) {
    return (int64_t) (wbytes(&M->gate_exps) + wbytes(&M->up_exps) + wbytes(&M->down_exps));
}

/* Expert e of layer il to the device: one allocation, gate | up | down. */
static gh_status put_expert(gh_model * m, gh_hybrid * hy, int il, int32_t e) {
    const gh_moe_layer * M = &m->layers[il].moe;
    gh_dlayer * D = &hy->layers[il];
    if (!D->exps) {
        D->exps = calloc((size_t) m->hp.n_expert, sizeof *D->exps);
        if (!D->exps) return gh_fail(GH_ERR_OOM, "out of memory");
    }
    void * base;
    gh_status st = dev_alloc(hy, (size_t) expert_bytes(M), &base);
    if (st) return st;
    st = gh_expert_upload(hy->b, M, e, base, &D->exps[e]);
    if (!st) {
        hy->info.n_experts_device++;
        hy->info.expert_bytes += expert_bytes(M);
    }
    return st;
}

gh_status gh_expert_upload(gh_backend * b, const gh_moe_layer * M, int32_t e, void * base,
                           gh_dexpert * out) {
    const gh_weight * ws[3] = { &M->gate_exps, &M->up_exps, &M->down_exps };
    gh_dweight * ds[3] = { &out->gate, &out->up, &out->down };
    size_t off = 0;
    for (int i = 0; i < 3; i++) {
        const gh_weight w = gh_expert(ws[i], e);
        ds[i]->type = w.type;
        ds[i]->rows = w.rows;
        ds[i]->cols = w.cols;
        ds[i]->row_bytes = w.row_bytes;
        ds[i]->data = (uint8_t *) base + off;
        gh_status st = b->ops->upload(b, ds[i]->data, w.data, wbytes(&w));
        if (st) return st;
        off += wbytes(&w);
    }
    return GH_OK;
}

typedef struct { float f; int32_t il, e; } expert_freq;

/* Falling frequency; ties by layer, then expert id (placement.py's order). */
static int by_expert_freq(const void * a, const void * b) {
    const expert_freq * x = a, * y = b;
    if (x->f != y->f) return x->f > y->f ? -1 : 1;
    if (x->il != y->il) return x->il < y->il ? -1 : 1;
    return (x->e > y->e) - (x->e < y->e);
}

static gh_status upload_split(gh_model * m, gh_hybrid * hy, const gh_layer * L, int64_t ff,
                              const int32_t * ids, int64_t n, gh_dsplit * D);

/* Sparse experts (ffn_down_exps_t, docs/FORMAT.md "Hot neurons of experts"): the device
 * takes the hot neurons of experts that the file's record (blk.N.ffn_exp_hot_count,
 * blk.N.ffn_exp_hot, validated at load) names, each expert's as one neuron split, which the
 * FFN executor runs per selected expert as it runs a dense layer's (a whole expert: all its
 * neurons). The record is used when it fits what is left, else the experts stay the CPU's;
 * the first n_cpu_moe layers get none. The expert cache holds whole experts as llama.cpp
 * stores them, which the sparse form does not have: none is made. */
static gh_status place_expert_neurons(gh_model * m, gh_hybrid * hy, const gh_model_params * p,
                                      int64_t left) {
    const gh_hparams * hp = &m->hp;
    const int nl = hp->n_layer, ne = hp->n_expert;
    const int64_t ff = hp->n_ff_exp, d = hp->n_embd;
    gh_device_info * in = &hy->info;
    in->n_neurons = (int64_t) (nl - hp->n_dense_lead) * ne * ff;
    if (p->expert_cache > 0) {
        note(hy, "No expert cache: it holds whole experts in llama.cpp's layout, not the sparse form.");
    }
    const int first = GH_MIN(p->n_cpu_moe, nl);
    bool has_rec = false;
    int64_t need = 0, n_hot = 0;
    for (int il = 0; il < nl; il++) {
        const gh_moe_layer * M = &m->layers[il].moe;
        if (!M->hot_off) continue;
        has_rec = true;
        if (il < first) continue;
        for (int32_t e = 0; e < ne; e++) {
            gh_layer V;
            gh_expert_view(M, e, ff, d, &V);
            const int64_t n = M->hot_off[e + 1] - M->hot_off[e];
            need += n * neuron_bytes(&V);
            n_hot += n;
        }
    }
    if (!has_rec) {
        note(hy, "Experts in the sparse form (ffn_down_exps_t) without a hot-neuron record (blk.N.ffn_exp_hot: "
             "`python -m powerinfer_cpp.place --profile`): they run on the CPU.");
        return GH_OK;
    }
    if (n_hot == 0) {
        note(hy, "The file's record of the experts' hot neurons (sparse form, ffn_down_exps_t) puts "
             "none on the device%s.", first > 0 ? " past the first n_cpu_moe layers" : "");
        return GH_OK;
    }
    if (need > left) {
        note(hy, "The file's hot neurons of the experts (sparse form, ffn_down_exps_t) need %.1f MiB "
             "but %.1f MiB are left: the experts run on the CPU.", need / 1048576.0, left / 1048576.0);
        return GH_OK;
    }
    for (int il = first; il < nl; il++) {
        const gh_moe_layer * M = &m->layers[il].moe;
        if (!M->hot_off) continue;
        gh_dlayer * D = &hy->layers[il];
        D->exp_hot = calloc((size_t) ne, sizeof *D->exp_hot);
        if (!D->exp_hot) return gh_fail(GH_ERR_OOM, "out of memory");
        for (int32_t e = 0; e < ne; e++) {
            const int64_t n = M->hot_off[e + 1] - M->hot_off[e];
            if (n == 0) continue;
            gh_layer V;
            gh_expert_view(M, e, ff, d, &V);
            const gh_status st = upload_split(m, hy, &V, ff, M->hot_ids + M->hot_off[e], n,
                                              &D->exp_hot[e]);
            if (st) return st;
            in->n_hot_experts++;
        }
    }
    in->index_source = 1;
    return GH_OK;
}

/* The expert cache, then whole experts in what is left: the file's placement
 * (blk.N.ffn_exp_gpu, validated at load) when it places some and they fit, else the most frequent first
 * (blk.N.ffn_exp_freq), else in layer order; the first n_cpu_moe layers get none. */
static gh_status place_experts(gh_model * m, gh_hybrid * hy, const gh_model_params * p, int64_t left) {
    const gh_hparams * hp = &m->hp;
    const int nl = hp->n_layer, ne = hp->n_expert;
    gh_device_info * in = &hy->info;
    if (m->layers[hp->n_dense_lead].moe.has_down_t) { /* (the first layer with experts) */
        return place_expert_neurons(m, hy, p, left);
    }
    int64_t eb_max = 0;
    for (int il = 0; il < nl; il++) eb_max = GH_MAX(eb_max, expert_bytes(&m->layers[il].moe));
    if (p->expert_cache > 0) {
        int64_t slots = GH_MAX((int64_t) 1, p->expert_cache / eb_max);
        if (slots * eb_max > left) {
            note(hy, "The expert cache of %lld experts (%.1f MiB) does not fit the %.1f MiB left: "
                 "%lld experts.", (long long) slots, slots * eb_max / 1048576.0, left / 1048576.0,
                 (long long) (left / eb_max));
            slots = GH_MAX((int64_t) 0, left / eb_max);
        }
        slots = GH_MIN(slots, (int64_t) nl * ne);
        hy->cache_slots = (int32_t) slots;
        hy->slot_bytes = (size_t) eb_max;
        in->expert_cache_slots = (int32_t) slots;
        in->expert_cache_bytes = slots * eb_max;
        left -= slots * eb_max;
    }
    const int first = GH_MIN(p->n_cpu_moe, nl);
    gh_status st = GH_OK;

    /* the file's placement, if it fits */
    int64_t file_bytes = 0, file_n = 0;
    bool has_file = false, has_freq = false;
    for (int il = 0; il < nl; il++) {
        const gh_moe_layer * M = &m->layers[il].moe;
        has_freq |= M->freq != NULL;
        if (!M->on_gpu) continue;
        has_file = true;
        if (il < first) continue;
        for (int32_t e = 0; e < ne; e++) {
            if (M->on_gpu[e]) { file_bytes += expert_bytes(M); file_n++; }
        }
    }
    if (has_file && file_n > 0 && file_bytes <= left) {
        for (int il = first; il < nl && !st; il++) {
            const gh_moe_layer * M = &m->layers[il].moe;
            for (int32_t e = 0; M->on_gpu && e < ne && !st; e++) {
                if (M->on_gpu[e]) st = put_expert(m, hy, il, e);
            }
        }
        in->expert_source = 1;
        return st;
    }
    if (has_file && file_n == 0) {
        note(hy, "The file's expert placement puts none on the device%s: experts placed at load.",
             first > 0 ? " past the first n_cpu_moe layers" : "");
    } else if (has_file) {
        note(hy, "The file's expert placement needs %.1f MiB but %.1f MiB are left: experts "
             "re-placed at load.", file_bytes / 1048576.0, left / 1048576.0);
    }
    int64_t n = 0;
    for (int il = first; il < nl; il++) n += m->layers[il].moe.router.rows ? ne : 0;
    expert_freq * order = malloc((size_t) GH_MAX(n, 1) * sizeof *order);
    if (!order) return gh_fail(GH_ERR_OOM, "out of memory");
    int64_t k = 0;
    for (int il = first; il < nl; il++) {
        const gh_moe_layer * M = &m->layers[il].moe;
        for (int32_t e = 0; M->router.rows && e < ne; e++) {
            order[k].f = M->freq ? M->freq[e] : 0.0f;
            order[k].il = il;
            order[k].e = e;
            k++;
        }
    }
    if (has_freq) qsort(order, (size_t) n, sizeof *order, by_expert_freq);
    else if (n > 0 && left > 0) {
        note(hy, "The file has no expert frequencies (blk.N.ffn_exp_freq; `python -m "
             "powerinfer_cpp.place --profile`): experts placed in layer order.");
    }
    for (int64_t i = 0; i < n && !st; i++) {
        const int64_t b = expert_bytes(&m->layers[order[i].il].moe);
        if (b > left) continue;
        st = put_expert(m, hy, order[i].il, order[i].e);
        left -= b;
    }
    free(order);
    if (!st) in->expert_source = in->n_experts_device ? (has_freq ? 2 : 3) : 0;
    return st;
}

/* ------------------------------------------------------------- placement -- */

/* The neurons ids[0..n) (ascending) of the unit L (a layer's FFN, or an expert viewed as
 * a layer; ff neurons) to the device as the split D: their gate, up and down_t rows and
 * biases compacted, the host's row map and cold list. Counts them in the device info. */
static gh_status upload_split(gh_model * m, gh_hybrid * hy, const gh_layer * L, int64_t ff,
                              const int32_t * ids, int64_t n, gh_dsplit * D) {
    D->bucket = malloc((size_t) GH_MAX(n, 1) * sizeof(int32_t));
    D->row_of = malloc((size_t) ff * sizeof(int32_t));
    D->cold = malloc((size_t) GH_MAX(ff - n, 1) * sizeof(int32_t));
    const size_t rb = GH_MAX(GH_MAX(GH_MAX(L->gate.row_bytes, L->up.row_bytes),
                                    L->down_t.row_bytes), sizeof(float));
    uint8_t * tmp = malloc((size_t) GH_MAX(n, 1) * rb);
    if (!D->bucket || !D->row_of || !D->cold || !tmp) {
        free(tmp);
        return gh_fail(GH_ERR_OOM, "out of memory staging %lld hot neurons", (long long) n);
    }
    memcpy(D->bucket, ids, (size_t) n * sizeof(int32_t));
    for (int64_t i = 0; i < ff; i++) D->row_of[i] = -1;
    for (int64_t k = 0; k < n; k++) D->row_of[ids[k]] = (int32_t) k;
    D->n_cold = 0;
    for (int64_t i = 0; i < ff; i++) if (D->row_of[i] < 0) D->cold[D->n_cold++] = (int32_t) i;
    D->hot.n_hot = n;
    D->hot.gated = m->hp.gated;
    D->hot.act = m->hp.ffn_act;
    D->hot.act_t = m->hp.act_threshold;
    gh_status st;
    if (!(st = put_rows(hy, &L->gate, ids, n, tmp, &D->hot.gate)) &&
        !(st = m->hp.gated ? put_rows(hy, &L->up, ids, n, tmp, &D->hot.up) : GH_OK) &&
        !(st = put_bias(hy, L->gate_b, ids, n, tmp, &D->hot.gate_b)) &&
        !(st = put_bias(hy, L->up_b, ids, n, tmp, &D->hot.up_b))) {
        st = put_rows(hy, &L->down_t, ids, n, tmp, &D->hot.down_t);
    }
    free(tmp);
    if (!st) {
        hy->info.hot_bytes += n * neuron_bytes(L);
        hy->info.n_hot += n;
    }
    return st;
}

static gh_status upload_hot(gh_model * m, gh_hybrid * hy, int il, const int32_t * ids, int64_t n) {
    const gh_status st = upload_split(m, hy, &m->layers[il], m->hp.n_ff, ids, n, &hy->layers[il].ffn);
    if (!st) hy->info.n_hot_layers++;
    return st;
}

static gh_status place(gh_model * m, gh_hybrid * hy, const gh_model_params * p) {
    const gh_hparams * hp = &m->hp;
    const int nl = hp->n_layer;
    gh_device_info * in = &hy->info;
    size_t free_b = 0, total_b = 0;
    gh_status st = hy->b->ops->mem_info(hy->b, &free_b, &total_b);
    if (st) return st;
    const int64_t avail = (int64_t) GH_MIN(free_b, (size_t) INT64_MAX);
    int64_t budget;
    if (p->vram_budget < 0) {
        budget = GH_MAX((int64_t) 0, avail - DEFAULT_MARGIN);
    } else if (p->vram_budget > avail) {
        budget = avail;
        note(hy, "The VRAM budget of %.1f MiB is more than the device's free %.1f MiB: using %.1f MiB.",
             p->vram_budget / 1048576.0, avail / 1048576.0, avail / 1048576.0);
    } else {
        budget = p->vram_budget;
    }
    in->budget = budget;
    int64_t left = budget;

    /* dense parts, strict priority: attention, predictors, head */
    bool stop = false;
    for (int il = 0; il < nl && !stop; il++) {
        const gh_layer * L = &m->layers[il];
        const int64_t b = (int64_t) (wbytes(&L->wq) + wbytes(&L->wk) + wbytes(&L->wv) + wbytes(&L->wo));
        if (b > left) { stop = true; break; }
        gh_dlayer * D = &hy->layers[il];
        if ((st = put(hy, &L->wq, &D->wq)) || (st = put(hy, &L->wk, &D->wk)) ||
            (st = put(hy, &L->wv, &D->wv)) || (st = put(hy, &L->wo, &D->wo))) return st;
        D->att = true;
        left -= b;
        in->dense_bytes += b;
        in->n_attention_layers++;
    }
    for (int il = 0; il < nl && !stop; il++) {
        const gh_layer * L = &m->layers[il];
        if (!L->has_pred) continue;
        const int64_t b = (int64_t) (wbytes(&L->fc1) + wbytes(&L->fc2));
        if (b > left) { stop = true; break; }
        gh_dlayer * D = &hy->layers[il];
        if ((st = put(hy, &L->fc1, &D->fc1)) || (st = put(hy, &L->fc2, &D->fc2))) return st;
        D->pred = true;
        left -= b;
        in->dense_bytes += b;
        in->n_predictor_layers++;
    }
    for (int il = 0; il < nl && !stop && hp->n_expert; il++) {
        const gh_moe_layer * M = &m->layers[il].moe;
        if (!M->router.rows) continue; /* a leading dense layer: its FFN stays on the CPU */
        const int64_t b = (int64_t) wbytes(&M->router);
        if (b > left) { stop = true; break; }
        if ((st = put(hy, &M->router, &hy->layers[il].router))) return st;
        left -= b;
        in->dense_bytes += b;
    }
    if (!stop && (int64_t) wbytes(&m->output) <= left) {
        if ((st = put(hy, &m->output, &hy->output))) return st;
        hy->head = true;
        left -= (int64_t) wbytes(&m->output);
        in->dense_bytes += (int64_t) wbytes(&m->output);
        in->head_on_device = 1;
    } else {
        stop = true;
    }
    /* the shared experts (qwen2moe): every token runs them, so a byte of theirs serves a
     * token as often as the head's and more often than any routed expert's (whose share
     * of the tokens is its frequency, at most 1): they come before the cache and the routed
     * experts. n_cpu_moe does not keep them (llama.cpp's --n-cpu-moe pattern names only
     * ffn_*_exps). Their sigmoid gate (one vector) stays on the host. */
    for (int il = 0; il < nl && !stop && hp->n_expert; il++) {
        const gh_moe_layer * M = &m->layers[il].moe;
        if (!M->gate_shexp.rows) continue;
        const int64_t b = (int64_t) (wbytes(&M->gate_shexp) + wbytes(&M->up_shexp) +
                                     wbytes(&M->down_shexp));
        if (b > left) { stop = true; break; }
        gh_dexpert * S = &hy->layers[il].shexp;
        if ((st = put(hy, &M->gate_shexp, &S->gate)) || (st = put(hy, &M->up_shexp, &S->up)) ||
            (st = put(hy, &M->down_shexp, &S->down))) return st;
        left -= b;
        in->shexp_bytes += b;
        in->n_shexp_device++;
    }

    if (hp->n_expert) return place_experts(m, hy, p, left);

    /* hot neurons: the file's index if it fits, else placed here */
    int64_t file_bytes = 0, file_hot = 0;
    bool has_index = false, has_freq = false;
    for (int il = 0; il < nl; il++) {
        const gh_layer * L = &m->layers[il];
        has_index |= L->gpu_idx != NULL;
        has_freq |= freq_of(m, il) != NULL;
        if (L->n_hot && L->has_down_t) {
            file_bytes += L->n_hot * neuron_bytes(L);
            file_hot += L->n_hot;
        }
    }
    in->file_budget = has_index ? m->index_budget : -1;
    if (has_index && m->index_file[0]) note(hy, "GPU index from %s", m->index_file);

    if (file_hot > 0 && file_bytes <= left && !p->reset_gpu_index) {
        for (int il = 0; il < nl; il++) {
            const gh_layer * L = &m->layers[il];
            if (L->n_hot && L->has_down_t && (st = upload_hot(m, hy, il, L->gpu_bucket, L->n_hot))) {
                return st;
            }
        }
        in->index_source = 1;
        return GH_OK;
    }
    if (left <= 0) {
        if (file_hot > 0) note(hy, "The dense parts took the whole budget: no hot neurons on the device.");
        return GH_OK;
    }
    if (!has_freq) {
        note(hy, "The file has no neuron frequencies (blk.N.ffn_freq; convert with --sparse): "
             "the FFN stays on the CPU.");
        return GH_OK;
    }
    if (p->reset_gpu_index) {
        note(hy, "GPU index reset: hot neurons placed at load (greedy).");
    } else if (file_hot > 0) {
        note(hy, "The file's GPU index needs %.1f MiB but %.1f MiB are left after the dense parts: "
             "hot neurons re-placed at load (greedy; `python -m powerinfer_cpp.place` writes an ILP "
             "solution for this budget).", file_bytes / 1048576.0, left / 1048576.0);
    } else {
        note(hy, "The file's GPU index is empty (solved for %s): hot neurons placed at load (greedy; "
             "`python -m powerinfer_cpp.place` writes an ILP solution).",
             in->file_budget >= 0 ? "a 0-byte budget" : "no GPU");
    }
    int32_t ** hot = calloc((size_t) nl, sizeof *hot);
    int64_t * n_hot = calloc((size_t) nl, sizeof *n_hot);
    if (!hot || !n_hot) { free(hot); free(n_hot); return gh_fail(GH_ERR_OOM, "out of memory"); }
    st = greedy(m, left, hot, n_hot);
    for (int il = 0; il < nl && !st; il++) {
        if (n_hot[il]) st = upload_hot(m, hy, il, hot[il], n_hot[il]);
    }
    for (int il = 0; il < nl; il++) free(hot[il]);
    free(hot);
    free(n_hot);
    if (!st) in->index_source = in->n_hot > 0 ? 2 : 0;
    return st;
}

void gh_hybrid_free(gh_hybrid * hy) {
    if (!hy) return;
    for (int i = 0; i < hy->n_bufs; i++) hy->b->ops->free(hy->b, hy->bufs[i]);
    free(hy->bufs);
    for (int il = 0; hy->layers && il < hy->n_layer; il++) {
        gh_dlayer * D = &hy->layers[il];
        free(D->ffn.bucket);
        free(D->ffn.row_of);
        free(D->ffn.cold);
        for (int32_t e = 0; D->exp_hot && e < hy->n_expert; e++) {
            free(D->exp_hot[e].bucket);
            free(D->exp_hot[e].row_of);
            free(D->exp_hot[e].cold);
        }
        free(D->exp_hot);
        free(D->exps);
    }
    free(hy->layers);
    gh_backend_free(hy->b);
    free(hy);
}

gh_status gh_hybrid_place(gh_model * m, const gh_model_params * p) {
    m->hy = NULL;
    if (!p || !p->device || strcmp(p->device, "cpu") == 0) return GH_OK;
    if (p->n_cpu_moe < 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "n_cpu_moe must be >= 0 layers, got %d", p->n_cpu_moe);
    }
    if (p->expert_cache < 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "expert_cache must be >= 0 bytes, got %lld",
                       (long long) p->expert_cache);
    }
    if (p->vram_budget < -1) {
        return gh_fail(GH_ERR_INVALID_ARG, "vram_budget must be >= 0 bytes (or -1 for the default), "
                       "got %lld", (long long) p->vram_budget);
    }
    gh_hybrid * hy = calloc(1, sizeof *hy);
    if (!hy) return gh_fail(GH_ERR_OOM, "out of memory");
    gh_status st = gh_backend_new(p->device, &hy->b);
    if (st) { free(hy); return st; }
    hy->layers = calloc((size_t) m->hp.n_layer, sizeof *hy->layers);
    hy->n_layer = m->hp.n_layer;
    hy->n_expert = m->hp.n_expert;
    if (!hy->layers) st = gh_fail(GH_ERR_OOM, "out of memory");
    snprintf(hy->info.device, sizeof hy->info.device, "%s", p->device);
    hy->info.n_neurons = m->hp.n_expert ? 0 : (int64_t) m->hp.n_layer * m->hp.n_ff;
    hy->info.n_experts = (int64_t) (m->hp.n_layer - m->hp.n_dense_lead) * m->hp.n_expert;
    m->hy = hy; /* so that gh_model_free releases a partial placement */
    if (!st) st = check_types(m, hy);
    if (!st) st = place(m, hy, p);
    return st;
}

/* What was placed and why (the CPU's answer for a model without a device). */
gh_status gh_model_device_info(const gh_model * m, gh_device_info * out) {
    if (!m || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_device_info: NULL argument");
    if (m->hy) {
        *out = m->hy->info;
        return GH_OK;
    }
    memset(out, 0, sizeof *out);
    snprintf(out->device, sizeof out->device, "cpu");
    out->file_budget = -1;
    out->n_neurons = (int64_t) m->hp.n_layer * m->hp.n_ff;
    return GH_OK;
}

/* ------------------------------------------------------ per-context stream -- */

gh_status gh_hybrid_stream_new(const gh_model * m, gh_stream ** out) {
    const gh_hparams * hp = &m->hp;
    /* an expert's down projection reads n_ff_exp inputs per token, a shared expert's
     * n_ff_shexp */
    const int64_t d = GH_MAX(GH_MAX((int64_t) hp->n_embd, (int64_t) hp->n_ff_exp),
                             (int64_t) hp->n_ff_shexp),
                  dq = (int64_t) hp->n_head * hp->head_dim;
    int64_t h = 1;
    for (int il = 0; il < hp->n_layer; il++) {
        if (m->layers[il].has_pred) h = GH_MAX(h, m->layers[il].fc1.rows);
    }
    gh_stream_params p = {
        .max_in = GH_DEVICE_CHUNK * GH_MAX(d, dq),
        .max_out = GH_MAX(GH_DEVICE_CHUNK * GH_MAX(GH_MAX(d, dq), (int64_t) hp->n_vocab),
                          (int64_t) hp->n_ff),
        .max_rows = GH_MAX(hp->n_ff, hp->n_ff_exp), /* a sparse expert's hot rows too */
        .max_hidden = h,
    };
    return m->hy->b->ops->stream_new(m->hy->b, &p, out);
}

gh_status gh_hybrid_matmul_async(gh_context * c, const gh_dweight * w, const float * x, int64_t n,
                                 float * y) {
    const gh_backend_ops * ops = c->model->hy->b->ops;
    gh_status st = GH_OK;
    for (int64_t t0 = 0; t0 < n && !st; t0 += GH_DEVICE_CHUNK) {
        const int64_t nt = GH_MIN((int64_t) GH_DEVICE_CHUNK, n - t0);
        st = ops->matmul(c->stream, w, x + t0 * w->cols, nt, y + t0 * w->rows);
        const gh_tap_ev ev = { .point = GH_TAP_DEVICE, .il = -1, .up = (double) nt * w->cols * 4,
                               .down = (double) nt * w->rows * 4,
                               .bytes = (double) w->rows * w->row_bytes };
        gh_tap_emit(&c->tap, &ev);
    }
    return st;
}

gh_status gh_hybrid_sync(gh_context * c, gh_status st) {
    const double tw = gh_now();
    double dev = 0.0;
    const gh_status ss = c->model->hy->b->ops->sync(c->stream, &dev);
    const gh_tap_ev ev = { .point = GH_TAP_DEVICE, .il = -1, .seconds = dev, .wait = gh_now() - tw };
    gh_tap_emit(&c->tap, &ev);
    return st ? st : ss;
}

gh_status gh_model_expert_placement(const gh_model * m, int8_t * where, int64_t n) {
    if (!m) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_expert_placement: model is NULL");
    const int64_t need = (int64_t) m->hp.n_layer * m->hp.n_expert;
    if (need == 0) return GH_OK;
    if (!where || n < need) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_model_expert_placement: where holds %lld values, "
                       "the model has %d layers of %d experts (%lld)", (long long) (where ? n : 0),
                       m->hp.n_layer, m->hp.n_expert, (long long) need);
    }
    for (int il = 0; il < m->hp.n_layer; il++) {
        const gh_dexpert * x = m->hy ? m->hy->layers[il].exps : NULL;
        for (int32_t e = 0; e < m->hp.n_expert; e++) {
            where[(int64_t) il * m->hp.n_expert + e] = x && x[e].gate.data ? 1 : 0;
        }
    }
    return GH_OK;
}

gh_status gh_model_expert_hot_counts(const gh_model * m, int32_t * counts, int64_t n) {
    if (!m) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_expert_hot_counts: model is NULL");
    const int64_t need = (int64_t) m->hp.n_layer * m->hp.n_expert;
    if (need == 0) return GH_OK;
    if (!counts || n < need) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_model_expert_hot_counts: counts holds %lld values, "
                       "the model has %d layers of %d experts (%lld)", (long long) (counts ? n : 0),
                       m->hp.n_layer, m->hp.n_expert, (long long) need);
    }
    for (int il = 0; il < m->hp.n_layer; il++) {
        const gh_dsplit * x = m->hy ? m->hy->layers[il].exp_hot : NULL;
        for (int32_t e = 0; e < m->hp.n_expert; e++) {
            counts[(int64_t) il * m->hp.n_expert + e] = x ? (int32_t) x[e].hot.n_hot : 0;
        }
    }
    return GH_OK;
}
