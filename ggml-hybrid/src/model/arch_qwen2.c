/* Qwen2 / Qwen2.5: llama's block with q/k/v biases, and NeoX RoPE on unpermuted q/k rows
 * (as llama.cpp stores and runs them). */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_qwen2 = {
    .name = "qwen2",
    .models = "Qwen2, Qwen2.5",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
};
