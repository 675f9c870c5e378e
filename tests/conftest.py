"""Shared fixtures: small GGUF models made once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
sys.path.insert(0, str(TESTS_DIR))  # tests import their helpers (hf_models) by name

SHIPPED_DIR = REPO_DIR / "models" / "tiny-relu-kjv"
#: The shipped SwiGLU model: the default model of the gate-magnitude sparsity tests.
SHIPPED_SWIGLU_DIR = REPO_DIR / "models" / "tiny-swiglu-kjv"


@pytest.fixture(scope="session")
def random_gguf(tmp_path_factory) -> Path:
    """A small random-init ReLU LLaMA (GQA, tied) converted to f32 GGUF."""
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    from powerinfer_cpp.convert import convert

    d = tmp_path_factory.mktemp("random-model")
    hf_dir = make_llama_model(d / "hf", act="relu", tied=True, seed=1)
    return Path(convert(hf_dir, d / "model.gguf", outtype="f32", progress=False))


@pytest.fixture(scope="session")
def shipped_gguf(tmp_path_factory) -> Path:
    """The trained model the project ships, converted to f16 GGUF."""
    from powerinfer_cpp.convert import convert

    d = tmp_path_factory.mktemp("shipped")
    return Path(convert(SHIPPED_DIR, d / "tiny-f16.gguf", outtype="f16", progress=False))


@pytest.fixture(scope="session")
def shipped_sparse(tmp_path_factory):
    """The shipped model converted with the sparse pipeline (f16), the dense conversion,
    and the number of held-out tokens used for calibration (evaluation starts after)."""
    from powerinfer_cpp.convert import convert

    d = tmp_path_factory.mktemp("shipped-sparse")
    rep = []
    sparse = convert(SHIPPED_DIR, d / "tiny-sparse-f16.gguf", "f16", progress=False, sparse=True,
                     report=rep)
    dense = convert(SHIPPED_DIR, d / "tiny-dense-f16.gguf", "f16", progress=False)
    return {"sparse": sparse, "dense": dense, "n_calib": rep[0].n_calib_tokens, "dir": d}


@pytest.fixture(scope="session")
def swiglu_default(tmp_path_factory):
    """The shipped SwiGLU model converted by the command line's defaults (f16: gate
    thresholds at the largest sparsity within the 2% perplexity budget), its dense
    conversion, and the number of calibration tokens (held-out text starts after)."""
    import gguf

    from powerinfer_cpp import format as F
    from powerinfer_cpp.convert import convert, main

    d = tmp_path_factory.mktemp("swiglu-default")
    sparse = d / "tiny-swiglu-f16.gguf"
    assert main([str(SHIPPED_SWIGLU_DIR), "-o", str(sparse), "--threads", "2", "-q"]) == 0
    dense = convert(SHIPPED_SWIGLU_DIR, d / "tiny-swiglu-dense-f16.gguf", "f16", progress=False)
    f = gguf.GGUFReader(str(sparse)).fields
    n_calib = int(f[F.KEY_SPARSE_CALIB_TOKENS].parts[-1][0])
    return {"sparse": sparse, "dense": Path(dense), "n_calib": n_calib, "dir": d}
