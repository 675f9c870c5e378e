"""The generation arguments, checked and normalised in one place: what Context.stream takes
(checked before a stream starts), how llama-cpp-python's `Llama` and the server read their
OpenAI-style fields into it (max_tokens, stop, the logits processors), and the value checks
of arguments that reach a native call (a C int32, no silent truncation of 2.5 to 2)."""

from __future__ import annotations

import numbers
import operator
from typing import Callable, Sequence

import numpy as np

# -- values passed to native calls ---------------------------------------------------------


def int32(name: str, value) -> int:
    """value as a C int32 argument; ValueError (not cffi's OverflowError) if it cannot be."""
    v = int(value)
    if not -2**31 <= v < 2**31:
        raise ValueError(f"{name} = {v} is out of range")
    return v


def int_arg(name: str, value) -> int:
    """value as a Python int; TypeError for floats, bools, None, strings (no silent
    truncation of 2.5 to 2)."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def float_arg(name: str, value) -> float:
    """value as a float; TypeError for strings, None and the like."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def is_sequence(x) -> bool:
    return isinstance(x, (Sequence, np.ndarray)) or (hasattr(x, "__len__") and
                                                     hasattr(x, "__getitem__"))


def token_array(tokens) -> np.ndarray:
    """Token ids as an int64 array; TypeError for floats, bools, strings; ValueError for
    ids too large for any vocabulary."""
    if isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise TypeError(f"tokens must be a sequence of token ids (ints), not "
                        f"{type(tokens).__name__}; use model.tokenize(text) for text")
    arr = np.asarray(tokens)
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == object:
        vals = arr.reshape(-1).tolist()
        for v in vals:
            int_arg("a token id", v)
        big = [v for v in vals if not -2**63 <= int(v) < 2**63]
        if big:
            raise ValueError(f"token id {big[0]} is outside the vocabulary")
        return np.array([int(v) for v in vals], dtype=np.int64).reshape(arr.shape)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got an array of {arr.dtype} "
                        "(floats and bools are not token ids)")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 2**63:
        raise ValueError(f"token id {int(arr.max())} is outside the vocabulary")
    return np.ascontiguousarray(arr, dtype=np.int64)


# -- Context.stream's arguments ------------------------------------------------------------


def prompt_ids(prompt, model) -> list[int]:
    """A prompt (text, tokenized by `model`, or a flat sequence of token ids) as checked
    token ids: TypeError for bytes and other types, ValueError for an empty prompt or an id
    outside the vocabulary."""
    if isinstance(prompt, str):
        ids = model.tokenize(prompt)
    elif isinstance(prompt, (bytes, bytearray)) or not is_sequence(prompt):
        raise TypeError(f"prompt must be a str or a sequence of token ids, not "
                        f"{type(prompt).__name__}")
    else:
        arr = token_array(prompt)
        if arr.ndim != 1 and arr.size:
            raise ValueError("a prompt of token ids must be a flat sequence of ints")
        ids = [int(t) for t in arr.reshape(-1)]
    if not ids:
        raise ValueError("the prompt is empty (no tokens)")
    bad = [t for t in ids if not 0 <= t < model.n_vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {model.n_vocab})")
    return ids


def check_stops(stop) -> list[str]:
    """Context.stream's stop: None, a string or a sequence of non-empty strings, as a list
    (TypeError / ValueError naming what is wrong)."""
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, (bytes, bytearray)) or not is_sequence(stop):
        raise TypeError(f"stop must be a str or a list of str, not {type(stop).__name__}")
    else:
        stops = list(stop)
    for s in stops:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, not {type(s).__name__} ({s!r})")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stops


def repeat_window(history: Sequence[int], repeat_last_n: int) -> Sequence[int]:
    """The tokens a new sampler accepts before the first pick: the last repeat_last_n of
    `history` (the repeat penalty's window; none for repeat_last_n <= 0)."""
    return history[-repeat_last_n:] if repeat_last_n > 0 else []


# -- the OpenAI-style fields of Llama and the server ---------------------------------------


def resolve_max_tokens(max_tokens, n_prompt: int, n_ctx: int) -> int:
    """max_tokens as llama-cpp-python reads it: None or <= 0 = up to the context."""
    if max_tokens is None:
        return max(n_ctx - n_prompt, 0)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
        raise TypeError(f"max_tokens must be an integer or None, got {max_tokens!r}")
    return int(max_tokens) if max_tokens > 0 else max(n_ctx - n_prompt, 0)


def stop_list(stop) -> list[str]:
    """stop as a list of strings (None, a string, or a list of strings), empty strings
    dropped: Llama's and the server's reading (Context.stream refuses an empty one)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a string or a list of strings")
    return [s for s in stop if s]


def stream_kwargs(max_tokens, n_prompt: int, n_ctx: int, *, temperature, top_p, min_p, top_k,
                  repeat_penalty, seed, limit: int | None = None, **more) -> dict:
    """Context.stream's keyword arguments from a request's sampling fields: max_tokens read
    as llama-cpp-python does (resolve_max_tokens), capped at `limit`; `more` (stop,
    repeat_last_n, ignore_eos, ...) passed on."""
    n = resolve_max_tokens(max_tokens, n_prompt, n_ctx)
    return dict(max_tokens=n if limit is None else min(n, limit), temperature=temperature,
                top_p=top_p, min_p=min_p, top_k=top_k, repeat_penalty=repeat_penalty,
                seed=seed, **more)


def make_logits_processor(eos_id: int, processors=None, logit_bias=None,
                          stopping_criteria=None) -> Callable | None:
    """One (input_ids, logits) -> logits callable from llama-cpp-python's hooks: a
    logits_processor (a callable or a list of them, each given an np.intc array of the
    ids so far and the float32 logits), logit_bias ({token id: bias}) and
    stopping_criteria (callables (ids, logits) -> bool; true ends the reply, as "stop")."""
    procs = callables("logits_processor", processors)
    crits = callables("stopping_criteria", stopping_criteria)
    bias = None
    if logit_bias:
        if not isinstance(logit_bias, dict):
            raise TypeError("logit_bias must be a dict {token_id: bias}")
        try:
            bias = {int(k): float(v) for k, v in logit_bias.items()}
        except (TypeError, ValueError):
            raise TypeError("logit_bias must map token ids (int or numeric str) to numbers") \
                from None
    if not procs and not crits and not bias:
        return None

    def process(input_ids, logits):
        ids = np.asarray(input_ids, dtype=np.intc)
        for f in procs:
            logits = f(ids, logits)
        if bias:
            logits = np.array(logits, dtype=np.float32, copy=True)
            for k, v in bias.items():
                if 0 <= k < logits.shape[-1]:
                    logits[k] += v
        if crits and any(bool(c(ids, logits)) for c in crits):
            # End the reply the way the stream already knows: only EOS can be sampled.
            logits = np.full_like(np.asarray(logits, dtype=np.float32), -1e30)
            logits[eos_id] = 0.0
        return logits

    return process


def callables(name: str, value) -> list:
    """A callable or a list of them (None: none) as a list; TypeError naming `name` for
    anything else."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for f in items:
        if not callable(f):
            raise TypeError(f"{name} must be a callable or a list of callables")
    return items


def chain_processors(*procs) -> Callable | None:
    """One (input_ids, logits) -> logits callable running the given ones (None skipped) in
    order."""
    procs = [p for p in procs if p is not None]
    if len(procs) <= 1:
        return procs[0] if procs else None

    def run(ids, logits):
        for p in procs:
            logits = p(ids, logits)
        return logits

    return run
