#!/usr/bin/env python3
"""Quality of gate-magnitude sparsity against sparsity (not a test): held-out perplexity,
mean KL divergence to the dense next-token distribution and top-1 agreement, for each
per-layer allocation (uniform, greedy), as a markdown table and a PNG plot.

One calibration is reused: the model folder is converted once (convert --sparsity with the
greedy allocation, which also measures the layers' KL curves), and every level x allocation
patches that file's thresholds (sparse/gate_eval.py) from the same quantile table. The
held-out tokens are those of the calibration text after the profiled ones; each runs the
gate FFN (one token at a time, as decode), against the dense FFN of the same file, f32 KV
cache for both.

    PYTHONPATH=python python tools/eval_sparsity.py [--model models/tiny-swiglu-kjv]
        [--sparsity 0,0.25,0.4,0.5,0.6,0.7] [--outtype f16] [--tokens 0]
        [--plot docs/img/gate_sparsity_swiglu.png] [--budget 0.02]

--budget also converts with the default quality budget (per allocation) and reports the
sparsity it chose and its quality on the same held-out tokens. matplotlib is needed for
--plot only (a dev tool; the package does not depend on it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from powerinfer_cpp import Model
from powerinfer_cpp.convert import convert
from powerinfer_cpp.sparse.gate_eval import GateEvaluator
from powerinfer_cpp.sparse.pipeline import HELDOUT_FILE, SparseOptions
from powerinfer_cpp.sparse.thresholds import ALLOCATIONS, greedy_allocation, uniform_allocation


def table_md(rows: list[dict]) -> str:
    """The markdown table of the measurements."""
    out = ["| allocation | sparsity | per-layer sparsity | measured density | held-out ppl | vs dense | "
           "mean KL to dense | top-1 agreement |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['allocation']} | {r['sparsity']:.0%} | "
                   + " / ".join(f"{v:.0%}" for v in r["levels"])
                   + f" | {r['density']:.1%} | {r['ppl']:.3f} | {r['ppl'] / r['ppl_dense'] - 1:+.2%} | "
                   f"{r['kl']:.4f} | {r['top1']:.1%} |")
    return "\n".join(out)


COLORS = {"uniform": "C0", "greedy": "C1"}


def plot(rows: list[dict], path: str, title: str) -> None:
    """Perplexity increase and KL against sparsity, one line per allocation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for alloc in ALLOCATIONS:
        rs = [r for r in rows if r["allocation"] == alloc]
        if not rs:
            continue
        x = [100 * r["sparsity"] for r in rs]
        a1.plot(x, [100 * (r["ppl"] / r["ppl_dense"] - 1) for r in rs], "o-", color=COLORS[alloc], label=alloc)
        a2.plot(x, [100 * r["top1"] for r in rs], "o-", color=COLORS[alloc], label=f"{alloc}: top-1")
    a1.axhline(2.0, color="grey", ls="--", lw=0.8, label="2% budget")
    a1.set_xlabel("FFN sparsity (% of neurons skipped)")
    a1.set_ylabel("held-out perplexity increase over dense (%)")
    a1.legend()
    a1.grid(alpha=0.3)
    a2.set_xlabel("FFN sparsity (% of neurons skipped)")
    a2.set_ylabel("top-1 agreement with dense (%)")
    ax = a2.twinx()
    for alloc in ALLOCATIONS:
        rs = [r for r in rows if r["allocation"] == alloc]
        if rs:
            ax.plot([100 * r["sparsity"] for r in rs], [r["kl"] for r in rs], "s:", color=COLORS[alloc], alpha=0.6,
                    label=f"{alloc}: KL")
    ax.set_ylabel("mean KL divergence to dense (nats)")
    h1, l1 = a2.get_legend_handles_labels()
    h2, l2 = ax.get_legend_handles_labels()
    a2.legend(h1 + h2, l1 + l2, loc="lower left")
    a2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-swiglu-kjv", help="HF model folder (with heldout.txt)")
    ap.add_argument("--sparsity", default="0,0.25,0.4,0.5,0.6,0.7", help="comma-separated levels")
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--calib-tokens", type=int, default=16384, help="as convert's default")
    ap.add_argument("--tokens", type=int, default=0, help="held-out tokens to score (0: all after the calibration)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=None, metavar="PNG", help="write the plot here (needs matplotlib)")
    ap.add_argument("--budget", type=float, default=None, metavar="P",
                    help="also convert with --max-ppl-increase P per allocation and report the result")
    args = ap.parse_args()
    levels = [float(v) for v in args.sparsity.split(",")]
    heldout = os.path.join(args.model, HELDOUT_FILE)
    if not os.path.isfile(heldout):
        sys.exit(f"error: {heldout} not found (the held-out text to evaluate on)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("error: --plot needs matplotlib (pip install matplotlib)")
    text = open(heldout, encoding="utf-8").read()
    tmp = tempfile.mkdtemp(prefix="eval-sparsity-")
    try:
        t0 = time.time()
        rep: list = []
        path = convert(args.model, os.path.join(tmp, "cal.gguf"), args.outtype, progress=False, sparse=True,
                       sparse_options=SparseOptions(sparsity=0.5, allocation="greedy", n_threads=args.threads,
                                                    calib_tokens=args.calib_tokens, keep_calibration=True),
                       report=rep)
        r0 = rep[0]
        n_cal, table, costs = r0.n_calib_tokens, r0.gate_table, r0.gate_costs
        print(f"calibrated on {n_cal} tokens in {time.time() - t0:.0f} s; layer KL curves (10%..90%):",
              flush=True)
        for l, c in enumerate(costs):
            print(f"  L{l}: " + " ".join(f"{v:.4f}" for v in c))
        with Model(path, n_ctx=16) as m:
            ids = m.tokenize(text)[n_cal:]
        if args.tokens:
            ids = ids[:args.tokens + 1]
        ev = GateEvaluator(path, 512, args.threads)
        rows = []
        n_layer = table.n_layer
        for alloc in ALLOCATIONS:
            for s in levels:
                lv = greedy_allocation(costs, s) if alloc == "greedy" else uniform_allocation(n_layer, s)
                r = ev.measure(ids, table.thresholds(lv))
                r.update(allocation=alloc, sparsity=s, levels=lv)
                rows.append(r)
                print(f"{alloc:7s} S={s:.2f}: ppl {r['ppl']:.3f} vs {r['ppl_dense']:.3f} "
                      f"({r['ppl'] / r['ppl_dense'] - 1:+.2%}), KL {r['kl']:.4f}, top-1 {r['top1']:.1%}, "
                      f"density {r['density']:.1%}", flush=True)
        print(f"\n{len(ids) - 1} held-out positions (after {n_cal} calibration tokens) of {heldout}, "
              f"{args.outtype}\n")
        print(table_md(rows))
        if args.plot:
            plot(rows, args.plot, f"gate-magnitude sparsity, {os.path.basename(os.path.normpath(args.model))} "
                                  f"({args.outtype}, {len(ids) - 1} held-out tokens)")
            print(f"wrote {args.plot}")
        if args.budget is not None:
            print()
            for alloc in ALLOCATIONS:
                rep = []
                bpath = convert(args.model, os.path.join(tmp, f"budget-{alloc}.gguf"), args.outtype, progress=False,
                                sparse=True, report=rep,
                                sparse_options=SparseOptions(max_ppl_increase=args.budget, allocation=alloc,
                                                             n_threads=args.threads, calib_tokens=args.calib_tokens))
                b = rep[0]
                r = GateEvaluator(bpath, 512, args.threads).measure(ids, b.gate_thresholds)
                print(f"budget {args.budget:.1%}, {alloc}: sparsity {b.gate_sparsity:.1%} "
                      f"(per layer {' / '.join(f'{v:.0%}' for v in b.gate_layer_sparsity)}; "
                      f"{len(b.budget_tried)} levels tried); on the calibration's held-out split "
                      f"{b.budget_result['ppl'] / b.budget_result['ppl_dense'] - 1:+.2%}; on the tokens after "
                      f"the calibration: ppl {r['ppl']:.3f} vs {r['ppl_dense']:.3f} "
                      f"({r['ppl'] / r['ppl_dense'] - 1:+.2%}), KL {r['kl']:.4f}, top-1 {r['top1']:.1%}, "
                      f"density {r['density']:.1%}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
