"""Qwen3 (dense) -> GGUF architecture ``qwen3`` (llama.cpp's).

Qwen2's block without the q/k/v biases and with an RMSNorm of q and of k applied to each
head on its own (``q_norm`` / ``k_norm``, weights [head_dim] shared by the heads) between
the projections and RoPE, stored as llama.cpp's ``attn_q_norm`` / ``attn_k_norm``. q/k rows
are not permuted: like llama.cpp, the runtime applies NeoX RoPE (HF's rotate_half), and a
per-head norm must see the head's values in HF's order anyway. The head size is the
config's ``head_dim`` (128 in the released models, whatever d / n_head is).

Refused: ``attention_bias`` true (llama.cpp's qwen3 has no projection biases), sliding
windows shorter than the context (as qwen2), RoPE scaling other than none/linear.
"""

from __future__ import annotations

import re

from .. import format as F
from ..gguf_write import ConvertError
from .arch import (NORM_RMS, Architecture, Config, HFParams, act_kind, act_threshold, heads,
                   read_rope)
from . import arch_llama, arch_qwen2


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Qwen3 config.json."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    n_ctx = c.n_ctx()
    if c.get("attention_bias"):
        raise ConvertError("unsupported: config.json attention_bias=true (biased q/k/v/o projections; "
                           "llama.cpp's qwen3 has none)")
    arch_qwen2.refuse_sliding_window(c, n_layer, n_ctx)
    rope = read_rope(c, head_dim)
    hidden_act = c.get("hidden_act", "silu")
    act = act_kind(hidden_act, c.get("use_drelu"))
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_QWEN3, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("intermediate_size"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-6), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=act, hf_hidden_act=str(hidden_act), act_threshold=act_threshold(c, act), gated=True,
        tied=c.flag("tie_word_embeddings", False), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"))


def tensors(p: HFParams):
    """llama's tensors, unpermuted, with the per-head q/k norms."""
    return arch_llama.tensors(p, qk_permute=False, qk_norm=arch_llama.QK_NORM_HEAD)


ARCH = Architecture(
    name=F.ARCH_QWEN3, hf_classes=("Qwen3ForCausalLM",), model_types={"qwen3": "Qwen3ForCausalLM"},
    read_config=read_config, tensors=tensors,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
