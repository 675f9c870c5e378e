/* The dense FFN: every neuron, through forward.c's matmuls (no selection). */
#include "ffn/strategy.h"
#include "ggml-hybrid.h"

const gh_ffn_strategy gh_ffn_dense = { .name = "dense", .mode = GH_FFN_DENSE };
