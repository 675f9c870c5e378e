#!/usr/bin/env python3
"""Micro-benchmark of decode attention over the KV cache per cache type (not a test).

One decode token (n_tokens = 1) attends over a cache of --depth positions for each layer
of the 1.1B bench model's shape (22 layers, 32 query heads, 4 kv heads, head size 64);
the layers' caches are distinct arrays, so at depth 2048 the cache read per token is
92 MB in f32 (more than the L3), as in a real decode. Reports microseconds per token for
all layers and the cache bytes read per second, from the process's CPU time divided by the
thread count (so other work on the machine does not count, as in tools/bench_kernels.py).

    PYTHONPATH=python python tools/bench_attention.py [--depth 64,512,2048] [--threads 1,2]
        [--simd 1]   # 0 scalar, 1 avx2, 2 avx512 (default: the machine's best)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from powerinfer_cpp._native import check, ffi, lib

N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM = 22, 32, 4, 64
TYPES = {"f32": 0, "f16": 1, "q8_0": 8}


def cache_rows(kind: str, a: np.ndarray) -> np.ndarray:
    """The rows of `a` stored as the cache type."""
    if kind == "f32":
        return a
    if kind == "f16":
        return a.astype(np.float16)
    import gguf

    return gguf.quants.quantize(a.reshape(a.shape[0], -1), gguf.GGMLQuantizationType.Q8_0)


def bench(kind: str, depth: int, n_threads: int, reps: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    n_kv = depth + 1
    q = rng.standard_normal((1, N_HEAD, HEAD_DIM)).astype(np.float32)
    out = np.empty_like(q)
    layers = []
    for _ in range(N_LAYER):
        k = rng.standard_normal((n_kv, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((n_kv, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
        layers.append((cache_rows(kind, k), cache_rows(kind, v)))
    nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
    qp, op = ffi.from_buffer("float[]", q), ffi.from_buffer("float[]", out)
    ptrs = [(ffi.from_buffer(k), ffi.from_buffer(v)) for k, v in layers]
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for kp, vp in ptrs:
            check(lib.gh_op_attention_kv(TYPES[kind], qp, kp, vp, op, 1, depth, N_HEAD,
                                         N_HEAD_KV, HEAD_DIM, n_threads))
        best = min(best, (time.process_time() - t0) / n_threads)
    return best * 1e6, nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", default="64,512,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default="f32,f16,q8_0")
    ap.add_argument("--simd", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.simd is not None:
        lib.gh_simd_set(args.simd)
    print(f"decode attention, {N_LAYER} layers x {N_HEAD}/{N_HEAD_KV} heads x {HEAD_DIM}, "
          f"best of {args.reps}: us per token (cache GB/s)")
    print("depth threads " + " ".join(f"{t:>18}" for t in args.types.split(",")))
    for depth in (int(x) for x in args.depth.split(",")):
        for nt in (int(x) for x in args.threads.split(",")):
            cells = []
            for kind in args.types.split(","):
                us, gbs = bench(kind, depth, nt, args.reps)
                cells.append(f"{us:9.0f} ({gbs:5.1f})")
            print(f"{depth:5d} {nt:7d} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
