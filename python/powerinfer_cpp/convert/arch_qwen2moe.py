"""Qwen1.5-MoE / Qwen2-MoE -> GGUF architecture ``qwen2moe`` (llama.cpp's).

Qwen2's block (q/k/v biases when ``qkv_bias``, unpermuted q/k for NeoX RoPE) with a
mixture of experts in place of the FFN: the router ``mlp.gate`` (``blk.N.ffn_gate_inp``),
the experts' ``gate_proj`` / ``up_proj`` / ``down_proj`` stacked into
``blk.N.ffn_{gate,up,down}_exps`` (width ``moe_intermediate_size``), and the shared expert
``mlp.shared_expert`` (``ffn_{gate,up,down}_shexp``, width
``shared_expert_intermediate_size``) whose output is scaled by
sigmoid(``mlp.shared_expert_gate`` . x) (``ffn_gate_inp_shexp``). ``norm_topk_prob``
(default false) goes to ``qwen2moe.expert_weights_norm``; llama.cpp itself never
renormalises for this architecture, so a file with it true runs right only here.

Refused: layers with a dense FFN (``decoder_sparse_step`` > 1, ``mlp_only_layers``),
sliding windows shorter than the context (as qwen2), RoPE scaling other than none/linear,
activations other than SwiGLU.
"""

from __future__ import annotations

import re

from .. import format as F
from ..gguf_write import ConvertError
from .arch import (NORM_RMS, Architecture, Config, ExpertNames, HFParams, act_kind, heads, read_experts,
                   read_rope, refuse_dense_layers)
from . import arch_llama, arch_qwen2

EXPERTS = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{e}.{proj}.weight",
                      shared="mlp.shared_expert.{proj}.weight", shared_gate="mlp.shared_expert_gate.weight")


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Qwen2-MoE config.json."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    n_ctx = c.n_ctx()
    arch_qwen2.refuse_sliding_window(c, n_layer, n_ctx)
    refuse_dense_layers(c)
    rope = read_rope(c, head_dim)
    hidden_act = c.get("hidden_act", "silu")
    if act_kind(hidden_act) != F.ACT_SILU:
        raise ConvertError(f"unsupported: {hf_arch} with hidden_act {hidden_act!r} (the experts run SwiGLU)")
    ff_exp = c.int("moe_intermediate_size")
    norm = c.flag("norm_topk_prob", False)
    n_expert, used = read_experts(c, ff_exp, norm)
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_QWEN2MOE, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("intermediate_size"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-6), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=F.ACT_SILU, hf_hidden_act=str(hidden_act), gated=True,
        tied=c.flag("tie_word_embeddings", False), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"),
        layout={"qkv_bias": c.flag("qkv_bias", True)}, n_expert=n_expert, n_expert_used=used,
        n_ff_exp=ff_exp, n_ff_shexp=c.int("shared_expert_intermediate_size"), expert_norm=norm)


def tensors(p: HFParams):
    """qwen2's tensors (biases as the config says) with the experts in place of the FFN."""
    return arch_llama.tensors(p, qk_permute=False, qkv_bias=p.layout["qkv_bias"], experts=EXPERTS)


ARCH = Architecture(
    name=F.ARCH_QWEN2MOE, hf_classes=("Qwen2MoeForCausalLM",), model_types={"qwen2_moe": "Qwen2MoeForCausalLM"},
    read_config=read_config, tensors=tensors,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
