/* libFuzzer driver for the whole load path: the reader, the loader (hyper-parameters,
 * every tensor checked against them, the sparse extension) and a forward pass. The input
 * is a GGUF image; if the loader accepts it, a context of 8 tokens on one thread evaluates
 * one token and then a second one (which reads the first one's KV entries), and every
 * logit is read. A load or context error is fine (a clean refusal); a crash, a sanitizer
 * report, a leak or a handle returned with an error is a finding.
 * Build and run: see tools/fuzz/README.md ("The load path"). */
#include "model/model.h"

#include <stddef.h>
#include <stdint.h>

static volatile float g_sink;

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    gh_model * m = NULL;
    if (gh_model_load_memory(data, size, &m) != GH_OK) {
        if (m != NULL) __builtin_trap();  /* a failed load must not hand out a handle */
        return 0;
    }
    gh_model_info info;
    if (gh_model_info_get(m, &info) != GH_OK || info.n_vocab < 1) __builtin_trap();
    /* NaN/Inf weights load with a warning (by design: tests/model/test_bad_models.py); running
     * them feeds non-finite activations to the int8 quantizers of cpu/, whose float ->
     * int conversion then overflows (UBSan's first finding here, reported to the kernel
     * tables' owner; README "The load path"). The forward pass runs on finite files. */
    int64_t n_bad = 0;
    if (gh_model_check_weights(m, &n_bad) != GH_OK || n_bad > 0) {
        gh_model_free(m);
        return 0;
    }
    gh_context_params p = gh_context_default_params();
    p.n_ctx = 8;
    p.n_threads = 1;
    gh_context * c = NULL;
    if (gh_context_new(m, &p, &c) == GH_OK) {
        /* bos when the file names one (the loader checked it against the vocabulary) */
        const int32_t toks[2] = { info.bos_id >= 0 ? info.bos_id : 0, info.n_vocab - 1 };
        for (int i = 0; i < 2; i++) {
            if (gh_eval(c, &toks[i], 1, 0) != GH_OK) break;
            const float * lg = gh_get_logits(c, -1);
            if (!lg) __builtin_trap();
            float s = 0.0f;
            for (int32_t k = 0; k < info.n_vocab; k++) s += lg[k];
            g_sink += s;
        }
        gh_context_free(c);
    } else if (c != NULL) {
        __builtin_trap();
    }
    gh_model_free(m);
    return 0;
}

#ifdef GH_FUZZ_STANDALONE
/* Without libFuzzer (gcc, valgrind): run each file named on the command line once. */
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char ** argv) {
    for (int i = 1; i < argc; i++) {
        FILE * f = fopen(argv[i], "rb");
        if (!f) { perror(argv[i]); return 1; }
        fseek(f, 0, SEEK_END);
        const long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t * buf = malloc(n > 0 ? (size_t) n : 1);
        if (!buf || fread(buf, 1, (size_t) n, f) != (size_t) n) { fclose(f); free(buf); return 1; }
        fclose(f);
        LLVMFuzzerTestOneInput(buf, (size_t) n);
        free(buf);
    }
    return 0;
}
#endif
