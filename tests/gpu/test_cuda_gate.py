"""The gate mode's hybrid split on a real GPU: the shipped SwiGLU model in gate mode with a
GPU index for part of its neurons on device "cuda" gives the CPU-only logits and active
neurons, and reads each gate row once (the device its hot neurons' gates, the CPU the
others'). Skipped without a GPU (tests/conftest.py's cuda_device); tests/sparse/test_hybrid_gate.py runs the same
on host-device everywhere (GH_TEST_CUDA_DEVICE=host-device runs this file there too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerinfer_cpp import Model, parse_size
from powerinfer_cpp.convert import convert
from powerinfer_cpp.sparse.pipeline import SparseOptions


REPO = Path(__file__).resolve().parents[2]
SWIGLU_DIR = REPO / "models" / "tiny-swiglu-kjv"
TOL = 1e-3  # max |logit difference| / max |logit|, as test_cuda_model.py


@pytest.fixture(scope="module")
def gate_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda-gate")
    return str(convert(SWIGLU_DIR, d / "gate.gguf", "f16", progress=False, sparse=True,
                       sparse_options=SparseOptions(sparsity=0.5, calib_tokens=512, n_threads=2,
                                                    vram_budget=parse_size("6M"))))


def decode(m: Model, tokens):
    ctx = m.create_context(n_ctx=64, n_threads=2, ffn="file")  # the file's gate mode (`auto` may pick dense)
    assert ctx.ffn_mode == "gate"
    return np.stack([ctx.eval([t]) for t in tokens]), ctx.stats()


@pytest.mark.parametrize("budget", ["6M", None], ids=["file-index", "all-on-device"])
def test_cuda_gate_split_equals_cpu_only(cuda_device, gate_file, budget):  # noqa: F811
    with Model(gate_file) as m:
        tokens = m.tokenize((SWIGLU_DIR / "heldout.txt").read_text(encoding="utf-8")[-2000:])[:24]
        want, ref = decode(m, tokens)
    with Model(gate_file, device=cuda_device, vram_budget=budget, reset_gpu_index=budget is None) as m:
        info = m.device_info()
        got, st = decode(m, tokens)
    assert float(np.abs(got - want).max()) <= TOL * float(np.abs(want).max())
    dv = st["device"]
    # a neuron at its threshold may flip between the two sides' sums; allow a handful
    assert abs(st["n_active"] - ref["n_active"]) <= 4
    assert dv["neurons_device"] > 0 and dv["neurons_device"] + dv["neurons_cpu"] == st["n_active"]
    assert info["n_hot"] > 0 and (budget is not None or dv["neurons_cpu"] == 0)
    if st["n_active"] == ref["n_active"]:  # else the flips' up/down rows differ
        assert st["bytes"]["ffn"] == ref["bytes"]["ffn"]
