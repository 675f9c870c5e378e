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

import numpy as np

from ._native import check, ffi, lib
from .model import FFN_MODES, Context, Generation, Model, _INTERFERED, _int_arg

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
    sd = as_self_draft(draft)
    lk = as_lookup_draft(draft)
    if lk is not None:
        drafter = _LookupDrafter(ctx, lk)
    elif sd is not None:
        drafter = _SelfDrafter(ctx, check_self_draft(ctx.model, sd), sd)
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
    """The target file drafts in the target context itself, in its sparse FFN mode, over a
    subset of the vocabulary and through a subset of the layers (SelfDraft); the cache then
    holds the drafts' keys and values (none in skipped layers), which the verification
    truncates and writes densely."""

    shares_target = True

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
        self.head_ids: np.ndarray | None = None  # the rows the context holds now

    def _head_rows(self, ptr, seq: list[int]) -> None:
        """Set the context's head rows to the vocabulary subset plus the tokens of seq."""
        new = [t for t in set(seq) if t not in self.vocab]
        if new or self.head_ids is None:
            self.vocab.update(new)
            self.head_ids = np.fromiter(sorted(self.vocab), dtype=np.int32,
                                        count=len(self.vocab))
        if lib.gh_context_get_head_rows(ptr) != self.head_ids.size:
            check(lib.gh_context_set_head_rows(ptr, ffi.from_buffer("int32_t[]", self.head_ids),
                                               self.head_ids.size))

    def draft(self, gen: "SpeculativeGeneration", ptr, seq: list[int], k: int):
        ctx = self.ctx
        mode, sb = lib.gh_context_get_ffn_mode(ptr), lib.gh_context_get_sparse_batch(ptr)
        check(lib.gh_context_set_ffn_mode(ptr, FFN_MODES[self.mode]))
        check(lib.gh_context_set_sparse_batch(ptr, max(sb, 1)))
        try:
            if self.sd.vocab:
                self._head_rows(ptr, seq)
            if self.skip is not None:
                check(lib.gh_context_set_layer_skip(ptr, ffi.from_buffer("uint8_t[]", self.skip),
                                                    self.skip.size))
            return gen._draft_loop(lambda ids: (ctx._eval_ids(ptr, ids, False),
                                                _last_logits(ctx, ptr))[1], [seq[-1]], k)
        finally:
            if self.sd.vocab:
                check(lib.gh_context_set_head_rows(ptr, ffi.NULL, 0))
            if self.skip is not None:
                check(lib.gh_context_set_layer_skip(ptr, ffi.NULL, 0))
            check(lib.gh_context_set_ffn_mode(ptr, mode))
            check(lib.gh_context_set_sparse_batch(ptr, sb))


class _LookupDrafter:
    """Prompt lookup decoding: the draft is what followed the latest earlier occurrence of
    the context's last n tokens (n from the longest down to 1) in the prompt and the
    generation, with no model run at all, so a draft token costs nothing and only the
    verification's extra tokens are paid. Its q is one-hot (the token proposed with
    certainty), so speculative sampling keeps a draft x with probability p(x) and draws a
    rejection from p without x: still the dense distribution. No match: the round verifies
    no draft (a plain dense token)."""

    shares_target = False

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

    def draft(self, gen: "SpeculativeGeneration", ptr, seq: list[int], k: int):
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
        want = self.k if self.cost is None else self.cost.choose(self.k)
        k = min(want, self.max_tokens - self.n_gen - 1, lib.gh_context_n_ctx(ptr) - n - 1)
        if k < 1:
            t0 = time.perf_counter()
            with _dense(ptr):
                ctx._eval_ids(ptr, [t_n], False)
            if self.cost is not None and want < 1:
                self.cost.plain(time.perf_counter() - t0)
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
        if self.cost is not None:
            self.cost.round(len(drafts), len(kept), token is not None and len(kept) < len(drafts),
                            t1 - t0, t2 - t1)
        # k follows the acceptance: longer after a fully kept draft, shorter after an early
        # rejection (EOS-shortened drafts say nothing about k)
        if len(drafts) == k and len(kept) == k:
            self.k = min(self.k + 1, self.draft_max)
        elif len(kept) < len(drafts) // 2:
            self.k = max(self.k - 1, 1)

    def finish(self) -> None:
        super().finish()
        self.result.timings["speculative"] = self.spec.as_dict()
