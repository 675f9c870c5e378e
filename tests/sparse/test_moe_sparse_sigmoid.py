"""Sparse experts of DeepSeek-V3-style mixtures (glm4moe, dots1; issue 26): the converter's
calibration (sparse/expert_sparsity.py) routes as the file says (route(): sigmoid gating,
selection bias, groups, norm, scale, as ffn/moe.c route()) and leaves the leading dense
layers and the shared experts dense.

- route()'s choices and weights are transformers' on the hidden states its routers see;
- a sparse-expert file whose thresholds are 0 (exact for SwiGLU: only g = 0 skipped) equals
  the dense file's logits; the dense first layer gets no expert tensors;
- the calibrated level is hit on held-out text within 3 points (as qwen3moe's);
- host-device equals CPU-only for such a file;
- the runtime's expert counts (the placement's profile, sparse/experts.py) are route()'s."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import hf_reference_model, make_hf_model  # noqa: E402

from conftest import SHIPPED_DIR  # noqa: E402
from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.experts import profile_experts  # noqa: E402
from powerinfer_cpp.sparse.expert_sparsity import Gating, route  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402

torch.set_num_threads(1)

HELDOUT = SHIPPED_DIR / "heldout.txt"
N_POS = 24


def _file_router(path, arch):
    """(Gating from the file's keys, {layer: (router, exp_probs_b)}) of a GGUF."""
    import gguf

    r = gguf.GGUFReader(path)
    kv = {}
    for name, f in r.fields.items():
        if f.types and f.types[0] != gguf.GGUFValueType.ARRAY:
            kv[name] = f.contents()
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    layers = {}
    for il in range(int(kv[f"{arch}.block_count"])):
        name = F.tensor_name(F.T_FFN_GATE_INP, il)
        if name in t:
            layers[il] = (t[name].astype(np.float32), t.get(F.tensor_name(F.T_FFN_EXP_PROBS_B, il, "bias")))
    return Gating.from_kv(kv, arch), kv, layers


@pytest.mark.parametrize("variant", ["glm4moe", "dots1", "glm4moe-qknorm", "qwen3moe"])
def test_route_is_transformers_router(tmp_path, variant):
    """On the hidden states transformers' routers see, route() with the file's gating and
    weights picks transformers' experts (as sets) with its weights: the sigmoid routers and,
    the same function, Qwen3-MoE's softmax one."""
    hf = make_hf_model(variant, tmp_path / "hf", seed=7)
    arch = variant.split("-")[0]
    path = convert(hf, tmp_path / "f32.gguf", "f32", progress=False)
    gating, kv, layers = _file_router(path, arch)
    cfg = json.loads((hf / "config.json").read_text())
    sigmoid = arch != "qwen3moe"
    assert gating.sigmoid == sigmoid and gating.norm == cfg["norm_topk_prob"]
    if sigmoid:
        assert gating.n_group == cfg["n_group"] and gating.n_group_used == cfg["topk_group"]
        assert gating.scale == pytest.approx(cfg["routed_scaling_factor"])
    lead = cfg.get("first_k_dense_replace", 0)
    assert sorted(layers) == list(range(lead, cfg["num_hidden_layers"]))
    ref = hf_reference_model(hf)
    got, hooks = {}, []
    for il in layers:
        gate = ref.model.layers[il].mlp.gate
        hooks.append(gate.register_forward_hook(
            lambda mod, inp, out, il=il: got.__setitem__(il, (inp[0].reshape(-1, inp[0].shape[-1]).numpy().copy(),
                                                              out[1].numpy().copy(), out[2].numpy().copy()))))
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 384, size=64)]
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    k = cfg["num_experts_per_tok"]
    for il, (router, probs_b) in layers.items():
        x, w_ref, sel_ref = got[il]
        sel, w = route(x, router, k, gating=gating, probs_b=probs_b, weights=True)
        for t in range(len(ids)):
            a, b = np.argsort(sel[t]), np.argsort(sel_ref[t])
            np.testing.assert_array_equal(sel[t][a], sel_ref[t][b])
            np.testing.assert_allclose(w[t][a], w_ref[t][b], rtol=1e-5, atol=1e-6)
        if sigmoid:  # the selection bias (and the groups) matter here: without them the choice moves
            plain = route(x, router, k, gating=Gating(sigmoid=True))
            assert (np.sort(plain, axis=1) != np.sort(sel, axis=1)).any()


def test_expert_profile_is_route(tmp_path):
    """The placement's profile (the runtime's selection counts, sparse/experts.py) counts
    route()'s choices on the runtime's own FFN inputs: none in the dense first layer."""
    from powerinfer_cpp.sparse.profile import profile_model

    hf = make_hf_model("glm4moe", tmp_path / "hf", seed=7)
    path = convert(hf, tmp_path / "f32.gguf", "f32", progress=False)
    text = HELDOUT.read_text(encoding="utf-8")[:3000]
    with Model(path) as m:
        toks = m.tokenize(text)[:96]
        ne, k = m.info.n_expert, m.info.n_expert_used
    freq, n = profile_experts(path, toks, n_ctx=96)
    prof = profile_model(path, text, n_ctx=96, max_tokens=96, progress=False)
    assert prof.n_tokens == n == 96
    gating, _, layers = _file_router(path, "glm4moe")
    assert not freq[0].any()
    for il, (router, probs_b) in layers.items():
        sel = route(prof.x[il], router, k, gating=gating, probs_b=probs_b)
        np.testing.assert_allclose(freq[il] * n, np.bincount(sel.reshape(-1), minlength=ne))


@pytest.fixture(scope="module", params=["glm4moe", "dots1"])
def sparse_case(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(f"{variant}-sparse")
    hf = make_hf_model(variant, d / "hf", seed=7)
    dense = convert(hf, d / "f32.gguf", "f32", progress=False)
    rep: list = []
    sparse = convert(hf, d / "sparse.gguf", "f32", progress=False, sparse=True, report=rep,
                     sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=300, profile_ctx=100,
                                                  sparsity=0.5))
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 300, size=N_POS)]
    return {"variant": variant, "hf": hf, "dense": dense, "sparse": sparse, "rep": rep[0], "ids": ids,
            "dir": d, "lead": json.loads((hf / "config.json").read_text())["first_k_dense_replace"]}


def _decode(m, ids, mode):
    ctx = m.create_context(n_ctx=64, cache_type="f32", ffn=mode)
    return np.stack([ctx.eval([t]) for t in ids]).astype(np.float64), ctx.stats()


def test_exact_file_is_the_dense_model(sparse_case):
    """The sparse file with every threshold 0 (SwiGLU: only g = 0 is skipped) equals the
    dense file's logits, and those are transformers'; the dense first layer has no expert
    tensors and no thresholds, the shared experts keep their dense tensors."""
    import gguf

    names = {t.name for t in gguf.GGUFReader(sparse_case["sparse"]).tensors}
    lead = sparse_case["lead"]
    assert lead == 1 and sparse_case["rep"].expert_holdout_sparsity[0] is None
    assert not any(n.startswith("blk.0.ffn_") and ("exp" in n and "shexp" not in n) for n in names)
    assert F.tensor_name(F.T_FFN_DOWN, 0) in names
    thr_names = [F.sparse_expert_tensor_name(F.T_FFN_EXP_GATE_THR, il) for il in range(lead, 2)]
    assert all(n in names for n in thr_names) and F.tensor_name(F.T_FFN_DOWN_SHEXP, 1) in names
    exact = rewrite_gguf(sparse_case["sparse"], sparse_case["dir"] / "exact.gguf",
                         tensors={n: (lambda a: a * 0) for n in thr_names})
    ids = sparse_case["ids"]
    with torch.no_grad():
        want = hf_reference_model(sparse_case["hf"])(torch.tensor([ids])).logits[0].double().numpy()
    scale = np.ptp(want)
    with Model(sparse_case["dense"]) as m:
        dense, _ = _decode(m, ids, "dense")
    with Model(exact) as m:
        gate, _ = _decode(m, ids, "gate")
    np.testing.assert_allclose(dense, want, rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(gate, dense, rtol=0, atol=2e-5 * scale)


def test_host_device_equals_cpu(sparse_case):
    """host-device (attention, routers, the dense first layer and the shared experts placed;
    the sparse experts the CPU's) equals CPU-only in the gate and dense modes."""
    ids = sparse_case["ids"][:12]
    with Model(sparse_case["sparse"]) as m:
        cpu = {mode: _decode(m, ids, mode)[0] for mode in ("gate", "dense")}
    with Model(sparse_case["sparse"], device="host-device", vram_budget="64M") as m:
        assert m.device_info()["experts"]["device"] == 0
        for mode in ("gate", "dense"):
            got, _ = _decode(m, ids, mode)
            np.testing.assert_allclose(got, cpu[mode], rtol=0, atol=2e-5 * np.ptp(cpu[mode]))


@pytest.mark.parametrize("level", [0.5, 0.8])
def test_calibration_hits_the_level_on_heldout_text(tmp_path, level):
    """glm4moe's SwiGLU experts (sigmoid router, groups, a dense first layer): the share of the
    selected experts' neurons the gate mode skips on text after the calibration tokens is the
    level +- 3 points, by the converter's held-out count and by the runtime's."""
    hf = make_hf_model("glm4moe", tmp_path / "hf", seed=3)
    rep: list = []
    path = convert(hf, tmp_path / "gate.gguf", "f32", progress=False, sparse=True, report=rep,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=1500, profile_ctx=128,
                                                sparsity=level))
    held = rep[0].expert_holdout_sparsity
    assert held[0] is None and len(held) == 2
    for s in held[1:]:
        assert abs(s - level) <= 0.03, held
    with Model(path) as m:
        info = m.info
        ctx = m.create_context(n_ctx=128, cache_type="f32", ffn="gate")
        toks = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[2000:2100]
        for t in toks:
            ctx.eval([t])
        st = ctx.stats()
    # the up rows counted are the routed experts' (the dense first layer and the shared
    # experts run their dense matmuls, not row lists)
    entries = len(toks) * (info.n_layer - 1) * info.n_expert_used * info.n_ff_exp
    skipped = 1.0 - st["n_up_rows"] / entries
    print(f"glm4moe level {level}: converter held-out {held}, runtime {skipped:.3f}")
    assert abs(skipped - level) <= 0.03
