/* libFuzzer driver for the GGUF reader: parse the input with gh_gguf_open_memory and,
 * if it is accepted, touch everything the handle exposes (every key and value through
 * the typed getters, every tensor's first and last data byte), then close it.
 * Build and run: see tools/fuzz/README.md. */
#include "gguf/gguf.h"

#include <stddef.h>
#include <stdint.h>

static volatile uint64_t g_sink;

static void walk(const gh_gguf * g) {
    for (int64_t i = 0; i < gh_gguf_n_kv(g); i++) {
        const char * key = gh_gguf_kv_key(g, i);
        if (gh_gguf_find_key(g, key) != i) __builtin_trap();  /* keys are unique */
        int64_t iv;
        double fv;
        int32_t et;
        if (gh_gguf_kv_int(g, i, &iv) == GH_OK) g_sink += (uint64_t) iv;
        if (gh_gguf_kv_float(g, i, &fv) == GH_OK) g_sink += (uint64_t) (fv == fv);
        const char * s = gh_gguf_kv_str(g, i);
        if (s) for (; *s; s++) g_sink += (uint8_t) *s;
        int64_t n = gh_gguf_kv_arr(g, i, &et);
        if (n >= 0) g_sink += (uint64_t) n + (uint64_t) et;
        const void * ad;
        uint64_t an;
        if (gh_gguf_kv_arr_data(g, i, &ad, &an) == GH_OK && an > 0) {
            /* touch the first and last byte: the reader promises the span is in bounds */
            g_sink += ((const uint8_t *) ad)[0] + ((const uint8_t *) ad)[an - 1];
        }
        uint32_t u;
        float f;
        bool b, err = false;
        g_sink += gh_gguf_get_u32(g, key, &u, &err) + gh_gguf_get_f32(g, key, &f, &err) +
                  gh_gguf_get_bool(g, key, &b, &err);
        g_sink += (uint64_t) gh_gguf_get_arr_n(g, key) + (gh_gguf_get_str(g, key) != NULL);
    }
    for (int64_t i = 0; i < gh_gguf_n_tensors(g); i++) {
        const char * name = gh_gguf_tensor_name(g, i);
        const gh_gguf_tensor * t = gh_gguf_find_tensor(g, name);
        if (!t || t != &g->tensors[i]) __builtin_trap();
        if (t->nbytes > 0) {
            const uint8_t * d = t->data;
            g_sink += d[0] + d[t->nbytes - 1];  /* ASan checks these lie in the input */
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    gh_gguf * g = NULL;
    if (gh_gguf_open_memory(data, size, &g) == GH_OK) {
        walk(g);
        gh_gguf_close(g);
    } else if (g != NULL) {
        __builtin_trap();  /* a failed open must not hand out a handle */
    }
    return 0;
}

#ifdef GH_FUZZ_STANDALONE
/* Without libFuzzer (e.g. gcc + valgrind): run each file named on the command line
 * through the same entry point once. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char ** argv) {
    for (int i = 1; i < argc; i++) {
        FILE * f = fopen(argv[i], "rb");
        if (!f) { perror(argv[i]); return 1; }
        uint8_t * buf = NULL;
        size_t n = 0, cap = 0;
        for (;;) {
            if (n == cap) {
                cap = cap ? 2 * cap : 4096;
                uint8_t * p = realloc(buf, cap);
                if (!p) { free(buf); fclose(f); return 1; }
                buf = p;
            }
            size_t r = fread(buf + n, 1, cap - n, f);
            if (r == 0) break;
            n += r;
        }
        fclose(f);
        /* an exact-size copy, so memcheck sees reads past the end */
        uint8_t * exact = malloc(n ? n : 1);
        if (!exact) { free(buf); return 1; }
        if (n) memcpy(exact, buf, n);
        free(buf);
        LLVMFuzzerTestOneInput(exact, n);
        free(exact);
    }
    printf("ran %d inputs\n", argc - 1);
    return 0;
}
#endif
