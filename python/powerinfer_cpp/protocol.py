"""OpenAI's shapes, one home for the Python API (`Llama`) and the server: the response and
chunk dicts (text_completion, chat.completion, chat.completion.chunk, the embeddings list,
usage) built by the functions below, so both give the same dicts for the same request; and
the request bodies the server accepts, as OpenAI (and llama-server's extensions) shape them.

The bodies are pydantic models, strict (a "16" is not an integer and 1 is not a bool, as
OpenAI's API answers them with 400); pydantic comes with the server extra, so they are
defined only where it is installed (Llama needs only the builders)."""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np

# -- responses ---------------------------------------------------------------------------


def new_id(kind: str) -> str:
    """A response id ("cmpl-..." / "chatcmpl-...")."""
    return f"{kind}-{uuid.uuid4().hex}"


def usage(result) -> dict:
    """The usage block of a finished Completion (cached prompt tokens in the details)."""
    p, c = result.n_prompt_tokens, len(result.tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": getattr(result, "n_cached_tokens", 0)}}


def completion_response(cid: str, created: int, model: str, text: str, finish_reason: str,
                        result) -> dict:
    """A text_completion dict."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(result)}


def completion_chunk(cid: str, created: int, model: str, text: str,
                     finish_reason: str | None = None) -> dict:
    """One streamed text_completion chunk."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None,
                         "finish_reason": finish_reason}]}


def chat_response(cid: str, created: int, model: str, text: str, finish_reason: str,
                  result) -> dict:
    """A chat.completion dict."""
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(result)}


def chat_chunk(cid: str, created: int, model: str, delta: dict,
               finish_reason: str | None = None) -> dict:
    """One streamed chat.completion.chunk."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}


def embedding_response(vectors, model: str, n_tokens: int, encoding_format: str = "float") -> dict:
    """An embeddings list: one entry per input vector, as floats or (encoding_format
    "base64") the base64 of its little-endian float32 bytes, as OpenAI sends them."""
    def enc(v):
        if encoding_format == "base64":
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return np.asarray(v, dtype=np.float32).tolist()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": enc(v)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def usage_chunk(cid: str, obj: str, created: int, model: str, result) -> dict:
    """The last chunk of a stream asked for with stream_options.include_usage: no choices,
    the usage (`obj`: "text_completion" or "chat.completion.chunk")."""
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(result)}


# -- request bodies (the server's) -------------------------------------------------------

try:
    from pydantic import BaseModel, ConfigDict, Field
except ImportError:  # no server extra: the bodies are not needed
    pass
else:
    # The sampling ranges are the native sampler's (gh_sampler_new), checked here so that a
    # streamed request is refused with a 400 before its stream starts, as an unstreamed one is.


    def _temperature(default: float):
        return Field(default, ge=0, allow_inf_nan=False)


    class Body(BaseModel):
        model_config = ConfigDict(strict=True, extra="ignore")

        model: Optional[str] = None
        max_tokens: Optional[int] = None
        temperature: float = _temperature(0.8)
        top_p: float = Field(0.95, gt=0, allow_inf_nan=False)
        top_k: int = Field(40, ge=-2**31, lt=2**31)
        min_p: float = Field(0.05, ge=0, le=1, allow_inf_nan=False)
        repeat_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
        stop: Union[str, list[str], None] = None
        seed: Optional[int] = None
        stream: bool = False
        stream_options: Optional[dict[str, Any]] = None
        n: int = 1
        logit_bias: Optional[dict[str, float]] = None
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        logprobs: Union[bool, int, None] = None
        user: Optional[str] = None
        ignore_eos: bool = False  # llama.cpp's server extension: generate past EOS
        grammar: Optional[str] = None  # llama.cpp's server extension: a GBNF (or Lark) grammar


    class CompletionBody(Body):
        prompt: Union[str, list[str], list[int]]
        max_tokens: Optional[int] = 16
        echo: bool = False
        suffix: Optional[str] = None


    class Message(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")

        role: Literal["system", "user", "assistant", "developer", "tool"]
        content: Union[str, list[dict[str, Any]], None] = None


    class ChatBody(Body):
        messages: list[Message] = Field(min_length=1)
        temperature: float = _temperature(0.2)
        max_completion_tokens: Optional[int] = None
        tools: Optional[list[Any]] = None
        tool_choice: Union[str, dict[str, Any], None] = None
        parallel_tool_calls: bool = True
        response_format: Optional[dict[str, Any]] = None


    class EmbeddingBody(BaseModel):
        """/v1/embeddings: `input` a string, a list of strings, a list of token ids or a list of
        such lists; the vectors as floats or base64 (little-endian float32, what the openai
        client asks for by default)."""

        model_config = ConfigDict(strict=True, extra="ignore")

        input: Union[str, list[str], list[int], list[list[int]]]
        model: Optional[str] = None
        encoding_format: Literal["float", "base64"] = "float"
        dimensions: Optional[int] = None
        user: Optional[str] = None
