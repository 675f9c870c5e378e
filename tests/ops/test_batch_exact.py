"""A batch of tokens equals its tokens one by one, bit for bit, in both matmul ops, every
type and every SIMD level: what speculative verification and batched decode rely on to
reproduce plain decode's logits (and so its greedy text; the model-level checks are in
test_speculative.py).

* gh_op_matmul (the projections): any batch size; the multi-token tiles run each token
  through the one-token tile's sums.
* gh_op_matmul_t (the transposed down of every --sparsity / gate file): batches of up to
  EXACT_MAX tokens run each token's decode sums (cpu/axpy.c, AXPY_EXACT_MAX); larger ones
  are only within rounding (checked against numpy in test_sparse_ffn.py and here).
Both with dense activations (a SwiGLU FFN: every row used by every token) and ReLU-like
ones (half of them zero, each token its own rows), and rows that are and are not whole
groups of 16 (the int8 forms' groups). Every batch is also checked against numpy on the
dequantized weights, so the equal results are right ones. Q4_0's and Q4_1's one-token int8
forms also give the same bits at AVX2 and AVX-512, as their batch forms do (Q8_0's one-token
form is AVX2's at both levels, its batch form VNNI at AVX-512: the batch tests above hold
that to the one-token sums)."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp._native import check, lib
from cbuf import fptr, iptr  # noqa: E402
from opref import BLOCK, TYPES, encode, vptr  # noqa: E402

#: cpu/axpy.c's AXPY_EXACT_MAX: the largest batch of the transposed matmul that sums as decode
EXACT_MAX = 16
#: |batch - numpy| / max |numpy| (int8 activations of the quantized types: ~1e-3 measured)
REF_BOUND = 2e-2


def simd_levels() -> list[int]:
    return list(range(int(lib.gh_simd_supported()) + 1))


@pytest.fixture
def simd_level(request):
    prev = lib.gh_simd_set(request.param)
    assert prev != -2
    yield request.param
    lib.gh_simd_set(prev)


_weights: dict = {}


def weights(t: int, rows: int, cols: int):
    key = (t, rows, cols)
    if key not in _weights:
        w = np.random.default_rng(rows * 31 + cols).standard_normal((rows, cols)).astype(np.float32)
        raw, wd = encode(t, w)
        _weights[key] = (np.ascontiguousarray(raw), wd)
    return _weights[key]


def run(op, t: int, raw: np.ndarray, rows: int, cols: int, x: np.ndarray, n_out: int) -> np.ndarray:
    y = np.full((x.shape[0], n_out), np.nan, np.float32)
    check(op(t, vptr(raw), rows, cols, fptr(x), x.shape[0], fptr(y), 1))
    return y


def one_by_one(op, t, raw, rows, cols, x, n_out) -> np.ndarray:
    return np.concatenate([run(op, t, raw, rows, cols, np.ascontiguousarray(x[i:i + 1]), n_out)
                           for i in range(x.shape[0])])


def check_ref(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert err < REF_BOUND, f"{what}: {err:.2e} from numpy"


@pytest.mark.parametrize("simd_level", simd_levels(), indirect=True)
@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_batch_is_its_tokens(name, simd_level):
    t = TYPES[name]
    rows, cols = 70, 512  # 4-row tiles and a partial one; whole blocks of every type
    raw, wd = weights(t, rows, cols)
    rng = np.random.default_rng(7)
    for n in (2, 3, 5, 8, 9, 16, 17, 33):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        got = run(lib.gh_op_matmul, t, raw, rows, cols, x, rows)
        what = f"{name} level {simd_level} n={n}"
        assert np.array_equal(got, one_by_one(lib.gh_op_matmul, t, raw, rows, cols, x, rows)), what
        check_ref(got, x.astype(np.float64) @ wd.astype(np.float64).T, what)


@pytest.mark.parametrize("simd_level", simd_levels(), indirect=True)
@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_t_batch_is_its_tokens(name, simd_level):
    t = TYPES[name]
    cols = 512 if BLOCK[t] == 256 else 288  # (288: a segment of 256 columns and a rest)
    rng = np.random.default_rng(11)
    for rows in (64, 200):  # whole groups of 16 rows, and a partial one
        raw, wd = weights(t, rows, cols)
        for sparse in (False, True):
            for n in (2, 3, 5, 9, EXACT_MAX, EXACT_MAX + 1):
                h = rng.standard_normal((n, rows)).astype(np.float32)
                if sparse:
                    h[rng.random(h.shape) < 0.5] = 0.0
                got = run(lib.gh_op_matmul_t, t, raw, rows, cols, h, cols)
                what = f"{name} level {simd_level} rows={rows} sparse={sparse} n={n}"
                check_ref(got, h.astype(np.float64) @ wd.astype(np.float64), what)
                if n <= EXACT_MAX:
                    ref = one_by_one(lib.gh_op_matmul_t, t, raw, rows, cols, h, cols)
                    assert np.array_equal(got, ref), what


@pytest.mark.skipif(int(lib.gh_simd_supported()) < 2, reason="needs AVX-512")
@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_int8_one_token_levels_agree(name):
    """Q4_0's and Q4_1's one-token int8 form (groups of 16 rows) has an AVX-512 (VNNI) and
    an AVX2 version whose integer sums are the same, scaled and added alike: one token gives
    the same bits at both levels, through the whole down_t and an id list, on rows with whole
    groups of 8 blocks, a tail of them and a chunk's tail (the AVX-512 form takes 8 blocks'
    scales at once), 1 and 2 threads (2: each thread its columns)."""
    t = TYPES[name]
    rng = np.random.default_rng(5)
    prev = lib.gh_simd_set(2)
    try:
        for rows, cols in ((16, 256), (37, 96), (130, 544), (48, 4096 + 32 * 3)):
            raw, wd = weights(t, rows, cols)
            for dens in (1.0, 0.5):
                h = rng.standard_normal((1, rows)).astype(np.float32)
                h[rng.random(h.shape) >= dens] = 0.0
                ids = np.flatnonzero(h[0]).astype(np.int32)
                a = np.ascontiguousarray(h[0, ids])
                got = {}
                for level in (1, 2):
                    assert lib.gh_simd_set(level) != -2
                    for nt in (1, 2):
                        y = np.full((1, cols), np.nan, np.float32)
                        check(lib.gh_op_matmul_t(t, vptr(raw), rows, cols, fptr(h), 1, fptr(y), nt))
                        yl = np.full(cols, np.nan, np.float32)
                        check(lib.gh_op_sparse_down(t, vptr(raw), rows, cols, iptr(ids), fptr(a), ids.size,
                                                    fptr(yl), nt))
                        got[(level, nt)] = (y[0], yl)
                what = f"{name} rows={rows} cols={cols} density={dens}"
                check_ref(got[(2, 1)][0][None], h.astype(np.float64) @ wd.astype(np.float64), what)
                for key, (y, yl) in got.items():
                    assert np.array_equal(y, got[(1, 1)][0]), (what, key, "whole down_t")
                    assert np.array_equal(yl, got[(1, 1)][0]), (what, key, "id list")
    finally:
        lib.gh_simd_set(prev)


@pytest.mark.parametrize("simd_level", simd_levels(), indirect=True)
def test_q8_0_int8_forms_full_quant_range(simd_level):
    """Q8_0's int8 forms on blocks whose quants span all of int8, -128 included (a file may
    hold them though gguf's quantizer stops at -127): the AVX2 form takes |q| as the
    unsigned operand and the sign onto the int8 activations, the VNNI one q + 128, and
    both must give -128 x (a negative activation) right. Whole down_t, id list and a
    batch of 16 dense tokens (the batch form) against numpy on gguf.quants' dequantized
    rows, the batch equal to its tokens."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(11)
    rows, cols = 48, 32 * 40
    nb = cols // 32
    blk = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
    b = np.zeros((rows, nb), blk)
    b["d"] = rng.uniform(0.5, 2.0, (rows, nb)).astype(np.float16) * np.float16(1 / 64)
    q = rng.integers(-128, 128, (rows, nb, 32))
    q[:, ::3, :4] = -128  # runs of the extreme the sign trick must take as +128 under |.|
    q[:, 1::3, 4:8] = 127
    b["qs"] = q.astype(np.int8)
    raw = np.ascontiguousarray(b.view(np.uint8).reshape(rows, -1))
    wd = quants.dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float64)
    assert wd.shape == (rows, cols) and (wd[:, :4] < 0).all()
    t = TYPES["q8_0"]
    h = rng.standard_normal((16, rows)).astype(np.float32)
    h[:, ::2] = -np.abs(h[:, ::2])  # negative activations on the -128 quants
    got = run(lib.gh_op_matmul_t, t, raw, rows, cols, h, cols)
    check_ref(got, h.astype(np.float64) @ wd, f"q8_0 level {simd_level} batch")
    assert np.array_equal(got, one_by_one(lib.gh_op_matmul_t, t, raw, rows, cols, h, cols))
    ids = np.arange(rows, dtype=np.int32)
    a = np.ascontiguousarray(h[0])
    yl = np.full(cols, np.nan, np.float32)
    check(lib.gh_op_sparse_down(t, vptr(raw), rows, cols, iptr(ids), fptr(a), rows, fptr(yl), 1))
    assert np.array_equal(yl, got[0])
