#!/usr/bin/env python3
"""What input sparsity costs and saves in the kernels (not a test), one thread, CPU time:

  * decode: the dense matvec of the 1.1B LLaMA shape's q/k/v (2560 x 2048) against the
    input-sparse path (gh_op_sparse_cols over the transposed copy) at input densities
    100/75/50/25%; several copies (> L3) are cycled so both read DRAM;
  * prompt: 128 tokens through a 2048 x 2048 matrix, row-major matmul against the
    transposed matmul (what prompts would cost if only the transposed copies were stored).

    PYTHONPATH=python python tools/bench_input_sparsity.py [--types f16,q8_0,q4_0,q4_k]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from powerinfer_cpp._native import check, ffi, lib  # noqa: E402

TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_k": 12, "q5_k": 13, "q6_k": 14}


def quantize(t: int, w: np.ndarray) -> np.ndarray:
    """w [rows, cols] as rows of type t."""
    out = np.empty((w.shape[0], lib.gh_type_row_size(t, w.shape[1])), np.uint8)
    for r in range(w.shape[0]):
        check(lib.gh_quantize_row(t, ffi.cast("float *", w[r].ctypes.data), ffi.cast("void *", out[r].ctypes.data),
                                  w.shape[1]))
    return out


def best_cpu(f, n: int, reps: int = 4) -> float:
    """Smallest CPU seconds per call of f(i) over i < n, of reps sweeps."""
    best = 1e30
    for _ in range(reps):
        t0 = time.process_time()
        for i in range(n):
            f(i)
        best = min(best, (time.process_time() - t0) / n)
    return best


def p(a):
    return ffi.cast("void *", a.ctypes.data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="f16,q8_0,q4_0,q4_k")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    d_in, d_out = 2048, 2560
    w = rng.standard_normal((d_out, d_in)).astype(np.float32)
    x = rng.standard_normal(d_in).astype(np.float32)
    wp = rng.standard_normal((2048, 2048)).astype(np.float32)
    xp = rng.standard_normal((128, 2048)).astype(np.float32)
    print("| type | dense matvec | sparse at 100% | 75% | 50% | 25% | prompt matmul (128 tok) | transposed | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.types.split(","):
        t = TYPES[name]
        one, one_t = quantize(t, w), quantize(t, np.ascontiguousarray(w.T))
        n = max(2, int(64e6 // one.nbytes) + 1)
        ws, wts = [one.copy() for _ in range(n)], [one_t.copy() for _ in range(n)]
        y = np.empty(d_out, np.float32)
        tm = best_cpu(lambda i: check(lib.gh_op_matmul(t, p(ws[i]), d_out, d_in, ffi.cast("float *", x.ctypes.data), 1,
                                                       ffi.cast("float *", y.ctypes.data), 1)), n)
        cells = [f"{tm * 1e6:.0f} us"]
        for dens in (1.0, 0.75, 0.5, 0.25):
            thr = np.full(d_in, np.quantile(np.abs(x), 1 - dens) if dens < 1 else 0.0, np.float32)
            ts = best_cpu(lambda i: check(lib.gh_op_sparse_cols(
                t, p(wts[i]), d_in, d_out, ffi.cast("float *", x.ctypes.data), ffi.cast("float *", thr.ctypes.data),
                ffi.cast("float *", y.ctypes.data), ffi.NULL, 1)), n)
            cells.append(f"{ts * 1e6:.0f} us ({tm / ts:.2f}x)")
        q, qt = quantize(t, wp), quantize(t, np.ascontiguousarray(wp.T))
        yp = np.empty((128, 2048), np.float32)
        tp = best_cpu(lambda i: check(lib.gh_op_matmul(t, p(q), 2048, 2048, ffi.cast("float *", xp.ctypes.data), 128,
                                                       ffi.cast("float *", yp.ctypes.data), 1)), 1, 3)
        tt = best_cpu(lambda i: check(lib.gh_op_matmul_t(t, p(qt), 2048, 2048, ffi.cast("float *", xp.ctypes.data), 128,
                                                         ffi.cast("float *", yp.ctypes.data), 1)), 1, 3)
        cells += [f"{tp * 1e3:.1f} ms", f"{tt * 1e3:.1f} ms", f"{tt / tp:.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
