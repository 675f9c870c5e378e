/* A model: weights loaded from a GGUF file (mapped, or read once into huge pages:
 * gh_load_mode; used in place, never converted except small norm and bias vectors) as
 * its architecture (model/arch.h) describes them, and the context (KV cache + activation
 * buffers) a forward pass runs in. */
#ifndef GH_MODEL_H
#define GH_MODEL_H

#include "core/common.h"

#include <stdatomic.h>
#include "gguf/gguf.h"
#include "cpu/ops.h"
#include "core/threadpool.h"
#include "backend/backend.h"
#include "types/types.h"
#include "model/arch.h"
/* the experts' data only: the MoE FFN (ffn/moe.h) runs on the model, not the model on it */
#include "ffn/experts.h"
#include "core/tap.h"

/* Vectors (norms, biases) are owned f32 copies, NULL where the file has none. One expert
 * of a mixture is viewed as a gh_layer too (moe.c: its gate, up, down_t rows, biases and
 * gate threshold), so that the FFN strategies and executor run it as they run a layer. */
typedef struct gh_layer {
    float *   attn_norm, * attn_norm_b;  /* [n_embd] the attention's input norm: attn_norm, or
                                          * attn_norm_2 in llama.cpp's two-norm Falcon layout;
                                          * NULL (arch no_pre_norms): it reads x itself */
    gh_weight wq, wk, wv, wo;            /* a fused attn_qkv is viewed as its three row ranges */
    float *   bq, * bk, * bv, * bo;
    float *   q_norm, * k_norm;      /* RMSNorm weights of q and k (hp.qk_norm; NULL: none) */
    float *   sinks;                 /* [n_head] attention sink logits (gpt-oss; NULL: none) */
    /* the FFN's input norm: ffn_norm (sequential block), attn_norm (parallel block with
     * two norms, llama.cpp's naming) or none (parallel block: the FFN reads the
     * attention's normed input) */
    float *   ffn_norm, * ffn_norm_b;
    /* the sublayers' output norms (arch post_norms; NULL: none): x += norm(attn(..)),
     * x += norm(ffn(..)) */
    float *   post_attn_norm, * post_attn_norm_b, * post_ffn_norm, * post_ffn_norm_b;
    /* gate = the rows the activation reads: ffn_gate, or ffn_up of an ungated FFN (whose
     * `up` then has no rows); up = the rows multiplied in (gated FFNs) */
    gh_weight gate, up, down;
    float *   gate_b, * up_b, * down_b;
    /* a mixture of experts in place of gate/up/down (hp.n_expert > 0; run by ffn/moe.c) */
    gh_moe_layer moe;
    /* sparse extension (all optional; see load_ffn_down_and_sparse in model.c) */
    bool      has_down_t;  /* down_t replaces down: row i = neuron i's output vector */
    gh_weight down_t;      /* [n_ff rows][n_embd cols] */
    bool      has_pred;
    gh_weight fc1, fc2;    /* predictor: score = fc2 . relu(fc1 . x); [h][n_embd], [n_ff][h] */
    uint8_t * gpu_idx;     /* [n_ff] 0/1 (owned copy), NULL when the file has none */
    int32_t * gpu_bucket;  /* [n_hot] sorted hot neuron ids (owned copy), NULL if none */
    int32_t   n_hot;
    /* gate-magnitude sparsity (powerinfer.sparse.gate_threshold[il] = t): neuron i is
     * active iff |act(gate_i)| > t, which is gate_i > gate_hi_cut, or (for activations
     * with a negative lobe deeper than -t: SiLU, GELU) gate_lo < gate_i < gate_hi, the
     * cut points solved once at load so the per-token test needs no act() */
    bool      has_gate_thr;
    float     gate_thr, gate_cut, gate_lo, gate_hi;
    /* input sparsity of the projections (optional, all or none; load_input_sparse):
     * q/k/v transposed into one matrix (row i = input channel i's contribution to q's, then
     * k's, then v's outputs) and o transposed, each with a threshold per input channel;
     * *_on: some threshold is > 0 (else the site runs dense: nothing to skip) */
    bool      has_in_sparse;
    gh_weight qkv_t;       /* [n_embd rows][dq + 2 dkv cols] */
    gh_weight wo_t;        /* [dq rows][n_embd cols] */
    float *   thr_qkv;     /* [n_embd] */
    float *   thr_o;       /* [dq] */
    bool      qkv_on, o_on;
    /* input sparsity of the FFN (optional, every layer or none; ffn/input_ffn.h): gate and
     * up transposed side by side (row i = input channel i's contribution to the n_ff gate
     * outputs, then to the n_ff up outputs; ungated: n_ff) with a threshold per input, and
     * a threshold per down_t row on |act(g) * u| (ffn_down_in_thr, separately optional) */
    bool      has_ffn_in, has_down_in;
    gh_weight gate_up_t;   /* [n_embd rows][n_ff (x2 gated) cols] */
    float *   thr_ffn_in;  /* [n_embd] */
    float *   thr_down_in; /* [n_ff] */
    bool      ffn_in_on, down_in_on;
} gh_layer;

struct gh_model {
    gh_gguf *       gguf;
    gh_gguf *       gpuidx;      /* while loading: the .generated.gpuidx side file, or NULL */
    char            index_file[512]; /* the side file the GPU index came from ("" if none) */
    int64_t         index_budget;/* the budget the GPU index was solved for (-1: unknown) */
    const gh_arch * arch;
    gh_hparams      hp;          /* what the runtime works with */
    gh_model_info   info;        /* the public view of it (gh_model_info_get) */
    int             embd_type;
    const uint8_t * embd;        /* token_embd rows, embd_row_bytes each */
    size_t          embd_row_bytes;
    int             pos_type;    /* learned positions: position_embd rows (n_pos of them) */
    const uint8_t * pos;
    size_t          pos_row_bytes;
    float *         output_norm, * output_norm_b; /* [n_embd] */
    gh_weight       output;      /* the head: output.weight or token_embd when tied */
    gh_weight       output_t;    /* input sparsity: the head transposed [n_embd][n_vocab] */
    float *         thr_head;    /* its per-input thresholds [n_embd] (NULL: none) */
    bool            head_on;     /* some thr_head > 0 */
    gh_layer *      layers;
    char *          warnings;    /* non-fatal findings, one per line (gh_model_warnings) */
    void **         owned;       /* the vectors' f32 copies, freed with the model */
    int             n_owned, cap_owned;
    struct gh_hybrid * hy;       /* the model's device placement; NULL: CPU only */
    _Atomic int     refs;        /* the loader's reference + one per live context */
};

struct gh_context {
    gh_model *      model;
    gh_threadpool * tp;
    int32_t         n_ctx;
    int32_t         n_batch;
    int32_t         n_past;
    /* KV cache, per layer [n_ctx] rows of n_head_kv * head_dim values in cache_type
     * (kv_row bytes each); for a cache type other than F32 (and in a batched decode) the
     * new tokens' k and v are made in f32 in k_cur / v_cur [n_batch][n_head_kv * head_dim],
     * then stored */
    void **         k_cache;
    void **         v_cache;
    int32_t         cache_type;
    size_t          kv_row;
    gh_from_float_fn kv_store; /* f32 row -> cache_type (NULL for F32: written in place) */
    float *         k_cur;
    float *         v_cur;
    /* activations for up to n_batch tokens, named after what they hold */
    float *         x;      /* residual stream [n_batch][n_embd] */
    float *         xb;     /* normed input [n_batch][n_embd] */
    float *         xb2;    /* sublayer output [n_batch][n_embd] */
    float *         xb3;    /* a parallel block's attention output [n_batch][n_embd] */
    float *         q;      /* [n_batch][n_head * head_dim] */
    float *         att;    /* attention output [n_batch][n_head * head_dim] */
    float *         rope;   /* RoPE cos/sin of each token's position [n_batch][head_dim] */
    float *         rope_swa; /* the same for local layers (in rope's allocation; NULL: none) */
    float *         hb;     /* gate / activated [n_batch][n_ff] */
    float *         hb2;    /* up [n_batch][n_ff] */
    void *          mm_scratch;
    float *         logits;         /* [logits_cap][n_vocab] */
    int32_t         logits_cap;
    int32_t         n_logit_rows;
    /* input-sparse projections (gh_context_set_input_sparse): on/off, the used inputs of
     * one token (ids and values, [max(n_embd, dq)]) and its q|k|v outputs [dq + 2 dkv] */
    bool            input_sparse;
    int32_t *       in_ids;
    float *         in_a;
    float *         in_qkv;
    /* the FFN's mode (a row of ffn/strategy.c's registry), the batches it applies to
     * (gh_context_set_sparse_batch) and the executor's buffers (ffn/exec.c) */
    int32_t         ffn_mode;
    int32_t         sparse_batch;
    struct gh_ffn_state * ffn;
    /* drafting (gh_context_set_head_rows, _layer_skip): the head's kept rows (head_ids
     * [n_head_ids], their weight rows copied into head_w's compact matrix), in use while
     * head_rows_on (kept when the full head is restored, so that a drafter switching back
     * and forth with the same ids copies nothing), one row's logits while they are
     * scattered (head_tmp [n_head_ids]), and the layers skipped (skip [n_layer], NULL:
     * none; n_skip of them) */
    bool            head_rows_on;
    int32_t         n_head_ids;
    int32_t *       head_ids;
    gh_weight       head_w;
    float *         head_tmp;
    uint8_t *       skip;
    int32_t         n_skip;
    /* statistics since the last reset (core/stats.h; gh_context_get_stats), and the one
     * observation hook they and the profiler hang on (core/tap.h) */
    gh_stats        stats;
    gh_tap          tap;
    /* mixture-of-experts FFN: buffers and selection counts (moe.c; NULL without experts) */
    struct gh_moe_state * moe;
    /* hybrid: the context's device stream (NULL on the CPU); a device error is returned up
     * the forward pass's call chain to gh_eval */
    gh_stream *     stream;
    /* 1 while a call runs in this context (ctx_enter / ctx_leave): a second thread is
     * refused instead of overwriting the buffers and cache the first one uses */
    atomic_int      busy;
    /* a batch of several contexts (gh_eval_batch_ex, model/batch.c): while set, token t of
     * the forward pass is context seq[t]'s, at position seq_pos[t] of its KV cache (each
     * context's tokens are consecutive rows), and this context lends the pass its buffers
     * and threads; NULL otherwise */
    struct gh_context * const * seq;
    const int32_t *             seq_pos;
};

/* A model from a GGUF image in memory (not copied: it must outlive the model), without a
 * GPU index side file; for the load-path fuzzer (tools/fuzz/load_fuzz.c). */
gh_status gh_model_load_memory(const void * data, size_t size, gh_model ** out);

/* The forward pass (forward.c) of n tokens, n <= c->n_batch: which logits it keeps.
 * Returns the first device error, which ends the pass with its cache rows and logits
 * partly written; the callers keep neither (gh_eval puts n_past back, a batch of contexts
 * moves none). */
enum { GH_LOGITS_NONE, GH_LOGITS_LAST, GH_LOGITS_ALL };
gh_status gh_forward_batch(gh_context * c, const int32_t * tokens, int32_t n, int which,
                           int32_t row0);
/* gh_eval's work on a claimed context (forward.c): the tokens in batches of n_batch, each
 * batch's logits as logits_all asks; an observer set on c->tap sees every batch. */
gh_status gh_eval_tokens(gh_context * c, const int32_t * tokens, int32_t n_tokens,
                         int32_t logits_all);

/* Claims c for one call, or fails with GH_ERR_BUSY naming `what`; ctx_leave releases it. */
gh_status gh_ctx_enter(gh_context * c, const char * what);
void gh_ctx_leave(gh_context * c);

#endif
