"""Mixture-of-experts models (ffn/moe.c), beyond the architecture table (test_architectures.py:
logits of every MoE variant against transformers in f32, f16, q8_0, q4_0, greedy text):

- the expert selection counts equal the experts transformers' routers choose;
- a decode step reads exactly the router and its k experts per layer (plus the shared
  expert); a prompt reads each expert some token chose once;
- any batch split (tokens grouped by expert) equals token by token;
- bad files refused by name; sparse modes and sparse conversion refused for now (devices:
  test_moe_device.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf import GGUFValueType as VT  # noqa: E402
from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import VARIANTS, hf_reference_model, make_hf_model  # noqa: E402

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp.convert import ConvertError, convert  # noqa: E402

torch.set_num_threads(1)

N_POS = 24


@pytest.fixture(scope="module", params=["mixtral", "qwen2moe", "qwen3moe-top1", "olmoe"])
def case(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(variant)
    hf = make_hf_model(variant, d / "hf", seed=7)
    path = convert(hf, d / "f32.gguf", "f32", progress=False)
    with Model(path) as m:
        ids = [int(t) for t in np.random.default_rng(2).integers(3, m.n_vocab, size=N_POS)]
    return {"variant": variant, "hf": hf, "gguf": path, "ids": ids, "dir": d}


def hf_choices(hf_dir, ids) -> list[np.ndarray]:
    """Per layer, the experts transformers' router picks for each token [n_tok, k]: the
    router modules' own outputs (router_logits, scores, indices), caught by forward hooks."""
    ref = hf_reference_model(hf_dir)
    routers = [m for m in ref.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == len(ref.model.layers)
    got = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: got.append(out[2].numpy().copy()))
             for r in routers]
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return got


def test_expert_counts_are_transformers_choices(case):
    with Model(case["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        info = m.info
        ctx = m.context
        assert ctx.expert_counts().shape == (info.n_layer, info.n_expert)
        ctx.eval(case["ids"])
        counts = ctx.expert_counts()
        ctx.reset_stats()
        assert not ctx.expert_counts().any()
    want = np.stack([np.bincount(c.reshape(-1), minlength=info.n_expert) for c in hf_choices(case["hf"], case["ids"])])
    np.testing.assert_array_equal(counts, want)
    assert (counts.sum(axis=1) == N_POS * info.n_expert_used).all()


def _ffn_bytes_per_layer(info, n_distinct: np.ndarray) -> float:
    """An f32 file's FFN bytes for one layer pass: the router, each distinct chosen expert's
    gate, up and down, and the shared expert with its gate vector."""
    d, ff, fs = info.n_embd, info.n_ff_exp, info.n_ff_shexp
    shared = (3 * fs * d + d) * 4 if fs else 0
    return float(((info.n_expert * d + n_distinct * 3 * ff * d) * 4 + shared).sum())


def test_decode_reads_only_the_chosen_experts(case):
    ids = case["ids"]
    with Model(case["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        info = m.info
        ctx = m.context
        ctx.eval(ids[:8])
        ctx.reset_stats()
        for t in ids[8:12]:  # decode: each layer reads its router and k experts
            ctx.eval([t])
        st = ctx.stats()
        assert st["bytes"]["ffn"] == 4 * _ffn_bytes_per_layer(info, np.full(info.n_layer, info.n_expert_used))
        ctx.reset()
        ctx.reset_stats()
        ctx.eval(ids)  # a prompt: each chosen expert's rows once for the whole batch
        counts = ctx.expert_counts()
        assert ctx.stats()["bytes"]["ffn"] == _ffn_bytes_per_layer(info, (counts > 0).sum(axis=1))


def test_any_batch_split_equals_token_by_token(case):
    ids = case["ids"]
    with Model(case["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        whole = m.create_context(n_ctx=64, cache_type="f32").eval(ids, logits_all=True)
        parts = m.create_context(n_ctx=64, n_batch=5, cache_type="f32").eval(ids, logits_all=True)
        one = m.create_context(n_ctx=64, cache_type="f32", n_threads=1)
        steps = np.stack([one.eval([t]) for t in ids])
    scale = np.ptp(whole)
    np.testing.assert_allclose(parts, whole, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-5 * scale)


def test_info(case):
    _, kw = VARIANTS[case["variant"]]
    with Model(case["gguf"]) as m:
        info = m.info
    assert info.n_expert == kw.get("num_experts", kw.get("num_local_experts"))
    assert info.n_expert_used == kw["num_experts_per_tok"]
    assert info.n_ff_shexp == kw.get("shared_expert_intermediate_size", 0)
    assert info.expert_norm == kw.get("norm_topk_prob", case["variant"].startswith("mixtral"))


def test_sparse_modes_refused(case, tmp_path):
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    with Model(case["gguf"]) as m:
        for mode in ("sparse", "oracle", "gate"):
            with pytest.raises(NativeError, match=f"the {mode} FFN mode is not available for "
                                                  "mixture-of-experts models"):
                m.context.set_ffn_mode(mode)
    with pytest.raises(ConvertError, match="sparse conversion .* of a mixture-of-experts model"):
        convert(case["hf"], tmp_path / "s.gguf", "f32", progress=False, sparse=True,
                sparse_options=SparseOptions(sparsity=0.5))
    assert not (tmp_path / "s.gguf").exists()


# ---- bad files: each refused with the key or tensor named ---------------------------------

@pytest.fixture(scope="module")
def qwen2moe_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-moe")
    hf = make_hf_model("qwen2moe", d / "hf", seed=1)
    return convert(hf, d / "f32.gguf", "f32", progress=False), d


BAD = {
    "count": (dict(kv={"qwen2moe.expert_count": (5, VT.UINT32)}),
              r"tensor 'blk\.0\.ffn_gate_inp\.weight' \(the router\) has shape \[64, 6, 1, 1\], expected "
              r"\[64, 5\] \(qwen2moe.embedding_length, qwen2moe.expert_count\)"),
    "no-count": (dict(drop_kv=["qwen2moe.expert_count"]), "missing required key 'qwen2moe.expert_count'"),
    "used": (dict(kv={"qwen2moe.expert_used_count": (7, VT.UINT32)}),
             r"key 'qwen2moe.expert_used_count' = 7 is out of range \(must be 1 to 6\)"),
    "no-router": (dict(drop=["blk.1.ffn_gate_inp.weight"]), r"missing tensor 'blk\.1\.ffn_gate_inp\.weight'"),
    "no-experts": (dict(drop=["blk.0.ffn_up_exps.weight"]),
                   r"missing tensor 'blk\.0\.ffn_up_exps\.weight' \(the 6 experts of a mixture-of-experts layer"),
    "short-expert": (dict(tensors={"blk.1.ffn_down_exps.weight": lambda a: a[:-1]}),
                     r"tensor 'blk\.1\.ffn_down_exps\.weight' has shape \[32, 64, 5, 1\], expected \[32, 64, 6\]"),
    "width": (dict(kv={"qwen2moe.expert_feed_forward_length": (48, VT.UINT32)}),
              r"'blk\.0\.ffn_gate_exps\.weight' has shape \[64, 32, 6, 1\], expected \[64, 48, 6\].*"
              r"qwen2moe.expert_feed_forward_length = 48"),
    "no-shared": (dict(drop=["blk.0.ffn_down_shexp.weight"]), r"missing tensor 'blk\.0\.ffn_down_shexp\.weight'"),
    "gating": (dict(kv={"qwen2moe.expert_gating_func": (2, VT.UINT32)}),
               "key 'qwen2moe.expert_gating_func' = 2: only the softmax router"),
    "norm-type": (dict(kv={"qwen2moe.expert_weights_norm": (1, VT.UINT32)}), "qwen2moe.expert_weights_norm"),
    "dense-ffn": (dict(add={"blk.1.ffn_down.weight": np.zeros((64, 96), np.float32)}),
                  r"tensor 'blk\.1\.ffn_down\.weight' in a mixture-of-experts layer"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_moe_files(qwen2moe_gguf, bad):
    src, d = qwen2moe_gguf
    kw, match = BAD[bad]
    with pytest.raises(NativeError, match=match):
        Model(rewrite_gguf(src, d / f"{bad}.gguf", **kw))


def test_scale_key_scales_the_routing_weights(qwen2moe_gguf):
    """qwen2moe.expert_weights_scale multiplies the routed experts' weights (not the shared
    expert's): the experts' share of the FFN output doubles with a scale of 2."""
    src, d = qwen2moe_gguf
    x2 = rewrite_gguf(src, d / "scale2.gguf", kv={"qwen2moe.expert_weights_scale": (2.0, VT.FLOAT32)})
    x1 = rewrite_gguf(src, d / "scale1.gguf", kv={"qwen2moe.expert_weights_scale": (1.0, VT.FLOAT32)})
    ids = [5, 9, 17]
    with Model(src) as a, Model(x1) as b, Model(x2) as c:
        base, one, two = (m.context.eval(ids) for m in (a, b, c))
    np.testing.assert_array_equal(one, base)
    assert np.abs(two - base).max() > 1e-3 * np.ptp(base)


def test_cli_converts_moe_dense_by_default(case, tmp_path, capsys):
    """The CLI's default for a SwiGLU model is a gate-sparse file; for a mixture of experts,
    which has no sparse form yet, a dense one; asking for sparsity is refused by name."""
    from powerinfer_cpp.convert.cli import main

    out = tmp_path / "cli.gguf"
    assert main([str(case["hf"]), "-o", str(out), "--outtype", "f32", "-q"]) == 0
    with Model(out) as m:
        assert m.info.n_expert > 0 and m.context.ffn_mode == "dense"
    assert main([str(case["hf"]), "-o", str(tmp_path / "s.gguf"), "--sparsity", "0.5", "-q"]) == 1
    assert "mixture-of-experts model" in capsys.readouterr().err


def test_router_f32_and_experts_quantized(case, tmp_path):
    """A q4_0 file keeps the routers F32 (as llama.cpp's) and stores each expert tensor as 3-D
    Q4_0 rows (the block runs along a row of one expert)."""
    import gguf

    path = convert(case["hf"], tmp_path / "q4.gguf", "q4_0", progress=False)
    ts = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    Q = gguf.GGMLQuantizationType
    for name, t in ts.items():
        if "ffn_gate_inp" in name:
            assert t.tensor_type == Q.F32, name
        elif "_exps" in name:
            assert t.tensor_type == Q.Q4_0 and len(t.shape) == 3, name


@pytest.mark.parametrize("outtype", ["q4_k", "q6_k", "iq4_nl"])
def test_experts_in_other_types(tmp_path_factory, outtype):
    """Experts are views of rows of the 3-D tensor through the dense kernel table, so every
    weight type works: a model with 256-wide rows (whole K-quant blocks) in K-quants and
    IQ4_NL against its f32 file (a misaddressed expert row gives errors of order 1)."""
    d = tmp_path_factory.mktemp(f"kq-{outtype}")
    hf = make_hf_model("qwen3moe-top1", d / "hf", seed=4, hidden_size=256, head_dim=64,
                       moe_intermediate_size=256, intermediate_size=256, num_experts_per_tok=2)
    ids = list(range(5, 25))
    with Model(convert(hf, d / "f32.gguf", "f32", progress=False), n_ctx=64, cache_type="f32") as m:
        want = m.eval(ids, logits_all=True).astype(np.float64)
    path = convert(hf, d / f"{outtype}.gguf", outtype, progress=False)
    with Model(path, n_ctx=64, cache_type="f32") as m:
        assert m.info.weight_type == outtype.split("_m")[0]
        got = m.eval(ids, logits_all=True).astype(np.float64)
    nrmse = np.sqrt(((got - want) ** 2).mean() / ((want - want.mean()) ** 2).mean())
    print(f"{outtype}: nrmse {nrmse:.2e}")
    assert nrmse < K_QUANT_NRMSE[outtype]


# Normalized RMS logit error against the f32 file, measured 1.26e-1 (q4_k), 4.2e-2 (q6_k),
# 1.23e-1 (iq4_nl) on this random tiny model (whose routing the quantization moves a little);
# a wrong row layout gives errors of order 1.
K_QUANT_NRMSE = {"q4_k": 2e-1, "q6_k": 8e-2, "iq4_nl": 2e-1}


def test_router_ties_resolved_as_transformers(tmp_path):
    """Two experts with the same router row tie exactly in every token's probabilities: the
    top-1 choice between them is transformers' (torch.topk on the CPU: the lower id), and
    since the two experts' weights differ, so are the logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = make_hf_model("qwen3moe-top1", tmp_path / "src", seed=6)
    d = tmp_path / "tie"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    for k in [k for k in sd if k.endswith("mlp.gate.weight")]:
        sd[k] = sd[k].copy()
        sd[k][3] = sd[k][1]   # experts 1 and 3 score alike
        sd[k][0] -= 1.0       # experts 1/3 win often (they tie for first)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    path = convert(d, tmp_path / "tie.gguf", "f32", progress=False)
    ids = list(range(3, 3 + N_POS))
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.eval(ids, logits_all=True).astype(np.float64)
        counts = m.context.expert_counts()
    choices = hf_choices(d, ids)
    assert sum((c == 1).sum() for c in choices) > 0  # the tie was met, and resolved to 1
    assert sum((c == 3).sum() for c in choices) == 0
    want_counts = np.stack([np.bincount(c.reshape(-1), minlength=4) for c in choices])
    np.testing.assert_array_equal(counts, want_counts)
    with torch.no_grad():
        want = hf_reference_model(d)(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)
