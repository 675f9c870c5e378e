"""A layer's projections as the sparse pipeline reads them, whatever layout its file stores.

The layouts a file may have (docs/FORMAT.md):

- a gated FFN's gate and up rows in ``ffn_gate`` and ``ffn_up``, or fused in one ``ffn_up``
  (phi3: the n_ff gate rows, then the n_ff up rows; two rows a neuron);
- an ungated FFN (OPT, Falcon): ``ffn_up`` alone, whose rows play the gate's part (they
  decide a neuron's activity, act(up x + b)) and which has no up rows of its own;
- the q, k, v projections in ``attn_q``, ``attn_k``, ``attn_v``, or fused in ``attn_qkv``
  (phi3, Falcon: all q rows, then k's, then v's).

The layout is read off the tensors the file has (ffn_up's rows against n_ff), which is what
the runtime's architecture table fixes it to. This module is the one place of sparse/ that
knows these layouts: the pipeline, the placement, the decode-cost model and input sparsity
read a layer through ``ffn_view`` and ``attention_inputs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container

from .. import format as F

#: Every attention projection of a layer, separate or fused (the output's included).
ATTN_KINDS = (F.T_ATTN_Q, F.T_ATTN_K, F.T_ATTN_V, F.T_ATTN_QKV, F.T_ATTN_OUTPUT)
#: Every FFN projection of a layer, in any layout (ffn_down_t: a sparse file's down).
FFN_KINDS = (F.T_FFN_GATE, F.T_FFN_UP, F.T_FFN_DOWN, F.T_FFN_DOWN_T)


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) of the tensor ``tensor`` (``total`` rows in all)."""
    tensor: str
    start: int
    stop: int
    total: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.total

    @property
    def share(self) -> float:
        """The part of the tensor's rows that these are (0.5: one half of a fused gate/up)."""
        return (self.stop - self.start) / self.total


@dataclass(frozen=True)
class FFNView:
    """One layer's FFN as the runtime reads it."""
    layer: int
    n_ff: int
    gate: Rows          # the rows deciding a neuron's activity: ffn_gate's, a fused ffn_up's
                        # first n_ff, or an ungated FFN's ffn_up
    up: Rows | None     # the up rows (None: an ungated FFN)
    down: str           # ffn_down_t where the file has it, else ffn_down

    @property
    def gated(self) -> bool:
        return self.up is not None

    @property
    def inputs(self) -> tuple[str, ...]:
        """The tensors whose rows, concatenated in order, are the gate's then the up's: the
        rows a neuron reads of the FFN's input (each tensor once: a fused ffn_up alone)."""
        return tuple(dict.fromkeys([self.gate.tensor] + ([self.up.tensor] if self.up else [])))


def ffn_view(rows: Callable[[str], int | None], layer: int, n_ff: int) -> FFNView:
    """The FFN of ``layer``; rows(name): the rows of the file's tensor ``name`` as the runtime
    reads them (its leading numpy dimension), None where the file has no such tensor."""
    gate, up = F.tensor_name(F.T_FFN_GATE, layer), F.tensor_name(F.T_FFN_UP, layer)
    down_t = F.sparse_tensor_name(F.T_FFN_DOWN_T, layer)
    down = down_t if rows(down_t) is not None else F.tensor_name(F.T_FFN_DOWN, layer)
    up_rows = rows(up)
    if up_rows is None:
        raise ValueError(f"layer {layer} has no {up}: not a dense FFN")
    if rows(gate) is not None:
        return FFNView(layer, n_ff, Rows(gate, 0, rows(gate), rows(gate)), Rows(up, 0, up_rows, up_rows), down)
    if up_rows == 2 * n_ff:  # fused: gate's rows, then up's
        return FFNView(layer, n_ff, Rows(up, 0, n_ff, up_rows), Rows(up, n_ff, up_rows, up_rows), down)
    return FFNView(layer, n_ff, Rows(up, 0, up_rows, up_rows), None, down)


def attention_inputs(names: Container[str], layer: int) -> tuple[str, ...]:
    """The tensors whose rows, concatenated in order, are the q, k and v projections of
    ``layer`` (a fused attn_qkv alone); names: the file's tensor names."""
    qkv = F.tensor_name(F.T_ATTN_QKV, layer)
    if qkv in names:
        return (qkv,)
    return tuple(F.tensor_name(k, layer) for k in (F.T_ATTN_Q, F.T_ATTN_K, F.T_ATTN_V))
