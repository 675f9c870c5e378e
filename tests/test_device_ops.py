"""Every device op (matmul, predict, hot FFN) on every backend against numpy: the
host-device backend always, CUDA where a GPU is present (skipped with the reason
elsewhere; tools/gpu_check.sh runs them on a GPU machine)."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp import device_available
from powerinfer_cpp._native import ffi, lib

from cbuf import fptr, iptr
from opref import ACTS, TYPES, act_ref, encode, id_lists, nrmse, vptr

GH_ERR_INVALID_ARG, GH_ERR_UNSUPPORTED, GH_ERR_RANGE = 4, 3, 6
# float types agree to rounding; the device's dot products run in another order
TOL = 1e-5


def _device_param(name):
    ok, why = device_available(name)
    return pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"{name}: {why}"))


DEVICES = [_device_param("host-device"), _device_param("cuda")]


def err() -> str:
    return ffi.string(lib.gh_last_error()).decode()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("rows, cols, n", [(1, 32, 1), (33, 64, 1), (97, 96, 5), (64, 256, 3)])
def test_matmul(device, tname, rows, cols, n):
    rng = np.random.default_rng(rows * 1000 + cols)
    raw, deq = encode(TYPES[tname], rng.standard_normal((rows, cols)).astype(np.float32))
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = np.full((n, rows), np.nan, dtype=np.float32)
    assert lib.gh_device_op_matmul(device.encode(), TYPES[tname], vptr(raw), rows, cols, fptr(x),
                                   n, fptr(y)) == 0, err()
    assert nrmse(y, x @ deq.T) < TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t1, t2", [("f32", "f32"), ("f16", "f16"), ("bf16", "f16"),
                                    ("q8_0", "f32"), ("q4_0", "q8_0")])
@pytest.mark.parametrize("d, h, ff", [(64, 32, 96), (96, 64, 161)])
def test_predict(device, t1, t2, d, h, ff):
    rng = np.random.default_rng(d + h + ff)
    r1, w1 = encode(TYPES[t1], rng.standard_normal((h, d)).astype(np.float32))
    r2, w2 = encode(TYPES[t2], rng.standard_normal((ff, h)).astype(np.float32))
    x = rng.standard_normal(d).astype(np.float32)
    score = np.full(ff, np.nan, dtype=np.float32)
    assert lib.gh_device_op_predict(device.encode(), TYPES[t1], vptr(r1), TYPES[t2], vptr(r2),
                                    d, h, ff, fptr(x), fptr(score)) == 0, err()
    assert nrmse(score, w2 @ np.maximum(w1 @ x, 0)) < TOL


def hot_ffn_ref(gate, up, down_t, act, x, rows):
    if len(rows) == 0:
        return np.zeros(down_t.shape[1], dtype=np.float32)
    a = act_ref(act, gate[rows] @ x, up[rows] @ x)
    return (a[:, None] * down_t[rows]).sum(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("aname", list(ACTS))
def test_hot_ffn(device, tname, aname):
    t, act = TYPES[tname], ACTS[aname]
    n_hot, d = 77, 64
    rng = np.random.default_rng(7 + t * 5 + act)
    rg, g = encode(t, rng.standard_normal((n_hot, d)).astype(np.float32))
    ru, u = encode(t, rng.standard_normal((n_hot, d)).astype(np.float32))
    down_type = TYPES["f16"] if tname == "q4_0" else t  # mixed types are allowed
    rd, dn = encode(down_type, rng.standard_normal((n_hot, d)).astype(np.float32))
    x = rng.standard_normal(d).astype(np.float32)
    for name, rows in id_lists(n_hot, rng).items():
        y = np.full(d, np.nan, dtype=np.float32)
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        assert lib.gh_device_op_hot_ffn(device.encode(), t, vptr(rg), vptr(ru), down_type,
                                        vptr(rd), n_hot, d, act, fptr(x),
                                        iptr(rows) if len(rows) else ffi.NULL, len(rows),
                                        fptr(y)) == 0, err()
        ref = hot_ffn_ref(g, u, dn, act, x, rows)
        if name == "empty":
            assert (y == 0).all()
            continue
        # act(g, u) is at most |g u|; errors scale with the terms before they cancel (a
        # GELU of a very negative g is a tiny difference of float32 numbers)
        scale = (np.abs(g[rows] @ x) * np.abs(u[rows] @ x)) @ np.abs(dn[rows])
        assert np.abs(y - ref).max() <= TOL * scale.max(), name


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device):
    dev = device.encode()
    w = np.zeros((4, 32), dtype=np.float32)
    x = np.zeros(32, dtype=np.float32)
    y = np.zeros(32, dtype=np.float32)
    assert lib.gh_device_op_matmul(dev, 99, vptr(w), 4, 32, fptr(x), 1, fptr(y)) == GH_ERR_UNSUPPORTED
    assert lib.gh_device_op_matmul(dev, TYPES["q4_0"], vptr(w), 4, 33, fptr(x), 1, fptr(y)) == GH_ERR_INVALID_ARG
    assert "block size" in err()
    assert lib.gh_device_op_matmul(dev, 0, vptr(w), 4, 32, fptr(x), 0, fptr(y)) == GH_ERR_INVALID_ARG
    rows = np.array([0, 4], dtype=np.int32)
    assert lib.gh_device_op_hot_ffn(dev, 0, vptr(w), vptr(w), 0, vptr(w), 4, 32, 1, fptr(x),
                                    iptr(rows), 2, fptr(y)) == GH_ERR_RANGE
    assert "outside [0, 4)" in err()
    assert lib.gh_device_op_hot_ffn(dev, 0, vptr(w), vptr(w), 0, vptr(w), 4, 32, 9, fptr(x),
                                    iptr(rows), 1, fptr(y)) == GH_ERR_INVALID_ARG


def test_device_names():
    assert lib.gh_device_check(b"cpu") == 0
    assert lib.gh_device_check(b"host-device") == 0
    assert lib.gh_device_check(b"tpu") == GH_ERR_INVALID_ARG and "unknown device" in err()
    assert lib.gh_device_check(b"cuda:-1") == GH_ERR_INVALID_ARG
    w = np.zeros((1, 32), dtype=np.float32)
    assert lib.gh_device_op_matmul(b"cpu", 0, vptr(w), 1, 32, fptr(w[0]), 1, fptr(w[0])) == GH_ERR_INVALID_ARG
    if not lib.gh_have_cuda():
        assert lib.gh_device_check(b"cuda") == GH_ERR_UNSUPPORTED
        assert "no CUDA backend" in err()


def test_host_device_capacity(monkeypatch):
    """An allocation beyond the simulated device's memory is a clear out-of-memory error."""
    monkeypatch.setenv("GH_HOST_DEVICE_MEM", "1K")
    w = np.zeros((64, 32), dtype=np.float32)  # 8 KiB
    x = np.zeros(32, dtype=np.float32)
    y = np.zeros(64, dtype=np.float32)
    assert lib.gh_device_op_matmul(b"host-device", 0, vptr(w), 64, 32, fptr(x), 1, fptr(y)) == 5
    assert "out of memory" in err() and "GH_HOST_DEVICE_MEM" in err()
