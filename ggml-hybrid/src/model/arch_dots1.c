/* dots.llm1 (Dots1ForCausalLM), as llama.cpp writes it (general.architecture "dots1"):
 * Qwen3's block (per-head q/k RMSNorm, no biases, NeoX RoPE) with dense FFNs in the first
 * leading_dense_block_count layers and DeepSeek-V3's mixture of experts in the rest, the
 * router and shared experts as glm4moe's (arch_glm4moe.c): sigmoid scores chosen with
 * exp_probs_b within the best groups, weighted unbiased, renormalised when
 * expert_weights_norm, times expert_weights_scale, expert_shared_count shared experts added
 * unweighted. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_dots1 = {
    .name = "dots1",
    .models = "dots.llm1",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .qk_norm = GH_QK_NORM_HEAD,
    .moe = GH_MOE_REQUIRED,
    .expert_norm = false, /* llama.cpp's default; its converter writes the config's */
    .expert_gating = GH_GATING_SIGMOID,
    .exp_probs_b = true,
    .shexp_by_count = true,
    .dense_lead = true,
};
