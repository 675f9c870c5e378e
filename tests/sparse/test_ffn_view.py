"""The one view of a layer's projections the sparse pipeline reads (sparse/ffn_view.py): the
rows of each layout a file may store, checked against the rows a gated FFN computes from
separate and from fused (phi3) tensors of the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp import format as F
from powerinfer_cpp.sparse.ffn_view import attention_inputs, ffn_view

N_FF, D = 6, 4


def _rows(tensors: dict):
    return lambda name: tensors[name].shape[0] if name in tensors else None


def _gate_up(tensors: dict, v) -> tuple[np.ndarray, np.ndarray | None]:
    """The gate and up matrices the view points at."""
    g = tensors[v.gate.tensor][v.gate.start:v.gate.stop]
    u = None if v.up is None else tensors[v.up.tensor][v.up.start:v.up.stop]
    return g, u


def test_separate_and_fused_gate_up_read_the_same_rows():
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((N_FF, D)), rng.standard_normal((N_FF, D))
    down = rng.standard_normal((D, N_FF))
    sep = {F.tensor_name(F.T_FFN_GATE, 1): gate, F.tensor_name(F.T_FFN_UP, 1): up,
           F.tensor_name(F.T_FFN_DOWN, 1): down}
    fused = {F.tensor_name(F.T_FFN_UP, 1): np.concatenate([gate, up]),  # phi3: gate's rows, then up's
             F.sparse_tensor_name(F.T_FFN_DOWN_T, 1): down.T}
    vs, vf = ffn_view(_rows(sep), 1, N_FF), ffn_view(_rows(fused), 1, N_FF)
    for t, v in ((sep, vs), (fused, vf)):
        g, u = _gate_up(t, v)
        assert v.gated and np.array_equal(g, gate) and np.array_equal(u, up)
        # the inputs' rows concatenated: gate's, then up's (the runtime's ffn_gate_up_t order)
        assert np.array_equal(np.concatenate([t[n] for n in v.inputs]), np.concatenate([gate, up]))
    assert vs.inputs == ("blk.1.ffn_gate.weight", "blk.1.ffn_up.weight") and vs.down == "blk.1.ffn_down.weight"
    assert vf.inputs == ("blk.1.ffn_up.weight",) and vf.down == "blk.1.ffn_down_t.weight"
    assert vs.up.share == 1.0 and vf.up.share == vf.gate.share == 0.5


def test_ungated_up_is_the_gate():
    """OPT, Falcon: ffn_up's rows decide activity; no up rows."""
    t = {F.tensor_name(F.T_FFN_UP, 0): np.zeros((N_FF, D)), F.tensor_name(F.T_FFN_DOWN, 0): np.zeros((D, N_FF))}
    v = ffn_view(_rows(t), 0, N_FF)
    assert not v.gated and v.up is None and v.gate.whole and v.inputs == ("blk.0.ffn_up.weight",)
    with pytest.raises(ValueError, match="no blk.3.ffn_up.weight"):
        ffn_view(_rows(t), 3, N_FF)


def test_attention_inputs():
    assert attention_inputs({"blk.2.attn_qkv.weight"}, 2) == ("blk.2.attn_qkv.weight",)
    assert attention_inputs({"blk.2.attn_q.weight", "blk.2.attn_k.weight", "blk.2.attn_v.weight"}, 2) == (
        "blk.2.attn_q.weight", "blk.2.attn_k.weight", "blk.2.attn_v.weight")
