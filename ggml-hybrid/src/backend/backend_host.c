/* The host-device backend: a simulated device whose memory is host RAM with a fixed
 * capacity and whose ops run the reference math (rows dequantized to f32, dot products in
 * f32, the CPU runtime's gh_glu for the activation) on a worker thread of each stream. It makes the hybrid path real on any machine:
 * the placement, the neuron split, the CPU and device halves of a layer running at the
 * same time, and the merge. Tests compare it with the CPU-only runtime. */
#include "backend/backend.h"
#include "cpu/ops.h"
#include "types/types.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* The calls a fault can be injected into (GH_HOST_DEVICE_FAULT). */
enum { F_MATMUL, F_PREDICT, F_HOT_FFN, F_SYNC, F_UPLOAD, F_COUNT, F_NONE = -1 };
static const char * const fault_names[F_COUNT] = { "matmul", "predict", "hot_ffn", "sync", "upload" };

typedef struct {
    gh_backend base;
    pthread_mutex_t mu;
    size_t capacity, used;
    bool reads[GH_TYPE_COUNT]; /* the types its ops read (GH_HOST_DEVICE_TYPES) */
    /* the injected fault: call fault_at of fault_op fails; calls counted since the first
     * stream (live) */
    int fault_op;
    long long fault_at;
    atomic_llong calls;
    atomic_bool live;
} host_backend;

/* The failure a device would report from this call, when it is the injected fault's:
 * the fault's op, counted over every stream of the backend from its first stream on (a
 * model's first context: a load's uploads are not counted, so "upload" is an expert
 * cache refill). */
static gh_status fault(host_backend * h, int op) {
    if (op != h->fault_op || !atomic_load(&h->live)) return GH_OK;
    const long long k = atomic_fetch_add(&h->calls, 1) + 1;
    if (k != h->fault_at) return GH_OK;
    return gh_fail(GH_ERR_UNSUPPORTED, "host-device: %s failed: injected fault "
                   "(GH_HOST_DEVICE_FAULT=%s:%lld)", fault_names[op], fault_names[op], k);
}

/* GH_HOST_DEVICE_FAULT="op:N" (spec; NULL or empty: none) into h. */
static gh_status parse_fault(const char * spec, host_backend * h) {
    h->fault_op = F_NONE;
    if (!spec || !*spec) return GH_OK;
    const char * colon = strchr(spec, ':');
    for (int i = 0; i < F_COUNT && colon; i++) {
        const size_t len = strlen(fault_names[i]);
        if ((size_t) (colon - spec) == len && strncmp(spec, fault_names[i], len) == 0) h->fault_op = i;
    }
    char * end = NULL;
    errno = 0;
    const long long at = colon ? strtoll(colon + 1, &end, 10) : 0;
    if (h->fault_op == F_NONE || end == colon + 1 || *end || errno || at < 1) {
        h->fault_op = F_NONE;
        return gh_fail(GH_ERR_INVALID_ARG, "GH_HOST_DEVICE_FAULT='%s': expected OP:N, OP one of "
                       "matmul, predict, hot_ffn, sync, upload and N >= 1 (the call that fails)",
                       spec);
    }
    h->fault_at = at;
    return GH_OK;
}

static bool hb_reads_type(const gh_backend * b, int type) {
    const host_backend * h = (const host_backend *) b;
    return type >= 0 && type < GH_TYPE_COUNT && h->reads[type];
}

/* Every allocation carries its size in front, so free() can return it to the capacity. */
#define HDR 64

static void hb_destroy(gh_backend * b) {
    host_backend * h = (host_backend *) b;
    pthread_mutex_destroy(&h->mu);
    free(h);
}

static gh_status hb_mem_info(gh_backend * b, size_t * free_bytes, size_t * total) {
    host_backend * h = (host_backend *) b;
    pthread_mutex_lock(&h->mu);
    if (free_bytes) *free_bytes = h->capacity - h->used;
    if (total) *total = h->capacity;
    pthread_mutex_unlock(&h->mu);
    return GH_OK;
}

static gh_status hb_alloc(gh_backend * b, size_t bytes, void ** ptr) {
    host_backend * h = (host_backend *) b;
    *ptr = NULL;
    pthread_mutex_lock(&h->mu);
    const size_t avail = h->capacity - h->used;
    const bool fits = bytes <= avail && bytes <= SIZE_MAX - HDR;
    if (fits) h->used += bytes;
    pthread_mutex_unlock(&h->mu);
    if (!fits) {
        return gh_fail(GH_ERR_OOM, "host-device: out of memory allocating %.1f MiB (%.1f MiB free "
                       "of %.1f MiB); lower the VRAM budget or raise GH_HOST_DEVICE_MEM",
                       bytes / 1048576.0, avail / 1048576.0, h->capacity / 1048576.0);
    }
    uint8_t * p = gh_aligned_alloc(bytes + HDR);
    if (!p) {
        pthread_mutex_lock(&h->mu);
        h->used -= bytes;
        pthread_mutex_unlock(&h->mu);
        return gh_fail(GH_ERR_OOM, "host-device: the host is out of memory (%.1f MiB)",
                       bytes / 1048576.0);
    }
    memcpy(p, &bytes, sizeof bytes);
    *ptr = p + HDR;
    return GH_OK;
}

static void hb_free(gh_backend * b, void * ptr) {
    if (!ptr) return;
    host_backend * h = (host_backend *) b;
    uint8_t * p = (uint8_t *) ptr - HDR;
    size_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    pthread_mutex_lock(&h->mu);
    h->used -= bytes;
    pthread_mutex_unlock(&h->mu);
    gh_aligned_free(p);
}

static gh_status hb_upload(gh_backend * b, void * dst, const void * src, size_t bytes) {
    const gh_status f = fault((host_backend *) b, F_UPLOAD);
    if (f) return f;
    memcpy(dst, src, bytes);
    return GH_OK;
}

/* ------------------------------------------------------------ reference math -- */

/* w[r] . x with the row dequantized into tmp (cols floats). */
static float ref_dot(const gh_dweight * w, int64_t r, const float * x, float * tmp) {
    gh_type_traits_get(w->type)->to_float((const uint8_t *) w->data + (size_t) r * w->row_bytes,
                                          tmp, w->cols);
    float s = 0.0f;
    for (int64_t c = 0; c < w->cols; c++) s += tmp[c] * x[c];
    return s;
}

/* -------------------------------------------------------------------- stream -- */

enum { OP_MATMUL, OP_PREDICT, OP_HOT_FFN };

typedef struct {
    int op;
    const gh_dweight * w, * w2;  /* matmul: w; predict: fc1, fc2 */
    const gh_dffn * f;
    int64_t n;        /* matmul tokens; hot_ffn rows */
    float * y;        /* host output */
    int64_t * n_nonzero; /* hot_ffn: host output, may be NULL */
    bool given_g;     /* hot_ffn: the listed rows' gates were given (staged in g[slot]) */
    int slot;         /* staging slot of x (and rows, gates) */
} host_op;

#define QUEUE 8 /* ops in flight per stream; enqueueing a ninth waits for the first */

typedef struct {
    gh_stream base;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    host_op q[QUEUE];
    int head, count;     /* ring of pending ops; the running one stays counted until done */
    bool quit;
    gh_stream_params p;
    float * x[QUEUE];     /* input staging ("device" copies of x) */
    int32_t * rows[QUEUE];
    float * g[QUEUE];     /* hot_ffn's given gates */
    int slot_next;
    float * tmp;          /* one dequantized row */
    float * hid;          /* predictor hidden / hot gates, then activations */
    float * up;           /* hot ups */
    double busy;          /* seconds of work since the last sync */
} host_stream;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

static void run_op(host_stream * s, const host_op * o) {
    const float * x = s->x[o->slot];
    switch (o->op) {
    case OP_MATMUL:
        for (int64_t t = 0; t < o->n; t++) {
            for (int64_t r = 0; r < o->w->rows; r++) {
                o->y[t * o->w->rows + r] = ref_dot(o->w, r, x + t * o->w->cols, s->tmp);
            }
        }
        break;
    case OP_PREDICT:
        for (int64_t r = 0; r < o->w->rows; r++) {
            const float v = ref_dot(o->w, r, x, s->tmp);
            s->hid[r] = v > 0.0f ? v : 0.0f;
        }
        for (int64_t r = 0; r < o->w2->rows; r++) o->y[r] = ref_dot(o->w2, r, s->hid, s->tmp);
        break;
    case OP_HOT_FFN: {
        const gh_dffn * f = o->f;
        const int32_t * rows = s->rows[o->slot];
        const int64_t d = f->down_t.cols;
        for (int64_t k = 0; k < o->n; k++) {
            s->hid[k] = o->given_g ? s->g[o->slot][k]
                      : ref_dot(&f->gate, rows[k], x, s->tmp) + (f->gate_b ? f->gate_b[rows[k]] : 0.0f);
            s->up[k] = 0.0f;
            if (f->gated)
                s->up[k] = ref_dot(&f->up, rows[k], x, s->tmp) + (f->up_b ? f->up_b[rows[k]] : 0.0f);
        }
        /* the CPU runtime's activation */
        gh_glu(f->act, f->act_t, s->hid, f->gated ? s->up : NULL, s->hid, o->n);
        for (int64_t c = 0; c < d; c++) o->y[c] = 0.0f;
        int64_t nz = 0;
        for (int64_t k = 0; k < o->n; k++) {
            if (s->hid[k] == 0.0f) continue;
            gh_type_traits_get(f->down_t.type)->to_float(
                (const uint8_t *) f->down_t.data + (size_t) rows[k] * f->down_t.row_bytes, s->tmp, d);
            for (int64_t c = 0; c < d; c++) o->y[c] += s->hid[k] * s->tmp[c];
            nz++;
        }
        if (o->n_nonzero) *o->n_nonzero = nz;
        break;
    }
    }
}

static void * worker(void * arg) {
    host_stream * s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->count == 0 && !s->quit) pthread_cond_wait(&s->cv_work, &s->mu);
        if (s->count == 0 && s->quit) break;
        const host_op o = s->q[s->head];
        pthread_mutex_unlock(&s->mu);
        const double t0 = now_s();
        run_op(s, &o);
        const double dt = now_s() - t0;
        pthread_mutex_lock(&s->mu);
        s->busy += dt;
        s->head = (s->head + 1) % QUEUE;
        s->count--;
        pthread_cond_broadcast(&s->cv_done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void hs_free(gh_stream * st) {
    if (!st) return;
    host_stream * s = (host_stream *) st;
    if (s->th) {
        pthread_mutex_lock(&s->mu);
        s->quit = true;
        pthread_cond_signal(&s->cv_work);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->th, NULL);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv_work);
        pthread_cond_destroy(&s->cv_done);
    }
    for (int i = 0; i < QUEUE; i++) {
        gh_aligned_free(s->x[i]);
        gh_aligned_free(s->rows[i]);
        gh_aligned_free(s->g[i]);
    }
    gh_aligned_free(s->tmp);
    gh_aligned_free(s->hid);
    gh_aligned_free(s->up);
    free(s);
}

static gh_status hs_new(gh_backend * b, const gh_stream_params * p, gh_stream ** out) {
    *out = NULL;
    host_stream * s = calloc(1, sizeof *s);
    if (!s) return gh_fail(GH_ERR_OOM, "host-device: out of memory for a stream");
    s->base.backend = b;
    s->p = *p;
    const int64_t nin = GH_MAX(p->max_in, 1), nrow = GH_MAX(p->max_rows, 1);
    bool ok = true;
    for (int i = 0; i < QUEUE && ok; i++) {
        s->x[i] = gh_aligned_alloc((size_t) nin * sizeof(float));
        s->rows[i] = gh_aligned_alloc((size_t) nrow * sizeof(int32_t));
        s->g[i] = gh_aligned_alloc((size_t) nrow * sizeof(float));
        ok = s->x[i] && s->rows[i] && s->g[i];
    }
    /* a dequantized row is at most max(max_in, max_hidden, max_out) long */
    const int64_t wide = GH_MAX(GH_MAX(nin, p->max_hidden), GH_MAX(p->max_out, 1));
    s->tmp = ok ? gh_aligned_alloc((size_t) wide * sizeof(float)) : NULL;
    s->hid = ok ? gh_aligned_alloc((size_t) GH_MAX(GH_MAX(p->max_hidden, nrow), 1) * sizeof(float)) : NULL;
    s->up = ok ? gh_aligned_alloc((size_t) nrow * sizeof(float)) : NULL;
    if (!s->tmp || !s->hid || !s->up) {
        hs_free(&s->base);
        return gh_fail(GH_ERR_OOM, "host-device: out of memory for a stream's buffers");
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    if (pthread_create(&s->th, NULL, worker, s) != 0) {
        s->th = 0;
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv_work);
        pthread_cond_destroy(&s->cv_done);
        hs_free(&s->base);
        return gh_fail(GH_ERR_OOM, "host-device: cannot start the device thread");
    }
    *out = &s->base;
    atomic_store(&((host_backend *) b)->live, true);
    return GH_OK;
}

/* Copies the inputs into a free staging slot and queues the op. */
static gh_status enqueue(host_stream * s, host_op * o, const float * x, int64_t nx,
                         const int32_t * rows, const float * g, int64_t nrows) {
    if (nx > s->p.max_in || nrows > s->p.max_rows) {
        return gh_fail(GH_ERR_INVALID_ARG, "host-device: op input of %lld floats / %lld rows "
                       "exceeds the stream's capacity (%lld / %lld)", (long long) nx,
                       (long long) nrows, (long long) s->p.max_in, (long long) s->p.max_rows);
    }
    pthread_mutex_lock(&s->mu);
    while (s->count == QUEUE) pthread_cond_wait(&s->cv_done, &s->mu);
    /* a slot is free once the op that used it QUEUE enqueues ago has finished, which
     * count < QUEUE guarantees */
    o->slot = s->slot_next;
    s->slot_next = (s->slot_next + 1) % QUEUE;
    pthread_mutex_unlock(&s->mu);
    memcpy(s->x[o->slot], x, (size_t) nx * sizeof(float));
    if (nrows) memcpy(s->rows[o->slot], rows, (size_t) nrows * sizeof(int32_t));
    if (nrows && g) memcpy(s->g[o->slot], g, (size_t) nrows * sizeof(float));
    pthread_mutex_lock(&s->mu);
    s->q[(s->head + s->count) % QUEUE] = *o;
    s->count++;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    return GH_OK;
}

/* A weight of a type the device does not read (GH_HOST_DEVICE_TYPES) is refused by name. */
static gh_status hs_check_type(const host_stream * s, const char * what, int type) {
    return gh_backend_check_type(s->base.backend, "host-device", what, type, NULL);
}

static gh_status hs_fault(const host_stream * s, int op) {
    return fault((host_backend *) s->base.backend, op);
}

static gh_status hs_matmul(gh_stream * st, const gh_dweight * w, const float * x, int64_t n,
                           float * y) {
    host_stream * s = (host_stream *) st;
    gh_status ts = hs_check_type(s, "matmul's weight", w->type);
    if (ts) return ts;
    if (n < 1 || n * w->rows > s->p.max_out) {
        return gh_fail(GH_ERR_INVALID_ARG, "host-device matmul: %lld x %lld outputs exceed the "
                       "stream's %lld", (long long) n, (long long) w->rows, (long long) s->p.max_out);
    }
    if ((ts = hs_fault(s, F_MATMUL))) return ts;
    host_op o = { .op = OP_MATMUL, .w = w, .n = n, .y = y };
    return enqueue(s, &o, x, n * w->cols, NULL, NULL, 0);
}

static gh_status hs_predict(gh_stream * st, const gh_dweight * fc1, const gh_dweight * fc2,
                            const float * x, float * score) {
    host_stream * s = (host_stream *) st;
    gh_status ts;
    if ((ts = hs_check_type(s, "predict's fc1", fc1->type)) ||
        (ts = hs_check_type(s, "predict's fc2", fc2->type))) {
        return ts;
    }
    if (fc1->rows > s->p.max_hidden || fc2->rows > s->p.max_out || fc2->cols != fc1->rows) {
        return gh_fail(GH_ERR_INVALID_ARG, "host-device predict: bad shapes (h %lld, n_ff %lld)",
                       (long long) fc1->rows, (long long) fc2->rows);
    }
    if ((ts = hs_fault(s, F_PREDICT))) return ts;
    host_op o = { .op = OP_PREDICT, .w = fc1, .w2 = fc2, .y = score };
    return enqueue(s, &o, x, fc1->cols, NULL, NULL, 0);
}

static gh_status hs_hot_ffn(gh_stream * st, const gh_dffn * f, const float * x,
                            const int32_t * rows, const float * g, int64_t n_rows, float * y,
                            int64_t * n_nonzero) {
    host_stream * s = (host_stream *) st;
    gh_status ts;
    if ((ts = hs_check_type(s, "hot_ffn's gate", f->gate.type)) ||
        (f->gated && (ts = hs_check_type(s, "hot_ffn's up", f->up.type))) ||
        (ts = hs_check_type(s, "hot_ffn's down_t", f->down_t.type))) {
        return ts;
    }
    for (int64_t k = 0; k < n_rows; k++) {
        if (rows[k] < 0 || rows[k] >= f->n_hot) {
            return gh_fail(GH_ERR_INVALID_ARG, "host-device hot_ffn: row %d outside [0, %lld)",
                           rows[k], (long long) f->n_hot);
        }
    }
    if ((ts = hs_fault(s, F_HOT_FFN))) return ts;
    host_op o = { .op = OP_HOT_FFN, .f = f, .n = n_rows, .y = y, .n_nonzero = n_nonzero,
                  .given_g = g != NULL };
    return enqueue(s, &o, x, f->gate.cols, rows, g, n_rows);
}

static gh_status hs_sync(gh_stream * st, double * device_seconds) {
    host_stream * s = (host_stream *) st;
    pthread_mutex_lock(&s->mu);
    while (s->count > 0) pthread_cond_wait(&s->cv_done, &s->mu);
    if (device_seconds) *device_seconds = s->busy;
    s->busy = 0.0;
    pthread_mutex_unlock(&s->mu);
    /* an injected fault surfaces after the work is done, as a device's error at its sync */
    return hs_fault(s, F_SYNC);
}

static const gh_backend_ops host_ops = {
    .name = "host-device",
    .destroy = hb_destroy,
    .reads_type = hb_reads_type,
    .mem_info = hb_mem_info,
    .alloc = hb_alloc,
    .free = hb_free,
    .upload = hb_upload,
    .stream_new = hs_new,
    .stream_free = hs_free,
    .matmul = hs_matmul,
    .predict = hs_predict,
    .hot_ffn = hs_hot_ffn,
    .sync = hs_sync,
};

gh_status gh_backend_host_new(size_t capacity, const bool * reads, const char * fault_spec,
                              gh_backend ** out) {
    *out = NULL;
    host_backend * h = calloc(1, sizeof *h);
    if (!h) return gh_fail(GH_ERR_OOM, "out of memory");
    const gh_status st = parse_fault(fault_spec, h);
    if (st) {
        free(h);
        return st;
    }
    h->base.ops = &host_ops;
    h->capacity = capacity;
    /* the reference math reads what the runtime's type table dequantizes */
    for (int t = 0; t < GH_TYPE_COUNT; t++) h->reads[t] = gh_type_traits_get(t) && (!reads || reads[t]);
    pthread_mutex_init(&h->mu, NULL);
    *out = &h->base;
    return GH_OK;
}

/* ---------------------------------------------- its settings, from the environment -- */

#define HOST_DEVICE_DEFAULT_MEM ((size_t) 4 << 30)

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

gh_status gh_backend_host_from_env(int index, gh_backend ** out) {
    (void) index; /* one simulated device */
    *out = NULL;
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
