/* ggml's IQ1/IQ2/IQ3 lattice types (layouts byte for byte; values as gguf.quants
 * dequantizes them). Super-blocks of 256 values; each group of 8 (IQ3: 4) values is one
 * point of a codebook grid, a sign pattern and a sub-block scale. The grids (and the
 * sign table) are not written here: tools/gen_iq_grids.py generates them at build time
 * from the gguf package's tables (gguf.quants), into the build tree's iq_grids.h. A build
 * without them (GH_IQ_GRIDS 0) keeps these types as layout rows only: refused by name.
 *
 *   IQ2_XXS { fp16 d; u16 qs[32] }                          66 bytes, 2.06 bits/value
 *       sub-block ib < 8 (32 values) = two u32: a0 = qs[4ib..], a1 = qs[4ib + 2..]; its
 *       four 8-value groups k take grid point byte k of a0 and the signs
 *       ksigns[(a1 >> 7k) & 127]; x = (d * (0.5 + (a1 >> 28)) * 0.25) * grid * sign
 *   IQ2_XS  { fp16 d; u16 qs[32]; u8 scales[8] }            74 bytes, 2.31
 *       group l < 32: grid point qs[l] & 511 (512 points), signs ksigns[qs[l] >> 9];
 *       16 values per 4-bit scale s (nibble l / 2 of scales[]): (d * (0.5 + s) * 0.25)
 *   IQ2_S   { fp16 d; u8 qs[64]; u8 qh[8]; u8 scales[8] }  82 bytes, 2.56
 *       group l: point qs[l] | ((qh[l / 4] >> 2 (l % 4)) & 3) << 8 (1024 points), its
 *       eight sign bits qs[32 + l] as they are; scales as IQ2_XS
 *   IQ3_XXS { fp16 d; u8 qs[64]; u32 scales_signs[8] }      98 bytes, 3.06
 *       4-value group m < 64: grid point qs[m] (256 points of 4); sub-block ib: signs and
 *       scale of a = scales_signs[ib] as IQ2_XXS's a1; x = (d * (0.5 + (a >> 28)) * 0.5) * ...
 *   IQ3_S   { fp16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4] }   110 bytes, 3.44
 *       group m: point qs[m] | ((qh[m / 8] >> m % 8) & 1) << 8 (512 points of 4); sign bit
 *       of value v: bit v % 8 of signs[v / 8]; 32 values per 4-bit scale s (nibble ib of
 *       scales[]): x = (d * (1 + 2 s)) * grid * sign
 *   IQ1_S   { fp16 d; u8 qs[32]; u16 qh[8] }                50 bytes, 1.56
 *       group l < 32 of sub-block ib = l / 4: point qs[l] | ((qh[ib] >> 3 (l % 4)) & 7) << 8
 *       (2048 points, values -1, 0, 1); x = (d * (2 ((qh[ib] >> 12) & 7) + 1)) *
 *       (grid + delta), delta = -1/8 if bit 15 of qh[ib] is set, else +1/8
 *   IQ1_M   { u8 qs[32]; u8 qh[16]; u16 scales[4] }         56 bytes, 1.75
 *       group l: point qs[l] | (h & 7) << 8, h nibble l % 2 of qh[l / 2], delta -1/8 if
 *       bit 3 of h is set; 16 values per 3-bit scale s (bits 3 (j % 4) of scales[j / 4],
 *       j = l / 2): x = (d * (2 s + 1)) * (grid + delta); the fp16 d is the top nibbles of
 *       scales[0..4) (scales[0]'s the lowest).
 * Every product above is exact in float (at most 22 significant bits), so any order of
 * the factors gives gguf.quants' values bit for bit. The dots take the K-quants' Q8_K
 * activations (llama.cpp's pairing): integer sums per group, the scales as integers
 * (IQ2: (2s + 1) / 8, IQ3_XXS: (2s + 1) / 4), IQ1's delta through the activations' sums. */
#ifndef GH_TYPES_IQLAT_H
#define GH_TYPES_IQLAT_H

#include "types/types.h"

#include <string.h>

/* generated in the build tree: GH_IQ_GRIDS (1: the codebooks are in). Code compiled outside
 * the library's build (the tests' CUDA emulation, which needs the layouts only) has no such
 * header and sees the types as built without their codebooks. */
#if defined(__has_include)
#if __has_include("iq_grids.h")
#include "iq_grids.h"
#endif
#endif
#ifndef GH_IQ_GRIDS
#define GH_IQ_GRIDS 0
#endif

typedef struct { uint16_t d; uint16_t qs[QK_K / 8]; } block_iq2_xxs;
typedef struct { uint16_t d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; } block_iq2_xs;
typedef struct { uint16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; } block_iq2_s;
typedef struct { uint16_t d; uint8_t qs[3 * QK_K / 8]; } block_iq3_xxs;
typedef struct {
    uint16_t d;
    uint8_t  qs[QK_K / 4];
    uint8_t  qh[QK_K / 32];
    uint8_t  signs[QK_K / 8];
    uint8_t  scales[QK_K / 64];
} block_iq3_s;
typedef struct { uint16_t d; uint8_t qs[QK_K / 8]; uint16_t qh[QK_K / 32]; } block_iq1_s;
typedef struct { uint8_t qs[QK_K / 8]; uint8_t qh[QK_K / 16]; uint8_t scales[QK_K / 32]; } block_iq1_m;
GH_STATIC_ASSERT(sizeof(block_iq2_xxs) == 66, "block_iq2_xxs layout");
GH_STATIC_ASSERT(sizeof(block_iq2_xs) == 74, "block_iq2_xs layout");
GH_STATIC_ASSERT(sizeof(block_iq2_s) == 82, "block_iq2_s layout");
GH_STATIC_ASSERT(sizeof(block_iq3_xxs) == 98, "block_iq3_xxs layout");
GH_STATIC_ASSERT(sizeof(block_iq3_s) == 110, "block_iq3_s layout");
GH_STATIC_ASSERT(sizeof(block_iq1_s) == 50, "block_iq1_s layout");
GH_STATIC_ASSERT(sizeof(block_iq1_m) == 56, "block_iq1_m layout");

#if GH_IQ_GRIDS
/* the generated codebooks (tools/gen_iq_grids.py says what each holds) */
extern const uint64_t gh_iq2xxs_grid[256];
extern const uint64_t gh_iq2xs_grid[512];
extern const uint64_t gh_iq2s_grid[1024];
extern const uint32_t gh_iq3xxs_grid[256];
extern const uint32_t gh_iq3s_grid[512];
extern const uint64_t gh_iq1s_grid[2048];
extern const uint8_t  gh_iq2_ksigns[128];
extern const uint64_t gh_iq2_signs64[128];

/* Value j (< 8) of a grid point as an int (IQ1's bytes are signed). */
static inline int gh_grid8_u(uint64_t g, int j) { return (int) ((g >> (8 * j)) & 0xff); }
static inline int gh_grid8_s(uint64_t g, int j) { return (int) (int8_t) ((g >> (8 * j)) & 0xff); }
static inline int gh_grid4_u(uint32_t g, int j) { return (int) ((g >> (8 * j)) & 0xff); }

/* A little-endian u32 at p (IQ3_XXS's scale-and-sign words sit at an odd offset). */
static inline uint32_t gh_le32(const void * p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* IQ1_M's fp16 d from the top nibbles of its four scale words. */
static inline uint16_t gh_iq1_m_d(const block_iq1_m * b) {
    uint16_t s[4];
    memcpy(s, b->scales, 8);
    return (uint16_t) ((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000));
}

/* IQ1_M's 3-bit scale j < 16 (16 values each). */
static inline int gh_iq1_m_scale(const block_iq1_m * b, int j) {
    uint16_t s;
    memcpy(&s, b->scales + 2 * (j / 4), 2);
    return (s >> (3 * (j % 4))) & 7;
}

/* The rows' dequantizers (types_iqlat.c), bit-identical to gguf.quants. */
void gh_iq2_xxs_to_float(const void * src, float * dst, int64_t n);
void gh_iq2_xs_to_float(const void * src, float * dst, int64_t n);
void gh_iq2_s_to_float(const void * src, float * dst, int64_t n);
void gh_iq3_xxs_to_float(const void * src, float * dst, int64_t n);
void gh_iq3_s_to_float(const void * src, float * dst, int64_t n);
void gh_iq1_s_to_float(const void * src, float * dst, int64_t n);
void gh_iq1_m_to_float(const void * src, float * dst, int64_t n);
#endif

#endif
