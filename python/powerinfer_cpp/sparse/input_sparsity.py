"""Training-free input sparsity of the projections the FFN modes leave dense (TEAL / WINA):
attention q/k/v (their shared input, the attention norm's output), o (the heads' outputs)
and the output head (the final norm's output).

``y = W x`` computed over the inputs i with ``|x_i| > thr_i`` only is a sum of W's columns;
the runtime reads them as rows of the transposed copy (``attn_qkv_t``, ``attn_output_t``,
``output_t``: docs/FORMAT.md "Input sparsity"). Per layer and site, a threshold reaching
the target share of skipped inputs on the profiled calibration tokens:

- ``magnitude`` (TEAL): the ``s`` quantile of ``|x_i|`` over the site's tokens and
  channels, one value for every channel;
- ``wina``: the ``s`` quantile of ``|x_i| * ||W[:, i]||`` (the input's magnitude times the
  L2 norm of the weight column it multiplies: what it can add to the output), stored per
  channel as ``t / ||W[:, i]||``, so the runtime's test stays one compare per input.

Every site gets the same target (uniform); the thresholds come from the first
``1 - HOLDOUT`` of the recorded tokens and the share they skip on the rest is reported.
The profile runs densely, so these are dense-mode inputs; input_eval.refit then moves each
site's threshold to the target on the inputs a profile pass in the sparse mode records (o's
input, the attention output, shrinks when q/k/v are input-sparse).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from .. import format as F
from ..gguf_write import TensorJob, decode_matrix, fit_rows
from .ffn_view import FFNView, attention_inputs, ffn_view
from .thresholds import activation

#: Share of the recorded tokens (the last ones) the thresholds are not fitted on.
HOLDOUT = 0.2
#: The criterion convert uses unless told (measured: docs/BENCHMARKS.md "Input sparsity").
DEFAULT_INPUT_CRITERION = "wina"
#: Tokens whose projection inputs the profile records by default (whole windows).
DEFAULT_INPUT_TOKENS = 4096
#: A channel whose weight column is all zero never contributes: a threshold no finite input
#: passes, yet finite (the runtime refuses inf).
NEVER = float(np.finfo(np.float32).max)
SITE_QKV, SITE_O, SITE_HEAD = "qkv", "o", "head"
#: The FFN's sites (optional, calibrate_input_levels(ffn=True)): gate and up's shared input
#: (the FFN norm's output) and the down projection's input h = act(gate . x) * (up . x).
SITE_FFN, SITE_DOWN = "ffn", "down"


@dataclass
class InputCalibration:
    """Per-channel thresholds of every site and what they skip on the held-out tokens.

    A site's thresholds are ``t / gain_i`` (gain: wina's column norms, 1 for magnitude)
    for one criterion threshold ``t``, so that ``t`` can be refit later on other inputs
    (input_eval.refit) without the weights."""
    criterion: str
    sparsity: float
    qkv: list = field(default_factory=list)     # per layer f32 [n_embd]
    o: list = field(default_factory=list)       # per layer f32 [n_head * head_dim]
    head: np.ndarray | None = None              # f32 [n_embd]
    ffn: list = field(default_factory=list)     # per layer f32 [n_embd] (empty: no FFN sites)
    down: list = field(default_factory=list)    # per layer f32 [n_ff]
    heldout_sparsity: dict = field(default_factory=dict)  # site -> share skipped on held-out tokens
    n_fit: int = 0                              # the first n_fit recorded tokens (prof.input_ids)
    t: dict = field(default_factory=dict)       # (site, layer or None) -> criterion threshold
    gain: dict = field(default_factory=dict)    # (site, layer) -> [in] float64, or None (magnitude)
    # input_eval.refit: (site, layer) -> (share skipped in the runtime's sparse mode with the
    # dense-mode fit, after the refit: on the last profile pass's inputs), on the fit tokens
    sparse_mode: dict = field(default_factory=dict)
    max_ppl_increase: float | None = None       # the budget the level was chosen by (auto)
    ppl_increase: float | None = None           # the file's held-out increase measured with it

    def keys(self) -> list:
        """Every site's key in forward order: (qkv, 0), (o, 0), [(ffn, 0), (down, 0),]
        (qkv, 1), ..., (head, None)."""
        sites = (SITE_QKV, SITE_O, SITE_FFN, SITE_DOWN) if self.ffn else (SITE_QKV, SITE_O)
        return [(s, l) for l in range(len(self.qkv)) for s in sites] + [(SITE_HEAD, None)]

    def _per_layer(self, site: str) -> list:
        return {SITE_QKV: self.qkv, SITE_O: self.o, SITE_FFN: self.ffn, SITE_DOWN: self.down}[site]

    def thresholds(self, key) -> np.ndarray:
        """The stored thresholds of one site."""
        site, layer = key
        return self.head if site == SITE_HEAD else self._per_layer(site)[layer]

    def at(self, key, t: float) -> np.ndarray:
        """The site's per-channel thresholds for criterion threshold t."""
        return _per_channel(t, self.gain[key], self.thresholds(key).size)

    def set_t(self, key, t: float) -> None:
        """Move one site to criterion threshold t."""
        self.t[key] = float(t)
        thr = self.at(key, t)
        site, layer = key
        if site == SITE_HEAD:
            self.head = thr
        else:
            self._per_layer(site)[layer] = thr

    def summary(self) -> str:
        """One line: criterion, target and the held-out shares per site."""
        h = self.heldout_sparsity
        ffn = (f", FFN in {h.get(SITE_FFN, 0):.1%}, down in {h.get(SITE_DOWN, 0):.1%}"
               if self.ffn else "")
        return (f"{self.criterion}, target {self.sparsity:.0%}, fitted on {self.n_fit} tokens; skipped on "
                f"held-out tokens: q/k/v {h.get(SITE_QKV, 0):.1%}, o {h.get(SITE_O, 0):.1%}, "
                f"head {h.get(SITE_HEAD, 0):.1%}" + ffn)


def _per_channel(t: float, gain: np.ndarray | None, n_in: int) -> np.ndarray:
    """thr_i = t / gain_i (t for every channel without gains; NEVER for a zero gain)."""
    if t <= 0.0:
        return np.zeros(n_in, np.float32)
    if gain is None:
        return np.full(n_in, t, np.float32)
    with np.errstate(divide="ignore"):
        thr = np.where(gain > 0, t / np.maximum(gain, 1e-300), NEVER)
    return np.minimum(thr, NEVER).astype(np.float32)


def column_norms(w_t: np.ndarray) -> np.ndarray:
    """||W[:, i]|| for the transposed weight w_t [in, out] (row i = column i of W)."""
    return np.sqrt(np.einsum("ij,ij->i", w_t.astype(np.float64), w_t.astype(np.float64)))


def _scores(x: np.ndarray, gain: np.ndarray | None) -> np.ndarray:
    mag = np.abs(x.astype(np.float32))
    return mag if gain is None else mag * gain.astype(np.float32)


def criterion_t(x: np.ndarray, sparsity: float, gain: np.ndarray | None) -> float:
    """The criterion threshold t skipping the share ``sparsity`` of x [tokens, in]'s scores
    (|x_i| * gain_i; |x_i| without gains)."""
    return float(np.quantile(_scores(x, gain), sparsity))


def site_thresholds(x: np.ndarray, sparsity: float, criterion: str,
                    col_norm: np.ndarray | None = None) -> np.ndarray:
    """Per-channel thresholds f32 [in] skipping the share ``sparsity`` of x [tokens, in]'s
    entries under ``criterion`` (wina needs col_norm [in]); zeros at sparsity 0."""
    if criterion not in F.INPUT_CRITERIA:
        raise ValueError(f"criterion must be one of {', '.join(F.INPUT_CRITERIA)}, got {criterion!r}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"input sparsity must be in [0, 1), got {sparsity}")
    if sparsity == 0.0:
        return np.zeros(x.shape[1], np.float32)
    if criterion == "wina" and col_norm is None:
        raise ValueError("the wina criterion needs the weight's column norms")
    gain = np.asarray(col_norm, np.float64) if criterion == "wina" else None
    return _per_channel(criterion_t(x, sparsity, gain), gain, x.shape[1])


def skipped_share(x: np.ndarray, thr: np.ndarray) -> float:
    """Share of x [tokens, in]'s entries the runtime skips (|x_i| <= thr_i)."""
    return float((np.abs(x) <= thr[None, :]).mean()) if x.size else 0.0


def calibrate_inputs(prof, sparsity: float, criterion: str, weights_t, ffn: bool = False) -> InputCalibration:
    """Thresholds of every site from a profile recorded with inputs (profile_model(inputs=K)).
    weights_t(site, layer) -> the site's transposed weight [in, out] as float (wina's column
    norms; layer None for the head; with ffn also the FFN's: (ffn, l) gate and up side by
    side [d, 2 n_ff], (down, l) down_t [n_ff, d])."""
    return calibrate_input_levels(prof, [sparsity], criterion, weights_t, ffn)[0]


def down_inputs(x: np.ndarray, gate_up_t: np.ndarray, act: str, gated: bool = True,
                chunk: int = 2048) -> np.ndarray:
    """h = act(x . gate) * (x . up) [tokens, n_ff] f32, the down projection's input, from the FFN
    inputs x [tokens, d] and gate_up_t [d, 2 n_ff] (gate's outputs then up's; ungated [d, n_ff]:
    h = act(x . up))."""
    ff = gate_up_t.shape[1] // (2 if gated else 1)
    w = gate_up_t.astype(np.float32)
    out = []
    for s in range(0, x.shape[0], chunk):
        gu = x[s:s + chunk].astype(np.float32) @ w
        a = activation(act, gu[:, :ff])
        out.append((a * gu[:, ff:] if gated else a).astype(np.float32))
    return np.concatenate(out, axis=0)


def calibrate_input_levels(prof, levels, criterion: str, weights_t, ffn: bool = False) -> list[InputCalibration]:
    """calibrate_inputs at several levels at once (each site's scores sorted once). With ffn,
    the FFN's sites too, fitted on the profile's FFN inputs (prof.x, dense-mode ones: the
    sparse-mode refit covers the attention's and head's sites only) and the h they give."""
    k = prof.n_input_tokens
    if k < 2:
        raise ValueError("the profile recorded no projection inputs (profile_model(..., inputs=K))")
    levels = [float(s) for s in levels]
    for s in levels:
        if not 0.0 <= s < 1.0:
            raise ValueError(f"input sparsity must be in [0, 1), got {s}")
    n_fit = max(1, k - max(1, int(round(k * HOLDOUT))))
    cals = [InputCalibration(criterion=criterion, sparsity=s, n_fit=n_fit) for s in levels]
    held: list = [{SITE_QKV: [], SITE_O: [], SITE_HEAD: [], SITE_FFN: [], SITE_DOWN: []} for _ in levels]

    def fit(site, layer, x):
        gain = column_norms(weights_t(site, layer)) if criterion == "wina" else None
        q = np.quantile(_scores(x[:n_fit], gain), levels).astype(np.float64)
        key = (site, layer)
        for i, (cal, s) in enumerate(zip(cals, levels)):
            cal.gain[key] = gain
            cal.t[key] = float(q[i]) if s > 0 else 0.0
            thr = _per_channel(cal.t[key], gain, x.shape[1])
            held[i][site].append(skipped_share(x[n_fit:k], thr))
            yield thr

    for l in range(prof.n_layer):
        for cal, thr in zip(cals, fit(SITE_QKV, l, prof.attn_in[l][:k])):
            cal.qkv.append(thr)
        for cal, thr in zip(cals, fit(SITE_O, l, prof.attn_out_in[l][:k])):
            cal.o.append(thr)
        if ffn:
            x = prof.x[l][:k]
            for cal, thr in zip(cals, fit(SITE_FFN, l, x)):
                cal.ffn.append(thr)
            gu = weights_t(SITE_FFN, l)
            gated = gu.shape[1] == 2 * weights_t(SITE_DOWN, l).shape[0]
            for cal, thr in zip(cals, fit(SITE_DOWN, l, down_inputs(x, gu, prof.ffn_act, gated))):
                cal.down.append(thr)
    for cal, thr in zip(cals, fit(SITE_HEAD, None, prof.head_in[:k])):
        cal.head = thr
    for cal, h in zip(cals, held):
        cal.heldout_sparsity = {s: float(np.mean(v)) for s, v in h.items() if v}
    return cals


class InputSources:
    """The transposed projections of a dense plan (its TensorJobs): their float weights
    (wina's column norms) and the jobs that write them with their thresholds."""

    def __init__(self, jobs, n_layer: int, n_ff: int):
        self.by_name = {j.name: j for j in jobs}
        self.n_layer = n_layer
        self.n_ff = n_ff

    def _job(self, kind: str, layer: int | None = None):
        return self.by_name.get(F.tensor_name(kind, layer))

    @staticmethod
    def _float(job) -> np.ndarray:
        a = job.load()
        if job.raw:  # a GGUF input's tensor: its encoded bytes
            a = decode_matrix(np.asarray(a), job.qtype, job.shape)
        return np.asarray(a, dtype=np.float32)

    def _ffn(self, layer: int) -> FFNView:
        def rows(name):
            j = self.by_name.get(name)
            return None if j is None else int(j.shape[0])
        return ffn_view(rows, layer, self.n_ff)

    def _sources(self, site: str, layer: int | None) -> list:
        """The jobs whose rows, concatenated, are the site's projection (ffn_view.py)."""
        if site == SITE_FFN:  # gate's rows, then up's (an ungated FFN: its up rows alone)
            return [self.by_name.get(n) for n in self._ffn(layer).inputs]
        if site == SITE_DOWN:
            return [self.by_name.get(self._ffn(layer).down)]
        if site == SITE_QKV:
            return [self.by_name.get(n) for n in attention_inputs(self.by_name, layer)]
        if site == SITE_O:
            return [self._job(F.T_ATTN_OUTPUT, layer)]
        out = self._job(F.T_OUTPUT)
        return [out if out is not None else self._job(F.T_TOKEN_EMBD)]  # tied: the embedding

    def weight_t(self, site: str, layer: int | None) -> np.ndarray:
        """The site's weight transposed [in, out] in float32 (q, k, v rows concatenated)."""
        srcs = self._sources(site, layer)
        if any(j is None for j in srcs):
            raise ValueError(f"the dense plan lacks the {site} projection of layer {layer}")
        if srcs[0].name == F.tensor_name(F.T_FFN_DOWN_T, layer):
            return self._float(srcs[0])  # stored transposed already
        w = np.concatenate([self._float(j) for j in srcs], axis=0)
        return np.ascontiguousarray(w.T)

    def qtype(self, site: str, layer: int | None, out_len: int):
        """Storage of the transposed weight: its source's type, if the new rows (out_len
        long) are whole blocks of it (else gguf_write.fit_rows's fallback)."""
        return fit_rows(self._sources(site, layer)[0].qtype, out_len)[0]

    def _pair(self, site, layer, thr, wkind, tkind):
        srcs = self._sources(site, layer)
        out_len = sum(int(j.shape[0]) for j in srcs)
        in_len = int(srcs[0].shape[1])
        wname = F.input_sparse_tensor_name(wkind, layer)
        tname = F.input_sparse_tensor_name(tkind, layer)
        thr = np.ascontiguousarray(thr, dtype=np.float32)
        return [TensorJob(wname, (in_len, out_len), self.qtype(site, layer, out_len),
                          lambda s=site, l=layer: self.weight_t(s, l)),
                TensorJob(tname, (in_len,), Q.F32, lambda a=thr: a)]

    def layer_jobs(self, cal: InputCalibration, layer: int) -> list:
        """attn_qkv_t, its thresholds, attn_output_t, its thresholds of one layer (and, when
        cal has the FFN's sites, ffn_gate_up_t, ffn_in_thr and ffn_down_in_thr)."""
        jobs = (self._pair(SITE_QKV, layer, cal.qkv[layer], F.T_ATTN_QKV_T, F.T_ATTN_QKV_IN_THR) +
                self._pair(SITE_O, layer, cal.o[layer], F.T_ATTN_OUTPUT_T, F.T_ATTN_OUTPUT_IN_THR))
        if cal.ffn:
            jobs += self._pair(SITE_FFN, layer, cal.ffn[layer], F.T_FFN_GATE_UP_T, F.T_FFN_IN_THR)
            down = np.ascontiguousarray(cal.down[layer], dtype=np.float32)
            jobs.append(TensorJob(F.input_sparse_tensor_name(F.T_FFN_DOWN_IN_THR, layer), (down.size,), Q.F32,
                                  lambda a=down: a))
        return jobs

    def head_jobs(self, cal: InputCalibration) -> list:
        """output_t and its thresholds."""
        return self._pair(SITE_HEAD, None, cal.head, F.T_OUTPUT_T, F.T_OUTPUT_IN_THR)


def input_kv(cal: InputCalibration) -> list:
    """(key, value, GGUFValueType) of an input-sparse file."""
    kv = [(F.KEY_INPUT_SPARSITY, float(cal.sparsity), V.FLOAT32),
          (F.KEY_INPUT_CRITERION, cal.criterion, V.STRING)]
    if cal.max_ppl_increase is not None:
        kv.append((F.KEY_INPUT_MAX_PPL_INCREASE, float(cal.max_ppl_increase), V.FLOAT32))
        kv.append((F.KEY_INPUT_PPL_INCREASE, float(cal.ppl_increase or 0.0), V.FLOAT32))
    return kv
