"""OLMoE -> GGUF architecture ``olmoe`` (llama.cpp's).

llama's pre-norm block with q and k RMS-normed over the whole projection (``q_norm``
[n_head*head_dim], ``k_norm`` [n_head_kv*head_dim]: ``attn_q_norm`` / ``attn_k_norm``, as
olmo2's) before NeoX RoPE on unpermuted q/k, and a mixture of experts in place of the FFN:
the router ``mlp.gate`` (``blk.N.ffn_gate_inp``) and the experts' ``gate_proj`` / ``up_proj``
/ ``down_proj`` stacked into ``blk.N.ffn_{gate,up,down}_exps``, of width
``intermediate_size`` (``olmoe.feed_forward_length``, also written as
``expert_feed_forward_length``). ``norm_topk_prob`` (false in the released model) goes to
``olmoe.expert_weights_norm``; llama.cpp never renormalises for this architecture.

Refused: ``attention_bias``, ``clip_qkv`` (llama.cpp's olmoe applies neither), RoPE
scaling other than none/linear, activations other than SwiGLU.
"""

from __future__ import annotations

import re

from .. import format as F
from ..gguf_write import ConvertError
from .arch import (NORM_RMS, Architecture, Config, ExpertNames, HFParams, act_kind, heads, read_experts,
                   read_rope)
from . import arch_llama

EXPERTS = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{e}.{proj}.weight")


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of an OLMoE config.json."""
    n_embd = c.int("hidden_size")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head, head_dim_key=None)
    c.refuse("attention_bias", bool, "biased q/k/v/o projections; llama.cpp's olmoe has none")
    c.refuse("clip_qkv", lambda v: v is not None, "q/k/v clamping")
    rope = read_rope(c, head_dim)
    hidden_act = c.get("hidden_act", "silu")
    if act_kind(hidden_act) != F.ACT_SILU:
        raise ConvertError(f"unsupported: {hf_arch} with hidden_act {hidden_act!r} (the experts run SwiGLU)")
    n_ff = c.int("intermediate_size")
    norm = c.flag("norm_topk_prob", False)
    n_expert, used = read_experts(c, n_ff, norm)
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_OLMOE, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=c.int("num_hidden_layers"), n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=c.n_ctx(), norm_eps=c.number("rms_norm_eps", 1e-5), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=F.ACT_SILU, hf_hidden_act=str(hidden_act), gated=True,
        tied=c.flag("tie_word_embeddings", False), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"),
        n_expert=n_expert, n_expert_used=used, n_ff_exp=n_ff, expert_norm=norm)


def tensors(p: HFParams):
    """llama's tensors, unpermuted, with q/k norms over the projection and the experts in
    place of the FFN."""
    return arch_llama.tensors(p, qk_permute=False, qk_norm=arch_llama.QK_NORM_PROJ, experts=EXPERTS)


ARCH = Architecture(
    name=F.ARCH_OLMOE, hf_classes=("OlmoeForCausalLM",), model_types={"olmoe": "OlmoeForCausalLM"},
    read_config=read_config, tensors=tensors,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
