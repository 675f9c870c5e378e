"""Expert placement of a mixture-of-experts model: which whole experts go on the device.

Profile: the expert selection counts of the native runtime (``Context.expert_counts``) over
calibration text give, per layer, each expert's frequency = the share of tokens whose top-k
held it (a layer's frequencies sum to k).

Budget, in the runtime's order (model/placement.c): each layer's attention projections, each
layer's router, the output head, each layer's shared expert (qwen2moe; each group in layer
order, stopping at the first that does not fit), then the expert cache a context makes
(whole experts of the largest layer's size, at least one), then the experts. A shared
expert comes first among the FFN bytes because every token runs it: its value per byte in
the objective below is 1, at least any routed expert's freq[l,e] (the ILP would take it
first too), and ``n_cpu_moe`` does not keep it on the CPU (llama.cpp's ``--n-cpu-moe``
names only the routed ``ffn_*_exps``). The ILP (python-mip, CBC) over binary ``x[l,e]`` (l not
among the first ``n_cpu_moe`` layers)::

    maximize   sum_{l,e} freq[l,e] * bytes[l] * x[l,e]   (expert bytes per token the device
                                                        reads instead of the CPU)
    subject to sum_{l,e} bytes[l] * x[l,e] <= bytes left

warm-started from the greedy rule the runtime uses without a stored placement (most
frequent first, ties by layer then id, each taken if it still fits) and never returned worse
than it. With equal expert sizes in every layer the greedy rule is optimal; the ILP matters
when layers store their experts in different types (the ``_m`` mixes).
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass

import numpy as np

from .. import format as F
from ..sizes import format_size
from .ffn_view import ATTN_KINDS
from .placement import tensor_nbytes

__all__ = ["ExpertPlacement", "expert_budget", "profile_experts", "solve_experts", "ExpertNeuronPlacement",
           "expert_neuron_freq", "solve_expert_neurons", "expert_hot_tensors"]


@dataclass
class ExpertPlacement:
    """on[l, e]: expert e of layer l on the device."""
    on: np.ndarray                  # bool [n_layer, n_expert]
    freq: np.ndarray                # float64 [n_layer, n_expert]
    expert_bytes: np.ndarray        # int64 [n_layer]: one expert's bytes
    budget: int
    dense_bytes: int                # attention, routers, head placed before
    shared_bytes: int               # the shared experts placed before (qwen2moe; else 0)
    shared_layers: int              # layers whose shared expert that is: the first ones
    cache_bytes: int                # the expert cache, whole experts
    left: int                       # bytes left to the experts
    n_cpu_moe: int
    solver: str                     # "ilp", "greedy" or "none"
    status: str = ""
    seconds: float = 0.0
    greedy_value: float = 0.0

    @property
    def bytes(self) -> int:
        return int((self.on.sum(axis=1) * self.expert_bytes).sum())

    @property
    def value(self) -> float:
        return float((self.freq * self.expert_bytes[:, None] * self.on).sum())

    @property
    def served_share(self) -> float:
        """Share of the profiled expert selections that the device's experts serve."""
        total = float(self.freq.sum())
        return float((self.freq * self.on).sum()) / total if total > 0 else 0.0

    def summary(self) -> str:
        return (f"expert placement ({self.solver}, {self.seconds:.2f} s"
                f"{', ' + self.status if self.status else ''}): budget {format_size(self.budget)}, "
                f"attention/routers/head {format_size(self.dense_bytes)}, shared experts "
                f"{format_size(self.shared_bytes)} ({self.shared_layers} layers), expert cache "
                f"{format_size(self.cache_bytes)}, experts {format_size(self.bytes)} of "
                f"{format_size(self.left)} left; device experts per layer "
                f"{[int(v) for v in self.on.sum(axis=1)]}, served selections {self.served_share:.2%}")


def _nbytes(tensors: dict, name: str) -> int:
    q, s = tensors[name]
    return tensor_nbytes(q, s)


def expert_budget(tensors: dict, n_layer: int, n_expert: int, budget: int,
                  cache: int = 0) -> tuple[int, int, int, int, int, np.ndarray]:
    """(dense bytes placed, shared expert bytes placed, layers whose shared expert that is,
    cache bytes, bytes left for experts, one expert's bytes per layer) for ``budget``, as
    the runtime spends it (module doc)."""
    left = int(budget)
    dense = shared = n_shared = 0
    groups = [[F.tensor_name(k, l) for k in ATTN_KINDS] for l in range(n_layer)]
    groups += [[F.tensor_name(F.T_FFN_GATE_INP, l)] for l in range(n_layer)]
    head = F.tensor_name(F.T_OUTPUT)
    groups.append([head if head in tensors else F.tensor_name(F.T_TOKEN_EMBD)])
    n_dense = len(groups)
    groups += [[F.tensor_name(k, l) for k in (F.T_FFN_GATE_SHEXP, F.T_FFN_UP_SHEXP, F.T_FFN_DOWN_SHEXP)]
               for l in range(n_layer) if F.tensor_name(F.T_FFN_GATE_SHEXP, l) in tensors]
    for i, g in enumerate(groups):
        b = sum(_nbytes(tensors, n) for n in g if n in tensors)
        if b > left:
            break
        left -= b
        if i < n_dense:
            dense += b
        else:
            shared += b
            n_shared += 1
    # (0 for a leading dense layer, glm4moe's and dots1's: nothing there to place)
    eb = np.array([sum(_nbytes(tensors, F.tensor_name(k, l)) for k in
                       (F.T_FFN_GATE_EXPS, F.T_FFN_UP_EXPS, F.T_FFN_DOWN_EXPS)
                       if F.tensor_name(k, l) in tensors) // n_expert
                   for l in range(n_layer)], dtype=np.int64)
    cache_bytes = 0
    if cache > 0:
        slot = int(eb.max())
        slots = max(1, int(cache) // slot)
        slots = min(slots, max(0, left // slot), n_layer * n_expert)
        cache_bytes = slots * slot
        left -= cache_bytes
    return dense, shared, n_shared, cache_bytes, left, eb


def profile_experts(path, tokens, n_ctx: int = 512, n_threads: int = 0) -> tuple[np.ndarray, int]:
    """(freq [n_layer, n_expert], tokens counted): the selection counts of the model at
    ``path`` (on the CPU) over ``tokens``, run in windows of ``n_ctx`` tokens, divided by
    the token count."""
    from ..model import Model

    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("no calibration tokens to profile the experts over")
    with Model(path, n_ctx=n_ctx, n_threads=n_threads, n_batch=min(n_ctx, 512)) as m:
        if not m.info.n_expert:
            raise ValueError(f"{path} is not a mixture-of-experts model (no experts to profile)")
        ctx = m.create_context(n_ctx=n_ctx, n_threads=n_threads)
        n = min(n_ctx, m.context.n_ctx)
        for i in range(0, len(tokens), n):
            ctx.reset(0)
            ctx.eval(tokens[i:i + n])
        counts = ctx.expert_counts()
    return counts.astype(np.float64) / len(tokens), len(tokens)


def _greedy(freq: np.ndarray, eb: np.ndarray, left: int, first: int) -> np.ndarray:
    n_layer, n_expert = freq.shape
    on = np.zeros(freq.shape, dtype=bool)
    cand = [(-float(freq[l, e]), l, e) for l in range(first, n_layer) if eb[l] for e in range(n_expert)]
    cand.sort()
    for _, l, e in cand:
        if eb[l] <= left:
            on[l, e] = True
            left -= int(eb[l])
    return on


def solve_experts(freq, tensors: dict, budget: int, *, cache: int = 0, n_cpu_moe: int = 0,
                  method: str = "ilp", time_limit: float = 10.0) -> ExpertPlacement:
    """The expert placement for ``budget`` bytes of a model described by ``{name: (qtype,
    numpy shape)}`` with expert frequencies ``freq`` [n_layer, n_expert]."""
    freq = np.asarray(freq, dtype=np.float64)
    if freq.ndim != 2 or not np.isfinite(freq).all() or (freq < 0).any() or (freq > 1).any():
        raise ValueError("expert frequencies must be a [n_layer, n_expert] array of values in [0, 1]")
    if method not in ("ilp", "greedy"):
        raise ValueError(f"unknown placement method {method!r} (ilp, greedy)")
    if n_cpu_moe < 0:
        raise ValueError(f"n_cpu_moe must be >= 0, got {n_cpu_moe}")
    n_layer, n_expert = freq.shape
    t0 = time.perf_counter()
    dense, shared, n_shared, cache_bytes, left, eb = expert_budget(tensors, n_layer, n_expert,
                                                                   budget, cache)
    first = min(n_cpu_moe, n_layer)
    greedy = _greedy(freq, eb, left, first)
    gval = float((freq * eb[:, None] * greedy).sum())
    res = dict(freq=freq, expert_bytes=eb, budget=int(budget), dense_bytes=dense,
               shared_bytes=shared, shared_layers=n_shared, cache_bytes=cache_bytes, left=left, n_cpu_moe=first, greedy_value=gval)
    free = [(l, e) for l in range(first, n_layer) if eb[l] for e in range(n_expert)]
    if sum(int(eb[l]) for l, _ in free) <= left or method == "greedy" or left <= 0 or not free:
        solver = "none" if not greedy.any() else ("ilp" if method == "ilp" else "greedy")
        status = "all fit" if greedy.sum() == len(free) and free else ""
        return ExpertPlacement(on=greedy, solver=solver, status=status,
                               seconds=time.perf_counter() - t0, **res)
    with contextlib.redirect_stdout(io.StringIO()):  # mip announces itself on import
        import mip
    m = mip.Model(sense=mip.MAXIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    m.threads = 1
    m.seed = 0
    vmax = max(float((freq * eb[:, None]).max()), 1e-30)
    x = {(l, e): m.add_var(var_type=mip.BINARY, name=f"x_{l}_{e}") for l, e in free}
    m.objective = mip.xsum(float(freq[l, e] * eb[l]) / vmax * v for (l, e), v in x.items())
    m += mip.xsum(int(eb[l]) * v for (l, _), v in x.items()) <= int(left), "budget"
    with contextlib.redirect_stdout(io.StringIO()):
        m.start = [(v, 1.0 if greedy[l, e] else 0.0) for (l, e), v in x.items()]
    status = m.optimize(max_seconds=max(0.1, float(time_limit)))
    on = None
    if status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) and m.num_solutions:
        on = np.zeros(freq.shape, dtype=bool)
        for (l, e), v in x.items():
            on[l, e] = v.x >= 0.5
        if int((on.sum(axis=1) * eb).sum()) > left:
            on = None
    sname = status.name.lower()
    if on is None or float((freq * eb[:, None] * on).sum()) + 1e-12 * max(gval, 1.0) < gval:
        return ExpertPlacement(on=greedy, solver="greedy" if greedy.any() else "none",
                               status=f"ILP {sname}; greedy kept", seconds=time.perf_counter() - t0, **res)
    return ExpertPlacement(on=on, solver="ilp" if on.any() else "none", status=sname,
                           seconds=time.perf_counter() - t0, **res)


# ---------------------------------------------------------------------------
# Selection traces and the expert cache, replayed
# ---------------------------------------------------------------------------

def selection_trace(path, tokens, n_ctx: int = 512, n_threads: int = 0) -> np.ndarray:
    """bool [n_tokens, n_layer, n_expert]: the experts each token chose in each layer, from
    decoding ``tokens`` one at a time on the CPU (the selection counts' steps); windows of
    ``n_ctx`` tokens."""
    from ..model import Model

    tokens = [int(t) for t in tokens]
    with Model(path, n_ctx=n_ctx, n_threads=n_threads) as m:
        ctx = m.create_context(n_ctx=n_ctx, n_threads=n_threads)
        out = np.zeros((len(tokens), m.info.n_layer, m.info.n_expert), dtype=bool)
        prev = ctx.expert_counts()
        for i, t in enumerate(tokens):
            if ctx.n_past >= ctx.n_ctx:
                ctx.reset(0)
            ctx.eval([t])
            now = ctx.expert_counts()
            out[i] = now > prev
            prev = now
    return out


@dataclass
class CacheReplay:
    """What a decode over a trace does with a static placement and an expert cache."""
    runs_device: int = 0     # expert runs on the device (placed or cached)
    runs_cpu: int = 0
    hits: int = 0            # runs of non-placed experts the cache held
    misses: int = 0          # ... it did not hold (uploaded when a slot was free to take)
    uploads: int = 0
    # per token and layer: runs on the device, runs on the CPU, uploads
    per_token: np.ndarray | None = None  # int [n_tokens, n_layer, 3]

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


def replay_cache(trace: np.ndarray, on: np.ndarray | None, slots: int,
                 policy: str = "lru") -> CacheReplay:
    """The runtime's decode over ``trace`` (selection_trace) with the experts ``on`` placed
    and a cache of ``slots`` experts (ffn/moe.c): per token, per layer, per chosen expert
    in ascending id: placed -> device; held -> hit; else a miss that takes the slot to
    evict (one this layer call is not using) and uploads the expert. ``policy`` "lru" is
    the runtime's (the least recently used slot, the lowest index among equals); "lfu"
    evicts the slot whose expert was chosen least often so far (ties: least recently
    used), for comparison."""
    if policy not in ("lru", "lfu"):
        raise ValueError(f"unknown cache policy {policy!r} (lru, lfu)")
    n_tok, n_layer, n_expert = trace.shape
    on = np.zeros((n_layer, n_expert), dtype=bool) if on is None else np.asarray(on, dtype=bool)
    r = CacheReplay(per_token=np.zeros((n_tok, n_layer, 3), dtype=np.int64))
    key = [-1] * slots
    used = [0] * slots
    where: dict[int, int] = {}
    seen = np.zeros(n_layer * n_expert, dtype=np.int64)  # choices so far (lfu)
    tick = 0
    for t in range(n_tok):
        for l in range(n_layer):
            tick += 1
            for e in np.flatnonzero(trace[t, l]):
                k = l * n_expert + int(e)
                seen[k] += 1
                if on[l, e]:
                    r.runs_device += 1
                    r.per_token[t, l, 0] += 1
                    continue
                if slots == 0:
                    r.runs_cpu += 1
                    r.per_token[t, l, 1] += 1
                    continue
                s = where.get(k)
                if s is not None:
                    r.hits += 1
                    used[s] = tick
                    r.runs_device += 1
                    r.per_token[t, l, 0] += 1
                    continue
                r.misses += 1
                best = -1
                for i in range(slots):
                    if used[i] == tick:
                        continue
                    if best < 0:
                        best = i
                    elif policy == "lru" or key[i] < 0 or key[best] < 0:
                        if (key[i] < 0) != (key[best] < 0) and policy == "lfu":
                            best = i if key[i] < 0 else best
                        elif used[i] < used[best]:
                            best = i
                    else:
                        fi, fb = seen[key[i]], seen[key[best]]
                        if fi < fb or (fi == fb and used[i] < used[best]):
                            best = i
                if best < 0:
                    r.runs_cpu += 1
                    r.per_token[t, l, 1] += 1
                    continue
                if key[best] >= 0:
                    del where[key[best]]
                key[best] = k
                where[k] = best
                used[best] = tick
                r.uploads += 1
                r.runs_device += 1
                r.per_token[t, l, 0] += 1
                r.per_token[t, l, 2] += 1
    return r


# ---------------------------------------------------------------------------
# Hot neurons of sparse experts (docs/FORMAT.md "Hot neurons of experts")
# ---------------------------------------------------------------------------

def expert_neuron_freq(x: np.ndarray, sel: np.ndarray, gate_exps: np.ndarray, act: str,
                       thr: np.ndarray | None = None, act_threshold: float = 0.0,
                       up_exps: np.ndarray | None = None):
    """float64 [n_expert, n_ff_exp]: for one layer, the share of the tokens that chose expert e
    on which its neuron i is active, |act(gate_e x)| > the expert's threshold (thr [n_expert],
    default 0: a ReLU family's exact zeros), the neurons whose up rows the gate and oracle
    modes read; an expert no token chose: 0. x [N, d] the layer's FFN inputs, sel [N, k]
    the experts each token chose (expert_sparsity.route), gate_exps [n_expert, n_ff_exp, d].
    With up_exps (same shape) a pair: that and the share whose activation comes out nonzero,
    the neurons whose down_t rows are read (dReLU's relu(g)·relu(u): both factors positive;
    the other activations: the same as the first, their up factor is never exactly 0)."""
    from .expert_sparsity import expert_tokens
    from .thresholds import gate_magnitudes

    ne, ff = gate_exps.shape[:2]
    out = np.zeros((ne, ff), dtype=np.float64)
    down = np.zeros((ne, ff), dtype=np.float64)
    for e, t in enumerate(expert_tokens(sel, ne)):
        if t.size == 0:
            continue
        cut = 0.0 if thr is None else float(thr[e])
        if cut < 0:  # no threshold: the expert runs dense, every neuron's rows read
            out[e] = down[e] = 1.0
            continue
        on = gate_magnitudes(x[t], gate_exps[e], act, act_threshold=act_threshold) > cut
        out[e] = on.mean(axis=0)
        if up_exps is not None:
            if act == F.ACT_DRELU:
                on = on & (x[t].astype(np.float32) @ up_exps[e].T.astype(np.float32) > 0)
            down[e] = on.mean(axis=0)
    return out if up_exps is None else (out, down)


@dataclass
class ExpertNeuronPlacement:
    """hot[l][e]: the ascending neuron ids of expert e of layer l on the device."""
    hot: list                       # [n_layer][n_expert] int32 arrays
    value: float                    # CPU weight bytes per token the device's rows serve
    total: float                    # CPU weight bytes per token of every expert neuron
    bytes: int                      # device bytes of the placed rows
    left: int                       # bytes the solve could use
    group_size: int
    whole: bool                     # whole experts only (all of an expert's neurons, or none)
    solver: str                     # "ilp", "greedy" or "none"
    status: str = ""
    seconds: float = 0.0
    greedy_value: float = 0.0

    @property
    def counts(self) -> np.ndarray:
        return np.array([[len(h) for h in row] for row in self.hot], dtype=np.int32)

    def summary(self) -> str:
        share = self.value / self.total if self.total > 0 else 0.0
        return (f"hot neurons of experts ({self.solver}{', whole experts' if self.whole else ''}, "
                f"{self.seconds:.2f} s{', ' + self.status if self.status else ''}): "
                f"{format_size(self.bytes)} of {format_size(self.left)}, "
                f"{int(self.counts.sum())} neurons in {int((self.counts > 0).sum())} experts, "
                f"{self.value:.0f} of {self.total:.0f} CPU bytes per token ({share:.1%}) moved to the device")


def _neuron_values(freq, nfreq, dfreq, row_bytes, gate_always):
    """Per layer [n_expert, n_ff] the CPU bytes per token each neuron's rows cost, and one
    neuron's device bytes."""
    out, nb = [], []
    for l in range(freq.shape[0]):
        g, u, dn = (int(v) for v in row_bytes[l])
        gate = g * (np.ones_like(nfreq[l]) if gate_always else nfreq[l])
        out.append(freq[l][:, None] * (gate + nfreq[l] * u + dfreq[l] * dn))
        nb.append(g + u + dn)
    return out, nb


def solve_expert_neurons(freq, nfreq, row_bytes, left: int, *, group_size: int = 16,
                         n_cpu_moe: int = 0, whole: bool = False, gate_always: bool = True,
                         dfreq=None, method: str = "ilp",
                         time_limit: float = 10.0) -> ExpertNeuronPlacement:
    """Which neurons of which sparse experts go on the device, in ``left`` bytes.

    freq [n_layer, n_expert]: each expert's selection frequency (profile_experts); nfreq
    [n_layer, n_expert, n_ff_exp]: each neuron's activity share among the tokens that chose
    its expert (expert_neuron_freq); dfreq (same shape, default nfreq): each neuron's share
    whose activation comes out nonzero (the down_t rows read; dReLU's is smaller); row_bytes
    [n_layer] of (gate, up, down_t) bytes of one neuron's rows. A neuron's value is the CPU
    bytes per token it costs there, freq·(gate + nfreq·up + dfreq·down_t) (``gate_always``:
    the gate mode reads every listed expert's gate rows; False: the predictor and oracle modes
    read the active ones' only), its cost its rows' bytes. Each expert's neurons are sorted by value and cut into groups of ``group_size``;
    binary x[l,e,g] = group g of expert e of layer l on the device (l past the first
    ``n_cpu_moe``)::

        maximize   sum value[l,e,g] x[l,e,g]        (CPU bytes per token moved to the device)
        subject to sum bytes[l,e,g] x[l,e,g] <= left
                   x[l,e,g+1] <= x[l,e,g]          (an expert's groups in value order)

    ``whole``: one group per expert (whole experts or none), for comparison. A whole expert
    is all its groups, so the ILP chooses between whole experts and hot groups by value per
    byte. CBC, warm-started from the greedy rule (groups by falling value per byte, each
    expert's in order, while they fit) and never returned worse than it."""
    freq = np.asarray(freq, dtype=np.float64)
    nfreq = np.asarray(nfreq, dtype=np.float64)
    if freq.ndim != 2 or nfreq.ndim != 3 or nfreq.shape[:2] != freq.shape:
        raise ValueError("freq must be [n_layer, n_expert] and nfreq [n_layer, n_expert, n_ff_exp]")
    dfreq = nfreq if dfreq is None else np.asarray(dfreq, dtype=np.float64)
    if dfreq.shape != nfreq.shape:
        raise ValueError("dfreq must have nfreq's shape [n_layer, n_expert, n_ff_exp]")
    for a, what in ((freq, "expert"), (nfreq, "neuron"), (dfreq, "neuron")):
        if not np.isfinite(a).all() or (a < 0).any() or (a > 1).any():
            raise ValueError(f"{what} frequencies must be values in [0, 1]")
    if len(row_bytes) != freq.shape[0]:
        raise ValueError("row_bytes needs one (gate, up, down_t) entry per layer")
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    if method not in ("ilp", "greedy"):
        raise ValueError(f"unknown placement method {method!r} (ilp, greedy)")
    t0 = time.perf_counter()
    n_layer, n_expert, n_ff = nfreq.shape
    first = min(max(0, int(n_cpu_moe)), n_layer)
    vals, nb = _neuron_values(freq, nfreq, dfreq, row_bytes, gate_always)
    gs = n_ff if whole else int(group_size)
    order, gval, gbytes, gsize = {}, {}, {}, {}
    for l in range(first, n_layer):
        for e in range(n_expert):
            o = np.argsort(-vals[l][e], kind="stable")
            starts = np.arange(0, n_ff, gs)
            order[l, e] = o
            gval[l, e] = np.add.reduceat(vals[l][e][o], starts)
            gsize[l, e] = np.minimum(gs, n_ff - starts)
            gbytes[l, e] = gsize[l, e].astype(np.int64) * nb[l]
    total = float(sum(v.sum() for v in vals))

    # greedy: groups by falling value per byte; an expert whose next group does not fit is
    # closed (its later groups may not be taken before it)
    cand = sorted(((-(float(gval[k][g]) / float(gbytes[k][g])) if gbytes[k][g] else -np.inf, k, g)
                   for k in gval for g in range(len(gval[k]))), key=lambda c: (c[0], c[1], c[2]))
    taken = {k: 0 for k in gval}
    closed = set()
    room = int(left)
    for _, k, g in cand:
        if k in closed or g != taken[k]:
            if g != taken[k]:
                closed.add(k)
            continue
        if gbytes[k][g] > room:
            closed.add(k)
            continue
        room -= int(gbytes[k][g])
        taken[k] += 1

    def value_of(t):
        return float(sum(gval[k][:n].sum() for k, n in t.items()))

    def bytes_of(t):
        return int(sum(gbytes[k][:n].sum() for k, n in t.items()))

    greedy = dict(taken)
    gv = value_of(greedy)
    best, solver, status = greedy, ("greedy" if any(greedy.values()) else "none"), ""
    all_bytes = int(sum(b.sum() for b in gbytes.values()))
    if all_bytes <= left:
        best = {k: len(v) for k, v in gval.items()}
        solver, status = ("ilp" if method == "ilp" else "greedy") if best else "none", "all fit"
    elif method == "ilp" and left > 0 and gval:
        with contextlib.redirect_stdout(io.StringIO()):  # mip announces itself on import
            import mip
        m = mip.Model(sense=mip.MAXIMIZE, solver_name=mip.CBC)
        m.verbose = 0
        m.threads = 1
        m.seed = 0
        m.max_mip_gap = 1e-6
        vmax = max(max(float(v.max()) for v in gval.values()), 1e-30)
        x = {k: [m.add_var(var_type=mip.BINARY, name=f"x_{k[0]}_{k[1]}_{g}") for g in range(len(v))]
             for k, v in gval.items()}
        m.objective = mip.xsum(float(gval[k][g]) / vmax * x[k][g] for k in x for g in range(len(x[k])))
        m += mip.xsum(int(gbytes[k][g]) * x[k][g] for k in x for g in range(len(x[k]))) <= int(left)
        for k, xs in x.items():
            for g in range(len(xs) - 1):
                m += xs[g + 1] <= xs[g]
        with contextlib.redirect_stdout(io.StringIO()):
            m.start = [(x[k][g], 1.0 if g < greedy[k] else 0.0) for k in x for g in range(len(x[k]))]
        st = m.optimize(max_seconds=max(0.1, float(time_limit)))
        status = st.name.lower()
        if st in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) and m.num_solutions:
            t = {}
            for k, xs in x.items():
                n = 0
                while n < len(xs) and xs[n].x >= 0.5:
                    n += 1
                t[k] = n
            if bytes_of(t) <= left and value_of(t) + 1e-12 * max(gv, 1.0) >= gv:
                best, solver = t, ("ilp" if any(t.values()) else "none")
            else:
                status += "; greedy kept"
        else:
            status = f"ILP {status}; greedy kept"
    hot = [[np.zeros(0, np.int32) for _ in range(n_expert)] for _ in range(n_layer)]
    for (l, e), n in best.items():
        k = int(gsize[l, e][:n].sum())
        hot[l][e] = np.sort(order[l, e][:k]).astype(np.int32)
    return ExpertNeuronPlacement(hot=hot, value=value_of(best), total=total, bytes=bytes_of(best),
                                 left=int(left), group_size=gs, whole=whole, solver=solver,
                                 status=status, seconds=time.perf_counter() - t0, greedy_value=gv)


def expert_hot_tensors(pl: ExpertNeuronPlacement, nfreq=None) -> dict:
    """{name: array} of the placement's record (docs/FORMAT.md "Hot neurons of experts"):
    per layer blk.N.ffn_exp_hot_count and, when it places any, blk.N.ffn_exp_hot; with nfreq
    [n_layer, n_expert, n_ff_exp], blk.N.ffn_exp_nfreq too."""
    out = {}
    for l, row in enumerate(pl.hot):
        out[F.expert_hot_tensor_name(F.T_FFN_EXP_HOT_COUNT, l)] = np.array([len(h) for h in row], np.int32)
        ids = np.concatenate([np.asarray(h, np.int32) for h in row]) if row else np.zeros(0, np.int32)
        if ids.size:
            out[F.expert_hot_tensor_name(F.T_FFN_EXP_HOT, l)] = ids.astype(np.int32)
        if nfreq is not None:
            out[F.expert_hot_tensor_name(F.T_FFN_EXP_NFREQ, l)] = np.asarray(nfreq[l], np.float32)
    return out
