"""Gemma 2 -> GGUF architecture ``gemma2`` (llama.cpp's).

The block: ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``, then
``h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`` (llama.cpp's
``attn_norm``, ``post_attention_norm``, ``ffn_norm``, ``post_ffw_norm``), with a GeGLU FFN
(``hidden_activation``, tanh GELU in the released models). Gemma's RMSNorm multiplies by
``1 + weight``: the stored norm weights have the 1 added, as llama.cpp's converter writes
them, so every reader runs a plain RMSNorm. Token embeddings are scaled by sqrt(hidden_size)
in the model (nothing is stored for it); the head is the embedding matrix.

Attention: the head size is ``head_dim`` (256 in the released models, not d / n_head); q.k
is scaled by ``query_pre_attn_scalar``^-1/2, stored as ``attention.scale`` (llama.cpp has no
key for it and derives it from the model size, which gives the same value for the released
models); scores and final logits are soft-capped (``attn_logit_softcapping``,
``final_logit_softcapping``: x -> c tanh(x / c)); the layers of ``layer_types``
"sliding_attention" (0, 2, 4, ... by default) attend to the last ``sliding_window`` positions
only. q/k rows are not permuted: the runtime applies NeoX RoPE (HF's rotate_half).

Refused: untied heads (llama.cpp's gemma2 always reads token_embd as the head), missing
soft-caps (llama.cpp's gemma2 always caps, 50 and 30 when the keys are absent, and has no way
to say "none"), ``attention_bias``, bidirectional attention, RoPE scaling other than
none/linear.
"""

from __future__ import annotations

import dataclasses
import re

from gguf import GGUFValueType as V

from .. import format as F
from ..gguf_write import KV, ConvertError
from .arch import (NORM_RMS, Architecture, Config, HFParams, Rope, TensorMap, act_kind, direct,
                   heads, read_rope)


def positive(c: Config, key: str, default: float | None) -> float | None:
    """A positive finite number, or ``default`` (may be None) when absent or null."""
    v = c.get(key)
    if v is None:
        return default
    f = c.number(key, 0.0)
    if not f > 0:
        raise ConvertError(f"config.json: {key!r} must be > 0, not {v!r}")
    return f


def local_layers(c: Config, n_layer: int, period: int) -> list[bool]:
    """Which layers attend through the sliding window: ``layer_types`` ("sliding_attention" /
    "full_attention"), else HF's default pattern of the given period (the last layer of each
    period global; Gemma 3's old configs name the period ``sliding_window_pattern``)."""
    types = c.get("layer_types")
    if types is None:
        period = c.int("sliding_window_pattern", period)
        return [bool((i + 1) % period) for i in range(n_layer)]
    ok = {"sliding_attention": True, "full_attention": False}
    if not isinstance(types, list) or len(types) != n_layer or any(t not in ok for t in types):
        raise ConvertError(f"config.json: layer_types must list {n_layer} entries, each "
                           f"'sliding_attention' or 'full_attention', not {types!r}")
    return [ok[t] for t in types]


def read_common(c: Config, hf_arch: str, arch: str, rope: Rope, default_period: int) -> HFParams:
    """What Gemma 2 and Gemma 3 share: sizes, heads, activation, scale, window and pattern."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    n_ctx = c.n_ctx()
    c.refuse("attention_bias", bool, f"biased q/k/v/o projections; llama.cpp's {arch} has none")
    c.refuse("use_bidirectional_attention", bool, "bidirectional attention (an encoder's)")
    hidden_act = c.get("hidden_activation", c.get("hidden_act", "gelu_pytorch_tanh"))
    act = act_kind(hidden_act, key="hidden_activation")
    if act not in (F.ACT_GELU, F.ACT_GELU_ERF):
        raise ConvertError(f"unsupported: config.json hidden_activation {hidden_act!r} (Gemma's FFN is "
                           "GeGLU: gelu_pytorch_tanh)")
    scalar = positive(c, "query_pre_attn_scalar", 256.0)  # transformers' default for both
    window = c.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ConvertError(f"config.json: sliding_window must be a positive integer or null, not {window!r}")
    local = local_layers(c, n_layer, default_period) if window is not None else [False] * n_layer
    layout = {"attention_scale": scalar ** -0.5, "local_layers": local,
              "default_local": [il % default_period < default_period - 1 for il in range(n_layer)],
              "attn_softcap": None, "final_softcap": None, "rope_base_swa": None}
    return HFParams(
        hf_arch=hf_arch, arch=arch, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("intermediate_size"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-6), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=act, hf_hidden_act=str(hidden_act), gated=True,
        tied=c.flag("tie_word_embeddings", True), sliding_window=window if any(local) else None,
        bos_token_id=c.token_id("bos_token_id"), eos_token_id=c.token_id("eos_token_id"),
        pad_token_id=c.token_id("pad_token_id"), layout=layout)


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Gemma 2 config.json."""
    n_embd, n_head = c.int("hidden_size"), c.int("num_attention_heads")
    p = read_common(c, hf_arch, F.ARCH_GEMMA2, read_rope(c, heads(c, n_embd, n_head)[1]),
                    F.SWA_PERIOD[F.ARCH_GEMMA2])
    if not p.tied:
        raise ConvertError("unsupported: config.json tie_word_embeddings=false (llama.cpp's gemma2 "
                           "always uses token_embd as the head)")
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        caps[key] = positive(c, key, None)
        if caps[key] is None:
            raise ConvertError(f"unsupported: config.json {key}=null (llama.cpp's gemma2 always "
                               "soft-caps, with 50 / 30 when the file has no value)")
    layout = {**p.layout, "attn_softcap": caps["attn_logit_softcapping"],
              "final_softcap": caps["final_logit_softcapping"]}
    # no window: llama.cpp's gemma2 assumes 4096 when the key is absent, so the file says the
    # whole context instead (a window of n_ctx masks nothing)
    return dataclasses.replace(p, layout=layout, sliding_window=p.sliding_window or p.n_ctx)


def keys(p: HFParams) -> list[KV]:
    """attention.scale, the soft-caps, the local layers' RoPE base and the layer pattern
    where it is not the architecture's default."""
    A, lay = p.arch, p.layout
    out: list[KV] = [(F.arch_key(F.KEY_ATTENTION_SCALE, A), float(lay["attention_scale"]), V.FLOAT32, None)]
    for key, v in ((F.KEY_ATTN_LOGIT_SOFTCAPPING, lay["attn_softcap"]),
                   (F.KEY_FINAL_LOGIT_SOFTCAPPING, lay["final_softcap"]),
                   (F.KEY_ROPE_FREQ_BASE_SWA, lay["rope_base_swa"])):
        if v is not None:
            out.append((F.arch_key(key, A), float(v), V.FLOAT32, None))
    if any(lay["local_layers"]) and lay["local_layers"] != lay["default_local"]:
        out.append((F.arch_key(F.KEY_SLIDING_WINDOW_PATTERN, A), [bool(b) for b in lay["local_layers"]],
                    V.ARRAY, V.BOOL))
    return out


def _plus_one(w):
    """Gemma's RMSNorm weight w as a plain RMSNorm's: 1 + w (in float32)."""
    return w + 1.0


def tensors(p: HFParams, qk_norm: bool = False) -> list[TensorMap]:
    """The GGUF tensors of a Gemma 2 (qk_norm: Gemma 3) model; every norm weight + 1."""
    d, q_rows, kv_rows, hd = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim, p.head_dim
    out = [direct(F.tensor_name(F.T_TOKEN_EMBD), F.T_TOKEN_EMBD, "model.embed_tokens.weight", (p.n_vocab, d))]
    for il in range(p.n_layer):
        pre = f"model.layers.{il}."

        def t(kind, hf, shape, transform=None):
            return direct(F.tensor_name(kind, il), kind, pre + hf, shape, transform)

        out.append(t(F.T_ATTN_NORM, "input_layernorm.weight", (d,), _plus_one))
        out.append(t(F.T_ATTN_Q, "self_attn.q_proj.weight", (q_rows, d)))
        out.append(t(F.T_ATTN_K, "self_attn.k_proj.weight", (kv_rows, d)))
        out.append(t(F.T_ATTN_V, "self_attn.v_proj.weight", (kv_rows, d)))
        if qk_norm:
            out.append(t(F.T_ATTN_Q_NORM, "self_attn.q_norm.weight", (hd,), _plus_one))
            out.append(t(F.T_ATTN_K_NORM, "self_attn.k_norm.weight", (hd,), _plus_one))
        out.append(t(F.T_ATTN_OUTPUT, "self_attn.o_proj.weight", (d, q_rows)))
        out.append(t(F.T_POST_ATTN_NORM, "post_attention_layernorm.weight", (d,), _plus_one))
        out.append(t(F.T_FFN_NORM, "pre_feedforward_layernorm.weight", (d,), _plus_one))
        out.append(t(F.T_FFN_GATE, "mlp.gate_proj.weight", (p.n_ff, d)))
        out.append(t(F.T_FFN_UP, "mlp.up_proj.weight", (p.n_ff, d)))
        out.append(t(F.T_FFN_DOWN, "mlp.down_proj.weight", (d, p.n_ff)))
        out.append(t(F.T_POST_FFW_NORM, "post_feedforward_layernorm.weight", (d,), _plus_one))
    out.append(direct(F.tensor_name(F.T_OUTPUT_NORM), F.T_OUTPUT_NORM, "model.norm.weight", (d,), _plus_one))
    if not p.tied:
        out.append(direct(F.tensor_name(F.T_OUTPUT), F.T_OUTPUT, "lm_head.weight", (p.n_vocab, d)))
    return out


IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

ARCH = Architecture(
    name=F.ARCH_GEMMA2, hf_classes=("Gemma2ForCausalLM",), model_types={"gemma2": "Gemma2ForCausalLM"},
    read_config=read_config, tensors=tensors, keys=keys, ignored=IGNORED)
