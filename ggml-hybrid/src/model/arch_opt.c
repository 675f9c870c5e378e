/* OPT (pre-LN: OPT-125m ... 66B): LayerNorm with bias, biased q/k/v/o, learned absolute
 * positions read at row pos + 2 (OPT's table keeps two offset rows), no RoPE, ungated ReLU
 * FFN with biases. Names as PowerInfer's converter wrote them (llama.cpp has no OPT). */
#include "model/arch.h"
#include "ggml-hybrid.h"

const gh_arch gh_arch_opt = {
    .name = "opt",
    .models = "OPT-125m ... OPT-66B (pre-LN)",
    .norm = GH_NORM_LAYER,
    .rope = GH_ROPE_NONE,
    .learned_pos = true,
    .pos_offset = 2,
    .default_act = GH_ACT_RELU,
};
