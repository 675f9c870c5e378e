#!/usr/bin/env python3
"""Speculative decoding against plain dense decode, greedy, alternating passes.

    python tools/bench_speculative.py MODEL.gguf [DRAFT[@K] ...] [--n 128] [--reps 2]
        [--threads 1] [--prompt TEXT] [--costs]

Each rep generates --n tokens (ignore_eos) with plain dense decode and then with each
DRAFT ("self", "self:vocab=4096,skip=3", "lookup", a draft GGUF; @K: draft_max, default 8),
one context each, and prints per pass the process CPU time per token (the fair measure on
a shared machine: run with --threads 1) and the wall speed, with the acceptance, the mean
k, tokens per verification and the draft / verify times; finally whether every draft's
tokens equal plain decode's. --costs first prints what a draft token and a verification
cost: the CPU time of a one-token pass with the head over the N lowest ids and with layers
skipped, and of dense passes of n = 1, 2, 3, 5, 8 tokens after a 64-token prefix.
"""
import argparse
import resource
import time

import numpy as np

from powerinfer_cpp import Model
from powerinfer_cpp._native import check, ffi, lib

PROMPT = "The village lay in a narrow valley between two ridges of pine. In the mornings"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def costs(m: Model, threads: int, reps: int = 5) -> None:
    ctx = m.create_context(n_ctx=512, n_threads=threads, ffn="dense")
    nl = m.info.n_layer
    ids = np.asarray((m.tokenize(PROMPT) * 8)[:64], dtype=np.int32)
    tok = np.array([100], dtype=np.int32)
    cfgs = [(0, []), (4096, []), (2048, []), (1024, []), (0, [3]), (4096, [3, 4, 5])]
    cfgs = [(min(v, m.n_vocab), [i for i in s if i < nl - 1]) for v, s in cfgs]
    one: dict = {}
    multi: dict = {}
    with ctx._calling() as ptr:
        check(lib.gh_context_set_sparse_batch(ptr, 0))
        check(lib.gh_eval(ptr, ffi.from_buffer("int32_t[]", ids), ids.size, 0))
        n0 = lib.gh_context_n_past(ptr)
        for _ in range(reps):
            for vocab, skip in cfgs:
                if vocab:
                    hid = np.arange(vocab, dtype=np.int32)
                    check(lib.gh_context_set_head_rows(ptr, ffi.from_buffer("int32_t[]", hid),
                                                       vocab))
                sk = np.zeros(nl, dtype=np.uint8)
                sk[skip] = 1
                check(lib.gh_context_set_layer_skip(ptr, ffi.from_buffer("uint8_t[]", sk), nl))
                c0 = cpu()
                for _ in range(8):
                    check(lib.gh_eval(ptr, ffi.from_buffer("int32_t[]", tok), 1, 0))
                one.setdefault((vocab, tuple(skip)), []).append((cpu() - c0) / 8)
                check(lib.gh_context_truncate(ptr, n0))
                check(lib.gh_context_set_head_rows(ptr, ffi.NULL, 0))
                check(lib.gh_context_set_layer_skip(ptr, ffi.NULL, 0))
            for n in (1, 2, 3, 5, 8):
                arr = np.arange(100, 100 + n, dtype=np.int32)
                c0 = cpu()
                check(lib.gh_eval(ptr, ffi.from_buffer("int32_t[]", arr), n, 1))
                multi.setdefault(n, []).append(cpu() - c0)
                check(lib.gh_context_truncate(ptr, n0))
    base = float(np.median(one[(0, ())]))
    for (vocab, skip), v in one.items():
        t = float(np.median(v))
        print(f"draft token, head rows {vocab or 'all'}, skip {list(skip)}: {t * 1e3:.2f} ms "
              f"cpu ({t / base:.2f} of dense)")
    for n, v in multi.items():
        t = float(np.median(v))
        print(f"dense pass of {n} tokens: {t * 1e3:.2f} ms cpu ({t / base:.2f} dense tokens)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("drafts", nargs="*", default=["self"])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--costs", action="store_true")
    a = ap.parse_args()
    m = Model(a.model, n_ctx=512, n_threads=a.threads)
    if a.costs:
        costs(m, a.threads)
    dense = m.create_context(n_ctx=512, n_threads=a.threads, ffn="dense")
    spec = m.create_context(n_ctx=512, n_threads=a.threads, ffn="dense")
    tokens: dict = {}
    for r in range(a.reps):
        for name in ["dense"] + a.drafts:
            ctx = dense if name == "dense" else spec
            kw = {}
            if name != "dense":
                d, _, k = name.partition("@")
                kw = dict(draft=d, draft_max=int(k) if k else 8)
            ctx.reset()
            c0, w0 = cpu(), time.perf_counter()
            out = ctx.generate(a.prompt, max_tokens=a.n, temperature=0, ignore_eos=True, **kw)
            c1, w1 = cpu(), time.perf_counter()
            tokens.setdefault(name, out.tokens)
            sp = out.timings.get("speculative")
            extra = ""
            if sp:
                extra = (f" acceptance {sp['acceptance']:.1%} mean_k {sp['mean_k']:.2f} "
                         f"tokens/round {sp['tokens_per_round']:.2f} rounds {sp['rounds']} draft "
                         f"{sp['draft_s'] * 1e3 / max(sp['drafted'], 1):.2f} ms/token verify "
                         f"{sp['verify_s'] * 1e3 / max(sp['rounds'], 1):.2f} ms/round")
            print(f"rep {r} {name:32s} cpu {(c1 - c0) * 1e3 / a.n:6.2f} ms/token wall "
                  f"{a.n / (w1 - w0):7.2f} tok/s{extra}", flush=True)
    for name, t in tokens.items():
        if name != "dense":
            print(f"{name}: tokens equal plain decode's: {t == tokens['dense']}")


if __name__ == "__main__":
    main()
