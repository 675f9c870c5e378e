"""One quality budget for FFN and input sparsity (``--max-ppl-increase P`` with
``--input-sparsity auto``): the (gate level, input level) combination with the shortest
estimated decode time among those whose held-out perplexity bound stays within P of dense.

The search, over a small grid of input levels (INPUT_GRID):

1. the gate alone: the largest gate level within P (gate_eval.search_budget's bisection);
2. each input level, ascending: its thresholds refit in the sparse mode (input_eval.refit),
   then the largest gate level within P with those inputs on, searched below the previous
   level's gate level (more input sparsity leaves less headroom: the bound grows with both),
   down to gate 0; the walk stops at the first input level over P even with an exact FFN;
3. the candidate with the shortest estimated decode time wins: the runtime's bytes per token
   of each stage (gate, up/down rows read, attention and head rows read) weighted by what a
   byte costs on its path in its tensor's type (decode_cost.DecodeCost: the input-sparse
   projections read the transposed copies through the list axpy, cheaper per byte than the
   dense row dot in F16 but ~1.4x dearer in Q4_0/Q8_0 and ~1.2x in Q4_K, so fewer bytes can
   be slower); ties go to the lower input level, and an input level must beat off by
   INPUT_MIN_GAIN (a file without input sparsity does not store the transposed copies).
   Without a cost model, the fewest bytes win (with the same margin).

A file with predictors has no gate level: step 2 measures each input level over the
predictor FFN, and the fastest within P wins (in F16 the largest level: fewer bytes and
cheaper ones; in the quantized types possibly off).
The refit runs with the FFN at the gate level the search starts from for that input level,
so that the thresholds measured are the ones written: the file's bound is what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .gate_eval import search_budget

#: Input levels --input-sparsity auto tries (0 = off is always a candidate).
INPUT_GRID = (0.1, 0.2, 0.25, 0.3, 0.4)
#: What an input level must gain on input sparsity off, in estimated time (or bytes), to be
#: chosen by auto: its file stores the transposed copies (+25-37% size), and the cost
#: factors are single measurements with 15-30% noise (decode_cost.py).
INPUT_MIN_GAIN = 0.05


@dataclass
class Candidate:
    """One measured combination."""
    gate: float | None       # mean gate sparsity (None: a predictor FFN)
    inputs: float            # input sparsity (0: off)
    result: dict             # GateEvaluator.measure's
    cal: Any = None          # its InputCalibration (None when off)
    time: float | None = None  # estimated decode time per token (DecodeCost.estimate; None: not ranked by it)

    @property
    def bytes_per_token(self) -> float:
        return float(self.result["bytes_per_token"])

    @property
    def rank(self) -> tuple[float, float]:
        """What search_levels minimises: the estimated time (else the bytes), then the input level."""
        return (self.bytes_per_token if self.time is None else self.time, self.inputs)


def describe_time(t: float, dense: float | None = None) -> str:
    """An estimated decode time (decode_cost's unit: MB a dense row dot reads meanwhile) for a log line."""
    return f"{t / 1e6:.3f} MB-dot/token" + ("" if not dense else f" ({t / dense:.2f}x a dense file's)")


def _ub(r: dict) -> float:
    return float(r.get("ppl_increase_ub", r["ppl"] / r["ppl_dense"] - 1.0))


def over_budget(r: dict, budget: float, max_kl: float | None = None) -> bool:
    """Whether a measurement breaks the perplexity budget (its upper bound) or the KL bound:
    input sparsity can lower the held-out perplexity while the KL to dense is several times
    the gate's at the same budget (docs/BENCHMARKS.md "Sparsity on a real model")."""
    return _ub(r) > budget or (max_kl is not None and float(r["kl"]) > max_kl)


def search_levels(measure: Callable[[float | None, Any], dict], make_inputs: Callable[[float, float | None], Any],
                  budget: float, levels: Sequence[float], gate_hi: float | None, include_off: bool = True,
                  resolution: float = 0.025, say: Callable[[str], None] | None = None,
                  cost: Callable[[dict], float] | None = None, dense_time: float | None = None,
                  max_kl: float | None = None) -> tuple[Candidate, list[Candidate]]:
    """The fastest combination within the budget (see the module's docstring).

    measure(gate level or None, input calibration or None) -> a GateEvaluator.measure dict;
    make_inputs(input level, gate level or None) -> the (refit) calibration at that level;
    gate_hi: the largest gate level tried (None: the FFN has predictors, no gate level);
    include_off: input sparsity off is a candidate (else only the levels given: when the
    user fixed one, it is kept even over the budget, with gate 0);
    cost(measure's dict) -> estimated decode time per token (DecodeCost.estimate), the
    ranking (None: bytes per token); dense_time: a dense file's estimate, for the log; max_kl:
    a bound on the mean KL to dense beside the perplexity budget (None: none).
    Returns (the chosen candidate, every candidate measured: the best gate level of each
    input level walked, and the first over the budget)."""
    say = say or (lambda s: None)
    gated = gate_hi is not None
    cands: list[Candidate] = []

    def cand(g, s, r, cal=None) -> Candidate:
        return Candidate(g, s, r, cal, None if cost is None else float(cost(r)))

    def note(c: Candidate, why: str = "") -> None:
        r = c.result
        g = "" if c.gate is None else f"gate {c.gate:.1%}, "
        say(f"  {g}input {c.inputs:.0%}: ppl {r['ppl']:.3f} vs dense {r['ppl_dense']:.3f} "
            f"(bound {_ub(r):+.2%}), KL {r['kl']:.4f}, {r['bytes_per_token'] / 1e6:.3f} MB/token"
            + ("" if c.time is None else f", est. time {describe_time(c.time, dense_time)}") + why)

    def gate_search(cal) -> tuple[float, dict | None]:
        lvl, r, _ = search_budget(lambda s: measure(s, cal), budget, hi, resolution,
                                  say=lambda m: say("  " + m), max_kl=max_kl)
        return lvl, r

    hi = gate_hi
    if gated:
        hi, r0 = gate_search(None)
        if r0 is None:
            r0 = measure(0.0, None)
        off = cand(hi, 0.0, r0)
    else:
        off = cand(None, 0.0, measure(None, None))
    note(off, " (input sparsity off)")
    tried = [off]
    if include_off:
        cands.append(off)
    chosen_over = None
    for s in sorted(float(v) for v in levels if v > 0):
        cal = make_inputs(s, hi)
        r = None
        if gated and hi > 0:
            g, r = gate_search(cal)
        if r is None:
            g = 0.0 if gated else None
            r = measure(g, cal)
            if over_budget(r, budget, max_kl):
                over = cand(g, s, r, cal)
                note(over, ": over the budget")
                tried.append(over)
                if not include_off and not cands:
                    chosen_over = over
                break
        c = cand(g, s, r, cal)
        note(c)
        cands.append(c)
        tried.append(c)
        hi = g
    if not cands:
        return chosen_over, tried
    best = min(cands, key=lambda c: c.rank)
    if include_off and best.inputs > 0 and best.rank[0] > (1.0 - INPUT_MIN_GAIN) * off.rank[0]:
        say(f"  input {best.inputs:.0%} gains less than {INPUT_MIN_GAIN:.0%} on off: off")
        best = off
    return best, tried
