"""Input sparsity measured in the native runtime's sparse mode: the share each site skips,
and the refit that moves every site's threshold to the target on the inputs it sees there.

Why a refit: the thresholds of input_sparsity.calibrate_inputs are fitted on the main
profile's inputs, which are dense-mode ones (recording the FFN's inputs and masks needs the
dense FFN, so that profile runs dense throughout). In the sparse mode a site's input comes from
the input-sparse sites (and sparse FFNs) before it: o's input (the attention output) is computed
from input-sparse q/k/v and shrinks (a flatter softmax), so o's dense-fitted thresholds skip
more than asked: on tiny-relu-kjv at 50%, o skipped ~7 points more on held-out text with q/k/v
sparse, 1.5 alone (docs/BENCHMARKS.md "Input sparsity").

How: the runtime records the projections' inputs in its sparse modes when it is not asked
for the FFN's (profile.profile_inputs; gh_eval_profile with ffn_in and mask NULL), each one
as the site's threshold test reads it. The refit runs that profile pass over the refit's
tokens with the file's current thresholds, then moves every site's criterion threshold t to
the target quantile of its recorded scores (|x_i| * gain_i, the form calibrate_inputs fits:
thr_i = t / gain_i). A site's inputs depend on the sites before it, whose thresholds the
refit just moved too, so a second pass would record slightly different inputs; measured from
the dense-mode fit, the sites stayed within 0.2 points of the target on them, so the refit
runs one pass (REFIT_PASSES; with more, a further pass refits again when the one before left
a site more than REFIT_TOL off the target).

Cost: one sparse-mode decode of the refit's tokens per pass (the old site-by-site refit ran
2-4 per layer, so it grew with n_layer squared), and memory for their inputs:
tokens x (n_layer x (n_embd + n_head x head_dim) + n_embd) floats, e.g. 1024 tokens of a
22-layer d=2048 model: 0.37 GB.

The runtime reads the thresholds when it loads a file, so each pass patches them in place
(patch_input_thresholds: same sizes, only values change) and reloads (an mmap).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import gguf
import numpy as np
from tqdm import tqdm

from .. import format as F
from .input_sparsity import SITE_HEAD, SITE_O, SITE_QKV, InputCalibration, criterion_t, skipped_share

#: Target tolerance of the refit: the share a site skips in the sparse mode, on the fit tokens.
REFIT_TOL = 0.005
#: Profile passes the refit runs at most. One from the dense-mode fit: on tiny-swiglu-kjv (gate
#: FFN 25%, wina, 40/50%) a second pass found every site within 0.2 points of the target with
#: the first pass's thresholds, the held-out shares the same (docs/BENCHMARKS.md "Refit in the
#: sparse mode"). Far from the target (every t x1.3: 33-37% skipped at 25%) one pass left o
#: 0.7 points off, and a second is needed.
REFIT_PASSES = 1
#: Fit tokens the refit runs over by default.
DEFAULT_REFIT_TOKENS = 1024


def patch_input_thresholds(path: str, qkv: Sequence[np.ndarray], o: Sequence[np.ndarray],
                           head: np.ndarray, ffn: Sequence[np.ndarray] = (), down: Sequence[np.ndarray] = ()) -> None:
    """Overwrite the input thresholds of the GGUF file at path in place (ffn, down: the FFN's
    sites, when given)."""
    r = gguf.GGUFReader(path, "r+")
    try:
        t = {x.name: x for x in r.tensors}
        for kind, vals in ((F.T_ATTN_QKV_IN_THR, qkv), (F.T_ATTN_OUTPUT_IN_THR, o), (F.T_FFN_IN_THR, ffn),
                           (F.T_FFN_DOWN_IN_THR, down)):
            for l, v in enumerate(vals):
                t[F.input_sparse_tensor_name(kind, l)].data[:] = v
        t[F.input_sparse_tensor_name(F.T_OUTPUT_IN_THR)].data[:] = head
        r.data.flush()
    finally:
        del r


def patch_calibration(path: str, cal: InputCalibration) -> None:
    """Write cal's thresholds into the file at path."""
    patch_input_thresholds(path, cal.qkv, cal.o, cal.head, cal.ffn, cal.down)


def sparse_inputs(path: str, cal: InputCalibration, ids: Sequence[int], window: int, n_threads: int = 0,
                  progress: Callable[[int], None] | None = None) -> dict:
    """Per site key, the inputs [tokens, in] it sees on ids (windows of `window` tokens) in
    the sparse mode of the file at path (the one it loads by default: predictors or gate)
    with cal's thresholds, which the file is left with."""
    from ..model import Model
    from .profile import profile_inputs

    patch_calibration(path, cal)
    with Model(path, n_ctx=window, n_threads=n_threads, cache_type="f32") as m:
        ctx = m.create_context(n_ctx=window, n_threads=n_threads, cache_type="f32", ffn="file",
                               input_sparse=True)
        try:
            ctx.sparse_batch = window  # every window's tokens in the sparse mode
            a_in, a_out, h_in = profile_inputs(ctx, ids, window, progress)
            ran = ctx.stats()["n_sparse_tokens"]
        finally:
            ctx.close()
    if ran != len(ids):  # a runtime older than the recording in the sparse modes: dense inputs
        raise RuntimeError(f"the native runtime ran {ran} of {len(ids)} tokens of the input profile in the "
                           "sparse mode; it needs a build that records the projections' inputs there")
    out = {(SITE_HEAD, None): h_in}
    for l in range(a_in.shape[0]):
        out[(SITE_QKV, l)], out[(SITE_O, l)] = a_in[l], a_out[l]
    return out


def _shares(x: dict, cal: InputCalibration) -> dict:
    """Per site recorded in x (the FFN's sites are not: their fit stays the dense-mode one)."""
    return {key: skipped_share(x[key], cal.thresholds(key)) for key in cal.keys() if key in x}


def site_shares(path: str, ids: Sequence[int], window: int, cal: InputCalibration, n_threads: int = 0) -> dict:
    """Per site, the share of its inputs the file's sparse mode skips on ids with cal's
    thresholds (one profile pass); the file is left with cal's thresholds."""
    return _shares(sparse_inputs(path, cal, ids, window, n_threads), cal)


def refit(path: str, cal: InputCalibration, ids: Sequence[int], window: int, n_threads: int = 0,
          tol: float = REFIT_TOL, max_passes: int = REFIT_PASSES, say: Callable[[str], None] | None = None,
          progress: bool = False) -> int:
    """Move every site of cal (in place) to its target share in the sparse mode of the file
    at path, on the inputs a profile pass over ids records there; a further pass (up to
    max_passes) when the one before left a site more than tol off the target. Records
    (share before, after) per site in cal.sparse_mode and leaves the file with the new
    thresholds. Returns the number of passes."""
    t0 = time.perf_counter()
    target = cal.sparsity
    # a site at 0 runs dense; the FFN's sites are not recorded in the sparse mode
    keys = [k for k in cal.keys() if cal.t.get(k, 0.0) > 0.0 and k[0] in (SITE_QKV, SITE_O, SITE_HEAD)]
    # a pass decodes len(ids) tokens in the sparse mode: minutes on a large model
    bar = tqdm(total=len(ids), desc=f"input refit {target:.0%}", unit="tok", disable=not progress)
    before = after = None
    passes = 0
    try:
        while passes < max_passes:
            if passes:
                bar.total += len(ids)
                bar.refresh()
            x = sparse_inputs(path, cal, ids, window, n_threads, bar.update)
            passes += 1
            now = _shares(x, cal)
            if before is None:
                before = now
            elif all(abs(now[k] - target) <= tol for k in keys):
                after = now
                break
            for k in keys:
                cal.set_t(k, criterion_t(x[k], target, cal.gain[k]))
            after = _shares(x, cal)
            del x
    finally:
        bar.close()
    cal.sparse_mode = {k: (before[k], after[k]) for k in keys}
    patch_calibration(path, cal)
    if say:
        say("  " + refit_summary(cal) + f" ({passes} profile pass{'es' if passes > 1 else ''} on {len(ids)} "
            f"tokens, {time.perf_counter() - t0:.1f} s)")
    return passes


def refit_tokens(input_ids: Sequence[int], n_fit: int, window: int, n_tokens: int = DEFAULT_REFIT_TOKENS) -> list[int]:
    """The refit's tokens: whole windows of the first n_fit recorded ones (a profile's
    input_ids, windows in text order), about n_tokens of them, spread over the fit windows."""
    starts = list(range(0, max(n_fit - window, 0) + 1, window))
    want = min(len(starts), max(1, int(n_tokens) // window))
    pick = sorted({starts[int(round(i))] for i in np.linspace(0, len(starts) - 1, want)})
    return [int(t) for s in pick for t in input_ids[s:min(s + window, n_fit)]]


def _mean_by_site(shares: dict) -> dict:
    by: dict = {}
    for (site, _), v in shares.items():
        by.setdefault(site, []).append(v)
    return {s: float(np.mean(v)) for s, v in by.items()}


def refit_summary(cal: InputCalibration) -> str:
    """One line: each site kind's mean share skipped in the sparse mode before and after."""
    before = _mean_by_site({k: v[0] for k, v in cal.sparse_mode.items()})
    after = _mean_by_site({k: v[1] for k, v in cal.sparse_mode.items()})
    names = {SITE_QKV: "q/k/v", SITE_O: "o", SITE_HEAD: "head"}
    return (f"refit in the sparse mode (target {cal.sparsity:.0%}): " + ", ".join(
        f"{names[s]} {before[s]:.1%} -> {after[s]:.1%}" for s in (SITE_QKV, SITE_O, SITE_HEAD) if s in before))
