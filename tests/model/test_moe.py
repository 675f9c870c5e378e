"""Mixture-of-experts models (ffn/moe.c), beyond the architecture table (test_architectures.py:
logits of every MoE variant against transformers in f32, f16, q8_0, q4_0, greedy text):

- the expert selection counts equal the experts transformers' routers choose;
- a decode step reads exactly the router and its k experts per layer (plus the shared
  expert); a prompt reads each expert some token chose once;
- any batch split (tokens grouped by expert) equals token by token;
- bad files refused by name; the sparse modes of a dense file refused by name (sparse
  experts: test_moe_sparse.py; devices: test_moe_device.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batch_util import check_splits_equal_tokens  # noqa: E402
from conftest import SHIPPED_DIR  # noqa: E402
from gguf import GGUFValueType as VT  # noqa: E402
from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import VARIANTS, hf_reference_model, make_hf_model  # noqa: E402

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp.convert import ConvertError, convert  # noqa: E402

torch.set_num_threads(1)

N_POS = 24


@pytest.fixture(scope="module", params=["mixtral", "qwen2moe", "qwen3moe-top1", "olmoe", "gptoss"])
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
    check_splits_equal_tokens(case["gguf"], case["ids"])


def test_info(case):
    _, kw = VARIANTS[case["variant"]]
    with Model(case["gguf"]) as m:
        info = m.info
    assert info.n_expert == kw.get("num_experts", kw.get("num_local_experts"))
    assert info.n_expert_used == kw["num_experts_per_tok"]
    assert info.n_ff_shexp == kw.get("shared_expert_intermediate_size", 0)
    # Mixtral and gpt-oss always renormalise (gpt-oss: a softmax over the top-k logits)
    assert info.expert_norm == kw.get("norm_topk_prob", case["variant"].startswith(("mixtral", "gptoss")))


def test_sparse_modes_of_a_dense_file_refused(case, tmp_path):
    """A dense MoE file has no sparse experts: each mode names what it lacks (their sparse
    form: test_moe_sparse.py); gpt-oss's clamped SwiGLU has no gate threshold to calibrate."""
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    with Model(case["gguf"]) as m:
        for mode, what in (("sparse", "needs predictors"), ("oracle", "transposed down projection"),
                           ("gate", "needs calibrated gate thresholds")):
            with pytest.raises(NativeError, match=f"the {mode} FFN .*{what}"):
                m.context.set_ffn_mode(mode)
    if case["variant"].startswith("gptoss"):
        with pytest.raises(ConvertError, match="sparse experts need a gate threshold on the experts' "
                                               "activation, and 'swiglu_oai' has none"):
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
    """The CLI's default for a SwiGLU model is a gate-sparse file; for a mixture of SwiGLU
    experts, whose thresholds need a level, a dense one; --sparsity S gives the sparse
    experts' file (gate mode), refused by name for gpt-oss's clamped SwiGLU."""
    from powerinfer_cpp.convert.cli import main

    out = tmp_path / "cli.gguf"
    assert main([str(case["hf"]), "-o", str(out), "--outtype", "f32", "-q"]) == 0
    with Model(out) as m:
        assert m.info.n_expert > 0 and m.context.ffn_mode == "dense"
    calib = str(SHIPPED_DIR / "heldout.txt")
    args = [str(case["hf"]), "-o", str(tmp_path / "s.gguf"), "--outtype", "f32", "--sparsity", "0.5",
            "--calib", calib, "--calib-tokens", "200", "-q"]
    if case["variant"].startswith("gptoss"):
        assert main(args) == 1
        assert "'swiglu_oai' has none" in capsys.readouterr().err
        return
    assert main(args) == 0
    with Model(tmp_path / "s.gguf") as m:
        assert m.context.ffn_mode == "gate"


def test_router_f32_and_experts_quantized(case, tmp_path):
    """A q4_0 file keeps the routers F32 (as llama.cpp's) and stores each expert tensor as 3-D
    Q4_0 rows (the block runs along a row of one expert); biases (gpt-oss's [n_expert, rows]
    expert biases too) stay F32."""
    import gguf

    path = convert(case["hf"], tmp_path / "q4.gguf", "q4_0", progress=False)
    ts = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    Q = gguf.GGMLQuantizationType
    for name, t in ts.items():
        if "ffn_gate_inp" in name or name.endswith(".bias"):
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


def _tied_router_run(tmp_path, variant, seed, tie):
    """variant's model with its routers' rows edited by tie(router weight), converted: the
    runtime's choices must be transformers' (expert counts equal, logits within 1e-4 of
    their range). Returns transformers' choices per layer [n_tok, k]."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = make_hf_model(variant, tmp_path / "src", seed=seed)
    d = tmp_path / "tie"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    for k in [k for k in sd if k.endswith("mlp.gate.weight")]:
        sd[k] = sd[k].copy()
        tie(sd[k])
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    path = convert(d, tmp_path / "tie.gguf", "f32", progress=False)
    ids = list(range(3, 3 + N_POS))
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.eval(ids, logits_all=True).astype(np.float64)
        counts = m.context.expert_counts()
    choices = hf_choices(d, ids)
    want_counts = np.stack([np.bincount(c.reshape(-1), minlength=counts.shape[1]) for c in choices])
    np.testing.assert_array_equal(counts, want_counts)
    with torch.no_grad():
        want = hf_reference_model(d)(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)
    return choices


def test_router_ties_resolved_as_transformers(tmp_path):
    """Two experts with the same router row tie exactly in every token's probabilities: the
    top-1 choice between them is transformers' (torch.topk on the CPU), and
    since the two experts' weights differ, so are the logits."""
    def tie(w):
        w[3] = w[1]   # experts 1 and 3 score alike
        w[0] -= 1.0   # experts 1/3 win often (they tie for first)

    choices = _tied_router_run(tmp_path, "qwen3moe-top1", 6, tie)
    assert sum((c == 1).sum() for c in choices) > 0  # the tie was met, and resolved to 1
    assert sum((c == 3).sum() for c in choices) == 0


@pytest.mark.parametrize("variant", ["qwen3moe", "olmoe"])
def test_router_ties_at_the_cut_resolved_as_transformers(tmp_path, variant):
    """Top-2 of 8 with the router rows of experts 2, 3 made those of 0, 1 and 5 that of 4:
    a twin pair often straddles the cut, and torch.topk (std::nth_element over 8 values)
    then keeps the higher id as often as the lower one. The runtime's choices (expert
    counts) and logits are transformers'."""
    def tie(w):
        w[2:4] = w[0:2]
        w[5] = w[4]

    choices = _tied_router_run(tmp_path, variant, 7, tie)
    # the higher twin kept without the lower one: a tie resolved against the lower id
    higher = sum(int((((c == 2) | (c == 3)).any(axis=1) & ~((c == 0) | (c == 1)).any(axis=1)).sum()) +
                 int(((c == 5).any(axis=1) & ~(c == 4).any(axis=1)).sum()) for c in choices)
    assert higher > 0

# ---- gpt-oss: what its row in the architecture table exercises, its bad files, MXFP4 ------

@pytest.fixture(scope="module")
def gptoss_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss")
    hf = make_hf_model("gptoss", d / "hf", seed=5)
    return convert(hf, d / "f32.gguf", "f32", progress=False), hf, d


def _logits(path, ids):
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        return m.eval(ids, logits_all=True).astype(np.float64)


def test_gptoss_features_move_the_logits(gptoss_gguf):
    """Each gpt-oss feature the table's f32 bound (1e-4 of the logit range) checks moves the
    tiny model's logits by more than that: without the sinks, the windows, the SwiGLU's clamp,
    YaRN, the router's or the experts' biases, the logits differ by > 5e-4 of their range
    (measured: YaRN 8.6e-4, the random model's attention scores being small; the others
    > 1e-2)."""
    src, _, d = gptoss_gguf
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 384, size=32)]
    base = _logits(src, ids)
    A = "gpt-oss"
    changes = {
        "sinks": dict(tensors={f"blk.{il}.attn_sinks.weight": lambda a: np.full_like(a, -1e4) for il in (0, 1)}),
        "window": dict(kv={f"{A}.attention.sliding_window": (64, VT.UINT32)}),
        "clamp": dict(kv={f"{A}.swiglu_clamp_exp": (1e4, VT.FLOAT32)}),
        "yarn": dict(kv={f"{A}.rope.scaling.type": ("none", VT.STRING)}),
        "router-bias": dict(tensors={f"blk.{il}.ffn_gate_inp.bias": np.zeros_like for il in (0, 1)}),
        "expert-bias": dict(tensors={f"blk.{il}.ffn_down_exps.bias": np.zeros_like for il in (0, 1)}),
    }
    for name, kw in changes.items():
        got = _logits(rewrite_gguf(src, d / f"no-{name}.gguf", **kw), ids)
        moved = np.abs(got - base).max() / np.ptp(base)
        print(f"without {name}: logits move {moved:.3f} of their range")
        assert moved > 5e-4, name


def test_gptoss_llama_cpp_file(gptoss_gguf, tmp_path):
    """llama.cpp's gpt-oss file has none of our keys (activation, SwiGLU limit, YaRN's betas:
    its defaults 7, 32, 1 apply): with the limit the model has (7), the same logits."""
    _, _, d = gptoss_gguf
    hf = make_hf_model("gptoss-top4", tmp_path / "hf", seed=2)
    ours = convert(hf, tmp_path / "ours.gguf", "f32", progress=False)
    A = "gpt-oss"
    lcpp = rewrite_gguf(ours, tmp_path / "lcpp.gguf", drop_kv=[
        "powerinfer.format_version", "powerinfer.ffn_activation", "powerinfer.hf_hidden_act",
        f"{A}.swiglu_clamp_exp", f"{A}.rope.scaling.yarn_beta_fast", f"{A}.rope.scaling.yarn_beta_slow",
        f"{A}.expert_weights_norm", f"{A}.expert_gating_func"])
    ids = list(range(3, 3 + N_POS))
    np.testing.assert_array_equal(_logits(lcpp, ids), _logits(ours, ids))
    with Model(lcpp) as m:
        assert m.info.arch == A and m.info.n_expert == 8 and m.info.n_expert_used == 4
        assert m.info.ffn_act == "swiglu_oai" and m.info.expert_norm


GPTOSS_BAD = {
    "no-sinks": (dict(drop=["blk.1.attn_sinks.weight"]),
                 r"missing tensor 'blk\.1\.attn_sinks\.weight' \(architecture 'gpt-oss' has a learned "
                 r"attention sink per head: \[4\] logits\)"),
    "short-sinks": (dict(tensors={"blk.0.attn_sinks.weight": lambda a: a[:3]}), r"blk\.0\.attn_sinks\.weight"),
    "count": (dict(kv={"gpt-oss.expert_count": (3, VT.UINT32)}),
              r"tensor 'blk\.0\.ffn_gate_inp\.weight' \(the router\) has shape \[64, 4, 1, 1\], expected "
              r"\[64, 3\]"),
    "no-router": (dict(drop=["blk.0.ffn_gate_inp.weight"]), r"missing tensor 'blk\.0\.ffn_gate_inp\.weight'"),
    "no-router-bias": (dict(drop=["blk.1.ffn_gate_inp.bias"]),
                       r"missing tensor 'blk\.1\.ffn_gate_inp\.bias' \(architecture 'gpt-oss' has biased"),
    "no-expert-bias": (dict(drop=["blk.0.ffn_up_exps.bias"]), r"missing tensor 'blk\.0\.ffn_up_exps\.bias'"),
    "expert-bias-shape": (dict(tensors={"blk.1.ffn_down_exps.bias": lambda a: a[:3]}),
                          r"tensor 'blk\.1\.ffn_down_exps\.bias' has shape \[64, 3, 1, 1\], expected \[64, 4\]"),
    "limit": (dict(kv={"gpt-oss.swiglu_clamp_exp": (0.0, VT.FLOAT32)}),
              r"key 'gpt-oss\.swiglu_clamp_exp' = 0 \(the clamped SwiGLU's limit must be finite and > 0\)"),
    "yarn-ctx": (dict(drop_kv=["gpt-oss.rope.scaling.original_context_length"]),
                 r"missing required key 'gpt-oss\.rope\.scaling\.original_context_length'"),
    "ffn-norm": (dict(drop=["blk.0.post_attention_norm.weight"]),
                 r"blk\.0\.post_attention_norm\.weight"),
}


@pytest.mark.parametrize("bad", list(GPTOSS_BAD))
def test_bad_gptoss_files(gptoss_gguf, bad):
    src, _, d = gptoss_gguf
    kw, match = GPTOSS_BAD[bad]
    with pytest.raises(NativeError, match=match):
        Model(rewrite_gguf(src, d / f"bad-{bad}.gguf", **kw))


def test_gptoss_config_refusals(tmp_path):
    """What the runtime does not compute is refused by the converter, by name."""
    import json

    hf = make_hf_model("gptoss", tmp_path / "hf", seed=1)
    cfg = json.loads((hf / "config.json").read_text())
    cases = {
        "swiglu_alpha": ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
        "attention_bias": ({"attention_bias": False}, "attention_bias=false"),
        "truncate": ({"rope_parameters": {**cfg["rope_parameters"], "truncate": True}}, "truncate true"),
        "quantized": ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config 'gptq'"),
    }
    for name, (upd, match) in cases.items():
        (hf / "config.json").write_text(json.dumps({**cfg, **upd}))
        with pytest.raises(ConvertError, match=match):
            convert(hf, tmp_path / f"{name}.gguf", "f32", progress=False)


# MXFP4 experts (llama.cpp's gpt-oss files): normalized RMS logit error against transformers
# run with the same dequantized expert weights (our MXFP4 dots round the activations to 8
# bits, as llama.cpp's do), and against the f32 model (the 4-bit experts' own error).
# Measured on this tiny model: 3.0e-4 and 7.6e-3; the bounds a few times above (a misaddressed
# block or a wrong nibble order gives errors of order 1).
MXFP4_NRMSE_SAME_WEIGHTS = 2e-3
MXFP4_NRMSE_F32 = 3e-2


def test_gptoss_mxfp4_experts(gptoss_gguf):
    """The f32 file with every ffn_*_exps weight quantized to MXFP4 by gguf.quants (block 32
    along a row of one expert, as llama.cpp's converter stores gpt-oss's experts), against
    transformers given the dequantized weights (gate and up back into their interleaved
    columns) and against the f32 model."""
    import gguf
    from gguf.quants import dequantize, quantize

    src, hf, d = gptoss_gguf
    MX = gguf.GGMLQuantizationType.MXFP4
    deq = {}

    def to_mxfp4(name):
        def f(a):
            q = quantize(np.ascontiguousarray(a, dtype=np.float32), MX)
            deq[name] = dequantize(q, MX).reshape(a.shape)
            return q, MX
        return f

    names = [f"blk.{il}.ffn_{p}_exps.weight" for il in (0, 1) for p in ("gate", "up", "down")]
    path = rewrite_gguf(src, d / "mxfp4.gguf", tensors={n: to_mxfp4(n) for n in names})
    with Model(path) as m:
        assert m.info.weight_type == "mxfp4"
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 384, size=N_POS)]
    got = _logits(path, ids)
    ref = hf_reference_model(hf)
    with torch.no_grad():
        f32 = ref(torch.tensor([ids])).logits[0].double().numpy()
        for il, layer in enumerate(ref.model.layers):
            ex = layer.mlp.experts
            gu = ex.gate_up_proj.data  # [n_expert, d, 2 ff], gate and up interleaved
            gu[:, :, 0::2] = torch.from_numpy(deq[f"blk.{il}.ffn_gate_exps.weight"].transpose(0, 2, 1))
            gu[:, :, 1::2] = torch.from_numpy(deq[f"blk.{il}.ffn_up_exps.weight"].transpose(0, 2, 1))
            ex.down_proj.data[:] = torch.from_numpy(deq[f"blk.{il}.ffn_down_exps.weight"].transpose(0, 2, 1))
        same = ref(torch.tensor([ids])).logits[0].double().numpy()

    def nrmse(a, b):
        return np.sqrt(((a - b) ** 2).mean() / ((b - b.mean()) ** 2).mean())

    e_same, e_f32 = nrmse(got, same), nrmse(got, f32)
    print(f"mxfp4 experts: nrmse {e_same:.2e} against the same weights, {e_f32:.2e} against f32")
    assert e_same < MXFP4_NRMSE_SAME_WEIGHTS and e_f32 < MXFP4_NRMSE_F32


def _hf_mxfp4(codes_ggml: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 bytes [..., G * 17] as the released checkpoints store them: (blocks
    [..., G, 16] with values 2j / 2j + 1 in byte j's low / high nibble, scales [..., G])."""
    q = codes_ggml.reshape(codes_ggml.shape[:-1] + (-1, 17))
    vals = np.concatenate([q[..., 1:] & 0x0F, q[..., 1:] >> 4], axis=-1)  # value order 0..31
    return (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8), q[..., 0].copy()


def test_gptoss_mxfp4_checkpoint(gptoss_gguf, tmp_path):
    """A checkpoint as the released ones (quantization_config mxfp4, the experts as
    *_blocks / *_scales, gate and up rows interleaved) converts with its experts kept MXFP4
    bit for bit (any outtype), and runs as transformers does on the weights its own
    dequantization (convert_moe_packed_tensors) gives."""
    import json
    import shutil

    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, hf, _ = gptoss_gguf
    d = tmp_path / "mx"
    shutil.copytree(hf, d)
    sd = load_file(str(d / "model.safetensors"))
    MX = gguf.GGMLQuantizationType.MXFP4
    want_bytes, deq = {}, {}
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = np.ascontiguousarray(sd.pop(k).transpose(0, 2, 1))  # [E, out, in]
        q = quantize(rows, MX)
        blocks, scales = _hf_mxfp4(q)
        sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
        deq[k] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                            dtype=torch.float32)  # [E, in, out], transformers' layout
        want_bytes[k] = q
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (d / "config.json").write_text(json.dumps(cfg))
    path = convert(d, tmp_path / "mx.gguf", "f16", progress=False)
    ts = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for il in (0, 1):
        L = f"model.layers.{il}.mlp.experts."
        gu, dn = want_bytes[L + "gate_up_proj"], want_bytes[L + "down_proj"]
        for name, want in ((f"blk.{il}.ffn_gate_exps.weight", gu[:, 0::2]),
                           (f"blk.{il}.ffn_up_exps.weight", gu[:, 1::2]),
                           (f"blk.{il}.ffn_down_exps.weight", dn)):
            assert ts[name].tensor_type == MX, name
            np.testing.assert_array_equal(np.asarray(ts[name].data).reshape(want.shape), want, err_msg=name)
        assert ts[f"blk.{il}.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    ref = hf_reference_model(hf)
    with torch.no_grad():
        for il, layer in enumerate(ref.model.layers):
            L = f"model.layers.{il}.mlp.experts."
            layer.mlp.experts.gate_up_proj.data[:] = deq[L + "gate_up_proj"]
            layer.mlp.experts.down_proj.data[:] = deq[L + "down_proj"]
        ids = [int(t) for t in np.random.default_rng(5).integers(3, 384, size=N_POS)]
        want = ref(torch.tensor([ids])).logits[0].double().numpy()
    got = _logits(path, ids)
    nrmse = np.sqrt(((got - want) ** 2).mean() / ((want - want.mean()) ** 2).mean())
    print(f"mxfp4 checkpoint (f16 rest): nrmse {nrmse:.2e} against transformers on its dequantized experts")
    assert nrmse < MXFP4_NRMSE_SAME_WEIGHTS


def _fused_checkpoint(hf_dir, out_dir, drop: str | None = None):
    """hf_dir rewritten as a checkpoint of transformers >= 5's in-memory layout (its
    state_dict: each layer's experts fused into ``mlp.experts.gate_up_proj`` and
    ``down_proj``, Mixtral's router at ``mlp.gate``), less the tensors whose names end in
    ``drop``."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(hf_dir, out_dir)
    (out_dir / "model.safetensors").unlink()
    sd = {k: v.detach().clone().contiguous() for k, v in hf_reference_model(hf_dir).state_dict().items()}
    fused = [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]
    assert len(fused) == 2, sorted(sd)    # the test means nothing unless the layout is fused
    if drop is not None:
        sd = {k: v for k, v in sd.items() if not k.endswith(drop)}
    save_file(sd, str(out_dir / "model.safetensors"))
    return out_dir


@pytest.mark.parametrize("variant", ["mixtral", "qwen2moe", "qwen3moe-top1", "olmoe"])
def test_fused_expert_checkpoint_converts_like_per_expert(variant, tmp_path):
    """A checkpoint written from transformers >= 5's state_dict keeps the experts fused
    ([n_expert, 2 ff, d] gate-then-up, [n_expert, d, ff] down): it converts to the same file,
    tensor for tensor, as the per-expert checkpoint save_pretrained writes."""
    import gguf

    hf = make_hf_model(variant, tmp_path / "hf", seed=3)
    want = convert(hf, tmp_path / "per-expert.gguf", "f32", progress=False)
    got = convert(_fused_checkpoint(hf, tmp_path / "fused"), tmp_path / "fused.gguf", "f32", progress=False)
    a = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(want)).tensors}
    b = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(got)).tensors}
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_fused_expert_checkpoint_missing_down_refused(tmp_path):
    """Half a fused layout (no down_proj) is refused naming the tensors it lacks."""
    hf = make_hf_model("qwen3moe-top1", tmp_path / "hf", seed=3)
    bad = _fused_checkpoint(hf, tmp_path / "fused", drop="mlp.experts.down_proj")
    with pytest.raises(ConvertError, match=r"missing tensors: .*down_proj"):
        convert(bad, tmp_path / "bad.gguf", "f32", progress=False)
