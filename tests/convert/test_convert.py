"""Tests of powerinfer_cpp.convert (HF folder -> GGUF)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_models import make_llama_model, patch_drelu  # noqa: E402

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import ConvertError, convert, unpermute_qk  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

Q = gguf.GGMLQuantizationType
REPO = REPO_DIR

# Normalized squared error bounds ||deq - ref||^2 / ||ref||^2 per storage type.
# (f16 ~ 2^-11 relative rounding, bf16 ~ 2^-8; q8_0 step = absmax/127 and
# q4_0 step = absmax/8 per 32-block of Gaussian-ish weights.)
NMSE_BOUND = {Q.F32: 0.0, Q.F16: 1e-6, Q.BF16: 3e-5, Q.Q8_0: 1e-4, Q.Q4_0: 1.5e-2, Q.Q4_1: 1.5e-2,
              Q.Q5_0: 4e-3, Q.Q5_1: 4e-3, Q.IQ4_NL: 1e-2, Q.IQ4_XS: 1e-2}  # IQ4 on Gaussian rows: ~5.5e-3

# name -> make_llama_model kwargs
MODELS = {
    "relu_tied": dict(act="relu", tied=True),
    "silu_untied": dict(act="silu", tied=False, n_ff=80, seed=1),              # n_ff % 32 != 0
    "gelu_mistral": dict(act="gelu", tied=False, arch="MistralForCausalLM", head_dim=32, n_head_kv=1,
                         dtype="bfloat16", max_shard_size="30KB", seed=2),     # sharded, bf16, head_dim
    "drelu_spm": dict(act="drelu", tied=True, tokenizer="spm", dtype="float16", n_head_kv=4, seed=3),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_llama_model(root / name, **kw) for name, kw in MODELS.items()}


def hf_weights(d) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    return out


def fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensors(reader) -> dict:
    """name -> (type, numpy shape (rows, cols), float32 data)"""
    out = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        out[t.name] = (t.tensor_type, shape, data)
    return out


def low_fallback():
    """Q2_K / Q3_K rows that are not whole 256-blocks: llama.cpp's IQ4_NL where the runtime
    reads it, else Q5_0."""
    from powerinfer_cpp._native import lib
    return Q.IQ4_NL if lib.gh_type_row_size(int(Q.IQ4_NL), 32) else Q.Q5_0


def k_fallback(t, cols: int):
    """llama.cpp's fallback of a K-quant whose rows are not whole 256-blocks, then F16."""
    if t not in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K) or cols % 256 == 0:
        return t
    if cols % 32:
        return Q.F16
    return {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}.get(t) or low_fallback()


# llama.cpp's Q2_K and Q3_K_M for a layer's matrix of a dense LLaMA (not 70B), written out:
# (kind, layer, n_layer, n_head / n_head_kv) -> type before the fallback
LOW_MIXES = {
    "q2_k": lambda kind, layer, n_layer, gqa: {
        F.T_ATTN_V: Q.Q4_K if gqa >= 4 else Q.Q3_K, F.T_FFN_DOWN: Q.Q3_K, F.T_ATTN_OUTPUT: Q.Q3_K,
    }.get(kind, Q.Q2_K),
    "q3_k_m": lambda kind, layer, n_layer, gqa: {
        F.T_ATTN_V: Q.Q5_K if layer is not None and layer < 2 else Q.Q4_K,
        F.T_FFN_DOWN: Q.Q5_K if layer is not None and layer < n_layer // 16 else Q.Q4_K,
        F.T_ATTN_OUTPUT: Q.Q4_K,
    }.get(kind, Q.Q3_K),
}


def expected_type(kind: str, shape, outtype: str, layer=None, n_layer=0, tied=False, gqa=1):
    """The storage type of the small MODELS (rows of 32..128: a K-quant's rows always fall
    back; the _m mixes' rule itself is test_k_mix_types')."""
    from powerinfer_cpp.gguf_write import use_more_bits
    if len(shape) == 1:
        return Q.F32
    if outtype in LOW_MIXES:
        t = LOW_MIXES[outtype](kind, layer, n_layer, gqa)
        if kind == F.T_OUTPUT or (kind == F.T_TOKEN_EMBD and tied):
            t = Q.Q6_K
        return k_fallback(t, shape[-1])
    if outtype in ("iq4_nl", "iq4_xs"):
        # llama.cpp's IQ4 presets: the head Q6_K, ffn_down Q5_K in the first eighth (MODELS:
        # no attn_v rule, n_head / n_head_kv < 4); every row here falls back (K-quants to
        # 32-value blocks, IQ4_XS to IQ4_NL)
        if kind == F.T_OUTPUT or (kind == F.T_TOKEN_EMBD and tied):
            t = Q.Q6_K
        elif kind == F.T_FFN_DOWN and layer is not None and layer < n_layer // 8:
            t = Q.Q5_K
        else:
            t = Q.IQ4_NL if outtype == "iq4_nl" else Q.IQ4_XS
        if shape[-1] % {Q.Q6_K: 256, Q.Q5_K: 256, Q.IQ4_XS: 256}.get(t, 32):
            t = {Q.Q6_K: Q.Q8_0, Q.Q5_K: Q.Q5_1, Q.IQ4_XS: Q.IQ4_NL}.get(t, t)
        return t if shape[-1] % 32 == 0 else Q.F16
    if outtype in F.OUTTYPE_MIXES:
        more = layer is not None and use_more_bits(layer, n_layer)
        outtype = outtype[:-2]  # the base K-quant
        if kind == F.T_OUTPUT or (kind == F.T_TOKEN_EMBD and tied) or (
                kind in (F.T_ATTN_V, F.T_FFN_DOWN) and more):
            outtype = "q6_k"
        return expected_type(kind if kind != F.T_TOKEN_EMBD and kind != F.T_OUTPUT else "", shape, outtype)
    t = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
         "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, "q4_k_m": Q.Q4_K,
         "q5_k_m": Q.Q5_K}[outtype]
    if kind in (F.T_TOKEN_EMBD, F.T_OUTPUT):
        t = {Q.Q4_0: Q.Q8_0, Q.Q4_1: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.Q5_1: Q.Q8_0, Q.Q4_K: Q.Q6_K,
             Q.Q5_K: Q.Q6_K}.get(t, t)
    if t in (Q.Q4_K, Q.Q5_K, Q.Q6_K) and shape[-1] % 256:
        # llama.cpp's fallback
        t = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}[t] if shape[-1] % 32 == 0 else Q.F16
    elif t not in (Q.F32, Q.F16, Q.BF16) and shape[-1] % 32:
        t = Q.F16
    return t


HF_NAME = {
    F.T_TOKEN_EMBD: "model.embed_tokens.weight", F.T_OUTPUT_NORM: "model.norm.weight",
    F.T_OUTPUT: "lm_head.weight", F.T_ATTN_NORM: "model.layers.{}.input_layernorm.weight",
    F.T_ATTN_Q: "model.layers.{}.self_attn.q_proj.weight", F.T_ATTN_K: "model.layers.{}.self_attn.k_proj.weight",
    F.T_ATTN_V: "model.layers.{}.self_attn.v_proj.weight", F.T_ATTN_OUTPUT: "model.layers.{}.self_attn.o_proj.weight",
    F.T_FFN_NORM: "model.layers.{}.post_attention_layernorm.weight",
    F.T_FFN_GATE: "model.layers.{}.mlp.gate_proj.weight", F.T_FFN_UP: "model.layers.{}.mlp.up_proj.weight",
    F.T_FFN_DOWN: "model.layers.{}.mlp.down_proj.weight",
}


def assert_no_leftovers(d: Path, allowed=()):
    left = [p.name for p in Path(d).iterdir() if p.name not in allowed]
    assert left == [], left


# --------------------------------------------------------------------------
# successful conversions
# --------------------------------------------------------------------------

# bf16/q8_0 on the gelu/drelu models are left out: the other models cover those types,
# and the suite stays fast.
@pytest.mark.parametrize("name,outtype", [
    (name, outtype) for name in MODELS for outtype in F.OUTTYPES
    if not (outtype in ("bf16", "q8_0", *F.OUTTYPE_MIXES) and name in ("gelu_mistral", "drelu_spm"))])
def test_convert_outtypes(hf_dirs, tmp_path, name, outtype):
    kw = MODELS[name]
    d = hf_dirs[name]
    cfg = json.loads((d / "config.json").read_text())
    out = tmp_path / "out.gguf"
    assert convert(d, out, outtype, progress=False) == str(out)
    assert_no_leftovers(tmp_path, {"out.gguf"})
    r = gguf.GGUFReader(str(out))
    kv = fields(r)
    n_layer, n_embd, n_ff, n_head = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    n_kv, hd = cfg["num_key_value_heads"], cfg["head_dim"]
    A = lambda k: F.arch_key(k, F.ARCH_LLAMA)  # noqa: E731
    assert kv[F.KEY_GENERAL_ARCHITECTURE] == "llama"
    assert kv[F.KEY_GENERAL_NAME] == name
    assert kv[F.KEY_GENERAL_FILE_TYPE] == F.OUTTYPE_FILE_TYPE[outtype]
    assert kv[A(F.KEY_CONTEXT_LENGTH)] == cfg["max_position_embeddings"]
    assert kv[A(F.KEY_EMBEDDING_LENGTH)] == n_embd
    assert kv[A(F.KEY_BLOCK_COUNT)] == n_layer
    assert kv[A(F.KEY_FEED_FORWARD_LENGTH)] == n_ff
    assert kv[A(F.KEY_HEAD_COUNT)] == n_head
    assert kv[A(F.KEY_HEAD_COUNT_KV)] == n_kv
    assert kv[A(F.KEY_RMS_EPS)] == pytest.approx(cfg["rms_norm_eps"])
    assert kv[A(F.KEY_ROPE_FREQ_BASE)] == pytest.approx(10000.0)
    assert kv[A(F.KEY_ROPE_DIMENSION_COUNT)] == hd
    assert kv[A(F.KEY_VOCAB_SIZE)] == cfg["vocab_size"]
    if hd * n_head != n_embd:
        assert kv[A(F.KEY_KEY_LENGTH)] == hd and kv[A(F.KEY_VALUE_LENGTH)] == hd
    else:
        assert A(F.KEY_KEY_LENGTH) not in kv and A(F.KEY_VALUE_LENGTH) not in kv
    assert A(F.KEY_ROPE_SCALING_TYPE) not in kv
    assert kv[F.KEY_FORMAT_VERSION] == F.FORMAT_VERSION
    assert kv[F.KEY_FFN_ACTIVATION] == {"gelu": "gelu_erf"}.get(kw["act"], kw["act"])
    # tokenizer
    assert len(kv[F.KEY_TOKENIZER_TOKENS]) == cfg["vocab_size"] == len(kv[F.KEY_TOKENIZER_TOKEN_TYPE])
    assert kv[F.KEY_TOKENIZER_HF_JSON] == (d / "tokenizer.json").read_text(encoding="utf-8")
    assert kv[F.KEY_TOKENIZER_ADD_BOS] is True and kv[F.KEY_TOKENIZER_ADD_EOS] is False
    assert kv[F.KEY_TOKENIZER_CHAT_TEMPLATE].startswith("{% for m in messages %}")
    spm = kw.get("tokenizer") == "spm"
    assert kv[F.KEY_TOKENIZER_MODEL] == ("llama" if spm else "gpt2")
    assert kv[F.KEY_TOKENIZER_BOS_ID] == (1 if spm else 0)
    assert kv[F.KEY_TOKENIZER_EOS_ID] == (2 if spm else 1)
    if spm:
        assert len(kv[F.KEY_TOKENIZER_SCORES]) == cfg["vocab_size"]
        assert kv[F.KEY_TOKENIZER_UNK_ID] == 0 and kv[F.KEY_TOKENIZER_ADD_SPACE_PREFIX] is True
        types = kv[F.KEY_TOKENIZER_TOKEN_TYPE]
        assert types[0] == F.TOKEN_TYPE_UNKNOWN and types[1] == types[2] == F.TOKEN_TYPE_CONTROL
        assert all(t == F.TOKEN_TYPE_BYTE for t in types[3:259])
    else:
        assert len(kv[F.KEY_TOKENIZER_MERGES]) > 50
        assert kv[F.KEY_TOKENIZER_PAD_ID] == 2
        toks, types = kv[F.KEY_TOKENIZER_TOKENS], kv[F.KEY_TOKENIZER_TOKEN_TYPE]
        assert types[toks.index("<|im_start|>")] == F.TOKEN_TYPE_CONTROL
        assert types[toks.index("<custom_tok>")] == F.TOKEN_TYPE_USER_DEFINED
        assert toks[-1] == f"[PAD{cfg['vocab_size'] - 1}]" and types[-1] == F.TOKEN_TYPE_UNUSED

    # tensors
    tied = kw["tied"]
    ts = tensors(r)
    assert list(ts) == F.dense_tensor_names(n_layer, tied)
    ref = hf_weights(d)
    for tname, (ttype, shape, data) in ts.items():
        kind, layer, _ = F.parse_tensor_name(tname)
        w = ref[HF_NAME[kind].format(layer)]
        assert shape == w.shape, tname
        assert ttype == expected_type(kind, shape, outtype, layer, n_layer, tied, n_head // n_kv), tname
        if kind == F.T_ATTN_Q:
            data = unpermute_qk(data, n_head)
        elif kind == F.T_ATTN_K:
            data = unpermute_qk(data, n_kv)
        if ttype == Q.F32:
            np.testing.assert_array_equal(data, w, err_msg=tname)
        else:
            nmse = float(np.sum((data - w) ** 2) / np.sum(w ** 2))
            assert nmse <= NMSE_BOUND[ttype], (tname, ttype.name, nmse)


def np_forward(path, ids):
    """Reference LLaMA forward pass over a GGUF file, applying RoPE to
    adjacent pairs (2i, 2i+1) ("normal" RoPE, as the runtime does)."""
    r = gguf.GGUFReader(str(path))
    kv = fields(r)
    ts = {n: d for n, (_, _, d) in tensors(r).items()}
    A = lambda k: kv[F.arch_key(k, F.ARCH_LLAMA)]  # noqa: E731
    n_head, n_kv, n_layer = A(F.KEY_HEAD_COUNT), A(F.KEY_HEAD_COUNT_KV), A(F.KEY_BLOCK_COUNT)
    hd, eps, base = A(F.KEY_ROPE_DIMENSION_COUNT), A(F.KEY_RMS_EPS), A(F.KEY_ROPE_FREQ_BASE)
    act = kv[F.KEY_FFN_ACTIVATION]
    T = len(ids)
    x = ts["token_embd.weight"][ids].astype(np.float64)

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * w

    pos = np.arange(T)[:, None]
    ang = pos * base ** (-np.arange(0, hd, 2) / hd)[None, :]  # [T, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(v):  # v [T, H, hd]
        a, b = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for il in range(n_layer):
        W = lambda k: ts[F.tensor_name(k, il)]  # noqa: E731
        h = norm(x, W(F.T_ATTN_NORM))
        q = rope((h @ W(F.T_ATTN_Q).T).reshape(T, n_head, hd))
        k = rope((h @ W(F.T_ATTN_K).T).reshape(T, n_kv, hd))
        v = (h @ W(F.T_ATTN_V).T).reshape(T, n_kv, hd)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", p, v).reshape(T, n_head * hd)
        x = x + o @ W(F.T_ATTN_OUTPUT).T
        h = norm(x, W(F.T_FFN_NORM))
        g, u = h @ W(F.T_FFN_GATE).T, h @ W(F.T_FFN_UP).T
        if act == "relu":
            a = np.maximum(g, 0) * u
        elif act == "drelu":
            a = np.maximum(g, 0) * np.maximum(u, 0)
        else:
            a = g / (1 + np.exp(-g)) * u
        x = x + a @ W(F.T_FFN_DOWN).T
    x = norm(x, ts["output_norm.weight"])
    out = ts.get("output.weight", ts["token_embd.weight"])
    return x @ out.T


@pytest.mark.parametrize("name", ["relu_tied", "silu_untied", "drelu_spm"])
def test_permuted_qk_normal_rope_matches_hf_logits(hf_dirs, tmp_path, name):
    """The q/k row permutation makes adjacent-pair RoPE equal HF's rotate_half."""
    from transformers import AutoModelForCausalLM
    d = hf_dirs[name]
    out = convert(d, tmp_path / "m.gguf", "f32", progress=False)
    ids = [1, 5, 77, 200, 3, 9, 120, 42, 300, 7, 11]
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    if MODELS[name]["act"] == "drelu":
        patch_drelu(model)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double().numpy()
    got = np_forward(out, ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


# A model whose rows are whole K-blocks, 8 layers, GQA, untied head: llama.cpp's use_more_bits
# layers of 8 are 0 and 7 (the first and last eighth) and 3, 6 (every third between).
MIX_MODEL = dict(act="silu", tied=False, n_layer=8, d=256, n_head=4, n_head_kv=2, n_ff=512, seed=5)
MORE_BITS_OF_8 = {0, 3, 6, 7}
# nmse of Gaussian-ish weights per K-quant (tests/ops/test_types_matmul.py: nrmse 0.0715, 0.0362, 0.0178)
K_NMSE = {Q.Q4_K: 8e-3, Q.Q5_K: 2e-3, Q.Q6_K: 5e-4}
# Q2_K / Q3_K: nrmse 0.2745 / 0.1450 there (nmse 0.075 / 0.021)
K_NMSE.update({Q.Q2_K: 0.09, Q.Q3_K: 0.025})


@pytest.fixture(scope="module")
def mix_dir(tmp_path_factory):
    return make_llama_model(tmp_path_factory.mktemp("mix") / "m", **MIX_MODEL)


@pytest.mark.parametrize("outtype,base", [("q4_k_m", Q.Q4_K), ("q5_k_m", Q.Q5_K)])
def test_k_mix_types(mix_dir, tmp_path, outtype, base):
    """q4_k_m / q5_k_m store each tensor as llama.cpp's mix does (written out here, not taken
    from the converter): the head Q6_K, attn_v and ffn_down Q6_K in the use_more_bits layers,
    every other matrix (the untied embedding too) the base K-quant; gguf's reader reads the
    file, its values are the HF weights within each type's error, and the runtime computes
    what the file's own (dequantized) weights give."""
    from powerinfer_cpp import Model

    out = convert(mix_dir, tmp_path / "m.gguf", outtype, progress=False)
    r = gguf.GGUFReader(str(out))
    assert fields(r)[F.KEY_GENERAL_FILE_TYPE] == {"q4_k_m": 15, "q5_k_m": 17}[outtype]
    ts = tensors(r)
    ref = hf_weights(mix_dir)
    for tname, (ttype, shape, data) in ts.items():
        kind, layer, _ = F.parse_tensor_name(tname)
        if len(shape) == 1:
            want = Q.F32
        elif kind == F.T_OUTPUT or (kind in (F.T_ATTN_V, F.T_FFN_DOWN) and layer in MORE_BITS_OF_8):
            want = Q.Q6_K
        else:
            want = base
        assert ttype == want, (tname, ttype.name, want.name)
        if len(shape) == 2 and kind not in (F.T_ATTN_Q, F.T_ATTN_K):  # q/k: permuted rows
            w = ref[HF_NAME[kind].format(layer)]
            nmse = float(np.sum((data - w) ** 2) / np.sum(w ** 2))
            assert nmse <= K_NMSE[ttype], (tname, ttype.name, nmse)
    counts = {}
    for ttype, _, _ in ts.values():
        counts[ttype] = counts.get(ttype, 0) + 1
    assert counts == {Q.F32: 17, base: 8 * 7 - 8 + 1, Q.Q6_K: 9}, counts
    from powerinfer_cpp.inspect import describe
    text = describe(out)
    assert f"file type: {fields(r)[F.KEY_GENERAL_FILE_TYPE]} (MOSTLY_{outtype.upper()})" in text
    assert f"{base.name} x49" in text and "Q6_K x9" in text and "F32 x17" in text
    ids = [1, 5, 77, 200, 3, 9, 120, 42, 300, 7, 11]
    want = np_forward(out, ids)
    with Model(out, n_ctx=32, n_threads=2, cache_type="f32") as model:
        got = model.eval(ids, logits_all=True).astype(np.float64)
    nrmse = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    # the activations' quantization (Q8_K / Q8_0 per block) on this random model: measured
    # q4_k_m 1.8e-2, q5_k_m 1.7e-2 (a q4_k file 1.7e-2, q6_k 1.6e-2, q8_0 1.2e-2)
    print(f"{outtype}: runtime vs the file's weights nrmse {nrmse:.3g}")
    assert nrmse < 3e-2, nrmse


@pytest.mark.parametrize("outtype", ["q2_k", "q3_k_m"])
def test_low_k_mix_types(mix_dir, tmp_path, outtype):
    """q2_k / q3_k_m store each tensor as llama.cpp's Q2_K / Q3_K_M do (LOW_MIXES; the head
    Q6_K, the untied embedding the base type), the values within each type's error, the
    runtime as the file's own weights."""
    from powerinfer_cpp import Model

    out = convert(mix_dir, tmp_path / "m.gguf", outtype, progress=False)
    r = gguf.GGUFReader(str(out))
    assert fields(r)[F.KEY_GENERAL_FILE_TYPE] == {"q2_k": 10, "q3_k_m": 12}[outtype]
    ref = hf_weights(mix_dir)
    gqa = MIX_MODEL["n_head"] // MIX_MODEL["n_head_kv"]
    counts = {}
    for tname, (ttype, shape, data) in tensors(r).items():
        kind, layer, _ = F.parse_tensor_name(tname)
        assert ttype == expected_type(kind, shape, outtype, layer, MIX_MODEL["n_layer"], False, gqa), tname
        counts[ttype.name] = counts.get(ttype.name, 0) + 1
        if len(shape) == 2 and kind not in (F.T_ATTN_Q, F.T_ATTN_K):
            w = ref[HF_NAME[kind].format(layer)]
            nmse = float(np.sum((data - w) ** 2) / np.sum(w ** 2))
            assert nmse <= K_NMSE[ttype], (tname, ttype.name, nmse)
    # 8 layers, n_head / n_head_kv = 2: Q2_K's attn_v, ffn_down, attn_output Q3_K; Q3_K_M's
    # attn_v Q5_K in layers 0, 1, else Q4_K, ffn_down and attn_output Q4_K
    assert counts == ({"F32": 17, "Q2_K": 1 + 8 * 4, "Q3_K": 8 * 3, "Q6_K": 1} if outtype == "q2_k" else
                      {"F32": 17, "Q3_K": 1 + 8 * 4, "Q5_K": 2, "Q4_K": 6 + 8 * 2, "Q6_K": 1}), counts
    from powerinfer_cpp.inspect import describe
    assert f"(MOSTLY_{outtype.upper()})" in describe(out)
    ids = [1, 5, 77, 200, 3, 9, 120, 42, 300, 7, 11]
    want = np_forward(out, ids)
    with Model(out, n_ctx=32, n_threads=2, cache_type="f32") as model:
        got = model.eval(ids, logits_all=True).astype(np.float64)
    nrmse = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    print(f"{outtype}: runtime vs the file's weights nrmse {nrmse:.3g}")
    assert nrmse < 3e-2, nrmse


@pytest.mark.parametrize("outtype,base", [("iq4_nl", Q.IQ4_NL), ("iq4_xs", Q.IQ4_XS)])
def test_iq4_mix_types(mix_dir, tmp_path, outtype, base):
    """iq4_nl / iq4_xs on a model of whole 256-blocks: the head Q6_K, ffn_down of layer 0
    (the first eighth of 8) Q5_K, every other matrix (the untied embedding and attn_v:
    n_head / n_head_kv = 2) the base type; the values within the types' error, and the
    runtime computes what the file's own weights give."""
    from powerinfer_cpp import Model

    out = convert(mix_dir, tmp_path / "m.gguf", outtype, progress=False)
    r = gguf.GGUFReader(str(out))
    assert fields(r)[F.KEY_GENERAL_FILE_TYPE] == {"iq4_nl": 25, "iq4_xs": 30}[outtype]
    ts = tensors(r)
    ref = hf_weights(mix_dir)
    nmse_bound = {Q.Q6_K: 5e-4, Q.Q5_K: 2e-3, base: 7e-3}  # IQ4 nrmse 0.074 on Gaussian rows
    for tname, (ttype, shape, data) in ts.items():
        kind, layer, _ = F.parse_tensor_name(tname)
        want = (Q.F32 if len(shape) == 1 else Q.Q6_K if kind == F.T_OUTPUT
                else Q.Q5_K if kind == F.T_FFN_DOWN and layer == 0 else base)
        assert ttype == want, (tname, ttype.name, want.name)
        if len(shape) == 2 and kind not in (F.T_ATTN_Q, F.T_ATTN_K):
            w = ref[HF_NAME[kind].format(layer)]
            nmse = float(np.sum((data - w) ** 2) / np.sum(w ** 2))
            assert nmse <= nmse_bound[ttype], (tname, ttype.name, nmse)
    ids = [1, 5, 77, 200, 3, 9, 120, 42, 300, 7, 11]
    want = np_forward(out, ids)
    with Model(out, n_ctx=32, n_threads=2, cache_type="f32") as model:
        got = model.eval(ids, logits_all=True).astype(np.float64)
    nrmse = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    print(f"{outtype}: runtime vs the file's weights nrmse {nrmse:.3g}")
    assert nrmse < 3e-2, nrmse


def test_moe_mix_rule():
    """The mixes' choices for a mixture of experts, from llama.cpp's quantizer: a stacked
    expert or shared-expert down projection (its name holds "ffn_down") takes ffn_down's rule
    by the layer in its name over all n_layer (q4_k_m / q5_k_m Q6_K where use_more_bits,
    iq4 Q5_K in the first eighth, q3_k_m Q5_K in the first sixteenth); with 8 experts attn_v
    and attn_k Q8_0, attn_output Q5_K in q2_k, q3_k_m, q4_k_m, iq4_nl and iq4_xs."""
    from powerinfer_cpp.gguf_write import QuantMix, storage_type, use_more_bits

    moe = QuantMix(arch=F.ARCH_QWEN3MOE, n_layer=32, n_head=32, n_head_kv=4, n_expert=128)
    shape = (128, 2048, 768)  # [n_expert, n_embd, n_ff_exp]: Qwen3-30B-A3B's ffn_down_exps
    more = [i for i in range(32) if use_more_bits(i, 32)]
    for kind in (F.T_FFN_DOWN_EXPS, F.T_FFN_DOWN_SHEXP):
        assert [storage_type(kind, shape, "q4_k_m", i, moe)[0] for i in range(32)] == [
            Q.Q6_K if i in more else Q.Q4_K for i in range(32)]
        assert storage_type(kind, shape, "q5_k_m", 5, moe)[0] == Q.Q5_K
        assert [storage_type(kind, shape, "iq4_xs", i, moe)[0] for i in (3, 4)] == [Q.Q5_K, Q.IQ4_XS]
        assert [storage_type(kind, shape, "q3_k_m", i, moe)[0] for i in (1, 2)] == [Q.Q5_K, Q.Q4_K]
    for kind in (F.T_FFN_GATE_EXPS, F.T_FFN_UP_EXPS):  # no rule of their own: the preset's type
        assert storage_type(kind, (128, 768, 2048), "q4_k_m", 0, moe)[0] == Q.Q4_K
    assert storage_type(F.T_FFN_GATE_INP, (128, 2048), "q4_k_m", 0, moe)[0] == Q.F32
    assert storage_type(F.T_ATTN_V, (512, 2048), "q4_k_m", 4, moe)[0] == Q.Q4_K  # 128 experts: no bump
    mixtral = QuantMix(arch=F.ARCH_LLAMA, n_layer=32, n_head=32, n_head_kv=8, n_expert=8)
    for ot in ("q4_k_m", "q5_k_m", "q2_k", "q3_k_m", "iq4_nl", "iq4_xs"):
        assert storage_type(F.T_ATTN_V, (1024, 4096), ot, 4, mixtral)[0] == Q.Q8_0, ot
        assert storage_type(F.T_ATTN_K, (1024, 4096), ot, 4, mixtral)[0] == Q.Q8_0, ot
        # Q5_K by the 8-expert rule, or (q5_k_m) as its base type
        assert storage_type(F.T_ATTN_OUTPUT, (4096, 4096), ot, 4, mixtral)[0] == Q.Q5_K, ot
    assert storage_type(F.T_ATTN_OUTPUT, (4096, 4096), "q2_k", 4, mixtral)[0] == Q.Q5_K  # not Q3_K
    assert storage_type(F.T_ATTN_Q, (4096, 4096), "q4_k_m", 4, mixtral)[0] == Q.Q4_K
    assert storage_type(F.T_ATTN_K, (1024, 4096), "q4_0", 4, mixtral)[0] == Q.Q4_0  # not a preset mix


def test_k_mix_rule():
    """The mixes' other cases, from the rule as llama.cpp states it: Falcon's head Q8_0 and
    its q4_k_m ffn_down (Q6_K in the first sixteenth, Q5_K where use_more_bits), a fused
    attn_qkv one step up, a tied embedding as the head, the 70B LLaMA's attn_v, and rows
    that are not whole K-blocks (llama.cpp's Q5_0 / Q5_1 / Q8_0, then F16)."""
    from powerinfer_cpp.gguf_write import QuantMix, storage_type, use_more_bits

    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                              28, 29, 30, 31]
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]
    falcon = QuantMix(arch=F.ARCH_FALCON, n_layer=32, tied=True, n_head=64, n_head_kv=8)
    st = lambda kind, layer, ot, mix, shape=(512, 256): storage_type(kind, shape, ot, layer, mix)[0]  # noqa: E731
    assert st(F.T_TOKEN_EMBD, None, "q4_k_m", falcon) == Q.Q8_0
    assert [st(F.T_FFN_DOWN, i, "q4_k_m", falcon) for i in (0, 1, 2, 5, 6, 31)] == [
        Q.Q6_K, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q5_K, Q.Q5_K]
    assert [st(F.T_FFN_DOWN, i, "q5_k_m", falcon) for i in (0, 2, 5)] == [Q.Q6_K, Q.Q6_K, Q.Q5_K]
    assert st(F.T_ATTN_QKV, 5, "q4_k_m", falcon) == Q.Q5_K and st(F.T_ATTN_QKV, 5, "q5_k_m", falcon) == Q.Q6_K
    assert st(F.T_ATTN_OUTPUT, 0, "q4_k_m", falcon) == Q.Q4_K and st(F.T_FFN_UP, 0, "q5_k_m", falcon) == Q.Q5_K
    llama = QuantMix(arch=F.ARCH_LLAMA, n_layer=32, tied=True, n_head=32, n_head_kv=8)
    assert st(F.T_TOKEN_EMBD, None, "q4_k_m", llama) == Q.Q6_K
    assert st(F.T_TOKEN_EMBD, None, "q4_k_m", QuantMix(n_layer=32)) == Q.Q4_K  # untied: an ordinary matrix
    assert [st(F.T_ATTN_V, i, "q4_k_m", llama) for i in (3, 4, 6)] == [Q.Q6_K, Q.Q4_K, Q.Q6_K]
    l70 = QuantMix(arch=F.ARCH_LLAMA, n_layer=80, n_head=64, n_head_kv=8)
    assert [st(F.T_ATTN_V, i, "q4_k_m", l70) for i in (0, 11)] == [Q.Q6_K, Q.Q5_K]
    assert st(F.T_ATTN_V, 11, "q5_k_m", l70) == Q.Q5_K
    assert st(F.T_ATTN_V, 11, "q4_k_m", QuantMix(n_layer=80, n_head=64, n_head_kv=64)) == Q.Q4_K  # 65B: MHA
    assert st(F.T_FFN_DOWN, 3, "q4_k_m", llama, (256, 11008)) == Q.Q6_K  # 11008 = 43 blocks of 256
    assert storage_type(F.T_FFN_DOWN, (256, 1000), "q4_k_m", 3, llama) == (
        Q.F16, "row length 1000 is not a multiple of 256: stored as F16, not Q6_K")
    assert storage_type(F.T_FFN_DOWN, (256, 800), "q4_k_m", 4, llama)[0] == Q.Q5_0
    assert storage_type(F.T_FFN_UP, (800, 800), "q5_k_m", 4, llama)[0] == Q.Q5_1
    assert storage_type(F.T_OUTPUT, (384, 64), "q6_k")[0] == Q.Q8_0
    assert st(F.T_ATTN_NORM, 0, "q4_k_m", llama, (256,)) == Q.F32

    # Q2_K and Q3_K_M (llama.cpp's MOSTLY_Q2_K, MOSTLY_Q3_K_M)
    assert st(F.T_OUTPUT, None, "q2_k", QuantMix(n_layer=32)) == Q.Q6_K
    assert st(F.T_TOKEN_EMBD, None, "q3_k_m", falcon) == Q.Q8_0
    assert st(F.T_TOKEN_EMBD, None, "q2_k", QuantMix(n_layer=32)) == Q.Q2_K  # untied
    assert st(F.T_ATTN_V, 5, "q2_k", llama) == Q.Q4_K  # 32 / 8 heads: n_gqa 4
    assert st(F.T_ATTN_V, 5, "q2_k", QuantMix(n_layer=32, n_head=32, n_head_kv=16)) == Q.Q3_K
    assert [st(F.T_ATTN_V, i, "q3_k_m", llama) for i in (0, 1, 2, 31)] == [Q.Q5_K, Q.Q5_K, Q.Q4_K, Q.Q4_K]
    assert st(F.T_ATTN_V, 11, "q3_k_m", l70) == Q.Q5_K and st(F.T_ATTN_V, 11, "q2_k", l70) == Q.Q5_K
    assert [st(F.T_FFN_DOWN, i, "q2_k", llama) for i in (0, 5)] == [Q.Q3_K, Q.Q3_K]
    assert [st(F.T_FFN_DOWN, i, "q3_k_m", llama) for i in (0, 1, 2, 5)] == [Q.Q5_K, Q.Q5_K, Q.Q4_K, Q.Q4_K]
    assert [st(F.T_FFN_DOWN, i, "q3_k_m", falcon) for i in (1, 2, 4, 6)] == [Q.Q5_K, Q.Q4_K, Q.Q3_K, Q.Q4_K]
    assert st(F.T_ATTN_OUTPUT, 3, "q2_k", llama) == Q.Q3_K and st(F.T_ATTN_OUTPUT, 3, "q3_k_m", llama) == Q.Q4_K
    assert st(F.T_ATTN_OUTPUT, 3, "q2_k", falcon) == Q.Q2_K and st(F.T_ATTN_OUTPUT, 3, "q3_k_m", falcon) == Q.Q3_K
    assert st(F.T_ATTN_QKV, 3, "q3_k_m", falcon) == Q.Q4_K and st(F.T_ATTN_QKV, 3, "q2_k", falcon) == Q.Q2_K
    assert [st(kind, 3, "q2_k", llama) for kind in (F.T_ATTN_Q, F.T_ATTN_K, F.T_FFN_GATE, F.T_FFN_UP)] == [Q.Q2_K] * 4
    assert [st(kind, 3, "q3_k_m", llama) for kind in (F.T_ATTN_Q, F.T_FFN_UP)] == [Q.Q3_K] * 2
    # rows that are not whole 256-blocks: IQ4_NL when the runtime reads it, else Q5_0; then F16
    assert storage_type(F.T_FFN_UP, (800, 800), "q2_k", 4, llama)[0] == low_fallback()
    assert storage_type(F.T_ATTN_Q, (800, 800), "q3_k_m", 4, llama)[0] == low_fallback()
    assert storage_type(F.T_FFN_DOWN, (800, 800), "q3_k_m", 4, llama)[0] == Q.Q5_0  # Q4_K's
    assert storage_type(F.T_FFN_UP, (256, 1000), "q2_k", 4, llama)[0] == Q.F16


def test_iq4_mix_rule():
    """llama.cpp's IQ4_NL / IQ4_XS presets (no importance matrix): the head and a tied
    embedding Q6_K (Falcon's Q8_0), an untied embedding the base type, attn_v Q5_K with
    grouped-query attention of 4 or more heads per KV head, ffn_down Q5_K in the first
    eighth of the layers; IQ4_XS rows that are not whole 256-blocks IQ4_NL, the Q5_K ones
    Q5_1, then F16."""
    from powerinfer_cpp.gguf_write import QuantMix, storage_type

    gqa = QuantMix(arch=F.ARCH_LLAMA, n_layer=32, tied=False, n_head=32, n_head_kv=8)
    mha = QuantMix(arch=F.ARCH_LLAMA, n_layer=32, tied=True, n_head=32, n_head_kv=32)
    for ot, base in (("iq4_nl", Q.IQ4_NL), ("iq4_xs", Q.IQ4_XS)):
        st = lambda kind, layer, mix, shape=(512, 256): storage_type(kind, shape, ot, layer, mix)[0]  # noqa: E731
        assert st(F.T_OUTPUT, None, gqa) == Q.Q6_K and st(F.T_TOKEN_EMBD, None, mha) == Q.Q6_K
        assert st(F.T_TOKEN_EMBD, None, gqa) == base
        assert st(F.T_OUTPUT, None, QuantMix(arch=F.ARCH_FALCON, n_layer=32)) == Q.Q8_0
        assert [st(F.T_ATTN_V, i, gqa) for i in (0, 17)] == [Q.Q5_K, Q.Q5_K]
        assert st(F.T_ATTN_V, 0, mha) == base
        assert [st(F.T_FFN_DOWN, i, gqa) for i in (0, 3, 4, 31)] == [Q.Q5_K, Q.Q5_K, base, base]
        assert [st(k, 5, gqa) for k in (F.T_ATTN_Q, F.T_ATTN_K, F.T_ATTN_OUTPUT, F.T_FFN_UP)] == [base] * 4
        assert st(F.T_FFN_DOWN, 0, gqa, (256, 800)) == Q.Q5_1
        assert st(F.T_FFN_UP, 5, gqa, (800, 800)) == Q.IQ4_NL
        assert storage_type(F.T_FFN_UP, (256, 1000), ot, 5, gqa) == (
            Q.F16, f"row length 1000 is not a multiple of {32 if ot == 'iq4_nl' else 256}: stored as F16, "
                   f"not {'IQ4_NL' if ot == 'iq4_nl' else 'IQ4_XS'}")
    assert F.OUTTYPE_FILE_TYPE["iq4_nl"] == 25 and F.OUTTYPE_FILE_TYPE["iq4_xs"] == 30


def test_rope_linear_scaling_keys(hf_dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(hf_dirs["relu_tied"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    kv = fields(gguf.GGUFReader(convert(d, tmp_path / "o.gguf", "f16", progress=False)))
    assert kv["llama.rope.scaling.type"] == "linear"
    assert kv["llama.rope.scaling.factor"] == pytest.approx(4.0)
    assert kv["llama.rope.freq_base"] == pytest.approx(50000.0)


@pytest.mark.parametrize("cfg_patch,act", [
    ({"hidden_act": "drelu"}, "drelu"),
    ({"hidden_act": "relu", "use_drelu": True}, "drelu"),
    ({"hidden_act": "swish"}, "silu"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "gelu"),
    ({"hidden_act": "gelu_new"}, "gelu"),
    ({"hidden_act": "gelu"}, "gelu_erf"),
])
def test_activation_key(hf_dirs, tmp_path, cfg_patch, act):
    d = tmp_path / "m"
    shutil.copytree(hf_dirs["relu_tied"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(cfg_patch)
    (d / "config.json").write_text(json.dumps(cfg))
    kv = fields(gguf.GGUFReader(convert(d, tmp_path / "o.gguf", "f32", progress=False)))
    assert kv[F.KEY_FFN_ACTIVATION] == act
    assert kv[F.KEY_HF_HIDDEN_ACT] == cfg["hidden_act"]


def test_pytorch_bin_weights(hf_dirs, tmp_path):
    from safetensors.torch import load_file
    d = tmp_path / "m"
    shutil.copytree(hf_dirs["silu_untied"], d)
    sd = load_file(str(d / "model.safetensors"))
    torch.save(sd, d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    a = convert(d, tmp_path / "bin.gguf", "f32", progress=False)
    b = convert(hf_dirs["silu_untied"], tmp_path / "st.gguf", "f32", progress=False)
    ta, tb = tensors(gguf.GGUFReader(a)), tensors(gguf.GGUFReader(b))
    assert list(ta) == list(tb)
    for k in ta:
        np.testing.assert_array_equal(ta[k][2], tb[k][2])


def test_pytorch_bin_without_torch(hf_dirs, tmp_path, monkeypatch):
    d = tmp_path / "m"
    shutil.copytree(hf_dirs["relu_tied"], d)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "torch", None)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConvertError, match="torch is not installed.*safetensors"):
        convert(d, out_dir / "o.gguf", "f16", progress=False)
    assert_no_leftovers(out_dir)


def test_streaming_peak_memory(tmp_path):
    """Tensors are converted one at a time: traced peak allocation stays well
    below the model size."""
    import tracemalloc
    d = make_llama_model(tmp_path / "big", act="relu", tied=False, n_layer=4, d=256, n_head=4,
                      n_head_kv=4, n_ff=1024, vocab=1024)
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    tracemalloc.start()
    try:
        convert(d, tmp_path / "o.gguf", "q8_0", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 15e6
    assert peak < 0.35 * size, (peak, size)


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------

def _copy(hf_dirs, tmp_path, name="relu_tied") -> Path:
    d = tmp_path / "m"
    shutil.copytree(hf_dirs[name], d)
    return d


def _patch_cfg(d, **upd):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in upd.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(d, fn):
    from safetensors.numpy import save_file
    w = {k: np.ascontiguousarray(v) for k, v in hf_weights(d).items()}
    fn(w)
    save_file(w, str(d / "model.safetensors"))


BAD_CASES = {
    "missing_dir": (lambda d: shutil.rmtree(d), "model folder not found"),
    "missing_config": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "bad_json": (lambda d: (d / "config.json").write_text("{not json"), "cannot read"),
    "unsupported_arch": (lambda d: _patch_cfg(d, architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    "shape_mismatch": (lambda d: _patch_cfg(d, intermediate_size=64), "shape mismatch: model.layers.0.mlp.gate_proj.weight"),
    "vocab_mismatch": (lambda d: _patch_cfg(d, vocab_size=500), "shape mismatch: model.embed_tokens.weight"),
    "attention_bias": (lambda d: _patch_cfg(d, attention_bias=True), "attention_bias"),
    "mlp_bias": (lambda d: _patch_cfg(d, mlp_bias=True), "mlp_bias"),
    "rope_yarn": (lambda d: _patch_cfg(d, rope_parameters={"rope_type": "yarn", "factor": 2.0}), "unsupported rope scaling 'yarn'"),
    "bad_act": (lambda d: _patch_cfg(d, hidden_act="tanh"), "unsupported hidden_act"),
    "drelu_with_silu": (lambda d: _patch_cfg(d, hidden_act="silu", use_drelu=True), "use_drelu"),
    "bad_heads": (lambda d: _patch_cfg(d, num_key_value_heads=3), "num_key_value_heads"),
    "untied_no_lm_head": (lambda d: _patch_cfg(d, tie_word_embeddings=False), "no lm_head"),
    "missing_tensor": (lambda d: _rewrite_weights(d, lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
                       "missing tensors: model.layers.1.mlp.up_proj.weight"),
    "unexpected_tensor": (lambda d: _rewrite_weights(d, lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})),
                          "unexpected tensors"),
    "truncated": (lambda d: os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size - 100), "truncated"),
    "tiny_file": (lambda d: (d / "model.safetensors").write_bytes(b"\x01\x02"), "truncated"),
    "huge_header": (lambda d: (d / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}"), "header length"),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), "no weights"),
    "no_tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input(hf_dirs, tmp_path, case):
    d = _copy(hf_dirs, tmp_path)
    mutate, msg = BAD_CASES[case]
    mutate(d)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConvertError) as ei:
        convert(d, out_dir / "o.gguf", "q4_0", progress=False)
    assert msg in str(ei.value)
    assert_no_leftovers(out_dir)


def test_unknown_outtype(hf_dirs, tmp_path):
    with pytest.raises(ConvertError, match="unknown outtype 'q7_0'"):
        convert(hf_dirs["relu_tied"], tmp_path / "o.gguf", "q7_0", progress=False)
    assert_no_leftovers(tmp_path)


def test_missing_output_folder(hf_dirs, tmp_path):
    with pytest.raises(ConvertError, match="does not exist"):
        convert(hf_dirs["relu_tied"], tmp_path / "nope" / "o.gguf", "f16", progress=False)


def test_failure_while_writing_leaves_nothing(hf_dirs, tmp_path, monkeypatch):
    import powerinfer_cpp.gguf_write as W
    real, calls = W.encode_job, []

    def flaky(job):
        calls.append(job.name)
        if len(calls) == 5:
            raise RuntimeError("simulated failure")
        return real(job)

    monkeypatch.setattr(W, "encode_job", flaky)
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")  # an existing output is left untouched on failure
    with pytest.raises(RuntimeError, match="simulated"):
        convert(hf_dirs["relu_tied"], out, "f16", progress=False)
    assert out.read_bytes() == b"old"
    assert_no_leftovers(tmp_path, {"o.gguf"})


def test_cli(hf_dirs, tmp_path):
    from powerinfer_cpp._native import lib_path  # the child uses the library this process loaded
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), GH_LIBRARY=str(lib_path))
    out = tmp_path / "cli.gguf"
    p = subprocess.run([sys.executable, "-m", "powerinfer_cpp.convert", str(hf_dirs["relu_tied"]), "-o", str(out),
                        "--outtype", "q8_0", "-q", "--dense"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert fields(gguf.GGUFReader(str(out)))[F.KEY_GENERAL_FILE_TYPE] == F.FILE_TYPE_MOSTLY_Q8_0
    p = subprocess.run([sys.executable, "-m", "powerinfer_cpp.convert", str(tmp_path / "nope"), "-o", str(tmp_path / "x.gguf")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.startswith("error: model folder not found")
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "x.gguf").exists()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_scratch_is_removed_and_others_kept(tmp_path):
    """Scratch of a killed conversion goes at the next conversion into that folder; scratch
    of a running one and unrelated hidden files stay."""
    dead, live = _dead_pid(), os.getpid()
    stale_dir = tmp_path / f".m.gguf.sparse-{dead}-abcd1234"
    stale_dir.mkdir()
    (stale_dir / "dense.gguf").write_bytes(b"x" * 1000)
    stale_file = tmp_path / f".other.gguf.{dead}-k2j4h6_8.tmp"
    stale_file.write_bytes(b"GGUF")
    running = tmp_path / f".m.gguf.sparse-{live}-zzzz9999"
    running.mkdir()
    unrelated = [tmp_path / ".config.2024-backup", tmp_path / f".notes.{dead}-abc.tmp"]
    for u in unrelated:
        u.write_text("keep")
    out = convert(REPO / "models" / "tiny-relu-kjv", tmp_path / "m.gguf", outtype="f32",
                  progress=False)
    assert Path(out).is_file()
    assert not stale_dir.exists() and not stale_file.exists()
    assert running.is_dir() and all(u.exists() for u in unrelated)
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.gguf.")]
    assert left == [running.name]


def test_sigkilled_sparse_convert_leaves_nothing_after_the_next_run(tmp_path):
    import signal
    import time

    out = tmp_path / "k.gguf"
    cmd = [sys.executable, "-m", "powerinfer_cpp.convert", str(REPO / "models" / "tiny-relu-kjv"),
           "-o", str(out), "--outtype", "f32", "--sparse"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        scratch = []
        while time.monotonic() < deadline and proc.poll() is None:
            scratch = [p for p in tmp_path.iterdir() if p.name.startswith(".k.gguf.sparse-")
                       and (p / "dense.gguf").exists()]
            if scratch:
                break
            time.sleep(0.05)
        assert scratch, "the sparse convert never made its scratch folder"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert scratch[0].exists()  # SIGKILL cannot clean up
    res = subprocess.run(cmd[:-1] + ["--dense"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "left by a conversion that was killed" in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["k.gguf"]
