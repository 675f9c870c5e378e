#!/usr/bin/env python3
"""Sparse experts against dense experts: decode speed and bytes read per token.

    PYTHONPATH=python python tools/bench_sparse_experts.py \\
        --run dense=DENSE.gguf:dense --run exact=SPARSE.gguf:gate --run gate0.9=GATE.gguf:gate \\
        [--tokens 32] [--rounds 3] [--threads 1]

Each ``--run NAME=PATH:MODE`` loads the file and decodes the same held-out text one token
at a time in the FFN mode (after a short prompt), in rounds that alternate the runs (so
that load on a shared machine hits them alike). Reported per run: the FFN's and the whole
forward's weight bytes per decoded token, exact from the runtime's statistics (the same in
every round), the selected experts' up and down rows read per token, the process CPU
time per token (median over the rounds; CPU time, not wall time, because the machine is
shared), and the FFN's part of that CPU time, estimated as the CPU time times the FFN
stage's share of the forward's wall time in the runtime's statistics (preemption on a
shared machine stretches every stage alike; the stage times themselves are wall clock).
Writes a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
HELDOUT = REPO / "models" / "tiny-relu-kjv" / "heldout.txt"


def run_once(model, mode: str, prompt: list, toks: list, threads: int) -> dict:
    ctx = model.create_context(n_ctx=len(prompt) + len(toks) + 8, n_threads=threads, ffn=mode)
    try:
        ctx.eval(prompt)
        ctx.reset_stats()
        c0 = time.process_time()
        for t in toks:
            ctx.eval([t])
        cpu = time.process_time() - c0
        st = ctx.stats()
    finally:
        ctx.close()
    n = len(toks)
    return {"cpu_ms": 1e3 * cpu / n, "ffn_bytes": st["bytes"]["ffn"] / n,
            "bytes": sum(st["bytes"].values()) / n, "up_rows": st["n_up_rows"] / n,
            "down_rows": st["n_down_rows"] / n,
            # the FFN's share of the forward's wall time, applied to the CPU time (preemption
            # on a shared machine stretches every stage alike)
            "ffn_cpu_ms": 1e3 * cpu / n * st["time_s"]["ffn"] / max(sum(st["time_s"].values()), 1e-12)}


def main(argv=None) -> int:
    from powerinfer_cpp import Model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="NAME=PATH:MODE")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per run (default 32)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens before them (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="threads (default 1)")
    a = ap.parse_args(argv)
    runs = []
    for spec in a.run:
        name, rest = spec.split("=", 1)
        path, mode = rest.rsplit(":", 1)
        runs.append((name, path, mode))
    models = {p: Model(p, n_threads=a.threads) for _, p, _ in runs}
    try:
        first = next(iter(models.values()))
        ids = first.tokenize(HELDOUT.read_text(encoding="utf-8"))[1000:1000 + a.prompt + a.tokens]
        prompt, toks = ids[:a.prompt], ids[a.prompt:]
        res: dict = {name: [] for name, _, _ in runs}
        for r in range(a.rounds):
            for name, path, mode in runs:
                res[name].append(run_once(models[path], mode, prompt, toks, a.threads))
                print(f"round {r}: {name} {res[name][-1]['cpu_ms']:.1f} ms/token", file=sys.stderr)
        base = runs[0][0]
        b0 = res[base][0]
        cpu0 = statistics.median(x["cpu_ms"] for x in res[base])
        ffn0 = statistics.median(x["ffn_cpu_ms"] for x in res[base])
        info = first.info
        print(f"{info.n_layer} layers, {info.n_expert} experts of {info.n_ff_exp} (top {info.n_expert_used}), "
              f"d {info.n_embd}; {a.tokens} decoded tokens after {a.prompt}, {a.threads} thread(s), "
              f"median of {a.rounds} alternating rounds of process CPU time\n")
        print("| run | file mode | FFN MB/token | all MB/token | FFN bytes vs first | up rows/token | "
              "down rows/token | CPU ms/token | speed vs first | FFN CPU ms/token (est.) | FFN speed vs first |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, path, mode in runs:
            x = res[name][0]
            cpu = statistics.median(y["cpu_ms"] for y in res[name])
            ffn = statistics.median(y["ffn_cpu_ms"] for y in res[name])
            rows = (f"{x['up_rows']:.0f} | {x['down_rows']:.0f}" if mode != "dense" else "all | all")
            print(f"| {name} | {mode} | {x['ffn_bytes'] / 1e6:.2f} | {x['bytes'] / 1e6:.2f} | "
                  f"{x['ffn_bytes'] / b0['ffn_bytes']:.3f} | {rows} | "
                  f"{cpu:.1f} | {cpu0 / cpu:.2f}x | {ffn:.1f} | {ffn0 / ffn:.2f}x |")
    finally:
        for m in models.values():
            m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
