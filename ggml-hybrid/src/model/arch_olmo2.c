/* OLMo 2: llama's projections and SwiGLU FFN, but the block norms each sublayer's output
 * instead of its input (x += post_attention_norm(attn(x)); x += post_ffw_norm(ffn(x))),
 * and q and k are RMS-normed over the whole projection (weights [n_head·head_dim] and
 * [n_head_kv·head_dim]) before RoPE. NeoX RoPE on unpermuted q/k, as llama.cpp runs it. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_olmo2 = {
    .name = "olmo2",
    .models = "OLMo 2",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .qk_norm = GH_QK_NORM_PROJ,
    .no_pre_norms = true,
    .post_norms = true,
};
