#!/usr/bin/env python3
"""Sparse kernels against the dense one, per byte read (not a test).

For each weight type, SIMD level, thread count, shape and density, three public ops are
timed on the same bytes' worth of weights:
  dense  gh_op_matmul: one token through the type's dense decode tiles (the baseline);
  rows   gh_op_sparse_glu, ungated: the gathered row-dots over a sorted id list (the
         gate/up path of the sparse FFN);
  cols   gh_op_sparse_down: the axpy over a sorted id list of the transposed down
         projection (down_t; the column-sparse path, which gh_op_sparse_cols and the
         input-sparse projections share);
  dt     gh_op_matmul_t of one token: the axpy over every row of down_t, which is what a
         sparse or gate file's dense FFN runs for its down projection (such a file stores
         ffn_down_t, not ffn_down); one ratio per type, whatever the density.
GB/s = weight bytes the call reads (dense: the whole matrix; sparse: the listed rows) /
time, and 'ratio' = sparse GB/s / dense GB/s: 1.0 means reading 20% fewer bytes is 20%
faster. The rows path is compared with the dense matmul of the same matrix (n_ff x n_embd),
the cols and dt paths with the dense matmul of the down projection (n_embd x n_ff), which
is what dense decode of a file with ffn_down runs (ffn/auto_mode.c compares cols with dt for
files that carry ffn_down_t).

Shapes: "smol" is SmolLM2-135M's FFN (n_embd 576, n_ff 1536), "2048" a 2048 x 5632 FFN.
A type whose block does not divide a row (the K-quants and IQ4_XS on 576 columns: a real
file stores those tensors in another type) has no row on that shape.

Every op reads from DRAM as in decode: the matrix is stacked in K copies (> 2x L3), and one
call covers the whole stack (the id list spans all copies, as K layers' lists would).
--per-call instead runs one copy per call (cycling the copies): the per-call cost of the
op (pool wake-up, x conversion) then counts as it does in a decode step.

The machine is shared: A (dense) and B (sparse) calls alternate, each rep a fresh id list
(one of 8), and the medians over --reps reps are reported (the median of many short
alternating reps is what stays stable when other processes take the cores). The time is the
process CPU time / threads (--wall: wall time): with ~8 busy processes on 2 cores the wall
time of a call mostly says how often the scheduler ran it. (The 2-thread pool's workers
spin while they wait, so at 2 threads a descheduled partner inflates the CPU time too.)

    PYTHONPATH=python python tools/bench_sparse_kernels.py [--types f16,q4_0] [--simd avx512,avx2]
        [--threads 1,2] [--density 0.1,0.3,0.5,0.7,0.9] [--shapes smol,2048] [--reps 21]
        [--per-call] [--paths rows,cols,dt] [--run 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# numpy's BLAS threads would share the cores with the kernels
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from powerinfer_cpp._native import check, ffi, lib  # noqa: E402

TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
         "q2_k": 10, "q3_k": 11, "q4_k": 12, "q5_k": 13, "q6_k": 14, "iq4_nl": 20, "iq4_xs": 23,
         "mxfp4": 39}
DEFAULT_TYPES = "f16,q8_0,q4_0,q4_1,q4_k,q5_k,q6_k,iq4_xs,iq4_nl,mxfp4"
SHAPES = {"smol": (576, 1536), "2048": (2048, 5632)}  # n_embd, n_ff
SIMD = {"scalar": 0, "avx2": 1, "avx512": 2}
STACK_BYTES = 80 << 20  # > 2x the 32 MiB L3 of the machines measured


def p(a, ctype="void *"):
    return ffi.cast(ctype, a.ctypes.data)


def quantize(t: int, w: np.ndarray) -> np.ndarray:
    out = np.empty((w.shape[0], lib.gh_type_row_size(t, w.shape[1])), dtype=np.uint8)
    check(lib.gh_quantize_row(t, p(w, "float *"), p(out), w.size))
    return out


def stacked(t, rows, cols, k, rng):
    """k copies of a random rows x cols matrix of type t, one buffer (k * rows rows)."""
    q = quantize(t, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
    return np.ascontiguousarray(np.tile(q, (k, 1)))


def id_list(rng, rows, n, run):
    """A sorted list of n of the rows: drawn one by one (run 1), or as n / run runs of run
    consecutive rows (aligned to run), which is how contiguous the active lists would be
    with co-active neurons stored next to each other."""
    if run <= 1:
        return np.sort(rng.choice(rows, n, replace=False)).astype(np.int32)
    starts = rng.choice(rows // run, max(1, n // run), replace=False) * run
    return np.sort((starts[:, None] + np.arange(run)).ravel()).astype(np.int32)


def median_pair(fa, fb, reps, nth, wall):
    """Median seconds of fa() and fb() over reps alternating reps (the order swapped every
    rep, so a burst of load hits both alike): the process CPU time / nth (what the call
    takes when its threads have the cores: on a machine shared with other processes wall
    time mostly measures the scheduler), or with wall=True the wall time."""
    clock = time.perf_counter if wall else time.process_time
    fa(0)
    fb(0)
    ta, tb = [], []
    for r in range(reps):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            f, acc = (fa, ta) if which == 0 else (fb, tb)
            t0 = clock()
            f(r)
            acc.append((clock() - t0) / (1 if wall else nth))
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--simd", default="avx512,avx2")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--density", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--shapes", default="smol,2048")
    ap.add_argument("--paths", default="rows,cols,dt")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--per-call", action="store_true")
    ap.add_argument("--wall", action="store_true", help="wall time instead of CPU time / threads")
    ap.add_argument("--run", type=int, default=1,
                    help="the lists as runs of this many consecutive rows (1: rows drawn one by one)")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    dens = [float(d) for d in args.density.split(",")]
    paths = args.paths.split(",")
    mode = "one copy per call" if args.per_call else "stack per call"
    clock = "wall time" if args.wall else "CPU time / threads"
    print(f"# medians of {args.reps} alternating reps ({clock}), {mode}; GB/s per byte read; "
          f"ratio = sparse / dense")
    print(f"{'type':7} {'isa':6} {'thr':>3} {'shape':5} {'path':4} {'dense':>6} | "
          + " ".join(f"{int(d * 100):>3}%: GB/s ratio" for d in dens))
    for shape in args.shapes.split(","):
        n_embd, n_ff = SHAPES[shape]
        for name in args.types.split(","):
            t = TYPES[name]
            bs = lib.gh_type_block_size(t)
            rb_gate = lib.gh_type_row_size(t, n_embd) if n_embd % bs == 0 else 0
            rb_down = lib.gh_type_row_size(t, n_ff) if n_ff % bs == 0 else 0
            if not rb_gate:  # no row-dots and no down_t of this shape (both are n_ff x n_embd)
                print(f"{name:7} {'-':6} {'-':>3} {shape:5} n/a: block {bs} does not divide {n_embd}")
                continue
            mat_bytes = n_ff * rb_gate
            k = 1 if args.per_call else max(1, -(-STACK_BYTES // mat_bytes))
            ncopy = max(1, -(-STACK_BYTES // mat_bytes)) if args.per_call else 1
            # gate (n_ff x n_embd) doubles as down_t: the same shape and bytes
            gate = [stacked(t, n_ff, n_embd, k, rng)]
            if ncopy > 1:
                gate = [gate[0].copy() for _ in range(ncopy)]
            down = []
            if rb_down:
                down = [stacked(t, n_embd, n_ff, k, rng)]
                if ncopy > 1:
                    down = [down[0].copy() for _ in range(ncopy)]
            x = rng.standard_normal(n_embd).astype(np.float32)
            h = rng.standard_normal(n_ff).astype(np.float32)
            y = np.empty(max(n_ff, n_embd) * k, dtype=np.float32)
            a = rng.standard_normal(n_ff * k).astype(np.float32)
            R = n_ff * k
            for isa in args.simd.split(","):
                if lib.gh_simd_set(SIMD[isa]) == -2:
                    print(f"{name:7} {isa:6} not supported here")
                    continue
                for nth in [int(v) for v in args.threads.split(",")]:
                    for path in paths:
                        if path in ("cols", "dt") and not down:
                            print(f"{name:7} {isa:6} {nth:3} {shape:5} {path:4} n/a (block {bs} does not "
                                  f"divide {n_ff})")
                            continue
                        cells, dense_gbs = [], []
                        if path == "dt":  # one cell: every row, no list
                            hk = rng.standard_normal(R).astype(np.float32)

                            def fa(i):
                                check(lib.gh_op_matmul(t, p(down[i % len(down)]), n_embd * k, n_ff,
                                                       p(h, "float *"), 1, p(y, "float *"), nth))

                            def fb(i):
                                check(lib.gh_op_matmul_t(t, p(gate[i % len(gate)]), R, n_embd,
                                                         p(hk, "float *"), 1, p(y, "float *"), nth))
                            sa, sb = median_pair(fa, fb, args.reps, nth, args.wall)
                            ga, gb = n_embd * k * rb_down / sa / 1e9, R * rb_gate / sb / 1e9
                            print(f"{name:7} {isa:6} {nth:3} {shape:5} {path:4} {ga:6.1f} | "
                                  f"100%: {gb:9.1f} {gb / ga:5.2f}", flush=True)
                            continue
                        for d in dens:
                            n = max(1, int(round(d * R)))
                            lists = [id_list(rng, R, n, args.run) for _ in range(8)]
                            n = len(lists[0])
                            if path == "rows":
                                def fa(i):
                                    check(lib.gh_op_matmul(t, p(gate[i % len(gate)]), R, n_embd,
                                                           p(x, "float *"), 1, p(y, "float *"), nth))
                                def fb(i):
                                    check(lib.gh_op_sparse_glu(t, p(gate[i % len(gate)]), ffi.NULL, R, n_embd,
                                                               0, 0.0, p(x, "float *"),
                                                               p(lists[i % 8], "int32_t *"), n,
                                                               p(a, "float *"), nth))
                                ba = R * rb_gate
                            else:
                                def fa(i):
                                    check(lib.gh_op_matmul(t, p(down[i % len(down)]), n_embd * k, n_ff,
                                                           p(h, "float *"), 1, p(y, "float *"), nth))
                                def fb(i):
                                    check(lib.gh_op_sparse_down(t, p(gate[i % len(gate)]), R, n_embd,
                                                                p(lists[i % 8], "int32_t *"), p(a, "float *"),
                                                                n, p(y, "float *"), nth))
                                ba = n_embd * k * rb_down
                            bb = n * rb_gate
                            sa, sb = median_pair(fa, fb, args.reps, nth, args.wall)
                            ga, gb = ba / sa / 1e9, bb / sb / 1e9
                            dense_gbs.append(ga)
                            cells.append(f"{gb:9.1f} {gb / ga:5.2f}")
                        print(f"{name:7} {isa:6} {nth:3} {shape:5} {path:4} {statistics.median(dense_gbs):6.1f} | "
                              + " ".join(cells), flush=True)
    lib.gh_simd_set(SIMD["avx512"] if lib.gh_simd_supported() >= 2 else lib.gh_simd_supported())


if __name__ == "__main__":
    main()
