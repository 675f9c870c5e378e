"""Embeddings: a text's vector from the model's final hidden states.

The hidden state of a token is the output norm's output, what the head reads
(gh_eval_embd). A text's vector pools those of its tokens the way the file says
(`{arch}.pooling_type`, llama.cpp's values) or the caller asks:

- "mean": the average over the tokens; the default of a file that does not say (a causal
  LM: every token sees only its left context, so the mean uses them all);
- "last": the last token's (the only one that saw the whole text: what decoder embedding
  models such as e5-mistral and Qwen3-Embedding are trained for; their files say "last");
- "cls": the first token's (BERT-style models);
- "none": no pooling, one vector per token.

Vectors are L2-normalised unless asked otherwise (OpenAI's and llama-server's default), so
a dot product is the cosine similarity. Tokens run through the dense FFN (the prompts'
path), whatever the context's decode mode, so a text has one vector.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from . import format as F
from ._native import NativeError, check, ffi, lib

POOLINGS = ("mean", "last", "cls", "none")
# a file's pooling_type value -> our name (rank, 4, is a reranker's head: refused)
_POOLING_NAMES = {v: k for k, v in F.POOLING_TYPES.items() if k != "rank"}
DEFAULT_POOLING = "mean"


class EmbeddingError(ValueError):
    """An input that cannot be embedded (empty, longer than the context, not text or ids)."""


def file_pooling(path: str | os.PathLike, arch: str) -> str | None:
    """The pooling the GGUF file names (`{arch}.pooling_type`), None when it names none;
    EmbeddingError for a value this runtime does not pool by."""
    out = ffi.new("gh_gguf **")
    check(lib.gh_gguf_open(os.fspath(path).encode(), out))
    g = out[0]
    key = F.arch_key(F.KEY_POOLING_TYPE, arch)
    try:
        i = lib.gh_gguf_find_key(g, key.encode())
        if i < 0:
            return None
        v = ffi.new("int64_t *")
        try:
            check(lib.gh_gguf_kv_int(g, i, v))
        except NativeError:
            raise EmbeddingError(f"{key} is not an integer") from None
    finally:
        lib.gh_gguf_close(g)
    if v[0] == F.POOLING_TYPES["rank"]:
        raise EmbeddingError(f"{key} = {v[0]} (rank): a reranker's classification head, "
                             "which this runtime does not run")
    if v[0] not in _POOLING_NAMES:
        raise EmbeddingError(f"{key} = {v[0]} is not a pooling type (0 none, 1 mean, 2 cls, "
                             "3 last)")
    return _POOLING_NAMES[int(v[0])]


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    return pooling


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """hidden [n_tokens, n_embd] pooled to [n_embd] (or left [n_tokens, n_embd] for
    "none"), in float32 (the mean is summed in float64)."""
    if pooling == "mean":
        return hidden.mean(axis=0, dtype=np.float64).astype(np.float32)
    if pooling == "last":
        return hidden[-1].copy()
    if pooling == "cls":
        return hidden[0].copy()
    if pooling == "none":
        return hidden
    raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")


def normalize(v: np.ndarray) -> np.ndarray:
    """v / ||v|| along the last axis (a zero vector stays zero)."""
    n = np.linalg.norm(v.astype(np.float64), axis=-1, keepdims=True)
    return (v / np.where(n > 0, n, 1.0)).astype(np.float32)


def input_ids(model, item, n_ctx: int, truncate: bool, where: str = "input") -> list[int]:
    """One input (a str, or a sequence of token ids) as checked token ids: not empty, ids in
    the vocabulary, at most n_ctx tokens (or cut to n_ctx with truncate). Text is tokenized
    with BOS and EOS as the file says (embedding models that pool the last token mark the end
    with EOS; their files set add_eos_token)."""
    if isinstance(item, str):
        if not item:
            raise EmbeddingError(f"{where} is an empty string")
        ids = model.tokenizer.encode(item, add_bos=None, add_eos=None)
    elif isinstance(item, (bytes, bytearray)):
        raise EmbeddingError(f"{where} must be a str or a list of token ids, not bytes")
    else:
        try:
            ids = [_token(t) for t in item]
        except TypeError:
            raise EmbeddingError(f"{where} must be a str or a list of token ids (ints)") \
                from None
        bad = [t for t in ids if not 0 <= t < model.n_vocab]
        if bad:
            raise EmbeddingError(f"{where}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {model.n_vocab})")
    if not ids:
        raise EmbeddingError(f"{where} has no tokens")
    if len(ids) > n_ctx:
        if not truncate:
            raise EmbeddingError(
                f"{where} has {len(ids)} tokens, more than the context's {n_ctx}: shorten it, "
                "use a larger n_ctx, or truncate")
        ids = ids[:n_ctx]
    return ids


def _token(t) -> int:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
        raise TypeError
    return int(t)


def inputs_list(inputs) -> tuple[list, bool]:
    """(the inputs as a list, whether one input was given): a str or one list of ids is one
    input; a list of str or of lists of ids, several."""
    if isinstance(inputs, str):
        return [inputs], True
    if isinstance(inputs, (bytes, bytearray)) or not isinstance(inputs, (Sequence, np.ndarray)):
        raise EmbeddingError("input must be a str, a list of str, a list of token ids or a "
                             f"list of such lists, not {type(inputs).__name__}")
    items = list(inputs)
    if not items:
        raise EmbeddingError("input is an empty list")
    if all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
           for x in items):
        return [items], True
    return items, False


def embed_ids(ctx, ids: list[int], pooling: str, normalized: bool) -> np.ndarray:
    """The vector of checked token ids on a context (its cache is reset to them)."""
    v = pool(ctx.hidden_states(ids), pooling)
    return normalize(v) if normalized else v
