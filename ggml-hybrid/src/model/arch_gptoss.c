/* gpt-oss (gpt-oss-20b, gpt-oss-120b), as llama.cpp writes it (general.architecture
 * "gpt-oss"): a pre-norm block with biased q/k/v/o projections, a learned attention sink per
 * head (blk.N.attn_sinks: one more logit in each softmax's denominator), sliding-window
 * attention on the even layers (0, 2, ...; window attention.sliding_window, 128 in the
 * released models) and full attention on the odd ones, NeoX RoPE with YaRN scaling, and a
 * mixture of experts in every layer: a biased softmax router whose top-k logits are
 * softmaxed (the renormalised top-k of the full softmax), experts with biased gate/up/down
 * (MXFP4 in llama.cpp's files) and a clamped SwiGLU, (clamp(up, -7, 7) + 1) *
 * g sigmoid(1.702 g) with g = min(gate, 7).
 *
 * llama.cpp's names: the FFN's input norm is post_attention_norm (the HF name), not ffn_norm;
 * it has no key for the SwiGLU's limit (7) or gain (1.702) and always renormalises. YaRN's
 * ramp follows the model's reference (unrounded ends), where llama.cpp rounds them. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_gptoss = {
    .name = "gpt-oss",
    .models = "gpt-oss",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SWIGLU_OAI,
    .swa_pattern = 2,
    .n_swa_default = 128,
    .moe = GH_MOE_REQUIRED,
    .expert_norm = true,
    .expert_biases = true,
    .attn_sinks = true,
    .ffn_norm = "post_attention_norm",
    .yarn_exact = true,
};
