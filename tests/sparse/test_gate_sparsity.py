"""Training-free gate-magnitude sparsity (convert --sparsity / --max-ppl-increase, the
"gate" FFN mode): on a small random SwiGLU model against transformers with the same
activation mask as the reference, and on the shipped trained SwiGLU model
(models/tiny-swiglu-kjv) the calibration's held-out sparsity, the quality budget's
default and the per-layer allocation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hf_models import make_llama_model  # noqa: E402

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import ConvertError, convert, main  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402
from powerinfer_cpp.sparse.thresholds import activation  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

REPO = REPO_DIR
SWIGLU_DIR = REPO / "models" / "tiny-swiglu-kjv"
HELDOUT = SWIGLU_DIR / "heldout.txt"
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
    # a SwiGLU folder is calibrated to the quality budget by default; without text of its
    # own the error names the file it looked for and the option
    with pytest.raises(ConvertError, match=r"quality budget.*--calib FILE.*ships no heldout\.txt"):
        convert(hf, tmp_path / "y.gguf", "f32", progress=False, sparse=True)


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


def test_format_doc_lists_the_gate_keys(swiglu, swiglu_default):
    import re

    _, path, _, _ = swiglu
    text = (REPO / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    start = text.index("## Gate-magnitude sparsity\n")
    sec = text[start:text.index("\n## ", start + 1)]
    doc = dict(re.findall(r"^\| `(powerinfer\.[a-z0-9_.]+)` \| (\w+) \|", sec, re.M))
    assert set(doc) == set(F.GATE_KEYS) | set(F.GATE_BUDGET_KEYS)
    types = {"f32": gguf.GGUFValueType.FLOAT32, "string": gguf.GGUFValueType.STRING}
    fixed = gguf.GGUFReader(str(path)).fields
    budget = gguf.GGUFReader(str(swiglu_default["sparse"])).fields
    assert not set(F.GATE_BUDGET_KEYS) & set(fixed)  # a fixed --sparsity has no budget
    for k in set(F.GATE_KEYS) | set(F.GATE_BUDGET_KEYS):
        f = budget[k]
        assert gguf.GGUFValueType(f.types[-1]) == types[doc[k]], k
    assert str(bytes(fixed[F.KEY_SPARSE_GATE_ALLOCATION].parts[-1]), "utf-8") in F.GATE_ALLOCATIONS


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


# ---------------------------------------------------------------------------
# the shipped SwiGLU model
# ---------------------------------------------------------------------------

def _fields(path):
    return gguf.GGUFReader(str(path)).fields


def _f32(fields, key):
    return float(fields[key].parts[-1][0])


def _heldout_ids(path, n_calib, n=None):
    """Token ids of heldout.txt after the calibration's (text the conversion never saw)."""
    with Model(path, n_ctx=16) as m:
        ids = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[n_calib:]
    return ids if n is None else ids[:n + 1]


def _measure(path, ids, tmp_path):
    """The file's own thresholds measured on ids (on a copy: the evaluator patches files)."""
    import shutil

    from powerinfer_cpp.sparse.gate_eval import GateEvaluator

    cp = tmp_path / ("m-" + Path(path).name)
    shutil.copyfile(path, cp)
    return GateEvaluator(str(cp), 512, 2).measure(ids, _thresholds(cp))


def test_budget_default_keeps_heldout_ppl_within_2_percent(swiglu_default, tmp_path):
    """The command line's default for a SwiGLU folder (--max-ppl-increase 0.02, chosen on
    the last 20% of the profiled tokens): on the rest of heldout.txt, which neither the
    calibration nor the search saw, every token in the gate mode stays within 2% of the
    dense perplexity, at a real sparsity."""
    path = swiglu_default["sparse"]
    f = _fields(path)
    assert _f32(f, F.KEY_SPARSE_MAX_PPL_INCREASE) == pytest.approx(0.02)
    assert 0 <= _f32(f, F.KEY_SPARSE_PPL_INCREASE) <= 0.02
    target = _f32(f, F.KEY_SPARSE_TARGET)
    assert target >= 0.25, target
    with Model(path, n_ctx=64, ffn="file") as m:  # the file's mode (`auto` may pick dense)
        assert m.context.ffn_mode == "gate"
    r = _measure(path, _heldout_ids(path, swiglu_default["n_calib"]), tmp_path)
    inc = r["ppl"] / r["ppl_dense"] - 1
    assert inc <= 0.02, r
    assert abs((1 - r["density"]) - target) <= 0.03, (r["density"], target)


@pytest.mark.parametrize("sparsity, allocation", [(0.5, "uniform"), (0.4, "greedy")])
def test_calibration_reaches_the_sparsity_on_heldout_text(sparsity, allocation, tmp_path):
    """The gate mode's measured density on held-out tokens (after the calibration's) is the
    requested sparsity's complement within 3 points, for either allocation; the file
    records the allocation and the per-layer levels, whose mean is the target."""
    rep: list = []
    path = convert(SWIGLU_DIR, tmp_path / "s.gguf", "f16", progress=False, sparse=True, report=rep,
                   sparse_options=SparseOptions(sparsity=sparsity, allocation=allocation, calib_tokens=4096,
                                                greedy_tokens=128, n_threads=2))
    f = _fields(path)
    assert str(bytes(f[F.KEY_SPARSE_GATE_ALLOCATION].parts[-1]), "utf-8") == allocation
    layer = [float(f[F.KEY_SPARSE_LAYER_SPARSITY].parts[i][0]) for i in f[F.KEY_SPARSE_LAYER_SPARSITY].data]
    assert np.mean(layer) == pytest.approx(sparsity, abs=1e-6)
    assert _f32(f, F.KEY_SPARSE_TARGET) == pytest.approx(sparsity)
    if allocation == "uniform":
        assert layer == pytest.approx([sparsity] * 4)
    else:
        assert rep[0].gate_costs.shape == (4, 9)
    ids = _heldout_ids(path, rep[0].n_calib_tokens, 1024)
    with Model(path, n_ctx=512, n_threads=2) as m:
        ctx = m.create_context(n_ctx=512, ffn="file")  # the file's gate mode, whatever `auto` says
        ctx.sparse_batch = 512
        for s in range(0, len(ids), 512):
            ctx.reset()
            ctx.eval(ids[s:s + 512])
        st = ctx.stats()
    assert st["n_sparse_tokens"] == len(ids)
    assert abs((1 - st["density"]) - sparsity) <= 0.03, st["density"]
    for l, want in enumerate(layer):
        assert abs((1 - st["layer_density"][l]) - want) <= 0.03, (l, st["layer_density"], layer)


def test_zero_sparsity_equals_dense_on_the_shipped_model(tmp_path):
    """--sparsity 0: thresholds 0, every neuron active, and the gate mode's logits are the
    dense mode's, token by token, bit for bit."""
    path = convert(SWIGLU_DIR, tmp_path / "z.gguf", "f16", progress=False, sparse=True,
                   sparse_options=SparseOptions(sparsity=0.0, calib_tokens=256))
    assert _thresholds(path) == [0.0] * 4
    ids = _heldout_ids(path, 256, 40)
    with Model(path, n_ctx=64, n_threads=2) as m:
        gate = m.create_context(n_ctx=64, ffn="file")  # the file's gate mode, whatever `auto` says
        dense = m.create_context(n_ctx=64, ffn="dense")
        g = np.stack([gate.eval([t]) for t in ids])
        d = np.stack([dense.eval([t]) for t in ids])
        assert gate.ffn_mode == "gate" and gate.stats()["density"] > 0.9999
    np.testing.assert_array_equal(g, d)


@pytest.mark.parametrize("argv, words", [
    (["--max-ppl-increase", "0"], "max_ppl_increase must be a share in"),
    (["--max-ppl-increase", "-0.1"], "max_ppl_increase must be a share in"),
    (["--max-ppl-increase", "nan"], "max_ppl_increase must be a share in"),
    (["--sparsity", "1.5"], "sparsity must be in"),
    (["--sparsity", "0.5", "--max-ppl-increase", "0.02"], "pass one of them"),
    (["--dense", "--max-ppl-increase", "0.02"], "cannot be combined with --dense"),
    (["--dense", "--sparsity-allocation", "greedy"], "cannot be combined with --dense"),
    (["--sparsity", "0.95", "--sparsity-allocation", "greedy"], "greedy allocation reaches a mean"),
    (["--greedy-tokens", "4", "--sparsity-allocation", "greedy"], "greedy_tokens must be"),
])
def test_bad_gate_options_are_clear_errors(argv, words, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert main([str(SWIGLU_DIR), "-o", str(out), "-q", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err, err
    assert not out.exists()


def test_bad_allocation_name_and_predictor_models(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse: the choices are listed
        main([str(SWIGLU_DIR), "-o", str(tmp_path / "x.gguf"), "--sparsity-allocation", "teal"])
    assert e.value.code == 2 and "uniform" in capsys.readouterr().err
    with pytest.raises(ConvertError, match="allocation must be one of"):
        SparseOptions(allocation="teal")
    # a ReLU model gets predictors by default: an allocation has nothing to share
    assert main([str(REPO / "models" / "tiny-relu-kjv"), "-o", str(tmp_path / "r.gguf"), "-q",
                 "--sparsity-allocation", "greedy"]) == 1
    assert "trains predictors" in capsys.readouterr().err


def test_greedy_allocation_and_budget_search_units():
    from powerinfer_cpp.sparse.gate_eval import search_budget
    from powerinfer_cpp.sparse.thresholds import QuantileTable, greedy_allocation

    grid = [0.1 * i for i in range(1, 10)]
    # layer 1 is 10x cheaper than layer 0: it takes the sparsity first, up to the cap
    costs = np.array([[s ** 2 for s in grid], [0.1 * s ** 2 for s in grid]])
    lv = greedy_allocation(costs, 0.5)
    assert np.mean(lv) == pytest.approx(0.5) and lv[1] > lv[0]
    assert greedy_allocation(costs, 0.0) == [0.0, 0.0]
    assert greedy_allocation(costs, 0.9) == pytest.approx([0.9, 0.9])
    with pytest.raises(ValueError, match="outside"):
        greedy_allocation(costs, 0.95)
    # bisection: ppl increase = sparsity^2 -> the largest level within 4% is 0.2
    tried = []

    def ppl_at(s):
        tried.append(s)
        return {"ppl": 1.0 + s * s, "ppl_dense": 1.0, "kl": 0.0, "top1": 1.0, "density": 1 - s}

    s, r, log = search_budget(ppl_at, 0.04, 0.9, resolution=0.01)
    assert 0.19 <= s <= 0.2 and r["ppl"] <= 1.04 and len(log) == len(tried) <= 8
    # the quantile table: thresholds are the magnitudes' quantiles
    rng = np.random.default_rng(0)
    mags = [np.abs(rng.standard_normal((200, 50))).astype(np.float32) for _ in range(2)]
    t = QuantileTable(mags)
    for q in (0.25, 0.5, 0.7):
        assert t.threshold(1, q) == pytest.approx(float(np.quantile(mags[1], q)), rel=2e-3)
    assert t.threshold(0, 0.0) == 0.0
