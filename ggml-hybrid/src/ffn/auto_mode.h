/* The `auto` FFN mode (auto_mode.c): the mode a new context starts in, chosen per file
 * and per machine (the SIMD level's measured kernel ratios), with the reason. The public
 * half (gh_ffn_auto_in, gh_ffn_auto_choice, gh_ffn_auto_decide, gh_model_ffn_auto) is in
 * ggml-hybrid.h. */
#ifndef GH_FFN_AUTO_MODE_H
#define GH_FFN_AUTO_MODE_H

#include "core/common.h"

/* The kernel ratio (sparse GB/s / dense GB/s per byte read) of type at the SIMD level and
 * density: the gathered row-dots (cols_path 0) or the column-sparse axpy (1); *measured
 * (may be NULL): whether the table has the type at the level (else the level's lowest
 * ratio, which the auto rule does not use). */
double gh_ffn_kernel_ratio(int type, int simd_level, int cols_path, double density, bool * measured);

/* The file's mode (sparse, gate or dense) kept only where estimated faster than dense. */
gh_status gh_ffn_auto_mode(const gh_model * m, int simd_level, gh_ffn_auto_choice * out);

#endif
