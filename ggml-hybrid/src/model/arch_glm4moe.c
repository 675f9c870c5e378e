/* GLM-4.5 / GLM-4.5-Air / GLM-4.6 (Glm4MoeForCausalLM), as llama.cpp writes it
 * (general.architecture "glm4moe"): a pre-norm block with q/k/v biases (attention_bias),
 * per-head q/k RMSNorm where the file has it (use_qk_norm: GLM-4.5's released configs have
 * none, GLM-4.6's some), NeoX RoPE over the first rope.dimension_count dims of each head
 * (partial_rotary_factor 0.5), the FFN's input norm named post_attention_norm, dense FFNs in
 * the first leading_dense_block_count layers and DeepSeek-V3's mixture of experts in the
 * rest: a sigmoid router whose choice adds exp_probs_b (e_score_correction_bias) within the
 * best expert_group_used_count of expert_group_count groups, weights from the unbiased
 * sigmoid (renormalised when expert_weights_norm) times expert_weights_scale
 * (routed_scaling_factor), and expert_shared_count shared experts of the experts' width
 * added unweighted. The multi-token prediction layers (nextn_predict_layers, blk.n_layer..)
 * are left alone, as llama.cpp leaves them. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_glm4moe = {
    .name = "glm4moe",
    .models = "GLM-4.5, GLM-4.6",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .qk_norm = GH_QK_NORM_HEAD,
    .qk_norm_optional = true,
    .partial_rope = true,
    .moe = GH_MOE_REQUIRED,
    .expert_norm = false, /* llama.cpp's default; its converter writes the config's */
    .expert_gating = GH_GATING_SIGMOID,
    .exp_probs_b = true,
    .shexp_by_count = true,
    .dense_lead = true,
    .nextn = true,
    .ffn_norm = "post_attention_norm",
};
