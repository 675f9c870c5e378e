"""OPT -> GGUF architecture ``opt`` (llama.cpp has none; the names PowerInfer's converter
used).

Pre-LN blocks (OPT-125m, 1.3b ... 66b): LayerNorm with bias, biased q/k/v/out
projections, an ungated FFN ``fc2(act(fc1 x + b1)) + b2``, learned absolute positions
(the table has 2 extra leading rows: position p reads row p + 2, as HF does), a head
tied to the embeddings unless the checkpoint has its own. Refused: post-LN blocks
(OPT-350m's ``do_layer_norm_before: false``) and the embedding projections that come
with ``word_embed_proj_dim != hidden_size``.
"""

from __future__ import annotations

from .. import format as F
from ..gguf_write import ConvertError
from .arch import NORM_LAYER, Architecture, Config, HFParams, TensorMap, act_kind, act_threshold, direct

#: HF's OPTLearnedPositionalEmbedding offset: position p is row p + 2.
POSITION_OFFSET = 2
#: OPT's LayerNorms use torch's default epsilon; config.json has no key for it.
LAYER_NORM_EPS = 1e-5


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of an OPT config.json."""
    n_embd = c.int("hidden_size")
    n_head = c.int("num_attention_heads")
    c.refuse("do_layer_norm_before", lambda v: v is False,
             "post-LN blocks, as in OPT-350m; only pre-LN OPT is supported")
    c.refuse("word_embed_proj_dim", lambda v: v is not None and v != n_embd,
             f"embeddings of another width than hidden_size={n_embd} need project_in/project_out")
    c.refuse("_remove_final_layer_norm", lambda v: v is True, "no final LayerNorm")
    c.refuse("enable_bias", lambda v: v is False, "projections without biases")
    c.refuse("layer_norm_elementwise_affine", lambda v: v is False, "LayerNorms without weight and bias")
    if n_embd % n_head:
        raise ConvertError(f"config.json: hidden_size {n_embd} is not a multiple of num_attention_heads {n_head}")
    head_dim = n_embd // n_head
    hidden_act = c.get("activation_function", "relu")
    act = act_kind(hidden_act, gated=False, key="activation_function")
    return HFParams(
        hf_arch=hf_arch, arch=F.ARCH_OPT, name=c.name, n_vocab=c.int("vocab_size"), n_embd=n_embd,
        n_layer=c.int("num_hidden_layers"), n_ff=c.int("ffn_dim"), n_head=n_head, n_head_kv=n_head,
        head_dim=head_dim, n_ctx=c.n_ctx(), norm_eps=LAYER_NORM_EPS, norm=NORM_LAYER, rope_theta=None,
        activation=act, hf_hidden_act=str(hidden_act), act_threshold=act_threshold(c, act), gated=False,
        tied=c.flag("tie_word_embeddings", True), bos_token_id=c.token_id("bos_token_id"),
        eos_token_id=c.token_id("eos_token_id"), pad_token_id=c.token_id("pad_token_id"))


def tensors(p: HFParams) -> list[TensorMap]:
    """The GGUF tensors of an OPT model, in file order."""
    d, ff = p.n_embd, p.n_ff
    D = "model.decoder."
    out = [direct(F.tensor_name(F.T_TOKEN_EMBD), F.T_TOKEN_EMBD, D + "embed_tokens.weight", (p.n_vocab, d)),
           direct(F.tensor_name(F.T_POSITION_EMBD), F.T_POSITION_EMBD, D + "embed_positions.weight",
                  (p.n_ctx + POSITION_OFFSET, d))]
    for il in range(p.n_layer):
        pre = f"{D}layers.{il}."

        def wb(kind, hf, shape):
            return [direct(F.tensor_name(kind, il), kind, f"{pre}{hf}.weight", shape),
                    direct(F.tensor_name(kind, il, "bias"), kind, f"{pre}{hf}.bias", (shape[0],))]

        out += wb(F.T_ATTN_NORM, "self_attn_layer_norm", (d,))
        out += wb(F.T_ATTN_Q, "self_attn.q_proj", (d, d))
        out += wb(F.T_ATTN_K, "self_attn.k_proj", (d, d))
        out += wb(F.T_ATTN_V, "self_attn.v_proj", (d, d))
        out += wb(F.T_ATTN_OUTPUT, "self_attn.out_proj", (d, d))
        out += wb(F.T_FFN_NORM, "final_layer_norm", (d,))
        out += wb(F.T_FFN_UP, "fc1", (ff, d))
        out += wb(F.T_FFN_DOWN, "fc2", (d, ff))
    out += [direct(F.tensor_name(F.T_OUTPUT_NORM), F.T_OUTPUT_NORM, D + "final_layer_norm.weight", (d,)),
            direct(F.tensor_name(F.T_OUTPUT_NORM, suffix="bias"), F.T_OUTPUT_NORM, D + "final_layer_norm.bias", (d,))]
    if not p.tied:
        out.append(direct(F.tensor_name(F.T_OUTPUT), F.T_OUTPUT, "lm_head.weight", (p.n_vocab, d)))
    return out


def canonical(name: str) -> str:
    """facebook/opt-* checkpoints name the decoder without the ``model.`` prefix."""
    return "model." + name if name.startswith("decoder.") else name


ARCH = Architecture(
    name=F.ARCH_OPT, hf_classes=("OPTForCausalLM",), model_types={"opt": "OPTForCausalLM"},
    read_config=read_config, tensors=tensors, canonical=canonical)
