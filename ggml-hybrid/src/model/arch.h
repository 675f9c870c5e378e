/* Architectures as data. An architecture is one descriptor (one file, arch_<name>.c) that
 * says how its block is built from the shared pieces; the loader (model.c) reads the
 * common keys and tensors under the architecture's name and the forward pass (forward.c)
 * runs whatever the descriptor and the loaded tensors say. The hyper-parameters the
 * runtime works with are gh_hparams (internal), not the public gh_model_info, so a new key
 * does not change the ABI.
 *
 * Adding an architecture: docs/FORMAT.md, "Adding an architecture". */
#ifndef GH_ARCH_H
#define GH_ARCH_H

#include "core/common.h"
#include "gguf/gguf.h"

typedef enum { GH_NORM_RMS, GH_NORM_LAYER } gh_norm_kind;
typedef enum { GH_ROPE_NONE, GH_ROPE_NORMAL, GH_ROPE_NEOX } gh_rope_kind;
/* RMSNorm of q and k after their projection, before RoPE: none, each head on its own
 * (weights [head_dim], Qwen3), or the whole projection at once (weights [n_head·head_dim]
 * and [n_head_kv·head_dim], OLMo 2) */
typedef enum { GH_QK_NORM_NONE, GH_QK_NORM_HEAD, GH_QK_NORM_PROJ } gh_qk_norm;
/* Whether an architecture's FFN is a mixture of experts (ffn/moe.h): never, when the file
 * says so ({arch}.expert_count > 0: llama.cpp writes Mixtral as `llama`), or always. */
typedef enum { GH_MOE_NONE, GH_MOE_OPTIONAL, GH_MOE_REQUIRED } gh_moe_kind;
/* A router's gating function, llama.cpp's {arch}.expert_gating_func values: the experts'
 * probabilities are softmax(logits) (1), or each its own sigmoid(logit) (2, DeepSeek-V3's
 * router: chosen by sigmoid + exp_probs_b, weighted by the unbiased sigmoid). */
typedef enum { GH_GATING_SOFTMAX = 1, GH_GATING_SIGMOID = 2 } gh_gating;

typedef struct {
    int32_t n_vocab, n_ctx_train, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    int32_t bos_id, eos_id;
    /* FFN */
    bool    gated;          /* down(act(gate x) * up x); else down(act(up x)) */
    int32_t ffn_act;        /* gh_act */
    bool    act_from_file;  /* powerinfer.ffn_activation present */
    float   act_threshold;  /* FATReLU's t (powerinfer.ffn_act_threshold); the clamped
                             * SwiGLU's limit ({arch}.swiglu_clamp_exp, default 7) */
    /* block */
    gh_norm_kind norm;
    float   norm_eps;
    bool    parallel;       /* attention and FFN both read the layer input and both add to
                             * the residual (Falcon) */
    gh_qk_norm qk_norm;
    bool    post_norms;     /* each sublayer's output is normed before the residual add */
    /* positions */
    gh_rope_kind rope;
    float   rope_theta;
    float   rope_freq_scale;   /* linear scaling: positions times this (1 / factor) */
    float * rope_freqs;        /* [head_dim / 2] frequency divisors (rope_freqs.weight,
                                * Llama-3 scaling; YaRN's ramp, computed at load), owned;
                                * NULL: none */
    float   rope_attn_factor;  /* cos and sin times this (YaRN's 0.1 ln(factor) + 1; else 1) */
    int32_t nope_every;        /* layers il with (il + 1) % nope_every == 0 have no RoPE
                                * (0: every layer has it) */
    int32_t n_rot;             /* the first n_rot dims of each head rotate (rope.dimension_count,
                                * NeoX pairs (i, i + n_rot / 2)); the rest pass through */
    /* sliding-window layers (Gemma): a local layer (gh_layer.swa) attends to the n_swa most
     * recent positions, itself included, with its own RoPE base and scale */
    int32_t n_swa;             /* 0: every layer attends to the whole context */
    uint8_t * swa;             /* [n_layer] 1: local layer (owned by the model; NULL: none) */
    float   rope_theta_swa, rope_freq_scale_swa;
    /* attention and head */
    float   embd_scale;        /* token embeddings times this (Gemma: sqrt(n_embd)) */
    float   attn_scale;        /* q.k times this (Gemma: query_pre_attn_scalar^-1/2) */
    float   attn_softcap;      /* scores -> c tanh(scores / c) after scaling (0: none) */
    float   final_softcap;     /* logits -> c tanh(logits / c) (0: none) */
    int32_t pos_offset;        /* learned positions: row pos + offset of position_embd */
    int32_t n_pos;             /* rows of position_embd (0: no learned positions) */
    /* mixture of experts (n_expert > 0; ffn/moe.h): each token runs the n_expert_used
     * experts its router scores highest, weighted by their softmax probabilities
     * (renormalised over the chosen ones when expert_norm, then times expert_scale), plus
     * a shared expert of width n_ff_shexp behind a sigmoid gate where the architecture has one */
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    bool    expert_norm;
    float   expert_scale;
    /* the router's gating (gh_gating); the sigmoid router's group-limited choice: experts in
     * n_expert_groups equal groups of consecutive ids, each group scored by the sum of its
     * two highest selection scores, only the n_group_used best groups' experts eligible
     * (1 group: no limit) */
    int32_t expert_gating, n_expert_groups, n_group_used;
    /* the first n_dense_lead layers have a dense FFN of width n_ff (leading_dense_block_count) */
    int32_t n_dense_lead;
    /* layers past n_layer in the file (nextn_predict_layers: GLM-4.5's multi-token prediction
     * layers), loaded by nobody: llama.cpp's files keep them as blk.n_layer.. */
    int32_t n_nextn;
    /* sparse extension */
    bool    pred_residual;     /* predictors read the residual stream before the FFN's norm
                                * (PowerInfer's), not the normed input (ours) */
} gh_hparams;

typedef struct gh_arch {
    const char * name;         /* general.architecture, the prefix of its keys */
    const char * models;       /* the model families it runs, for messages */
    gh_norm_kind norm;         /* the eps key follows: layer_norm_rms_epsilon / _epsilon */
    gh_rope_kind rope;
    bool         fused_qkv;    /* blk.N.attn_qkv (rows: q heads, k heads, v heads) */
    bool         gated;        /* blk.N.ffn_gate is part of the FFN */
    bool         fused_gate_up;/* gated, with gate and up as the two row halves of ffn_up */
    bool         parallel;     /* parallel block unless blk.N.ffn_norm says sequential */
    bool         learned_pos;  /* position_embd.weight, row pos + pos_offset */
    int32_t      pos_offset;
    int32_t      default_act;  /* when the file does not name its activation */
    gh_qk_norm   qk_norm;      /* blk.N.attn_q_norm / attn_k_norm */
    bool         no_pre_norms; /* no attn_norm / ffn_norm: each sublayer reads x itself */
    bool         post_norms;   /* blk.N.post_attention_norm and post_ffw_norm norm each
                                * sublayer's output before it is added to x */
    int32_t      nope_every;   /* every nope_every-th layer has no RoPE (SmolLM3: 4, part of
                                * the architecture: llama.cpp's files carry no key for it) */
    /* Gemma */
    bool         scale_embd;   /* token embeddings times sqrt(n_embd) */
    int32_t      swa_pattern;  /* sliding windows: layer il is local iff il % swa_pattern <
                                * swa_pattern - 1, unless <arch>.attention.sliding_window_pattern
                                * says otherwise (0: no sliding windows; the key is ignored) */
    int32_t      n_swa_default;/* the window when the file has no attention.sliding_window
                                * (0: then no layer is local) */
    float        rope_base_swa;/* local layers' RoPE base when the file has no rope.freq_base_swa,
                                * unscaled (0: local layers rotate as the global ones) */
    float        attn_softcap, final_softcap; /* when the file has no <arch>.attn_ /
                                * final_logit_softcapping (0: none) */
    int32_t      scale_by_embd_layers; /* no attention.scale key: q.k scaled by
                                * 1/sqrt(n_embd / n_head) in a model of this many layers (the
                                * 27B's), 1/sqrt(head_dim) otherwise (0: always the latter) */
    gh_moe_kind  moe;          /* experts in place of the dense FFN (blk.N.ffn_gate_inp, ...) */
    bool         expert_norm;  /* renormalised top-k weights when the file has no
                                * {arch}.expert_weights_norm (llama.cpp fixes it per architecture) */
    bool         shared_expert;/* a shared expert beside the routed ones (blk.N.ffn_*_shexp) */
    /* DeepSeek-V3's MoE (glm4moe, dots1) */
    int32_t      expert_gating;/* gh_gating when the file has no {arch}.expert_gating_func (0:
                                * softmax) */
    bool         exp_probs_b;  /* blk.N.exp_probs_b.bias [n_expert] required: the selection bias
                                * of a sigmoid router (other architectures: read where present) */
    bool         shexp_by_count; /* the shared experts are expert_shared_count experts of the
                                * routed experts' width fused into one (0: none), unweighted */
    bool         dense_lead;   /* {arch}.leading_dense_block_count dense-FFN layers first */
    bool         nextn;        /* {arch}.nextn_predict_layers trailing layers to leave alone */
    bool         qk_norm_optional; /* qk_norm where the file has blk.0.attn_q_norm (GLM-4.5's
                                * use_qk_norm), else none */
    bool         partial_rope; /* rope.dimension_count may be below the head size */
    /* gpt-oss */
    bool         expert_biases;/* ffn_gate_inp.bias and ffn_{gate,up,down}_exps.bias required
                                * (other MoE architectures: read where the file has them) */
    bool         attn_sinks;   /* blk.N.attn_sinks.weight [n_head] required: a logit per head
                                * in each softmax's denominator */
    const char * ffn_norm;     /* the FFN's input norm's tensor (NULL: "ffn_norm"; gpt-oss:
                                * llama.cpp names it "post_attention_norm") */
    bool         yarn_exact;   /* YaRN's ramp between its unrounded correction dims (the
                                * model's reference and transformers' truncate=false), not
                                * llama.cpp's floor/ceil of them */
} gh_arch;

/* The descriptor for general.architecture = name, or NULL. */
const gh_arch * gh_arch_find(const char * name);
/* "llama, qwen2, ..." (static). */
const char * gh_arch_names(void);

extern const gh_arch gh_arch_llama, gh_arch_qwen2, gh_arch_falcon, gh_arch_opt, gh_arch_phi3,
    gh_arch_qwen3, gh_arch_olmo2, gh_arch_smollm3, gh_arch_gemma2, gh_arch_gemma3,
    gh_arch_qwen2moe, gh_arch_qwen3moe, gh_arch_olmoe, gh_arch_gptoss, gh_arch_glm4moe,
    gh_arch_dots1;

#endif
