/* The `auto` FFN mode (auto_mode.c): the mode a new context starts in, chosen per file
 * and per machine (the SIMD level's measured kernel ratios), with the reason. The public
 * half (gh_ffn_auto_in, gh_ffn_auto_choice, gh_ffn_auto_decide, gh_model_ffn_auto) is in
 * ggml-hybrid.h. */
#ifndef GH_FFN_AUTO_MODE_H
#define GH_FFN_AUTO_MODE_H

#include "core/common.h"

/* The kernel ratio (path GB/s / dense matmul GB/s per byte read) of type at the SIMD level
 * and density: the gathered row-dots (path GH_FFN_PATH_ROWS), the column-sparse axpy
 * (GH_FFN_PATH_COLS) or the axpy over every row of down_t (GH_FFN_PATH_DT, density
 * ignored); *measured (may be NULL): whether the table has the type at the level (else the
 * level's lowest ratio, which the auto rule does not use). */
enum { GH_FFN_PATH_ROWS, GH_FFN_PATH_COLS, GH_FFN_PATH_DT };
double gh_ffn_kernel_ratio(int type, int simd_level, int path, double density, bool * measured);

/* The file's mode (sparse, gate or dense) kept only where estimated faster than dense. */
gh_status gh_ffn_auto_mode(const gh_model * m, int simd_level, gh_ffn_auto_choice * out);

#endif
