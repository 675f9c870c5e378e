"""The op table (ggml's test-backend-ops idea): every op the native library exposes for
testing is one row of OPS (how to run it on a backend, its numpy reference, its shapes,
its bound), and one test runs each row x every weight type the CPU kernel table has
(asked from the library, gh_kernel_source: a type added to the tables is tested here
without an edit) x every backend column the op has: each SIMD level this CPU runs (the
library's level switch, gh_simd_set), and every device kind of the backend registry
(device_kinds): the simulated device "host-device", and CUDA (skipped without a GPU;
GH_REQUIRE_CUDA=1 fails instead, tools/gpu_check.sh).

Inputs: Gaussian weights stored as the type by opref.encode (gguf.quants quantizes the
types it can, the runtime's reference quantizer the others, random valid blocks for the
read-only lattice types). The references are numpy in float64 on the *dequantized*
weights (gguf.quants' dequantization, independent of the runtime) and the f32 inputs, so
a bound measures the kernel alone: its activation format (bf16, 8-bit blocks, Q8_K), its
int8 forms' rounding (opref.axpy_int8_bound) and f32 accumulation. On the CPU every op
also gives the same bits at 1 and 2 threads (threads split rows or columns on tile
boundaries; each output is summed the same way).

The rows' bounds, with why:

* dequantize: bit for bit gguf.quants.dequantize of the same bytes.
* matmul (gh_op_matmul; devices: gh_device_op_matmul): the normalised squared error
  err = ||y - y_ref||^2 / max(||y_ref||^2, sum_{t,r} ||W_r||^2 ||x_t||^2 / cols) (the
  second term the expected ||y_ref||^2 of random data) below NMSE_BOUND: f32/f16 1e-10
  (float accumulation only), bf16 1e-4 (activations rounded to bf16, ~1e-6 expected), the
  8-bit-activation types 1e-3 (~3e-5 expected); devices 1e-9 (weights dequantized
  exactly, activations never quantized: ~1e-13).
* matmul_t (gh_op_matmul_t, the transposed down projection, one token and batches):
  per output |y - y_ref| <= 4e-7 rows (|h| . |W|) + 1e-6 + the int8 forms' rounding.
* sparse_down (gh_op_sparse_down over id lists: empty, one, all, sorted, unsorted with
  repeats, a run): the same with the list's length.
* sparse_glu (gh_op_sparse_glu, act(gate . x, up . x) over id lists, ReLU / dReLU /
  SiLU): |a - a_ref| <= 1.2 e (|g|s |u| + |u|s |g| + e |g|s |u|s) + 1e-7 with e the
  type's dot error relative to |W| . |x| (GLU_EPS) and |g|s = |W_gate| . |x|.
* sparse_glu_union (gh_op_sparse_glu_union, n tokens' masks over the union of rows,
  gated and not, ReLU / SiLU / FATReLU): unlisted neurons exactly 0, listed ones within
  sparse_glu's bound and equal to gh_op_sparse_glu over the token's own list, bit for bit
  where the type's gathered four-row dot runs.
* sparse_cols (gh_op_sparse_cols, input-sparse columns: all, none, one, half and
  per-channel thresholds): matmul_t's bound over the inputs used, their count exact,
  and with no threshold gh_op_matmul_t of the token bit for bit.
* predict (gh_op_sparse_predict; devices: gh_device_op_predict): score = fc2 .
  relu(fc1 . x) within PREDICT_TOL of max |score| on the CPU (its activation formats),
  err < 1e-9 on the devices; on the CPU the active list is exactly the scores at or above
  the threshold, ascending, and agrees with numpy wherever the side is certain.
* attention (gh_op_attention_kv: causal, grouped heads, over a cache stored in each type
  it reads, asked from the library): within 1e-5 of numpy on the dequantized cache, and
  over a quantized cache the bits of the same kernels over its f32 values; f32 err
  below 1e-12 and the bits of gh_op_attention.

Ops outside the table: the device-only hot FFN (tests/gpu/test_cuda_ops.py), the float
ops that take no weight type (tests/ops/test_ops_basic.py: norms, RoPE, GLU, attention's
causality, long contexts, windows, soft-capping and sinks), the one-token FFN with input
sparsity of two types (tests/sparse/test_ffn_input_sparsity.py), and each op's argument errors
(in the files of their features)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
from gguf import quants

from powerinfer_cpp._native import check, ffi, lib
from powerinfer_cpp.model import device_available, device_kinds

from cbuf import fptr, iptr
from conftest import at_simd, cuda_device_or_skip, last_error, simd_id, simd_levels
from opref import (BLOCK, GGUF_QT, act_ref, attn_inputs, axpy_int8_bound, block_cols, encode, has_form,
                   id_lists, matmul_t_int8_bound, nrmse, ref_attention, vptr)


def kernel_types() -> list[int]:
    """Every weight type the CPU kernel table has a row for (the library's answer)."""
    return [t for t in range(256) if lib.gh_kernel_source(t, 0, lib.GH_SIMD_SCALAR, ffi.NULL, ffi.NULL) != -2]


def type_name(t: int) -> str:
    return ffi.string(lib.gh_type_name(t)).decode()


def kv_types() -> list[int]:
    """The types a KV cache may be stored in: those gh_op_attention_kv reads (it refuses
    the others by name), asked on a one-key cache of one block per row."""
    out = []
    for t in kernel_types():
        d = BLOCK[t]
        q = np.zeros(d, np.float32)
        kv = np.zeros(lib.gh_type_row_size(t, d), np.uint8)
        y = np.zeros(d, np.float32)
        if lib.gh_op_attention_kv(t, fptr(q), vptr(kv), vptr(kv), fptr(y), 1, 0, 1, 1, d, 1) == lib.GH_OK:
            out.append(t)
    return out


TYPES = kernel_types()
KV_TYPES = kv_types()
FLOATS = (lib.GH_TYPE_F32, lib.GH_TYPE_F16, lib.GH_TYPE_BF16)
RELU, DRELU, SILU, FATRELU = lib.GH_ACT_RELU, lib.GH_ACT_DRELU, lib.GH_ACT_SILU, lib.GH_ACT_FATRELU

# the dot's error relative to the exact product, by the activation format of the type's
# kernels: none (f32, f16), bf16, 8-bit blocks of 32 (the 32-value block types), Q8_K (one
# scale per 256: the K-quants, IQ4_XS, the lattice types); a new type gets its block's
NMSE_BOUND = {lib.GH_TYPE_F32: 1e-10, lib.GH_TYPE_F16: 1e-10, lib.GH_TYPE_BF16: 1e-4}
DEVICE_NMSE_BOUND = 1e-9
GLU_EPS = {lib.GH_TYPE_F32: 1e-6, lib.GH_TYPE_F16: 1e-6, lib.GH_TYPE_BF16: 5e-3}
PREDICT_TOL = {lib.GH_TYPE_F32: 1e-5, lib.GH_TYPE_F16: 1e-4, lib.GH_TYPE_BF16: 2e-2}


def nmse_bound(t: int) -> float:
    return NMSE_BOUND.get(t, 1e-3)


def glu_eps(t: int) -> float:
    return GLU_EPS.get(t, 2e-2 if BLOCK[t] == 32 else 3e-2)


def predict_tol(t: int) -> float:
    return PREDICT_TOL.get(t, 3e-2 if BLOCK[t] == 32 else 4e-2)


# ---- backends ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """A column: the CPU at one SIMD level, or a device ("host-device", "cuda")."""
    name: str
    level: int | None = None  # the CPU's SIMD level; None: a device

    @property
    def cpu(self) -> bool:
        return self.level is not None

    def device(self) -> bytes:
        """The device's name for gh_device_op_*; the CUDA column skips without a GPU (and
        fails under GH_REQUIRE_CUDA=1), any other kind's column where it cannot run here."""
        if self.name == "cuda":
            return cuda_device_or_skip().encode()
        ok, why = device_available(self.name)
        if not ok:
            pytest.skip(f"device '{self.name}' unavailable: {why}")
        return self.name.encode()


CPU = tuple(Backend(simd_id(lv), lv) for lv in simd_levels())
#: a column per kind of the backend registry (backend/registry.c): a new backend is tested
#: here without an edit
DEVICES = tuple(Backend(k.name) for k in device_kinds())


def cpu_run(fn: Callable, threads=(1, 2)):
    """fn(n_threads) at each thread count: the results must be the same bits."""
    outs = [fn(nt) for nt in threads]
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o, err_msg=f"threads {threads}")
    return outs[0]


def weights(t: int, rows: int, cols: int, rng, scale=1.0):
    raw, wd = encode(t, rng.standard_normal((rows, cols)) * scale)
    return np.ascontiguousarray(raw), wd.astype(np.float64)


# ---- the rows ----------------------------------------------------------------------------

def op_dequantize(t: int, be: Backend, rng):
    for rows, cols in [(1, 32), (3, 96), (9, 4096 + 32)]:
        cols = block_cols(t, cols)
        raw, _ = weights(t, rows, cols, rng, scale=10.0)
        raw = raw.reshape(rows, -1)
        got = np.full((rows, cols), np.nan, np.float32)
        for r in range(rows):
            check(lib.gh_dequantize_row(t, vptr(raw[r]), fptr(got[r]), cols))
        with np.errstate(over="ignore"):
            ref = quants.dequantize(raw, GGUF_QT[t]).astype(np.float32).reshape(rows, cols)
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=f"{rows}x{cols}")


def matmul_shapes(t: int, be: Backend):
    b = max(BLOCK[t], 32)  # rows of 1, 3 and 4096 / b + 1 blocks (the float types: of 32 values)
    cols = [b, 3 * b, 4096 + b]
    if t in FLOATS:  # any width: vector tails, masked loads; the devices' vector path (40:
        cols += [1, 7, 33, 37, 40, 100, 1000 + 17]  # 8-element units) and element path
    if be.cpu:
        return list(itertools.product(cols, [1, 3, 17, 257], [1, 3, 8, 33]))
    return list(itertools.product(cols, [1, 33, 97], [1, 5, 17]))  # one token, a partial tile, 3 tiles


def op_matmul(t: int, be: Backend, rng):
    worst = 0.0
    for cols, rows, n in matmul_shapes(t, be):
        raw, wd = weights(t, rows, cols, rng)
        x = rng.standard_normal((n, cols)).astype(np.float32)

        def run(nt, dev=None):
            y = np.full((n, rows), np.nan, np.float32)
            if dev is None:
                check(lib.gh_op_matmul(t, vptr(raw), rows, cols, fptr(x), n, fptr(y), nt))
            else:
                assert lib.gh_device_op_matmul(dev, t, vptr(raw), rows, cols, fptr(x), n, fptr(y)) == lib.GH_OK, \
                    last_error()
            return y

        y = cpu_run(run) if be.cpu else run(1, be.device())
        assert np.isfinite(y).all(), (cols, rows, n)
        ref = x.astype(np.float64) @ wd.T
        expected = np.sum(wd ** 2) * np.sum(x.astype(np.float64) ** 2) / cols
        err = float(np.sum((y - ref) ** 2) / max(np.sum(ref ** 2), expected, 1e-300))
        worst = max(worst, err)
        assert err < (nmse_bound(t) if be.cpu else DEVICE_NMSE_BOUND), (cols, rows, n, err)
    print(f"matmul {type_name(t)} {be.name}: worst nmse {worst:.2e}")


def op_matmul_t(t: int, be: Backend, rng):
    for (rows, cols), n, zeros in itertools.product([(1, 32), (7, 96), (130, 544), (67, 4096 + 32)],
                                                    [1, 3, 9, 70], [0.0, 0.9, 1.0]):
        cols = block_cols(t, cols)
        raw, wd = weights(t, rows, cols, rng)
        h = rng.standard_normal((n, rows)).astype(np.float32)
        h[rng.random(h.shape) < zeros] = 0.0
        if zeros == 0.9 and n > 1:
            h[:, ::3] = 0.0  # rows that no token needs, next to rows only some need

        def run(nt, h=h):
            y = np.full((h.shape[0], cols), np.nan, np.float32)
            check(lib.gh_op_matmul_t(t, vptr(raw), rows, cols, fptr(h), h.shape[0], fptr(y), nt))
            return y

        y = cpu_run(run)
        if n > 1 and t in FLOATS:
            # a batch (dense blocks in register tiles) sums as its tokens one by one (float
            # rows dequantize exactly; quantized ones are scaled in another order there)
            one = np.concatenate([run(1, h[i:i + 1].copy()) for i in range(n)])
            np.testing.assert_array_equal(y, one)
        ref = h.astype(np.float64) @ wd
        scale = np.abs(h.astype(np.float64)) @ np.abs(wd)
        # the int8 forms round too: one token's groups of 16 nonzero rows, a batch's groups of
        # 16 rows some token needs
        int8 = (axpy_int8_bound(t, be.level, raw, wd, np.arange(rows), h[0]) if n == 1
                else matmul_t_int8_bound(t, be.level, raw, wd, h))
        assert np.all(np.abs(y - ref) <= 4e-7 * rows * scale + 1e-6 + int8), \
            ((rows, cols, n, zeros), np.max(np.abs(y - ref)))
        if zeros == 1.0:
            assert np.all(y == 0)


def op_sparse_down(t: int, be: Backend, rng):
    for rows, cols in [(1, 32), (67, 96), (130, 544), (37, 4096 + 32)]:
        cols = block_cols(t, cols)
        raw, wd = weights(t, rows, cols, rng)
        for name, ids in id_lists(rows, rng).items():
            a = rng.standard_normal(ids.size).astype(np.float32)
            if ids.size > 3:
                a[::3] = 0.0  # zero activations are skipped

            def run(nt):
                y = np.full(cols, np.nan, np.float32)
                check(lib.gh_op_sparse_down(t, vptr(raw), rows, cols, iptr(ids), fptr(a), ids.size, fptr(y), nt))
                return y

            # threads split the columns and each sums the whole list in order: equal
            y = cpu_run(run, threads=(1, 2, 3))
            ref = a.astype(np.float64) @ wd[ids]
            scale = np.abs(a) @ np.abs(wd[ids]) if ids.size else np.zeros(cols)
            int8 = axpy_int8_bound(t, be.level, raw, wd, ids, a)  # the int8 forms' rounding
            assert np.all(np.abs(y - ref) <= 4e-7 * max(ids.size, 1) * scale + 1e-6 + int8), \
                ((rows, cols), name, np.max(np.abs(y - ref)))
            if int8.any():  # the bound is the worst case; typically the error is far below it
                assert nrmse(y, ref) < 2e-2, ((rows, cols), name, nrmse(y, ref))
            if ids.size == 0:
                assert np.all(y == 0)


def sparse_glu(t, graw, uraw, rows, cols, act, x, ids, nt, act_t=0.0):
    a = np.full(max(ids.size, 1), np.nan, dtype=np.float32)
    check(lib.gh_op_sparse_glu(t, vptr(graw), vptr(uraw) if uraw is not None else ffi.NULL, rows, cols,
                               act, act_t, fptr(x), iptr(ids), ids.size, fptr(a), nt))
    return a[: ids.size]


def glu_bound(e, gs, us, g, u):
    """sparse_glu's bound (the module's docstring) for gated neurons."""
    return 1.2 * e * (gs * np.abs(u) + us * np.abs(g) + e * gs * us) + 1e-7


def op_sparse_glu(t: int, be: Backend, rng):
    e = glu_eps(t)
    for (rows, cols), act in itertools.product([(1, 32), (67, 96), (301, 256), (45, 2048 + 64)],
                                               [RELU, DRELU, SILU]):
        cols = block_cols(t, cols)
        graw, gd = weights(t, rows, cols, rng, scale=1 / np.sqrt(cols))
        uraw, ud = weights(t, rows, cols, rng, scale=1 / np.sqrt(cols))
        x = rng.standard_normal(cols).astype(np.float32)
        g_all, u_all = gd @ x, ud @ x
        gs, us = np.abs(gd) @ np.abs(x), np.abs(ud) @ np.abs(x)  # error scales of the dots
        for name, ids in id_lists(rows, rng).items():
            a = cpu_run(lambda nt: sparse_glu(t, graw, uraw, rows, cols, act, x, ids, nt))
            if ids.size == 0:
                continue
            # the list order does not matter: each entry is its own neuron's value
            ref = act_ref(act, g_all[ids], u_all[ids])
            bound = glu_bound(e, gs[ids], us[ids], g_all[ids], u_all[ids])
            assert np.all(np.abs(a - ref) <= bound), ((rows, cols), act, name, np.max(np.abs(a - ref) / bound))
            if act in (RELU, DRELU):  # exactly 0 where the gate is negative beyond the dot's error
                assert np.all(a[g_all[ids] + 1.2 * e * gs[ids] < 0] == 0.0)


def op_sparse_glu_union(t: int, be: Backend, rng):
    rows, cols, n, thr = 301, block_cols(t, 256), 5, 0.05
    e = glu_eps(t)
    graw, gd = weights(t, rows, cols, rng, scale=1 / np.sqrt(cols))
    uraw, ud = weights(t, rows, cols, rng, scale=1 / np.sqrt(cols))
    x = rng.standard_normal((n, cols)).astype(np.float32)
    mask = np.zeros((n, rows), dtype=np.uint8)  # one empty, one full, the others sparse, overlapping
    mask[1] = 1
    mask[2] = rng.random(rows) < 0.1
    mask[3] = rng.random(rows) < 0.3
    mask[4, 40:90] = 1
    g_all, u_all = x.astype(np.float64) @ gd.T, x.astype(np.float64) @ ud.T
    gs, us = np.abs(x) @ np.abs(gd).T, np.abs(x) @ np.abs(ud).T
    exact = has_form(t, "dot4", be.level)  # the gathered four-row dot: each token's own list's bits
    for act, gated in itertools.product([RELU, SILU, FATRELU], [True, False]):
        act_t = thr if act == FATRELU else 0.0
        u = uraw if gated else None

        def run(nt):
            a = np.full((n, rows), np.nan, dtype=np.float32)
            check(lib.gh_op_sparse_glu_union(t, vptr(graw), vptr(u) if gated else ffi.NULL, rows, cols, act,
                                             act_t, fptr(x), n, ffi.from_buffer("uint8_t[]", mask), fptr(a), nt))
            return a

        a = cpu_run(run)  # not the thread count's
        for k in range(n):
            ids = np.flatnonzero(mask[k]).astype(np.int32)
            assert np.all(a[k][mask[k] == 0] == 0.0), (act, gated, k)
            if ids.size == 0:
                continue
            if exact:
                own = sparse_glu(t, graw, u, rows, cols, act, x[k], ids, 2, act_t)
                np.testing.assert_array_equal(a[k][ids], own, err_msg=f"act {act} gated {gated} token {k}")
            g = g_all[k, ids]
            hg = g / (1 + np.exp(-g)) if act == SILU else np.where(g > act_t, g, 0.0)
            if gated:
                ref, bound = hg * u_all[k, ids], glu_bound(e, gs[k, ids], us[k, ids], g, u_all[k, ids])
            else:
                ref, bound = hg, 1.2 * e * gs[k, ids] + 1e-7
            assert np.all(np.abs(a[k][ids] - ref) <= bound), (act, gated, k)


def op_sparse_cols(t: int, be: Backend, rng):
    for rows, cols in [(1, 32), (37, 96), (129, 544)]:
        cols = block_cols(t, cols)
        raw, wd = weights(t, rows, cols, rng)
        x = rng.standard_normal(rows).astype(np.float32)
        x[::5] = 0.0
        one = np.full(rows, 1e30, np.float32)
        one[rows // 2] = 0.0
        x[rows // 2] = 1.5
        cases = {"all": None, "empty": np.full(rows, 1e30, np.float32), "one": one,
                 "half": np.full(rows, float(np.median(np.abs(x))), np.float32),
                 "per-channel": (rng.random(rows) * 1.5).astype(np.float32)}
        for name, thr in cases.items():
            used = np.abs(x) > (thr if thr is not None else 0.0)

            def run(nt):
                y = np.full(cols, np.nan, dtype=np.float32)
                n_used = ffi.new("int64_t *")
                check(lib.gh_op_sparse_cols(t, vptr(raw), rows, cols, fptr(x),
                                            fptr(thr) if thr is not None else ffi.NULL, fptr(y), n_used, nt))
                assert n_used[0] == int(used.sum()), name
                return y

            y = cpu_run(run)  # threads split the columns
            if thr is None:  # every nonzero input: the transposed matmul of the token, bit for bit
                ym = np.empty(cols, np.float32)
                check(lib.gh_op_matmul_t(t, vptr(raw), rows, cols, fptr(x), 1, fptr(ym), 1))
                np.testing.assert_array_equal(y, ym)
            ref = x[used].astype(np.float64) @ wd[used]
            scale = np.abs(x[used]) @ np.abs(wd[used]) if used.any() else np.zeros(cols)
            int8 = axpy_int8_bound(t, be.level, raw, wd, np.flatnonzero(used), x[used])
            assert np.all(np.abs(y - ref) <= 4e-7 * max(int(used.sum()), 1) * scale + 1e-6 + int8), \
                ((rows, cols), name)
            if not used.any():
                assert np.all(y == 0)


def op_predict(t: int, be: Backend, rng):
    for d, h, ff in [(64, 32, 100), (256, 96, 1024), (96, 64, 33)]:
        d, h = block_cols(t, d), block_cols(t, h)  # fc2's rows are h long: whole blocks
        raw1, w1 = weights(t, h, d, rng, scale=1 / np.sqrt(d))
        raw2, w2 = weights(t, ff, h, rng, scale=1 / np.sqrt(h))
        x = rng.standard_normal(d).astype(np.float32)
        hid = np.maximum(w1 @ x, 0)
        ref = w2 @ hid
        if not be.cpu:
            score = np.full(ff, np.nan, dtype=np.float32)
            assert lib.gh_device_op_predict(be.device(), t, vptr(raw1), t, vptr(raw2), d, h, ff, fptr(x),
                                            fptr(score)) == lib.GH_OK, last_error()
            expected = np.sum(w2 ** 2) * np.sum(hid ** 2) / h
            err = float(np.sum((score - ref) ** 2) / max(np.sum(ref ** 2), expected, 1e-300))
            assert err < DEVICE_NMSE_BOUND, (d, h, ff, err)
            continue
        tol = predict_tol(t) * np.abs(ref).max()
        for thr in (0.0, 0.3, -1e9, 1e9):
            def run(nt):
                active = np.full(ff, -1, dtype=np.int32)
                score = np.zeros(ff, dtype=np.float32)
                n = ffi.new("int64_t *")
                check(lib.gh_op_sparse_predict(t, vptr(raw1), t, vptr(raw2), d, h, ff, fptr(x), thr,
                                               iptr(active), n, fptr(score), nt))
                return np.concatenate([score.view(np.int32), active[: n[0]]])

            out = cpu_run(run)
            score, got = out[:ff].view(np.float32), out[ff:]
            # the list is exactly the scores at or above the threshold, ascending
            np.testing.assert_array_equal(got, np.flatnonzero(score >= thr))
            assert np.max(np.abs(score - ref)) <= tol, (d, h, ff)
            sure = np.abs(ref - thr) > tol  # neurons whose side of the threshold is certain
            np.testing.assert_array_equal(np.isin(np.arange(ff), got)[sure], (ref >= thr)[sure])
            if thr == -1e9:
                assert got.size == ff
            if thr == 1e9:
                assert got.size == 0


def op_attention(t: int, be: Backend, rng):
    heads = [(4, 4), (8, 2), (8, 1)]
    dims = [d for d in (2, 8, 32, 64, 128) if d % BLOCK[t] == 0]
    for (n_head, n_head_kv), d, (n, n_past) in itertools.product(heads, dims, [(1, 0), (1, 37), (5, 0), (13, 20),
                                                                               (1, 100), (5, 70)]):
        q, k, v = attn_inputs(n, n_past, n_head, n_head_kv, d, seed=int(rng.integers(1 << 30)))
        kq, kd = encode(t, k.reshape(n_past + n, -1))
        vq, vd = encode(t, v.reshape(n_past + n, -1))
        kd, vd = kd.reshape(k.shape), vd.reshape(v.shape)

        def run(nt, t=t, kq=kq, vq=vq):
            out = np.full(q.shape, np.nan, dtype=np.float32)
            check(lib.gh_op_attention_kv(t, fptr(q), vptr(np.ascontiguousarray(kq)), vptr(np.ascontiguousarray(vq)),
                                         fptr(out), n, n_past, n_head, n_head_kv, d, nt))
            return out

        # each (token, head) is computed the same way whichever thread takes it
        out = cpu_run(run, threads=(1, 2, 3))
        ref = ref_attention(q, kd, vd, n_past)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5, err_msg=f"{(n_head, n_head_kv, d, n, n_past)}")
        if t == lib.GH_TYPE_F32:
            assert float(np.sum((out - ref) ** 2) / np.sum(ref ** 2)) < 1e-12
            plain = np.full(q.shape, np.nan, dtype=np.float32)  # gh_op_attention: the f32 cache's
            check(lib.gh_op_attention(fptr(q), fptr(k), fptr(v), fptr(plain), n, n_past, n_head, n_head_kv, d, 2))
            np.testing.assert_array_equal(out, plain)
        else:  # the tiles hold exactly the dequantized rows, the kernels run as over an f32 cache
            np.testing.assert_array_equal(out, run(1, lib.GH_TYPE_F32, kd, vd))


@dataclass(frozen=True)
class Op:
    """A row: run(t, backend, rng) runs the op over its shapes and checks each result
    against its numpy reference and bound (the module's docstring); types: the weight
    types it reads (the kernel table's, or the KV cache's); backends: its columns."""
    name: str
    run: Callable
    backends: tuple
    types: tuple = tuple(TYPES)


OPS = [
    Op("dequantize", op_dequantize, CPU),
    Op("matmul", op_matmul, CPU + DEVICES),
    Op("matmul_t", op_matmul_t, CPU),
    Op("sparse_down", op_sparse_down, CPU),
    Op("sparse_glu", op_sparse_glu, CPU),
    Op("sparse_glu_union", op_sparse_glu_union, CPU),
    Op("sparse_cols", op_sparse_cols, CPU),
    Op("predict", op_predict, CPU + DEVICES),
    Op("attention", op_attention, CPU, tuple(KV_TYPES)),
]
TABLE = [pytest.param(op, t, be, id=f"{op.name}-{type_name(t)}-{be.name}")
         for op in OPS for t in op.types for be in op.backends]


@pytest.mark.parametrize("op, t, be", TABLE)
def test_op(op, t, be):
    rng = np.random.default_rng([t, OPS.index(op)])
    if be.cpu:
        with at_simd(be.level):
            op.run(t, be, rng)
    else:
        op.run(t, be, rng)


def test_table_reads_the_library():
    """The table's types are the kernel table's, each a type the library reads and gguf
    can dequantize (so every row's reference exists), and its columns are every SIMD
    level the library reports for this CPU."""
    assert lib.GH_TYPE_F32 in TYPES and lib.GH_TYPE_Q4_0 in TYPES and lib.GH_TYPE_I32 not in TYPES
    for t in TYPES:
        assert lib.gh_type_block_size(t) == BLOCK[t] and t in GGUF_QT, type_name(t)
    assert [be.level for be in CPU] == list(range(lib.gh_simd_supported() + 1))
    # a context's KV cache types (gh_context_params.cache_type) are among those attention reads
    assert {lib.GH_TYPE_F32, lib.GH_TYPE_F16, lib.GH_TYPE_Q8_0} <= set(KV_TYPES) < set(TYPES)
