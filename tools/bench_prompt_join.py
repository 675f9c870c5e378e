"""What a joining prompt costs a decoding generation, per scheduler step, in process (no
server, no HTTP): generation A decodes while generation B reads a prompt in chunks of a
token budget per step, either as the server did before (B's chunk in a pass of its own, then
A's token in another: two weight reads per step) or in ONE mixed pass (eval_batch: A's token
and budget - 1 prompt tokens together). Reports per budget A's gap between tokens (the step's
time: max and mean), B's whole prompt time, and the weight bytes read per step (the
runtime's statistics: exact, whatever the machine's load).

    python tools/bench_prompt_join.py MODEL.gguf --budgets 16,64,256 --prompt 256

Times are this thread's CPU time with one thread per pass (the pass runs on the calling
thread), so that a machine shared with other work changes them less than wall-clock time.
Not a test: it prints a Markdown table for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from powerinfer_cpp import Model
from powerinfer_cpp.model import eval_batch


def one_join(m, prompt: list[int], budget: int, mixed: bool) -> dict:
    """A decoding, B's prompt read in steps of `budget` tokens; per-step CPU times."""
    a, b = m.create_context(n_ctx=len(prompt) + 256), m.create_context(n_ctx=len(prompt) + 8)
    try:
        ga = a.start_generation("And God said", max_tokens=len(prompt) + 64, temperature=0,
                                ignore_eos=True)
        ga.prefill()
        ga.sample()
        gb = b.start_generation(prompt, max_tokens=1, temperature=0)
        a.reset_stats()
        b.reset_stats()
        gaps = []
        while not gb.prefilled:
            t0 = time.thread_time()
            if mixed:
                eval_batch([ga, gb], budget - 1)
            else:
                gb.prefill(budget)
                ga.step()
            ga.sample()
            gaps.append(time.thread_time() - t0)
        read = sum(sum(c.stats()["bytes"].values()) for c in (a, b))
        return {"max": max(gaps), "mean": statistics.mean(gaps), "total": sum(gaps),
                "steps": len(gaps), "bytes": read / len(gaps)}
    finally:
        a.close()
        b.close()


def main(argv=None) -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--budgets", default="16,64,256", help="tokens per step")
    ap.add_argument("--prompt", type=int, default=256, help="B's prompt tokens")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds (medians)")
    args = ap.parse_args(argv)
    with Model(args.model, n_ctx=args.prompt + 256, n_threads=1, ffn="dense") as m:
        rng = np.random.default_rng(0)
        prompt = [int(x) for x in rng.integers(100, m.n_vocab - 1, size=args.prompt)]
        print(f"\nB's prompt: {args.prompt} tokens; CPU ms per step, 1 thread; medians of "
              f"{args.rounds} alternated rounds\n")
        print("| budget | scheduler | steps | A's largest gap (ms) | A's mean gap (ms) | "
              "B's prompt (ms) | weights read per step (MB) |")
        print("|---|---|---|---|---|---|---|")
        for budget in (int(x) for x in args.budgets.split(",")):
            runs = {False: [], True: []}
            for _ in range(args.rounds):
                for mixed in (False, True):
                    runs[mixed].append(one_join(m, prompt, budget, mixed))
            for mixed in (False, True):
                med = {k: statistics.median(r[k] for r in runs[mixed])
                       for k in ("max", "mean", "total", "bytes")}
                name = "one mixed pass" if mixed else "chunk pass + decode pass"
                print(f"| {budget} | {name} | {runs[mixed][0]['steps']} | {med['max'] * 1e3:.1f} | "
                      f"{med['mean'] * 1e3:.1f} | {med['total'] * 1e3:.0f} | "
                      f"{med['bytes'] / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
