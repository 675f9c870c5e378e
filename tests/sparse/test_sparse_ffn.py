"""The sparse FFN: its ops (gh_op_sparse_predict / _glu / _glu_union / _down) beyond the
op table's rows against numpy (test_op_table.py: every type, SIMD level, thread count,
list shape): the ungated and FATReLU forms, rows equal to the decode's, bad arguments;
the FFN modes on the shipped trained model (oracle == dense logits; sparse within the
stated accuracy of dense), and the runtime's statistics.

The sparse-mode accuracy numbers are printed (pytest -s) and recorded in
docs/BENCHMARKS.md ("Sparse FFN accuracy")."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFReader

from powerinfer_cpp import Model, NativeError
from powerinfer_cpp._native import check, ffi, lib
from powerinfer_cpp.sparse.profile import profile_model

from conftest import SHIPPED_DIR, at_simd, simd_levels
from cbuf import fptr, iptr  # noqa: E402
from opref import (B32_QUANTS, BF16, DRELU, F16, F32, GELU, GELU_ERF, IQ4_NL, IQ4_XS, K_QUANTS, LATTICE, MXFP4,  # noqa: E402
                   Q4_0, Q8_0, RELU, SILU, TYPES, act_ref, block_cols, encode, id_lists, vptr)

HELDOUT = SHIPPED_DIR / "heldout.txt"


# ---- gh_op_sparse_down: y = sum_k a[k] * W[ids[k]] ----------------------------------------


def sparse_down(t, raw, rows, cols, ids, a, n_threads):
    y = np.full(cols, np.nan, dtype=np.float32)
    check(lib.gh_op_sparse_down(t, vptr(raw), rows, cols, iptr(ids), fptr(a), ids.size, fptr(y),
                                n_threads))
    return y


def test_sparse_down_equals_matmul_t():
    """The list form of one token is the dense gh_matmul_t over the nonzero h, bit for bit."""
    rng = np.random.default_rng(3)
    for t in TYPES.values():
        rows, cols = 75, block_cols(t, 160)
        raw, _ = encode(t, rng.standard_normal((rows, cols)))
        h = rng.standard_normal(rows).astype(np.float32)
        h[rng.random(rows) < 0.7] = 0.0
        ids = np.flatnonzero(h).astype(np.int32)
        y = np.zeros(cols, dtype=np.float32)
        check(lib.gh_op_matmul_t(t, vptr(raw), rows, cols, fptr(h), 1, fptr(y), 2))
        np.testing.assert_array_equal(sparse_down(t, raw, rows, cols, ids, h[ids].copy(), 2), y)


def test_sparse_down_odd_float_cols():
    rng = np.random.default_rng(4)
    for cols in (1, 7, 17, 33, 100):
        for t in (F32, F16, BF16):
            raw, wd = encode(t, rng.standard_normal((11, cols)))
            ids = np.array([10, 0, 3, 3, 7], dtype=np.int32)
            a = rng.standard_normal(5).astype(np.float32)
            for level in simd_levels():
                with at_simd(level):
                    for nt in (1, 2, 4):
                        np.testing.assert_allclose(sparse_down(t, raw, 11, cols, ids, a, nt),
                                                   a @ wd[ids], rtol=1e-5, atol=1e-5)


# ---- gh_op_sparse_glu: a[k] = act(gate[ids[k]] . x, up[ids[k]] . x) ----------------------

# error bound per type, relative to |W| . |x|: activations are converted to the type's dot
# format (bf16 for BF16; 8-bit blocks for Q8_0/Q4_0)
# (one scale per 256 values for the K-quants' and IQ4_XS's Q8_K)
GLU_EPS = {F32: 1e-6, F16: 1e-6, BF16: 5e-3, Q8_0: 2e-2, Q4_0: 2e-2, **{k: 2e-2 for k in B32_QUANTS},
           **{k: 3e-2 for k in K_QUANTS}, IQ4_NL: 2e-2, MXFP4: 2e-2, IQ4_XS: 3e-2,
           **{k: 3e-2 for k in LATTICE}}


def sparse_glu(t, graw, uraw, rows, cols, act, x, ids, n_threads, act_t=0.0):
    a = np.full(max(ids.size, 1), np.nan, dtype=np.float32)
    check(lib.gh_op_sparse_glu(t, vptr(graw), vptr(uraw) if uraw is not None else ffi.NULL, rows,
                               cols, act, act_t, fptr(x), iptr(ids), ids.size, fptr(a), n_threads))
    return a[: ids.size]


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("act", [RELU, SILU, lib.GH_ACT_FATRELU])
def test_sparse_glu_ungated_and_fatrelu(tname, act):
    """up = NULL (OPT/Falcon: the activation reads up's rows, which take the gate's place):
    a[k] = act(g); FATReLU (gated and not) zeroes g <= t. Against numpy at every level."""
    t = TYPES[tname]
    rows, cols, thr = 67, block_cols(TYPES[tname], 96), 0.05
    rng = np.random.default_rng(act + 7 * t)
    graw, gd = encode(t, rng.standard_normal((rows, cols)) / np.sqrt(cols))
    uraw, ud = encode(t, rng.standard_normal((rows, cols)) / np.sqrt(cols))
    x = rng.standard_normal(cols).astype(np.float32)
    g_all, u_all = gd.astype(np.float64) @ x, ud.astype(np.float64) @ x
    gs, us = np.abs(gd) @ np.abs(x), np.abs(ud) @ np.abs(x)
    e = GLU_EPS[t]

    def act1(g):
        if act == RELU:
            return np.maximum(g, 0)
        if act == lib.GH_ACT_FATRELU:
            return np.where(g > thr, g, 0.0)
        return g / (1 + np.exp(-g))

    for name, ids in id_lists(rows, rng).items():
        if ids.size == 0:
            continue
        for level in simd_levels():
            with at_simd(level):
                a = sparse_glu(t, graw, None, rows, cols, act, x, ids, 2, act_t=thr)
                ag = sparse_glu(t, graw, uraw, rows, cols, act, x, ids, 2, act_t=thr)
            near = np.abs(g_all[ids] - (thr if act == lib.GH_ACT_FATRELU else 0.0)) < 2 * e * gs[ids] + 1e-6
            ref = act1(g_all[ids])
            assert np.all((np.abs(a - ref) <= 1.2 * e * gs[ids] + 1e-7) | near), (name, level)
            refg = ref * u_all[ids]
            bound = 1.2 * e * (gs[ids] * np.abs(u_all[ids]) + us[ids] * np.abs(g_all[ids]) +
                               e * gs[ids] * us[ids]) + 1e-7
            assert np.all((np.abs(ag - refg) <= bound) | near), (name, level)


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("cols", [96, 160, 4096 + 32])
def test_sparse_glu_rows_equal_decode(tname, cols):
    """A listed row's dot is the dense decode matvec's value of that row, bit for bit, at
    every SIMD level (the gathered-row tiles compute a row as the decode tile does)."""
    t = TYPES[tname]
    rows = 64
    cols = block_cols(t, cols)
    rng = np.random.default_rng(cols)
    graw, _ = encode(t, rng.standard_normal((rows, cols)) / np.sqrt(cols))
    uraw, _ = encode(t, rng.standard_normal((rows, cols)) / np.sqrt(cols))
    x = rng.standard_normal(cols).astype(np.float32)
    for level in simd_levels():
        with at_simd(level):
            g = np.empty(rows, dtype=np.float32)
            u = np.empty(rows, dtype=np.float32)
            check(lib.gh_op_matmul(t, vptr(graw), rows, cols, fptr(x), 1, fptr(g), 1))
            check(lib.gh_op_matmul(t, vptr(uraw), rows, cols, fptr(x), 1, fptr(u), 1))
            for name, ids in id_lists(rows, rng).items():
                a = sparse_glu(t, graw, uraw, rows, cols, RELU, x, ids, 2)
                np.testing.assert_array_equal(a, np.maximum(g[ids], 0) * u[ids], err_msg=f"{name} level {level}")


def test_sparse_glu_gelu_and_large_list_threads():
    rng = np.random.default_rng(9)
    rows, cols = 2000, 256  # big enough to run on the pool
    raw_g, gd = encode(F16, rng.standard_normal((rows, cols)) / 16)
    raw_u, ud = encode(F16, rng.standard_normal((rows, cols)) / 16)
    x = rng.standard_normal(cols).astype(np.float32)
    ids = rng.permutation(rows)[:1500].astype(np.int32)
    for act in (GELU, GELU_ERF):
        ref = act_ref(act, gd[ids].astype(np.float64) @ x, ud[ids].astype(np.float64) @ x)
        outs = [sparse_glu(F16, raw_g, raw_u, rows, cols, act, x, ids, nt) for nt in (1, 2, 3)]
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], outs[2])
        np.testing.assert_allclose(outs[0], ref, rtol=1e-3, atol=1e-4)


# ---- the ops' bad arguments (against numpy: test_op_table.py's rows) ----------------------


def test_sparse_ops_bad_args():
    w = np.zeros((4, 32), dtype=np.float32)
    x = np.zeros(32, dtype=np.float32)
    y = np.zeros(32, dtype=np.float32)
    a = np.ones(4, dtype=np.float32)
    ids = np.array([0, 4], dtype=np.int32)  # 4 is out of range
    n = ffi.new("int64_t *")
    act = np.zeros(4, dtype=np.int32)
    assert lib.gh_op_sparse_down(F32, vptr(w), 4, 32, iptr(ids), fptr(a), 2, fptr(y), 1) == lib.GH_ERR_RANGE
    assert "outside" in ffi.string(lib.gh_last_error()).decode()
    ok = np.array([1, 3], dtype=np.int32)
    assert lib.gh_op_sparse_down(4, vptr(w), 4, 32, iptr(ok), fptr(a), 2, fptr(y), 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_down(Q8_0, vptr(w), 4, 16, iptr(ok), fptr(a), 2, fptr(y), 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_down(F32, vptr(w), 4, 32, iptr(ok), fptr(a), -1, fptr(y), 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_down(F32, vptr(w), 4, 32, iptr(ok), fptr(a), 2, fptr(y), 0) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_glu(F32, vptr(w), vptr(w), 4, 32, 9, 0.0, fptr(x), iptr(ok), 2, fptr(a), 1) \
        == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_glu(F32, vptr(w), vptr(w), 4, 32, RELU, 0.0, fptr(x), iptr(ids), 2, fptr(a), 1) \
        == lib.GH_ERR_RANGE
    assert lib.gh_op_sparse_glu(F32, ffi.NULL, vptr(w), 4, 32, RELU, 0.0, fptr(x), iptr(ok), 2, fptr(a), 1) \
        == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_glu(F32, vptr(w), ffi.NULL, 4, 32, DRELU, 0.0, fptr(x), iptr(ok), 2, fptr(a), 1) \
        == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_predict(F32, vptr(w), F32, vptr(w), 32, 4, 4, fptr(x), 0.0, iptr(act),
                                    ffi.NULL, ffi.NULL, 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_predict(F32, vptr(w), Q8_0, vptr(w), 32, 4, 4, fptr(x), 0.0, iptr(act),
                                    n, ffi.NULL, 1) == lib.GH_ERR_INVALID_ARG  # fc2 rows of 4: not q8_0
    # nothing was written to y by the failing calls
    assert np.all(y == 0)


# ---- FFN modes on the shipped trained model ---------------------------------------------


def fresh_tokens(m: Model, n_calib: int) -> list[int]:
    ids = m.tokenize(HELDOUT.read_text(encoding="utf-8"))
    fresh = ids[n_calib:]
    assert len(fresh) >= 2048
    return fresh


def step_logits(ctx, tokens):
    """Logits of every token, fed one at a time (decode: the sparse path)."""
    ctx.reset()
    return np.stack([ctx.eval([t]) for t in tokens])


def test_default_mode_and_errors(shipped_sparse):
    with Model(shipped_sparse["sparse"], n_ctx=64) as m:
        assert m.context.ffn_mode == "sparse"  # predictors in every layer
        assert m.create_context(n_ctx=16, ffn="oracle").ffn_mode == "oracle"
        m.context.set_ffn_mode("dense")
        assert m.context.ffn_mode == "dense"
        m.context.set_ffn_mode("auto")
        assert m.context.ffn_mode == "sparse"
        with pytest.raises(ValueError, match="unknown FFN mode"):
            m.context.set_ffn_mode("fast")
        assert lib.gh_context_set_ffn_mode(m.context._ptr, 7) == lib.GH_ERR_INVALID_ARG
        assert m.context.sparse_batch == 4
        m.context.sparse_batch = 0
        assert m.context.sparse_batch == 0
        with pytest.raises(ValueError):
            m.context.sparse_batch = -1
    with Model(shipped_sparse["dense"], n_ctx=64) as m:
        assert m.context.ffn_mode == "dense"  # no predictors
        with pytest.raises(NativeError, match="predictor|ffn_down_t"):
            m.context.set_ffn_mode("sparse")
        with pytest.raises(NativeError, match="ffn_down_t"):
            m.context.set_ffn_mode("oracle")
        assert m.context.ffn_mode == "dense"
    with pytest.raises(NativeError, match="convert the model with --sparse"):
        Model(shipped_sparse["dense"], n_ctx=64, ffn="sparse").context
    with pytest.raises(ValueError):
        Model(shipped_sparse["sparse"], n_ctx=64, ffn="bogus")


@pytest.mark.parametrize("outtype", ["f16", "q4_0"])
def test_oracle_equals_dense(shipped_sparse, outtype):
    path = shipped_sparse["sparse"]
    if outtype != "f16":
        # the same pipeline in q4_0 (predictors retrained: a few seconds)
        from powerinfer_cpp.convert import convert

        path = shipped_sparse["dir"] / f"tiny-sparse-{outtype}.gguf"
        if not path.exists():
            convert(SHIPPED_DIR, path, outtype, progress=False, sparse=True)
    # an f32 KV cache: batch and step differ by float rounding only (an f16 cache rounds
    # those differences to f16, and q4_0's int8 activations round them again)
    with Model(path, n_ctx=256, n_threads=2, cache_type="f32") as m:
        toks = fresh_tokens(m, shipped_sparse["n_calib"])[:120]
        ctx = m.context
        ctx.set_ffn_mode("dense")
        dense = step_logits(ctx, toks)
        ctx.reset()
        dense_batch = ctx.eval(toks, logits_all=True)
        ctx.reset()
        ctx.set_ffn_mode("oracle")
        oracle = step_logits(ctx, toks)
        np.testing.assert_allclose(oracle, dense, rtol=0, atol=2e-4 * np.abs(dense).max())
        # a step's down_t runs through q4_0's int8 form (axpy_avx2.c), a batch's in f32: their
        # difference is that form's rounding too (measured KL 1.5e-5, docs/BENCHMARKS.md)
        step_tol = 6e-3 if outtype == "q4_0" and lib.gh_simd_get() >= 1 else 2e-3
        np.testing.assert_allclose(dense_batch, dense, rtol=0, atol=step_tol * np.abs(dense).max())
        # a batch of <= sparse_batch tokens runs the sparse path token by token
        ctx.reset()
        ctx.sparse_batch = 1000
        # (attention of a batch sums in another order than step by step: as dense_batch)
        np.testing.assert_allclose(ctx.eval(toks, logits_all=True), dense_batch, rtol=0,
                                   atol=step_tol * np.abs(dense).max())
        st = ctx.stats()
        assert st["n_sparse_tokens"] == 2 * len(toks)
        # 1 and 2 threads: the same logits
        ctx.reset()
        ctx.set_threads(1)
        np.testing.assert_allclose(step_logits(ctx, toks[:20]), oracle[:20], rtol=0,
                                   atol=1e-5 * np.abs(dense).max())


def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def window_logits(ctx, toks, n_ctx):
    """Teacher-forced logits of toks in windows of n_ctx (one eval per window)."""
    out = []
    for s in range(0, len(toks), n_ctx):
        ctx.reset()
        out.append(ctx.eval(toks[s:s + n_ctx], logits_all=True))
    return np.concatenate(out)


def test_sparse_accuracy_shipped(shipped_sparse, capsys):
    """Sparse mode vs dense on held-out text the predictors never saw: perplexity within
    3%, greedy top-1 agreement >= 95% over >= 1,000 positions."""
    n_ctx = 512
    with Model(shipped_sparse["sparse"], n_ctx=n_ctx, n_threads=2) as m:
        toks = fresh_tokens(m, shipped_sparse["n_calib"])[:2048]
        ctx = m.context
        ctx.sparse_batch = n_ctx  # whole windows through the sparse path, token by token
        ctx.set_ffn_mode("dense")
        dense = window_logits(ctx, toks, n_ctx)
        ctx.set_ffn_mode("sparse")
        ctx.reset_stats()
        sparse = window_logits(ctx, toks, n_ctx)
        st = ctx.stats()
    assert st["n_sparse_tokens"] == len(toks)
    # positions that predict a next token within their window
    keep = np.array([(i % n_ctx) != n_ctx - 1 for i in range(len(toks) - 1)])
    tgt = np.asarray(toks[1:])[keep]
    pos = np.arange(len(toks) - 1)[keep]

    def ppl(lg):
        return math.exp(-log_softmax(lg[pos])[np.arange(len(pos)), tgt].mean())

    ppl_d, ppl_s = ppl(dense), ppl(sparse)
    agree = float(np.mean(dense[pos].argmax(1) == sparse[pos].argmax(1)))
    rel = ppl_s / ppl_d - 1
    with capsys.disabled():
        print(f"\nsparse FFN accuracy (shipped tiny-relu-kjv, f16, {len(pos)} held-out positions): "
              f"ppl dense {ppl_d:.3f} sparse {ppl_s:.3f} ({rel:+.2%}); greedy top-1 agreement "
              f"{agree:.2%}; predicted density {st['density']:.2%} "
              f"(per layer {', '.join(f'{x:.1%}' for x in st['layer_density'])})")
    assert len(pos) >= 1000
    assert abs(rel) <= 0.03
    assert agree >= 0.95


def test_stats_add_up(shipped_sparse):
    path = shipped_sparse["sparse"]
    r = GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    with Model(path, n_ctx=128, n_threads=2) as m:
        info = m.info
        toks = fresh_tokens(m, shipped_sparse["n_calib"])[:40]
        ctx = m.context
        ctx.reset_stats()
        assert ctx.stats()["n_tokens"] == 0
        step_logits(ctx, toks)
        st = ctx.stats()
        assert st["ffn_mode"] == "sparse"
        assert st["n_tokens"] == st["n_sparse_tokens"] == len(toks)
        nl, ff = info.n_layer, info.n_ff
        assert st["density"] == pytest.approx(st["n_active"] / (len(toks) * nl * ff))
        assert np.mean(st["layer_density"]) == pytest.approx(st["density"])
        assert 0 < st["density"] < 0.5
        assert st["n_down_rows"] <= st["n_up_rows"] <= st["n_active"]

        def nbytes(name):
            return int(tensors[name].n_bytes)

        pred = sum(nbytes(f"blk.{l}.fc1.weight") + nbytes(f"blk.{l}.fc2.weight") for l in range(nl))
        att = sum(nbytes(f"blk.{l}.attn_{p}.weight") for l in range(nl) for p in "qkv") + \
            sum(nbytes(f"blk.{l}.attn_output.weight") for l in range(nl))
        row = info.n_embd * 2  # f16 rows of gate, up, down_t: n_embd values each
        b = st["bytes"]
        assert b["predictor"] == len(toks) * pred
        assert b["attention"] == len(toks) * att
        assert b["ffn"] == row * (st["n_active"] + st["n_up_rows"] + st["n_down_rows"])
        assert b["head"] == len(toks) * info.n_vocab * info.n_embd * 2
        assert st["bytes_per_token"] == pytest.approx(sum(b.values()) / len(toks))
        t = st["time_s"]
        assert all(v >= 0 for v in t.values())
        assert t["attention"] + t["predictor"] + t["ffn"] + t["other"] == pytest.approx(t["total"])

        # layer 0's input does not depend on the FFN mode: its predicted count equals the
        # predictor op run on the profiled (dense) inputs
        prof = profile_model(m, toks, n_ctx=128, progress=False)
        fc1, fc2 = tensors["blk.0.fc1.weight"], tensors["blk.0.fc2.weight"]
        h = int(fc1.shape[1])
        raw1, raw2 = np.ascontiguousarray(np.array(fc1.data)), np.ascontiguousarray(np.array(fc2.data))
        count = 0
        active = np.zeros(ff, dtype=np.int32)
        n = ffi.new("int64_t *")
        for t_ in range(len(toks)):
            x = np.ascontiguousarray(prof.x[0][t_], dtype=np.float32)
            check(lib.gh_op_sparse_predict(int(fc1.tensor_type), vptr(raw1), int(fc2.tensor_type),
                                           vptr(raw2), info.n_embd, h, ff, fptr(x),
                                           info.sparse_threshold, iptr(active), n, ffi.NULL, 1))
            count += n[0]
        assert st["layer_density"][0] == pytest.approx(count / (len(toks) * ff))

        # oracle: the density is the exact one the profiler measures, layer by layer
        ctx.set_ffn_mode("oracle")
        ctx.reset_stats()
        step_logits(ctx, toks)
        np.testing.assert_allclose(ctx.stats()["layer_density"],
                                   [prof.mask[l].mean() for l in range(nl)], rtol=0, atol=1e-9)

        # a dense prompt batch counts whole matrices (down_t: rows some token needs)
        ctx.set_ffn_mode("dense")
        ctx.reset_stats()
        ctx.reset()
        ctx.eval(toks)
        st = ctx.stats()
        assert st["n_sparse_tokens"] == 0 and st["density"] == 0
        need = sum(int(prof.mask[l].any(axis=0).sum()) for l in range(nl))
        assert st["bytes"]["ffn"] == row * (2 * nl * ff + need)
        assert st["bytes"]["head"] == info.n_vocab * info.n_embd * 2  # last token only


def test_generate_cli_ffn(shipped_sparse, capsys):
    from powerinfer_cpp.generate import main

    for mode in ("sparse", "dense"):
        assert main(["-m", str(shipped_sparse["sparse"]), "-p", "And God said", "-n", "12",
                     "--temp", "0", "--ffn", mode, "-t", "1"]) == 0
        err = capsys.readouterr().err
        assert f"ffn mode    = {mode}" in err
        assert "MB read per token" in err
        assert ("density" in err) == (mode == "sparse")
    assert main(["-m", str(shipped_sparse["dense"]), "-p", "x", "-n", "2", "--ffn", "sparse"]) == 1
    assert "convert the model with --sparse" in capsys.readouterr().err


# ---- gh_op_sparse_glu_union: several tokens' lists over their union ---------------------

def test_sparse_glu_union_refuses_bad_input():
    w = np.zeros((4, 32), dtype=np.float32)
    x = np.zeros((2, 32), dtype=np.float32)
    mask = np.ones((2, 4), dtype=np.uint8)
    a = np.zeros((2, 4), dtype=np.float32)
    m = ffi.from_buffer("uint8_t[]", mask)
    assert lib.gh_op_sparse_glu_union(F32, vptr(w), vptr(w), 4, 32, RELU, 0.0, fptr(x), 65, m,
                                      fptr(a), 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_glu_union(F32, vptr(w), vptr(w), 4, 32, 9, 0.0, fptr(x), 2, m,
                                      fptr(a), 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_sparse_glu_union(F32, vptr(w), vptr(w), 4, 32, RELU, 0.0, fptr(x), 2,
                                      ffi.NULL, fptr(a), 1) == lib.GH_ERR_INVALID_ARG
