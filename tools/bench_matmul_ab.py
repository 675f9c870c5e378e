#!/usr/bin/env python3
"""Interleaved A/B of gh_op_matmul between two builds at SmolLM2's IQ4 shapes (not a test).

IQ4_NL 1536 x 576 (gate/up) and 576 x 576 (q/o), IQ4_XS 576 x 1536 (down), random
weights, NTOK tokens, 1 thread. Both libraries are dlopen'ed in one process and their calls
alternate (8 calls a batch, the order swapped every round); time per call is the median
batch's process CPU time, which stays comparable on a busy machine. Also prints whether
the two builds give the same bits, and whether B's batch equals its tokens one by one
(every 7th token).

    PYTHONPATH=python python tools/bench_matmul_ab.py OLD.so NEW.so SIMD(1 avx2, 2 avx512) [ROUNDS=11] [NTOK=128]
"""
import sys
import time

import numpy as np

from powerinfer_cpp._native import ffi

libs = [ffi.dlopen(sys.argv[1]), ffi.dlopen(sys.argv[2])]
simd = int(sys.argv[3])
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 11
ntok = int(sys.argv[5]) if len(sys.argv) > 5 else 128
for L in libs:
    assert L.gh_simd_set(simd) != -2, f"SIMD level {simd} not supported here"


def P(a, t="void *"):
    return ffi.cast(t, a.ctypes.data)


rng = np.random.default_rng(1)
CASES = [("iq4_nl", 20, 1536, 576), ("iq4_xs", 23, 576, 1536), ("iq4_nl", 20, 576, 576)]
for name, t, rows, cols in CASES:
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    q = np.empty((rows, libs[0].gh_type_row_size(t, cols)), dtype=np.uint8)
    libs[0].gh_quantize_row(t, P(w, "float *"), P(q), w.size)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    ys = [np.empty((ntok, rows), np.float32) for _ in libs]

    def call(i):
        assert libs[i].gh_op_matmul(t, P(q), rows, cols, P(x, "float *"), ntok, P(ys[i], "float *"), 1) == 0

    call(0)
    call(1)
    same = np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))
    ok = True
    dec = np.empty(rows, np.float32)
    for k in range(0, ntok, 7):
        xk = x[k:k + 1].copy()
        assert libs[1].gh_op_matmul(t, P(q), rows, cols, P(xk, "float *"), 1, P(dec, "float *"), 1) == 0
        ok = ok and np.array_equal(dec.view(np.uint32), ys[1][k].view(np.uint32))
    times = [[], []]
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.process_time()
            for _ in range(8):
                call(i)
            times[i].append((time.process_time() - t0) / 8)
    med = [float(np.median(b)) for b in times]
    gf = [2 * rows * cols * ntok / m / 1e9 for m in med]
    print(f"{name} {rows}x{cols} x{ntok}: A {med[0] * 1e3:.3f} ms ({gf[0]:.0f} GFLOP/s)  "
          f"B {med[1] * 1e3:.3f} ms ({gf[1]:.0f})  B/A {med[1] / med[0]:.3f}  A==B bits {same}  "
          f"B batch==decode {ok}")
