"""The device ops against numpy, on every backend: the host-device backend always, the
CUDA kernels where a GPU is present (skipped elsewhere: the cuda_device fixture in
tests/conftest.py). Matmul and the predictor of one type are rows of the op table
(test_op_table.py: every weight type, odd sizes, token tiles); here prompt-sized batches
and repeats, predictors of mixed types, and the hot FFN for every weight type, every
activation, odd sizes (both the vector and the element-per-lane paths of the float
types), row lists (empty, one, all, unsorted with repeats, long enough to be sliced),
determinism and the errors.

Error measure (as tests/ops/test_types_matmul.py): the normalised squared error

    err = ||y - y_ref||^2 / max(||y_ref||^2, expected ||y_ref||^2 of random data)

with y_ref in float64 on the *dequantized* weights (gguf-py's, independent of the
runtime) and the f32 activations. The kernels dequantize weights exactly and never
quantize activations, so the only error is f32 accumulation (~1e-13 here); BOUND leaves
a wide margin while any indexing mistake gives err ~ 1."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp._native import ffi, lib

from cbuf import fptr, iptr
from opref import ACTS, QUANTIZED, TYPES, act_ref, block_cols, encode, id_lists, vptr


@pytest.fixture(params=["host-device", "cuda"])
def op_device(request) -> str:
    """Each test runs on the simulated device and on the GPU (when there is one)."""
    if request.param == "host-device":
        return "host-device"
    return request.getfixturevalue("cuda_device")


BOUND = 1e-9
QUANT = {n for n, t in TYPES.items() if t in QUANTIZED}


def err() -> str:
    return ffi.string(lib.gh_last_error()).decode("utf-8", "replace")


def nmse(y, ref, expected_sq) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((y - ref) ** 2) / max(np.sum(ref ** 2), expected_sq, 1e-300))


def weights(tname, rows, cols, rng):
    raw, deq = encode(TYPES[tname], rng.standard_normal((rows, cols)).astype(np.float32))
    return raw, deq.astype(np.float64)


# ---- matmul ------------------------------------------------------------------------------

def run_matmul(device, tname, raw, rows, cols, x):
    n = x.shape[0]
    y = np.full((n, rows), np.nan, dtype=np.float32)
    st = lib.gh_device_op_matmul(device.encode(), TYPES[tname], vptr(raw), rows, cols, fptr(x), n,
                                 fptr(y))
    assert st == 0, err()
    return y


@pytest.mark.parametrize("tname", list(TYPES))
def test_matmul_batch_and_repeat(op_device, tname):
    """A prompt-sized batch (9 tiles, the last partial); the same call twice gives the same
    bits."""
    rows, cols, n = 257, block_cols(TYPES[tname], 4096 + 32), 70
    rng = np.random.default_rng(5)
    raw, w = weights(tname, rows, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = run_matmul(op_device, tname, raw, rows, cols, x)
    ref = x.astype(np.float64) @ w.T
    expected = np.sum(w ** 2) * np.sum(x.astype(np.float64) ** 2) / cols
    assert nmse(y, ref, expected) < BOUND
    np.testing.assert_array_equal(run_matmul(op_device, tname, raw, rows, cols, x), y)
    # token t of the batch alone: the same row products (the tile only shares the weights)
    y1 = run_matmul(op_device, tname, raw, rows, cols, x[3:4].copy())
    assert nmse(y1[0], ref[3], expected / n) < BOUND


# ---- predictor ---------------------------------------------------------------------------

# one type per predictor: the op table's predict row (test_op_table.py); here mixed types
PREDICT_CASES = [
    ("q4_k", "q6_k", 512, 256, 300),
    ("q4_0", "f16", 4096 + 32, 128, 1000),   # a real predictor's shape
    ("f32", "q8_0", 64, 32, 1),
    ("bf16", "q4_0", 96, 64, 33),
    ("f16", "f16", 40, 37, 33),              # hidden layer of odd width (element path)
    ("f32", "bf16", 7, 5, 3),
]


@pytest.mark.parametrize("t1, t2, d, h, ff", PREDICT_CASES)
def test_predict(op_device, t1, t2, d, h, ff):
    rng = np.random.default_rng(d * 3 + h * 5 + ff)
    r1, w1 = weights(t1, h, d, rng)
    r2, w2 = weights(t2, ff, h, rng)
    x = rng.standard_normal(d).astype(np.float32)
    score = np.full(ff, np.nan, dtype=np.float32)
    st = lib.gh_device_op_predict(op_device.encode(), TYPES[t1], vptr(r1), TYPES[t2], vptr(r2),
                                  d, h, ff, fptr(x), fptr(score))
    assert st == 0, err()
    hid = np.maximum(w1 @ x.astype(np.float64), 0.0)
    ref = w2 @ hid
    expected = np.sum(w2 ** 2) * np.sum(hid ** 2) / h
    e = nmse(score, ref, expected)
    assert e < BOUND, (t1, t2, d, h, ff, e)


# ---- hot FFN -----------------------------------------------------------------------------


def run_hot_ffn(device, t, rg, ru, down_t, rd, n_hot, d, act, x, rows, gb=None, ub=None, act_t=0.0):
    y = np.full(d, np.nan, dtype=np.float32)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    opt = lambda a: fptr(a) if a is not None else ffi.NULL  # noqa: E731
    st = lib.gh_device_op_hot_ffn(device.encode(), TYPES[t], vptr(rg),
                                  vptr(ru) if ru is not None else ffi.NULL, opt(gb), opt(ub),
                                  TYPES[down_t], vptr(rd), n_hot, d, act, act_t, fptr(x),
                                  iptr(rows) if rows.size else ffi.NULL, rows.size, fptr(y))
    assert st == 0, err()
    return y


def hot_ffn_check(device, tname, down_name, act, n_hot, d, lists, seed):
    rng = np.random.default_rng(seed)
    rg, g = weights(tname, n_hot, d, rng)
    ru, u = weights(tname, n_hot, d, rng)
    rd, dn = weights(down_name, n_hot, d, rng)
    x = rng.standard_normal(d).astype(np.float32)
    gx, ux = g @ x.astype(np.float64), u @ x.astype(np.float64)
    for name, rows in lists.items():
        y = run_hot_ffn(device, tname, rg, ru, down_name, rd, n_hot, d, act, x, rows)
        if rows.size == 0:
            assert (y == 0).all(), name  # overwritten with zeros
            continue
        a = act_ref(act, gx[rows], ux[rows])
        ref = a @ dn[rows]
        # expected ||ref||^2 for random data; a's own rounding scales with |g u|
        expected = np.sum((np.abs(gx[rows] * ux[rows]) + np.abs(a)) ** 2) * np.sum(dn ** 2) / (
            n_hot * d)
        e = nmse(y, ref, expected)
        assert e < BOUND, (tname, down_name, act, name, e)
        # fixed summation order: bit-identical when repeated
        np.testing.assert_array_equal(
            run_hot_ffn(device, tname, rg, ru, down_name, rd, n_hot, d, act, x, rows), y)


# every type with itself, and mixes: gate/up and down_t are instantiated and read apart
HOT_TYPES = [(t, t) for t in TYPES] + [("q4_0", "f16"), ("q8_0", "q4_0"), ("f32", "bf16"),
                                      ("f16", "q8_0"), ("q4_k", "q6_k"), ("q5_k", "f16"),
                                      ("q4_1", "q5_0"), ("q5_1", "q4_k"), ("q5_0", "q5_1"),
                                      ("q2_k", "mxfp4"), ("iq4_xs", "q3_k"), ("mxfp4", "iq4_nl"),
                                      ("iq4_nl", "iq4_xs")]


@pytest.mark.parametrize("tname, down_name", HOT_TYPES)
@pytest.mark.parametrize("aname", list(ACTS))
def test_hot_ffn(op_device, tname, down_name, aname):
    n_hot, d = 97, max(block_cols(TYPES[tname], 96), block_cols(TYPES[down_name], 96))
    rng = np.random.default_rng(11)
    hot_ffn_check(op_device, tname, down_name, ACTS[aname], n_hot, d, id_lists(n_hot, rng),
                  seed=TYPES[tname] * 37 + TYPES[down_name] + ACTS[aname])


@pytest.mark.parametrize("tname", ["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_1"])
@pytest.mark.parametrize("aname", ["relu", "fatrelu", "gelu_erf"])
@pytest.mark.parametrize("gated", [True, False])
def test_hot_ffn_biases_ungated(op_device, tname, aname, gated):
    """Biases on the activation input (and on up), an ungated FFN (OPT, Falcon: up = NULL,
    a = act(gate . x + b)) and FATReLU's threshold, on the device as on the CPU."""
    n_hot, d, t = 61, 64, 0.1
    act = {**ACTS, "fatrelu": lib.GH_ACT_FATRELU}[aname]
    rng = np.random.default_rng(5 + gated)
    rg, g = weights(tname, n_hot, d, rng)
    ru, u = weights(tname, n_hot, d, rng)
    rd, dn = weights(tname, n_hot, d, rng)
    gb = rng.standard_normal(n_hot).astype(np.float32)
    ub = rng.standard_normal(n_hot).astype(np.float32)
    x = rng.standard_normal(d).astype(np.float32)
    rows = rng.permutation(n_hot)[:40].astype(np.int32)
    gx = g[rows] @ x.astype(np.float64) + gb[rows]
    ux = u[rows] @ x.astype(np.float64) + ub[rows] if gated else np.ones(len(rows))
    y = run_hot_ffn(op_device, tname, rg, ru if gated else None, tname, rd, n_hot, d, act, x,
                    rows, gb=gb, ub=ub if gated else None, act_t=t)
    if act == 5:
        a = np.where(gx > t, gx, 0.0) * ux
    else:
        a = act_ref(act, gx, ux)
    ref = a @ dn[rows]
    expected = np.sum((np.abs(gx * ux) + np.abs(a)) ** 2) * np.sum(dn ** 2) / (n_hot * d)
    assert nmse(y, ref, expected) < BOUND


@pytest.mark.parametrize("tname", [t for t in TYPES if t not in QUANT])
def test_hot_ffn_odd_float_width(op_device, tname):
    """Float rows of 100 columns: gate/up on the element path, down element by element."""
    n_hot, d = 33, 100
    rng = np.random.default_rng(3)
    hot_ffn_check(op_device, tname, tname, ACTS["relu"], n_hot, d, id_lists(n_hot, rng), seed=4)


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("aname", ["relu", "silu"])
def test_hot_ffn_long_lists(op_device, tname, aname):
    """A 7B-like width and lists long enough to be cut into many slices (sums of slices
    added in order) and to need several shared-memory tiles per slice."""
    n_hot, d = 700, block_cols(TYPES[tname], 4096 + 32)
    rng = np.random.default_rng(17)
    perm = rng.permutation(n_hot).astype(np.int32)
    lists = {
        "all": np.arange(n_hot, dtype=np.int32),
        "unsorted-repeats": np.concatenate([perm[:400], perm[:300]]).astype(np.int32),
        "65": perm[:65],  # just over one slice of 64
        "one": perm[:1],
    }
    hot_ffn_check(op_device, tname, tname, ACTS[aname], n_hot, d, lists, seed=23)


def test_hot_ffn_narrow_many_rows(op_device):
    """A narrow output with a very long list: at most 64 slices of many rows each (several
    shared-memory tiles of 256 rows per slice)."""
    n_hot, d = 3000, 32
    rng = np.random.default_rng(29)
    lists = {"all": np.arange(n_hot, dtype=np.int32),
             "reversed": np.arange(n_hot, dtype=np.int32)[::-1].copy(),
             "repeats": rng.integers(0, n_hot, 20000).astype(np.int32)}
    hot_ffn_check(op_device, "f16", "f16", ACTS["drelu"], n_hot, d, lists, seed=31)


# ---- errors ------------------------------------------------------------------------------


def test_errors(op_device):
    dev = op_device.encode()
    w = np.zeros((4, 32), dtype=np.float32)
    x = np.zeros(64, dtype=np.float32)
    y = np.zeros(64, dtype=np.float32)
    assert lib.gh_device_op_matmul(dev, 99, vptr(w), 4, 32, fptr(x), 1, fptr(y)) == lib.GH_ERR_UNSUPPORTED
    assert lib.gh_device_op_matmul(dev, TYPES["q4_0"], vptr(w), 4, 48, fptr(x), 1,
                                   fptr(y)) == lib.GH_ERR_INVALID_ARG
    rows = np.array([0, 4], dtype=np.int32)
    assert lib.gh_device_op_hot_ffn(dev, lib.GH_TYPE_F32, vptr(w), vptr(w), ffi.NULL, ffi.NULL, 0, vptr(w), 4,
                                    32, 1, 0.0, fptr(x), iptr(rows), 2, fptr(y)) == lib.GH_ERR_RANGE
    assert lib.gh_device_op_hot_ffn(dev, lib.GH_TYPE_F32, vptr(w), vptr(w), ffi.NULL, ffi.NULL, 0, vptr(w), 4,
                                    32, 17, 0.0, fptr(x), iptr(rows), 1, fptr(y)) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_device_op_hot_ffn(dev, lib.GH_TYPE_F32, vptr(w), ffi.NULL, ffi.NULL, ffi.NULL, 0, vptr(w), 4,
                                    32, 2, 0.0, fptr(x), iptr(rows), 1, fptr(y)) == lib.GH_ERR_INVALID_ARG


def test_missing_gpu_index_is_a_clear_error(cuda_device):
    if cuda_device != "cuda" and not cuda_device.startswith("cuda:"):
        pytest.skip("a CUDA device name is needed")
    assert lib.gh_device_check(b"cuda:999") == lib.GH_ERR_UNSUPPORTED
    assert "does not exist" in err() and "cuda:0" in err()
    w = np.zeros((1, 32), dtype=np.float32)
    assert lib.gh_device_op_matmul(b"cuda:999", lib.GH_TYPE_F32, vptr(w), 1, 32, fptr(w[0]), 1,
                                   fptr(w[0])) == lib.GH_ERR_UNSUPPORTED
