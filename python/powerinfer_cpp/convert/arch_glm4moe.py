"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 -> GGUF architecture ``glm4moe`` (llama.cpp's).

A pre-norm block: q/k/v biases when ``attention_bias`` (o has none), per-head q/k RMSNorm
when ``use_qk_norm``, NeoX RoPE on unpermuted q/k over the first ``partial_rotary_factor``
of each head (default 0.5; ``glm4moe.rope.dimension_count``), and the FFN's input norm
``post_attention_layernorm`` under llama.cpp's name ``post_attention_norm``. The first
``first_k_dense_replace`` layers have a dense SwiGLU FFN (``intermediate_size``;
``glm4moe.leading_dense_block_count``), the rest DeepSeek-V3's mixture of experts:

- the router ``mlp.gate`` (``ffn_gate_inp``) scores each expert by sigmoid; the choice adds
  ``mlp.gate.e_score_correction_bias`` (``exp_probs_b.bias``) and is limited to the best
  ``topk_group`` of ``n_group`` groups (``expert_group_used_count`` / ``expert_group_count``);
  the weights are the unbiased scores, renormalised when ``norm_topk_prob``
  (``expert_weights_norm``), times ``routed_scaling_factor`` (``expert_weights_scale``);
- the ``n_routed_experts`` experts (``moe_intermediate_size``) stacked into
  ``ffn_{gate,up,down}_exps``;
- ``mlp.shared_experts``: ``n_shared_experts`` experts fused into one FFN of
  ``n_shared_experts * moe_intermediate_size`` (``ffn_{gate,up,down}_shexp``,
  ``expert_shared_count``), added unweighted.

The multi-token prediction layers a checkpoint carries past ``num_hidden_layers``
(``num_nextn_predict_layers``: ``model.layers.N..``) are not written: transformers and
llama.cpp run without them (llama.cpp keeps them in its files as blk.N.., which the runtime
loads around: ``glm4moe.nextn_predict_layers``).

Refused: RoPE scaling (with RoPE over part of the head), activations other than SwiGLU,
``topk_group`` groups holding fewer experts than ``num_experts_per_tok``.
"""

from __future__ import annotations

import re

from gguf import GGUFValueType as V

from .. import format as F
from ..gguf_write import KV, ConvertError
from .arch import (NORM_RMS, Architecture, Config, ExpertNames, HFParams, TensorMap, act_kind, direct,
                   expert_tensors, heads, read_rope)

EXPERTS = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{e}.{proj}.weight",
                      shared="mlp.shared_experts.{proj}.weight")
#: The checkpoint's name of the sigmoid router's selection bias.
SCORE_BIAS = "mlp.gate.e_score_correction_bias"


def read_sigmoid_moe(c: Config, hf_arch: str, n_layer: int) -> dict:
    """The DeepSeek-V3 mixture's keys of a glm4_moe / dots1 config.json, validated:
    HFParams fields plus ``layout`` entries."""
    hidden_act = c.get("hidden_act", "silu")
    if act_kind(hidden_act) != F.ACT_SILU:
        raise ConvertError(f"unsupported: {hf_arch} with hidden_act {hidden_act!r} (the experts run SwiGLU)")
    ff_exp = c.int("moe_intermediate_size")
    n_expert = c.int("n_routed_experts")
    used = c.int("num_experts_per_tok")
    n_group = c.int("n_group", 1)
    topk_group = c.int("topk_group", 1)
    n_shared = c.get("n_shared_experts") or 0
    if not isinstance(n_shared, int) or isinstance(n_shared, bool) or n_shared < 0:
        raise ConvertError(f"config.json: 'n_shared_experts' must be a count >= 0, not {n_shared!r}")
    lead = c.get("first_k_dense_replace") or 0
    if not isinstance(lead, int) or isinstance(lead, bool) or not 0 <= lead <= n_layer:
        raise ConvertError(f"config.json: 'first_k_dense_replace' must be 0 to num_hidden_layers={n_layer}, "
                           f"not {lead!r}")
    if n_expert % n_group or (n_group > 1 and n_expert // n_group < 2):
        raise ConvertError(f"config.json: n_routed_experts={n_expert} must split into n_group={n_group} "
                           "groups of at least 2 experts (a group is scored by its two best)")
    if topk_group > n_group:
        raise ConvertError(f"config.json: topk_group={topk_group} is more than n_group={n_group}")
    if used > topk_group * (n_expert // n_group):
        raise ConvertError(f"config.json: num_experts_per_tok={used} is more than the "
                           f"{topk_group * (n_expert // n_group)} experts of the topk_group={topk_group} "
                           "groups kept")
    scale = c.number("routed_scaling_factor", 1.0)
    if not scale > 0:
        raise ConvertError(f"config.json: routed_scaling_factor={scale} must be > 0")
    return dict(
        activation=F.ACT_SILU, hf_hidden_act=str(hidden_act), n_expert=n_expert, n_expert_used=used,
        n_ff_exp=ff_exp, n_ff_shexp=n_shared * ff_exp, expert_norm=c.flag("norm_topk_prob", False),
        expert_gating=F.EXPERT_GATING_SIGMOID,
        layout={"n_shared": n_shared, "n_group": n_group, "topk_group": topk_group, "lead": lead,
                "scale": scale})


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a GLM-4.5 (glm4_moe) config.json."""
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_head_kv, head_dim = heads(c, n_embd, n_head)
    rope = read_rope(c, head_dim, partial_default=0.5)
    moe = read_sigmoid_moe(c, hf_arch, n_layer)
    nextn = c.get("num_nextn_predict_layers", c.get("num_mtp_layers")) or 0
    if not isinstance(nextn, int) or isinstance(nextn, bool) or nextn < 0:
        raise ConvertError(f"config.json: 'num_nextn_predict_layers' must be a count >= 0, not {nextn!r}")
    moe["layout"].update(qkv_bias=c.flag("attention_bias", False), qk_norm=c.flag("use_qk_norm", False),
                         nextn=nextn)
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_GLM4MOE, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=n_layer, n_ff=c.int("intermediate_size"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ctx=c.n_ctx(), norm_eps=c.number("rms_norm_eps", 1e-5), norm=NORM_RMS,
        rope_theta=rope.theta, n_rot=int(head_dim * rope.partial), gated=True,
        tied=c.flag("tie_word_embeddings", False), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"), **moe)


def sigmoid_moe_keys(p: HFParams) -> list[KV]:
    """llama.cpp's keys of the DeepSeek-V3 mixture: shared experts, groups, dense layers, scale."""
    A, lay = p.arch, p.layout
    return [(F.arch_key(F.KEY_EXPERT_SHARED_COUNT, A), lay["n_shared"], V.UINT32, None),
            (F.arch_key(F.KEY_EXPERT_GROUP_COUNT, A), lay["n_group"], V.UINT32, None),
            (F.arch_key(F.KEY_EXPERT_GROUP_USED_COUNT, A), lay["topk_group"], V.UINT32, None),
            (F.arch_key(F.KEY_LEADING_DENSE_BLOCK_COUNT, A), lay["lead"], V.UINT32, None),
            (F.arch_key(F.KEY_EXPERT_WEIGHTS_SCALE, A), lay["scale"], V.FLOAT32, None)]


def block_tensors(p: HFParams, qkv_bias: bool, qk_norm: bool, ffn_norm: str) -> list[TensorMap]:
    """The GGUF tensors of a DeepSeek-V3-style model without MLA (glm4moe, dots1): llama's
    attention unpermuted (NeoX RoPE), the FFN's input norm as ``ffn_norm`` (the kind llama.cpp
    names it by), dense FFNs in the leading layers and the sigmoid mixture in the rest."""
    d, q_rows, kv_rows = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    out = [direct(F.tensor_name(F.T_TOKEN_EMBD), F.T_TOKEN_EMBD, "model.embed_tokens.weight", (p.n_vocab, d))]
    for il in range(p.n_layer):
        pre = f"model.layers.{il}."

        def t(kind, hf, shape, suffix="weight"):
            return direct(F.tensor_name(kind, il, suffix), kind, pre + hf, shape)

        out.append(t(F.T_ATTN_NORM, "input_layernorm.weight", (d,)))
        for kind, proj, rows in ((F.T_ATTN_Q, "q_proj", q_rows), (F.T_ATTN_K, "k_proj", kv_rows),
                                 (F.T_ATTN_V, "v_proj", kv_rows)):
            out.append(t(kind, f"self_attn.{proj}.weight", (rows, d)))
            if qkv_bias:
                out.append(t(kind, f"self_attn.{proj}.bias", (rows,), suffix="bias"))
        if qk_norm:
            out.append(t(F.T_ATTN_Q_NORM, "self_attn.q_norm.weight", (p.head_dim,)))
            out.append(t(F.T_ATTN_K_NORM, "self_attn.k_norm.weight", (p.head_dim,)))
        out.append(t(F.T_ATTN_OUTPUT, "self_attn.o_proj.weight", (d, q_rows)))
        out.append(t(ffn_norm, "post_attention_layernorm.weight", (d,)))
        if il < p.layout["lead"]:
            out.append(t(F.T_FFN_GATE, "mlp.gate_proj.weight", (p.n_ff, d)))
            out.append(t(F.T_FFN_UP, "mlp.up_proj.weight", (p.n_ff, d)))
            out.append(t(F.T_FFN_DOWN, "mlp.down_proj.weight", (d, p.n_ff)))
            continue
        names = EXPERTS if p.n_ff_shexp else ExpertNames(router=EXPERTS.router, expert=EXPERTS.expert)
        moe = expert_tensors(p, il, pre, names)
        out += moe[:1]
        out.append(t(F.T_FFN_EXP_PROBS_B, SCORE_BIAS, (p.n_expert,), suffix="bias"))
        out += moe[1:]
    out.append(direct(F.tensor_name(F.T_OUTPUT_NORM), F.T_OUTPUT_NORM, "model.norm.weight", (d,)))
    if not p.tied:
        out.append(direct(F.tensor_name(F.T_OUTPUT), F.T_OUTPUT, "lm_head.weight", (p.n_vocab, d)))
    return out


def tensors(p: HFParams) -> list[TensorMap]:
    """GLM-4.5's tensors (biases and q/k norms as the config says; the FFN's norm under
    llama.cpp's post_attention_norm)."""
    return block_tensors(p, p.layout["qkv_bias"], p.layout["qk_norm"], F.T_POST_ATTN_NORM)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layer(p: HFParams, name: str) -> bool:
    """Whether an HF tensor belongs to a multi-token prediction layer (model.layers.N.. past
    num_hidden_layers, as many as num_nextn_predict_layers), which no runtime here runs."""
    m = _LAYER.match(name)
    return m is not None and p.n_layer <= int(m.group(1)) < p.n_layer + p.layout["nextn"]


ARCH = Architecture(
    name=F.ARCH_GLM4MOE, hf_classes=("Glm4MoeForCausalLM",), model_types={"glm4_moe": "Glm4MoeForCausalLM"},
    read_config=read_config, tensors=tensors, keys=sigmoid_moe_keys,
    ignored=re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"), ignored_for=mtp_layer)
