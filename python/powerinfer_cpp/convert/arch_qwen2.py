"""Qwen2 / Qwen2.5 -> GGUF architecture ``qwen2`` (llama.cpp's).

A llama-shaped block (RMSNorm, SwiGLU, GQA) with biased q/k/v projections. The q/k rows
are NOT permuted: like llama.cpp, the runtime applies NeoX-style RoPE (rotate_half
pairs i, i + head_dim/2) to qwen2, which is HF's own convention. Sliding-window
attention on some layers is refused (the runtime attends to the full context).
"""

from __future__ import annotations

import re

from .. import format as F
from ..gguf_write import ConvertError
from .arch import (NORM_RMS, Architecture, Config, HFParams, act_kind, act_threshold, heads,
                   read_rope)
from . import arch_llama


def refuse_sliding_window(c: Config, n_layer: int, n_ctx: int) -> None:
    """ConvertError when some layer attends to a window shorter than the context (Qwen2's
    and Qwen3's keys: use_sliding_window, sliding_window, layer_types or max_window_layers):
    the runtime attends to the full context."""
    sw = c.get("sliding_window")
    if c.flag("use_sliding_window", False) and isinstance(sw, int) and 0 < sw < n_ctx:
        types = c.get("layer_types")
        if isinstance(types, list):
            sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        else:
            first = c.get("max_window_layers", 28)
            sliding = list(range(first, n_layer)) if isinstance(first, int) else list(range(n_layer))
        if sliding:
            shown = ", ".join(map(str, sliding[:8])) + (" ..." if len(sliding) > 8 else "")
            raise ConvertError(f"unsupported: config.json use_sliding_window=true with sliding_window={sw} "
                               f"< max_position_embeddings={n_ctx} (layers {shown} attend to a window; "
                               "the runtime attends to the full context)")


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Qwen2 config.json."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    n_ctx = c.n_ctx()
    refuse_sliding_window(c, n_layer, n_ctx)
    rope = read_rope(c, head_dim)
    hidden_act = c.get("hidden_act", "silu")
    act = act_kind(hidden_act, c.get("use_drelu"))
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_QWEN2, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("intermediate_size"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-6), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=act, hf_hidden_act=str(hidden_act), act_threshold=act_threshold(c, act), gated=True,
        tied=c.flag("tie_word_embeddings", False), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"))


def tensors(p: HFParams):
    """llama's tensors plus the q/k/v biases, without the q/k permutation."""
    return arch_llama.tensors(p, qk_permute=False, qkv_bias=True)


ARCH = Architecture(
    name=F.ARCH_QWEN2, hf_classes=("Qwen2ForCausalLM",), model_types={"qwen2": "Qwen2ForCausalLM"},
    read_config=read_config, tensors=tensors,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
