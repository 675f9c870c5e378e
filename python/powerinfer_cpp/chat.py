"""Chat templates: render a model's ``tokenizer.chat_template`` (jinja2) into a prompt.

    tmpl = ChatTemplate.from_model(model)                    # the file's template
    text = tmpl.render([{"role": "user", "content": "Hi"}])  # add_generation_prompt=True
    ids = tmpl.tokenize(model, text)                         # no doubled BOS

The semantics are Hugging Face's ``apply_chat_template``: the template sees ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` (and the other special tokens), the
functions ``raise_exception(msg)`` and ``strftime_now(fmt)``, a ``tojson`` filter that
keeps non-ASCII text, the ``loopcontrols`` extension (``break``/``continue``), and it is
compiled with ``trim_blocks`` and ``lstrip_blocks``. Templates come from files, so they run
in jinja2's immutable sandbox: no attribute access to Python internals, no mutation of
the messages.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "ChatTemplateLimitError", "ChatTemplate", "normalize_messages"]


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, fails while rendering, or raised
    an error itself (``raise_exception``)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A render went past a limit it was given (output size here; the server's worker
    adds time and memory); ``limit`` names it."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


def _raise_exception(message: str = "the chat template raised an error"):
    """raise_exception() as templates call it: a clear Python error with their message."""
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    # Hugging Face's filter keeps non-ASCII characters as they are (jinja2's own escapes
    # them and marks the result safe for HTML, which a prompt is not).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


# The largest string, list or integer (in digits) one operator may make: a prompt never
# needs more, and {{ 'a' * 300000000 }} is a single C call nothing can interrupt.
MAX_OPERATION_SIZE = 10_000_000


def _result_size(op: str, left, right) -> int:
    """How big `left op right` would be (characters, items, or decimal digits), worked out
    without computing it; 0 when it is small by nature."""
    sized = (str, list, tuple)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(n, int):
                return len(seq) * max(n, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (abs(left).bit_length() + abs(right).bit_length()) * 30 // 100
    if op == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return abs(left).bit_length() * right * 30 // 100
    return 0


def _environment():
    class Env(ImmutableSandboxedEnvironment):
        # Intercepted: checked in call_binop before they run (and never folded at compile
        # time, where the server would compute them itself).
        intercepted_binops = frozenset({"*", "+", "**"})

        def call_binop(self, context, operator, left, right):
            if _result_size(operator, left, right) > MAX_OPERATION_SIZE:
                raise ChatTemplateLimitError(
                    f"the chat template's '{operator}' would make a value larger than the "
                    f"sandbox's limit of {MAX_OPERATION_SIZE} characters/items",
                    "operation size")
            return super().call_binop(context, operator, left, right)

    return Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])


@functools.lru_cache(maxsize=32)
def _compile(source: str):
    """The compiled template (cached: a server renders the same template per request)."""
    env = _environment()
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} "
                                f"(template line {e.lineno})") from None


def normalize_messages(messages: Any) -> list[dict]:
    """Check OpenAI-style messages and return plain dicts; content given as a list of
    {"type": "text", "text": ...} parts is joined into one string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, not "
                        f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', not "
                            f"{type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a 'role' string (system, user, assistant)")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content: only text parts "
                                     "({'type': 'text', 'text': ...}) are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise TypeError(f"messages[{i}].content must be a string, not "
                            f"{type(content).__name__}")
        d = dict(m)
        d["content"] = "" if content is None else content
        out.append(d)
    return out


class ChatTemplate:
    """A compiled chat template plus the special tokens it is rendered with."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 special_tokens: Mapping[str, str] | None = None, compile: bool = True):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty")
        self.source = source
        self.tokens = dict(special_tokens or {})
        self.tokens["bos_token"] = bos_token
        self.tokens["eos_token"] = eos_token
        # Compiling runs template code: jinja evaluates constant expressions and filters
        # then ({{ 'a'|center(300000000) }} takes seconds and 300 MB in whoever compiles).
        # compile=False leaves it to the first render (the server's render worker).
        self._compiled = _compile(source) if compile else None

    @property
    def _template(self):
        if self._compiled is None:
            self._compiled = _compile(self.source)
        return self._compiled

    @classmethod
    def from_model(cls, model, template: str | None = None,
                   compile: bool = True) -> "ChatTemplate":
        """The template of a loaded Model (``template`` overrides the file's); a clear error
        when the file has none and none is given."""
        tok = model.tokenizer
        source = template if template is not None else tok.chat_template
        if not source:
            raise ChatTemplateError(
                f"{getattr(model, 'path', 'the model')} has no chat template "
                "(tokenizer.chat_template); pass one (chat_template=... / --chat-template-file), "
                "or add \"chat_template\" to the Hugging Face folder's tokenizer_config.json and "
                "convert again")

        def piece(i):
            return "" if i is None else tok.token_to_piece(i, special=True)

        special = {"unk_token": piece(tok.unk_id), "pad_token": piece(tok.pad_id)}
        return cls(source, bos_token=piece(tok.bos_id), eos_token=piece(tok.eos_id),
                   special_tokens=special, compile=compile)

    def render(self, messages: Iterable[Mapping], add_generation_prompt: bool = True,
               max_chars: int | None = None, **extra) -> str:
        """The prompt text for ``messages`` (``extra`` become template variables, e.g.
        ``tools`` or ``date_string``). ``max_chars``: stop as soon as the output grows
        past it (ChatTemplateLimitError) instead of building all of it."""
        msgs = normalize_messages(list(messages) if not isinstance(messages, Sequence)
                                  else messages)
        variables = {**self.tokens, **extra, "messages": msgs,
                     "add_generation_prompt": bool(add_generation_prompt)}
        try:
            if max_chars is None:
                return self._template.render(**variables)
            # generate() hands the output over piece by piece, so a template that writes
            # without end is stopped at the cap rather than when memory runs out.
            out, n = [], 0
            for piece in self._template.generate(**variables):
                n += len(piece)
                if n > max_chars:
                    raise ChatTemplateLimitError(
                        f"the chat template's output exceeds the cap of {max_chars} "
                        "characters", "output size")
                out.append(piece)
            return "".join(out)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def tokenize(self, model, text: str) -> list[int]:
        """Token ids of a rendered prompt: special-token text becomes the special tokens,
        and BOS is added as the file says unless the template already wrote it."""
        bos = self.tokens.get("bos_token") or ""
        add_bos = None if not (bos and text.startswith(bos)) else False
        return model.tokenizer.encode(text, add_bos=add_bos, special=True)

    def turn_separator(self) -> str:
        """The text the template writes between the end of an assistant reply and the next
        user message (e.g. "\\nuser: "), used as a stop string so that a model that goes on
        to write the user's next turn is cut there; "" if it cannot be found."""
        a, b = "\x00A\x00", "\x00B\x00"
        try:
            text = self.render([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": a},
                                {"role": "user", "content": b}], add_generation_prompt=False)
        except ChatTemplateError:
            return ""
        i, j = text.find(a), text.find(b)
        if i < 0 or j < i:
            return ""
        return text[i + len(a):j]

    def stop_strings(self) -> list[str]:
        """Stop strings for a chat reply: the template's turn separator (when it has visible
        text) and the EOS token's text."""
        stops = []
        sep = self.turn_separator()
        if sep.strip():
            stops.append(sep)
        eos = self.tokens.get("eos_token")
        if eos and eos not in stops:
            stops.append(eos)
        return stops
