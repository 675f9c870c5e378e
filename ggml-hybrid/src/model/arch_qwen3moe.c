/* Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's block (per-head q/k RMSNorm, no biases,
 * NeoX RoPE) with a mixture of experts in place of the FFN: softmax router, top-k weights
 * renormalised (llama.cpp's rule, as the released configs' norm_topk_prob; files of ours
 * say which in qwen3moe.expert_weights_norm), no shared expert. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_qwen3moe = {
    .name = "qwen3moe",
    .models = "Qwen3-MoE",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .qk_norm = GH_QK_NORM_HEAD,
    .moe = GH_MOE_REQUIRED,
    .expert_norm = true,
};
