#!/usr/bin/env python3
"""Would per-site input rotations (LaRoSA's, on top of a rotated residual stream) pay for
their bytes? A numpy estimate, not a test (docs/BENCHMARKS.md "Per-site rotations").

On the dense (rotated-residual) model's profiled inputs (the first --tokens calibration tokens:
thresholds and PCA fitted on the first 80%, output errors on --eval-tokens of the rest), per
site and level 5, 10, ..., 90% the squared output error E||W (x - kept(x))||^2 (the lower of
magnitude and WINA) without and with a PCA rotation of the site's input:

- "site": q/k/v's input (one rotation for the three), gate/up's (one for both), the head's;
  each a d x d matrix applied at run time (its bytes charged, its own rounding in the type
  given added to the error);
- "layer": one rotation per layer shared by q/k/v and gate/up (the PCA of both inputs);
- "o": o's input per kv head (sparse/rotation.py head_rotations: folded into W_v and W_o,
  free).

o's and down's output spaces do not change, so a site's KL per unit of output error is the
one the rotated-residual run's proxy measured (--proxy: make_frontier_files' site-proxy json
of that file); each rotated curve is that run's predicted KL curve times the error ratio. Per
budget, allocate_options picks per site a rotation or none and a level at least bytes.

    PYTHONPATH=python GH_LIBRARY=build/libggml_hybrid.so python tools/estimate_site_rotations.py \\
        ROT.gguf --calib calib.txt --proxy rot/site-proxy-mixed-0.3.json --kl 0.012,0.02,0.03
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

import numpy as np


def pca(xs) -> np.ndarray:
    from powerinfer_cpp.sparse.rotation import pca_rotation
    return pca_rotation(xs, [np.ones(xs[0].shape[1])] * len(xs)).astype(np.float32)


def level_errors(fit, te, g, grid) -> np.ndarray:
    """[2, n_level] (magnitude, WINA): mean ||W d||^2 = d^T G d over te's tokens, d the inputs
    whose score is at or below the fit tokens' quantile at each level (one threshold per site,
    the runtime's test with WINA's column norms folded in)."""
    gain = np.sqrt(np.maximum(np.diag(g), 0)).astype(np.float32)
    out = np.zeros((2, len(grid)))
    for c, s in enumerate((np.ones_like(gain), gain)):
        st = np.abs(te) * s
        for j, t in enumerate(np.quantile(np.abs(fit) * s, grid)):
            d = np.where(st <= t, te, 0).astype(np.float32)
            out[c, j] = float(((d @ g) * d).sum(dtype=np.float64)) / len(te)
    return out


def rounding_error(te, g, r, qtype) -> float:
    """mean ||W (R Rq^T - I) x||^2: the rotation stored as R^T's rows in qtype (gguf.quants)."""
    from gguf import quants
    rt = np.ascontiguousarray(r.T)
    rq = quants.dequantize(quants.quantize(rt, qtype), qtype).reshape(rt.shape).astype(np.float32)
    d = te @ (r @ rq).T - te
    return float(((d @ g) * d).sum(dtype=np.float64)) / len(te)


def main() -> int:
    import gguf
    from gguf import GGMLQuantizationType as QT

    from powerinfer_cpp import Model
    from powerinfer_cpp.gguf_write import decode_matrix
    from powerinfer_cpp.sparse.profile import profile_model
    from powerinfer_cpp.sparse.rotation import head_rotations
    from powerinfer_cpp.sparse.site_allocation import allocate_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="the dense rotated-residual GGUF (tools/rotate_residual.py) the proxy was made on")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--proxy", required=True, help="make_frontier_files' site-proxy json of that model")
    ap.add_argument("--kl", default="0.012,0.02,0.03", help="predicted-KL budgets")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=None, metavar="DIR", help="keep the profile and the errors here")
    args = ap.parse_args()
    import json

    t0 = time.time()
    prof_path = args.cache and os.path.join(args.cache, "profile.pkl")
    if prof_path and os.path.exists(prof_path):
        prof = pickle.load(open(prof_path, "rb"))
    else:
        with Model(args.model, n_ctx=16) as m:
            ids = m.tokenize(open(args.calib, encoding="utf-8").read())[:args.tokens]
        prof = profile_model(args.model, ids, n_ctx=512, n_threads=args.threads, progress=False, inputs=len(ids))
        if prof_path:
            os.makedirs(args.cache, exist_ok=True)
            pickle.dump(prof, open(prof_path, "wb"), protocol=4)
    r = gguf.GGUFReader(args.model)
    tw = {t.name: t for t in r.tensors}
    n_head = int(r.fields["llama.attention.head_count"].contents())
    n_kv = int(r.fields["llama.attention.head_count_kv"].contents())
    if any(f"blk.0.{n}.weight" not in tw for n in ("attn_q", "ffn_gate")) or "output.weight" not in tw:
        raise SystemExit(f"{args.model}: a llama-family file with an untied head (a rotated-residual file) is expected")

    def w(name):
        t = tw[name]
        shape = tuple(int(v) for v in reversed(t.shape))
        return decode_matrix(np.asarray(t.data), t.tensor_type, shape).astype(np.float32)

    hd = int(tw["blk.0.attn_output.weight"].shape[0]) // n_head
    k = prof.n_input_tokens
    n0 = k - int(round(k * 0.2))
    grid = [round(0.05 * i, 2) for i in range(1, 19)]
    err_path = args.cache and os.path.join(args.cache, "errors.json")
    if err_path and os.path.exists(err_path):
        errs = json.load(open(err_path))
    else:
        errs = {}

        def site(key, x, g, rots):
            fit, te = x[:n0], x[n0:n0 + args.eval_tokens]
            out = {"base": level_errors(fit, te, g, grid).tolist()}
            for name, rot in rots.items():
                out[name] = level_errors(fit @ rot, te @ rot, rot.T @ g @ rot, grid).tolist()
                if name != "o":
                    out[name + "_f16"] = rounding_error(te, g, rot, QT.F16)
                    out[name + "_q8_0"] = rounding_error(te, g, rot, QT.Q8_0)
            errs[key] = out

        wh = w("output.weight")
        site("head.", prof.head_in, wh.T @ wh, {"site": pca([prof.head_in[:n0]])})
        del wh
        for l in range(prof.n_layer):
            p = f"blk.{l}."
            xa, xf, xo = prof.attn_in[l], prof.x[l][:k], prof.attn_out_in[l]
            rl = pca([xa[:n0], xf[:n0]])
            g = sum(m.T @ m for m in (w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")))
            site(f"qkv.{l}", xa, g, {"site": pca([xa[:n0]]), "layer": rl})
            g = sum(m.T @ m for m in (w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")))
            site(f"ffn.{l}", xf, g, {"site": pca([xf[:n0]]), "layer": rl})
            ro = head_rotations(xo[:n0], n_head, n_kv).astype(np.float32)
            big = np.zeros((n_head * hd, n_head * hd), np.float32)
            for h in range(n_head):
                big[h * hd:(h + 1) * hd, h * hd:(h + 1) * hd] = ro[h // (n_head // n_kv)]
            wo = w(p + "attn_output.weight")
            site(f"o.{l}", xo, wo.T @ wo, {"o": big})
            print(f"layer {l} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        if err_path:
            json.dump(errs, open(err_path, "w"))

    px = json.load(open(args.proxy))
    if [round(v, 2) for v in px["grid"]] != grid:
        raise SystemExit(f"{args.proxy}: its grid is not 0.05, ..., 0.9")
    lv = np.array([0.0] + grid)
    names = [f"{g[0][0]}.{'' if g[0][1] is None else g[0][1]}" for g in px["keys"]]
    cost = {n: np.concatenate([[0.0], c]) for n, c in zip(names, px["costs"])}
    d = prof.head_in.shape[1]
    f16 = {"qkv": sum(tw[f"blk.0.attn_{x}.weight"].shape[1] for x in "qkv") * d * 2,
           "o": d * n_head * hd * 2, "ffn": 2 * tw["blk.0.ffn_gate.weight"].shape[1] * d * 2,
           "down": tw["blk.0.ffn_down.weight"].shape[0] * d * 2, "head": tw["output.weight"].shape[1] * d * 2}
    n_layer = prof.n_layer

    def curve(key, opt, qt):
        if opt == "base":
            return cost[key]
        s = errs[key]
        b = np.array(s["base"]).min(0)
        q = s.get(f"{opt}_{qt}", 0.0) if qt else 0.0
        r = np.array(s[opt]).min(0) + q
        return np.concatenate([[cost[key][1] / max(b[0], 1e-30) * q], cost[key][1:] * r / np.maximum(b, 1e-30)])

    def units(use, rot_bytes, qt, scale):
        def by(kind):
            return f16[kind] * scale * (1 - lv)
        out = []
        for l in range(n_layer):
            q, f = f"qkv.{l}", f"ffn.{l}"
            opts = [(0.0, [(by("qkv"), curve(q, "base", qt)), (by("ffn"), curve(f, "base", qt))])]
            if "site" in use:
                for a, b, n in (("site", "base", 1), ("base", "site", 1), ("site", "site", 2)):
                    opts.append((n * rot_bytes, [(by("qkv"), curve(q, a, qt)), (by("ffn"), curve(f, b, qt))]))
            if "layer" in use:
                opts.append((rot_bytes, [(by("qkv"), curve(q, "layer", qt)), (by("ffn"), curve(f, "layer", qt))]))
            out.append(opts)
            o = f"o.{l}"
            out.append([(0.0, [(by("o"), curve(o, "base", qt))])] +
                       ([(0.0, [(by("o"), curve(o, "o", None))])] if "o" in use else []))
            out.append([(0.0, [(by("down"), cost[f"down.{l}"])])])
        out.append([(0.0, [(by("head"), curve("head.", "base", qt))])] +
                   ([(rot_bytes, [(by("head"), curve("head.", "site", qt))])] if "head" in use else []))
        return out

    r16, rq8 = d * d * 2, d * d * 34 / 32
    cases = [("rotated residual (the proxy's curves)", set(), 0, None, 1.0),
             ("+ o per kv head (free)", {"o"}, 0, None, 1.0),
             ("+ head's rotation", {"head"}, r16, "f16", 1.0),
             ("+ o + head", {"o", "head"}, r16, "f16", 1.0),
             ("+ per-site q/k/v, gate/up and head", {"site", "head"}, r16, "f16", 1.0),
             ("+ per-layer q/k/v+gate/up and head", {"layer", "head"}, r16, "f16", 1.0),
             ("+ all (o, per-site, per-layer, head)", {"o", "site", "layer", "head"}, r16, "f16", 1.0),
             ("bound: all, the rotations free", {"o", "site", "layer", "head"}, 0.0, None, 1.0),
             ("Q8_0 file, Q8_0 rotations, all", {"o", "site", "layer", "head"}, rq8, "q8_0", 34 / 64),
             ("Q8_0 file, F16 rotations, all", {"o", "site", "layer", "head"}, r16, "f16", 34 / 64)]
    budgets = [float(v) for v in args.kl.split(",")]
    dense = n_layer * sum(f16[x] for x in ("qkv", "o", "ffn", "down")) + f16["head"]
    print("| option | " + " | ".join(f"bytes vs dense at predicted KL {b:g}" for b in budgets) +
          f" | rotations at {budgets[0]:g} | mean level: q/k/v, gate/up, o, down, head |")
    print("|---|" + "---|" * len(budgets) + "---|---|")
    for label, use, rb, qt, scale in cases:
        us = units(use, rb, qt, scale)
        row, first = [], None
        for kl in budgets:
            b, _, pick = allocate_options(us, kl)
            row.append(f"{b / (dense * scale):.3f}")
            first = first or pick
        rots = {"q/k/v+gate/up": 0, "head": 0, "o": 0}
        where = []
        lvs = {x: [] for x in ("qkv", "ffn", "o", "down", "head")}
        for i, (oi, js) in enumerate(first):
            kind = "head" if i == len(first) - 1 else ("qkv", "o", "down")[i % 3]
            if kind == "qkv":
                lvs["qkv"].append(lv[js[0]]), lvs["ffn"].append(lv[js[1]])
                n = (0, 1, 1, 2, 1)[oi] if "site" in use else oi
                rots["q/k/v+gate/up"] += n
                if n and len(where) < 6:
                    kinds = ("none", "q/k/v", "gate/up", "both", "layer")
                    where.append(f"{i // 3}:" + kinds[oi if "site" in use else 4 * oi])
            else:
                lvs[kind].append(lv[js[0]])
                if oi:
                    rots[kind if kind in rots else "o"] += 1
        print(f"| {label} | " + " | ".join(row) + " | " + ", ".join(f"{k} {v}" for k, v in rots.items() if v) +
              (f" (layer:kind {', '.join(where)})" if where else "") +
              " | " + " / ".join(f"{100 * np.mean(v):.0f}%" for v in lvs.values()) + " |", flush=True)
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
