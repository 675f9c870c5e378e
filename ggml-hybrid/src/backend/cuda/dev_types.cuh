/* The CUDA backend's type table: for each weight type the kernels read, how its blocks
 * unpack on the device (dev_type<T>), and THE list of those types (dev_types), from which
 * the backend instantiates its kernels, checks weights and words its refusals.
 *
 * Adding a type: one dev_type specialisation here (block, bytes, align, elem, unit; the
 * reads equal the runtime's to_float bit for bit) and its id in dev_types. The kernels,
 * the supported-type check, the refusal message and tests/gpu/cuda_emu.cu (which replays
 * every listed type against gh_dequantize_row) follow from the list.
 *
 * Everything here is __host__ __device__ so that cuda_emu.cu can run it on the CPU.
 *
 * Includes: the caller includes types.h (block layouts, gh_type ids) first. */
#ifndef GH_CUDA_DEV_TYPES_CUH
#define GH_CUDA_DEV_TYPES_CUH

#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace gh_cuda {

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

/* a * b, a - b and a + b each rounded once: the device compiler fuses a product followed
 * by an add into an FMA (one rounding), and the element reads must equal the runtime's
 * dequantizer, which rounds twice (types.c is built without FMA contraction: the portable
 * x86-64 flags have no FMA; gguf.quants' numpy does not fuse either). */
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
GH_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

/* How the rows of type T read on the device, one specialisation per type:
 *   block, bytes  elements and bytes per block (as the type table's; cuda_emu.cu checks);
 *   is_float      one element per block: rows of any width, an element-per-lane path;
 *   align         the alignment of a row's start that the loads need (bytes);
 *   elem(row, i)  element i of a row (the down kernel's reads);
 *   unit(row, u, w, o0, o1)  unit u (8 elements) of a row, for the row dot products:
 *                 w[0..3] multiply x[o0..o0+3], w[4..7] x[o1..o1+3] (o0, o1 multiples of 4).
 *                 Float types: elements 8u..8u+7 by vector loads (16-byte aligned rows,
 *                 float_vec_ok); block types: units tile each block in order, read with
 *                 16-bit loads (blocks are only 2-byte aligned).
 * Both reads equal the runtime's to_float bit for bit. The primary template has no
 * definition: a kernel for an unlisted type does not compile. */
template <int T> struct dev_type;

template <> struct dev_type<GH_TYPE_F32> {
    static constexpr int block = 1, bytes = 4, align = 4;
    static constexpr bool is_float = true;
    GH_HD static float elem(const uint8_t * row, int64_t i) {
        return ldg(reinterpret_cast<const float *>(row) + i);
    }
    GH_HD static void unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
        const float4 * p = reinterpret_cast<const float4 *>(row) + 2 * u;
        const float4 a = ldg(p), b = ldg(p + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
        o0 = 8 * u;
        o1 = o0 + 4;
    }
};

/* F16 and BF16: 16-bit floats, 8 to a 16-byte load. */
template <bool BF> struct half_type {
    static constexpr int block = 1, bytes = 2, align = 2;
    static constexpr bool is_float = true;
    GH_HD static float cvt(uint32_t h) { return BF ? bf16_bits(h) : f16_bits(h); }
    GH_HD static float elem(const uint8_t * row, int64_t i) { return cvt(ld_u16(row + 2 * i)); }
    GH_HD static void unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
        const uint4 q = ldg(reinterpret_cast<const uint4 *>(row) + u);
        const uint32_t v[4] = {q.x, q.y, q.z, q.w};
GH_UNROLL()
        for (int i = 0; i < 4; i++) { /* little-endian: element 2i is the low half */
            w[2 * i] = cvt(v[i] & 0xFFFFu);
            w[2 * i + 1] = cvt(v[i] >> 16);
        }
        o0 = 8 * u;
        o1 = o0 + 4;
    }
};
template <> struct dev_type<GH_TYPE_F16> : half_type<false> {};
template <> struct dev_type<GH_TYPE_BF16> : half_type<true> {};

template <> struct dev_type<GH_TYPE_Q8_0> {
    static constexpr int block = QK8_0, bytes = sizeof(block_q8_0), align = 2;
    static constexpr bool is_float = false;
    GH_HD static float elem(const uint8_t * row, int64_t i) {
        const uint8_t * b = row + (i >> 5) * (int64_t) bytes;
        const float d = f16_bits(ld_u16(b));
        return d * (float) (int8_t) ldg(b + 2 + (i & 31));
    }
    /* quarter u % 4 of block u / 4: elements 8p .. 8p + 7 */
    GH_HD static void unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
        const int64_t blk = u >> 2;
        const int p = (int) (u & 3);
        const uint8_t * b = row + blk * (int64_t) bytes;
        const float d = f16_bits(ld_u16(b));
        const uint8_t * q = b + 2 + 8 * p;
GH_UNROLL()
        for (int i = 0; i < 4; i++) {
            const uint16_t v = ld_u16(q + 2 * i);
            w[2 * i] = d * (float) (int8_t) (v & 0xFF);
            w[2 * i + 1] = d * (float) (int8_t) (v >> 8);
        }
        o0 = 32 * blk + 8 * p;
        o1 = o0 + 4;
    }
};

/* The 32-value nibble types Q4_0, Q4_1, Q5_0, Q5_1 (types.h): fp16 d, with MIN an fp16 m,
 * with HIGH 4 bytes qh (bit j: bit 4 of value j), then 16 bytes of nibbles (element j < 16
 * the low nibble of qs[j], j + 16 its high nibble). x = d * (q - zero) without a min
 * (zero 8, or 16 with the fifth bit), d * q + m with one. */
template <bool MIN, bool HIGH> struct nibble32 {
    static constexpr int block = 32, align = 2;
    static constexpr int QH = 2 + 2 * MIN, QS = QH + 4 * HIGH, bytes = QS + 16;
    static constexpr int ZERO = HIGH ? 16 : 8;
    static constexpr bool is_float = false;
    /* qh as one word (two 16-bit loads: blocks are 2-byte aligned) */
    GH_HD static uint32_t high_bits(const uint8_t * b) {
        return (uint32_t) ld_u16(b + QH) | (uint32_t) ld_u16(b + QH + 2) << 16;
    }
    /* q -> x as types.c's q4_0/q4_1/q5_0/q5_1_to_float: (float) (q - zero) * d in one
     * rounding, or d * q and + m rounded apart (no FMA, as the CPU) */
    GH_HD static float value(float d, float m, int q) {
        if constexpr (MIN) return add_rn(mul_rn(d, (float) q), m);
        else return d * (float) (q - ZERO);
    }
    GH_HD static float elem(const uint8_t * row, int64_t i) {
        const uint8_t * b = row + (i >> 5) * (int64_t) bytes;
        const float d = f16_bits(ld_u16(b));
        const float m = MIN ? f16_bits(ld_u16(b + 2)) : 0.0f;
        const int j = (int) (i & 31);
        const uint8_t byte = ldg(b + QS + (j & 15));
        int q = j < 16 ? (byte & 0xF) : (byte >> 4);
        if constexpr (HIGH) q |= (int) ((high_bits(b) >> j) & 1u) << 4;
        return value(d, m, q);
    }
    /* quarter p = u % 4 of block u / 4: bytes 4p .. 4p + 3 of qs, i.e. elements 4p + i
     * (low nibbles) and 4p + 16 + i (high nibbles) */
    GH_HD static void unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
        const int64_t blk = u >> 2;
        const int p = (int) (u & 3);
        const uint8_t * b = row + blk * (int64_t) bytes;
        const float d = f16_bits(ld_u16(b));
        const float m = MIN ? f16_bits(ld_u16(b + 2)) : 0.0f;
        const uint8_t * q = b + QS + 4 * p;
        const uint32_t v = (uint32_t) ld_u16(q) | ((uint32_t) ld_u16(q + 2) << 16);
        uint32_t lo_h = 0, hi_h = 0; /* the fifth bits of the 4 low / 4 high values, bit i */
        if constexpr (HIGH) {
            const uint32_t h = high_bits(b);
            lo_h = h >> (4 * p);
            hi_h = h >> (16 + 4 * p);
        }
GH_UNROLL()
        for (int i = 0; i < 4; i++) {
            const uint32_t byte = (v >> (8 * i)) & 0xFFu;
            w[i] = value(d, m, (int) (byte & 0xFu) | (int) ((lo_h >> i) & 1u) << 4);
            w[4 + i] = value(d, m, (int) (byte >> 4) | (int) ((hi_h >> i) & 1u) << 4);
        }
        o0 = 32 * blk + 4 * p;
        o1 = o0 + 16;
    }
};
template <> struct dev_type<GH_TYPE_Q4_0> : nibble32<false, false> {};
template <> struct dev_type<GH_TYPE_Q4_1> : nibble32<true, false> {};
template <> struct dev_type<GH_TYPE_Q5_0> : nibble32<false, true> {};
template <> struct dev_type<GH_TYPE_Q5_1> : nibble32<true, true> {};
static_assert(dev_type<GH_TYPE_Q4_0>::bytes == sizeof(block_q4_0), "q4_0 layout");
static_assert(dev_type<GH_TYPE_Q4_1>::bytes == sizeof(block_q4_1), "q4_1 layout");
static_assert(dev_type<GH_TYPE_Q5_0>::bytes == sizeof(block_q5_0), "q5_0 layout");
static_assert(dev_type<GH_TYPE_Q5_1>::bytes == sizeof(block_q5_1), "q5_1 layout");

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

/* The K-quants Q4_K, Q5_K, Q6_K: 256-value blocks (types.h). */
template <int T, int BYTES> struct k_quant {
    static constexpr int block = QK_K, bytes = BYTES, align = 2;
    static constexpr bool is_float = false;
    /* Elements e0 .. e0 + k - 1 (within one 32-value sub-block of a Q4_K/Q5_K block, one
     * 16-value sub-block of a Q6_K block) of block b, dequantized as the runtime does. */
    template <int K>
    GH_HD static void elems(const uint8_t * b, int e0, float * w) {
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
    GH_HD static float elem(const uint8_t * row, int64_t i) {
        float w;
        elems<1>(row + (i >> 8) * (int64_t) bytes, (int) (i & 255), &w);
        return w;
    }
    /* elements 8p .. 8p + 7 of block u / 32, p = u % 32 */
    GH_HD static void unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
        const int64_t blk = u >> 5;
        const int p = (int) (u & 31);
        elems<8>(row + blk * (int64_t) bytes, 8 * p, w);
        o0 = QK_K * blk + 8 * p;
        o1 = o0 + 4;
    }
};
template <> struct dev_type<GH_TYPE_Q4_K> : k_quant<GH_TYPE_Q4_K, sizeof(block_q4_K)> {};
template <> struct dev_type<GH_TYPE_Q5_K> : k_quant<GH_TYPE_Q5_K, sizeof(block_q5_K)> {};
template <> struct dev_type<GH_TYPE_Q6_K> : k_quant<GH_TYPE_Q6_K, sizeof(block_q6_K)> {};

/* ---- the list ---- */

template <int... Ts> struct type_list {
    static constexpr int ids[sizeof...(Ts)] = {Ts...};
    static constexpr int count = (int) sizeof...(Ts);
};

/* THE types the CUDA kernels read, in the order messages list them. */
using dev_types = type_list<GH_TYPE_F32, GH_TYPE_F16, GH_TYPE_BF16, GH_TYPE_Q8_0, GH_TYPE_Q4_0,
                            GH_TYPE_Q4_1, GH_TYPE_Q5_0, GH_TYPE_Q5_1, GH_TYPE_Q4_K, GH_TYPE_Q5_K,
                            GH_TYPE_Q6_K>;

template <int T> using type_c = std::integral_constant<int, T>;

template <typename F, int... Ts>
bool visit_type(type_list<Ts...>, int type, F && f) {
    return ((type == Ts ? (f(type_c<Ts>{}), true) : false) || ...);
}

/* f(type_c<T>{}) for the listed type T == type (host code: the launches); false when the
 * device does not read type. With it a launch site is written once for every type. */
template <typename F>
bool with_dev_type(int type, F && f) {
    return visit_type(dev_types{}, type, f);
}

template <typename F, int... Ts>
void visit_all(type_list<Ts...>, F && f) {
    (f(type_c<Ts>{}), ...);
}

/* f(type_c<T>{}) for every listed T, in order (cuda_emu.cu checks each). */
template <typename F>
void for_each_dev_type(F && f) {
    visit_all(dev_types{}, f);
}

} /* namespace gh_cuda */

#endif
