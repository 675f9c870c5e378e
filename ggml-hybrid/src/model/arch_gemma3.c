/* Gemma 3 (text): Gemma 2's block (GeGLU with tanh GELU, norms on each sublayer's input and
 * output with 1 + w folded into the weights, embeddings times sqrt(n_embd), q scaled by
 * query_pre_attn_scalar^-1/2) plus an RMSNorm of each q and k head (attn_q_norm /
 * attn_k_norm, [head_dim]) before RoPE, and no attention soft-capping. Five local layers
 * to one global (layer il is global iff il % 6 == 5) when the file has a sliding window;
 * local layers rotate with their own base (rope.freq_base_swa, 10000 when absent) and no
 * scaling, global ones with rope.freq_base and the linear scaling the file states. Final
 * logits are capped only when the file says so. The head is output.weight, or token_embd
 * when the file has none.
 *
 * As llama.cpp's files have no key for the query scalar, q.k is scaled by
 * 1/sqrt(n_embd / n_head) for the 27B (62 layers), 1/sqrt(head_dim) otherwise, unless the
 * file states attention.scale (ours do). */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_gemma3 = {
    .name = "gemma3",
    .models = "Gemma 3 (text)",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .gated = true,
    .default_act = GH_ACT_GELU,
    .qk_norm = GH_QK_NORM_HEAD,
    .post_norms = true,
    .scale_embd = true,
    .swa_pattern = 6,
    .rope_base_swa = 10000.0f,
    .scale_by_embd_layers = 62,
};
