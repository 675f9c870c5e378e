"""The offline sparse pipeline: placement ILP, predictors, convert --sparse, place, inspect."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("mip")

from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.sparse.placement import (DenseItem, format_size, greedy_placement, ilp_placement,  # noqa: E402
                                      make_problem, parse_size)
from powerinfer_cpp.sparse.predictor import PredictorConfig, evaluate, train_layer  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

REPO = REPO_DIR
SHIPPED = REPO / "models" / "tiny-relu-kjv"
HELDOUT = SHIPPED / "heldout.txt"


# ---------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------

def test_parse_size():
    assert parse_size("0") == 0
    assert parse_size("512M") == 512 << 20
    assert parse_size("4G") == 4 << 30
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_size("300k") == 300 << 10
    assert parse_size("8") == 8 << 30  # a bare number is GiB, as PowerInfer's --vram-budget
    assert parse_size("0.5") == 1 << 29
    assert parse_size(77) == 77  # an int is bytes (the API)
    for bad in ("", "-1G", "abc", "4X", "nan", "12B"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(3 << 20) == "3.00 MiB"


def _brute_force(p):
    """Best objective over every subset of groups that meets the model's constraints
    (groups of a layer taken in frequency order; per-layer minimum; budget)."""
    best = 0.0
    n_groups = [len(v) for v in p.gvalue]
    for bits in itertools.product((0, 1), repeat=sum(n_groups)):
        off, ok, used, val = 0, True, 0, 0.0
        for l, ng in enumerate(n_groups):
            sel = bits[off:off + ng]
            off += ng
            k = sum(sel)
            if any(sel[g + 1] > sel[g] for g in range(ng - 1)) or 0 < k < p.min_groups[l]:
                ok = False
                break
            used += int(sum(int(p.gbytes[l][g]) for g in range(ng) if sel[g]))
            val += float(sum(p.gvalue[l][g] for g in range(ng) if sel[g]))
        if ok and used <= p.remaining:
            best = max(best, val)
    return best


def _random_problem(rng, max_groups=12):
    while True:
        n_layer = int(rng.integers(1, 4))
        gs = int(rng.integers(2, 6))
        n_ff = [int(rng.integers(gs, 4 * gs + 1)) for _ in range(n_layer)]
        if sum(-(-n // gs) for n in n_ff) <= max_groups:
            break
    freq = [rng.random(n) ** 3 for n in n_ff]
    nb = [int(rng.integers(1, 10)) for _ in range(n_layer)]
    dense = [DenseItem("attention", f"blk.{l}.attention", int(rng.integers(0, 10))) for l in range(n_layer)]
    total = sum(n * b for n, b in zip(n_ff, nb)) + sum(d.nbytes for d in dense)
    budget = int(rng.integers(0, total + 10))
    return make_problem(freq, nb, dense, budget, gs, float(rng.random() * 0.7))


def test_ilp_equals_brute_force():
    rng = np.random.default_rng(1234)
    n_greedy_worse = 0
    for _ in range(40):
        p = _random_problem(rng)
        ilp = ilp_placement(p)
        greedy = greedy_placement(p)
        best = _brute_force(p)
        assert ilp.served == pytest.approx(best, rel=1e-9, abs=1e-9)
        for sol in (ilp, greedy):
            assert sol.neuron_bytes <= p.remaining                     # budget never exceeded
            assert sol.neuron_bytes + sol.dense_bytes <= p.budget
            for l, h in enumerate(sol.hot):                              # per-layer minimum
                assert sol.groups[l] == 0 or sol.groups[l] >= p.min_groups[l]
                assert len(h) == int(p.gsize[l][:sol.groups[l]].sum())
                assert np.all(np.diff(h) > 0)                           # sorted, unique
                if len(h):  # the hottest neurons of the layer
                    assert p.freq[l][h].min() >= np.sort(p.freq[l])[::-1][len(h) - 1] - 1e-12
        assert ilp.served >= greedy.served - 1e-12                     # never worse than greedy
        n_greedy_worse += greedy.served < best - 1e-9
    assert n_greedy_worse > 0  # the instances are hard enough for greedy to miss sometimes


def test_budget_zero_and_everything():
    rng = np.random.default_rng(5)
    freq = [rng.random(300), rng.random(200)]
    dense = [DenseItem("attention", "a0", 1000), DenseItem("kv_cache", "kv", 500)]
    p = make_problem(freq, [100, 100], dense, 0, 64)
    for sol in (ilp_placement(p), greedy_placement(p)):
        assert sol.neuron_bytes == 0 and sol.dense_bytes == 0
        assert all(len(h) == 0 for h in sol.hot) and sol.solver == "none"
        assert sol.served_share == 0
    big = 1500 + 500 * 100
    p = make_problem(freq, [100, 100], dense, big, 64)
    for sol in (ilp_placement(p), greedy_placement(p)):
        assert [len(h) for h in sol.hot] == [300, 200]
        assert sol.served_share == pytest.approx(1.0)
        assert sol.dense_bytes == 1500 and sol.neuron_bytes == 500 * 100


def test_dense_priority():
    freq = [np.ones(128)]
    dense = [DenseItem("kv_cache", "kv", 100), DenseItem("predictor", "p", 100),
             DenseItem("attention", "a", 100), DenseItem("output", "o", 1000)]
    # attention, predictor fit; output does not, so the KV cache after it is not placed
    p = make_problem(freq, [1], dense, 1150, 32, 0.0)
    assert [d.category for d in p.placed_dense] == ["attention", "predictor"]
    assert p.remaining == 950
    sol = ilp_placement(p)
    assert len(sol.hot[0]) == 128 and sol.neuron_bytes == 128


def test_per_layer_minimum_binds():
    # one layer, min 50% = 4 groups of 8; budget for 3 groups only -> nothing placed
    p = make_problem([np.linspace(1, 0.1, 64)], [10], [], 3 * 8 * 10, 8, 0.5)
    assert p.min_groups == [4]
    for sol in (ilp_placement(p), greedy_placement(p)):
        assert sol.groups == [0]
    p = make_problem([np.linspace(1, 0.1, 64)], [10], [], 4 * 8 * 10, 8, 0.5)
    assert ilp_placement(p).groups == [4]


def test_ilp_larger_instance_fast():
    rng = np.random.default_rng(7)
    freq = [np.sort(rng.random(4096) ** 4)[::-1] * (1 + l / 10) for l in range(32)]
    nb = [3 * 4096 * 2 + 4] * 32
    total = sum(len(f) * b for f, b in zip(freq, nb))
    p = make_problem(freq, nb, [], total // 3, 64, 0.05)
    ilp, greedy = ilp_placement(p, time_limit=20), greedy_placement(p)
    assert ilp.neuron_bytes <= p.remaining
    assert ilp.served >= greedy.served - 1e-9


# ---------------------------------------------------------------------------
# predictors (synthetic data: a bias-free ReLU gate, as in a ReGLU FFN)
# ---------------------------------------------------------------------------

def _synthetic(n, d=64, n_ff=256, seed=0, draw=None):
    """(x, mask): teacher from `seed`, tokens drawn with `draw` (default: seed)."""
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal(d)
    mu /= np.linalg.norm(mu)
    basis = rng.standard_normal((d, 16)) / 4.0
    g = (rng.standard_normal((n_ff, d)) / np.sqrt(d) - np.outer(np.abs(rng.standard_normal(n_ff)) * 0.8, mu))
    r = np.random.default_rng([seed, 1000 if draw is None else draw])
    x = (2 * mu + r.standard_normal((n, 16)) @ basis.T + 0.1 * r.standard_normal((n, d))).astype(np.float32)
    return x, (x @ g.T.astype(np.float32)) > 0


def test_predictor_reaches_recall_target():
    x, m = _synthetic(3000)
    assert 0.05 < m.mean() < 0.5
    p = train_layer(x, m, PredictorConfig(recall_target=0.99, seed=3))
    assert p.reached and p.recall >= 0.99
    assert p.n_heldout == 600 and p.n_train == 2400
    assert p.precision > 1.5 * m.mean()  # much better than "everything active"
    rec, prec, dens = evaluate(p.w1, p.w2, x[2400:], m[2400:])
    assert rec == pytest.approx(p.recall) and prec == pytest.approx(p.precision)
    # fresh tokens from the same distribution, never seen in training or selection
    xf, mf = _synthetic(3000, draw=7)
    rec_f, prec_f, _ = evaluate(p.w1, p.w2, xf, mf)
    assert rec_f >= 0.985
    assert p.tried[0][0] == 32 and p.h == p.tried[-1][0]


def test_predictor_torch_backend():
    pytest.importorskip("torch")
    x, m = _synthetic(2000, seed=5)
    p = train_layer(x, m, PredictorConfig(backend="torch", seed=2))
    assert p.reached and p.recall >= 0.99 and p.w1.dtype == np.float32


def test_predictor_deterministic_and_capped():
    x, m = _synthetic(1200, seed=4)
    cfg = PredictorConfig(recall_target=0.9999, h_max=64, max_tune_steps=1, seed=1)
    a = train_layer(x, m, cfg)
    b = train_layer(x, m, cfg)
    assert np.array_equal(a.w1, b.w1) and np.array_equal(a.w2, b.w2)
    assert a.h <= 64
    if not a.reached:
        assert a.h == 64 and len(a.tried) == 2


def _lowdim(n, d=96, k=12, n_ff=300, seed=6, noise=0.0):
    """(x, mask, gate): inputs in a k-dimensional subspace plus a large constant direction
    (as in the bench model), optionally with full-rank noise; mask = gate . x > 0."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    basis = np.linalg.qr(rng.standard_normal((d, k)))[0]
    g = rng.standard_normal((n_ff, d)) * 0.1 - np.outer(np.abs(rng.standard_normal(n_ff)) * 0.4, u)
    x = 3 * u + rng.standard_normal((n, k)) @ basis.T + noise * rng.standard_normal((n, d))
    x, g = x.astype(np.float32), g.astype(np.float32)
    return x, (x @ g.T) > 0, g


def test_predictor_gate_lowrank_exact():
    """Inputs in a (k+1)-dimensional subspace: the rank-(k+1) data-weighted approximation of
    the gate is exact there, so it is taken without training at the first size that has the
    rank, and it predicts the mask of fresh tokens."""
    x, m, g = _lowdim(1500)
    assert 0.05 < m.mean() < 0.6
    p = train_layer(x, m, PredictorConfig(recall_target=0.99, h_start=8, h_max=64, train_fallback=False), gate=g)
    assert p.reached and p.recall >= 0.999 and p.precision >= 0.999
    assert p.h == 32 and [t[0] for t in p.tried] == [32]   # 8, 16 (rank < 13) fall short
    assert p.w1.shape == (32, 96) and p.w2.shape == (300, 32)
    rng = np.random.default_rng(99)
    # the predictor is the linear map A B on the data: W2 relu(W1 x) == approx G x
    s = np.maximum(x @ p.w1.T, 0) @ p.w2.T
    np.testing.assert_allclose(s, x @ g.T, atol=1e-3 * float(np.abs(x @ g.T).max()))
    # with training as the fallback, every size tries the approximation before training
    q = train_layer(x, m, PredictorConfig(recall_target=0.99, h_start=8, h_max=64, epochs=2), gate=g)
    assert q.reached and q.h <= 32
    # and the +v/-v unit pairs make it exactly linear: scaling x scales the score
    xs = x[:5] * np.float32(rng.uniform(0.5, 2.0))
    np.testing.assert_allclose(np.maximum(xs @ p.w1.T, 0) @ p.w2.T, xs @ g.T, rtol=1e-3, atol=1e-3)


def test_predictor_gate_lowrank_falls_back():
    """Full-rank noise the capped rank cannot follow: training runs, and the trained net is
    kept only if it has the higher recall at no higher predicted density; without the
    fallback the approximation is returned as it is."""
    x, m, g = _lowdim(1200, noise=1.0, seed=8)
    cfg = PredictorConfig(recall_target=0.999, h_start=8, h_max=16, max_tune_steps=1, epochs=2, grow_epochs=1)
    p = train_layer(x, m, cfg, gate=g)
    trained = train_layer(x, m, cfg)
    assert not p.reached and p.h == 16
    if np.array_equal(p.w1, trained.w1):
        assert p.recall == trained.recall
    else:
        assert p.pred_density < trained.pred_density or p.recall >= trained.recall
    fixed = train_layer(x, m, PredictorConfig(recall_target=0.999, h_start=16, h_max=16, train_fallback=False),
                        gate=g)
    assert not fixed.reached and fixed.h == 16 and len(fixed.tried) == 1 and fixed.pos_weight == 0.0
    assert (fixed.recall, fixed.pred_density) == evaluate(fixed.w1, fixed.w2, x[960:], m[960:])[::2]
    with pytest.raises(ValueError, match="gate has shape"):
        train_layer(x, m, cfg, gate=g[:, :10])


def test_predictor_whitening():
    """Whitened training (PredictorConfig.whiten) folds the transform back into w1: the
    stored predictor reads raw x and reaches the target on the synthetic gate."""
    x, m = _synthetic(3000)
    p = train_layer(x, m, PredictorConfig(recall_target=0.99, seed=3, whiten=1e-2))
    rec, prec, dens = evaluate(p.w1, p.w2, x[2400:], m[2400:])
    assert rec == pytest.approx(p.recall) and rec >= 0.98
    assert p.precision > 1.5 * m.mean()


def test_predictor_type_option():
    from powerinfer_cpp.convert import ConvertError
    from powerinfer_cpp.sparse.pipeline import SparseOptions, predictor_qtype
    Q = gguf.GGMLQuantizationType
    assert predictor_qtype("f16", 2048) == Q.F16 and predictor_qtype("q4_0", 2048) == Q.Q8_0
    assert predictor_qtype("f16", 2048, "q8_0") == Q.Q8_0
    assert predictor_qtype("f16", 33, "q8_0") == Q.F16      # rows that cannot be blocked
    assert predictor_qtype("q4_0", 2048, "f16") == Q.F16
    assert predictor_qtype("q8_0", 64, "f32") == Q.F32
    assert predictor_qtype("f16", 2048, "q4_0") == Q.Q4_0
    assert predictor_qtype("q8_0", 33, "q4_0") == Q.F16     # rows that cannot be blocked
    SparseOptions(predictor_type="q4_0", threshold=-0.15)
    with pytest.raises(ConvertError, match="predictor_type"):
        SparseOptions(predictor_type="q5_0")
    with pytest.raises(ConvertError, match="threshold must be a finite number"):
        SparseOptions(threshold=float("nan"))


# ---------------------------------------------------------------------------
# the pipeline on a small random ReLU model
# ---------------------------------------------------------------------------

def _fields(path):
    from powerinfer_cpp.place import read_fields
    return read_fields(gguf.GGUFReader(str(path)))


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def random_sparse(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    from powerinfer_cpp.convert import convert
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    d = tmp_path_factory.mktemp("sparse-random")
    hf = make_llama_model(d / "hf", act="relu", tied=False, seed=11, n_layer=2, d=64, n_ff=256, n_ctx=256)
    (hf / "heldout.txt").write_text(HELDOUT.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    out = {"hf": hf, "dir": d}
    for outtype in ("f32", "q8_0"):
        rep = []
        opts = SparseOptions(calib_tokens=1024, vram_budget=parse_size("150K"), keep_predictors=True,
                             profile_ctx=128)
        out[outtype] = Path(convert(hf, d / f"sparse-{outtype}.gguf", outtype, progress=False, sparse=True,
                                    sparse_options=opts, report=rep))
        out[f"rep-{outtype}"] = rep[0]
        out[f"dense-{outtype}"] = Path(convert(hf, d / f"dense-{outtype}.gguf", outtype, progress=False))
    return out


def test_sparse_file_roundtrip(random_sparse):
    from safetensors.numpy import load_file
    path, rep, dense = random_sparse["f32"], random_sparse["rep-f32"], random_sparse["dense-f32"]
    f = _fields(path)
    t = _tensors(path)
    td = _tensors(dense)
    n_layer, n_ff, d = 2, 256, 64
    assert f[F.KEY_FORMAT_VERSION] == 1
    assert f[F.KEY_SPARSE_THRESHOLD] == 0.0
    assert f[F.KEY_SPARSE_CALIB_TOKENS] == rep.n_calib_tokens == 1024
    assert f[F.KEY_SPARSE_CALIB_SOURCE].startswith("heldout.txt sha256:")
    assert f[F.KEY_SPARSE_RECALL_TARGET] == pytest.approx(0.99)
    pl = rep.placement
    assert f[F.KEY_GPU_VRAM_BUDGET] == parse_size("150K") == pl.budget
    assert f[F.KEY_GPU_GROUP_SIZE] == 64 and f[F.KEY_GPU_CTX] == 256
    assert f[F.KEY_GPU_DENSE_BYTES] == pl.dense_bytes and f[F.KEY_GPU_NEURON_BYTES] == pl.neuron_bytes
    assert pl.dense_bytes + pl.neuron_bytes <= pl.budget
    assert f[F.KEY_GPU_SERVED_SHARE] == pytest.approx(pl.served_share)
    assert f[F.KEY_GPU_SOLVER] in F.GPU_SOLVERS
    # dense tensors: byte-identical to the dense conversion, except ffn_down -> ffn_down_t
    for name, dt in td.items():
        kind, il, _ = F.parse_tensor_name(name)
        if kind == F.T_FFN_DOWN:
            assert name not in t
            dt_t = t[F.sparse_tensor_name(F.T_FFN_DOWN_T, il)]
            assert list(dt_t.shape) == [d, n_ff]  # GGUF ne
            assert np.array_equal(np.asarray(dt_t.data).reshape(n_ff, d), np.asarray(dt.data).reshape(d, n_ff).T)
        else:
            assert bytes(t[name].data) == bytes(dt.data), name
    hf = load_file(str(random_sparse["hf"] / "model.safetensors"))
    for l in range(n_layer):
        p = rep.predictors[l]
        fc1, fc2 = t[F.sparse_tensor_name(F.T_FC1, l)], t[F.sparse_tensor_name(F.T_FC2, l)]
        assert fc1.tensor_type == fc2.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(fc1.data).reshape(p.h, d), p.w1)
        assert np.array_equal(np.asarray(fc2.data).reshape(n_ff, p.h), p.w2)
        down_t = np.asarray(t[F.sparse_tensor_name(F.T_FFN_DOWN_T, l)].data).reshape(n_ff, d)
        assert np.array_equal(down_t, hf[f"model.layers.{l}.mlp.down_proj.weight"].T)
        freq = np.asarray(t[F.sparse_tensor_name(F.T_FFN_FREQ, l)].data)
        assert freq.dtype == np.float32 and freq.shape == (n_ff,) and 0 <= freq.min() and freq.max() <= 1
        idx = np.asarray(t[F.sparse_tensor_name(F.T_GPU_IDX, l)].data)
        assert idx.dtype == np.int32 and set(np.unique(idx)) <= {0, 1}
        hot = pl.hot[l]
        assert np.array_equal(np.flatnonzero(idx), hot)
        bname = F.sparse_tensor_name(F.T_GPU_BUCKET, l)
        if len(hot):
            b = np.asarray(t[bname].data)
            assert b.dtype == np.int32 and np.array_equal(b, hot)
        else:
            assert bname not in t
    # file order of a layer
    names = [x.name for x in gguf.GGUFReader(str(path)).tensors]
    i = names.index(F.tensor_name(F.T_FFN_UP, 0))
    n_hot = len(pl.hot[0])
    assert names[i + 1:i + 1 + len(F.sparse_layer_tensor_names(0, n_hot))] == F.sparse_layer_tensor_names(0, n_hot)


def test_sparse_q8_0_predictors(random_sparse):
    t = _tensors(random_sparse["q8_0"])
    rep = random_sparse["rep-q8_0"]
    for l in range(2):
        assert t[F.sparse_tensor_name(F.T_FC1, l)].tensor_type == gguf.GGMLQuantizationType.Q8_0
        assert t[F.sparse_tensor_name(F.T_FFN_DOWN_T, l)].tensor_type == gguf.GGMLQuantizationType.Q8_0
        # the stored (quantized) predictor loses little recall
        rec_stored = rep.stored_recall[l][0]
        assert rec_stored >= rep.predictors[l].recall - 0.01


def test_place_changes_only_index(random_sparse, tmp_path):
    from powerinfer_cpp.place import main as place_main
    from powerinfer_cpp.place import replace_index

    src = random_sparse["f32"]
    before = src.read_bytes()
    out = tmp_path / "placed.gguf"
    pl = replace_index(src, parse_size("10M"), out)
    assert src.read_bytes() == before  # -o leaves the input alone
    assert [len(h) for h in pl.hot] == [256, 256]
    fa, fb = _fields(src), _fields(out)
    assert set(fa) == set(fb)
    changed = {k for k in fa if fa[k] != fb[k]}
    assert changed and changed <= set(F.GPU_KEYS)
    assert fb[F.KEY_GPU_VRAM_BUDGET] == 10 << 20
    ta, tb = _tensors(src), _tensors(out)
    ga = gguf.GGUFReader(str(src))
    for k, fld in ga.fields.items():  # key types unchanged too
        if not k.startswith("GGUF."):
            assert gguf.GGUFReader(str(out)).fields[k].types == fld.types
    idx_kinds = set(F.GPU_INDEX_TENSORS)
    for name in set(ta) | set(tb):
        kind, _, _ = F.parse_tensor_name(name)
        if kind in idx_kinds:
            continue
        assert ta[name].tensor_type == tb[name].tensor_type
        assert bytes(ta[name].data) == bytes(tb[name].data), name
    for l in range(2):
        assert np.asarray(tb[F.sparse_tensor_name(F.T_GPU_IDX, l)].data).sum() == 256
        assert np.array_equal(np.asarray(tb[F.sparse_tensor_name(F.T_GPU_BUCKET, l)].data), np.arange(256))
    # without -o only the index is written, as the side file next to the model (the model
    # is not copied); back to CPU only: buckets disappear; no temp files left
    work = tmp_path / "inplace.gguf"
    work.write_bytes(out.read_bytes())
    model_before = work.read_bytes()
    assert place_main([str(work), "--vram-budget", "0", "-q"]) == 0
    assert work.read_bytes() == model_before
    side = tmp_path / ("inplace.gguf" + F.GPUIDX_SUFFIX)
    fs = _fields(side)
    assert fs[F.KEY_GENERAL_ARCHITECTURE] == F.GPUIDX_ARCH
    assert fs[F.KEY_GPU_SOLVER] == F.GPU_SOLVER_NONE and fs[F.KEY_GPU_MODEL_BYTES] == len(model_before)
    tw = _tensors(side)
    assert set(tw) == {F.sparse_tensor_name(F.T_GPU_IDX, l) for l in range(2)}  # no buckets
    assert all(np.asarray(tw[F.sparse_tensor_name(F.T_GPU_IDX, l)].data).sum() == 0 for l in range(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inplace.gguf", side.name, "placed.gguf"]
    # -o onto a model with a side file: the whole file is written and the side file, which
    # would override it, removed
    assert place_main([str(out), "--vram-budget", "10M", "-q"]) == 0
    assert (tmp_path / ("placed.gguf" + F.GPUIDX_SUFFIX)).exists()
    assert place_main([str(work), "--vram-budget", "10M", "-q", "-o", str(out)]) == 0
    assert not (tmp_path / ("placed.gguf" + F.GPUIDX_SUFFIX)).exists()
    # a dense file is refused
    assert place_main([str(random_sparse["dense-f32"]), "--vram-budget", "1G"]) == 1


def test_convert_cli_predictor_type_and_threshold(random_sparse, tmp_path):
    """--predictor-type q4_0 --predictor-threshold T: Q4_0 predictor tensors, the threshold
    in the file and in the runtime, and sparse decode on them; a lower threshold predicts
    more neurons active."""
    from powerinfer_cpp import Model
    from powerinfer_cpp.convert import main

    out = tmp_path / "q4pred.gguf"
    assert main([str(random_sparse["hf"]), "--outtype", "f32", "--outfile", str(out), "--calib-tokens", "512",
                 "--predictor-type", "q4_0", "--predictor-threshold", "-0.25", "-q"]) == 0
    assert _fields(out)[F.KEY_SPARSE_THRESHOLD] == pytest.approx(-0.25)
    t = _tensors(out)
    for l in range(2):
        for kind in (F.T_FC1, F.T_FC2):
            assert t[F.sparse_tensor_name(kind, l)].tensor_type == gguf.GGMLQuantizationType.Q4_0
    toks = [1, 5, 9, 33, 100, 7, 12, 40]
    density = {}
    for key, path in (("default", random_sparse["f32"]), ("low", out)):
        m = Model(path, n_ctx=64)
        assert m.info.sparse_threshold == pytest.approx(0.0 if key == "default" else -0.25)
        c = m.create_context(n_ctx=64)
        c.set_ffn_mode("sparse")
        for tok in toks:
            logits = c.eval([tok])
        assert np.isfinite(np.asarray(logits)).all()
        density[key] = c.stats()["density"]
        c.close()
        m.close()
    assert 0 < density["default"] < density["low"] <= 1


def test_runtime_loads_sparse_file(random_sparse):
    from powerinfer_cpp import Model

    for key in ("f32", "q8_0"):
        m = Model(random_sparse[key], n_ctx=64)
        assert m.info.has_predictor == 2 and m.info.has_down_t == 2
        assert m.info.sparse_threshold == 0.0
        m.close()
    # ffn_down_t is the exact transpose: the dense forward pass gives the same logits
    toks = [1, 5, 9, 33, 100, 7]
    a = Model(random_sparse["f32"], n_ctx=64)
    b = Model(random_sparse["dense-f32"], n_ctx=64)
    la, lb = np.asarray(a.eval(toks)), np.asarray(b.eval(toks))
    assert np.allclose(la, lb, rtol=1e-4, atol=1e-4)
    a.close()
    b.close()


def test_profiling_deterministic(random_sparse):
    from powerinfer_cpp.sparse.profile import profile_model

    text = HELDOUT.read_text(encoding="utf-8")[:3000]
    p1 = profile_model(random_sparse["dense-f32"], text, n_ctx=128, max_tokens=300, progress=False, n_threads=1)
    p2 = profile_model(random_sparse["dense-f32"], text, n_ctx=128, max_tokens=300, progress=False, n_threads=2)
    assert np.array_equal(p1.x, p2.x) and np.array_equal(p1.mask, p2.mask)
    assert np.array_equal(p1.freq, p2.freq)


def test_inspect(random_sparse, capsys):
    from powerinfer_cpp.inspect import main as inspect_main

    assert inspect_main([str(random_sparse["q8_0"])]) == 0
    out = capsys.readouterr().out
    assert "sparse: yes" in out and "gpu index: budget 150.00 KiB" in out and "Q8_0,Q8_0" in out
    assert inspect_main([str(random_sparse["dense-f32"]), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "sparse: no" in out and "blk.1.ffn_down.weight" in out


def test_failure_leaves_no_output(random_sparse, tmp_path, monkeypatch):
    import powerinfer_cpp.sparse.pipeline as SC
    from powerinfer_cpp.convert import convert

    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")

    def boom(*a, **k):
        raise RuntimeError("training failed")

    monkeypatch.setattr(SC, "train_predictors", boom)
    with pytest.raises(RuntimeError, match="training failed"):
        convert(random_sparse["hf"], out, "f32", progress=False, sparse=True,
                sparse_options=SC.SparseOptions(calib_tokens=256, profile_ctx=128))
    assert out.read_bytes() == b"old"  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]  # no temp dense file, no partial output


def test_cli_sparse_errors(tmp_path):
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    from powerinfer_cpp._native import lib_path  # the child uses the library this process loaded
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), GH_LIBRARY=str(lib_path))
    silu = make_llama_model(tmp_path / "silu", act="silu", n_layer=1, d=32, n_ff=64)
    relu = make_llama_model(tmp_path / "relu", act="relu", n_layer=1, d=32, n_ff=64)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "powerinfer_cpp.convert", *map(str, args), "-q"], env=env,
                              capture_output=True, text=True, timeout=120)

    # non-ReLU gated: --sparse (and the default) is the gate-threshold quality budget
    p = run(silu, "-o", tmp_path / "a.gguf", "--sparse", "--calib", HELDOUT, "--calib-tokens", "512")
    assert p.returncode == 0, p.stderr
    assert F.KEY_SPARSE_GATE_THRESHOLD in _fields(tmp_path / "a.gguf")
    (tmp_path / "a.gguf").unlink()
    p = run(relu, "-o", tmp_path / "b.gguf")  # sparse by default for ReLU; no calibration text
    assert p.returncode == 1 and "--calib" in p.stderr and "Traceback" not in p.stderr
    p = run(relu, "-o", tmp_path / "c.gguf", "--vram-budget", "lots")
    assert p.returncode == 1 and "--vram-budget" in p.stderr
    assert not any(x.suffix == ".gguf" or x.name.startswith(".") for x in tmp_path.iterdir())
    p = run(silu, "-o", tmp_path / "d.gguf")  # the budget needs calibration text: says where
    assert p.returncode == 1 and "heldout.txt" in p.stderr and "--calib" in p.stderr, p.stderr
    p = run(silu, "-o", tmp_path / "d.gguf", "--dense")
    assert p.returncode == 0, p.stderr
    assert not F.is_sparse(_fields(tmp_path / "d.gguf"))


# ---------------------------------------------------------------------------
# the shipped trained model
# ---------------------------------------------------------------------------

@pytest.mark.skipif(not (SHIPPED / "model.safetensors").exists(), reason="shipped model not trained yet")
def test_shipped_model_pipeline(tmp_path):
    """convert --sparse on the shipped trained model with the defaults (16384 tokens of
    its heldout.txt): every layer's stored predictor reaches recall >= 0.99 on the
    held-out 20% of the calibration tokens; on the rest of heldout.txt (text the
    pipeline never saw) recall stays >= 0.98. Precision is reported."""
    import time

    from powerinfer_cpp import Model
    from powerinfer_cpp.convert import convert
    from powerinfer_cpp.gguf_write import decode_matrix
    from powerinfer_cpp.sparse.pipeline import SparseOptions
    from powerinfer_cpp.sparse.profile import profile_model

    rep = []
    t0 = time.perf_counter()
    out = Path(convert(SHIPPED, tmp_path / "tiny-sparse.gguf", "f16", progress=False, sparse=True,
                       sparse_options=SparseOptions(vram_budget=parse_size("8M")), report=rep))
    secs = time.perf_counter() - t0
    rep = rep[0]
    assert rep.n_calib_tokens == 16384
    dense = Path(convert(SHIPPED, tmp_path / "tiny-dense.gguf", "f16", progress=False))
    m = Model(out, n_ctx=512)
    assert m.info.has_predictor == m.info.n_layer
    assert len(m.generate("And God said", max_tokens=8).tokens) > 0
    ids = m.tokenize(HELDOUT.read_text(encoding="utf-8"))
    fresh = ids[rep.n_calib_tokens:]
    assert len(fresh) >= 2048
    prof = profile_model(dense, fresh, n_ctx=512, progress=False)
    t = _tensors(out)
    lines = [f"shipped model: sparse conversion {secs:.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in rep.seconds.items())}); "
             f"{rep.placement.summary()}"]
    for l in range(m.info.n_layer):
        fc1, fc2 = t[F.sparse_tensor_name(F.T_FC1, l)], t[F.sparse_tensor_name(F.T_FC2, l)]
        h = int(fc1.shape[1])
        w1 = decode_matrix(fc1.data, fc1.tensor_type, (h, m.info.n_embd))
        w2 = decode_matrix(fc2.data, fc2.tensor_type, (m.info.n_ff, h))
        rec_h, prec_h, dens_h = rep.stored_recall[l]
        rec, prec, dens = evaluate(w1, w2, prof.x[l], prof.mask[l], 0.0)
        lines.append(f"layer {l}: h={h} ({rep.pred_bytes[l] / rep.ffn_bytes[l]:.1%} of the FFN bytes); held-out: "
                     f"recall {rec_h:.4f} precision {prec_h:.3f} predicted density {dens_h:.3f} (true "
                     f"{rep.density[l]:.3f}); unseen text ({len(fresh)} tokens): recall {rec:.4f} precision "
                     f"{prec:.3f} predicted density {dens:.3f} (true {prof.mask[l].mean():.3f})")
        assert rec_h >= 0.99, lines[-1]
        assert rec >= 0.98, lines[-1]
    print("\n".join(lines))
    m.close()


def test_profile_memory_check_counts_the_page_cache(monkeypatch, tmp_path):
    """The profile's memory check uses what can be allocated (MemAvailable: free memory plus
    droppable page cache), not the free pages alone, which after reading a model file can be
    a small share of memory; and it refuses a profile that does not fit, saying what to do."""
    import os

    from powerinfer_cpp.convert import convert
    from powerinfer_cpp.sparse import profile as P

    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert P._available_memory() >= free
    monkeypatch.setattr(P, "_available_memory", lambda: 1 << 20)
    path = convert(SHIPPED, tmp_path / "m.gguf", "f32", progress=False)
    with pytest.raises(MemoryError, match="smaller max_tokens"):
        P.profile_model(path, list(range(3, 300)), n_ctx=64, progress=False)
