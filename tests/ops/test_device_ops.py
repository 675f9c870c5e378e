"""Device names (the backend registry, backend/registry.c, and every place that names a
device after it) and the simulated device's memory limit. The device ops themselves are
checked against numpy on every backend of the registry in tests/ops/test_op_table.py
(host-device always, CUDA where a GPU is present)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from powerinfer_cpp import Llama, Model, device_available
from powerinfer_cpp._native import ffi, lib
from powerinfer_cpp.generate import _llama_habits, build_parser
from powerinfer_cpp.model import DeviceKind, device_kinds, device_names, gpu_device

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


def test_registry_kinds_are_the_names_the_library_takes():
    """Every kind the registry lists (gh_device_kind_get) is a device name the library
    knows: made here (GH_OK), or refused as unavailable (a build without it, no GPU), never
    as an unknown name; ":N" only for the indexed kinds; a kind this build lacks says how
    to get it."""
    kinds = device_kinds()
    names = [k.name for k in kinds]
    assert len(set(names)) == len(names) and "cpu" not in names
    by_name = {k.name: k for k in kinds}
    assert by_name["host-device"] == DeviceKind("host-device", indexed=False, accelerator=False,
                                                built=True)
    cuda = by_name["cuda"]
    assert cuda.indexed and cuda.accelerator and cuda.built == bool(lib.gh_have_cuda())
    for k in kinds:
        for name in [k.name, f"{k.name}:0"] if k.indexed else [k.name]:
            st = lib.gh_device_check(name.encode())
            assert st in (lib.GH_OK, lib.GH_ERR_UNSUPPORTED), (name, err())
            if not k.built:
                assert st == lib.GH_ERR_UNSUPPORTED and "this build of powerinfer-cpp has no" in err()
        if not k.indexed:
            assert lib.gh_device_check(f"{k.name}:0".encode()) == lib.GH_ERR_INVALID_ARG
            assert f"unknown device '{k.name}:0'" in err()
    out = ffi.new("gh_device_kind *")
    assert lib.gh_device_kind_get(len(kinds), out) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_device_kind_get(-1, out) == lib.GH_ERR_INVALID_ARG


def test_unknown_device_lists_the_registry():
    """The C message for an unknown device and Model's TypeError list exactly the names of
    the registry (device_names), so a new backend is named there without an edit."""
    assert lib.gh_device_check(b"tpu") == lib.GH_ERR_INVALID_ARG
    listed = re.fullmatch(r"unknown device 'tpu' \(use (.*)\)", err())
    assert listed and re.split(r", | or ", listed.group(1)) == device_names()
    with pytest.raises(TypeError, match=re.escape(", ".join(device_names()))):
        Model(__file__, device=0)


def test_gpu_choice_and_llama_cpp_names_follow_the_registry():
    """n_gpu_layers / -ngl ask for the first accelerator kind that runs here (None with
    every accelerator's reason when none does); --device takes llama.cpp's <NAME><N> for
    every indexed kind."""
    accel = [k.name for k in device_kinds() if k.accelerator]
    gpu, why = gpu_device()
    usable = [n for n in accel if device_available(n)[0]]
    assert gpu == (usable[0] if usable else None)
    if gpu is None:
        assert all(f"{n}: " in why for n in accel) and why
    for k in device_kinds():
        args = build_parser().parse_args(["-dev", f"{k.name.upper()}3"])
        _llama_habits(args)
        assert args.device == (f"{k.name}:3" if k.indexed else f"{k.name.upper()}3")


def test_llama_takes_every_usable_registry_device(shipped_gguf):
    """Llama(device=...) loads on every kind of the registry that runs here, and says so."""
    usable = [k.name for k in device_kinds() if device_available(k.name)[0]]
    assert "host-device" in usable
    for name in usable:
        with Llama(str(shipped_gguf), device=name, n_ctx=32, verbose=False) as llm:
            assert llm.model.device_info()["device"] == name


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
