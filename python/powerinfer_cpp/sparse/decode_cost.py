"""Estimated decode time of a sparse file's candidates: what ``--input-sparsity auto``
ranks by (sparse/budget.py), instead of the bytes read.

Bytes alone favour input sparsity in every type, but the input-sparse path reads the
transposed copies (``*_t``) through the list axpy, which costs more per byte than the
dense row dot in the quantized types: in Q4_0 and Q8_0 input sparsity only breaks even
near 30%, in Q4_K near 20%, while in F16 the axpy beats the dot even at full density. So
each byte is weighted by the cost of the path that reads it, in its tensor's type:

    time ~ sum over stages and paths of bytes x COSTS[type].dot x COSTS[type].<path>

The unit is the time a bandwidth-bound dense row dot (F16, Q8_0, Q4_0) takes per byte, so
an estimate reads as "MB of dense row dot per token", and a dense file's decode estimates
at about its bytes.

Where the factors come from (docs/BENCHMARKS.md; 1 thread, CPU time, ratios within one run):

* ``dot``: the dense row dot of every type is bound by the bytes except the K-quants', which
  are bound by instructions ("AVX2 kernels": "Decode matvec, every type: bytes"). K-quants:
  "The K-quant axpy rewrite", A/B table, AVX2 cold dot after, Q4_0's GB/s over the type's
  (19.6 over Q4_K 14.3, Q5_K 13.4, Q6_K 16.6).
* ``cols``, the input-sparse column axpy over ``*_t``, per byte against the type's dense
  matvec in the same run, the mean over the measured input densities: F16, Q8_0 from
  "Speed of the kernels, and the default" (q/k/v 2560 x 2048 from DRAM, densities
  100/75/50/25%: F16 0.63/0.67/0.68/0.59, Q8_0 1.34/1.40/1.43/1.57); Q4_0 from "The Q4_0
  axpy in int8" (its int8 axpy replaced the float form that table measured: the input-sparse
  q/k/v after, two runs each, 549/621, 298/387, 159/155 us at 100/50/25% against the dense
  matvec's 407-474 us: 1.33/1.56/1.43); Q4_K from "The Q4_K axpy in int8" (the same
  benchmark, two runs each of the float and the int8 forms: 1.28/1.38/1.45/1.36 and
  1.85/1.92/1.99/2.08 before, mean 1.66; 1.05/1.13/1.13/0.99 and 1.27/1.34/1.45/1.53 after,
  mean 1.24); Q5_K and Q6_K from "The Q5_K and Q6_K axpy in int8" (the same benchmark, two
  runs each of the int8 forms: Q5_K 1.37/1.39/1.63/1.73 and 1.41/1.48/1.74/2.08, mean 1.60;
  Q6_K 1.51/1.62/1.86/2.06 and 1.78/1.68/1.97/2.25, mean 1.84).
* ``rows``, gathered rows through the row dot (up; the gate's rows in the predictor mode),
  and ``down``, the gathered ``ffn_down_t`` rows through the axpy, per byte against the
  dense matvec: F16, Q8_0, Q4_0 from "AVX2 kernels" (the sparse FFN layer's glu/down us at
  1 thread after, 563 rows of 2048 each, over the dense table's 1-thread 2048 x 5632 rate:
  F16 465/170 us against 13.0 GB/s, Q8_0 230/118 against 12.2, Q4_0 161/111 against 11.7),
  Q4_0's down then scaled by the int8 axpy's gain on the same stage ("The Q4_0 axpy in int8",
  sparse down at 8% of the rows, 98/94 -> 68/81 us: x0.78); the K-quants from "The K-quant
  axpy rewrite" (bench_kernels, AVX2 1 thread after: dense / glu / down GB/s Q4_K
  10.3/10.8/5.9, Q5_K 8.0/8.9/5.9, Q6_K 9.9/11.6/7.6), their down then scaled by their int8
  axpy's gain: Q4_K as its cols (1.24 / 1.66: x0.75), Q5_K and Q6_K by the sparse down's A/B
  of the two forms at AVX2, 10% of 5632 x 2048 from DRAM (1.39x and 1.16x: x0.72, x0.86).

* Q4_1, Q5_0, Q5_1 (2026-12-03, bench_kernels_ab at AVX2, 1 thread, one loaded run each):
  ``dot`` from the cold 2048 x 5632 matvec against Q4_0's in the same run, per byte (Q4_1
  350 us, Q5_0 703, Q5_1 576 against Q4_0's 290; times 18 / 20, 22, 24 bytes per block:
  1.09, 1.98, 1.49: the Q5 types' fifth-bit unpacking makes them instruction-bound); their
  axpy forms are Q8_0's float ones over another unpacking, so ``cols``, ``rows``, ``down``
  take Q8_0's (not measured separately).
* Q2_K, Q3_K (2026-12-03, bench_kernels at AVX2, 1 thread, three loaded runs): ``dot`` from
  the decode GB/s against Q4_K's in the same runs (Q2_K 7.8-9.2, Q3_K 8.6-10.0 against
  11.1-14.7: x1.52 and x1.39 Q4_K's 1.37); gathered rows (glu) 2.3 / 2.1 GB/s and the sparse
  down 1.3 / 1.2 GB/s against their dense 8.5 / 9.3 (``rows`` 3.7 / 4.4, ``down`` 6.5 / 7.8:
  one-row axpy only); ``cols`` as ``down`` (the same axpy).

* IQ4_NL, IQ4_XS, MXFP4 (2026-12-03, bench_kernels at AVX2, 1 thread, loaded): ``dot`` from
  the decode GB/s against Q4_0's in the same run (IQ4_NL 11.9, MXFP4 12.3, IQ4_XS 10.3
  against 16.4: 1.38, 1.34, 1.59); ``rows`` (their gathered four-row tile is Q4_0's form)
  Q4_0's. They have no SIMD axpy yet: ``cols`` and ``down`` run the scalar axpy, which
  measured 10-18x the SIMD forms' time for Q4_1/Q5_0/Q5_1 (their A/B before and after):
  taken as 10x Q8_0's 1.44 (not measured), so ``auto`` does not pick input sparsity for them.

* The IQ lattice types (2026-12-05, not measured): their AVX2 dot gathers a codebook
  point per 8 values (IQ3: per 4) and applies signs before Q2_K's kind of integer dot, so
  ``dot`` takes Q2_K's 2.08 (IQ3_XXS, IQ3_S, whose points are 4 values: x1.2 of it, 2.5);
  ``rows`` Q2_K's (gathered rows through the same dot, one row at a time); their axpy is
  a one-row AVX2 form only, as Q2_K's and Q3_K's (whose ``cols`` / ``down`` measured 6.5
  and 7.8 of their dot), so ``cols`` and ``down`` take 7.0.

Not measured, and given the nearest measured type's factors: BF16 and F32 all of F16's
(the same float kernels, with another conversion or none). The figures carry the benchmarks' noise
(15-30% per run on the loaded 2-core machine): the model decides between candidates that
differ by more than that, and near a break-even it may pick either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import gguf

from .. import format as F
from .ffn_view import ATTN_KINDS, ffn_view


@dataclass(frozen=True)
class PathCost:
    """Time per byte of one tensor type's decode paths (see the module's docstring)."""
    dot: float    # the dense row dot, against a bandwidth-bound one
    cols: float   # the input-sparse column axpy over *_t, against this type's dot
    rows: float   # gathered rows through the row dot, against this type's dot
    down: float   # gathered ffn_down_t rows through the axpy, against this type's dot


_F16 = PathCost(dot=1.0, cols=0.64, rows=1.31, down=0.96)

#: Per GGML type name: the factors of each path (the module's docstring gives the sources).
COSTS: dict[str, PathCost] = {
    "F16": _F16,
    "BF16": _F16,   # not measured: F16's
    "F32": _F16,    # not measured: F16's
    "Q8_0": PathCost(dot=1.0, cols=1.44, rows=1.15, down=1.17),
    "Q4_0": PathCost(dot=1.0, cols=1.44, rows=1.45, down=1.55),
    "Q4_K": PathCost(dot=1.37, cols=1.24, rows=0.95, down=1.31),
    "Q5_K": PathCost(dot=1.46, cols=1.60, rows=0.90, down=0.98),
    "Q6_K": PathCost(dot=1.18, cols=1.84, rows=0.85, down=1.12),
    "Q4_1": PathCost(dot=1.09, cols=1.44, rows=1.15, down=1.17),
    "Q5_0": PathCost(dot=1.98, cols=1.44, rows=1.15, down=1.17),
    "Q5_1": PathCost(dot=1.49, cols=1.44, rows=1.15, down=1.17),
    "Q2_K": PathCost(dot=2.08, cols=6.5, rows=3.7, down=6.5),
    "Q3_K": PathCost(dot=1.90, cols=7.8, rows=4.4, down=7.8),
    "IQ4_NL": PathCost(dot=1.38, cols=14.4, rows=1.45, down=14.4),
    "IQ4_XS": PathCost(dot=1.59, cols=14.4, rows=1.45, down=14.4),
    "MXFP4": PathCost(dot=1.34, cols=14.4, rows=1.45, down=14.4),
    "IQ2_XXS": PathCost(dot=2.08, cols=7.0, rows=3.7, down=7.0),
    "IQ2_XS": PathCost(dot=2.08, cols=7.0, rows=3.7, down=7.0),
    "IQ2_S": PathCost(dot=2.08, cols=7.0, rows=3.7, down=7.0),
    "IQ3_XXS": PathCost(dot=2.5, cols=7.0, rows=3.7, down=7.0),
    "IQ3_S": PathCost(dot=2.5, cols=7.0, rows=3.7, down=7.0),
    "IQ1_S": PathCost(dot=2.08, cols=7.0, rows=3.7, down=7.0),
    "IQ1_M": PathCost(dot=2.08, cols=7.0, rows=3.7, down=7.0),
}

PATHS = ("dot", "cols", "rows", "down")


def cost_per_byte(type_name: str, path: str) -> float:
    """Time per byte of a tensor of this GGML type read through path, in dense-dot bytes."""
    c = COSTS.get(type_name)
    if c is None:
        raise ValueError(f"no decode cost for tensor type {type_name} (the runtime's types: {', '.join(COSTS)})")
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r} (one of {', '.join(PATHS)})")
    return c.dot if path == "dot" else c.dot * getattr(c, path)


@dataclass(frozen=True)
class Tensor:
    """What the cost model needs of a file's tensor."""
    name: str
    type: str      # GGML type name ("Q4_0", ...)
    n_bytes: int
    n_rows: int    # rows as the runtime reads them (GGUF ne[1] x ...)


def _mean(ts: list[Tensor], path: str) -> float:
    """The bytes-weighted cost per byte of tensors read through one path (0 without bytes)."""
    nb = sum(t.n_bytes for t in ts)
    return sum(t.n_bytes * cost_per_byte(t.type, path) for t in ts) / nb if nb else 0.0


def _row_bytes(parts: list[tuple[Tensor, float]]) -> float:
    """Mean bytes of one row over (tensor, share) parts (share: the part of the tensor's rows
    that are one kind's, as half of a fused gate + up)."""
    n = sum(t.n_rows * share for t, share in parts)
    return sum(t.n_bytes * share for t, share in parts) / n if n else 0.0


class DecodeCost:
    """The estimated decode time per token of one file's candidates (estimate(result))."""

    def __init__(self, tensors: Iterable[Tensor], ffn: str = "gate"):
        if ffn not in ("gate", "sparse"):
            raise ValueError(f"ffn must be 'gate' or 'sparse', not {ffn!r}")
        self.ffn = ffn
        by: dict[str, list[Tensor]] = {}
        named: dict[str, Tensor] = {}
        for t in tensors:
            kind, layer, suffix = F.parse_tensor_name(t.name)
            if suffix == "weight":
                by.setdefault(kind, []).append(t)
                named[t.name] = t
        att = [t for k in ATTN_KINDS for t in by.get(k, [])]
        head = by.get(F.T_OUTPUT) or by.get(F.T_TOKEN_EMBD, [])
        down_t = by.get(F.T_FFN_DOWN_T, [])
        # each dense FFN's gate and up rows in its layout (ffn_view.py; an ungated FFN's
        # ffn_up is its gate, and it counts no up rows)
        layers = sorted({F.parse_tensor_name(t.name)[1] for t in by.get(F.T_FFN_UP, [])})
        views = [ffn_view(lambda n: named[n].n_rows if n in named else None, l,
                          named[F.sparse_tensor_name(F.T_FFN_DOWN_T, l)].n_rows
                          if F.sparse_tensor_name(F.T_FFN_DOWN_T, l) in named else 0) for l in layers]
        gate_ts = [named[v.gate.tensor] for v in views]
        up_parts = [(named[v.up.tensor], v.up.share) for v in views if v.up is not None]
        up_ts = [t for t, _ in up_parts]
        self.factor = {
            "attention": _mean(att, "dot"),
            "attention_t": _mean(by.get(F.T_ATTN_QKV_T, []) + by.get(F.T_ATTN_OUTPUT_T, []), "cols"),
            "head": _mean(head, "dot"),
            "head_t": _mean(by.get(F.T_OUTPUT_T, []), "cols"),
            "predictor": _mean(by.get(F.T_FC1, []) + by.get(F.T_FC2, []), "dot"),
            "gate": _mean(gate_ts, "dot" if ffn == "gate" else "rows"),
            "up": _mean(up_ts, "rows"),
            "down": _mean(down_t, "down"),
        }
        self.up_row_bytes = _row_bytes(up_parts)
        self.down_row_bytes = _row_bytes([(t, 1.0) for t in down_t])
        ffn_rm = list({t.name: t for t in gate_ts + up_ts}.values())  # each tensor once
        down = by.get(F.T_FFN_DOWN, []) or down_t
        # a dense file's decode: every matrix once through the row dot
        self.dense = sum(t.n_bytes * cost_per_byte(t.type, "dot") for t in att + head + ffn_rm + down)

    @classmethod
    def from_file(cls, path: str, ffn: str = "gate") -> "DecodeCost":
        """The cost model of the GGUF file at path, whose sparse FFN mode is ffn."""
        r = gguf.GGUFReader(path)
        try:
            ts = [Tensor(t.name, t.tensor_type.name, int(t.n_bytes),
                         int(t.n_elements // max(int(t.shape[0]), 1)) if len(t.shape) else 1) for t in r.tensors]
        finally:
            del r
        return cls(ts, ffn)

    def breakdown(self, result: dict) -> dict:
        """Estimated time per token, per stage (attention, predictor, ffn, head), of a
        GateEvaluator.measure result, in dense-dot bytes."""
        st = result["bytes_per_token_stage"]
        on = bool(result.get("input_sparse"))
        f = self.factor
        rows = result.get("ffn_rows_per_token", {})
        up = float(rows.get("up", 0.0)) * self.up_row_bytes
        down = float(rows.get("down", 0.0)) * self.down_row_bytes
        gate = max(float(st["ffn"]) - up - down, 0.0)
        return {"attention": float(st["attention"]) * f["attention_t" if on else "attention"],
                "predictor": float(st["predictor"]) * f["predictor"],
                "ffn": gate * f["gate"] + up * f["up"] + down * f["down"],
                "head": float(st["head"]) * f["head_t" if on else "head"]}

    def estimate(self, result: dict) -> float:
        """Estimated time per decoded token of a GateEvaluator.measure result, in the bytes a
        dense row dot reads in that time."""
        return sum(self.breakdown(result).values())
