/* Internal helpers shared by every source file of the runtime. */
#ifndef GH_COMMON_H
#define GH_COMMON_H

#include "ggml-hybrid.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Record an error message for gh_last_error() and return the status, so call sites
 * read `return gh_fail(GH_ERR_FORMAT, "tensor %s: ...", name);`. */
gh_status gh_fail(gh_status st, const char * fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Overflow-checked size arithmetic for untrusted sizes: return false on overflow. */
static inline bool gh_mul_ok(uint64_t a, uint64_t b, uint64_t * out) {
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool gh_add_ok(uint64_t a, uint64_t b, uint64_t * out) {
    return !__builtin_add_overflow(a, b, out);
}

/* Aligned allocation for activation buffers (64 bytes: one AVX-512 register). */
void * gh_aligned_alloc(size_t size);
void gh_aligned_free(void * p);

#define GH_MIN(a, b) ((a) < (b) ? (a) : (b))
#define GH_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
