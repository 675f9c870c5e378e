"""Input sparsity measured by the native runtime in its sparse mode: the share each site
skips, and the refit that moves every site's threshold to the target on the inputs it sees
there.

Why a refit: the profile runs densely, so the thresholds of input_sparsity.calibrate_inputs
are fitted on dense-mode inputs. In the sparse mode o's input (the attention output) is
computed from input-sparse q/k/v and shrinks (a flatter softmax), so o's dense-fitted
thresholds skip more than asked: on tiny-relu-kjv at 50%, o skipped ~7 points more on
held-out text with q/k/v sparse, 1.5 alone (docs/BENCHMARKS.md "Input sparsity").

How, without recording sparse-mode inputs (the runtime's profiling always runs dense): a
site's count of used inputs is part of the context's statistics (attention: q/k/v and o of
every layer summed; head apart). A site's inputs depend only on the sites before it in the
forward pass (q/k/v of layer l, then o of l, then layer l + 1, ..., the head last), so with
the sites after it off (thresholds all 0: the dense matmul, not counted), the count it adds
to the one of the sites before it is its count in the full sparse mode. The refit walks the
sites in that order; at each, the runtime measures the share its threshold t skips, and t
moves by the quantile map of the site's dense-mode scores (the sparse-mode inputs taken as
the dense ones scaled) until the share is within REFIT_TOL of the target: one to three runs
a site. Every threshold keeps the criterion's form t / gain_i, so the result is the
threshold a profile of the sparse-mode inputs would give, to REFIT_TOL.

Cost: 2-4 runs per layer over the refit's tokens, so it grows with n_layer squared in
compute. One profile pass would do if the runtime recorded the projections' inputs in the
sparse modes: gh_sparse_applies (ffn/sparse.c) turns them off whenever any profile buffer is
set, though only ffn_in and the mask need the dense FFN (attention() and the head record
theirs on either path).

The runtime reads the thresholds when it loads a file, so each run patches them in place
(patch_input_thresholds: same sizes, only values change) and reloads (an mmap).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .. import format as F
from .input_sparsity import SITE_HEAD, SITE_O, SITE_QKV, InputCalibration

#: Target tolerance of the refit: the share a site skips in the sparse mode, on the fit tokens.
REFIT_TOL = 0.005
#: Runtime runs per site at most.
REFIT_MAX_RUNS = 4
#: Fit tokens the refit runs over by default.
DEFAULT_REFIT_TOKENS = 1024


def patch_input_thresholds(path: str, qkv: Sequence[np.ndarray], o: Sequence[np.ndarray],
                           head: np.ndarray) -> None:
    """Overwrite the input thresholds of the GGUF file at path in place."""
    import gguf

    r = gguf.GGUFReader(path, "r+")
    try:
        t = {x.name: x for x in r.tensors}
        for kind, vals in ((F.T_ATTN_QKV_IN_THR, qkv), (F.T_ATTN_OUTPUT_IN_THR, o)):
            for l, v in enumerate(vals):
                t[F.input_sparse_tensor_name(kind, l)].data[:] = v
        t[F.input_sparse_tensor_name(F.T_OUTPUT_IN_THR)].data[:] = head
        r.data.flush()
    finally:
        del r


def patch_calibration(path: str, cal: InputCalibration) -> None:
    """Write cal's thresholds into the file at path."""
    patch_input_thresholds(path, cal.qkv, cal.o, cal.head)


class SiteMeter:
    """Used-input counts of the sparse mode of one file (the one it loads by default:
    predictors or gate) over fixed tokens, in windows as the profile ran them."""

    def __init__(self, path: str, ids: Sequence[int], window: int, n_threads: int = 0):
        self.path, self.ids, self.window, self.n_threads = path, [int(t) for t in ids], int(window), n_threads
        self.runs = 0

    def count(self, qkv, o, head, logits: bool) -> dict:
        """The stats' input counts with these thresholds (logits: every token's head runs)."""
        from ..model import Model

        patch_input_thresholds(self.path, qkv, o, head)
        with Model(self.path, n_ctx=self.window, n_threads=self.n_threads, cache_type="f32") as m:
            ctx = m.create_context(n_ctx=self.window, n_threads=self.n_threads, cache_type="f32",
                                   input_sparse=True)
            ctx.sparse_batch = self.window
            for s in range(0, len(self.ids), self.window):
                ctx.reset()
                ctx.eval(self.ids[s:s + self.window], logits_all=logits)
            st = ctx.stats()
            ctx.close()
        self.runs += 1
        return {"tokens": int(st["n_sparse_tokens"]), **st["input_sparse"]}


def _off(cal: InputCalibration):
    return ([np.zeros_like(v) for v in cal.qkv], [np.zeros_like(v) for v in cal.o], np.zeros_like(cal.head))


def _set(state, key, thr) -> None:
    qkv, o, _ = state
    site, layer = key
    if site == SITE_HEAD:
        state[2] = thr
    else:
        (qkv if site == SITE_QKV else o)[layer] = thr


def walk_sites(meter: SiteMeter, cal: InputCalibration,
               choose: Callable[[tuple, Callable[[float], float]], float] | None = None) -> dict:
    """The share each site of cal skips in the sparse mode, sites enabled in forward order.
    choose(key, share_at_t) -> t, given a function measuring the site's share at a criterion
    threshold t, picks the site's threshold (None: keep cal's); returns key -> share at the
    chosen t."""
    state = list(_off(cal))
    base = 0
    out: dict = {}
    for key in cal.keys():
        if not np.any(cal.thresholds(key)):
            out[key] = 0.0  # off: runs dense, counts nothing
            continue
        head = key[0] == SITE_HEAD
        n_in = cal.thresholds(key).size
        seen: dict = {}

        def share_at(t, key=key, head=head, n_in=n_in, seen=seen):
            _set(state, key, cal.at(key, t) if t is not None else cal.thresholds(key))
            c = meter.count(state[0], state[1], state[2], logits=head)
            used = c["head_inputs_used"] if head else c["attention_inputs_used"] - base
            n = c["head_inputs"] if head else c["tokens"] * n_in
            seen[t] = (1.0 - used / max(n, 1), c["attention_inputs_used"])
            return seen[t][0]

        t = None if choose is None else choose(key, share_at)  # None: the stored thresholds
        if t not in seen:
            share_at(t)
        _set(state, key, cal.at(key, t) if t is not None else cal.thresholds(key))
        out[key], used_all = seen[t]
        if not head:
            base = used_all
        if choose is not None:
            cal.set_t(key, t)
    return out


def site_shares(path: str, ids: Sequence[int], window: int, cal: InputCalibration, n_threads: int = 0) -> dict:
    """Per site, the share of its inputs the file's sparse mode skips on ids with cal's
    thresholds (2 n_layer + 1 runs); the file is left with cal's thresholds."""
    meter = SiteMeter(path, ids, window, n_threads)
    out = walk_sites(meter, cal)
    patch_calibration(path, cal)
    return out


def refit(path: str, cal: InputCalibration, ids: Sequence[int], window: int, n_threads: int = 0,
          tol: float = REFIT_TOL, max_runs: int = REFIT_MAX_RUNS, say: Callable[[str], None] | None = None,
          progress: bool = False) -> int:
    """Move every site of cal (in place) to its target share in the sparse mode of the file
    at path, measured on ids; records (share before, after) per site in cal.sparse_mode and
    leaves the file with the new thresholds. Returns the number of runtime runs."""
    from tqdm import tqdm

    target = cal.sparsity
    meter = SiteMeter(path, ids, window, n_threads)
    # 1-3 runs of len(ids) sparse-mode tokens per site, 2 n_layer + 1 sites: minutes on a
    # large model, so it shows its progress
    bar = tqdm(total=len(list(cal.keys())), desc=f"input refit {target:.0%}", unit="site", disable=not progress)

    def choose(key, share_at):
        try:
            return _choose(key, share_at)
        finally:
            bar.update(1)

    def _choose(key, share_at):
        t = cal.t[key]
        lo, hi = 0.0, np.inf
        tried = []
        for _ in range(max_runs):
            s = share_at(t)
            tried.append((abs(s - target), t, s))
            if abs(s - target) <= tol:
                break
            if s < target:
                lo = max(lo, t)
            else:
                hi = min(hi, t)
            # the sparse-mode scores as the dense ones times a: s = F(t / a), so the target
            # is at a * F^-1(target)
            q = cal.t_for_share(key, s)
            nxt = t * cal.t_for_share(key, target) / q if q > 0 else 2.0 * t
            if not lo < nxt < hi:
                nxt = 2.0 * t if hi == np.inf else (0.5 * (lo + hi) if lo > 0 else 0.5 * hi)
            t = nxt
        best = min(tried)
        cal.sparse_mode[key] = (tried[0][2], best[2])
        return best[1]

    try:
        walk_sites(meter, cal, choose)
    finally:
        bar.close()
    patch_calibration(path, cal)
    if say:
        say("  " + refit_summary(cal) + f" ({meter.runs} runs on {len(ids)} tokens)")
    return meter.runs


def refit_tokens(input_ids: Sequence[int], n_fit: int, window: int, n_tokens: int = DEFAULT_REFIT_TOKENS) -> list[int]:
    """The refit's tokens: whole windows of the first n_fit recorded ones (a profile's
    input_ids, windows in text order), about n_tokens of them, spread over the fit windows."""
    starts = list(range(0, max(n_fit - window, 0) + 1, window))
    want = min(len(starts), max(1, int(n_tokens) // window))
    pick = sorted({starts[int(round(i))] for i in np.linspace(0, len(starts) - 1, want)})
    return [int(t) for s in pick for t in input_ids[s:min(s + window, n_fit)]]


def _mean_by_site(shares: dict) -> dict:
    by: dict = {}
    for (site, _), v in shares.items():
        by.setdefault(site, []).append(v)
    return {s: float(np.mean(v)) for s, v in by.items()}


def refit_summary(cal: InputCalibration) -> str:
    """One line: each site kind's mean share skipped in the sparse mode before and after."""
    before = _mean_by_site({k: v[0] for k, v in cal.sparse_mode.items()})
    after = _mean_by_site({k: v[1] for k, v in cal.sparse_mode.items()})
    names = {SITE_QKV: "q/k/v", SITE_O: "o", SITE_HEAD: "head"}
    return (f"refit in the sparse mode (target {cal.sparsity:.0%}): " + ", ".join(
        f"{names[s]} {before[s]:.1%} -> {after[s]:.1%}" for s in (SITE_QKV, SITE_O, SITE_HEAD) if s in before))
