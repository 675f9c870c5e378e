/* THE backends by name (BACKENDS: gh_backend_new, and gh_device_kind_get for the Python
 * side's device lists and its GPU choice), and the public device-op entry points that
 * tests use to check every backend against numpy. The backends know nothing of this file:
 * each includes only the interface (backend.h, backend.c). */
#include "backend/backend.h"
#include "types/types.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

/* The table of backends: a device is asked for by a row's name (or name:N where the row is
 * indexed), in this order. A row whose backend this build lacks has no constructor and
 * says how to get a build with it. */
typedef struct {
    const char * name;
    bool indexed;      /* "name:N" is device N; "name" device 0 */
    bool accelerator;  /* real hardware: what n_gpu_layers / -ngl ask for; false: simulated */
    gh_status (*make)(int index, gh_backend ** out);  /* NULL: not in this build */
    const char * missing;  /* what this build lacks and how to get it (when make is NULL) */
} backend_row;

#ifdef GH_HAVE_CUDA
#define CUDA_NEW gh_backend_cuda_new
#else
#define CUDA_NEW NULL
#endif

static const backend_row BACKENDS[] = {
    { "host-device", false, false, gh_backend_host_from_env, NULL },
    { "cuda", true, true, CUDA_NEW, "this build of powerinfer-cpp has no CUDA backend: reinstall "
      "on a machine with nvcc (the CUDA toolkit) on PATH, or build with -DGH_CUDA=ON" },
};
#define N_BACKENDS ((int32_t) (sizeof BACKENDS / sizeof BACKENDS[0]))

/* The cuda row's: whether this build made it a constructor. */
int32_t gh_have_cuda(void) {
    for (int32_t i = 0; i < N_BACKENDS; i++) {
        if (strcmp(BACKENDS[i].name, "cuda") == 0) return BACKENDS[i].make != NULL;
    }
    return 0;
}

int32_t gh_device_kind_count(void) {
    return N_BACKENDS;
}

gh_status gh_device_kind_get(int32_t i, gh_device_kind * out) {
    if (!out || i < 0 || i >= N_BACKENDS) {
        return gh_fail(GH_ERR_INVALID_ARG, "gh_device_kind_get: kind %d of %d%s", i, N_BACKENDS,
                       out ? "" : " (out is NULL)");
    }
    const backend_row * r = &BACKENDS[i];
    *out = (gh_device_kind) { .name = r->name, .indexed = r->indexed,
                              .accelerator = r->accelerator, .built = r->make != NULL };
    return GH_OK;
}

/* "cpu, host-device, cuda or cuda:N": every name a device is asked for by. */
static const char * device_names(char * buf, size_t cap) {
    size_t len = (size_t) snprintf(buf, cap, "cpu");
    for (int32_t i = 0; i < N_BACKENDS && len < cap; i++) {
        const bool last = i + 1 == N_BACKENDS;
        len += (size_t) snprintf(buf + len, cap - len, "%s%s",
                                 last && !BACKENDS[i].indexed ? " or " : ", ", BACKENDS[i].name);
        if (BACKENDS[i].indexed && len < cap) {
            len += (size_t) snprintf(buf + len, cap - len, "%s%s:N", last ? " or " : ", ",
                                     BACKENDS[i].name);
        }
    }
    return buf;
}

/* A backend fills every op of the interface: one that left an op out is refused when made,
 * naming it, rather than crashing at the op's first call. */
static gh_status check_ops(const char * name, gh_backend ** b) {
    const gh_backend_ops * o = (*b)->ops;
    const struct { const char * op; bool set; } ops[] = {
        { "destroy", o->destroy }, { "reads_type", o->reads_type }, { "mem_info", o->mem_info },
        { "alloc", o->alloc }, { "free", o->free }, { "upload", o->upload },
        { "stream_new", o->stream_new }, { "stream_free", o->stream_free },
        { "matmul", o->matmul }, { "predict", o->predict }, { "hot_ffn", o->hot_ffn },
        { "sync", o->sync },
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        if (ops[i].set) continue;
        if (o->destroy) o->destroy(*b);
        *b = NULL;
        return gh_fail(GH_ERR_UNSUPPORTED, "backend '%s' does not fill the op '%s' of the backend "
                       "interface (backend/backend.h)", name, ops[i].op);
    }
    return GH_OK;
}

gh_status gh_backend_new(const char * name, gh_backend ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_backend_new: out is NULL");
    *out = NULL;
    if (!name) return gh_fail(GH_ERR_INVALID_ARG, "device name is NULL");
    for (int32_t i = 0; i < N_BACKENDS; i++) {
        const backend_row * r = &BACKENDS[i];
        const size_t len = strlen(r->name);
        if (strncmp(name, r->name, len) != 0 || (name[len] && !(r->indexed && name[len] == ':'))) {
            continue;
        }
        int index = 0;
        if (name[len] == ':') {
            char * end;
            errno = 0;
            const long v = strtol(name + len + 1, &end, 10);
            if (end == name + len + 1 || *end || errno || v < 0 || v > 1024) {
                return gh_fail(GH_ERR_INVALID_ARG, "device '%s': expected %s:N with N a device "
                               "number", name, r->name);
            }
            index = (int) v;
        }
        if (!r->make) {
            return gh_fail(GH_ERR_UNSUPPORTED, "%s; use device 'cpu' or 'host-device' meanwhile",
                           r->missing);
        }
        gh_status st = r->make(index, out);
        if (!st) st = check_ops(r->name, out);
        return st;
    }
    char names[256];
    return gh_fail(GH_ERR_INVALID_ARG, "unknown device '%s' (use %s)", name,
                   device_names(names, sizeof names));
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
