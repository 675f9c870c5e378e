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
        [--shapes 2048x2048,32000x2048] [--no-pp]

--sparse: instead, one layer's sparse FFN at d=2048, n_ff=5632 for each weight type: the
predictor (fc1 h x d, fc2 n_ff x h; F16 for float models, Q8_0 for quantized ones, as
the sparse pipeline stores them), the sparse GLU (gate and up rows of the active list) and the
sparse down (active rows of down_t), over a fresh random sorted list of --density of the
neurons per call (SiLU, so every listed up and down row is read: the bytes touched are
n x 3 rows). GB/s = bytes touched / CPU-normalised time; 'x dense' = the time the dense
FFN (gate, up, down matvecs at the dense kernel's rate measured here) over the sparse
layer's time (predictor + GLU + down).

    PYTHONPATH=python python tools/bench_kernels.py --sparse [--types f16,q4_0] [--density 0.1]
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

TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q4_k": 12,
         "q5_k": 13, "q6_k": 14, "q2_k": 10, "q3_k": 11}
TYPES |= {"iq4_nl": 20, "iq4_xs": 23, "mxfp4": 39}  # the non-linear 4-bit types
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
    return timed(lambda i: run(t, copies[i], rows, cols, x, y, n_threads), len(copies),
                 n_threads, reps, min_time)


def p(a, ctype="void *"):
    return ffi.cast(ctype, a.ctypes.data)


def timed(fn, n_sets, n_threads, reps, min_time):
    """Best-of-reps (wall, cpu) seconds per call of fn(i), i cycling over n_sets."""
    fn(0)
    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        n = 0
        t0 = time.perf_counter()
        c0 = time.process_time()
        while True:
            fn(n % n_sets)
            n += 1
            el = time.perf_counter() - t0
            if el >= min_time and n >= n_sets:
                break
        best_wall = min(best_wall, el / n)
        best_cpu = min(best_cpu, (time.process_time() - c0) / n_threads / n)
    return best_wall, best_cpu


def sparse_main(args, threads) -> None:
    d, ff, h = 2048, 5632, args.pred_h
    rng = np.random.default_rng(1)
    n_act = int(round(args.density * ff))
    print(f"sparse FFN layer: d={d} n_ff={ff} predictor h={h} ({(d * h + h * ff) / (3 * d * ff):.0%} of the "
          f"FFN's params), {n_act} active ({args.density:.0%}), random sorted ids per call; GB/s = bytes "
          f"touched / CPU-normalised time")
    print(f"{'type':6} {'thr':>3} | {'pred us':>7} {'GB/s':>5} | {'glu us':>6} {'GB/s':>5} | {'down us':>7} "
          f"{'GB/s':>5} | {'dense GB/s':>10} | {'layer us':>8} {'GB/s':>5} {'x dense':>7}")
    for name in args.types.split(","):
        t = TYPES[name]
        pt = TYPES["f16"] if name in ("f32", "f16", "bf16") else TYPES["q8_0"]
        mats = lambda r, c, ty: quantize(ty, rng.standard_normal((r, c)).astype(np.float32) * 0.05)
        gate, up, down = mats(ff, d, t), mats(ff, d, t), mats(ff, d, t)
        fc1, fc2 = mats(h, d, pt), mats(ff, h, pt)
        set_bytes = gate.nbytes * 3 + fc1.nbytes + fc2.nbytes
        n_copies = max(2, -(-8 * L3_BYTES // set_bytes))
        sets = [(gate, up, down, fc1, fc2)] + [tuple(m.copy() for m in (gate, up, down, fc1, fc2))
                                                for _ in range(n_copies - 1)]
        n_ids = 64
        ids = [np.sort(rng.choice(ff, n_act, replace=False)).astype(np.int32) for _ in range(n_ids)]
        xs = [rng.standard_normal(d).astype(np.float32) for _ in range(n_ids)]
        av = [rng.standard_normal(n_act).astype(np.float32) for _ in range(n_ids)]
        row = gate.nbytes // ff
        active = np.empty(ff, dtype=np.int32)
        n_out = ffi.new("int64_t *")
        a = np.empty(max(n_act, 1), dtype=np.float32)
        y = np.empty(d, dtype=np.float32)
        n_calls = max(len(sets), n_ids)
        for nth in threads:
            def pred(i):
                s = sets[i % len(sets)]
                check(lib.gh_op_sparse_predict(pt, p(s[3]), pt, p(s[4]), d, h, ff, p(xs[i % n_ids], "float *"),
                                               0.0, p(active, "int32_t *"), n_out, ffi.NULL, nth))

            def glu(i):
                s = sets[i % len(sets)]
                check(lib.gh_op_sparse_glu(t, p(s[0]), p(s[1]), ff, d, 0, 0.0, p(xs[i % n_ids], "float *"),
                                           p(ids[i % n_ids], "int32_t *"), n_act, p(a, "float *"), nth))

            def dn(i):
                s = sets[i % len(sets)]
                check(lib.gh_op_sparse_down(t, p(s[2]), ff, d, p(ids[i % n_ids], "int32_t *"),
                                            p(av[i % n_ids], "float *"), n_act, p(y, "float *"), nth))

            _, cp = timed(pred, n_calls, nth, args.reps, args.min_time)
            _, cg = timed(glu, n_calls, nth, args.reps, args.min_time)
            _, cd = timed(dn, n_calls, nth, args.reps, args.min_time)
            _, cdense = bench(t, [s[0] for s in sets], ff, d, 1, nth, args.reps, args.min_time)
            bp, bg, bd = fc1.nbytes + fc2.nbytes, 2 * n_act * row, n_act * row
            dense_gbs = gate.nbytes / cdense / 1e9
            total = cp + cg + cd
            print(f"{name:6} {nth:3d} | {cp * 1e6:7.0f} {bp / cp / 1e9:5.1f} | {cg * 1e6:6.0f} {bg / cg / 1e9:5.1f} | "
                  f"{cd * 1e6:7.0f} {bd / cd / 1e9:5.1f} | {dense_gbs:10.1f} | {total * 1e6:8.0f} "
                  f"{(bp + bg + bd) / total / 1e9:5.1f} {3 * cdense / total:7.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--simd", type=int, default=-1, help="SIMD level (0 scalar, 1 avx2, 2 avx512; -1 best)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--pp-tokens", type=int, default=128)
    ap.add_argument("--no-pp", action="store_true")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES),
                    help="rows x cols of the matrices, comma-separated (e.g. 2048x2048,32000x2048)")
    ap.add_argument("--sparse", action="store_true", help="the sparse FFN ops instead (see above)")
    ap.add_argument("--density", type=float, default=0.1, help="--sparse: share of active neurons")
    ap.add_argument("--pred-h", type=int, default=768, help="--sparse: predictor hidden size")
    args = ap.parse_args()

    if lib.gh_simd_set(args.simd) == -2:
        raise SystemExit(f"SIMD level {args.simd} not supported here")
    level = ["scalar", "avx2", "avx512"][lib.gh_simd_get()]
    threads = [int(s) for s in args.threads.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.sparse:
        if args.types == ",".join(TYPES):
            args.types = "f16,q4_0"
        print(f"SIMD level: {level}; best of {args.reps}")
        sparse_main(args, threads)
        return
    print(f"SIMD level: {level}; best of {args.reps}; GB/s = weight bytes / time; "
          f"'cpu' columns use process CPU time / threads (robust when other processes share the cores)")
    print(f"{'type':6} {'shape':>10} {'thr':>3} | {'decode us':>9} {'GB/s':>6} {'cpu GB/s':>8} {'tok/s':>7} |"
          f" {'pp GFLOP/s':>10} {'cpu GFLOP/s':>11} {'pp tok/s':>8}")
    print("tok/s, pp tok/s: the 542M model's decode / prompt rate at the 'cpu' rates")
    rng = np.random.default_rng(1)
    for name in args.types.split(","):
        t = TYPES[name]
        for rows, cols in shapes:
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
