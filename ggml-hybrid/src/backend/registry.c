/* The backends by name (gh_backend_new: host-device, cuda), and the public device-op
 * entry points that tests use to check every backend against numpy. The backends know
 * nothing of this file: each includes only the interface (backend.h, backend.c). */
#include "backend/backend.h"
#include "types/types.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <strings.h>

#define HOST_DEVICE_DEFAULT_MEM ((size_t) 4 << 30)

#ifndef GH_HAVE_CUDA
gh_status gh_backend_cuda_new(int device, gh_backend ** out) {
    *out = NULL;
    return gh_fail(GH_ERR_UNSUPPORTED, "this build of powerinfer-cpp has no CUDA backend: "
                   "reinstall on a machine with nvcc (the CUDA toolkit) on PATH, or build with "
                   "-DGH_CUDA=ON; use device 'cpu' or 'host-device' meanwhile");
}
#endif

int32_t gh_have_cuda(void) {
#ifdef GH_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

/* "4G", "512M", "1048576": bytes; false if malformed. */
static bool parse_size(const char * s, size_t * out) {
    errno = 0;
    char * end;
    const double v = strtod(s, &end);
    if (end == s || errno || !(v >= 0)) return false;
    double mul = 1;
    switch (toupper((unsigned char) *end)) {
    case 'K': mul = 1024.0; end++; break;
    case 'M': mul = 1048576.0; end++; break;
    case 'G': mul = 1073741824.0; end++; break;
    case 'T': mul = 1099511627776.0; end++; break;
    default: break;
    }
    if (toupper((unsigned char) *end) == 'I') end++;
    if (toupper((unsigned char) *end) == 'B') end++;
    if (*end || v * mul >= 9.2e18) return false;
    *out = (size_t) (v * mul);
    return true;
}

/* GH_HOST_DEVICE_TYPES="f32,q8_0,...": the types the simulated device reads (a device
 * whose type list lacks some of the runtime's, for rehearsing the refusals on any
 * machine); unset or empty: every type the runtime reads. Names as the type table spells
 * them, any case. */
static gh_status host_device_types(bool reads[GH_TYPE_COUNT], bool * restricted) {
    *restricted = false;
    const char * env = getenv("GH_HOST_DEVICE_TYPES");
    if (!env || !*env) return GH_OK;
    *restricted = true;
    memset(reads, 0, GH_TYPE_COUNT * sizeof *reads);
    const char * p = env;
    while (*p) {
        const size_t len = strcspn(p, ",");
        size_t a = 0, b = len;
        while (a < b && isspace((unsigned char) p[a])) a++;
        while (b > a && isspace((unsigned char) p[b - 1])) b--;
        int found = -1;
        for (int t = 0; t < GH_TYPE_COUNT && found < 0 && b > a; t++) {
            const gh_type_traits * tr = gh_type_traits_get(t);
            if (tr && strlen(tr->name) == b - a && strncasecmp(tr->name, p + a, b - a) == 0) {
                found = t;
            }
        }
        if (found < 0) {
            return gh_fail(GH_ERR_INVALID_ARG, "GH_HOST_DEVICE_TYPES='%s': '%.*s' is not a type "
                           "this runtime reads (it reads %s)", env, (int) (b - a), p + a,
                           gh_types_read_list());
        }
        reads[found] = true;
        p += len;
        if (*p == ',') p++;
    }
    return GH_OK;
}

gh_status gh_backend_new(const char * name, gh_backend ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_backend_new: out is NULL");
    *out = NULL;
    if (!name) return gh_fail(GH_ERR_INVALID_ARG, "device name is NULL");
    if (strcmp(name, "host-device") == 0) {
        size_t cap = HOST_DEVICE_DEFAULT_MEM;
        const char * env = getenv("GH_HOST_DEVICE_MEM");
        if (env && *env && !parse_size(env, &cap)) {
            return gh_fail(GH_ERR_INVALID_ARG, "GH_HOST_DEVICE_MEM='%s' is not a size (e.g. "
                           "4G, 512M, 1048576)", env);
        }
        bool reads[GH_TYPE_COUNT], restricted;
        gh_status st = host_device_types(reads, &restricted);
        if (st) return st;
        return gh_backend_host_new(cap, restricted ? reads : NULL, getenv("GH_HOST_DEVICE_FAULT"),
                                   out);
    }
    if (strncmp(name, "cuda", 4) == 0) {
        int dev = 0;
        if (name[4] == ':') {
            char * end;
            errno = 0;
            const long v = strtol(name + 5, &end, 10);
            if (end == name + 5 || *end || errno || v < 0 || v > 1024) {
                return gh_fail(GH_ERR_INVALID_ARG, "device '%s': expected cuda:N with N a GPU "
                               "number", name);
            }
            dev = (int) v;
        } else if (name[4]) {
            return gh_fail(GH_ERR_INVALID_ARG, "unknown device '%s' (use cpu, host-device, cuda "
                           "or cuda:N)", name);
        }
        return gh_backend_cuda_new(dev, out);
    }
    return gh_fail(GH_ERR_INVALID_ARG, "unknown device '%s' (use cpu, host-device, cuda or "
                   "cuda:N)", name);
}

gh_status gh_device_check(const char * device) {
    if (device && strcmp(device, "cpu") == 0) return GH_OK;
    gh_backend * b;
    gh_status st = gh_backend_new(device, &b);
    if (st) return st == GH_ERR_INVALID_ARG ? st : GH_ERR_UNSUPPORTED;
    gh_backend_free(b);
    return GH_OK;
}

/* ------------------------------------------------ one-shot ops (tests, tools) -- */

/* A backend, its stream and the device copies of up to five buffers. */
typedef struct {
    gh_backend * b;
    gh_stream * s;
    void * buf[5];
} oneshot;

static void oneshot_end(oneshot * o) {
    if (o->s) o->b->ops->stream_free(o->s);
    for (int i = 0; i < 5; i++) if (o->buf[i]) o->b->ops->free(o->b, o->buf[i]);
    gh_backend_free(o->b);
}

static gh_status check_weight(const char * fn, int type, const void * w, int64_t rows,
                              int64_t cols) {
    if (!gh_type_traits_get(type) || type == GH_TYPE_I32) {
        return gh_fail(GH_ERR_UNSUPPORTED, "%s: unsupported weight type %d", fn, type);
    }
    if (!w || rows < 1 || cols < 1) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: need a weight of at least 1 x 1 (got %lld x %lld)",
                       fn, (long long) rows, (long long) cols);
    }
    if (gh_row_size(type, cols) == 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: %lld columns is not a multiple of %s's block "
                       "size %lld", fn, (long long) cols, gh_type_traits_get(type)->name,
                       (long long) gh_type_traits_get(type)->block_size);
    }
    return GH_OK;
}

/* Uploads w (rows x cols of type) into o->buf[i] and describes it in *dw. */
static gh_status put_weight(oneshot * o, int i, int type, const void * w, int64_t rows,
                            int64_t cols, gh_dweight * dw) {
    dw->type = type;
    dw->rows = rows;
    dw->cols = cols;
    dw->row_bytes = gh_row_size(type, cols);
    const size_t bytes = dw->row_bytes * (size_t) rows;
    gh_status st = o->b->ops->alloc(o->b, bytes, &o->buf[i]);
    if (st) return st;
    dw->data = o->buf[i];
    return o->b->ops->upload(o->b, o->buf[i], w, bytes);
}

static gh_status oneshot_begin(oneshot * o, const char * device, const gh_stream_params * p) {
    memset(o, 0, sizeof *o);
    if (device && strcmp(device, "cpu") == 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "device ops need a device (host-device or cuda), "
                       "not 'cpu'");
    }
    gh_status st = gh_backend_new(device, &o->b);
    if (st) return st;
    return o->b->ops->stream_new(o->b, p, &o->s);
}

gh_status gh_device_op_matmul(const char * device, int type, const void * w, int64_t rows,
                              int64_t cols, const float * x, int64_t n, float * y) {
    const char * fn = "gh_device_op_matmul";
    gh_status st = check_weight(fn, type, w, rows, cols);
    if (st) return st;
    if (!x || !y || n < 1) return gh_fail(GH_ERR_INVALID_ARG, "%s: need x, y and n >= 1", fn);
    gh_stream_params p = { .max_in = n * cols, .max_out = n * rows, .max_rows = 1, .max_hidden = 1 };
    oneshot o;
    gh_dweight dw;
    if (!(st = oneshot_begin(&o, device, &p)) && !(st = put_weight(&o, 0, type, w, rows, cols, &dw)) &&
        !(st = o.b->ops->matmul(o.s, &dw, x, n, y))) {
        st = o.b->ops->sync(o.s, NULL);
    }
    oneshot_end(&o);
    return st;
}

gh_status gh_device_op_predict(const char * device, int fc1_type, const void * fc1,
                               int fc2_type, const void * fc2, int64_t n_embd, int64_t h,
                               int64_t n_ff, const float * x, float * score) {
    const char * fn = "gh_device_op_predict";
    gh_status st;
    if ((st = check_weight(fn, fc1_type, fc1, h, n_embd)) || (st = check_weight(fn, fc2_type, fc2, n_ff, h))) {
        return st;
    }
    if (!x || !score) return gh_fail(GH_ERR_INVALID_ARG, "%s: x and score are required", fn);
    gh_stream_params p = { .max_in = n_embd, .max_out = n_ff, .max_rows = 1, .max_hidden = h };
    oneshot o;
    gh_dweight d1, d2;
    if (!(st = oneshot_begin(&o, device, &p)) && !(st = put_weight(&o, 0, fc1_type, fc1, h, n_embd, &d1)) &&
        !(st = put_weight(&o, 1, fc2_type, fc2, n_ff, h, &d2)) &&
        !(st = o.b->ops->predict(o.s, &d1, &d2, x, score))) {
        st = o.b->ops->sync(o.s, NULL);
    }
    oneshot_end(&o);
    return st;
}

/* A bias of n floats into o->buf[i] (NULL: none). */
static gh_status put_bias(oneshot * o, int i, const float * b, int64_t n, float ** out) {
    *out = NULL;
    if (!b) return GH_OK;
    gh_status st = o->b->ops->alloc(o->b, (size_t) n * sizeof(float), &o->buf[i]);
    if (st) return st;
    *out = o->buf[i];
    return o->b->ops->upload(o->b, o->buf[i], b, (size_t) n * sizeof(float));
}

gh_status gh_device_op_hot_ffn(const char * device, int type, const void * gate,
                               const void * up, const float * gate_b, const float * up_b,
                               int down_type, const void * down_t, int64_t n_hot,
                               int64_t n_embd, int act, float act_t, const float * x,
                               const int32_t * rows, int64_t n_rows, float * y) {
    const char * fn = "gh_device_op_hot_ffn";
    gh_status st;
    if ((st = check_weight(fn, type, gate, n_hot, n_embd)) ||
        (up && (st = check_weight(fn, type, up, n_hot, n_embd))) ||
        (st = check_weight(fn, down_type, down_t, n_hot, n_embd))) {
        return st;
    }
    if (act < GH_ACT_SILU || act > GH_ACT_FATRELU || (act == GH_ACT_DRELU && !up)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: unknown activation %d%s", fn, act,
                       act == GH_ACT_DRELU ? " without up (dReLU needs it)" : "");
    }
    if (!isfinite(act_t)) return gh_fail(GH_ERR_INVALID_ARG, "%s: act_t must be finite", fn);
    if (!x || !y || n_rows < 0 || (n_rows > 0 && !rows)) {
        return gh_fail(GH_ERR_INVALID_ARG, "%s: need x, y and a row list of n_rows >= 0", fn);
    }
    for (int64_t k = 0; k < n_rows; k++) {
        if (rows[k] < 0 || rows[k] >= n_hot) {
            return gh_fail(GH_ERR_RANGE, "%s: rows[%lld] = %d is outside [0, %lld)", fn,
                           (long long) k, rows[k], (long long) n_hot);
        }
    }
    gh_stream_params p = { .max_in = n_embd, .max_out = n_embd, .max_rows = GH_MAX(n_rows, 1),
                           .max_hidden = 1 };
    oneshot o;
    gh_dffn f = { .n_hot = n_hot, .gated = up != NULL, .act = act, .act_t = act_t };
    if (!(st = oneshot_begin(&o, device, &p)) && !(st = put_weight(&o, 0, type, gate, n_hot, n_embd, &f.gate)) &&
        !(st = up ? put_weight(&o, 1, type, up, n_hot, n_embd, &f.up) : GH_OK) &&
        !(st = put_weight(&o, 2, down_type, down_t, n_hot, n_embd, &f.down_t)) &&
        !(st = put_bias(&o, 3, gate_b, n_hot, &f.gate_b)) &&
        !(st = put_bias(&o, 4, up_b, n_hot, &f.up_b)) &&
        !(st = o.b->ops->hot_ffn(o.s, &f, x, rows, NULL, n_rows, y, NULL))) {
        st = o.b->ops->sync(o.s, NULL);
    }
    oneshot_end(&o);
    return st;
}
