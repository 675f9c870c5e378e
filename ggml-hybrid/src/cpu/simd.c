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
#include <stddef.h>
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

/* The partial tables by level (index = gh_simd level): the dot family's and the axpy
 * family's. */
static const gh_kernel_set * const DOT_TABLES[] = {
    gh_dot_rows_scalar,
#if defined(GH_X86)
    gh_dot_rows_avx2, gh_dot_rows_avx512,
#endif
};
static const gh_kernel_set * const AXPY_TABLES[] = {
    gh_axpy_rows_scalar,
#if defined(GH_X86)
    gh_axpy_rows_avx2, gh_axpy_rows_avx512,
#endif
};
#define N_TABLE_LEVELS ((int) (sizeof DOT_TABLES / sizeof DOT_TABLES[0]))

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

/* Level l's dot row of type t in use (AVX-512 and AVX2 F16 on AMD: the streamed rows, see
 * kernels_avx512.c and kernels_avx2.c). */
static const gh_kernel_set * dot_row(int l, int t) {
#if defined(GH_X86)
    if (l == GH_SIMD_AVX512 && t == GH_TYPE_F16 && g_amd) return &gh_dot_row_avx512_f16_streamed;
    if (l == GH_SIMD_AVX2 && t == GH_TYPE_F16 && g_amd) return &gh_dot_row_avx2_f16_streamed;
#endif
    return &DOT_TABLES[l][t];
}

static void select_kernels(int level) {
    for (int t = 0; t < GH_TYPE_COUNT; t++) {
        gh_kernel_set k = { 0 };
        for (int l = 0; l <= level && l < N_TABLE_LEVELS; l++) {
            overlay(&k, dot_row(l, t));
            overlay(&k, &AXPY_TABLES[l][t]);
        }
        g_kernels[t] = k;
    }
}

/* ---- the table as data (gh_kernel_source): which level supplies each form ---- */

typedef void (*any_fn)(void);

/* The kernel forms of a row: the dot family goes as one group (from the highest level
 * whose row has a gemm), each axpy form on its own (overlay's rules). */
static const struct {
    const char * name;
    bool         dot_family;
    size_t       off;
} FORMS[] = {
    { "dot", true, offsetof(gh_kernel_set, gemm) },  /* vec_dot, from_float_x, the gemm tiles */
    { "dot4", true, offsetof(gh_kernel_set, dot4) },
    { "axpy", false, offsetof(gh_kernel_set, axpy) },
    { "axpy4", false, offsetof(gh_kernel_set, axpy4) },
    { "axpy4pf", false, offsetof(gh_kernel_set, axpy4pf) },
    { "axpy16", false, offsetof(gh_kernel_set, axpy16) },
    { "matmul16", false, offsetof(gh_kernel_set, matmul16) },
    { "tiles", false, offsetof(gh_kernel_set, tiles) },
};
#define N_FORMS ((int) (sizeof FORMS / sizeof FORMS[0]))

static bool has_form(const gh_kernel_set * row, int form) {
    any_fn f;
    memcpy(&f, (const char *) row + FORMS[form].off, sizeof f);
    return f != NULL;
}

const char * gh_kernel_form_name(int form) {
    return form >= 0 && form < N_FORMS ? FORMS[form].name : NULL;
}

int gh_kernel_source(int type, int form, int level, int * mr, int * nt) {
    if (mr) *mr = 0;
    if (nt) *nt = 0;
    if (!gh_type_traits_get(type) || !gh_dot_rows_scalar[type].gemm) return -2;
    if (form < 0 || form >= N_FORMS || level < GH_SIMD_SCALAR || level > GH_SIMD_AVX512) return -2;
    int src = -1;
    for (int l = 0; l <= level && l < N_TABLE_LEVELS; l++) {
        const gh_kernel_set * row = FORMS[form].dot_family ? &DOT_TABLES[l][type] : &AXPY_TABLES[l][type];
        if (FORMS[form].dot_family ? row->gemm != NULL : has_form(row, form)) src = l;
    }
    if (src >= 0 && FORMS[form].dot_family) {
        const gh_kernel_set * row = &DOT_TABLES[src][type];
        if (!has_form(row, form)) return -1; /* the group's level lacks it: none */
        if (mr) *mr = row->mr;
        if (nt) *nt = row->nt;
    }
    return src;
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
