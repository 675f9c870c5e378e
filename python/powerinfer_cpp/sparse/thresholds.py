"""Training-free gate-magnitude sparsity (CATS-style): calibrate, per layer, the threshold
t on |act(gate)| that zeroes a target share of the FFN's neurons on calibration text.

At run time (the "gate" FFN mode) the gate is computed densely, and only the neurons with
|act(gate_i)| > t get their rows of up and down_t read: the same rows the sparse FFN
reads for a predicted neuron, but with no predictor. The threshold is the target
quantile of |act(gate)| over the profiled tokens of that layer (a uniform sparsity per
layer).
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


def calibrate_layer(x: np.ndarray, w_gate: np.ndarray, act: str, sparsity: float,
                    chunk: int = 2048, act_threshold: float = 0.0) -> tuple[float, np.ndarray]:
    """(threshold, per-neuron activity frequency) for one layer: x [tokens, d] are the
    layer's FFN inputs, w_gate [n_ff, d] its gate weights as stored (dequantized)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    mags = []
    for s in range(0, x.shape[0], chunk):
        g = x[s:s + chunk].astype(np.float32) @ w_gate.T.astype(np.float32)
        mags.append(np.abs(activation(act, g, act_threshold)).astype(np.float32))
    mag = np.concatenate(mags, axis=0)
    t = float(np.quantile(mag, sparsity)) if sparsity > 0 else 0.0
    freq = (mag > t).mean(axis=0, dtype=np.float64)
    return t, freq
