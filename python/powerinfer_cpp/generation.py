"""Generation: a completion run a step at a time on a Context (prefill, sample, step or
eval_batch with other generations, flush, finish), the stream that runs one, and the
native sampler. Context.start_generation checks the arguments and makes one."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from ._native import check, ffi, lib
from .arguments import float_arg, int32, int_arg, repeat_window
from .handles import FFN_MODES
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .context import Context


@dataclass
class Completion:
    """The result of Context.generate."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_tokens or context full)
    n_prompt_tokens: int
    timings: dict = field(default_factory=dict)
    # prompt tokens whose KV entries were kept from the context's previous use (the longest
    # common prefix); only the other n_prompt_tokens - n_cached_tokens were evaluated
    n_cached_tokens: int = 0



class Detokenizer:
    """Turns a growing token list into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0   # ids[prefix:read] decode to the text already emitted (a window)
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if full.endswith("\ufffd") or len(full) <= len(done):
            return ""  # a multi-byte character is still incomplete (or a special token)
        # Keep a short window so decode cost stays constant per token.
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
        return full[len(done):]



def find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


INTERFERED = ("this stream's context was used by another call (eval, reset, perplexity or "
               "another stream) while the stream was paused, so it cannot continue; use "
               "create_context() for streams that run side by side")


class Generation:
    """One generation on a context, a step at a time: what Context.stream() runs, split so
    that a scheduler can evaluate the next tokens of several generations together
    (eval_batch: the server's continuous batching). Made by Context.start_generation.

    The order: prefill() until it returns True (the prompt, in chunks of any size); then
    per token sample(), which picks the next token from the context's logits and returns
    the text it completes, and, unless `done`, the evaluation of that token (`next_token`,
    None again once evaluated) by step() alone or by eval_batch() with other generations;
    at the end flush() (the text held back for stop strings) and finish() (timings).
    `result` is the Completion."""

    def __init__(self, ctx: "Context", prompt_ids: list[int], sampler, max_tokens: int,
                 repeat_last_n: int, stops: list[str], ignore_eos: bool,
                 stats: Completion | None, logits_processor):
        self.ctx = ctx
        self.prompt_ids = prompt_ids
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stops = stops
        self.ignore_eos = ignore_eos
        self.logits_processor = logits_processor
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.result = stats if stats is not None else Completion("", [], "length", 0)
        self.result.n_prompt_tokens = len(prompt_ids)
        self.result.tokens, self.result.text = [], ""
        for t in repeat_window(prompt_ids, repeat_last_n):
            lib.gh_sampler_accept(sampler, t)
        self.eos = ctx.model.eos_id
        self.detok = Detokenizer(ctx.model.tokenizer)
        self.pending = ""    # text held back because it may be the start of a stop string
        self.finish_reason = "length"
        self.n_gen = 0
        self.next_token: int | None = None  # sampled, to be evaluated next
        self.done = max_tokens <= 0
        self._at: int | None = None  # prompt tokens in the cache (None: not started)
        self._mine = None            # ctx._use after our last evaluation
        self._t0: float | None = None  # when the prompt's evaluation began
        self._t1: float | None = None  # ... and ended

    @property
    def prefilled(self) -> bool:
        return self._at == len(self.prompt_ids)

    def prefill(self, n_max: int | None = None) -> bool:
        """Evaluate the next n_max prompt tokens (None: the rest); True once the whole
        prompt is in the cache and its last token's logits are there."""
        ctx = self.ctx
        with ctx._calling() as ptr:
            chunk = self._prompt_chunk(ptr, n_max)
            with dense_prompt(ptr):
                ctx._eval_ids(ptr, chunk, False)
            self._prompt_done(len(chunk))
        return self.prefilled

    def _prompt_chunk(self, ptr, n_max: int | None) -> list[int]:
        """The next n_max prompt tokens (None: the rest) to evaluate, the cached prefix
        kept at the first call (the context's lock held)."""
        ctx = self.ctx
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self._at is None:
            # Keep the cached prefix, as far as it was computed exactly: a prompt (reused or
            # not) always runs through the dense FFN, so the reply is the one a fresh
            # context gives, whatever this context did before. At least the last prompt
            # token is evaluated (its logits start the generation).
            keep = 0
            limit = min(ctx._n_exact, len(self.prompt_ids) - 1)
            while keep < limit and ctx._cached[keep] == self.prompt_ids[keep]:
                keep += 1
            check(lib.gh_context_truncate(ptr, keep))
            del ctx._cached[keep:]
            ctx._n_exact = min(ctx._n_exact, keep)
            self.result.n_cached_tokens = keep
            self._at = keep
        elif ctx._use != self._mine:
            raise RuntimeError(INTERFERED)
        end = len(self.prompt_ids) if n_max is None else min(len(self.prompt_ids),
                                                              self._at + max(n_max, 1))
        return self.prompt_ids[self._at:end]

    def _prompt_done(self, n: int) -> None:
        """n more prompt tokens are in the cache (after _prompt_chunk's)."""
        self._at += n
        self._mine = self.ctx._use
        if self.prefilled:
            self._t1 = time.perf_counter()

    def sample(self) -> str:
        """Pick the next token from the context's logits; returns the text it completes
        ("" while a character or a possible stop string is incomplete) and sets `done` at
        EOS, a stop string or max_tokens, else `next_token`."""
        token = self._pick()
        self.next_token = None
        if token == self.eos and not self.ignore_eos:
            self.finish_reason, self.done = "stop", True
            return ""
        self.n_gen += 1
        self.result.tokens.append(token)
        lib.gh_sampler_accept(self.sampler, token)
        self.pending += self.detok.push(token)
        cut = find_stop(self.pending, self.stops)
        if cut is not None:
            piece, self.finish_reason, self.done = self.pending[:cut], "stop", True
            self.result.text += piece
            self.pending = ""
            return piece
        piece = ""
        emit = len(self.pending) - self.hold if self.stops else len(self.pending)
        if emit > 0:
            piece, self.pending = self.pending[:emit], self.pending[emit:]
            self.result.text += piece
        if self.n_gen >= self.max_tokens:
            self.done = True
        else:
            self.next_token = token
        return piece

    def _pick(self) -> int:
        """The next token, sampled from the context's logits (speculative decoding's
        Generation hands out the tokens its last verification decided first)."""
        ctx = self.ctx
        with ctx._calling() as ptr:  # the caller may have closed the context meanwhile
            if ctx._use != self._mine:
                raise RuntimeError(INTERFERED)
            return ctx._sample(ptr, self.sampler, self.prompt_ids, self.result.tokens,
                               self.logits_processor)

    def _claim(self, ptr) -> bool:
        """Before next_token is evaluated (the context's lock held): raise if another call
        used the context meanwhile; False (and done) if the context is full."""
        if self.ctx._use != self._mine:
            raise RuntimeError(INTERFERED)
        if lib.gh_context_n_past(ptr) >= lib.gh_context_n_ctx(ptr):
            self.done, self.next_token = True, None
            return False
        return True

    def step(self) -> None:
        """Evaluate next_token alone (gh_eval)."""
        ctx = self.ctx
        with ctx._calling() as ptr:
            if self._claim(ptr):
                ctx._eval_ids(ptr, [self.next_token], False)
                self._mine = ctx._use
                self.next_token = None  # its logits are ready for sample()

    def batchable(self) -> bool:
        """Whether eval_batch can take this generation's next token: in every FFN mode (in
        the sparse modes each row of the batched pass selects its own neurons and gives what
        the context gets alone); contexts batched together must share batch_key()."""
        return True

    def batch_key(self, n_tokens: int = 1) -> tuple:
        """What the generations of one eval_batch must share (gh_eval_batch_ex refuses a
        mix): whether its n_tokens run through the dense FFN (the dense mode, a sparse batch
        below n_tokens, or a prompt: prefill reads it densely), else its sparse mode and
        input sparsity. A decode step is one token; a prompt chunk reads as ("dense",)."""
        with self.ctx._calling() as ptr:
            mode = int(lib.gh_context_get_ffn_mode(ptr))
            if mode == FFN_MODES["dense"] or lib.gh_context_get_sparse_batch(ptr) < n_tokens:
                return ("dense",)
            return (mode, bool(lib.gh_context_get_input_sparse(ptr)))

    def flush(self) -> str:
        """At a normal end: the held-back text that turned out not to start a stop string."""
        piece, self.pending = self.pending, ""
        self.result.text += piece
        return piece

    def finish(self) -> None:
        """Record the finish reason and the timings in `result`."""
        t2 = time.perf_counter()
        t0 = self._t0 if self._t0 is not None else t2
        t1 = self._t1 if self._t1 is not None else t2
        r, n_gen = self.result, self.n_gen
        r.finish_reason = self.finish_reason
        r.timings = {
            "load_s": self.ctx.model.load_time,
            "prompt_s": t1 - t0,
            "prompt_tokens": len(self.prompt_ids),
            "prompt_tok_per_s": len(self.prompt_ids) / max(t1 - t0, 1e-9),
            "decode_s": t2 - t1,
            "decode_tokens": n_gen,
            "decode_tok_per_s": max(n_gen - 1, 0) / max(t2 - t1, 1e-9) if n_gen > 1 else 0.0,
        }


def run_stream(gen: Generation) -> Iterator[str]:
    """Context.stream's generator: the generation's steps, one token at a time."""
    gen.prefill()
    try:
        while not gen.done:
            piece = gen.sample()
            if piece:
                yield piece
            if not gen.done:
                gen.step()
        tail = gen.flush()
        if tail:
            yield tail
    finally:
        gen.finish()


@contextlib.contextmanager
def dense_prompt(ptr):
    """A prompt runs through the dense FFN (sparse batch 0 while it is evaluated), so a
    reply does not depend on how its prompt was split (Generation.prefill)."""
    sparse_batch = lib.gh_context_get_sparse_batch(ptr)
    check(lib.gh_context_set_sparse_batch(ptr, 0))
    try:
        yield
    finally:
        check(lib.gh_context_set_sparse_batch(ptr, sparse_batch))


def eval_batch(gens: Sequence[Generation], prompt_chunk: int | None = None,
               parts: Sequence = ()) -> int:
    """Evaluate every generation's next tokens in ONE forward pass (gh_eval_batch_ex: each
    weight read once for all of them; each context's tokens attend over its own cache): a
    decoding generation's next_token (it must be batchable(); all must share one
    batch_key()), a generation still reading
    its prompt its next prompt_chunk prompt tokens (None: the rest; through the dense FFN,
    as prefill() reads them). Each must be on a context of its own of the same model, and
    all the tokens together within the first one's n_batch; a decoding generation whose
    context is full is marked done and left out. On an error no context has advanced and
    each generation may be stepped (or prefilled) again. Returns the tokens evaluated.

    `parts` join the pass with tokens of their own choosing (speculative decoding's drafts
    and verifications, speculative.py): each has `ctx`, `logits_all` (every token's logits
    kept: then every context of the pass keeps them, its last row being what a lone
    evaluation leaves), begin(ptr, stack) -> its tokens (the context's lock held; undo
    what it sets on `stack`), settle() after the pass whatever happened, and end(ptr) after
    a pass that succeeded."""
    owners = list(gens) + list(parts)
    if len({id(o.ctx) for o in owners}) != len(owners):
        raise ValueError("eval_batch: two generations share a context")
    if any(g.prefilled and g.next_token is None for g in gens):
        raise ValueError("eval_batch: a generation has no token to evaluate (sample() first)")
    with contextlib.ExitStack() as stack:
        # every context's lock, in one global order (another thread takes one at a time)
        ptrs = {id(o): stack.enter_context(o.ctx._calling())
                for o in sorted(owners, key=lambda o: id(o.ctx))}
        live = []  # (generation, its pointer, its tokens, whether they are prompt tokens)
        for g in gens:
            p = ptrs[id(g)]
            if not g.prefilled:
                live.append((g, p, g._prompt_chunk(p, prompt_chunk), True))
            elif g._claim(p):
                live.append((g, p, [g.next_token], False))
        for part in parts:
            live.append((part, ptrs[id(part)], part.begin(ptrs[id(part)], stack), None))
        if not live:
            return 0
        counts = np.array([len(ids) for _, _, ids, _ in live], dtype=np.int32)
        tokens = np.array([t for _, _, ids, _ in live for t in ids], dtype=np.int32)
        cptrs = ffi.new("gh_context *[]", [p for _, p, _, _ in live])
        for _, p, _, prompt in live:
            if prompt:
                stack.enter_context(dense_prompt(p))
        for g, p, ids, _ in live:
            g.ctx._before_eval(p, len(ids))
        logits_all = any(part.logits_all for part in parts)
        try:
            check(lib.gh_eval_batch_ex(cptrs, len(live), ffi.from_buffer("int32_t[]", counts),
                                       ffi.from_buffer("int32_t[]", tokens),
                                       1 if logits_all else 0))
        finally:
            for g, p, ids, prompt in live:
                g.ctx._after_eval(p, ids)
                if prompt is None:
                    g.settle()
                else:
                    g._mine = g.ctx._use  # our own call: the generation carries on
        for g, p, ids, prompt in live:
            if prompt is None:
                g.end(p)
            elif prompt:
                g._prompt_done(len(ids))
            else:
                g.next_token = None  # its logits are ready for sample()
    return int(tokens.size)


def new_sampler(n_vocab: int, temperature, top_k, top_p, min_p, repeat_penalty,
                 repeat_last_n, seed):
    """A native sampler (freed with its last reference) from checked arguments; seed None
    = random."""
    sp = lib.gh_sampler_default_params()
    sp.temperature = float_arg("temperature", temperature)
    sp.top_k = int32("top_k", int_arg("top_k", top_k))
    sp.top_p = float_arg("top_p", top_p)
    sp.min_p = float_arg("min_p", min_p)
    sp.repeat_penalty = float_arg("repeat_penalty", repeat_penalty)
    sp.repeat_last_n = int32("repeat_last_n", int_arg("repeat_last_n", repeat_last_n))
    sp.seed = (int.from_bytes(os.urandom(8), "little") if seed is None
               else int_arg("seed", seed)) % 2**64
    out = ffi.new("gh_sampler **")
    check(lib.gh_sampler_new(ffi.new("gh_sampler_params *", sp), n_vocab, out))
    return ffi.gc(out[0], lib.gh_sampler_free)


class Sampler:
    """The sampler of stream(), on its own: for callers that run eval() themselves
    (llama-cpp-python's Llama.sample / Llama.generate). accept() feeds the repeat
    penalty's window; sample() picks a token from a row of logits (temperature <= 0:
    greedy)."""

    def __init__(self, n_vocab: int, *, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, seed: int | None = None):
        self.n_vocab = int(n_vocab)
        self._s = new_sampler(self.n_vocab, temperature, top_k, top_p, min_p, repeat_penalty,
                               repeat_last_n, seed)
        self._out = ffi.new("int32_t *")

    def accept(self, token: int) -> None:
        lib.gh_sampler_accept(self._s, int(token))

    def sample(self, logits) -> int:
        arr = np.ascontiguousarray(logits, dtype=np.float32)
        if arr.shape != (self.n_vocab,):
            raise ValueError(f"logits must have shape ({self.n_vocab},), not {arr.shape}")
        check(lib.gh_sampler_sample(self._s, ffi.from_buffer("float[]", arr), self._out))
        return int(self._out[0])
