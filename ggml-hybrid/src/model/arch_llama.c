/* LLaMA and the llama-shaped families: RMSNorm, separate q/k/v, RoPE in the GGUF llama
 * layout (q/k rows permuted so that rotated pairs are adjacent), gated FFN. Llama-3's
 * RoPE scaling comes as rope_freqs.weight, linear scaling as rope.scaling.*. Mixtral is a
 * llama file with llama.expert_count > 0: its FFN is a mixture of experts with the top-k
 * weights renormalised (llama.cpp's rule for the architecture). */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_llama = {
    .name = "llama",
    .models = "LLaMA 1/2/3, Mistral, Mixtral, ReluLLaMA, ProSparse, Bamboo, TurboSparse",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NORMAL,
    .gated = true,
    .default_act = GH_ACT_SILU, /* what llama.cpp assumes for this architecture */
    .moe = GH_MOE_OPTIONAL,
    .expert_norm = true,
};
