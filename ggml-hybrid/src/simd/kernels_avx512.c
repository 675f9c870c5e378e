/* avx512 kernels (placeholder until the SIMD kernels land). */
#include "kernels.h"

bool gh_kernels_avx512(int type, gh_kernel_set * ks) {
    (void) type;
    (void) ks;
    return false;
}
