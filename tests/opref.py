"""numpy references and encoders for the op tests (CPU and device backends)."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

from powerinfer_cpp._native import ffi

F32, F16, Q4_0, Q8_0, BF16 = 0, 1, 2, 8, 30
TYPES = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0, "q4_0": Q4_0}
GGUF_QT = {F32: QT.F32, F16: QT.F16, BF16: QT.BF16, Q8_0: QT.Q8_0, Q4_0: QT.Q4_0}
SILU, RELU, DRELU, GELU, GELU_ERF = 0, 1, 2, 3, 4
ACTS = {"silu": SILU, "relu": RELU, "drelu": DRELU, "gelu": GELU, "gelu_erf": GELU_ERF}


def vptr(a: np.ndarray):
    """void * to a contiguous array."""
    return ffi.cast("void *", a.ctypes.data)


def encode(t: int, a: np.ndarray):
    """(raw bytes of a stored as type t, its dequantized float32 values)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if t == F32:
        return a, a
    raw = np.ascontiguousarray(quants.quantize(a, GGUF_QT[t]))
    return raw, quants.dequantize(raw, GGUF_QT[t]).astype(np.float32).reshape(a.shape)


def act_ref(act, g, u):
    """act(g, u) of the GLU kinds (gh_act)."""
    if act == RELU:
        return np.maximum(g, 0) * u
    if act == DRELU:
        return np.maximum(g, 0) * np.maximum(u, 0)
    if act == SILU:
        return g / (1 + np.exp(-g)) * u
    if act == GELU:
        return 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))) * u
    return 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2))) * u


def id_lists(rows, rng):
    """Empty, one, all, sorted random, unsorted random with repeats, a contiguous run."""
    perm = rng.permutation(rows)
    return {
        "empty": np.zeros(0, dtype=np.int32),
        "one": np.array([rows // 2], dtype=np.int32),
        "all": np.arange(rows, dtype=np.int32),
        "sorted": np.sort(perm[: max(1, rows // 5)]).astype(np.int32),
        "unsorted": np.concatenate([perm[: max(1, rows // 3)], perm[:2]]).astype(np.int32),
        "run": np.arange(rows // 4, rows // 4 + min(rows, 9), dtype=np.int32) % rows,
    }


def nrmse(got: np.ndarray, ref: np.ndarray) -> float:
    """Root-mean-square error normalised by the reference's RMS."""
    den = float(np.sqrt(np.mean(np.square(ref, dtype=np.float64))))
    return float(np.sqrt(np.mean(np.square(got - ref, dtype=np.float64)))) / max(den, 1e-30)
