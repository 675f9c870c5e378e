"""The gate mode (gate-magnitude sparsity, no predictor) split over host-device and the CPU:
each side computes the gate of its own neurons, thresholds it and computes up and down for
its active ones. On the shipped SwiGLU model converted in gate mode with a GPU index for
part of the neurons, the split equals the CPU-only run (logits within the summation order's
rounding, the same active neurons) and the statistics say what each side did."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from powerinfer_cpp import Model, parse_size  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

REPO = REPO_DIR
SWIGLU_DIR = REPO / "models" / "tiny-swiglu-kjv"
BUDGET = "6M"  # the dense parts (3.5 MiB in f16), the KV cache and about a fifth of the neurons
N_TOK = 24


@pytest.fixture(scope="module")
def gate_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid-gate")
    return Path(convert(SWIGLU_DIR, d / "gate.gguf", "f16", progress=False, sparse=True,
                        sparse_options=SparseOptions(sparsity=0.5, calib_tokens=512, n_threads=2,
                                                     vram_budget=parse_size(BUDGET))))


@pytest.fixture(scope="module")
def tokens(gate_file):
    with Model(gate_file, n_ctx=16) as m:
        return m.tokenize((SWIGLU_DIR / "heldout.txt").read_text(encoding="utf-8")[-2000:])[:N_TOK]


def decode(m: Model, tokens):
    ctx = m.create_context(n_ctx=64, n_threads=2, ffn="gate")  # named: `auto` may pick dense
    assert ctx.ffn_mode == "gate"
    return np.stack([ctx.eval([t]) for t in tokens]), ctx.stats()


@pytest.fixture(scope="module")
def cpu_ref(gate_file, tokens):
    with Model(gate_file) as m:
        return decode(m, tokens)


def row_bytes(path) -> dict:
    """Bytes of one row of layer 0's gate, up and down_t (layers share types and shapes)."""
    t = {x.name: x for x in gguf.GGUFReader(str(path)).tensors}
    return {k: int(t[f"blk.0.{k}.weight"].n_bytes) // int(t[f"blk.0.{k}.weight"].shape[1])
            for k in ("ffn_gate", "ffn_up", "ffn_down_t")}


@pytest.mark.parametrize("budget", [BUDGET, None], ids=["file-index", "all-on-device"])
def test_gate_split_equals_cpu_only(gate_file, tokens, cpu_ref, budget):
    want, ref = cpu_ref
    with Model(gate_file, device="host-device", vram_budget=budget, reset_gpu_index=budget is None) as m:
        info = m.device_info()
        n_layer, n_ff = m.info.n_layer, m.info.n_ff
        got, st = decode(m, tokens)
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 2e-4 * scale
    assert (got.argmax(1) == want.argmax(1)).all()
    dv = st["device"]
    # the same neurons are active (the two sides' gates differ only in summation order)
    assert st["n_active"] == ref["n_active"] and st["layer_density"] == pytest.approx(ref["layer_density"])
    assert dv["neurons_device"] + dv["neurons_cpu"] == st["n_active"]
    # each gate row is read once, by one side: the FFN reads the CPU-only run's bytes
    assert st["bytes"]["ffn"] == ref["bytes"]["ffn"]
    assert st["n_up_rows"] == st["n_down_rows"] == dv["neurons_cpu"]
    rb = row_bytes(gate_file)
    n_tok = st["n_sparse_tokens"]
    cpu_ffn = (n_tok * (n_layer * n_ff - info["n_hot"]) * rb["ffn_gate"]
               + dv["neurons_cpu"] * (rb["ffn_up"] + rb["ffn_down_t"]))
    dev_ffn = n_tok * info["n_hot"] * rb["ffn_gate"] + dv["neurons_device"] * (rb["ffn_up"] + rb["ffn_down_t"])
    assert st["bytes"]["ffn"] == cpu_ffn + dev_ffn
    # the device also ran the attention and the head (every decode step's logits)
    dense_dev = st["bytes"]["attention"] + st["bytes"]["head"]
    assert dv["bytes_device"] == pytest.approx(dense_dev + dev_ffn, rel=1e-12)
    assert dv["time_s"]["device"] > 0
    if budget is None:
        assert info["hot_share"] == 1.0 and dv["neurons_cpu"] == 0
    else:
        assert info["index_source"] == "file" and 0 < info["hot_share"] < 0.5
        assert 0 < dv["neurons_device"] and 0 < dv["neurons_cpu"]
        # the hot neurons are the frequent ones: they fire more often than the others
        assert dv["neurons_device"] / (n_tok * info["n_hot"]) > dv["neurons_cpu"] / (
            n_tok * (n_layer * n_ff - info["n_hot"]))


def test_gate_split_prompt_and_dense_mode(gate_file, tokens):
    """Prompts (dense FFN on the CPU, projections on the device) and the dense mode are
    the CPU's on a split gate file too."""
    with Model(gate_file) as m:
        ctx = m.create_context(n_ctx=64, n_threads=2)
        want_prompt = ctx.eval(tokens, logits_all=True)
        dense = m.create_context(n_ctx=64, n_threads=2, ffn="dense")
        want_dense = np.stack([dense.eval([t]) for t in tokens[:8]])
    with Model(gate_file, device="host-device", vram_budget=BUDGET) as m:
        ctx = m.create_context(n_ctx=64, n_threads=2)
        got_prompt = ctx.eval(tokens, logits_all=True)
        dense = m.create_context(n_ctx=64, n_threads=2, ffn="dense")
        got_dense = np.stack([dense.eval([t]) for t in tokens[:8]])
    for got, want in ((got_prompt, want_prompt), (got_dense, want_dense)):
        assert float(np.abs(got - want).max()) <= 2e-4 * float(np.abs(want).max())
