/* Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block (q/k/v biases, NeoX RoPE on
 * unpermuted q/k) with a mixture of experts in place of the FFN: softmax router, top-k
 * weights NOT renormalised (llama.cpp's rule; files of ours say so in
 * qwen2moe.expert_weights_norm), and a shared expert whose output is scaled by
 * sigmoid(ffn_gate_inp_shexp . x) and added. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_qwen2moe = {
    .name = "qwen2moe",
    .models = "Qwen1.5-MoE, Qwen2-MoE",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .moe = GH_MOE_REQUIRED,
    .expert_norm = false,
    .shared_expert = true,
};
