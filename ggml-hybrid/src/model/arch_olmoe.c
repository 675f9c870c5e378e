/* OLMoE: llama's pre-norm block with q and k RMS-normed over the whole projection
 * (weights [n_head·head_dim] and [n_head_kv·head_dim]) before NeoX RoPE on unpermuted
 * q/k, and a mixture of experts in place of the FFN: softmax router, top-k weights not
 * renormalised (llama.cpp's rule, the released config's norm_topk_prob; files of ours say
 * which in olmoe.expert_weights_norm). The experts' width is feed_forward_length. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_olmoe = {
    .name = "olmoe",
    .models = "OLMoE",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .qk_norm = GH_QK_NORM_PROJ,
    .moe = GH_MOE_REQUIRED,
    .expert_norm = false,
};
