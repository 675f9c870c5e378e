/* The non-linear 4-bit types (ggml's layouts, byte for byte; values as gguf.quants
 * dequantizes them):
 *   IQ4_NL: { fp16 d; uint8 qs[16] }                                   18 bytes / 32
 *          x = d * kvalues_iq4nl[nibble]; element j < 16 is the low nibble of qs[j],
 *          element j + 16 its high nibble (as Q4_0).
 *   IQ4_XS: { fp16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128] }  136 bytes / 256
 *          8 sub-blocks of 32: x = (d * (ls - 32)) * kvalues_iq4nl[nibble], ls 6-bit:
 *          low 4 bits the nibble ib % 2 of scales_l[ib / 2], high 2 bits bits 2ib..2ib+1
 *          of scales_h; sub-block ib's nibbles are qs[16 ib .. 16 ib + 16) as IQ4_NL's.
 *   MXFP4:  { uint8 e; uint8 qs[16] }                                  17 bytes / 32
 *          x = 2^(e - 128) * kvalues_mxfp4[nibble] (e8m0 scale, halved because the e2m1
 *          values are stored doubled, so every level is an integer); nibbles as IQ4_NL.
 * Every level is an int8, so a dot is a byte-table lookup of the nibbles and an integer
 * dot with the 8-bit activations: IQ4_NL and MXFP4 take Q8_X4's 32-value blocks, IQ4_XS
 * the K-quants' Q8_K. */
#ifndef GH_TYPES_IQ4_H
#define GH_TYPES_IQ4_H

#include "types/types.h"

#include <string.h>

typedef struct { uint16_t d; uint8_t qs[16]; } block_iq4_nl;
typedef struct {
    uint16_t d;
    uint16_t scales_h;
    uint8_t  scales_l[QK_K / 64];
    uint8_t  qs[QK_K / 2];
} block_iq4_xs;
typedef struct { uint8_t e; uint8_t qs[16]; } block_mxfp4;
GH_STATIC_ASSERT(sizeof(block_iq4_nl) == 18, "block_iq4_nl layout");
GH_STATIC_ASSERT(sizeof(block_iq4_xs) == 136, "block_iq4_xs layout");
GH_STATIC_ASSERT(sizeof(block_mxfp4) == 17, "block_mxfp4 layout");

/* The 16 levels of IQ4_NL / IQ4_XS (ascending) and MXFP4's e2m1 values doubled (index
 * 8..15 the negatives of 0..7). */
extern const int8_t gh_kvalues_iq4nl[16];
extern const int8_t gh_kvalues_mxfp4[16];

/* 2^(e - 128): half the e8m0 scale 2^(e - 127) (e = 0, 1: the subnormals 2^-128, 2^-127). */
static inline float gh_e8m0_to_fp32_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t) (e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The signed scale ls - 32 (-32..31) of IQ4_XS sub-block ib < 8. */
static inline int gh_iq4_xs_scale(const block_iq4_xs * b, int ib) {
    const int lo = (b->scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
    const int hi = (b->scales_h >> (2 * ib)) & 3;
    return (lo | hi << 4) - 32;
}

/* The rows' conversions (types_iq4.c): to_float bit-identical to gguf.quants; from_float
 * MXFP4's that of gguf.quants / ggml byte for byte, IQ4_NL / IQ4_XS our own. */
void gh_iq4_nl_to_float(const void * src, float * dst, int64_t n);
void gh_iq4_nl_from_float(const float * src, void * dst, int64_t n);
void gh_iq4_xs_to_float(const void * src, float * dst, int64_t n);
void gh_iq4_xs_from_float(const float * src, void * dst, int64_t n);
void gh_mxfp4_to_float(const void * src, float * dst, int64_t n);
void gh_mxfp4_from_float(const float * src, void * dst, int64_t n);

#endif
