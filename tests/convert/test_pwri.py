"""PowerInfer's own files, as its release writes them (../shared/REFERENCE.md, "PowerInfer's
file layout"): a GGUF whose magic is PWRI, the threshold under powerinfer.sparse_threshold,
predictors fed the residual stream before ffn_norm, no activation key (ReGLU), and the GPU
index in a "<model>.generated.gpuidx" side file. No such file can be downloaded here, so
they are written from that layout with the gguf package: a tiny ReLU LLaMA's sparse file of
ours, rewritten. The reference for the sparse rule is transformers with a patched MLP."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf import GGUFValueType as VT  # noqa: E402
from gguf import GGUFReader, GGUFWriter  # noqa: E402

from conftest import SHIPPED_DIR  # noqa: E402
from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import hf_reference_model, make_hf_model  # noqa: E402

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402

torch.set_num_threads(1)


def _to_pwri(path):
    """Patch the magic in place: PowerInfer writes GGUF v3 with "PWRI" instead of "GGUF"."""
    with open(path, "r+b") as f:
        assert f.read(4) == b"GGUF"
        f.seek(0)
        f.write(b"PWRI")
    return path


def write_gpuidx(path, idx: list[np.ndarray], budget: int = 1 << 30):
    """PowerInfer's side file: architecture generic.gpu_index, blk.N.gpu_idx (i32 0/1) and
    blk.N.gpu_bucket (the sorted ids it marks) per layer, and the budget it was solved for."""
    w = GGUFWriter(str(path), "generic.gpu_index")
    w.add_uint64("split.vram_capacity", budget)
    for il, m in enumerate(idx):
        w.add_tensor(f"blk.{il}.gpu_idx", m.astype(np.int32))
        w.add_tensor(f"blk.{il}.gpu_bucket", np.flatnonzero(m).astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def pwri(tmp_path_factory):
    d = tmp_path_factory.mktemp("pwri")
    hf = make_hf_model("llama-relu", d / "hf", seed=4)
    opts = SparseOptions(calib=str(SHIPPED_DIR / "heldout.txt"), calib_tokens=800, profile_ctx=100)
    ours = convert(hf, d / "ours.gguf", "f32", progress=False, sparse=True, sparse_options=opts)
    r = GGUFReader(ours)
    keep_kv = [f for f in r.fields if f.startswith("powerinfer.")]
    n_layer = int(r.fields["llama.block_count"].parts[-1][0])
    ours_only = [t.name for t in r.tensors if t.name.endswith((".gpu_idx", ".gpu_bucket", ".ffn_freq"))]
    path = rewrite_gguf(ours, d / "model.powerinfer.gguf", drop=ours_only, drop_kv=keep_kv,
                        kv={"powerinfer.sparse_threshold": (0.0, VT.FLOAT32)})
    _to_pwri(path)
    tensors = {t.name: np.array(t.data) for t in r.tensors}
    return {"dir": d, "hf": hf, "path": path, "ours": ours, "n_layer": n_layer, "t": tensors}


def _decode(m, ids, mode, **kw):
    ctx = m.create_context(n_ctx=64, ffn=mode, cache_type="f32", **kw)
    return np.stack([ctx.eval([t]) for t in ids])


def _hf_powerinfer_rule(hf_dir, tensors, n_layer, ids, threshold=0.0):
    """transformers' LLaMA with PowerInfer's rule: in layer N, neuron i is computed iff
    (fc2 . relu(fc1 . h))[i] >= threshold, h = the residual stream entering ffn_norm."""
    model = hf_reference_model(hf_dir)
    for il, layer in enumerate(model.model.layers):
        fc1 = torch.tensor(tensors[f"blk.{il}.fc1.weight"], dtype=torch.float32)
        fc2 = torch.tensor(tensors[f"blk.{il}.fc2.weight"], dtype=torch.float32)
        seen = {}
        norm, mlp = layer.post_attention_layernorm, layer.mlp

        def norm_fwd(x, norm=norm, orig=norm.forward, seen=seen):
            seen["h"] = x
            return orig(x)

        def mlp_fwd(x, mlp=mlp, fc1=fc1, fc2=fc2, seen=seen):
            keep = (torch.relu(seen["h"] @ fc1.T) @ fc2.T) >= threshold
            a = torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x)
            return mlp.down_proj(a * keep)

        norm.forward = norm_fwd
        mlp.forward = mlp_fwd
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def test_pwri_dense_equals_ours_and_sparse_follows_powerinfers_rule(pwri):
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 384, size=20)]
    with Model(pwri["ours"]) as m:
        dense_ours = _decode(m, ids, "dense")
    with Model(pwri["path"]) as m:
        assert m.info.ffn_act == "relu"  # no activation key: ReGLU, as PowerInfer builds its LLaMA FFN
        assert m.context.ffn_mode == "sparse"
        np.testing.assert_array_equal(_decode(m, ids, "dense"), dense_ours)
        sparse = _decode(m, ids, "sparse")
    want = _hf_powerinfer_rule(pwri["hf"], pwri["t"], pwri["n_layer"], ids)
    rng_ = np.ptp(want)
    err = np.abs(sparse - want).max() / rng_
    assert err < 1e-4, err
    # and the rule differs from ours (predictor on the normed input): the files are not read alike
    with Model(pwri["ours"]) as m:
        assert np.abs(_decode(m, ids, "sparse") - sparse).max() > 1e-6 * rng_


def test_pwri_gpu_index_side_file(pwri, tmp_path):
    """The .generated.gpuidx next to the model is its GPU index: host-device places exactly
    those neurons, and equals the CPU."""
    import shutil

    path = tmp_path / "m.gguf"
    shutil.copy(pwri["path"], path)
    n_ff = pwri["t"]["blk.0.fc2.weight"].shape[0]
    rng = np.random.default_rng(0)
    idx = [(rng.random(n_ff) < 0.3) for _ in range(pwri["n_layer"])]
    write_gpuidx(str(path) + ".generated.gpuidx", idx)
    ids = list(range(5, 25))
    with Model(str(path)) as m:
        cpu = _decode(m, ids, "sparse")
    with Model(str(path), device="host-device", vram_budget="256M") as m:
        info = m.device_info()
        assert info["n_hot"] == sum(int(x.sum()) for x in idx)
        assert info["index_source"] == "file"
        np.testing.assert_allclose(_decode(m, ids, "sparse"), cpu, rtol=0, atol=2e-5 * np.abs(cpu).max())
    # a side file that disagrees with the model is an error naming the tensor
    bad = [x.copy() for x in idx]
    bad[1] = bad[1][:-1]
    write_gpuidx(str(path) + ".generated.gpuidx", bad)
    with pytest.raises(NativeError, match=r"blk\.1\.gpu_idx.*vector of"):
        Model(str(path))
    (tmp_path / "m.gguf.generated.gpuidx").write_bytes(b"GGUF" + bytes(8))
    with pytest.raises(NativeError, match="gpuidx"):
        Model(str(path))


def test_pwri_threshold_key(pwri, tmp_path):
    """PowerInfer's threshold key (powerinfer.sparse_threshold) is the cut: a higher one
    leaves fewer neurons active."""
    ids = list(range(5, 20))
    hi = rewrite_gguf(pwri["ours"], tmp_path / "hi.gguf",
                      drop=[n for n in pwri["t"] if n.endswith((".gpu_idx", ".gpu_bucket", ".ffn_freq"))],
                      drop_kv=[f for f in GGUFReader(pwri["ours"]).fields if f.startswith("powerinfer.")],
                      kv={"powerinfer.sparse_threshold": (2.0, VT.FLOAT32)})
    _to_pwri(hi)
    with Model(str(hi)) as m:
        assert m.info.sparse_threshold == 2.0
        ctx = m.create_context(n_ctx=64, ffn="sparse", cache_type="f32")
        for t in ids:
            ctx.eval([t])
        hi_density = ctx.stats()["density"]
    with Model(pwri["path"]) as m:
        ctx = m.create_context(n_ctx=64, ffn="sparse", cache_type="f32")
        for t in ids:
            ctx.eval([t])
        assert hi_density < ctx.stats()["density"]


def test_inspect_reads_pwri(pwri):
    from powerinfer_cpp.inspect import describe

    text = describe(pwri["path"])
    assert "PowerInfer's PWRI-magic GGUF v3" in text
    assert "activation relu (absent: a PowerInfer file)" in text
    assert "predictors on the residual stream" in text and "threshold 0" in text
    assert "loads: yes" in text
