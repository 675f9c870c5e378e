#!/usr/bin/env python3
"""Interleaved A/B of two builds of the runtime in one process (not a test).

Each library is dlopen'ed separately (the cdef of the one header serves both) and their
calls alternate in short batches (8 calls each, the order swapped every round); the best
batch per library gives its time per call, 1 thread. Other processes on the cores slow
both sides alike, so on a busy machine the ratio B/A stays meaningful where two separate
runs of tools/bench_kernels.py differ by 15-30% (a kernel both builds share reads ~1.00x).

  op dot:  gh_op_matmul of one token: "hot" 512 x 2048 (the weights stay in L2), "cold"
           2048 x 5632 with 4 copies cycled (DRAM)
  op down: gh_op_sparse_down over a sorted id list: "hot" all 256 rows of 256 x 2048,
           "cold" 10% of 5632 x 2048 with 8 copies cycled
  op dt:   gh_op_matmul_t of one token, every row (the full down_t axpy that dense decode of a
           gate or sparse file runs): "hot" 256 x 2048, "cold" 5632 x 2048 with 4 copies cycled
  op rows: gh_op_sparse_glu, ungated, over a sorted id list (the sparse FFN's gathered
           gate/up rows) at DENS percent of the rows (default 50): "hot" SmolLM2-135M's
           1536 x 576 (in L2/L3), "cold" the same shape stacked to 80 MiB, the list spanning
           the stack (DRAM); timed by process CPU time (the median batch), with whether A and B
           give the same bits
  op batch: gh_op_matmul_t of a dense batch (a prompt's down_t): "hot" 16 tokens over
           256 x 2048, "cold" 128 tokens over 5632 x 2048
  op prompt: gh_op_matmul of NTOK tokens (default 128) at SmolLM2-135M's shapes, "up"
           1536 x 576, "down" 576 x 1536 and "qo" 576 x 576 (rows x columns); timed by
           process CPU time (the median batch, as the machine is shared), reported in
           GFLOP/s, with whether A and B give the same bits and whether B's batch equals
           its tokens one by one (every 7th token)
GB/s = weight bytes read per call / time.

    PYTHONPATH=python python tools/bench_kernels_ab.py OLD/libggml_hybrid.so NEW/libggml_hybrid.so \
        SIMD(0 scalar, 1 avx2, 2 avx512) dot|down|dt|rows|batch|prompt \
        f16,q4_0,q4_1,q5_0,q5_1,q8_0,q4_k,q5_k,q6_k,iq4_nl,iq4_xs [ROUNDS=60] [NTOK=128 | DENS=50]
"""
import sys
import time

import numpy as np

from powerinfer_cpp._native import ffi

libs = [ffi.dlopen(sys.argv[1]), ffi.dlopen(sys.argv[2])]
simd, op, types = int(sys.argv[3]), sys.argv[4], sys.argv[5].split(",")
rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 60
ntok = int(sys.argv[7]) if len(sys.argv) > 7 else 128
TYPES = {"f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14,
         "iq4_nl": 20, "iq4_xs": 23}
for L in libs:
    assert L.gh_simd_set(simd) != -2, f"SIMD level {simd} not supported here"


def P(a, t="void *"):
    return ffi.cast(t, a.ctypes.data)



rng = np.random.default_rng(1)
for name in types:
    t = TYPES[name]
    out = []
    for mode in ("up", "down", "qo") if op == "prompt" else ("hot", "cold"):
        if op == "prompt":
            rows, cols, nc = {"up": (1536, 576, 1), "down": (576, 1536, 1), "qo": (576, 576, 1)}[mode]
            if cols % libs[0].gh_type_block_size(t):
                continue  # (the K-quants and IQ4_XS store no 576-column rows)
        elif op == "dot":
            rows, cols, nc = (512, 2048, 1) if mode == "hot" else (2048, 5632, 4)
        elif op == "down":
            rows, cols, nc = (256, 2048, 1) if mode == "hot" else (5632, 2048, 8)
        elif op == "dt":
            rows, cols, nc = (256, 2048, 1) if mode == "hot" else (5632, 2048, 4)
        elif op == "rows":
            cols = 576 if 576 % libs[0].gh_type_block_size(t) == 0 else 2048
            stack = 1 if mode == "hot" else -(-(80 << 20) // (1536 * libs[0].gh_type_row_size(t, cols)))
            rows, nc = 1536 * stack, 1
        else:
            rows, cols, nc = (256, 2048, 1) if mode == "hot" else (5632, 2048, 1)
        rs = libs[0].gh_type_row_size(t, cols)
        r1 = rows if op != "rows" else 1536
        w = rng.standard_normal((r1, cols)).astype(np.float32)
        q = np.empty((r1, rs), dtype=np.uint8)
        libs[0].gh_quantize_row(t, P(w, "float *"), P(q), w.size)
        if r1 != rows:  # the rows op's stack of copies
            q = np.ascontiguousarray(np.tile(q, (rows // r1, 1)))
        ws = [q] + [q.copy() for _ in range(nc - 1)]
        x = rng.standard_normal(cols).astype(np.float32)
        nact = rows if mode == "hot" else rows // 10
        if op == "rows":
            nact = max(1, rows * (ntok if len(sys.argv) > 7 else 50) // 100)
        ids = [np.sort(rng.choice(rows, nact, replace=False)).astype(np.int32) for _ in range(8)]
        a = rng.standard_normal(nact).astype(np.float32)
        nt = (16 if mode == "hot" else 128) if op == "batch" else ntok if op == "prompt" else 1
        h = rng.standard_normal((nt, rows)).astype(np.float32)
        xp = rng.standard_normal((nt, cols)).astype(np.float32)
        y = np.empty(max(rows, cols) * nt, dtype=np.float32)
        def call(L, i):
            if op == "prompt":
                L.gh_op_matmul(t, P(ws[0]), rows, cols, P(xp, "float *"), nt, P(y, "float *"), 1)
            elif op == "dot":
                L.gh_op_matmul(t, P(ws[i % nc]), rows, cols, P(x, "float *"), 1, P(y, "float *"), 1)
            elif op == "dt":
                L.gh_op_matmul_t(t, P(ws[i % nc]), rows, cols, P(h, "float *"), 1, P(y, "float *"), 1)
            elif op == "rows":
                L.gh_op_sparse_glu(t, P(ws[0]), ffi.NULL, rows, cols, 0, 0.0, P(x, "float *"),
                                   P(ids[i % 8], "int32_t *"), nact, P(y, "float *"), 1)
            elif op == "batch":
                L.gh_op_matmul_t(t, P(ws[i % nc]), rows, cols, P(h, "float *"), nt, P(y, "float *"), 1)
            else:
                L.gh_op_sparse_down(t, P(ws[i % nc]), rows, cols, P(ids[i % 8], "int32_t *"), P(a, "float *"), nact, P(y, "float *"), 1)
        best = [1e9, 1e9]
        nb = 8
        clock = time.process_time if op in ("prompt", "rows") else time.perf_counter
        times = [[], []]
        for r in range(rounds):
            for k in (0, 1) if r % 2 == 0 else (1, 0):
                t0 = clock()
                for i in range(nb): call(libs[k], i + r)
                times[k].append((clock() - t0) / nb)
                best[k] = min(best[k], times[k][-1])
        if op == "prompt":
            best = [float(np.median(tk)) for tk in times]
            fl = 2.0 * rows * cols * nt
            ys = []
            for L in libs:
                call(L, 0)
                ys.append(y[:rows * nt].copy())
            same = np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))
            exact, dec = True, np.empty(rows, np.float32)
            for k in range(0, nt, 7):
                xk = xp[k:k + 1].copy()
                libs[1].gh_op_matmul(t, P(ws[0]), rows, cols, P(xk, "float *"), 1, P(dec, "float *"), 1)
                exact = exact and np.array_equal(dec.view(np.uint32), ys[1][k * rows:(k + 1) * rows].view(np.uint32))
            out.append(f"{mode} {rows}x{cols}: A {best[0]*1e3:6.2f} ms {fl/best[0]/1e9:5.1f} GFLOP/s, "
                       f"B {best[1]*1e3:6.2f} ms {fl/best[1]/1e9:5.1f} GFLOP/s ({best[0]/best[1]:.2f}x; "
                       f"A==B bits {same}, B batch==decode {exact})")
            continue
        same = ""
        if op == "rows":
            best = [float(np.median(tk)) for tk in times]
            ys = []
            for L in libs:
                call(L, 0)
                ys.append(y[:nact].copy())
            same = f"; A==B bits {np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))}"
        byt = q.nbytes * (nact / rows if op in ("down", "rows") else 1)
        if op == "batch":  # per token
            best = [b / nt for b in best]
        out.append(f"{mode}: A {best[0]*1e6:6.1f} us {byt/best[0]/1e9:5.1f} GB/s, B {best[1]*1e6:6.1f} us {byt/best[1]/1e9:5.1f} GB/s ({best[0]/best[1]:.2f}x{same})")
    print(f"{name} simd{simd} {op}: " + " | ".join(out), flush=True)
