"""Mixtral -> GGUF architecture ``llama`` with experts (llama.cpp writes Mixtral so).

LLaMA's block (q/k rows permuted for the runtime's adjacent-pair RoPE, as arch_llama)
with a mixture of experts in place of the FFN: ``block_sparse_moe.gate`` is the router
(``blk.N.ffn_gate_inp``), and each expert's ``w1`` / ``w3`` / ``w2`` (gate / up / down) are
stacked into ``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``. Mixtral always
renormalises its top-k routing weights (``llama.expert_weights_norm`` true, llama.cpp's
rule for the architecture). The experts' width is ``intermediate_size``
(``llama.feed_forward_length``, also written as ``expert_feed_forward_length``).

ReLU-family experts (issue 26, "sparse inside experts"): ``hidden_act: relu`` gives ReGLU
experts (relu(w1 x) * w3 x, as transformers' Mixtral computes them), and ``use_drelu: true``
TurboSparse-Mixtral's dReLU (relu(w1 x) * relu(w3 x)); the activation is written to
``powerinfer.ffn_activation`` (llama.cpp reads none: it would run them as SwiGLU), and
``convert --sparse`` gives their experts the sparse form (docs/FORMAT.md "Sparse experts").

Refused: anything arch_llama refuses; an activation other than SwiGLU, ReGLU or dReLU.
"""

from __future__ import annotations

import re

from .. import format as F
from ..gguf_write import ConvertError
from .arch import Architecture, Config, ExpertNames, HFParams, read_experts
from . import arch_llama

#: The experts' activations: SwiGLU (Mixtral), ReGLU and dReLU (TurboSparse-Mixtral).
EXPERT_ACTS = (F.ACT_SILU, F.ACT_RELU, F.ACT_DRELU)

EXPERTS = ExpertNames(router="block_sparse_moe.gate.weight",
                      expert="block_sparse_moe.experts.{e}.{proj}.weight", gate="w1", up="w3", down="w2")


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Mixtral config.json."""
    p = arch_llama.read_config(c, hf_arch)
    if p.activation not in EXPERT_ACTS:
        raise ConvertError(f"unsupported: {hf_arch} with hidden_act {p.hf_hidden_act!r} (the experts "
                           "run SwiGLU, ReGLU (relu) or dReLU (relu with use_drelu))")
    p.n_expert, p.n_expert_used = read_experts(c, p.n_ff, True)
    p.n_ff_exp, p.expert_norm = p.n_ff, True
    return p


def tensors(p: HFParams):
    """llama's tensors with the experts in place of the FFN."""
    return arch_llama.tensors(p, experts=EXPERTS)


ARCH = Architecture(
    name=F.ARCH_LLAMA, hf_classes=("MixtralForCausalLM",), model_types={"mixtral": "MixtralForCausalLM"},
    read_config=read_config, tensors=tensors,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
