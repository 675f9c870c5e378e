"""Speculative decoding: a cheap drafter proposes k tokens one at a time, the dense model
checks all of them in ONE batched pass (each weight read once for k + 1 tokens), and the
longest agreeing prefix is kept, so the output is the dense model's.

Drafters:
- "self": the same file in its sparse FFN mode (predictors: GH_FFN_SPARSE, gate thresholds:
  GH_FFN_GATE), drafting into the target context's own KV cache; the verification rolls the
  cache back (gh_context_truncate) and writes the dense keys and values over the drafts.
- a draft model (another GGUF with the same vocabulary: a smaller model, or the same model
  converted at a more aggressive sparsity), with a KV cache of its own that follows the
  accepted tokens (kept up to the longest common prefix, the rest evaluated again).

Acceptance is standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): the
draft token x drawn from q is kept with probability min(1, p(x) / q(x)); at the first
rejection the token is drawn from norm(max(0, p - q)); when all k are kept one more is drawn
from p. p and q are the distributions the sampler draws from (gh_sampler_probs: repetition
penalty, temperature, top-k, top-p, min-p, and the logits processor, each with the drafted
tokens as history), so the tokens follow the dense model's sampled distribution exactly;
greedy (temperature <= 0) p and q are one-hot and this is "keep while the argmax agrees".
All random numbers come from the sampler's seeded stream (gh_sampler_random).

Verification runs k + 1 tokens through the multi-token matmul tiles, plain decode one token
through the one-token tiles; where a type's two tiles sum in a different order the logits
differ by rounding (see gh_eval_batch in ggml-hybrid.h), so a near-tie between the two best
tokens can in principle break the other way. The tests compare whole greedy generations
token for token.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ._native import check, ffi, lib
from .model import FFN_MODES, Context, Generation, Model, _INTERFERED, _int_arg

#: Default of draft_max: most tokens drafted per verification.
DEFAULT_DRAFT_MAX = 8
#: Upper bound of draft_max (the verification batch must fit the context's n_batch too).
DRAFT_MAX_LIMIT = 64
#: k of the first round (then adapted to the acceptance, within [1, draft_max]).
START_K = 4

# draft Models loaded from a path, per target Model (loaded once; freed with the target)
_draft_models: "weakref.WeakKeyDictionary[Model, dict]" = weakref.WeakKeyDictionary()
# the draft model's context that follows each target context
_draft_contexts: "weakref.WeakKeyDictionary[Context, dict]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()  # both caches (server slots start generations side by side)


@dataclass
class SpeculativeStats:
    """What a speculative generation did: verification rounds, tokens drafted and kept,
    and the seconds spent drafting and verifying (timings["speculative"] of the Completion)."""

    draft: str = ""
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance(self) -> float:
        """Drafted tokens kept / drafted tokens (0 if none were drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"draft": self.draft, "rounds": self.rounds, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": self.acceptance,
                "mean_k": self.drafted / self.rounds if self.rounds else 0.0,
                "tokens_per_round": (self.accepted + self.rounds) / self.rounds
                if self.rounds else 0.0,
                "draft_s": self.draft_s, "verify_s": self.verify_s}


def self_draft_mode(model: Model) -> str:
    """The FFN mode `draft="self"` drafts with: "sparse" (predictors) or "gate" (gate
    thresholds); ValueError naming what the file lacks when it has neither."""
    info = model.info
    full = info.has_down_t == info.n_layer
    if full and info.has_predictor == info.n_layer:
        return "sparse"
    if full and info.has_gate_threshold:
        return "gate"
    raise ValueError(
        f"draft='self' needs a sparse FFN mode to draft with, but {model.path} has none (no "
        "FFN predictors from `convert --sparse` on a ReLU model, no gate thresholds from "
        "`convert --sparsity S`); convert it with one, or pass a separate draft model "
        "(draft_model=FILE / --model-draft FILE)")


def check_vocab(model: Model, draft: Model) -> None:
    """ValueError naming the difference when the draft model's vocabulary is not the
    target's (speculation compares token ids)."""
    if draft.n_vocab != model.n_vocab:
        raise ValueError(
            f"the draft model {draft.path} has a vocabulary of {draft.n_vocab} tokens but "
            f"{model.path} has {model.n_vocab}; a draft model must share the vocabulary")
    a, b = model.tokenizer, draft.tokenizer
    for i in range(min(len(a), len(b))):
        ta, tb = a.token_to_bytes(i), b.token_to_bytes(i)
        if ta != tb:
            raise ValueError(
                f"the draft model {draft.path} has a different vocabulary from {model.path}: "
                f"token {i} is {tb!r} there and {ta!r} here; a draft model must share the "
                "vocabulary")
    if (a.eos_id, a.bos_id) != (b.eos_id, b.bos_id):
        raise ValueError(
            f"the draft model {draft.path} has other special tokens than {model.path} (eos "
            f"{b.eos_id} / bos {b.bos_id} there, {a.eos_id} / {a.bos_id} here)")


def load_draft_model(model: Model, path) -> Model:
    """The draft model in file `path` for `model` (loaded once per target model, with its
    thread count), its vocabulary checked."""
    key = os.path.realpath(os.fspath(path))
    with _cache_lock:
        cache = _draft_models.setdefault(model, {})
        draft = cache.get(key)
        if draft is None or draft._ptr is None:
            d = model._ctx_defaults
            draft = Model(path, n_threads=d["n_threads"], n_batch=d["n_batch"])
            try:
                check_vocab(model, draft)
            except BaseException:
                draft.close()
                raise
            cache[key] = draft
    return draft


def start_speculative(ctx: Context, draft, draft_max, greedy: bool, prompt_ids, sampler,
                      max_tokens, repeat_last_n, stops, ignore_eos, stats,
                      logits_processor) -> "SpeculativeGeneration":
    """Context.start_generation with a draft: the checked arguments' generation."""
    if draft is None:
        raise ValueError("draft_max needs a draft (draft='self' or a draft model)")
    draft_max = DEFAULT_DRAFT_MAX if draft_max is None else _int_arg("draft_max", draft_max)
    if not 1 <= draft_max <= DRAFT_MAX_LIMIT:
        raise ValueError(f"draft_max must be in [1, {DRAFT_MAX_LIMIT}], got {draft_max}")
    if isinstance(draft, str) and draft == "self":
        drafter = _SelfDrafter(ctx, self_draft_mode(ctx.model))
    else:
        if isinstance(draft, Model):
            dmodel = draft
            check_vocab(ctx.model, dmodel)
        elif isinstance(draft, (str, os.PathLike)):
            dmodel = load_draft_model(ctx.model, draft)
        else:
            raise TypeError(f"draft must be 'self', a Model or a GGUF file path, not "
                            f"{type(draft).__name__}")
        if dmodel is ctx.model:
            raise ValueError("the draft model is the model itself; use draft='self' (its "
                             "sparse mode drafts) or another file")
        drafter = _ModelDrafter(ctx, dmodel)
    return SpeculativeGeneration(ctx, prompt_ids, sampler, max_tokens, repeat_last_n, stops,
                                 ignore_eos, stats, logits_processor, drafter=drafter,
                                 draft_max=draft_max, greedy=greedy)


@contextlib.contextmanager
def _dense(ptr):
    """Every batch of the context through the dense FFN (and dense projections) meanwhile:
    the verifying model."""
    sb = lib.gh_context_get_sparse_batch(ptr)
    check(lib.gh_context_set_sparse_batch(ptr, 0))
    try:
        yield
    finally:
        check(lib.gh_context_set_sparse_batch(ptr, sb))


def _truncate(ctx: Context, ptr, n: int) -> None:
    """Context.reset(n) with the context's lock already held."""
    check(lib.gh_context_truncate(ptr, n))
    del ctx._cached[n:]
    ctx._n_exact = min(ctx._n_exact, n)
    ctx._changed()


def _last_logits(ctx: Context, ptr, row: int = -1) -> np.ndarray:
    nv = ctx.model.n_vocab
    return np.frombuffer(ffi.buffer(lib.gh_get_logits(ptr, row), nv * 4), dtype=np.float32)


class _SelfDrafter:
    """The target file's sparse mode drafts in the target context itself (its cache then
    holds the drafts' sparse keys and values, which the verification overwrites)."""

    shares_target = True

    def __init__(self, ctx: Context, mode: str):
        self.ctx, self.mode, self.name = ctx, mode, f"self ({mode})"

    def draft(self, gen: "SpeculativeGeneration", ptr, seq: list[int], k: int):
        ctx = self.ctx
        mode, sb = lib.gh_context_get_ffn_mode(ptr), lib.gh_context_get_sparse_batch(ptr)
        check(lib.gh_context_set_ffn_mode(ptr, FFN_MODES[self.mode]))
        check(lib.gh_context_set_sparse_batch(ptr, max(sb, 1)))
        try:
            return gen._draft_loop(lambda ids: (ctx._eval_ids(ptr, ids, False),
                                                _last_logits(ctx, ptr))[1], [seq[-1]], k)
        finally:
            check(lib.gh_context_set_ffn_mode(ptr, mode))
            check(lib.gh_context_set_sparse_batch(ptr, sb))


class _ModelDrafter:
    """A separate draft model with its own context, kept in step with the target's tokens
    (its cache keeps the longest common prefix with them)."""

    shares_target = False

    def __init__(self, ctx: Context, dmodel: Model):
        self.name = dmodel.path
        n_ctx = ctx.n_ctx
        with _cache_lock:
            per_ctx = _draft_contexts.setdefault(ctx, {})
            dctx = per_ctx.get(id(dmodel))
            if dctx is None or dctx._ptr is None or dctx.model is not dmodel:
                dctx = dmodel.create_context(n_ctx=n_ctx)
                per_ctx[id(dmodel)] = dctx
        self.dctx = dctx

    def draft(self, gen: "SpeculativeGeneration", ptr, seq: list[int], k: int):
        dctx = self.dctx
        with dctx._calling() as dptr:
            cached, keep = dctx._cached, 0
            limit = min(len(cached), len(seq) - 1)  # at least the last token is evaluated
            while keep < limit and cached[keep] == seq[keep]:
                keep += 1
            _truncate(dctx, dptr, keep)
            return gen._draft_loop(lambda ids: (dctx._eval_ids(dptr, ids, False),
                                                _last_logits(dctx, dptr))[1], seq[keep:], k)


class SpeculativeGeneration(Generation):
    """Generation that decodes speculatively: step() drafts k tokens, verifies them in one
    dense pass and queues the tokens it decided (the kept drafts and one drawn from the
    dense model), which the following sample() calls hand out one by one. Not batchable
    (the server's scheduler steps it alone)."""

    def __init__(self, *args, drafter, draft_max: int, greedy: bool, **kw):
        super().__init__(*args, **kw)
        self.drafter = drafter
        self.draft_max = draft_max
        self.greedy = greedy
        self.k = min(START_K, draft_max)
        self.queue: list[int] = []  # decided tokens not handed out yet
        self.spec = SpeculativeStats(draft=drafter.name)
        self._probs_buf = np.empty(self.ctx.model.n_vocab, dtype=np.float32)

    # -- the distributions -----------------------------------------------------

    def _probs(self, logits: np.ndarray, extra: list[int]) -> np.ndarray:
        """The sampler's distribution for logits after the history and `extra` (float64)."""
        if self.logits_processor is not None:
            nv = logits.shape[0]
            logits = np.ascontiguousarray(
                self.logits_processor(self.prompt_ids + self.result.tokens + extra,
                                      logits.copy()), dtype=np.float32)
            if logits.shape != (nv,):
                raise ValueError(f"logits_processor returned shape {logits.shape}; it must "
                                 f"return the logits it was given, shape ({nv},)")
        ext = np.asarray(extra, dtype=np.int32)
        check(lib.gh_sampler_probs(self.sampler, ffi.from_buffer("float[]", logits),
                                   ffi.from_buffer("int32_t[]", ext) if ext.size else ffi.NULL,
                                   ext.size, ffi.from_buffer("float[]", self._probs_buf,
                                                             require_writable=True)))
        return self._probs_buf.astype(np.float64)

    def _draw(self, probs: np.ndarray) -> int:
        """A token from probs (greedy: its one token) with the sampler's random stream."""
        if self.greedy:
            return int(np.argmax(probs))
        cdf = np.cumsum(probs)
        u = lib.gh_sampler_random(self.sampler) * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), len(probs) - 1))

    def _draft_loop(self, run, first: list[int], k: int):
        """Up to k draft tokens: run(ids) evaluates ids in the drafting context and returns
        the last logits; `first` are the tokens it has not seen yet (ending with the last
        decided token). Stops early after an end-of-sequence draft."""
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        ids = first
        while len(drafts) < k:
            q = self._probs(run(ids), drafts)
            tok = self._draw(q)
            drafts.append(tok)
            qs.append(q)
            if tok == self.eos and not self.ignore_eos:
                break
            ids = [tok]
        return drafts, qs

    # -- the steps -------------------------------------------------------------

    def _pick(self) -> int:
        if self.queue:
            if self.ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            return self.queue.pop(0)
        return super()._pick()

    def batchable(self) -> bool:
        return False

    def step(self) -> None:
        """Evaluate next_token: a verified draft is in the cache already; else draft, verify
        and queue the decided tokens (or, with no room for a draft, evaluate it densely)."""
        if self.queue:
            if self.ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            self.next_token = None
            return
        ctx = self.ctx
        with ctx._calling() as ptr:
            if self._claim(ptr):
                self._round(ctx, ptr)
                self._mine = ctx._use
                self.next_token = None

    def _round(self, ctx: Context, ptr) -> None:
        t_n = self.next_token
        n = lib.gh_context_n_past(ptr)
        # the round emits up to k + 1 tokens into the cache's free room
        k = min(self.k, self.max_tokens - self.n_gen - 1, lib.gh_context_n_ctx(ptr) - n - 1)
        if k < 1:
            with _dense(ptr):
                ctx._eval_ids(ptr, [t_n], False)
            return  # _pick samples from its logits
        seq = self.prompt_ids + self.result.tokens
        t0 = time.perf_counter()
        try:
            drafts, qs = self.drafter.draft(self, ptr, seq, k)
        finally:
            if self.drafter.shares_target:
                _truncate(ctx, ptr, n)
        t1 = time.perf_counter()
        with _dense(ptr):
            ctx._eval_ids(ptr, [t_n] + drafts, True)
        if lib.gh_n_logit_rows(ptr) != len(drafts) + 1:
            raise RuntimeError("speculative verification: the batch's logits are missing")
        kept: list[int] = []
        token = None
        for i, d in enumerate(drafts):
            p = self._probs(_last_logits(ctx, ptr, i), drafts[:i])
            q = qs[i]
            if self.greedy:
                ok = p[d] > 0
            else:
                ok = lib.gh_sampler_random(self.sampler) * q[d] < p[d]
            if ok:
                kept.append(d)
                continue
            r = np.maximum(p - q, 0.0)
            token = self._draw(r if r.sum() > 0 else p)
            break
        if token is None:
            token = self._draw(self._probs(_last_logits(ctx, ptr, len(drafts)), drafts))
        _truncate(ctx, ptr, n + 1 + len(kept))
        self.queue = kept + [token]
        t2 = time.perf_counter()
        st = self.spec
        st.rounds += 1
        st.drafted += len(drafts)
        st.accepted += len(kept)
        st.draft_s += t1 - t0
        st.verify_s += t2 - t1
        # k follows the acceptance: longer after a fully kept draft, shorter after an early
        # rejection (EOS-shortened drafts say nothing about k)
        if len(drafts) == k and len(kept) == k:
            self.k = min(self.k + 1, self.draft_max)
        elif len(kept) < len(drafts) // 2:
            self.k = max(self.k - 1, 1)

    def finish(self) -> None:
        super().finish()
        self.result.timings["speculative"] = self.spec.as_dict()
