#!/usr/bin/env python3
"""How far a batch's logits are from the same tokens decoded one by one.

    python tools/batch_vs_decode.py MODEL.gguf [MODEL.gguf ...] [--n 2,5] [--threads 2]

For each file: a 10-token prefix, then the next n tokens once as one batch (all logits kept)
and once one token at a time, both in the dense FFN mode; prints the largest difference of
any row as a fraction of that row's largest |logit|, and whether the argmaxes agree. 0 means
the multi-token tiles sum as the one-token tiles (speculative verification and batched
decode then reproduce plain decode's tokens exactly). GH_SIMD picks the SIMD level.
"""
import argparse

import numpy as np

from powerinfer_cpp import Model

TEXT = ("The village lay in a narrow valley between two ridges of pine. In the mornings, the "
        "village was full of people")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--n", default="2,5", help="batch sizes (default 2,5)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    sizes = [int(v) for v in a.n.split(",")]
    for path in a.models:
        m = Model(path, n_ctx=256, n_threads=a.threads)
        ids = m.tokenize(TEXT)
        base, n_max = 10, max(sizes)
        if len(ids) < base + n_max:
            raise SystemExit(f"error: the text has {len(ids)} tokens, fewer than {base + n_max}")
        c = m.create_context(n_ctx=256, n_threads=a.threads, ffn="dense")
        c.eval(ids[:base])
        one = [np.asarray(c.eval([t])).reshape(-1).copy() for t in ids[base:base + n_max]]
        out = []
        for n in sizes:
            c.reset()
            c.eval(ids[:base])
            rows = np.asarray(c.eval(ids[base:base + n], logits_all=True)).reshape(n, -1)
            err = max(float(np.abs(rows[i] - one[i]).max() / np.abs(one[i]).max()) for i in range(n))
            same = all(rows[i].argmax() == one[i].argmax() for i in range(n))
            out.append(f"n={n}: {err:.1e}{'' if same else ' (argmax differs)'}")
        print(f"{path}: " + ", ".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
