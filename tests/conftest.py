"""Shared fixtures: small GGUF models made once per test session, and the backend
columns of the op tests (the SIMD levels this CPU has, the devices)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
# Tests import their helpers (hf_models, opref, ...) from this folder and a few names from
# other test files (test_real_models.smollm2_path) by module name: this folder and every
# test folder under it are on sys.path, whichever file pytest is given. Module names are
# therefore unique across the folders (test_repo_files checks it), and this is the only
# conftest.py: one in a subfolder would shadow `from conftest import ...`.
sys.path.insert(0, str(TESTS_DIR))
sys.path[1:1] = [str(d) for d in sorted(TESTS_DIR.iterdir()) if d.is_dir() and any(d.glob("test_*.py"))]

SHIPPED_DIR = REPO_DIR / "models" / "tiny-relu-kjv"


def load_tool(relpath: str):
    """A script of tools/ (not a package) imported as a module, e.g. load_tool("moefy.py")."""
    import importlib.util

    path = REPO_DIR / "tools" / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
#: The shipped SwiGLU model: the default model of the gate-magnitude sparsity tests.
SHIPPED_SWIGLU_DIR = REPO_DIR / "models" / "tiny-swiglu-kjv"


# ---- the backend columns of the op tests ------------------------------------------------

def _lib():
    from powerinfer_cpp._native import lib

    return lib


def simd_names() -> dict:
    """The library's SIMD levels (lib.GH_SIMD_*) by id: {0: "scalar", 1: "avx2", ...}."""
    lib = _lib()
    return {getattr(lib, k): k[len("GH_SIMD_"):].lower() for k in dir(lib)
            if k.startswith("GH_SIMD_") and k != "GH_SIMD_AUTO"}


def simd_levels() -> list[int]:
    """The SIMD levels this CPU runs, scalar first (the library's own level switch,
    gh_simd_set, forces each in turn; GH_SIMD caps the one chosen at start-up)."""
    lib = _lib()
    return list(range(lib.GH_SIMD_SCALAR, int(lib.gh_simd_supported()) + 1))


def simd_id(level: int) -> str:
    """A test id for a level: its name in the library's enum."""
    return simd_names()[level]


@contextlib.contextmanager
def at_simd(level: int):
    """Run the kernels at `level`, then restore the level that was set before."""
    lib = _lib()
    prev = lib.gh_simd_get()
    assert lib.gh_simd_set(level) != -2, f"this CPU cannot run SIMD level {level}"
    try:
        yield level
    finally:
        lib.gh_simd_set(prev)


@pytest.fixture
def simd_level(request):
    """A test at one SIMD level (parametrize it indirectly with simd_levels()), the
    previous level restored afterwards."""
    with at_simd(request.param):
        yield request.param


@pytest.fixture(params=simd_levels(), ids=simd_id)
def simd(request):
    """A test at every SIMD level this CPU has, the previous level restored afterwards."""
    with at_simd(request.param):
        yield request.param


@pytest.fixture
def restore_simd():
    """For tests that switch levels themselves: the level set before is restored."""
    lib = _lib()
    prev = lib.gh_simd_get()
    yield
    lib.gh_simd_set(prev)


def last_error() -> str:
    """The calling thread's last native error message."""
    from powerinfer_cpp._native import last_error as native_last_error

    return native_last_error()


#: the device the CUDA column runs on (GH_TEST_CUDA_DEVICE: "host-device" runs the CUDA
#: column's tests on the simulated device, which is how their bounds were checked without
#: a GPU)
CUDA_DEVICE = os.environ.get("GH_TEST_CUDA_DEVICE", "cuda")


def cuda_unavailable_reason() -> str | None:
    """None if CUDA_DEVICE can run ops here, else why not (the runtime's message)."""
    lib = _lib()
    if lib.gh_device_check(CUDA_DEVICE.encode()) != lib.GH_OK:
        built = "built with" if lib.gh_have_cuda() else "built WITHOUT"
        return f"device '{CUDA_DEVICE}' unavailable (library {built} CUDA): {last_error()}"
    return None


def cuda_device_or_skip() -> str:
    """The CUDA column's device; skips without one, fails under GH_REQUIRE_CUDA=1
    (tools/gpu_check.sh: a broken GPU setup cannot pass as "all skipped")."""
    why = cuda_unavailable_reason()
    if why:
        if os.environ.get("GH_REQUIRE_CUDA") == "1":
            pytest.fail(f"GH_REQUIRE_CUDA=1 but {why}")
        pytest.skip(why)
    return CUDA_DEVICE


@pytest.fixture(scope="session")
def cuda_device() -> str:
    """The CUDA device to test (tests/gpu); skips without one (see cuda_device_or_skip)."""
    return cuda_device_or_skip()


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
