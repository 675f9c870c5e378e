/* The IQ1/IQ2/IQ3 lattice types (layouts: types/iqlat.h): their codebooks, generated at
 * build time from the gguf package's tables (tools/gen_iq_grids.py), and the
 * dequantizers, bit for bit those of gguf.quants (every product is exact: iqlat.h).
 * There is no quantizer: llama.cpp's needs an importance matrix to be worth its bits, and
 * these types are read, not written (gh_quantize_row refuses them). */
#include "types/iqlat.h"

#if GH_IQ_GRIDS
#define GH_IQ_GRIDS_DEFINE
#include "iq_grids.h"

#include <string.h>

/* 8 values of grid point g (unsigned levels) times dl, signed by the bits of s. */
static inline void put8(float * y, float dl, uint64_t g, unsigned s) {
    for (int j = 0; j < 8; j++) y[j] = dl * (float) gh_grid8_u(g, j) * ((s >> j) & 1 ? -1.0f : 1.0f);
}

void gh_iq2_xxs_to_float(const void * src, float * dst, int64_t n) {
    const block_iq2_xxs * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        const uint8_t * q = (const uint8_t *) b[i].qs;
        for (int ib = 0; ib < QK_K / 32; ib++, dst += 32) {
            const uint32_t a1 = gh_le32(q + 8 * ib + 4);
            const float db = d * (0.5f + (float) (a1 >> 28)) * 0.25f;
            for (int k = 0; k < 4; k++) {
                put8(dst + 8 * k, db, gh_iq2xxs_grid[q[8 * ib + k]], gh_iq2_ksigns[(a1 >> (7 * k)) & 127]);
            }
        }
    }
}

void gh_iq2_xs_to_float(const void * src, float * dst, int64_t n) {
    const block_iq2_xs * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK_K / 8; l++, dst += 8) {
            const int s = (b[i].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0x0f;
            const float db = d * (0.5f + (float) s) * 0.25f;
            put8(dst, db, gh_iq2xs_grid[b[i].qs[l] & 511], gh_iq2_ksigns[b[i].qs[l] >> 9]);
        }
    }
}

void gh_iq2_s_to_float(const void * src, float * dst, int64_t n) {
    const block_iq2_s * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int l = 0; l < QK_K / 8; l++, dst += 8) {
            const int s = (b[i].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0x0f;
            const float db = d * (0.5f + (float) s) * 0.25f;
            const int idx = b[i].qs[l] | (((b[i].qh[l / 4] >> (2 * (l % 4))) & 3) << 8);
            put8(dst, db, gh_iq2s_grid[idx], b[i].qs[32 + l]);
        }
    }
}

void gh_iq3_xxs_to_float(const void * src, float * dst, int64_t n) {
    const block_iq3_xxs * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++, dst += 32) {
            const uint32_t a = gh_le32(b[i].qs + QK_K / 4 + 4 * ib);
            const float db = d * (0.5f + (float) (a >> 28)) * 0.5f;
            for (int k = 0; k < 4; k++) {
                const unsigned s = gh_iq2_ksigns[(a >> (7 * k)) & 127];
                for (int h = 0; h < 2; h++) {
                    const uint32_t g = gh_iq3xxs_grid[b[i].qs[8 * ib + 2 * k + h]];
                    for (int j = 0; j < 4; j++) {
                        dst[8 * k + 4 * h + j] = db * (float) gh_grid4_u(g, j) * ((s >> (4 * h + j)) & 1 ? -1.0f : 1.0f);
                    }
                }
            }
        }
    }
}

void gh_iq3_s_to_float(const void * src, float * dst, int64_t n) {
    const block_iq3_s * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const float db = d * (float) (1 + 2 * ((b[i].scales[ib / 2] >> (4 * (ib % 2))) & 0x0f));
            for (int m = 8 * ib; m < 8 * ib + 8; m++, dst += 4) {
                const int idx = b[i].qs[m] | (((b[i].qh[m / 8] >> (m % 8)) & 1) << 8);
                const uint32_t g = gh_iq3s_grid[idx];
                const unsigned s = b[i].signs[m / 2] >> (4 * (m % 2));
                for (int j = 0; j < 4; j++) dst[j] = db * (float) gh_grid4_u(g, j) * ((s >> j) & 1 ? -1.0f : 1.0f);
            }
        }
    }
}

#define IQ1_DELTA 0.125f

void gh_iq1_s_to_float(const void * src, float * dst, int64_t n) {
    const block_iq1_s * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const unsigned qh = b[i].qh[ib];
            const float dl = d * (float) (2 * ((qh >> 12) & 7) + 1);
            const float delta = qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA;
            for (int k = 0; k < 4; k++, dst += 8) {
                const uint64_t g = gh_iq1s_grid[b[i].qs[4 * ib + k] | (((qh >> (3 * k)) & 7) << 8)];
                for (int j = 0; j < 8; j++) dst[j] = dl * ((float) gh_grid8_s(g, j) + delta);
            }
        }
    }
}

void gh_iq1_m_to_float(const void * src, float * dst, int64_t n) {
    const block_iq1_m * b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = gh_fp16_to_fp32(gh_iq1_m_d(&b[i]));
        for (int l = 0; l < QK_K / 8; l++, dst += 8) {
            const unsigned h = (b[i].qh[l / 2] >> (4 * (l % 2))) & 0x0f;
            const float dl = d * (float) (2 * gh_iq1_m_scale(&b[i], l / 2) + 1);
            const float delta = h & 8 ? -IQ1_DELTA : IQ1_DELTA;
            const uint64_t g = gh_iq1s_grid[b[i].qs[l] | ((h & 7) << 8)];
            for (int j = 0; j < 8; j++) dst[j] = dl * ((float) gh_grid8_s(g, j) + delta);
        }
    }
}
#endif
