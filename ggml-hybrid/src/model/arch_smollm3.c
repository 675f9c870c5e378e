/* SmolLM3: llama's block (RMSNorm, SwiGLU, GQA, q/k rows permuted for normal RoPE, as
 * llama.cpp's converter writes them) except that every 4th layer (il + 1 divisible by 4)
 * applies no RoPE ("NoPE"). llama.cpp fixes the interval for the architecture and its
 * files have no key for it, so it is data here too. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_smollm3 = {
    .name = "smollm3",
    .models = "SmolLM3",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NORMAL,
    .gated = true,
    .default_act = GH_ACT_SILU,
    .nope_every = 4,
};
