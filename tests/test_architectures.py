"""One table for every architecture: tiny models made with transformers from a config
(random seeded weights, biases nonzero, GQA/MQA, tied and untied, odd head sizes), saved,
converted and run by the native runtime, against transformers (CPU torch, float32).

Per variant: all logits over 40 positions (f32 weights and cache: max error <= 1e-4 of the
logit range; f16 / q8_0 / q4_0: the normalized RMS bounds below), greedy decoding, and for
the ReLU-family ones the sparse file: oracle == dense and host-device == cpu."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import SHIPPED_DIR  # noqa: E402
from hf_models import MOE_VARIANTS, hf_reference_model, make_hf_model  # noqa: E402

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402

torch.set_num_threads(1)

# variant -> whether its FFN is ReLU-family (runs sparse)
VARIANTS = {
    "llama": False, "llama-relu": True, "llama3": False, "prosparse": True, "bamboo": True,
    "mistral-nemo": False,
    "qwen2": False, "qwen2-tied": False, "qwen3": False, "qwen3-tied": False,
    "olmo2": False, "olmo2-tied": False, "smollm3": False, "smollm3-untied": False,
    "opt": True, "opt-untied": True,
    "falcon-7b": False, "falcon-7b-bias": False, "falcon-mha": False, "falcon-40b": False,
    "falcon-40b-1ln": False, "falcon-rw-like": False, "falcon-relu": True,
    "phi3": False,
    # mixtures of experts (hf_models.MOE_VARIANTS; their own tests: test_moe.py)
    "mixtral": False, "mixtral-top1": False, "qwen2moe": False, "qwen2moe-norm": False,
    "qwen3moe": False, "qwen3moe-top1": False, "olmoe": False, "olmoe-norm": False,
}
N_POS = 40

# Normalized RMS logit error against transformers per weight type (f32 cache: the weights'
# error alone); random tiny models, so the quantized bounds are loose but still catch a
# wrong layout (which gives errors of order 1). Measured over the table: f16 2.0-5.6e-4,
# q8_0 0.8-1.5e-2, q4_0 1.2-19.1e-2 (the top: smollm3's 4 layers, olmo2 1.8e-1; f32: max
# error 1.1-2.7e-7 of the logit range). Rows
# of 48 columns are not whole Q8_0/Q4_0 blocks: those variants keep f16 there.
QUANT_NRMSE = {"f16": 2e-3, "q8_0": 3e-2, "q4_0": 2e-1}


@pytest.fixture(scope="module", params=list(VARIANTS))
def arch_case(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(variant)
    hf_dir = make_hf_model(variant, d / "hf", seed=5)
    ref = hf_reference_model(hf_dir)
    gguf = convert(hf_dir, d / "f32.gguf", outtype="f32", progress=False)
    rng = np.random.default_rng(1)
    with Model(gguf) as m:
        ids = [int(t) for t in rng.integers(3, m.n_vocab, size=N_POS)]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].double().numpy()
    return {"variant": variant, "hf": hf_dir, "ref": ref, "gguf": gguf, "ids": ids,
            "want": want, "dir": d}


def test_logits_f32(arch_case):
    with Model(arch_case["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.eval(arch_case["ids"], logits_all=True).astype(np.float64)
        # decode reads what the prompt wrote: token by token equals the batch
        step = m.create_context(n_ctx=64, cache_type="f32")
        rows = np.stack([step.eval([t]) for t in arch_case["ids"][:12]])
    want = arch_case["want"]
    rng_ = want.max() - want.min()
    err = np.abs(got - want).max() / rng_
    print(f"{arch_case['variant']}: f32 max error / logit range {err:.2e}")
    assert err <= 1e-4, f"{arch_case['variant']}: max logit error {err:.2e} of the range"
    np.testing.assert_allclose(rows, got[:12], rtol=0, atol=1e-5 * rng_)


@pytest.mark.parametrize("outtype", list(QUANT_NRMSE))
def test_logits_quantized(arch_case, outtype):
    gguf = convert(arch_case["hf"], arch_case["dir"] / f"{outtype}.gguf", outtype=outtype,
                   progress=False)
    with Model(gguf, n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.eval(arch_case["ids"], logits_all=True).astype(np.float64)
    want = arch_case["want"]
    nrmse = np.sqrt(((got - want) ** 2).mean() / ((want - want.mean()) ** 2).mean())
    print(f"{arch_case['variant']}: {outtype} nrmse {nrmse:.2e}")
    assert nrmse < QUANT_NRMSE[outtype], f"{arch_case['variant']} {outtype}: nrmse {nrmse:.3g}"


def test_greedy(arch_case):
    """16 greedy tokens of ours, each transformers' argmax given the same prefix (or within
    1e-4 of the logit range of it: random models have near-ties float rounding may flip)."""
    prompt = arch_case["ids"][:6]
    with Model(arch_case["gguf"], n_ctx=64, n_threads=2) as m:
        out = m.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True).tokens
    assert len(out) == 16
    seq = list(prompt) + list(out)
    with torch.no_grad():
        logits = arch_case["ref"](torch.tensor([seq])).logits[0].double().numpy()
    for k, tok in enumerate(out):
        row = logits[len(prompt) - 1 + k]
        assert row.max() - row[tok] <= 1e-4 * (row.max() - row.min()), (arch_case["variant"], k)


@pytest.fixture(scope="module")
def sparse_case(arch_case):
    if not VARIANTS[arch_case["variant"]]:
        pytest.skip("not a ReLU-family FFN: no sparse file (see test_gate_sparsity)")
    opts = SparseOptions(calib=str(SHIPPED_DIR / "heldout.txt"), calib_tokens=800, profile_ctx=100,
                         ilp_time_limit=5.0)
    path = convert(arch_case["hf"], arch_case["dir"] / "sparse.gguf", outtype="f32",
                   progress=False, sparse=True, sparse_options=opts)
    return path


def _decode(m, ids, mode):
    ctx = m.create_context(n_ctx=64, n_threads=2, ffn=mode, cache_type="f32")
    return np.stack([ctx.eval([t]) for t in ids])


def test_sparse_oracle_equals_dense_and_host_device_equals_cpu(arch_case, sparse_case):
    ids = arch_case["ids"][:24]
    with Model(sparse_case) as m:
        dense = _decode(m, ids, "dense")
        oracle = _decode(m, ids, "oracle")
        sparse = _decode(m, ids, "sparse")
    scale = np.abs(dense).max()
    np.testing.assert_allclose(oracle, dense, rtol=0, atol=2e-5 * scale)
    # dense logits of the sparse file are transformers' (ffn_down_t holds the same weights)
    np.testing.assert_allclose(dense, arch_case["want"][:24], rtol=0,
                               atol=1e-4 * np.ptp(arch_case["want"]))
    # hot neurons on the host-device backend, cold on the CPU: the CPU's results
    with Model(sparse_case, device="host-device", vram_budget="64M") as m:
        assert m.device_info()["n_hot"] > 0
        np.testing.assert_allclose(_decode(m, ids, "oracle"), oracle, rtol=0, atol=2e-5 * scale)
        np.testing.assert_allclose(_decode(m, ids, "sparse"), sparse, rtol=0, atol=2e-5 * scale)
        np.testing.assert_allclose(_decode(m, ids, "dense"), dense, rtol=0, atol=2e-5 * scale)


# ---- files the runtime refuses, each with the key or tensor named ----------------------

def _variant_gguf(tmp_path_factory, variant):
    d = tmp_path_factory.mktemp(f"bad-{variant}")
    hf_dir = make_hf_model(variant, d / "hf", seed=2)
    return convert(hf_dir, d / "f32.gguf", outtype="f32", progress=False), d


@pytest.fixture(scope="module")
def opt_gguf(tmp_path_factory):
    return _variant_gguf(tmp_path_factory, "opt")


@pytest.fixture(scope="module")
def falcon_gguf(tmp_path_factory):
    return _variant_gguf(tmp_path_factory, "falcon-40b")


def test_bad_opt_files(opt_gguf):
    from gguf import GGUFValueType as VT
    from gguf_rewrite import rewrite_gguf
    from powerinfer_cpp import NativeError

    src, d = opt_gguf
    with pytest.raises(NativeError, match="missing tensor 'position_embd.weight'"):
        Model(rewrite_gguf(src, d / "nopos.gguf", drop=["position_embd.weight"]))
    with pytest.raises(NativeError, match=r"n_ctx = 500 exceeds the 128 positions .*position_embd"):
        with Model(src) as m:
            m.create_context(n_ctx=500)
    with pytest.raises(NativeError, match="ungated FFN"):
        Model(rewrite_gguf(src, d / "gate.gguf",
                           add={"blk.0.ffn_gate.weight": np.zeros((160, 64), np.float32)}))
    with pytest.raises(NativeError, match="drelu, which needs a gated FFN"):
        Model(rewrite_gguf(src, d / "drelu.gguf",
                           kv={"powerinfer.ffn_activation": ("drelu", VT.STRING)}))
    with pytest.raises(NativeError, match="fatrelu but the file has no powerinfer.ffn_act_threshold"):
        Model(rewrite_gguf(src, d / "fat.gguf",
                           kv={"powerinfer.ffn_activation": ("fatrelu", VT.STRING)}))
    with pytest.raises(NativeError, match=r"blk\.1\.ffn_up\.bias.*expected \[160\]"):
        Model(rewrite_gguf(src, d / "bias.gguf", tensors={"blk.1.ffn_up.bias": lambda a: a[:-1]}))
    with pytest.raises(NativeError, match="rope_freqs.weight': architecture 'opt' has no RoPE"):
        Model(rewrite_gguf(src, d / "rope.gguf",
                           add={"rope_freqs.weight": np.ones(8, np.float32)}))
    with pytest.raises(NativeError, match=r"unsupported architecture 'gptj' \(general.architecture; "
                                          r"supported: llama, qwen2, falcon, opt, phi3"):
        Model(rewrite_gguf(src, d / "gptj.gguf",
                           kv={"general.architecture": ("gptj", VT.STRING)}))


def test_bad_falcon_files(falcon_gguf):
    from gguf_rewrite import rewrite_gguf
    from powerinfer_cpp import NativeError

    src, d = falcon_gguf
    with pytest.raises(NativeError, match=r"missing tensor 'blk\.0\.attn_qkv\.weight'"):
        Model(rewrite_gguf(src, d / "noqkv.gguf", drop=["blk.0.attn_qkv.weight"]))
    with pytest.raises(NativeError, match=r"blk\.1\.attn_qkv\.weight.*expected \[64, 96\]"):
        Model(rewrite_gguf(src, d / "qkv.gguf", tensors={"blk.1.attn_qkv.weight": lambda a: a[:-8]}))
    # the two-norm layout is all or nothing
    with pytest.raises(NativeError, match=r"missing tensor 'blk\.1\.attn_norm_2\.weight'"):
        Model(rewrite_gguf(src, d / "ln.gguf", drop=["blk.1.attn_norm_2.weight", "blk.1.attn_norm_2.bias"]))


# ---- the shipped OPT-shaped model: the ungated sparse path on a real distribution ------

OPT_DIR = SHIPPED_DIR.parent / "tiny-opt-kjv"


def _log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_sparse_accuracy_shipped_opt(tmp_path_factory, capsys):
    """tiny-opt-kjv converted with the sparse pipeline (predictors on the ungated FFN): on
    held-out text the predictors never saw, perplexity within 3% of dense and greedy top-1
    agreement >= 95% over >= 1,000 positions; dense equals transformers."""
    d = tmp_path_factory.mktemp("opt-shipped")
    rep = []
    path = convert(OPT_DIR, d / "opt-sparse-f16.gguf", "f16", progress=False, sparse=True, report=rep)
    n_ctx = 512
    with Model(path, n_ctx=n_ctx, n_threads=2) as m:
        toks = m.tokenize((OPT_DIR / "heldout.txt").read_text(encoding="utf-8"))[rep[0].n_calib_tokens:]
        toks = toks[:2048]
        assert len(toks) == 2048
        ctx = m.context
        ctx.sparse_batch = n_ctx  # whole windows through the sparse path, token by token

        def windows():
            out = []
            for s in range(0, len(toks), n_ctx):
                ctx.reset()
                out.append(ctx.eval(toks[s:s + n_ctx], logits_all=True))
            return np.concatenate(out)

        ctx.set_ffn_mode("dense")
        dense = windows()
        ctx.set_ffn_mode("sparse")
        ctx.reset_stats()
        sparse = windows()
        st = ctx.stats()
    ref = hf_reference_model(OPT_DIR)
    with torch.no_grad():
        want = ref(torch.tensor([toks[:n_ctx]])).logits[0].double().numpy()
    nrmse = np.sqrt(((dense[:n_ctx] - want) ** 2).mean() / (want ** 2).mean())
    assert nrmse < 1e-3, nrmse  # f16 weights hold the shipped fp16 ones exactly
    keep = np.array([(i % n_ctx) != n_ctx - 1 for i in range(len(toks) - 1)])
    tgt = np.asarray(toks[1:])[keep]
    pos = np.arange(len(toks) - 1)[keep]

    def ppl(lg):
        return float(np.exp(-_log_softmax(lg[pos])[np.arange(len(pos)), tgt].mean()))

    ppl_d, ppl_s = ppl(dense), ppl(sparse)
    agree = float(np.mean(dense[pos].argmax(1) == sparse[pos].argmax(1)))
    rel = ppl_s / ppl_d - 1
    with capsys.disabled():
        print(f"\nsparse FFN accuracy (shipped tiny-opt-kjv, f16, {len(pos)} held-out positions): "
              f"ppl dense {ppl_d:.3f} sparse {ppl_s:.3f} ({rel:+.2%}); greedy top-1 agreement "
              f"{agree:.2%}; predicted density {st['density']:.2%} "
              f"(per layer {', '.join(f'{x:.1%}' for x in st['layer_density'])})")
    assert st["n_sparse_tokens"] == len(toks)
    assert abs(rel) <= 0.03
    assert agree >= 0.95


# (mixtures of experts have no sparse modes yet: test_moe.py checks they are refused)
GATED_NOT_RELU = [v for v, relu in VARIANTS.items()
                  if not relu and not v.startswith("falcon") and v not in MOE_VARIANTS]
# The share of active neurons a 20-token decode may show around the calibrated 0.5. OLMo 2's
# FFN reads the un-normed residual stream (no input norm), so its gate values scale with each
# token's residual norm and the share moves with the text: olmo2-tied measured 0.64 over these
# 20 tokens, 0.55 over the first 100 calibration tokens and 0.43 over later held-out text
# (qwen3-tied, with an input norm: 0.50, 0.50, 0.50).
GATE_DENSITY_BAND = {"olmo2": (0.3, 0.7), "olmo2-tied": (0.3, 0.7)}


@pytest.mark.parametrize("variant", GATED_NOT_RELU)
def test_gate_sparsity_each_gated_architecture(tmp_path, variant):
    """convert --sparsity on every gated SwiGLU architecture (phi3: the gate rows are the
    first half of the fused ffn_up): the gate mode runs at the calibrated share and moves
    the logits by a bounded amount (the accuracy itself: test_gate_sparsity.py)."""
    hf_dir = make_hf_model(variant, tmp_path / "hf", seed=1)
    opts = SparseOptions(calib=str(SHIPPED_DIR / "heldout.txt"), calib_tokens=600, profile_ctx=100,
                         sparsity=0.5)
    path = convert(hf_dir, tmp_path / "gate.gguf", "f32", progress=False, sparse=True, sparse_options=opts)
    ids = list(range(5, 25))
    with Model(path) as m:
        assert m.create_context(n_ctx=8).ffn_mode == "gate"  # the default for such files
        gate = _decode(m, ids, "gate")
        st_ctx = m.create_context(n_ctx=64, ffn="gate")
        for t in ids:
            st_ctx.eval([t])
        density = st_ctx.stats()["density"]
        dense = _decode(m, ids, "dense")
    lo, hi = GATE_DENSITY_BAND.get(variant, (0.4, 0.6))
    assert lo <= density <= hi, density
    rel = np.abs(gate - dense).max() / np.ptp(dense)
    assert 0 < rel < 0.1, rel
