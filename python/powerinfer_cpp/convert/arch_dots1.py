"""dots.llm1 -> GGUF architecture ``dots1`` (llama.cpp's).

Qwen3's block (per-head q/k RMSNorm, no biases, unpermuted q/k for NeoX RoPE over the whole
head, the FFN's input norm ``ffn_norm``) with GLM-4.5's mixture (arch_glm4moe.py): dense
SwiGLU FFNs in the first ``first_k_dense_replace`` layers, DeepSeek-V3's sigmoid router
(``e_score_correction_bias`` to ``exp_probs_b.bias``, ``n_group`` / ``topk_group``,
``norm_topk_prob``, ``routed_scaling_factor``) and ``n_shared_experts`` shared experts
added unweighted in the rest.

Refused: ``attention_bias`` (llama.cpp's dots1 has no biases), layers attending to a sliding
window shorter than the context, RoPE scaling other than none/linear, activations other
than SwiGLU.
"""

from __future__ import annotations

import re

from .. import format as F
from ..gguf_write import ConvertError
from .arch import NORM_RMS, Architecture, Config, HFParams, heads, read_rope
from . import arch_glm4moe


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a dots.llm1 (dots1) config.json."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    n_ctx = c.n_ctx()
    c.refuse("attention_bias", bool, "biased q/k/v/o projections; llama.cpp's dots1 has none")
    sw, types = c.get("sliding_window"), c.get("layer_types")
    if isinstance(sw, int) and 0 < sw < n_ctx:
        first = c.get("max_window_layers", n_layer)
        local = ([i for i, t in enumerate(types) if t == "sliding_attention"] if isinstance(types, list)
                 else list(range(first if isinstance(first, int) else 0, n_layer)))
        if local:
            raise ConvertError(f"unsupported: config.json sliding_window={sw} < max_position_embeddings="
                               f"{n_ctx} in layers {', '.join(map(str, local[:8]))} (the runtime attends to "
                               "the full context)")
    rope = read_rope(c, head_dim)
    moe = arch_glm4moe.read_sigmoid_moe(c, hf_arch, n_layer)
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_DOTS1, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("intermediate_size"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-6), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        gated=True, tied=c.flag("tie_word_embeddings", False), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"), **moe)


def tensors(p: HFParams):
    """glm4moe's tensors with per-head q/k norms, no biases and the FFN's norm as ffn_norm."""
    return arch_glm4moe.block_tensors(p, qkv_bias=False, qk_norm=True, ffn_norm=F.T_FFN_NORM)


ARCH = Architecture(
    name=F.ARCH_DOTS1, hf_classes=("Dots1ForCausalLM",), model_types={"dots1": "Dots1ForCausalLM"},
    read_config=read_config, tensors=tensors, keys=arch_glm4moe.sigmoid_moe_keys,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
