"""Per-site input sparsity by measured KL (TEAL's greedy, over every input-sparse site).

A site is one projection input with its own thresholds: per layer q/k/v's, o's and (with the
FFN's sites) gate/up's and down's, plus the head's. A uniform level spends the same share
everywhere, while on SmolLM2-135M the head alone is 21% of the bytes and its sensitivity is
nothing like a q/k/v input's (docs/BENCHMARKS.md "Sparsity on a real model"). So:

1. each site's cost curve: the KL divergence of the next-token distribution to the dense one
   when only that site is sparsified, at the levels of ``grid`` (the other sites at 0, i.e.
   dense), measured by the runtime in the file's sparse mode on calibration tokens
   (``site_costs``: n_site x len(grid) evaluations);
2. ``thresholds.greedy_allocation`` with each site's weight bytes per token as its weight:
   sparsity is added in steps to the site whose KL rises least per byte saved, until the
   summed KL reaches the budget (the sites' costs taken as additive).

A site's criterion threshold at any level comes from the calibrations at a list of levels
(``SiteTable``: interpolated between them), so the allocation needs one calibration pass.

Measuring every site's curve in the runtime costs n_site x len(grid) runs (605 for
SmolLM2-135M per layer at 5 levels). The proxy (``output_errors``, ``proxy_curves``) needs one
per site: a skipped input set changes the site's output by ``d = W (x - kept(x))``, and for
small changes the KL to dense is quadratic in it, ``KL_s(level) ~ c_s E||d||^2``. The squared
output error is computed in numpy from the profiled inputs at every level and criterion (the
Gram matrix ``W^T W`` when the output is wider than the input: the head's 49,152 rows become
576 x 576), and one runtime KL per site at an anchor level gives ``c_s``. With curves per
criterion, each site at each level takes the criterion whose predicted KL is lower
(``MixedSiteTable``): WINA's ``|x_i| ||W[:, i]||`` where the column norms vary, magnitude
where they do not.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import gguf

import numpy as np
from tqdm.auto import tqdm

from .. import format as F
from .input_sparsity import SITE_DOWN, SITE_FFN, SITE_HEAD, SITE_O, SITE_QKV, InputCalibration
from .thresholds import greedy_allocation

#: Levels at which a site's KL is measured (0 is free).
SITE_GRID = (0.25, 0.5, 0.75)


class SiteTable:
    """Each site's criterion threshold as a function of its level, from calibrations of the
    same profile at several levels (input_sparsity.calibrate_input_levels)."""

    def __init__(self, cals: Sequence[InputCalibration]):
        cals = sorted(cals, key=lambda c: c.sparsity)
        if not cals or cals[0].sparsity != 0.0:
            raise ValueError("SiteTable needs the calibration at level 0 first")
        self.levels = np.array([c.sparsity for c in cals], np.float64)
        self.base = cals[0]
        self.keys = cals[0].keys()
        self.t = {k: np.array([c.t.get(k, 0.0) for c in cals], np.float64) for k in self.keys}

    @property
    def max_level(self) -> float:
        return float(self.levels[-1])

    def threshold(self, key, level: float) -> float:
        return 0.0 if level <= 0 else float(np.interp(level, self.levels, self.t[key]))

    def calibration(self, levels: dict) -> InputCalibration:
        """A calibration with every site at levels.get(key, 0)."""
        cal = copy.deepcopy(self.base)
        for k in self.keys:
            cal.set_t(k, self.threshold(k, float(levels.get(k, 0.0))))
        cal.sparsity = float(np.mean([levels.get(k, 0.0) for k in self.keys]))
        return cal


class MixedSiteTable:
    """Per site and level the threshold of one of several criteria's SiteTables (same
    profile, same levels): ``choice[key][j]`` names the criterion at level table.levels[j]
    (the nearest grid level is used in between)."""

    def __init__(self, tables: dict, choice: dict):
        self.tables = tables
        first = next(iter(tables.values()))
        for t in tables.values():
            if not np.array_equal(t.levels, first.levels) or t.keys != first.keys:
                raise ValueError("MixedSiteTable needs tables of the same sites and levels")
        self.levels, self.keys, self.choice = first.levels, first.keys, choice

    @property
    def max_level(self) -> float:
        return float(self.levels[-1])

    def criterion(self, key, level: float) -> str:
        return self.choice[key][int(np.argmin(np.abs(self.levels - level)))]

    def calibration(self, levels: dict) -> InputCalibration:
        """A calibration with every site at levels.get(key, 0), each by its chosen criterion;
        its criterion is the common one, or "mixed"."""
        first = next(iter(self.tables.values()))
        cal = copy.deepcopy(first.base)
        used = set()
        for k in self.keys:
            lv = float(levels.get(k, 0.0))
            c = self.criterion(k, lv)
            t = self.tables[c]
            cal.gain[k] = t.base.gain.get(k)
            cal.set_t(k, t.threshold(k, lv))
            if lv > 0:
                used.add(c)
        cal.criterion = used.pop() if len(used) == 1 else ("mixed" if used else cal.criterion)
        cal.sparsity = float(np.mean([levels.get(k, 0.0) for k in self.keys]))
        return cal


def output_errors(x: np.ndarray, w_t: np.ndarray, thresholds) -> np.ndarray:
    """[len(thresholds)]: for each per-channel threshold vector thr [in], the mean over x's
    tokens [n, in] of ||W (x - kept(x))||^2, kept(x) zeroing the inputs with |x_i| <= thr_i
    (the runtime's test); w_t: W transposed [in, out]. Through the Gram matrix w_t w_t^T
    [in, in] when out > in (the same value, fewer operations)."""
    x = np.asarray(x, np.float32)
    w_t = np.asarray(w_t, np.float32)
    g = (w_t @ w_t.T) if w_t.shape[1] > w_t.shape[0] else None
    out = np.zeros(len(thresholds))
    for j, thr in enumerate(thresholds):
        d = np.where(np.abs(x) <= np.asarray(thr, np.float32)[None, :], x, 0.0).astype(np.float32)
        e = (d @ g) * d if g is not None else np.square(d @ w_t)
        out[j] = float(e.sum(dtype=np.float64)) / max(len(x), 1)
    return out


def proxy_curves(errors: dict, anchor: int, anchor_kl: np.ndarray, ref: str | None = None) -> tuple:
    """KL curves from output errors: errors[criterion] [n_site, n_level] (output_errors per
    site), anchor_kl [n_site] the runtime's KL with only site i at level index ``anchor`` by
    criterion ``ref`` (default: the first). Returns (curves [n_site, n_level]: the lower
    criterion's predicted KL per level, choice [n_site][n_level]: its name)."""
    names = list(errors)
    ref = names[0] if ref is None else ref
    e_ref = np.asarray(errors[ref], np.float64)
    c = np.asarray(anchor_kl, np.float64) / np.maximum(e_ref[:, anchor], 1e-30)
    stack = np.stack([c[:, None] * np.asarray(errors[n], np.float64) for n in names])
    best = np.argmin(stack, axis=0)
    curves = np.take_along_axis(stack, best[None], axis=0)[0]
    return curves, [[names[b] for b in row] for row in best]


def site_bytes(path: str) -> dict:
    """Per site key, the weight bytes a dense token reads through it in the file at path: the
    transposed copy's rows times their bytes (q/k/v together, gate and up together)."""
    r = gguf.GGUFReader(path)
    try:
        nb = {t.name: int(t.n_bytes) for t in r.tensors}
    finally:
        del r
    out = {(SITE_HEAD, None): nb[F.input_sparse_tensor_name(F.T_OUTPUT_T)]}
    l = 0
    while F.input_sparse_tensor_name(F.T_ATTN_QKV_T, l) in nb:
        out[(SITE_QKV, l)] = nb[F.input_sparse_tensor_name(F.T_ATTN_QKV_T, l)]
        out[(SITE_O, l)] = nb[F.input_sparse_tensor_name(F.T_ATTN_OUTPUT_T, l)]
        gu = F.input_sparse_tensor_name(F.T_FFN_GATE_UP_T, l)
        if gu in nb:
            out[(SITE_FFN, l)] = nb[gu]
            out[(SITE_DOWN, l)] = nb[F.sparse_tensor_name(F.T_FFN_DOWN_T, l)]
        l += 1
    return out


def group_sites(keys: Sequence, layers_per_group: int = 1) -> list:
    """The allocation's units: each site alone (1), or the sites of one kind in runs of
    layers_per_group consecutive layers sharing one level (fewer KL curves to measure:
    n_kind x n_layer / layers_per_group + 1 instead of n_kind x n_layer + 1)."""
    groups: dict = {}
    for k in keys:
        site, layer = k
        groups.setdefault((site, None if layer is None else layer // layers_per_group), []).append(k)
    return list(groups.values())


def group_weights(groups: Sequence, weights: dict) -> list[float]:
    """A group's bytes per token: its sites' sum."""
    return [float(sum(weights[k] for k in g)) for g in groups]


def site_costs(measure: Callable[[InputCalibration], float], table: SiteTable, groups: Sequence,
               grid: Sequence[float] = SITE_GRID, progress: bool = True,
               say: Callable[[str], None] | None = None) -> np.ndarray:
    """[len(groups), len(grid)]: measure(cal) (the KL to dense) with only the sites of
    groups[i] (group_sites) at each grid level."""
    keys = groups
    costs = np.zeros((len(keys), len(grid)))
    bar = None
    if progress:
        bar = tqdm(total=len(keys) * len(grid), desc="site sensitivity", unit="eval", dynamic_ncols=True)
    try:
        for i, k in enumerate(keys):
            for j, s in enumerate(grid):
                costs[i, j] = measure(table.calibration({key: s for key in k}))
                if bar is not None:
                    bar.update(1)
            if say:
                layers = [key[1] for key in k if key[1] is not None]
                say(f"  site {k[0][0]} {f'{min(layers)}-{max(layers)}' if layers else ''}: KL " + ", ".join(
                    f"{s:.0%} {c:.4f}" for s, c in zip(grid, costs[i])))
    finally:
        if bar is not None:
            bar.close()
    return costs


def refine_curves(costs: np.ndarray, grid: Sequence[float], step: float = 0.05) -> tuple[np.ndarray, list]:
    """The measured curves on a grid of `step`, for a coarse measurement grid: below its first
    level a power law through 0 whose exponent comes from the first two levels (clipped to
    [1, 6]), between levels geometric interpolation. The curves are convex (measured on
    SmolLM2-135M: KL ~ s^1.8 for q/k/v, ~ s^4 for gate/up, ~ s^3 for the head between 30% and
    60%), so the linear reading from 0 that the gate's 10-level grid can afford would price a
    site's first steps several times too high on a 2-level grid."""
    grid = np.asarray(grid, np.float64)
    c = np.maximum.accumulate(np.maximum(np.asarray(costs, np.float64), 1e-12), axis=1)
    fine = np.round(np.arange(step, grid[-1] + 1e-9, step), 6)
    if len(grid) > 1:
        p = np.clip(np.log(c[:, 1] / c[:, 0]) / np.log(grid[1] / grid[0]), 1.0, 6.0)
    else:
        p = np.full(len(c), 2.0)
    out = np.zeros((len(c), len(fine)))
    for j, s in enumerate(fine):
        if s <= grid[0]:
            out[:, j] = c[:, 0] * (s / grid[0]) ** p
        else:
            k = min(int(np.searchsorted(grid, s)) - 1, len(grid) - 2)
            f = (s - grid[k]) / (grid[k + 1] - grid[k])
            out[:, j] = np.exp((1 - f) * np.log(c[:, k]) + f * np.log(c[:, k + 1]))
    return out, [float(v) for v in fine]


def allocate_sites(costs: np.ndarray, groups: Sequence, weights: dict, max_kl: float,
                   grid: Sequence[float] = SITE_GRID, step: float = 0.05) -> dict:
    """Per site key its level: thresholds.greedy_allocation over the groups (group_sites) by
    KL per byte (weights: a site's bytes per token) until the summed measured KL reaches
    max_kl; a group's sites share its level."""
    lv = greedy_allocation(costs, None, grid, step, weights=group_weights(groups, weights), max_cost=max_kl)
    return {k: v for g, v in zip(groups, lv) for k in g}


def predicted_bytes(levels: dict, weights: dict) -> float:
    """The bytes the sites read at levels (each site's bytes times its density)."""
    return float(sum(weights[k] * (1.0 - levels.get(k, 0.0)) for k in weights))


def allocate_options(units: Sequence, max_kl: float, iters: int = 100) -> tuple:
    """Per-site levels where a site may also be read another way at a fixed price (a rotation
    of its input: its bytes, and a lower KL curve; one rotation shared by several sites).
    units: each a list of options (fixed bytes, [(bytes [n_level], kl [n_level]) per site]);
    per unit one option, per site of it one level. The summed KL is kept <= max_kl by a
    Lagrangian search: each unit minimizes bytes + lam * KL alone, lam bisected; that answer
    is optimal for the KL it reaches (no assignment of KL <= that reads fewer bytes) but may
    stop short of max_kl where a fixed price makes the costs non-convex, so the rest of the
    budget is then spent greedily: one unit at a time, the change that saves the most bytes
    within the remaining KL, until no single unit's change fits and saves.
    Returns (bytes, kl, [(option index, [level index per site]) per unit])."""

    def solve(lam):
        tb = tk = 0.0
        pick = []
        for opts in units:
            best = None
            for oi, (fixed, parts) in enumerate(opts):
                b, k, lv = float(fixed), 0.0, []
                for bv, kv in parts:
                    j = int(np.argmin(np.asarray(bv) + lam * np.asarray(kv)))
                    b, k = b + float(bv[j]), k + float(kv[j])
                    lv.append(j)
                if best is None or b + lam * k < best[0] + lam * best[1]:
                    best = (b, k, oi, lv)
            tb, tk = tb + best[0], tk + best[1]
            pick.append((best[2], best[3]))
        return tb, tk, pick

    lo, hi = 1e-12, 1e18  # bytes per unit of KL
    if solve(lo)[1] <= max_kl:
        return solve(lo)
    for _ in range(iters):
        mid = float(np.sqrt(lo * hi))
        if solve(mid)[1] > max_kl:
            lo = mid
        else:
            hi = mid
    return _fill(units, solve(hi), max_kl)


def _unit_table(opts) -> list:
    """Per option (bytes, kl, level grids) over every combination of its sites' levels."""
    out = []
    for fixed, parts in opts:
        b = np.full((), float(fixed))
        k = np.zeros(())
        for bv, kv in parts:
            b = np.add.outer(b, np.asarray(bv, np.float64))
            k = np.add.outer(k, np.asarray(kv, np.float64))
        out.append((b, k))
    return out


def _fill(units: Sequence, start: tuple, max_kl: float) -> tuple:
    """allocate_options' greedy spending of the KL a Lagrangian answer left over."""
    tb, tk, pick = start
    pick = [(oi, list(lv)) for oi, lv in pick]
    tables = [_unit_table(opts) for opts in units]
    while True:
        best = None
        for u, tab in enumerate(tables):
            oi, lv = pick[u]
            b0, k0 = float(tab[oi][0][tuple(lv)]), float(tab[oi][1][tuple(lv)])
            for o2, (b, k) in enumerate(tab):
                ok = (k - k0 <= max_kl - tk + 1e-15) & (b < b0 - 1e-9)
                if not ok.any():
                    continue
                idx = np.unravel_index(int(np.argmin(np.where(ok, b, np.inf))), b.shape)
                save = b0 - float(b[idx])
                if best is None or save > best[0]:
                    best = (save, u, o2, [int(i) for i in idx], float(k[idx]) - k0)
        if best is None:
            return tb, tk, pick
        save, u, o2, lv, dk = best
        pick[u] = (o2, lv)
        tb, tk = tb - save, tk + dk
