"""Phi-3 (mini / medium, 4k context) -> GGUF architecture ``phi3`` (llama.cpp's).

A llama-shaped block with two fused projections, stored fused as llama.cpp stores them:
``attn_qkv`` (HF ``qkv_proj``: all q heads, then k, then v) and ``ffn_up`` (HF
``gate_up_proj``: the n_ff gate rows, then the n_ff up rows). q/k are not permuted: the
runtime applies NeoX RoPE (HF's rotate_half) to phi3. The 128k variants' ``longrope``
scaling and Phi-4-mini's partial rotary factor are refused.
"""

from __future__ import annotations

from .. import format as F
from .arch import (NORM_RMS, Architecture, Config, HFParams, TensorMap, act_kind, direct, heads,
                   read_rope, sliding_window)


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a Phi-3 config.json."""
    n_embd = c.int("hidden_size")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    rope = read_rope(c, head_dim)
    hidden_act = c.get("hidden_act", "silu")
    n_ctx = c.n_ctx()
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_PHI3, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=c.int("num_hidden_layers"), n_ff=c.int("intermediate_size"), n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_ctx=n_ctx, norm_eps=c.number("rms_norm_eps", 1e-5),
        norm=NORM_RMS, rope_theta=rope.theta, rope_scaling_type=rope.scaling_type,
        rope_scaling_factor=rope.factor, activation=act_kind(hidden_act, None),
        hf_hidden_act=str(hidden_act), gated=True, tied=c.flag("tie_word_embeddings", False),
        sliding_window=sliding_window(c, n_ctx, F.ARCH_PHI3), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"))


def tensors(p: HFParams) -> list[TensorMap]:
    """llama.cpp's phi3 tensors: fused attn_qkv and ffn_up, copied as HF stores them."""
    d, qkv_rows = p.n_embd, (p.n_head + 2 * p.n_head_kv) * p.head_dim
    out = [direct(F.tensor_name(F.T_TOKEN_EMBD), F.T_TOKEN_EMBD, "model.embed_tokens.weight", (p.n_vocab, d))]
    for il in range(p.n_layer):
        pre = f"model.layers.{il}."

        def t(kind, hf, shape):
            return direct(F.tensor_name(kind, il), kind, pre + hf, shape)

        out += [t(F.T_ATTN_NORM, "input_layernorm.weight", (d,)),
                t(F.T_ATTN_QKV, "self_attn.qkv_proj.weight", (qkv_rows, d)),
                t(F.T_ATTN_OUTPUT, "self_attn.o_proj.weight", (d, p.n_head * p.head_dim)),
                t(F.T_FFN_NORM, "post_attention_layernorm.weight", (d,)),
                t(F.T_FFN_UP, "mlp.gate_up_proj.weight", (2 * p.n_ff, d)),
                t(F.T_FFN_DOWN, "mlp.down_proj.weight", (d, p.n_ff))]
    out.append(direct(F.tensor_name(F.T_OUTPUT_NORM), F.T_OUTPUT_NORM, "model.norm.weight", (d,)))
    if not p.tied:
        out.append(direct(F.tensor_name(F.T_OUTPUT), F.T_OUTPUT, "lm_head.weight", (p.n_vocab, d)))
    return out


ARCH = Architecture(name=F.ARCH_PHI3, hf_classes=("Phi3ForCausalLM",), model_types={"phi3": "Phi3ForCausalLM"},
                    read_config=read_config, tensors=tensors)
