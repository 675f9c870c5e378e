#!/usr/bin/env python3
"""Quality of input-sparse attention and head against sparsity, per criterion (not a test):
held-out perplexity, mean KL divergence to the dense next-token distribution and top-1
agreement, as a markdown table.

For each criterion (magnitude, wina) the model folder is converted once (the file's sparse
FFN mode: predictors for ReLU models, gate thresholds at --ffn-sparsity for gated non-ReLU
ones), its projections' inputs are profiled once, and each level's thresholds (the same
calibration as convert's: input_sparsity.calibrate_inputs, then refit in the sparse mode by
input_eval.refit unless --no-refit) are patched into the file's threshold tensors in place. The held-out tokens are those of the calibration text after the
profiled ones; every one runs the sparse mode (one token at a time, as decode), against the
dense mode of the same file, f32 KV cache for both. The "FFN only" rows are the file's FFN
mode with input sparsity off.

    PYTHONPATH=python python tools/eval_input_sparsity.py --model models/tiny-relu-kjv
        [--sparsity 0,0.25,0.4,0.5,0.6] [--criteria magnitude,wina] [--outtype f16]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile

import gguf
import numpy as np

from powerinfer_cpp import Model
from powerinfer_cpp import format as F
from powerinfer_cpp.convert import convert
from powerinfer_cpp.sparse.gate_eval import log_softmax
from powerinfer_cpp.sparse.input_eval import patch_calibration, refit, refit_tokens
from powerinfer_cpp.sparse.input_sparsity import calibrate_inputs
from powerinfer_cpp.sparse.pipeline import HELDOUT_FILE, SparseOptions
from powerinfer_cpp.sparse.profile import profile_model


def logprobs(path: str, ids: list[int], ffn: str, input_sparse: bool, threads: int, window: int = 512):
    """log p rows of ids[:-1] and the stats of the run."""
    with Model(path, n_ctx=window, n_threads=threads, cache_type="f32") as m:
        ctx = m.create_context(n_ctx=window, n_threads=threads, cache_type="f32", ffn=ffn)
        if m.info.has_input_sparsity:
            ctx.input_sparse = input_sparse
        ctx.sparse_batch = window
        rows = []
        for s in range(0, len(ids) - 1, window):
            w = ids[s:s + window + 1]
            if len(w) < 2:
                break
            ctx.reset()
            rows.append(log_softmax(ctx.eval(w[:-1], logits_all=True)))
        st = ctx.stats()
        ctx.close()
    return np.concatenate(rows), st


def compare(ld: np.ndarray, lg: np.ndarray, ids: list[int]) -> dict:
    tgt = np.asarray(ids[1:len(lg) + 1])
    idx = np.arange(len(tgt))
    return {"ppl": math.exp(-lg[idx, tgt].mean()), "ppl_dense": math.exp(-ld[idx, tgt].mean()),
            "kl": float((np.exp(ld) * (ld - lg)).sum(axis=1).mean()),
            "top1": float((ld.argmax(1) == lg.argmax(1)).mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-relu-kjv", help="HF model folder (with heldout.txt)")
    ap.add_argument("--sparsity", default="0,0.25,0.4,0.5,0.6", help="comma-separated input sparsities")
    ap.add_argument("--criteria", default=",".join(F.INPUT_CRITERIA))
    ap.add_argument("--ffn-sparsity", type=float, default=0.0,
                    help="gated non-ReLU models: the gate FFN's sparsity (default 0: the FFN exact)")
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens to score")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-refit", action="store_true",
                    help="keep the thresholds fitted on the dense profile (no refit in the sparse mode)")
    args = ap.parse_args()
    levels = [float(v) for v in args.sparsity.split(",")]
    heldout = os.path.join(args.model, HELDOUT_FILE)
    text = open(heldout, encoding="utf-8").read()
    tmp = tempfile.mkdtemp(prefix="eval-input-")
    rows = []
    try:
        for crit in args.criteria.split(","):
            rep: list = []
            relu = "relu" in os.path.basename(os.path.normpath(args.model))
            kw = {} if relu else {"sparsity": args.ffn_sparsity}
            path = convert(args.model, os.path.join(tmp, f"{crit}.gguf"), args.outtype, progress=False,
                           sparse=True, report=rep,
                           # (input_refit off: each level below gets its own thresholds)
                           sparse_options=SparseOptions(input_sparsity=0.5, input_criterion=crit, input_refit=False,
                                                        n_threads=args.threads, calib_tokens=args.calib_tokens,
                                                        **kw))
            n_cal = rep[0].n_calib_tokens
            with Model(path, n_ctx=16) as m:
                ids = m.tokenize(text)
                ffn = m.create_context(n_ctx=16).ffn_mode
            prof = profile_model(path, ids[:n_cal], n_ctx=512, n_threads=args.threads, progress=False,
                                 inputs=4096)
            ids = ids[n_cal:n_cal + args.tokens + 1]
            ld, _ = logprobs(path, ids, "dense", False, args.threads)
            if not rows:
                lf, st = logprobs(path, ids, ffn, False, args.threads)
                r = compare(ld, lf, ids)
                # a decoded token reads every row-major attention and head weight once
                rd = gguf.GGUFReader(path)
                nb = {t.name: int(t.n_bytes) for t in rd.tensors}
                att = sum(v for k, v in nb.items() if F.parse_tensor_name(k)[0] in
                          (F.T_ATTN_Q, F.T_ATTN_K, F.T_ATTN_V, F.T_ATTN_QKV, F.T_ATTN_OUTPUT)
                          and k.endswith(".weight"))
                head = nb.get(F.tensor_name(F.T_OUTPUT), nb[F.tensor_name(F.T_TOKEN_EMBD)])
                del rd
                r.update(criterion="FFN only", sparsity=0.0, att=1.0, head=1.0, ffn=ffn,
                         bpt={"attention": att, "head": head})
                rows.append(r)
                print(r, flush=True)
            rd = gguf.GGUFReader(path)
            tw = {t.name: t for t in rd.tensors}

            def weights_t(site, layer, tw=tw):
                from powerinfer_cpp.gguf_write import decode_matrix
                kind = {"qkv": F.T_ATTN_QKV_T, "o": F.T_ATTN_OUTPUT_T, "head": F.T_OUTPUT_T}[site]
                t = tw[F.input_sparse_tensor_name(kind, layer)]
                shape = tuple(int(v) for v in reversed(t.shape))
                return decode_matrix(np.asarray(t.data), t.tensor_type, shape)

            # (a site at 0 runs dense: its bytes are the row-major weights')
            cals = [calibrate_inputs(prof, s, crit, weights_t) for s in levels]
            del rd, tw
            for s, cal in zip(levels, cals):
                if not args.no_refit and s > 0:
                    refit(path, cal, refit_tokens(prof.input_ids, cal.n_fit, 512), 512, args.threads,
                          say=lambda m: print(m, flush=True))
                patch_calibration(path, cal)
                lg, st = logprobs(path, ids, ffn, True, args.threads)
                r = compare(ld, lg, ids)
                r.update(criterion=crit, sparsity=s, att=st["input_sparse"]["attention_density"],
                         head=st["input_sparse"]["head_density"], ffn=ffn, bpt=st["bytes_per_token_stage"])
                rows.append(r)
                print({k: v for k, v in r.items()}, flush=True)
        print(f"\n{args.model} ({args.outtype}), FFN mode {rows[0]['ffn']}, {len(ids) - 1} held-out positions "
              f"after {n_cal} calibration tokens\n")
        print("| criterion | input sparsity | attention / head input density | held-out ppl | vs dense | "
              "mean KL to dense | top-1 agreement | attention + head bytes / token |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            b = r["bpt"]["attention"] + r["bpt"]["head"]
            print(f"| {r['criterion']} | {r['sparsity']:.0%} | {r['att']:.1%} / {r['head']:.1%} | {r['ppl']:.3f} | "
                  f"{r['ppl'] / r['ppl_dense'] - 1:+.2%} | {r['kl']:.4f} | {r['top1']:.1%} | {b / 1e6:.2f} MB |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
