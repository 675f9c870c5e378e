"""Gemma 3 (text: ``Gemma3ForCausalLM``, model_type ``gemma3_text``) -> GGUF architecture
``gemma3`` (llama.cpp's).

Gemma 2's block and tensors (arch_gemma2: sandwich norms with 1 + weight folded in, GeGLU,
embeddings times sqrt(d), ``query_pre_attn_scalar``, sliding windows) with an RMSNorm of
each q and k head before RoPE (``q_norm`` / ``k_norm`` [head_dim], also 1 + weight:
llama.cpp's ``attn_q_norm`` / ``attn_k_norm``), no attention soft-capping, and five local
layers to one global by default (``layer_types``; the old ``sliding_window_pattern`` 6).
Global layers rotate with ``rope_theta`` (1e6 by default) and the config's linear scaling
(``rope.freq_base``, ``rope.scaling.*``); local ones with their own base (the
``sliding_attention`` RoPE parameters, or the old ``rope_local_base_freq``; 10000 by default)
unscaled: ``rope.freq_base_swa``. The head is the embedding matrix unless the config unties
it (``output.weight``, which llama.cpp's gemma3 reads when present).

Refused: ``attn_logit_softcapping`` (llama.cpp's gemma3 never applies it), scaled RoPE on the
local layers, multimodal configs (``text_config``; the registry does not take
``Gemma3ForConditionalGeneration``), and what arch_gemma2 refuses for both.
"""

from __future__ import annotations

import dataclasses

from .. import format as F
from ..gguf_write import ConvertError
from .arch import Architecture, Config, HFParams, Rope, heads, read_rope
from . import arch_gemma2


def read_ropes(c: Config, head_dim: int) -> tuple[Rope, float]:
    """(the global layers' RoPE, the local layers' base) from transformers>=5's per-layer-type
    ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    rp = c.get("rope_parameters")
    local_base = c.number("rope_local_base_freq", 10000.0)
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, loc = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(loc, dict):
            raise ConvertError(f"config.json: malformed rope_parameters {rp!r}")
        glob = read_rope(Config({"rope_parameters": {"rope_theta": 1e6, **full}}, c.folder), head_dim)
        local = read_rope(Config({"rope_parameters": {"rope_theta": local_base, **loc}}, c.folder), head_dim)
    else:
        cfg = {**c.cfg, "rope_theta": c.number("rope_theta", 1e6)}
        glob = read_rope(Config(cfg, c.folder), head_dim)
        local = Rope(local_base)
    if local.scaling_type != F.ROPE_SCALING_NONE:
        raise ConvertError(f"unsupported: {local.scaling_type} RoPE scaling on the sliding-window "
                           "layers (llama.cpp's gemma3 rotates them unscaled)")
    return glob, local.theta


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Gemma 3 text config.json."""
    if "text_config" in c:
        raise ConvertError("unsupported: a multimodal Gemma 3 config (text_config; only the text "
                           "model, Gemma3ForCausalLM, converts)")
    c.refuse("attn_logit_softcapping", lambda v: v is not None,
             "attention soft-capping, which llama.cpp's gemma3 does not apply")
    n_embd, n_head = c.int("hidden_size"), c.int("num_attention_heads")
    rope, local_base = read_ropes(c, heads(c, n_embd, n_head)[1])
    p = arch_gemma2.read_common(c, hf_arch, F.ARCH_GEMMA3, rope, F.SWA_PERIOD[F.ARCH_GEMMA3])
    layout = {**p.layout, "final_softcap": arch_gemma2.positive(c, "final_logit_softcapping", None),
              "rope_base_swa": local_base if p.sliding_window is not None else None}
    return dataclasses.replace(p, layout=layout)


def tensors(p: HFParams):
    """Gemma 2's tensors with the per-head q/k norms."""
    return arch_gemma2.tensors(p, qk_norm=True)


ARCH = Architecture(
    name=F.ARCH_GEMMA3, hf_classes=("Gemma3ForCausalLM",),
    model_types={"gemma3_text": "Gemma3ForCausalLM"}, read_config=read_config, tensors=tensors,
    keys=arch_gemma2.keys, ignored=arch_gemma2.IGNORED)
