"""Tensor types (quantize / dequantize) and the matmul kernels against numpy.

* Block layouts: our reference quantizers must be byte-identical to gguf-py's
  (`gguf.quants`, itself bit-exact with ggml's reference code) for Q8_0, Q4_0 and BF16,
  and to numpy's float16 for F16; dequantization must match exactly. K-quants (Q4_K,
  Q5_K, Q6_K): gguf.quants only dequantizes them; our dequantizer must equal it bit for
  bit on random blocks and on our quantizer's, and our quantizer's error must be that of
  ggml's reference quantizer or better (K_NRMSE: ggml's measured error on the same
  Gaussian data plus 3%; see docs/BENCHMARKS.md, "K-quant kernels").
* Matmul: every type x every SIMD level x odd sizes x 1 and 2 threads against numpy is
  a row of the op table (test_op_table.py); here its tile edges, batches against their
  tokens, the levels against each other, extreme values and bad arguments, against numpy
  (float64) on the *dequantized* weights and the f32 activations. The error measure is
  the normalized squared error

      err = ||y - y_ref||^2 / max(||y_ref||^2, sum_{t,r} ||W_r||^2 ||x_t||^2 / cols)

  (the second term is the expected ||y_ref||^2 of random data; it keeps one-output cases
  from dividing by a near-zero result). Bounds per type (NMSE_BOUND): f32/f16 1e-10
  (float accumulation only); bf16 1e-4 (activations rounded to bf16: ~1e-6 expected);
  q8_0/q4_0 1e-3 (activations quantized to 8 bits per 32-block: ~3e-5 expected);
  K-quants 1e-3 (8 bits per 256-block, Q8_K: ~5e-5 expected).
* SIMD levels against the scalar level (same activation conversion, so 1e-8), and
  1 thread against 2 threads (bit-identical: threads split rows on tile boundaries).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from powerinfer_cpp._native import NativeError, check, ffi, lib
from cbuf import fptr  # noqa: E402
from conftest import simd_levels  # noqa: E402

from opref import (BF16, BLOCK, F16, F32, GGUF_QT, IQ4_NL, IQ4_XS, K_QUANTS, LATTICE, LATTICE_ALL,  # noqa: E402
                   LATTICE_SIZE, MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPES,
                   block_cols, encode)

NAME = {F32: "f32", F16: "f16", BF16: "bf16", Q8_0: "q8_0", Q4_0: "q4_0", Q4_1: "q4_1",
        Q5_0: "q5_0", Q5_1: "q5_1", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", Q2_K: "Q2_K",
        Q3_K: "Q3_K", IQ4_NL: "iq4_nl", IQ4_XS: "iq4_xs", MXFP4: "mxfp4",
        **{t: n for n, t in LATTICE_ALL.items()}}
TYPE_SIZE = {F32: 4, F16: 2, BF16: 2, Q8_0: 34, Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q4_K: 144,
             Q5_K: 176, Q6_K: 210, Q2_K: 84, Q3_K: 110, IQ4_NL: 18, IQ4_XS: 136, MXFP4: 17,
             **LATTICE_SIZE}
# the lattice types: Q8_K activations as the K-quants'
NMSE_BOUND = {F32: 1e-10, F16: 1e-10, BF16: 1e-4, Q8_0: 1e-3, Q4_0: 1e-3, Q4_1: 1e-3, Q5_0: 1e-3,
              Q5_1: 1e-3, Q4_K: 1e-3, Q5_K: 1e-3, Q6_K: 1e-3, Q2_K: 1e-3, Q3_K: 1e-3, IQ4_NL: 1e-3,
              IQ4_XS: 1e-3, MXFP4: 1e-3, **{t: 1e-3 for t in LATTICE}}
# quantizer error (RMS error / RMS) on Gaussian rows: ggml's reference quantizer measured
# 0.0715 / 0.0362 / 0.0178 on such data (ours: 0.0719 / 0.0360 / 0.0170); Q2_K / Q3_K on
# this test's data 0.2952 / 0.1507 (ours: 0.2745 / 0.1450)
K_NRMSE = {Q4_K: 0.0715 * 1.03, Q5_K: 0.0362 * 1.03, Q6_K: 0.0178 * 1.03, Q2_K: 0.2952 * 1.03,
           Q3_K: 0.1507 * 1.03}
# where a K-quant block keeps its fp16 scales (d, and dmin where it has one)
K_HALVES = {Q4_K: slice(0, 4), Q5_K: slice(0, 4), Q6_K: slice(208, 210), Q2_K: slice(80, 84),
            Q3_K: slice(108, 110)}
# how far a constant sub-block of 3.0 may come back (the sub-block scales' bits: 6, and
# Q6_K's 8: ~1%; Q2_K's 4-bit scale against 4 levels: measured 0.14)
K_CONST = {Q2_K: 0.2}
# IQ4_NL / IQ4_XS (our quantizers; gguf.quants has none) on the same data: measured 0.0738 /
# 0.0740 (Q4_0's reference quantizer: 0.0862, Q4_K's 0.0719); bound +3%
IQ4_NRMSE = {IQ4_NL: 0.0738 * 1.03, IQ4_XS: 0.0740 * 1.03}
SIMD_VS_SCALAR_BOUND = 1e-8



def vptr(a: np.ndarray):
    assert a.flags.c_contiguous
    return ffi.cast("void *", a.ctypes.data)


def quantize(t: int, a: np.ndarray) -> np.ndarray:
    """Our quantizer, row by row (uint8 bytes, rows x row_size)."""
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, a.shape[-1])
    rs = lib.gh_type_row_size(t, a.shape[1])
    out = np.zeros((a.shape[0], rs), dtype=np.uint8)
    for r in range(a.shape[0]):
        check(lib.gh_quantize_row(t, fptr(a[r]), vptr(out[r]), a.shape[1]))
    return out


def dequantize(t: int, q: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((q.shape[0], n), dtype=np.float32)
    for r in range(q.shape[0]):
        check(lib.gh_dequantize_row(t, vptr(q[r]), fptr(out[r]), n))
    return out


def gguf_bytes(t: int, a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(quants.quantize(a, GGUF_QT[t])).view(np.uint8).reshape(a.shape[0], -1)


def matmul(t: int, wq: np.ndarray, rows: int, cols: int, x: np.ndarray, n_threads: int) -> np.ndarray:
    y = np.full((x.shape[0], rows), np.nan, dtype=np.float32)
    check(lib.gh_op_matmul(t, vptr(wq), rows, cols, fptr(x), x.shape[0], fptr(y), n_threads))
    return y


def nmse(y: np.ndarray, ref: np.ndarray, w: np.ndarray, x: np.ndarray) -> float:
    y = y.astype(np.float64)
    ref = ref.astype(np.float64)
    expected = float(np.sum(w.astype(np.float64) ** 2, axis=1).sum()
                     * np.sum(x.astype(np.float64) ** 2, axis=1).sum()) / w.shape[1]
    return float(np.sum((y - ref) ** 2)) / max(float(np.sum(ref ** 2)), expected, 1e-300)


# ------------------------------------------------------------------- type table

def test_type_table():
    for t in TYPES.values():
        assert ffi.string(lib.gh_type_name(t)).decode() == NAME[t]
        assert lib.gh_type_block_size(t) == BLOCK[t]
        assert lib.gh_type_row_size(t, 64 * BLOCK[t]) == 64 * TYPE_SIZE[t]
    assert lib.gh_type_row_size(Q4_0, 33) == 0
    assert lib.gh_type_row_size(12345, 32) == 0
    assert lib.gh_type_block_size(12345) == 0
    assert lib.gh_type_row_size(1000, 128) == 0  # the internal activation types are not public
    assert lib.gh_type_row_size(15, 256) == 0  # Q8_K
    assert lib.gh_type_row_size(Q4_K, 128) == 0


def test_simd_levels():
    sup = lib.gh_simd_supported()
    assert lib.GH_SIMD_SCALAR <= sup <= lib.GH_SIMD_AVX512
    cur = lib.gh_simd_get()
    assert lib.GH_SIMD_SCALAR <= cur <= sup
    assert lib.gh_simd_set(sup + 1) == -2 if sup < lib.GH_SIMD_AVX512 else True
    assert lib.gh_simd_set(7) == -2
    prev = lib.gh_simd_set(lib.GH_SIMD_SCALAR)
    assert prev == cur and lib.gh_simd_get() == lib.GH_SIMD_SCALAR
    assert lib.gh_simd_set(lib.GH_SIMD_AUTO) == lib.GH_SIMD_SCALAR and lib.gh_simd_get() == sup
    lib.gh_simd_set(cur)


# ------------------------------------------------------------ block layouts

def special_values(n: int, rng) -> np.ndarray:
    """Rows that exercise rounding ties, zero blocks, sign of the max, subnormals."""
    a = rng.standard_normal((6, n)).astype(np.float32)
    a[1, :32] = 0.0                                             # all-zero block
    a[2, :32] = np.linspace(-1, 0.5, 32, dtype=np.float32)      # max |x| is negative
    a[3, :32] = np.float32([127.0] + [k + 0.5 for k in range(-15, 16)])  # q8_0 ties
    a[4] *= 1e-3
    a[5, :32] = np.float32(3.0)                                 # constant block
    return a


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "bf16"])
def test_quantize_matches_gguf(name):
    t = TYPES[name]
    rng = np.random.default_rng(1)
    for n in (32, 96, 4096 + 32):
        a = np.concatenate([special_values(n, rng), rng.standard_normal((8, n)).astype(np.float32) * 10])
        ours = quantize(t, a)
        ref = gguf_bytes(t, a)
        assert ours.shape == ref.shape
        assert np.array_equal(ours, ref), f"{name} n={n}: rows {np.nonzero((ours != ref).any(1))[0]}"
        # dequantize: identical to gguf's
        deq = dequantize(t, ours, n)
        ref_deq = quants.dequantize(ref.reshape(-1), GGUF_QT[t]).reshape(a.shape[0], n)
        assert np.array_equal(deq, ref_deq)


def random_k_blocks(t: int, n_blocks: int, rng) -> np.ndarray:
    """Random bytes as K-quant blocks, with finite fp16 scales of moderate size (every
    other bit pattern is a valid block)."""
    size = TYPE_SIZE[t]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    halves = (rng.standard_normal((n_blocks, 2)) * 0.05).astype(np.float16).view(np.uint8)
    where = K_HALVES[t]
    raw[:, where] = halves[:, : where.stop - where.start]
    return raw


@pytest.mark.parametrize("t", K_QUANTS, ids=lambda t: NAME[t])
def test_k_quant_dequantize_matches_gguf(t):
    """Bit for bit on random blocks, and on our quantizer's blocks of ordinary, special
    and scaled data."""
    rng = np.random.default_rng(t)
    raw = random_k_blocks(t, 300, rng)
    ours = dequantize(t, raw.reshape(1, -1), 300 * 256)[0]
    ref = quants.dequantize(raw.reshape(-1), GGUF_QT[t]).astype(np.float32).reshape(-1)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    for n in (256, 768, 4096 + 256):
        a = np.concatenate([special_values(n, rng), rng.standard_normal((8, n)).astype(np.float32) * 10,
                            rng.standard_t(3, (4, n)).astype(np.float32)])
        q = quantize(t, a)
        assert q.shape[1] == n // 256 * TYPE_SIZE[t]
        ref = quants.dequantize(q.reshape(-1), GGUF_QT[t]).reshape(a.shape[0], n)
        assert np.array_equal(dequantize(t, q, n), ref)
        assert (ref[1, :32] == 0).all() or t != Q6_K  # a zero sub-block stays zero (Q6_K: no min)
        assert np.abs(ref[5, :32] - 3.0).max() <= K_CONST.get(t, 0.06)  # a constant sub-block


@pytest.mark.parametrize("t", K_QUANTS, ids=lambda t: NAME[t])
def test_k_quant_quantizer_error(t):
    """The quantizer is as good as ggml's reference one (K_NRMSE) and degrades gracefully:
    all-zero rows stay zero, tiny and huge magnitudes keep their relative error."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((64, 4096)).astype(np.float32)
    back = dequantize(t, quantize(t, a), a.shape[1])
    e = float(np.sqrt(np.mean((back - a) ** 2)) / np.sqrt(np.mean(a ** 2)))
    print(f"{NAME[t]}: nrmse {e:.4f} (bound {K_NRMSE[t]:.4f})")
    assert e <= K_NRMSE[t]
    for scale in (1e-3, 1e3):
        b = a[:8] * scale
        eb = float(np.sqrt(np.mean((dequantize(t, quantize(t, b), 4096) - b) ** 2)) / np.sqrt(np.mean(b ** 2)))
        assert eb <= 1.1 * K_NRMSE[t], (scale, eb)
    z = np.zeros((1, 256), dtype=np.float32)
    assert (dequantize(t, quantize(t, z), 256) == 0).all()


@pytest.mark.parametrize("t", [IQ4_NL, IQ4_XS, MXFP4], ids=lambda t: NAME[t])
def test_iq4_dequantize_matches_gguf(t):
    """Bit for bit on random blocks (fp16 scales of moderate size, MXFP4's every e8m0 byte)
    and on our quantizer's blocks."""
    rng = np.random.default_rng(t)
    nb = 600
    raw = rng.integers(0, 256, size=(nb, TYPE_SIZE[t]), dtype=np.uint8)
    if t != MXFP4:
        raw[:, :2] = (rng.standard_normal((nb, 1)) * 0.05).astype(np.float16).view(np.uint8)
    else:
        raw[:256, 0] = np.arange(256)  # every exponent, the subnormal halves 0 and 1 too
    n = nb * BLOCK[t]
    ours = dequantize(t, raw.reshape(1, -1), n)[0]
    with np.errstate(over="ignore"):
        ref = quants.dequantize(raw.reshape(-1), GGUF_QT[t]).astype(np.float32).reshape(-1)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    for n in (256, 4096 + 256):
        a = np.concatenate([special_values(n, rng), rng.standard_normal((8, n)).astype(np.float32) * 10])
        q = quantize(t, a)
        ref = quants.dequantize(q.reshape(-1), GGUF_QT[t]).reshape(a.shape[0], n)
        assert np.array_equal(dequantize(t, q, n), ref)
        assert (ref[1, :32] == 0).all()  # a zero block stays zero


@pytest.mark.parametrize("t", [IQ4_NL, IQ4_XS], ids=lambda t: NAME[t])
def test_iq4_quantizer_error(t):
    """Our IQ4_NL / IQ4_XS quantizers (IQ4_NRMSE) at any magnitude; zero rows stay zero."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((64, 4096)).astype(np.float32)
    e = float(np.sqrt(np.mean((dequantize(t, quantize(t, a), 4096) - a) ** 2)) / np.sqrt(np.mean(a ** 2)))
    print(f"{NAME[t]}: nrmse {e:.4f} (bound {IQ4_NRMSE[t]:.4f})")
    assert e <= IQ4_NRMSE[t]
    for scale in (1e-3, 1e3):
        b = a[:8] * scale
        eb = float(np.sqrt(np.mean((dequantize(t, quantize(t, b), 4096) - b) ** 2)) / np.sqrt(np.mean(b ** 2)))
        assert eb <= 1.1 * IQ4_NRMSE[t], (scale, eb)
    z = np.zeros((1, 256), dtype=np.float32)
    assert (dequantize(t, quantize(t, z), 256) == 0).all()


def test_f16_matches_numpy():
    rng = np.random.default_rng(2)
    special = np.float32([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, np.inf, -np.inf,
                          6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8, 8.9e-8, 1e-10, -3e-6,
                          1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2049.0, 2051.0])
    # every float16 value, and values exactly half-way between neighbouring float16 values
    all_h = np.arange(0, 1 << 16, dtype=np.uint16).view(np.float16)
    all_h = all_h[np.isfinite(all_h)].astype(np.float32)
    finite = np.sort(all_h[all_h >= 0])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    vals = np.concatenate([special, all_h, mids, -mids, rng.standard_normal(4096).astype(np.float32) * 100])
    ours = quantize(F16, vals[None, :]).view(np.uint16)[0]
    with np.errstate(over="ignore"):
        ref = vals.astype(np.float16).view(np.uint16)
    bad = np.nonzero(ours != ref)[0]
    assert bad.size == 0, f"f16 mismatch at {vals[bad[:5]]}: {ours[bad[:5]]} vs {ref[bad[:5]]}"
    back = dequantize(F16, ours.view(np.uint8)[None, :], len(vals))[0]
    assert np.array_equal(back, ref.view(np.float16).astype(np.float32))
    # NaN stays NaN
    nan = quantize(F16, np.float32([np.nan, -np.nan])[None, :]).view(np.uint16)[0]
    assert np.isnan(nan.view(np.float16)).all()


def test_dequantize_round_trip():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 4096)).astype(np.float32)
    for name, bound in [("f32", 0.0), ("f16", 1e-7), ("bf16", 1e-5), ("q8_0", 1e-4), ("q4_0", 2e-2),
                        ("q4_k", 6e-3), ("q5_k", 1.5e-3), ("q6_k", 4e-4)]:
        t = TYPES[name]
        back = dequantize(t, quantize(t, a), a.shape[1])
        err = float(np.sum((back - a) ** 2) / np.sum(a ** 2))
        assert err <= bound, f"{name}: round-trip nmse {err}"


def test_quantize_invalid_args():
    x = np.zeros(64, dtype=np.float32)
    buf = np.zeros(1024, dtype=np.uint8)
    for call in (lambda: lib.gh_quantize_row(Q4_0, fptr(x), vptr(buf), 33),
                 lambda: lib.gh_quantize_row(99, fptr(x), vptr(buf), 32),
                 lambda: lib.gh_quantize_row(Q8_0, fptr(x), vptr(buf), -32),
                 lambda: lib.gh_quantize_row(Q8_0, ffi.NULL, vptr(buf), 32),
                 lambda: lib.gh_dequantize_row(Q4_0, vptr(buf), ffi.NULL, 32),
                 lambda: lib.gh_dequantize_row(Q8_0, vptr(buf), fptr(x), 31),
                 # the lattice types are read, never written: no quantizer
                 *[(lambda t=t: lib.gh_quantize_row(t, fptr(np.zeros(256, np.float32)), vptr(buf), 256))
                   for t in LATTICE]):
        with pytest.raises(NativeError) as e:
            check(call())
        assert e.value.status == lib.GH_ERR_INVALID_ARG and str(e.value)


# ---------------------------------------------------------------------- matmul

_weights: dict = {}


def weights(t: int, rows: int, cols: int):
    """(quantized bytes, dequantized f32) of a random rows x cols matrix, cached."""
    key = (t, rows, cols)
    if key not in _weights:
        rng = np.random.default_rng(rows * 7919 + cols)
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        wq = encode(t, w)[0] if t in LATTICE else quantize(t, w)  # (lattice: random blocks)
        _weights[key] = (wq, dequantize(t, wq, cols))
    return _weights[key]


def activations(n_tokens: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(n_tokens * 131 + cols)
    return rng.standard_normal((n_tokens, cols)).astype(np.float32)


@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_simd_vs_scalar(name):
    t = TYPES[name]
    levels = simd_levels()
    if len(levels) == 1:
        pytest.skip("this CPU has no SIMD level")
    prev = lib.gh_simd_get()
    try:
        for cols, rows, n_tokens in [(4096 + 32, 17, 3), (96, 257, 33), (32, 3, 8), (4096 + 32, 5, 1)]:
            cols = block_cols(t, cols)
            wq, wd = weights(t, rows, cols)
            x = activations(n_tokens, cols)
            lib.gh_simd_set(lib.GH_SIMD_SCALAR)
            ys = matmul(t, wq, rows, cols, x, 1)
            for level in levels[1:]:
                lib.gh_simd_set(level)
                y = matmul(t, wq, rows, cols, x, 2)
                err = nmse(y, ys, wd, x)
                assert err < SIMD_VS_SCALAR_BOUND, f"{name} level {level} {(cols, rows, n_tokens)}: {err}"
    finally:
        lib.gh_simd_set(prev)


@pytest.mark.parametrize("simd_level", simd_levels(), indirect=True)
@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_tile_edges(name, simd_level):
    """Shapes at the edges of the register tiles (4-row decode and quantized tiles, 3-row
    float prompt tiles, 4- or 6-token tiles; rows of 2, 5 or 9 blocks leave a half or a
    partial group of four): 1, 2 and 3 threads give the same bits, all within the bound."""
    t = TYPES[name]
    # K-quants: rows of 1, 2, 5 and 9 blocks
    col_list = [256, 512, 1280, 2304] if BLOCK[t] == 256 else [64, 160, 288, 2048 + 96]
    for cols, rows, n_tokens in itertools.product(col_list, [2, 5, 7, 13], [1, 2, 5, 7, 13]):
        wq, wd = weights(t, rows, cols)
        x = activations(n_tokens, cols)
        ref = x.astype(np.float64) @ wd.astype(np.float64).T
        y1 = matmul(t, wq, rows, cols, x, 1)
        for nth in (2, 3):
            assert np.array_equal(y1, matmul(t, wq, rows, cols, x, nth)), (cols, rows, n_tokens, nth)
        err = nmse(y1, ref, wd, x)
        assert err < NMSE_BOUND[t], f"{name} level {simd_level} {(cols, rows, n_tokens)}: nmse {err}"


# (type, level) pairs whose prompt tiles sum a row otherwise than their decode tiles: the
# AVX-512 Q4_0 and Q8_0 tiles (an accumulator per row and token against the decode tile's
# four rows transposed into one register); there a batch is within SIMD_VS_SCALAR_BOUND of
# its tokens
BATCH_NOT_BITWISE = {(Q4_0, 2), (Q8_0, 2)}


@pytest.mark.parametrize("simd_level", simd_levels(), indirect=True)
@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_batch_equals_tokens(name, simd_level):
    """A prompt (tiles of several tokens) gives every token the values its decode (one
    token) gives, bit for bit: a row sums alike in every tile it can land in."""
    t = TYPES[name]
    # 75 and 4096 + 107 columns (float types): a tail of 3 after 9 and 525 steps of 8, which
    # the AVX2 F16 tiles add to their even and odd set of four-step blocks respectively
    for cols, rows, n_tokens in [(4096 + 32, 13, 11), (96, 9, 17), (288, 5, 3), (75, 6, 5), (4096 + 107, 5, 7)]:
        cols = block_cols(t, cols)
        wq, wd = weights(t, rows, cols)
        x = activations(n_tokens, cols)
        batch = matmul(t, wq, rows, cols, x, 2)
        one = np.concatenate([matmul(t, wq, rows, cols, x[i:i + 1], 1) for i in range(n_tokens)])
        if (t, simd_level) in BATCH_NOT_BITWISE:
            assert nmse(batch, one, wd, x) < SIMD_VS_SCALAR_BOUND, (cols, rows, n_tokens)
        else:
            np.testing.assert_array_equal(batch, one, err_msg=f"{name} level {simd_level} {(cols, rows, n_tokens)}")


def test_matmul_extreme_values():
    """Large and tiny magnitudes stay finite and accurate (no int16 overflow in the
    quantized kernels: activations quantized to +-127, weights to full range)."""
    prev = lib.gh_simd_get()
    try:
        rng = np.random.default_rng(5)
        cols, rows = 256, 8
        x = np.full((2, cols), 1e4, dtype=np.float32)
        x[1] = -1e-4
        for name, t in TYPES.items():
            w = np.where(rng.random((rows, cols)) < 0.5, -1.0, 1.0).astype(np.float32) * 30
            wq = encode(t, w)[0] if t in LATTICE else quantize(t, w)
            wd = dequantize(t, wq, cols)
            ref = x.astype(np.float64) @ wd.astype(np.float64).T
            scale = np.abs(x.astype(np.float64)) @ np.abs(wd.astype(np.float64)).T
            for level in simd_levels():
                lib.gh_simd_set(level)
                y = matmul(t, wq, rows, cols, x, 1)
                assert np.isfinite(y).all(), (name, level)
                assert (np.abs(y - ref) <= 1e-2 * scale).all(), (name, level)
    finally:
        lib.gh_simd_set(prev)


def test_matmul_invalid_args():
    w = np.zeros(4096, dtype=np.uint8)
    x = np.zeros(256, dtype=np.float32)
    y = np.zeros(256, dtype=np.float32)
    bad = [
        (99, vptr(w), 2, 32, fptr(x), 1, fptr(y), 1),          # unknown type
        (Q4_0, vptr(w), 2, 48, fptr(x), 1, fptr(y), 1),        # cols not a block multiple
        (F32, vptr(w), 0, 32, fptr(x), 1, fptr(y), 1),         # no rows
        (F32, vptr(w), 2, 32, fptr(x), 0, fptr(y), 1),         # no tokens
        (F32, vptr(w), 2, -32, fptr(x), 1, fptr(y), 1),        # negative cols
        (F32, ffi.NULL, 2, 32, fptr(x), 1, fptr(y), 1),        # NULL weights
        (F32, vptr(w), 2, 32, ffi.NULL, 1, fptr(y), 1),        # NULL x
        (F32, vptr(w), 2, 32, fptr(x), 1, ffi.NULL, 1),        # NULL y
        (F32, vptr(w), 2, 32, fptr(x), 1, fptr(y), 0),         # no threads
        (F32, vptr(w), 1 << 62, 1 << 62, fptr(x), 1, fptr(y), 1),  # size overflow
    ]
    for args in bad:
        with pytest.raises(NativeError) as e:
            check(lib.gh_op_matmul(*args))
        assert e.value.status == lib.GH_ERR_INVALID_ARG and str(e.value)


def test_simd_env_override():
    """GH_SIMD caps the level chosen at start-up."""
    import os
    import subprocess
    import sys

    code = "from powerinfer_cpp._native import lib; print(lib.gh_simd_get(), lib.gh_simd_supported())"
    for want, level in (("scalar", lib.GH_SIMD_SCALAR), ("avx2", lib.GH_SIMD_AVX2), ("avx512", lib.GH_SIMD_AVX512)):
        env = dict(os.environ, GH_SIMD=want)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        got, sup = int(out[0]), int(out[1])
        assert got == min(level, sup), (want, out)


def test_process_exits_cleanly_after_threaded_matmul():
    """gh_op_matmul keeps a thread pool; it must be joined when the library is unloaded
    (cffi closes it at interpreter exit), not crash in unmapped code."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from powerinfer_cpp._native import ffi, lib, check\n"
        "w = np.ones((64, 256), np.float32); x = np.ones((1, 256), np.float32)\n"
        "y = np.empty((1, 64), np.float32)\n"
        "for _ in range(20):\n"
        "    check(lib.gh_op_matmul(lib.GH_TYPE_F32, ffi.cast('void *', w.ctypes.data), 64, 256,\n"
        "          ffi.cast('float *', x.ctypes.data), 1, ffi.cast('float *', y.ctypes.data), 2))\n"
        "assert (y == 256).all()\n"
    )
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("simd_level", simd_levels(), indirect=True)
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k"])
def test_nonfinite_activations_give_nan_not_ub(name, simd_level):
    """A block of activations holding inf or NaN (a row that overflowed float) makes its
    int8 codes out of range: the quantizers clamp them (the sanitizer run of this test would
    report the int overflow of their sums otherwise), the rows' results are not finite, the
    other tokens' results are unaffected."""
    t = TYPES[name]
    rows, cols = 8, block_cols(t, 512)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    wq = quantize(t, w)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    x[0, 5] = np.inf
    x[1, 40] = np.nan
    y = matmul(t, wq, rows, cols, x, 1)
    assert not np.isfinite(y[0]).any() and not np.isfinite(y[1]).any()
    ok = x.copy()
    ok[0, 5] = ok[1, 40] = 0.0
    np.testing.assert_array_equal(y[2], matmul(t, wq, rows, cols, ok, 1)[2])
