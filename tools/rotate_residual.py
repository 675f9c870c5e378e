#!/usr/bin/env python3
"""A dense llama-family GGUF with its residual stream rotated by the PCA of its normalized
projection inputs (sparse/rotation.py): the same function, a basis where input sparsity
loses less (not a test; docs/BENCHMARKS.md "Rotated residual stream").

The inputs of q/k/v, the FFN and the head are recorded on the first --tokens calibration
tokens (windows of 512, dense), Q is fitted on the first 80% of them (every second token);
the output is then an ordinary dense file to convert with input sparsity as any other.
--o-heads also rotates o's input per kv head (the PCA of the same tokens' o inputs, folded
into W_v's rows and W_o's columns; sparse/rotation.py head_rotations).

    PYTHONPATH=python python tools/rotate_residual.py DENSE.gguf --calib CAL.txt -o ROT.gguf
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main() -> int:
    import gguf

    from powerinfer_cpp import Model
    from powerinfer_cpp.sparse.profile import profile_model
    from powerinfer_cpp.sparse.rotation import head_rotations, pca_rotation, rotate_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="dense llama-family GGUF (F16/F32 weights are kept in F16/F32)")
    ap.add_argument("--calib", required=True, help="calibration text (keep it disjoint from the evaluation's)")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--o-heads", action="store_true", help="also rotate o's input per kv head (PCA per head group)")
    ap.add_argument("--save-q", default=None, metavar="NPY", help="also write Q [d, d] here")
    args = ap.parse_args()
    t0 = time.time()
    with Model(args.model, n_ctx=16) as m:
        ids = m.tokenize(open(args.calib, encoding="utf-8").read())[:args.tokens]
    prof = profile_model(args.model, ids, n_ctx=512, n_threads=args.threads, progress=False, inputs=len(ids))
    r = gguf.GGUFReader(args.model)
    tw = {t.name: t for t in r.tensors}

    def g(name):
        return np.asarray(tw[name].data, np.float64)

    k = prof.n_input_tokens
    n0 = k - int(round(k * 0.2))
    xs, gs = [], []
    for l in range(prof.n_layer):
        xs += [prof.attn_in[l][:n0:2], prof.x[l][:n0:2]]
        gs += [g(f"blk.{l}.attn_norm.weight"), g(f"blk.{l}.ffn_norm.weight")]
    xs.append(prof.head_in[:n0:2])
    gs.append(g("output_norm.weight"))
    q = pca_rotation(xs, gs)
    o_rot = None
    if args.o_heads:
        n_head = int(r.fields["llama.attention.head_count"].contents())
        n_kv = int(r.fields["llama.attention.head_count_kv"].contents()) \
            if "llama.attention.head_count_kv" in r.fields else n_head
        o_rot = [head_rotations(prof.attn_out_in[l][:n0:2], n_head, n_kv) for l in range(prof.n_layer)]
    del prof, r, tw
    if args.save_q:
        np.save(args.save_q, q)
    rotate_gguf(args.model, args.out, q, o_rotations=o_rot)
    print(f"{args.out}: residual stream rotated ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
