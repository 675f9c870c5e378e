/* The `auto` FFN mode: which mode a new context starts in (see auto_mode.h).
 *
 * The rule: a sparse mode (predictor or gate) is chosen only where its estimated time for
 * the FFN is below the dense FFN's. The estimate counts weight bytes, each at its path's
 * rate: the dense matmul's rate is 1; a gathered row-dot (gate/up over the active list)
 * reads at r_rows(d) of it, the column-sparse down (axpy over the list) at r_cols(d), and
 * the axpy over every row of down_t at r_dt: the kernel ratios measured at density d by
 * tools/bench_sparse_kernels.py. So (bytes: gate b_g, up b_u, down b_d, predictor b_p):
 *   sparse  b_p + d b_g / r_rows + d b_u / r_rows + d b_d / r_cols
 *   gate    b_g + d b_u / r_rows + d b_d / r_cols          (the gate stays dense)
 *   dense   b_g + b_u + b_d / r_dt
 * and the mode is kept iff its time is below dense's. r_dt is the dense path the file
 * actually runs: a sparse or gate file stores ffn_down_t, not ffn_down, so its dense FFN
 * runs down as the axpy over every row (forward.c, ffn_dense), which reads at well under
 * the dense matmul's rate; with ffn_down (not such a file) r_dt = 1. (Comparing with the
 * dense matmul instead charged the column path its whole gap to a matmul such a file never
 * runs, and kept dense where the file's mode was faster.) The density d is
 * what the file's calibration recorded: 1 - powerinfer.sparse.target_sparsity (gate files),
 * or the mean of the blk.N.ffn_freq neuron frequencies (predictor files). A file that
 * records no density keeps its mode (nothing to estimate from), and says so; so does one
 * whose weight types have no measured ratios at the SIMD level. */
#include "ffn/auto_mode.h"
#include "ffn/strategy.h"
#include "model/model.h"
#include "gguf/gguf.h"
#include "types/types.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Kernel ratios (path GB/s / dense matmul GB/s per byte read) at densities 10%, 50%, 90%
 * (rows, cols) and of the axpy over every row of down_t (dt), measured 2026-12-05 on an AMD
 * EPYC (Zen 4, 2 cores shared with ~8 other processes: medians of 11 alternating reps,
 * process CPU time, 1 thread) with
 *   PYTHONPATH=python python tools/bench_sparse_kernels.py --threads 1 --density 0.1,0.5,0.9 \
 *       --types f16,q8_0,q4_0,q4_1,q4_k,q6_k,iq4_xs --reps 11
 * (docs/BENCHMARKS.md, "Sparse kernel ratios again"). Each is the conservative one over the
 * two shapes (SmolLM2's 576 x 1536, and 2048 x 5632; the K-quants and IQ4_XS: the latter
 * only): the lowest rows and cols ratio (the sparse paths at their slowest) and the highest
 * dt (dense at its fastest), so a mode is kept only where it is faster on both shapes'
 * numbers. The old table (before the decode tiles' tail prefetch and the rows below) took
 * the lowest over 1 and 2 threads; 2-thread CPU times were not measurable on the shared
 * machine this time. A type not measured at the level has no estimate: the file's mode is
 * kept, as with no recorded density. Measured again after the whole down_t's int8 groups
 * got their prefetch and Q4_0/Q4_1 their VNNI form (docs/BENCHMARKS.md, "The whole down_t
 * axpy per byte read", same command with --paths cols,dt --simd avx512,avx2): the dt of
 * Q4_0, Q4_1, Q4_K and Q6_K and the cols of Q4_0 and Q4_1 at AVX-512 (the kernels that
 * changed); the other cells are the earlier run's. Q8_0's rows were measured again at
 * 20:49 the same way (--types q8_0 --paths rows --reps 11), after its gathered tile took
 * the next group into L1 (docs/BENCHMARKS.md, "The gathered rows per byte read"). Q8_0's
 * cols and dt at both levels were measured again at 21:17 after it got its int8 sixteen-row
 * forms (--types q8_0 --paths cols,dt --simd avx512,avx2 --reps 7, two runs: the lower
 * cols and the higher dt of the two; docs/BENCHMARKS.md, "Q8_0's int8 column forms"). */
typedef struct {
    int   type;
    float rows[3], cols[3];
    float dt; /* the axpy over every row of down_t (gh_op_matmul_t, one token) */
} ratio_row;

static const ratio_row RATIOS_AVX512[] = {
    { GH_TYPE_F16,    { 0.46f, 0.59f, 0.70f }, { 0.46f, 0.59f, 0.71f }, 1.11f },
    { GH_TYPE_Q8_0,   { 0.36f, 0.45f, 0.68f }, { 0.29f, 0.44f, 0.53f }, 0.75f },
    { GH_TYPE_Q4_0,   { 0.32f, 0.41f, 0.54f }, { 0.20f, 0.28f, 0.38f }, 0.46f },
    { GH_TYPE_Q4_1,   { 0.41f, 0.57f, 0.80f }, { 0.22f, 0.30f, 0.43f }, 0.48f },
    { GH_TYPE_Q4_K,   { 0.54f, 0.79f, 1.06f }, { 0.59f, 0.69f, 0.72f }, 0.71f },
    { GH_TYPE_Q6_K,   { 0.57f, 0.79f, 1.18f }, { 0.41f, 0.49f, 0.51f }, 0.50f },
    { GH_TYPE_IQ4_XS, { 0.59f, 0.82f, 1.09f }, { 0.48f, 0.51f, 0.52f }, 0.52f },
};
static const ratio_row RATIOS_AVX2[] = {
    { GH_TYPE_F16,    { 0.43f, 0.55f, 0.70f }, { 0.49f, 0.59f, 0.72f }, 0.94f },
    { GH_TYPE_Q8_0,   { 0.46f, 0.61f, 0.83f }, { 0.34f, 0.45f, 0.56f }, 0.71f },
    { GH_TYPE_Q4_0,   { 0.37f, 0.47f, 0.59f }, { 0.22f, 0.30f, 0.45f }, 0.54f },
    { GH_TYPE_Q4_1,   { 0.43f, 0.62f, 0.86f }, { 0.23f, 0.31f, 0.46f }, 0.52f },
    { GH_TYPE_Q4_K,   { 0.54f, 0.77f, 1.03f }, { 0.63f, 0.78f, 0.80f }, 0.76f },
    { GH_TYPE_Q6_K,   { 0.60f, 0.83f, 1.21f }, { 0.77f, 0.88f, 0.90f }, 0.78f },
    { GH_TYPE_IQ4_XS, { 0.69f, 0.90f, 1.05f }, { 0.52f, 0.55f, 0.57f }, 0.57f },
};

/* r at density d: linear between the measured points, flat outside them. */
static double interp3(const float v[3], double d) {
    static const double x[3] = { 0.1, 0.5, 0.9 };
    if (d <= x[0]) return v[0];
    if (d >= x[2]) return v[2];
    const int i = d < x[1] ? 0 : 1;
    return v[i] + (v[i + 1] - v[i]) * (d - x[i]) / (x[i + 1] - x[i]);
}

static double row_ratio(const ratio_row * r, int path, double density) {
    return path == GH_FFN_PATH_DT ? r->dt : interp3(path == GH_FFN_PATH_COLS ? r->cols : r->rows, density);
}

double gh_ffn_kernel_ratio(int type, int simd_level, int path, double density, bool * measured) {
    const ratio_row * t = simd_level >= GH_SIMD_AVX512 ? RATIOS_AVX512 : RATIOS_AVX2;
    const size_t n = simd_level >= GH_SIMD_AVX512 ? sizeof RATIOS_AVX512 / sizeof *t
                                                  : sizeof RATIOS_AVX2 / sizeof *t;
    if (measured) *measured = false;
    /* the scalar level has no table: its dense tiles and gathered rows are the same code per
     * row, but nothing was measured, so it takes the AVX2 table's guesses */
    double lo = INFINITY;
    for (size_t i = 0; i < n; i++) {
        const double r = row_ratio(&t[i], path, density);
        if (t[i].type == type) {
            if (measured) *measured = simd_level >= GH_SIMD_AVX2;
            return r;
        }
        lo = fmin(lo, r);
    }
    return lo;
}

static double weight_bytes(const gh_weight * w) { return (double) w->rows * (double) w->row_bytes; }

gh_status gh_ffn_auto_decide(const gh_ffn_auto_in * in, gh_ffn_auto_choice * out) {
    memset(out, 0, sizeof *out);
    out->mode = in->candidate;
    out->file_mode = in->candidate;
    out->density = in->density;
    out->est_time = 1.0;
    if (in->candidate == GH_FFN_DENSE) {
        snprintf(out->why, sizeof out->why, "dense: the file has no sparse mode");
        return GH_OK;
    }
    const char * name = in->candidate == GH_FFN_SPARSE ? "sparse" : "gate";
    if (!(in->density >= 0.0 && in->density <= 1.0)) {
        snprintf(out->why, sizeof out->why, "%s: the file records no density to estimate its speed from "
                 "(the file's mode is kept)", name);
        return GH_OK;
    }
    const double B = in->bytes_gate + in->bytes_up + in->bytes_down;
    if (!(B > 0)) return gh_fail(GH_ERR_INVALID_ARG, "gh_ffn_auto_decide: the FFN's bytes must be positive");
    bool m1, m2;
    const double d = in->density;
    /* an ungated FFN's "gate" rows are its up rows: read over the list in both modes */
    const double r_rows = gh_ffn_kernel_ratio(in->type_gate, in->simd_level, GH_FFN_PATH_ROWS, d, &m1);
    const double r_cols = gh_ffn_kernel_ratio(in->type_down, in->simd_level, GH_FFN_PATH_COLS, d, &m2);
    const double r_dt = in->dense_down_t ? gh_ffn_kernel_ratio(in->type_down, in->simd_level, GH_FFN_PATH_DT, 1.0, NULL)
                                         : 1.0;
    if (!m1 || !m2) {
        /* no measurement, no estimate: as with no recorded density */
        snprintf(out->why, sizeof out->why, "%s: no kernel ratios measured for %s at the %s level "
                 "(the file's mode is kept)", name, gh_type_name(m1 ? in->type_down : in->type_gate),
                 in->simd_level >= GH_SIMD_AVX512 ? "AVX-512" : in->simd_level >= GH_SIMD_AVX2 ? "AVX2" : "scalar");
        return GH_OK;
    }
    const double rows_t = d * in->bytes_up / r_rows, down_t = d * in->bytes_down / r_cols;
    const double dense = in->bytes_gate + in->bytes_up + in->bytes_down / r_dt;
    const double t = (in->candidate == GH_FFN_SPARSE ? in->bytes_pred + d * in->bytes_gate / r_rows + rows_t + down_t
                                                     : in->bytes_gate + rows_t + down_t) / dense;
    out->ratio_rows = r_rows;
    out->ratio_cols = r_cols;
    out->ratio_dt = r_dt;
    out->est_time = t;
    out->mode = t < 1.0 ? in->candidate : GH_FFN_DENSE;
    const char * isa = in->simd_level >= GH_SIMD_AVX512 ? "AVX-512" : in->simd_level >= GH_SIMD_AVX2 ? "AVX2" : "scalar";
    if (in->dense_down_t) {
        snprintf(out->why, sizeof out->why,
                 "%s: %s at density %.0f%% is estimated at %.2fx the dense FFN's time (dense runs "
                 "down_t whole; kernel ratios per byte read: rows %.2f, cols %.2f, down_t whole %.2f, %s)",
                 out->mode == GH_FFN_DENSE ? "dense" : name, name, 100.0 * d, t, r_rows, r_cols, r_dt, isa);
    } else {
        snprintf(out->why, sizeof out->why,
                 "%s: %s at density %.0f%% is estimated at %.2fx the dense FFN's time (kernel ratios per "
                 "byte read: rows %.2f, cols %.2f, %s)", out->mode == GH_FFN_DENSE ? "dense" : name, name,
                 100.0 * d, t, r_rows, r_cols, isa);
    }
    return GH_OK;
}

/* The density the file's calibration recorded, or -1. */
static double file_density(const gh_model * m, int candidate) {
    if (candidate == GH_FFN_GATE) {
        float s;
        bool err = false;
        if (gh_gguf_get_f32(m->gguf, "powerinfer.sparse.target_sparsity", &s, &err) && s >= 0.0f && s <= 1.0f) {
            return 1.0 - s;
        }
        return -1.0;
    }
    double sum = 0.0;
    int64_t n = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_freq", il);
        const gh_gguf_tensor * fq = gh_gguf_find_tensor(m->gguf, name);
        if (!fq) return -1.0;  /* (checked at load: f32 [n_ff] in [0, 1]) */
        for (int64_t i = 0; i < fq->ne[0]; i++) {
            float v;
            memcpy(&v, (const uint8_t *) fq->data + i * 4, 4);
            sum += v;
        }
        n += fq->ne[0];
    }
    return n > 0 ? sum / (double) n : -1.0;
}

/* The mode the file supports: sparse when every layer has a predictor and ffn_down_t,
 * else gate when it has the gate thresholds and ffn_down_t, else dense. */
/* the file's mode: the first strategy of the registry's default order the file can run */
static int file_mode(const gh_model * m) { return gh_ffn_default_mode(m); }

gh_status gh_ffn_auto_mode(const gh_model * m, int simd_level, gh_ffn_auto_choice * out) {
    const int candidate = file_mode(m);
    gh_ffn_auto_in in = { .candidate = candidate, .simd_level = simd_level, .density = -1.0 };
    if (candidate != GH_FFN_DENSE && m->hp.n_layer > 0) {
        const bool gated = m->hp.gated, moe = m->hp.n_expert > 0;
        /* (a mixture: its first layer with experts, past glm4moe's / dots1's dense ones) */
        const gh_layer * L = &m->layers[moe ? m->hp.n_dense_lead : 0];
        const gh_moe_layer * M = &L->moe;
        /* a mixture: one expert's FFN (each selected expert runs the strategy's list) */
        const gh_weight * g = moe ? &M->gate_exps : &L->gate, * u = moe ? &M->up_exps : &L->up,
                        * dt = moe ? &M->down_exps_t : &L->down_t;
        in.density = file_density(m, candidate);
        in.type_gate = g->type;
        in.type_down = dt->type;
        in.bytes_gate = weight_bytes(g);
        in.bytes_up = gated ? weight_bytes(u) : 0.0;
        in.bytes_down = weight_bytes(dt);
        in.bytes_pred = L->has_pred ? weight_bytes(&L->fc1) + weight_bytes(&L->fc2) : 0.0;
        in.dense_down_t = L->has_down_t; /* (always, for these modes: see file_mode) */
    }
    return gh_ffn_auto_decide(&in, out);
}

gh_status gh_model_ffn_auto(const gh_model * m, gh_ffn_auto_choice * out) {
    if (!m || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_model_ffn_auto: NULL argument");
    return gh_ffn_auto_mode(m, gh_simd_get(), out);
}
