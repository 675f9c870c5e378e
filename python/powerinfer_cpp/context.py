"""Context: a KV cache and scratch buffers over a Model, and what runs on it (eval, hidden
states, perplexity, the cache's saved states, the FFN mode and statistics); its
generations are generation.py's."""

from __future__ import annotations

import math
import threading
import warnings
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from . import arguments as A
from ._native import check, ffi, lib
from .generation import Completion, Generation, new_sampler, run_stream
from .handles import (CACHE_NAMES, FFN_MODES, FFN_NAMES, NativeHandle, cache_type_id,
                      ffn_mode_id)
from .speculative import start_speculative

if TYPE_CHECKING:
    from .model import Model


class ContextState:
    """A saved KV cache (Context.save_state): the token ids it holds, how many of them were
    computed exactly (the prefix a later prompt may reuse, see Generation.prefill) and the
    runtime's state of their keys and values (gh_context_state_save: tagged with the model,
    the cache type and a checksum). to_bytes() / from_bytes() keep one on disk."""

    MAGIC = b"GHSLOT01"

    __slots__ = ("tokens", "n_exact", "data")

    def __init__(self, tokens: Sequence[int], n_exact: int, data: bytes | bytearray):
        self.tokens = [int(t) for t in tokens]
        self.n_exact = int(n_exact)
        self.data = data

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """What the state holds in memory (its keys and values, and the token ids)."""
        return len(self.data) + 4 * len(self.tokens)

    def to_bytes(self) -> bytes:
        """MAGIC, the token count and n_exact (uint32 little-endian), the ids (int32), then
        the runtime's state."""
        head = np.array([len(self.tokens), self.n_exact], dtype="<u4").tobytes()
        return (self.MAGIC + head + np.asarray(self.tokens, dtype="<i4").tobytes()
                + bytes(self.data))

    @classmethod
    def from_bytes(cls, blob) -> "ContextState":
        """The state to_bytes() wrote; ValueError naming the problem for anything else (the
        runtime checks the rest when it is loaded)."""
        mv = memoryview(blob)
        if len(mv) < 16 or bytes(mv[:8]) != cls.MAGIC:
            raise ValueError("not a saved context state (it does not start with "
                             f"{cls.MAGIC.decode()})")
        n, n_exact = (int(x) for x in np.frombuffer(mv[8:16], dtype="<u4"))
        if n_exact > n or len(mv) < 16 + 4 * n:
            raise ValueError(f"a truncated or corrupt context state ({len(mv)} bytes for "
                             f"{n} tokens)")
        tokens = np.frombuffer(mv[16:16 + 4 * n], dtype="<i4").tolist()
        return cls(tokens, n_exact, bytes(mv[16 + 4 * n:]))

    def __repr__(self) -> str:
        return f"ContextState(n_tokens={self.n_tokens}, n_exact={self.n_exact}, nbytes={self.nbytes})"


class Context(NativeHandle):
    """A KV cache and scratch buffers over a Model.

    Safe from several threads: calls are serialised, and close() waits for the call in
    flight. The cache is shared state, though: eval() appends to what this thread last
    left there, so when another thread changed the cache since this thread's last call,
    eval() raises RuntimeError instead of computing logits of someone else's tokens
    (call reset() to start over). stream() and generate() manage the cache themselves
    and work from any thread; give threads that run side by side a context each
    (Model.create_context).
    """

    def __init__(self, model: Model, *, n_ctx: int = 0, n_threads: int = 0, n_batch: int = 512,
                 ffn: str = "auto", cache_type: str = "f16", input_sparse: bool | None = None):
        self.model = model
        mode = ffn_mode_id(ffn)
        p = lib.gh_context_default_params()
        p.n_ctx, p.n_threads, p.n_batch = (A.int32("n_ctx", n_ctx), A.int32("n_threads", n_threads),
                                           A.int32("n_batch", n_batch))
        p.cache_type = cache_type_id(cache_type)
        out = ffi.new("gh_context **")
        check(lib.gh_context_new(model._handle(), ffi.new("gh_context_params *", p), out))
        self._ptr = out[0]
        # tokens one forward pass takes (gh_context_new's rule: 0 or more than n_ctx = n_ctx)
        n_ctx_now = lib.gh_context_n_ctx(self._ptr)
        self.n_batch = min(n_batch, n_ctx_now) if n_batch > 0 else n_ctx_now
        model._contexts.add(self)  # closed with the model, however it was made
        self._use = 0  # bumped by every eval/reset; a stream stops if it changed under it
        self._seen = threading.local()  # .use: self._use after this thread's last call
        self._cached: list[int] = []    # the tokens in the KV cache, in order
        # _cached[:_n_exact] were computed with the exact (dense-result) FFN; tokens decoded
        # by the sparse FFN after them are not reused by the next prompt, so a reply does
        # not depend on what the context computed before (see Generation.prefill)
        self._n_exact = 0
        self._out = ffi.new("int32_t *")
        if mode is not None or input_sparse is not None:
            try:
                if mode is not None:
                    self.set_ffn_mode(ffn)
                if input_sparse is not None:
                    self.input_sparse = input_sparse
            except BaseException:
                self.close()
                raise
        n_train = model.info.n_ctx_train
        if n_train > 0 and self.n_ctx > n_train:
            warnings.warn(
                f"n_ctx = {self.n_ctx} is larger than the context the model was trained with "
                f"({n_train}); output past {n_train} tokens is likely garbage", RuntimeWarning,
                stacklevel=3)

    _closed_msg = "this Context has been closed (or its Model was closed)"

    def _free(self, ptr) -> None:
        lib.gh_context_free(ptr)

    @property
    def n_ctx(self) -> int:
        with self._calling() as ptr:
            return lib.gh_context_n_ctx(ptr)

    @property
    def n_past(self) -> int:
        with self._calling() as ptr:
            return lib.gh_context_n_past(ptr)

    @property
    def cache_type(self) -> str:
        """How the KV cache is stored: "f16", "f32" or "q8_0"."""
        with self._calling() as ptr:
            return CACHE_NAMES[lib.gh_context_cache_type(ptr)]

    @property
    def cached_tokens(self) -> list[int]:
        """The token ids whose keys and values are in the cache (a copy)."""
        with self._lock:
            return list(self._cached)

    @property
    def reusable_tokens(self) -> list[int]:
        """The cached tokens a later prompt may reuse: those computed exactly (by the dense
        FFN's result, see Generation.prefill), a prefix of cached_tokens (a copy)."""
        with self._lock:
            return self._cached[:self._n_exact]

    def peek_reusable_tokens(self) -> list[int] | None:
        """reusable_tokens, or None at once when another thread is in a call on this
        context (a look that must not wait for someone else's prompt)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._cached[:self._n_exact]
        finally:
            self._lock.release()

    def set_threads(self, n_threads: int) -> None:
        """Change the number of threads the forward pass uses (0 = all cores)."""
        with self._calling() as ptr:
            check(lib.gh_context_set_threads(ptr, A.int32("n_threads", n_threads)))

    def reset(self, n_past: int = 0) -> None:
        """Forget cached tokens after position n_past (default: all)."""
        with self._calling() as ptr:
            check(lib.gh_context_truncate(ptr, A.int32("n_past", n_past)))
            del self._cached[n_past:]
            self._n_exact = min(self._n_exact, n_past)
            self._changed()

    def state_size(self, n_tokens: int | None = None) -> int:
        """Bytes of the runtime's state of n_tokens cached tokens (default: all of them)."""
        with self._calling() as ptr:
            n = len(self._cached) if n_tokens is None else A.int32("n_tokens", n_tokens)
            out = ffi.new("uint64_t *")
            check(lib.gh_context_state_size(ptr, n, out))
            return int(out[0])

    def save_state(self, n_tokens: int | None = None) -> ContextState:
        """The keys and values of the first n_tokens cached tokens (default: all) and their
        ids, to restore into this or another context of the same model (load_state). The
        cache is not changed."""
        with self._calling() as ptr:
            n = len(self._cached) if n_tokens is None else A.int32("n_tokens", n_tokens)
            size = ffi.new("uint64_t *")
            check(lib.gh_context_state_size(ptr, n, size))
            buf = bytearray(size[0])
            written = ffi.new("uint64_t *")
            check(lib.gh_context_state_save(ptr, n, ffi.from_buffer(buf), len(buf), written))
            # the buffer itself (no copy: a long cache's state is tens of MB)
            return ContextState(self._cached[:n], min(self._n_exact, n), buf)

    def load_state(self, state: ContextState) -> None:
        """Replace the cache by a saved state (of this model and cache type; n_ctx must hold
        it). ValueError or NativeError naming the problem, the cache unchanged, for a state
        that is corrupt, truncated or of another model. The next eval() continues after the
        state's tokens (its logits are not kept: evaluate at least one token)."""
        if not isinstance(state, ContextState):
            raise TypeError(f"load_state() takes a ContextState, not {type(state).__name__}")
        ids = state.tokens
        if ids and (min(ids) < 0 or max(ids) >= self.model.n_vocab):
            raise ValueError("the state holds a token id outside this model's vocabulary")
        if not 0 <= state.n_exact <= len(ids):
            raise ValueError(f"the state's n_exact ({state.n_exact}) is not within its "
                             f"{len(ids)} tokens")
        with self._calling() as ptr:
            size = ffi.new("uint64_t *")
            if len(ids) > lib.gh_context_n_ctx(ptr):
                raise ValueError(f"the state holds {len(ids)} tokens, more than this "
                                 f"context's {lib.gh_context_n_ctx(ptr)}")
            check(lib.gh_context_state_size(ptr, len(ids), size))
            data = state.data
            if len(data) != size[0]:
                raise ValueError(f"the state's data is {len(data)} bytes; {len(ids)} tokens "
                                 f"of this context take {size[0]} (truncated, or saved from "
                                 "another model or cache type)")
            n = ffi.new("int32_t *")
            check(lib.gh_context_state_load(ptr, ffi.from_buffer(data), len(data), n))
            self._cached = list(ids)
            self._n_exact = state.n_exact
            self._changed()

    def _changed(self) -> None:
        """Record a change of the cache made by this thread."""
        self._use += 1
        self._seen.use = self._use

    # -- sparse FFN ------------------------------------------------------------

    @property
    def ffn_mode(self) -> str:
        """The FFN mode: "dense", "sparse" or "oracle"."""
        with self._calling() as ptr:
            return FFN_NAMES[lib.gh_context_get_ffn_mode(ptr)]

    def set_ffn_mode(self, mode: str) -> None:
        """Switch the FFN mode ("dense", "sparse", "oracle", "gate", "file" = the file's own
        mode, or "auto" = the file's mode where estimated faster than dense here, else
        dense); NativeError if the file lacks what the mode needs (predictors, ffn_down_t).
        Takes effect at the next eval; the cache stays valid."""
        m = ffn_mode_id(mode)
        if m is None or m == -1:
            ch = ffi.new("gh_ffn_auto_choice *")
            check(lib.gh_model_ffn_auto(self.model._handle(), ch))
            m = ch.mode if m is None else ch.file_mode
        with self._calling() as ptr:
            check(lib.gh_context_set_ffn_mode(ptr, m))

    @property
    def input_sparse(self) -> bool:
        """Whether the sparse and gate FFN modes also run the attention's and the head's
        projections input-sparse (on by default for a file converted with --input-sparsity)."""
        with self._calling() as ptr:
            return bool(lib.gh_context_get_input_sparse(ptr))

    @input_sparse.setter
    def input_sparse(self, on: bool) -> None:
        with self._calling() as ptr:
            check(lib.gh_context_set_input_sparse(ptr, 1 if on else 0))

    @property
    def sparse_batch(self) -> int:
        """Largest batch (tokens per eval) that runs the sparse FFN; bigger ones run dense."""
        with self._calling() as ptr:
            return lib.gh_context_get_sparse_batch(ptr)

    @sparse_batch.setter
    def sparse_batch(self, n_max: int) -> None:
        with self._calling() as ptr:
            check(lib.gh_context_set_sparse_batch(ptr, A.int32("sparse_batch", n_max)))

    def stats(self) -> dict:
        """What this context did since it was made or reset_stats(): token counts, the
        FFN density (per layer too), weight bytes read per stage and per token, and
        seconds per stage (attention / predictor / ffn / other)."""
        n_layer = self.model.info.n_layer
        st = ffi.new("gh_context_stats *")
        dens = ffi.new("double[]", n_layer)
        with self._calling() as ptr:
            check(lib.gh_context_get_stats(ptr, st, dens, n_layer))
        n = max(st.n_tokens, 1)
        return {
            "ffn_mode": FFN_NAMES.get(st.ffn_mode, str(st.ffn_mode)),
            "n_tokens": st.n_tokens,
            "n_sparse_tokens": st.n_sparse_tokens,
            "n_active": st.n_active,
            "n_up_rows": st.n_up_rows,
            "n_down_rows": st.n_down_rows,
            "density": st.density,
            "layer_density": [dens[i] for i in range(n_layer)],
            "input_sparse": {"attention_density": st.attn_input_density,
                             "head_density": st.head_input_density,
                             "attention_inputs": st.n_attn_inputs,
                             "attention_inputs_used": st.n_attn_inputs_used,
                             "head_inputs": st.n_head_inputs, "head_inputs_used": st.n_head_inputs_used},
            "bytes": {"attention": st.bytes_attention, "predictor": st.bytes_predictor,
                      "ffn": st.bytes_ffn, "head": st.bytes_head},
            "bytes_per_token": st.bytes_per_token,
            "bytes_per_token_stage": {"attention": st.bytes_attention / n,
                                      "predictor": st.bytes_predictor / n,
                                      "ffn": st.bytes_ffn / n, "head": st.bytes_head / n},
            "time_s": {"attention": st.t_attention, "predictor": st.t_predictor,
                       "ffn": st.t_ffn, "other": st.t_other, "total": st.t_total},
            "device": {
                "neurons_device": st.n_active_device,
                "neurons_cpu": st.n_active_cpu,
                "device_share": st.n_active_device / st.n_active if st.n_active else 0.0,
                "bytes_device": st.bytes_device,
                "bytes_uploaded": st.bytes_uploaded,
                "bytes_downloaded": st.bytes_downloaded,
                "time_s": {"device": st.t_device, "cpu_ffn": st.t_cpu_ffn, "wait": st.t_wait},
            },
            "experts": {
                "runs_device": st.n_expert_runs_device,
                "runs_cpu": st.n_expert_runs_cpu,
                "cache_hits": st.n_cache_hits,
                "cache_misses": st.n_cache_misses,
                "cache_hit_rate": (st.n_cache_hits / (st.n_cache_hits + st.n_cache_misses)
                                   if st.n_cache_hits + st.n_cache_misses else 0.0),
                "bytes_cache_uploaded": st.bytes_cache_uploaded,
            },
        }

    def expert_counts(self) -> np.ndarray:
        """Mixture-of-experts models: int64 [n_layer, n_expert], how many times each expert of
        each layer was chosen since the context was made or reset_stats() (a token counts
        once for each of its top-k experts); [n_layer, 0] for a model without experts."""
        info = self.model.info
        out = np.zeros((info.n_layer, info.n_expert), dtype=np.int64)
        with self._calling() as ptr:
            check(lib.gh_context_get_expert_counts(ptr, ffi.cast("int64_t *", out.ctypes.data), out.size))
        return out

    def reset_stats(self) -> None:
        """Zero the counters stats() and expert_counts() report."""
        with self._calling() as ptr:
            check(lib.gh_context_reset_stats(ptr))

    # -- evaluation ------------------------------------------------------------

    def _eval_ids(self, ptr, ids: list[int], logits_all: bool) -> None:
        """Evaluate checked token ids after the cache (caller holds the lock)."""
        arr32 = np.asarray(ids, dtype=np.int32)
        self._before_eval(ptr, len(ids))
        try:
            check(lib.gh_eval(ptr, ffi.from_buffer("int32_t[]", arr32), arr32.size,
                              1 if logits_all else 0))
        finally:
            self._after_eval(ptr, ids)

    def _before_eval(self, ptr, n: int) -> None:
        """Count n tokens about to be evaluated as exact (reusable by a later prompt)
        unless the context's FFN runs them sparse (caller holds the lock)."""
        mode = lib.gh_context_get_ffn_mode(ptr)
        exact = (not (mode == FFN_MODES["sparse"] or
                      (mode == FFN_MODES["gate"] and lib.gh_context_get_input_sparse(ptr))) or
                 n > lib.gh_context_get_sparse_batch(ptr))
        if exact and self._n_exact == len(self._cached):
            self._n_exact += n  # lowered by _after_eval if the runtime keeps fewer

    def _after_eval(self, ptr, ids: list[int]) -> None:
        """Keep the token list equal to the cache after an evaluation of ids, which on
        failure leaves the cache as it was (or truncated after a device error)."""
        n = lib.gh_context_n_past(ptr)
        self._cached.extend(ids[:max(n - len(self._cached), 0)])
        del self._cached[n:]
        self._n_exact = min(self._n_exact, n)
        self._changed()

    def _check_ids(self, tokens) -> list[int]:
        arr = A.token_array(tokens)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence of ids")
        if arr.min() < 0 or arr.max() >= self.model.n_vocab:
            bad = int(arr[(arr < 0) | (arr >= self.model.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.model.n_vocab})")
        return [int(t) for t in arr]

    def eval(self, tokens: Sequence[int], logits_all: bool = False) -> np.ndarray:
        """Run tokens after the cached ones; logits of the last token [n_vocab], or of
        every token [n_tokens, n_vocab] with logits_all (a copy)."""
        ids = self._check_ids(tokens)
        with self._calling() as ptr:
            seen = getattr(self._seen, "use", None)
            if seen is not None and seen != self._use:
                raise RuntimeError(
                    "another thread changed this context's cache since this thread last used "
                    "it, so eval() would continue someone else's tokens; call reset() first, "
                    "or give each thread its own context (Model.create_context)")
            self._eval_ids(ptr, ids, logits_all)
            rows = lib.gh_n_logit_rows(ptr)
            nv = self.model.n_vocab
            buf = ffi.buffer(lib.gh_get_logits(ptr, 0), rows * nv * 4)
            out = np.frombuffer(buf, dtype=np.float32).reshape(rows, nv).copy()
        return out if logits_all else out[0]

    def hidden_states(self, tokens: Sequence[int]) -> np.ndarray:
        """The final hidden state of every token of `tokens` (the output norm's output, what
        the head reads), run from an empty cache with the dense FFN: [n_tokens, n_embd]
        float32. The cache then holds the tokens (a next prompt starting with them reuses
        them)."""
        ids = self._check_ids(tokens)
        d = self.model.info.n_embd
        with self._calling() as ptr:
            n_ctx = lib.gh_context_n_ctx(ptr)
            if len(ids) > n_ctx:
                raise ValueError(f"{len(ids)} tokens do not fit the context's {n_ctx}")
            out = np.empty((len(ids), d), dtype=np.float32)
            arr32 = np.asarray(ids, dtype=np.int32)
            check(lib.gh_context_truncate(ptr, 0))
            self._cached.clear()
            self._n_exact = 0
            sparse_batch = lib.gh_context_get_sparse_batch(ptr)
            check(lib.gh_context_set_sparse_batch(ptr, 0))  # the dense FFN's states
            try:
                check(lib.gh_eval_embd(ptr, ffi.from_buffer("int32_t[]", arr32), arr32.size,
                                       ffi.from_buffer("float[]", out, require_writable=True)))
            finally:
                check(lib.gh_context_set_sparse_batch(ptr, sparse_batch))
                n = lib.gh_context_n_past(ptr)
                self._cached.extend(ids[:n])
                self._n_exact = n
                self._changed()
        return out

    def perplexity(self, text: str) -> float:
        """exp(mean negative log-likelihood) of `text`, in windows of n_ctx tokens."""
        ids = self.model.tokenize(text)
        if len(ids) < 2:
            raise ValueError("perplexity needs a text of at least 2 tokens")
        with self._lock:  # the windows' reset + eval pairs stay together
            n_ctx = self.n_ctx
            nll, count = 0.0, 0
            for start in range(0, len(ids) - 1, n_ctx):
                window = ids[start:start + n_ctx]
                if len(window) < 2:
                    break
                self.reset()
                logits = self.eval(window, logits_all=True).astype(np.float64)
                logits -= logits.max(axis=1, keepdims=True)
                logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
                tgt = np.asarray(window[1:])
                nll -= float(logp[np.arange(len(tgt)), tgt].sum())
                count += len(tgt)
            self.reset()
        return math.exp(nll / count)

    # -- generation ------------------------------------------------------------

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
               temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
               min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
               seed: int | None = None, stop: str | Sequence[str] | None = None,
               ignore_eos: bool = False, stats: Completion | None = None,
               logits_processor=None, draft=None, draft_max: int | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated.

        The cache keeps the longest common prefix of its tokens and the prompt (a chat
        turn or a repeated system prompt is not evaluated again); only the rest of the
        prompt is evaluated. The prompt always runs through the dense FFN and generated
        tokens through the context's FFN mode; tokens a sparse FFN decoded are not reused
        (they are evaluated again, densely, as part of the next prompt), so a reply is
        the same as on a fresh context. temperature <= 0 is greedy. Generation ends at EOS, a stop
        string (not included in the text), max_tokens (None: until the context is full),
        or when the context is full. Pass a Completion as `stats` to receive tokens,
        finish reason, timings and how many prompt tokens came from the cache.
        `logits_processor(input_ids, logits) -> logits` (a float32 array of n_vocab) may
        change each token's logits before sampling. `draft` ("self", a draft Model or its
        file) decodes speculatively, `draft_max` tokens drafted at most per verification
        (see powerinfer_cpp.speculative: the output is the dense model's); the Completion's
        timings["speculative"] then reports acceptance and the draft/verify split.

        The arguments are checked here, before the first piece is asked for (a bad
        one raises at once). A stream owns its context while it runs: evaluating,
        resetting or streaming on the same context meanwhile makes the old stream
        raise RuntimeError when resumed (use create_context() for concurrent streams).
        """
        return run_stream(self.start_generation(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed,
            stop=stop, ignore_eos=ignore_eos, stats=stats, logits_processor=logits_processor,
            draft=draft, draft_max=draft_max))

    def start_generation(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
                         temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                         min_p: float = 0.05, repeat_penalty: float = 1.0,
                         repeat_last_n: int = 64, seed: int | None = None,
                         stop: str | Sequence[str] | None = None, ignore_eos: bool = False,
                         stats: Completion | None = None,
                         logits_processor=None, draft=None,
                         draft_max: int | None = None) -> Generation:
        """stream()'s generation as a Generation, run a step at a time by the caller (the
        server's batching scheduler): same arguments, checked here."""
        model = self.model
        self._handle()
        prompt_ids = A.prompt_ids(prompt, model)
        if len(prompt_ids) >= self.n_ctx:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds only {self.n_ctx}; "
                f"use a shorter prompt or a larger n_ctx (the model was trained with "
                f"{model.info.n_ctx_train})")
        max_tokens = self.n_ctx if max_tokens is None else A.int_arg("max_tokens", max_tokens)
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0 (or None: until the context is full)")
        if logits_processor is not None and not callable(logits_processor):
            raise TypeError("logits_processor must be a callable (input_ids, logits) -> logits")
        stops = A.check_stops(stop)

        repeat_last_n = A.int_arg("repeat_last_n", repeat_last_n)
        sampler = new_sampler(model.n_vocab, temperature, top_k, top_p, min_p, repeat_penalty,
                               repeat_last_n, seed)
        if draft is not None or draft_max is not None:
            return start_speculative(self, draft, draft_max, float(temperature) <= 0,
                                     prompt_ids, sampler, max_tokens,
                                     repeat_last_n, stops, bool(ignore_eos), stats,
                                     logits_processor)
        return Generation(self, prompt_ids, sampler, max_tokens, repeat_last_n, stops,
                          bool(ignore_eos), stats, logits_processor)

    def _sample(self, ptr, sampler, prompt_ids: list[int], generated: list[int],
                logits_processor) -> int:
        """The next token from the last logits (caller holds the lock)."""
        logits = lib.gh_get_logits(ptr, -1)
        if logits_processor is not None:
            nv = self.model.n_vocab
            arr = np.frombuffer(ffi.buffer(logits, nv * 4), dtype=np.float32).copy()
            arr = np.ascontiguousarray(logits_processor(prompt_ids + generated, arr),
                                       dtype=np.float32)
            if arr.shape != (nv,):
                raise ValueError(f"logits_processor returned shape {arr.shape}; it must return "
                                 f"the logits it was given, shape ({nv},)")
            logits = ffi.from_buffer("float[]", arr)
        check(lib.gh_sampler_sample(sampler, logits, self._out))
        return self._out[0]

    def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        """Generate a completion; same arguments as stream()."""
        result = Completion("", [], "length", 0)
        for _ in self.stream(prompt, stats=result, **kw):
            pass
        return result
