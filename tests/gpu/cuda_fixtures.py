"""What the CUDA tests share (imported by name: a conftest.py here would shadow the
`conftest` module that tests/*.py import). The CUDA tests need a GPU and a library built
with the CUDA backend, and skip with the runtime's reason anywhere else (a machine without
a GPU or driver, a build without nvcc). tools/gpu_check.sh runs them on a GPU machine
with GH_REQUIRE_CUDA=1, which turns that skip into a failure, so a broken GPU setup
cannot pass as "all skipped".

GH_TEST_CUDA_DEVICE picks the device (default "cuda", i.e. cuda:0). Pointing it at
"host-device" runs the same tests on the simulated device, which is how their tolerances
were checked on machines without a GPU."""

from __future__ import annotations

import os

import pytest

CUDA_DEVICE = os.environ.get("GH_TEST_CUDA_DEVICE", "cuda")


def cuda_unavailable_reason() -> str | None:
    """None if CUDA_DEVICE can run ops here, else why not (the runtime's message)."""
    from powerinfer_cpp._native import ffi, lib

    try:
        device_check = lib.gh_device_check
    except AttributeError:
        return "this build of the native library has no device API (gh_device_check)"
    if device_check(CUDA_DEVICE.encode()) != 0:
        why = ffi.string(lib.gh_last_error()).decode("utf-8", "replace")
        built = "built with" if lib.gh_have_cuda() else "built WITHOUT"
        return f"device '{CUDA_DEVICE}' unavailable (library {built} CUDA): {why}"
    return None


@pytest.fixture(scope="session")
def cuda_device() -> str:
    """The device name to test; skips (or fails under GH_REQUIRE_CUDA=1) without one."""
    why = cuda_unavailable_reason()
    if why:
        if os.environ.get("GH_REQUIRE_CUDA") == "1":
            pytest.fail(f"GH_REQUIRE_CUDA=1 but {why}")
        pytest.skip(why)
    return CUDA_DEVICE
