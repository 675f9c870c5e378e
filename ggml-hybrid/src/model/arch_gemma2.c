/* Gemma 2: GeGLU FFN (tanh GELU), RMSNorm on each sublayer's input and output
 * (attn_norm, post_attention_norm, ffn_norm, post_ffw_norm; Gemma's 1 + w is folded into the
 * stored weights by llama.cpp's converter and ours), token embeddings times sqrt(n_embd), a
 * head size of its own (key_length, 256 in the released models), q scaled by
 * query_pre_attn_scalar^-1/2, attention scores and final logits soft-capped
 * (c tanh(x / c)), and sliding-window attention on every other layer (0, 2, 4, ...). NeoX
 * RoPE on unpermuted q/k rows; the head is token_embd (tied).
 *
 * llama.cpp's defaults where its files carry no key: window 4096, caps 50 (attention) and
 * 30 (logits), local layers rotate as the global ones; it has no key for the query scalar
 * and takes 1/sqrt(n_embd / n_head) for the 27B (46 layers), 1/sqrt(head_dim) otherwise. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_gemma2 = {
    .name = "gemma2",
    .models = "Gemma 2",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_GELU,
    .post_norms = true,
    .scale_embd = true,
    .swa_pattern = 2,
    .n_swa_default = 4096,
    .attn_softcap = 50.0f,
    .final_softcap = 30.0f,
    .scale_by_embd_layers = 46,
};
