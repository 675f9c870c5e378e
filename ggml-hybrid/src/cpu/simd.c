/* CPU feature detection and the SIMD level the kernels run at.
 *
 * Levels: scalar (always), AVX2 (AVX2 + FMA + F16C, OS saves YMM state), AVX-512
 * (F, BW, VL, DQ, VNNI, VBMI, BF16, GFNI, OS saves ZMM state). The environment variable
 * GH_SIMD=scalar|avx2|avx512 caps the level chosen at start-up; gh_simd_set changes
 * it later (tests). */
#include "core/common.h"
#include "types/types.h"
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
#else
static int detect_level(void) { return GH_SIMD_SCALAR; }
#endif

static int g_supported = GH_SIMD_SCALAR;
static atomic_int g_level = GH_SIMD_SCALAR;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_set_mutex = PTHREAD_MUTEX_INITIALIZER;

static void simd_init(void) {
    g_supported = detect_level();
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
    gh_types_select_kernels(level);
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
    gh_types_select_kernels(level);
    pthread_mutex_unlock(&g_set_mutex);
    return prev;
}
