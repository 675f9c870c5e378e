"""What hot neurons of sparse experts give over whole experts on a device: the CPU bytes per
token each placement moves to the device at a few budgets, by the cost model of the
placement (sparse/experts.py solve_expert_neurons) on held-out text, checked against the
runtime's own row counts on the host-device backend.

    python tools/bench_expert_neurons.py SPARSE_MOE.gguf --text FILE [--profile-tokens 2048]
        [--tokens 256] [--budgets 0.05,0.1,0.25,0.5] [--group-size 16] [--cpu-bw 50e9]
        [--dev-bw 2e12]

SPARSE_MOE.gguf: a mixture with sparse experts (ffn_down_exps_t; convert --sparse of a
ReLU-family mixture).

1. Profile: each expert's selection share and each neuron's activity among the tokens that
   chose its expert, over the first --profile-tokens tokens of the text
   (expert_sparsity.profile_expert_neurons: the runtime's FFN inputs, its routing, the file's
   gate thresholds).
2. For each budget (a share of all the experts' bytes, beside attention, routers and head),
   two placements: hot neuron groups (the ILP over groups of --group-size) and whole experts
   (the same ILP, one group per expert: all or none).
3. Held out: the next --tokens tokens profiled the same way; a placement's value there is
   the CPU bytes per token its rows would have cost on the CPU, sum over its neurons of
   freq·(gate row + listed·up row + nonzero·down_t row) (the gate mode reads every selected
   expert's gate rows; dReLU's nonzero share is below its listed one). Simulated time per token: sum over layers of max(device bytes /
   dev_bw, CPU bytes / cpu_bw) (the executor runs the device's neurons while the CPU runs
   the rest), attention, routers and head left out.
4. Runtime check: each placement written into the file and decoded over the held-out tokens
   on host-device in the gate mode; the CPU's up and down rows per token (the statistics)
   against CPU-only, times the row bytes, is the measured up + down bytes moved, beside the
   model's prediction of the same (sum freq·(listed·up + nonzero·down_t)).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.gguf_write import TensorJob, write_gguf  # noqa: E402
from powerinfer_cpp.gguf_read import open_gguf  # noqa: E402
from powerinfer_cpp.place import _copy_fields, read_fields  # noqa: E402
from powerinfer_cpp.sparse.expert_sparsity import profile_expert_neurons  # noqa: E402
from powerinfer_cpp.sparse.experts import expert_hot_tensors, solve_expert_neurons  # noqa: E402


def value(hot, freq, nfreq, dfreq, row_bytes, parts=("gate", "up", "down")):
    """Per layer the CPU bytes per token the neurons hot[l][e] cost on the CPU: the gate rows
    of a selected expert, the up rows of its listed neurons, the down_t rows of those whose
    activation is nonzero."""
    out = np.zeros(len(hot))
    for l, row in enumerate(hot):
        g, u, d = row_bytes[l]
        for e, ids in enumerate(row):
            if len(ids) == 0:
                continue
            v = 0.0
            if "gate" in parts:
                v += g * len(ids)
            if "up" in parts:
                v += nfreq[l, e, ids].sum() * u
            if "down" in parts:
                v += dfreq[l, e, ids].sum() * d
            out[l] += freq[l, e] * v
    return out


def all_hot(nl, ne, ff):
    return [[np.arange(ff, dtype=np.int32) for _ in range(ne)] for _ in range(nl)]


def with_record(src, dst, arrays):
    r = open_gguf(src)
    jobs = [TensorJob(t.name, tuple(int(v) for v in reversed(t.shape)), t.tensor_type,
                      lambda a=t.data: a, raw=True) for t in r.tensors]
    from gguf import GGMLQuantizationType as Q
    for name, a in sorted(arrays.items()):
        jobs.append(TensorJob(name, a.shape, Q.I32 if a.dtype == np.int32 else Q.F32, lambda a=a: a))
    arch = read_fields(r)["general.architecture"]
    write_gguf(dst, lambda w: _copy_fields(r, w, set()), jobs, False, arch=arch)


def cpu_rows(path, toks, budget=None, n_ctx=128):
    """(CPU up rows, CPU down rows, the device's dense bytes) of a gate-mode decode of toks
    in windows of n_ctx tokens (the profile's windows: the same inputs)."""
    kw = {} if budget is None else dict(device="host-device", vram_budget=budget)
    with Model(path, n_ctx=n_ctx, **kw) as m:
        ctx = m.create_context(n_ctx=n_ctx, ffn="gate")
        for i, t in enumerate(toks):
            if i % n_ctx == 0:
                ctx.reset(0)
            ctx.eval([t])
        st = ctx.stats()
        return st["n_up_rows"], st["n_down_rows"], (m.device_info()["dense_bytes"] if budget else 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--text", required=True)
    ap.add_argument("--profile-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--budgets", default="0.05,0.1,0.25,0.5")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--cpu-bw", type=float, default=50e9)
    ap.add_argument("--dev-bw", type=float, default=2e12)
    args = ap.parse_args(argv)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    with Model(args.model, n_ctx=128) as m:
        ids = m.tokenize(text)
        info = m.info
    prof, held = ids[:args.profile_tokens], ids[args.profile_tokens:args.profile_tokens + args.tokens]
    nl, ne, ff, k = info.n_layer, info.n_expert, info.n_ff_exp, info.n_expert_used
    freq, nfreq, dfreq, rb = profile_expert_neurons(args.model, prof, n_ctx=128)
    hfreq, hnfreq, hdfreq, _ = profile_expert_neurons(args.model, held, n_ctx=128)
    neuron = sum(rb[0])
    all_bytes = nl * ne * ff * neuron
    total = value(all_hot(nl, ne, ff), hfreq, hnfreq, hdfreq, rb)
    act = float((hfreq[:, :, None] * hnfreq).sum() / (hfreq.sum() * ff))
    act_d = float((hfreq[:, :, None] * hdfreq).sum() / (hfreq.sum() * ff))
    print(f"model {os.path.basename(args.model)}: {nl} layers x {ne} experts, top-{k}, {ff} neurons of "
          f"{neuron} B (gate + up + down_t rows) per expert, all experts {all_bytes / 1024:.0f} KiB; "
          f"profile {len(prof)} tokens, held out {len(held)}; share of a selected expert's neurons "
          f"listed (up rows read) {act:.1%}, with a nonzero activation (down_t rows read) {act_d:.1%}; CPU expert bytes per token (all on the CPU) {total.sum() / 1024:.1f} KiB")
    print(f"cost model: CPU {args.cpu_bw / 1e9:g} GB/s, device {args.dev_bw / 1e9:g} GB/s; "
          f"group size {args.group_size}")
    print()
    with tempfile.TemporaryDirectory() as tmp:
        up0, dn0, _ = cpu_rows(args.model, held)
        _, _, dense_dev = cpu_rows(args.model, held[:1], budget="1G")
        rows = []
        for share in (float(s) for s in args.budgets.split(",")):
            left = int(share * all_bytes)
            for whole in (True, False):
                pl = solve_expert_neurons(freq, nfreq, rb, left, group_size=args.group_size, whole=whole,
                                          dfreq=dfreq)
                moved = value(pl.hot, hfreq, hnfreq, hdfreq, rb)
                cpu = total - moved
                t = sum(max(moved[l] / args.dev_bw, cpu[l] / args.cpu_bw) for l in range(nl))
                t_cpu = sum(total[l] / args.cpu_bw for l in range(nl))
                pred_ud = value(pl.hot, hfreq, hnfreq, hdfreq, rb, parts=("up", "down")).sum()
                path = os.path.join(tmp, f"m-{share}-{whole}.gguf")
                with_record(args.model, path, expert_hot_tensors(pl))
                up, dn, _ = cpu_rows(path, held, budget=dense_dev + pl.bytes)
                meas_ud = ((up0 - up) * rb[0][1] + (dn0 - dn) * rb[0][2]) / len(held)
                rows.append((share, left, "whole experts" if whole else "hot neuron groups",
                             int(pl.counts.sum()), int((pl.counts > 0).sum()), moved.sum(),
                             moved.sum() / total.sum(), t * 1e6, t_cpu / t, pred_ud, meas_ud))
    print("| budget (share of expert bytes) | placement | neurons on the device | experts touched | "
          "CPU bytes / token moved (held out) | share of the experts' CPU bytes | simulated µs / token | "
          "vs CPU | up+down bytes moved: model | up+down bytes moved: runtime |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for share, left, what, n, ex, mv, sh, us, sp, p, r in rows:
        print(f"| {share:.0%} ({left / 1024:.0f} KiB) | {what} | {n} | {ex} | {mv:.0f} | {sh:.1%} | "
              f"{us:.3f} | {sp:.2f}x | {p:.0f} | {r:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
