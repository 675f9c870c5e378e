"""Speculative decoding: a cheap drafter proposes k tokens one at a time, the dense model
checks all of them in ONE batched pass (each weight read once for k + 1 tokens), and the
longest agreeing prefix is kept, so the output is the dense model's.

Drafters:
- "self": the same file in its sparse FFN mode (predictors: GH_FFN_SPARSE, gate thresholds:
  GH_FFN_GATE), drafting into the target context's own KV cache; the verification rolls the
  cache back (gh_context_truncate) and writes the dense keys and values over the drafts.
  "self:ffn=M,vocab=N,skip=L" (SelfDraft) makes the draft cheaper still: a head over a
  vocabulary subset (gh_context_set_head_rows) and layers passed over
  (gh_context_set_layer_skip).
- "lookup": prompt lookup decoding, the continuation of the context's last n-gram where it
  occurred before; no model runs.

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
All random numbers come from the sampler's seeded stream (gh_sampler_random). Greedy
decoding also picks each round's k by the measured costs (_CostModel), down to plain decode
where drafting does not pay.


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
from typing import TYPE_CHECKING

import numpy as np

from ._native import check, ffi, lib
from .arguments import int_arg as _int_arg
from .generation import INTERFERED as _INTERFERED
from .generation import Generation
from .handles import FFN_MODES, ModelHandle

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

#: Default of draft_max: most tokens drafted per verification.
DEFAULT_DRAFT_MAX = 8
#: Upper bound of draft_max (the verification batch must fit the context's n_batch too).
DRAFT_MAX_LIMIT = 64
#: k of the first round (then adapted to the acceptance, within [1, draft_max]).
START_K = 4
#: Greedy decoding's cost policy: while plain decode is estimated faster than every k, one
#: speculative round of one draft after this many plain tokens keeps the acceptance and
#: costs current (a longer probe of a drafter that does not pay lost 15% on SmolLM2).
PROBE_EVERY = 16
#: Weight of a new measurement in the cost policy's running averages.
EMA = 0.3

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


@dataclass(frozen=True)
class SelfDraft:
    """How the model drafts for itself (`draft=SelfDraft(...)`, or the string
    "self:ffn=gate,vocab=8192,skip=12-17" that parse_self_draft reads; "self" alone is the
    file's sparse FFN mode with the full head and every layer, as before):

    - ffn: the draft's FFN mode, "sparse", "gate" or "dense"; None: the file's sparse mode
      (predictors, else gate thresholds), else dense when head rows or skipped layers make
      the draft cheaper anyway;
    - vocab: > 0 drafts over a subset of the vocabulary: the head computes the logits of
      the `vocab` lowest token ids (a byte-level BPE numbers its tokens in merge order,
      i.e. roughly by frequency in the tokenizer's corpus) plus every token of the prompt
      and of the generation so far, the rest of the head's rows are not read (0: the full
      head);
    - skip: layers the draft passes over (their attention and FFN do not run), as in
      LayerSkip / Draft & Verify / SWIFT.

    Every choice is lossless: the dense model verifies each draft, and the draft
    distribution q that speculative sampling divides by is the one the draft token was
    drawn from (tokens outside the subset have q = 0 and are reached through the residual
    max(0, p - q))."""

    ffn: str | None = None
    vocab: int = 0
    skip: tuple = ()

    def describe(self) -> str:
        parts = [f"ffn={self.ffn}" if self.ffn else ""]
        if self.vocab:
            parts.append(f"vocab={self.vocab}")
        if self.skip:
            parts.append("skip=" + ",".join(str(i) for i in self.skip))
        return "; ".join(p for p in parts if p)


def parse_self_draft(text: str) -> SelfDraft:
    """SelfDraft from "self" or "self:KEY=VALUE,..." (keys ffn, vocab, skip; skip takes
    layer numbers and ranges joined by '+' or ',': skip=10-17+20); ValueError naming the
    problem."""
    if text == "self":
        return SelfDraft()
    if not text.startswith("self:"):
        raise ValueError(f"a self draft is 'self' or 'self:ffn=M,vocab=N,skip=A-B', not {text!r}")
    ffn, vocab, skip, key = None, 0, [], None
    for item in text[len("self:"):].split(","):
        if "=" in item:
            key, _, val = item.partition("=")
            key = key.strip()
        elif key == "skip":  # skip=3,5-7: the list goes on after commas
            val = item
        else:
            raise ValueError(f"self draft option {item!r} is not KEY=VALUE (ffn, vocab, skip)")
        val = val.strip()
        if key == "ffn":
            ffn = val
        elif key == "vocab":
            if not val.isdigit():
                raise ValueError(f"self draft vocab must be a number of tokens, not {val!r}")
            vocab = int(val)
        elif key == "skip":
            for part in val.split("+"):
                a, dash, b = part.partition("-")
                if not a.strip().isdigit() or (dash and not b.strip().isdigit()):
                    raise ValueError(f"self draft skip takes layers and ranges (3, 10-17), "
                                     f"not {part!r}")
                skip.extend(range(int(a), int(b) + 1) if dash else [int(a)])
        else:
            raise ValueError(f"unknown self draft option {key!r} (ffn, vocab, skip)")
    return SelfDraft(ffn=ffn, vocab=vocab, skip=tuple(sorted(set(skip))))


def as_self_draft(draft) -> SelfDraft | None:
    """The SelfDraft that `draft` ("self", "self:...", a SelfDraft) names, else None."""
    if isinstance(draft, SelfDraft):
        return draft
    if isinstance(draft, str) and (draft == "self" or draft.startswith("self:")):
        return parse_self_draft(draft)
    return None


#: Longest n-gram a lookup draft matches by default ("lookup" = "lookup:3").
LOOKUP_NGRAM = 3


def as_lookup_draft(draft) -> int | None:
    """The longest n-gram of a lookup draft ("lookup" or "lookup:N", 1 <= N <= 8), else
    None; ValueError for a malformed one."""
    if not isinstance(draft, str) or not (draft == "lookup" or draft.startswith("lookup:")):
        return None
    if draft == "lookup":
        return LOOKUP_NGRAM
    n = draft[len("lookup:"):]
    if not n.isdigit() or not 1 <= int(n) <= 8:
        raise ValueError(f"a lookup draft is 'lookup' or 'lookup:N' (longest n-gram, 1..8), "
                         f"not {draft!r}")
    return int(n)


def check_self_draft(model: Model, sd: SelfDraft) -> str:
    """The FFN mode name the self draft `sd` runs with on `model`, its options checked
    (ValueError naming the problem)."""
    nl = model.info.n_layer
    bad = [i for i in sd.skip if not 0 <= i < nl]
    if bad:
        raise ValueError(f"self draft skip: layer {bad[0]} is outside the model's {nl} layers")
    if len(sd.skip) >= nl:
        raise ValueError("self draft skip: the draft must keep at least one layer")
    if not 0 <= sd.vocab <= model.n_vocab:
        raise ValueError(f"self draft vocab must be in [0, {model.n_vocab}], got {sd.vocab}")
    if sd.ffn is not None:
        if sd.ffn not in ("sparse", "gate", "dense"):
            raise ValueError(f"self draft ffn must be sparse, gate or dense, not {sd.ffn!r}")
        if sd.ffn != "dense":
            mode = self_draft_mode(model, required=True)
            if sd.ffn == "sparse" and mode != "sparse" or sd.ffn == "gate" and \
                    not model.info.has_gate_threshold:
                raise ValueError(f"self draft ffn={sd.ffn}: {model.path} has no {sd.ffn} mode "
                                 f"(it has {mode})")
        return sd.ffn
    mode = self_draft_mode(model, required=not (sd.vocab or sd.skip))
    return mode or "dense"


def resolve_draft(model: Model, draft):
    """A draft given by name or path, checked against `model`: a lookup or self draft's
    string as it is, a file loaded as a draft model (load_draft_model)."""
    if as_lookup_draft(draft) is not None:
        return draft
    sd = as_self_draft(draft)
    if sd is not None:
        check_self_draft(model, sd)
        return draft
    return load_draft_model(model, draft)


def serves_dense(draft, ffn: str) -> bool:
    """Whether the target's own contexts run the dense FFN: with a self draft the file's
    sparse mode is the drafter and the output is the dense model's, so what is decoded
    without drafting (a grammar, a logit bias, a probe of the cost policy) is the dense
    model's too; an explicit ffn other than "auto" is kept."""
    return ffn == "auto" and isinstance(draft, str) and as_self_draft(draft) is not None


def self_draft_mode(model: Model, required: bool = True) -> str | None:
    """The FFN mode `draft="self"` drafts with: "sparse" (predictors) or "gate" (gate
    thresholds); when the file has neither, ValueError naming what it lacks (required)
    or None."""
    info = model.info
    full = info.has_down_t == info.n_layer
    if full and info.has_predictor == info.n_layer:
        return "sparse"
    if full and info.has_gate_threshold:
        return "gate"
    if not required:
        return None
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
            draft = model._load_draft(path)
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
    sd = as_self_draft(draft)
    lk = as_lookup_draft(draft)
    if lk is not None:
        drafter = _LookupDrafter(ctx, lk)
    elif sd is not None:
        drafter = _SelfDrafter(ctx, check_self_draft(ctx.model, sd), sd)
    else:
        if isinstance(draft, ModelHandle):
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
    """The target file drafts in the target context itself, in its sparse FFN mode, over a
    subset of the vocabulary and through a subset of the layers (SelfDraft); the cache then
    holds the drafts' keys and values (none in skipped layers), which the verification
    truncates and writes densely."""

    shares_target = True
    passless = False

    def __init__(self, ctx: Context, mode: str, sd: SelfDraft):
        self.ctx, self.mode, self.sd = ctx, mode, sd
        extra = sd.describe()
        self.name = f"self ({mode}{'; ' + extra if extra else ''})"
        nl = ctx.model.info.n_layer
        self.skip = None
        if sd.skip:
            self.skip = np.zeros(nl, dtype=np.uint8)
            self.skip[list(sd.skip)] = 1
        # the head's rows: the lowest ids, then the context's tokens as they appear
        self.vocab: set[int] = set(range(sd.vocab)) if sd.vocab else set()
        self.head_ids: np.ndarray | None = None

    def _head_ids(self, seq: list[int]) -> np.ndarray:
        """The vocabulary subset plus the tokens of seq (the context's cache keeps the rows
        it copied last, so an unchanged list costs nothing)."""
        new = [t for t in set(seq) if t not in self.vocab]
        if new or self.head_ids is None:
            self.vocab.update(new)
            self.head_ids = np.fromiter(sorted(self.vocab), dtype=np.int32,
                                        count=len(self.vocab))
        return self.head_ids

    def part(self, gen: "SpeculativeGeneration", ids: list[int], seq: list[int], on_logits):
        """The next draft step: ids (the last decided token, then each draft) through the
        sparse FFN (and the smaller head, past the skipped layers) in the target context.
        A draft with head rows or skipped layers runs in a pass of its own (a batch of
        contexts runs one head and every layer)."""
        ctx, mode = self.ctx, FFN_MODES[self.mode]
        with ctx._calling() as ptr:
            key = (mode, bool(lib.gh_context_get_input_sparse(ptr)))
        if self.sd.vocab or self.skip is not None:
            key = key + ("draft", id(ctx))
        head = self._head_ids(seq) if self.sd.vocab else None
        skip = self.skip

        def begin(ptr, stack):
            _set_mode(stack, ptr, mode, max(lib.gh_context_get_sparse_batch(ptr), len(ids)))
            if head is not None:
                check(lib.gh_context_set_head_rows(ptr, ffi.from_buffer("int32_t[]", head),
                                                   head.size))
                stack.callback(lambda: check(lib.gh_context_set_head_rows(ptr, ffi.NULL, 0)))
            if skip is not None:
                check(lib.gh_context_set_layer_skip(ptr, ffi.from_buffer("uint8_t[]", skip),
                                                    skip.size))
                stack.callback(lambda: check(lib.gh_context_set_layer_skip(ptr, ffi.NULL, 0)))
            return ids

        return _Part(ctx, key, len(ids), False, begin,
                     lambda ptr: on_logits(_last_logits(ctx, ptr)), gen)


class _LookupDrafter:
    """Prompt lookup decoding: the draft is what followed the latest earlier occurrence of
    the context's last n tokens (n from the longest down to 1) in the prompt and the
    generation, with no model run at all, so a draft token costs nothing and only the
    verification's extra tokens are paid. Its q is one-hot (the token proposed with
    certainty), so speculative sampling keeps a draft x with probability p(x) and draws a
    rejection from p without x: still the dense distribution. No match: the round verifies
    no draft (a plain dense token)."""

    shares_target = False
    passless = True  # its drafts come without a pass (SpeculativeGeneration.batch_part)

    def __init__(self, ctx: Context, ngram: int):
        self.ngram, self.name = ngram, f"lookup (n-grams <= {ngram})"
        self.nv = ctx.model.n_vocab
        # per n: n-gram -> end of its latest occurrence that a token follows
        self.index: list[dict] = [dict() for _ in range(ngram + 1)]
        self.seen: list[int] = []  # the history indexed so far

    def _update(self, seq: list[int]) -> None:
        seen = self.seen
        keep = 0
        while keep < min(len(seen), len(seq)) and seen[keep] == seq[keep]:
            keep += 1
        if keep < len(seen):  # another history (a new generation): index it again
            self.index = [dict() for _ in range(self.ngram + 1)]
            seen.clear()
            keep = 0
        # index the n-grams ending at e, for every e before the last token (a token follows)
        for e in range(max(len(seen) - 1, 1), len(seq)):
            for n in range(1, self.ngram + 1):
                if e - n >= 0 and e <= len(seq) - 1:
                    self.index[n][tuple(seq[e - n:e])] = e
        seen[:] = seq

    def drafts(self, gen: "SpeculativeGeneration", seq: list[int], k: int):
        """Up to k draft tokens and their (one-hot) q, none without a match."""
        self._update(seq)
        for n in range(min(self.ngram, len(seq)), 0, -1):
            e = self.index[n].get(tuple(seq[-n:]))
            if e is not None and e < len(seq):
                drafts = [int(t) for t in seq[e:e + k]]
                if not gen.ignore_eos and gen.eos in drafts:
                    drafts = drafts[:drafts.index(gen.eos) + 1]
                qs = []
                for t in drafts:
                    q = np.zeros(self.nv)
                    q[t] = 1.0
                    qs.append(q)
                return drafts, qs
        return [], []


class _ModelDrafter:
    """A separate draft model with its own context, kept in step with the target's tokens
    (its cache keeps the longest common prefix with them)."""

    shares_target = False
    passless = False

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


class _CostModel:
    """Greedy decoding's choice of k by measured costs: drafting pays only where a round's
    expected tokens per second beat plain decode's. With a draft token kept with
    probability a (each independently), a round of k drafts emits E(k) = 1 + a + .. + a^k
    tokens and costs k t_draft + t_verify(k + 1), t_verify(n) = t_1 + s (n - 1) (t_1: a plain
    one-token pass, s: each further token of the verifying batch); plain decode emits 1
    token in t_1. k maximizes E(k) / cost(k) over 0..draft_max; at k = 0 the generation
    decodes plainly and runs a round of one draft every PROBE_EVERY tokens to keep a,
    t_draft and s current. All are running averages of this generation's own wall times, so the
    choice follows the machine's load; it never changes a greedy token, only which pass
    computes it (sampling keeps the acceptance policy alone: its random stream must not
    depend on timings, so that a seed repeats)."""

    def __init__(self, draft_max: int):
        self.draft_max = draft_max
        self.kept = self.seen = 0.0  # drafts kept / drafts judged (a draft after a rejection is not)
        self.t_draft = self.t_1 = self.slope = None
        self.since_probe = 0
        self._pending = None  # (t_verify, drafted) of a round before any plain pass

    @staticmethod
    def _avg(old, new):
        return new if old is None else old + EMA * (new - old)

    def round(self, drafted: int, kept: int, rejected: bool, t_draft: float, t_verify: float):
        self.kept += kept
        self.seen += kept + (1 if rejected else 0)
        if drafted:
            self.t_draft = self._avg(self.t_draft, t_draft / drafted)
            if self.t_1 is not None:
                self.slope = self._avg(self.slope, max(t_verify - self.t_1, 0.0) / drafted)
            else:  # no plain pass measured yet: take the batch's mean cost
                self._pending = (t_verify, drafted)
        self.since_probe = 0

    def plain(self, t: float):
        self.t_1 = self._avg(self.t_1, t)
        pending = self._pending
        if pending is not None and self.slope is None:
            self.slope = max(pending[0] - self.t_1, 0.0) / pending[1]
        self.since_probe += 1

    def choose(self, k_accept: int) -> int:
        """The round's k (0: a plain token). Until the costs are known: a round of the
        acceptance policy's k, then one plain token."""
        if self.t_draft is None:
            return k_accept
        if self.t_1 is None or self.slope is None:
            return 0
        a = min(self.kept / self.seen, 0.999) if self.seen else 0.0
        best_k, best = 0, 1.0 / self.t_1
        e = 1.0
        for k in range(1, self.draft_max + 1):
            e += a ** k
            rate = e / (k * self.t_draft + self.t_1 + self.slope * k)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0 and self.since_probe >= PROBE_EVERY:
            return 1
        return best_k


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
        self.cost = _CostModel(draft_max) if greedy else None
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
                want = self.k if self.cost is None else self.cost.choose(self.k)
                k = min(want, self.max_tokens - self.n_gen - 1,
                        lib.gh_context_n_ctx(ptr) - n - 1)
            if k < 1:
                return self._dense_part(timed=want < 1)
            self._round = {"n": n, "k": k, "t_n": self.next_token, "drafts": [], "qs": [],
                           "t0": time.perf_counter()}
            if self.drafter.passless:  # lookup: the drafts at once, then the verification
                seq = self.prompt_ids + self.result.tokens  # ends with next_token
                self._round["drafts"], self._round["qs"] = self.drafter.drafts(self, seq, k)
                return self._verify_part()
        r = self._round
        if len(r["drafts"]) < r["k"] and not (
                r["drafts"] and r["drafts"][-1] == self.eos and not self.ignore_eos):
            last = r["drafts"][-1] if r["drafts"] else r["t_n"]
            seq = self.prompt_ids + self.result.tokens + r["drafts"]
            return self.drafter.part(self, [last], seq, self._drafted)
        return self._verify_part()

    def _dense_part(self, timed: bool = False) -> "_Part":
        """next_token densely (no room for a draft, or the cost policy's plain token: timed,
        from the part's making to its end, as a round is)."""
        ctx, t_n = self.ctx, self.next_token
        t0 = time.perf_counter()

        def begin(ptr, stack):
            if ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            _set_mode(stack, ptr, lib.gh_context_get_ffn_mode(ptr), 0)
            return [t_n]

        def end(ptr):
            self.next_token = None  # _pick samples from its logits
            if timed and self.cost is not None:
                self.cost.plain(time.perf_counter() - t0)

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
        if self.cost is not None:
            self.cost.round(len(drafts), len(kept), token is not None and len(kept) < len(drafts),
                            r["t1"] - r["t0"], t2 - r["t1"])
        # k follows the acceptance: longer after a fully kept draft, shorter after an early
        # rejection (EOS-shortened drafts say nothing about k)
        if len(drafts) == k and len(kept) == k:
            self.k = min(self.k + 1, self.draft_max)
        elif len(kept) < len(drafts) // 2:
            self.k = max(self.k - 1, 1)

    def finish(self) -> None:
        super().finish()
        self.result.timings["speculative"] = self.spec.as_dict()
