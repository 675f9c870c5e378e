"""What the server's prompt cache saves on a long prompt sent again: the prompt time of a
request whose long prefix is (a) in another slot that is generating (copied as a KV state),
(b) in the RAM cache after its slot moved on to another prompt, against (c) the same
length with nothing to reuse. Starts the server itself; prints a Markdown table for
docs/BENCHMARKS.md. Not a test.

    python tools/bench_prompt_cache.py -m MODEL.gguf --prefix 1500 --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import running_server  # noqa: E402


def complete(url, prompt, n=4, **kw):
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **kw})
    r.raise_for_status()
    t = r.json()["timings"]
    t["wall_ms"] = (time.perf_counter() - t0) * 1e3
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--prefix", type=int, default=1500, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=16, help="tokens after it, new each request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=2048)
    a = ap.parse_args(argv)

    import numpy as np

    rng = np.random.default_rng(0)
    lo = hi = 0

    def ids(n):  # ordinary tokens: special ones sit at a vocabulary's ends
        return [int(x) for x in rng.integers(lo, hi, n)]

    rows = {"cold (nothing to reuse)": [], "prefix in a generating slot": [],
            "prefix in the RAM cache": []}
    cached = {k: [] for k in rows}
    with running_server(a.model, "--parallel", "2", "--ctx", str(a.ctx), "-t",
                        str(a.threads), "--cache-ram", "256") as url:
        n_vocab = httpx.get(url + "/v1/models").json()["data"][0]["meta"]["n_vocab"]
        lo, hi = n_vocab // 20, n_vocab - n_vocab // 20
        complete(url, ids(32))  # warm up
        for _ in range(a.rounds):
            p = ids(a.prefix)
            t = complete(url, ids(a.prefix + a.suffix))
            rows["cold (nothing to reuse)"].append(t)
            cached["cold (nothing to reuse)"].append(t["cached_n"])
            # (a) slot X generates after p; the same p with another suffix goes to the other
            # slot, which copies the prefix
            with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
                    "prompt": p + ids(a.suffix), "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as s:
                lines = s.iter_lines()
                next(x for x in lines if x.startswith("data: "))
                t = complete(url, p + ids(a.suffix))
                for _ in lines:
                    pass
            assert t["cached_from"] and t["cached_from"].startswith("slot"), t
            rows["prefix in a generating slot"].append(t)
            cached["prefix in a generating slot"].append(t["cached_n"])
            # (b) both slots move on to other long prompts (p goes to the RAM cache), then p
            # comes back
            q1, q2 = ids(a.prefix), ids(a.prefix)
            with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
                    "prompt": q1, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as s:
                lines = s.iter_lines()
                next(x for x in lines if x.startswith("data: "))
                complete(url, q2)
                for _ in lines:
                    pass
            t = complete(url, p + ids(a.suffix))
            assert t["cached_from"] == "ram", t
            rows["prefix in the RAM cache"].append(t)
            cached["prefix in the RAM cache"].append(t["cached_n"])
    def med(v, key):
        return statistics.median(x[key] for x in v)

    cold = med(rows["cold (nothing to reuse)"], "wall_ms")
    print(f"\n{a.prefix}-token prefix + {a.suffix} new tokens, 4 tokens generated, "
          f"`--parallel 2 -t {a.threads}`, {a.rounds} rounds, medians\n")
    print("| request | tokens reused | prompt ms | prefix copy ms | request ms (client) | "
          "vs cold |")
    print("|---|---|---|---|---|---|")
    for k, v in rows.items():
        wall = med(v, "wall_ms")
        print(f"| {k} | {int(statistics.median(cached[k]))} | {med(v, 'prompt_ms'):.1f} | "
              f"{med(v, 'cache_ms'):.1f} | {wall:.1f} | {cold / wall:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
