"""The hybrid runtime on a real GPU: the shipped sparse model on device "cuda" under several
VRAM budgets must give the CPU-only sparse logits, keep to its budget, and count its
neurons; and a decode benchmark at two budgets (printed; run with -s). Skipped without a
GPU (the cuda_device fixture in tests/conftest.py); tests/sparse/test_hybrid.py runs the same path on the simulated
host-device backend everywhere."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from powerinfer_cpp import Model

from hybrid_sizes import part_sizes

N_TOK = 40        # decode steps compared per budget
TOL = 1e-3        # max |logit difference| / max |logit|
BENCH_TOKENS = int(os.environ.get("GH_BENCH_TOKENS", "128"))
PROMPT = ("In the beginning God created the heaven and the earth. And the earth was without "
          "form, and void; and darkness was upon the face")


@pytest.fixture(scope="module")
def sparse_path(request):
    """The shipped model converted with the sparse pipeline (f16): GH_TEST_SPARSE_GGUF if
    set (tools/gpu_check.sh --prepare makes one, for machines without the ILP solver),
    else the session's conversion (conftest.shipped_sparse)."""
    pre = os.environ.get("GH_TEST_SPARSE_GGUF")
    if pre:
        return pre
    return str(request.getfixturevalue("shipped_sparse")["sparse"])


@pytest.fixture(scope="module")
def tokens(sparse_path):
    with Model(sparse_path) as m:
        return m.tokenize(PROMPT)[:N_TOK]


def decode_logits(m: Model, tokens, mode="sparse"):
    ctx = m.create_context(n_ctx=128, n_threads=2, ffn=mode)
    return np.stack([ctx.eval([t]) for t in tokens]), ctx


@pytest.fixture(scope="module")
def cpu_ref(sparse_path, tokens):
    with Model(sparse_path) as m:
        sparse, _ = decode_logits(m, tokens, "sparse")
        dense, _ = decode_logits(m, tokens, "dense")
        prompt = m.create_context(n_ctx=128, n_threads=2).eval(tokens, logits_all=True)
    return {"sparse": sparse, "dense": dense, "prompt": prompt}


def budget_bytes(path, which: str) -> int | None:
    """zero: nothing on the GPU; few-MB: a few MiB (attention and some of the rest);
    dense+some: every dense part and ~700 neurons (a real CPU/GPU neuron split); all:
    the whole model (None = the GPU's free memory less a margin)."""
    with Model(path) as m:
        z = part_sizes(m.path, m.info.n_layer, m.info.n_ff)
    return {"zero": 0, "few-MB": 3 << 20,
            "dense+some": z["dense"] + 700 * z["neuron"], "all": None}[which]


def max_rel_diff(a, b) -> float:
    return float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1.0)


@pytest.mark.parametrize("which", ["zero", "few-MB", "dense+some", "all"])
def test_cuda_decode_equals_cpu(cuda_device, sparse_path, tokens, cpu_ref, which):
    budget = budget_bytes(sparse_path, which)
    with Model(sparse_path, device=cuda_device, vram_budget=budget) as m:
        info = m.device_info()
        assert info["device"].startswith(cuda_device.split(":")[0])
        if budget is not None:
            assert info["budget"] == budget
        assert info["used_bytes"] <= info["budget"]
        assert info["used_bytes"] == info["dense_bytes"] + info["hot_bytes"]
        got, ctx = decode_logits(m, tokens)
        diff = max_rel_diff(got, cpu_ref["sparse"])
        agree = float((got.argmax(1) == cpu_ref["sparse"].argmax(1)).mean())
        print(f"\n{cuda_device} budget {which}: n_hot {info['n_hot']} ({info['hot_share']:.1%}), "
              f"{info['used_bytes'] / 2**20:.2f} MiB used; max |dlogit|/max|logit| {diff:.2e}, "
              f"greedy agreement {agree:.1%}")
        assert diff <= TOL, diff
        assert agree >= 0.975, agree
        st = ctx.stats()
        dv = st["device"]
        assert dv["neurons_device"] + dv["neurons_cpu"] == st["n_active"] > 0
        assert 0.0 <= dv["device_share"] <= 1.0
        if which == "zero":
            assert info["used_bytes"] == 0 and info["n_hot"] == 0 and dv["neurons_device"] == 0
        if which == "dense+some":
            assert 0 < info["n_hot"] <= 700
            assert dv["neurons_device"] > 0 and dv["neurons_cpu"] > 0
        if which == "all":
            assert info["hot_share"] == 1.0 and dv["neurons_cpu"] == 0
        if info["used_bytes"]:
            assert dv["bytes_device"] > 0 and dv["time_s"]["device"] > 0


@pytest.mark.parametrize("which", ["dense+some", "all"])
def test_cuda_dense_mode_and_prompt(cuda_device, sparse_path, tokens, cpu_ref, which):
    """Dense mode and a prompt batch (projections on the GPU in token tiles) equal the CPU."""
    budget = budget_bytes(sparse_path, which)
    with Model(sparse_path, device=cuda_device, vram_budget=budget) as m:
        dense, _ = decode_logits(m, tokens, "dense")
        assert max_rel_diff(dense, cpu_ref["dense"]) <= TOL
        prompt = m.create_context(n_ctx=128, n_threads=2).eval(tokens, logits_all=True)
        assert max_rel_diff(prompt, cpu_ref["prompt"]) <= TOL


def test_cuda_budget_sweep_stays_within(cuda_device, sparse_path):
    """Budgets from zero to the whole model: never more than the budget on the GPU (real
    cudaMalloc sizes), and the whole model once the budget holds it."""
    with Model(sparse_path) as m:
        nl, n_ff = m.info.n_layer, m.info.n_ff
        z = part_sizes(m.path, nl, n_ff)
    full = z["dense"] + nl * n_ff * z["neuron"]
    for budget in np.linspace(0, full * 1.05, 8).astype(np.int64):
        with Model(sparse_path, device=cuda_device, vram_budget=int(budget)) as m:
            info = m.device_info()
        assert info["used_bytes"] <= budget
    assert info["n_hot"] == nl * n_ff


def decode_rate(path, device, budget, n_tokens):
    """Greedy decode of n_tokens after PROMPT (one token per eval); tok/s and the context's
    statistics."""
    with Model(path, device=device, vram_budget=budget) as m:
        ctx = m.create_context(n_ctx=len(m.tokenize(PROMPT)) + n_tokens + 8)
        logits = ctx.eval(m.tokenize(PROMPT))
        for _ in range(8):  # warm-up (first kernel loads, caches)
            logits = ctx.eval([int(np.argmax(logits))])
        ctx.reset_stats()
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            logits = ctx.eval([int(np.argmax(logits))])
        dt = time.perf_counter() - t0
        return n_tokens / dt, ctx.stats(), m.device_info()


def test_cuda_decode_benchmark(cuda_device, sparse_path):
    """Decode tokens/s on the CPU alone and on the GPU at two budgets (printed, lines that
    start with BENCH; no timing assertion)."""
    rows = [("cpu", "cpu", None)]
    for which in ("dense+some", "all"):
        rows.append((f"{cuda_device} {which}", cuda_device, budget_bytes(sparse_path, which)))
    print()
    for label, device, budget in rows:
        rate, st, info = decode_rate(sparse_path, device, budget, BENCH_TOKENS)
        dv = st.get("device", {})
        share = dv.get("device_share", 0.0)
        t_dev = dv.get("time_s", {}).get("device", 0.0)
        shown = "-" if device == "cpu" else "free VRAM" if budget is None else f"{budget} B"
        print(f"BENCH {label:<22} {rate:8.1f} tok/s  budget {shown}  "
              f"used {info['used_bytes'] / 2**20:.2f} MiB  device share {share:.1%}  "
              f"device time {t_dev * 1e3 / max(BENCH_TOKENS, 1):.3f} ms/token", flush=True)
        assert rate > 0
