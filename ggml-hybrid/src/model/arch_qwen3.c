/* Qwen3 (dense): Qwen2's block without the q/k/v biases and with an RMSNorm of q and of k
 * on each head (weights [head_dim], shared by the heads) between the projection and RoPE.
 * NeoX RoPE on unpermuted q/k rows, as llama.cpp stores and runs them. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_qwen3 = {
    .name = "qwen3",
    .models = "Qwen3 (dense)",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .qk_norm = GH_QK_NORM_HEAD,
};
