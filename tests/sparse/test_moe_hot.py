"""Hot neurons of sparse experts on the device (issue 26): a ReLU-family mixture converted with
sparse experts (ffn_down_exps_t) carries a record of each expert's hot neurons
(blk.N.ffn_exp_hot_count / ffn_exp_hot, docs/FORMAT.md "Hot neurons of experts"); the
loader uploads those rows (model/placement.c) and the FFN executor splits each selected
expert's list between the device and the CPU as it splits a dense layer's (ffn/exec.c,
ffn/moe.c).

- host-device equals CPU-only (the sparse experts' host-device bound) with no, some and all
  neurons placed, in the gate, oracle and dense modes, with the expert cache asked for, with
  n_cpu_moe; a batch equals its tokens; the oracle still equals dense;
- the placement (sparse/experts.py solve_expert_neurons) against brute force on tiny
  instances, and from a profile to the file to the loader;
- bad records refused by name at load."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import make_hf_model  # noqa: E402

from conftest import REPO_DIR, SHIPPED_DIR  # noqa: E402
from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.expert_sparsity import profile_expert_neurons  # noqa: E402
from powerinfer_cpp.sparse.experts import (expert_hot_tensors, solve_expert_neurons)  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402

torch.set_num_threads(1)

HELDOUT = SHIPPED_DIR / "heldout.txt"
N_POS = 12


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtral-relu-hot")
    hf = make_hf_model("mixtral-relu", d / "hf", seed=11)
    sparse = convert(hf, d / "sparse.gguf", "f32", progress=False, sparse=True,
                     sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=300, profile_ctx=100))
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 300, size=N_POS)]
    with Model(sparse) as m:
        info = m.info
        cpu = {mode: _decode(m, ids, mode)[0] for mode in ("gate", "oracle", "dense")}
    return {"dir": d, "sparse": sparse, "ids": ids, "cpu": cpu, "nl": info.n_layer,
            "ne": info.n_expert, "ff": info.n_ff_exp}


def _decode(m, ids, mode, **kw):
    ctx = m.create_context(n_ctx=64, cache_type="f32", ffn=mode, **kw)
    rows = np.stack([ctx.eval([t]) for t in ids]).astype(np.float64)
    return rows, ctx.stats()


def _record(case, which: str, seed: int = 0):
    """hot[l][e] ascending ids: "none", "some" (a random subset of each of some experts, a
    whole expert among them), "all" (every neuron of every expert)."""
    rng = np.random.default_rng(seed)
    nl, ne, ff = case["nl"], case["ne"], case["ff"]
    hot = [[np.zeros(0, np.int32) for _ in range(ne)] for _ in range(nl)]
    for l, e in itertools.product(range(nl), range(ne)):
        if which == "all" or (which == "some" and (l, e) == (0, 1)):
            hot[l][e] = np.arange(ff, dtype=np.int32)
        elif which == "some" and (l + e) % 2 == 0:
            n = int(rng.integers(1, ff))
            hot[l][e] = np.sort(rng.choice(ff, size=n, replace=False)).astype(np.int32)
    return hot


def _write(case, hot, name):
    add = {}
    for l, row in enumerate(hot):
        add[F.expert_hot_tensor_name(F.T_FFN_EXP_HOT_COUNT, l)] = np.array([len(h) for h in row], np.int32)
        ids = np.concatenate(row).astype(np.int32)
        if ids.size:
            add[F.expert_hot_tensor_name(F.T_FFN_EXP_HOT, l)] = ids
    return rewrite_gguf(case["sparse"], case["dir"] / name, add=add)


def _check(case, got: dict, atol_share=2e-5):
    for mode, rows in got.items():
        want = case["cpu"][mode]
        np.testing.assert_allclose(rows, want, rtol=0, atol=atol_share * np.ptp(want), err_msg=mode)


@pytest.mark.parametrize("which", ["none", "some", "all"])
def test_host_device_with_hot_neurons_equals_cpu(case, which):
    """Every placement runs the gate, oracle and dense modes equal to CPU-only; the device's
    neurons are the record's, its bytes grow with them, and a whole expert on the device
    leaves none of its rows to the CPU."""
    hot = _record(case, which)
    path = _write(case, hot, f"hot-{which}.gguf")
    want_counts = np.array([[len(h) for h in row] for row in hot], np.int32)
    with Model(path, device="host-device", vram_budget="64M") as m:
        info = m.device_info()
        np.testing.assert_array_equal(m.expert_hot_counts(), want_counts)
        assert info["experts"]["hot_experts"] == int((want_counts > 0).sum())
        assert info["n_hot"] == int(want_counts.sum())
        assert info["index_source"] == ("file" if want_counts.sum() else "none")
        row = 3 * 4 * 64  # gate, up and down_t rows of 64 f32 values
        assert info["hot_bytes"] == int(want_counts.sum()) * row
        got, stats = {}, {}
        for mode in ("gate", "oracle", "dense"):
            got[mode], stats[mode] = _decode(m, case["ids"], mode)
    _check(case, got)
    # the CPU's up and down rows: none left when every neuron is on the device
    cpu_rows = stats["gate"]["n_up_rows"] + stats["gate"]["n_down_rows"]
    assert (cpu_rows == 0) == (which == "all")
    dev = stats["gate"]["device"]["bytes_device"]
    with Model(case["sparse"], device="host-device", vram_budget="64M") as m:
        base = _decode(m, case["ids"], "gate")[1]["device"]["bytes_device"]
    assert (dev > base) == (which != "none")


def test_cache_and_n_cpu_moe_with_hot_neurons(case):
    """An expert cache asked for is not made for sparse experts (the loader says so) and the
    hot neurons still run; n_cpu_moe keeps the first layers' experts wholly on the CPU."""
    path = _write(case, _record(case, "all"), "hot-all-cache.gguf")
    with Model(path, device="host-device", vram_budget="64M", expert_cache="1M") as m:
        info = m.device_info()
        assert "expert cache" in info["note"] and info["experts"]["cache_slots"] == 0
        assert info["experts"]["hot_experts"] == case["nl"] * case["ne"]
        got = {mode: _decode(m, case["ids"], mode)[0] for mode in ("gate", "oracle")}
    _check(case, got)
    with Model(path, device="host-device", vram_budget="64M", n_cpu_moe=1) as m:
        counts = m.expert_hot_counts()
        assert (counts[0] == 0).all() and (counts[1:] == case["ff"]).all()
        got = {mode: _decode(m, case["ids"], mode)[0] for mode in ("gate",)}
    _check(case, got)


def test_a_batch_equals_its_tokens_with_hot_neurons(case):
    """Prompt chunks within the sparse batch (each token its own split) equal one token at a
    time bit for bit; a prompt past it (experts dense on the CPU) within the bound."""
    path = _write(case, _record(case, "some", seed=3), "hot-some-batch.gguf")
    ids = case["ids"]
    with Model(path, device="host-device", vram_budget="64M") as m:
        one, _ = _decode(m, ids, "gate")
        chunks = m.create_context(n_ctx=64, cache_type="f32", n_batch=3).eval(ids, logits_all=True)
        np.testing.assert_array_equal(chunks, one.astype(np.float32))
        whole = m.create_context(n_ctx=64, cache_type="f32").eval(ids, logits_all=True)
        np.testing.assert_allclose(whole, one, rtol=0, atol=2e-5 * np.ptp(one))


def test_oracle_equals_dense_with_hot_neurons(case):
    path = _write(case, _record(case, "some", seed=5), "hot-some-oracle.gguf")
    with Model(path, device="host-device", vram_budget="64M") as m:
        oracle, _ = _decode(m, case["ids"], "oracle")
        dense, _ = _decode(m, case["ids"], "dense")
    np.testing.assert_allclose(oracle, dense, rtol=0, atol=2e-5 * np.ptp(dense))


def test_a_record_that_does_not_fit_leaves_the_experts_on_the_cpu(case):
    path = _write(case, _record(case, "all"), "hot-all-small.gguf")
    with Model(case["sparse"], device="host-device") as m:
        dense = m.device_info()["dense_bytes"]
    with Model(path, device="host-device", vram_budget=dense + 1000) as m:
        info = m.device_info()
        assert "need" in info["note"] and info["n_hot"] == 0
        assert (m.expert_hot_counts() == 0).all()
        got = {"gate": _decode(m, case["ids"], "gate")[0]}
    _check(case, got)


# ---- the placement ----------------------------------------------------------------------------

def _brute(freq, nfreq, row_bytes, left, gs, whole):
    """The best total value over every choice of a prefix of each expert's value-sorted groups."""
    nl, ne, ff = nfreq.shape
    per = []
    for l, e in itertools.product(range(nl), range(ne)):
        g, u, dn = row_bytes[l]
        v = freq[l, e] * (g + nfreq[l, e] * (u + dn))
        v = np.sort(v)[::-1]
        size = ff if whole else gs
        opts = [(0.0, 0)]
        for n in range(size, ff + size, size):
            n = min(n, ff)
            opts.append((float(v[:n].sum()), n * (g + u + dn)))
        per.append(opts)
    best = 0.0
    for choice in itertools.product(*per):
        b = sum(c[1] for c in choice)
        if b <= left:
            best = max(best, sum(c[0] for c in choice))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_placement_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    nl, ne, ff = 2, 2, 6
    freq = rng.uniform(0, 1, (nl, ne))
    nfreq = rng.uniform(0, 1, (nl, ne, ff)) ** 2
    row_bytes = [(8, 8, 8), (4, 12, 8)]
    total = sum(ne * ff * sum(r) for r in row_bytes)
    for left in (0, total // 7, total // 3, total // 2, total):
        for whole in (False, True):
            pl = solve_expert_neurons(freq, nfreq, row_bytes, left, group_size=2, whole=whole)
            want = _brute(freq, nfreq, row_bytes, left, 2, whole)
            assert pl.bytes <= left
            assert pl.value == pytest.approx(want, rel=1e-9, abs=1e-9), (left, whole)
            assert pl.value >= pl.greedy_value - 1e-9
            # the ids are each expert's most valuable neurons, ascending
            for l, e in itertools.product(range(nl), range(ne)):
                h = pl.hot[l][e]
                assert (np.diff(h) > 0).all()
        # hot groups never serve less than whole experts in the same bytes
        assert (solve_expert_neurons(freq, nfreq, row_bytes, total // 3, group_size=2).value >=
                solve_expert_neurons(freq, nfreq, row_bytes, total // 3, whole=True).value - 1e-9)


def test_placement_refuses_bad_inputs():
    f, nf = np.full((1, 2), 0.5), np.full((1, 2, 4), 0.5)
    with pytest.raises(ValueError, match="nfreq"):
        solve_expert_neurons(f, nf[:, :1], [(4, 4, 4)], 100)
    with pytest.raises(ValueError, match="neuron frequencies"):
        solve_expert_neurons(f, nf * 3, [(4, 4, 4)], 100)
    with pytest.raises(ValueError, match="one \\(gate, up, down_t\\) entry per layer"):
        solve_expert_neurons(f, nf, [], 100)


def test_profile_to_file_to_loader(case):
    """From the runtime's profile (the neurons' activity inside each expert at the file's
    thresholds) to the solved record, written and loaded: the device holds what the solve
    chose and the gate mode still equals CPU-only."""
    freq, nfreq, dfreq, row_bytes = profile_expert_neurons(case["sparse"], HELDOUT.read_text(encoding="utf-8"),
                                                    n_ctx=100, max_tokens=300)
    assert freq.shape == (case["nl"], case["ne"]) and nfreq.shape == (case["nl"], case["ne"], case["ff"])
    np.testing.assert_allclose(freq.sum(axis=1), 2.0)  # top-2: a layer's shares sum to k
    assert 0.2 < nfreq[freq > 0].mean() < 0.8  # ReLU: about half the gates pass
    np.testing.assert_array_equal(dfreq, nfreq)  # ReGLU: relu(g) * u is nonzero where g passes
    assert row_bytes == [(256, 256, 256)] * case["nl"]
    left = case["nl"] * case["ne"] * case["ff"] * 768 // 4
    pl = solve_expert_neurons(freq, nfreq, row_bytes, left, group_size=16)
    whole = solve_expert_neurons(freq, nfreq, row_bytes, left, whole=True)
    assert pl.value >= whole.value and 0 < pl.bytes <= left
    path = rewrite_gguf(case["sparse"], case["dir"] / "hot-solved.gguf", add=expert_hot_tensors(pl, nfreq))
    with Model(path, device="host-device", vram_budget="64M") as m:
        np.testing.assert_array_equal(m.expert_hot_counts(), pl.counts)
        got = {"gate": _decode(m, case["ids"], "gate")[0]}
    _check(case, got)


# ---- bad records -----------------------------------------------------------------------------

def test_bad_records_refused_by_name(case, tmp_path):
    ne, ff = case["ne"], case["ff"]
    good = _record(case, "some", seed=1)
    counts0 = np.array([len(h) for h in good[0]], np.int32)
    ids0 = np.concatenate(good[0]).astype(np.int32)
    base = {}
    for l, row in enumerate(good):
        base[f"blk.{l}.ffn_exp_hot_count"] = np.array([len(h) for h in row], np.int32)
        base[f"blk.{l}.ffn_exp_hot"] = np.concatenate(row).astype(np.int32)

    def with_(**changes):
        add = dict(base)
        for k, v in changes.items():
            name = k.replace("__", ".")
            if v is None:
                add.pop(name)
            else:
                add[name] = v
        return add

    out_of_range = ids0.copy()
    out_of_range[-1] = ff
    descending = ids0.copy()
    descending[:2] = descending[1::-1]
    too_many = counts0.copy()
    too_many[0] = ff + 1
    cases = [
        (with_(**{"blk.0.ffn_exp_hot": out_of_range}),
         rf"tensor 'blk\.0\.ffn_exp_hot': expert \d+'s hot neuron \d+ is {ff}, out of range \[0, {ff}\)"),
        (with_(**{"blk.0.ffn_exp_hot": descending}), r"tensor 'blk\.0\.ffn_exp_hot': expert 0's hot neuron ids must ascend"),
        (with_(**{"blk.0.ffn_exp_hot": ids0[:-1]}),
         rf"tensor 'blk\.0\.ffn_exp_hot' has {ids0.size - 1} I32 values, but 'blk\.0\.ffn_exp_hot_count' counts {ids0.size}"),
        (with_(**{"blk.0.ffn_exp_hot_count": too_many}),
         rf"tensor 'blk\.0\.ffn_exp_hot_count': expert 0's count is {ff + 1} \(must be in \[0, {ff}\]"),
        (with_(**{"blk.0.ffn_exp_hot_count": counts0[:-1]}),
         rf"tensor 'blk\.0\.ffn_exp_hot_count' has shape \[{ne - 1}, 1, 1, 1\], expected a vector of {ne}"),
        (with_(**{"blk.1.ffn_exp_hot_count": None, "blk.1.ffn_exp_hot": None}),
         r"tensor 'blk\.1\.ffn_exp_hot_count' is missing"),
        (with_(**{"blk.0.ffn_exp_hot_count": None, "blk.0.ffn_exp_hot": None}),
         r"'blk\.0\.ffn_exp_hot_count' is missing: every layer needs its record"),
        (with_(**{"blk.0.ffn_exp_hot_count": None}), r"tensor 'blk\.0\.ffn_exp_hot' without 'blk\.0\.ffn_exp_hot_count'"),
        (with_(**{"blk.0.ffn_exp_hot": None}), r"tensor 'blk\.0\.ffn_exp_hot' is missing: 'blk\.0\.ffn_exp_hot_count' counts"),
    ]
    for i, (add, match) in enumerate(cases):
        path = rewrite_gguf(case["sparse"], tmp_path / f"bad{i}.gguf", add=add)
        with pytest.raises(NativeError, match=match):
            Model(path)


def test_a_record_in_a_dense_experts_file_is_refused(tmp_path):
    hf = make_hf_model("mixtral-relu", tmp_path / "hf", seed=11)
    dense = convert(hf, tmp_path / "f32.gguf", "f32", progress=False)
    with Model(dense) as m:
        ne, nl = m.info.n_expert, m.info.n_layer
    add = {f"blk.{l}.ffn_exp_hot_count": np.zeros(ne, np.int32) for l in range(nl)}
    with pytest.raises(NativeError, match=r"tensor 'blk\.0\.ffn_exp_hot_count': hot neurons of experts "
                                          r"need the experts' sparse form"):
        Model(rewrite_gguf(dense, tmp_path / "bad.gguf", add=add))


def test_format_doc_lists_the_hot_neurons_of_experts():
    import re

    text = (REPO_DIR / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    start = text.index("## Hot neurons of experts\n")
    sec = text[start:text.index("\n## ", start + 1)]
    tensors = set(re.findall(r"^\| `blk\.N\.([a-z_]+)` \|", sec, re.M))
    assert tensors == set(F.EXPERT_HOT_TENSORS)


def test_place_profile_writes_the_hot_neurons_the_loader_uses(case, tmp_path):
    """place --profile on a sparse-experts file: the profile's neuron activity inside each
    expert, the ILP's hot neurons for the bytes the budget leaves after attention, routers and
    head, in the side file (default) or a whole file (-o); the loader places exactly those
    rows at that budget (they fit: the same budget order) and inspect shows them."""
    import shutil

    from powerinfer_cpp.inspect import describe
    from powerinfer_cpp.place import main, replace_expert_placement

    path = str(tmp_path / "m.gguf")
    shutil.copy(case["sparse"], path)
    with Model(path, device="host-device") as m:
        dense = m.device_info()["dense_bytes"]
    quarter = case["nl"] * case["ne"] * case["ff"] * 768 // 4
    budget = dense + quarter
    pl = replace_expert_placement(path, budget, profile=str(HELDOUT), profile_tokens=300, n_ctx=100)
    assert 0 < pl.bytes <= quarter and pl.value >= pl.greedy_value - 1e-9
    with Model(path, device="host-device", vram_budget=budget) as m:
        info = m.device_info()
        np.testing.assert_array_equal(m.expert_hot_counts(), pl.counts)
        assert info["index_source"] == "file" and info["hot_bytes"] == pl.bytes
        got = {"gate": _decode(m, case["ids"], "gate")[0]}
    _check(case, got)
    text = describe(path)
    assert "profiled over 300 tokens of heldout.txt" in text and "hot neurons of experts" in text
    assert f"/{case['ff']}]" in text
    out = str(tmp_path / "whole.gguf")
    assert budget % 1024 == 0  # (the CLI's sizes: K, M, G; a bare number is GiB)
    assert main([path, "--vram-budget", f"{budget // 1024}K", "--profile", str(HELDOUT), "--profile-tokens", "300",
                 "-o", out, "-q"]) == 0
    import gguf

    # (the CLI profiles in windows of its own n_ctx: its solution is its own)
    by = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(out).tensors}
    written = np.stack([by[f"blk.{l}.ffn_exp_hot_count"].reshape(-1) for l in range(case["nl"])])
    assert written.sum() > 0
    with Model(out, device="host-device", vram_budget=budget) as m:
        np.testing.assert_array_equal(m.expert_hot_counts(), written)
    with pytest.raises(Exception, match="pass --profile TEXT"):
        replace_expert_placement(path, budget)


def test_profile_predicts_the_rows_the_device_takes(case):
    """The placement's cost model is the runtime's: over the same tokens (windows of the
    profile's n_ctx), the up and down_t rows the CPU no longer reads with a record placed
    (its statistics, against CPU-only) are the profile's count of the placed neurons'
    (token, neuron) entries: freq · tokens · listed share for up, · nonzero share for down."""
    with Model(case["sparse"]) as m:
        ids = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[500:700]
    freq, nfreq, dfreq, _ = profile_expert_neurons(case["sparse"], ids, n_ctx=100)
    hot = _record(case, "some", seed=7)
    path = _write(case, hot, "hot-some-rows.gguf")

    def rows(p, **kw):
        with Model(p, n_ctx=100, **kw) as m:
            ctx = m.create_context(n_ctx=100, ffn="gate")
            for i, t in enumerate(ids):
                if i % 100 == 0:
                    ctx.reset(0)
                ctx.eval([t])
            st = ctx.stats()
        return st["n_up_rows"], st["n_down_rows"]

    up0, dn0 = rows(case["sparse"])
    up, dn = rows(path, device="host-device", vram_budget="64M")
    want_up = sum(freq[l, e] * len(ids) * nfreq[l, e, h].sum() for l, row in enumerate(hot) for e, h in enumerate(row))
    want_dn = sum(freq[l, e] * len(ids) * dfreq[l, e, h].sum() for l, row in enumerate(hot) for e, h in enumerate(row))
    assert up0 - up == pytest.approx(want_up, abs=1e-6 * up0) and up0 - up > 0
    assert dn0 - dn == pytest.approx(want_dn, abs=1e-6 * dn0)


@pytest.mark.parametrize("fault", ["hot_ffn:1", "matmul:6", "sync:4"])
def test_device_fault_in_an_expert_split(case, monkeypatch, fault):
    """A device failure in an expert's split (its hot rows, hot_ffn:1; in the gate mode its
    hot gate rows, the layer's sixth matmul after q, k, v, o and the router; the wait for
    them, the fourth sync after q/k/v, o and the router's) ends the call with the device's
    error, the context back where it was, and the same tokens again give what a context
    that never failed gives."""
    path = _write(case, _record(case, "all"), "hot-all-fault.gguf")
    ids = case["ids"][:3]
    with Model(path, device="host-device", vram_budget="64M") as m:
        want = m.create_context(n_ctx=64, cache_type="f32", ffn="gate").eval(ids)
    monkeypatch.setenv("GH_HOST_DEVICE_FAULT", fault)
    try:
        m = Model(path, device="host-device", vram_budget="64M")
    finally:
        monkeypatch.delenv("GH_HOST_DEVICE_FAULT", raising=False)
    with m:
        c = m.create_context(n_ctx=64, cache_type="f32", ffn="gate")
        op = fault.split(":")[0]
        with pytest.raises(NativeError, match=rf"device 'host-device' failed during gh_eval \(the context "
                                              rf"is back at 0 tokens\): host-device: {op} failed: injected"):
            c.eval(ids)
        assert c.n_past == 0
        np.testing.assert_array_equal(c.eval(ids), want)


def test_hot_counts_api_checks_its_buffer(case):
    from powerinfer_cpp._native import ffi, lib

    with Model(case["sparse"]) as m:
        assert (m.expert_hot_counts() == 0).all()  # the CPU: none
        buf = ffi.new("int32_t[]", 1)
        with m._calling() as ptr:
            assert lib.gh_model_expert_hot_counts(ptr, buf, 1) != 0
            assert "counts holds 1 values" in ffi.string(lib.gh_last_error()).decode()
