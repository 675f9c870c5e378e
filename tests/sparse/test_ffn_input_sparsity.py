"""Input sparsity of the FFN (convert --input-ffn, docs/FORMAT.md "Input sparsity") and the
per-site allocation by KL (sparse/site_allocation.py): the FFN op (gate/up over the used
inputs' columns, down over the rows whose |act(g) * u| passes) against numpy for several
types, SIMD levels and thread counts, with empty, one and all inputs/rows kept; on the
shipped SwiGLU model the FFN sites' held-out sparsity at the requested level, a file at
level 0 equal to the gate mode without input sparsity, the bytes following the densities;
the generalized greedy allocation on made-up curves and on the model's measured ones; WINA on
every site (the FFN's included) at its level on held-out text, the proxy's output errors
against numpy, a per-site mixed-criterion table at level 0 equal to dense."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp._native import check, ffi, lib  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.gate_eval import GateEvaluator  # noqa: E402
from powerinfer_cpp.sparse.input_eval import patch_calibration  # noqa: E402
from powerinfer_cpp.sparse.input_sparsity import SITE_DOWN, SITE_FFN, down_inputs  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402
from powerinfer_cpp.sparse.site_allocation import (SiteTable, allocate_sites, group_sites,  # noqa: E402
                                                   predicted_bytes, site_bytes, site_costs)
from powerinfer_cpp.sparse.thresholds import greedy_allocation  # noqa: E402

from cbuf import fptr  # noqa: E402
from conftest import SHIPPED_SWIGLU_DIR  # noqa: E402
from opref import F32, TYPES, axpy_int8_bound, block_cols, encode, vptr  # noqa: E402

HELDOUT = SHIPPED_SWIGLU_DIR / "heldout.txt"
S_IN = 0.3


def silu(g):
    return g / (1.0 + np.exp(-g))


def ffn_op(t, gu_raw, dt, d_raw, d, ff, x, thr_in, thr_down, n_threads):
    y = np.full(d, np.nan, np.float32)
    ni, nd = ffi.new("int64_t *"), ffi.new("int64_t *")
    check(lib.gh_op_ffn_input_sparse(t, vptr(gu_raw), dt, vptr(d_raw), d, ff, 1, lib.GH_ACT_SILU, 0.0, fptr(x),
                                     fptr(thr_in) if thr_in is not None else ffi.NULL,
                                     fptr(thr_down) if thr_down is not None else ffi.NULL,
                                     fptr(y), ni, nd, n_threads))
    return y, int(ni[0]), int(nd[0])


def _between(v: np.ndarray, share: float) -> float:
    """A threshold halfway between two neighbouring sorted values near the share's quantile,
    so the float32 rounding of the runtime's h cannot move a value across it."""
    s = np.sort(np.abs(v))
    gaps = np.diff(s)
    k = int(share * (len(s) - 1))
    k = max(0, min(len(gaps) - 1, k))
    lo = max(0, k - 4)
    j = lo + int(np.argmax(gaps[lo:k + 5]))
    return float((s[j] + s[j + 1]) / 2)


@pytest.mark.parametrize("tname", ["f32", "f16", "q8_0", "q4_0"])
def test_ffn_op_vs_numpy(tname):
    t = TYPES[tname]
    d, ff = block_cols(t, 64), block_cols(t, 96)
    rng = np.random.default_rng(d + ff)
    gu_raw, gu = encode(t, rng.standard_normal((d, 2 * ff)) * 0.2)
    d_raw, dw = encode(t, rng.standard_normal((ff, d)) * 0.2)
    x = rng.standard_normal(d).astype(np.float32)
    x[::7] = 0.0
    big = np.float32(1e30)
    one_in = np.full(d, big, np.float32)
    one_in[3] = 0.0
    for name, thr_in, down_share in (("all", None, None), ("half-in", "half", None),
                                     ("half-in half-down", "half", 0.5), ("all-in one-down", None, "one"),
                                     ("one-in", one_in, 0.3), ("empty-in", np.full(d, big, np.float32), None),
                                     ("empty-down", None, "empty")):
        if isinstance(thr_in, str):
            thr_in = np.full(d, _between(x, 0.5), np.float32)
        used = np.abs(x) > (thr_in if thr_in is not None else 0.0)
        g_u = x[used].astype(np.float64) @ gu[used].astype(np.float64)
        h = silu(g_u[:ff]) * g_u[ff:]
        if down_share is None:
            thr_down = None
        elif down_share == "one":
            thr_down = np.full(ff, big, np.float32)
            thr_down[int(np.argmax(np.abs(h)))] = 0.0
        elif down_share == "empty":
            thr_down = np.full(ff, big, np.float32)
        else:
            thr_down = np.full(ff, _between(h, down_share), np.float32) if used.any() else None
        keep = np.abs(h) > (thr_down if thr_down is not None else 0.0)
        ref = h[keep] @ dw[keep].astype(np.float64)
        scale = np.abs(h[keep]) @ np.abs(dw[keep]) if keep.any() else np.zeros(d)
        hscale = np.abs(x[used]) @ np.abs(gu[used]) if used.any() else np.zeros(2 * ff)
        prev = lib.gh_simd_get()
        for level in range(int(lib.gh_simd_supported()) + 1):
            assert lib.gh_simd_set(level) != -2
            try:
                y1, n1, m1 = ffn_op(t, gu_raw, t, d_raw, d, ff, x, thr_in, thr_down, 1)
                y2, n2, m2 = ffn_op(t, gu_raw, t, d_raw, d, ff, x, thr_in, thr_down, 2)
            finally:
                lib.gh_simd_set(prev)
            np.testing.assert_array_equal(y1, y2)  # threads split the columns
            assert n1 == n2 == int(used.sum()), (name, level)
            assert m1 == m2 == int(keep.sum()), (name, level)
            # gate/up's rounding (int8 forms included) moves h; then down's own
            up_err = 4e-7 * max(n1, 1) * hscale + 1e-6 + axpy_int8_bound(t, level, gu_raw, gu, np.flatnonzero(used),
                                                                         x[used])
            h_err = np.abs(silu(g_u[:ff]) * up_err[ff:]) + 1.2 * up_err[:ff] * np.abs(g_u[ff:]) + 1e-6
            tol = (4e-7 * max(m1, 1) * scale + h_err[keep] @ np.abs(dw[keep]) + 1e-5
                   + axpy_int8_bound(t, level, d_raw, dw, np.flatnonzero(keep), h[keep]))
            assert np.all(np.abs(y1 - ref) <= tol), (name, level, np.max(np.abs(y1 - ref) - tol))
        if not keep.any():
            assert np.all(y1 == 0), name


def test_ffn_op_bad_args():
    w = np.zeros(64, np.float32)
    y = np.zeros(4, np.float32)
    x = np.ones(4, np.float32)
    with pytest.raises(Exception, match="NULL buffer"):
        check(lib.gh_op_ffn_input_sparse(F32, vptr(w), F32, vptr(w), 4, 4, 1, lib.GH_ACT_SILU, 0.0, ffi.NULL, ffi.NULL,
                                         ffi.NULL, fptr(y), ffi.NULL, ffi.NULL, 1))
    with pytest.raises(Exception, match="activation"):
        check(lib.gh_op_ffn_input_sparse(F32, vptr(w), F32, vptr(w), 4, 4, 0, lib.GH_ACT_DRELU, 0.0, fptr(x), ffi.NULL,
                                         ffi.NULL, fptr(y), ffi.NULL, ffi.NULL, 1))  # dReLU ungated
    with pytest.raises(Exception, match="n_threads"):
        check(lib.gh_op_ffn_input_sparse(F32, vptr(w), F32, vptr(w), 4, 4, 1, lib.GH_ACT_SILU, 0.0, fptr(x), ffi.NULL,
                                         ffi.NULL, fptr(y), ffi.NULL, ffi.NULL, 0))


def test_down_inputs_vs_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    g, u = x.astype(np.float64) @ w[:, :6], x.astype(np.float64) @ w[:, 6:]
    np.testing.assert_allclose(down_inputs(x, w, F.ACT_SILU), silu(g) * u, rtol=1e-5, atol=1e-6)


# ---- the shipped SwiGLU model: gate mode at 0, every site's inputs ----------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ffn-input-sparsity")
    rep: list = []
    path = convert(SHIPPED_SWIGLU_DIR, d / "in.gguf", "f16", progress=False, sparse=True, report=rep,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=3072, profile_ctx=256,
                                                sparsity=0.0, input_sparsity=S_IN, input_tokens=2048,
                                                input_ffn=True, input_refit=False, n_threads=1))
    with Model(path, n_ctx=16) as m:
        later = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[rep[0].n_calib_tokens:]
    return {"path": path, "rep": rep[0], "later": later, "dir": d}


def _run(path, ids, input_sparse=None, window=256):
    with Model(path, n_ctx=window, n_threads=1, cache_type="f32") as m:
        # the file's gate mode (`auto` picks dense where the estimate says so)
        ctx = m.create_context(n_ctx=window, n_threads=1, cache_type="f32", ffn="file",
                               input_sparse=input_sparse)
        ctx.sparse_batch = window
        out = []
        for s in range(0, len(ids), window):
            ctx.reset()
            out.append(ctx.eval(ids[s:s + window], logits_all=True).copy())
        st = ctx.stats()
        ctx.close()
    return np.concatenate(out), st


def test_file_and_heldout_sparsity(files):
    cal = files["rep"].input_calibration
    assert len(cal.ffn) == len(cal.down) == 4
    names = {t.name for t in gguf.GGUFReader(files["path"]).tensors}
    for l in range(4):
        for k in F.FFN_INPUT_SPARSE_TENSORS:
            assert F.input_sparse_tensor_name(k, l) in names
    # the FFN's sites skip the requested share of held-out (profile) tokens within 3 points
    for site in (SITE_FFN, SITE_DOWN):
        assert abs(cal.heldout_sparsity[site] - S_IN) <= 0.03, cal.summary()
    # on held-out text in the runtime: the down rows read follow, and the FFN's bytes with them
    lg, st = _run(files["path"], files["later"][:512])
    assert st["ffn_mode"] == "gate"
    assert abs(st["density"] - (1 - S_IN)) <= 0.05, st["density"]
    per = st["bytes_per_token_stage"]["ffn"]
    nb = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(files["path"]).tensors}
    full = sum(nb[F.input_sparse_tensor_name(F.T_FFN_GATE_UP_T, l)] + nb[F.sparse_tensor_name(F.T_FFN_DOWN_T, l)]
               for l in range(4))
    assert 0.6 * full < per < 0.8 * full, (per, full)
    off, _ = _run(files["path"], files["later"][:512], input_sparse=False)
    assert not np.array_equal(lg, off)


def test_level_zero_equals_gate_mode(files):
    """Every threshold 0: the gate mode's own result, bit for bit (the FFN keeps its row path)."""
    z = files["dir"] / "zero.gguf"
    shutil.copy(files["path"], z)
    r = gguf.GGUFReader(z, "r+")
    for t in r.tensors:
        if t.name.endswith("_in_thr"):
            t.data[:] = 0.0
    r.data.flush()
    del r
    ids = files["later"][:200]
    on, _ = _run(z, ids, input_sparse=True)
    off, _ = _run(z, ids, input_sparse=False)
    np.testing.assert_array_equal(on, off)


def test_greedy_allocation_weights_and_cost():
    costs = np.array([[0.01, 0.04, 0.09], [0.01, 0.04, 0.09], [0.5, 1.0, 2.0]])
    grid = (0.25, 0.5, 0.75)
    # equal weights, a mean: the two cheap sites first (the old gate behaviour)
    lv = greedy_allocation(costs, 0.25, grid)
    assert lv[2] == 0 and sum(lv) == pytest.approx(0.75)
    # a heavy site that is ten times costlier per level but 100 times larger wins per byte
    lv = greedy_allocation(costs, None, grid, weights=[1.0, 1.0, 100.0], max_cost=0.5)
    assert lv[2] > 0
    # the summed cost stays within max_cost, and a larger budget only adds
    xs = np.concatenate([[0.0], grid])
    for kl in (0.01, 0.05, 0.2):
        lv = greedy_allocation(costs, None, grid, weights=[1.0, 2.0, 3.0], max_cost=kl)
        spent = sum(np.interp(v, xs, np.concatenate([[0.0], c])) for v, c in zip(lv, costs))
        assert spent <= kl + 1e-12
    a = greedy_allocation(costs, None, grid, max_cost=0.02)
    b = greedy_allocation(costs, None, grid, max_cost=0.1)
    assert all(y >= x for x, y in zip(a, b)) and sum(b) > sum(a)
    with pytest.raises(ValueError):
        greedy_allocation(costs, None, grid)
    with pytest.raises(ValueError):
        greedy_allocation(costs, 0.2, grid, weights=[1.0, 0.0, 1.0])


def test_site_greedy_on_the_model(files, tmp_path):
    """Each site's measured KL curve, then the greedy: larger budgets save more bytes, the
    allocation's summed curve cost stays within the budget and its measured KL is near it."""
    import copy
    from powerinfer_cpp.sparse.input_sparsity import calibrate_input_levels
    from powerinfer_cpp.sparse.profile import profile_model

    path = str(files["path"])
    with Model(path, n_ctx=16) as m:
        ids = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[:1024]
    prof = profile_model(path, ids, n_ctx=256, n_threads=1, progress=False, inputs=512)
    r = gguf.GGUFReader(path)
    tw = {t.name: t for t in r.tensors}
    from powerinfer_cpp.gguf_write import decode_matrix
    kinds = {"qkv": F.T_ATTN_QKV_T, "o": F.T_ATTN_OUTPUT_T, "head": F.T_OUTPUT_T, "ffn": F.T_FFN_GATE_UP_T}

    def weights_t(site, layer):
        t = tw[F.sparse_tensor_name(F.T_FFN_DOWN_T, layer) if site == "down"
               else F.input_sparse_tensor_name(kinds[site], layer)]
        return decode_matrix(np.asarray(t.data), t.tensor_type, tuple(int(v) for v in reversed(t.shape)))

    cals = calibrate_input_levels(prof, [0.0, 0.25, 0.5, 0.75], "magnitude", weights_t, ffn=True)
    del r, tw
    table = SiteTable(cals)
    assert len(table.keys) == 4 * 4 + 1
    ev_path = str(tmp_path / "ev.gguf")
    shutil.copy(path, ev_path)
    ev = GateEvaluator(ev_path, window=32, n_threads=1)
    tok = ids[512:545]
    keys = table.keys
    assert len(group_sites(keys, 1)) == 17
    groups = group_sites(keys, 2)  # two layers per group: 4 kinds x 2 + the head
    assert len(groups) == 9 and sorted(map(str, (k for g in groups for k in g))) == sorted(map(str, keys))
    costs = site_costs(lambda cal: ev.measure(tok, None, inputs=cal)["kl"], table, groups, (0.25, 0.5, 0.75),
                       progress=False)
    assert costs.shape == (9, 3) and np.all(costs >= 0) and costs[:, -1].sum() > 0
    w = site_bytes(path)
    assert set(w) == set(keys)
    budgets = (0.25 * costs[:, -1].sum() / 3, costs[:, -1].sum() / 3)
    saved, measured = [], []
    for kl in budgets:
        lv = allocate_sites(costs, groups, w, kl, (0.25, 0.5, 0.75))
        assert set(lv) == set(keys) and all(len({lv[k] for k in g}) == 1 for g in groups)
        xs = np.array([0.0, 0.25, 0.5, 0.75])
        spent = sum(np.interp(lv[g[0]], xs, np.concatenate([[0.0], np.maximum.accumulate(costs[i])]))
                    for i, g in enumerate(groups))
        assert spent <= kl + 1e-12
        saved.append(sum(w.values()) - predicted_bytes(lv, w))
        measured.append(ev.measure(tok, None, inputs=table.calibration(lv))["kl"])
    assert saved[1] > saved[0] > 0
    assert measured[1] > measured[0]
    # the level-0 calibration runs dense: no KL
    assert ev.measure(tok, None, inputs=copy.deepcopy(table.base))["kl"] < 1e-6
    patch_calibration(ev_path, table.base)


# ---- WINA on every site, the output-error proxy, per-site criteria ---------------------------


def test_output_errors_vs_numpy():
    """Both paths (direct, and through the Gram matrix when the output is wider) equal the
    squared output error of the skipped inputs computed directly, every input kept gives 0
    and every input skipped gives ||W x||^2."""
    from powerinfer_cpp.sparse.site_allocation import output_errors
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 16)).astype(np.float32)
    for n_out in (8, 40):  # narrower (direct) and wider (Gram) than the input
        w_t = rng.standard_normal((16, n_out)).astype(np.float32)
        thr = [np.zeros(16, np.float32), np.full(16, 0.5, np.float32), rng.uniform(0, 2, 16).astype(np.float32),
               np.full(16, np.inf, np.float32)]
        got = output_errors(x, w_t, thr)
        for t, g in zip(thr, got):
            skipped = np.where(np.abs(x) <= t, x, 0.0).astype(np.float64)
            want = float(np.mean(np.sum(np.square(skipped @ w_t.astype(np.float64)), axis=1)))
            assert g == pytest.approx(want, rel=1e-4, abs=1e-6)
        assert got[0] == 0.0
        assert got[-1] == pytest.approx(float(np.mean(np.sum(np.square(x.astype(np.float64) @ w_t), axis=1))),
                                        rel=1e-4)


def test_proxy_curves_scale_and_choice():
    from powerinfer_cpp.sparse.site_allocation import proxy_curves
    mag = np.array([[1.0, 4.0, 9.0], [2.0, 4.0, 8.0]])
    wina = np.array([[0.5, 5.0, 9.0], [2.0, 2.0, 2.0]])
    curves, choice = proxy_curves({"magnitude": mag, "wina": wina}, 1, np.array([0.04, 0.4]))
    # c = anchor KL / magnitude's error at the anchor level: 0.01 and 0.1
    np.testing.assert_allclose(curves, [[0.005, 0.04, 0.09], [0.2, 0.2, 0.2]])
    assert choice == [["wina", "magnitude", "magnitude"], ["magnitude", "wina", "wina"]]


@pytest.fixture(scope="module")
def wina_cal(files):
    """Magnitude and WINA calibrations of every site (the FFN's included) from one profile."""
    from powerinfer_cpp.gguf_write import decode_matrix
    from powerinfer_cpp.sparse.input_sparsity import calibrate_input_levels
    from powerinfer_cpp.sparse.profile import profile_model

    path = str(files["path"])
    with Model(path, n_ctx=16) as m:
        ids = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[:2048]
    prof = profile_model(path, ids, n_ctx=256, n_threads=1, progress=False, inputs=1024)
    r = gguf.GGUFReader(path)
    tw = {t.name: t for t in r.tensors}
    kinds = {"qkv": F.T_ATTN_QKV_T, "o": F.T_ATTN_OUTPUT_T, "head": F.T_OUTPUT_T, "ffn": F.T_FFN_GATE_UP_T}

    def weights_t(site, layer):
        t = tw[F.sparse_tensor_name(F.T_FFN_DOWN_T, layer) if site == "down"
               else F.input_sparse_tensor_name(kinds[site], layer)]
        return decode_matrix(np.asarray(t.data), t.tensor_type, tuple(int(v) for v in reversed(t.shape)))

    levels = [0.0, 0.15, S_IN, 0.45]
    cals = {c: calibrate_input_levels(prof, levels, c, weights_t, ffn=True) for c in F.INPUT_CRITERIA}
    w = {k: weights_t(*k) for k in cals["wina"][0].keys()}
    del r, tw
    return {"cals": cals, "levels": levels, "prof": prof, "w": w}


def test_wina_every_site_hits_its_level(files, wina_cal, tmp_path):
    """WINA's thresholds (t / ||W[:, i]||) on every site: the share skipped on the profile's
    held-out tokens and, in the runtime on later text, the down rows read, within 3 points of
    the requested level; the score is |x_i| * ||W[:, i]|| (numpy on the stored thresholds)."""
    from powerinfer_cpp.sparse.input_sparsity import column_norms
    cals, levels = wina_cal["cals"]["wina"], wina_cal["levels"]
    for cal, s in zip(cals[1:], levels[1:]):
        assert cal.criterion == "wina"
        for site, v in cal.heldout_sparsity.items():
            assert abs(v - s) <= 0.03, (site, s, cal.summary())
    cal = cals[levels.index(S_IN)]
    prof = wina_cal["prof"]
    for key in cal.keys():
        norm = column_norms(wina_cal["w"][key])
        thr = cal.thresholds(key)
        x = {"qkv": prof.attn_in, "o": prof.attn_out_in, "ffn": prof.x}.get(key[0])
        if key[0] == "head":
            x = prof.head_in
        elif key[0] == "down":
            continue  # its inputs are computed (down_inputs); the rule is the same
        else:
            x = x[key[1]]
        x = np.asarray(x[:cal.n_fit], np.float32)
        # the runtime's test |x_i| > thr_i is the score test |x_i| * norm_i > t (up to rounding)
        by_thr = np.abs(x) > thr[None, :]
        by_score = np.abs(x).astype(np.float64) * norm[None, :] > cal.t[key]
        assert float((by_thr != by_score).mean()) <= 1e-3
        assert abs(float((np.abs(x) * norm[None, :] <= cal.t[key]).mean()) - S_IN) <= 0.03
    p = tmp_path / "wina.gguf"
    shutil.copy(files["path"], p)
    patch_calibration(str(p), cal)
    _, st = _run(p, files["later"][:512])
    assert abs(st["density"] - (1 - S_IN)) <= 0.03, st["density"]  # down rows read on held-out text
    ins = st["input_sparse"]
    assert abs(float(ins["attention_density"]) - (1 - S_IN)) <= 0.05, ins
    assert abs(float(ins["head_density"]) - (1 - S_IN)) <= 0.05, ins


def test_mixed_table_level_zero_is_dense_and_picks_criteria(files, wina_cal, tmp_path):
    """MixedSiteTable: every site at 0 gives zero thresholds and the dense result exactly; at a
    level each site's thresholds are those of the criterion chosen for it."""
    from powerinfer_cpp.sparse.site_allocation import MixedSiteTable, SiteTable
    tables = {c: SiteTable(v) for c, v in wina_cal["cals"].items()}
    keys = tables["wina"].keys
    choice = {k: ["magnitude"] + ["wina" if i % 2 else "magnitude" for _ in tables["wina"].levels[1:]]
              for i, k in enumerate(keys)}
    mixed = MixedSiteTable(tables, choice)
    zero = mixed.calibration({})
    assert all(not np.any(zero.thresholds(k)) for k in keys)
    p = tmp_path / "mixed.gguf"
    shutil.copy(files["path"], p)
    patch_calibration(str(p), zero)
    ids = files["later"][:128]
    on, _ = _run(p, ids, input_sparse=True)
    off, _ = _run(p, ids, input_sparse=False)
    np.testing.assert_array_equal(on, off)
    cal = mixed.calibration({k: S_IN for k in keys})
    assert cal.criterion == "mixed"
    for i, k in enumerate(keys):
        want = tables["wina" if i % 2 else "magnitude"].calibration({k: S_IN}).thresholds(k)
        np.testing.assert_array_equal(cal.thresholds(k), want)
