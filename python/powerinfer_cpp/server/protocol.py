"""The request bodies the routes accept, as OpenAI (and llama-server's extensions) shape
them: pydantic models, strict (a "16" is not an integer and 1 is not a bool, as OpenAI's API
answers them with 400). What they mean is the routes' business (app.py); the responses'
shapes are built by the functions powerinfer_cpp.api shares with the Python API."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

# The sampling ranges are the native sampler's (gh_sampler_new), checked here so that a
# streamed request is refused with a 400 before its stream starts, as an unstreamed one is.


def _temperature(default: float):
    return Field(default, ge=0, allow_inf_nan=False)


class _Body(BaseModel):
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


class CompletionBody(_Body):
    prompt: Union[str, list[str], list[int]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    suffix: Optional[str] = None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatBody(_Body):
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
