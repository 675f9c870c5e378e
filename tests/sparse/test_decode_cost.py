"""The decode-time estimate that ``--input-sparsity auto`` ranks by (sparse/decode_cost.py):
synthetic files and runtime statistics against estimates worked out by hand."""

from __future__ import annotations

import pytest

from powerinfer_cpp.sparse.decode_cost import COSTS, DecodeCost, Tensor, cost_per_byte


def _layer(t_att="Q4_0", t_ffn="Q4_0", t_head="Q8_0", gate=True, pred=None):
    """One layer of a sparse file with input sparsity: 1000-byte projections (and their
    transposed copies), 4000-byte FFN matrices of 100 rows (down_t rows: 40 bytes), a 2000-byte
    head; pred: the predictors' type (fc1 + fc2, 500 bytes each), None for a gate file."""
    ts = [Tensor("blk.0.attn_q.weight", t_att, 1000, 10), Tensor("blk.0.attn_output.weight", t_att, 1000, 10),
          Tensor("blk.0.attn_qkv_t.weight", t_att, 1000, 10), Tensor("blk.0.attn_output_t.weight", t_att, 1000, 10),
          Tensor("blk.0.ffn_up.weight", t_ffn, 4000, 100), Tensor("blk.0.ffn_down_t.weight", t_ffn, 4000, 100),
          Tensor("blk.0.attn_norm.weight", "F32", 40, 1),
          Tensor("output.weight", t_head, 2000, 20), Tensor("output_t.weight", t_head, 2000, 20),
          Tensor("token_embd.weight", t_head, 2000, 20)]
    if gate:
        ts.append(Tensor("blk.0.ffn_gate.weight", t_ffn, 4000, 100))
    if pred:
        ts += [Tensor("blk.0.fc1.weight", pred, 500, 5), Tensor("blk.0.fc2.weight", pred, 500, 100)]
    return ts


def _result(att, head, ffn, up_rows, down_rows, on, pred=0.0):
    return {"bytes_per_token_stage": {"attention": att, "predictor": pred, "ffn": ffn, "head": head},
            "ffn_rows_per_token": {"up": up_rows, "down": down_rows}, "input_sparse": on}


def test_gate_file_q4_0():
    """Gate mode: the gate whole through the row dot, up rows gathered, down_t through the
    axpy; input-sparse attention and head through the column axpy. In Q4_0 (head Q8_0) 30%
    input sparsity at the same gate level estimates slower than off, though it reads less."""
    c = DecodeCost(_layer(), "gate")
    ffn = 4000 + 10 * 40 + 10 * 40  # gate whole, 10 up rows, 10 down_t rows of 40 bytes
    off = _result(2000, 2000, ffn, 10, 10, False)
    assert c.estimate(off) == pytest.approx(2000 + 4000 + 400 * 1.45 + 400 * 1.55 + 2000)
    on = _result(1400, 1400, ffn, 10, 10, True)  # 70% of the inputs used
    b = c.breakdown(on)
    assert b["attention"] == pytest.approx(1400 * 1.44) and b["head"] == pytest.approx(1400 * 1.44)
    assert b["ffn"] == pytest.approx(4000 + 400 * 1.45 + 400 * 1.55) and b["predictor"] == 0.0
    assert c.estimate(on) > c.estimate(off)  # 0.7 x 1.44 > 1
    assert c.estimate(_result(1000, 1000, ffn, 10, 10, True)) < c.estimate(off)  # 50%: pays
    # a dense file's decode: every matrix once through the row dot (ffn_down: down_t's bytes)
    assert c.dense == pytest.approx(2000 + 3 * 4000 + 2000)


def test_f16_input_sparsity_pays_at_full_density():
    c = DecodeCost(_layer("F16", "F16", "F16"), "gate")
    ffn = 4000 + 800
    off = c.estimate(_result(2000, 2000, ffn, 10, 10, False))
    assert off == pytest.approx(2000 + 4000 + 400 * 1.31 + 400 * 0.96 + 2000)
    assert c.estimate(_result(2000, 2000, ffn, 10, 10, True)) == pytest.approx(off - 4000 * (1 - 0.64))


def test_predictor_file_and_types():
    """The predictor mode: fc1/fc2 through the row dot, the gate's listed rows gathered like up;
    a K-quant's every path scaled by its dot's cost; a type without its own measurement takes
    the nearest measured one's factors (BF16, F32: F16's)."""
    c = DecodeCost(_layer("Q4_K", "Q4_K", "Q6_K", pred="Q8_0"), "sparse")
    k4, k6 = COSTS["Q4_K"], COSTS["Q6_K"]
    r = _result(1400, 1400, 20 * 40 + 10 * 40 + 10 * 40, 10, 10, True, pred=1000)
    assert c.breakdown(r) == pytest.approx({
        "attention": 1400 * k4.dot * k4.cols, "predictor": 1000 * 1.0,
        "ffn": 800 * k4.dot * k4.rows + 400 * k4.dot * k4.rows + 400 * k4.dot * k4.down,
        "head": 1400 * k6.dot * k6.cols})
    assert COSTS["BF16"] == COSTS["F32"] == COSTS["F16"]
    assert cost_per_byte("Q4_0", "dot") == 1.0 and cost_per_byte("Q4_K", "cols") == pytest.approx(1.37 * 1.24)
    with pytest.raises(ValueError, match="no decode cost for tensor type Q8_1"):
        cost_per_byte("Q8_1", "dot")
    with pytest.raises(ValueError, match="ffn must be"):
        DecodeCost([], "dense")


def test_ungated_and_fused_up():
    """An ungated FFN's ffn_up is the runtime's gate (no up rows); a fused one (phi3: gate's rows
    then up's in ffn_up) gives up half of its rows."""
    ts = [t for t in _layer("F16", "F16", "F16", gate=False)]
    c = DecodeCost(ts, "sparse")
    assert c.up_row_bytes == 0.0 and c.factor["gate"] == pytest.approx(1.31)
    fused = [Tensor(t.name, t.type, 8000, 200) if t.name == "blk.0.ffn_up.weight" else t for t in ts]
    c = DecodeCost(fused, "sparse")
    assert c.up_row_bytes == pytest.approx(40.0) and c.dense == pytest.approx(2000 + 8000 + 4000 + 2000)


def test_every_runtime_type_has_costs():
    """Each weight type the runtime reads (its type table, asked through the library) has
    decode-cost factors, so `--input-sparsity auto` works on a file of any of them."""
    from powerinfer_cpp._native import ffi, lib

    read = [ffi.string(lib.gh_type_name(t)).decode() for t in range(64)
            if lib.gh_type_block_size(t) > 0 and t != 26]  # 26: I32, index tensors only
    assert {"F32", "F16", "Q4_0", "Q4_K"} <= {n.upper() for n in read}
    missing = [n for n in read if n.upper() not in COSTS]
    assert not missing, missing
