/* CPU kernels per type and SIMD level (internal): the kernel table. cpu/simd.c selects
 * the rows of the current level; every op reads them through gh_kernels_get().
 *
 * Every weight type has one kernel shape, a register tile ("gemm"): it computes
 *     y[t * ldy + r] = W[r] . X[t]      for r < nr, t < nt
 * with W rows `w_stride` bytes apart (in the weight's type) and X rows `x_stride`
 * bytes apart (already converted to the type's vec_dot_type). nr <= mr and nt <= nt
 * of the kernel set, or nt == 1 and nr <= mr1. A 1 x 1 tile is the vec_dot of the type table. */
#ifndef GH_KERNELS_H
#define GH_KERNELS_H

#include "types/types.h"

#include <string.h>

typedef void (*gh_gemm_fn)(int64_t n, const void * w, size_t w_stride, int nr,
                           const void * x, size_t x_stride, int nt, float * y, int64_t ldy);

/* Four gathered rows, one token (the sparse row-dots): y[r] = rows[r] . x for r < 4, each
 * row's value computed exactly as the type's four-row decode tile computes it (so it does
 * not depend on the other three rows: a short list pads with repeats). While it runs it
 * prefetches the rows pf[0..4) (the tile after next, say) into L2, a slice per step. */
typedef void (*gh_dot4_fn)(int64_t n, const void * const * rows, const void * const * pf,
                           const void * x, float * y);

/* The transposed matmul's forms (cpu/axpy.c runs them; each ISA file fills its rows).
 * y[0..n) += s * row, the row in the weight's type from a block boundary, n a multiple of
 * the block size. */
typedef void (*gh_axpy_fn)(int64_t n, float s, const void * row, float * y);
/* y[0..n) += s[0] * row[0] + ... + s[3] * row[3]: four rows per pass over y (decode). */
typedef void (*gh_axpy4_fn)(int64_t n, const float * s, const void * const * row, float * y);
/* The four-row form that also prefetches the same column range of the rows pf[0..4) into
 * L2, a slice per step (scattered list rows stream in while these are added); the sums
 * are those of the gh_axpy4_fn, bit for bit. */
typedef void (*gh_axpy4pf_fn)(int64_t n, const float * s, const void * const * row,
                              const void * const * pf, float * y);
/* Sixteen rows at once, y[0..n) += s[0] * row[0] + ... + s[15] * row[15], with the rows
 * pf[0..16) prefetched (pf may be NULL): the decode list's groups of 16, in int8 (the
 * scaled rows are quantized like the int8 dots' activations, so the sums differ from the
 * float forms' by that rounding; avx2/axpy_int8.h). */
typedef void (*gh_axpy16_fn)(int64_t n, const float * s, const void * const * row,
                             const void * const * pf, float * y);
/* The batch form of up to four groups of 16 rows: for t < n_tokens,
 * y[t * ldy + 0..n) += sum_{k < nk} h[t * ldh + hc[k]] * row[k][0..n), nk <= 64, each
 * token's sums those of the gh_axpy16_fn over the rows 16 at a time in order (the last
 * group padded as if with rows whose h is 0): a prompt's dense blocks. */
typedef void (*gh_matmul16_fn)(int64_t n, int64_t n_tokens, const float * h, int64_t ldh,
                               const int32_t * hc, int nk, const void * const * row, float * y,
                               int64_t ldy);
/* A dense block of a batch over rows already dequantized to f32 (buf, rows ldb floats
 * apart): y[t * ldy + c] += sum_{k < nk} h[t * ldh + rows[k]] * buf[k * ldb + c] for c < n,
 * t < n_tokens, each value through the same FMAs in the same row order as the f32 axpy
 * (so a batch equals its tokens bit for bit). The F32 row's form only. */
typedef void (*gh_tiles_fn)(int64_t n_tokens, const float * h, int64_t ldh, const int32_t * rows,
                            int64_t nk, const float * buf, int64_t ldb, int64_t n, float * y,
                            int64_t ldy);

/* A type's row of CPU kernels. Each ISA folder fills rows of two partial tables (its dot
 * file the dot family, its axpy file the axpy family; unnamed fields stay NULL), and
 * cpu/simd.c, the one place that detects the CPU and selects, builds the row in use:
 * the scalar rows, then each level up to the selected one laid over them —
 *   the dot family as one group (vec_dot, from_float_x, gemm and its tile sizes, dot4:
 *   the activation format goes with the kernels that read it), from the highest level
 *   whose row has a gemm;
 *   each axpy form on its own, from the highest level that has it (NULL at every level:
 *   the caller uses the next smaller form).
 * Adding a type: its row in types/types.c, and at each ISA its kernels and their rows. */
typedef struct {
    gh_vec_dot_fn    vec_dot;
    gh_from_float_fn from_float_x;  /* NULL when vec_dot_type is F32 (no conversion) */
    gh_gemm_fn       gemm;
    int              mr;            /* max rows of a tile */
    int              nt;            /* max tokens of a tile */
    int              mr1;           /* max rows of a one-token tile (decode) */
    gh_dot4_fn       dot4;          /* gathered four-row tile, or NULL (vec_dot per row) */

    gh_axpy_fn       axpy;          /* every type has one (the scalar row at least) */
    gh_axpy4_fn      axpy4;
    gh_axpy4pf_fn    axpy4pf;
    gh_axpy16_fn     axpy16;
    gh_matmul16_fn   matmul16;
    gh_tiles_fn      tiles;
} gh_kernel_set;

/* A row of a dot table. */
#define GH_DOT_ROW(dot, from_x, tile, MR, NT, MR1, d4) \
    { .vec_dot = dot, .from_float_x = from_x, .gemm = tile, .mr = MR, .nt = NT, .mr1 = MR1, .dot4 = d4 }

/* The partial tables, indexed by type id (cpu/scalar, cpu/avx2, cpu/avx512). */
extern const gh_kernel_set gh_dot_rows_scalar[GH_TYPE_COUNT];
extern const gh_kernel_set gh_axpy_rows_scalar[GH_TYPE_COUNT];
extern const gh_kernel_set gh_dot_rows_avx2[GH_TYPE_COUNT];
extern const gh_kernel_set gh_axpy_rows_avx2[GH_TYPE_COUNT];
extern const gh_kernel_set gh_dot_rows_avx512[GH_TYPE_COUNT];
extern const gh_kernel_set gh_axpy_rows_avx512[GH_TYPE_COUNT];
/* AVX-512 F16 rows read one after another instead of the interleaved tile (the
 * selection takes it on AMD parts; see kernels_avx512.c). */
extern const gh_kernel_set gh_dot_row_avx512_f16_streamed;
/* AVX2 F16 decode likewise (kernels_avx2.c, gemm_f16_streamed). */
extern const gh_kernel_set gh_dot_row_avx2_f16_streamed;

/* The kernels for `type` at the current SIMD level (initialises SIMD on first use);
 * NULL for a type without kernels. */
const gh_kernel_set * gh_kernels_get(int type);

/* Detect the CPU once (thread-safe) and select the kernels; called by every entry
 * point that uses the kernel table. */
void gh_simd_ensure_init(void);

/* The eight 6-bit scales and mins of a Q4_K/Q5_K block (gh_k4_scale_min for j = 0..7)
 * at once, as bytes: sub-block j's scale is byte j of sm[0..2), its min byte j of sm[2..4)
 * (little-endian words of the 12 scale bytes: the low 6 bits of bytes 0..3 / 4..7 are
 * sub-blocks 0..3's scales / mins, bytes 8..11 the low nibbles of 4..7's, whose top two
 * bits sit in the top bits of bytes 0..3 / 4..7). */
static inline void gh_k4_scales_mins(const uint8_t * q, uint32_t sm[4]) {
    uint32_t w[3];
    memcpy(w, q, sizeof(w));
    sm[0] = w[0] & 0x3f3f3f3fu;
    sm[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    sm[2] = w[1] & 0x3f3f3f3fu;
    sm[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
}

/* Scalar helpers shared by the kernel files. */
void gh_quantize_row_q8_x4_ref(const float * x, void * y, int64_t n);
void gh_quantize_row_q8_K_ref(const float * x, void * y, int64_t n);

#endif
