#!/usr/bin/env python3
"""Quality of sparse files against their dense model, the way llama.cpp's
`llama-perplexity --kl-divergence` reports a quantized file against its base (not a test).

The harness: a dense GGUF and one or more sparse ones of the same model (or one file under
several FFN modes), scored on held-out text by decoding it one token at a time, so every
position runs the decode path, the one the sparse modes change (a batch longer than the
context's sparse batch limit runs the dense FFN, which would hide the loss). Per run:

    perplexity, and its ratio to the dense run's (exp of the mean per-token loss difference)
    mean KL(dense || sparse) of the next-token distributions, its 99.9% quantile, max
    same top token: the share of positions whose argmax equals the dense one
    weight bytes read per token (the runtime's stats, per stage), FFN and input densities

standard errors are those of means of independent tokens, as llama.cpp computes them (they
understate the spread a little: neighbouring tokens' losses are correlated). The text is cut
into windows of --window tokens, each decoded from an empty cache, every position after a
window's first token scored (llama.cpp scores only each chunk's second half; here every
position counts, the short-context ones too). Both runs use an f32 KV cache, so the
difference is the sparse mode's alone. Output: a markdown table and, with --json, every number.

    PYTHONPATH=python python tools/eval_sparsity.py --dense DENSE.gguf --text HELDOUT.txt
        [--tokens 1024] [--window 512] [--manifest DIR/manifest.json] [RUN ...]
        [--json out.json] [--md out.md]

RUN: [LABEL=]PATH[@MODE] (MODE: the FFN mode, default the file's own, e.g. gate or sparse;
@MODE,noinput runs it without input sparsity). --manifest adds every file
tools/make_frontier_files.py made, labelled by method and level. The text must be disjoint
from the calibration's.

The older sweep of gate-magnitude sparsity over an HF model folder (one calibration, each
level patched in, scored with batched windows run through the sparse FFN) stays:

    PYTHONPATH=python python tools/eval_sparsity.py [--model models/tiny-swiglu-kjv]
        [--sparsity 0,0.25,0.4,0.5,0.6,0.7] [--outtype f16] [--tokens 0]
        [--plot docs/img/gate_sparsity_swiglu.png] [--budget 0.02]

--budget also converts with the default quality budget (per allocation) and reports the
sparsity it chose and its quality on the same held-out tokens. matplotlib is needed for
--plot only (a dev tool; the package does not depend on it).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from powerinfer_cpp import Model
from powerinfer_cpp.convert import convert
from powerinfer_cpp.sparse.gate_eval import GateEvaluator, log_softmax
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


# -- the harness: metrics ------------------------------------------------------

#: KL quantiles reported (llama.cpp prints these among others).
KL_QUANTILES = (0.5, 0.9, 0.99, 0.999)


def token_metrics(ld: np.ndarray, lg: np.ndarray, targets) -> dict:
    """Per position, from log-probability rows of the dense (ld) and the sparse (lg) run
    [n, n_vocab] and the next tokens: nll_dense, nll, kl (KL(dense || sparse)), same_top."""
    ld = np.asarray(ld, dtype=np.float64)
    lg = np.asarray(lg, dtype=np.float64)
    t = np.asarray(targets, dtype=np.int64)
    i = np.arange(len(t))
    return {"nll_dense": -ld[i, t], "nll": -lg[i, t],
            "kl": (np.exp(ld) * (ld - lg)).sum(axis=1),
            "same_top": (ld.argmax(axis=1) == lg.argmax(axis=1)).astype(np.float64)}


def _se(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def summarize(m: dict) -> dict:
    """The report of per-position metrics (token_metrics' keys, concatenated over runs)."""
    nll, nll_d, kl, top = (np.asarray(m[k], dtype=np.float64) for k in ("nll", "nll_dense", "kl", "same_top"))
    diff = nll - nll_d
    ratio = math.exp(float(diff.mean()))
    out = {"n": int(len(nll)),
           "ppl": math.exp(float(nll.mean())), "ppl_dense": math.exp(float(nll_d.mean())),
           "ppl_ratio": ratio, "ppl_ratio_se": ratio * _se(diff),  # d exp(u) = exp(u) du
           "kl_mean": float(kl.mean()), "kl_mean_se": _se(kl), "kl_max": float(kl.max()),
           "top1": float(top.mean()), "top1_se": _se(top)}
    for q in KL_QUANTILES:
        out[f"kl_q{q * 100:g}"] = float(np.quantile(kl, q))
    return out


# -- the harness: decoding -----------------------------------------------------

def windows(ids, window: int):
    """(start, tokens) of each window: `window` scored positions, the next token included."""
    for s in range(0, len(ids) - 1, window):
        w = list(ids[s:s + window + 1])
        if len(w) >= 2:
            yield s, w


def decode(path: str, ids, window: int, threads: int, ffn: str = "dense", input_sparse: bool | None = None,
           row=None) -> dict:
    """Decode ids one token at a time (windows from an empty cache) in the given FFN mode
    ("file": the file's own mode) and call row(position, log-probs of the next token) for each;
    returns the context's stats. Raises if a sparse mode did not run on every token."""
    with Model(path, n_ctx=window, n_threads=threads, cache_type="f32") as m:
        inp = input_sparse if m.info.has_input_sparsity else None
        ctx = m.create_context(n_ctx=window, n_threads=threads, cache_type="f32", ffn=ffn, input_sparse=inp)
        try:
            for s, w in windows(ids, window):
                ctx.reset()
                for j, t in enumerate(w[:-1]):
                    row(s + j, log_softmax(ctx.eval([t])[None, :])[0])
            st = ctx.stats()
            st["ffn_mode_run"] = ctx.ffn_mode
            st["input_sparse_run"] = bool(inp)
        finally:
            ctx.close()
    if st["ffn_mode_run"] != "dense" and st["n_sparse_tokens"] != st["n_tokens"]:
        raise RuntimeError(f"{path}: {st['n_sparse_tokens']} of {st['n_tokens']} tokens ran the sparse FFN")
    return st


def dense_reference(path: str, ids, window: int, threads: int) -> tuple[np.ndarray, dict]:
    """Dense log-probs [len(ids) - 1, n_vocab] (float32: 4 bytes a logit is enough for KL of
    1e-4 and up, and halves the memory) and the dense run's stats."""
    with Model(path, n_ctx=16) as m:
        nv = m.n_vocab
    out = np.empty((len(ids) - 1, nv), dtype=np.float32)

    def row(i, lp):
        out[i] = lp
    st = decode(path, ids, window, threads, "dense", False, row)
    return out, st


def evaluate(path: str, ids, ref: np.ndarray, window: int, threads: int, ffn: str = "file",
             input_sparse: bool | None = True) -> dict:
    """summarize() of the file's decode against the dense log-probs ref, with the run's
    weight bytes per token (total and per stage), FFN density and input densities."""
    tgt = np.asarray(ids[1:], dtype=np.int64)
    acc = {k: np.zeros(len(tgt)) for k in ("nll_dense", "nll", "kl", "same_top")}

    def row(i, lp):
        m = token_metrics(ref[i:i + 1], lp[None, :], tgt[i:i + 1])
        for k, v in m.items():
            acc[k][i] = v[0]
    st = decode(path, ids, window, threads, ffn, input_sparse, row)
    r = summarize(acc)
    ins = st["input_sparse"]
    r.update(ffn_mode=st["ffn_mode_run"], input_sparse=st["input_sparse_run"],
             bytes_per_token=float(st["bytes_per_token"]), bytes_per_token_stage=st["bytes_per_token_stage"],
             # (the dense mode counts no neurons: all of them ran)
             ffn_density=float(st["density"]) if st["ffn_mode_run"] != "dense" else 1.0,
             attention_input_density=float(ins["attention_density"]) if ins["attention_inputs"] else 1.0,
             head_input_density=float(ins["head_density"]) if ins["head_inputs"] else 1.0)
    return r


def parse_run(spec: str) -> dict:
    """[LABEL=]PATH[@MODE[,noinput]] -> {label, path, ffn, input_sparse}."""
    label, _, rest = spec.rpartition("=") if "=" in spec else ("", "", spec)
    path, _, mode = rest.partition("@")
    opts = [o for o in mode.split(",") if o]
    ffn = next((o for o in opts if o != "noinput"), "file")
    return {"label": label or os.path.basename(path), "path": path, "ffn": ffn,
            "input_sparse": "noinput" not in opts}


def harness_md(dense: dict, rows: list[dict]) -> str:
    """The markdown table: one row per run, dense first."""
    out = ["| run | FFN density | attn / head input density | weight MB / token | vs dense | PPL | PPL ratio | "
           "mean KL | KL 99.9% | same top |", "|---|---|---|---|---|---|---|---|---|---|"]
    b0 = dense["bytes_per_token"]
    out.append(f"| dense | 100% | 100% / 100% | {b0 / 1e6:.1f} | 1.000 | {dense['ppl']:.3f} | 1 | 0 | 0 | 100% |")
    for r in rows:
        out.append(f"| {r['label']} | {r['ffn_density']:.1%} | {r['attention_input_density']:.1%} / "
                   f"{r['head_input_density']:.1%} | {r['bytes_per_token'] / 1e6:.1f} | "
                   f"{r['bytes_per_token'] / b0:.3f} | {r['ppl']:.3f} | {r['ppl_ratio']:.4f} ± "
                   f"{r['ppl_ratio_se']:.4f} | {r['kl_mean']:.4f} ± {r['kl_mean_se']:.4f} | {r['kl_q99.9']:.3f} | "
                   f"{r['top1']:.1%} ± {r['top1_se']:.1%} |")
    return "\n".join(out)


def crossing(levels, values, limit: float, origin: bool = True) -> float | None:
    """The level where values (measured at ascending levels; with origin, level 0 = value 0
    implied) first exceed limit, linearly interpolated; None when no measured level does,
    nan when the first one does and there is no origin to interpolate from."""
    xs = ([0.0] if origin else []) + [float(v) for v in levels]
    ys = ([0.0] if origin else []) + [float(v) for v in values]
    if not origin and ys[0] > limit:
        return math.nan
    for i in range(1, len(xs)):
        if ys[i] > limit:
            return xs[i - 1] + (limit - ys[i - 1]) * (xs[i] - xs[i - 1]) / (ys[i] - ys[i - 1])
    return None


#: Quality budgets reported per method: (perplexity increase, mean KL).
BUDGETS = ((0.02, 0.02), (0.05, 0.05))


def levels_md(rows: list[dict]) -> str:
    """Per method with several levels: the level at each budget, interpolated between the
    measured ones, by perplexity and by KL, and the weight bytes there (interpolated too)."""
    by: dict = {}
    for r in rows:
        if "meta" in r and isinstance(r["meta"].get("level"), (int, float)):
            by.setdefault(r["meta"]["method"], []).append(r)
    out = ["| method | " + " | ".join(f"level at +{p:.0%} PPL / at KL {k:g} | bytes vs dense there"
                                      for p, k in BUDGETS) + " |",
           "|---|" + "---|---|" * len(BUDGETS)]
    for meth, rs in by.items():
        if len(rs) < 2:
            continue
        rs = sorted(rs, key=lambda r: r["meta"]["level"])
        lv = [r["meta"]["level"] for r in rs]
        # a method on top of another (a gate level under input levels) is not dense at level 0
        origin = "gate_level" not in rs[0]["meta"]
        cells = []
        for p, k in BUDGETS:
            a = crossing(lv, [r["ppl_ratio"] - 1 for r in rs], p, origin)
            b = crossing(lv, [r["kl_mean"] for r in rs], k, origin)
            both = [v for v in (a, b) if v is not None and not math.isnan(v)]
            s = None if any(v is not None and math.isnan(v) for v in (a, b)) else min(both) if both else None
            rel = [r["bytes_per_token"] / r["dense_bytes_per_token"] for r in rs]
            x0, y0 = ([0.0], [1.0]) if origin else ([], [])
            by_s = "" if s is None else f"{float(np.interp(s, x0 + lv, y0 + rel)):.3f}"

            def fmt(v):
                return f"> {lv[-1]:.0%}" if v is None else f"< {lv[0]:.0%}" if math.isnan(v) else f"{v:.1%}"
            cells.append(f"{fmt(a)} / {fmt(b)} | {by_s or 'n/a'}")
        out.append(f"| {meth} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def harness(args) -> int:
    """--dense mode: score each run against the dense file on the held-out text."""
    import json

    runs = [parse_run(s) for s in args.runs]
    if args.manifest:
        man = json.load(open(args.manifest))
        for p, meta in man["files"].items():
            if args.match and not any(m in f"{meta['method']} {meta['level']:g}" for m in args.match.split(",")):
                continue
            runs.append({"label": f"{meta['method']} {meta['level']:g}", "path": p, "ffn": "file",
                         "input_sparse": True, "meta": meta})
    text = open(args.text, encoding="utf-8").read()
    with Model(args.dense, n_ctx=16) as m:
        ids = m.tokenize(text)
    if args.tokens:
        ids = ids[:args.tokens + 1]
    t0 = time.time()
    cache = args.ref_cache
    key = {"dense": os.path.abspath(args.dense), "ids": [int(t) for t in ids], "window": args.window}
    if cache and os.path.exists(cache + ".json") and json.load(open(cache + ".json"))["key"] == key:
        # the same dense file, tokens and windows: its log-probs do not change between sweeps
        ref, st = np.load(cache + ".npy", mmap_mode="r"), json.load(open(cache + ".json"))["stats"]
    else:
        ref, st = dense_reference(args.dense, ids, args.window, args.threads)
        if cache:
            np.save(cache + ".npy", ref)
            json.dump({"key": key, "stats": st}, open(cache + ".json", "w"))
    dense = {"path": args.dense, "bytes_per_token": float(st["bytes_per_token"]),
             "bytes_per_token_stage": st["bytes_per_token_stage"]}
    dense["ppl"] = math.exp(float(-ref[np.arange(len(ids) - 1), np.asarray(ids[1:])].astype(np.float64).mean()))
    print(f"dense: ppl {dense['ppl']:.3f}, {dense['bytes_per_token'] / 1e6:.1f} MB/token "
          f"({len(ids) - 1} positions, {time.time() - t0:.0f} s)", flush=True)
    rows = []
    report = {"text": args.text, "n_positions": len(ids) - 1, "window": args.window, "dense": dense, "runs": rows}
    for run in runs:
        t0 = time.time()
        r = evaluate(run["path"], ids, ref, args.window, args.threads, run["ffn"], run["input_sparse"])
        r.update({k: v for k, v in run.items()})
        r["dense_bytes_per_token"] = dense["bytes_per_token"]
        rows.append(r)
        print(f"{r['label']}: ppl x{r['ppl_ratio']:.4f}, KL {r['kl_mean']:.4f} (99.9% {r['kl_q99.9']:.3f}), "
              f"top-1 {r['top1']:.1%}, {r['bytes_per_token'] / dense['bytes_per_token']:.3f} of dense bytes "
              f"({time.time() - t0:.0f} s)", flush=True)
        if args.json:  # after every run: a long sweep keeps what it measured
            json.dump(report, open(args.json, "w"), indent=1)
    md = harness_md(dense, rows) + "\n\n" + levels_md(rows)
    print()
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    return 0


def merge(paths: list[str]) -> int:
    """The tables of several harness runs (sweeps made at different times, one dense run)."""
    import json

    reps = [json.load(open(p)) for p in paths]
    for r in reps[1:]:
        if r["dense"] != reps[0]["dense"] or r["n_positions"] != reps[0]["n_positions"]:
            sys.exit(f"error: {paths[0]} and another file were not scored against the same dense run")
    rows = [row for r in reps for row in r["runs"]]
    print(harness_md(reps[0]["dense"], rows) + "\n\n" + levels_md(rows))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-swiglu-kjv", help="HF model folder (with heldout.txt)")
    ap.add_argument("--sparsity", default="0,0.25,0.4,0.5,0.6,0.7", help="comma-separated levels")
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--calib-tokens", type=int, default=16384, help="as convert's default")
    ap.add_argument("--tokens", type=int, default=0, help="held-out tokens to score (0: all; for the sweep: all after the calibration)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=None, metavar="PNG", help="write the plot here (needs matplotlib)")
    ap.add_argument("--budget", type=float, default=None, metavar="P",
                    help="also convert with --max-ppl-increase P per allocation and report the result")
    ap.add_argument("--dense", default=None, metavar="GGUF",
                    help="the harness: score RUNs against this dense file on --text, decoding token by token")
    ap.add_argument("runs", nargs="*", metavar="RUN", help="[LABEL=]PATH[@MODE[,noinput]] (with --dense)")
    ap.add_argument("--text", default=None, help="held-out text (with --dense; disjoint from the calibration's)")
    ap.add_argument("--window", type=int, default=512, help="tokens decoded from an empty cache (with --dense)")
    ap.add_argument("--manifest", default=None, help="tools/make_frontier_files.py's manifest.json (with --dense)")
    ap.add_argument("--match", default=None, metavar="S,...",
                    help="only the manifest's files whose label (method and level) contains one of these")
    ap.add_argument("--json", default=None, help="write every number here (with --dense)")
    ap.add_argument("--ref-cache", default=None, metavar="STEM",
                    help="keep the dense log-probs in STEM.npy / STEM.json and reuse them while the dense "
                         "file, tokens and window are the same (several sweeps, one dense run)")
    ap.add_argument("--md", default=None, help="write the markdown table here (with --dense)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="print the tables of several --json outputs of one dense run together")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge)
    if args.dense:
        if not args.text:
            sys.exit("error: --dense needs --text (held-out text)")
        return harness(args)
    return sweep(args)


def sweep(args) -> int:
    """The gate-magnitude sweep over an HF model folder (see the module's doc)."""
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
