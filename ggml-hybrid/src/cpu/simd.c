/* CPU feature detection, the SIMD level the kernels run at, and the selection of the
 * kernel table (cpu/kernels.h): the one place that asks what this CPU can do.
 *
 * Levels: scalar (always), AVX2 (AVX2 + FMA + F16C, OS saves YMM state), AVX-512
 * (F, BW, VL, DQ, VNNI, VBMI, BF16, GFNI, OS saves ZMM state). The environment variable
 * GH_SIMD=scalar|avx2|avx512 caps the level chosen at start-up; gh_simd_set changes
 * it later (tests). */
#include "core/common.h"
#include "cpu/kernels.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(GH_X86)
#include <cpuid.h>

static uint64_t read_xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t) hi << 32) | lo;
}

static int detect_level(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return GH_SIMD_SCALAR;
    const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
    const bool fma = c & (1u << 12), f16c = c & (1u << 29);
    if (!osxsave || !avx) return GH_SIMD_SCALAR;
    const uint64_t xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) return GH_SIMD_SCALAR;           /* XMM + YMM state */
    if (__get_cpuid_max(0, NULL) < 7) return GH_SIMD_SCALAR;
    unsigned a7, b7, c7, d7;
    __cpuid_count(7, 0, a7, b7, c7, d7);
    const bool avx2 = b7 & (1u << 5);
    if (!(avx2 && fma && f16c)) return GH_SIMD_SCALAR;
    int level = GH_SIMD_AVX2;
    const bool zmm_state = (xcr0 & 0xe0) == 0xe0;              /* opmask + ZMM state */
    const bool f = b7 & (1u << 16), dq = b7 & (1u << 17), bw = b7 & (1u << 30);
    const bool vl = b7 & (1u << 31), vbmi = c7 & (1u << 1), vnni = c7 & (1u << 11);
    const bool gfni = c7 & (1u << 8);
    bool bf16 = false;
    if (a7 >= 1) {
        unsigned a71, b71, c71, d71;
        __cpuid_count(7, 1, a71, b71, c71, d71);
        bf16 = a71 & (1u << 5);
    }
    if (zmm_state && f && dq && bw && vl && vbmi && vnni && bf16 && gfni) level = GH_SIMD_AVX512;
    return level;
}

static bool detect_amd(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    return b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
}
#else
static int detect_level(void) { return GH_SIMD_SCALAR; }
static bool detect_amd(void) { return false; }
#endif

/* ---- the kernel table in use ---- */

static gh_kernel_set g_kernels[GH_TYPE_COUNT];
static bool g_amd;

/* Lay one level's row over the row built so far (the rules: cpu/kernels.h). */
static void overlay(gh_kernel_set * k, const gh_kernel_set * l) {
    if (l->gemm) {
        k->vec_dot = l->vec_dot;
        k->from_float_x = l->from_float_x;
        k->gemm = l->gemm;
        k->mr = l->mr;
        k->nt = l->nt;
        k->mr1 = l->mr1;
        k->dot4 = l->dot4;
    }
    if (l->axpy) k->axpy = l->axpy;
    if (l->axpy4) k->axpy4 = l->axpy4;
    if (l->axpy4pf) k->axpy4pf = l->axpy4pf;
    if (l->axpy16) k->axpy16 = l->axpy16;
    if (l->matmul16) k->matmul16 = l->matmul16;
    if (l->tiles) k->tiles = l->tiles;
}

static void select_kernels(int level) {
    for (int t = 0; t < GH_TYPE_COUNT; t++) {
        gh_kernel_set k = { 0 };
        overlay(&k, &gh_dot_rows_scalar[t]);
        overlay(&k, &gh_axpy_rows_scalar[t]);
#if defined(GH_X86)
        if (level >= GH_SIMD_AVX2) {
            overlay(&k, &gh_dot_rows_avx2[t]);
            overlay(&k, &gh_axpy_rows_avx2[t]);
        }
        if (level >= GH_SIMD_AVX512) {
            overlay(&k, t == GH_TYPE_F16 && g_amd ? &gh_dot_row_avx512_f16_streamed : &gh_dot_rows_avx512[t]);
            overlay(&k, &gh_axpy_rows_avx512[t]);
        }
#endif
        g_kernels[t] = k;
    }
}

const gh_kernel_set * gh_kernels_get(int type) {
    if (!gh_type_traits_get(type)) return NULL;
    gh_simd_ensure_init();
    return g_kernels[type].gemm ? &g_kernels[type] : NULL;
}

static int g_supported = GH_SIMD_SCALAR;
static atomic_int g_level = GH_SIMD_SCALAR;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_set_mutex = PTHREAD_MUTEX_INITIALIZER;

static void simd_init(void) {
    g_supported = detect_level();
    g_amd = detect_amd();
    int level = g_supported;
    const char * env = getenv("GH_SIMD");
    if (env) {
        int want = -1;
        if (strcmp(env, "scalar") == 0) want = GH_SIMD_SCALAR;
        else if (strcmp(env, "avx2") == 0) want = GH_SIMD_AVX2;
        else if (strcmp(env, "avx512") == 0) want = GH_SIMD_AVX512;
        if (want >= 0 && want < level) level = want;
    }
    atomic_store(&g_level, level);
    select_kernels(level);
}

void gh_simd_ensure_init(void) { pthread_once(&g_once, simd_init); }

int gh_simd_supported(void) {
    gh_simd_ensure_init();
    return g_supported;
}

int gh_simd_get(void) {
    gh_simd_ensure_init();
    return atomic_load(&g_level);
}

/* Not meant to race with running kernels: tests switch levels between calls. */
int gh_simd_set(int level) {
    gh_simd_ensure_init();
    if (level == GH_SIMD_AUTO) level = g_supported;
    if (level < GH_SIMD_SCALAR || level > g_supported) return -2;
    pthread_mutex_lock(&g_set_mutex);
    int prev = atomic_exchange(&g_level, level);
    select_kernels(level);
    pthread_mutex_unlock(&g_set_mutex);
    return prev;
}
