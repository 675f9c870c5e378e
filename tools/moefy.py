#!/usr/bin/env python3
"""MoEfication: a dense llama-family GGUF split into a mixture of experts with a fitted
router, written as an ordinary Mixtral-layout GGUF (not a test; a bench tool).

    PYTHONPATH=python python tools/moefy.py DENSE.gguf --calib CALIB.txt -o OUT.gguf
        [--experts 16] [--top-k 4[,8,...]] [--tokens 8192] [--cluster activation|weights]
        [--router lsq|random] [--router-bias] [--flat 1e-3] [--threads 2]
    PYTHONPATH=python python tools/moefy.py MOE.gguf --random-router -o CONTROL.gguf

Why: no trained mixture-of-experts checkpoint can be downloaded here, and the random MoE
configs' routers are random projections, whose selections have none of a trained router's
structure. Splitting a real model's FFN into experts and routing by what each expert would
contribute (Zhang et al. 2022, "MoEfication: Transformer Feed-forward Layers are Mixtures of
Experts") gives selections that follow real activations on real text.

Per layer, over the calibration text's FFN inputs x (the runtime's profile, after ffn_norm):
1. The activations h = act(x W_gate^T) * (x W_up^T) of the ff neurons.
2. Clustering: the ff neurons into E equal groups by balanced spherical k-means, either on
   their activation magnitudes over the calibration tokens (--cluster activation: neurons
   that fire together share an expert, MoEfication's co-activation idea) or on their
   concatenated gate and up rows (--cluster weights, MoEfication's parameter clustering).
   Equal groups (the runtime's experts all have one width): each round gives every neuron,
   the most decided first, its nearest centroid with room left, then recentres.
3. Router: a linear map R [E, d] (and with --router-bias a bias [E]) fitted by least squares
   to each expert's importance, the sum of |h| over its neurons (MoEfication's target);
   80% of the tokens fit it, the other 20% measure it (the share of the true top-k experts
   the router picks, and the share of the true top-k's |h| mass it keeps). --router random
   puts a random projection in its place, and --random-router copies a MoEfied file with
   its routers replaced so (a control: the random MoE configs' routing over the same
   experts and real hidden states).
4. Experts: expert e's FFN is the dense FFN's rows/columns of its neurons; the dense FFN is
   exactly the sum of all E experts' outputs, so the MoE output should be the unweighted
   sum of the selected experts.

Weights of 1: the runtime (and llama.cpp) weigh the chosen experts by softmax(router
logits), renormalised over the top k with expert_weights_norm, times expert_weights_scale,
so exactly 1 per expert cannot be written. The file stores the router times a small factor
eps (logits eps * s, their spread per token at most --flat on the calibration's 99.9%
quantile), expert_weights_norm true and expert_weights_scale k: each weight is
k exp(eps s_j) / sum_i exp(eps s_i) over the chosen, 1 within about --flat, and the top k of
eps * s are those of s (softmax is monotone; float32 resolves logit differences down to
about 6e-8, i.e. 6e-5 of the spread at --flat 1e-3). With k = E (all experts) the model is
the dense one up to those weights and rounding (tests/model/test_moefy.py). The layout is
llama.cpp's Mixtral (llama architecture, ffn_gate_inp, ffn_{gate,up,down}_exps,
expert_count, expert_used_count, feed_forward_length = the experts' width); llama.cpp's
llama graph does not read expert_weights_scale (docs/FORMAT.md: it ignores these
architectures' weight keys), so there its outputs would be 1/k of the sum.

--top-k takes a list: the first value's file is OUT, each other k's is OUT with -k<k> before
the extension (the same experts and router; only expert_used_count and the scale differ).
Source weights F16/F32 or any type gguf.quants dequantizes; experts are stored F16
(--outtype f32 for F32), the router F32, every other tensor as it was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.convert.from_gguf import _kv_entries  # noqa: E402
from powerinfer_cpp.gguf_write import ConvertError, TensorJob, add_kv, decode_matrix, write_gguf  # noqa: E402
from powerinfer_cpp.sparse.profile import profile_model  # noqa: E402

ARCH = "llama"
FFN = ("ffn_gate", "ffn_up", "ffn_down")


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


#: the gated FFN's activation h(g, u) per format.ACTIVATIONS kind (those calibrated here)
ACTS = {"silu": lambda g, u: silu(g) * u, "relu": lambda g, u: np.maximum(g, 0.0) * u,
        "drelu": lambda g, u: np.maximum(g, 0.0) * np.maximum(u, 0.0)}


def balanced_kmeans(feat: np.ndarray, n_groups: int, iters: int = 20, seed: int = 0) -> np.ndarray:
    """Rows of feat (unit norm) into n_groups groups of equal size, maximising the cosine to
    the group's centroid: each round gives every row, those with the highest best
    similarity first, the most similar group that has room left, then recentres.
    Returns the group of each row."""
    n = feat.shape[0]
    if n % n_groups:
        raise ValueError(f"{n} neurons do not split into {n_groups} equal experts")
    cap = n // n_groups
    rng = np.random.default_rng(seed)
    cent = feat[rng.choice(n, n_groups, replace=False)].copy()
    group = np.full(n, -1)
    for _ in range(iters):
        sim = feat @ cent.T                                  # [n, groups]
        new = np.full(n, -1)
        room = np.full(n_groups, cap)
        # the most decided neurons first, each to its nearest group with room left
        for i in np.argsort(-sim.max(axis=1), kind="stable"):
            g = int(np.argmax(np.where(room > 0, sim[i], -np.inf)))
            new[i] = g
            room[g] -= 1
        if np.array_equal(new, group):
            break
        group = new
        for g in range(n_groups):
            c = feat[group == g].sum(axis=0)
            cent[g] = c / max(np.linalg.norm(c), 1e-30)
    return group


def _unit_rows(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-30)


def fit_router(x: np.ndarray, target: np.ndarray, bias: bool, ridge: float = 1e-3):
    """Least squares x R^T (+ b) ~ target; returns (R [E, d], b [E] or None)."""
    a = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1) if bias else x
    g = a.T @ a
    g += ridge * np.trace(g) / g.shape[0] * np.eye(g.shape[0])
    w = np.linalg.solve(g, a.T @ target)                    # [d(+1), E]
    return (w[:-1].T, w[-1]) if bias else (w.T, None)


def router_quality(s: np.ndarray, target: np.ndarray, k: int) -> tuple[float, float]:
    """(the share of the true top-k experts the router's top k holds, the share of the true
    top-k's importance the router's top k keeps) over the rows."""
    pick = np.argsort(-s, axis=1, kind="stable")[:, :k]
    true = np.argsort(-target, axis=1, kind="stable")[:, :k]
    hit = np.mean([len(set(p) & set(t)) / k for p, t in zip(pick, true)])
    kept = np.take_along_axis(target, pick, 1).sum(1) / np.take_along_axis(target, true, 1).sum(1)
    return float(hit), float(kept.mean())


def moefy(src: str, dst: str, calib_ids, n_expert: int, top_k: list[int], *, cluster: str = "activation",
          router: str = "lsq", router_bias: bool = False, flat: float = 1e-3, outtype: str = "f16", n_threads: int = 0,
          n_ctx: int = 512, seed: int = 0, log=print) -> list[str]:
    """Write src's MoEfied model (module doc) for each k of top_k; returns the paths."""
    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    if arch != ARCH:
        raise ConvertError(f"{src}: MoEfication writes the llama architecture's Mixtral layout; "
                           f"this file is {arch!r}")
    tensors = {t.name: t for t in r.tensors}
    if any(".ffn_gate_inp." in n for n in tensors):
        raise ConvertError(f"{src} is already a mixture of experts")
    n_layer = 0
    while f"blk.{n_layer}.ffn_up.weight" in tensors:
        n_layer += 1
    if n_layer == 0 or "blk.0.ffn_gate.weight" not in tensors:
        raise ConvertError(f"{src}: no gated FFN (blk.N.ffn_gate/ffn_up/ffn_down) to split")
    extra = [n for n in tensors if n.startswith("blk.") and n.split(".")[2] in FFN and not n.endswith(".weight")]
    if extra:
        raise ConvertError(f"{src}: FFN biases ({extra[0]}) are not split here")
    def mat(name):
        t = tensors[name]
        return decode_matrix(np.asarray(t.data), t.tensor_type, tuple(int(v) for v in reversed(t.shape)))

    ff, d = mat("blk.0.ffn_up.weight").shape
    if ff % n_expert:
        raise ValueError(f"feed_forward_length {ff} does not split into {n_expert} equal experts")
    ffe = ff // n_expert
    for k in top_k:
        if not 1 <= k <= n_expert:
            raise ValueError(f"top-k {k} outside [1, {n_expert}]")

    t0 = time.time()
    prof = profile_model(src, list(calib_ids), n_ctx=n_ctx, n_threads=n_threads, progress=False)
    n = prof.n_tokens
    act = ACTS.get(prof.ffn_act)
    if act is None:
        raise ConvertError(f"{src}: activation {prof.ffn_act!r} not calibrated here ({', '.join(ACTS)})")
    n_fit = max(1, int(n * 0.8))
    log(f"profiled {n} calibration tokens ({time.time() - t0:.0f} s); fitting on {n_fit}, "
        f"measuring the router on {n - n_fit}")

    layers = []
    quality = []
    for l in range(n_layer):
        wg, wu, wd = (mat(f"blk.{l}.{k}.weight") for k in FFN)
        x = prof.x[l].astype(np.float32)
        h = act(x @ wg.T, x @ wu.T)                    # [N, ff]
        a = np.abs(h)
        if cluster == "activation":
            feat = _unit_rows(a[:n_fit].T.astype(np.float64))
        elif cluster == "weights":
            feat = _unit_rows(np.concatenate([wg, wu], axis=1).astype(np.float64))
        else:
            raise ValueError(f"unknown clustering {cluster!r} (activation, weights)")
        group = balanced_kmeans(feat, n_expert, seed=seed + l)
        idx = np.stack([np.flatnonzero(group == e) for e in range(n_expert)])  # [E, ffe]
        target = np.stack([a[:, i].sum(1) for i in idx], axis=1).astype(np.float64)  # [N, E]
        if router == "lsq":
            R, b = fit_router(x[:n_fit].astype(np.float64), target[:n_fit], router_bias)
        elif router == "random":  # the control: the random MoE configs' kind of router
            R, b = np.random.default_rng(seed + 1000 + l).standard_normal((n_expert, d)), None
        else:
            raise ValueError(f"unknown router {router!r} (lsq, random)")
        s = x.astype(np.float64) @ R.T + (0.0 if b is None else b)
        q = [router_quality(s[n_fit:], target[n_fit:], k) for k in top_k] if n > n_fit else []
        quality.append(q)
        if (l + 1) % 10 == 0 and l + 1 < n_layer:
            log(f"  {l + 1} of {n_layer} layers split ({time.time() - t0:.0f} s)")
        spread = float(np.quantile(s.max(1) - s.min(1), 0.999))
        eps = flat / max(spread, 1e-30)
        layers.append(dict(gate=wg[idx], up=wu[idx], down=np.stack([wd[:, i] for i in idx]),
                           router=(R * eps).astype(np.float32),
                           bias=None if b is None else (b * eps).astype(np.float32)))
    del prof
    for j, k in enumerate(top_k):
        if quality and quality[0]:
            hit = np.mean([q[j][0] for q in quality])
            kept = np.mean([q[j][1] for q in quality])
            log(f"router, top-{k} of {n_expert}, held-out calibration tokens: picks {hit:.1%} of the "
                f"true top-{k} experts, keeps {kept:.1%} of their |activation|")

    etype = Q.F32 if outtype == "f32" else Q.F16
    jobs = []
    ffn_names = {f"blk.{l}.{k}.weight" for l in range(n_layer) for k in FFN}
    for t in r.tensors:
        if t.name in ffn_names:
            continue
        shape = tuple(int(v) for v in reversed(t.shape))
        jobs.append(TensorJob(t.name, shape, t.tensor_type, lambda t=t: np.asarray(t.data), raw=True))
    for l, L in enumerate(layers):
        for kind, key, shape in (("ffn_gate_exps", "gate", (n_expert, ffe, d)),
                                 ("ffn_up_exps", "up", (n_expert, ffe, d)),
                                 ("ffn_down_exps", "down", (n_expert, d, ffe))):
            jobs.append(TensorJob(f"blk.{l}.{kind}.weight", shape, etype,
                                  lambda a=L[key]: np.ascontiguousarray(a, dtype=np.float32)))
        jobs.append(TensorJob(f"blk.{l}.ffn_gate_inp.weight", (n_expert, d), Q.F32, lambda a=L["router"]: a))
        if L["bias"] is not None:
            jobs.append(TensorJob(f"blk.{l}.ffn_gate_inp.bias", (n_expert,), Q.F32, lambda a=L["bias"]: a))

    keys = {f"{ARCH}.{k}" for k in ("feed_forward_length", "expert_count", "expert_used_count",
                                    "expert_feed_forward_length", "expert_weights_norm",
                                    "expert_weights_scale", "expert_gating_func")}
    kv = [e for e in _kv_entries(r) if e[0] != "general.architecture" and e[0] not in keys]

    def setup(w, k):
        add_kv(w, kv)
        add_kv(w, [(f"{ARCH}.feed_forward_length", ffe, V.UINT32, None),
                   (f"{ARCH}.expert_feed_forward_length", ffe, V.UINT32, None),
                   (f"{ARCH}.expert_count", n_expert, V.UINT32, None),
                   (f"{ARCH}.expert_used_count", k, V.UINT32, None),
                   (f"{ARCH}.expert_weights_norm", True, V.BOOL, None),
                   (f"{ARCH}.expert_weights_scale", float(k), V.FLOAT32, None)])

    first = os.fspath(dst)
    write_gguf(first, lambda w: setup(w, top_k[0]), jobs, progress=False, arch=ARCH)
    out = [first]
    stem, ext = os.path.splitext(first)
    for k in top_k[1:]:
        p = f"{stem}-k{k}{ext}"
        shutil.copyfile(first, p)
        set_top_k(p, k)
        out.append(p)
    log(f"{n_layer} layers x {n_expert} experts of {ffe} neurons ({cluster} clustering, {router} "
        f"router {'with' if router_bias else 'without'} bias, --flat {flat:g}): {', '.join(out)} "
        f"({time.time() - t0:.0f} s)")
    return out


def set_top_k(path: str, k: int) -> None:
    """Patch a MoEfied file's expert_used_count and expert_weights_scale in place (both
    fixed-size values)."""
    r = gguf.GGUFReader(path, "r+")
    r.fields[f"{ARCH}.expert_used_count"].parts[-1][0] = k
    r.fields[f"{ARCH}.expert_weights_scale"].parts[-1][0] = float(k)
    r.data.flush()


def random_router_copy(src: str, dst: str, seed: int = 0) -> str:
    """A copy of the MoEfied file src whose routers are random Gaussian projections (the
    random MoE configs' kind of router) with the fitted ones' norms, so the logits keep
    about the same small spread: the same experts, the routing with no learned structure
    (a control for the cache simulation)."""
    shutil.copyfile(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    rng = np.random.default_rng(seed)
    n = 0
    for t in r.tensors:
        if t.name.endswith(".ffn_gate_inp.weight"):
            if t.tensor_type != Q.F32:
                raise ConvertError(f"{src}: {t.name} is {t.tensor_type.name}, not a router this tool wrote")
            a = np.asarray(t.data)
            g = rng.standard_normal(a.shape)
            a[...] = (g * (np.linalg.norm(a) / np.linalg.norm(g))).astype(np.float32)
            n += 1
        elif t.name.endswith(".ffn_gate_inp.bias"):
            np.asarray(t.data)[...] = 0.0
    if n == 0:
        raise ConvertError(f"{src} has no router (ffn_gate_inp) to replace")
    r.data.flush()
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="dense llama-family GGUF with a gated FFN (with --random-router: a "
                                  "file this tool wrote)")
    ap.add_argument("--calib", help="calibration text (keep it disjoint from the evaluation's)")
    ap.add_argument("--random-router", action="store_true",
                    help="copy MODEL (a MoEfied file) to --out with random routers (the control)")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--experts", type=int, default=16, help="experts per layer (divides feed_forward_length)")
    ap.add_argument("--top-k", default="4", help="experts used per token; a list writes one file per value")
    ap.add_argument("--tokens", type=int, default=8192, help="calibration tokens (the first ones)")
    ap.add_argument("--cluster", choices=("activation", "weights"), default="activation")
    ap.add_argument("--router", choices=("lsq", "random"), default="lsq",
                    help="random: a random projection instead of the fitted router (a control: the "
                         "same experts routed as the random MoE configs are)")
    ap.add_argument("--router-bias", action="store_true",
                    help="fit a router bias too (ffn_gate_inp.bias: this runtime reads it, llama.cpp's "
                         "Mixtral does not)")
    ap.add_argument("--flat", type=float, default=1e-3, help="largest spread of the stored router logits")
    ap.add_argument("--outtype", choices=("f16", "f32"), default="f16", help="the experts' storage")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.random_router:
        random_router_copy(a.model, a.out, a.seed)
        print(f"{a.out}: {a.model} with random routers")
        return 0
    if not a.calib:
        ap.error("--calib is required")
    with Model(a.model, n_ctx=16) as m:
        ids = m.tokenize(open(a.calib, encoding="utf-8").read())[:a.tokens]
    moefy(a.model, a.out, ids, a.experts, [int(v) for v in a.top_k.split(",")], cluster=a.cluster,
          router=a.router, router_bias=a.router_bias, flat=a.flat, outtype=a.outtype, n_threads=a.threads, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
