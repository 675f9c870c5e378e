/* Row math of the CUDA kernels: the per-lane part of a row dot product, the gated
 * activations and how the hot-down kernel slices its row list. How each weight type's
 * elements are read is dev_types.cuh (the device's type table).
 *
 * Everything here is __host__ __device__ so that tests/gpu/cuda_emu.cu can run it on the
 * CPU: it calls row_dot for lanes 0..31 in turn (what one warp does in parallel) and
 * checks every listed type's reads against the runtime's dequantizer, with no GPU.
 * backend_cuda.cu builds the kernels from these pieces.
 *
 * Includes: the caller includes types.h (block layouts, gh_type ids) first. */
#ifndef GH_CUDA_ROWS_CUH
#define GH_CUDA_ROWS_CUH

#include <stdint.h>

#include <math.h>

#include "backend/cuda/dev_types.cuh"

namespace gh_cuda {

constexpr int WARP = 32;
constexpr int MM_WARPS = 4;        /* weight rows (warps) per block of the row-dot kernels */
constexpr int MM_TOK = 8;          /* tokens per tile of the matmul kernel (n > 1) */
constexpr int DOWN_THREADS = 128;  /* columns per block of the down kernel */
constexpr int DOWN_TILE = 256;     /* row ids / activations staged in shared memory at once */
constexpr int DOWN_MAX_SLICES = 64;

/* Lane `lane`'s partial sums acc[t] += row . x[t] for t < nt (x rows ldx floats apart);
 * the warp's 32 partials add up to the dot products.
 * VEC (float types): the unit path, needs cols % 8 == 0 and a 16-byte aligned row;
 * otherwise one element per lane per step. Quantized types always take the unit path
 * (cols is a multiple of 32). On the unit path each token's x must be 16-byte aligned. */
template <int T, bool VEC, int NT>
GH_HD void row_dot(const uint8_t * __restrict__ row, int64_t cols, const float * __restrict__ x,
                   int64_t ldx, int nt, int lane, float (&acc)[NT]) {
    if constexpr (dev_type<T>::is_float && !VEC) {
GH_UNROLL(4)
        for (int64_t i = lane; i < cols; i += WARP) {
            const float w = dev_type<T>::elem(row, i);
GH_UNROLL()
            for (int t = 0; t < NT; t++) {
                if (t < nt) acc[t] = fmaf(w, ldg(x + t * ldx + i), acc[t]);
            }
        }
    } else {
        const int64_t n_units = cols >> 3;
GH_UNROLL(2)
        for (int64_t u = lane; u < n_units; u += WARP) {
            float w[8];
            int64_t o0, o1;
            dev_type<T>::unit(row, u, w, o0, o1);
GH_UNROLL()
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const float4 a = ldg(reinterpret_cast<const float4 *>(x + t * ldx + o0));
                    const float4 b = ldg(reinterpret_cast<const float4 *>(x + t * ldx + o1));
                    float s = acc[t];
                    s = fmaf(w[0], a.x, s); s = fmaf(w[1], a.y, s);
                    s = fmaf(w[2], a.z, s); s = fmaf(w[3], a.w, s);
                    s = fmaf(w[4], b.x, s); s = fmaf(w[5], b.y, s);
                    s = fmaf(w[6], b.z, s); s = fmaf(w[7], b.w, s);
                    acc[t] = s;
                }
            }
        }
    }
}

/* act(g, u) of the gh_act kinds, the formulas of ops.c's gh_glu (the GPU has no SIMD
 * sigmoid to share, so they are written here once for host and device code); t is
 * FATReLU's threshold, u = 1 for an ungated FFN. */
GH_HD float act_glu(int act, float t, float g, float u) {
    switch (act) {
    case GH_ACT_RELU: return g > 0.0f ? g * u : 0.0f;
    case GH_ACT_FATRELU: return g > t ? g * u : 0.0f;
    case GH_ACT_DRELU: return g > 0.0f && u > 0.0f ? g * u : 0.0f;
    case GH_ACT_GELU: {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * u;
    }
    case GH_ACT_GELU_ERF: return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f)) * u;
    default: return g / (1.0f + expf(-g)) * u; /* GH_ACT_SILU */
    }
}

/* How the hot-down kernel cuts a list of n_rows rows into slices for an output of d_out
 * columns: slice s is rows [s * chunk, min((s + 1) * chunk, n_rows)), s < n_slices.
 * About 16 or more rows a slice, at most DOWN_MAX_SLICES slices and ~256K column-threads
 * in all. It depends on n_rows and d_out alone, so the same op always sums in the same
 * order (deterministic results). n_rows == 0: no slices. */
inline void down_slices(int64_t n_rows, int64_t d_out, int64_t * n_slices, int64_t * chunk) {
    *n_slices = *chunk = 0;
    if (n_rows <= 0) return;
    int64_t by_width = ((int64_t) 1 << 18) / (d_out > 0 ? d_out : 1);
    if (by_width < 1) by_width = 1;
    int64_t s = (n_rows + 15) / 16;
    if (s > DOWN_MAX_SLICES) s = DOWN_MAX_SLICES;
    if (s > by_width) s = by_width;
    *chunk = (n_rows + s - 1) / s;
    *n_slices = (n_rows + *chunk - 1) / *chunk;
}

} /* namespace gh_cuda */

#endif
