"""The quality harness's metric math (tools/eval_sparsity.py) against numpy written out the
plain way, on synthetic logits: no model, no native runtime run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import load_tool


@pytest.fixture(scope="module")
def ev():
    return load_tool("eval_sparsity.py")


def _logp(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    return z - (np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) + z.max(1, keepdims=True))


def _pair(seed: int, n: int = 300, v: int = 50, noise: float = 0.3):
    rng = np.random.default_rng(seed)
    zd = rng.normal(0, 3, (n, v))
    zs = zd + rng.normal(0, noise, (n, v))
    return _logp(zd), _logp(zs), rng.integers(0, v, n)


def test_token_metrics_match_numpy(ev):
    ld, lg, t = _pair(0)
    m = ev.token_metrics(ld, lg, t)
    for i in range(0, len(t), 37):
        p, q = np.exp(ld[i]), np.exp(lg[i])
        assert m["kl"][i] == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-9, abs=1e-12)
        assert m["nll"][i] == pytest.approx(-math.log(q[t[i]]), rel=1e-9)
        assert m["nll_dense"][i] == pytest.approx(-math.log(p[t[i]]), rel=1e-9)
        assert m["same_top"][i] == float(np.argmax(p) == np.argmax(q))
    assert (m["kl"] >= -1e-12).all()


def test_summary_matches_numpy(ev):
    ld, lg, t = _pair(1)
    s = ev.summarize(ev.token_metrics(ld, lg, t))
    i = np.arange(len(t))
    ppl = math.exp(-lg[i, t].mean())
    ppl_d = math.exp(-ld[i, t].mean())
    kl = np.array([np.sum(np.exp(ld[k]) * (ld[k] - lg[k])) for k in i])
    assert s["n"] == len(t)
    assert s["ppl"] == pytest.approx(ppl, rel=1e-9)
    assert s["ppl_dense"] == pytest.approx(ppl_d, rel=1e-9)
    assert s["ppl_ratio"] == pytest.approx(ppl / ppl_d, rel=1e-9)  # ratio of the two perplexities
    assert s["kl_mean"] == pytest.approx(kl.mean(), rel=1e-9)
    assert s["kl_mean_se"] == pytest.approx(kl.std(ddof=1) / math.sqrt(len(kl)), rel=1e-9)
    assert s["kl_max"] == pytest.approx(kl.max(), rel=1e-9)
    srt = np.sort(kl)
    # the 99.9% quantile, linear between order statistics: (n - 1) * 0.999 = 298.701 here
    pos = (len(kl) - 1) * 0.999
    lo = int(math.floor(pos))
    assert s["kl_q99.9"] == pytest.approx(srt[lo] + (pos - lo) * (srt[lo + 1] - srt[lo]), rel=1e-9)
    assert s["kl_q50"] == pytest.approx(np.median(kl), rel=1e-9)
    top = (ld.argmax(1) == lg.argmax(1)).mean()
    assert s["top1"] == pytest.approx(top)
    assert s["top1_se"] == pytest.approx(math.sqrt(top * (1 - top) * len(t) / (len(t) - 1)) / math.sqrt(len(t)))
    assert 0.0 < s["top1"] < 1.0 and s["kl_mean"] > 0


def test_identical_runs_are_exact(ev):
    ld, _, t = _pair(2)
    s = ev.summarize(ev.token_metrics(ld, ld.copy(), t))
    assert s["ppl_ratio"] == 1.0 and s["ppl_ratio_se"] == 0.0
    assert s["kl_mean"] == 0.0 and s["kl_q99.9"] == 0.0 and s["kl_max"] == 0.0
    assert s["top1"] == 1.0


def test_more_noise_more_divergence(ev):
    """A sanity order: a noisier copy is further from the reference in KL and top-1."""
    a = ev.summarize(ev.token_metrics(*_pair(3, noise=0.1)))
    b = ev.summarize(ev.token_metrics(*_pair(3, noise=1.0)))
    assert b["kl_mean"] > 10 * a["kl_mean"] and b["top1"] < a["top1"]


def test_float32_reference_is_close_enough(ev):
    """The harness keeps the dense log-probs in float32: KL then moves by far less than the
    levels it reports (1e-4 and up)."""
    ld, lg, t = _pair(4, v=4000, noise=0.05)
    k64 = ev.token_metrics(ld, lg, t)["kl"]
    k32 = ev.token_metrics(ld.astype(np.float32), lg.astype(np.float32), t)["kl"]
    assert np.abs(k64 - k32).max() < 2e-5


def test_windows_and_run_specs(ev):
    ids = list(range(11))
    ws = list(ev.windows(ids, 4))
    assert [s for s, _ in ws] == [0, 4, 8]
    assert ws[0][1] == [0, 1, 2, 3, 4] and ws[-1][1] == [8, 9, 10]
    # every position 0..9 is scored once: a window scores len(w) - 1 positions
    assert sum(len(w) - 1 for _, w in ws) == len(ids) - 1
    assert ev.parse_run("a.gguf") == {"label": "a.gguf", "path": "a.gguf", "ffn": "file", "input_sparse": True}
    assert ev.parse_run("g30=/x/b.gguf@gate,noinput") == {"label": "g30", "path": "/x/b.gguf", "ffn": "gate",
                                                          "input_sparse": False}


def test_crossing(ev):
    # +1% at 10%, +3% at 20%: +2% is crossed half-way
    assert ev.crossing([0.1, 0.2], [0.01, 0.03], 0.02) == pytest.approx(0.15)
    # from 0 (value 0) to the first level
    assert ev.crossing([0.1, 0.2], [0.04, 0.08], 0.02) == pytest.approx(0.05)
    assert ev.crossing([0.1, 0.2], [0.01, 0.015], 0.02) is None


def test_levels_table(ev):
    rows = [{"meta": {"method": "m", "level": lv}, "ppl_ratio": 1 + d, "kl_mean": k,
             "bytes_per_token": b, "dense_bytes_per_token": 100.0}
            for lv, d, k, b in ((0.1, 0.01, 0.01, 90.0), (0.2, 0.03, 0.03, 80.0), (0.3, 0.06, 0.06, 70.0))]
    md = ev.levels_md(rows)
    # +2%: 15% by both; bytes there 0.85 of dense. +5%: by ppl 26.7%, by KL 26.7%
    assert "| m | 15.0% / 15.0% | 0.850 | 26.7% / 26.7% | 0.733 |" in md


def test_crossing_without_origin(ev):
    """A method stacked on another (input levels over a gate level) starts above 0."""
    assert ev.crossing([0.1, 0.2], [0.01, 0.03], 0.02, origin=False) == pytest.approx(0.15)
    assert math.isnan(ev.crossing([0.1, 0.2], [0.03, 0.05], 0.02, origin=False))
