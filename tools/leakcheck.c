/* Leak check of the model/context/sampler life cycle, run under LeakSanitizer by
 * tools/sanitize_tests.sh (a standalone program: Python itself leaks by design).
 *
 *   leakcheck MODEL.gguf [ROUNDS]
 *
 * Each round loads the model, opens its file through the GGUF reader (from disk and
 * from memory), makes contexts with several shapes, evaluates tokens, changes the
 * thread count, truncates, samples, and frees everything; it also drives the error
 * paths (truncated file, bad context parameters, bad tokens, context overflow) that
 * must free what they allocated. Exit status: 0 if every call behaved as expected
 * (LeakSanitizer then fails the run at exit if anything leaked), 1 otherwise. */
#include "ggml-hybrid.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_failures;

#define EXPECT(cond)                                                                     \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "leakcheck: %s:%d: expected %s (last error: %s)\n", __FILE__, \
                    __LINE__, #cond, gh_last_error());                                   \
            g_failures++;                                                                \
        }                                                                                \
    } while (0)

static unsigned char * read_file(const char * path, size_t * size) {
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char * buf = n > 0 ? malloc((size_t) n) : NULL;
    if (buf && fread(buf, 1, (size_t) n, f) != (size_t) n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *size = buf ? (size_t) n : 0;
    return buf;
}

static void run_context(gh_model * m, int32_t n_vocab, int32_t n_ctx, int32_t n_batch,
                        int32_t n_threads) {
    gh_context_params p = gh_context_default_params();
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    p.n_threads = n_threads;
    gh_context * c = NULL;
    EXPECT(gh_context_new(m, &p, &c) == GH_OK && c);
    if (!c) return;

    int32_t tokens[12];
    for (int i = 0; i < 12; i++) tokens[i] = (i * 7 + 1) % n_vocab;
    EXPECT(gh_eval(c, tokens, 12, 1) == GH_OK);          /* logits for every token */
    EXPECT(gh_n_logit_rows(c) == 12 && gh_get_logits(c, -1) != NULL);
    EXPECT(gh_context_set_threads(c, n_threads == 1 ? 2 : 1) == GH_OK);
    EXPECT(gh_context_truncate(c, 4) == GH_OK);
    EXPECT(gh_eval(c, tokens, 3, 0) == GH_OK);

    /* error paths: nothing may be appended or leaked */
    int32_t bad[2] = { 1, n_vocab };
    EXPECT(gh_eval(c, bad, 2, 0) == GH_ERR_RANGE);
    int32_t big[64];
    for (int i = 0; i < 64; i++) big[i] = 1;
    EXPECT(gh_eval(c, big, n_ctx, 0) == GH_ERR_RANGE);   /* context full */
    EXPECT(gh_context_set_threads(c, -3) == GH_ERR_INVALID_ARG);

    gh_sampler_params sp = gh_sampler_default_params();
    sp.temperature = 0.8f;
    sp.top_k = 20;
    sp.seed = 7;
    gh_sampler * s = NULL;
    EXPECT(gh_sampler_new(&sp, n_vocab, &s) == GH_OK && s);
    for (int i = 0; s && i < 4; i++) {
        int32_t tok = -1;
        EXPECT(gh_sampler_sample(s, gh_get_logits(c, -1), &tok) == GH_OK);
        EXPECT(tok >= 0 && tok < n_vocab);
        gh_sampler_accept(s, tok);
        EXPECT(gh_eval(c, &tok, 1, 0) == GH_OK);
    }
    gh_sampler_reset(s);
    gh_sampler_free(s);
    gh_context_free(c);
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [ROUNDS]\n", argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const int rounds = argc > 2 ? atoi(argv[2]) : 10;
    size_t size = 0;
    unsigned char * image = read_file(path, &size);
    if (!image) {
        fprintf(stderr, "leakcheck: cannot read %s\n", path);
        return 2;
    }
    /* a truncated copy, for the loader's error path */
    char bad_path[4096];
    snprintf(bad_path, sizeof bad_path, "%s.truncated", path);
    FILE * f = fopen(bad_path, "wb");
    if (!f || fwrite(image, 1, size / 2, f) != size / 2) {
        fprintf(stderr, "leakcheck: cannot write %s\n", bad_path);
        return 2;
    }
    fclose(f);

    for (int r = 0; r < rounds; r++) {
        gh_gguf * g = NULL;
        EXPECT(gh_gguf_open(path, &g) == GH_OK);
        gh_gguf_close(g);
        g = NULL;
        EXPECT(gh_gguf_open_memory(image, size, &g) == GH_OK);
        gh_gguf_close(g);
        g = NULL;
        EXPECT(gh_gguf_open_memory(image, size / 3, &g) != GH_OK && g == NULL);

        gh_model * bad = NULL;
        EXPECT(gh_model_load(bad_path, &bad) != GH_OK && bad == NULL);

        gh_model * m = NULL;
        EXPECT(gh_model_load(path, &m) == GH_OK && m);
        if (!m) break;
        gh_model_info info;
        EXPECT(gh_model_info_get(m, &info) == GH_OK);
        int64_t n_bad = -1;
        EXPECT(gh_model_check_weights(m, &n_bad) == GH_OK && n_bad == 0);
        EXPECT(strcmp(gh_model_warnings(m), "") == 0);

        gh_context_params p = gh_context_default_params();
        gh_context * c = NULL;
        p.n_threads = -1;
        EXPECT(gh_context_new(m, &p, &c) == GH_ERR_INVALID_ARG && c == NULL);
        p.n_threads = 100000;
        EXPECT(gh_context_new(m, &p, &c) == GH_ERR_INVALID_ARG && c == NULL);
        p.n_threads = 1;
        p.n_ctx = -5;
        EXPECT(gh_context_new(m, &p, &c) == GH_ERR_INVALID_ARG && c == NULL);

        /* contexts of several shapes while another one over the same model is alive */
        p = gh_context_default_params();
        p.n_ctx = 8;
        p.n_threads = 2;
        EXPECT(gh_context_new(m, &p, &c) == GH_OK && c);
        int32_t tok = 1;
        EXPECT(gh_eval(c, &tok, 1, 0) == GH_OK);
        run_context(m, info.n_vocab, 32, 0, 1);
        run_context(m, info.n_vocab, 48, 5, 2);   /* 12 tokens in batches of 5 */
        run_context(m, info.n_vocab, 16, 1, 3);
        EXPECT(gh_eval(c, &tok, 1, 0) == GH_OK);
        gh_context_free(c);
        gh_model_free(m);

        /* the same on the host-device backend, with the model released before its
         * contexts (the last context frees it), and the device's error paths */
        gh_model_params mp = gh_model_default_params();
        mp.device = "host-device";
        mp.vram_budget = r % 2 ? -1 : 300000;
        EXPECT(gh_model_load_ex(path, &mp, &m) == GH_OK && m);
        if (!m) break;
        run_context(m, info.n_vocab, 32, 0, 2);
        p = gh_context_default_params();
        p.n_ctx = 8;
        EXPECT(gh_context_new(m, &p, &c) == GH_OK && c);
        gh_model_free(m);
        EXPECT(gh_eval(c, &tok, 1, 0) == GH_OK);
        gh_context_free(c);
        mp.device = "no-such-device";
        EXPECT(gh_model_load_ex(path, &mp, &m) == GH_ERR_INVALID_ARG && m == NULL);
        mp.device = "host-device";
        mp.vram_budget = -7;
        EXPECT(gh_model_load_ex(path, &mp, &m) == GH_ERR_INVALID_ARG && m == NULL);
    }
    free(image);
    remove(bad_path);
    if (g_failures) {
        fprintf(stderr, "leakcheck: %d unexpected results\n", g_failures);
        return 1;
    }
    printf("leakcheck: %d rounds clean\n", rounds);
    return 0;
}
