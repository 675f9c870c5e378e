"""Training-free gate-magnitude sparsity (CATS-style): calibrate, per layer, the threshold
t on |act(gate)| that zeroes a target share of the FFN's neurons on calibration text.

At run time (the "gate" FFN mode) the gate is computed densely, and only the neurons with
|act(gate_i)| > t get their rows of up and down_t read: the same rows the sparse FFN
reads for a predicted neuron, but with no predictor. A layer's threshold for sparsity s
is the s quantile of |act(gate)| over its profiled tokens (``QuantileTable``).

How a mean sparsity is shared among the layers (the allocation):

- ``uniform``: every layer at the mean;
- ``greedy`` (after TEAL's greedy allocation, with a measured cost): each layer's
  sensitivity curve, the KL divergence of the next-token distribution to the dense one
  when only that layer is sparsified at s, is measured by the runtime on calibration
  tokens (``ALLOCATION_GRID``); then sparsity is added in steps to the layer whose curve
  rises least, until the mean is reached (the layers' costs taken as additive: n_layer x
  len(grid) evaluations instead of the n_layer x steps of a re-measured greedy).
"""

from __future__ import annotations

import math

import numpy as np

from .. import format as F


def activation(act: str, g: np.ndarray, act_threshold: float = 0.0) -> np.ndarray:
    """act(g) as the runtime computes it (float64 here), for the gated activations
    (``act_threshold``: fatrelu's t)."""
    g = np.asarray(g, dtype=np.float64)
    if act in (F.ACT_RELU, F.ACT_DRELU):
        return np.maximum(g, 0.0)
    if act == F.ACT_FATRELU:
        return np.where(g > act_threshold, g, 0.0)
    if act == F.ACT_SILU:
        return g / (1.0 + np.exp(-g))
    if act == F.ACT_GELU:  # tanh form
        a = math.sqrt(2.0 / math.pi)
        return 0.5 * g * (1.0 + np.tanh(a * (g + 0.044715 * g ** 3)))
    if act == F.ACT_GELU_ERF:
        return 0.5 * g * (1.0 + _erf(g / math.sqrt(2.0)))
    raise ValueError(f"no gate-magnitude sparsity for activation {act!r}")


def _erf(x: np.ndarray) -> np.ndarray:
    """erf over an array (numpy has none; a per-element math.erf would be a Python call per
    neuron and token): Abramowitz & Stegun 7.1.26, absolute error < 1.5e-7."""
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 +
                                                                          t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


ALLOCATIONS = F.GATE_ALLOCATIONS
#: Sparsity levels at which the greedy allocation measures each layer's cost.
ALLOCATION_GRID = tuple(round(0.1 * i, 2) for i in range(1, 10))
#: The largest sparsity a layer may get from the greedy allocation.
MAX_LAYER_SPARSITY = ALLOCATION_GRID[-1]
#: Quantile levels a QuantileTable keeps (0.001 apart: between them np.quantile is
#: linear anyway, so the table's interpolation stays within a rank of the exact quantile).
_Q_LEVELS = np.linspace(0.0, 1.0, 1001)


def gate_magnitudes(x: np.ndarray, w_gate: np.ndarray, act: str, chunk: int = 2048,
                    act_threshold: float = 0.0) -> np.ndarray:
    """|act(gate . x)| [tokens, n_ff] float32 for one layer's FFN inputs x [tokens, d] and
    its gate weights w_gate [n_ff, d] as stored (dequantized)."""
    wt = w_gate.T.astype(np.float32)
    mags = []
    for s in range(0, x.shape[0], chunk):
        g = x[s:s + chunk].astype(np.float32) @ wt
        mags.append(np.abs(activation(act, g, act_threshold)).astype(np.float32))
    return np.concatenate(mags, axis=0)


def calibrate_layer(x: np.ndarray, w_gate: np.ndarray, act: str, sparsity: float,
                    chunk: int = 2048, act_threshold: float = 0.0) -> tuple[float, np.ndarray]:
    """(threshold, per-neuron activity frequency) for one layer: x [tokens, d] are the
    layer's FFN inputs, w_gate [n_ff, d] its gate weights as stored (dequantized)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    mag = gate_magnitudes(x, w_gate, act, chunk, act_threshold)
    t = float(np.quantile(mag, sparsity)) if sparsity > 0 else 0.0
    return t, (mag > t).mean(axis=0, dtype=np.float64)


class QuantileTable:
    """Per layer, the quantiles of |act(gate)| on a fine grid: the threshold for any
    sparsity without keeping the magnitudes."""

    def __init__(self, mags_per_layer):
        self.q = np.stack([np.quantile(m, _Q_LEVELS) for m in mags_per_layer]).astype(np.float64)

    @property
    def n_layer(self) -> int:
        return int(self.q.shape[0])

    def threshold(self, layer: int, sparsity: float) -> float:
        """The threshold that zeroes the share ``sparsity`` of layer's neurons (0 at 0)."""
        if sparsity <= 0:
            return 0.0
        return float(np.interp(sparsity, _Q_LEVELS, self.q[layer]))

    def thresholds(self, levels) -> list[float]:
        """Thresholds of every layer for per-layer sparsities ``levels``."""
        return [self.threshold(l, float(s)) for l, s in enumerate(levels)]


def uniform_allocation(n_layer: int, mean: float) -> list[float]:
    """The same sparsity in every layer."""
    return [float(mean)] * n_layer


def greedy_allocation(costs: np.ndarray, mean: float | None, grid=ALLOCATION_GRID,
                      step: float = 0.05, weights=None, max_cost: float | None = None) -> list[float]:
    """Per-site sparsities (a site: a layer's FFN for the gate mode, or any input-sparse site)
    built by adding ``step`` at a time to the site whose cost rises least per unit of weight,
    until their weighted mean reaches ``mean`` or (max_cost) the next step would take the
    summed cost past ``max_cost``. costs [n_site, len(grid)]: each site's measured cost (KL to
    dense) at the grid levels, 0 at sparsity 0; read piecewise linearly, made non-decreasing
    (a dip below a lower level's cost is measurement noise). weights [n_site]: what a unit of
    a site's sparsity saves (its weight bytes per token; None: 1 each, the gate's layers),
    so the rise per byte saved is compared and the mean is a share of the bytes; the costs
    are taken as additive over the sites (measured: docs/BENCHMARKS.md)."""
    costs = np.maximum.accumulate(np.maximum(np.asarray(costs, np.float64), 0.0), axis=1)
    n_site = costs.shape[0]
    w = np.ones(n_site) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (n_site,) or not np.all(w > 0):
        raise ValueError(f"weights must be {n_site} positive values")
    xs = np.concatenate([[0.0], np.asarray(grid, np.float64)])
    cs = np.concatenate([np.zeros((n_site, 1)), costs], axis=1)
    cap = float(xs[-1])
    if mean is None and max_cost is None:
        raise ValueError("greedy_allocation needs a mean, a max_cost or both")
    if mean is not None and not 0.0 <= mean <= cap:
        raise ValueError(f"a mean sparsity of {mean} is outside [0, {cap}] (the greedy allocation's "
                         "per-layer maximum)")
    level = np.zeros(n_site)
    need = (cap if mean is None else mean) * float(w.sum())
    spent = 0.0
    while need > 1e-9 * float(w.sum()):
        best, best_rise, best_inc = -1, math.inf, 0.0
        for l in range(n_site):
            inc = min(step, need / w[l])
            if level[l] + inc > cap + 1e-9:
                continue
            rise = np.interp(level[l] + inc, xs, cs[l]) - np.interp(level[l], xs, cs[l])
            if rise / (w[l] * inc) < best_rise - 1e-15:
                best, best_rise, best_inc = l, rise / (w[l] * inc), inc
        if best < 0:  # every site at the cap: cannot happen for mean <= cap
            break
        rise = best_rise * w[best] * best_inc
        if max_cost is not None and spent + rise > max_cost:
            break
        spent += rise
        level[best] += best_inc
        need -= best_inc * w[best]
    return [float(min(v, cap)) for v in level]
