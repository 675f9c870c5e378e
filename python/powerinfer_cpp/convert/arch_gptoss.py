"""gpt-oss -> GGUF architecture ``gpt-oss`` (llama.cpp's).

The block: ``h = x + attn(input_layernorm(x))``, ``h + moe(post_attention_layernorm(h))``
(llama.cpp names the FFN's input norm ``post_attention_norm``). Attention has biased
q/k/v/o projections, a learned sink logit per head (``self_attn.sinks`` ->
``blk.N.attn_sinks.weight``: one more term in each softmax's denominator), NeoX RoPE on
unpermuted rows with YaRN scaling, and the layers of ``layer_types`` "sliding_attention"
(0, 2, 4, ... by default) attend to the last ``sliding_window`` positions only.

The experts: transformers keeps them fused and transposed, ``mlp.experts.gate_up_proj``
[n_expert, d, 2 ff] with gate and up in *interleaved* columns (gate = 0::2, up = 1::2),
``gate_up_proj_bias`` [n_expert, 2 ff] likewise, ``down_proj`` [n_expert, ff, d] and
``down_proj_bias`` [n_expert, d]: split and transposed into llama.cpp's
``ffn_{gate,up,down}_exps`` with their ``.bias``. The router ``mlp.router`` (weight and bias)
is ``ffn_gate_inp``; its top-k logits are softmaxed, which is the renormalised top-k of
the full softmax. The experts' clamped SwiGLU: ``(clamp(up, -limit, limit) + 1) * g *
sigmoid(alpha g)``, ``g = min(gate, limit)``; the limit goes to ``gpt-oss.swiglu_clamp_exp``.

The released checkpoints keep the experts in MXFP4 (``quantization_config`` ``mxfp4``:
``gate_up_proj_blocks`` / ``_scales``, ``down_proj_blocks`` / ``_scales``, rows = outputs):
they are repacked into ggml's MXFP4 blocks bit for bit (``mxfp4_repack``), whatever the
outtype, as llama.cpp's converter does; the rest follows the outtype.

Refused: ``swiglu_alpha`` other than 1.702 (the runtime's constant, as llama.cpp's),
``attention_bias`` false (llama.cpp's gpt-oss always has the biases), RoPE scaling other than
none or YaRN, a YaRN ``attention_factor`` or ``truncate: true`` (the architecture's ramp is
unrounded, as the released configs say), and quantizations other than MXFP4.
"""

from __future__ import annotations

import math
import re

import numpy as np
from gguf import GGUFValueType as V

from .. import format as F
from ..gguf_write import KV, ConvertError
from .arch import NORM_RMS, Architecture, Config, HFParams, Rope, TensorMap, direct, heads, read_experts
from .arch_gemma2 import local_layers


def read_yarn(c: Config) -> tuple[Rope, dict]:
    """(RoPE, its YaRN facts for keys()) from ``rope_parameters`` / ``rope_scaling``."""
    rp = c.get("rope_parameters")
    scaling = rp if isinstance(rp, dict) and rp else (c.get("rope_scaling") or {})
    theta = scaling.get("rope_theta", c.get("rope_theta", 150000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ConvertError(f"config.json: rope_theta must be a positive number, not {theta!r}")
    rtype = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rtype in ("default", "none"):
        return Rope(float(theta)), {}
    if rtype != "yarn":
        raise ConvertError(f"unsupported rope scaling {rtype!r} for gpt-oss (supported: none, yarn)")

    def pos(key: str, default: float | None = None) -> float:
        v = scaling.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
            raise ConvertError(f"config.json: yarn rope scaling needs a positive {key}, got {v!r}")
        return float(v)

    factor = pos("factor")
    if factor < 1:
        raise ConvertError(f"config.json: yarn rope scaling factor {factor} must be >= 1")
    orig = scaling.get("original_max_position_embeddings")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
        raise ConvertError(f"config.json: yarn rope scaling needs a positive integer "
                           f"original_max_position_embeddings, got {orig!r}")
    if scaling.get("truncate", True) is not False:
        raise ConvertError("unsupported: yarn rope scaling with truncate true (gpt-oss's ramp is "
                           "unrounded: truncate false, as its released configs say)")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if scaling.get(key) is not None:
            raise ConvertError(f"unsupported: yarn rope scaling with {key}={scaling[key]!r} (gpt-oss's "
                               "attention factor is 0.1 ln(factor) + 1)")
    yarn = {"orig": orig, "beta_fast": pos("beta_fast", 32.0), "beta_slow": pos("beta_slow", 1.0)}
    return Rope(float(theta), F.ROPE_SCALING_YARN, factor), yarn


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a gpt-oss config.json."""
    qc = c.get("quantization_config")
    mxfp4 = False
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        if method != "mxfp4":
            raise ConvertError(f"unsupported: a quantized checkpoint (config.json quantization_config "
                               f"{method!r}; the released gpt-oss checkpoints' 'mxfp4' is taken)")
        mxfp4 = True
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    n_ctx = c.n_ctx()
    if c.get("attention_bias", True) is not True:
        raise ConvertError("unsupported: config.json attention_bias=false (llama.cpp's gpt-oss always "
                           "has q/k/v/o biases)")
    alpha = c.number("swiglu_alpha", F.SWIGLU_OAI_ALPHA)
    if abs(alpha - F.SWIGLU_OAI_ALPHA) > 1e-6:
        raise ConvertError(f"unsupported: config.json swiglu_alpha={alpha} (the runtime's clamped SwiGLU "
                           f"has the released models' {F.SWIGLU_OAI_ALPHA}, as llama.cpp's)")
    limit = c.number("swiglu_limit", 7.0)
    if not (limit > 0 and math.isfinite(limit)):
        raise ConvertError(f"config.json: swiglu_limit must be a positive number, not {limit!r}")
    rope, yarn = read_yarn(c)
    window = c.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ConvertError(f"config.json: sliding_window must be a positive integer or null, not {window!r}")
    period = F.SWA_PERIOD[F.ARCH_GPTOSS]
    local = local_layers(c, n_layer, period) if window is not None else [False] * n_layer
    ff_exp = c.int("intermediate_size")
    n_expert, used = read_experts(c, ff_exp, True)
    if mxfp4 and (n_embd % 32 or ff_exp % 32):
        raise ConvertError(f"config.json: MXFP4 experts need hidden_size ({n_embd}) and intermediate_size "
                           f"({ff_exp}) in whole blocks of 32")
    layout = {"local_layers": local, "default_local": [il % period < period - 1 for il in range(n_layer)],
              "swiglu_limit": float(limit), "yarn": yarn, "mxfp4": mxfp4}
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_GPTOSS, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=ff_exp, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-5), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=F.ACT_SWIGLU_OAI, hf_hidden_act=str(c.get("hidden_act", "silu")), gated=True,
        tied=c.flag("tie_word_embeddings", False),
        # no window at all: a window of the whole context (the architecture's default is 128)
        sliding_window=window if any(local) else n_ctx,
        bos_token_id=c.token_id("bos_token_id"), eos_token_id=c.token_id("eos_token_id"),
        pad_token_id=c.token_id("pad_token_id"), layout=layout,
        n_expert=n_expert, n_expert_used=used, n_ff_exp=ff_exp, expert_norm=True)


def mxfp4_repack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The released checkpoints' MXFP4 (``*_blocks`` [..., G, 16]: byte j holds the 4-bit
    codes of values 2j (low nibble) and 2j + 1 (high); ``*_scales`` [..., G]: the E8M0
    exponent) as ggml's MXFP4 blocks [..., G * 17]: the exponent byte, then byte j holding
    values j (low) and j + 16 (high). The codes and the exponent mean the same in both (ggml
    doubles its value table and halves its scale), so the values are kept bit for bit."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ConvertError(f"MXFP4 blocks {blocks.shape} {blocks.dtype} and scales {scales.shape} "
                           f"{scales.dtype} are not uint8 [..., G, 16] and [..., G]")
    codes = np.empty(blocks.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    out = np.empty(blocks.shape[:-1] + (17,), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(blocks.shape[:-2] + (-1,))


def keys(p: HFParams) -> list[KV]:
    """YaRN's keys, the SwiGLU's limit and the layer pattern where it is not the default."""
    A, lay = p.arch, p.layout
    out: list[KV] = [(F.arch_key(F.KEY_SWIGLU_CLAMP_EXP, A), lay["swiglu_limit"], V.FLOAT32, None)]
    if p.rope_scaling_type == F.ROPE_SCALING_YARN:
        y = lay["yarn"]
        out += [(F.arch_key(F.KEY_ROPE_SCALING_TYPE, A), F.ROPE_SCALING_YARN, V.STRING, None),
                (F.arch_key(F.KEY_ROPE_SCALING_FACTOR, A), p.rope_scaling_factor, V.FLOAT32, None),
                (F.arch_key(F.KEY_ROPE_SCALING_ORIG_CTX, A), y["orig"], V.UINT32, None),
                (F.arch_key(F.KEY_ROPE_SCALING_YARN_BETA_FAST, A), y["beta_fast"], V.FLOAT32, None),
                (F.arch_key(F.KEY_ROPE_SCALING_YARN_BETA_SLOW, A), y["beta_slow"], V.FLOAT32, None)]
    if lay["local_layers"] != lay["default_local"]:
        out.append((F.arch_key(F.KEY_SLIDING_WINDOW_PATTERN, A), [bool(b) for b in lay["local_layers"]],
                    V.ARRAY, V.BOOL))
    return out


def tensors(p: HFParams) -> list[TensorMap]:
    """The GGUF tensors: llama.cpp's names, the experts split and transposed."""
    d, q_rows, kv_rows = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    ne, ff = p.n_expert, p.n_ff_exp
    out = [direct(F.tensor_name(F.T_TOKEN_EMBD), F.T_TOKEN_EMBD, "model.embed_tokens.weight", (p.n_vocab, d))]
    for il in range(p.n_layer):
        pre = f"model.layers.{il}."

        def t(kind, hf, shape, suffix="weight"):
            return direct(F.tensor_name(kind, il, suffix), kind, pre + hf, shape)

        def experts(kind, hf, shape, src_shape, transform, suffix="weight"):
            return TensorMap(F.tensor_name(kind, il, suffix), kind, shape, (pre + hf,), (src_shape,), transform)

        out.append(t(F.T_ATTN_NORM, "input_layernorm.weight", (d,)))
        for kind, proj, rows in ((F.T_ATTN_Q, "q_proj", q_rows), (F.T_ATTN_K, "k_proj", kv_rows),
                                 (F.T_ATTN_V, "v_proj", kv_rows)):
            out.append(t(kind, f"self_attn.{proj}.weight", (rows, d)))
            out.append(t(kind, f"self_attn.{proj}.bias", (rows,), "bias"))
        out.append(t(F.T_ATTN_OUTPUT, "self_attn.o_proj.weight", (d, q_rows)))
        out.append(t(F.T_ATTN_OUTPUT, "self_attn.o_proj.bias", (d,), "bias"))
        out.append(t(F.T_ATTN_SINKS, "self_attn.sinks", (p.n_head,)))
        out.append(t(F.T_POST_ATTN_NORM, "post_attention_layernorm.weight", (d,)))
        out.append(t(F.T_FFN_GATE_INP, "mlp.router.weight", (ne, d)))
        out.append(t(F.T_FFN_GATE_INP, "mlp.router.bias", (ne,), "bias"))
        gu, gub = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
        if p.layout.get("mxfp4"):
            # MXFP4 rows are the outputs (gate and up interleaved), blocks along the inputs
            def packed(kind, hf, rows, cols, sel):  # sel: the rows taken (gate's, up's, all)
                return TensorMap(F.tensor_name(kind, il), kind, (ne, len(range(rows)[sel]), cols),
                                 (pre + hf + "_blocks", pre + hf + "_scales"),
                                 ((ne, rows, cols // 32, 16), (ne, rows, cols // 32)),
                                 lambda b, s_, sel=sel: mxfp4_repack(b[:, sel], s_[:, sel]), raw_type="MXFP4")
            out.append(packed(F.T_FFN_GATE_EXPS, gu, 2 * ff, d, slice(0, None, 2)))
        else:  # x @ gate_up_proj[e]: columns are outputs, gate and up interleaved
            out.append(experts(F.T_FFN_GATE_EXPS, gu, (ne, ff, d), (ne, d, 2 * ff),
                               lambda a: a[:, :, 0::2].transpose(0, 2, 1)))
        out.append(experts(F.T_FFN_GATE_EXPS, gub, (ne, ff), (ne, 2 * ff), lambda a: a[:, 0::2], "bias"))
        if p.layout.get("mxfp4"):
            out.append(packed(F.T_FFN_UP_EXPS, gu, 2 * ff, d, slice(1, None, 2)))
        else:
            out.append(experts(F.T_FFN_UP_EXPS, gu, (ne, ff, d), (ne, d, 2 * ff),
                               lambda a: a[:, :, 1::2].transpose(0, 2, 1)))
        out.append(experts(F.T_FFN_UP_EXPS, gub, (ne, ff), (ne, 2 * ff), lambda a: a[:, 1::2], "bias"))
        if p.layout.get("mxfp4"):
            out.append(packed(F.T_FFN_DOWN_EXPS, "mlp.experts.down_proj", d, ff, slice(None)))
        else:
            out.append(experts(F.T_FFN_DOWN_EXPS, "mlp.experts.down_proj", (ne, d, ff), (ne, ff, d),
                               lambda a: a.transpose(0, 2, 1)))
        out.append(t(F.T_FFN_DOWN_EXPS, "mlp.experts.down_proj_bias", (ne, d), "bias"))
    out.append(direct(F.tensor_name(F.T_OUTPUT_NORM), F.T_OUTPUT_NORM, "model.norm.weight", (d,)))
    if not p.tied:
        out.append(direct(F.tensor_name(F.T_OUTPUT), F.T_OUTPUT, "lm_head.weight", (p.n_vocab, d)))
    return out


ARCH = Architecture(
    name=F.ARCH_GPTOSS, hf_classes=("GptOssForCausalLM",), model_types={"gpt_oss": "GptOssForCausalLM"},
    read_config=read_config, tensors=tensors, keys=keys,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"))
