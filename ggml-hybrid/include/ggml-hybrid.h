/* ggml-hybrid: the native runtime of powerinfer-cpp.
 *
 * This is the ONE public header: everything a user (or the Python binding) may call.
 * The Python binding feeds the text between the CFFI-BEGIN and CFFI-END markers to
 * cffi's cdef, so that region holds plain C declarations only (no macros, no
 * preprocessor lines, no inline functions).
 *
 * Conventions: opaque handles; every fallible call returns gh_status and, on failure,
 * leaves a human-readable message in gh_last_error() (thread-local). Untrusted input
 * (files, token ids, sizes) never aborts the process.
 */
#ifndef GGML_HYBRID_H
#define GGML_HYBRID_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CFFI-BEGIN */

typedef enum {
    GH_OK              = 0,
    GH_ERR_IO          = 1,  /* cannot open / read / map a file */
    GH_ERR_FORMAT      = 2,  /* malformed or inconsistent file */
    GH_ERR_UNSUPPORTED = 3,  /* valid but not supported (architecture, type, ...) */
    GH_ERR_INVALID_ARG = 4,  /* bad argument from the caller */
    GH_ERR_OOM         = 5,  /* allocation failed */
    GH_ERR_RANGE       = 6,  /* out of range: token id, context full, ... */
    GH_ERR_BUSY        = 7   /* the context is running a call on another thread */
} gh_status;

/* Tensor types; the numeric values are the GGML type ids used in GGUF files. */
typedef enum {
    GH_TYPE_F32  = 0,
    GH_TYPE_F16  = 1,
    GH_TYPE_Q4_0 = 2,
    GH_TYPE_Q4_1 = 3,
    GH_TYPE_Q5_0 = 6,
    GH_TYPE_Q5_1 = 7,
    GH_TYPE_Q8_0 = 8,
    GH_TYPE_Q2_K = 10,
    GH_TYPE_Q3_K = 11,
    GH_TYPE_Q4_K = 12,
    GH_TYPE_Q5_K = 13,
    GH_TYPE_Q6_K = 14,
    GH_TYPE_IQ2_XXS = 16, /* the IQ lattice types: read (when built with their codebooks), */
    GH_TYPE_IQ2_XS = 17,  /* never written */
    GH_TYPE_IQ3_XXS = 18,
    GH_TYPE_IQ1_S = 19,
    GH_TYPE_IQ4_NL = 20,
    GH_TYPE_IQ3_S = 21,
    GH_TYPE_IQ2_S = 22,
    GH_TYPE_IQ4_XS = 23,
    GH_TYPE_I32  = 26, /* index tensors only (blk.N.gpu_idx, blk.N.gpu_bucket); no matmul */
    GH_TYPE_IQ1_M = 29,
    GH_TYPE_BF16 = 30,
    GH_TYPE_MXFP4 = 39
} gh_type;

/* FFN activation kinds (how gate and up combine). */
typedef enum {
    GH_ACT_SILU  = 0,  /* SwiGLU: silu(gate) * up            (Llama-2/3, Mistral) */
    GH_ACT_RELU  = 1,  /* ReGLU:  relu(gate) * up            (ReluLLaMA, ProSparse) */
    GH_ACT_DRELU = 2,  /* dReLU:  relu(gate) * relu(up)      (Bamboo, TurboSparse) */
    GH_ACT_GELU  = 3,  /* GeGLU:  gelu_tanh(gate) * up      (HF gelu_new / gelu_pytorch_tanh) */
    GH_ACT_GELU_ERF = 4, /* GeGLU with exact erf GELU       (HF "gelu") */
    GH_ACT_FATRELU = 5, /* fatrelu(gate) * up, fatrelu(g) = g if g > t else 0   (ProSparse) */
    GH_ACT_SWIGLU_OAI = 6 /* gpt-oss's clamped SwiGLU with limit t: g = min(gate, t),
                           * (clamp(up, -t, t) + 1) * g * sigmoid(1.702 g) (gated only) */
} gh_act;
/* An ungated FFN (OPT, Falcon) applies the same kinds to up alone: act(up) (dReLU has no
 * ungated form). */

/* SIMD levels for the CPU kernels; GH_SIMD_AUTO picks the best the CPU has. */
typedef enum {
    GH_SIMD_AUTO   = -1,
    GH_SIMD_SCALAR = 0,
    GH_SIMD_AVX2   = 1,
    GH_SIMD_AVX512 = 2
} gh_simd;

const char * gh_last_error(void);
const char * gh_version(void);
/* Best SIMD level this CPU supports. */
int gh_simd_supported(void);
/* Force a SIMD level for all later kernel calls (tests); returns the previous level,
 * or -2 if the CPU cannot run the requested level. */
int gh_simd_set(int level);
int gh_simd_get(void);
/* The CPU kernel table as data (tools/kernel_coverage.py, tests). gh_kernel_form_name(f)
 * names kernel form f ("dot": vec_dot and the gemm tiles, "dot4", "axpy", "axpy4", ...;
 * NULL past the last). gh_kernel_source: the SIMD level whose table supplies form f of
 * `type` when the kernels run at `level` (any level, whether this CPU has it or not):
 * `level` itself, a lower level (that level has none of its own and inherits it), -1 (no
 * level up to it has one: the callers use the next smaller form), or -2 (a type without
 * kernels, a form or level out of range). *mr, *nt (may be NULL) get the "dot" form's
 * tile: rows x tokens. */
const char * gh_kernel_form_name(int form);
int gh_kernel_source(int type, int form, int level, int * mr, int * nt);

/* ---- tensor types and ops on raw buffers (used by tests and tools) ---- */

/* Bytes of one row of n elements; 0 if n is not a multiple of the block size. */
size_t gh_type_row_size(int type, int64_t n);
int64_t gh_type_block_size(int type);
const char * gh_type_name(int type);
gh_status gh_quantize_row(int type, const float * src, void * dst, int64_t n);
gh_status gh_dequantize_row(int type, const void * src, float * dst, int64_t n);

/* y[t, r] = sum_c W[r, c] * x[t, c] for t < n_tokens, r < rows; W is rows x cols of
 * `type` (row-major, rows contiguous as in GGUF), x and y are f32. */
gh_status gh_op_matmul(int type, const void * w, int64_t rows, int64_t cols,
                       const float * x, int64_t n_tokens, float * y, int n_threads);
/* Transposed matmul (the down projection through ffn_down_t):
 * y[t, c] = sum_r h[t, r] * W[r, c] for t < n_tokens, c < cols; W is rows x cols of
 * `type` (row r = neuron r's output vector), h is [n_tokens][rows], y [n_tokens][cols].
 * Rows whose h is zero are skipped (ReLU FFNs: most of them). */
gh_status gh_op_matmul_t(int type, const void * w, int64_t rows, int64_t cols,
                         const float * h, int64_t n_tokens, float * y, int n_threads);
/* y = x / rms(x) * w over rows of length n (n_rows rows). */
gh_status gh_op_rmsnorm(const float * x, const float * w, int64_t n, int64_t n_rows,
                        float eps, float * y);
/* y = (x - mean(x)) / sqrt(var(x) + eps) * w + b over rows of length n; b may be NULL. */
gh_status gh_op_layernorm(const float * x, const float * w, const float * b, int64_t n,
                          int64_t n_rows, float eps, float * y);
/* In-place rotary embedding of x [n_tokens][n_head][head_dim] at positions pos[]; the
 * frequency of pair i is theta^(-2i/head_dim) / freq_div[i] * freq_scale (freq_div: NULL
 * or head_dim/2 divisors, Llama-3's rope_freqs; freq_scale: 1, or 1/factor for linear
 * scaling); neox = 0 rotates adjacent pairs (GGUF llama layout), 1 rotates halves. */
gh_status gh_op_rope(float * x, int64_t n_tokens, int n_head, int head_dim,
                     const int32_t * pos, float theta, float freq_scale,
                     const float * freq_div, int neox);
/* out[t][i] = act(gate[t][i]) * up[t][i] (see gh_act; t is FATReLU's threshold), or
 * act(gate[t][i]) when up is NULL (an ungated FFN). */
gh_status gh_op_glu(int act, float t, const float * gate, const float * up, float * out,
                    int64_t n);
/* Causal attention of n_tokens queries at positions n_past.. over a cache of
 * n_past + n_tokens keys/values. q: [n_tokens][n_head][head_dim];
 * k, v: [n_kv_total][n_head_kv][head_dim]; out: [n_tokens][n_head][head_dim]. */
gh_status gh_op_attention(const float * q, const float * k, const float * v, float * out,
                          int64_t n_tokens, int64_t n_past, int n_head, int n_head_kv,
                          int head_dim, int n_threads);
/* The same over a cache stored as kv_type (GH_TYPE_F32, GH_TYPE_F16 or GH_TYPE_Q8_0; each
 * row of n_head_kv * head_dim values in that type's layout), as a context's KV cache is. */
gh_status gh_op_attention_kv(int kv_type, const float * q, const void * k, const void * v,
                             float * out, int64_t n_tokens, int64_t n_past, int n_head,
                             int n_head_kv, int head_dim, int n_threads);
/* The same with the scores' scale (gh_op_attention_kv: 1/sqrt(head_dim)), soft-capping of
 * the scaled scores s -> softcap * tanh(s / softcap) (0: none), a sliding window: the
 * query at position p sees the keys at positions p - window + 1 .. p (0: 0 .. p) (Gemma),
 * and attention sinks: sinks[h] (n_head finite values; NULL: none) is one more logit in
 * head h's softmax whose share is dropped (gpt-oss). */
gh_status gh_op_attention_ext(int kv_type, const float * q, const void * k, const void * v,
                              float * out, int64_t n_tokens, int64_t n_past, int n_head,
                              int n_head_kv, int head_dim, int n_threads, float scale,
                              float softcap, int64_t window, const float * sinks);

/* ---- GGUF files (the same reader the model loader uses) ---- */

typedef struct gh_gguf gh_gguf;

/* How a file's bytes reach memory (gh_gguf_open_ex, gh_model_params.load). */
enum gh_load_mode {
    GH_LOAD_AUTO = 0, /* READ when the kernel offers transparent huge pages and the file
                       * fits in the available memory with 1 GiB to spare; else MMAP */
    GH_LOAD_MMAP = 1, /* map the file: pages come and go with the page cache and are
                       * shared with other processes using the file */
    GH_LOAD_READ = 2, /* read the file into private memory in 2 MiB pages: the sparse
                       * FFN's scattered rows and the matmuls miss the TLB far less
                       * (docs/BENCHMARKS.md, "Weights in huge pages"); a file larger
                       * than the available memory is refused (GH_ERR_OOM) */
};

/* Maps the file (GH_LOAD_MMAP). */
gh_status gh_gguf_open(const char * path, gh_gguf ** out);
gh_status gh_gguf_open_ex(const char * path, int load, gh_gguf ** out);
/* GH_LOAD_MMAP or GH_LOAD_READ: how the handle's image was made (memory images: READ). */
int32_t gh_gguf_load_mode(const gh_gguf * g);
/* Parses a GGUF image in memory; the buffer must outlive the handle. */
gh_status gh_gguf_open_memory(const void * data, size_t size, gh_gguf ** out);
void gh_gguf_close(gh_gguf * g);
int64_t gh_gguf_n_kv(const gh_gguf * g);
int64_t gh_gguf_n_tensors(const gh_gguf * g);
const char * gh_gguf_tensor_name(const gh_gguf * g, int64_t i);
/* Inspection by index (tests, tools). Value types are the GGUF ids: 0 uint8, 1 int8,
 * 2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32, 7 bool, 8 string, 9 array,
 * 10 uint64, 11 int64, 12 float64. */
const char * gh_gguf_kv_key(const gh_gguf * g, int64_t i);     /* NULL if out of range */
int32_t gh_gguf_kv_type(const gh_gguf * g, int64_t i);         /* -1 if out of range */
int64_t gh_gguf_find_key(const gh_gguf * g, const char * key); /* index; -1 if absent */
/* Integer or bool value of key i (fails for other types and uint64 > INT64_MAX). */
gh_status gh_gguf_kv_int(const gh_gguf * g, int64_t i, int64_t * out);
/* Any numeric value of key i as a double. */
gh_status gh_gguf_kv_float(const gh_gguf * g, int64_t i, double * out);
const char * gh_gguf_kv_str(const gh_gguf * g, int64_t i);     /* NULL if not a string */
/* Element count of array key i (element type in *elem_type); -1 if not an array. */
int64_t gh_gguf_kv_arr(const gh_gguf * g, int64_t i, int32_t * elem_type);
/* The raw elements of array key i as stored (little-endian numbers; strings as a u64
 * length followed by the bytes, already checked to lie inside the file). */
gh_status gh_gguf_kv_arr_data(const gh_gguf * g, int64_t i, const void ** data, uint64_t * nbytes);
/* Tensor i: gh_type, n_dims, ne[4] (unused dims 1), offset within the data section,
 * byte size, and a pointer to its data in the image. Any out pointer may be NULL. */
gh_status gh_gguf_tensor_info(const gh_gguf * g, int64_t i, int32_t * type, int32_t * n_dims,
                              int64_t * ne, uint64_t * offset, uint64_t * nbytes,
                              const void ** data);

/* ---- models and contexts ---- */

typedef struct gh_model gh_model;
typedef struct gh_context gh_context;

/* The general.architecture values the loader runs, "llama, qwen2, ..." (static; the
 * loader's own registry, so a check before loading names the same list). */
const char * gh_arch_names(void);

typedef struct {
    char    arch[32];
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    int32_t ffn_act;       /* gh_act */
    int32_t act_from_file; /* 1 if the file names its activation, 0 if SwiGLU was assumed */
    int32_t tied_output;
    int32_t bos_id;        /* -1 if none */
    int32_t eos_id;        /* -1 if none */
    int32_t weight_type;   /* gh_type of the FFN weights of layer 0 */
    float   rms_eps;
    float   rope_theta;
    int64_t n_params;
    int64_t n_bytes;       /* bytes of tensor data */
    /* sparse extension (powerinfer.* keys, blk.N.fc1/fc2/ffn_down_t/... tensors) */
    int32_t has_predictor; /* number of layers with a predictor (fc1 + fc2); 0 = none */
    int32_t has_down_t;    /* number of layers whose down projection is ffn_down_t */
    float   sparse_threshold; /* powerinfer.sparse.threshold (0 when absent) */
    int32_t has_gate_threshold; /* 1: powerinfer.sparse.gate_threshold (gate-magnitude
                                 * sparsity, GH_FFN_GATE) is present */
    int32_t has_input_sparsity; /* 1: every layer has attn_qkv_t / attn_output_t with their
                                 * input thresholds and the file has output_t + output_in_thr
                                 * (input-sparse projections, gh_context_set_input_sparse) */
    /* mixture of experts ({arch}.expert_* keys); n_expert 0: a dense FFN */
    int32_t n_expert;      /* experts per layer */
    int32_t n_expert_used; /* experts each token runs (top-k) */
    int32_t n_ff_exp;      /* an expert's FFN width */
    int32_t n_ff_shexp;    /* the shared expert's width (0: none) */
    int32_t expert_norm;   /* 1: the top-k routing weights are renormalised to sum to 1 */
} gh_model_info;

gh_status gh_model_load(const char * path, gh_model ** out);

/* Where a model runs (see "devices" below for the names). */
typedef struct {
    const char * device;      /* NULL or "cpu": CPU only; "host-device", "cuda", "cuda:N" */
    int64_t vram_budget;      /* bytes the model may take on the device; -1 = the device's
                               * free memory minus a margin of 256 MiB; a budget above the
                               * free memory is lowered to it (the note says so) */
    int32_t reset_gpu_index;  /* 1: ignore the file's GPU index and place the hot neurons
                               * at load (greedy, from blk.N.ffn_freq) */
    int32_t load;             /* gh_load_mode of the weights (default GH_LOAD_AUTO) */
    /* mixture-of-experts models (ignored without experts): */
    int32_t n_cpu_moe;        /* the routed experts of the first n_cpu_moe layers stay on
                               * the CPU (llama.cpp's --n-cpu-moe); >= 0. A shared expert
                               * does not count: it is placed as llama.cpp's rule leaves it,
                               * with the dense parts (gh_model_load_ex) */
    int64_t expert_cache;     /* bytes of each context's device cache of recently used CPU
                               * experts (LRU; 0 = none), whole experts, at least one; the
                               * budget reserves one context's before the experts are placed
                               * (each further context allocates its own beside the budget,
                               * as its stream's buffers are) */
} gh_model_params;

gh_model_params gh_model_default_params(void);
/* gh_model_load that also puts the model on a device: the dense parts in priority order
 * (attention weights of each layer, then predictors (a mixture of experts: its routers),
 * then the output head, then a mixture of experts' shared experts; each in layer order,
 * stopping at the first that does not fit),
 * then the hot FFN neurons, or for a mixture of experts its expert cache and then whole
 * experts: the file's expert placement (blk.N.ffn_exp_gpu) when it places some and they
 * fit, else by the
 * expert frequencies (blk.N.ffn_exp_freq, most frequent first), else in layer order;
 * never in the first n_cpu_moe layers. The file's
 * GPU index (blk.N.gpu_bucket) is used when it fits what is left; when it does not, or
 * the file's index is empty, or reset_gpu_index is set, the neurons are placed at load by
 * the greedy rule of the offline placement (value per byte over frequency-ordered groups,
 * each layer either none or at least its minimum); gh_device_info.note says which. */
gh_status gh_model_load_ex(const char * path, const gh_model_params * p, gh_model ** out);

typedef struct {
    char    device[32];         /* "cpu", "host-device", "cuda:0", ... */
    int64_t budget;             /* bytes the placement could use (0 for cpu) */
    int64_t file_budget;        /* budget the file's GPU index was solved for (-1: no index) */
    int64_t used_bytes;         /* bytes the model holds on the device */
    int64_t dense_bytes;        /* of them: attention, predictors, output head */
    int64_t hot_bytes;          /* of them: hot neurons (gate + up + down_t rows) */
    int64_t n_hot;              /* hot neurons, all layers */
    int64_t n_neurons;          /* n_layer * n_ff */
    int32_t n_attention_layers; /* layers whose attention weights are on the device */
    int32_t n_predictor_layers; /* layers whose predictor is on the device */
    int32_t n_hot_layers;       /* layers with hot neurons */
    int32_t head_on_device;
    int32_t index_source;       /* 0 no hot neurons, 1 the file's index, 2 placed at load */
    char    note[256];          /* what the loader decided and why ("" if nothing to say) */
    /* mixture of experts */
    int64_t n_experts;          /* n_layer * n_expert (0: no experts) */
    int64_t n_experts_device;   /* experts placed on the device */
    int64_t expert_bytes;       /* of used_bytes: those experts */
    int64_t expert_cache_bytes; /* each context's expert cache (whole experts) */
    int32_t expert_cache_slots; /* experts the cache holds */
    int32_t expert_source;      /* 0 none placed, 1 the file's placement, 2 by frequency, 3 in
                                 * layer order (no frequencies) */
    int32_t n_shexp_device;     /* layers whose shared expert (qwen2moe) is on the device: the
                                 * first n_shexp_device layers */
    int64_t shexp_bytes;        /* of used_bytes: those shared experts (gate, up, down) */
    int64_t n_hot_experts;      /* sparse experts (ffn_down_exps_t) with hot neurons on the
                                 * device (their neurons in n_hot and hot_bytes; n_neurons:
                                 * every expert's neurons) */
} gh_device_info;

/* Mixture-of-experts models on a device: where[l * n_expert + e] = 1 if expert e of layer l
 * is on the device, else 0 (n >= n_layer * n_expert; all 0 on the CPU). */
gh_status gh_model_expert_placement(const gh_model * m, int8_t * where, int64_t n);

/* Sparse experts on a device: counts[l * n_expert + e] = the neurons of expert e of layer l
 * whose rows are on the device (0..n_ff_exp; all 0 on the CPU or without any placed). */
gh_status gh_model_expert_hot_counts(const gh_model * m, int32_t * counts, int64_t n);

gh_status gh_model_device_info(const gh_model * m, gh_device_info * out);
/* Releases the caller's model; its memory goes when its last context is freed too. */
void gh_model_free(gh_model * m);
gh_status gh_model_info_get(const gh_model * m, gh_model_info * out);
/* GH_LOAD_MMAP or GH_LOAD_READ: how the model's weights were loaded. */
int32_t gh_model_load_mode(const gh_model * m);
/* Non-fatal findings of the loader, one per line ("" if none): e.g. NaN/Inf in the
 * norm weights, which every load checks (they are copied to f32 anyway). Valid until
 * the model is freed or gh_model_check_weights adds to it. */
const char * gh_model_warnings(const gh_model * m);
/* Opt-in full scan: reads every tensor of the file (the whole model: slow for big
 * files) and adds a warning per tensor holding NaN/Inf; *n_bad (may be NULL) = the
 * number of such tensors. Call before sharing the model across threads. */
gh_status gh_model_check_weights(gh_model * m, int64_t * n_bad);

typedef struct {
    int32_t n_ctx;      /* max tokens in the KV cache; 0 = model's training context */
    int32_t n_batch;    /* max tokens per gh_eval call; 0 = n_ctx */
    int32_t n_threads;  /* 0 = number of online CPUs */
    int32_t cache_type; /* KV cache storage: GH_TYPE_F16 (default), GH_TYPE_F32, GH_TYPE_Q8_0 */
} gh_context_params;

gh_context_params gh_context_default_params(void);
/* A context serves one call at a time. A call that changes or runs it (gh_eval,
 * gh_eval_profile, gh_context_truncate, _set_threads, _set_ffn_mode, _set_sparse_batch,
 * _reset_stats, _state_save, _state_load) while another thread is inside one of them on the same context is refused
 * with GH_ERR_BUSY and changes nothing; give each thread its own context (they may share
 * one model). gh_context_free must not race a call on the same context. */
gh_status gh_context_new(gh_model * m, const gh_context_params * p, gh_context ** out);
void gh_context_free(gh_context * c);
int32_t gh_context_n_ctx(const gh_context * c);
int32_t gh_context_n_past(const gh_context * c);
int32_t gh_context_cache_type(const gh_context * c);
gh_status gh_context_set_threads(gh_context * c, int32_t n_threads);
/* Forget the cache after position n_past (0 clears it). */
gh_status gh_context_truncate(gh_context * c, int32_t n_past);
/* States: the keys and values of a context's first n_tokens cached tokens, saved to a
 * buffer and loaded into a context of the same model (a prompt cache; a server slot saved
 * to disk). A state is tagged with the model's identity (architecture, shape and a sample
 * of its weights), the cache type and row size, and ends with a checksum; it holds neither
 * the token ids (the caller keeps them) nor logits. Host byte order.
 * _size: the bytes a state of n_tokens takes (0 <= n_tokens <= n_ctx).
 * _save: writes the state of the first n_tokens (<= n_past) to buf (size bytes, at least
 *   _size's), *written (may be NULL) = its bytes. The cache is not changed.
 * _load: replaces the cache by the state's tokens (n_past = *n_tokens, may be NULL); the
 *   logits are dropped (gh_get_logits returns NULL until the next gh_eval). A state that is
 *   not one or is truncated or corrupt (GH_ERR_FORMAT), from another model or cache type
 *   (GH_ERR_INVALID_ARG) or longer than n_ctx (GH_ERR_RANGE) is refused, naming the
 *   problem, and the context is unchanged.
 * _save and _load claim the context as gh_eval does (GH_ERR_BUSY). */
gh_status gh_context_state_size(const gh_context * c, int32_t n_tokens, uint64_t * size);
gh_status gh_context_state_save(gh_context * c, int32_t n_tokens, void * buf, uint64_t size,
                                uint64_t * written);
gh_status gh_context_state_load(gh_context * c, const void * buf, uint64_t size,
                                int32_t * n_tokens);

/* Run tokens at the current position and append them to the cache. With
 * logits_all = 0 only the last token's logits are kept, else one row per token. */
gh_status gh_eval(gh_context * c, const int32_t * tokens, int32_t n_tokens, int32_t logits_all);
/* Logits of the last gh_eval: row i of the rows it kept (n_vocab floats each);
 * i = -1 means the last row. The pointer stays valid until the next gh_eval. */
const float * gh_get_logits(const gh_context * c, int32_t i);
int32_t gh_n_logit_rows(const gh_context * c);
/* Embeddings: gh_eval (the last token's logits kept) that also writes every token's final
 * hidden state, the output norm's output (what the head reads), to out[t * n_embd + j]
 * (n_tokens * n_embd floats). The tokens are appended to the cache as by gh_eval, in the
 * context's FFN mode (set the sparse batch to 0 for the dense FFN's states). */
gh_status gh_eval_embd(gh_context * c, const int32_t * tokens, int32_t n_tokens, float * out);

/* Batches of several contexts (continuous batching in a server): the next tokens of each
 * of n contexts of one model in ONE forward pass: n_tokens[i] >= 1 tokens for ctxs[i] (a
 * decoding context its next token, a context reading a prompt a chunk of it), given one
 * context after another in tokens (sum n_tokens[i] of them). Norms, projections, the FFN
 * and the head run over all the tokens together, so each weight is read once for all of
 * them; each context's tokens join its own cache after its n_past and attend causally over
 * that cache alone. Afterwards each context holds n_tokens[i] more tokens and the logits a
 * gh_eval of those tokens leaves (logits_all = 0: its last token's, gh_get_logits(ctxs[i],
 * 0); else one row per token), equal to a gh_eval's up to the rounding of the matmul's
 * tiles, which group a pass's token rows differently from one context's own pass: bit for
 * bit where a type's tiles sum alike, which they do in every type at AVX2 and AVX-512 (the
 * transposed down of gate and predictor files: in passes of up to 16 tokens; measured on
 * SmolLM2 files of every type, tests/ops/test_batch_exact.py; every architecture's f32 test
 * model within 1e-5), else apart by that rounding, which the quantized types' int8
 * activations can grow (a Q8_0 file whose down is stored transposed, a pass of more than
 * 16 tokens: 3e-2 of the logit range; docs/BENCHMARKS.md "Batched tokens against one-token
 * decode"; tests/model/test_batch.py allows 1e-4 on its files and asks for the same greedy
 * token). The pass borrows ctxs[0]'s buffers and
 * threads (sum n_tokens[i] <= its n_batch) and its statistics count the pass (times, weight
 * bytes, all the tokens); the other contexts' statistics do not change.
 * The sparse FFN modes (sparse, gate, oracle) batch too: each token selects its own active
 * neurons (its predictor, its gate's threshold); gate and up run once over the union of
 * the tokens' lists, each union row read from memory once for all of them (past a union
 * density of one half, where gathered rows cannot beat the streamed ones, as the dense
 * matmuls); each token then takes only its own neurons, so one outside its list adds
 * exactly zero, and runs its activation and down_t's axpy over its own list. So each
 * context's logits are those it gets alone: bit for bit where the gathered four-row dot
 * (and, past the cut, the matmul's tiles) sum each row alike (measured: the shipped f16
 * models, predictor, oracle and gate modes, at AVX-512), else apart by that rounding,
 * within the bound above. A layer split with a device, and the input-sparse FFN, run
 * token by token.
 * Every context must be distinct (a context's tokens are one run), of the same model, have
 * room for its tokens, and evaluate its n_tokens[i] as ctxs[0] evaluates its own: all
 * through the dense FFN (the dense mode, or a sparse batch below the context's count:
 * gh_context_set_sparse_batch), or all through one sparse mode with one input sparsity,
 * else GH_ERR_UNSUPPORTED naming the context: one pass runs one FFN. On any error no
 * context changes. Each context is claimed as gh_eval claims it (GH_ERR_BUSY, and nothing
 * done, if one is in a call on another thread). */
gh_status gh_eval_batch_ex(gh_context * const * ctxs, int32_t n, const int32_t * n_tokens,
                           const int32_t * tokens, int32_t logits_all);
/* Batched decode: gh_eval_batch_ex with one token per context (tokens[i] for ctxs[i]) and
 * each context's logits of it kept. */
gh_status gh_eval_batch(gh_context * const * ctxs, int32_t n, const int32_t * tokens);

/* Profiling (offline predictor training, input-sparsity calibration): gh_eval (logits of
 * the last token only) that also hands back, for every layer l and token t of this call,
 * what the buffers of *out ask for (each may be NULL: not recorded):
 *   ffn_in[l * ffn_in_stride + t * n_embd + j]  the FFN input: the RMS-normed x that
 *                                               feeds gate and up (n_embd floats);
 *   mask[l * mask_stride + t * n_ff + i]        1 if neuron i is active, else 0;
 *   attn_in[l * attn_in_stride + t * n_embd + j]   the attention norm's output (q/k/v input);
 *   attn_out_in[l * attn_out_in_stride + t * dq + j]  the heads' outputs (o's input),
 *                                                  dq = n_head * head_dim;
 *   head_in[t * n_embd + j]                        the final norm's output of every token.
 * A neuron is active iff its activation output is nonzero: ReGLU gate > 0; dReLU
 * gate > 0 and up > 0; SwiGLU/GeGLU act(gate) * up != 0 (almost always: those models
 * are not sparse). Strides are in elements; 0 means packed (n_tokens * n_embd,
 * n_tokens * n_ff, n_tokens * dq), so a caller can also write into a slice of a larger
 * per-layer array. Results do not depend on the thread count. With ffn_in and mask both
 * NULL the batch runs in the context's FFN mode and input sparsity (the sparse batch limit
 * applies as in gh_eval), and the projections' inputs are those each projection sees
 * there, before its thresholds are applied (what they are compared against); with either
 * set, the whole call runs dense. A mixture-of-experts model records no mask. */
typedef struct gh_profile_bufs {
    float *   ffn_in;
    int64_t   ffn_in_stride;
    uint8_t * mask;
    int64_t   mask_stride;
    float *   attn_in;
    int64_t   attn_in_stride;
    float *   attn_out_in;
    int64_t   attn_out_in_stride;
    float *   head_in;
} gh_profile_bufs;
gh_status gh_eval_profile(gh_context * c, const int32_t * tokens, int32_t n_tokens,
                          const gh_profile_bufs * out);

/* ---- sparse FFN (ffn/: strategy_*.c select, exec.c computes) ---- */

/* How a context computes the feed-forward of each layer. */
typedef enum {
    GH_FFN_DENSE  = 0, /* every neuron: gate, up and down over all rows */
    GH_FFN_SPARSE = 1, /* predictor -> active neurons -> gate/up/down over those rows only */
    GH_FFN_ORACLE = 2, /* gate dense, active = neurons with a nonzero activation, then up and
                        * down over those: the dense result (for tests) */
    GH_FFN_GATE   = 3  /* gate dense, active = neurons whose |act(gate)| exceeds the layer's
                        * calibrated threshold (powerinfer.sparse.gate_threshold), then up
                        * and down over those: training-free sparsity for any gated FFN */
} gh_ffn_mode;

/* Sparse, oracle and gate need ffn_down_t in every layer, sparse also a predictor in every
 * layer (files converted with --sparse), gate the gate thresholds (--sparsity); otherwise
 * GH_ERR_UNSUPPORTED with the reason. A new context is in the `auto` mode's choice
 * (gh_model_ffn_auto): the file's mode (sparse when the model has predictors and
 * ffn_down_t in every layer, else gate when it has thresholds and ffn_down_t, else dense)
 * where estimated faster than dense, else dense. The sparse
 * modes apply to batches of up to gh_context_get_sparse_batch tokens (decode), run one
 * token at a time; bigger batches (prompts) use the dense FFN. Profiling the FFN (ffn_in or
 * mask of gh_eval_profile) runs dense; profiling only the projections' inputs keeps the
 * context's modes. */
gh_status gh_context_set_ffn_mode(gh_context * c, int32_t mode);
int32_t gh_context_get_ffn_mode(const gh_context * c);
/* The `auto` mode (a new context's): the file's sparse or gate mode only where it is
 * estimated faster than dense on this machine, else dense. Estimate, in units of the dense
 * FFN's time, each weight's bytes at its path's rate (dense matmul 1; gathered row-dots
 * ratio_rows, column-sparse down ratio_cols, the dense down_t axpy ratio_dt: the kernel
 * ratios per byte read that tools/bench_sparse_kernels.py measured at the density, for the
 * types and SIMD level):
 *   sparse (bytes_pred + d (bytes_gate + bytes_up) / ratio_rows + d bytes_down / ratio_cols) / D
 *   gate   (bytes_gate + d bytes_up / ratio_rows + d bytes_down / ratio_cols) / D
 * where D, the dense FFN's time, is bytes_gate + bytes_up + bytes_down / ratio_dt when the
 * dense FFN runs its down projection through ffn_down_t (dense_down_t: what a sparse or gate
 * file stores, so its dense mode runs the axpy over every row), else with ratio_dt = 1 (the
 * dense matmul of ffn_down); the mode is kept iff est_time < 1. density: what
 * the file's calibration recorded (1 - powerinfer.sparse.target_sparsity for gate files, the
 * mean of the blk.N.ffn_freq frequencies for predictor files); outside [0, 1] (not recorded),
 * or types without measured ratios at the level: the file's mode is kept. */
typedef struct {
    int32_t candidate;        /* the file's mode: GH_FFN_SPARSE, GH_FFN_GATE or GH_FFN_DENSE */
    int32_t simd_level;       /* gh_simd */
    int32_t type_gate;        /* gh_type of the gate/up rows */
    int32_t type_down;        /* gh_type of ffn_down_t */
    double  density;          /* active fraction of the neurons; < 0: unknown */
    double  bytes_gate, bytes_up, bytes_down, bytes_pred; /* one layer's (up 0: ungated) */
    int32_t dense_down_t;     /* 1: the dense FFN's down runs through ffn_down_t (see above) */
} gh_ffn_auto_in;
typedef struct {
    int32_t mode;             /* the choice: GH_FFN_SPARSE, GH_FFN_GATE or GH_FFN_DENSE */
    int32_t file_mode;        /* the file's mode (the candidate), whatever the estimate */
    double  density;
    double  ratio_rows, ratio_cols; /* the kernel ratios used (0: none) */
    double  ratio_dt;         /* the dense down_t axpy's ratio used (1: the dense FFN has ffn_down) */
    double  est_time;         /* the estimate, dense = 1 */
    char    why[256];         /* the choice and its reason, one line */
} gh_ffn_auto_choice;
gh_status gh_ffn_auto_decide(const gh_ffn_auto_in * in, gh_ffn_auto_choice * out);
/* The choice for a model at the current SIMD level (what gh_context_new starts with). */
gh_status gh_model_ffn_auto(const gh_model * m, gh_ffn_auto_choice * out);
/* Input sparsity of the projections that the FFN modes leave dense: attention q/k/v (their
 * shared input, the attention norm's output), o (the heads' concatenated outputs) and the
 * head (the final norm's output). Input i is used iff |x_i| > its calibrated threshold, and
 * only the rows of the transposed weights (attn_qkv_t, attn_output_t, output_t: one row per
 * input channel) of the used inputs are read. It applies with the sparse and gate FFN modes
 * to the batches they run (decode); dense and oracle stay exact. on = 1 needs a file
 * converted with --input-sparsity (else GH_ERR_UNSUPPORTED with the reason); a new context
 * has it on when the file has it. A site whose thresholds are all 0 runs the dense matmul
 * (nothing to skip but exact zeros), so sparsity 0 equals dense exactly. On a device the
 * attention and head placed there stay dense. */
gh_status gh_context_set_input_sparse(gh_context * c, int32_t on);
int32_t gh_context_get_input_sparse(const gh_context * c);
/* Largest batch the sparse modes apply to (default 4, measured: README "Sparse FFN");
 * 0 = never (every batch dense). */
gh_status gh_context_set_sparse_batch(gh_context * c, int32_t n_max);
int32_t gh_context_get_sparse_batch(const gh_context * c);

/* Drafting (speculative decoding's cheap drafter, whose tokens a dense pass then verifies):
 * two settings of a context that make its tokens cheaper and its logits those of a smaller
 * model. Both apply to every gh_eval of the context until changed back (and to a
 * gh_eval_batch_ex of that context alone); a batch of several contexts, one of which has
 * either set, is refused (GH_ERR_UNSUPPORTED).
 * _head_rows: with n > 0 the head computes the logits of the tokens ids[0..n) only (their
 *   rows of the head, copied here into one compact matrix, so it reads n rows instead of
 *   n_vocab), every other token's logit is -INFINITY; n = 0 (ids may be NULL) restores the
 *   full head, keeping the copy, so that setting the same ids again copies nothing (a
 *   drafter switches back and forth every round). Ids in [0, n_vocab), each at most once
 *   (else GH_ERR_INVALID_ARG / RANGE).
 * _layer_skip: skip[il] != 0 makes layer il pass the residual stream through unchanged
 *   (its attention and FFN do not run, its cache rows at those positions are not written:
 *   truncate them before a full-depth pass reads them); skip NULL (n 0) runs every layer.
 *   n must be the model's layer count. */
gh_status gh_context_set_head_rows(gh_context * c, const int32_t * ids, int32_t n);
int32_t gh_context_get_head_rows(const gh_context * c);
gh_status gh_context_set_layer_skip(gh_context * c, const uint8_t * skip, int32_t n);
/* layers skipped now (0: none) */
int32_t gh_context_get_layer_skip(const gh_context * c);

/* What the context did since it was made or gh_context_reset_stats. Bytes are weight
 * bytes read (a batch reads a weight once for all its tokens); times are wall-clock
 * seconds inside gh_eval. */
typedef struct {
    int32_t n_layer;
    int32_t ffn_mode;          /* current gh_ffn_mode */
    int64_t n_tokens;          /* tokens evaluated */
    int64_t n_sparse_tokens;   /* of them, tokens whose FFN ran sparse or oracle */
    int64_t n_active;          /* active neurons (predicted, or exact in oracle mode),
                                * summed over layers and sparse tokens */
    int64_t n_up_rows;         /* up rows the CPU read for sparse tokens (relu family: active
                                * with gate > 0) */
    int64_t n_down_rows;       /* ffn_down_t rows the CPU read for sparse tokens (nonzero
                                * activation) */
    double  density;           /* n_active / (n_sparse_tokens * n_layer * n_ff); 0 if none (a
                                * mixture: over its layers with experts, each n_expert_used *
                                * n_ff_exp wide) */
    double  bytes_attention;   /* q, k, v, o projections */
    double  bytes_predictor;   /* fc1 + fc2 */
    double  bytes_ffn;         /* gate, up, down rows read (sparse: active rows only) */
    double  bytes_head;        /* output projection (when logits are computed) */
    double  bytes_per_token;   /* the four above / n_tokens */
    double  t_attention;       /* norms, projections, rope, attention, residual */
    double  t_predictor;
    double  t_ffn;             /* norm, gate/up, activation, down, residual */
    double  t_other;           /* embedding, head, bookkeeping: t_total - the three above */
    double  t_total;
    /* hybrid runs (a model on a device; without one, everything is on the CPU) */
    int64_t n_active_device;   /* active neurons computed on the device (hot), of n_active */
    int64_t n_active_cpu;      /* ... and on the CPU: n_active_device + n_active_cpu = n_active */
    double  bytes_device;      /* weight bytes read on the device (all stages) */
    double  bytes_uploaded;    /* activations sent to the device */
    double  bytes_downloaded;  /* results copied back */
    double  t_device;          /* seconds the device worked (its own clock) */
    double  t_cpu_ffn;         /* seconds of the CPU half of hybrid FFNs (layers with hot neurons) */
    double  t_wait;            /* seconds the CPU waited for the device */
    /* input-sparse projections (gh_context_set_input_sparse): input channels seen and used
     * (|x_i| > threshold_i) by the attention's q/k/v and o projections, and by the head,
     * summed over the tokens that ran them input-sparse */
    int64_t n_attn_inputs, n_attn_inputs_used;
    int64_t n_head_inputs, n_head_inputs_used;
    double  attn_input_density; /* n_attn_inputs_used / n_attn_inputs; 0 if none */
    double  head_input_density; /* n_head_inputs_used / n_head_inputs; 0 if none */
    /* mixture of experts on a device: expert runs (an expert over the tokens of a batch
     * that chose it) on the device (placed or cached) and on the CPU; of the runs of CPU
     * experts, those the expert cache held (hits) and those it uploaded (misses), and the
     * bytes it uploaded */
    int64_t n_expert_runs_device, n_expert_runs_cpu;
    int64_t n_cache_hits, n_cache_misses;
    double  bytes_cache_uploaded;
} gh_context_stats;

/* layer_density (may be NULL): n_layer >= the model's layer count values, each that
 * layer's active / n_ff averaged over sparse tokens. */
gh_status gh_context_get_stats(const gh_context * c, gh_context_stats * out,
                               double * layer_density, int32_t n_layer);
gh_status gh_context_reset_stats(gh_context * c);
/* Mixture-of-experts models: how many times each expert of each layer was chosen since
 * the context was made or gh_context_reset_stats (a token counts once for each of its
 * n_expert_used experts, prompt tokens too): counts[l * n_expert + e], n >= n_layer *
 * n_expert values. A model without experts has no counts (nothing is written). */
gh_status gh_context_get_expert_counts(const gh_context * c, int64_t * counts, int64_t n);

/* Sparse ops on raw buffers (tests, tools). Weights are row-major as in GGUF.
 * Predictor: score = fc2 . relu(fc1 . x), fc1 h x n_embd, fc2 n_ff x h; writes the ids with
 * score >= threshold to active (n_ff capacity) in ascending order, their count to
 * *n_active, and the scores to score (n_ff floats; may be NULL). */
gh_status gh_op_sparse_predict(int fc1_type, const void * fc1, int fc2_type, const void * fc2,
                               int64_t n_embd, int64_t h, int64_t n_ff, const float * x,
                               float threshold, int32_t * active, int64_t * n_active,
                               float * score, int n_threads);
/* a[k] = act(gate[ids[k]] . x, up[ids[k]] . x) for k < n (gate, up: rows x cols of type;
 * ids in any order, each in [0, rows)); up NULL: a[k] = act(gate[ids[k]] . x) (an ungated
 * FFN); act_t: FATReLU's threshold. */
gh_status gh_op_sparse_glu(int type, const void * gate, const void * up, int64_t rows,
                           int64_t cols, int act, float act_t, const float * x,
                           const int32_t * ids, int64_t n, float * a, int n_threads);
/* The batched decode's gate/up (gh_eval_batch's sparse modes): n tokens (1..64), x: n x
 * cols, mask: n x rows bytes (token t lists neuron i when mask[t * rows + i] != 0). Gate
 * and up run over the union of the lists, each union row read once for all tokens; then
 * a[t * rows + i] = act(gate[i] . x_t, up[i] . x_t) for the neurons token t lists and exactly
 * 0 for the others, equal to gh_op_sparse_glu over the token's own list (bit for bit where
 * the type has a gathered four-row dot kernel). */
gh_status gh_op_sparse_glu_union(int type, const void * gate, const void * up, int64_t rows,
                                 int64_t cols, int act, float act_t, const float * x, int32_t n,
                                 const uint8_t * mask, float * a, int n_threads);
/* y[c] = sum_k a[k] * W[ids[k]][c] for c < cols (W: rows x cols of type, the transposed
 * down projection; ids in any order, each in [0, rows); y overwritten). Threads split the
 * columns: the result does not depend on n_threads. */
gh_status gh_op_sparse_down(int type, const void * w, int64_t rows, int64_t cols,
                            const int32_t * ids, const float * a, int64_t n, float * y,
                            int n_threads);

/* Input-sparse matvec through a transposed weight (the projections' sparse path):
 * y[c] = sum over i < rows with |x[i]| > thr[i] of x[i] * W[i][c], for c < cols (W: rows =
 * input channels x cols = outputs, of type; thr NULL: every nonzero x[i]; y overwritten);
 * the inputs are added in ascending i. *n_used (may be NULL) = the inputs used. Threads split
 * the columns: the result does not depend on n_threads; with thr NULL it equals
 * gh_op_matmul_t of the one token bit for bit. */
gh_status gh_op_sparse_cols(int type, const void * w, int64_t rows, int64_t cols,
                            const float * x, const float * thr, float * y, int64_t * n_used,
                            int n_threads);

/* The FFN of one token with input sparsity on both its inputs (TEAL on the FFN):
 * gu[c] = sum over i < n_embd with |x[i]| > thr_in[i] of x[i] * GU[i][c] (GU = gate_up_t:
 * n_embd rows x (2 n_ff gated, else n_ff) cols of type: the gate's outputs, then the up's);
 * h[j] = act(gu[j]) * gu[n_ff + j] (ungated: act(gu[j])); y[c] = sum over j < n_ff with
 * |h[j]| > thr_down[j] of h[j] * D[j][c] (D = down_t: n_ff rows x n_embd cols of down_type),
 * inputs and rows added in ascending order; thr_in / thr_down NULL: every nonzero value; y
 * (n_embd) overwritten. *n_in, *n_down (may be NULL): the inputs and down rows used. act:
 * gh_act, act_t: FATReLU's threshold. The result does not depend on n_threads. */
gh_status gh_op_ffn_input_sparse(int type, const void * gate_up_t, int down_type, const void * down_t,
                                 int64_t n_embd, int64_t n_ff, int32_t gated, int32_t act, float act_t,
                                 const float * x, const float * thr_in, const float * thr_down, float * y,
                                 int64_t * n_in, int64_t * n_down, int n_threads);

/* ---- devices (the backends of the hybrid runtime) ---- */

/* Device names: "cpu" (no device: everything on the CPU), "host-device" (a simulated
 * device: its memory is host RAM, capacity GH_HOST_DEVICE_MEM bytes, default 4 GiB, and its
 * ops run the reference kernels on a thread of their own; it exercises the whole hybrid
 * path on any machine), "cuda" or "cuda:N" (NVIDIA GPU N; needs a build with nvcc); the
 * list is the registry's (gh_device_kind_get). GH_OK if the device can be used here, else
 * GH_ERR_UNSUPPORTED and the reason (GH_ERR_INVALID_ARG for a name no backend has, the
 * message listing the names). */
gh_status gh_device_check(const char * device);
/* Whether this library was built with the CUDA backend. */
int32_t gh_have_cuda(void);

/* One kind of device the library knows (a row of the backend registry): what Python's
 * device lists, its error messages and its choice of a GPU (n_gpu_layers, -ngl) read, so
 * that a new backend is named there without an edit. */
typedef struct {
    const char * name;        /* "host-device", "cuda" (static) */
    int32_t      indexed;     /* 1: "name:N" is device N ("name": device 0) */
    int32_t      accelerator; /* 1: real hardware, what n_gpu_layers asks for; 0: simulated */
    int32_t      built;       /* 1: this build has the backend */
} gh_device_kind;
/* The number of device kinds ("cpu", no device, is none of them). */
int32_t gh_device_kind_count(void);
/* Kind i (0 <= i < gh_device_kind_count()) in the registry's order. */
gh_status gh_device_kind_get(int32_t i, gh_device_kind * out);

/* Device ops on raw host buffers (tests of every backend against numpy): each call opens
 * the device, uploads the weights, runs the op, copies the result back and frees it all.
 * matmul: y[t][r] = W[r] . x[t] (W rows x cols of type, x n x cols, y n x rows).
 * predict: score[i] = fc2[i] . relu(fc1 . x) (fc1 h x n_embd, fc2 n_ff x h).
 * hot_ffn: for k < n_rows, r = rows[k] < n_hot:
 *   a_k = act(gate[r] . x + gate_b[r], up[r] . x + up_b[r]) (act_t: FATReLU's threshold);
 *   y = sum_k a_k down_t[r] (gate, up: n_hot x n_embd of type; down_t n_hot x n_embd of
 *   down_type; y n_embd floats). up NULL: an ungated FFN, a_k = act(gate[r] . x + gate_b[r]);
 *   a NULL bias adds nothing. */
gh_status gh_device_op_matmul(const char * device, int type, const void * w, int64_t rows,
                              int64_t cols, const float * x, int64_t n, float * y);
gh_status gh_device_op_predict(const char * device, int fc1_type, const void * fc1,
                               int fc2_type, const void * fc2, int64_t n_embd, int64_t h,
                               int64_t n_ff, const float * x, float * score);
gh_status gh_device_op_hot_ffn(const char * device, int type, const void * gate,
                               const void * up, const float * gate_b, const float * up_b,
                               int down_type, const void * down_t, int64_t n_hot,
                               int64_t n_embd, int act, float act_t, const float * x,
                               const int32_t * rows, int64_t n_rows, float * y);

/* ---- sampling ---- */

typedef struct gh_sampler gh_sampler;

typedef struct {
    float    temperature;     /* <= 0: greedy */
    int32_t  top_k;           /* <= 0: off */
    float    top_p;           /* >= 1: off */
    float    min_p;           /* <= 0: off */
    float    repeat_penalty;  /* 1: off */
    int32_t  repeat_last_n;   /* tokens of history the penalty looks at */
    uint64_t seed;
} gh_sampler_params;

gh_sampler_params gh_sampler_default_params(void);
gh_status gh_sampler_new(const gh_sampler_params * p, int32_t n_vocab, gh_sampler ** out);
void gh_sampler_free(gh_sampler * s);
/* Add a token to the history the repetition penalty sees. */
void gh_sampler_accept(gh_sampler * s, int32_t token);
void gh_sampler_reset(gh_sampler * s);
/* Sample from one row of logits (n_vocab floats). Does not accept the token. */
gh_status gh_sampler_sample(gh_sampler * s, const float * logits, int32_t * out_token);
/* The distribution gh_sampler_sample draws from (speculative decoding compares two of
 * them): probs[i] (n_vocab floats, summing to 1) after the repetition penalty, temperature,
 * top-k, top-p and min-p, as if the n_extra tokens `extra` (drafted, not accepted yet; may be
 * NULL when n_extra is 0) had been accepted after the history; greedy (temperature <= 0): 1
 * at the token gh_sampler_sample picks, 0 elsewhere. Draws no random number. */
gh_status gh_sampler_probs(gh_sampler * s, const float * logits, const int32_t * extra,
                           int32_t n_extra, float * probs);
/* The next uniform number in [0, 1) of the sampler's seeded stream (the one
 * gh_sampler_sample draws from), for draws made outside it. */
double gh_sampler_random(gh_sampler * s);

/* CFFI-END */

#ifdef __cplusplus
}
#endif

#endif /* GGML_HYBRID_H */
