"""One table for every architecture: tiny models made with transformers from a config
(random seeded weights, biases nonzero, GQA/MQA, tied and untied, odd head sizes), saved,
converted and run by the native runtime, against transformers (CPU torch, float32).

Per variant: all logits over 40 positions (f32 weights and cache: max error <= 1e-4 of the
logit range; f16 / q8_0 / q4_0: the normalized RMS bounds below), greedy decoding, batched
decode (gh_eval_batch) against single steps, and for the ReLU-family ones the sparse file:
oracle == dense and host-device == cpu."""

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
    "gemma2": False, "gemma2-mqa": False, "gemma3": False, "gemma3-untied": False,
    "opt": True, "opt-untied": True,
    "falcon-7b": False, "falcon-7b-bias": False, "falcon-mha": False, "falcon-40b": False,
    "falcon-40b-1ln": False, "falcon-rw-like": False, "falcon-relu": True,
    "phi3": False,
    # mixtures of experts (hf_models.MOE_VARIANTS; their own tests: test_moe.py)
    # (the ReLU-family experts, mixtral-relu and -drelu, have no predictors: their sparse
    # experts are test_moe_sparse.py's)
    "mixtral": False, "mixtral-top1": False, "mixtral-relu": False, "mixtral-drelu": False,
    "qwen2moe": False, "qwen2moe-norm": False,
    "qwen3moe": False, "qwen3moe-top1": False, "olmoe": False, "olmoe-norm": False,
    "gptoss": False, "gptoss-top1": False, "gptoss-top4": False,
    # DeepSeek-V3's sigmoid router (their own tests: test_moe_sigmoid.py)
    "glm4moe": False, "glm4moe-qknorm": False, "dots1": False, "dots1-top1": False,
}
N_POS = 40

# Normalized RMS logit error against transformers per weight type (f32 cache: the weights'
# error alone); random tiny models, so the quantized bounds are loose but still catch a
# wrong layout (which gives errors of order 1). Measured over the table: f16 2.0-5.6e-4,
# q8_0 0.8-1.5e-2, q4_0 1.2-19.1e-2 (the top: smollm3's 4 layers, olmo2 1.8e-1; f32: max
# error 1.1-2.7e-7 of the logit range). Rows
# of 48 columns are not whole Q8_0/Q4_0 blocks: those variants keep f16 there.
QUANT_NRMSE = {"f16": 2e-3, "q8_0": 3e-2, "q4_0": 2e-1}
# Gemma's post-norms scale every sublayer's output to the norm weights' size while the random
# embeddings keep the residual stream small, so the weights' own rounding reaches the logits
# almost undamped: transformers run with the q4_0 file's dequantized weights is itself 0.364
# (gemma3) and 0.333 (gemma2-mqa) away from its f32 logits, ours 0.367 and 0.333; q8_0 0.025
# and 0.021, ours 0.037 and 0.026 (our dots also round the activations to 8 bits). Measured
# over the gemma rows: f16 7.2e-4 - 3.0e-3, q8_0 1.2-3.9e-2, q4_0 0.14-0.37.
QUANT_NRMSE_POST_NORMS = {"f16": 5e-3, "q8_0": 6e-2, "q4_0": 5e-1}
# A router's top-k is discontinuous: where the weights' rounding flips a token's expert
# choice, that position's logits move by the other expert's output. mixtral-relu's q8_0 file:
# nrmse 0.031, carried by 2 of the 40 positions (0.13 each, the rest 0.010-0.015; f16
# 3.6e-4 with no position above 1e-3).
QUANT_NRMSE_VARIANT = {("mixtral-relu", "q8_0"): 4e-2}


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


def test_sliding_window_decode(arch_case):
    """Gemma's and gpt-oss's local layers past their window (4-6 of the 40 positions): every
    token decoded one at a time, and the prompt in batches of 7 that straddle windows, against
    transformers; an F16 cache within the f16 bound."""
    if not arch_case["variant"].startswith(("gemma", "gptoss")):
        pytest.skip("no sliding-window layers")
    ids, want = arch_case["ids"], arch_case["want"]
    rng_ = np.ptp(want)
    with Model(arch_case["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        step = m.create_context(n_ctx=64, cache_type="f32")
        rows = np.stack([step.eval([t]) for t in ids]).astype(np.float64)
        chunks = m.create_context(n_ctx=64, n_batch=7, cache_type="f32").eval(ids, logits_all=True)
        f16 = m.create_context(n_ctx=64, cache_type="f16").eval(ids, logits_all=True)
    err_step = np.abs(rows - want).max() / rng_
    err_chunk = np.abs(chunks.astype(np.float64) - want).max() / rng_
    nrmse = np.sqrt(((f16 - want) ** 2).mean() / ((want - want.mean()) ** 2).mean())
    print(f"{arch_case['variant']}: decode {err_step:.2e}, batches of 7 {err_chunk:.2e} of the "
          f"logit range; f16 cache nrmse {nrmse:.2e}")
    assert err_step <= 1e-4 and err_chunk <= 1e-4, (err_step, err_chunk)
    assert nrmse < QUANT_NRMSE_POST_NORMS["f16"], nrmse


@pytest.mark.parametrize("outtype", list(QUANT_NRMSE))
def test_logits_quantized(arch_case, outtype):
    gguf = convert(arch_case["hf"], arch_case["dir"] / f"{outtype}.gguf", outtype=outtype,
                   progress=False)
    with Model(gguf, n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.eval(arch_case["ids"], logits_all=True).astype(np.float64)
    want = arch_case["want"]
    nrmse = np.sqrt(((got - want) ** 2).mean() / ((want - want.mean()) ** 2).mean())
    print(f"{arch_case['variant']}: {outtype} nrmse {nrmse:.2e}")
    bound = (QUANT_NRMSE_POST_NORMS if arch_case["variant"].startswith("gemma") else QUANT_NRMSE)[outtype]
    bound = QUANT_NRMSE_VARIANT.get((arch_case["variant"], outtype), bound)
    assert nrmse < bound, f"{arch_case['variant']} {outtype}: nrmse {nrmse:.3g}"


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


def test_yarn_rounded_ramp_llama_cpp_file(tmp_path):
    """YaRN in another architecture's file (llama.cpp's keys, as its converter writes them for
    Qwen2 / Llama YaRN models): the ramp between rounded correction dims (floor / ceil,
    llama.cpp's and transformers' default truncate=true) and the attention factor, against
    transformers given the same rope_parameters. Our converter writes YaRN only for gpt-oss
    (whose unrounded ramp its own row tests), so the file is ours with the keys added."""
    import json

    from gguf import GGUFValueType as VT
    from gguf_rewrite import rewrite_gguf

    hf_dir = make_hf_model("qwen2", tmp_path / "hf", seed=3, max_position_embeddings=256)
    ours = convert(hf_dir, tmp_path / "f32.gguf", outtype="f32", progress=False)
    yarn = rewrite_gguf(ours, tmp_path / "yarn.gguf", kv={
        "qwen2.rope.scaling.type": ("yarn", VT.STRING), "qwen2.rope.scaling.factor": (8.0, VT.FLOAT32),
        "qwen2.rope.scaling.original_context_length": (32, VT.UINT32)})
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                              "rope_theta": cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    ref = hf_reference_model(hf_dir)
    ids = list(range(3, 3 + N_POS))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].double().numpy()
    with Model(yarn, n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.eval(ids, logits_all=True).astype(np.float64)
    with Model(ours, n_ctx=64, cache_type="f32", n_threads=2) as m:
        plain = m.eval(ids, logits_all=True).astype(np.float64)
    err = np.abs(got - want).max() / np.ptp(want)
    print(f"qwen2 yarn: {err:.2e} of the logit range; without yarn {np.abs(plain - want).max() / np.ptp(want):.2e}")
    assert err <= 1e-4
    assert np.abs(plain - want).max() > 1e-3 * np.ptp(want)


def test_gemma2_llama_cpp_defaults(tmp_path):
    """llama.cpp's gemma2 files carry no attention.scale (it takes 1/sqrt(head size) but for
    the 27B) and it assumes soft-caps 50 / 30 where the keys are absent: such a file runs as
    transformers does with those values. A sliding_window_pattern array of the wrong length
    is refused by name."""
    from gguf import GGUFValueType as VT
    from gguf_rewrite import rewrite_gguf
    from powerinfer_cpp import NativeError

    hf_dir = make_hf_model("gemma2", tmp_path / "hf", seed=7, query_pre_attn_scalar=16,
                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    ref = hf_reference_model(hf_dir)
    ours = convert(hf_dir, tmp_path / "f32.gguf", outtype="f32", progress=False)
    bare = rewrite_gguf(ours, tmp_path / "bare.gguf", drop_kv=[
        "gemma2.attention.scale", "gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping"])
    ids = list(range(3, 3 + N_POS))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].double().numpy()
    with Model(bare, n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.eval(ids, logits_all=True).astype(np.float64)
    assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)
    bad = rewrite_gguf(ours, tmp_path / "pattern.gguf", kv={
        "gemma2.attention.sliding_window_pattern": ([True, False], VT.ARRAY)})
    with pytest.raises(NativeError, match=r"gemma2\.attention\.sliding_window_pattern' must be a "
                                          r"period \(uint32\) or an array of 3 bools"):
        Model(bad)


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
# How far the gate mode may move the logits (share of their range). Gemma's post-FFN norm
# scales the thinned FFN output back up, over a small residual stream (random embeddings):
# 0.27-0.56 at 50% (0.10-0.12 at 20%), while the logits equal transformers' with the same
# mask to 1e-6 (test_gate_mode_geglu_matches_transformers).
GATE_LOGIT_MOVE = {"gemma2": 0.7, "gemma2-mqa": 0.7, "gemma3": 0.7, "gemma3-untied": 0.7}


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
    assert 0 < rel < GATE_LOGIT_MOVE.get(variant, 0.1), rel


@pytest.mark.parametrize("variant", ["gemma2", "gemma3-untied"])
def test_gate_mode_geglu_matches_transformers(tmp_path, variant):
    """The gate mode on a GeGLU FFN (tanh GELU, whose negative lobe makes |act(g)| > t two
    cut points on g) computes transformers' model with each MLP masked the same way:
    down((act(gate x) if |act(gate x)| > t_l else 0) * up x), t_l read from the file."""
    import gguf

    hf_dir = make_hf_model(variant, tmp_path / "hf", seed=1)
    opts = SparseOptions(calib=str(SHIPPED_DIR / "heldout.txt"), calib_tokens=600, profile_ctx=100,
                         sparsity=0.5)
    path = convert(hf_dir, tmp_path / "gate.gguf", "f32", progress=False, sparse=True, sparse_options=opts)
    thr = gguf.GGUFReader(path).fields["powerinfer.sparse.gate_threshold"].contents()
    ids = list(range(5, 25))
    with Model(path) as m:
        got = _decode(m, ids, "gate").astype(np.float64)
    ref = hf_reference_model(hf_dir)
    for layer, t in zip(ref.model.layers, thr):
        mlp = layer.mlp

        def fwd(x, mlp=mlp, t=t):
            a = mlp.act_fn(mlp.gate_proj(x))
            return mlp.down_proj(torch.where(a.abs() > t, a, torch.zeros_like(a)) * mlp.up_proj(x))

        mlp.forward = fwd
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].double().numpy()
    err = np.abs(got - want).max() / np.ptp(want)
    print(f"{variant}: gate mode vs masked transformers {err:.2e} of the logit range")
    assert err <= 1e-4, err


def test_batched_decode_equals_single_steps(arch_case):
    """Batched decode (gh_eval_batch: the server's continuous batching) runs the same
    forward pass over rows of several contexts: three contexts at different positions
    decode 6 steps together, and each step's logits equal gh_eval's of the same token on a
    twin context (f32 weights and cache: within 1e-5 of the logit range)."""
    from powerinfer_cpp._native import check, ffi, lib

    ids = arch_case["ids"]
    with Model(arch_case["gguf"], n_ctx=64, n_threads=2) as m:
        ctxs = [m.create_context(n_ctx=64, cache_type="f32") for _ in range(3)]
        twins = [m.create_context(n_ctx=64, cache_type="f32") for _ in range(3)]
        last = []
        for k, (c, t) in enumerate(zip(ctxs, twins)):
            c.eval(ids[:3 + 4 * k])
            last.append(t.eval(ids[:3 + 4 * k]))
        ptrs = ffi.new("gh_context *[]", [c._handle() for c in ctxs])
        for step in range(6):
            tokens = np.array([int(lg.argmax()) for lg in last], dtype=np.int32)
            check(lib.gh_eval_batch(ptrs, 3, ffi.from_buffer("int32_t[]", tokens)))
            last = [t.eval([int(tok)]) for t, tok in zip(twins, tokens)]
            for i, ref in enumerate(last):
                got = np.frombuffer(ffi.buffer(lib.gh_get_logits(ptrs[i], 0), m.n_vocab * 4),
                                    np.float32)
                err = np.abs(got - ref).max() / (ref.max() - ref.min())
                assert err <= 1e-5, (arch_case["variant"], step, i, err)


def test_mixed_batches_equal_gh_eval(arch_case):
    """gh_eval_batch_ex (the server's prompt chunks in the decode pass): decode tokens and
    prompt chunks of several contexts in one pass equal gh_eval of each context's tokens
    (f32 weights and cache: within 1e-5 of the logit range), and so does the next step."""
    from batch_util import check_mixed_batches

    with Model(arch_case["gguf"], n_ctx=64, n_threads=2) as m:
        check_mixed_batches(m, "f32", 1e-5)
