"""Load test of the OpenAI-compatible server: requests/s, tokens/s, time to first token
and per-token latency at several numbers of concurrent clients.

    python tools/load_test.py -m MODEL.gguf --parallel 4 --threads 2 --clients 1,2,4
    python tools/load_test.py -m MODEL.gguf --parallel 4 --threads 2 --no-cont-batching
    python tools/load_test.py --url http://127.0.0.1:8080 --clients 1,4   # a running server
    python tools/load_test.py -m MODEL.gguf --parallel 2 --threads 2 --ctx 2048 --join 1500

Each client sends its requests one after another (streamed /v1/completions, greedy, the
same number of tokens each, prompts varied per request), and times every chunk; the
tokens/s column is the aggregate over all clients (continuous batching should make it grow
with the clients; --no-cont-batching starts the server with a thread per slot instead, for
the comparison). With -m the tool starts the server itself on a free port and also
measures the Python API's decode speed on the same file and thread count, alternated with
one-client server requests (the reference for the server's decode), and a chat turn over a
cached history against the same new message sent alone. --join N measures instead how much
a long prompt joining stalls a client that is decoding: client A streams; after its 8th
token client B sends a prompt of about N tokens; A's largest gap between two tokens while
B's prompt is read (until B's first token) against A's median gap before B came.
Not a test: it prints a Markdown table for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPTS = ["And God said", "In the beginning", "And Jesus said unto them", "The LORD is my",
           "Blessed are the", "And the king", "Thus saith the LORD", "For God so loved"]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; nan for no data."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int,
                headers: dict) -> dict:
    """One streamed completion: time to first token, time per later token, tokens."""
    try:
        return _one_request(client, url, prompt, max_tokens, headers)
    except httpx.RemoteProtocolError:
        # the server closed a kept-alive connection before answering (llama-server does
        # after some requests): the request never started, so send it again
        return _one_request(client, url, prompt, max_tokens, headers)


def _one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int,
                 headers: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, last, n_tokens, server_tps = None, None, 0, None
    with client.stream("POST", url + "/v1/completions", json=body, headers=headers,
                       timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("timings"):
                server_tps = chunk["timings"]["predicted_per_second"]
            if chunk.get("usage"):
                n_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                if first is None:
                    first = last
    # time per output token after the first (the server may send several in one chunk)
    tpot = (last - first) / (n_tokens - 1) if first is not None and n_tokens > 1 else None
    return {"ttft": (first or time.perf_counter()) - t0, "tpot": tpot, "tokens": n_tokens,
            "server_tps": server_tps,
            "total": time.perf_counter() - t0}


def run_level(url: str, clients: int, requests: int, max_tokens: int, headers: dict) -> dict:
    """`clients` clients, each sending `requests` requests in a row."""
    def client_loop(i):
        out = []
        with httpx.Client() as c:
            for k in range(requests):
                out.append(one_request(c, url, PROMPTS[(i + k) % len(PROMPTS)] + f" {k}",
                                       max_tokens, headers))
        return out

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as ex:
        results = [r for f in [ex.submit(client_loop, i) for i in range(clients)]
                   for r in f.result()]
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    gaps = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "wall_s": wall,
            "req_per_s": len(results) / wall, "tok_per_s": tokens / wall,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "tpot_p50_ms": percentile(gaps, 50) * 1e3, "tpot_p99_ms": percentile(gaps, 99) * 1e3,
            "server_tok_s": statistics.median(r["server_tps"] for r in results),
            # median, since a client that is late to read gets a burst of chunks at once
            "per_client_tok_s": statistics.median(1 / t for t in gaps if t > 0)}


def chat_turn_ttft(url: str, headers: dict, repeats: int = 9) -> dict:
    """Time to first token of a chat turn after a long history (cached in the slot) and of
    the new message alone (nothing cached, same new text), medians of `repeats`."""
    history = []
    for i in range(6):
        history += [{"role": "user", "content": f"{PROMPTS[i]}, what then?"},
                    {"role": "assistant", "content": "And the LORD spake unto Moses, saying, "
                     "Speak unto the children of Israel. " * 2}]

    client = httpx.Client()  # one connection: a new one per request adds its own latency

    def ttft(messages, max_tokens=1):
        try:
            return ttft_once(messages, max_tokens)
        except httpx.RemoteProtocolError:
            # a server may close a kept-alive connection after some requests (llama-server
            # does): the request never started, so send it again on a new connection
            return ttft_once(messages, max_tokens)

    def ttft_once(messages, max_tokens):
        t0 = time.perf_counter()
        with client.stream("POST", url + "/v1/chat/completions", headers=headers, timeout=120,
                           json={"messages": messages, "max_tokens": max_tokens,
                                 "temperature": 0, "stream": True}) as r:
            first, prompt_ms, counts = None, float("nan"), (0, 0)
            for line in r.iter_lines():  # to the end: the slot is free again for the next turn
                if first is None and line.startswith("data: ") and '"content": "' in line \
                        and '"content": ""' not in line:
                    first = time.perf_counter() - t0
                if '"timings"' in line:
                    tm = json.loads(line[6:])["timings"]
                    # llama-server names the reused count cache_n
                    prompt_ms, counts = tm["prompt_ms"], (tm["prompt_n"], tm.get("cached_n", tm.get("cache_n", 0)))
        return (first if first is not None else time.perf_counter() - t0), prompt_ms, counts

    cached, alone, cached_eval, alone_eval = [], [], [], []
    for k in range(repeats):
        new = {"role": "user", "content": f"And what of the {['light', 'sea', 'land', 'stars', 'night'][k % 5]}?"}
        ttft(history)                                  # the history is now in a slot's cache
        t, e, cached_n = ttft(history + [new])
        cached.append(t)
        cached_eval.append(e)
        # a first message of its own each round, so that nothing but BOS and the role
        # header can come from a cache: the cost of the new message by itself
        t, e, alone_n = ttft([{"role": "user", "content": "QZJXVK"[k % 6] * (k + 1)}, new])
        alone.append(t)
        alone_eval.append(e)
    return {"cached_ms": statistics.median(cached) * 1e3,
            "alone_ms": statistics.median(alone) * 1e3,
            "cached_eval_ms": statistics.median(cached_eval),
            "alone_eval_ms": statistics.median(alone_eval),
            "cached_n": cached_n, "alone_n": alone_n}  # (prompt tokens, cached), last round


def decode_vs_python_api(url: str, headers: dict, model: str, threads: int,
                         max_tokens: int, rounds: int = 7) -> tuple[float, float, float]:
    """Decode tokens/s of Model.generate on the same file and of a one-client, non-streamed
    server request, alternated so that both see the same machine load (the client waits
    idle meanwhile); medians, and the median of the per-round ratios."""
    from powerinfer_cpp import Model

    api, srv, ratio = [], [], []
    with Model(model, n_threads=threads) as m, httpx.Client() as c:
        for i in range(rounds):
            p = PROMPTS[i % len(PROMPTS)]
            a = m.generate(p, max_tokens=max_tokens, temperature=0,
                           ignore_eos=True).timings["decode_tok_per_s"]
            r = c.post(url + "/v1/completions", headers=headers, timeout=300, json={
                "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}).json()["timings"]["predicted_per_second"]
            api.append(a)
            srv.append(r)
            ratio.append(r / a)
    return statistics.median(api), statistics.median(srv), statistics.median(ratio)


def join_stall(url: str, headers: dict, n_prompt: int, rounds: int = 3) -> list[dict]:
    """Per round: A's median gap between tokens before B joins, A's largest gap while B's
    prompt (about n_prompt tokens) is read, B's prompt tokens and time to first token."""
    long_prompt = "And it came to pass, that the sons of God saw the daughters of men. " * \
        max(1, n_prompt // 16)
    out = []
    for k in range(rounds):
        times: list[float] = []
        started = concurrent.futures.Future()

        def client_a():
            body = {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": 160, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            with httpx.Client() as c, c.stream("POST", url + "/v1/completions", json=body,
                                               headers=headers, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and \
                            json.loads(line[6:]).get("choices"):
                        times.append(time.perf_counter())
                        if len(times) == 8:
                            started.set_result(None)

        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            a = ex.submit(client_a)
            started.result(timeout=600)
            t_join = time.perf_counter()
            b = one_request(httpx.Client(), url, long_prompt + f" {k}", 2, headers)
            t_first = t_join + b["ttft"]
            usage = httpx.post(url + "/v1/completions", headers=headers, timeout=600, json={
                "prompt": long_prompt + f" {k}", "max_tokens": 1}).json()["usage"]
            a.result()
        gaps = [(t1 - t0, t0, t1) for t0, t1 in zip(times, times[1:])]
        before = [g for g, _, t1 in gaps if t1 <= t_join]
        during = [g for g, t0, t1 in gaps if t1 > t_join and t0 < t_first]
        out.append({"base_ms": statistics.median(before) * 1e3,
                    "max_ms": max(during, default=float("nan")) * 1e3,
                    "n_during": len(during), "prompt_tokens": usage["prompt_tokens"],
                    "ttft_ms": b["ttft"] * 1e3})
    return out


def main(argv=None) -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("-m", "--model", help="GGUF file: start a server for it")
    src.add_argument("--url", help="a running server")
    ap.add_argument("--parallel", type=int, default=2, help="slots of the started server")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of a forward pass (with --no-cont-batching: per slot)")
    ap.add_argument("--no-cont-batching", action="store_true",
                    help="start the server with --no-cont-batching (a thread per slot)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--clients", default="1,2,4,8", help="concurrency levels")
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default=os.environ.get("POWERINFER_API_KEY"))
    ap.add_argument("--join", type=int, default=0, metavar="N",
                    help="measure instead the stall a prompt of about N tokens joining causes "
                         "a decoding client (see above)")
    ap.add_argument("--prompt-chunk", type=int, default=0,
                    help="the started server's --prompt-chunk (0: its default)")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc = None
    url = args.url
    if args.model:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "powerinfer_cpp.server", "-m", args.model, "--port",
             str(port), "--parallel", str(args.parallel), "-t", str(args.threads), "--ctx",
             str(args.ctx), "--queue", "64"] + (["--api-key", args.api_key] if args.api_key
                                                else [])
            + (["--no-cont-batching"] if args.no_cont_batching else [])
            + (["--prompt-chunk", str(args.prompt_chunk)] if args.prompt_chunk else []))
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
    if args.join:
        try:
            one_request(httpx.Client(), url, "warm up", 8, headers)
            rows = join_stall(url, headers, args.join)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        print("\n| round | B's prompt tokens | A's median gap before (ms) | A's largest gap "
              "while B's prompt is read (ms) | A's tokens meanwhile | B's TTFT (ms) |")
        print("|---|---|---|---|---|---|")
        for i, r in enumerate(rows):
            print(f"| {i + 1} | {r['prompt_tokens']} | {r['base_ms']:.1f} | {r['max_ms']:.1f} "
                  f"| {r['n_during']} | {r['ttft_ms']:.0f} |")
        return 0
    try:
        one_request(httpx.Client(), url, "warm up", 8, headers)
        rows = [run_level(url, int(c), args.requests, args.max_tokens, headers)
                for c in args.clients.split(",")]
        has_chat = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code == 200
        chat = chat_turn_ttft(url, headers) if has_chat else None  # no chat template: skip
        ref = decode_vs_python_api(url, headers, args.model, args.threads, args.max_tokens) \
            if args.model else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    mode = ("" if not args.model else ", server with --no-cont-batching"
            if args.no_cont_batching else ", server with continuous batching")
    print(f"\n{args.requests} streamed requests per client, {args.max_tokens} tokens each "
          f"(greedy, EOS ignored{mode})\n")
    print("| clients | requests/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | per-token p50 (ms)"
          " | per-token p99 (ms) | decode per client (tokens/s) | decode in the server (tokens/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.0f} | "
              f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['tpot_p50_ms']:.2f} | "
              f"{r['tpot_p99_ms']:.2f} | {r['per_client_tok_s']:.0f} | {r['server_tok_s']:.0f} |")
    if chat:
        (pc, cc), (pa, ca) = chat["cached_n"], chat["alone_n"]
        print(f"\nchat turn after a cached history ({pc} prompt tokens, {cc} cached): TTFT "
              f"{chat['cached_ms']:.1f} ms (prompt eval {chat['cached_eval_ms']:.1f} ms); the "
              f"same new message alone ({pa} tokens, {ca} cached): {chat['alone_ms']:.1f} ms "
              f"(prompt eval {chat['alone_eval_ms']:.1f} ms) (medians)")
    if ref:
        print(f"one client, not streamed, alternated with the Python API on the same file and "
              f"{args.threads} thread(s): server {ref[1]:.0f} tokens/s, Python API {ref[0]:.0f} "
              f"tokens/s (medians; per-round ratio {ref[2]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
