#!/usr/bin/env python3
"""Accuracy of gate-magnitude sparsity (convert --sparsity) on held-out text (not a test).

For each target sparsity: convert the model folder with --sparsity S, then decode the
held-out tokens after the calibration part one at a time (so every token runs the gate
FFN) in the dense and the gate mode, and report perplexity, KL divergence of the gate
mode's next-token distribution to the dense one, top-1 agreement and the FFN density the
runtime measured. Both modes use an f32 KV cache, so the difference is the FFN's alone.

    PYTHONPATH=python python tools/gate_accuracy.py [--model models/tiny-swiglu-kjv]
        [--sparsity 0.25,0.4,0.5] [--outtype f16] [--tokens 1000]

tools/eval_sparsity.py measures the same on more levels and both allocations, with one
calibration, a table and a plot; this one converts once per level.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from powerinfer_cpp import Model
from powerinfer_cpp.convert import convert
from powerinfer_cpp.sparse.pipeline import SparseOptions


def logprobs(ctx, ids: list[int], window: int) -> np.ndarray:
    """log p(next token) rows for ids[:-1], decoding one token at a time in windows."""
    rows = []
    for s in range(0, len(ids) - 1, window):
        ctx.reset()
        w = ids[s:s + window + 1]
        for t in w[:-1]:
            lg = ctx.eval([t]).astype(np.float64)
            lg -= lg.max()
            rows.append(lg - np.log(np.exp(lg).sum()))
    return np.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-swiglu-kjv")
    ap.add_argument("--sparsity", default="0.25,0.4,0.5")
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    text = open(os.path.join(args.model, "heldout.txt"), encoding="utf-8").read()
    with tempfile.TemporaryDirectory() as tmp:
        for s in (float(v) for v in args.sparsity.split(",")):
            rep: list = []
            path = convert(args.model, os.path.join(tmp, f"s{s}.gguf"), args.outtype,
                           progress=False, sparse=True, sparse_options=SparseOptions(sparsity=s),
                           report=rep)
            n_cal = rep[0].n_calib_tokens
            with Model(path, n_ctx=512, n_threads=args.threads, cache_type="f32") as m:
                ids = m.tokenize(text)[n_cal:n_cal + args.tokens + 1]
                tgt = np.asarray(ids[1:])
                dense_ctx = m.create_context(n_ctx=512, ffn="dense")
                gate_ctx = m.create_context(n_ctx=512, ffn="gate")
                ld = logprobs(dense_ctx, ids, 500)
                gate_ctx.reset_stats()
                lg = logprobs(gate_ctx, ids, 500)
                density = gate_ctx.stats()["density"]
            n = len(tgt)
            ppl_d = float(np.exp(-ld[np.arange(n), tgt].mean()))
            ppl_g = float(np.exp(-lg[np.arange(n), tgt].mean()))
            kl = float((np.exp(ld) * (ld - lg)).sum(axis=1).mean())
            top1 = float((ld.argmax(1) == lg.argmax(1)).mean())
            thr = ", ".join(f"{t:.3g}" for t in rep[0].gate_thresholds)
            print(f"S={s:g}: ppl dense {ppl_d:.3f} gate {ppl_g:.3f} ({(ppl_g / ppl_d - 1) * 100:+.2f}%), "
                  f"KL {kl:.4f}, top-1 {top1:.3f}, density {density:.3f} (thresholds {thr}); "
                  f"{n} held-out positions after {n_cal} calibration tokens", flush=True)


if __name__ == "__main__":
    main()
