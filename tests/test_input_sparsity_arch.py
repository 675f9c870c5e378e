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
                 "opt": {}, "falcon-relu": {}}


@pytest.mark.parametrize("variant", list(ARCH_VARIANTS))
def test_every_architecture_transposed_layout(variant, tmp_path):
    """With thresholds below every input the input-sparse path uses every input: its logits
    are the row-major path's up to the summation order (f32 weights)."""
    pytest.importorskip("torch")
    from hf_models import make_hf_model
    hf = make_hf_model(variant, tmp_path / "hf", seed=3)
    path = convert(hf, tmp_path / "in.gguf", "f32", progress=False, sparse=True,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=256, profile_ctx=64,
                                                input_sparsity=0.5, input_tokens=64, n_threads=2,
                                                **ARCH_VARIANTS[variant]))
    r = gguf.GGUFReader(path, "r+")
    for t in r.tensors:
        if t.name.endswith("_in_thr"):
            t.data[:] = 1e-30  # > 0: the sites run input-sparse, yet every input passes
    r.data.flush()
    del r
    with Model(path, n_ctx=64) as m:
        ids = m.tokenize("In the beginning God created the heaven and the earth.")[:24]
    on, st = _run(path, ids, input_sparse=True, window=32)
    off, _ = _run(path, ids, input_sparse=False, window=32)
    assert st["input_sparse"]["attention_density"] > 0.99 and st["input_sparse"]["head_density"] > 0.99
    scale = float(np.abs(off).max())
    assert float(np.abs(on - off).max()) <= 1e-4 * scale, variant
