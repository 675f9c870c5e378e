"""LLaMA-family models -> GGUF architecture ``llama``.

Takes LLaMA (1, 2, 3.x), Mistral, ReluLLaMA (hidden_act relu: ReGLU), ProSparse
(``SparseLlamaForCausalLM`` or plain LLaMA with hidden_act ``fatrelu`` and its threshold
in ``hidden_act_param``), Bamboo and TurboSparse-Mistral (``BambooForCausalLM``,
model_type ``bamboo``: hidden_act relu applied to gate and up, i.e. dReLU), and
``use_drelu: true`` configs.

Tensors: llama.cpp's names; the q/k rows are permuted so that the runtime's "normal"
RoPE (adjacent pairs) equals HF's rotate_half (``permute_qk``). Llama-3 rope scaling
adds ``rope_freqs.weight``. Biased projections (``attention_bias``, ``mlp_bias``) are
refused: llama.cpp's llama files have none.
"""

from __future__ import annotations

import re

import numpy as np

from .. import format as F
from ..gguf_write import ConvertError
from .arch import (NORM_RMS, Architecture, Config, ExpertNames, HFParams, TensorMap, act_kind,
                   act_threshold, direct, expert_tensors, heads, read_rope, sliding_window)

HF_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "SparseLlamaForCausalLM", "BambooForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "sparsellama": "SparseLlamaForCausalLM", "bamboo": "BambooForCausalLM"}
#: Bamboo's MLP applies hidden_act to both gate and up (dReLU when it is relu).
DRELU_CLASSES = ("BambooForCausalLM",)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of an HF q_proj/k_proj weight [n_heads*head_dim, d]
    so that rotary embedding rotates adjacent pairs (2i, 2i+1) ("normal"
    RoPE) instead of HF's rotate_half pairs (i, i + head_dim/2)."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of permute_qk."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a LLaMA-family config.json."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_ff = c.int("intermediate_size")
    n_head = c.int("num_attention_heads")
    n_vocab = c.int("vocab_size")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    if c.get("attention_bias"):
        raise ConvertError("unsupported: attention_bias is true (biased q/k/v/o projections)")
    if c.get("mlp_bias"):
        raise ConvertError("unsupported: mlp_bias is true (biased FFN projections)")
    rope = read_rope(c, head_dim, allow_llama3=True)
    hidden_act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    use_drelu = c.get("use_drelu")
    if hf_arch in DRELU_CLASSES and use_drelu is None and str(hidden_act).lower() == "relu":
        use_drelu = True
    act = act_kind(hidden_act, use_drelu)
    if hf_arch in DRELU_CLASSES and act != F.ACT_DRELU:
        raise ConvertError(f"unsupported: {hf_arch} with hidden_act {hidden_act!r} (its MLP applies "
                           "hidden_act to gate and up; only relu, i.e. dReLU, is supported)")
    n_ctx = c.n_ctx()
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_LLAMA, name=c.name, n_vocab=n_vocab, n_embd=n_embd,
        n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-6), norm=NORM_RMS,
        rope_theta=rope.theta, rope_scaling_type=rope.scaling_type, rope_scaling_factor=rope.factor,
        rope_freqs=rope.freqs, activation=act, hf_hidden_act=str(hidden_act),
        act_threshold=act_threshold(c, act), gated=True,
        tied=c.flag("tie_word_embeddings", False), sliding_window=sliding_window(c, n_ctx, F.ARCH_LLAMA),
        bos_token_id=c.token_id("bos_token_id"), eos_token_id=c.token_id("eos_token_id"),
        pad_token_id=c.token_id("pad_token_id"))


def rope_freqs_map(p: HFParams) -> list[TensorMap]:
    """``rope_freqs.weight`` (computed from the config) when the model has Llama-3 scaling."""
    if p.rope_freqs is None:
        return []
    freqs = p.rope_freqs
    return [TensorMap(F.tensor_name(F.T_ROPE_FREQS), F.T_ROPE_FREQS, freqs.shape,
                      transform=lambda f=freqs: f)]


QK_NORM_HEAD = "head"  # q_norm / k_norm of each head: weights [head_dim] (Qwen3)
QK_NORM_PROJ = "proj"  # over the whole projection: [n_head*head_dim], [n_head_kv*head_dim] (OLMo 2)


def tensors(p: HFParams, qk_permute: bool = True, qkv_bias: bool = False,
            qk_norm: str | None = None, post_norms: bool = False,
            experts: ExpertNames | None = None) -> list[TensorMap]:
    """The GGUF tensors of a llama-shaped model (qwen2, qwen3, olmo2 and the MoE families
    reuse this with their options: q/k/v biases, q/k norms after the projections, output
    norms in place of the input norms: OLMo 2's post_attention_layernorm /
    post_feedforward_layernorm; a mixture of experts in place of the FFN, where the
    checkpoint keeps it under ``experts``' names)."""
    d, q_rows, kv_rows = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    L = "model.layers.{}."
    out = [direct(F.tensor_name(F.T_TOKEN_EMBD), F.T_TOKEN_EMBD, "model.embed_tokens.weight", (p.n_vocab, d))]
    out += rope_freqs_map(p)
    for il in range(p.n_layer):
        pre = L.format(il)

        def t(kind, hf, shape, transform=None, suffix="weight"):
            return direct(F.tensor_name(kind, il, suffix), kind, pre + hf, shape, transform)

        pq = (lambda w: permute_qk(w, p.n_head)) if qk_permute else None
        pk = (lambda w: permute_qk(w, p.n_head_kv)) if qk_permute else None
        if not post_norms:
            out.append(t(F.T_ATTN_NORM, "input_layernorm.weight", (d,)))
        out.append(t(F.T_ATTN_Q, "self_attn.q_proj.weight", (q_rows, d), pq))
        if qkv_bias:
            out.append(t(F.T_ATTN_Q, "self_attn.q_proj.bias", (q_rows,), suffix="bias"))
        out.append(t(F.T_ATTN_K, "self_attn.k_proj.weight", (kv_rows, d), pk))
        if qkv_bias:
            out.append(t(F.T_ATTN_K, "self_attn.k_proj.bias", (kv_rows,), suffix="bias"))
        out.append(t(F.T_ATTN_V, "self_attn.v_proj.weight", (kv_rows, d)))
        if qkv_bias:
            out.append(t(F.T_ATTN_V, "self_attn.v_proj.bias", (kv_rows,), suffix="bias"))
        if qk_norm is not None:
            per_head = qk_norm == QK_NORM_HEAD
            out.append(t(F.T_ATTN_Q_NORM, "self_attn.q_norm.weight", (p.head_dim if per_head else q_rows,)))
            out.append(t(F.T_ATTN_K_NORM, "self_attn.k_norm.weight", (p.head_dim if per_head else kv_rows,)))
        out.append(t(F.T_ATTN_OUTPUT, "self_attn.o_proj.weight", (d, q_rows)))
        # llama's post_attention_layernorm is the FFN's input norm; OLMo 2's norms the
        # attention's output
        out.append(t(F.T_POST_ATTN_NORM if post_norms else F.T_FFN_NORM,
                     "post_attention_layernorm.weight", (d,)))
        if experts is not None:
            out += expert_tensors(p, il, pre, experts)
        else:
            out.append(t(F.T_FFN_GATE, "mlp.gate_proj.weight", (p.n_ff, d)))
            out.append(t(F.T_FFN_UP, "mlp.up_proj.weight", (p.n_ff, d)))
            out.append(t(F.T_FFN_DOWN, "mlp.down_proj.weight", (d, p.n_ff)))
        if post_norms:
            out.append(t(F.T_POST_FFW_NORM, "post_feedforward_layernorm.weight", (d,)))
    out.append(direct(F.tensor_name(F.T_OUTPUT_NORM), F.T_OUTPUT_NORM, "model.norm.weight", (d,)))
    if not p.tied:
        out.append(direct(F.tensor_name(F.T_OUTPUT), F.T_OUTPUT, "lm_head.weight", (p.n_vocab, d)))
    return out


# rotary caches some checkpoints carry; TurboSparse-Mistral ships its own FFN predictors
# inside the MLPs, which we do not use (the sparse pipeline trains ours)
_IGNORED = re.compile(r"^model\.layers\.\d+\.(self_attn\.rotary_emb\.inv_freq$|mlp\.predictor\.)")


ARCH = Architecture(
    name=F.ARCH_LLAMA, hf_classes=HF_CLASSES, model_types=MODEL_TYPES,
    read_config=read_config, tensors=tensors, ignored=_IGNORED)
