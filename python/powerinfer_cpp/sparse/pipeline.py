"""The sparse conversion pipeline (``python -m powerinfer_cpp.convert --sparse``).

It starts from the converter's plan of the dense file (``DenseModel``: metadata and
tensor jobs) and knows no architecture: an FFN is gated or ungated (OPT and Falcon), with or
without biases, and its projections are read through ffn_view.py, which alone knows which
layouts fuse (phi3's gate/up in one ffn_up, fused q/k/v).

    1. write the dense GGUF to a temporary file (next to the output),
    2. profile it with the native runtime over calibration text (profile.py),
    3. train a predictor per layer (predictor.py), or (gate mode, any gated FFN)
       calibrate the gate thresholds (thresholds.py) to a sparsity or to a quality
       budget measured by the runtime on the held-out part of the profile (gate_eval.py);
       input sparsity's thresholds (input_sparsity.py) refit in the sparse mode
       (input_eval.py), their level fixed or chosen with the gate's by the budget (budget.py),
    4. solve the GPU placement for the VRAM budget (placement.py),
    5. write ONE extended GGUF: the dense tensors (copied byte for byte from the
       profiled file) with ffn_down replaced by ffn_down_t, plus per layer the
       predictor, the neuron frequencies and the GPU index, plus the
       powerinfer.sparse.* / powerinfer.gpu.* keys (docs/FORMAT.md).

The output is written atomically (temp file + rename); the temporary dense
file is removed whatever happens.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from tqdm.auto import tqdm

from .. import format as F
from ..gguf_write import (ConvertError, TensorJob, add_kv, decode_matrix, encode_matrix, storage_type,
                          write_gguf)
from ..gguf_read import open_gguf
from ..scratch import remove_stale, scratch_dir
from .placement import (Placement, format_size, make_problem, model_costs, solve_placement,
                        tensor_nbytes)
from .report import HELDOUT_FILE, SparseReport, calib_source_string, resolve_calib  # noqa: F401 (HELDOUT_FILE: the tools')
from .predictor import LayerPredictor, PredictorConfig, evaluate, format_report, train_predictors
from .gate_eval import GateEvaluator, layer_costs, patch_gate_thresholds, search_budget
from .expert_sparsity import convert_sparse_experts
from .input_eval import DEFAULT_REFIT_TOKENS, refit, refit_summary, refit_tokens
from .input_sparsity import (DEFAULT_INPUT_CRITERION, DEFAULT_INPUT_TOKENS, InputSources, calibrate_input_levels,
                             input_kv)
from .budget import INPUT_GRID, describe_time, over_budget, search_levels
from .decode_cost import DecodeCost
from .ffn_view import FFNView, ffn_view
from .thresholds import (ALLOCATIONS, ALLOCATION_GRID, MAX_LAYER_SPARSITY, QuantileTable, gate_magnitudes,
                         greedy_allocation, uniform_allocation)

log = logging.getLogger("powerinfer_cpp.convert")

#: The quality budget a gated non-ReLU model (SwiGLU, GeGLU) is calibrated to by default:
#: the largest sparsity whose held-out perplexity stays within 2% of dense.
DEFAULT_MAX_PPL_INCREASE = 0.02
#: Share of the profiled tokens (the last ones) held out of the calibration, on which the
#: quality budget is measured: as the predictors' held-out share (PredictorConfig.holdout).
GATE_HOLDOUT = 0.2
#: Largest mean sparsity the quality budget tries.
BUDGET_MAX_SPARSITY = MAX_LAYER_SPARSITY


@dataclass
class DenseModel:
    """The dense file the sparse pipeline starts from, as the converter planned it."""
    arch: str                 # general.architecture
    kv: list                  # its metadata entries (gguf_write.KV)
    jobs: list                # its tensors (gguf_write.TensorJob), in file order
    outtype: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_embd_kv: int            # K (= V) width per token: the KV cache the budget reserves
    n_ctx: int
    activation: str           # format.ACTIVATIONS
    gated: bool               # the FFN has ffn_gate
    hf_dir: str = ""          # the model folder (its heldout.txt is the default calibration text)
    act_threshold: float | None = None  # fatrelu's t
    path: str = ""            # a GGUF input (convert/from_gguf.py): profiled and copied as is,
                              # no dense file is written; jobs then hold its raw tensors
    down_types: list | None = None  # per layer ffn_down_t's type (None: storage_type's rule)
    n_expert: int = 0         # a mixture of experts (expert_sparsity.py): experts per layer,
    n_expert_used: int = 0    # chosen per token,
    n_ff_exp: int = 0         # and their width


def _kl_bound(opts, budget: float) -> float | None:
    """The KL bound of a quality budget: opts.max_kl, or the budget's own value (None: off
    for inf)."""
    k = budget if opts.max_kl is None else opts.max_kl
    return None if math.isinf(k) else float(k)


@dataclass
class SparseOptions:
    calib: str | None = None          # calibration text file; None: HF_DIR/heldout.txt
    calib_tokens: int = 16384         # tokens profiled (the first ones of the text)
    predictor_recall: float = 0.99    # recall target on held-out tokens
    threshold: float = 0.0            # global predictor threshold (score >= threshold: active)
    vram_budget: int = 0              # bytes; 0 = CPU only
    ctx: int | None = None            # KV cache reserved in the budget; None: the model's context length
    group_size: int = 64
    min_layer_share: float = 0.05
    ilp_time_limit: float = 10.0
    placement: str = "ilp"            # "ilp" | "greedy"
    profile_ctx: int = 512            # window length of the profiling runs
    n_threads: int = 0
    predictor: PredictorConfig | None = None
    predictor_type: str | None = None  # storage of fc1/fc2: f32|f16|q8_0|q4_0; None: predictor_qtype's rule
    gate_init: bool = True            # ReGLU: try the gate's low-rank approximation first (predictor.train_layer)
    expert_predictors: bool = False   # ReLU-family experts: train a predictor per expert as well
                                      # (expert_sparsity.train_expert_predictors)
    sparsity: float | None = None     # gate-magnitude sparsity instead of predictors: the share of
                                      # neurons the calibrated thresholds zero (thresholds.py)
    max_kl: float | None = None       # the quality budget's bound on the mean KL to dense (nats) beside
                                      # the perplexity's; None: the budget's own value (0.02 at P = 0.02)
    max_ppl_increase: float | None = None  # gate mode calibrated to a quality budget: the largest
                                      # sparsity whose held-out ppl is within this share of dense;
                                      # None with sparsity None: DEFAULT_MAX_PPL_INCREASE for a gated
                                      # non-ReLU FFN, predictors for a ReLU one
    allocation: str = "uniform"       # gate mode: how the mean sparsity is shared by the layers
                                      # (thresholds.ALLOCATIONS)
    budget_tokens: int = 2048         # held-out tokens the budget's perplexities are measured on
    greedy_tokens: int = 512          # calibration tokens of the greedy allocation's KL measurements
    keep_predictors: bool = False     # keep the trained weights in the report (tests)
    keep_calibration: bool = False    # gate mode: keep the quantile table in the report
                                      # (tools/eval_sparsity.py reuses one calibration)
    input_sparsity: float | str | None = None  # input-sparse attention and head (input_sparsity.py):
                                      # the share of each projection's inputs to skip; "auto": the
                                      # level chosen by the quality budget with the FFN's (budget.py);
                                      # None: off
    input_criterion: str = DEFAULT_INPUT_CRITERION  # magnitude | wina (format.INPUT_CRITERIA)
    input_tokens: int = DEFAULT_INPUT_TOKENS  # profiled tokens whose projection inputs calibrate
    input_refit: bool = True          # refit the thresholds on the sparse mode's inputs (input_eval.py)
    input_refit_tokens: int = DEFAULT_REFIT_TOKENS  # fit tokens the refit's runs cover
    input_grid: tuple = INPUT_GRID    # "auto": the input levels tried
    input_ffn: bool = False           # the FFN's inputs too (gate and up's, down's; gate mode only)

    def __post_init__(self):
        checks = [
            (self.calib_tokens >= 2, f"calib_tokens must be >= 2, got {self.calib_tokens}"),
            (0 < self.predictor_recall <= 1, f"predictor_recall must be in (0, 1], got {self.predictor_recall}"),
            (0 <= self.vram_budget < 2**63, f"vram_budget must be in [0, 2^63) bytes, got {self.vram_budget}"),
            (self.ctx is None or 1 <= self.ctx < 2**31, f"ctx must be a positive context length, got {self.ctx}"),
            (self.group_size >= 1, f"group_size must be >= 1, got {self.group_size}"),
            (0 <= self.min_layer_share <= 1, f"min_layer_share must be in [0, 1], got {self.min_layer_share}"),
            (self.ilp_time_limit > 0, f"ilp_time_limit must be > 0 seconds, got {self.ilp_time_limit}"),
            (self.placement in ("ilp", "greedy"), f"placement must be 'ilp' or 'greedy', got {self.placement!r}"),
            (1 <= self.profile_ctx < 2**31, f"profile_ctx must be >= 1, got {self.profile_ctx}"),
            (0 <= self.n_threads <= 512, f"n_threads must be in [0, 512] (0 = all cores), got {self.n_threads}"),
            (math.isfinite(self.threshold), f"threshold must be a finite number, got {self.threshold!r}"),
            (self.sparsity is None or 0.0 <= self.sparsity < 1.0,
             f"sparsity must be in [0, 1), got {self.sparsity}"),
            (self.max_ppl_increase is None or (math.isfinite(self.max_ppl_increase)
                                               and 0.0 < self.max_ppl_increase <= 10.0),
             f"max_ppl_increase must be a share in (0, 10] (0.02 = 2%), got {self.max_ppl_increase}"),
            (self.max_kl is None or (not math.isnan(self.max_kl) and self.max_kl > 0.0),
             f"max_kl must be > 0 (inf: no KL bound), got {self.max_kl}"),
            (self.sparsity is None or self.max_ppl_increase is None,
             "sparsity (a fixed level) and max_ppl_increase (the level chosen by a quality budget) "
             "exclude each other"),
            (self.allocation in ALLOCATIONS,
             f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}"),
            (self.allocation != "greedy" or self.sparsity is None or self.sparsity <= MAX_LAYER_SPARSITY,
             f"the greedy allocation reaches a mean sparsity of at most {MAX_LAYER_SPARSITY}, "
             f"got {self.sparsity}"),
            (self.budget_tokens >= 16, f"budget_tokens must be >= 16, got {self.budget_tokens}"),
            (self.greedy_tokens >= 16, f"greedy_tokens must be >= 16, got {self.greedy_tokens}"),
            (self.input_sparsity is None or self.input_sparsity == "auto"
             or (not isinstance(self.input_sparsity, str) and 0.0 <= self.input_sparsity < 1.0),
             f"input_sparsity must be a share in [0, 1) or 'auto', got {self.input_sparsity!r}"),
            (self.input_sparsity != "auto" or self.sparsity is None or self.max_ppl_increase is not None,
             "input_sparsity 'auto' chooses the input level by the quality budget, and sparsity fixes "
             "the gate level without one: pass max_ppl_increase P instead of sparsity (the budget then "
             "chooses both levels), or a fixed input_sparsity S"),
            (all(0.0 < float(v) < 1.0 for v in self.input_grid) and len(self.input_grid) > 0,
             f"input_grid must be input levels in (0, 1), got {self.input_grid!r}"),
            (self.input_refit_tokens >= 16, f"input_refit_tokens must be >= 16, got {self.input_refit_tokens}"),
            (self.input_criterion in F.INPUT_CRITERIA,
             f"input_criterion must be one of {', '.join(F.INPUT_CRITERIA)}, got {self.input_criterion!r}"),
            (self.input_tokens >= 16, f"input_tokens must be >= 16, got {self.input_tokens}"),
            (self.predictor_type in PREDICTOR_TYPES,
             f"predictor_type must be one of {', '.join(str(t) for t in PREDICTOR_TYPES)}, got {self.predictor_type!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConvertError(f"sparse options: {msg}")


#: Storage types a predictor may be asked for (None: follow the model's type).
PREDICTOR_TYPES = (None, "f32", "f16", "q8_0", "q4_0")


def predictor_qtype(outtype: str, row_len: int, want: str | None = None):
    """Storage type of a predictor matrix. ``want`` (f32, f16, q8_0, q4_0) overrides the
    rule: F32 for f32 models, F16 for f16/bf16 (bf16's 8-bit mantissa flips more scores
    near the threshold), Q8_0 for q8_0/q4_0 models (Q8_0 keeps recall within ~0.5% at the
    same threshold; Q4_0 halves the bytes but needs a lower threshold for the same recall,
    see docs/BENCHMARKS.md); F16 when a row cannot be block-quantized."""
    if want is None:
        want = {"f32": "f32", "f16": "f16", "bf16": "f16"}.get(outtype, "q8_0")
    if want in ("f32", "f16"):
        return Q.F32 if want == "f32" else Q.F16
    return (Q.Q8_0 if want == "q8_0" else Q.Q4_0) if row_len % F.QUANT_BLOCK == 0 else Q.F16


def gpu_index_kv(pl: Placement, group_size: int, ctx: int) -> list[tuple[str, Any, Any]]:
    """(key, value, GGUFValueType) of the GPU index keys (format.GPU_KEYS)."""
    return [
        (F.KEY_GPU_VRAM_BUDGET, int(pl.budget), V.UINT64),
        (F.KEY_GPU_GROUP_SIZE, int(group_size), V.UINT32),
        (F.KEY_GPU_CTX, int(ctx), V.UINT32),
        (F.KEY_GPU_DENSE_BYTES, int(pl.dense_bytes), V.UINT64),
        (F.KEY_GPU_NEURON_BYTES, int(pl.neuron_bytes), V.UINT64),
        (F.KEY_GPU_SERVED_SHARE, float(pl.served_share), V.FLOAT32),
        (F.KEY_GPU_SOLVER, pl.solver, V.STRING),
    ]


def solve_from_tensors(tensors: dict, freq: list[np.ndarray], n_layer: int, n_embd_kv: int, ctx: int,
                       budget: int, group_size: int = 64, min_layer_share: float = 0.05,
                       method: str = "ilp", time_limit: float = 10.0) -> Placement:
    """Placement for a sparse model described by ``{name: (qtype, numpy shape)}``."""
    dense, per_neuron = model_costs(tensors, n_layer, n_embd_kv, ctx)
    prob = make_problem(freq, per_neuron, dense, budget, group_size, min_layer_share)
    return solve_placement(prob, method, time_limit)


@dataclass
class _Run:
    """What the stages of one convert_sparse share: its arguments, the plan read from the
    options (_plan), and what each stage leaves for the next (the profile, the dense file's
    tensors, the fitted predictors or gate table, the chosen levels, the placement)."""

    dense: DenseModel
    opts: SparseOptions
    out_path: str
    progress: bool
    say: Callable[[str], None]
    # the plan
    budget: float | None       # the gate's quality budget (None: a fixed sparsity, or predictors)
    gate_mode: bool            # gate thresholds (else ReLU predictors)
    in_req: bool               # input sparsity asked for
    in_auto: bool              # ... at a level the budget chooses
    in_budget: float | None    # the budget input sparsity is measured against
    calib: str                 # the calibration text's file
    text: str                  # ... and the text
    ctx: int
    rep: SparseReport
    tmpdir: str = ""
    # [1] the dense file; [2] its profile and input thresholds per level
    dense_path: str = ""
    prof: Any = None
    in_src: InputSources | None = None
    n_hold: int = 0            # where a budget's held-out tokens start
    in_levels: list = field(default_factory=list)
    cals: dict = field(default_factory=dict)
    # [3] the dense file's tensors, the fitted FFN, the chosen levels
    t_fit: float = 0.0         # when [3] began (rep.seconds "predictors" / "thresholds")
    reader: Any = None
    dense_t: dict = field(default_factory=dict)
    down_q: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)   # name -> (type, shape) of the output file
    preds: list = field(default_factory=list)
    pred_enc: list = field(default_factory=list)  # per layer (q1, e1, q2, e2): stored predictors
    table: QuantileTable | None = None
    freq: list = field(default_factory=list)
    ev: GateEvaluator | None = None
    allocate: Callable | None = None
    held_ids: list = field(default_factory=list)
    mean: float | None = None  # the gate's mean sparsity
    cal: Any = None            # the input calibration the file gets
    # [4]
    pl: Placement | None = None

    @property
    def n_layer(self) -> int:
        return self.dense.n_layer

    def ffn(self, l: int) -> FFNView:
        """Layer l's FFN in the dense file's layout (ffn_view.py)."""
        def rows(name):
            t = self.dense_t.get(name)
            return None if t is None else int(t.shape[-1])  # GGUF's ne[1]: the rows
        return ffn_view(rows, l, self.dense.n_ff)

    def gate_matrix(self, l: int) -> np.ndarray:
        """The gate rows as the runtime reads them (float32 [n_ff, n_embd])."""
        g = self.ffn(l).gate
        t = self.dense_t[g.tensor]
        w = decode_matrix(np.asarray(t.data), t.tensor_type, (g.total, self.dense.n_embd))
        return w if g.whole else w[g.start:g.stop]

    def gate_thr(self, g):
        """The per-layer gate thresholds at mean sparsity g (None: predictors)."""
        return self.table.thresholds(self.allocate(g)) if self.gate_mode else None

    def make_inputs(self, level, gate_level):
        """The input calibration at `level`, refit (when asked) under the gate at gate_level."""
        cal = self.cals[level]
        opts = self.opts
        if opts.input_refit and level > 0:
            if self.gate_mode:
                patch_gate_thresholds(self.ev.path, self.gate_thr(gate_level))
            ids = refit_tokens(self.prof.input_ids, cal.n_fit, self.prof.n_ctx, opts.input_refit_tokens)
            refit(self.ev.path, cal, ids, self.prof.n_ctx, opts.n_threads, say=self.say, progress=self.progress)
        return cal

    def measure(self, g, cal):
        """The held-out perplexity and bytes at gate sparsity g and input calibration cal."""
        return self.ev.measure(self.held_ids, self.gate_thr(g), inputs=cal)


def convert_sparse(dense: DenseModel, out_path: str, opts: SparseOptions, progress: bool = True,
                   say: Callable[[str], None] | None = None) -> tuple[str, SparseReport]:
    """Run the whole pipeline; returns (output path, report). The stages, in order: the
    dense file, the profile (and input thresholds per level), the FFN's fit (predictors, or
    the gate's quantile table), the levels (budget search, input refit), the placement, the
    extended file; each a function over one _Run."""
    say = say or (lambda s: log.info("%s", s))
    if dense.n_expert:  # a mixture of experts: thresholds per expert
        return convert_sparse_experts(dense, out_path, opts, progress, say)
    if opts.expert_predictors:
        raise ConvertError("--expert-predictors trains a predictor per expert of a mixture of experts, "
                           "and this model has no experts (a dense sparse file gets its predictors "
                           "per layer without it)")
    run = _plan(dense, out_path, opts, progress, say)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    remove_stale(out_dir)
    run.tmpdir = scratch_dir(os.path.join(out_dir, os.path.basename(out_path)))
    try:
        _dense_file(run)
        _profile(run)
        _fit_ffn(run)
        _fit_levels(run)
        _place(run)
        return _write(run)
    finally:
        shutil.rmtree(run.tmpdir, ignore_errors=True)


def _plan(dense: DenseModel, out_path: str, opts: SparseOptions, progress: bool, say) -> _Run:
    """The options checked against the model and read into a plan (gate or predictors, the
    budgets), and the calibration text read; ConvertError naming what is wrong."""
    budget = opts.max_ppl_increase
    if (opts.sparsity is None and budget is None and dense.gated
            and dense.activation not in F.SPARSE_ACTIVATIONS):
        budget = DEFAULT_MAX_PPL_INCREASE  # SwiGLU/GeGLU: no exact zeros for a predictor
    gate_mode = opts.sparsity is not None or budget is not None
    if gate_mode and not dense.gated:
        raise ConvertError(
            f"--sparsity calibrates thresholds on the FFN's gate, and this {dense.arch} model's FFN "
            "has none (down(act(up x))); use --sparse (predictors; ReLU-family models) or "
            "convert it densely")
    if not gate_mode and dense.activation not in F.SPARSE_ACTIVATIONS:
        raise ConvertError(
            f"--sparse needs a ReLU-family model (activation relu, drelu or fatrelu); this model's FFN uses "
            f"{dense.activation!r}, whose outputs are almost never exactly zero, so there is no activation "
            "sparsity for a predictor to exploit. Use --sparsity S or --max-ppl-increase P for "
            "training-free gate-magnitude sparsity, or convert it densely (without --sparse)")
    if not 0.0 < opts.predictor_recall <= 1.0:
        raise ConvertError(f"--predictor-recall must be in (0, 1], got {opts.predictor_recall}")
    if opts.calib_tokens < 16:
        raise ConvertError(f"--calib-tokens must be at least 16, got {opts.calib_tokens}")
    if opts.group_size < 1:
        raise ConvertError("--group-size must be >= 1")
    in_req, in_auto = opts.input_sparsity is not None, opts.input_sparsity == "auto"
    # the budget input sparsity is measured against: the gate's, shared; with predictors
    # (no gate budget) only "auto" has one, the default's
    in_budget = budget if gate_mode else (DEFAULT_MAX_PPL_INCREASE if in_auto else None)
    why = "sparse conversion"
    if gate_mode and opts.sparsity is None:
        why = (f"the quality budget (--max-ppl-increase {budget:g}"
               + (", the default for a {} model)".format(dense.activation) if opts.max_ppl_increase is None else ")")
               + " measures held-out perplexity on the calibration text and")
    calib = resolve_calib(dense.hf_dir, opts.calib, why)
    try:
        with open(calib, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"cannot read calibration text {calib}: {e}") from None
    if not text.strip():
        raise ConvertError(f"calibration text {calib} is empty")
    ctx = int(opts.ctx if opts.ctx is not None else dense.n_ctx)
    return _Run(dense=dense, opts=opts, out_path=out_path, progress=progress, say=say, budget=budget,
                gate_mode=gate_mode, in_req=in_req, in_auto=in_auto, in_budget=in_budget, calib=calib, text=text,
                ctx=ctx, rep=SparseReport(calib_source=calib_source_string(calib)))


def _dense_file(run: _Run) -> None:
    """[1] The dense GGUF the runtime profiles: the input file itself, or written now."""
    dense, rep = run.dense, run.rep
    jobs = dense.jobs
    t0 = time.perf_counter()
    if dense.path:
        run.dense_path = dense.path
        run.say(f"[1/5] input GGUF {run.dense_path} ({len(jobs)} tensors kept in their types)")
    else:
        run.dense_path = os.path.join(run.tmpdir, "dense.gguf")
        write_gguf(run.dense_path, lambda w: add_kv(w, dense.kv), jobs, run.progress, arch=dense.arch)
        run.say(f"[1/5] dense GGUF written ({dense.outtype}, {len(jobs)} tensors, "
                f"{time.perf_counter() - t0:.1f} s)")
    rep.seconds["dense"] = time.perf_counter() - t0


def _profile(run: _Run) -> None:
    """[2] The FFN's activity on the calibration text (and the projections' inputs when
    input sparsity is asked for), then the input thresholds of each level it may take."""
    opts, rep = run.opts, run.rep
    t0 = time.perf_counter()
    from .profile import profile_model  # loads the native runtime: only a sparse conversion needs it
    try:
        prof = profile_model(run.dense_path, run.text, n_ctx=opts.profile_ctx, n_threads=opts.n_threads,
                             max_tokens=opts.calib_tokens, progress=run.progress,
                             inputs=opts.input_tokens if run.in_req else 0,
                             # under a budget the input thresholds never see its held-out tokens
                             inputs_span=1.0 - GATE_HOLDOUT if run.in_budget is not None else 1.0)
    except MemoryError as e:
        raise ConvertError(f"profiling: {e} (pass a smaller --calib-tokens)") from None
    run.prof = prof
    rep.n_calib_tokens = prof.n_tokens
    rep.density = [float(v) for v in prof.density]
    rep.seconds["profile"] = time.perf_counter() - t0
    if prof.n_tokens < 16:
        raise ConvertError(f"calibration text {run.calib} gave only {prof.n_tokens} tokens; need at least 16")
    run.say(f"[2/5] profile: {prof.summary()} ({rep.seconds['profile']:.1f} s)")
    run.in_src = InputSources(run.dense.jobs, run.n_layer, run.dense.n_ff) if run.in_req else None
    run.n_hold = prof.n_tokens - max(1, int(round(prof.n_tokens * GATE_HOLDOUT)))  # a budget's held-out start
    if run.in_budget is not None and prof.n_tokens - run.n_hold < 16:
        raise ConvertError(f"the quality budget needs at least 16 held-out tokens (the last "
                           f"{GATE_HOLDOUT:.0%} of the profile); {prof.n_tokens} tokens were profiled: give a "
                           "longer --calib text or a larger --calib-tokens")
    if run.in_req:
        t1 = time.perf_counter()
        run.in_levels = (sorted({float(v) for v in opts.input_grid}) if run.in_auto
                         else [float(opts.input_sparsity)])
        fitted = calibrate_input_levels(prof, [0.0] + run.in_levels, opts.input_criterion, run.in_src.weight_t,
                                        ffn=opts.input_ffn)
        run.cals = dict(zip([0.0] + run.in_levels, fitted))
        run.say(f"[2/5] input thresholds ({time.perf_counter() - t1:.1f} s, on dense-mode inputs): "
                + "; ".join(run.cals[v].summary() for v in run.in_levels))


def _fit_ffn(run: _Run) -> None:
    """[3] The dense file's tensors read, then the FFN fitted: gate mode's quantile table of
    the gate's magnitudes, or the predictors trained, encoded in their storage types and
    evaluated as stored (with the neuron frequencies the placement uses)."""
    dense, opts, rep, prof = run.dense, run.opts, run.rep, run.prof
    n_layer, n_ff, d = dense.n_layer, dense.n_ff, dense.n_embd
    run.t_fit = time.perf_counter()
    run.reader = open_gguf(run.dense_path)  # a PWRI input too
    dense_t = run.dense_t = {t.name: t for t in run.reader.tensors}
    run.down_q = dense.down_types or [storage_type(F.T_FFN_DOWN, (n_ff, d), dense.outtype)[0]] * n_layer
    kept = {j.name for j in dense.jobs}   # a sparse input's old predictors and index are not
    for t in run.reader.tensors:
        if t.name in kept:
            run.tensors[t.name] = (t.tensor_type, tuple(int(v) for v in reversed(t.shape)))
    for l in range(n_layer):
        run.tensors.pop(F.tensor_name(F.T_FFN_DOWN, l), None)
        run.tensors[F.sparse_tensor_name(F.T_FFN_DOWN_T, l)] = (run.down_q[l], (n_ff, d))

    if run.gate_mode:
        run.table = _gate_table(dense, opts, run.budget, prof, run.gate_matrix, rep)
        return
    pcfg = opts.predictor or PredictorConfig()
    pcfg.recall_target = opts.predictor_recall
    pcfg.threshold = opts.threshold

    def gate_of(l):
        # the gate as the runtime computes it (the stored, possibly quantized weights);
        # only ReGLU decides activity by the gate's sign alone
        if not dense.gated or dense.activation != F.ACT_RELU or not opts.gate_init:
            return None
        return run.gate_matrix(l)

    preds = run.preds = train_predictors([(prof.x[l], prof.mask[l]) for l in range(n_layer)], pcfg,
                                         run.progress, log=lambda s: log.debug("%s", s), gates=gate_of)
    rep.seconds["predictors"] = time.perf_counter() - run.t_fit

    # storage types and what the stored (encoded) predictors actually achieve
    for l, p in enumerate(preds):
        q1, q2 = predictor_qtype(dense.outtype, d, opts.predictor_type), predictor_qtype(dense.outtype, p.h, opts.predictor_type)
        e1, e2 = encode_matrix(p.w1, q1), encode_matrix(p.w2, q2)
        r1, r2 = decode_matrix(e1, q1, p.w1.shape), decode_matrix(e2, q2, p.w2.shape)
        n_tr = p.n_train
        rec, prec, dens = evaluate(r1, r2, prof.x[l][n_tr:], prof.mask[l][n_tr:], opts.threshold)
        rep.stored_recall.append((rec, prec, dens))
        run.pred_enc.append((q1, e1, q2, e2))
        rep.pred_bytes.append(int(e1.nbytes + e2.nbytes))
        v = run.ffn(l)
        rep.ffn_bytes.append(sum(int(dense_t[n].n_bytes) for n in v.inputs + (v.down,)))
    run.say(f"[3/5] predictors trained ({rep.seconds['predictors']:.1f} s); held-out recall of the stored "
            f"({gguf.GGMLQuantizationType(run.pred_enc[0][0]).name}) weights:\n"
            + format_report([_with_stored(p, s) for p, s in zip(preds, rep.stored_recall)],
                            rep.ffn_bytes, rep.pred_bytes, opts.predictor_recall))
    rep.predictors = list(preds) if opts.keep_predictors else [_strip(p) for p in preds]
    run.freq = [np.asarray(prof.freq[l], dtype=np.float64) for l in range(n_layer)]


def _fit_levels(run: _Run) -> None:
    """[3] The levels: the gate's mean sparsity (fixed, or the largest within the budget)
    and its allocation over the layers, the input sparsity level (alone, or searched
    jointly with the gate under the shared budget) and its refit; measured by the runtime
    on one evaluation file whose thresholds each trial patches."""
    dense, opts, rep, prof = run.dense, run.opts, run.rep, run.prof
    n_layer, gate_mode, budget, in_budget = dense.n_layer, run.gate_mode, run.budget, run.in_budget
    # one evaluation file (CPU-only index, placeholder frequencies, input thresholds 0) for
    # what the runtime measures: the budget, greedy's costs, the input refit; each trial
    # patches its thresholds
    if ((gate_mode and (budget is not None or opts.allocation == "greedy"))
            or (any(v > 0 for v in run.in_levels) and (opts.input_refit or in_budget is not None))):
        flat = [np.full(dense.n_ff, 0.5) for _ in range(n_layer)]
        pl0 = solve_from_tensors(run.tensors, flat, n_layer, dense.n_embd_kv, run.ctx, 0, opts.group_size,
                                 opts.min_layer_share, "greedy")
        if gate_mode:
            rep.gate_thresholds = [0.0] * n_layer
            rep.gate_layer_sparsity = [0.0] * n_layer
        eval_path, _ = _write_extended(run, os.path.join(run.tmpdir, "eval.gguf"), flat, pl0,
                                       _gate_kv(rep, None, opts) if gate_mode else [], show=False,
                                       inputs=run.cals.get(0.0))
        run.ev = GateEvaluator(eval_path, prof.n_ctx, opts.n_threads, ffn="gate" if gate_mode else "sparse")
    if gate_mode:
        run.allocate = _gate_allocation(dense, opts, prof, rep, run.table, run.ev,
                                        run.n_hold if budget is not None else prof.n_tokens, run.progress,
                                        run.say)
    run.held_ids = [int(t) for t in prof.tokens[run.n_hold:run.n_hold + opts.budget_tokens]]

    in_levels, say = run.in_levels, run.say
    joint = run.in_req and in_budget is not None and (run.in_auto or in_levels[0] > 0)
    if joint:
        say(f"[3/5] quality budget {in_budget:.1%} " + ("shared by the gate FFN and " if gate_mode else
                                                      "(the predictors' loss included) for ")
            + f"input sparsity at {', '.join(f'{v:.0%}' for v in in_levels)}"
            + (" (or off)" if run.in_auto else "") + f", on {len(run.held_ids)} held-out tokens")
        # ranked by estimated decode time: the file's types decide what a byte costs
        dcost = DecodeCost.from_file(run.ev.path, run.ev.ffn)
        best, rep.input_tried = search_levels(run.measure, run.make_inputs, in_budget, in_levels,
                                              BUDGET_MAX_SPARSITY if gate_mode else None, include_off=run.in_auto,
                                              say=say, cost=dcost.estimate, dense_time=dcost.dense,
                                              max_kl=_kl_bound(opts, in_budget))
        run.mean, run.cal, rep.budget_result = best.gate, best.cal, best.result
        r, cal, mean = best.result, run.cal, run.mean
        if cal is not None and run.in_auto:
            cal.max_ppl_increase, cal.ppl_increase = in_budget, r["ppl"] / r["ppl_dense"] - 1.0
        over = over_budget(r, in_budget, _kl_bound(opts, in_budget))
        why_over = (f"input sparsity {best.inputs:.0%} alone (kept: it was asked for)" if best.inputs > 0
                    else "the predictor FFN alone")
        say("[3/5] chosen: " + (f"gate sparsity {mean:.1%}, " if gate_mode else "")
            + f"input sparsity {best.inputs:.0%}"
            + (" (off: the file stores no transposed copies)" if cal is None else "")
            + f": held-out ppl {r['ppl']:.3f} vs dense {r['ppl_dense']:.3f} ({r['ppl'] / r['ppl_dense'] - 1:+.2%}, "
              f"bound {r['ppl_increase_ub']:+.2%}), {r['bytes_per_token'] / 1e6:.3f} of "
              f"{r['bytes_per_token_dense'] / 1e6:.3f} MB/token, est. time {describe_time(best.time, dcost.dense)}"
            + (f"; over the budget: {why_over}" if over else ""))
        if over:
            log.warning("over the %.1f%% quality budget: %s", 100 * in_budget, why_over)
    elif gate_mode and budget is not None:
        run.mean = _budget_gate(run.ev, run.held_ids, run.gate_thr, budget, run.n_hold, rep, run.progress, say,
                                _kl_bound(opts, budget))
    elif gate_mode:
        run.mean = float(opts.sparsity)
    if run.in_req and not joint:
        run.cal = run.make_inputs(in_levels[0], run.mean)  # the FFN final: its inputs are the file's
    rep.input_calibration = run.cal
    if gate_mode:
        run.freq = _gate_final(dense, opts, prof, run.gate_matrix, rep, run.table, run.allocate(run.mean),
                               run.mean)
        rep.seconds["thresholds"] = time.perf_counter() - run.t_fit
        say(f"[3/5] gate thresholds ({rep.gate_allocation}, mean sparsity {rep.gate_sparsity:.1%}, "
            f"{rep.seconds['thresholds']:.1f} s): " + ", ".join(
                f"L{l} {sl:.0%} t={t:.3g} density {dn:.1%}" for l, (sl, t, dn) in enumerate(
                    zip(rep.gate_layer_sparsity, rep.gate_thresholds, rep.gate_density))))

    if run.cal is not None and run.cal.sparse_mode:
        say(f"[3/5] input thresholds, {refit_summary(run.cal)}")


def _place(run: _Run) -> None:
    """[4] The neuron placement under the VRAM budget (with the predictors' bytes)."""
    dense, opts, rep = run.dense, run.opts, run.rep
    t0 = time.perf_counter()
    for l, (q1, e1, q2, e2) in enumerate(run.pred_enc):
        run.tensors[F.sparse_tensor_name(F.T_FC1, l)] = (q1, run.preds[l].w1.shape)
        run.tensors[F.sparse_tensor_name(F.T_FC2, l)] = (q2, run.preds[l].w2.shape)
    run.pl = solve_from_tensors(run.tensors, run.freq, dense.n_layer, dense.n_embd_kv, run.ctx,
                                opts.vram_budget, opts.group_size, opts.min_layer_share,
                                opts.placement, opts.ilp_time_limit)
    rep.placement = run.pl
    rep.seconds["placement"] = time.perf_counter() - t0
    run.say(f"[4/5] {run.pl.summary()}")


def _write(run: _Run) -> tuple[str, SparseReport]:
    """[5] The extended file at out_path; returns (its path, the report)."""
    rep, opts = run.rep, run.opts
    t0 = time.perf_counter()
    out, n_jobs = _write_extended(run, run.out_path, run.freq, run.pl,
                                  _gate_kv(rep, run.budget, opts) if run.gate_mode else [],
                                  inputs=rep.input_calibration)
    run.reader, run.dense_t = None, {}
    rep.seconds["write"] = time.perf_counter() - t0
    size = os.path.getsize(out)
    run.say(f"[5/5] wrote {out} ({format_size(size)}, {n_jobs} tensors, {rep.seconds['write']:.1f} s)")
    return out, rep


def _write_extended(run: _Run, path: str, freq, pl, gate_kv, show: bool | None = None,
                    inputs=None) -> tuple[str, int]:
    """The extended file: dense tensors copied, ffn_down -> ffn_down_t, predictors, the
    neuron index, the input-sparse copies, the sparse keys; returns (path, tensors)."""
    dense, opts, rep, dense_t = run.dense, run.opts, run.rep, run.dense_t
    n_ff, d = dense.n_ff, dense.n_embd
    show = run.progress if show is None else show
    new_jobs: list = []
    src_names = {j.name: j for j in dense.jobs}
    for j in dense.jobs:
        kind, il, suffix = F.parse_tensor_name(j.name)
        if kind in (F.T_FFN_DOWN, F.T_FFN_DOWN_T) and il is not None and suffix == "weight":
            if kind == F.T_FFN_DOWN_T:  # a sparse input's: its bytes as they are
                new_jobs.append(_raw_job(j.name, j.shape, j.qtype, dense_t[j.name].data))
            else:
                src_job = src_names[j.name]

                def load_t(src_job=src_job):
                    return np.ascontiguousarray(src_job.load().T)

                new_jobs.append(TensorJob(F.sparse_tensor_name(F.T_FFN_DOWN_T, il), (n_ff, d),
                                          run.down_q[il], load_t))
            if not run.gate_mode:
                q1, e1, q2, e2 = run.pred_enc[il]
                new_jobs.append(_raw_job(F.sparse_tensor_name(F.T_FC1, il), run.preds[il].w1.shape, q1, e1))
                new_jobs.append(_raw_job(F.sparse_tensor_name(F.T_FC2, il), run.preds[il].w2.shape, q2, e2))
            new_jobs += index_jobs(il, freq[il], pl.hot[il], n_ff)
            if inputs is not None:
                new_jobs += run.in_src.layer_jobs(inputs, il)
        else:
            rt = dense_t[j.name]
            new_jobs.append(_raw_job(j.name, j.shape, j.qtype, rt.data))
    if inputs is not None:
        new_jobs += run.in_src.head_jobs(inputs)

    def setup(w):
        add_kv(w, dense.kv)
        if run.gate_mode:
            for k, v, ty in gate_kv:
                if ty is None:
                    w.add_array(k, v)
                else:
                    w.add_key_value(k, v, ty)
        else:
            w.add_key_value(F.KEY_SPARSE_THRESHOLD, float(opts.threshold), V.FLOAT32)
            w.add_key_value(F.KEY_SPARSE_RECALL_TARGET, float(opts.predictor_recall), V.FLOAT32)
        w.add_key_value(F.KEY_SPARSE_CALIB_SOURCE, rep.calib_source, V.STRING)
        w.add_key_value(F.KEY_SPARSE_CALIB_TOKENS, int(rep.n_calib_tokens), V.UINT32)
        for k, v, ty in gpu_index_kv(pl, opts.group_size, run.ctx):
            w.add_key_value(k, v, ty)
        for k, v, ty in (input_kv(inputs) if inputs is not None else []):
            w.add_key_value(k, v, ty)

    return write_gguf(path, setup, new_jobs, show, arch=dense.arch), len(new_jobs)


def _gate_kv(rep: SparseReport, budget: float | None, opts: SparseOptions) -> list:
    """(key, value, GGUFValueType or None for an f32 array) of a gate-sparse file."""
    kv = [(F.KEY_SPARSE_GATE_THRESHOLD, [float(t) for t in rep.gate_thresholds], None),
          (F.KEY_SPARSE_TARGET, float(rep.gate_sparsity or 0.0), V.FLOAT32),
          (F.KEY_SPARSE_LAYER_SPARSITY, [float(v) for v in rep.gate_layer_sparsity], None),
          (F.KEY_SPARSE_GATE_ALLOCATION, rep.gate_allocation or opts.allocation, V.STRING)]
    if budget is not None:
        kv.append((F.KEY_SPARSE_MAX_PPL_INCREASE, float(budget), V.FLOAT32))
        r = rep.budget_result
        kv.append((F.KEY_SPARSE_PPL_INCREASE, float(r["ppl"] / r["ppl_dense"] - 1.0) if r else 0.0, V.FLOAT32))
    return kv


def _gate_table(dense: DenseModel, opts: SparseOptions, budget: float | None, prof, gate_matrix,
                rep: SparseReport) -> QuantileTable:
    """Gate mode's quantile table of |act(gate)| per layer, on the calibration tokens (the
    profile's first ones: a budget is measured on the rest)."""
    n_layer, n = dense.n_layer, prof.n_tokens
    n_fit = n - max(1, int(round(n * GATE_HOLDOUT))) if budget is not None else n
    if budget is not None and n - n_fit < 16:
        raise ConvertError(f"the quality budget needs at least 16 held-out tokens (the last "
                           f"{GATE_HOLDOUT:.0%} of the profile); {n} tokens were profiled: give a longer "
                           "--calib text or a larger --calib-tokens")
    rep.n_gate_fit = n_fit
    act_t = dense.act_threshold or 0.0
    table = QuantileTable(gate_magnitudes(prof.x[l][:n_fit], gate_matrix(l), dense.activation,
                                          act_threshold=act_t) for l in range(n_layer))
    if opts.keep_calibration:
        rep.gate_table = table
    return table


def _gate_allocation(dense: DenseModel, opts: SparseOptions, prof, rep: SparseReport, table: QuantileTable,
                     ev, n_fit: int, progress: bool, say) -> Callable[[float], list]:
    """The allocation: mean sparsity -> per-layer levels (greedy: from each layer's measured
    KL, into rep.gate_costs)."""
    n_layer = dense.n_layer
    if opts.allocation != "greedy":
        return lambda mean: uniform_allocation(n_layer, mean)
    ids = [int(t) for t in prof.tokens[:min(n_fit, opts.greedy_tokens)]]
    say(f"[3/5] greedy allocation: KL to dense of each layer alone at {ALLOCATION_GRID[0]:.0%}.."
        f"{ALLOCATION_GRID[-1]:.0%} on {len(ids)} calibration tokens ({n_layer * len(ALLOCATION_GRID)} runs)")
    costs = layer_costs(ev, ids, n_layer, table.threshold, ALLOCATION_GRID, progress, say)
    rep.gate_costs = costs
    return lambda mean: greedy_allocation(costs, mean)


def _budget_gate(ev, ids: list, gate_thr, budget: float, n_fit: int, rep: SparseReport, progress: bool,
                 say, max_kl: float | None = None) -> float:
    """The largest mean gate sparsity within the budget (and the KL bound max_kl) on the
    held-out ids (into rep)."""
    say(f"[3/5] quality budget: the largest sparsity within {budget:.1%} of dense perplexity on "
        f"{len(ids)} held-out tokens (calibration on the first {n_fit})")
    bar = None
    if progress:
        bar = tqdm(desc="quality budget", unit="level", dynamic_ncols=True)

    def ppl_at(s):
        r = ev.measure(ids, gate_thr(s))
        if bar is not None:
            bar.update(1)
        return r

    try:
        mean, rep.budget_result, rep.budget_tried = search_budget(ppl_at, budget, BUDGET_MAX_SPARSITY, say=say,
                                                                  max_kl=max_kl)
    finally:
        if bar is not None:
            bar.close()
    r = rep.budget_result
    say(f"[3/5] quality budget {budget:.1%}: sparsity {mean:.1%}"
        + (f", held-out ppl {r['ppl']:.3f} vs dense {r['ppl_dense']:.3f} ({r['ppl'] / r['ppl_dense'] - 1:+.2%})"
           if r else " (no level above 0 kept the budget)"))
    return mean


def _gate_final(dense: DenseModel, opts: SparseOptions, prof, gate_matrix, rep: SparseReport,
                table: QuantileTable, levels: list, mean: float) -> list[np.ndarray]:
    """Gate mode's result into rep (levels, thresholds, densities); returns the per-layer
    neuron frequencies on every profiled token."""
    rep.gate_sparsity, rep.gate_layer_sparsity, rep.gate_allocation = mean, levels, opts.allocation
    rep.gate_thresholds = table.thresholds(levels)
    act_t = dense.act_threshold or 0.0
    freq = []
    rep.gate_density = []
    for l in range(dense.n_layer):
        mag = gate_magnitudes(prof.x[l], gate_matrix(l), dense.activation, act_threshold=act_t)
        fr = (mag > rep.gate_thresholds[l]).mean(axis=0, dtype=np.float64)
        freq.append(fr)
        rep.gate_density.append(float(fr.mean()))
    return freq


def index_jobs(layer: int, freq: np.ndarray, hot: np.ndarray, n_ff: int) -> list:
    """TensorJobs of ffn_freq, gpu_idx and (when n_hot > 0) gpu_bucket."""
    idx = np.zeros(n_ff, np.int32)
    idx[hot] = 1
    out = [TensorJob(F.sparse_tensor_name(F.T_FFN_FREQ, layer), (n_ff,), Q.F32,
                     lambda f=freq: np.ascontiguousarray(f, dtype=np.float32)),
           TensorJob(F.sparse_tensor_name(F.T_GPU_IDX, layer), (n_ff,), Q.I32, lambda a=idx: a)]
    if len(hot):
        b = np.sort(np.asarray(hot, dtype=np.int32))
        out.append(TensorJob(F.sparse_tensor_name(F.T_GPU_BUCKET, layer), (len(b),), Q.I32, lambda a=b: a))
    return out


def _raw_job(name, shape, qtype, data):
    return TensorJob(name, tuple(int(s) for s in shape), qtype, lambda a=data: a, raw=True)


def _with_stored(p: LayerPredictor, stored) -> LayerPredictor:
    q = copy.copy(p)
    q.recall, q.precision, q.pred_density = stored
    return q


def _strip(p: LayerPredictor) -> LayerPredictor:
    q = copy.copy(p)
    q.w1 = np.zeros((p.h, 0), np.float32)
    q.w2 = np.zeros((0, p.h), np.float32)
    return q
