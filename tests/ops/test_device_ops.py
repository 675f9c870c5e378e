"""Device names and the simulated device's memory limit. The device ops themselves are
checked against numpy on every backend in tests/gpu/test_cuda_ops.py (host-device
always, CUDA where a GPU is present)."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp import device_available
from powerinfer_cpp._native import ffi, lib

from cbuf import fptr
from opref import vptr



def err() -> str:
    return ffi.string(lib.gh_last_error()).decode()


def test_device_names():
    assert lib.gh_device_check(b"cpu") == 0
    assert lib.gh_device_check(b"host-device") == 0
    assert lib.gh_device_check(b"tpu") == lib.GH_ERR_INVALID_ARG and "unknown device" in err()
    assert lib.gh_device_check(b"cuda:-1") == lib.GH_ERR_INVALID_ARG
    w = np.zeros((1, 32), dtype=np.float32)
    assert lib.gh_device_op_matmul(b"cpu", lib.GH_TYPE_F32, vptr(w), 1, 32, fptr(w[0]), 1, fptr(w[0])) == lib.GH_ERR_INVALID_ARG
    if not lib.gh_have_cuda():
        assert lib.gh_device_check(b"cuda") == lib.GH_ERR_UNSUPPORTED
        assert "no CUDA backend" in err()
    ok, why = device_available("cuda")
    assert ok == (lib.gh_device_check(b"cuda") == 0) and (ok or why)


def test_host_device_capacity(monkeypatch):
    """An allocation beyond the simulated device's memory is a clear out-of-memory error."""
    monkeypatch.setenv("GH_HOST_DEVICE_MEM", "1K")
    w = np.zeros((64, 32), dtype=np.float32)  # 8 KiB
    x = np.zeros(32, dtype=np.float32)
    y = np.zeros(64, dtype=np.float32)
    assert lib.gh_device_op_matmul(b"host-device", lib.GH_TYPE_F32, vptr(w), 64, 32, fptr(x), 1, fptr(y)) == lib.GH_ERR_OOM
    assert "out of memory" in err() and "GH_HOST_DEVICE_MEM" in err()


def test_host_device_type_list(monkeypatch):
    """The simulated device's ops refuse a weight type it does not read (GH_HOST_DEVICE_TYPES),
    naming it and the types it reads; unset, it reads every type the runtime reads."""
    w = np.zeros((2, 32), dtype=np.float32)
    x = np.ones(32, dtype=np.float32)
    y = np.zeros(2, dtype=np.float32)
    monkeypatch.setenv("GH_HOST_DEVICE_TYPES", "f16,bf16")
    assert lib.gh_device_op_matmul(b"host-device", lib.GH_TYPE_F32, vptr(w), 2, 32, fptr(x), 1, fptr(y)) == lib.GH_ERR_UNSUPPORTED
    assert "does not read type f32 (id 0) of matmul's weight: it reads f16 and bf16" in err()
    monkeypatch.setenv("GH_HOST_DEVICE_TYPES", "f32")
    assert lib.gh_device_op_matmul(b"host-device", lib.GH_TYPE_F32, vptr(w), 2, 32, fptr(x), 1, fptr(y)) == lib.GH_OK
    monkeypatch.setenv("GH_HOST_DEVICE_TYPES", "f32,,")
    assert lib.gh_device_op_matmul(b"host-device", lib.GH_TYPE_F32, vptr(w), 2, 32, fptr(x), 1, fptr(y)) == lib.GH_ERR_INVALID_ARG
    assert "GH_HOST_DEVICE_TYPES='f32,,': '' is not a type this runtime reads" in err()
