"""Activation predictors: per layer ``score = W2 · relu(W1 · x)`` (no biases).

Neuron j of the layer's FFN is predicted active for the FFN input x iff
``score_j >= threshold`` (one global threshold per file, default 0). The
runtime computes only the predicted-active neurons, so a missed active neuron
(a recall error) changes the output while a false positive only costs time:
the loss favours recall — a binary cross-entropy whose positive terms are
weighted by ``pos_weight`` — and the weight is raised (by fine-tuning) until the
recall on held-out tokens reaches the target.

The hidden size h is chosen per layer: it starts small and doubles (the wider
net starts from the narrower one: old units kept, new ones added with zero
output weights) until held-out recall reaches ``recall_target`` with a
positive weight of at most ``max_pos_weight``; it is capped at ``h_max``
(default min(n_embd, n_ff / 2)) and the shortfall reported.

For ReGLU models the converter also passes the layer's gate weights: a neuron fires iff
its gate row . x > 0, so the best rank-h/2 approximation of the gate on the profiled
inputs (_gate_lowrank) is itself a predictor of hidden size h. At each size it is tried
before training and taken when it reaches the recall target (on the benchmark model,
whose hidden states live in a 129-dimensional subspace, it is exact up to rounding).

Training inputs can be whitened (``whiten``): hidden states with one huge near-constant
direction and rounding noise in the rest (a Q4_0 model's) otherwise send least squares
and Adam after the noise, and recall is then bought with density (see _whitener).

Pure numpy (float32, seeded: the same data gives the same predictors);
torch is used as an accelerator only when ``backend="torch"`` is asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tqdm import tqdm

__all__ = ["PredictorConfig", "blas_threads", "LayerPredictor", "train_layer", "train_predictors", "evaluate",
           "predictor_scores", "format_report"]


@dataclass
class PredictorConfig:
    recall_target: float = 0.99
    threshold: float = 0.0
    h_start: int = 32
    h_max: int | None = None        # default: min(n_embd, n_ff // 2), at least h_start
    holdout: float = 0.2            # share of the tokens (the last ones) held out
    epochs: int = 12                # epochs at the first size; later sizes train `grow_epochs`
    grow_epochs: int = 8
    tune_epochs: int = 2            # per positive-weight step
    max_tune_steps: int = 8
    batch: int = 256
    lr: float = 3e-3
    pos_weight: float | None = None  # None: sqrt((1 - density) / density) (the training set's), >= 1
    pos_weight_step: float = 2.0     # factor per recall-tuning step
    max_pos_weight: float | None = None  # None: 16 (1 - density) / density
    seed: int = 0
    backend: str = "numpy"          # "numpy" | "torch"
    blas_threads: int | None = 1    # OpenBLAS threads while training (None: leave as is)
    whiten: float | None = None     # train on whitened inputs, floor eps (see _whitener); None: only rescale
    train_fallback: bool = True     # with a gate: train when its approximation misses the target


@dataclass
class LayerPredictor:
    layer: int
    w1: np.ndarray          # [h, n_embd] float32
    w2: np.ndarray          # [n_ff, h] float32
    recall: float           # on held-out tokens, at the threshold
    precision: float
    pred_density: float     # share of neurons predicted active
    true_density: float     # share truly active (held-out)
    reached: bool           # recall >= target
    pos_weight: float
    n_train: int
    n_heldout: int
    seconds: float
    tried: list = field(default_factory=list)  # (h, recall, precision, pos_weight) per size tried

    @property
    def h(self) -> int:
        return int(self.w1.shape[0])

    def n_params(self) -> int:
        return int(self.w1.size + self.w2.size)


def predictor_scores(w1: np.ndarray, w2: np.ndarray, x: np.ndarray) -> np.ndarray:
    a = x @ w1.T
    np.maximum(a, 0, out=a)
    return a @ w2.T


def evaluate(w1, w2, x, mask, threshold: float = 0.0, chunk: int = 2048) -> tuple[float, float, float]:
    """(recall, precision, predicted density) of a predictor over (x, mask).
    Recall = predicted-and-active / active, over all tokens and neurons."""
    tp = fp = pos = 0
    n = 0
    for i in range(0, len(x), chunk):
        s = predictor_scores(w1, w2, np.asarray(x[i:i + chunk], dtype=np.float32))
        p = s >= threshold
        m = np.asarray(mask[i:i + chunk], dtype=bool)
        tp += int(np.count_nonzero(p & m))
        fp += int(np.count_nonzero(p & ~m))
        pos += int(np.count_nonzero(m))
        n += p.size
    recall = tp / pos if pos else 1.0
    precision = tp / (tp + fp) if tp + fp else 1.0
    return recall, precision, (tp + fp) / n if n else 0.0


@contextlib.contextmanager
def blas_threads(n: int | None):
    """Limit numpy's OpenBLAS to ``n`` threads inside the block (best effort; no-op
    when n is None or the library cannot be found). Small predictor matmuls run
    an order of magnitude faster single-threaded on a busy machine."""
    if not n:
        yield
        return
    fns = _openblas_fns()
    if fns is None:
        yield
        return
    get, set_ = fns
    old = get()
    set_(int(n))
    try:
        yield
    finally:
        set_(old)


def _openblas_fns():
    try:
        with open("/proc/self/maps") as f:
            paths = set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read()))
    except OSError:
        return None
    for p in sorted(paths):
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        for pre, suf in (("scipy_openblas", "64_"), ("openblas", ""), ("openblas", "64_"), ("scipy_openblas", "")):
            g, s = getattr(lib, f"{pre}_get_num_threads{suf}", None), getattr(lib, f"{pre}_set_num_threads{suf}", None)
            if g is not None and s is not None:
                g.restype = ctypes.c_int
                s.argtypes = [ctypes.c_int]
                return g, s
    return None


class _Adam:
    def __init__(self, params, lr):
        self.lr = lr
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.t = 0

    def step(self, params, grads, lr):
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        c1 = 1 - b1 ** self.t
        c2 = 1 - b2 ** self.t
        for p, g, m, v in zip(params, grads, self.m, self.v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * (g * g)
            p -= (lr / c1) * m / (np.sqrt(v / c2) + eps)


def _train_numpy(w1, w2, x, y, pos_weight, epochs, cfg: PredictorConfig, rng):
    n = len(x)
    params = [w1, w2]
    opt = _Adam(params, cfg.lr)
    steps = max(1, epochs * math.ceil(n / cfg.batch))
    t = 0
    inv = np.float32(1.0)
    for _ in range(epochs):
        perm = rng.permutation(n)
        for i in range(0, n, cfg.batch):
            idx = perm[i:i + cfg.batch]
            xb = x[idx]
            yb = y[idx]
            a = xb @ w1.T
            r = np.maximum(a, 0)
            s = r @ w2.T
            # d/ds of  -[pw·y·log σ(s) + (1-y)·log(1-σ(s))]  =  σ(s)·(pw·y + 1 - y) − pw·y
            np.clip(s, -30, 30, out=s)
            sig = 1.0 / (1.0 + np.exp(-s))
            wy = yb * np.float32(pos_weight)
            g = sig * (wy + (1 - yb)) - wy
            g *= inv / np.float32(len(idx))
            gw2 = g.T @ r
            dr = g @ w2
            dr *= (a > 0)
            gw1 = dr.T @ xb
            lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * t / steps))  # cosine decay
            opt.step(params, [gw1, gw2], lr)
            t += 1
    return w1, w2


def _train_torch(w1, w2, x, y, pos_weight, epochs, cfg: PredictorConfig, rng):
    import torch

    torch.manual_seed(int(rng.integers(1 << 31)))
    tw1 = torch.nn.Parameter(torch.from_numpy(w1.copy()))
    tw2 = torch.nn.Parameter(torch.from_numpy(w2.copy()))
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam([tw1, tw2], lr=cfg.lr)
    n = len(x)
    steps = max(1, epochs * math.ceil(n / cfg.batch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps)))
    pw = torch.tensor(float(pos_weight))
    for _ in range(epochs):
        perm = torch.from_numpy(rng.permutation(n))
        for i in range(0, n, cfg.batch):
            idx = perm[i:i + cfg.batch]
            s = torch.relu(tx[idx] @ tw1.T) @ tw2.T
            loss = torch.nn.functional.binary_cross_entropy_with_logits(s, ty[idx], pos_weight=pw)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return tw1.detach().numpy().copy(), tw2.detach().numpy().copy()


def _whitener(x: np.ndarray, eps: float | None) -> np.ndarray:
    """[d, d] input transform for training. eps None: 1/RMS(x) (the same training whatever
    the input norm). Else ZCA whitening of the second moment C = E[x x^T]:
    V diag(1 / sqrt(lam + eps * mean(lam))) V^T scaled to unit RMS. Hidden states have a
    few very large directions (a near-constant one among them); without whitening the
    decision boundary lives in directions hundreds of times smaller, which the optimizer
    barely moves in, and least squares overfits the noise directions. The floor
    eps * mean(lam) keeps directions with next to no variance (rounding noise) from being
    blown up."""
    x64 = x.astype(np.float64)
    d = x64.shape[1]
    if eps is None:
        s = float(np.sqrt(np.mean(x64 ** 2))) or 1.0
        return np.eye(d, dtype=np.float32) / np.float32(s)
    c = x64.T @ x64 / max(1, len(x64))
    lam, v = np.linalg.eigh(c)
    lam = np.maximum(lam, 0.0)
    floor = eps * float(lam.mean()) + 1e-30
    w = (v / np.sqrt(lam + floor)) @ v.T
    s = float(np.sqrt(np.mean((x64 @ w) ** 2))) or 1.0
    return (w / s).astype(np.float32)


def _linear_directions(xs, y, h_max):
    """SVD of the least-squares linear map x -> 2y-1 (ridge-regularised)."""
    x64 = xs.astype(np.float64)
    d = x64.shape[1]
    g = x64.T @ x64
    g[np.diag_indices(d)] += 1e-3 * (np.trace(g) / d + 1e-12)
    b = x64.T @ (2.0 * y.astype(np.float64) - 1.0)
    lt = np.linalg.solve(g, b)                  # [d, n_ff]
    u, sv, vt = np.linalg.svd(lt, full_matrices=False)
    return u.astype(np.float32), sv.astype(np.float32), vt.astype(np.float32)


def _units(u, sv, vt, h0, h1, d, n_ff, rng):
    """Hidden units h0..h1-1: pairs (+v, -v) for singular directions h0/2.., random
    units once the directions run out."""
    w1 = np.empty((h1 - h0, d), np.float32)
    w2 = np.empty((n_ff, h1 - h0), np.float32)
    for i, j in enumerate(range(h0, h1)):
        k, sign = divmod(j, 2)
        if k < len(sv):
            w1[i] = u[:, k] * (1 if sign == 0 else -1)
            w2[:, i] = vt[k] * sv[k] * (2 if sign == 0 else -2)
        else:
            w1[i] = rng.standard_normal(d) / math.sqrt(d)
            w2[:, i] = 0.0
    return w1, w2


def _gate_lowrank(x: np.ndarray, gate: np.ndarray) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    """Rank-k approximations A B of the gate matrix G [n_ff, d] that are best on the data:
    they minimise E||G x - A B x||^2 over the rows of x (SVD of G C^1/2, C = E[x x^T]).
    The decompositions do not depend on k, so they are made once here; the returned
    function gives, for a rank k, predictor weights w1 = [B; -B], w2 = [A, -A], so that
    W2 relu(W1 x) = A B x (relu(v) - relu(-v) = v)."""
    x64 = x.astype(np.float64)
    c = x64.T @ x64 / max(1, len(x64))
    lam, q = np.linalg.eigh(c)
    lam = np.maximum(lam, 0.0)
    # directions with (next to) no variance are left out of the inverse: their weights
    # would be huge and, once the predictor is stored in 8 bits, would swamp the rest
    keep = lam > 1e-6 * float(lam.max())
    ch = (q * np.sqrt(lam)).astype(np.float32) @ q.T.astype(np.float32)
    cih = (q[:, keep] / np.sqrt(lam[keep])) @ q[:, keep].T
    g = np.asarray(gate, dtype=np.float32)
    gch = g @ ch                                   # [n_ff, d]
    mu, wv = np.linalg.eigh((gch.T @ gch).astype(np.float64))  # right singular vectors of G C^1/2
    wv = wv[:, ::-1]                               # largest first

    def rank(k: int) -> tuple[np.ndarray, np.ndarray]:
        wk = wv[:, :k]                             # [d, k]
        b = wk.T @ cih                             # [k, d]
        a = (gch @ wk.astype(np.float32)).astype(np.float64)  # [n_ff, k]
        # A B is unchanged by a_i -> a_i / s, b_i -> s b_i (relu is positively homogeneous):
        # give every column of A the same RMS, so 8-bit blocks of fc2 rows quantize evenly
        s = np.sqrt(np.mean(a * a, axis=0)) + 1e-30
        a /= s
        b *= s[:, None]
        w1 = np.concatenate([b, -b]).astype(np.float32)
        w2 = np.concatenate([a, -a], axis=1).astype(np.float32)
        return w1, w2

    return rank


def train_layer(x: np.ndarray, mask: np.ndarray, cfg: PredictorConfig | None = None, layer: int = 0,
                log: Callable[[str], None] | None = None, gate: np.ndarray | None = None) -> LayerPredictor:
    """Train one layer's predictor on FFN inputs x [N, n_embd] and true
    activation masks mask [N, n_ff] (the last ``holdout`` share of the tokens
    is held out for choosing h and reporting).

    ``gate`` [n_ff, n_embd] (the layer's gate weights as the runtime uses them; optional):
    at each hidden size (from h_start up) first try the data-weighted low-rank
    approximation of the gate itself (_gate_lowrank; in a ReLU-gated FFN a neuron fires
    iff its gate row . x > 0), taken without training when it reaches the recall target,
    then train at that size as below. When no size reaches the target, the trained net
    replaces the gate approximation of size h_max only if it has the higher recall at no
    higher predicted density (training buys recall with density: the positive weight rises
    until recall is met, so a higher recall alone can mean most neurons predicted active).
    With ``train_fallback`` off only the approximations are tried."""
    cfg = cfg or PredictorConfig()
    t0 = time.perf_counter()
    x = np.ascontiguousarray(x, dtype=np.float32)
    mask = np.asarray(mask, dtype=bool)
    n, d = x.shape
    if mask.shape[0] != n:
        raise ValueError(f"x has {n} rows, mask {mask.shape[0]}")
    n_ff = mask.shape[1]
    n_ho = max(1, int(round(n * cfg.holdout))) if n > 1 else 0
    n_tr = n - n_ho
    if n_tr < 1:
        raise ValueError("need at least 2 profiled tokens to train a predictor")
    xtr, ytr = x[:n_tr], mask[:n_tr].astype(np.float32)
    xho, mho = (x[n_tr:], mask[n_tr:]) if n_ho else (x, mask)
    # train on transformed inputs xs = x @ wt (wt folded back into w1 at the end, so the
    # stored predictor reads x as it is)
    wt = _whitener(xtr, cfg.whiten)
    xs = xtr @ wt
    density = float(ytr.mean()) if ytr.size else 0.0
    pw0 = cfg.pos_weight
    if pw0 is None:
        pw0 = float(max(1.0, math.sqrt((1 - density) / max(density, 1e-6))))
    pw_max = cfg.max_pos_weight if cfg.max_pos_weight is not None else \
        max(pw0, 16.0 * (1 - density) / max(density, 1e-6))
    h_max = cfg.h_max or max(cfg.h_start, min(d, n_ff // 2))
    rng = np.random.default_rng([cfg.seed, layer])
    train = _train_torch if cfg.backend == "torch" else _train_numpy

    def ev(w1, w2):
        return evaluate(w1 @ wt.T, w2, xho, mho, cfg.threshold)

    lowrank = None
    if gate is not None:
        gate = np.asarray(gate, dtype=np.float32)
        if gate.shape != (n_ff, d):
            raise ValueError(f"gate has shape {gate.shape}, expected {(n_ff, d)}")
        gate_rank = _gate_lowrank(xtr, gate)

    def try_gate(hg):
        g1, g2 = gate_rank(max(1, hg // 2))
        r = evaluate(g1, g2, xho, mho, cfg.threshold)
        if log:
            log(f"layer {layer}: gate rank {g1.shape[0] // 2} (h={g1.shape[0]}) recall {r[0]:.4f} "
                f"precision {r[1]:.3f} density {r[2]:.3f}")
        return (g1, g2) + r

    def gate_result(lr):
        g1, g2, rec, prec, dens = lr
        return LayerPredictor(layer, np.ascontiguousarray(g1), np.ascontiguousarray(g2), rec, prec, dens,
                              float(mho.mean()) if mho.size else 0.0, rec >= cfg.recall_target, 0.0, n_tr,
                              n_ho, time.perf_counter() - t0, [(g1.shape[0], rec, prec, 0.0)])

    if gate is not None and not cfg.train_fallback:
        hg = min(cfg.h_start, h_max)
        while True:
            lowrank = try_gate(hg)
            if lowrank[2] >= cfg.recall_target or hg >= h_max:
                return gate_result(lowrank)
            hg = min(2 * hg, h_max)

    h = min(cfg.h_start, h_max)
    # Start from the best linear predictor (least squares on +-1 targets), cut to
    # rank k by SVD: a rank-k linear map is exactly relu(V x) - relu(-V x) with
    # 2k hidden units. Wider nets take the next singular directions as new units
    # (with zero output weights, so the trained function is kept).
    u, sv, vt = _linear_directions(xs, ytr, h_max)
    w1, w2 = _units(u, sv, vt, 0, h, d, n_ff, rng)
    epochs = cfg.epochs
    tried = []
    pw = pw0
    while True:
        if gate is not None:
            # at each size the gate's approximation first: taken when it reaches the target
            lowrank = try_gate(h)
            if lowrank[2] >= cfg.recall_target:
                return gate_result(lowrank)
        w1, w2 = train(w1, w2, xs, ytr, pw, epochs, cfg, rng)
        rec, prec, dens = ev(w1, w2)
        steps = 0
        while rec < cfg.recall_target and steps < cfg.max_tune_steps and pw * cfg.pos_weight_step <= pw_max:
            pw *= cfg.pos_weight_step
            steps += 1
            w1, w2 = train(w1, w2, xs, ytr, pw, cfg.tune_epochs, cfg, rng)
            rec, prec, dens = ev(w1, w2)
        tried.append((h, rec, prec, pw))
        if log:
            log(f"layer {layer}: h={h} recall {rec:.4f} precision {prec:.3f} density {dens:.3f} pos_weight {pw:g}")
        if rec >= cfg.recall_target or h >= h_max:
            break
        h_new = min(2 * h, h_max)
        n1, n2 = _units(u, sv, vt, h, h_new, d, n_ff, rng)
        w1 = np.concatenate([w1, n1])
        w2 = np.concatenate([w2, np.zeros_like(n2)], axis=1)
        h = h_new
        epochs = cfg.grow_epochs
        pw = max(pw0, pw / cfg.pos_weight_step ** 2)
    w1 = np.ascontiguousarray(w1 @ wt.T, dtype=np.float32)
    w2 = np.ascontiguousarray(w2, dtype=np.float32)
    # no gate approximation reached the target (else it was returned): the trained net
    # replaces the largest one only if it reaches the target, or has the higher recall at
    # no higher predicted density
    if lowrank is not None and not (rec >= cfg.recall_target or (rec > lowrank[2] and dens <= lowrank[4])):
        w1, w2, rec, prec, dens = lowrank
        pw = 0.0
        tried.append((w1.shape[0], rec, prec, pw))
    return LayerPredictor(layer, w1, w2, rec, prec, dens, float(mho.mean()) if mho.size else 0.0,
                          rec >= cfg.recall_target, pw, n_tr, n_ho, time.perf_counter() - t0, tried)


def train_predictors(layers, cfg: PredictorConfig | None = None, progress: bool = True,
                     log: Callable[[str], None] | None = None,
                     gates: Callable[[int], np.ndarray | None] | None = None) -> list[LayerPredictor]:
    """Train every layer: ``layers`` is a sequence of (x, mask) pairs; ``gates(il)``, when
    given, returns layer il's gate weights [n_ff, n_embd] (see train_layer) or None."""
    cfg = cfg or PredictorConfig()
    out = []
    with blas_threads(cfg.blas_threads):
        for il, (x, mask) in enumerate(tqdm(layers, desc="predictors", unit="layer", disable=not progress)):
            out.append(train_layer(x, mask, cfg, il, log, gate=gates(il) if gates else None))
    return out


def format_report(preds: list[LayerPredictor], ffn_bytes: list[int] | None = None,
                  pred_bytes: list[int] | None = None, target: float | None = None) -> str:
    """A per-layer table: h, recall, precision, densities, predictor bytes / FFN bytes."""
    lines = ["layer     h  recall  precision  pred.density  true.density  pred/FFN bytes"]
    for i, p in enumerate(preds):
        share = f"{pred_bytes[i] / ffn_bytes[i]:.1%}" if ffn_bytes and pred_bytes else "-"
        flag = "" if p.reached else "  (target not reached)"
        lines.append(f"{p.layer:5d} {p.h:5d}  {p.recall:.4f}  {p.precision:9.3f}  {p.pred_density:12.3f}  "
                     f"{p.true_density:12.3f}  {share:>14}{flag}")
    if target is not None:
        bad = [p.layer for p in preds if not p.reached]
        lines.append(f"recall target {target}: " + ("reached in every layer" if not bad
                                                     else f"NOT reached in layers {bad} (h capped)"))
    return "\n".join(lines)
