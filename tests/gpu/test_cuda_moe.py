"""Mixture-of-experts models on a real GPU (tests/model/test_moe_device.py runs the same
placements on the simulated host-device backend everywhere): routed experts placed and
cached, and Qwen2-MoE's shared expert on the device or not, give the CPU-only logits
within the GPU's bound and the same expert choices. Skipped without a GPU (the cuda_device
fixture in tests/conftest.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from powerinfer_cpp import Model

N_POS = 20
TOL = 1e-4  # max |logit difference| / logit range: the device's f32 dots sum in another order


@pytest.fixture(scope="module", params=["qwen2moe", "mixtral"])
def moe(request, tmp_path_factory, cuda_device):
    """The model: GH_TEST_MOE_DIR/moe-VARIANT-f32.gguf (tools/gpu_check.sh --prepare makes
    them, for the GPU machine without transformers), else converted here."""
    pre = os.environ.get("GH_TEST_MOE_DIR")
    path = os.path.join(pre, f"moe-{request.param}-f32.gguf") if pre else None
    if not path or not os.path.exists(path):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
        from hf_models import make_hf_model
        from powerinfer_cpp.convert import convert

        d = tmp_path_factory.mktemp(request.param + "-cuda")
        path = convert(make_hf_model(request.param, d / "hf", seed=7), d / "f32.gguf", "f32",
                       progress=False)
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        ids = [int(t) for t in np.random.default_rng(3).integers(3, m.n_vocab, size=N_POS)]
        ctx = m.context
        want = ctx.eval(ids, logits_all=True)
        counts = ctx.expert_counts()
    with Model(path, device=cuda_device) as m:
        info = m.device_info()
    ex = info["experts"]
    return dict(path=path, ids=ids, want=want, counts=counts, device=cuda_device,
                attn=info["dense_bytes"], sh=ex["shared_bytes"], eb=ex["bytes"] // ex["device"],
                n_layer=len(counts))


@pytest.mark.parametrize("which", ["all", "shared only", "no shared, some experts", "cache"])
def test_cuda_moe_equals_cpu(moe, which):
    a, sh, eb = moe["attn"], moe["sh"], moe["eb"]
    kw = {"all": {}, "shared only": dict(vram_budget=a + sh),
          "no shared, some experts": dict(vram_budget=a + eb),
          "cache": dict(vram_budget=a + sh + 2 * eb, expert_cache=2 * eb)}[which]
    with Model(moe["path"], n_ctx=64, cache_type="f32", n_threads=2, device=moe["device"], **kw) as m:
        ex = m.device_info()["experts"]
        ctx = m.create_context(n_ctx=64, cache_type="f32", n_threads=2)
        whole = ctx.eval(moe["ids"], logits_all=True)
        one = m.create_context(n_ctx=64, cache_type="f32", n_threads=2)
        steps = np.stack([one.eval([t]) for t in moe["ids"]])
        counts = ctx.expert_counts()
    want_sh = 0 if not sh or which == "no shared, some experts" else moe["n_layer"]
    assert ex["shared_device"] == want_sh
    scale = np.ptp(moe["want"])
    for got in (whole, steps):
        np.testing.assert_allclose(got, moe["want"], rtol=0, atol=TOL * scale)
    np.testing.assert_array_equal(counts, moe["counts"])


@pytest.mark.parametrize("which", ["some", "all"])
def test_cuda_hot_neurons_of_sparse_experts(tmp_path, cuda_device, which):
    """Sparse ReGLU experts (ffn_down_exps_t) with a record of hot neurons
    (tests/sparse/test_moe_hot.py runs the same on host-device): the GPU's hot rows through
    the executor's split give the CPU-only gate-mode logits within the GPU's bound."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gguf_rewrite import rewrite_gguf
    from hf_models import make_hf_model
    from powerinfer_cpp.convert import convert
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    from conftest import SHIPPED_DIR

    hf = make_hf_model("mixtral-relu", tmp_path / "hf", seed=11)
    sparse = convert(hf, tmp_path / "sparse.gguf", "f32", progress=False, sparse=True,
                     sparse_options=SparseOptions(calib=str(SHIPPED_DIR / "heldout.txt"),
                                                  calib_tokens=300, profile_ctx=100))
    with Model(sparse, n_ctx=64) as m:
        nl, ne, ff = m.info.n_layer, m.info.n_expert, m.info.n_ff_exp
        ids = [int(t) for t in np.random.default_rng(4).integers(3, 300, size=12)]
        ctx = m.create_context(n_ctx=64, cache_type="f32", ffn="gate")
        want = np.stack([ctx.eval([t]) for t in ids])
    rng = np.random.default_rng(0)
    add = {}
    for l in range(nl):
        hot = [np.arange(ff, dtype=np.int32) if which == "all" or e == 0 else
               np.sort(rng.choice(ff, size=ff // 2, replace=False)).astype(np.int32) for e in range(ne)]
        add[f"blk.{l}.ffn_exp_hot_count"] = np.array([len(h) for h in hot], np.int32)
        add[f"blk.{l}.ffn_exp_hot"] = np.concatenate(hot)
    path = rewrite_gguf(sparse, tmp_path / "hot.gguf", add=add)
    with Model(path, n_ctx=64, device=cuda_device) as m:
        assert m.device_info()["experts"]["hot_experts"] == nl * ne
        ctx = m.create_context(n_ctx=64, cache_type="f32", ffn="gate")
        got = np.stack([ctx.eval([t]) for t in ids])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.ptp(want))
