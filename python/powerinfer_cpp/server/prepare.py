"""From a request body to what a slot runs: every check that can refuse a request, done
before it is handed to a slot, cheapest first, and the costly steps off the event loop.

1. the body as JSON, bounded: no NaN/Infinity, nesting at most MAX_DEPTH, no lone
   surrogates in any string (each would otherwise fail later, as a 500);
2. characters before tokens: a prompt longer than the context could hold even if every
   token were the vocabulary's longest is refused before it is tokenized (a 1 MB prompt
   at a 512-token context costs a comparison, not a second of tokenizing);
3. the chat template rendered in a worker process (templates.py), with a deadline;
4. tokenization of a long text in a worker thread (the tokenizer releases the GIL for
   long texts), with a deadline; a short one inline, as a thread hop would cost more.

A batching scheduler takes over after this: it receives token ids and checked sampling
arguments, never raw text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math

from ..chat import ChatTemplateError, ChatTemplateLimitError
from .errors import APIError
from .templates import MAX_WORKERS

MAX_DEPTH = 32          # no OpenAI request body nests deeper than ~6
INLINE_CHARS = 4096     # tokenized on the event loop below this (~1-3 ms at most)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes):
    """The request body as a JSON object; APIError 400 for anything a JSON parser would
    accept but the rest of the server could not handle."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests JSON deeper than {MAX_DEPTH} levels") \
            from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_values(data)
    return data


def check_values(data) -> None:
    """Nesting depth and valid Unicode in every string (keys too), without recursion."""
    stack = [(data, 1, "")]
    while stack:
        obj, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"the request body nests JSON deeper than {MAX_DEPTH} levels",
                           param=where or None)
        if isinstance(obj, dict):
            for k, v in obj.items():
                at = f"{where}.{k}" if where else str(k)
                _check_str(k, at)
                stack.append((v, depth + 1, at))
        elif isinstance(obj, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(obj))
        elif isinstance(obj, str):
            _check_str(obj, where)


def _check_str(s: str, where: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{where or 'the body'}: invalid Unicode: a lone surrogate "
                       f"(\\u{ord(s[e.start]):04x}) at character {e.start}",
                       param=where or None) from None


def check_logit_bias(bias: dict | None, n_vocab: int) -> dict[int, float] | None:
    """logit_bias as {id: bias}: ids inside the vocabulary, finite biases; else 400."""
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        try:
            i = int(k)
        except ValueError:
            i = None
        if i is None or not 0 <= i < n_vocab or str(i) != k.strip():
            raise APIError(400, f"logit_bias: token id {k!r} is not an id in this model's "
                           f"vocabulary [0, {n_vocab})", param="logit_bias")
        if not math.isfinite(v):
            raise APIError(400, f"logit_bias[{k}] = {v} is not a finite number",
                           param="logit_bias")
        out[i] = float(v)
    return out


class PromptPreparer:
    """Renders and tokenizes prompts for one server. `max_token_chars` is the longest
    token's text in bytes (a bound on the characters any token stands for)."""

    def __init__(self, model, n_ctx: int, tokenize_timeout: float, runner=None,
                 max_token_chars: int | None = None):
        self.model, self.n_ctx, self.timeout, self.runner = model, n_ctx, tokenize_timeout, runner
        if max_token_chars is None:
            max_token_chars = longest_token(model)
        self.max_chars = n_ctx * max(1, max_token_chars)
        # Tokenizing uses the CPU (two threads: one long prompt does not hold up the
        # next); a render only waits on a worker process's pipe, one thread per worker.
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self.render_pool = concurrent.futures.ThreadPoolExecutor(MAX_WORKERS,
                                                                 thread_name_prefix="render")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.render_pool.shutdown(wait=False, cancel_futures=True)

    def check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise APIError(400, f"This model's maximum context length is {self.n_ctx} tokens; "
                           f"the prompt has {len(text)} characters, more than that many "
                           f"tokens can hold ({self.max_chars}: {self.n_ctx} times the "
                           "longest token)", param=param, code="context_length_exceeded")

    async def tokenize(self, text: str, param: str, encode) -> list[int]:
        """encode(text) after the character check; off the loop when it is long."""
        self.check_chars(text, param)
        if len(text) <= INLINE_CHARS:
            return self._encode(encode, text, param)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.pool, self._encode, encode, text, param)
        try:
            return await asyncio.wait_for(fut, self.timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"tokenizing the prompt took longer than {self.timeout:g} s "
                           "(the server is busy); retry later", type="server_error",
                           code="server_busy") from None

    @staticmethod
    def _encode(encode, text: str, param: str) -> list[int]:
        try:
            return encode(text)
        except (ValueError, TypeError, UnicodeError) as e:
            raise APIError(400, f"the {param} cannot be tokenized: {e}", param=param) from None

    async def render(self, messages: list[dict], tools: list | None = None) -> str:
        """The chat template's text for messages (and the `tools` variable, when given),
        from a worker process."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.render_pool, self.runner.render, messages,
                                              True, tools)
        except ChatTemplateLimitError as e:
            if e.limit == "output size":  # the cap is what the context can hold
                raise APIError(400, f"This model's maximum context length is {self.n_ctx} "
                               f"tokens; the chat's prompt has more than {self.max_chars} "
                               f"characters, more than that many tokens can hold",
                               param="messages", code="context_length_exceeded") from None
            raise APIError(400, str(e), param="messages", code="chat_template_limit") from None
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None


def longest_token(model) -> int:
    """The most bytes any one token decodes to (special tokens as their text)."""
    tok = model.tokenizer
    return max((len(tok.token_to_bytes(i, special=True)) for i in range(model.n_vocab)),
               default=1)
