"""A/B of speculative slots under the batching scheduler: the server's process CPU time and
wall time for N concurrent greedy speculative requests, this checkout's Python package
against another revision's (git archive of its python/ and the header), alternated, on the
same native library; the replies must be equal.

    python tools/bench_spec_batching.py -m MODEL-gate.gguf --base 250f470 --reps 2

MODEL must have a sparse mode to draft with (--draft self): a file converted with gate
thresholds (--sparsity) or predictors. CPU time is the measure to compare on a shared
machine (wall time includes waiting for a core). Not a test: it prints one line per run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["And God said", "In the beginning", "And Jesus said unto them", "The LORD is my",
           "Blessed are the", "And the king", "Thus saith the LORD", "For God so loved"]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(pythonpath: str, args) -> tuple[float, float, int, list[str]]:
    """(server CPU s, wall s, batched passes, replies) of one batch of concurrent requests."""
    port = _port()
    env = dict(os.environ, PYTHONPATH=pythonpath)
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerinfer_cpp.server", "-m", args.model, "--port", str(port),
         "--parallel", str(args.clients), "-t", "1", "--ctx", str(args.ctx), "--draft", "self",
         "--draft-max", str(args.draft_max)], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError(f"the server ({pythonpath}) exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

        def ask(prompt):
            r = httpx.post(url + "/v1/completions", timeout=900, json={
                "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        ask("warm up")
        c0, t0 = _cpu_s(proc.pid), time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as ex:
            texts = list(ex.map(ask, PROMPTS[:args.clients]))
        c1, t1 = _cpu_s(proc.pid), time.perf_counter()
        steps = next(int(float(line.split()[1])) for line in
                     httpx.get(url + "/metrics").text.splitlines()
                     if line.startswith("powerinfer_batched_steps_total "))
        return c1 - c0, t1 - t0, steps, texts
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if not 1 <= args.clients <= len(PROMPTS):
        ap.error(f"--clients must be in [1, {len(PROMPTS)}]")
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base, "python",
                                  "ggml-hybrid/include"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        paths = {args.base: str(Path(tmp) / "python"), "this checkout": str(REPO / "python")}
        replies = {}
        for _ in range(args.reps):
            for name, path in paths.items():
                cpu, wall, steps, texts = run(path, args)
                replies.setdefault(name, texts)
                n = args.clients * args.max_tokens
                print(f"{name:>14}: server CPU {cpu:.2f} s, wall {wall:.2f} s for {n} tokens, "
                      f"batched passes {steps}", flush=True)
        same = len({tuple(t) for t in replies.values()}) == 1
        print("replies equal" if same else "REPLIES DIFFER")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
