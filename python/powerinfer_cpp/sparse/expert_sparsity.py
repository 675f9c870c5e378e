"""Sparse experts of a mixture-of-experts model (``convert --sparse`` / ``--sparsity S`` of
a MoE model; docs/FORMAT.md "Sparse experts").

Inside each selected expert the runtime runs the FFN strategies over id lists as it runs a
dense layer's (ffn/moe.c, gh_sparse_ffn_unit): the gate strategy computes the expert's
dense gate, keeps the neurons whose |act(g)| passes the expert's threshold, and reads only
their up rows and their rows of the transposed down projection. This module makes such a
file from the converter's dense plan:

    1. write the dense GGUF to a temporary file (next to the output),
    2. profile it with the native runtime over calibration text: each layer's FFN inputs
       (profile.py; a mixture records no neuron mask),
    3. route the profiled inputs as the runtime does (route(): the file's softmax or
       DeepSeek-V3 sigmoid gating with its selection bias and groups, top-k) and, in each
       layer with experts (not glm4moe's / dots1's leading dense layers, whose FFN stays
       dense; shared experts stay dense too), per expert, over the tokens that chose it, take the threshold on |act(gate x)|
       that zeroes the share ``sparsity`` of its (token, neuron) entries (thresholds.py's
       rule per expert instead of per layer: ExpertQuantiles) on the first 80% of the
       profiled tokens; the last 20% are held out, and the sparsity measured there is reported;
       the level is ``--sparsity S``, or with ``--max-ppl-increase P`` the largest one (the
       same in every layer) whose held-out perplexity bound stays within P of dense
       (gate_eval.search_budget, as a dense gate file's), measured by the runtime on the
       held-out tokens over one evaluation file whose per-expert thresholds each trial
       patches; with ``--input-sparsity S|auto`` the attention's and head's input thresholds
       as a dense file's (input_sparsity.py, refit in the gate mode: input_eval.py), their
       level fixed or chosen with the experts' under the one budget (budget.search_levels),
    4. write ONE file: the dense tensors copied byte for byte, ffn_down_exps replaced by
       ffn_down_exps_t, and per layer blk.N.ffn_exp_gate_thr (and the input-sparse copies).

ReLU-family experts (ReGLU, dReLU: SmallThinker, TurboSparse) without ``--sparsity`` get
threshold 0: exactly their zeros (the gate mode then computes the dense result). SwiGLU
experts need ``--sparsity S`` or ``--max-ppl-increase P``. An expert that fewer than MIN_EXPERT_TOKENS calibration
tokens chose keeps no threshold (written negative: the runtime runs it dense), and so does
every expert when the level is 0 for a non-ReLU activation. Whether the thresholds pay is
decided at load per machine, as for a dense gate file (ffn/auto_mode.c: the expert's bytes
at the recorded density against the measured kernel ratios).

With ``--expert-predictors`` (ReLU-family experts only) each expert also gets a trained
predictor (train_expert_predictors: on the tokens that chose it, against its exact zeros),
blk.N.ffn_exp_fc1 / ffn_exp_fc2, for the sparse FFN mode, which then skips the expert's
dense gate too; the held-out recall is reported per layer.

With ``--sparsity-allocation greedy`` the mean level is shared by the layers as a dense
gate file's is (thresholds.greedy_allocation over each layer's experts' KL to dense alone,
gate_eval.layer_costs); inside a layer every expert takes the layer's level.

Not here yet: a level per expert, input sparsity of the experts' own inputs
(--input-ffn), a device placement of sparse experts (they run on the CPU).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from .. import format as F
from ..gguf_write import ConvertError, TensorJob, add_kv, decode_matrix, fit_rows, write_gguf
from ..gguf_read import open_gguf
from ..scratch import remove_stale, scratch_dir
from .predictor import PredictorConfig, train_layer
from .report import SparseReport, calib_source_string, resolve_calib
from .thresholds import ALLOCATION_GRID, MAX_LAYER_SPARSITY, QuantileTable, gate_magnitudes, greedy_allocation

log = logging.getLogger("powerinfer_cpp.convert")

#: An expert chosen by fewer calibration tokens than this keeps no threshold (runs dense):
#: a quantile of a handful of tokens says little about the next ones.
MIN_EXPERT_TOKENS = 16
#: Share of the profiled tokens (the last ones) held out of the calibration.
HOLDOUT = 0.2
#: The activations whose gate thresholds the runtime solves (model.c gate_cuts).
GATE_ACTS = (F.ACT_RELU, F.ACT_DRELU, F.ACT_FATRELU, F.ACT_SILU, F.ACT_GELU, F.ACT_GELU_ERF)


@dataclass(frozen=True)
class Gating:
    """A mixture's router as its file describes it (ffn/moe.c route()): softmax or sigmoid
    gating; for sigmoid, the selection bias (exp_probs_b) and the group limit (n_group groups
    of consecutive ids, the n_group_used best kept); the weights renormalised (norm) and
    scaled (scale). norm and scale change the weights only, never the choice."""
    sigmoid: bool = False
    n_group: int = 1
    n_group_used: int = 1
    norm: bool = False
    scale: float = 1.0

    @classmethod
    def from_kv(cls, kv: dict, arch: str) -> "Gating":
        """From a file's metadata {key: value}, with the runtime's defaults for absent keys."""
        def get(template, default):
            v = kv.get(F.arch_key(template, arch))
            return default if v is None else v
        ng = int(get(F.KEY_EXPERT_GROUP_COUNT, 1)) or 1
        return cls(sigmoid=int(get(F.KEY_EXPERT_GATING_FUNC, F.EXPERT_GATING_SOFTMAX)) == F.EXPERT_GATING_SIGMOID,
                   n_group=ng, n_group_used=int(get(F.KEY_EXPERT_GROUP_USED_COUNT, ng)) or ng,
                   norm=bool(get(F.KEY_EXPERT_WEIGHTS_NORM, False)),
                   scale=float(get(F.KEY_EXPERT_WEIGHTS_SCALE, 1.0)))


def route(x: np.ndarray, router: np.ndarray, k: int, router_b: np.ndarray | None = None,
          gating: Gating | None = None, probs_b: np.ndarray | None = None,
          weights: bool = False):
    """Each token's k experts [N, k] as the runtime picks them (ffn/moe.c route()), and with
    ``weights`` also their routing weights [N, k] ((sel, w)).

    Softmax gating (the default): the largest router probabilities (softmax is monotonic, so
    the order of the logits), weights the probabilities (/ their sum when gating.norm) *
    gating.scale. Sigmoid gating (DeepSeek-V3's router: glm4moe, dots1): s = sigmoid(logits),
    the choice by c = s + probs_b; with groups, a group's score is the sum of its two largest
    c and only the n_group_used best groups' experts are eligible; the k largest eligible c,
    weights the unbiased s (/ (their sum + 1e-20) when norm) * scale. Equal values go to the
    lower id (a stable sort); the runtime resolves exact ties as torch.topk does, which only
    tie-built inputs reach (real hidden states give distinct scores)."""
    g = gating or Gating()
    logits = x.astype(np.float32) @ router.T.astype(np.float32)
    if router_b is not None:
        logits = logits + router_b
    n, ne = logits.shape
    if g.sigmoid:
        s = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
        c = s + probs_b.astype(np.float32) if probs_b is not None else s.copy()
        if g.n_group > 1 and g.n_group_used < g.n_group:
            per = ne // g.n_group
            top2 = -np.sort(-c.reshape(n, g.n_group, per), axis=2)[:, :, :2]
            gs = top2[:, :, 0] + top2[:, :, 1]
            keep = np.argsort(-gs, axis=1, kind="stable")[:, :g.n_group_used]
            mask = np.zeros((n, g.n_group), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=1)
            c = np.where(np.repeat(mask, per, axis=1), c, -np.inf)
        sel = np.argsort(-c, axis=1, kind="stable")[:, :k]
        if not weights:
            return sel
        w = np.take_along_axis(s, sel, axis=1)
        if g.norm:
            w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20))
        return sel, (w * np.float32(g.scale)).astype(np.float32)
    sel = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    if not weights:
        return sel
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    w = np.take_along_axis(p, sel, axis=1)
    if g.norm:
        w = w / w.sum(axis=1, keepdims=True)
    return sel, (w * np.float32(g.scale)).astype(np.float32)


def expert_tokens(sel: np.ndarray, n_expert: int) -> list[np.ndarray]:
    """Per expert, the ascending token indices that chose it."""
    tok = np.repeat(np.arange(sel.shape[0]), sel.shape[1])
    exp = sel.reshape(-1)
    return [np.sort(tok[exp == e]) for e in range(n_expert)]


class ExpertQuantiles:
    """One layer's thresholds.QuantileTable with a row per expert, over the tokens that chose
    it: the thresholds of any level without keeping the magnitudes, so that the quality
    budget's bisection can ask for many levels."""

    def __init__(self, x: np.ndarray, sel: np.ndarray, gate_exps: np.ndarray, act: str,
                 act_threshold: float = 0.0, min_tokens: int = MIN_EXPERT_TOKENS):
        """x [N, d] the layer's FFN inputs, sel [N, k] the experts each token chose,
        gate_exps [n_expert, n_ff, d] as stored (dequantized); an expert fewer than
        min_tokens tokens chose gets no row (it keeps no threshold)."""
        self.relu = act in F.SPARSE_ACTIVATIONS
        n_expert = gate_exps.shape[0]
        toks = expert_tokens(sel, n_expert)
        self.ok = np.array([t.size >= min_tokens for t in toks], dtype=bool)
        self.table = QuantileTable(gate_magnitudes(x[toks[e]], gate_exps[e], act, act_threshold=act_threshold)
                                   for e in np.flatnonzero(self.ok)) if self.ok.any() else None

    def thresholds(self, sparsity: float | None) -> np.ndarray:
        """Each expert's threshold [n_expert] float32 at a level: sparsity None or 0 gives 0
        for a ReLU-family activation (exactly its zeros) and -1 (none: dense) otherwise; an
        expert without a row: -1."""
        if not sparsity:
            return np.full(len(self.ok), 0.0 if self.relu else -1.0, dtype=np.float32)
        out = np.full(len(self.ok), -1.0, dtype=np.float32)
        if self.table is not None:
            out[self.ok] = self.table.thresholds([sparsity] * self.table.n_layer)
        return out


def calibrate_experts(x: np.ndarray, sel: np.ndarray, gate_exps: np.ndarray, act: str,
                      sparsity: float | None, act_threshold: float = 0.0,
                      min_tokens: int = MIN_EXPERT_TOKENS) -> np.ndarray:
    """Each expert's gate threshold [n_expert] float32 for one layer at one level
    (ExpertQuantiles' arguments and thresholds())."""
    return ExpertQuantiles(x, sel, gate_exps, act, act_threshold, min_tokens).thresholds(sparsity)


def measure_sparsity(x: np.ndarray, sel: np.ndarray, gate_exps: np.ndarray, act: str,
                     thr: np.ndarray, act_threshold: float = 0.0) -> tuple[float, int]:
    """(share of the (token, selected expert, neuron) entries whose |act(gate x)| is at or
    below the expert's threshold, those entries' count) over tokens x [N, d] routed as sel;
    an expert without a threshold counts as dense (all its entries active)."""
    toks = expert_tokens(sel, gate_exps.shape[0])
    zero = total = 0
    for e, t in enumerate(toks):
        if t.size == 0:
            continue
        n = t.size * gate_exps.shape[1]
        total += n
        if thr[e] >= 0:
            zero += int((gate_magnitudes(x[t], gate_exps[e], act, act_threshold=act_threshold) <= thr[e]).sum())
    return (zero / total if total else 0.0), total


def train_expert_predictors(x: np.ndarray, sel: np.ndarray, gate_exps: np.ndarray, act: str,
                            cfg, act_threshold: float = 0.0, min_tokens: int = MIN_EXPERT_TOKENS,
                            log: Callable[[str], None] | None = None):
    """One layer's predictors, one per expert, for ReLU-family experts: (w1 [n_expert, h, d],
    w2 [n_expert, n_ff, h] float32, held-out (recall, predicted density, true density)).

    Each expert's predictor is trained (predictor.train_layer, from the low-rank approximation
    of the expert's own gate) on the tokens that chose it, x[tokens] against the neurons its
    gate leaves nonzero (|act(gate x)| > 0: what the gate and oracle modes keep); the last
    ``cfg.holdout`` share of those tokens (the later text) is held out for the recall. The
    layer's h is its largest expert's: a smaller one is padded with zero units (relu(0) = 0
    adds nothing to a score). An expert chosen by fewer than ``min_tokens`` tokens gets the
    zero predictor: every score 0, so at a threshold <= 0 all its neurons run (dense: exact).
    Recall and densities pool the experts' held-out (token, neuron) entries."""
    n_expert, n_ff, d = gate_exps.shape
    toks = expert_tokens(sel, n_expert)
    preds = []
    tp = pos = pred_on = total = 0.0
    for e in range(n_expert):
        if toks[e].size < min_tokens:
            preds.append(None)
            continue
        xe = x[toks[e]].astype(np.float32)
        mask = gate_magnitudes(xe, gate_exps[e], act, act_threshold=act_threshold) > 0.0
        p = train_layer(xe, mask, cfg, layer=e, gate=gate_exps[e].astype(np.float32), log=log)
        preds.append(p)
        n_held = p.n_heldout
        tp += p.recall * p.true_density * n_held * n_ff
        pos += p.true_density * n_held * n_ff
        pred_on += p.pred_density * n_held * n_ff
        total += n_held * n_ff
    h = max([p.h for p in preds if p is not None], default=1)
    w1 = np.zeros((n_expert, h, d), dtype=np.float32)
    w2 = np.zeros((n_expert, n_ff, h), dtype=np.float32)
    for e, p in enumerate(preds):
        if p is not None:
            w1[e, :p.h] = p.w1
            w2[e, :, :p.h] = p.w2
    held = (tp / pos if pos else 1.0, pred_on / total if total else 1.0, pos / total if total else 0.0)
    return w1, w2, held


def _layer_weights(dense_t: dict, il: int, n_expert: int, n_ff: int, d: int):
    """Layer il's router [n_expert, d], its bias and its selection bias (exp_probs_b; None
    where absent) and gate_exps [n_expert, n_ff, d], as the runtime reads them (decoded from
    the dense file)."""
    def vec(name):
        t = dense_t.get(name)
        return None if t is None else decode_matrix(np.asarray(t.data), t.tensor_type, (n_expert,))
    r = dense_t[F.tensor_name(F.T_FFN_GATE_INP, il)]
    router = decode_matrix(np.asarray(r.data), r.tensor_type, (n_expert, d))
    router_b = vec(F.tensor_name(F.T_FFN_GATE_INP, il, "bias"))
    probs_b = vec(F.tensor_name(F.T_FFN_EXP_PROBS_B, il, "bias"))
    g = dense_t[F.tensor_name(F.T_FFN_GATE_EXPS, il)]
    gate = decode_matrix(np.asarray(g.data), g.tensor_type, (n_expert * n_ff, d)).reshape(n_expert, n_ff, d)
    return router, router_b, probs_b, gate


def _route_layer(dense_t: dict, il: int, dense, gating: Gating, x: np.ndarray):
    """(selections [N, k], gate_exps) of layer il's experts for its FFN inputs x."""
    router, router_b, probs_b, gate = _layer_weights(dense_t, il, dense.n_expert, dense.n_ff_exp, dense.n_embd)
    return route(x, router, dense.n_expert_used, router_b, gating, probs_b), gate


def _raw_job(name, shape, qtype, data):
    return TensorJob(name, tuple(int(s) for s in shape), qtype, lambda a=data: a, raw=True)


@dataclass
class _Levels:
    """What the levels' stage measures with: the per-layer quantile tables, the evaluation
    file (gate_eval.GateEvaluator over the sparse-experts file, its thresholds patched per
    trial), the held-out ids and the input calibrations per level."""
    tables: list                     # per layer ExpertQuantiles (None: a dense layer)
    fixed: float                     # the FFN's level without a budget (--sparsity S, or 0)
    allocate: Callable | None = None  # mean level -> per layer with experts (None: uniform)
    ev: object = None
    held_ids: list | None = None
    cals: dict | None = None
    prof: object = None
    opts: object = None
    say: Callable = print
    progress: bool = False

    @property
    def moe_layers(self) -> list:
        return [l for l, t in enumerate(self.tables) if t is not None]

    def levels(self, g: float | None) -> list:
        """Per layer the experts' level at mean level g (None: the fixed level; None for a
        layer without experts)."""
        mean = self.fixed if g is None else g
        each = self.allocate(mean) if self.allocate is not None and mean else [mean] * len(self.moe_layers)
        out = [None] * len(self.tables)
        for l, s in zip(self.moe_layers, each):
            out[l] = float(s)
        return out

    def thresholds(self, g: float | None) -> list:
        """Per layer the experts' thresholds at mean level g (None: the fixed level)."""
        return [None if t is None else t.thresholds(s) for t, s in zip(self.tables, self.levels(g))]

    def greedy(self, ids: list, progress: bool, say) -> np.ndarray:
        """The greedy allocation (thresholds.greedy_allocation) over the layers with experts,
        from each one's KL to dense alone at the ALLOCATION_GRID levels (gate_eval.layer_costs,
        the other layers' experts at threshold 0); sets self.allocate, returns the costs."""
        from .gate_eval import layer_costs

        moe, n = self.moe_layers, len(self.tables)
        ev = self.ev

        class _Layers:  # layer_costs' evaluator over the layers with experts only
            def measure(self, ids_, thr):
                full = [None] * n
                for l, v in zip(moe, thr):
                    full[l] = v
                return ev.measure(ids_, full)

        costs = layer_costs(_Layers(), ids, len(moe), lambda j, s: self.tables[moe[j]].thresholds(s),
                            ALLOCATION_GRID, progress, say)
        self.allocate = lambda mean: greedy_allocation(costs, mean)
        return costs

    def measure(self, g, cal) -> dict:
        return self.ev.measure(self.held_ids, self.thresholds(g), inputs=cal)

    def make_inputs(self, level: float, g):
        """The input calibration at level, refit (when asked) in the gate mode at level g."""
        from .gate_eval import patch_expert_thresholds
        from .input_eval import refit, refit_tokens

        cal, opts = self.cals[level], self.opts
        if opts.input_refit and level > 0:
            patch_expert_thresholds(self.ev.path, self.thresholds(g))
            ids = refit_tokens(self.prof.input_ids, cal.n_fit, self.prof.n_ctx, opts.input_refit_tokens)
            refit(self.ev.path, cal, ids, self.prof.n_ctx, opts.n_threads, say=self.say, progress=self.progress)
        return cal


def convert_sparse_experts(dense, out_path: str, opts, progress: bool = True,
                           say: Callable[[str], None] | None = None):
    """The sparse-experts file of a mixture-of-experts model (see the module's doc); returns
    (output path, SparseReport)."""
    from .budget import over_budget, search_levels
    from .gate_eval import GateEvaluator, patch_expert_thresholds, search_budget
    from .input_sparsity import InputSources, calibrate_input_levels, input_kv
    from .input_eval import refit_summary
    from .pipeline import DEFAULT_MAX_PPL_INCREASE, _kl_bound

    say = say or (lambda s: log.info("%s", s))
    act, sparsity, budget = dense.activation, opts.sparsity, opts.max_ppl_increase
    relu = act in F.SPARSE_ACTIVATIONS
    in_req, in_auto = opts.input_sparsity is not None, opts.input_sparsity == "auto"
    refuse = [(opts.vram_budget, "a VRAM budget (attention and the routers are placed at load; the "
                                 "experts' hot neurons by `python -m powerinfer_cpp.place --profile` "
                                 "on the converted file)"),
              (opts.expert_predictors and (not relu or sparsity or budget),
               f"--expert-predictors with {act} experts{' and a gate level' if sparsity or budget else ''} "
               "(predictors are trained for ReLU-family experts' exact zeros: --sparse without --sparsity or "
               "--max-ppl-increase)"),
              (opts.expert_predictors and in_req, "--input-sparsity with --expert-predictors"),
              (opts.input_ffn, "--input-ffn (input sparsity of the experts' own inputs; --input-sparsity "
                               "covers the attention and the head)"),
              (opts.allocation == "greedy" and not (sparsity or budget),
               "--sparsity-allocation greedy without a level (--sparsity S or --max-ppl-increase P)")]
    for bad, what in refuse:
        if bad:
            raise ConvertError(f"sparse experts (a mixture-of-experts model, {dense.n_expert} experts) "
                               f"do not take {what} yet")
    if act not in GATE_ACTS:
        raise ConvertError(f"sparse experts need a gate threshold on the experts' activation, and {act!r} "
                           f"has none here (supported: {', '.join(GATE_ACTS)}); convert it densely")
    if sparsity is None and budget is None and not relu:
        raise ConvertError(f"a mixture of {act} experts has no exact zeros: pass --sparsity S (the share of "
                           "each expert's neurons its gate threshold skips) or --max-ppl-increase P (the "
                           "largest level within P of dense perplexity on held-out text), or convert it densely")
    # the budget input sparsity is measured against: the gate's, shared; with a fixed FFN
    # (exact zeros, or --sparsity S with a fixed input level) only "auto" has one, the default's
    in_budget = budget if budget is not None else (DEFAULT_MAX_PPL_INCREASE if in_auto else None)
    calib = resolve_calib(dense.hf_dir, opts.calib)
    with open(calib, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ConvertError(f"calibration text {calib} is empty")
    rep = SparseReport(calib_source=calib_source_string(calib))
    n_layer, d, ne, ff = dense.n_layer, dense.n_embd, dense.n_expert, dense.n_ff_exp
    out_dir = os.path.dirname(os.path.abspath(out_path))
    remove_stale(out_dir)
    tmpdir = scratch_dir(os.path.join(out_dir, os.path.basename(out_path)))
    try:
        t0 = time.perf_counter()
        dense_path = os.path.join(tmpdir, "dense.gguf")
        write_gguf(dense_path, lambda w: add_kv(w, dense.kv), dense.jobs, progress, arch=dense.arch)
        say(f"[1/4] dense GGUF written ({dense.outtype}, {len(dense.jobs)} tensors, "
            f"{time.perf_counter() - t0:.1f} s)")

        t0 = time.perf_counter()
        from .profile import profile_model
        prof = profile_model(dense_path, text, n_ctx=opts.profile_ctx, n_threads=opts.n_threads,
                             max_tokens=opts.calib_tokens, progress=progress,
                             inputs=opts.input_tokens if in_req else 0,
                             # under a budget the input thresholds never see its held-out tokens
                             inputs_span=1.0 - HOLDOUT if in_budget is not None else 1.0)
        n = prof.n_tokens
        if n < 16:
            raise ConvertError(f"calibration text {calib} gave only {n} tokens; need at least 16")
        rep.n_calib_tokens = n
        n_fit = n - max(1, int(round(n * HOLDOUT)))
        rep.n_gate_fit = n_fit
        if in_budget is not None and n - n_fit < 16:
            raise ConvertError(f"the quality budget needs at least 16 held-out tokens (the last {HOLDOUT:.0%} "
                               f"of the profile); {n} tokens were profiled: give a longer --calib text or a "
                               "larger --calib-tokens")
        say(f"[2/4] profile: {n} tokens ({time.perf_counter() - t0:.1f} s)")
        in_src, in_levels, cals = None, [], {}
        if in_req:
            t1 = time.perf_counter()
            in_src = InputSources(dense.jobs, n_layer, dense.n_ff)
            in_levels = sorted({float(v) for v in opts.input_grid}) if in_auto else [float(opts.input_sparsity)]
            cals = dict(zip([0.0] + in_levels, calibrate_input_levels(prof, [0.0] + in_levels,
                                                                      opts.input_criterion, in_src.weight_t)))
            say(f"[2/4] input thresholds ({time.perf_counter() - t1:.1f} s, on dense-mode inputs): "
                + "; ".join(cals[v].summary() for v in in_levels))

        t0 = time.perf_counter()
        reader = open_gguf(dense_path)
        dense_t = {t.name: t for t in reader.tensors}
        # the router as the file says (softmax, or DeepSeek-V3's sigmoid with its selection
        # bias and groups), and the leading dense layers (glm4moe, dots1): no experts there,
        # their FFN stays dense (None in the report's per-layer lists)
        kv = {e[0]: e[1] for e in dense.kv}
        gating = Gating.from_kv(kv, dense.arch)
        lead = int(kv.get(F.arch_key(F.KEY_LEADING_DENSE_BLOCK_COUNT, dense.arch)) or 0)
        moe_layers = range(lead, n_layer)
        tables = [None] * n_layer
        for il in moe_layers:
            x = prof.x[il]
            sel, gate = _route_layer(dense_t, il, dense, gating, x)
            tables[il] = ExpertQuantiles(x[:n_fit], sel[:n_fit], gate, act, dense.act_threshold or 0.0)
        lv = _Levels(tables, float(sparsity or 0.0), cals=cals, prof=prof, opts=opts, say=say, progress=progress)
        preds = [None] * n_layer
        if opts.expert_predictors:
            t1 = time.perf_counter()
            cfg = opts.predictor or PredictorConfig(recall_target=opts.predictor_recall,
                                                    threshold=opts.threshold, h_start=8)
            for il in moe_layers:
                x = prof.x[il]
                sel, gate = _route_layer(dense_t, il, dense, gating, x)
                preds[il] = train_expert_predictors(x, sel, gate, act, cfg, dense.act_threshold or 0.0)
            rep.expert_predictor_recall = [p and p[2] for p in preds]
            say("      expert predictors: held-out recall / predicted density / true density per layer "
                + ", ".join(f"{p[2][0]:.3f}/{p[2][1]:.3f}/{p[2][2]:.3f}" for p in preds if p)
                + f"; h per layer {[int(p[0].shape[1]) for p in preds if p]} "
                f"({time.perf_counter() - t1:.1f} s)")

        def write(path, thr_all, cal, keys, show):
            """The sparse file: ffn_down_exps -> ffn_down_exps_t (the same values, each
            expert's matrix transposed, in the down's type refitted to rows of d), + the
            thresholds (+ the predictors; + the input-sparse copies of cal)."""
            new_jobs = []
            for j in dense.jobs:
                kind, il, suffix = F.parse_tensor_name(j.name)
                if kind == F.T_FFN_DOWN_EXPS and suffix == "weight":
                    qt, _ = fit_rows(j.qtype, d)

                    def load_t(j=j):
                        return np.ascontiguousarray(np.asarray(j.load(), dtype=np.float32).transpose(0, 2, 1))

                    new_jobs.append(TensorJob(F.sparse_expert_tensor_name(F.T_FFN_DOWN_EXPS_T, il), (ne, ff, d),
                                              qt, load_t))
                    new_jobs.append(TensorJob(F.sparse_expert_tensor_name(F.T_FFN_EXP_GATE_THR, il), (ne,), Q.F32,
                                              lambda a=thr_all[il]: a))
                    if preds[il] is not None:
                        w1, w2, _ = preds[il]
                        new_jobs.append(TensorJob(F.sparse_expert_tensor_name(F.T_FFN_EXP_FC1, il), w1.shape,
                                                  Q.F32, lambda a=w1: a))
                        new_jobs.append(TensorJob(F.sparse_expert_tensor_name(F.T_FFN_EXP_FC2, il), w2.shape,
                                                  Q.F32, lambda a=w2: a))
                else:
                    rt = dense_t[j.name]
                    new_jobs.append(_raw_job(j.name, j.shape, j.qtype, rt.data))
                if cal is not None and kind == F.T_ATTN_OUTPUT and suffix == "weight":
                    new_jobs += in_src.layer_jobs(cal, il)
            if cal is not None:
                new_jobs += in_src.head_jobs(cal)

            def setup(w):
                add_kv(w, dense.kv)
                for k, v, ty in keys + (input_kv(cal) if cal is not None else []):
                    w.add_key_value(k, v, ty)
                w.add_key_value(F.KEY_SPARSE_CALIB_SOURCE, rep.calib_source, V.STRING)
                w.add_key_value(F.KEY_SPARSE_CALIB_TOKENS, int(n), V.UINT32)
                if opts.expert_predictors and opts.threshold:
                    w.add_key_value(F.KEY_SPARSE_THRESHOLD, float(opts.threshold), V.FLOAT32)

            return write_gguf(path, setup, new_jobs, show, arch=dense.arch)

        # [3] the levels: the experts' (fixed, or the largest within the budget) and the
        # input level (fixed, or searched with the experts' under the shared budget: budget.py),
        # measured by the runtime on one evaluation file whose thresholds each trial patches
        greedy = opts.allocation == "greedy"
        if budget is not None or greedy or (in_req and (in_auto or in_budget is not None
                                                        or (opts.input_refit and in_levels[0] > 0))):
            eval_path = write(os.path.join(tmpdir, "eval.gguf"), lv.thresholds(0.0), cals.get(0.0), [], False)
            lv.ev = GateEvaluator(eval_path, prof.n_ctx, opts.n_threads, ffn="gate", patch=patch_expert_thresholds)
            lv.held_ids = [int(t) for t in prof.tokens[n_fit:n_fit + opts.budget_tokens]]
        if greedy:
            ids = [int(t) for t in prof.tokens[:min(n_fit if in_budget is not None else n, opts.greedy_tokens)]]
            say(f"[3/4] greedy allocation: KL to dense of each layer's experts alone at {ALLOCATION_GRID[0]:.0%}.."
                f"{ALLOCATION_GRID[-1]:.0%} on {len(ids)} calibration tokens "
                f"({len(lv.moe_layers) * len(ALLOCATION_GRID)} runs)")
            rep.gate_costs = lv.greedy(ids, progress, say)
        mean, cal = lv.fixed, None
        joint = in_req and in_budget is not None and (in_auto or in_levels[0] > 0)
        max_kl = _kl_bound(opts, in_budget) if in_budget is not None else None
        if joint:
            say(f"[3/4] quality budget {in_budget:.1%} " + ("shared by the experts' gate thresholds and "
                                                          if budget is not None else "(the experts' level fixed) for ")
                + f"input sparsity at {', '.join(f'{v:.0%}' for v in in_levels)}"
                + (" (or off)" if in_auto else "") + f", on {len(lv.held_ids)} held-out tokens")
            best, rep.input_tried = search_levels(lv.measure, lv.make_inputs, in_budget, in_levels,
                                                  MAX_LAYER_SPARSITY if budget is not None else None,
                                                  include_off=in_auto, say=say, max_kl=max_kl)
            mean = lv.fixed if best.gate is None else best.gate
            cal, rep.budget_result = best.cal, best.result
            r = best.result
            if cal is not None and in_auto:
                cal.max_ppl_increase, cal.ppl_increase = in_budget, r["ppl"] / r["ppl_dense"] - 1.0
            if over_budget(r, in_budget, max_kl):
                log.warning("over the %.1f%% quality budget: input sparsity %.0f%% alone (kept: it was asked for)",
                            100 * in_budget, 100 * best.inputs)
        elif budget is not None:
            say(f"[3/4] quality budget: the largest experts' sparsity within {budget:.1%} of dense perplexity "
                f"on {len(lv.held_ids)} held-out tokens (calibration on the first {n_fit})")
            mean, rep.budget_result, rep.budget_tried = search_budget(lambda g: lv.measure(g, None), budget,
                                                                      MAX_LAYER_SPARSITY, say=say, max_kl=max_kl)
        if in_req and not joint:
            cal = lv.make_inputs(in_levels[0], mean)
        rep.input_calibration = cal
        r = rep.budget_result
        if r is not None:
            say(f"[3/4] chosen: experts' sparsity {mean:.1%}" + (f", input sparsity {cal.sparsity:.0%}" if cal else "")
                + f": held-out ppl {r['ppl']:.3f} vs dense {r['ppl_dense']:.3f} "
                f"({r['ppl'] / r['ppl_dense'] - 1:+.2%}, bound {r['ppl_increase_ub']:+.2%}), KL {r['kl']:.4f}, "
                f"{r['bytes_per_token'] / 1e6:.3f} of {r['bytes_per_token_dense'] / 1e6:.3f} MB/token")
        elif budget is not None:
            say("[3/4] no experts' level above 0 kept the budget: the experts run dense")
        if cal is not None and cal.sparse_mode:
            say(f"[3/4] input thresholds, {refit_summary(cal)}")

        thr_all, held = lv.thresholds(mean), [None] * n_layer
        for il in moe_layers:
            x = prof.x[il]
            sel, gate = _route_layer(dense_t, il, dense, gating, x)
            held[il], _ = measure_sparsity(x[n_fit:], sel[n_fit:], gate, act, thr_all[il], dense.act_threshold or 0.0)
        rep.gate_thresholds = thr_all
        rep.gate_sparsity = mean
        rep.gate_layer_sparsity = lv.levels(mean)
        rep.gate_allocation = opts.allocation
        rep.expert_holdout_sparsity = held
        kept = sum(int((thr_all[il] >= 0).sum()) for il in moe_layers)
        what = f"sparsity {mean:g}" if mean else ("exact zeros" if relu else "level 0: every expert dense")
        say(f"[3/4] expert gate thresholds ({what}"
            + (f", per layer {', '.join(f'{s:.0%}' for s in rep.gate_layer_sparsity if s is not None)}"
               if greedy and mean else "") + "): "
            f"{kept} of {len(moe_layers) * ne} experts keep one; held-out sparsity per layer "
            f"{', '.join('dense' if v is None else f'{v:.3f}' for v in held)} ({time.perf_counter() - t0:.1f} s)")

        keys = []
        if mean:
            keys.append((F.KEY_SPARSE_TARGET, float(mean), V.FLOAT32))
        if budget is not None:
            keys.append((F.KEY_SPARSE_MAX_PPL_INCREASE, float(budget), V.FLOAT32))
            keys.append((F.KEY_SPARSE_PPL_INCREASE, float(r["ppl"] / r["ppl_dense"] - 1.0) if r else 0.0,
                         V.FLOAT32))
        t0 = time.perf_counter()
        path = write(out_path, thr_all, cal, keys, progress)
        say(f"[4/4] wrote {path} ({time.perf_counter() - t0:.1f} s)")
        lv.ev = None
        del reader
        return path, rep
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def profile_expert_neurons(path, text, *, n_ctx: int = 128, max_tokens: int | None = None,
                           n_threads: int = 0):
    """What the placement of hot neurons of experts (experts.solve_expert_neurons) needs from
    a sparse-experts file (ffn_down_exps_t) profiled over ``text`` (a string, or token ids):
    (freq [n_layer, n_expert]: each expert's selection share; nfreq [n_layer, n_expert,
    n_ff_exp]: each neuron's activity share among the tokens that chose its expert, at the
    file's gate thresholds (its up row read); dfreq, the same shape: the share whose
    activation is nonzero (its down_t row read); row_bytes [n_layer] of one neuron's (gate,
    up, down_t) bytes).
    The FFN inputs are the runtime's (the dense profile pass), routed as the runtime routes
    them (route()); leading dense layers (no experts) get zeros."""
    from ..place import read_fields
    from .experts import expert_neuron_freq
    from .profile import profile_model

    reader = open_gguf(str(path))
    kv = read_fields(reader)
    arch = kv.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)
    n_layer = int(kv[F.arch_key(F.KEY_BLOCK_COUNT, arch)])
    ne = int(kv[F.arch_key(F.KEY_EXPERT_COUNT, arch)])
    k = int(kv[F.arch_key(F.KEY_EXPERT_USED_COUNT, arch)])
    d = int(kv[F.arch_key(F.KEY_EMBEDDING_LENGTH, arch)])
    ff = int(kv[F.arch_key(F.KEY_EXPERT_FEED_FORWARD_LENGTH, arch)])
    t = {x.name: x for x in reader.tensors}
    if F.sparse_expert_tensor_name(F.T_FFN_DOWN_EXPS_T, n_layer - 1) not in t:
        raise ValueError(f"{path} has no sparse experts (ffn_down_exps_t): hot neurons of experts "
                         "need the sparse form (convert --sparse)")
    gating = Gating.from_kv(kv, arch)
    prof = profile_model(str(path), text, n_ctx=n_ctx, max_tokens=max_tokens, progress=False,
                         n_threads=n_threads)
    act = prof.ffn_act
    if act == F.ACT_FATRELU:
        raise ValueError("hot neurons of FATReLU experts are not profiled here (no such mixture yet)")
    freq = np.zeros((n_layer, ne))
    nfreq = np.zeros((n_layer, ne, ff))
    dfreq = np.zeros((n_layer, ne, ff))
    row_bytes = [(0, 0, 0)] * n_layer
    for il in range(n_layer):
        name = F.tensor_name(F.T_FFN_GATE_INP, il)
        if name not in t:
            continue  # a leading dense layer
        router, router_b, probs_b, gate = _layer_weights(t, il, ne, ff, d)
        x = prof.x[il]
        sel = route(x, router, k, router_b, gating, probs_b)
        thr_t = t.get(F.sparse_expert_tensor_name(F.T_FFN_EXP_GATE_THR, il))
        thr = None if thr_t is None else np.asarray(thr_t.data, dtype=np.float32).reshape(ne)
        freq[il] = np.bincount(sel.reshape(-1), minlength=ne)[:ne] / max(1, x.shape[0])
        u = t[F.tensor_name(F.T_FFN_UP_EXPS, il)]
        up = decode_matrix(np.asarray(u.data), u.tensor_type, (ne * ff, d)).reshape(ne, ff, d)
        nfreq[il], dfreq[il] = expert_neuron_freq(x, sel, gate, act, thr, up_exps=up)
        rb = [int(t[F.tensor_name(kind, il)].n_bytes) // (ne * ff)
              for kind in (F.T_FFN_GATE_EXPS, F.T_FFN_UP_EXPS)]
        rb.append(int(t[F.sparse_expert_tensor_name(F.T_FFN_DOWN_EXPS_T, il)].n_bytes) // (ne * ff))
        row_bytes[il] = tuple(rb)
    return freq, nfreq, dfreq, row_bytes
