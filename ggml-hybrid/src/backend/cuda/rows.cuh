/* Row math of the CUDA kernels: decoding weight elements, the per-lane part of a row dot
 * product, the gated activations and how the hot-down kernel slices its row list.
 *
 * Everything here is __host__ __device__ so that tests/gpu/cuda_emu.cu can run it on the
 * CPU: it calls row_dot for lanes 0..31 in turn (what one warp does in parallel) and
 * checks the element indexing of every type against the runtime's dequantizer, with no
 * GPU. backend_cuda.cu builds the kernels from these pieces.
 *
 * Includes: the caller includes types.h (block layouts, gh_type ids) first. */
#ifndef GH_CUDA_ROWS_CUH
#define GH_CUDA_ROWS_CUH

#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include <math.h>

namespace gh_cuda {

constexpr int WARP = 32;
constexpr int MM_WARPS = 4;        /* weight rows (warps) per block of the row-dot kernels */
constexpr int MM_TOK = 8;          /* tokens per tile of the matmul kernel (n > 1) */
constexpr int DOWN_THREADS = 128;  /* columns per block of the down kernel */
constexpr int DOWN_TILE = 256;     /* row ids / activations staged in shared memory at once */
constexpr int DOWN_MAX_SLICES = 64;

#define GH_HD __host__ __device__ __forceinline__
/* #pragma unroll for the device pass only (the host compiler does not know it) */
#ifdef __CUDA_ARCH__
#define GH_PRAGMA(x) _Pragma(#x)
#else
#define GH_PRAGMA(x)
#endif
#define GH_UNROLL(n) GH_PRAGMA(unroll n)

/* A read-only load: through the non-coherent (texture) path on the device. */
template <typename V>
GH_HD V ldg(const V * p) {
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}

GH_HD uint16_t ld_u16(const uint8_t * p) {
    return ldg(reinterpret_cast<const unsigned short *>(p));
}

GH_HD float bits_to_f32(uint32_t b) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
#endif
}

GH_HD float f16_bits(uint32_t h) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
GH_HD float bf16_bits(uint32_t h) { return bits_to_f32(h << 16); }

__host__ __device__ constexpr bool is_float_type(int t) {
    return t == GH_TYPE_F32 || t == GH_TYPE_F16 || t == GH_TYPE_BF16;
}

__host__ __device__ constexpr bool is_k_quant(int t) {
    return t == GH_TYPE_Q4_K || t == GH_TYPE_Q5_K || t == GH_TYPE_Q6_K;
}

/* a * b and a - b each rounded once: the device compiler would fuse (d * sc) * q - dmin * m
 * into an FMA, and the element reads must equal the runtime's dequantizer bit for bit */
GH_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
GH_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

/* Scale and min of sub-block j < 8 of a Q4_K/Q5_K block's 12 scale bytes (types.h's
 * gh_k4_scale_min, for the device). */
GH_HD void k4_scale_min(const uint8_t * q, int j, int & sc, int & m) {
    if (j < 4) {
        sc = ldg(q + j) & 63;
        m = ldg(q + j + 4) & 63;
    } else {
        const int a = ldg(q + j + 4);
        sc = (a & 0x0f) | ((ldg(q + j - 4) >> 6) << 4);
        m = (a >> 4) | ((ldg(q + j) >> 6) << 4);
    }
}

/* Elements e0 .. e0 + k - 1 (within one 32-value sub-block of a Q4_K/Q5_K block, one
 * 16-value sub-block of a Q6_K block) of block b, dequantized as the runtime does. */
template <int T, int K>
GH_HD void k_elems(const uint8_t * b, int e0, float * w) {
    if constexpr (T == GH_TYPE_Q6_K) {
        const int h = e0 >> 7, g = (e0 & 127) >> 5, l = e0 & 31;
        const uint8_t * ql = b + 64 * h + l + 32 * (g & 1);
        const uint8_t * qh = b + QK_K / 2 + 32 * h + l;
        const float d = f16_bits(ld_u16(b + QK_K / 2 + QK_K / 4 + QK_K / 16));
        const float dl = mul_rn(d, (float) (int8_t) ldg(b + QK_K / 2 + QK_K / 4 + (e0 >> 4)));
GH_UNROLL()
        for (int i = 0; i < K; i++) {
            const int q = ((ldg(ql + i) >> (4 * (g >> 1))) & 0x0f) | (((ldg(qh + i) >> (2 * g)) & 3) << 4);
            w[i] = mul_rn(dl, (float) (q - 32));
        }
    } else {
        const int j = e0 >> 5, l = e0 & 31;
        int sc, m;
        k4_scale_min(b + 4, j, sc, m);
        const float dl = mul_rn(f16_bits(ld_u16(b)), (float) sc);
        const float ml = mul_rn(f16_bits(ld_u16(b + 2)), (float) m);
        const uint8_t * qh = b + 4 + K_SCALE_SIZE;
        const uint8_t * qs = qh + (T == GH_TYPE_Q5_K ? QK_K / 8 : 0) + 32 * (j >> 1) + l;
GH_UNROLL()
        for (int i = 0; i < K; i++) {
            int q = (ldg(qs + i) >> (4 * (j & 1))) & 0x0f;
            if constexpr (T == GH_TYPE_Q5_K) q |= ((ldg(qh + l + i) >> j) & 1) << 4;
            w[i] = sub_rn(mul_rn(dl, (float) q), ml);
        }
    }
}

template <int T>
__host__ __device__ constexpr int64_t k_block_bytes() {
    return T == GH_TYPE_Q4_K ? (int64_t) sizeof(block_q4_K)
         : T == GH_TYPE_Q5_K ? (int64_t) sizeof(block_q5_K) : (int64_t) sizeof(block_q6_K);
}

/* Element i of a row (any type). */
template <int T>
GH_HD float load_elem(const uint8_t * row, int64_t i) {
    if constexpr (T == GH_TYPE_F32) {
        return ldg(reinterpret_cast<const float *>(row) + i);
    } else if constexpr (T == GH_TYPE_F16) {
        return f16_bits(ld_u16(row + 2 * i));
    } else if constexpr (T == GH_TYPE_BF16) {
        return bf16_bits(ld_u16(row + 2 * i));
    } else if constexpr (T == GH_TYPE_Q8_0) {
        const uint8_t * b = row + (i >> 5) * (int64_t) sizeof(block_q8_0);
        const float d = f16_bits(ld_u16(b));
        return d * (float) (int8_t) ldg(b + 2 + (i & 31));
    } else if constexpr (is_k_quant(T)) {
        float w;
        k_elems<T, 1>(row + (i >> 8) * k_block_bytes<T>(), (int) (i & 255), &w);
        return w;
    } else {
        static_assert(T == GH_TYPE_Q4_0, "unsupported type");
        const uint8_t * b = row + (i >> 5) * (int64_t) sizeof(block_q4_0);
        const float d = f16_bits(ld_u16(b));
        const int j = (int) (i & 31);
        const uint8_t q = ldg(b + 2 + (j & 15));
        return d * (float) ((j < 16 ? (q & 0xF) : (q >> 4)) - 8);
    }
}

/* Unit u (8 elements) of a row: w[0..3] multiply x[o0..o0+3], w[4..7] x[o1..o1+3]
 * (o0, o1 multiples of 4). Float types: elements 8u..8u+7, read with vector loads (the
 * row must be 16-byte aligned). Quantized types: quarter u % 4 of block u / 4 (blocks
 * are only 2-byte aligned: 16-bit loads). */
template <int T>
GH_HD void load_unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
    if constexpr (T == GH_TYPE_F32) {
        const float4 * p = reinterpret_cast<const float4 *>(row) + 2 * u;
        const float4 a = ldg(p), b = ldg(p + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
        o0 = 8 * u;
        o1 = o0 + 4;
    } else if constexpr (T == GH_TYPE_F16 || T == GH_TYPE_BF16) {
        const uint4 q = ldg(reinterpret_cast<const uint4 *>(row) + u);
        const uint32_t v[4] = {q.x, q.y, q.z, q.w};
GH_UNROLL()
        for (int i = 0; i < 4; i++) { /* little-endian: element 2i is the low half */
            if constexpr (T == GH_TYPE_F16) {
                w[2 * i] = f16_bits(v[i] & 0xFFFFu);
                w[2 * i + 1] = f16_bits(v[i] >> 16);
            } else {
                w[2 * i] = bits_to_f32(v[i] << 16);
                w[2 * i + 1] = bits_to_f32(v[i] & 0xFFFF0000u);
            }
        }
        o0 = 8 * u;
        o1 = o0 + 4;
    } else if constexpr (T == GH_TYPE_Q8_0) {
        const int64_t blk = u >> 2;
        const int p = (int) (u & 3);
        const uint8_t * b = row + blk * (int64_t) sizeof(block_q8_0);
        const float d = f16_bits(ld_u16(b));
        const uint8_t * q = b + 2 + 8 * p; /* elements 8p..8p+7 of the block */
GH_UNROLL()
        for (int i = 0; i < 4; i++) {
            const uint16_t v = ld_u16(q + 2 * i);
            w[2 * i] = d * (float) (int8_t) (v & 0xFF);
            w[2 * i + 1] = d * (float) (int8_t) (v >> 8);
        }
        o0 = 32 * blk + 8 * p;
        o1 = o0 + 4;
    } else if constexpr (is_k_quant(T)) { /* elements 8p .. 8p + 7 of block u / 32 */
        const int64_t blk = u >> 5;
        const int p = (int) (u & 31);
        k_elems<T, 8>(row + blk * k_block_bytes<T>(), 8 * p, w);
        o0 = QK_K * blk + 8 * p;
        o1 = o0 + 4;
    } else {
        static_assert(T == GH_TYPE_Q4_0, "unsupported type");
        const int64_t blk = u >> 2;
        const int p = (int) (u & 3);
        const uint8_t * b = row + blk * (int64_t) sizeof(block_q4_0);
        const float d = f16_bits(ld_u16(b));
        const uint8_t * q = b + 2 + 4 * p; /* bytes 4p..4p+3: elements 4p+i and 4p+16+i */
        const uint32_t v = (uint32_t) ld_u16(q) | ((uint32_t) ld_u16(q + 2) << 16);
GH_UNROLL()
        for (int i = 0; i < 4; i++) {
            const uint32_t byte = (v >> (8 * i)) & 0xFFu;
            w[i] = d * (float) ((int) (byte & 0xFu) - 8);
            w[4 + i] = d * (float) ((int) (byte >> 4) - 8);
        }
        o0 = 32 * blk + 4 * p;
        o1 = o0 + 16;
    }
}

/* Lane `lane`'s partial sums acc[t] += row . x[t] for t < nt (x rows ldx floats apart);
 * the warp's 32 partials add up to the dot products.
 * VEC (float types): the unit path, needs cols % 8 == 0 and a 16-byte aligned row;
 * otherwise one element per lane per step. Quantized types always take the unit path
 * (cols is a multiple of 32). On the unit path each token's x must be 16-byte aligned. */
template <int T, bool VEC, int NT>
GH_HD void row_dot(const uint8_t * __restrict__ row, int64_t cols, const float * __restrict__ x,
                   int64_t ldx, int nt, int lane, float (&acc)[NT]) {
    if constexpr (is_float_type(T) && !VEC) {
GH_UNROLL(4)
        for (int64_t i = lane; i < cols; i += WARP) {
            const float w = load_elem<T>(row, i);
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
            load_unit<T>(row, u, w, o0, o1);
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

#undef GH_HD
#undef GH_UNROLL
#undef GH_PRAGMA

} /* namespace gh_cuda */

#endif
