/* Device backends: the one small interface through which the runtime puts weights on a
 * device and runs ops there (allocate, upload, run op, synchronise, report memory).
 *
 * Implementations:
 *   host-device (backend_host.c): "device memory" is host RAM with a capacity, and every
 *       op runs the scalar reference kernels on a worker thread of its own, so placement,
 *       neuron splitting, the two-sided FFN and the merge run for real on any machine;
 *   cuda (cuda/backend_cuda.cu): built when CMake finds nvcc (GH_CUDA).
 * The CPU-only runtime uses no backend at all (gh_model.backend == NULL).
 *
 * Split of work: a backend object belongs to a model (weights are uploaded once and shared
 * by the model's contexts); a stream belongs to a context (its own queue, staging buffers
 * and, for CUDA, its own cudaStream_t), so contexts on different threads never share one.
 *
 * Semantics of the op calls: each enqueues work and returns at once. Host inputs are
 * copied before the call returns, so the caller may reuse them immediately; host outputs
 * are written by the time gh_stream_sync returns and must not be read before. Ops on one
 * stream run in the order they were enqueued. Weight layouts on the device are the host
 * layouts (GGUF rows, rows contiguous), so an upload is a plain byte copy. */
#ifndef GH_BACKEND_H
#define GH_BACKEND_H

#include "core/common.h"

typedef struct gh_backend gh_backend;
typedef struct gh_stream gh_stream;

/* A weight resident on a device: rows x cols of type (a gh_type the runtime reads and the
 * backend's reads_type accepts: cuda/dev_types.cuh lists CUDA's),
 * row_bytes = gh_row_size(type, cols), data = device pointer. */
typedef struct {
    int     type;
    int64_t rows;
    int64_t cols;
    size_t  row_bytes;
    void *  data;
} gh_dweight;

/* The hot part of one layer's FFN on the device: compacted row k (k < n_hot) of gate,
 * up and down_t is neuron bucket[k] of the full matrices (gate/up: n_hot x n_embd,
 * down_t: n_hot x n_embd, neuron k's output vector). An ungated FFN has its up rows as
 * `gate` and no `up` (gated = 0). gate_b / up_b: device f32 [n_hot] biases, compacted
 * like the rows, or NULL. act (gh_act) and act_t (FATReLU's threshold) are the model's.
 * Which rows are active is the FFN strategy's choice (ffn/strategy.h), made before the
 * call: the device is given the list. */
typedef struct {
    int64_t    n_hot;
    gh_dweight gate, up, down_t;
    int32_t    gated;
    int32_t    act;
    float      act_t;
    float *    gate_b, * up_b;
} gh_dffn;

/* Capacities a stream's staging buffers must hold (floats / ids per op call). */
typedef struct {
    int64_t max_in;    /* floats of any op's input x */
    int64_t max_out;   /* floats of any op's output */
    int64_t max_rows;  /* ids of a hot_ffn row list */
    int64_t max_hidden;/* floats of a predictor's hidden layer */
} gh_stream_params;

typedef struct {
    const char * name;  /* "host-device", "cuda" */
    void (*destroy)(gh_backend * b);
    /* Whether the device's ops read weights of this gh_type: the placement refuses a model
     * holding a weight the device would be given of a type it lacks, before any upload
     * (gh_backend_check_type), and the ops refuse such a weight by name. */
    bool (*reads_type)(const gh_backend * b, int type);
    /* Free and total device memory in bytes (host-device: its capacity less what is
     * allocated). */
    gh_status (*mem_info)(gh_backend * b, size_t * free_bytes, size_t * total_bytes);
    /* Device allocation of `bytes` (> 0); GH_ERR_OOM with a message when it does not fit. */
    gh_status (*alloc)(gh_backend * b, size_t bytes, void ** ptr);
    void (*free)(gh_backend * b, void * ptr);
    /* Synchronous host -> device copy (load time). */
    gh_status (*upload)(gh_backend * b, void * dst, const void * src, size_t bytes);

    gh_status (*stream_new)(gh_backend * b, const gh_stream_params * p, gh_stream ** out);
    void (*stream_free)(gh_stream * s);
    /* y[t][r] = w[r] . x[t] for t < n, r < w->rows; x: n x w->cols floats (host), y:
     * n x w->rows floats (host). */
    gh_status (*matmul)(gh_stream * s, const gh_dweight * w, const float * x, int64_t n,
                        float * y);
    /* score[i] = fc2[i] . relu(fc1 . x) for i < fc2->rows (one token). */
    gh_status (*predict)(gh_stream * s, const gh_dweight * fc1, const gh_dweight * fc2,
                         const float * x, float * score);
    /* One token's FFN over the hot rows listed: for k < n_rows, r = rows[k] (a compacted
     * row index < f->n_hot): a_k = act(g_k, up[r] . x + up_b[r]) with g_k = g[k] when g
     * (host, [n_rows], bias included: a strategy that computed the gates to choose the
     * rows hands them over, so no gate row is read twice) is given, else gate[r] . x +
     * gate_b[r] (u = 1 when ungated); y = sum_k a_k down_t[r] (y: f->down_t.cols floats,
     * host, overwritten; n_rows = 0 gives zeros; the down bias is the CPU's, added once
     * after the merge). *n_nonzero (may be NULL; host, written by the sync) = the listed
     * rows with a_k != 0, i.e. whose down row was read. */
    gh_status (*hot_ffn)(gh_stream * s, const gh_dffn * f, const float * x,
                         const int32_t * rows, const float * g, int64_t n_rows, float * y,
                         int64_t * n_nonzero);
    /* Waits for everything enqueued; *device_seconds (may be NULL) = time the device spent
     * on that work (its own clock). Errors of any earlier op surface here. */
    gh_status (*sync)(gh_stream * s, double * device_seconds);
} gh_backend_ops;

struct gh_backend {
    const gh_backend_ops * ops;
};

struct gh_stream {
    gh_backend * backend;
};

/* host-device backend with `capacity` bytes of "device memory", reading the types with
 * reads[type] set (NULL: every type the runtime reads), failing the call fault names
 * ("op:N": the N-th matmul, predict, hot_ffn, sync or upload, counted from its first
 * stream on; NULL or "": none; for rehearsing the runtime's device error paths). */
gh_status gh_backend_host_new(size_t capacity, const bool * reads, const char * fault,
                              gh_backend ** out);
/* host-device as the environment sets it (the registry's constructor; index unused):
 * capacity GH_HOST_DEVICE_MEM bytes, with K/M/G suffixes, default 4 GiB; types
 * GH_HOST_DEVICE_TYPES, comma-separated names, default every type the runtime reads; an
 * injected fault GH_HOST_DEVICE_FAULT, op:N. */
gh_status gh_backend_host_from_env(int index, gh_backend ** out);
/* CUDA backend on device `device` (cuda/backend_cuda.cu; only in a CUDA build, GH_HAVE_CUDA);
 * without a usable GPU GH_ERR_UNSUPPORTED with the driver's reason. */
gh_status gh_backend_cuda_new(int device, gh_backend ** out);
/* By name, from the registry's table (registry.c, the one place that knows the backends):
 * "host-device", or "cuda" (device 0) / "cuda:N". An unknown name is GH_ERR_INVALID_ARG
 * listing the names; a backend this build lacks GH_ERR_UNSUPPORTED saying how to get it. */
gh_status gh_backend_new(const char * name, gh_backend ** out);
void gh_backend_free(gh_backend * b);
/* GH_OK if b reads weights of type; else GH_ERR_UNSUPPORTED, the message naming the
 * device, the type, `what` (the weight: "tensor 'blk.0.attn_q.weight'") and every type the
 * device reads (its reads_type over the type table, in table order), then `hint` (what to
 * do; may be NULL). */
gh_status gh_backend_check_type(const gh_backend * b, const char * device, const char * what,
                                int type, const char * hint);
/* "f32, f16, ... and Q6_K": the types b reads, in the type table's order, into buf. */
const char * gh_backend_types_read(const gh_backend * b, char * buf, size_t cap);

#endif
