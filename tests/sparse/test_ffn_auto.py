"""The `auto` FFN mode (gh_ffn_auto_decide, gh_model_ffn_auto): a file's sparse or gate mode
is kept only where its estimated FFN time is below dense, from the file's recorded density
and the kernel ratios per byte read that tools/bench_sparse_kernels.py measured. The rule's
arithmetic is checked here with fixed inputs against the formula written out (no timing);
on converted files, that the context starts in the mode the rule names and that inspect
says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_models import make_llama_model  # noqa: E402

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp._native import check, ffi, lib  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

DENSE, SPARSE, GATE = lib.GH_FFN_DENSE, lib.GH_FFN_SPARSE, lib.GH_FFN_GATE
F32, F16, Q4_0, Q8_0, Q6_K = (lib.GH_TYPE_F32, lib.GH_TYPE_F16, lib.GH_TYPE_Q4_0, lib.GH_TYPE_Q8_0,
                              lib.GH_TYPE_Q6_K)
AVX2, AVX512 = lib.GH_SIMD_AVX2, lib.GH_SIMD_AVX512
# the table's F16 rows (auto_mode.c): ratios at densities 10%, 50%, 90%, and the dense
# down_t axpy's
F16_AVX512_ROWS, F16_AVX512_COLS, F16_AVX512_DT = (0.46, 0.59, 0.70), (0.46, 0.59, 0.71), 1.11


def decide(candidate, density, type_gate=F16, type_down=F16, simd=AVX512, gate=1.0, up=1.0, down=1.0,
           pred=0.0, dense_down_t=0, full=False):
    i = ffi.new("gh_ffn_auto_in *")
    i.candidate, i.simd_level, i.type_gate, i.type_down, i.density = candidate, simd, type_gate, type_down, density
    i.bytes_gate, i.bytes_up, i.bytes_down, i.bytes_pred = gate, up, down, pred
    i.dense_down_t = dense_down_t
    out = ffi.new("gh_ffn_auto_choice *")
    check(lib.gh_ffn_auto_decide(i, out))
    r = (out.mode, out.est_time, out.ratio_rows, out.ratio_cols, ffi.string(out.why).decode())
    return r + (out.ratio_dt,) if full else r


def interp(v, d):
    xs = (0.1, 0.5, 0.9)
    if d <= xs[0]:
        return v[0]
    if d >= xs[2]:
        return v[2]
    k = 0 if d < xs[1] else 1
    return v[k] + (v[k + 1] - v[k]) * (d - xs[k]) / (xs[k + 1] - xs[k])


@pytest.mark.parametrize("d", [0.05, 0.1, 0.3, 0.5, 0.83, 0.9, 1.0])
def test_gate_estimate_is_the_formula(d):
    mode, t, rr, rc, why = decide(GATE, d)
    assert rr == pytest.approx(interp(F16_AVX512_ROWS, d), rel=1e-6)
    assert rc == pytest.approx(interp(F16_AVX512_COLS, d), rel=1e-6)
    expect = (1.0 + d / rr + d / rc) / 3.0  # the gate stays dense; up over rows, down over cols
    assert t == pytest.approx(expect, rel=1e-9)
    assert mode == (GATE if expect < 1.0 else DENSE)
    assert why.startswith("gate:" if mode == GATE else "dense:") and f"{expect:.2f}x" in why


@pytest.mark.parametrize("d", [0.1, 0.5, 0.83, 0.9])
def test_dense_baseline_is_the_down_t_axpy_where_the_file_has_down_t(d):
    # a gate or sparse file stores ffn_down_t: its dense FFN runs down as the axpy over every
    # row, at ratio_dt of the dense matmul's rate, and that is what the mode is compared with
    mode, t, rr, rc, why, rdt = decide(GATE, d, gate=1.0, up=2.0, down=3.0, dense_down_t=1, full=True)
    assert rdt == pytest.approx(F16_AVX512_DT, rel=1e-6)
    expect = (1.0 + d * 2.0 / rr + d * 3.0 / rc) / (1.0 + 2.0 + 3.0 / rdt)
    assert t == pytest.approx(expect, rel=1e-9)
    assert mode == (GATE if expect < 1.0 else DENSE)
    assert "down_t whole" in why and f"{rdt:.2f}" in why and f"{expect:.2f}x" in why
    # sparse: the predictor and every matrix over the same baseline
    mode, t, rr, rc, _, rdt = decide(SPARSE, d, gate=2.0, up=2.0, down=3.0, pred=0.25, dense_down_t=1, full=True)
    assert t == pytest.approx((0.25 + d * 4.0 / rr + d * 3.0 / rc) / (4.0 + 3.0 / rdt), rel=1e-9)
    # with ffn_down (dense_down_t 0) the baseline is the dense matmul: ratio_dt 1
    assert decide(GATE, d, full=True)[5] == 1.0


def test_a_slow_dense_down_t_keeps_the_mode():
    # Q6_K at AVX-512: the axpy over every row of down_t reads at half the dense matmul's
    # rate, so density 83% (SmolLM2's 2% budget) pays against it, not against the matmul
    # the file does not run
    d = 0.83
    assert decide(GATE, d, Q6_K, Q6_K, AVX512)[0] == DENSE
    assert decide(GATE, d, Q6_K, Q6_K, AVX512, dense_down_t=1)[0] == GATE


def test_smollm2_density_prefers_dense_and_low_density_keeps_gate():
    # SmolLM2's 2% budget: 16.9% gate sparsity (density 83%): slower than dense at F16 and Q4_0
    for t in (F16, Q4_0, Q8_0):
        for simd in (AVX2, AVX512):
            assert decide(GATE, 0.83, t, t, simd)[0] == DENSE
            assert decide(GATE, 0.83, t, t, simd, dense_down_t=1)[0] == DENSE
    # a ReLU-like density keeps the mode
    assert decide(GATE, 0.1)[0] == GATE
    assert decide(SPARSE, 0.1, pred=0.1)[0] == SPARSE


def test_sparse_counts_the_predictor_and_every_matrix():
    d, pred = 0.3, 0.25
    mode, t, rr, rc, _ = decide(SPARSE, d, gate=2.0, up=2.0, down=3.0, pred=pred)
    # (pred + d (gate + up) / rr + d down / rc) / (gate + up + down)
    assert t == pytest.approx((pred + d * 4.0 / rr + d * 3.0 / rc) / 7.0, rel=1e-9)
    assert mode == (SPARSE if t < 1 else DENSE)
    # a predictor as big as the FFN can never pay
    assert decide(SPARSE, 0.01, pred=3.0)[0] == DENSE


def test_ungated_ffn_has_no_up():
    d = 0.2
    mode, t, rr, rc, _ = decide(GATE, d, up=0.0)
    assert t == pytest.approx((1.0 + d / rc) / 2.0, rel=1e-9)


def test_no_estimate_keeps_the_file_mode():
    for cand in (SPARSE, GATE):
        mode, t, _, _, why = decide(cand, -1.0)
        assert mode == cand and "no density" in why
        mode, _, _, _, why = decide(cand, 0.9, F32, F32)  # F32: no measured ratios
        assert mode == cand and "no kernel ratios measured for f32" in why
        mode, _, _, _, why = decide(cand, 0.9, F16, F16, simd=0)  # scalar: none measured
        assert mode == cand and "no kernel ratios" in why
    mode, _, _, _, why = decide(DENSE, 0.1)
    assert mode == DENSE and "no sparse mode" in why


def test_bad_bytes_is_an_error():
    i = ffi.new("gh_ffn_auto_in *")
    i.candidate, i.simd_level, i.type_gate, i.type_down, i.density = GATE, AVX512, F16, F16, 0.5
    out = ffi.new("gh_ffn_auto_choice *")
    assert lib.gh_ffn_auto_decide(i, out) != 0
    assert "bytes" in ffi.string(lib.gh_last_error()).decode()


@pytest.fixture(scope="module")
def gate_files(tmp_path_factory):
    pytest.importorskip("torch")
    from powerinfer_cpp.convert import convert
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    heldout = REPO_DIR / "models" / "tiny-swiglu-kjv" / "heldout.txt"
    d = tmp_path_factory.mktemp("auto")
    hf = make_llama_model(d / "hf", act="silu", tied=False, seed=4, n_layer=2, d=64, n_ff=192, n_ctx=256)
    out = {}
    for s in (0.1, 0.9):
        opts = SparseOptions(calib=str(heldout), calib_tokens=512, profile_ctx=128, sparsity=s)
        out[s] = Path(convert(hf, d / f"gate{s}.gguf", "f16", progress=False, sparse=True, sparse_options=opts))
    return out


def test_context_starts_in_the_rules_choice(gate_files):
    from powerinfer_cpp.inspect import describe

    prev = lib.gh_simd_get()
    try:
        for simd in (AVX2, AVX512):
            if lib.gh_simd_supported() < simd:
                continue
            lib.gh_simd_set(simd)
            for s, path in gate_files.items():
                # the rule at 90% density (sparsity 10%) says dense, at 10% gate, for F16 here
                want = decide(GATE, 1.0 - s, F16, F16, simd, down=1.0, dense_down_t=1)[0]
                assert want == (DENSE if s < 0.5 else GATE)
                with Model(path, n_ctx=32) as m:
                    assert m.context.ffn_mode == ("dense" if want == DENSE else "gate")
                    m.context.set_ffn_mode("gate")  # the file's mode stays available
                    assert m.context.ffn_mode == "gate"
                    m.context.set_ffn_mode("auto")
                    assert m.context.ffn_mode == ("dense" if want == DENSE else "gate")
                    assert m.create_context(n_ctx=16, ffn="file").ffn_mode == "gate"
                line = [ln for ln in describe(path).splitlines() if ln.startswith("ffn mode (auto):")]
                assert len(line) == 1 and f"density {round(100 * (1 - s))}%" in line[0]
                assert line[0].startswith("ffn mode (auto): " + ("dense:" if want == DENSE else "gate:"))
    finally:
        lib.gh_simd_set(prev)
