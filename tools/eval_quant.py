#!/usr/bin/env python3
"""Quality of each storage type against F16 (not a test), as llama.cpp reports it
(`llama-perplexity --kl-divergence`): held-out perplexity, its ratio to F16, mean KL
divergence of the next-token distribution to F16's and top-1 agreement.

The model folder is converted once per type (dense); every file runs the same held-out
tokens (the end of the folder's heldout.txt, which the shipped models' training never saw)
in independent windows, f32 KV cache, all logits of a window in one batch.

    PYTHONPATH=python python tools/eval_quant.py [--model models/tiny-swiglu-kjv]
        [--types q8_0,q6_k,q5_k_m,q4_k_m,q4_k,q4_0] [--tokens 4096] [--window 256]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.gate_eval import log_softmax  # noqa: E402


def log_probs(path: str, ids: list[int], window: int, threads: int) -> np.ndarray:
    """log p rows predicting ids[1:] (windows of `window` tokens, cache cleared between)."""
    rows = []
    with Model(path, n_ctx=window, n_threads=threads, cache_type="f32") as m:
        ctx = m.create_context(n_ctx=window, n_threads=threads, cache_type="f32", ffn="dense")
        for s in range(0, len(ids) - 1, window):
            w = ids[s:s + window + 1]
            if len(w) < 2:
                break
            ctx.reset()
            rows.append(log_softmax(ctx.eval(w[:-1], logits_all=True)))
        ctx.close()
    return np.concatenate(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-swiglu-kjv", help="Hugging Face model folder")
    ap.add_argument("--types", default="q8_0,q6_k,q5_k_m,q5_k,q4_k_m,q4_k,q4_0")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens (the end of heldout.txt)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        files = {t: convert(a.model, os.path.join(tmp, f"{t}.gguf"), t, progress=False) for t in ["f16"] + types}
        with Model(files["f16"]) as m:
            ids = m.tokenizer.encode(open(os.path.join(a.model, "heldout.txt"), encoding="utf-8").read())
        ids = [int(i) for i in ids[-a.tokens:]]
        ref = log_probs(files["f16"], ids, a.window, a.threads)
        idx = np.arange(len(ref))
        tgt = np.asarray(ids[1:len(ref) + 1])
        ppl16 = math.exp(-ref[idx, tgt].mean())
        print(f"{a.model}: {len(ref)} held-out tokens, windows of {a.window}\n")
        print("| type | file MB | perplexity | ratio to F16 | mean KLD to F16 | same top token |")
        print("|---|---|---|---|---|---|")
        print(f"| F16 | {os.path.getsize(files['f16']) / 1e6:.1f} | {ppl16:.3f} | 1 | 0 | 100% |")
        for t in types:
            lp = log_probs(files[t], ids, a.window, a.threads)
            ppl = math.exp(-lp[idx, tgt].mean())
            kld = float((np.exp(ref) * (ref - lp)).sum(axis=1).mean())
            top1 = float((ref.argmax(1) == lp.argmax(1)).mean())
            print(f"| {t.upper()} | {os.path.getsize(files[t]) / 1e6:.1f} | {ppl:.3f} | {ppl / ppl16:.4f} | "
                  f"{kld:.5f} | {top1:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
