"""Neuron placement: which FFN neurons go to the GPU under a VRAM budget.

The budget is spent in PowerInfer's priority: dense parts first (attention
weights, predictors, norms, output head, KV cache for ``ctx`` tokens), each
layer's part placed in turn while it fits; what is left goes to FFN neurons.

Neurons of each layer are sorted by activation frequency (most frequent
first) and cut into groups of ``group_size``. Binary ``x[l,g]`` = group g of
layer l on the GPU. The ILP (python-mip, CBC)::

    maximize   sum_{l,g} value[l,g] * x[l,g]          (activation mass served)
    subject to sum_{l,g} bytes[l,g] * x[l,g] <= remaining budget
               x[l,g+1] <= x[l,g]                     (groups taken in frequency order)
               x[l,g] <= y[l]                         (y[l] = layer l has GPU neurons)
               sum_g x[l,g] >= min_groups[l] * y[l]   (none, or enough to pay for
                                                       the layer's synchronisation)

solved with a time limit, warm-started from ``greedy_placement`` and never
returned worse than it. ``value`` = the summed activation frequency of the
group, i.e. the expected number of active neurons per token it serves.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import math
import time
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES

from .. import format as F
from ..sizes import format_size, parse_size  # noqa: F401 (re-exported for the sparse modules)
from .ffn_view import ATTN_KINDS, ffn_view

__all__ = ["DenseItem", "PlacementProblem", "Placement", "parse_size", "format_size",
           "make_problem", "greedy_placement", "ilp_placement", "solve_placement"]

#: Dense-part categories in the order they claim the budget.
DENSE_PRIORITY = ("attention", "predictor", "norm", "output", "kv_cache")


@dataclass
class DenseItem:
    """A dense part that claims VRAM before the neurons."""
    category: str  # one of DENSE_PRIORITY
    name: str
    nbytes: int


@dataclass
class PlacementProblem:
    """Everything the solvers need."""
    freq: list[np.ndarray]          # per layer: activation frequency of each neuron [n_ff]
    neuron_bytes: list[int]         # per layer: bytes one neuron costs on the GPU
    dense: list[DenseItem]          # in priority order
    budget: int                     # total VRAM budget (bytes)
    group_size: int = 64
    min_layer_share: float = 0.05   # a layer gets 0 or >= this share of its neurons
    # derived (make_problem / _prepare)
    order: list[np.ndarray] = field(default_factory=list)    # neurons by frequency, desc
    gvalue: list[np.ndarray] = field(default_factory=list)   # per layer per group
    gbytes: list[np.ndarray] = field(default_factory=list)
    gsize: list[np.ndarray] = field(default_factory=list)
    min_groups: list[int] = field(default_factory=list)
    dense_bytes: int = 0
    placed_dense: list[DenseItem] = field(default_factory=list)
    remaining: int = 0

    @property
    def n_layer(self) -> int:
        return len(self.freq)


@dataclass
class Placement:
    """The solution: per layer the GPU ("hot") neuron ids, sorted."""
    hot: list[np.ndarray]
    groups: list[int]               # groups taken per layer (a prefix in frequency order)
    solver: str                     # "ilp", "greedy" or "none"
    budget: int
    dense_bytes: int
    neuron_bytes: int
    served: float                   # activation mass served by the GPU
    total: float                    # total activation mass
    seconds: float = 0.0
    status: str = ""
    greedy_served: float | None = None
    bound: float | None = None      # LP upper bound on `served` (ILP only)

    @property
    def served_share(self) -> float:
        return self.served / self.total if self.total > 0 else 0.0

    def gpu_idx(self, layer: int, n_ff: int) -> np.ndarray:
        m = np.zeros(n_ff, dtype=np.int32)
        m[self.hot[layer]] = 1
        return m

    def summary(self) -> str:
        extra = f", greedy {self.greedy_served / self.total:.2%}" if self.greedy_served is not None \
            and self.total > 0 else ""
        if self.bound is not None and self.total > 0:
            extra += f", LP bound {self.bound / self.total:.2%}"
        return (f"placement ({self.solver}, {self.seconds:.2f} s{', ' + self.status if self.status else ''}): "
                f"budget {format_size(self.budget)}, dense {format_size(self.dense_bytes)}, "
                f"neurons {format_size(self.neuron_bytes)}, "
                f"GPU neurons per layer {[len(h) for h in self.hot]}, "
                f"served activation mass {self.served_share:.2%}{extra}")


def make_problem(freq, neuron_bytes, dense, budget: int, group_size: int = 64,
                 min_layer_share: float = 0.05) -> PlacementProblem:
    """Build a problem: place the dense parts in priority order, group the neurons."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    if not 0.0 <= min_layer_share <= 1.0:
        raise ValueError("min_layer_share must be in [0, 1]")
    if len(freq) != len(neuron_bytes):
        raise ValueError("freq and neuron_bytes need one entry per layer")
    p = PlacementProblem([np.asarray(f, dtype=np.float64) for f in freq], [int(b) for b in neuron_bytes],
                         list(dense), int(budget), int(group_size), float(min_layer_share))
    rank = {c: i for i, c in enumerate(DENSE_PRIORITY)}
    items = sorted(p.dense, key=lambda it: rank.get(it.category, len(rank)))  # stable: keeps layer order
    left = p.budget
    for it in items:
        if it.nbytes > left:
            break  # strict priority: a later part never jumps ahead of one that did not fit
        left -= it.nbytes
        p.placed_dense.append(it)
    p.dense_bytes = p.budget - left
    p.remaining = left
    for f, nb in zip(p.freq, p.neuron_bytes):
        n = len(f)
        order = np.argsort(-f, kind="stable")
        starts = np.arange(0, n, group_size)
        sizes = np.minimum(group_size, n - starts)
        sf = f[order]
        p.order.append(order)
        p.gvalue.append(np.add.reduceat(sf, starts) if n else np.zeros(0))
        p.gsize.append(sizes)
        p.gbytes.append(sizes.astype(np.int64) * nb)
        ng = len(starts)
        p.min_groups.append(min(ng, max(1, math.ceil(min_layer_share * n / group_size))) if ng else 0)
    return p


def _result(p: PlacementProblem, groups: list[int], solver: str, seconds: float, status: str = "") -> Placement:
    hot, served, nbytes = [], 0.0, 0
    for l, k in enumerate(groups):
        n = int(p.gsize[l][:k].sum())
        hot.append(np.sort(p.order[l][:n]).astype(np.int32))
        served += float(p.gvalue[l][:k].sum())
        nbytes += int(p.gbytes[l][:k].sum())
    total = float(sum(f.sum() for f in p.freq))
    return Placement(hot, list(groups), solver, p.budget, p.dense_bytes, nbytes, served, total, seconds, status)


def _feasible(p: PlacementProblem, groups: list[int]) -> bool:
    used = sum(int(p.gbytes[l][:k].sum()) for l, k in enumerate(groups))
    return used <= p.remaining and all(k == 0 or k >= p.min_groups[l] for l, k in enumerate(groups))


def _greedy_groups(p: PlacementProblem) -> list[int]:
    """Repeatedly take the best value-per-byte step that fits: the next group of a
    layer already on the GPU, or a layer's first block of min_groups groups. The
    budget only shrinks, so a step that does not fit never will: a heap suffices."""
    k = [0] * p.n_layer
    left = p.remaining
    heap = []

    def push(l):
        ng = len(p.gvalue[l])
        if k[l] >= ng:
            return
        n = 1 if k[l] > 0 else p.min_groups[l]
        b = int(p.gbytes[l][k[l]:k[l] + n].sum())
        v = float(p.gvalue[l][k[l]:k[l] + n].sum())
        heapq.heappush(heap, (-(v / b) if b > 0 else -math.inf, l, n, b))

    for l in range(p.n_layer):
        push(l)
    while heap:
        _, l, n, b = heapq.heappop(heap)
        if b > left:
            continue  # this layer can never grow again
        left -= b
        k[l] += n
        push(l)
    return k


def lp_bound(p: PlacementProblem) -> float:
    """Upper bound on the served mass: the fractional knapsack over all groups
    without the per-layer minimum (group densities fall along each layer's
    frequency order, so taking them by density respects the prefix order)."""
    vals = np.concatenate([v for v in p.gvalue] or [np.zeros(0)])
    bts = np.concatenate([b for b in p.gbytes] or [np.zeros(0, np.int64)]).astype(np.float64)
    if not len(vals):
        return 0.0
    dens = np.where(bts > 0, vals / np.maximum(bts, 1e-300), np.inf)
    order = np.argsort(-dens, kind="stable")
    cb = np.cumsum(bts[order])
    n_full = int(np.searchsorted(cb, p.remaining, side="right"))
    ub = float(vals[order[:n_full]].sum())
    if n_full < len(order):
        used = float(cb[n_full - 1]) if n_full else 0.0
        j = order[n_full]
        ub += float(vals[j]) * (p.remaining - used) / float(bts[j])
    return ub


def greedy_placement(p: PlacementProblem) -> Placement:
    """Greedy by value per byte over frequency-ordered groups (each layer's first
    step is a block of its minimum size). Fast; the ILP's warm start."""
    t0 = time.perf_counter()
    g = _greedy_groups(p)
    solver = "greedy" if any(g) else "none"
    return _result(p, g, solver, time.perf_counter() - t0)


def ilp_placement(p: PlacementProblem, time_limit: float = 10.0, verbose: bool = False,
                  rel_gap: float = 1e-6) -> Placement:
    """The placement ILP (python-mip / CBC), warm-started from the greedy
    solution; the greedy one is returned when the ILP does not beat it. CBC stops
    at ``time_limit`` seconds or when proven within ``rel_gap`` of the optimum."""
    with contextlib.redirect_stdout(io.StringIO()):  # mip announces itself on import
        import mip

    t0 = time.perf_counter()
    greedy = _greedy_groups(p)
    gval = sum(float(p.gvalue[l][:k].sum()) for l, k in enumerate(greedy))
    total_bytes = sum(int(b.sum()) for b in p.gbytes)
    if total_bytes <= p.remaining:  # everything fits: nothing to decide
        res = _result(p, [len(v) for v in p.gvalue], "ilp" if total_bytes else "none",
                      time.perf_counter() - t0, "all fit")
        res.greedy_served = gval
        return res
    if p.remaining <= 0 or all(len(v) == 0 for v in p.gvalue):
        res = _result(p, [0] * p.n_layer, "none", time.perf_counter() - t0, "no budget left")
        res.greedy_served = gval
        return res

    ub = lp_bound(p)
    if ub - gval <= rel_gap * ub:  # greedy already within the gap of the LP bound
        res = _result(p, greedy, "greedy" if any(greedy) else "none", time.perf_counter() - t0,
                      "greedy within gap of the LP bound")
        res.greedy_served, res.bound = gval, ub
        return res

    m = mip.Model(sense=mip.MAXIMIZE, solver_name=mip.CBC)
    m.verbose = 1 if verbose else 0
    m.threads = 1
    m.seed = 0
    m.max_mip_gap = rel_gap
    m.max_mip_gap_abs = 1e-12
    # scale values so the objective is O(1..1e6) whatever the token count
    vmax = max((float(v.max()) for v in p.gvalue if len(v)), default=1.0) or 1.0
    x, y = [], []
    for l in range(p.n_layer):
        ng = len(p.gvalue[l])
        x.append([m.add_var(var_type=mip.BINARY, name=f"x_{l}_{g}") for g in range(ng)])
        y.append(m.add_var(var_type=mip.BINARY, name=f"y_{l}"))
    m.objective = mip.xsum(float(p.gvalue[l][g]) / vmax * x[l][g]
                           for l in range(p.n_layer) for g in range(len(x[l])))
    m += mip.xsum(int(p.gbytes[l][g]) * x[l][g] for l in range(p.n_layer) for g in range(len(x[l]))) \
        <= int(p.remaining), "budget"
    for l in range(p.n_layer):
        xl = x[l]
        for g in range(len(xl) - 1):
            m += xl[g + 1] <= xl[g]
        for g in range(len(xl)):
            m += xl[g] <= y[l]
        m += mip.xsum(xl) >= p.min_groups[l] * y[l]
    start = []
    for l, k in enumerate(greedy):
        start += [(x[l][g], 1.0 if g < k else 0.0) for g in range(len(x[l]))]
        start.append((y[l], 1.0 if k > 0 else 0.0))
    with contextlib.redirect_stdout(io.StringIO()) if not verbose else contextlib.nullcontext():
        m.start = start
    status = m.optimize(max_seconds=max(0.1, float(time_limit)))
    groups = None
    if status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) and m.num_solutions:
        groups = [int(round(sum(v.x for v in x[l]))) for l in range(p.n_layer)]
        # re-read as prefixes (the constraints force them; guard against tolerances)
        for l in range(p.n_layer):
            k = 0
            while k < len(x[l]) and x[l][k].x >= 0.5:
                k += 1
            groups[l] = k
        if not _feasible(p, groups):
            groups = None
    secs = time.perf_counter() - t0
    sname = status.name.lower()
    if groups is None:
        res = _result(p, greedy, "greedy" if any(greedy) else "none", secs, f"ILP {sname}; greedy kept")
    else:
        ival = sum(float(p.gvalue[l][:k].sum()) for l, k in enumerate(groups))
        if ival + 1e-12 * max(1.0, abs(gval)) < gval:
            res = _result(p, greedy, "greedy", secs, f"ILP ({sname}) worse than greedy; greedy kept")
        else:
            res = _result(p, groups, "ilp" if any(groups) else "none", secs, sname)
    res.greedy_served, res.bound = gval, ub
    return res


def solve_placement(p: PlacementProblem, method: str = "ilp", time_limit: float = 10.0) -> Placement:
    if method == "ilp":
        return ilp_placement(p, time_limit)
    if method == "greedy":
        return greedy_placement(p)
    raise ValueError(f"unknown placement method {method!r} (ilp, greedy)")


# ---------------------------------------------------------------------------
# Costs from tensor descriptions (a plan being written, or a GGUF being read)
# ---------------------------------------------------------------------------

def tensor_nbytes(qtype, shape) -> int:
    bs, ts = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // bs * ts


def model_costs(tensors: dict, n_layer: int, n_embd_kv: int, ctx: int,
                kv_bytes_per_elem: int = 2, tied: bool = False):
    """From ``{name: (qtype, numpy shape)}`` of a sparse model: (dense items in
    priority order, per-layer bytes of one neuron on the GPU).

    A neuron costs its gate and up rows (ungated FFNs: up's alone; in the file's layout,
    ffn_view.py), its ffn_down_t row and 4 bytes of bucket index. Attention is every attn_*
    projection of a layer (separate or fused QKV, biases included); norms are every norm and
    the FFN biases. The KV cache costs 2 · n_layer · ctx · n_embd_kv elements (the runtime's default cache is f16:
    ``kv_bytes_per_elem`` = 2).
    """
    def nb(name):
        q, s = tensors[name]
        return tensor_nbytes(q, s)

    norm_kinds = {F.T_ATTN_NORM, F.T_ATTN_NORM_2, F.T_FFN_NORM, F.T_ATTN_Q_NORM, F.T_ATTN_K_NORM,
                  F.T_POST_ATTN_NORM, F.T_POST_FFW_NORM}
    layer_att, layer_small = [0] * n_layer, [0] * n_layer
    for name in tensors:
        kind, il, suffix = F.parse_tensor_name(name)
        if il is None or il >= n_layer:
            continue
        if kind in ATTN_KINDS:
            layer_att[il] += nb(name)
        elif kind in norm_kinds or (kind in (F.T_FFN_UP, F.T_FFN_DOWN) and suffix == "bias"):
            layer_small[il] += nb(name)

    dense: list[DenseItem] = []
    for l in range(n_layer):
        dense.append(DenseItem("attention", f"blk.{l}.attention", layer_att[l]))
    for l in range(n_layer):
        pred = sum(nb(F.sparse_tensor_name(k, l)) for k in (F.T_FC1, F.T_FC2)
                   if F.sparse_tensor_name(k, l) in tensors)
        dense.append(DenseItem("predictor", f"blk.{l}.predictor", pred))
    norms = sum(layer_small) + sum(nb(n) for n in (F.tensor_name(F.T_OUTPUT_NORM),
                                                     F.tensor_name(F.T_OUTPUT_NORM, suffix="bias"))
                                   if n in tensors)
    dense.append(DenseItem("norm", "norms", norms))
    head = F.tensor_name(F.T_OUTPUT)
    dense.append(DenseItem("output", "output head", nb(head if head in tensors else F.tensor_name(F.T_TOKEN_EMBD))))
    for l in range(n_layer):
        dense.append(DenseItem("kv_cache", f"blk.{l}.kv_cache", 2 * ctx * n_embd_kv * kv_bytes_per_elem))
    def rows(name):
        return tensors[name][1][0] if name in tensors else None

    per_neuron = []
    for l in range(n_layer):
        b = 4
        n_ff = tensors[F.sparse_tensor_name(F.T_FFN_DOWN_T, l)][1][0]
        v = ffn_view(rows, l, n_ff)
        for name in v.inputs + (v.down,):  # its gate and up rows (in any layout), its down_t row
            q, s = tensors[name]
            b += tensor_nbytes(q, s) // n_ff
        per_neuron.append(b)
    return dense, per_neuron
