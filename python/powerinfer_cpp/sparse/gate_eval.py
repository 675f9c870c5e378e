"""Quality of a gate-sparse file as its thresholds change, measured by the native runtime:
what the quality budget (``--max-ppl-increase``) and the greedy allocation decide on.

The runtime reads the thresholds (powerinfer.sparse.gate_threshold, f32[n_layer]) when it
loads a file, and has no call to change them. So the pipeline writes one evaluation file,
and each trial overwrites that array in place (same size: only its values change) and
reloads the file (an mmap: cheap), instead of writing a file per trial.

The budget is checked against an upper bound, not the point estimate: a perplexity ratio
measured on a couple of thousand tokens moves by about a point from one stretch of text
to the next (on the shipped SwiGLU model a level at +2.0% on the calibration's held-out
split measured +2.8% on the text after it). The bound is exp(mean + 2 se) - 1 of the
per-token log-likelihood loss, se from the means of blocks of BLOCK tokens (neighbouring
tokens' losses are correlated, so single tokens would understate it).

Every evaluated token runs the gate FFN (the context's sparse batch limit is raised to the
window), as decode does; a prompt would run dense and hide the loss. Both the dense
reference and the gate mode use an f32 KV cache, so the difference is the FFN's alone.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import gguf
import numpy as np
from tqdm.auto import tqdm

from .. import format as F
from .ffn_view import ATTN_KINDS, FFN_KINDS
from .input_eval import patch_calibration

#: Tokens per block of the loss's standard error.
BLOCK = 64


def patch_gate_thresholds(path: str, values: Sequence[float]) -> None:
    """Overwrite the gate thresholds of the GGUF file at path in place."""
    r = gguf.GGUFReader(path, "r+")
    try:
        f = r.fields[F.KEY_SPARSE_GATE_THRESHOLD]
        if len(f.data) != len(values):
            raise ValueError(f"{path}: {len(f.data)} thresholds, {len(values)} given")
        for i, v in zip(f.data, values):
            f.parts[i][0] = np.float32(v)
        r.data.flush()
    finally:
        del r


def patch_expert_thresholds(path: str, values: Sequence) -> None:
    """Overwrite the per-expert gate thresholds (blk.N.ffn_exp_gate_thr) of the sparse-experts
    file at path in place: values[N] an array [n_expert], a scalar for every expert, or None
    (a layer without experts, left as it is)."""
    r = gguf.GGUFReader(path, "r+")
    try:
        t = {x.name: x for x in r.tensors}
        for l, v in enumerate(values):
            if v is not None:
                t[F.sparse_expert_tensor_name(F.T_FFN_EXP_GATE_THR, l)].data[:] = np.asarray(v, np.float32)
        r.data.flush()
    finally:
        del r


#: A mixture's expert tensors: a decoded token reads expert_used_count of expert_count of them.
EXPERT_KINDS = (F.T_FFN_GATE_EXPS, F.T_FFN_UP_EXPS, F.T_FFN_DOWN_EXPS, F.T_FFN_DOWN_EXPS_T)
#: ... and the tensors every token of a mixture reads whole (router, shared expert).
MOE_WHOLE_KINDS = (F.T_FFN_GATE_INP, F.T_FFN_GATE_INP_SHEXP, F.T_FFN_GATE_SHEXP, F.T_FFN_UP_SHEXP,
                   F.T_FFN_DOWN_SHEXP)


def decode_weight_bytes(path: str) -> dict:
    """Weight bytes a dense decoded token reads from the file at path, per stage: attention
    (the row-major q/k/v/o), ffn (gate, up, down or down_t; a mixture's router, shared expert
    and expert_used_count / expert_count of its experts' bytes), head (output, or the tied
    embedding)."""
    r = gguf.GGUFReader(path)
    try:
        nb = {t.name: int(t.n_bytes) for t in r.tensors}
        arch = str(r.fields[F.KEY_GENERAL_ARCHITECTURE].contents())
        used = {}
        for key in (F.KEY_EXPERT_COUNT, F.KEY_EXPERT_USED_COUNT):
            f = r.fields.get(F.arch_key(key, arch))
            used[key] = int(f.contents()) if f is not None else 0
    finally:
        del r
    share = used[F.KEY_EXPERT_USED_COUNT] / used[F.KEY_EXPERT_COUNT] if used[F.KEY_EXPERT_COUNT] else 0.0
    out = {"attention": 0, "ffn": 0}
    for name, b in nb.items():
        kind, layer, suffix = F.parse_tensor_name(name)
        if layer is None or suffix != "weight":
            continue
        if kind in ATTN_KINDS:
            out["attention"] += b
        elif kind in FFN_KINDS or kind in MOE_WHOLE_KINDS:
            out["ffn"] += b
        elif kind in EXPERT_KINDS:
            out["ffn"] += b * share
    out["head"] = nb.get(F.tensor_name(F.T_OUTPUT), nb.get(F.tensor_name(F.T_TOKEN_EMBD), 0))
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of log-probabilities (float64) of logit rows."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


class GateEvaluator:
    """Perplexity and KL divergence to dense of one evaluation file in its sparse FFN mode
    (ffn: "gate" at given thresholds, or "sparse": the file's predictors), with or without
    input sparsity at a given calibration."""

    def __init__(self, path: str, window: int, n_threads: int = 0, ffn: str = "gate",
                 patch: Callable[[str, Sequence], None] = patch_gate_thresholds):
        """patch(path, thresholds) writes a trial's gate thresholds into the file: the
        per-layer key (patch_gate_thresholds), or a mixture's per-expert tensors
        (patch_expert_thresholds)."""
        self.path, self.window, self.n_threads, self.ffn = path, int(window), n_threads, ffn
        self.patch = patch
        self._dense: dict = {}
        self._weights = decode_weight_bytes(path)

    def _logprobs(self, ids: Sequence[int], thresholds: Sequence[float] | None, dense: bool = False,
                  inputs=None) -> tuple[np.ndarray, dict]:
        """log p rows for ids[:-1] (windows of self.window) and the run's stats: the dense
        FFN, or self.ffn with the gate thresholds patched in (None: the file's) and, when
        inputs (an input_sparsity.InputCalibration) is given, input-sparse at its thresholds."""
        from ..model import Model

        if thresholds is not None:
            self.patch(self.path, thresholds)
        if inputs is not None:
            patch_calibration(self.path, inputs)
        with Model(self.path, n_ctx=self.window, n_threads=self.n_threads, cache_type="f32") as m:
            ctx = m.create_context(n_ctx=self.window, n_threads=self.n_threads, cache_type="f32",
                                   ffn="dense" if dense else self.ffn,
                                   input_sparse=(inputs is not None) if m.info.has_input_sparsity else None)
            ctx.sparse_batch = self.window
            rows = []
            for s in range(0, len(ids) - 1, self.window):
                w = list(ids[s:s + self.window + 1])
                if len(w) < 2:
                    break
                ctx.reset()
                rows.append(log_softmax(ctx.eval(w[:-1], logits_all=True)))
            st = ctx.stats()
            ctx.close()
        return np.concatenate(rows), st

    def _dense_run(self, ids: Sequence[int]) -> tuple[np.ndarray, float]:
        key = tuple(int(t) for t in ids)
        if key not in self._dense:
            self._dense[key] = (self._logprobs(ids, None, dense=True)[0], float(sum(self._weights.values())))
        return self._dense[key]

    def _decode_bytes(self, st: dict, inputs) -> dict:
        """Weight bytes a decoded token reads, per stage. The runtime counts a batch's dense
        matmul once for all its tokens (the evaluation runs windows as one batch), but the
        sparse paths (the FFN modes, input-sparse projections) per token: so the dense
        attention and head count whole, the rest as measured."""
        per = st["bytes_per_token_stage"]
        on = inputs is not None
        return {"attention": per["attention"] if on else self._weights["attention"],
                "predictor": per["predictor"], "ffn": per["ffn"],
                "head": per["head"] if on else self._weights["head"]}

    def dense(self, ids: Sequence[int]) -> np.ndarray:
        """Dense log-probs of ids (cached per token list)."""
        return self._dense_run(ids)[0]

    def measure(self, ids: Sequence[int], thresholds: Sequence[float] | None, inputs=None) -> dict:
        """ppl (sparse and dense), the ppl increase's upper bound (ppl_increase_ub), mean
        KL(dense || sparse), top-1 agreement, the FFN's density, weight bytes per token
        (bytes_per_token, per stage bytes_per_token_stage, and the dense run's
        bytes_per_token_dense), the FFN rows read per token (ffn_rows_per_token: up and
        down_t, what decode_cost splits the FFN's bytes by), whether the projections ran
        input-sparse (input_sparse) and the input densities on ids; thresholds: the gate's
        (None: the file's), inputs as for _logprobs."""
        ld, dense_bpt = self._dense_run(ids)
        lg, st = self._logprobs(ids, thresholds, inputs=inputs)
        tgt = np.asarray(ids[1:len(lg) + 1])
        idx = np.arange(len(tgt))
        loss = ld[idx, tgt] - lg[idx, tgt]  # per-token nll(sparse) - nll(dense)
        nb = len(loss) // BLOCK
        se = (float(loss[:nb * BLOCK].reshape(nb, BLOCK).mean(axis=1).std(ddof=1)) / math.sqrt(nb)
              if nb >= 2 else float(loss.std()))
        ins = st["input_sparse"]
        stage = self._decode_bytes(st, inputs)
        n = max(int(st["n_tokens"]), 1)
        return {"ppl": math.exp(-lg[idx, tgt].mean()), "ppl_dense": math.exp(-ld[idx, tgt].mean()),
                "ppl_increase_ub": math.exp(float(loss.mean()) + 2.0 * se) - 1.0,
                "kl": float((np.exp(ld) * (ld - lg)).sum(axis=1).mean()),
                "top1": float((ld.argmax(1) == lg.argmax(1)).mean()), "density": float(st["density"]),
                "bytes_per_token": float(sum(stage.values())), "bytes_per_token_stage": stage,
                "bytes_per_token_dense": dense_bpt,
                "ffn_rows_per_token": {"up": st["n_up_rows"] / n, "down": st["n_down_rows"] / n},
                "input_sparse": inputs is not None,
                "attention_input_density": float(ins["attention_density"]) if ins["attention_inputs"] else 1.0,
                "head_input_density": float(ins["head_density"]) if ins["head_inputs"] else 1.0}


def layer_costs(ev: GateEvaluator, ids: Sequence[int], n_layer: int, threshold: Callable[[int, float], float],
                grid: Sequence[float], progress: bool = True, say: Callable[[str], None] | None = None) -> np.ndarray:
    """[n_layer, len(grid)] KL to dense with only layer l sparsified at each grid level
    (threshold(l, s) gives its threshold; the other layers keep 0, i.e. every neuron)."""
    costs = np.zeros((n_layer, len(grid)))
    bar = None
    if progress:
        bar = tqdm(total=n_layer * len(grid), desc="layer sensitivity", unit="eval", dynamic_ncols=True)
    try:
        for l in range(n_layer):
            for j, s in enumerate(grid):
                thr = [0.0] * n_layer
                thr[l] = threshold(l, s)
                costs[l, j] = ev.measure(ids, thr)["kl"]
                if bar is not None:
                    bar.update(1)
            if say:
                say(f"  layer {l}: KL to dense at " + ", ".join(
                    f"{s:.0%} {c:.4f}" for s, c in zip(grid, costs[l])))
    finally:
        if bar is not None:
            bar.close()
    return costs


def search_budget(ppl_at: Callable[[float], dict], max_increase: float, hi: float,
                  resolution: float = 0.025, say: Callable[[str], None] | None = None,
                  max_kl: float | None = None) -> tuple[float, dict | None, list]:
    """The largest mean sparsity in [0, hi] whose perplexity stays within max_increase of
    dense (its upper bound ppl_increase_ub, when measured) and, with max_kl, whose mean KL to
    dense stays within max_kl, by bisection (both grow with sparsity); ppl_at(s) measures one
    level. Returns (sparsity, its measurement or None for 0, every (sparsity, measurement)
    tried)."""
    tried: list = []

    def ok(s):
        r = ppl_at(s)
        inc = r["ppl"] / r["ppl_dense"] - 1.0
        ub = r.get("ppl_increase_ub", inc)
        good = ub <= max_increase and (max_kl is None or r["kl"] <= max_kl)
        tried.append((s, r))
        if say:
            say(f"  sparsity {s:.1%}: ppl {r['ppl']:.3f} vs dense {r['ppl_dense']:.3f} ({inc:+.2%}, "
                f"bound {ub:+.2%}), KL {r['kl']:.4f}, top-1 {r['top1']:.1%}, density {r['density']:.1%}: "
                + ("within" if good else "over") + f" the {max_increase:.1%} budget"
                + ("" if max_kl is None else f" (KL bound {max_kl:g})"))
        return good, r

    good, r = ok(hi)
    if good:
        return hi, r, tried
    lo, lo_r = 0.0, None
    while hi - lo > resolution:
        mid = round((lo + hi) / 2, 4)
        good, r = ok(mid)
        if good:
            lo, lo_r = mid, r
        else:
            hi = mid
    return lo, lo_r, tried
