/* The CUDA kernels' row math (ggml-hybrid/src/backend/cuda/rows.cuh, dev_types.cuh) run on
 * the CPU, no GPU needed: test_cuda_emu.py builds this with nvcc against the runtime library
 * and runs it.
 *
 * For every type of the device's list (dev_types), against the runtime's type table and
 * its dequantizer (gh_dequantize_row, itself bit for bit gguf.quants' dequantization:
 * tests/ops/test_types_matmul.py): the block and bytes agree with the table; every element
 * read (dev_type::elem, the down kernel's) and every unit read (dev_type::unit, the row
 * dots') is bit for bit the dequantized value, on the quantizer's blocks and on blocks of
 * random bytes, and the units cover each element of a row exactly once. A warp's work is replayed lane by lane: row_dot for lanes 0..31 gives
 * the 32 partial sums that the kernels reduce with shuffles, so their total must be the
 * dot product of the dequantized row with x (the vector and the element paths, 1 and
 * several tokens, odd widths). Also the activations against double precision formulas,
 * and the down kernel's slicing of row lists.
 *
 * What the host replay cannot see: FMA contraction of the device compiler (the host code
 * has no FMA here); dev_types.cuh's mul_rn/add_rn pin it, and test_cuda_ops.py checks the
 * kernels on a GPU.
 *
 * Prints one line per failure and a summary; exit status 0 = all passed. */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <vector>

extern "C" {
#include "types/types.h"
#include "types/iq4.h"
}

#include "backend/cuda/rows.cuh"

using namespace gh_cuda;

static int n_checks = 0, n_fail = 0;

#define CHECK(cond, ...)                                \
    do {                                                \
        n_checks++;                                     \
        if (!(cond)) {                                  \
            if (n_fail++ < 40) {                        \
                printf("FAIL %s:%d: ", __FILE__, __LINE__); \
                printf(__VA_ARGS__);                    \
                printf("\n");                           \
            }                                           \
        }                                               \
    } while (0)

static const char * tname(int t) { return gh_type_name(t); }

/* 64-byte aligned zeroed buffer */
struct abuf {
    void * p;
    explicit abuf(size_t bytes) {
        p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        memset(p, 0, (bytes + 63) / 64 * 64);
    }
    ~abuf() { free(p); }
    abuf(const abuf &) = delete;
    abuf & operator=(const abuf &) = delete;
};

/* Replays one warp: sum over lanes of row_dot's partials, for tokens t < nt. */
template <int T, bool VEC, int NT>
static void warp_dot(const uint8_t * row, int64_t cols, const float * x, int64_t ldx, int nt,
                     double out[NT]) {
    for (int t = 0; t < NT; t++) out[t] = 0.0;
    for (int lane = 0; lane < WARP; lane++) {
        float acc[NT];
        for (int t = 0; t < NT; t++) acc[t] = 0.0f;
        row_dot<T, VEC, NT>(row, cols, x, ldx, nt, lane, acc);
        for (int t = 0; t < NT; t++) out[t] += acc[t];
    }
}

template <int T, bool VEC, int NT>
static void check_dots(const uint8_t * w, size_t row_bytes, const std::vector<float> & wd,
                       int64_t rows, int64_t cols, const float * x, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t t0 = 0; t0 < n; t0 += NT) {
            const int nt = (int) (n - t0 < NT ? n - t0 : NT);
            double got[NT];
            warp_dot<T, VEC, NT>(w + r * row_bytes, cols, x + t0 * cols, cols, nt, got);
            for (int t = 0; t < nt; t++) {
                double ref = 0.0, mag = 0.0;
                for (int64_t c = 0; c < cols; c++) {
                    const double p = (double) wd[r * cols + c] * x[(t0 + t) * cols + c];
                    ref += p;
                    mag += fabs(p);
                }
                const double err = fabs(got[t] - ref);
                CHECK(err <= 1e-6 * mag + 1e-30,
                      "%s %s NT=%d rows=%lld cols=%lld r=%lld t=%lld: got %.9g want %.9g "
                      "(|err| %.3g, scale %.3g)", tname(T), VEC ? "vec" : "elem", NT,
                      (long long) rows, (long long) cols, (long long) r, (long long) (t0 + t),
                      got[t], ref, err, mag);
            }
        }
    }
}

/* The same bits, or both NaN (random blocks: a NaN scale's payload is not the format's). */
static bool same(float a, float b) { return memcmp(&a, &b, sizeof a) == 0 || (a != a && b != b); }

/* Every unit of a row: its 8 values bit for bit the dequantized ones, each element of the
 * row read by exactly one unit. */
template <int T>
static void check_units(const uint8_t * row, const float * wd, int64_t cols) {
    std::vector<int> seen(cols, 0);
    for (int64_t u = 0; u < cols / 8; u++) {
        float w[8];
        int64_t o0 = -1, o1 = -1;
        dev_type<T>::unit(row, u, w, o0, o1);
        const bool in = o0 >= 0 && o1 >= 0 && o0 % 4 == 0 && o1 % 4 == 0 && o0 + 4 <= cols &&
                        o1 + 4 <= cols;
        CHECK(in, "%s unit %lld of %lld columns: offsets %lld, %lld", tname(T), (long long) u,
              (long long) cols, (long long) o0, (long long) o1);
        if (!in) continue;
        for (int i = 0; i < 8; i++) {
            const int64_t c = (i < 4 ? o0 : o1) + (i & 3);
            seen[c]++;
            CHECK(same(w[i], wd[c]), "%s unit %lld w[%d] (column %lld): "
                  "%.9g vs %.9g", tname(T), (long long) u, i, (long long) c, w[i], wd[c]);
        }
    }
    for (int64_t c = 0; c < cols; c++) {
        CHECK(seen[c] == 1, "%s: column %lld of %lld read by %d units", tname(T), (long long) c,
              (long long) cols, seen[c]);
    }
}

/* Rows of random bytes (every scale, sub-block scale, high-bit and level pattern, where the
 * quantizer's blocks cover only what it writes): the element and unit reads equal the
 * runtime's dequantizer on them too. */
template <int T>
static void check_random_blocks(std::mt19937 & rng) {
    using D = dev_type<T>;
    const int64_t rows = 7, cols = 9 * D::block;
    const size_t rb = gh_row_size(T, cols);
    abuf wq(rb * rows);
    uint8_t * w = static_cast<uint8_t *>(wq.p);
    for (size_t i = 0; i < rb * rows; i++) w[i] = (uint8_t) rng();
    std::vector<float> wd(rows * cols);
    for (int64_t r = 0; r < rows; r++) {
        CHECK(gh_dequantize_row(T, w + r * rb, &wd[r * cols], cols) == GH_OK, "dequantize");
        for (int64_t c = 0; c < cols; c++) {
            const float got = D::elem(w + r * rb, c), want = wd[r * cols + c];
            CHECK(same(got, want), "%s random elem r=%lld c=%lld: %.9g vs %.9g", tname(T),
                  (long long) r, (long long) c, got, want);
        }
        check_units<T>(w + r * rb, &wd[r * cols], cols);
    }
}

template <int T>
static void check_type(std::mt19937 & rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    using D = dev_type<T>;
    const bool quant = !D::is_float;
    /* the device's block and bytes are the type table's */
    CHECK(gh_type_block_size(T) == D::block && gh_type_row_size(T, D::block) == (size_t) D::bytes,
          "%s: the device reads blocks of %d values in %d bytes, the type table says %lld in %zu",
          tname(T), D::block, D::bytes, (long long) gh_type_block_size(T),
          gh_type_row_size(T, gh_type_block_size(T)));
    /* whole blocks for block types (1, 3, 9 of them and one more than 4096 values) */
    std::vector<int64_t> widths = {D::block, 3 * D::block, 9 * D::block, 4096 + D::block};
    if (!quant) {
        widths = {32, 96, 288, 4096 + 32};
        for (int64_t c : {1, 7, 8, 37, 40, 100, 264}) widths.push_back(c);
    }
    for (int64_t cols : widths) {
        const int64_t rows = 5, n = 11;
        const size_t rb = gh_row_size(T, cols);
        CHECK(rb > 0, "%s: row size of %lld", tname(T), (long long) cols);
        if (!rb) continue;
        abuf wq(rb * rows), xb(sizeof(float) * n * cols);
        std::vector<float> src(rows * cols), wd(rows * cols);
        for (auto & v : src) v = nd(rng);
        uint8_t * w = static_cast<uint8_t *>(wq.p);
        for (int64_t r = 0; r < rows; r++) {
            CHECK(gh_quantize_row(T, &src[r * cols], w + r * rb, cols) == GH_OK, "quantize");
            CHECK(gh_dequantize_row(T, w + r * rb, &wd[r * cols], cols) == GH_OK, "dequantize");
        }
        float * x = static_cast<float *>(xb.p);
        for (int64_t i = 0; i < n * cols; i++) x[i] = nd(rng);

        /* the element reads of the down kernel: exact */
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t c = 0; c < cols; c++) {
                const float got = D::elem(w + r * rb, c), want = wd[r * cols + c];
                CHECK(memcmp(&got, &want, sizeof got) == 0, "%s elem r=%lld c=%lld: %.9g vs %.9g",
                      tname(T), (long long) r, (long long) c, got, want);
            }
        }
        /* the unit path where the backend takes it (float_vec_ok: 8 | cols, 16-byte rows;
         * quantized: always), the element path for any float row */
        const bool vec_ok = quant || (cols % 8 == 0 && rb % 16 == 0);
        if (vec_ok) {
            for (int64_t r = 0; r < rows; r++) check_units<T>(w + r * rb, &wd[r * cols], cols);
            check_dots<T, true, 1>(w, rb, wd, rows, cols, x, n);
            check_dots<T, true, MM_TOK>(w, rb, wd, rows, cols, x, n);
        }
        if constexpr (D::is_float) {
            check_dots<T, false, 1>(w, rb, wd, rows, cols, x, n);
            check_dots<T, false, MM_TOK>(w, rb, wd, rows, cols, x, n);
        }
    }
    if constexpr (!D::is_float) check_random_blocks<T>(rng);
}

static double act_ref(int act, double t, double g, double u) {
    switch (act) {
    case GH_ACT_RELU: return g > 0 ? g * u : 0.0;
    case GH_ACT_FATRELU: return g > t ? g * u : 0.0;
    case GH_ACT_DRELU: return g > 0 && u > 0 ? g * u : 0.0;
    case GH_ACT_GELU:
        return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u;
    case GH_ACT_GELU_ERF: return 0.5 * g * (1.0 + erf(g / sqrt(2.0))) * u;
    default: return g / (1.0 + exp(-g)) * u;
    }
}

static void check_acts() {
    const float t = 0.29f; /* FATReLU's threshold (the others ignore it) */
    for (int act = GH_ACT_SILU; act <= GH_ACT_FATRELU; act++) {
        for (float g = -12.0f; g <= 12.0f; g += 0.37f) {
            for (float u : {-3.5f, -1.0f, -0.0f, 0.25f, 1.0f, 2.0f}) {
                const double want = act_ref(act, t, g, u), got = act_glu(act, t, g, u);
                CHECK(fabs(got - want) <= 2e-6 * fabs(want) + 1e-6 * fabs(u),
                      "act %d g=%g u=%g: %.9g vs %.9g", act, g, u, got, want);
            }
        }
    }
}

static void check_slices() {
    for (int64_t d_out : {1LL, 96LL, 4096LL, 8192LL, 1LL << 20}) {
        for (int64_t n_rows = 0; n_rows < 5000; n_rows += n_rows < 300 ? 1 : 97) {
            int64_t s, chunk;
            down_slices(n_rows, d_out, &s, &chunk);
            if (n_rows == 0) {
                CHECK(s == 0, "no rows, %lld slices", (long long) s);
                continue;
            }
            CHECK(s >= 1 && s <= DOWN_MAX_SLICES && chunk >= 1,
                  "n_rows %lld d_out %lld: %lld slices of %lld", (long long) n_rows,
                  (long long) d_out, (long long) s, (long long) chunk);
            /* the slices [i*chunk, min((i+1)*chunk, n)) cover the list, none empty */
            CHECK(s * chunk >= n_rows && (s - 1) * chunk < n_rows,
                  "n_rows %lld: %lld slices of %lld do not tile it", (long long) n_rows,
                  (long long) s, (long long) chunk);
        }
    }
}

int main() {
    std::mt19937 rng(1234);
    /* every type the device reads, from its one list */
    for_each_dev_type([&](auto t) {
        const int n0 = n_fail;
        check_type<decltype(t)::value>(rng);
        printf("%s: %s\n", tname(t.value), n_fail == n0 ? "ok" : "FAILED");
    });
    /* the types the runtime reads that the device does not: they run on the CPU only
     * (a weight of one is refused by the CUDA backend, by name) */
    printf("runtime types the CUDA kernels do not read:");
    int missing = 0;
    for (int t = 0; t < GH_TYPE_COUNT; t++) {
        const bool listed = with_dev_type(t, [](auto) {});
        if (gh_type_block_size(t) > 0 && !listed) {
            printf(" %s", tname(t));
            missing++;
        }
    }
    printf("%s\n", missing ? "" : " none");
    check_acts();
    check_slices();
    printf("cuda_emu: %d checks, %d failed\n", n_checks, n_fail);
    return n_fail ? 1 : 0;
}
