/* The CUDA backend's type table: for each weight type the kernels read, how its blocks
 * unpack on the device (dev_type<T>), and THE list of those types (dev_types), from which
 * the backend instantiates its kernels, checks weights and words its refusals.
 *
 * Adding a type: one dev_type specialisation here (block, bytes, align, elem, unit; the
 * reads equal the runtime's to_float bit for bit) and its id in dev_types. The kernels,
 * the supported-type check (the backend's reads_type, which the placement asks before any
 * upload), the refusal message and tests/gpu/cuda_emu.cu (which replays every listed type
 * against gh_dequantize_row) follow from the list.
 *
 * Everything here is __host__ __device__ so that cuda_emu.cu can run it on the CPU (the
 * non-linear types' level tables aside: the device reads its copy, c_levels).
 *
 * Includes: the caller includes types.h (block layouts, gh_type ids) first. */
#ifndef GH_CUDA_DEV_TYPES_CUH
#define GH_CUDA_DEV_TYPES_CUH

#include <cuda_fp16.h>
#include <stdint.h>
#include <stddef.h>
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

/* Q2_K, Q3_K: 256-value blocks of 16 sub-blocks of 16 whose values' two low bits share
 * one qs[64] layout (types.h's gh_k2_low: value 128h + 32g + l is bits 2g of qs[32h + l]).
 *   Q2_K { scales[16]; qs[64]; fp16 d, dmin }: x = (d * (sc & 15)) * q - dmin * (sc >> 4);
 *   Q3_K { hmask[32]; qs[64]; scales[12]; fp16 d }: x = (d * (sc - 32)) * (q - 4) with
 *        q's bit 2 bit v / 32 of hmask[v % 32] (sc 6-bit, gh_k3_scale).
 * Products and the difference rounded apart, as types.c's q2_K/q3_K_to_float. */
template <int T> struct k_low2 {
    static constexpr bool Q3 = T == GH_TYPE_Q3_K;
    static constexpr int block = QK_K, align = 2;
    static constexpr int bytes = Q3 ? (int) sizeof(block_q3_K) : (int) sizeof(block_q2_K);
    static constexpr int QS = Q3 ? QK_K / 8 : QK_K / 16;   /* offset of qs[64] */
    static constexpr int SC = Q3 ? QS + QK_K / 4 : 0;       /* offset of the scales */
    static constexpr int D = Q3 ? SC + 12 : QS + QK_K / 4;  /* offset of fp16 d (dmin next) */
    static constexpr bool is_float = false;
    /* the 6-bit scale of Q3_K sub-block j < 16 (gh_k3_scale, for the device) */
    GH_HD static int k3_scale(const uint8_t * s, int j) {
        const int lo = j < 8 ? (ldg(s + j) & 0x0f) : (ldg(s + j - 8) >> 4);
        return lo | (((ldg(s + 8 + (j & 3)) >> (2 * (j >> 2))) & 3) << 4);
    }
    /* Elements e0 .. e0 + K - 1 of block b, within one 16-value sub-block and one run of
     * 32 consecutive qs bytes (e0 % 16 + K <= 16). */
    template <int K>
    GH_HD static void elems(const uint8_t * b, int e0, float * w) {
        const int j = e0 >> 4, sh = 2 * ((e0 >> 5) & 3), l = e0 & 31;
        const uint8_t * qs = b + QS + 32 * (e0 >> 7) + l;
        const float d = f16_bits(ld_u16(b + D));
        if constexpr (Q3) {
            const float dl = mul_rn(d, (float) (k3_scale(b + SC, j) - 32));
            const int hb = e0 >> 5; /* value v's bit 2: bit v / 32 of hmask[v % 32] */
GH_UNROLL()
            for (int i = 0; i < K; i++) {
                const int q = ((ldg(qs + i) >> sh) & 3) - (((ldg(b + l + i) >> hb) & 1) ? 0 : 4);
                w[i] = mul_rn(dl, (float) q);
            }
        } else {
            const int sc = ldg(b + j);
            const float dl = mul_rn(d, (float) (sc & 0x0f));
            const float ml = mul_rn(f16_bits(ld_u16(b + D + 2)), (float) (sc >> 4));
GH_UNROLL()
            for (int i = 0; i < K; i++) w[i] = sub_rn(mul_rn(dl, (float) ((ldg(qs + i) >> sh) & 3)), ml);
        }
    }
    GH_HD static float elem(const uint8_t * row, int64_t i) {
        float w;
        elems<1>(row + (i >> 8) * (int64_t) bytes, (int) (i & 255), &w);
        return w;
    }
    /* elements 8p .. 8p + 7 of block u / 32, p = u % 32 (half a sub-block) */
    GH_HD static void unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
        const int64_t blk = u >> 5;
        const int p = (int) (u & 31);
        elems<8>(row + blk * (int64_t) bytes, 8 * p, w);
        o0 = QK_K * blk + 8 * p;
        o1 = o0 + 4;
    }
};
template <> struct dev_type<GH_TYPE_Q2_K> : k_low2<GH_TYPE_Q2_K> {};
template <> struct dev_type<GH_TYPE_Q3_K> : k_low2<GH_TYPE_Q3_K> {};
static_assert((size_t) k_low2<GH_TYPE_Q2_K>::D == offsetof(block_q2_K, d), "q2_K layout");
static_assert((size_t) k_low2<GH_TYPE_Q3_K>::SC == offsetof(block_q3_K, scales), "q3_K layout");
static_assert((size_t) k_low2<GH_TYPE_Q3_K>::D == offsetof(block_q3_K, d), "q3_K layout");

/* ---- the non-linear 4-bit types: 16 int8 levels indexed by a nibble ---- */

/* A level table as two words, level i byte i % 8 of word i / 8: reading a level is a
 * register shift, where an indexed table would be a memory access per value (divergent
 * across a warp's lanes). */
struct levels16 {
    uint64_t lo, hi;
};
GH_HD int level_of(const levels16 & t, int q) {
    return (int) (int8_t) (uint8_t) ((q & 8 ? t.hi : t.lo) >> (8 * (q & 7)));
}
inline levels16 pack_levels(const int8_t k[16]) {
    levels16 t{0, 0};
    for (int i = 0; i < 8; i++) {
        t.lo |= (uint64_t) (uint8_t) k[i] << (8 * i);
        t.hi |= (uint64_t) (uint8_t) k[i + 8] << (8 * i);
    }
    return t;
}
/* The tables' one home is types_iq4.c (gh_kvalues_iq4nl, gh_kvalues_mxfp4): the device
 * copy c_levels is written from them when a backend opens its device
 * (upload_levels, backend_cuda.cu); host code (cuda_emu.cu) reads them directly. */
enum { LEVELS_IQ4NL, LEVELS_MXFP4, N_LEVELS };
__constant__ levels16 c_levels[N_LEVELS];
inline void host_levels(levels16 out[N_LEVELS]) {
    out[LEVELS_IQ4NL] = pack_levels(gh_kvalues_iq4nl);
    out[LEVELS_MXFP4] = pack_levels(gh_kvalues_mxfp4);
}
GH_HD levels16 levels(int which) {
#ifdef __CUDA_ARCH__
    return c_levels[which];
#else
    return pack_levels(which == LEVELS_MXFP4 ? gh_kvalues_mxfp4 : gh_kvalues_iq4nl);
#endif
}

/* The blocks (types/iq4.h): 32-value groups of nibbles laid out as Q4_0's (element j < 16
 * of a group the low nibble of its byte j, j + 16 the high one), x = s * level[nibble]
 * with the group's scale s, each product rounded once as types_iq4.c computes it. A spec
 * S gives block, bytes, align, the table, QS (the first group's 16 bytes; group g's at
 * QS + 16 g) and scale(b, g). */
struct iq4_nl_spec {
    static constexpr int block = 32, bytes = (int) sizeof(block_iq4_nl), align = 2, QS = 2;
    static constexpr int LEVELS = LEVELS_IQ4NL;
    GH_HD static float scale(const uint8_t * b, int) { return f16_bits(ld_u16(b)); }
};
/* 17-byte blocks: every other one starts at an odd address, so byte loads only (align 1) */
struct mxfp4_spec {
    static constexpr int block = 32, bytes = (int) sizeof(block_mxfp4), align = 1, QS = 1;
    static constexpr int LEVELS = LEVELS_MXFP4;
    /* 2^(e - 128) (gh_e8m0_to_fp32_half: e = 0, 1 the subnormals 2^-128, 2^-127) */
    GH_HD static float scale(const uint8_t * b, int) {
        const uint32_t e = ldg(b);
        return bits_to_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    }
};
/* { fp16 d; uint16 scales_h; uint8 scales_l[4]; qs[128] }: group g's scale d * (ls - 32),
 * ls's low 4 bits nibble g % 2 of scales_l[g / 2], its high 2 bits bits 2g of scales_h */
struct iq4_xs_spec {
    static constexpr int block = QK_K, bytes = (int) sizeof(block_iq4_xs), align = 2, QS = 8;
    static constexpr int LEVELS = LEVELS_IQ4NL;
    GH_HD static float scale(const uint8_t * b, int g) {
        const int lo = (ldg(b + 4 + g / 2) >> (4 * (g % 2))) & 0x0f;
        const int hi = (ld_u16(b + 2) >> (2 * g)) & 3;
        return mul_rn(f16_bits(ld_u16(b)), (float) ((lo | hi << 4) - 32));
    }
};
static_assert(offsetof(block_iq4_xs, qs) == (size_t) iq4_xs_spec::QS, "iq4_xs layout");
static_assert(offsetof(block_mxfp4, qs) == (size_t) mxfp4_spec::QS, "mxfp4 layout");

template <typename S> struct level4 {
    static constexpr int block = S::block, bytes = S::bytes, align = S::align;
    static constexpr bool is_float = false;
    static constexpr int BSH = block == 32 ? 5 : 8; /* log2(block) */
    /* bytes q[0..3] as one little-endian word */
    GH_HD static uint32_t word4(const uint8_t * q) {
        if constexpr (align >= 2) return (uint32_t) ld_u16(q) | (uint32_t) ld_u16(q + 2) << 16;
        else return (uint32_t) ldg(q) | (uint32_t) ldg(q + 1) << 8 | (uint32_t) ldg(q + 2) << 16 |
                    (uint32_t) ldg(q + 3) << 24;
    }
    GH_HD static float elem(const uint8_t * row, int64_t i) {
        const uint8_t * b = row + (i >> BSH) * (int64_t) bytes;
        const int e = (int) (i & (block - 1)), g = e >> 5, j = e & 31;
        const uint8_t byte = ldg(b + S::QS + 16 * g + (j & 15));
        const int q = j < 16 ? (byte & 0x0f) : (byte >> 4);
        return mul_rn(S::scale(b, g), (float) level_of(levels(S::LEVELS), q));
    }
    /* quarter p % 4 of group p / 4 of block u / (block / 8), p = u % (block / 8): bytes
     * 4 (p % 4) .. + 3 of the group, i.e. its elements 4 (p % 4) + i (low nibbles) and
     * 16 + 4 (p % 4) + i (high nibbles) */
    GH_HD static void unit(const uint8_t * row, int64_t u, float w[8], int64_t & o0, int64_t & o1) {
        const int64_t blk = u >> (BSH - 3);
        const int p = (int) (u & (block / 8 - 1)), g = p >> 2, pp = p & 3;
        const uint8_t * b = row + blk * (int64_t) bytes;
        const float s = S::scale(b, g);
        const levels16 t = levels(S::LEVELS);
        const uint32_t v = word4(b + S::QS + 16 * g + 4 * pp);
GH_UNROLL()
        for (int i = 0; i < 4; i++) {
            const int byte = (int) ((v >> (8 * i)) & 0xFFu);
            w[i] = mul_rn(s, (float) level_of(t, byte & 0x0f));
            w[4 + i] = mul_rn(s, (float) level_of(t, byte >> 4));
        }
        o0 = (int64_t) block * blk + 32 * g + 4 * pp;
        o1 = o0 + 16;
    }
};
template <> struct dev_type<GH_TYPE_IQ4_NL> : level4<iq4_nl_spec> {};
template <> struct dev_type<GH_TYPE_IQ4_XS> : level4<iq4_xs_spec> {};
template <> struct dev_type<GH_TYPE_MXFP4> : level4<mxfp4_spec> {};

/* ---- the list ---- */

template <int... Ts> struct type_list {
    static constexpr int ids[sizeof...(Ts)] = {Ts...};
    static constexpr int count = (int) sizeof...(Ts);
};

/* THE types the CUDA kernels read, in the order messages list them. */
using dev_types = type_list<GH_TYPE_F32, GH_TYPE_F16, GH_TYPE_BF16, GH_TYPE_Q8_0, GH_TYPE_Q4_0,
                            GH_TYPE_Q4_1, GH_TYPE_Q5_0, GH_TYPE_Q5_1, GH_TYPE_Q2_K, GH_TYPE_Q3_K,
                            GH_TYPE_Q4_K, GH_TYPE_Q5_K, GH_TYPE_Q6_K, GH_TYPE_IQ4_NL,
                            GH_TYPE_IQ4_XS, GH_TYPE_MXFP4>;

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
