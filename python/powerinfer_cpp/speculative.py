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


def _truncate(ctx: Context, ptr, n: int) -> None:
    """Context.reset(n) with the context's lock already held."""
    check(lib.gh_context_truncate(ptr, n))
    del ctx._cached[n:]
    ctx._n_exact = min(ctx._n_exact, n)
    ctx._changed()


def _last_logits(ctx: Context, ptr, row: int = -1) -> np.ndarray:
    nv = ctx.model.n_vocab
    return np.frombuffer(ffi.buffer(lib.gh_get_logits(ptr, row), nv * 4), dtype=np.float32)


class _Part:
    """One context's tokens in a pass (model.eval_batch's `parts`): a draft step or a
    verification of a speculative round. `key` is what the contexts of one pass share
    (Generation.batch_key's, with the draft model's identity where it is not the target)."""

    def __init__(self, ctx: Context, key: tuple, n: int, logits_all: bool, begin, end,
                 owner: "SpeculativeGeneration"):
        self.ctx, self.key, self.n, self.logits_all = ctx, key, n, logits_all  # n: tokens
        self._begin, self._end, self._owner = begin, end, owner

    def begin(self, ptr, stack) -> list[int]:
        return self._begin(ptr, stack)

    def settle(self) -> None:
        gen = self._owner
        if self.ctx is gen.ctx:
            gen._mine = gen.ctx._use  # our own call: the generation carries on

    def end(self, ptr) -> None:
        self._end(ptr)


def _set_mode(stack, ptr, mode: int, sparse_batch: int) -> None:
    """The context's FFN mode and sparse batch for one pass, restored after it."""
    old_mode, old_sb = lib.gh_context_get_ffn_mode(ptr), lib.gh_context_get_sparse_batch(ptr)
    check(lib.gh_context_set_ffn_mode(ptr, mode))
    stack.callback(lambda: (check(lib.gh_context_set_ffn_mode(ptr, old_mode)),
                            check(lib.gh_context_set_sparse_batch(ptr, old_sb))))
    check(lib.gh_context_set_sparse_batch(ptr, sparse_batch))


def _ctx_key(ptr, n_tokens: int) -> tuple:
    """Generation.batch_key of a context about to evaluate n_tokens (its lock held)."""
    mode = int(lib.gh_context_get_ffn_mode(ptr))
    if mode == FFN_MODES["dense"] or lib.gh_context_get_sparse_batch(ptr) < n_tokens:
        return ("dense",)
    return (mode, bool(lib.gh_context_get_input_sparse(ptr)))


class _SelfDrafter:
    """The target file's sparse mode drafts in the target context itself (its cache then
    holds the drafts' sparse keys and values, which the verification overwrites)."""

    shares_target = True

    def __init__(self, ctx: Context, mode: str):
        self.ctx, self.mode, self.name = ctx, mode, f"self ({mode})"

    def part(self, gen: "SpeculativeGeneration", ids: list[int], seq: list[int], on_logits):
        """The next draft step: ids (the last decided token, then each draft) through the
        sparse FFN in the target context."""
        ctx, mode = self.ctx, FFN_MODES[self.mode]
        with ctx._calling() as ptr:
            key = (mode, bool(lib.gh_context_get_input_sparse(ptr)))

        def begin(ptr, stack):
            _set_mode(stack, ptr, mode, max(lib.gh_context_get_sparse_batch(ptr), len(ids)))
            return ids

        return _Part(ctx, key, len(ids), False, begin,
                     lambda ptr: on_logits(_last_logits(ctx, ptr)), gen)


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

    def part(self, gen: "SpeculativeGeneration", ids: list[int], seq: list[int], on_logits):
        """The next draft step: the draft context catches up with seq (the decided tokens
        and the drafts so far: its cache keeps their longest common prefix, at least the
        last token is evaluated)."""
        dctx = self.dctx
        with dctx._calling() as dptr:
            cached, keep = dctx._cached, 0
            limit = min(len(cached), len(seq) - 1)
            while keep < limit and cached[keep] == seq[keep]:
                keep += 1
            key = ("draft", id(dctx.model)) + _ctx_key(dptr, len(seq) - keep)

        def begin(ptr, stack):
            cached, keep = dctx._cached, 0
            limit = min(len(cached), len(seq) - 1)
            while keep < limit and cached[keep] == seq[keep]:
                keep += 1
            _truncate(dctx, ptr, keep)
            return seq[keep:]

        return _Part(dctx, key, len(seq) - keep, False, begin,
                     lambda ptr: on_logits(_last_logits(dctx, ptr)), gen)


class SpeculativeGeneration(Generation):
    """Generation that decodes speculatively: step() drafts k tokens, verifies them in one
    dense pass and queues the tokens it decided (the kept drafts and one drawn from the
    dense model), which the following sample() calls hand out one by one. A scheduler may
    instead evaluate each part of a round (batch_part: a draft step, the verification) in
    a pass shared with other generations (model.eval_batch `parts`)."""

    def __init__(self, *args, drafter, draft_max: int, greedy: bool, **kw):
        super().__init__(*args, **kw)
        self.drafter = drafter
        self.draft_max = draft_max
        self.greedy = greedy
        self.k = min(START_K, draft_max)
        self.queue: list[int] = []  # decided tokens not handed out yet
        self._round: dict | None = None  # the round in progress (drafts so far, ...)
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

    # -- the steps -------------------------------------------------------------

    def _pick(self) -> int:
        if self.queue:
            if self.ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            return self.queue.pop(0)
        return super()._pick()

    def batchable(self) -> bool:
        return False  # its tokens join a pass as parts (batch_part), not as next_token

    def skip_cached(self) -> bool:
        """After sample() handed out a kept draft (already in the cache, so nothing to
        evaluate): True, and the next one may be sampled now."""
        if self.queue and self.next_token is not None and not self.done:
            if self.ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            self.next_token = None
            return True
        return False

    def step(self) -> None:
        """Evaluate next_token alone: a verified draft is in the cache already; else a whole
        round (draft, verify, queue the decided tokens), or with no room for a draft, the
        token densely."""
        if self.skip_cached():
            return
        while self.next_token is not None and not self.done:
            part = self.batch_part()
            if part is None:
                break
            self.run_part(part)

    def run_part(self, part: "_Part") -> None:
        """Evaluate one of batch_part()'s parts alone (gh_eval)."""
        with part.ctx._calling() as ptr, contextlib.ExitStack() as stack:
            ids = part.begin(ptr, stack)
            try:
                part.ctx._eval_ids(ptr, ids, part.logits_all)
            finally:
                part.settle()
            part.end(ptr)

    def batch_part(self):
        """The tokens this generation evaluates next, as a part of a pass (model.eval_batch
        `parts`; its `key` says which pass): a draft step, the verification of the drafts,
        or (no room for a draft) next_token densely; None when it has nothing to evaluate
        (its context is full: done). A round takes k + 1 passes: k draft steps, then the
        verification, which queues the tokens it decided."""
        if self.next_token is None or self.done:
            return None
        ctx = self.ctx
        if self._round is None:
            with ctx._calling() as ptr:
                if not self._claim(ptr):
                    return None
                n = lib.gh_context_n_past(ptr)
                # the round emits up to k + 1 tokens into the cache's free room
                k = min(self.k, self.max_tokens - self.n_gen - 1,
                        lib.gh_context_n_ctx(ptr) - n - 1)
            if k < 1:
                return self._dense_part()
            self._round = {"n": n, "k": k, "t_n": self.next_token, "drafts": [], "qs": [],
                           "t0": time.perf_counter()}
        r = self._round
        if len(r["drafts"]) < r["k"] and not (
                r["drafts"] and r["drafts"][-1] == self.eos and not self.ignore_eos):
            last = r["drafts"][-1] if r["drafts"] else r["t_n"]
            seq = self.prompt_ids + self.result.tokens + r["drafts"]
            return self.drafter.part(self, [last], seq, self._drafted)
        return self._verify_part()

    def _dense_part(self) -> "_Part":
        ctx, t_n = self.ctx, self.next_token

        def begin(ptr, stack):
            if ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            _set_mode(stack, ptr, lib.gh_context_get_ffn_mode(ptr), 0)
            return [t_n]

        def end(ptr):
            self.next_token = None  # _pick samples from its logits

        return _Part(ctx, ("dense",), 1, False, begin, end, self)

    def _drafted(self, logits: np.ndarray) -> None:
        """A draft step's logits: the next draft token from q."""
        r = self._round
        q = self._probs(logits, r["drafts"])
        r["drafts"].append(self._draw(q))
        r["qs"].append(q)

    def _verify_part(self) -> "_Part":
        """t_n and the drafts through the dense FFN, every token's logits kept."""
        ctx, r = self.ctx, self._round
        r["t1"] = time.perf_counter()

        def begin(ptr, stack):
            if ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            if self.drafter.shares_target:  # the drafts' sparse keys and values go
                _truncate(ctx, ptr, r["n"])
            if lib.gh_context_n_past(ptr) != r["n"]:
                raise RuntimeError(_INTERFERED)
            _set_mode(stack, ptr, lib.gh_context_get_ffn_mode(ptr), 0)
            return [r["t_n"]] + r["drafts"]

        return _Part(ctx, ("dense",), len(r["drafts"]) + 1, True, begin, self._verified, self)

    def _verified(self, ptr) -> None:
        """The verification's logits: keep the longest agreeing prefix of the drafts, draw
        the token after it, and queue them for sample()."""
        ctx, r = self.ctx, self._round
        drafts, qs, n = r["drafts"], r["qs"], r["n"]
        if lib.gh_n_logit_rows(ptr) < len(drafts) + 1:
            raise RuntimeError("speculative verification: the batch's logits are missing")
        rows = lib.gh_n_logit_rows(ptr)
        first = rows - (len(drafts) + 1)  # (a lone evaluation keeps exactly these rows)
        kept: list[int] = []
        token = None
        for i, d in enumerate(drafts):
            p = self._probs(_last_logits(ctx, ptr, first + i), drafts[:i])
            q = qs[i]
            if self.greedy:
                ok = p[d] > 0
            else:
                ok = lib.gh_sampler_random(self.sampler) * q[d] < p[d]
            if ok:
                kept.append(d)
                continue
            res = np.maximum(p - q, 0.0)
            token = self._draw(res if res.sum() > 0 else p)
            break
        if token is None:
            token = self._draw(self._probs(_last_logits(ctx, ptr, first + len(drafts)),
                                           drafts))
        _truncate(ctx, ptr, n + 1 + len(kept))
        self._mine = ctx._use
        self.queue = kept + [token]
        self.next_token = None
        self._round = None
        t2 = time.perf_counter()
        st, k = self.spec, r["k"]
        st.rounds += 1
        st.drafted += len(drafts)
        st.accepted += len(kept)
        st.draft_s += r["t1"] - r["t0"]
        st.verify_s += t2 - r["t1"]
        # k follows the acceptance: longer after a fully kept draft, shorter after an early
        # rejection (EOS-shortened drafts say nothing about k)
        if len(drafts) == k and len(kept) == k:
            self.k = min(self.k + 1, self.draft_max)
        elif len(kept) < len(drafts) // 2:
            self.k = max(self.k - 1, 1)

    def finish(self) -> None:
        super().finish()
        self.result.timings["speculative"] = self.spec.as_dict()
