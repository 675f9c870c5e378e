"""What a sparse conversion reports (SparseReport) and the calibration text it reads: the
pieces the dense pipeline (pipeline.py) and the experts' (expert_sparsity.py) share."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from ..gguf_write import ConvertError
from .placement import Placement

#: File name of the held-out text that a model folder may ship (the default
#: calibration text when --calib is not given).
HELDOUT_FILE = "heldout.txt"


@dataclass
class SparseReport:
    """What the pipeline did (also printed stage by stage)."""
    n_calib_tokens: int = 0
    calib_source: str = ""
    density: list = field(default_factory=list)
    predictors: list = field(default_factory=list)   # LayerPredictor (weights dropped)
    stored_recall: list = field(default_factory=list)  # recall/precision with the stored (encoded) weights
    pred_bytes: list = field(default_factory=list)
    ffn_bytes: list = field(default_factory=list)
    placement: Placement | None = None
    seconds: dict = field(default_factory=dict)
    gate_thresholds: list = field(default_factory=list)  # gate mode: per layer t
    gate_density: list = field(default_factory=list)     # and the share of neurons above it
    gate_sparsity: float | None = None                   # gate mode: the mean sparsity calibrated
    gate_layer_sparsity: list = field(default_factory=list)  # per layer (the allocation)
    gate_allocation: str = ""
    gate_costs: Any = None            # greedy: [n_layer, len(ALLOCATION_GRID)] measured KL
    gate_table: Any = None            # keep_calibration: the thresholds.QuantileTable
    budget_tried: list = field(default_factory=list)     # quality budget: (sparsity, measurement)
    budget_result: dict | None = None  # the chosen level's held-out measurement
    n_gate_fit: int = 0               # profiled tokens the thresholds were calibrated on
    input_calibration: Any = None     # input sparsity: input_sparsity.InputCalibration (None: off,
                                      # or "auto" chose 0)
    input_tried: list = field(default_factory=list)  # quality budget with input sparsity:
                                      # budget.Candidate of every combination measured
    expert_predictor_recall: list = field(default_factory=list)  # per layer: the experts'
                                      # predictors' recall and predicted density on held-out
                                      # tokens, (recall, density, true density)
    expert_holdout_sparsity: list = field(default_factory=list)  # sparse experts: per layer the
                                      # share of selected experts' neurons below their thresholds
                                      # on the held-out tokens (expert_sparsity.py); None for
                                      # a leading dense layer (glm4moe, dots1), as in
                                      # gate_thresholds and expert_predictor_recall there


def calib_source_string(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{os.path.basename(path)} sha256:{h.hexdigest()[:16]}"


def resolve_calib(hf_dir: str, calib: str | None, why: str = "sparse conversion") -> str:
    """The calibration text file: ``calib``, or the folder's heldout.txt."""
    if calib is None and not hf_dir:
        raise ConvertError(f"{why} needs calibration text: pass --calib FILE (plain text in the model's "
                           "language and domain, a few thousand tokens or more)")
    if calib is None:
        cand = os.path.join(hf_dir, HELDOUT_FILE)
        if not os.path.isfile(cand):
            raise ConvertError(
                f"{why} needs calibration text: pass --calib FILE (plain text in the model's "
                f"language and domain, a few thousand tokens or more); {hf_dir} ships no {HELDOUT_FILE}. "
                "Or convert densely with --dense")
        return cand
    if not os.path.isfile(calib):
        raise ConvertError(f"calibration text not found: {calib}")
    return calib
