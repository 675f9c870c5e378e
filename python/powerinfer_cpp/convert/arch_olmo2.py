"""OLMo 2 -> GGUF architecture ``olmo2`` (llama.cpp's).

llama's projections and SwiGLU FFN with two differences in the block: the norms sit on
each sublayer's output, not its input (``x + post_attention_layernorm(attn(x))``, then
``h + post_feedforward_layernorm(mlp(h))``: llama.cpp's ``post_attention_norm`` and
``post_ffw_norm``; there is no ``attn_norm`` / ``ffn_norm``), and q and k are RMS-normed over
the whole projection (``q_norm`` [n_head*head_dim], ``k_norm`` [n_head_kv*head_dim], llama.cpp's
``attn_q_norm`` / ``attn_k_norm``) before RoPE. q/k rows are not permuted: the runtime
applies NeoX RoPE (HF's rotate_half), as llama.cpp does for olmo2, and a norm over the
projection keeps HF's row order anyway.

Refused: ``attention_bias`` true (llama.cpp's olmo2 has no biases), ``clip_qkv`` (OLMo 1's
clamp, which llama.cpp's olmo2 does not apply), RoPE scaling other than none/linear.
"""

from __future__ import annotations

import re

from .. import format as F
from .arch import (NORM_RMS, Architecture, Config, HFParams, act_kind, act_threshold, heads,
                   read_rope)
from . import arch_llama


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of an OLMo 2 config.json."""
    n_embd = c.int("hidden_size")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    c.refuse("attention_bias", bool, "biased q/k/v/o projections; llama.cpp's olmo2 has none")
    c.refuse("clip_qkv", lambda v: v is not None, "q/k/v clamping")
    rope = read_rope(c, head_dim)
    hidden_act = c.get("hidden_act", "silu")
    act = act_kind(hidden_act, c.get("use_drelu"))
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_OLMO2, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=c.int("num_hidden_layers"), n_ff=c.int("intermediate_size"), n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_ctx=c.n_ctx(), norm_eps=c.number("rms_norm_eps", 1e-5),
        norm=NORM_RMS, rope_theta=rope.theta, rope_scaling_type=rope.scaling_type,
        rope_scaling_factor=rope.factor, activation=act, hf_hidden_act=str(hidden_act),
        act_threshold=act_threshold(c, act), gated=True, tied=c.flag("tie_word_embeddings", False),
        bos_token_id=c.token_id("bos_token_id"), eos_token_id=c.token_id("eos_token_id"),
        pad_token_id=c.token_id("pad_token_id"))


def tensors(p: HFParams):
    """llama's tensors, unpermuted, with q/k norms over the projection and output norms."""
    return arch_llama.tensors(p, qk_permute=False, qk_norm=arch_llama.QK_NORM_PROJ, post_norms=True)


ARCH = Architecture(
    name=F.ARCH_OLMO2, hf_classes=("Olmo2ForCausalLM",), model_types={"olmo2": "Olmo2ForCausalLM"},
    read_config=read_config, tensors=tensors,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
