"""Falcon -> GGUF architecture ``falcon`` (llama.cpp's).

LayerNorm with bias, a fused QKV projection, an ungated FFN (exact GELU in HF Falcon:
stored as ``gelu_erf``; ReluFalcon's ``relu``), NeoX RoPE (HF's rotate_half; no q/k
permutation), optional biases (``bias``), tied head by default. Three block layouts:

- Falcon-7B (``multi_query``, ``parallel_attn``): one shared input norm; attention and
  FFN read the same normed input and both add to the residual; one k/v head;
- Falcon-40B/180B (``new_decoder_architecture``): ``ln_mlp`` and ``ln_attn`` (stored as
  attn_norm and attn_norm_2, as llama.cpp names them: attn_norm is the FFN's input norm,
  attn_norm_2 the attention's) unless ``num_ln_in_parallel_attn`` is 1, GQA with
  ``num_kv_heads``;
- sequential (``parallel_attn: false``): input_layernorm -> attention -> residual ->
  post_attention_layernorm (stored as ffn_norm: its presence marks the layout) -> FFN.

``attn_qkv`` rows are always all q heads, then all k heads, then all v heads; HF's
fused layouts are reordered into it (``qkv_rows``). ALiBi models (Falcon-RW) are refused.
"""

from __future__ import annotations

import numpy as np

from .. import format as F
from ..gguf_write import ConvertError
from .arch import NORM_LAYER, Architecture, Config, HFParams, TensorMap, act_kind, act_threshold, direct, read_rope

QKV_NEW = "grouped"       # new_decoder_architecture: per kv group [q_0..q_{r-1}, k, v]
QKV_MHA = "interleaved"   # multi-head: per head [q, k, v]
QKV_MQA = "sequential"    # multi_query: [all q, k, v], already our order


def qkv_rows(w: np.ndarray, layout: str, n_head: int, n_head_kv: int, head_dim: int) -> np.ndarray:
    """Reorder the rows (first axis) of an HF fused QKV weight or bias into all q heads,
    then all k heads, then all v heads."""
    rest = w.shape[1:]
    if layout == QKV_MQA:
        return w
    if layout == QKV_MHA:
        g = w.reshape(n_head, 3, head_dim, *rest)
        q, k, v = g[:, 0], g[:, 1], g[:, 2]
    else:
        r = n_head // n_head_kv
        g = w.reshape(n_head_kv, r + 2, head_dim, *rest)
        q, k, v = g[:, :r], g[:, r], g[:, r + 1]
    return np.concatenate([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Falcon config.json."""
    n_embd = c.int("hidden_size")
    n_head = c.int("num_attention_heads")
    n_layer = c.int("num_hidden_layers")
    c.refuse("alibi", lambda v: v is True, "ALiBi position biases instead of RoPE")
    if n_embd % n_head:
        raise ConvertError(f"config.json: hidden_size {n_embd} is not a multiple of num_attention_heads {n_head}")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ConvertError(f"config.json: head size {head_dim} (hidden_size / num_attention_heads) must be even")
    new_arch = c.flag("new_decoder_architecture", False)
    multi_query = c.flag("multi_query", True)
    parallel = c.flag("parallel_attn", True)
    kv = c.get("num_kv_heads")
    if new_arch:
        if not parallel:
            raise ConvertError("unsupported: config.json new_decoder_architecture=true with parallel_attn=false "
                               "(HF Falcon has no such block either)")
        n_head_kv = c.int("num_kv_heads", n_head)
        if n_head % n_head_kv:
            raise ConvertError(f"config.json: num_kv_heads={n_head_kv} must divide num_attention_heads={n_head}")
        n_ln = c.get("num_ln_in_parallel_attn")
        if n_ln is None:
            n_ln = 2
        if n_ln not in (1, 2) or isinstance(n_ln, bool):
            raise ConvertError(f"unsupported: config.json num_ln_in_parallel_attn={n_ln!r} (1 or 2)")
        layout = QKV_NEW
    else:
        n_ln = 1
        if multi_query:
            n_head_kv, layout = 1, QKV_MQA
        else:
            if kv is not None and kv != n_head:
                raise ConvertError(f"unsupported: config.json num_kv_heads={kv!r} with multi_query=false and "
                                   f"without new_decoder_architecture (HF Falcon uses {n_head} k/v heads there)")
            n_head_kv, layout = n_head, QKV_MHA
    rope = read_rope(c, head_dim)
    hidden_act = c.get("activation", "gelu")
    act = act_kind(hidden_act, gated=False, key="activation")
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_FALCON, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("ffn_hidden_size", 4 * n_embd), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=c.n_ctx(), norm_eps=c.number("layer_norm_epsilon", 1e-5), norm=NORM_LAYER,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        activation=act, hf_hidden_act=str(hidden_act), act_threshold=act_threshold(c, act), gated=False,
        tied=c.flag("tie_word_embeddings", True), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"),
        layout={"qkv": layout, "parallel": parallel, "n_ln": n_ln, "bias": c.flag("bias", False)})


def tensors(p: HFParams) -> list[TensorMap]:
    """The GGUF tensors of a Falcon model, in file order."""
    d, ff, hd = p.n_embd, p.n_ff, p.head_dim
    qkv = (p.n_head + 2 * p.n_head_kv) * hd
    L, bias = p.layout, p.layout["bias"]
    T = "transformer."
    out = [direct(F.tensor_name(F.T_TOKEN_EMBD), F.T_TOKEN_EMBD, T + "word_embeddings.weight", (p.n_vocab, d))]
    for il in range(p.n_layer):
        pre = f"{T}h.{il}."

        def norm(kind, hf):
            return [direct(F.tensor_name(kind, il), kind, f"{pre}{hf}.weight", (d,)),
                    direct(F.tensor_name(kind, il, "bias"), kind, f"{pre}{hf}.bias", (d,))]

        def lin(kind, hf, shape, transform=None):
            ts = [direct(F.tensor_name(kind, il), kind, f"{pre}{hf}.weight", shape, transform)]
            if bias:
                ts.append(direct(F.tensor_name(kind, il, "bias"), kind, f"{pre}{hf}.bias", (shape[0],), transform))
            return ts

        def reorder(w):
            return qkv_rows(w, L["qkv"], p.n_head, p.n_head_kv, hd)

        if L["n_ln"] == 2:
            # llama.cpp's names: attn_norm = ln_mlp (the FFN's input), attn_norm_2 = ln_attn
            out += norm(F.T_ATTN_NORM, "ln_mlp") + norm(F.T_ATTN_NORM_2, "ln_attn")
        else:
            out += norm(F.T_ATTN_NORM, "input_layernorm")
        out += lin(F.T_ATTN_QKV, "self_attention.query_key_value", (qkv, d), reorder)
        out += lin(F.T_ATTN_OUTPUT, "self_attention.dense", (d, p.n_head * hd))
        if not L["parallel"]:
            out += norm(F.T_FFN_NORM, "post_attention_layernorm")
        out += lin(F.T_FFN_UP, "mlp.dense_h_to_4h", (ff, d))
        out += lin(F.T_FFN_DOWN, "mlp.dense_4h_to_h", (d, ff))
    out += [direct(F.tensor_name(F.T_OUTPUT_NORM), F.T_OUTPUT_NORM, T + "ln_f.weight", (d,)),
            direct(F.tensor_name(F.T_OUTPUT_NORM, suffix="bias"), F.T_OUTPUT_NORM, T + "ln_f.bias", (d,))]
    if not p.tied:
        out.append(direct(F.tensor_name(F.T_OUTPUT), F.T_OUTPUT, "lm_head.weight", (p.n_vocab, d)))
    return out


ARCH = Architecture(
    name=F.ARCH_FALCON, hf_classes=("FalconForCausalLM",), model_types={"falcon": "FalconForCausalLM"},
    read_config=read_config, tensors=tensors)
