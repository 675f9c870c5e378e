"""Sparse inside experts (issue 26): a mixture's selected experts run the FFN strategies over
id lists (ffn/moe.c through gh_sparse_ffn_unit), from the sparse-experts file the converter
writes (sparse/expert_sparsity.py: ffn_down_exps_t, blk.N.ffn_exp_gate_thr).

- ReLU-family experts (ReGLU: transformers' Mixtral with hidden_act relu; dReLU: the same
  with use_drelu, its experts in numpy, hf_models.patch_moe_drelu): the exact file's gate
  (threshold 0) and oracle modes equal the dense file's logits and transformers'; the FFN
  bytes the statistics count are the router, each selected expert's gate and the up and
  down_t rows of its active neurons, fewer than dense;
- a batch (prompt chunks within the sparse batch, and contexts batched by gh_eval_batch_ex)
  equals its tokens one by one; host-device (experts on the CPU) equals CPU-only;
- SwiGLU experts (Qwen3-MoE) and dReLU ones calibrated to a sparsity: the share of neurons
  the runtime skips on held-out text is the requested level within 3 points;
- bad files refused by name."""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import hf_reference_model, make_hf_model  # noqa: E402
from batch_util import native_batch_ex, logit_rows  # noqa: E402

from conftest import SHIPPED_DIR  # noqa: E402
from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.expert_sparsity import calibrate_experts, route  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402

torch.set_num_threads(1)

HELDOUT = SHIPPED_DIR / "heldout.txt"
N_POS = 24


@pytest.fixture(scope="module", params=["mixtral-relu", "mixtral-drelu"])
def relu_case(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(variant)
    hf = make_hf_model(variant, d / "hf", seed=11)
    dense = convert(hf, d / "f32.gguf", "f32", progress=False)
    sparse = convert(hf, d / "sparse.gguf", "f32", progress=False, sparse=True,
                     sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=300, profile_ctx=100))
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 300, size=N_POS)]
    with torch.no_grad():
        want = hf_reference_model(hf)(torch.tensor([ids])).logits[0].double().numpy()
    return {"variant": variant, "hf": hf, "dense": dense, "sparse": sparse, "ids": ids, "want": want,
            "dir": d}


def _decode(m, ids, mode, **kw):
    ctx = m.create_context(n_ctx=64, cache_type="f32", ffn=mode, **kw)
    rows = np.stack([ctx.eval([t]) for t in ids]).astype(np.float64)
    return rows, ctx.stats()


def test_exact_file_is_the_dense_model(relu_case):
    """Threshold 0 (the gate mode, the file's default) and the oracle equal dense."""
    ids, want = relu_case["ids"], relu_case["want"]
    rng_ = np.ptp(want)
    with Model(relu_case["dense"]) as m:
        dense, _ = _decode(m, ids, "dense")
    with Model(relu_case["sparse"]) as m:
        assert m.create_context(n_ctx=16).ffn_mode == "gate"
        gate, _ = _decode(m, ids, "gate")
        oracle, _ = _decode(m, ids, "oracle")
    np.testing.assert_allclose(dense, want, rtol=0, atol=1e-4 * rng_)
    np.testing.assert_allclose(gate, dense, rtol=0, atol=2e-5 * rng_)
    np.testing.assert_allclose(oracle, dense, rtol=0, atol=2e-5 * rng_)


def test_the_thresholds_written_are_exact_zeros(relu_case):
    import gguf

    r = gguf.GGUFReader(relu_case["sparse"])
    names = {t.name: t for t in r.tensors}
    with Model(relu_case["dense"]) as m:
        info = m.info
    for il in range(info.n_layer):
        thr = np.asarray(names[F.sparse_expert_tensor_name(F.T_FFN_EXP_GATE_THR, il)].data)
        assert thr.shape == (info.n_expert,) and (thr == 0).all()
        t = names[F.sparse_expert_tensor_name(F.T_FFN_DOWN_EXPS_T, il)]
        assert tuple(int(v) for v in t.shape) == (info.n_embd, info.n_ff_exp, info.n_expert)
        assert F.tensor_name(F.T_FFN_DOWN_EXPS, il) not in names


def test_bytes_are_the_active_rows(relu_case):
    """A decode step's FFN bytes: per layer the router and, per selected expert, its whole
    gate plus the up rows of the neurons whose gate passed and the down_t rows of the
    nonzero activations (the statistics' own row counts); fewer than the dense file's."""
    ids = relu_case["ids"]
    with Model(relu_case["dense"]) as m:
        info = m.info
        _, st_dense = _decode(m, ids, "dense")
    with Model(relu_case["sparse"]) as m:
        _, st = _decode(m, ids, "gate")
    d, ff, ne, k, nl = info.n_embd, info.n_ff_exp, info.n_expert, info.n_expert_used, info.n_layer
    row = 4 * d  # f32 rows of d values (gate, up and down_t alike)
    n = len(ids)
    want = n * nl * (ne * d * 4 + k * ff * row) + (st["n_up_rows"] + st["n_down_rows"]) * row
    assert st["bytes"]["ffn"] == want
    assert st_dense["bytes"]["ffn"] == n * nl * (ne * d * 4 + k * 3 * ff * row)
    # ReLU: about half the gates pass; dReLU: about a quarter of the products are nonzero
    assert 0.3 < st["n_up_rows"] / (n * nl * k * ff) < 0.7
    frac_down = st["n_down_rows"] / (n * nl * k * ff)
    assert (0.1 < frac_down < 0.4) if relu_case["variant"].endswith("drelu") else (0.3 < frac_down < 0.7)
    assert st["bytes"]["ffn"] < st_dense["bytes"]["ffn"]


def test_a_batch_equals_its_tokens(relu_case):
    """Prompt chunks within the sparse batch (each token its own lists) and a batched decode
    of several contexts equal one token at a time, bit for bit; a prompt past the sparse
    batch runs the experts dense (down_t over the rows some token needs) and equals too."""
    ids = relu_case["ids"]
    with Model(relu_case["sparse"]) as m:
        one, _ = _decode(m, ids, "gate")
        chunks = m.create_context(n_ctx=64, cache_type="f32", n_batch=3).eval(ids, logits_all=True)
        np.testing.assert_array_equal(chunks, one.astype(np.float32))
        whole = m.create_context(n_ctx=64, cache_type="f32").eval(ids, logits_all=True)
        np.testing.assert_allclose(whole, one, rtol=0, atol=2e-5 * np.ptp(one))
        ctxs = [m.create_context(n_ctx=64, cache_type="f32") for _ in range(3)]
        twins = [m.create_context(n_ctx=64, cache_type="f32") for _ in range(3)]
        for i, (c, t) in enumerate(zip(ctxs, twins)):
            c.eval(ids[i:i + 4])
            t.eval(ids[i:i + 4])
        for step in range(3):
            toks = [ids[(7 * i + step) % len(ids)] for i in range(3)]
            native_batch_ex(ctxs, [1, 1, 1], toks)
            for c, t, tok in zip(ctxs, twins, toks):
                np.testing.assert_array_equal(logit_rows(c)[-1], t.eval([tok]))


def test_host_device_equals_cpu(relu_case):
    """On the host-device backend (attention, routers and head placed; the sparse experts
    stay the CPU's, the loader says so, an expert cache asked for is not made) the gate and
    dense modes equal CPU-only."""
    ids = relu_case["ids"][:12]
    with Model(relu_case["sparse"]) as m:
        cpu_gate, _ = _decode(m, ids, "gate")
        cpu_dense, _ = _decode(m, ids, "dense")
    with Model(relu_case["sparse"], device="host-device", vram_budget="64M", expert_cache="1M") as m:
        info = m.device_info()
        assert info["attention_layers"] == m.info.n_layer and info["experts"]["device"] == 0
        assert "sparse form (ffn_down_exps_t)" in info["note"]
        gate, _ = _decode(m, ids, "gate")
        dense, _ = _decode(m, ids, "dense")
    scale = np.ptp(cpu_gate)
    np.testing.assert_allclose(gate, cpu_gate, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(dense, cpu_dense, rtol=0, atol=2e-5 * scale)


def test_shared_expert_on_the_device_beside_sparse_experts(tmp_path_factory):
    """Qwen2-MoE's SwiGLU experts calibrated sparse (ffn_down_exps_t: the CPU's) and its
    shared expert on the device, run while the CPU runs the selected experts: the gate and
    dense modes equal CPU-only within the host-device bound, with the shared expert on the
    device (its bytes in the device's count) and without room for it."""
    d = tmp_path_factory.mktemp("qwen2moe-sparse-shexp")
    hf = make_hf_model("qwen2moe", d / "hf", seed=5)
    path = convert(hf, d / "sparse.gguf", "f32", progress=False, sparse=True,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=300, profile_ctx=100,
                                                sparsity=0.5))
    ids = [int(t) for t in np.random.default_rng(6).integers(3, 300, size=12)]
    with Model(path) as m:
        cpu = {mode: _decode(m, ids, mode)[0] for mode in ("gate", "dense")}
        n_layer = m.info.n_layer
    with Model(path, device="host-device") as m:
        attn = m.device_info()["dense_bytes"]
    scale = np.ptp(cpu["dense"])
    dev_bytes = {}
    for budget, want in ((None, n_layer), (attn, 0)):
        kw = {} if budget is None else dict(vram_budget=budget)
        with Model(path, device="host-device", **kw) as m:
            ex = m.device_info()["experts"]
            assert ex["shared_device"] == want and ex["device"] == 0 and (ex["shared_bytes"] > 0) == (want > 0)
            for mode in ("gate", "dense"):
                got, st = _decode(m, ids, mode)
                np.testing.assert_allclose(got, cpu[mode], rtol=0, atol=2e-5 * scale)
                dev_bytes[budget, mode] = st["device"]["bytes_device"]
    # the device read each layer's shared expert once per token on top of the rest
    for mode in ("gate", "dense"):
        assert dev_bytes[None, mode] - dev_bytes[attn, mode] == len(ids) * _shared_bytes(path)


def _shared_bytes(path) -> int:
    import gguf

    r = gguf.GGUFReader(path)
    return sum(int(t.n_bytes) for t in r.tensors if t.name.endswith("_shexp.weight")
               and "gate_inp" not in t.name)


# ---- calibrated levels on held-out text ------------------------------------------------------


@pytest.mark.parametrize("variant,level", [("qwen3moe", 0.5), ("qwen3moe", 0.8), ("mixtral-drelu", 0.9)])
def test_calibration_hits_the_level_on_heldout_text(tmp_path_factory, variant, level):
    """The share of the selected experts' neurons the gate mode skips, counted by the
    runtime over text after the calibration tokens, is the requested level +- 3 points
    (and so is the converter's own held-out measurement): SwiGLU experts, and dReLU ones
    past their exact zeros (the threshold on relu(gate x), dReLU's gate factor)."""
    d = tmp_path_factory.mktemp(f"{variant}-{level}")
    hf = make_hf_model(variant, d / "hf", seed=3)
    rep: list = []
    path = convert(hf, d / f"gate{level}.gguf", "f32", progress=False, sparse=True, report=rep,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=1500, profile_ctx=128,
                                                sparsity=level))
    for s in rep[0].expert_holdout_sparsity:
        assert abs(s - level) <= 0.03, rep[0].expert_holdout_sparsity
    with Model(path) as m:
        info = m.info
        ctx = m.create_context(n_ctx=128, cache_type="f32", ffn="gate")
        toks = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[2000:2100]
        for t in toks:
            ctx.eval([t])
        st = ctx.stats()
    # every listed neuron's up row is read (SwiGLU: all; ReLU family: g above the threshold
    # >= 0), so the up rows are the active neurons
    entries = len(toks) * info.n_layer * info.n_expert_used * info.n_ff_exp
    skipped = 1.0 - st["n_up_rows"] / entries
    print(f"level {level}: converter held-out {rep[0].expert_holdout_sparsity}, runtime {skipped:.3f}")
    assert abs(skipped - level) <= 0.03


def test_calibration_units():
    """route: the runtime's top-k (the lower id among equals); calibrate_experts: the
    quantile over each expert's own tokens, -1 for an expert too few tokens chose, 0 for a
    ReLU family without a level."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 8)).astype(np.float32)
    router = rng.standard_normal((4, 8)).astype(np.float32)
    router[3] = router[1]  # expert 3 ties expert 1 everywhere: never chosen over it
    sel = route(x, router, 2)
    assert not (sel == 3).any() or (sel == 1).any(axis=1)[(sel == 3).any(axis=1)].all()
    logits = x @ router.T
    for t in range(10):
        order = sorted(range(4), key=lambda e: (-logits[t, e], e))
        assert list(sel[t]) == order[:2]
    gate = rng.standard_normal((4, 16, 8)).astype(np.float32)
    thr = calibrate_experts(x, sel, gate, F.ACT_SILU, 0.6, min_tokens=16)
    for e in range(4):
        toks = np.where((sel == e).any(axis=1))[0]
        if toks.size < 16:
            assert thr[e] == -1.0
            continue
        g = x[toks] @ gate[e].T
        mag = np.abs(g / (1 + np.exp(-g)))
        assert abs((mag <= thr[e]).mean() - 0.6) < 0.01
    assert (calibrate_experts(x, sel, gate, F.ACT_RELU, None) == 0).all()
    assert (calibrate_experts(x, sel, gate, F.ACT_SILU, None) == -1).all()


# ---- bad files ------------------------------------------------------------------------------

def test_bad_sparse_expert_files(relu_case, tmp_path):
    import gguf

    src = relu_case["sparse"]
    r = gguf.GGUFReader(relu_case["dense"])
    down0 = next(t for t in r.tensors if t.name == "blk.0.ffn_down_exps.weight")
    both = rewrite_gguf(src, tmp_path / "both.gguf", add={"blk.0.ffn_down_exps.weight": np.asarray(down0.data)})
    with pytest.raises(NativeError, match=r"layer 0 has both 'blk\.0\.ffn_down_exps\.weight' and "
                                          r"'blk\.0\.ffn_down_exps_t\.weight'"):
        Model(both)
    some = rewrite_gguf(src, tmp_path / "some.gguf", drop=["blk.1.ffn_exp_gate_thr"])
    with pytest.raises(NativeError, match=r"tensor 'blk\.1\.ffn_exp_gate_thr' is missing"):
        Model(some)
    nan = rewrite_gguf(src, tmp_path / "nan.gguf",
                       tensors={"blk.0.ffn_exp_gate_thr": lambda a: np.full_like(a, np.nan)})
    with pytest.raises(NativeError, match=r"'blk\.0\.ffn_exp_gate_thr': expert 0's threshold is nan"):
        Model(nan)
    # the dense file: the modes name what is missing
    with Model(relu_case["dense"]) as m:
        for mode, what in (("gate", "blk.N.ffn_exp_gate_thr"), ("oracle", "ffn_down_exps_t"),
                           ("sparse", "predictors")):
            with pytest.raises(NativeError, match=what):
                m.context.set_ffn_mode(mode)


@pytest.mark.parametrize("level,want", [(0.1, "dense"), (0.9, "gate")])
def test_auto_keeps_expert_thresholds_only_where_they_pay(tmp_path, level, want):
    """The `auto` rule (ffn/auto_mode.c) over one expert's bytes at density 1 - S: F16 SwiGLU
    experts at 90% density estimate slower than dense (the gathered rows' and columns'
    measured rates), at 10% faster; the file's gate mode stays available either way."""
    from powerinfer_cpp._native import lib

    if lib.gh_simd_get() < lib.GH_SIMD_AVX2:  # no kernel ratios measured below it: the file's mode is kept
        pytest.skip("needs AVX2")
    hf = make_hf_model("qwen3moe", tmp_path / "hf", seed=3)
    path = convert(hf, tmp_path / "g.gguf", "f16", progress=False, sparse=True,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=300, profile_ctx=100,
                                                sparsity=level))
    with Model(path, n_ctx=32) as m:
        assert m.context.ffn_mode == want
        assert m.create_context(n_ctx=16, ffn="file").ffn_mode == "gate"


# ---- predictors per expert (ReLU-family experts) -----------------------------------------------


def _exact_predictor_file(relu_case, dst, zero_layer=None):
    """The sparse file with an exact predictor per expert: fc1 = the expert's gate, fc2 = the
    identity, threshold 1e-30, so a neuron is predicted active iff relu(gate x) > 0, the
    oracle's own set; zero_layer: that layer's fc2 all zero (nothing predicted active)."""
    import gguf

    r = gguf.GGUFReader(str(relu_case["sparse"]))
    by = {t.name: t for t in r.tensors}
    add = {}
    il = 0
    while f"blk.{il}.ffn_gate_exps.weight" in by:
        gate = np.asarray(by[f"blk.{il}.ffn_gate_exps.weight"].data, dtype=np.float32)  # [ne, ff, d]
        ne, ff, _ = gate.shape
        eye = np.broadcast_to(np.eye(ff, dtype=np.float32), (ne, ff, ff)).copy()
        add[F.sparse_expert_tensor_name(F.T_FFN_EXP_FC1, il)] = np.ascontiguousarray(gate)
        add[F.sparse_expert_tensor_name(F.T_FFN_EXP_FC2, il)] = eye * (0.0 if il == zero_layer else 1.0)
        il += 1
    from gguf import GGUFValueType as V
    return rewrite_gguf(relu_case["sparse"], dst, add=add, kv={F.KEY_SPARSE_THRESHOLD: (1e-30, V.FLOAT32)})


def test_exact_expert_predictors_are_the_oracle(relu_case):
    """The sparse (predictor) mode runs each selected expert's own predictor: with predictors
    that predict exactly the nonzero gates it reads the oracle's up and down rows and gives
    the oracle's (= dense) logits, without the expert's dense gate; a layer whose predictors
    predict nothing loses its experts' output (the predictor, not the gate, decides)."""
    ids = relu_case["ids"][:12]
    d = relu_case["dir"]
    with Model(relu_case["sparse"]) as m:
        oracle, st_o = _decode(m, ids, "oracle")
        _, st_g = _decode(m, ids, "gate")
    with Model(_exact_predictor_file(relu_case, d / "exact-pred.gguf")) as m:
        sparse, st = _decode(m, ids, "sparse")
    scale = np.ptp(oracle)
    np.testing.assert_allclose(sparse, oracle, rtol=0, atol=2e-5 * scale)
    assert st["n_up_rows"] == st_o["n_up_rows"] and st["n_down_rows"] == st_o["n_down_rows"]
    assert st["bytes"]["ffn"] < st_g["bytes"]["ffn"]  # the gate rows of the predicted neurons only
    assert st["bytes"]["predictor"] > 0
    with Model(_exact_predictor_file(relu_case, d / "zero-pred.gguf", zero_layer=0)) as m:
        off, _ = _decode(m, ids, "sparse")
    assert np.abs(off - oracle).max() > 1e-3 * scale


def test_trained_expert_predictors_recall_on_heldout_text(tmp_path):
    """convert --sparse --expert-predictors on ReLU experts: a predictor per expert, trained on
    the tokens that chose it; the converter's held-out recall and the runtime's over later
    text (the sparse mode's up rows, each a predicted neuron whose gate is nonzero, over the
    oracle mode's, every nonzero gate) agree and are high; the predicted set is smaller than
    the expert."""
    hf = make_hf_model("mixtral-relu", tmp_path / "hf", seed=11)
    rep: list = []
    path = convert(hf, tmp_path / "pred.gguf", "f32", progress=False, sparse=True, report=rep,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=1500, profile_ctx=128,
                                                expert_predictors=True))
    held = rep[0].expert_predictor_recall
    for recall, pred_density, true_density in held:
        assert recall > 0.85 and true_density <= pred_density < 0.9
    with Model(path) as m:
        assert m.create_context(n_ctx=16).ffn_mode == "sparse"  # the file's mode, as with layer predictors
        toks = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[2000:2100]
        st = {}
        for mode in ("oracle", "sparse"):
            ctx = m.create_context(n_ctx=128, cache_type="f32", ffn=mode)
            for t in toks:
                ctx.eval([t])
            st[mode] = ctx.stats()
    recall = st["sparse"]["n_up_rows"] / st["oracle"]["n_up_rows"]
    print(f"expert predictors: converter held-out {held}, runtime recall {recall:.3f}")
    assert recall > 0.85 and abs(recall - np.mean([h[0] for h in held])) < 0.05


def test_expert_predictor_files_refused_by_name(relu_case, tmp_path):
    src = relu_case["sparse"]
    ok = _exact_predictor_file(relu_case, tmp_path / "ok.gguf")
    import gguf

    by = {t.name: t for t in gguf.GGUFReader(str(ok)).tensors}
    fc1 = np.asarray(by["blk.0.ffn_exp_fc1.weight"].data, dtype=np.float32)
    cases = [
        (dict(add={"blk.0.ffn_exp_fc1.weight": fc1}), r"tensor 'blk\.0\.ffn_exp_fc1\.weight' without "
                                                      r"'blk\.0\.ffn_exp_fc2\.weight'"),
        (dict(add={"blk.0.ffn_exp_fc1.weight": fc1[:, :, :-1].copy(),
                   "blk.0.ffn_exp_fc2.weight": np.zeros(fc1.shape[:2] + (fc1.shape[1],), np.float32)}),
         r"tensor 'blk\.0\.ffn_exp_fc1\.weight' has shape"),
        (dict(add={"blk.1.ffn_exp_fc1.weight": fc1,
                   "blk.1.ffn_exp_fc2.weight": np.zeros(fc1.shape[:2] + (fc1.shape[1],), np.float32)}),
         r"'blk\.0\.ffn_exp_fc1\.weight' is missing"),
    ]
    for i, (kw, match) in enumerate(cases):
        with pytest.raises(NativeError, match=match):
            Model(rewrite_gguf(src, tmp_path / f"bad{i}.gguf", **kw))
    with Model(src) as m, pytest.raises(NativeError, match="no blk.N.ffn_exp_fc1"):
        m.create_context(n_ctx=16, ffn="sparse")
