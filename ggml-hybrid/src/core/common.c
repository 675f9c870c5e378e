#include "core/common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static _Thread_local char g_last_error[1024];

gh_status gh_fail(gh_status st, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return st;
}

const char * gh_last_error(void) { return g_last_error; }

const char * gh_version(void) { return "0.1.0"; }

void * gh_aligned_alloc(size_t size) {
    void * p = NULL;
    if (size == 0) size = 64;
    size = (size + 63) & ~(size_t) 63;
    if (posix_memalign(&p, 64, size) != 0) return NULL;
    return p;
}

void gh_aligned_free(void * p) { free(p); }
