/* Phi-3 (mini/medium, 4k context): llama's block with fused QKV and a fused gate/up
 * projection (ffn_up holds gate's rows, then up's), NeoX RoPE on unpermuted q/k, as
 * llama.cpp stores it. The 128k variants' longrope scaling is refused by the converter. */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_phi3 = {
    .name = "phi3",
    .models = "Phi-3-mini/medium (4k)",
    .norm = GH_NORM_RMS,
    .rope = GH_ROPE_NEOX,
    .fused_qkv = true,
    .gated = true,
    .fused_gate_up = true,
    .default_act = GH_ACT_SILU,
};
