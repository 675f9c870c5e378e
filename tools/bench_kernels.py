#!/usr/bin/env python3
"""Micro-benchmark of the matmul kernels (not a test).

For each weight type, at 1 and 2 threads:
  * decode: matvec (one token) of a 2048x5632 and a 5632x2048 matrix; weight GB/s and
    the decode tokens/s the 542M LLaMA of REFERENCE.md (d=2048, 8 layers, n_ff=5632,
    vocab 32000) would reach at that rate: a token reads 8 layers x 51.4M weights plus
    the 65.5M output head (477M weights: 953 MB in F16, as REFERENCE.md says);
  * prompt: a 128-token matmul of the same matrices; GFLOP/s and the pp128 tokens/s of
    that model at that rate: 2 x 411M FLOP per prompt token (the layers' matmuls; the
    head runs for the last token only, attention is small at 128 tokens).
Several copies of each matrix (> L3) are cycled so decode reads from DRAM.

Run it on an idle machine. When other processes keep the cores busy, the 1-thread
'cpu' columns stay meaningful, but multi-threaded calls collapse (each call waits until
the scheduler runs all of its threads at once: ~20 ms per call at a load of 10 on two
cores), and neither wall nor CPU time says how fast the kernels are.

    PYTHONPATH=python python tools/bench_kernels.py [--types f16,q4_0] [--simd 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import time

# numpy's BLAS threads would share the cores and the process CPU time with the kernels
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from powerinfer_cpp._native import check, ffi, lib  # noqa: E402

TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}
SHAPES = [(2048, 5632), (5632, 2048)]  # rows x cols
LAYER_PARAMS = 4 * 2048 * 2048 + 3 * 2048 * 5632
MODEL_PARAMS = 8 * LAYER_PARAMS + 32000 * 2048   # weights read per decoded token
MODEL_FLOP_PER_TOKEN = 2 * 8 * LAYER_PARAMS       # per prompt token
L3_BYTES = 32 << 20


def quantize(t: int, w: np.ndarray) -> np.ndarray:
    rs = lib.gh_type_row_size(t, w.shape[1])
    out = np.empty((w.shape[0], rs), dtype=np.uint8)
    for r in range(w.shape[0]):
        check(lib.gh_quantize_row(t, ffi.cast("float *", w[r].ctypes.data),
                                  ffi.cast("void *", out[r].ctypes.data), w.shape[1]))
    return out


def run(t, wq, rows, cols, x, y, n_threads):
    check(lib.gh_op_matmul(t, ffi.cast("void *", wq.ctypes.data), rows, cols,
                           ffi.cast("float *", x.ctypes.data), x.shape[0],
                           ffi.cast("float *", y.ctypes.data), n_threads))


def bench(t, copies, rows, cols, n_tokens, n_threads, reps, min_time):
    """Best-of-reps seconds per call, cycling through the weight copies: (wall, cpu),
    where cpu is the process CPU time divided by the thread count, i.e. the wall time
    the call would take if its threads had the cores to themselves (the pool's threads
    spin, so on an idle machine the two agree)."""
    x = np.random.default_rng(0).standard_normal((n_tokens, cols)).astype(np.float32)
    y = np.empty((n_tokens, rows), dtype=np.float32)
    run(t, copies[0], rows, cols, x, y, n_threads)  # warm up (threads, page faults)
    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        n = 0
        t0 = time.perf_counter()
        c0 = time.process_time()
        while True:
            run(t, copies[n % len(copies)], rows, cols, x, y, n_threads)
            n += 1
            el = time.perf_counter() - t0
            if el >= min_time and n >= len(copies):
                break
        best_wall = min(best_wall, el / n)
        best_cpu = min(best_cpu, (time.process_time() - c0) / n_threads / n)
    return best_wall, best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--simd", type=int, default=-1, help="SIMD level (0 scalar, 1 avx2, 2 avx512; -1 best)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--pp-tokens", type=int, default=128)
    ap.add_argument("--no-pp", action="store_true")
    args = ap.parse_args()

    if lib.gh_simd_set(args.simd) == -2:
        raise SystemExit(f"SIMD level {args.simd} not supported here")
    level = ["scalar", "avx2", "avx512"][lib.gh_simd_get()]
    threads = [int(s) for s in args.threads.split(",")]
    print(f"SIMD level: {level}; best of {args.reps}; GB/s = weight bytes / time; "
          f"'cpu' columns use process CPU time / threads (robust when other processes share the cores)")
    print(f"{'type':6} {'shape':>10} {'thr':>3} | {'decode us':>9} {'GB/s':>6} {'cpu GB/s':>8} {'tok/s':>7} |"
          f" {'pp GFLOP/s':>10} {'cpu GFLOP/s':>11} {'pp tok/s':>8}")
    print("tok/s, pp tok/s: the 542M model's decode / prompt rate at the 'cpu' rates")
    rng = np.random.default_rng(1)
    for name in args.types.split(","):
        t = TYPES[name]
        for rows, cols in SHAPES:
            w = rng.standard_normal((rows, cols)).astype(np.float32)
            wq = quantize(t, w)
            n_copies = max(1, -(-4 * L3_BYTES // wq.nbytes))
            copies = [wq] + [wq.copy() for _ in range(n_copies - 1)]
            bytes_per_param = wq.nbytes / (rows * cols)
            for nth in threads:
                dt, dc = bench(t, copies, rows, cols, 1, nth, args.reps, args.min_time)
                gbs, gbs_cpu = wq.nbytes / dt / 1e9, wq.nbytes / dc / 1e9
                tok = gbs_cpu * 1e9 / (MODEL_PARAMS * bytes_per_param)
                pp = ""
                if not args.no_pp:
                    dtp, dcp = bench(t, copies[:1], rows, cols, args.pp_tokens, nth, max(1, args.reps // 2),
                                     args.min_time)
                    flop = 2 * rows * cols * args.pp_tokens
                    gflops, gflops_cpu = flop / dtp / 1e9, flop / dcp / 1e9
                    pp = f" {gflops:10.1f} {gflops_cpu:11.1f} {gflops_cpu * 1e9 / MODEL_FLOP_PER_TOKEN:8.0f}"
                print(f"{name:6} {f'{rows}x{cols}':>10} {nth:3d} | {dt * 1e6:9.0f} {gbs:6.1f} {gbs_cpu:8.1f} "
                      f"{tok:7.1f} |{pp}", flush=True)


if __name__ == "__main__":
    main()
