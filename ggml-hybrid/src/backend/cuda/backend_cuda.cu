/* The CUDA backend (see backend.h for the interface and its semantics).
 *
 * Memory: weights live in plain cudaMalloc allocations (no managed memory); uploads are
 * synchronous byte copies (device layouts are the GGUF host layouts). A stream owns a
 * cudaStream_t, device buffers for one op's input x, output, row list, predictor hidden
 * layer and hot activations, pinned host staging for inputs and outputs, and two events
 * that time the work enqueued between two syncs.
 *
 * An op call copies its host inputs into pinned staging (so the caller may reuse them at
 * once), enqueues the H2D copies, the kernels and a D2H copy of the result into pinned
 * output staging, and records (caller's pointer, staging offset, count) in a pending list.
 * gh_stream_sync waits for the stream and then copies each pending result to the caller.
 * Staging is used linearly between syncs; when an op does not fit in what is left, the
 * stream is flushed first (waited for, pending results delivered), so any number of ops
 * may be enqueued between two syncs.
 *
 * Kernels (weights of every type in dev_types.cuh's list, each kernel instantiated per
 * type from that list; activations and results f32; the weights are dequantized in
 * registers, the activations are never quantized; the row math is in rows.cuh and the
 * types' reads in dev_types.cuh, which tests/gpu/cuda_emu.cu also runs on the CPU):
 *   row dot products (matmul, the predictor's two layers, hot gate/up): one warp per
 *     weight row; the warp walks the row in units of 8 elements per lane (one 16/32-byte
 *     vector load for float types when the row is 16-byte aligned, the quarter of a
 *     quantized block otherwise), so consecutive lanes read consecutive bytes; each lane
 *     multiplies its weights with up to MM_TOK tokens' activations and the warp's partial
 *     sums are reduced with shuffles. Float rows that are not 8-element/16-byte aligned use
 *     an element-per-lane path.
 *   hot down (y = sum_k a_k down_t[rows[k]]): threads over output columns; the row list
 *     is cut into S contiguous slices (S fixed by n_rows and the width), each block sums
 *     its slice in list order into a partial vector (skipping a_k == 0), and a last
 *     kernel adds the S partials in order: deterministic, no atomics. */

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "backend/backend.h"
#include "types/types.h"
#include "types/iq4.h"
}

#include "backend/cuda/rows.cuh"

namespace {

using namespace gh_cuda;

/* ------------------------------------------------------------------ kernels -- */

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* y[t][r] = w[r] . x[t] (relu'd if relu) for r < rows, t < n. Block: MM_WARPS rows;
 * grid.y: tiles of NT tokens (NT = 1 for one token: fewer registers, more warps). */
template <int T, bool VEC, int NT>
__global__ void __launch_bounds__(MM_WARPS * WARP)
k_matmul(const uint8_t * __restrict__ w, size_t row_bytes, int64_t rows, int64_t cols,
         const float * __restrict__ x, int64_t n, float * __restrict__ y, int relu) {
    const int lane = threadIdx.x % WARP;
    const int64_t r = (int64_t) blockIdx.x * MM_WARPS + threadIdx.x / WARP;
    if (r >= rows) return; /* the whole warp */
    const int64_t t0 = (int64_t) blockIdx.y * NT;
    const int nt = (int) (n - t0 < NT ? n - t0 : NT);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    row_dot<T, VEC, NT>(w + (size_t) r * row_bytes, cols, x + t0 * cols, cols, nt, lane, acc);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            float v = warp_sum(acc[t]);
            if (relu) v = v > 0.0f ? v : 0.0f;
            if (lane == 0) y[(t0 + t) * rows + r] = v;
        }
    }
}

/* a[k] = act(g_k, up[r] . x + up_b[r]) for k < n_rows, r = rows[k], where g_k =
 * g_in[k] when given (the host computed the gates, bias included) else gate[r] . x +
 * gate_b[r] (up NULL: an ungated FFN, u = 1; a NULL bias adds nothing); one warp per k.
 * g_in may be a itself: every lane reads g_in[k] before lane 0 writes a[k] (__syncwarp). */
template <int T, bool VEC>
__global__ void __launch_bounds__(MM_WARPS * WARP)
k_hot_glu(const uint8_t * __restrict__ gate, const uint8_t * __restrict__ up, size_t row_bytes,
          int64_t cols, const float * __restrict__ x, const int32_t * __restrict__ rows,
          int64_t n_rows, const float * __restrict__ gate_b, const float * __restrict__ up_b,
          int act, float act_t, const float * g_in, float * a) {
    const int lane = threadIdx.x % WARP;
    const int64_t k = (int64_t) blockIdx.x * MM_WARPS + threadIdx.x / WARP;
    if (k >= n_rows) return;
    const int32_t r = __ldg(rows + k);
    const size_t off = (size_t) r * row_bytes;
    float g[1] = {0.0f}, u[1] = {0.0f};
    float gs;
    if (g_in) {
        gs = g_in[k];
        __syncwarp();
    } else {
        row_dot<T, VEC, 1>(gate + off, cols, x, cols, 1, lane, g);
        gs = warp_sum(g[0]); /* the butterfly leaves the same sum in every lane */
        if (gate_b) gs += __ldg(gate_b + r);
    }
    if (up) row_dot<T, VEC, 1>(up + off, cols, x, cols, 1, lane, u);
    float us = up ? warp_sum(u[0]) : 1.0f;
    if (up && up_b) us += __ldg(up_b + r);
    if (lane == 0) a[k] = act_glu(act, act_t, gs, us);
}

/* *count = the number of a[k] != 0, k < n (one block: a fixed order, no atomics). */
__global__ void k_count_nonzero(const float * __restrict__ a, int64_t n, float * __restrict__ count) {
    __shared__ int part[256];
    int c = 0;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) c += a[k] != 0.0f;
    part[threadIdx.x] = c;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int) threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) *count = (float) part[0]; /* exact below 2^24 rows */
}

/* part[s][c] = sum over k in slice s (in order) of a[k] * down[rows[k]][c], a[k] == 0
 * skipped. Slice s = [s * chunk, min((s + 1) * chunk, n_rows)); grid.y = slices. */
template <int T>
__global__ void __launch_bounds__(DOWN_THREADS)
k_hot_down(const uint8_t * __restrict__ down, size_t row_bytes, int64_t cols,
           const int32_t * __restrict__ rows, const float * __restrict__ a, int64_t n_rows,
           int64_t chunk, float * __restrict__ part) {
    __shared__ int32_t s_rows[DOWN_TILE];
    __shared__ float s_a[DOWN_TILE];
    const int64_t c = (int64_t) blockIdx.x * DOWN_THREADS + threadIdx.x;
    const int64_t k0 = (int64_t) blockIdx.y * chunk;
    const int64_t k1 = k0 + chunk < n_rows ? k0 + chunk : n_rows;
    float s = 0.0f;
    for (int64_t tb = k0; tb < k1; tb += DOWN_TILE) {
        const int nk = (int) (k1 - tb < DOWN_TILE ? k1 - tb : DOWN_TILE);
        __syncthreads();
        for (int i = threadIdx.x; i < nk; i += DOWN_THREADS) {
            s_rows[i] = rows[tb + i];
            s_a[i] = a[tb + i];
        }
        __syncthreads();
        if (c < cols) {
#pragma unroll 4
            for (int i = 0; i < nk; i++) {
                const float ak = s_a[i]; /* the same for the whole block: no divergence */
                if (ak == 0.0f) continue;
                s = fmaf(ak, dev_type<T>::elem(down + (size_t) s_rows[i] * row_bytes, c), s);
            }
        }
    }
    if (c < cols) part[blockIdx.y * cols + c] = s;
}

/* y[c] = sum_s part[s][c], s in order (n_slices may be 0: zeros). */
__global__ void k_sum_slices(const float * __restrict__ part, int64_t n_slices, int64_t cols,
                             float * __restrict__ y) {
    const int64_t c = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int64_t i = 0; i < n_slices; i++) s += part[i * cols + c];
    y[c] = s;
}

/* ---------------------------------------------------------------- host side -- */

struct cuda_backend {
    gh_backend base; /* first: gh_backend * <-> cuda_backend * */
    int device;
    char name[256];
};

struct pending_copy {
    float * dst;   /* caller's host buffer */
    size_t off;    /* floats into the output staging */
    size_t n;      /* floats */
    int64_t * count; /* instead of dst: one float staged, handed over as an integer */
};

struct cuda_stream {
    gh_stream base; /* first */
    cuda_backend * be;
    gh_stream_params p;
    cudaStream_t st;
    bool have_stream, have_events;
    cudaEvent_t ev_begin, ev_end;
    bool timing; /* ev_begin recorded since the last sync */
    float * d_x;      /* p.max_in */
    float * d_y;      /* p.max_out */
    float * d_h;      /* p.max_hidden */
    float * d_a;      /* p.max_rows */
    int32_t * d_rows; /* p.max_rows */
    float * d_part;   /* hot-down slice partials, grown on demand */
    size_t part_cap;  /* floats */
    uint8_t * h_in;   /* pinned input staging */
    size_t in_cap, in_used;
    float * h_out;    /* pinned output staging */
    size_t out_cap, out_used;
    pending_copy * pend;
    size_t n_pend, cap_pend;
};

gh_status cuda_fail(int device, cudaError_t e, const char * what) {
    const gh_status st = e == cudaErrorMemoryAllocation ? GH_ERR_OOM : GH_ERR_UNSUPPORTED;
    (void) cudaGetLastError(); /* clear a non-sticky error so later calls start clean */
    return gh_fail(st, "CUDA device %d: %s failed: %s (%s)", device, what,
                   cudaGetErrorString(e), cudaGetErrorName(e));
}

#define CU_CHECK(dev, call, what)                                   \
    do {                                                            \
        const cudaError_t e_ = (call);                              \
        if (e_ != cudaSuccess) return cuda_fail((dev), e_, (what)); \
    } while (0)

double mib(size_t bytes) { return (double) bytes / 1048576.0; }

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* --- backend ops --- */

void cb_destroy(gh_backend * b) {
    free(reinterpret_cast<cuda_backend *>(b));
}

gh_status cb_mem_info(gh_backend * b, size_t * free_bytes, size_t * total_bytes) {
    cuda_backend * be = reinterpret_cast<cuda_backend *>(b);
    CU_CHECK(be->device, cudaSetDevice(be->device), "cudaSetDevice");
    size_t f = 0, t = 0;
    CU_CHECK(be->device, cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return GH_OK;
}

/* cudaMalloc; OOM with the sizes and what to do about it. */
gh_status dev_malloc(int device, size_t bytes, void ** ptr) {
    *ptr = NULL;
    const cudaError_t e = cudaMalloc(ptr, bytes);
    if (e == cudaSuccess) return GH_OK;
    *ptr = NULL;
    if (e != cudaErrorMemoryAllocation) return cuda_fail(device, e, "cudaMalloc");
    (void) cudaGetLastError();
    size_t f = 0, t = 0;
    if (cudaMemGetInfo(&f, &t) != cudaSuccess) {
        (void) cudaGetLastError();
        f = t = 0;
    }
    return gh_fail(GH_ERR_OOM, "CUDA device %d: out of memory allocating %.1f MiB (free %.1f "
                   "MiB of %.1f MiB); lower --vram-budget (or free the GPU of other work)",
                   device, mib(bytes), mib(f), mib(t));
}

gh_status cb_alloc(gh_backend * b, size_t bytes, void ** ptr) {
    cuda_backend * be = reinterpret_cast<cuda_backend *>(b);
    if (!ptr) return gh_fail(GH_ERR_INVALID_ARG, "cuda alloc: ptr is NULL");
    *ptr = NULL;
    if (bytes == 0) return gh_fail(GH_ERR_INVALID_ARG, "cuda alloc: 0 bytes");
    CU_CHECK(be->device, cudaSetDevice(be->device), "cudaSetDevice");
    return dev_malloc(be->device, bytes, ptr);
}

void cb_free(gh_backend * b, void * ptr) {
    if (!ptr) return;
    cuda_backend * be = reinterpret_cast<cuda_backend *>(b);
    if (cudaSetDevice(be->device) != cudaSuccess || cudaFree(ptr) != cudaSuccess) {
        (void) cudaGetLastError(); /* nothing to report to: free cannot fail */
    }
}

gh_status cb_upload(gh_backend * b, void * dst, const void * src, size_t bytes) {
    cuda_backend * be = reinterpret_cast<cuda_backend *>(b);
    if (bytes == 0) return GH_OK;
    if (!dst || !src) return gh_fail(GH_ERR_INVALID_ARG, "cuda upload: NULL pointer");
    CU_CHECK(be->device, cudaSetDevice(be->device), "cudaSetDevice");
    CU_CHECK(be->device, cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice),
             "upload (cudaMemcpy host to device)");
    /* From pageable memory cudaMemcpy may return before the DMA lands; the streams are
     * non-blocking (no implicit order with the default stream), so wait for it here. */
    CU_CHECK(be->device, cudaStreamSynchronize(cudaStreamLegacy), "upload (synchronize)");
    return GH_OK;
}

/* --- streams --- */

void cs_free(gh_stream * gs) {
    if (!gs) return;
    cuda_stream * s = reinterpret_cast<cuda_stream *>(gs);
    if (cudaSetDevice(s->be->device) == cudaSuccess) {
        if (s->have_stream) (void) cudaStreamSynchronize(s->st);
        cudaFree(s->d_x);
        cudaFree(s->d_y);
        cudaFree(s->d_h);
        cudaFree(s->d_a);
        cudaFree(s->d_rows);
        cudaFree(s->d_part);
        if (s->h_in) cudaFreeHost(s->h_in);
        if (s->h_out) cudaFreeHost(s->h_out);
        if (s->have_events) {
            cudaEventDestroy(s->ev_begin);
            cudaEventDestroy(s->ev_end);
        }
        if (s->have_stream) cudaStreamDestroy(s->st);
    }
    (void) cudaGetLastError();
    free(s->pend);
    free(s);
}

/* Staging holds several ops' worth between syncs; bigger ones (a whole prompt's logits)
 * get room for one op plus up to 32 MiB. */
size_t staging_bytes(size_t one_op) {
    const size_t extra = (size_t) 32 << 20;
    const size_t four = one_op * 4;
    return one_op + (four - one_op < extra ? four - one_op : extra);
}

gh_status cs_new(gh_backend * b, const gh_stream_params * p, gh_stream ** out) {
    cuda_backend * be = reinterpret_cast<cuda_backend *>(b);
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "cuda stream_new: out is NULL");
    *out = NULL;
    if (!p || p->max_in < 0 || p->max_out < 0 || p->max_rows < 0 || p->max_hidden < 0) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda stream_new: bad capacities");
    }
    const int dev = be->device;
    CU_CHECK(dev, cudaSetDevice(dev), "cudaSetDevice");
    cuda_stream * s = static_cast<cuda_stream *>(calloc(1, sizeof(cuda_stream)));
    if (!s) return gh_fail(GH_ERR_OOM, "cuda: out of host memory for a stream");
    s->base.backend = b;
    s->be = be;
    s->p = *p;
    const size_t n_in = (size_t) GH_MAX(p->max_in, 1), n_out = (size_t) GH_MAX(p->max_out, 1);
    const size_t n_hid = (size_t) GH_MAX(p->max_hidden, 1), n_rows = (size_t) GH_MAX(p->max_rows, 1);
    gh_status st = GH_OK;
    cudaError_t e;
#define STEP(call, what)                                              \
    if (!st && (e = (call)) != cudaSuccess) st = cuda_fail(dev, e, what)
    STEP(cudaStreamCreateWithFlags(&s->st, cudaStreamNonBlocking), "cudaStreamCreate");
    if (!st) s->have_stream = true;
    STEP(cudaEventCreate(&s->ev_begin), "cudaEventCreate");
    if (!st && (e = cudaEventCreate(&s->ev_end)) != cudaSuccess) {
        cudaEventDestroy(s->ev_begin);
        st = cuda_fail(dev, e, "cudaEventCreate");
    }
    if (!st) s->have_events = true;
    if (!st) st = dev_malloc(dev, n_in * sizeof(float), (void **) &s->d_x);
    if (!st) st = dev_malloc(dev, n_out * sizeof(float), (void **) &s->d_y);
    if (!st) st = dev_malloc(dev, n_hid * sizeof(float), (void **) &s->d_h);
    if (!st) st = dev_malloc(dev, n_rows * sizeof(float), (void **) &s->d_a);
    if (!st) st = dev_malloc(dev, n_rows * sizeof(int32_t), (void **) &s->d_rows);
    /* one op's input: x, then the row list, each 256-byte aligned in the staging */
    s->in_cap = staging_bytes(align_up(n_in * sizeof(float), 256) + align_up(n_rows * sizeof(int32_t), 256));
    s->out_cap = staging_bytes(n_out * sizeof(float)) / sizeof(float);
    STEP(cudaMallocHost((void **) &s->h_in, s->in_cap), "cudaMallocHost (input staging)");
    STEP(cudaMallocHost((void **) &s->h_out, s->out_cap * sizeof(float)),
         "cudaMallocHost (output staging)");
#undef STEP
    if (!st) {
        s->cap_pend = 16;
        s->pend = static_cast<pending_copy *>(malloc(s->cap_pend * sizeof(pending_copy)));
        if (!s->pend) st = gh_fail(GH_ERR_OOM, "cuda: out of host memory for a stream");
    }
    if (st) {
        cs_free(&s->base);
        return st;
    }
    *out = &s->base;
    return GH_OK;
}

/* Waits for the stream and hands every pending result to its caller; staging is free
 * afterwards. On an error the pending results are dropped (their buffers are not
 * written). */
gh_status cs_drain(cuda_stream * s) {
    const cudaError_t e = cudaStreamSynchronize(s->st);
    if (e != cudaSuccess) {
        s->n_pend = 0;
        s->in_used = s->out_used = 0;
        return cuda_fail(s->be->device, e, "a queued op (found at cudaStreamSynchronize)");
    }
    for (size_t i = 0; i < s->n_pend; i++) {
        if (s->pend[i].count) *s->pend[i].count = (int64_t) s->h_out[s->pend[i].off];
        else memcpy(s->pend[i].dst, s->h_out + s->pend[i].off, s->pend[i].n * sizeof(float));
    }
    s->n_pend = 0;
    s->in_used = s->out_used = 0;
    return GH_OK;
}

/* Every op starts here: the calling thread's device, the start event of this batch, and
 * room in the staging for in_bytes (x + rows) and out_floats (draining when short). */
gh_status op_begin(cuda_stream * s, size_t in_bytes, size_t out_floats) {
    const int dev = s->be->device;
    CU_CHECK(dev, cudaSetDevice(dev), "cudaSetDevice");
    if (s->n_pend == s->cap_pend) {
        const size_t cap = s->cap_pend * 2;
        pending_copy * p = static_cast<pending_copy *>(realloc(s->pend, cap * sizeof(pending_copy)));
        if (!p) return gh_fail(GH_ERR_OOM, "cuda: out of host memory (pending copies)");
        s->pend = p;
        s->cap_pend = cap;
    }
    if (align_up(s->in_used, 256) + in_bytes > s->in_cap || s->out_used + out_floats > s->out_cap) {
        gh_status st = cs_drain(s);
        if (st) return st;
    }
    if (!s->timing) {
        CU_CHECK(dev, cudaEventRecord(s->ev_begin, s->st), "cudaEventRecord");
        s->timing = true;
    }
    return GH_OK;
}

/* Host src -> pinned staging -> (async) dev. op_begin made the room. */
gh_status stage_in(cuda_stream * s, void * dev_dst, const void * src, size_t bytes) {
    if (bytes == 0) return GH_OK;
    const size_t off = align_up(s->in_used, 256);
    memcpy(s->h_in + off, src, bytes);
    s->in_used = off + bytes;
    CU_CHECK(s->be->device,
             cudaMemcpyAsync(dev_dst, s->h_in + off, bytes, cudaMemcpyHostToDevice, s->st),
             "cudaMemcpyAsync (host to device)");
    return GH_OK;
}

/* dev (n floats) -> (async) pinned staging -> host dst at the next drain. */
gh_status stage_out(cuda_stream * s, float * dst, const float * dev_src, size_t n) {
    const size_t off = s->out_used;
    CU_CHECK(s->be->device,
             cudaMemcpyAsync(s->h_out + off, dev_src, n * sizeof(float), cudaMemcpyDeviceToHost,
                             s->st),
             "cudaMemcpyAsync (device to host)");
    s->out_used = off + n;
    s->pend[s->n_pend++] = pending_copy{dst, off, n, NULL};
    return GH_OK;
}

/* dev (one float, an exact count) -> *dst at the next drain. op_begin made the room for
 * it and for the pending entry. */
gh_status stage_out_count(cuda_stream * s, int64_t * dst, const float * dev_src) {
    const size_t off = s->out_used;
    CU_CHECK(s->be->device,
             cudaMemcpyAsync(s->h_out + off, dev_src, sizeof(float), cudaMemcpyDeviceToHost, s->st),
             "cudaMemcpyAsync (device to host)");
    s->out_used = off + 1;
    s->pend[s->n_pend++] = pending_copy{NULL, off, 1, dst};
    return GH_OK;
}

gh_status check_launch(cuda_stream * s, const char * what) {
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? GH_OK : cuda_fail(s->be->device, e, what);
}

/* "f32, f16, ... and Q6_K": the names of the types the kernels read (dev_types), for
 * messages. */
struct type_names {
    char s[256];
};

const char * dev_type_names() {
    static const type_names names = [] {
        type_names n{};
        size_t len = 0;
        for (int i = 0; i < dev_types::count && len < sizeof n.s; i++) {
            const char * sep = i == 0 ? "" : i + 1 < dev_types::count ? ", " : " and ";
            len += (size_t) snprintf(n.s + len, sizeof n.s - len, "%s%s", sep,
                                     gh_type_name(dev_types::ids[i]));
        }
        return n;
    }();
    return names.s;
}

gh_status type_refused(const char * fn, const char * what, int type) {
    return gh_fail(GH_ERR_UNSUPPORTED, "cuda %s: %s has type %s (id %d), which the CUDA kernels "
                   "do not read (they read %s)", fn, what, gh_type_name(type), type,
                   dev_type_names());
}

gh_status check_weight(const char * fn, const char * what, const gh_dweight * w) {
    if (!w) return gh_fail(GH_ERR_INVALID_ARG, "cuda %s: %s is NULL", fn, what);
    int align = 0;
    if (!with_dev_type(w->type, [&](auto t) { align = dev_type<decltype(t)::value>::align; })) {
        return type_refused(fn, what, w->type);
    }
    if (!w->data || w->rows < 1 || w->cols < 1 || w->rows > INT32_MAX * (int64_t) MM_WARPS) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda %s: %s: bad weight (%lld x %lld, data %p)", fn,
                       what, (long long) w->rows, (long long) w->cols, w->data);
    }
    const size_t rs = gh_row_size(w->type, w->cols);
    if (rs == 0 || rs != w->row_bytes) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda %s: %s: %lld columns of type %s need %zu bytes "
                       "per row (a multiple of the block size), not %zu", fn, what,
                       (long long) w->cols, gh_type_name(w->type), rs, w->row_bytes);
    }
    if ((uintptr_t) w->data % (uintptr_t) align) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda %s: %s: device pointer %p is not %d-byte aligned",
                       fn, what, w->data, align);
    }
    return GH_OK;
}

/* The unit (vector) path for float rows: 8-element units and 16-byte aligned rows. */
bool float_vec_ok(const gh_dweight * w) {
    return w->cols % 8 == 0 && (uintptr_t) w->data % 16 == 0 && w->row_bytes % 16 == 0;
}

/* f(type_c<T>{}, std::bool_constant<VEC>{}) for the weight type T == type: the unit path
 * (VEC) where the rows allow it (float types: float_vec_ok), always for block types (their
 * rows are whole blocks; row_dot ignores VEC for them, so one instance each: if constexpr,
 * or the VEC = false kernels would be compiled too). false for a type the device does not
 * read (check_weight refused it already). */
template <typename F>
bool with_weight_type(int type, bool vec, F && f) {
    return with_dev_type(type, [&](auto t) {
        if constexpr (!dev_type<decltype(t)::value>::is_float) f(t, std::true_type{});
        else if (vec) f(t, std::true_type{});
        else f(t, std::false_type{});
    });
}

/* y (device, n x w->rows) = w . x (device, n x w->cols); relu'd if relu. */
gh_status launch_matmul(cuda_stream * s, const gh_dweight * w, const float * x, int64_t n,
                        float * y, int relu) {
    const int nt = n == 1 ? 1 : MM_TOK;
    const int64_t tiles = (n + nt - 1) / nt;
    if (tiles > 65535) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda matmul: %lld tokens in one call (at most %d)",
                       (long long) n, 65535 * nt);
    }
    const dim3 grid((unsigned) ((w->rows + MM_WARPS - 1) / MM_WARPS), (unsigned) tiles);
    const bool vec = float_vec_ok(w);
    const uint8_t * wd = static_cast<const uint8_t *>(w->data);
    const bool known = with_weight_type(w->type, vec, [&](auto t, auto v) {
        constexpr int T = decltype(t)::value;
        constexpr bool V = decltype(v)::value;
        if (nt == 1) {
            k_matmul<T, V, 1><<<grid, MM_WARPS * WARP, 0, s->st>>>(wd, w->row_bytes, w->rows,
                                                                  w->cols, x, n, y, relu);
        } else {
            k_matmul<T, V, MM_TOK><<<grid, MM_WARPS * WARP, 0, s->st>>>(wd, w->row_bytes, w->rows,
                                                                       w->cols, x, n, y, relu);
        }
    });
    if (!known) return type_refused("matmul", "w", w->type);
    return check_launch(s, "matmul kernel launch");
}

gh_status cs_matmul(gh_stream * gs, const gh_dweight * w, const float * x, int64_t n, float * y) {
    cuda_stream * s = reinterpret_cast<cuda_stream *>(gs);
    gh_status st = check_weight("matmul", "w", w);
    if (st) return st;
    if (n == 0) return GH_OK;
    if (n < 0 || !x || !y) return gh_fail(GH_ERR_INVALID_ARG, "cuda matmul: need x, y and n >= 0");
    if (n > s->p.max_in / w->cols || n > s->p.max_out / w->rows) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda matmul: %lld tokens of %lld -> %lld exceed the "
                       "stream's capacity (%lld in, %lld out floats)", (long long) n,
                       (long long) w->cols, (long long) w->rows, (long long) s->p.max_in,
                       (long long) s->p.max_out);
    }
    const size_t nx = (size_t) (n * w->cols), ny = (size_t) (n * w->rows);
    if ((st = op_begin(s, nx * sizeof(float), ny))) return st;
    if ((st = stage_in(s, s->d_x, x, nx * sizeof(float)))) return st;
    if ((st = launch_matmul(s, w, s->d_x, n, s->d_y, 0))) return st;
    return stage_out(s, y, s->d_y, ny);
}

gh_status cs_predict(gh_stream * gs, const gh_dweight * fc1, const gh_dweight * fc2,
                     const float * x, float * score) {
    cuda_stream * s = reinterpret_cast<cuda_stream *>(gs);
    gh_status st;
    if ((st = check_weight("predict", "fc1", fc1)) || (st = check_weight("predict", "fc2", fc2))) {
        return st;
    }
    if (!x || !score) return gh_fail(GH_ERR_INVALID_ARG, "cuda predict: x and score are required");
    if (fc2->cols != fc1->rows || fc1->cols > s->p.max_in || fc1->rows > s->p.max_hidden ||
        fc2->rows > s->p.max_out) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda predict: fc1 %lld x %lld, fc2 %lld x %lld do not "
                       "chain or exceed the stream's capacity (in %lld, hidden %lld, out %lld)",
                       (long long) fc1->rows, (long long) fc1->cols, (long long) fc2->rows,
                       (long long) fc2->cols, (long long) s->p.max_in,
                       (long long) s->p.max_hidden, (long long) s->p.max_out);
    }
    const size_t nx = (size_t) fc1->cols, ny = (size_t) fc2->rows;
    if ((st = op_begin(s, nx * sizeof(float), ny))) return st;
    if ((st = stage_in(s, s->d_x, x, nx * sizeof(float)))) return st;
    if ((st = launch_matmul(s, fc1, s->d_x, 1, s->d_h, 1))) return st;
    if ((st = launch_matmul(s, fc2, s->d_h, 1, s->d_y, 0))) return st;
    return stage_out(s, score, s->d_y, ny);
}

gh_status cs_hot_ffn(gh_stream * gs, const gh_dffn * f, const float * x,
                     const int32_t * rows, const float * g_rows, int64_t n_rows, float * y,
                     int64_t * n_nonzero) {
    cuda_stream * s = reinterpret_cast<cuda_stream *>(gs);
    static const char fn[] = "hot_ffn";
    if (!f) return gh_fail(GH_ERR_INVALID_ARG, "cuda hot_ffn: f is NULL");
    const int act = f->act;
    gh_status st;
    if ((st = check_weight(fn, "gate", &f->gate)) ||
        (f->gated && (st = check_weight(fn, "up", &f->up))) ||
        (st = check_weight(fn, "down_t", &f->down_t))) {
        return st;
    }
    if ((f->gated && (f->gate.type != f->up.type || f->gate.cols != f->up.cols ||
                      f->gate.row_bytes != f->up.row_bytes || f->up.rows < f->n_hot)) ||
        f->n_hot < 0 || f->gate.rows < f->n_hot || f->down_t.rows < f->n_hot) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda hot_ffn: gate %lld x %lld, up %lld x %lld, "
                       "down_t %lld x %lld do not fit n_hot %lld", (long long) f->gate.rows,
                       (long long) f->gate.cols, (long long) f->up.rows, (long long) f->up.cols,
                       (long long) f->down_t.rows, (long long) f->down_t.cols,
                       (long long) f->n_hot);
    }
    if (act < GH_ACT_SILU || act > GH_ACT_FATRELU || (act == GH_ACT_DRELU && !f->gated)) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda hot_ffn: unknown activation %d (gated %d)", act,
                       f->gated);
    }
    if (!x || !y || n_rows < 0 || (n_rows > 0 && !rows)) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda hot_ffn: need x, y and a row list of n_rows >= 0");
    }
    const int64_t d_in = f->gate.cols, d_out = f->down_t.cols;
    if (d_in > s->p.max_in || d_out + (n_nonzero ? 1 : 0) > s->p.max_out || n_rows > s->p.max_rows) {
        return gh_fail(GH_ERR_INVALID_ARG, "cuda hot_ffn: %lld inputs, %lld outputs, %lld rows "
                       "exceed the stream's capacity (%lld, %lld, %lld)", (long long) d_in,
                       (long long) d_out, (long long) n_rows, (long long) s->p.max_in,
                       (long long) s->p.max_out, (long long) s->p.max_rows);
    }
    for (int64_t k = 0; k < n_rows; k++) {
        if (rows[k] < 0 || rows[k] >= f->n_hot) {
            return gh_fail(GH_ERR_RANGE, "cuda hot_ffn: rows[%lld] = %d is outside [0, %lld)",
                           (long long) k, rows[k], (long long) f->n_hot);
        }
    }
    /* slices of the row list for the down kernel (rows.cuh: deterministic) */
    int64_t n_slices, chunk;
    down_slices(n_rows, d_out, &n_slices, &chunk);
    const size_t in_bytes = align_up((size_t) d_in * sizeof(float), 256) +
                            align_up((size_t) n_rows * sizeof(int32_t), 256) +
                            (g_rows ? (size_t) n_rows * sizeof(float) : 0);
    if ((st = op_begin(s, in_bytes, (size_t) d_out + (n_nonzero ? 1 : 0)))) return st;
    if (n_nonzero && s->n_pend + 2 > s->cap_pend) {
        /* op_begin left room for one pending entry; the count needs a second */
        const size_t cap = s->cap_pend * 2;
        pending_copy * p = static_cast<pending_copy *>(realloc(s->pend, cap * sizeof(pending_copy)));
        if (!p) return gh_fail(GH_ERR_OOM, "cuda: out of host memory (pending copies)");
        s->pend = p;
        s->cap_pend = cap;
    }
    const int dev = s->be->device;
    const size_t part_need = n_slices > 1 ? (size_t) (n_slices * d_out) : 0;
    if (part_need > s->part_cap) {
        /* grow the partials: wait until no queued kernel uses the old buffer */
        if ((st = cs_drain(s))) return st;
        cudaFree(s->d_part);
        s->d_part = NULL;
        s->part_cap = 0;
        if ((st = dev_malloc(dev, part_need * sizeof(float), (void **) &s->d_part))) return st;
        s->part_cap = part_need;
    }
    if ((st = stage_in(s, s->d_x, x, (size_t) d_in * sizeof(float)))) return st;
    if ((st = stage_in(s, s->d_rows, rows, (size_t) n_rows * sizeof(int32_t)))) return st;
    /* given gates go to d_a, which the gate/up kernel then overwrites with the activations */
    if (g_rows && (st = stage_in(s, s->d_a, g_rows, (size_t) n_rows * sizeof(float)))) return st;
    if (n_rows > 0) {
        const unsigned gblocks = (unsigned) ((n_rows + MM_WARPS - 1) / MM_WARPS);
        const bool vec = float_vec_ok(&f->gate) && (!f->gated || float_vec_ok(&f->up));
        const uint8_t * g = static_cast<const uint8_t *>(f->gate.data);
        const uint8_t * u = f->gated ? static_cast<const uint8_t *>(f->up.data) : NULL;
        const float * gb = f->gate_b, * ub = f->up_b;
        const float t = f->act_t;
        const float * gin = g_rows ? s->d_a : NULL;
        const bool known = with_weight_type(f->gate.type, vec, [&](auto tc, auto v) {
            k_hot_glu<decltype(tc)::value, decltype(v)::value>
                <<<gblocks, MM_WARPS * WARP, 0, s->st>>>(g, u, f->gate.row_bytes, d_in, s->d_x,
                                                         s->d_rows, n_rows, gb, ub, act, t, gin,
                                                         s->d_a);
        });
        if (!known) return type_refused(fn, "gate", f->gate.type);
        if ((st = check_launch(s, "hot_ffn gate/up kernel launch"))) return st;
        const dim3 grid((unsigned) ((d_out + DOWN_THREADS - 1) / DOWN_THREADS), (unsigned) n_slices);
        float * part = n_slices > 1 ? s->d_part : s->d_y;
        const uint8_t * dn = static_cast<const uint8_t *>(f->down_t.data);
        const size_t drb = f->down_t.row_bytes;
        const bool known_down = with_dev_type(f->down_t.type, [&](auto tc) {
            k_hot_down<decltype(tc)::value><<<grid, DOWN_THREADS, 0, s->st>>>(
                dn, drb, d_out, s->d_rows, s->d_a, n_rows, chunk, part);
        });
        if (!known_down) return type_refused(fn, "down_t", f->down_t.type);
        if ((st = check_launch(s, "hot_ffn down kernel launch"))) return st;
    }
    if (n_slices != 1) { /* n_rows == 0 gives zeros */
        const unsigned blocks = (unsigned) ((d_out + 255) / 256);
        k_sum_slices<<<blocks, 256, 0, s->st>>>(s->d_part, n_slices, d_out, s->d_y);
        if ((st = check_launch(s, "hot_ffn sum kernel launch"))) return st;
    }
    if (n_nonzero) {
        /* the count rides behind y in d_y (max_out > d_out: the stream holds logits) */
        k_count_nonzero<<<1, 256, 0, s->st>>>(s->d_a, n_rows, s->d_y + d_out);
        if ((st = check_launch(s, "hot_ffn count kernel launch"))) return st;
        if ((st = stage_out_count(s, n_nonzero, s->d_y + d_out))) return st;
    }
    return stage_out(s, y, s->d_y, (size_t) d_out);
}

gh_status cs_sync(gh_stream * gs, double * device_seconds) {
    cuda_stream * s = reinterpret_cast<cuda_stream *>(gs);
    if (device_seconds) *device_seconds = 0.0;
    const int dev = s->be->device;
    CU_CHECK(dev, cudaSetDevice(dev), "cudaSetDevice");
    const bool timed = s->timing;
    s->timing = false;
    if (timed) {
        const cudaError_t e = cudaEventRecord(s->ev_end, s->st);
        if (e != cudaSuccess) {
            (void) cs_drain(s);
            return cuda_fail(dev, e, "cudaEventRecord");
        }
    }
    gh_status st = cs_drain(s);
    if (st) return st;
    if (timed && device_seconds) {
        float ms = 0.0f;
        CU_CHECK(dev, cudaEventElapsedTime(&ms, s->ev_begin, s->ev_end), "cudaEventElapsedTime");
        *device_seconds = (double) ms * 1e-3;
    }
    return GH_OK;
}

bool cb_reads_type(const gh_backend *, int type) {
    return with_dev_type(type, [](auto) {});
}

gh_backend_ops make_ops() {
    gh_backend_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.destroy = cb_destroy;
    o.reads_type = cb_reads_type;
    o.mem_info = cb_mem_info;
    o.alloc = cb_alloc;
    o.free = cb_free;
    o.upload = cb_upload;
    o.stream_new = cs_new;
    o.stream_free = cs_free;
    o.matmul = cs_matmul;
    o.predict = cs_predict;
    o.hot_ffn = cs_hot_ffn;
    o.sync = cs_sync;
    return o;
}

const gh_backend_ops cuda_ops = make_ops();

} /* namespace */

extern "C" gh_status gh_backend_cuda_new(int device, gh_backend ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_backend_cuda_new: out is NULL");
    *out = NULL;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void) cudaGetLastError();
        int drv = 0, rt = 0;
        if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
        if (cudaRuntimeGetVersion(&rt) != cudaSuccess) rt = 0;
        (void) cudaGetLastError();
        if (e == cudaErrorInsufficientDriver && drv == 0) {
            return gh_fail(GH_ERR_UNSUPPORTED, "CUDA is not usable on this machine: no NVIDIA "
                           "driver found (libcuda.so.1 cannot be loaded; %s); use device 'cpu' "
                           "or 'host-device'", cudaGetErrorName(e));
        }
        if (e == cudaErrorInsufficientDriver) {
            return gh_fail(GH_ERR_UNSUPPORTED, "CUDA is not usable on this machine: the NVIDIA "
                           "driver supports CUDA %d.%d but this build needs CUDA %d.%d: update "
                           "the driver (or use device 'cpu' or 'host-device')", drv / 1000,
                           drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
        }
        return gh_fail(GH_ERR_UNSUPPORTED, "CUDA is not usable on this machine: %s (%s%s); use "
                       "device 'cpu' or 'host-device'", cudaGetErrorString(e), cudaGetErrorName(e),
                       e == cudaErrorNoDevice ? "; is CUDA_VISIBLE_DEVICES set?" : "");
    }
    if (n < 1) {
        return gh_fail(GH_ERR_UNSUPPORTED, "CUDA: no CUDA device found; use device 'cpu' or "
                       "'host-device'");
    }
    if (device < 0 || device >= n) {
        return gh_fail(GH_ERR_UNSUPPORTED, "CUDA device %d does not exist: this machine has %d "
                       "CUDA device%s (cuda:0 to cuda:%d)", device, n, n == 1 ? "" : "s", n - 1);
    }
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return cuda_fail(device, e, "cudaSetDevice");
    cudaDeviceProp prop;
    e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) return cuda_fail(device, e, "cudaGetDeviceProperties");
    e = cudaFree(0); /* create the context now, so a broken driver fails here */
    if (e != cudaSuccess) return cuda_fail(device, e, "creating a context");
    /* The kernels must exist for this GPU (machine code for sm_80/86/89/90 or PTX that
     * the driver can compile): asking for a kernel's attributes loads it. */
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, k_sum_slices);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, k_matmul<GH_TYPE_Q4_0, true, 1>);
    if (e != cudaSuccess) {
        (void) cudaGetLastError();
        return gh_fail(GH_ERR_UNSUPPORTED, "CUDA device %d (%s, compute capability %d.%d): this "
                       "build has no kernels that run on it: %s (%s); rebuild with "
                       "-DCMAKE_CUDA_ARCHITECTURES=%d%d (compute capability 8.0 or newer)",
                       device, prop.name, prop.major, prop.minor, cudaGetErrorString(e),
                       cudaGetErrorName(e), prop.major, prop.minor);
    }
    /* the level tables of IQ4_NL / IQ4_XS / MXFP4 into the device's constant memory, from
     * the runtime's type table (dev_types.cuh: c_levels) */
    levels16 lv[N_LEVELS];
    host_levels(lv);
    e = cudaMemcpyToSymbol(c_levels, lv, sizeof lv);
    if (e != cudaSuccess) return cuda_fail(device, e, "copying the level tables to the device");
    cuda_backend * be = static_cast<cuda_backend *>(calloc(1, sizeof(cuda_backend)));
    if (!be) return gh_fail(GH_ERR_OOM, "cuda: out of host memory");
    be->base.ops = &cuda_ops;
    be->device = device;
    snprintf(be->name, sizeof be->name, "%s", prop.name);
    *out = &be->base;
    return GH_OK;
}
