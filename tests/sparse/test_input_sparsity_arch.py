"""Input sparsity on every architecture (tiny random HF models: llama, qwen2 with q/k/v
biases, phi3's fused q/k/v, OPT's biases and learned positions, Falcon's fused q/k/v and
parallel block): the transposed copies convert's pipeline writes compute what the row-major
tensors do."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402

from test_input_sparsity import HELDOUT, _run  # noqa: E402


ARCH_VARIANTS = {"llama": {"sparsity": 0.0}, "qwen2": {"sparsity": 0.0}, "phi3": {"sparsity": 0.0},
                 "qwen3": {"sparsity": 0.0}, "olmo2": {"sparsity": 0.0}, "smollm3": {"sparsity": 0.0},
                 "gemma2": {"sparsity": 0.0}, "gemma3": {"sparsity": 0.0}, "opt": {}, "falcon-relu": {}}


def _every_input_passes(path) -> list[int]:
    """Set every input threshold of the file at path to 1e-30 (> 0: the sites run
    input-sparse, yet every input passes); returns the test's prompt as tokens."""
    r = gguf.GGUFReader(path, "r+")
    for t in r.tensors:
        if t.name.endswith("_in_thr"):
            t.data[:] = 1e-30
    r.data.flush()
    del r
    with Model(path, n_ctx=64) as m:
        return m.tokenize("In the beginning God created the heaven and the earth.")[:24]


@pytest.mark.parametrize("variant", list(ARCH_VARIANTS))
def test_every_architecture_transposed_layout(variant, tmp_path):
    """With thresholds below every input the input-sparse path uses every input: its logits
    are the row-major path's up to the summation order (f32 weights)."""
    pytest.importorskip("torch")
    from hf_models import make_hf_model
    hf = make_hf_model(variant, tmp_path / "hf", seed=3)
    path = convert(hf, tmp_path / "in.gguf", "f32", progress=False, sparse=True,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=256, profile_ctx=64,
                                                input_sparsity=0.5, input_tokens=64, n_threads=1,
                                                **ARCH_VARIANTS[variant]))
    ids = _every_input_passes(path)
    on, st = _run(path, ids, input_sparse=True, window=32)
    off, _ = _run(path, ids, input_sparse=False, window=32)
    assert st["input_sparse"]["attention_density"] > 0.99 and st["input_sparse"]["head_density"] > 0.99
    scale = float(np.abs(off).max())
    assert float(np.abs(on - off).max()) <= 1e-4 * scale, variant


# the transposed copies' types (output_t follows the head's: Q8_0 beside Q4_0; Q6_K beside
# Q4_K, which rows of this vocabulary of 384 are not whole blocks of: fit_rows' Q8_0) and
# the logits' normalised RMS error against the row-major path bound: the copies are quantized
# along the other axis, so the two paths differ by about twice the type's own error (random
# tiny models: Q4_0 up to 0.13 against transformers, test_architectures.py); a wrong layout
# gives errors of order 1
OUTTYPES = {"bf16": ("BF16", "BF16", 1e-2), "q8_0": ("Q8_0", "Q8_0", 3e-2), "q4_0": ("Q4_0", "Q8_0", 0.35),
            "q4_k": ("Q4_K", "Q8_0", 0.35)}


@pytest.mark.parametrize("outtype", list(OUTTYPES))
def test_every_weight_type(outtype, tmp_path):
    pytest.importorskip("torch")
    from hf_models import make_hf_model
    hf = make_hf_model("llama", tmp_path / "hf", seed=4, d=256, n_ff=512)
    path = convert(hf, tmp_path / "in.gguf", outtype, progress=False, sparse=True,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=256, profile_ctx=64,
                                                sparsity=0.0, input_sparsity=0.5, input_tokens=64, n_threads=1))
    want_w, want_head, bound = OUTTYPES[outtype]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_qkv_t.weight"] == types["blk.0.attn_output_t.weight"] == want_w
    assert types["output_t.weight"] == want_head
    ids = _every_input_passes(path)
    on, _ = _run(path, ids, input_sparse=True, window=32)
    off, _ = _run(path, ids, input_sparse=False, window=32)
    err = float(np.sqrt(np.mean((on - off) ** 2)) / np.sqrt(np.mean(off ** 2)))
    assert err < bound, (outtype, err)
