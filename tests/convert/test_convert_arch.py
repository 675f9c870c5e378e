"""The converter's architecture table: every variant of hf_models.VARIANTS converted and
read back with the gguf package. Every tensor (name, shape, value after undoing the
documented transform) is checked against the HF state dict, every key against the
config, and every refused config variant for its message (docs/FORMAT.md
"Architectures"). The runtime's logits against transformers are tests/model/test_model*.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hf_models import VARIANTS, load_hf_config, make_hf_model  # noqa: E402

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import ConvertError, convert, unpermute_qk  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

ARCH_OF = {"llama": F.ARCH_LLAMA, "qwen2": F.ARCH_QWEN2, "opt": F.ARCH_OPT, "falcon": F.ARCH_FALCON,
           "phi3": F.ARCH_PHI3, "qwen3": F.ARCH_QWEN3, "olmo2": F.ARCH_OLMO2,
           "smollm3": F.ARCH_SMOLLM3, "gemma2": F.ARCH_GEMMA2, "gemma3": F.ARCH_GEMMA3,
           "mixtral": F.ARCH_LLAMA, "qwen2moe": F.ARCH_QWEN2MOE, "qwen3moe": F.ARCH_QWEN3MOE,
           "olmoe": F.ARCH_OLMOE, "gptoss": F.ARCH_GPTOSS, "glm4moe": F.ARCH_GLM4MOE, "dots1": F.ARCH_DOTS1}
MOE_FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe")
SIGMOID_FAMILIES = ("glm4moe", "dots1")  # DeepSeek-V3's router: dense leading layers, shared experts
# the llama variants test_convert.py does not cover already
TABLE = [v for v in VARIANTS if v not in ("llama", "llama-relu")]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch")
    return {v: make_hf_model(v, root / v, seed=i) for i, v in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("arch-gguf")
    return {v: Path(convert(hf_dirs[v], root / f"{v}.gguf", "f32", progress=False)) for v in TABLE}


def state_dict(d) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    return out


def read(path):
    r = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    ts = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        ts[t.name] = (gguf.GGMLQuantizationType(t.tensor_type), data)
    return kv, ts


# --------------------------------------------------------------------------
# the expected file, written down independently of the converter
# --------------------------------------------------------------------------

def hf_qkv(q, k, v, layout, n_head, n_kv, hd):
    """Falcon: our q…, k…, v… rows back in HF's fused layout (the inverse of the documented
    reorder)."""
    rest = q.shape[1:]
    if layout == "multi_query":
        return np.concatenate([q, k, v])
    qh, kh, vh = (a.reshape(-1, hd, *rest) for a in (q, k, v))
    if layout == "mha":  # per head (q, k, v)
        return np.stack([qh, kh, vh], axis=1).reshape(-1, *rest)
    r = n_head // n_kv    # per kv group (q_0 … q_{r-1}, k, v)
    groups = [np.concatenate([qh[g * r:(g + 1) * r], kh[g:g + 1], vh[g:g + 1]]) for g in range(n_kv)]
    return np.concatenate(groups).reshape(-1, *rest)


def expected(variant: str, cfg: dict, sd: dict) -> tuple[list[str], dict]:
    """(GGUF tensor names in file order, name -> (HF name, fn, ref_fn): fn(our array) must
    equal ref_fn(the HF array))."""
    family = VARIANTS[variant][0]
    names: list[str] = []
    undo: dict = {}

    def add(name, hf, fn=lambda a: a, ref_fn=lambda a: a):
        names.append(name)
        undo[name] = (hf, fn, ref_fn)

    n = cfg["num_hidden_layers"]
    if family in ("llama", "qwen2", "qwen3", "olmo2", "smollm3") + MOE_FAMILIES:
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        perm = family in ("llama", "smollm3", "mixtral")
        biased = family == "qwen2" or (family == "qwen2moe" and cfg.get("qkv_bias", True))
        post = family == "olmo2"  # output norms only, the q/k norms over the projection
        add("token_embd.weight", "model.embed_tokens.weight")
        if variant == "llama3":
            names.append("rope_freqs.weight")
        for i in range(n):
            L = f"model.layers.{i}."
            if not post:
                add(f"blk.{i}.attn_norm.weight", L + "input_layernorm.weight")
            for proj, kind, heads in (("q", "attn_q", nh), ("k", "attn_k", nkv), ("v", "attn_v", 0)):
                fn = (lambda a, h=heads: unpermute_qk(a, h)) if perm and heads else (lambda a: a)
                add(f"blk.{i}.{kind}.weight", L + f"self_attn.{proj}_proj.weight", fn)
                if biased:
                    add(f"blk.{i}.{kind}.bias", L + f"self_attn.{proj}_proj.bias")
            if family in ("qwen3", "olmo2", "qwen3moe", "olmoe"):  # per head / over the projection
                add(f"blk.{i}.attn_q_norm.weight", L + "self_attn.q_norm.weight")
                add(f"blk.{i}.attn_k_norm.weight", L + "self_attn.k_norm.weight")
            add(f"blk.{i}.attn_output.weight", L + "self_attn.o_proj.weight")
            add(f"blk.{i}.{'post_attention_norm' if post else 'ffn_norm'}.weight",
                L + "post_attention_layernorm.weight")
            if family in MOE_FAMILIES:  # each expert is row [e] of the stacked 3-D tensor
                moe, (g, u, dn) = (("block_sparse_moe.", ("w1", "w3", "w2")) if family == "mixtral"
                                   else ("mlp.", ("gate_proj", "up_proj", "down_proj")))
                ne = cfg.get("num_experts") or cfg.get("num_local_experts")
                add(f"blk.{i}.ffn_gate_inp.weight", L + moe + "gate.weight")
                for kind, proj in (("ffn_gate_exps", g), ("ffn_up_exps", u), ("ffn_down_exps", dn)):
                    add(f"blk.{i}.{kind}.weight", tuple(L + f"{moe}experts.{e}.{proj}.weight" for e in range(ne)))
                if family == "qwen2moe":
                    add(f"blk.{i}.ffn_gate_inp_shexp.weight", L + "mlp.shared_expert_gate.weight",
                        lambda a: a.reshape(1, -1))
                    for kind, proj in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                                       ("ffn_down_shexp", "down_proj")):
                        add(f"blk.{i}.{kind}.weight", L + f"mlp.shared_expert.{proj}.weight")
            else:
                add(f"blk.{i}.ffn_gate.weight", L + "mlp.gate_proj.weight")
                add(f"blk.{i}.ffn_up.weight", L + "mlp.up_proj.weight")
                add(f"blk.{i}.ffn_down.weight", L + "mlp.down_proj.weight")
            if post:
                add(f"blk.{i}.post_ffw_norm.weight", L + "post_feedforward_layernorm.weight")
        add("output_norm.weight", "model.norm.weight")
    elif family in SIGMOID_FAMILIES:
        # unpermuted q/k (NeoX), biases and q/k norms as the config says (dots1: norms always),
        # the FFN's norm under llama.cpp's name, dense leading layers, the router's selection
        # bias, the shared experts fused as HF keeps them
        glm = family == "glm4moe"
        qk_norm = cfg.get("use_qk_norm") if glm else True
        ne = cfg["n_routed_experts"]
        add("token_embd.weight", "model.embed_tokens.weight")
        for i in range(n):
            L = f"model.layers.{i}."
            add(f"blk.{i}.attn_norm.weight", L + "input_layernorm.weight")
            for kind, proj in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v")):
                add(f"blk.{i}.{kind}.weight", L + f"self_attn.{proj}_proj.weight")
                if glm and cfg["attention_bias"]:
                    add(f"blk.{i}.{kind}.bias", L + f"self_attn.{proj}_proj.bias")
            if qk_norm:
                add(f"blk.{i}.attn_q_norm.weight", L + "self_attn.q_norm.weight")
                add(f"blk.{i}.attn_k_norm.weight", L + "self_attn.k_norm.weight")
            add(f"blk.{i}.attn_output.weight", L + "self_attn.o_proj.weight")
            add(f"blk.{i}.{'post_attention_norm' if glm else 'ffn_norm'}.weight", L + "post_attention_layernorm.weight")
            if i < cfg["first_k_dense_replace"]:
                for kind, proj in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                    add(f"blk.{i}.{kind}.weight", L + f"mlp.{proj}.weight")
                continue
            add(f"blk.{i}.ffn_gate_inp.weight", L + "mlp.gate.weight")
            add(f"blk.{i}.exp_probs_b.bias", L + "mlp.gate.e_score_correction_bias")
            for kind, proj in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"),
                               ("ffn_down_exps", "down_proj")):
                add(f"blk.{i}.{kind}.weight", tuple(L + f"mlp.experts.{e}.{proj}.weight" for e in range(ne)))
            for kind, proj in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                               ("ffn_down_shexp", "down_proj")):
                add(f"blk.{i}.{kind}.weight", L + f"mlp.shared_experts.{proj}.weight")
        add("output_norm.weight", "model.norm.weight")
    elif family in ("gemma2", "gemma3"):
        # Gemma's RMSNorm scales by 1 + w: the file holds w + 1 (in float32, as the converter
        # adds it), q/k unpermuted, the four sandwich norms
        plus1 = lambda a: a + np.float32(1.0)  # noqa: E731
        add("token_embd.weight", "model.embed_tokens.weight")
        for i in range(n):
            L = f"model.layers.{i}."
            add(f"blk.{i}.attn_norm.weight", L + "input_layernorm.weight", ref_fn=plus1)
            for proj in "qkv":
                add(f"blk.{i}.attn_{proj}.weight", L + f"self_attn.{proj}_proj.weight")
            if family == "gemma3":
                add(f"blk.{i}.attn_q_norm.weight", L + "self_attn.q_norm.weight", ref_fn=plus1)
                add(f"blk.{i}.attn_k_norm.weight", L + "self_attn.k_norm.weight", ref_fn=plus1)
            add(f"blk.{i}.attn_output.weight", L + "self_attn.o_proj.weight")
            add(f"blk.{i}.post_attention_norm.weight", L + "post_attention_layernorm.weight", ref_fn=plus1)
            add(f"blk.{i}.ffn_norm.weight", L + "pre_feedforward_layernorm.weight", ref_fn=plus1)
            add(f"blk.{i}.ffn_gate.weight", L + "mlp.gate_proj.weight")
            add(f"blk.{i}.ffn_up.weight", L + "mlp.up_proj.weight")
            add(f"blk.{i}.ffn_down.weight", L + "mlp.down_proj.weight")
            add(f"blk.{i}.post_ffw_norm.weight", L + "post_feedforward_layernorm.weight", ref_fn=plus1)
        add("output_norm.weight", "model.norm.weight", ref_fn=plus1)
    elif family == "gptoss":
        # q/k unpermuted (NeoX), every projection biased; the experts fused and transposed in
        # HF (x @ gate_up_proj[e], gate and up in alternating columns): each expert's gate rows
        # are the even members of the column pairs, its up rows the odd ones
        ne, d, ff = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
        pairs = lambda a, j: a.reshape(ne, d, ff, 2)[..., j].transpose(0, 2, 1)  # noqa: E731
        add("token_embd.weight", "model.embed_tokens.weight")
        for i in range(n):
            L = f"model.layers.{i}."
            add(f"blk.{i}.attn_norm.weight", L + "input_layernorm.weight")
            for kind, proj in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_output", "o")):
                add(f"blk.{i}.{kind}.weight", L + f"self_attn.{proj}_proj.weight")
                add(f"blk.{i}.{kind}.bias", L + f"self_attn.{proj}_proj.bias")
            add(f"blk.{i}.attn_sinks.weight", L + "self_attn.sinks")
            add(f"blk.{i}.post_attention_norm.weight", L + "post_attention_layernorm.weight")
            add(f"blk.{i}.ffn_gate_inp.weight", L + "mlp.router.weight")
            add(f"blk.{i}.ffn_gate_inp.bias", L + "mlp.router.bias")
            E = L + "mlp.experts."
            add(f"blk.{i}.ffn_gate_exps.weight", E + "gate_up_proj", ref_fn=lambda a: pairs(a, 0))
            add(f"blk.{i}.ffn_gate_exps.bias", E + "gate_up_proj_bias", ref_fn=lambda a: a.reshape(ne, ff, 2)[..., 0])
            add(f"blk.{i}.ffn_up_exps.weight", E + "gate_up_proj", ref_fn=lambda a: pairs(a, 1))
            add(f"blk.{i}.ffn_up_exps.bias", E + "gate_up_proj_bias", ref_fn=lambda a: a.reshape(ne, ff, 2)[..., 1])
            add(f"blk.{i}.ffn_down_exps.weight", E + "down_proj", ref_fn=lambda a: np.swapaxes(a, 1, 2))
            add(f"blk.{i}.ffn_down_exps.bias", E + "down_proj_bias")
        add("output_norm.weight", "model.norm.weight")
    elif family == "phi3":  # fused as HF stores them: nothing to undo
        add("token_embd.weight", "model.embed_tokens.weight")
        for i in range(n):
            L = f"model.layers.{i}."
            for kind, hf in (("attn_norm", "input_layernorm"), ("attn_qkv", "self_attn.qkv_proj"),
                             ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
                             ("ffn_up", "mlp.gate_up_proj"), ("ffn_down", "mlp.down_proj")):
                add(f"blk.{i}.{kind}.weight", L + hf + ".weight")
        add("output_norm.weight", "model.norm.weight")
    elif family == "opt":
        D = "model.decoder."
        add("token_embd.weight", D + "embed_tokens.weight")
        add("position_embd.weight", D + "embed_positions.weight")
        for i in range(n):
            L = f"{D}layers.{i}."
            for kind, hf in (("attn_norm", "self_attn_layer_norm"), ("attn_q", "self_attn.q_proj"),
                             ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                             ("attn_output", "self_attn.out_proj"), ("ffn_norm", "final_layer_norm"),
                             ("ffn_up", "fc1"), ("ffn_down", "fc2")):
                add(f"blk.{i}.{kind}.weight", L + hf + ".weight")
                add(f"blk.{i}.{kind}.bias", L + hf + ".bias")
        add("output_norm.weight", D + "final_layer_norm.weight")
        add("output_norm.bias", D + "final_layer_norm.bias")
    else:  # falcon
        nh, d = cfg["num_attention_heads"], cfg["hidden_size"]
        hd = d // nh
        new = cfg["new_decoder_architecture"]
        nkv = cfg["num_kv_heads"] if new else (1 if cfg["multi_query"] else nh)
        layout = "grouped" if new else ("multi_query" if cfg["multi_query"] else "mha")
        two_ln = new and (cfg.get("num_ln_in_parallel_attn") or 2) == 2
        bias = cfg["bias"]

        def unqkv(a):
            q, k, v = np.split(a, [nh * hd, (nh + nkv) * hd])
            return hf_qkv(q, k, v, layout, nh, nkv, hd)

        T = "transformer."
        add("token_embd.weight", T + "word_embeddings.weight")
        for i in range(n):
            L = f"{T}h.{i}."
            norms = [("attn_norm", "ln_mlp"), ("attn_norm_2", "ln_attn")] if two_ln else [("attn_norm", "input_layernorm")]
            for kind, hf in norms:
                add(f"blk.{i}.{kind}.weight", L + hf + ".weight")
                add(f"blk.{i}.{kind}.bias", L + hf + ".bias")
            lins = [("attn_qkv", "self_attention.query_key_value", unqkv), ("attn_output", "self_attention.dense", None)]
            for kind, hf, fn in lins:
                add(f"blk.{i}.{kind}.weight", L + hf + ".weight", fn or (lambda a: a))
                if bias:
                    add(f"blk.{i}.{kind}.bias", L + hf + ".bias", fn or (lambda a: a))
            if not cfg["parallel_attn"]:
                add(f"blk.{i}.ffn_norm.weight", L + "post_attention_layernorm.weight")
                add(f"blk.{i}.ffn_norm.bias", L + "post_attention_layernorm.bias")
            for kind, hf in (("ffn_up", "mlp.dense_h_to_4h"), ("ffn_down", "mlp.dense_4h_to_h")):
                add(f"blk.{i}.{kind}.weight", L + hf + ".weight")
                if bias:
                    add(f"blk.{i}.{kind}.bias", L + hf + ".bias")
        add("output_norm.weight", T + "ln_f.weight")
        add("output_norm.bias", T + "ln_f.bias")
    if not cfg.get("tie_word_embeddings", family in ("opt", "falcon", "gemma2", "gemma3")):
        add("output.weight", "lm_head.weight")
    return names, undo


def expected_keys(variant: str, cfg: dict) -> dict:
    """Every hyper-parameter key the file must carry, with its value (and the absent ones: None)."""
    family = VARIANTS[variant][0]
    A = ARCH_OF[family]
    d, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    ok = {F.KEY_GENERAL_ARCHITECTURE: A, F.arch_key(F.KEY_EMBEDDING_LENGTH, A): d,
          F.arch_key(F.KEY_BLOCK_COUNT, A): cfg["num_hidden_layers"],
          F.arch_key(F.KEY_HEAD_COUNT, A): nh, F.arch_key(F.KEY_VOCAB_SIZE, A): cfg["vocab_size"],
          F.arch_key(F.KEY_CONTEXT_LENGTH, A): cfg["max_position_embeddings"],
          F.arch_key(F.KEY_ROPE_SCALING_TYPE, A): None, F.KEY_FFN_ACT_THRESHOLD: None}
    if family in ("llama", "qwen2", "qwen3", "olmo2", "smollm3", "phi3") + MOE_FAMILIES:
        hd = cfg.get("head_dim") or d // nh
        ok.update({F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A): cfg["intermediate_size"],
                   F.arch_key(F.KEY_HEAD_COUNT_KV, A): cfg["num_key_value_heads"],
                   F.arch_key(F.KEY_RMS_EPS, A): cfg["rms_norm_eps"], F.arch_key(F.KEY_LAYERNORM_EPS, A): None,
                   F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A): hd,
                   F.arch_key(F.KEY_ROPE_FREQ_BASE, A): cfg["rope_parameters"]["rope_theta"],
                   F.arch_key(F.KEY_KEY_LENGTH, A): hd if hd * nh != d else None,
                   F.arch_key(F.KEY_VALUE_LENGTH, A): hd if hd * nh != d else None,
                   F.KEY_FFN_ACTIVATION: {"prosparse": "fatrelu", "bamboo": "drelu", "llama3": "silu",
                                          "mistral-nemo": "silu",
                                          "qwen2": "silu", "qwen2-tied": "silu", "qwen3": "silu",
                                          "qwen3-tied": "silu", "olmo2": "silu", "olmo2-tied": "silu",
                                          "smollm3": "silu", "smollm3-untied": "silu",
                                          "phi3": "silu", **{v: "silu" for v in VARIANTS
                                                             if VARIANTS[v][0] in MOE_FAMILIES},
                                          "mixtral-relu": "relu", "mixtral-drelu": "drelu"}[variant]})
        if variant == "prosparse":
            ok[F.KEY_FFN_ACT_THRESHOLD] = 0.01
        ok[F.KEY_TOKENIZER_PRE] = "qwen2" if family in ("qwen2", "qwen3", "qwen2moe", "qwen3moe") else "default"
        moe = family in MOE_FAMILIES
        ff_exp = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
        ok.update({F.arch_key(F.KEY_EXPERT_COUNT, A): (cfg.get("num_experts") or cfg.get("num_local_experts")) if moe else None,
                   F.arch_key(F.KEY_EXPERT_USED_COUNT, A): cfg["num_experts_per_tok"] if moe else None,
                   F.arch_key(F.KEY_EXPERT_FEED_FORWARD_LENGTH, A): ff_exp if moe else None,
                   F.arch_key(F.KEY_EXPERT_SHARED_FEED_FORWARD_LENGTH, A):
                       cfg["shared_expert_intermediate_size"] if family == "qwen2moe" else None,
                   F.arch_key(F.KEY_EXPERT_WEIGHTS_NORM, A):
                       (family == "mixtral" or cfg["norm_topk_prob"]) if moe else None,
                   F.arch_key(F.KEY_EXPERT_GATING_FUNC, A): 1 if moe else None})
        if family == "phi3":
            ok[F.arch_key(F.KEY_ROPE_FREQ_BASE, A)] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    elif family in ("gemma2", "gemma3"):
        hd = cfg["head_dim"]
        rp = cfg["rope_parameters"]
        glob = rp["full_attention"] if family == "gemma3" else rp
        local = [t == "sliding_attention" for t in cfg["layer_types"]]
        default = [i % F.SWA_PERIOD[A] < F.SWA_PERIOD[A] - 1 for i in range(cfg["num_hidden_layers"])]
        ok.update({F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A): cfg["intermediate_size"],
                   F.arch_key(F.KEY_HEAD_COUNT_KV, A): cfg["num_key_value_heads"],
                   F.arch_key(F.KEY_RMS_EPS, A): cfg["rms_norm_eps"], F.arch_key(F.KEY_LAYERNORM_EPS, A): None,
                   F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A): hd,
                   F.arch_key(F.KEY_ROPE_FREQ_BASE, A): glob["rope_theta"],
                   F.arch_key(F.KEY_KEY_LENGTH, A): hd if hd * nh != d else None,
                   F.arch_key(F.KEY_VALUE_LENGTH, A): hd if hd * nh != d else None,
                   F.arch_key(F.KEY_SLIDING_WINDOW, A): cfg["sliding_window"],
                   F.arch_key(F.KEY_SLIDING_WINDOW_PATTERN, A): local if local != default else None,
                   F.arch_key(F.KEY_ATTENTION_SCALE, A): cfg["query_pre_attn_scalar"] ** -0.5,
                   F.arch_key(F.KEY_ATTN_LOGIT_SOFTCAPPING, A): cfg["attn_logit_softcapping"],
                   F.arch_key(F.KEY_FINAL_LOGIT_SOFTCAPPING, A): cfg["final_logit_softcapping"],
                   F.arch_key(F.KEY_ROPE_FREQ_BASE_SWA, A): (rp["sliding_attention"]["rope_theta"]
                                                             if family == "gemma3" else None),
                   F.KEY_FFN_ACTIVATION: "gelu", F.KEY_TOKENIZER_PRE: "default",
                   # SentencePiece-style, without the "▁" prefix, as llama.cpp writes Gemma's
                   F.KEY_TOKENIZER_MODEL: F.TOKENIZER_LLAMA, F.KEY_TOKENIZER_ADD_SPACE_PREFIX: False})
        if glob.get("rope_type") == "linear":
            ok[F.arch_key(F.KEY_ROPE_SCALING_TYPE, A)] = F.ROPE_SCALING_LINEAR
            ok[F.arch_key(F.KEY_ROPE_SCALING_FACTOR, A)] = glob["factor"]
    elif family == "gptoss":
        hd, rp = cfg["head_dim"], cfg["rope_parameters"]
        local = [t == "sliding_attention" for t in cfg["layer_types"]]
        ok.update({F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A): cfg["intermediate_size"],
                   F.arch_key(F.KEY_HEAD_COUNT_KV, A): cfg["num_key_value_heads"],
                   F.arch_key(F.KEY_RMS_EPS, A): cfg["rms_norm_eps"], F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A): hd,
                   F.arch_key(F.KEY_ROPE_FREQ_BASE, A): rp["rope_theta"],
                   F.arch_key(F.KEY_KEY_LENGTH, A): hd if hd * nh != d else None,
                   F.arch_key(F.KEY_ROPE_SCALING_TYPE, A): F.ROPE_SCALING_YARN,
                   F.arch_key(F.KEY_ROPE_SCALING_FACTOR, A): rp["factor"],
                   F.arch_key(F.KEY_ROPE_SCALING_ORIG_CTX, A): rp["original_max_position_embeddings"],
                   F.arch_key(F.KEY_ROPE_SCALING_YARN_BETA_FAST, A): rp["beta_fast"],
                   F.arch_key(F.KEY_ROPE_SCALING_YARN_BETA_SLOW, A): rp["beta_slow"],
                   F.arch_key(F.KEY_SLIDING_WINDOW, A): cfg["sliding_window"],
                   F.arch_key(F.KEY_SLIDING_WINDOW_PATTERN, A):
                       local if local != [i % 2 == 0 for i in range(len(local))] else None,
                   F.arch_key(F.KEY_SWIGLU_CLAMP_EXP, A): float(cfg["swiglu_limit"]),
                   F.arch_key(F.KEY_EXPERT_COUNT, A): cfg["num_local_experts"],
                   F.arch_key(F.KEY_EXPERT_USED_COUNT, A): cfg["num_experts_per_tok"],
                   F.arch_key(F.KEY_EXPERT_FEED_FORWARD_LENGTH, A): cfg["intermediate_size"],
                   F.arch_key(F.KEY_EXPERT_WEIGHTS_NORM, A): True,
                   F.KEY_FFN_ACTIVATION: F.ACT_SWIGLU_OAI, F.KEY_TOKENIZER_PRE: "default"})
    elif family in SIGMOID_FAMILIES:
        hd = d // nh
        rp = cfg.get("rope_parameters") or {}
        n_rot = int(hd * rp.get("partial_rotary_factor", 0.5)) if family == "glm4moe" else hd
        ff_e, n_sh = cfg["moe_intermediate_size"], cfg["n_shared_experts"]
        ok.update({F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A): cfg["intermediate_size"],
                   F.arch_key(F.KEY_HEAD_COUNT_KV, A): cfg["num_key_value_heads"],
                   F.arch_key(F.KEY_RMS_EPS, A): cfg["rms_norm_eps"], F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A): n_rot,
                   F.arch_key(F.KEY_ROPE_FREQ_BASE, A): rp.get("rope_theta", 10000.0),
                   F.arch_key(F.KEY_KEY_LENGTH, A): None,
                   F.arch_key(F.KEY_EXPERT_COUNT, A): cfg["n_routed_experts"],
                   F.arch_key(F.KEY_EXPERT_USED_COUNT, A): cfg["num_experts_per_tok"],
                   F.arch_key(F.KEY_EXPERT_FEED_FORWARD_LENGTH, A): ff_e,
                   F.arch_key(F.KEY_EXPERT_SHARED_FEED_FORWARD_LENGTH, A): n_sh * ff_e,
                   F.arch_key(F.KEY_EXPERT_SHARED_COUNT, A): n_sh,
                   F.arch_key(F.KEY_EXPERT_GROUP_COUNT, A): cfg["n_group"],
                   F.arch_key(F.KEY_EXPERT_GROUP_USED_COUNT, A): cfg["topk_group"],
                   F.arch_key(F.KEY_LEADING_DENSE_BLOCK_COUNT, A): cfg["first_k_dense_replace"],
                   F.arch_key(F.KEY_EXPERT_WEIGHTS_SCALE, A): float(cfg["routed_scaling_factor"]),
                   F.arch_key(F.KEY_EXPERT_WEIGHTS_NORM, A): cfg["norm_topk_prob"],
                   F.arch_key(F.KEY_EXPERT_GATING_FUNC, A): F.EXPERT_GATING_SIGMOID,
                   F.arch_key(F.KEY_NEXTN_PREDICT_LAYERS, A): None,
                   F.KEY_FFN_ACTIVATION: "silu", F.KEY_TOKENIZER_PRE: "default"})
    elif family == "opt":
        ok.update({F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A): cfg["ffn_dim"],
                   F.arch_key(F.KEY_HEAD_COUNT_KV, A): nh, F.arch_key(F.KEY_LAYERNORM_EPS, A): 1e-5,
                   F.arch_key(F.KEY_RMS_EPS, A): None, F.arch_key(F.KEY_ROPE_FREQ_BASE, A): None,
                   F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A): None, F.arch_key(F.KEY_KEY_LENGTH, A): None,
                   F.KEY_FFN_ACTIVATION: "relu", F.KEY_TOKENIZER_PRE: "default"})
    else:
        new = cfg["new_decoder_architecture"]
        nkv = cfg["num_kv_heads"] if new else (1 if cfg["multi_query"] else nh)
        ok.update({F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A): cfg["ffn_hidden_size"],
                   F.arch_key(F.KEY_HEAD_COUNT_KV, A): nkv,
                   F.arch_key(F.KEY_LAYERNORM_EPS, A): cfg["layer_norm_epsilon"], F.arch_key(F.KEY_RMS_EPS, A): None,
                   F.arch_key(F.KEY_ROPE_FREQ_BASE, A): cfg["rope_parameters"]["rope_theta"],
                   F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A): d // nh, F.arch_key(F.KEY_KEY_LENGTH, A): None,
                   F.KEY_FFN_ACTIVATION: {"gelu": "gelu_erf", "relu": "relu"}[cfg["activation"]],
                   F.KEY_TOKENIZER_PRE: "falcon"})
    return ok


# --------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", TABLE)
def test_tensors_and_keys(hf_dirs, converted, variant):
    d = hf_dirs[variant]
    cfg = load_hf_config(d)
    kv, ts = read(converted[variant])
    sd = state_dict(d)
    names, undo = expected(variant, cfg, sd)
    assert list(ts) == names
    for name, (qtype, data) in ts.items():
        if name == "rope_freqs.weight":
            continue  # test_llama3_rope_freqs
        hf, fn, ref_fn = undo[name]
        ref = np.stack([sd[h] for h in hf]) if isinstance(hf, tuple) else sd[hf]  # experts: stacked
        assert qtype == gguf.GGMLQuantizationType.F32, name  # an f32 conversion: every tensor
        np.testing.assert_array_equal(fn(data), ref_fn(ref), err_msg=f"{name} <- {hf}")
    # every HF tensor is used (a tied head is the embedding itself)
    used = {h for n in undo for h in (undo[n][0] if isinstance(undo[n][0], tuple) else (undo[n][0],))}
    assert set(sd) - used <= {"lm_head.weight"}, set(sd) - used
    for key, want in expected_keys(variant, cfg).items():
        if want is None:
            assert key not in kv, key
        elif isinstance(want, float):
            assert kv[key] == pytest.approx(want, rel=1e-6), key
        else:
            assert kv[key] == want, key
    assert kv[F.KEY_FORMAT_VERSION] == F.FORMAT_VERSION


def test_biases_are_nonzero(hf_dirs):
    """The factory perturbs biases (HF initializes them to 0, which would hide mix-ups)."""
    sd = state_dict(hf_dirs["opt"])
    assert all(np.abs(v).max() > 0.01 for k, v in sd.items() if k.endswith("bias"))


def _hf_falcon_qkv(att, w: torch.Tensor, x: torch.Tensor):
    """(q, k, v) as transformers' FalconAttention splits them out of query_key_value · x:
    its _split_heads where it has one (transformers 4), else the states its forward hands
    to the attention function (transformers 5; at position 0 RoPE is the identity)."""
    if hasattr(att, "_split_heads"):
        return att._split_heads(x @ w.T)
    from transformers.models.falcon import modeling_falcon as mf

    att = att.double()
    att.query_key_value.weight.data.copy_(w)
    if att.query_key_value.bias is not None:
        att.query_key_value.bias.data.zero_()
    seen = {}

    def capture(module, q, k, v, *args, **kwargs):
        seen["qkv"] = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype), None

    hd = att.head_dim
    pos = (torch.ones(1, 1, hd, dtype=torch.float64), torch.zeros(1, 1, hd, dtype=torch.float64))
    orig = mf.ALL_ATTENTION_FUNCTIONS.get_interface
    mf.ALL_ATTENTION_FUNCTIONS.get_interface = lambda *a, **k: capture
    try:
        with torch.no_grad():
            att(x, None, position_embeddings=pos)
    finally:
        mf.ALL_ATTENTION_FUNCTIONS.get_interface = orig
    return seen["qkv"]


def test_falcon_qkv_rows_match_hf_split(hf_dirs, converted):
    """attn_qkv · x split into (all q, all k, all v) equals what HF's own attention splits out
    of query_key_value · x, for the three fused layouts."""
    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention

    for variant in ("falcon-7b-bias", "falcon-mha", "falcon-40b"):
        cfg = FalconConfig.from_pretrained(str(hf_dirs[variant]))
        att = FalconAttention(cfg, layer_idx=0)
        sd = state_dict(hf_dirs[variant])
        w = torch.from_numpy(sd["transformer.h.0.self_attention.query_key_value.weight"])
        x = torch.randn(1, 1, cfg.hidden_size, dtype=torch.float64)
        q, k, v = _hf_falcon_qkv(att, w.double(), x)
        n_kv = cfg.num_kv_heads if cfg.new_decoder_architecture else (1 if cfg.multi_query else cfg.num_attention_heads)
        hd = cfg.hidden_size // cfg.num_attention_heads
        _, ts = read(converted[variant])
        ours = (x[0, 0].numpy() @ ts["blk.0.attn_qkv.weight"][1].astype(np.float64).T)
        oq, ok, ov = np.split(ours, [cfg.num_attention_heads * hd, (cfg.num_attention_heads + n_kv) * hd])
        np.testing.assert_allclose(oq, q.reshape(-1).numpy(), rtol=1e-6, atol=1e-9)
        # HF broadcasts k/v of the grouped layout over the query heads: compare the distinct heads
        kh = k.reshape(-1, hd).numpy()
        step = kh.shape[0] // n_kv
        np.testing.assert_allclose(ok, kh[::step].reshape(-1), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(ov, v.reshape(-1, hd).numpy()[::step].reshape(-1), rtol=1e-6, atol=1e-9)


def test_llama3_rope_freqs(hf_dirs, converted):
    """rope_freqs are the divisors that turn the unscaled frequencies into transformers'
    llama3 ones; no scaling type key (llama.cpp writes none for llama3)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig.from_pretrained(str(hf_dirs["llama3"]))
    inv_scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    kv, ts = read(converted["llama3"])
    qtype, freqs = ts["rope_freqs.weight"]
    hd = kv["llama.rope.dimension_count"]
    assert qtype == gguf.GGMLQuantizationType.F32 and freqs.shape == (hd // 2,)
    base = kv["llama.rope.freq_base"]
    inv = 1.0 / base ** (np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(inv / freqs, inv_scaled.double().numpy(), rtol=2e-6)
    assert freqs[0] == pytest.approx(1.0) and freqs[-1] == pytest.approx(8.0)  # high kept, low / factor
    assert "llama.rope.scaling.type" not in kv


def test_tokenizer_pre(hf_dirs, tmp_path):
    """An unknown byte-level pre-tokenizer (Falcon's without its split of digit runs into
    threes) is refused by name, never stored as "default" or "falcon"."""
    d = tmp_path / "m"
    shutil.copytree(hf_dirs["falcon-7b"], d)
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Punctuation", "behavior": "Contiguous"},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        {"type": "Digits", "individual_digits": False}]}
    (d / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    with pytest.raises(ConvertError, match="pre_tokenizer .*Punctuation"):
        convert(d, tmp_path / "o.gguf", "f32", progress=False)


FALCON_TEXTS = ["Hello world", "hello, world!! ...ok", "price: $12,345.67 (approx.)", "1234567 and 89",
                "a+b<=c^d~e|f`g", "12\u00bd3456 \u00bd6789 x\u00b2y \u0663\u0664\u0665",
                "\u043c and \u043c\u0438\u0440 999", "Don't stop at 3.14159265!", "  leading  and   spaces  ",
                "tabs\there\nnewline 42\n\n", "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600", ""]


def test_falcon_tokenizer_round_trip(hf_dirs, converted):
    """A Falcon folder (Falcon's published pre-tokenizer) is stored as pre = falcon, and its
    GGUF tokenizes exactly as transformers does: through the embedded tokenizer.json and
    through the tokenizer rebuilt from the tokenizer.ggml.* keys alone (as for a file
    from another tool)."""
    import transformers

    from powerinfer_cpp.tokenizer import load_tokenizer

    kv, _ = read(converted["falcon-7b"])
    assert kv[F.KEY_TOKENIZER_PRE] == F.TOKENIZER_PRE_FALCON
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dirs["falcon-7b"]))
    embedded, rebuilt = (load_tokenizer(converted["falcon-7b"], use_hf_json=u) for u in (True, False))
    for s in FALCON_TEXTS:
        want = ref(s, add_special_tokens=False)["input_ids"]
        assert embedded.encode(s, add_bos=False) == want, s
        assert rebuilt.encode(s, add_bos=False) == want, s
        assert rebuilt.decode(want) == ref.decode(want), s


def test_opt_names_without_model_prefix(hf_dirs, converted, tmp_path):
    """facebook/opt-* checkpoints name the decoder 'decoder.…' (no 'model.'): same file."""
    from safetensors.numpy import save_file

    d = tmp_path / "m"
    shutil.copytree(hf_dirs["opt-untied"], d)
    sd = state_dict(d)
    save_file({k.removeprefix("model."): np.ascontiguousarray(v) for k, v in sd.items()}, str(d / "model.safetensors"))
    _, a = read(convert(d, tmp_path / "o.gguf", "f32", progress=False))
    _, b = read(converted["opt-untied"])
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k][1], b[k][1])


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_0"])
def test_storage_types(hf_dirs, tmp_path, outtype):
    """Biases and norms stay F32, the learned positions follow the embedding's rule."""
    _, ts = read(convert(hf_dirs["opt"], tmp_path / "o.gguf", outtype, progress=False))
    Q = gguf.GGMLQuantizationType
    for name, (qtype, data) in ts.items():
        if data.ndim == 1:
            assert qtype == Q.F32, name
    want = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q8_0}[outtype]
    assert ts["position_embd.weight"][0] == want == ts["token_embd.weight"][0]


# --------------------------------------------------------------------------
# refused variants: a clear error naming the key and value
# --------------------------------------------------------------------------

def _patched(hf_dirs, tmp_path, variant, **upd):
    d = tmp_path / "m"
    shutil.copytree(hf_dirs[variant], d)
    cfg = load_hf_config(d)
    for k, v in upd.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return d


REFUSED = {
    "opt-post-ln": ("opt", dict(do_layer_norm_before=False), "do_layer_norm_before=false"),
    "opt-proj": ("opt", dict(word_embed_proj_dim=32), "word_embed_proj_dim=32"),
    "opt-no-bias": ("opt", dict(enable_bias=False), "enable_bias=false"),
    "opt-no-final-ln": ("opt", dict(_remove_final_layer_norm=True), "_remove_final_layer_norm=true"),
    "opt-no-affine": ("opt", dict(layer_norm_elementwise_affine=False), "layer_norm_elementwise_affine=false"),
    "opt-act": ("opt", dict(activation_function="tanh"), "unsupported activation_function 'tanh'"),
    "opt-drelu": ("opt", dict(activation_function="drelu"), "dReLU needs a gated FFN"),
    "falcon-alibi": ("falcon-7b", dict(alibi=True), "alibi=true"),
    "falcon-new-seq": ("falcon-40b", dict(parallel_attn=False), "parallel_attn=false"),
    "falcon-3ln": ("falcon-40b", dict(num_ln_in_parallel_attn=3), "num_ln_in_parallel_attn=3"),
    "falcon-mha-kv": ("falcon-mha", dict(num_kv_heads=2), "num_kv_heads=2"),
    "falcon-yarn": ("falcon-7b", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
                    "unsupported rope scaling 'yarn'"),
    "falcon-llama3": ("falcon-7b", dict(rope_parameters={"rope_type": "llama3", "factor": 2.0, "rope_theta": 1e4}),
                      "unsupported rope scaling 'llama3'"),
    "qwen2-swa": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None),
                  "use_sliding_window=true with sliding_window=16"),
    "qwen2-partial-rope": ("qwen2", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    "qwen3-swa": ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None),
                  "use_sliding_window=true with sliding_window=16"),
    "qwen3-bias": ("qwen3", dict(attention_bias=True), "attention_bias=true"),
    "olmo2-bias": ("olmo2", dict(attention_bias=True), "attention_bias=true"),
    "olmo2-clip": ("olmo2", dict(clip_qkv=8.0), "clip_qkv=8.0"),
    "smollm3-nope": ("smollm3", dict(no_rope_layers=[1, 0, 1, 1]), "no_rope_layers=[1, 0, 1, 1]"),
    "smollm3-interval": ("smollm3", dict(no_rope_layers=None, no_rope_layer_interval=2),
                         "no_rope_layers=[1, 0, 1, 0]"),
    "smollm3-swa": ("smollm3", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=true"),
    "gemma2-untied": ("gemma2", dict(tie_word_embeddings=False), "tie_word_embeddings=false"),
    "gemma2-no-cap": ("gemma2", dict(attn_logit_softcapping=None), "attn_logit_softcapping=null"),
    "gemma2-bias": ("gemma2", dict(attention_bias=True), "attention_bias=true"),
    "gemma2-act": ("gemma2", dict(hidden_activation="silu"), "hidden_activation 'silu'"),
    "gemma2-types": ("gemma2", dict(layer_types=["sliding_attention", "chunked"]), "layer_types must list 3"),
    "gemma3-softcap": ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    "gemma3-bidir": ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    "gemma3-local-scaled": ("gemma3", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
        "linear RoPE scaling on the sliding-window layers"),
    "gemma3-multimodal": ("gemma3", dict(architectures=["Gemma3ForConditionalGeneration"]),
                          "unsupported architecture 'Gemma3ForConditionalGeneration'"),
    "phi3-longrope": ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                    "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
                      "unsupported rope scaling 'longrope'"),
    "phi3-partial-rope": ("phi3", dict(partial_rotary_factor=0.75, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}), "partial_rotary_factor=0.75"),
    "llama3-no-low": ("llama3", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64}),
                      "low_freq_factor"),
    "llama3-high-low": ("llama3", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                                        "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}),
                        "high_freq_factor (4.0) > low_freq_factor (4.0)"),
    "prosparse-no-t": ("prosparse", dict(hidden_act_param=None), "hidden_act_param"),
    "prosparse-bad-t": ("prosparse", dict(hidden_act_param="x"), "'hidden_act_param' must be a number"),
    "bamboo-silu": ("bamboo", dict(hidden_act="silu"), "BambooForCausalLM with hidden_act 'silu'"),
    "unknown-arch": ("opt", dict(architectures=["GPTNeoXForCausalLM"]), "unsupported architecture 'GPTNeoXForCausalLM'"),
    "unknown-type": ("opt", dict(architectures=None, model_type="gpt_neox"), "model_type='gpt_neox'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(hf_dirs, tmp_path, case):
    variant, upd, msg = REFUSED[case]
    d = _patched(hf_dirs, tmp_path, variant, **upd)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvertError) as ei:
        convert(d, out / "o.gguf", "f32", progress=False)
    assert msg in str(ei.value)
    assert list(out.iterdir()) == []


def test_model_type_without_architectures(hf_dirs, tmp_path):
    d = _patched(hf_dirs, tmp_path, "falcon-40b", architectures=None)
    kv, _ = read(convert(d, tmp_path / "o.gguf", "f32", progress=False))
    assert kv[F.KEY_GENERAL_ARCHITECTURE] == "falcon"


def test_gate_sparsity_needs_a_gate(hf_dirs, tmp_path):
    """--sparsity calibrates the gate: refused for an ungated FFN before anything runs."""
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    heldout = REPO_DIR / "models" / "tiny-relu-kjv" / "heldout.txt"
    with pytest.raises(ConvertError, match="has none"):
        convert(hf_dirs["opt"], tmp_path / "o.gguf", "f32", progress=False, sparse=True,
                sparse_options=SparseOptions(calib=str(heldout), sparsity=0.5))
    assert list(tmp_path.iterdir()) == []


def test_placement_costs_ungated():
    """A neuron of an ungated FFN costs its rows of up and down_t (no gate); biases count
    with the norms, a fused QKV with the attention."""
    from powerinfer_cpp.sparse.placement import model_costs

    Q = gguf.GGMLQuantizationType
    d, ff, n = 64, 128, 2
    t = {"token_embd.weight": (Q.F16, (384, d)), "output_norm.weight": (Q.F32, (d,)),
         "output_norm.bias": (Q.F32, (d,))}
    for i in range(n):
        t.update({f"blk.{i}.attn_norm.weight": (Q.F32, (d,)), f"blk.{i}.attn_norm.bias": (Q.F32, (d,)),
                  f"blk.{i}.attn_qkv.weight": (Q.F16, (3 * d, d)), f"blk.{i}.attn_output.weight": (Q.F16, (d, d)),
                  f"blk.{i}.ffn_up.weight": (Q.Q8_0, (ff, d)), f"blk.{i}.ffn_up.bias": (Q.F32, (ff,)),
                  f"blk.{i}.ffn_down_t.weight": (Q.Q8_0, (ff, d)), f"blk.{i}.ffn_down.bias": (Q.F32, (d,))})
    dense, per_neuron = model_costs(t, n, d, 16)
    assert per_neuron == [4 + 2 * (d // 32 * 34)] * n
    by = {it.name: it.nbytes for it in dense}
    assert by["blk.0.attention"] == 4 * d * d * 2
    assert by["norms"] == n * (2 * d + ff + d) * 4 + 2 * d * 4


def test_format_doc_covers_every_architecture(converted):
    """docs/FORMAT.md has a section per architecture naming each tensor kind its files
    carry, and documents each key they carry (per-architecture keys as `A.…`)."""
    doc = (REPO_DIR / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    import re

    arch_doc = doc[doc.index("## Architectures\n"):doc.index("## Sparse extension\n")]
    llama_doc = doc[doc.index("## Tensors\n"):doc.index("## Architectures\n")]
    for variant, path in converted.items():
        kv, ts = read(path)
        A = kv[F.KEY_GENERAL_ARCHITECTURE]
        start = arch_doc.index(f"### `{A}`")
        sec = arch_doc[start:arch_doc.find("\n### ", start + 1)]
        for name in ts:
            kind = F.parse_tensor_name(name)[0]
            generic = re.sub(r"^blk\.\d+\.", "blk.N.", name)
            # sections that say "the llama tensors" inherit the llama table's rows
            in_llama = (A in (F.ARCH_LLAMA, F.ARCH_QWEN2, F.ARCH_QWEN3, F.ARCH_OLMO2, F.ARCH_SMOLLM3,
                              F.ARCH_GEMMA2, F.ARCH_GEMMA3, F.ARCH_QWEN2MOE, F.ARCH_QWEN3MOE,
                              F.ARCH_OLMOE, F.ARCH_GPTOSS, F.ARCH_GLM4MOE, F.ARCH_DOTS1)
                        and f"`{generic}`" in llama_doc)
            assert re.search(rf"\b{kind}\b", sec) or in_llama, (variant, name)
        for key in kv:
            if key.startswith("tokenizer.") or key.startswith("general."):
                continue
            doc_key = "A." + key[len(A) + 1:] if key.startswith(A + ".") else key
            assert f"`{doc_key}`" in doc or f"`{doc_key}" in doc, (variant, key)


def test_dense_relu_file_warns_about_llama_cpp(hf_dirs, tmp_path, caplog):
    """llama.cpp reads no activation key: a dense ReLU llama file would run as SwiGLU there,
    so convert says so; SwiGLU and Falcon's GELU (tanh or exact) do not warn."""
    import logging

    with caplog.at_level(logging.WARNING, logger="powerinfer_cpp.convert"):
        convert(hf_dirs["llama-relu"], tmp_path / "r.gguf", "f32", progress=False)
    assert "llama.cpp computes silu" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="powerinfer_cpp.convert"):
        convert(hf_dirs["llama"], tmp_path / "s.gguf", "f32", progress=False)
        convert(hf_dirs["falcon-7b"], tmp_path / "f.gguf", "f32", progress=False)
    assert "llama.cpp computes" not in caplog.text
