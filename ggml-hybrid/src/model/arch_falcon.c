/* Falcon: LayerNorm, fused QKV (MQA in 7B, GQA in 40B/180B), NeoX RoPE, ungated GELU FFN,
 * and a parallel block: attention and FFN read the same normed input (attn_norm), or two
 * norms of it (new_decoder_architecture: attn_norm_2 for the attention, attn_norm for the
 * FFN, as llama.cpp names them), and both add
 * to the residual. A file with blk.N.ffn_norm runs sequentially instead. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_falcon = {
    .name = "falcon",
    .models = "Falcon-7B/40B/180B, ReluFalcon",
    .norm = GH_NORM_LAYER,
    .rope = GH_ROPE_NEOX,
    .fused_qkv = true,
    .parallel = true,
    .default_act = GH_ACT_GELU, /* llama.cpp's falcon runs tanh-GELU; our converter names
                                 * the exact one (gelu_erf) that transformers uses */
};
