"""Training-free gate-magnitude sparsity (convert --sparsity, the "gate" FFN mode) on a
SwiGLU model, against transformers with the same activation mask as the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_models import make_llama_model  # noqa: E402

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import ConvertError, convert, main  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402
from powerinfer_cpp.sparse.thresholds import activation  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "models" / "tiny-relu-kjv" / "heldout.txt"
SPARSITY = 0.5


def _opts(sparsity):
    return SparseOptions(calib=str(HELDOUT), calib_tokens=1024, profile_ctx=128, sparsity=sparsity)


@pytest.fixture(scope="module")
def swiglu(tmp_path_factory):
    d = tmp_path_factory.mktemp("gate")
    hf = make_llama_model(d / "hf", act="silu", tied=False, seed=4, n_layer=2, d=64, n_ff=192,
                       n_ctx=256)
    rep: list = []
    path = convert(hf, d / "gate.gguf", "f32", progress=False, sparse=True,
                   sparse_options=_opts(SPARSITY), report=rep)
    return hf, Path(path), rep[0], d


def _thresholds(path) -> list[float]:
    r = gguf.GGUFReader(str(path))
    f = r.fields[F.KEY_SPARSE_GATE_THRESHOLD]
    return [float(f.parts[i][0]) for i in f.data]


def test_file_and_default_mode(swiglu):
    _, path, rep, _ = swiglu
    r = gguf.GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_down_t.weight" in names and "blk.0.ffn_down.weight" not in names
    assert not any(".fc1." in n or ".fc2." in n for n in names)  # no predictor needed
    assert F.KEY_SPARSE_THRESHOLD not in r.fields
    assert float(r.fields[F.KEY_SPARSE_TARGET].parts[-1][0]) == pytest.approx(SPARSITY)
    thr = _thresholds(path)
    assert len(thr) == 2 and all(t > 0 for t in thr)
    assert thr == pytest.approx(rep.gate_thresholds, rel=1e-6)
    # the calibration's own share of neurons above the threshold is the target's complement
    assert rep.gate_density == pytest.approx([1 - SPARSITY] * 2, abs=0.02)
    with Model(path, n_ctx=64) as m:
        assert m.info.has_gate_threshold and m.info.has_predictor == 0
        assert m.context.ffn_mode == "gate"


def test_gate_mode_matches_masked_transformers(swiglu):
    """Decode token by token in the gate mode = transformers whose MLP activation is
    zeroed where |silu(gate)| <= the layer's threshold."""
    hf, path, _, _ = swiglu
    thr = _thresholds(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    ref.eval()
    class MaskedSiLU(torch.nn.Module):
        def __init__(self, t):
            super().__init__()
            self.t = t

        def forward(self, g):
            a = torch.nn.functional.silu(g)
            return a * (a.abs() > self.t)

    for layer, t in zip(ref.model.layers, thr):
        layer.mlp.act_fn = MaskedSiLU(t)
    rng = np.random.default_rng(1)
    ids = [int(v) for v in rng.integers(3, 380, size=48)]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].double().numpy()
    with Model(path, n_ctx=64, n_threads=2, cache_type="f32") as m:  # the FFN's error only
        ctx = m.context
        ctx.reset_stats()
        got = np.stack([ctx.eval([t]) for t in ids]).astype(np.float64)
        st = ctx.stats()
    assert st["n_sparse_tokens"] == len(ids)
    assert 0.3 < st["density"] < 0.7, st["density"]
    err = np.abs(got - want).max(axis=1) / np.abs(want).max()
    # a neuron right at a threshold may fall on the other side in the other engine's
    # float rounding; every position but such rare ones agrees to float accuracy
    assert np.median(err) < 1e-5, np.median(err)
    assert (err < 1e-4).mean() >= 0.9, err
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.95


def test_zero_sparsity_is_the_dense_result(swiglu, tmp_path):
    hf, _, _, _ = swiglu
    path = convert(hf, tmp_path / "zero.gguf", "f32", progress=False, sparse=True,
                   sparse_options=_opts(0.0))
    assert _thresholds(path) == [0.0, 0.0]
    ids = list(range(5, 37))
    with Model(path, n_ctx=64, n_threads=1) as m:
        gate = m.create_context(n_ctx=64)
        assert gate.ffn_mode == "gate"
        dense = m.create_context(n_ctx=64, ffn="dense")
        g = np.stack([gate.eval([t]) for t in ids])
        d = np.stack([dense.eval([t]) for t in ids])
        assert gate.stats()["density"] > 0.99
    np.testing.assert_allclose(g, d, rtol=0, atol=1e-5 * np.abs(d).max())


def test_gate_mode_errors(swiglu, tmp_path, capsys):
    hf, path, _, _ = swiglu
    dense = convert(hf, tmp_path / "dense.gguf", "f32", progress=False)
    with Model(dense, n_ctx=32) as m:
        assert m.context.ffn_mode == "dense"
        with pytest.raises(NativeError, match="gate thresholds.*--sparsity"):
            m.context.set_ffn_mode("gate")
    with pytest.raises(ConvertError, match="sparsity must be in"):
        _opts(1.0)
    assert main([str(hf), "-o", str(tmp_path / "x.gguf"), "--dense", "--sparsity", "0.5"]) == 1
    assert "cannot be combined with --dense" in capsys.readouterr().err
    # a SwiGLU model without --sparsity still says what to do
    with pytest.raises(ConvertError, match="--sparsity"):
        convert(hf, tmp_path / "y.gguf", "f32", progress=False, sparse=True,
                sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=256))


@pytest.mark.parametrize("values, words", [
    ([0.1], "has 1 values but the model has 2 layers"),
    ([0.1, -1.0], "must be finite and >= 0"),
    ([0.1, float("nan")], "must be finite and >= 0"),
])
def test_bad_gate_thresholds_are_refused(swiglu, tmp_path, values, words):
    from gguf_rewrite import rewrite_gguf

    _, path, _, _ = swiglu
    bad = rewrite_gguf(path, tmp_path / "bad.gguf", drop_kv=[F.KEY_SPARSE_GATE_THRESHOLD],
                       kv={F.KEY_SPARSE_GATE_THRESHOLD: (values, gguf.GGUFValueType.ARRAY)})
    with pytest.raises(NativeError, match=words):
        Model(bad, n_ctx=16)


def test_activation_matches_the_runtime_formulas():
    g = np.linspace(-12, 12, 97)
    assert np.allclose(activation(F.ACT_SILU, g), g / (1 + np.exp(-g)))
    assert np.array_equal(activation(F.ACT_RELU, g), np.maximum(g, 0))
    with pytest.raises(ValueError, match="no gate-magnitude sparsity"):
        activation("swish", g)


def test_format_doc_lists_the_gate_keys(swiglu):
    import re

    _, path, _, _ = swiglu
    text = (REPO / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    start = text.index("## Gate-magnitude sparsity\n")
    sec = text[start:text.index("\n## ", start + 1)]
    doc = dict(re.findall(r"^\| `(powerinfer\.[a-z0-9_.]+)` \| (\w+) \|", sec, re.M))
    assert set(doc) == set(F.GATE_KEYS)
    r = gguf.GGUFReader(str(path))
    for k in F.GATE_KEYS:
        f = r.fields[k]
        assert gguf.GGUFValueType(f.types[-1]) == gguf.GGUFValueType.FLOAT32 and doc[k] == "f32"


def test_inspect_place_and_hybrid(swiglu, tmp_path):
    """inspect describes a gate file; place re-solves its GPU index; on host-device the
    hot neurons run on the device and the logits equal the CPU-only ones."""
    from powerinfer_cpp.inspect import describe
    from powerinfer_cpp.place import main as place_main

    _, path, _, _ = swiglu
    assert "gate magnitude, no predictors" in describe(str(path))
    placed = tmp_path / "placed.gguf"
    assert place_main([str(path), "--vram-budget", "400K", "-o", str(placed)]) == 0
    ids = list(range(7, 31))
    with Model(path, n_ctx=64, n_threads=1) as cpu:
        want = np.stack([cpu.eval([t]) for t in ids])
    with Model(placed, n_ctx=64, n_threads=1, device="host-device") as dev:
        assert dev.context.ffn_mode == "gate"
        assert dev.device_info()["n_hot"] > 0
        got = np.stack([dev.eval([t]) for t in ids])
        assert dev.context.stats()["device"]["neurons_device"] > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_gelu_erf_activation_matches_math_erf():
    import math

    g = np.linspace(-8, 8, 2001)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in g])
    np.testing.assert_allclose(activation(F.ACT_GELU_ERF, g), want, rtol=0, atol=1e-6)
