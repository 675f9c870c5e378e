"""Qwen3-MoE -> GGUF architecture ``qwen3moe`` (llama.cpp's).

Qwen3's block (per-head q/k RMSNorm, no biases, unpermuted q/k for NeoX RoPE) with a
mixture of experts in place of the FFN: the router ``mlp.gate`` (``blk.N.ffn_gate_inp``)
and the experts' ``gate_proj`` / ``up_proj`` / ``down_proj`` stacked into
``blk.N.ffn_{gate,up,down}_exps`` (width ``moe_intermediate_size``); no shared expert.
``norm_topk_prob`` (true in the released models, false by transformers' default) goes to
``qwen3moe.expert_weights_norm``; llama.cpp always renormalises for this architecture, so
a file with it false runs right only here.

ReLU-family experts (``hidden_act: relu``: ReGLU; with ``use_drelu: true``: dReLU, as
SmallThinker and TurboSparse put inside their experts) are read here for the sparse experts
(docs/FORMAT.md "Sparse experts"; transformers' Qwen3-MoE computes ReGLU for relu; the
activation is written to ``powerinfer.ffn_activation``, which llama.cpp does not read).

Refused: as qwen3 (biases, short sliding windows, RoPE scaling other than none/linear),
layers with a dense FFN (``decoder_sparse_step`` > 1, ``mlp_only_layers``), activations
other than SwiGLU, ReGLU and dReLU.
"""

from __future__ import annotations

import re

from .. import format as F
from ..gguf_write import ConvertError
from .arch import (NORM_RMS, Architecture, Config, ExpertNames, HFParams, act_kind, heads, read_experts,
                   read_rope, refuse_dense_layers)
from . import arch_llama, arch_qwen2

EXPERTS = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{e}.{proj}.weight")


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Qwen3-MoE config.json."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    n_ctx = c.n_ctx()
    if c.get("attention_bias"):
        raise ConvertError("unsupported: config.json attention_bias=true (biased q/k/v/o projections; "
                           "llama.cpp's qwen3moe has none)")
    arch_qwen2.refuse_sliding_window(c, n_layer, n_ctx)
    refuse_dense_layers(c)
    rope = read_rope(c, head_dim)
    hidden_act = c.get("hidden_act", "silu")
    act = act_kind(hidden_act, c.get("use_drelu"))
    if act not in (F.ACT_SILU, F.ACT_RELU, F.ACT_DRELU):
        raise ConvertError(f"unsupported: {hf_arch} with hidden_act {hidden_act!r} (the experts run "
                           "SwiGLU, ReGLU (relu) or dReLU (relu with use_drelu))")
    ff_exp = c.int("moe_intermediate_size")
    norm = c.flag("norm_topk_prob", False)
    n_expert, used = read_experts(c, ff_exp, norm)
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_QWEN3MOE, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("intermediate_size"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-6), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=act, hf_hidden_act=str(hidden_act), gated=True,
        tied=c.flag("tie_word_embeddings", False), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"),
        n_expert=n_expert, n_expert_used=used, n_ff_exp=ff_exp, expert_norm=norm)


def tensors(p: HFParams):
    """qwen3's tensors (per-head q/k norms) with the experts in place of the FFN."""
    return arch_llama.tensors(p, qk_permute=False, qk_norm=arch_llama.QK_NORM_HEAD, experts=EXPERTS)


ARCH = Architecture(
    name=F.ARCH_QWEN3MOE, hf_classes=("Qwen3MoeForCausalLM",), model_types={"qwen3_moe": "Qwen3MoeForCausalLM"},
    read_config=read_config, tensors=tensors,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
