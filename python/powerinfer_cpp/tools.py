"""OpenAI tool calling through the model's own chat template and its native call syntax.

A tool format is a row of FORMATS: how the model writes its calls (the text before and
after them, the key of the arguments, one JSON list or one block per call), whether the
template renders the tools itself, and how a plain answer looks. The row is picked from
the chat template's source (format_for_template): a template that renders `tools` and
writes one of the native markers gets that format, any other the generic one.

- "hermes" (Hermes 2 Pro, Qwen2.5, ...): one block per call,
  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
- "mistral" (Mistral v0.3, Mistral Nemo, ...): [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...];
  its templates want tool-call ids of 9 letters and digits: OpenAI's ids are mapped to such.
- "llama3" (Llama 3.1 / 3.2 JSON tool calling): one call per reply,
  {"name": ..., "parameters": {...}}, perhaps after <|python_tag|>.
- "generic" (any other template, e.g. ChatML without tools; llama.cpp's generic way): the
  tools go into the system message as text and the reply is one JSON object,
  {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} or {"response": "..."}; earlier
  calls and results go back as that JSON.

With a native format the template gets the OpenAI `tools` list as its `tools` variable and
earlier turns as structured messages (an assistant message's tool_calls with their
arguments as objects, tool results as role "tool"), so it writes them the way the model was
trained on. In every format the reply is constrained (structured.py, an llguidance Lark
grammar) to that format's calls, each call's arguments valid under its tool's parameter
schema, or (tool_choice "auto") a plain answer, which may not begin with the call syntax.
A marker that is one special token of the model's vocabulary (Mistral's [TOOL_CALLS],
Llama's <|python_tag|>) is required as that token, and since a reply's text drops special
tokens, the parser then finds the calls without it.

A reply that calls tools becomes OpenAI's message.tool_calls (each call's arguments the
JSON text the model wrote) with finish_reason "tool_calls"; one that answers, plain
content. Streamed (ToolStream), the deltas are OpenAI's: a call's first delta carries its
index, id, type and name (arguments ""), the following ones pieces of its arguments' text;
a plain answer streams as content once it cannot be the start of a call.

tool_choice: "auto" (call or answer), "required" (call), {"type": "function",
"function": {"name": ...}} (call that one), "none" (the tools are left out: a plain reply).
parallel_tool_calls=False allows one call per reply (the llama3 format always).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .structured import JSON_DEFAULTS, GrammarError, json_schema_grammar


class ToolError(ValueError):
    """tools, tool_choice or a tool message that cannot be used; the message names why."""


@dataclass(frozen=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]  # any of these in a template that renders `tools` selects it
    open: str                 # before the calls (as_list) or before each call
    close: str                # after them / it
    sep: str                  # between two calls' blocks (not as_list)
    args_key: str             # the key of a call's arguments
    as_list: bool             # all calls in one JSON array between open and close
    single: bool              # one call per reply, whatever parallel_tool_calls says
    id_len: int | None        # tool-call ids the template wants: this many letters/digits
    native: bool              # the template renders `tools` and structured tool_calls
    json_answer: bool         # a plain answer is {"response": "..."} (else free text)
    specials: tuple[str, ...]  # parts of open/close that may be one special token
    prefixes: tuple[str, ...] = ()  # text the model may write before a call (parsed, not made)


FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat("hermes", ("<tool_call>",), "<tool_call>\n", "\n</tool_call>", "\n",
               "arguments", False, False, None, True, False, ("<tool_call>", "</tool_call>")),
    ToolFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", "", "", "arguments", True, False,
               9, True, False, ("[TOOL_CALLS]",)),
    ToolFormat("llama3", ("<|python_tag|>", "ipython"), "", "", "", "parameters", False, True,
               None, True, False, (), ("<|python_tag|>",)),
    ToolFormat("generic", (), '{"tool_calls":', "}", "", "arguments", True, False, None, False,
               True, ()),
)
FORMAT_NAMES = {f.name: f for f in FORMATS}
GENERIC = FORMAT_NAMES["generic"]


def format_for_template(source: str | None) -> ToolFormat:
    """The tool format a chat template writes: the first native row one of whose markers
    the template uses, if it renders `tools` at all; else the generic format."""
    if source and "tools" in source:
        for f in FORMATS:
            if f.native and any(m in source for m in f.markers):
                return f
    return GENERIC


def _tool(t: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
    f = t.get("function")
    if not isinstance(f, dict):
        raise ToolError(f"{where}.function must be an object with a name")
    name = f.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function.name must be a non-empty string")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise ToolError(f"{where}.function.name {name!r} must be 1-64 letters, digits, '_', "
                        "'.' or '-' (as OpenAI's)")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object, not "
                        f"{type(params).__name__}")
    if params.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters must describe an object "
                        f"(\"type\": \"object\"), not {params.get('type')!r}")
    if "properties" in params and not isinstance(params["properties"], dict):
        raise ToolError(f"{where}.function.parameters.properties must be an object")
    if "required" in params and not (isinstance(params["required"], list) and all(
            isinstance(r, str) for r in params["required"])):
        raise ToolError(f"{where}.function.parameters.required must be a list of names")
    desc = f.get("description", "")
    if not isinstance(desc, str):
        raise ToolError(f"{where}.function.description must be a string")
    return {"name": name, "description": desc, "parameters": params}


def _lark_str(s: str) -> str:
    return json.dumps(s)  # a Lark string literal: JSON's escapes


class ToolPlan:
    """What one request's tools turn into: the messages and template variables to render,
    the grammar of the reply, and the parser of the reply (whole or streamed)."""

    def __init__(self, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool = True,
                 template_source: str | None = None, fmt: ToolFormat | None = None):
        if not isinstance(tools, list) or not tools:
            raise ToolError("tools must be a non-empty list of {\"type\": \"function\", ...}")
        self.tools = [_tool(t, i) for i, t in enumerate(tools)]
        names = [t["name"] for t in self.tools]
        if len(set(names)) != len(names):
            raise ToolError(f"tools: function names must be distinct ({names})")
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, dict):
            fn = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
                else None
            if fn not in names:
                raise ToolError(f"tool_choice names the function {fn!r}, which is not in tools "
                                f"({', '.join(names)})")
            self.mode, self.only = "required", fn
        elif choice in ("auto", "required", "none"):
            self.mode, self.only = choice, None
        else:
            raise ToolError(f"tool_choice must be \"auto\", \"required\", \"none\" or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, not "
                            f"{choice!r}")
        self.fmt = fmt if fmt is not None else format_for_template(template_source)
        self.parallel = bool(parallel_tool_calls) and not self.fmt.single
        self.active = self.mode != "none"
        self.use_special_tokens({})  # none known until grammar() sees the tokenizer

    def _allowed(self) -> list[dict]:
        return [t for t in self.tools if self.only in (None, t["name"])]

    # -- the prompt ------------------------------------------------------------------

    def system_text(self) -> str:
        """The generic format's instructions (the system message's end)."""
        lines = ["You can call these tools (each one's arguments follow its JSON schema):"]
        for t in self._allowed():
            lines.append(json.dumps({"name": t["name"], "description": t["description"],
                                     "parameters": t["parameters"]}, ensure_ascii=False))
        call = ('{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}'
                + (", ..." if self.parallel else "") + ']}')
        if self.mode == "auto":
            lines.append(f"Reply with one JSON object: {call} to call tools, or "
                         '{"response": "<your answer>"} to answer directly.')
        else:
            lines.append(f"Reply with one JSON object that calls a tool: {call}")
        return "\n".join(lines)

    def template_vars(self) -> dict:
        """The variables the chat template gets beside the messages: a native format's
        templates render `tools` (OpenAI's shape) themselves."""
        if not (self.active and self.fmt.native):
            return {}
        return {"tools": [{"type": "function", "function": t} for t in self._allowed()]}

    def messages(self, messages: list[dict]) -> list[dict]:
        """OpenAI messages (normalised) as the template gets them: native formats get the
        tool calls as structures, the generic one the tools in the system message and
        earlier calls and results as the JSON the model writes and reads."""
        if self.fmt.native:
            return native_messages(messages, self.fmt)
        out = [as_template_message(m, i) for i, m in enumerate(messages)]
        if not self.active:
            return out
        text = self.system_text()
        if out and out[0].get("role") in ("system", "developer"):
            first = dict(out[0])
            first["content"] = (first.get("content") or "") + "\n\n" + text
            return [first] + out[1:]
        return [{"role": "system", "content": text}] + out

    # -- the grammar -----------------------------------------------------------------

    def _call_schema(self, t: dict) -> dict:
        return {"type": "object",
                "properties": {"name": {"const": t["name"]},
                               self.fmt.args_key: t["parameters"]},
                "required": ["name", self.fmt.args_key], "additionalProperties": False}

    def schema(self) -> dict | None:
        """The JSON schema of one call (None when the tools are left out)."""
        if not self.active:
            return None
        calls = [self._call_schema(t) for t in self._allowed()]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def _lit(self, text: str, special_ids: dict[str, int]) -> str:
        """text as Lark: its special-token parts as those tokens (<[id]>), the rest quoted."""
        parts = []
        for piece in re.split("(" + "|".join(map(re.escape, self.fmt.specials)) + ")",
                              text) if self.fmt.specials else [text]:
            if not piece:
                continue
            parts.append(f"<[{special_ids[piece]}]>" if piece in special_ids
                         else _lark_str(piece))
        return " ".join(parts)

    def use_special_tokens(self, special_ids: dict[str, int]) -> None:
        """The format's markers that are one special token of the model (marker -> id):
        the grammar asks for that token, and the parser does without its text, which a
        reply's text drops."""
        self.special_ids = dict(special_ids)
        self.dropped = frozenset(special_ids)
        self._set_patterns()

    def grammar_text(self) -> str:
        """The Lark grammar of the reply (llguidance's dialect)."""
        f, special_ids = self.fmt, self.special_ids
        # compact JSON, as structured.py's (a model cannot spend its tokens on whitespace)
        compact = {"x-guidance": JSON_DEFAULTS}
        rules = []
        if f.as_list:
            arr = {"type": "array", "items": self.schema(), "minItems": 1,
                   **({} if self.parallel else {"maxItems": 1}), **compact}
            rules.append(f"calls: {self._lit(f.open, special_ids)} %json {json.dumps(arr)} "
                         f"{self._lit(f.close, special_ids)}".rstrip())
        else:
            block = f"{self._lit(f.open, special_ids)} call {self._lit(f.close, special_ids)}"
            more = f" ({_lark_str(f.sep)} {block})*" if self.parallel else ""
            rules.append(f"calls: {block}{more}")
            rules.append(f"call: %json {json.dumps({**self.schema(), **compact})}")
        if self.mode != "auto":
            rules.insert(0, "start: calls")
        elif f.json_answer:
            rules.insert(0, "start: calls | answer")
            rules.append('answer: "{\\"response\\":" %json '
                         f'{json.dumps({"type": "string", **compact})} "}}"')
        else:
            # a plain answer: any text that does not begin like a call
            start = self._visible(f.open).strip() or ("[" if f.as_list else "{")
            rules.insert(0, "start: calls | ANSWER")
            rules.append(f"ANSWER: /(?s:.+)/ & ~/(?s:\\s*{_lark_re(start)}.*)/")
        return "\n".join(rules) + "\n"

    def grammar(self, tokenizer=None) -> str | None:
        """The llguidance grammar of the reply (None when the tools are left out);
        tokenizer (the model's) says which of the format's markers are single special
        tokens, required as such. ToolError names a tool whose parameters schema cannot be
        used."""
        if not self.active:
            return None
        from .structured import _llg

        llg = _llg()
        for i, t in enumerate(self.tools):  # each schema on its own: the error names it
            if self.only not in (None, t["name"]):
                continue
            try:
                g = json_schema_grammar(t["parameters"], f"tools[{i}].function.parameters")
            except GrammarError as e:
                raise ToolError(str(e)) from None
            err = llg.LLMatcher.validate_grammar(g)
            if err and not err.startswith("WARNING"):
                raise ToolError(f"tools[{i}].function.parameters ({t['name']}): {err}")
        if tokenizer is not None:
            found = {}
            for m in self.fmt.specials:
                ids = tokenizer.encode(m, add_bos=False, special=True)
                if len(ids) == 1 and tokenizer.is_special(ids[0]):
                    found[m] = ids[0]
            self.use_special_tokens(found)
        try:
            return llg.grammar_from("lark", self.grammar_text())
        except Exception as e:  # noqa: BLE001 (whatever the library raises)
            raise ToolError(f"tools: the call grammar cannot be built: {e}") from None

    # -- the reply -------------------------------------------------------------------

    def _visible(self, text: str) -> str:
        """text as a reply shows it: the markers that are special tokens dropped."""
        for m in self.dropped:
            text = text.replace(m, "")
        return text

    def _text_start(self) -> str:
        """How a call begins in a reply's text (before the first call's JSON)."""
        return self._visible(self.fmt.open) + ("[" if self.fmt.as_list else "{")

    def _set_patterns(self) -> None:
        f = self.fmt

        def pat(text):  # the visible text, or the written marker, either way
            out = []
            for piece in re.split("(" + "|".join(map(re.escape, f.specials)) + ")", text) \
                    if f.specials else [text]:
                if piece in self.dropped:
                    out.append(f"(?:{re.escape(piece)})?")
                elif piece:
                    out.append(re.escape(piece).replace("\\\n", "\\s*").replace("\n", "\\s*"))
            return "".join(out)

        prefix = "".join(f"(?:{re.escape(p)})?" for p in f.prefixes)
        self._open_re = re.compile(r"\s*" + prefix + pat(f.open) + r"\s*")
        self._close_re = re.compile(r"\s*" + pat(f.close))
        self._sep_re = re.compile(r"\s*")

    def split_calls(self, text: str) -> list[tuple[str, str]] | None:
        """[(name, arguments' JSON text)] of a reply that is the format's calls and nothing
        else; None when it is not (a plain answer, or calls cut short)."""
        f = self.fmt
        dec = json.JSONDecoder()
        m = self._open_re.match(text)
        if m is None:
            return None
        pos = m.end()
        objs: list[tuple[dict, str]] = []
        try:
            if f.as_list:
                value, end = dec.raw_decode(text, pos)
                if not isinstance(value, list) or not value:
                    return None
                spans = _item_spans(text, pos)
                objs = list(zip(value, (text[a:b] for a, b in spans)))
                pos = end
                m = self._close_re.match(text, pos)
                if m is None:
                    return None
                pos = m.end()
            else:
                while True:
                    value, end = dec.raw_decode(text, pos)
                    objs.append((value, text[pos:end]))
                    m = self._close_re.match(text, end)
                    if m is None:
                        return None
                    pos = m.end()
                    m = self._open_re.match(text, pos)
                    if m is None or m.end() == pos or pos == len(text.rstrip()):
                        break
                    pos = m.end()
        except ValueError:
            return None
        if text[pos:].strip():
            return None
        calls = []
        for value, raw in objs:
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return None
            key = f.args_key if f.args_key in value else \
                next((k for k in ("arguments", "parameters") if k in value), None)
            if key is None or not isinstance(value[key], dict):
                return None
            fields = _object_fields(raw, 0)
            a, b = fields[key]
            calls.append((value["name"], raw[a:b]))
        return calls

    def parse(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """(the assistant message, finish_reason) of a reply's text."""
        if not self.active:
            return {"role": "assistant", "content": text}, finish_reason
        calls = self.split_calls(text)
        if calls:
            return {"role": "assistant", "content": None,
                    "tool_calls": [{"id": new_call_id(), "type": "function",
                                    "function": {"name": n, "arguments": a}}
                                   for n, a in calls]}, "tool_calls"
        return {"role": "assistant", "content": self.answer_text(text)}, finish_reason

    def answer_text(self, text: str) -> str:
        """A plain answer's content (the generic format's {"response": ...} unwrapped)."""
        if self.fmt.json_answer:
            try:
                value = json.loads(text)
            except ValueError:
                return text
            if isinstance(value, dict) and isinstance(value.get("response"), str):
                return value["response"]
        return text

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """A streamed reply's deltas in OpenAI's shape: feed() each piece of text, finish() at
    the end; each returns the delta to send (None: nothing yet)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""
        self.kind: str | None = None  # "calls" or "text" once the reply's start says which
        self.sent_text = 0            # characters of the answer sent
        self.calls: list[dict] = []   # per call: id, whether its head was sent, args sent
        self._scans: dict = {}        # JSON values' ends found so far (_value_end)
        self._answer: list | None = None  # generic answer: [next char to decode, its _Scan]

    def feed(self, piece: str) -> dict | None:
        self.buf += piece
        return self._deltas(final=False)

    def finish(self, finish_reason: str) -> tuple[dict, str]:
        """The last delta (what is left) and the finish_reason."""
        plan = self.plan
        calls = plan.split_calls(self.buf) if plan.active else None
        if calls and self.kind != "text":
            self.kind = "calls"
            return self._call_deltas(calls) or {}, "tool_calls"
        if self.kind is None:
            self.kind = "text"
        if self.kind == "text":
            return self._deltas(final=True) or {}, finish_reason
        return {}, finish_reason  # calls cut short (max_tokens): what was sent stays

    def _deltas(self, final: bool) -> dict | None:
        plan = self.plan
        if self.kind is None:
            if not plan.active:
                self.kind = "text"
            else:
                head = self.buf.lstrip()
                for p in plan.fmt.prefixes:
                    if head.startswith(p):
                        head = head[len(p):].lstrip()
                    elif p.startswith(head):
                        return None
                start = re.sub(r"\s+", "", plan._text_start())
                squeezed = re.sub(r"\s+", "", head)
                if start.startswith(squeezed) and not final:
                    return None  # could still be a call
                self.kind = "calls" if squeezed.startswith(start) else "text"
        if self.kind == "text":
            if plan.fmt.json_answer:
                new = self._json_answer(final)
            else:
                new, self.sent_text = self.buf[self.sent_text:], len(self.buf)
            return {"content": new} if new else None
        return self._call_deltas(self._partial_calls())

    def _json_answer(self, final: bool) -> str:
        """The generic format's {"response": "..."}: the answer's characters decoded since
        the last call, the longest piece of its JSON string that decodes (an escape or a
        surrogate pair may be cut); at the end, text that is no such object as it is."""
        if self._answer is None:
            m = re.match(r'\s*\{\s*"response"\s*:\s*"', self.buf)
            if m is None:
                if not final:
                    return ""
                new, self.sent_text = self.buf[self.sent_text:], len(self.buf)
                return new
            self._answer = [m.end(), _Scan(self.buf, m.end() - 1)]
        at, scan = self._answer
        end = scan.run(self.buf)
        seg = self.buf[at:end - 1 if end is not None else len(self.buf)]
        for cut in range(len(seg), max(len(seg) - 12, -1), -1):
            try:
                out = json.loads('"' + seg[:cut] + '"')
            except ValueError:
                continue
            if out and "\ud800" <= out[-1] <= "\udbff" and not (end is not None and
                                                              cut == len(seg)):
                continue  # half a surrogate pair: wait for the other half
            self._answer[0] = at + cut
            return out
        return ""

    def _partial_calls(self) -> list[tuple[str | None, str]]:
        """[(name or None while it is incomplete, the arguments' text so far)]."""
        plan, text, out = self.plan, self.buf, []
        m = plan._open_re.match(text)
        if m is None:
            return out
        pos = m.end()
        if plan.fmt.as_list:
            if not text.startswith("[", pos):
                return out
            pos += 1
        while pos < len(text):
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] != "{":
                break
            fields = _object_fields(text, pos, self._scans)
            name = None
            if "name" in fields and fields["name"][1] is not None:
                try:
                    name = json.loads(text[fields["name"][0]:fields["name"][1]])
                except ValueError:
                    name = None
            key = next((k for k in (plan.fmt.args_key, "arguments", "parameters")
                        if k in fields), None)
            args = ""
            if key is not None:
                a, b = fields[key]
                args = text[a:b if b is not None else len(text)]
            out.append((name if isinstance(name, str) else None, args))
            end = _value_end(text, pos, self._scans)
            if end is None:
                break
            pos = end
            if not plan.fmt.as_list:
                m = plan._close_re.match(text, pos)
                if m is None:
                    break
                m = plan._open_re.match(text, m.end())
                if m is None:
                    break
                pos = m.end()
        return out

    def _call_deltas(self, calls) -> dict | None:
        out = []
        for i, (name, args) in enumerate(calls):
            if i == len(self.calls):
                if name is None:
                    break
                self.calls.append({"id": new_call_id(), "args": 0})
                d = {"index": i, "id": self.calls[i]["id"], "type": "function",
                     "function": {"name": name, "arguments": ""}}
                out.append(d)
            else:
                d = None
            st = self.calls[i]
            new = args[st["args"]:]
            if new:
                st["args"] = len(args)
                if d is None:
                    d = {"index": i, "function": {"arguments": new}}
                    out.append(d)
                else:
                    d["function"]["arguments"] = new
        return {"tool_calls": out} if out else None


def _lark_re(text: str) -> str:
    """text as a regex inside a Lark /.../ literal."""
    return "".join("\\s*" if c == "\n" else ("\\/" if c == "/" else re.escape(c))
                   for c in text)


class _Scan:
    """Where the JSON string, array or object starting at text[i] ends, resumed where the
    last call stopped (a streamed reply's text only grows: each character is read once)."""

    def __init__(self, text: str, i: int):
        self.in_str = text[i] == '"'
        self.pos = i + 1 if self.in_str else i
        self.depth, self.esc, self.end = 0, False, None

    def run(self, text: str) -> int | None:
        j, n = self.pos, len(text)
        while self.end is None and j < n:
            ch = text[j]
            j += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        self.end = j
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = j
        self.pos = j
        return self.end


_SCALAR = re.compile(r"[^,}\]\s]*")


def _value_end(text: str, i: int, scans: dict | None = None) -> int | None:
    """Where the JSON value starting at text[i] ends; None while it is incomplete. scans
    (start -> _Scan) keeps the work done on a growing text."""
    if i >= len(text):
        return None
    if text[i] in '"{[':
        if scans is None:
            return _Scan(text, i).run(text)
        scan = scans.get(i)
        if scan is None:
            scan = scans[i] = _Scan(text, i)
        return scan.run(text)
    m = _SCALAR.match(text, i)
    return m.end() if m.end() < len(text) else None


def _object_fields(text: str, i: int,
                   scans: dict | None = None) -> dict[str, tuple[int, int | None]]:
    """The members of the JSON object at text[i] seen so far: key -> (value start, value
    end or None while incomplete)."""
    out: dict[str, tuple[int, int | None]] = {}
    ws = re.compile(r"\s*")
    pos = ws.match(text, i + 1).end()
    while pos < len(text) and text[pos] == '"':
        kend = _value_end(text, pos, scans)
        if kend is None:
            break
        key = json.loads(text[pos:kend])
        pos = ws.match(text, kend).end()
        if pos >= len(text) or text[pos] != ":":
            break
        pos = ws.match(text, pos + 1).end()
        if pos >= len(text):
            break
        vend = _value_end(text, pos, scans)
        out[key] = (pos, vend)
        if vend is None:
            break
        pos = ws.match(text, vend).end()
        if pos < len(text) and text[pos] == ",":
            pos = ws.match(text, pos + 1).end()
    return out


def _item_spans(text: str, i: int) -> list[tuple[int, int]]:
    """The spans of the items of the complete JSON array at text[i]."""
    spans, pos = [], i + 1
    ws = re.compile(r"[\s,]*")
    while True:
        pos = ws.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return spans
        end = _value_end(text, pos)
        spans.append((pos, end))
        pos = end


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _short_id(call_id: Any, n: int) -> str:
    """A template's id of n letters and digits for an OpenAI tool-call id (the same id
    maps to the same short one, so a call and its result still match)."""
    return hashlib.sha256(str(call_id).encode()).hexdigest()[:n]


def _arguments(f: dict, i: int, j: int) -> Any:
    args = f.get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                        "JSON") from None


def _calls_of(m: dict, i: int) -> list[dict]:
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise ToolError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolError(f"messages[{i}].tool_calls[{j}] needs function.name")
        out.append({"id": c.get("id"), "name": f["name"], "arguments": _arguments(f, i, j)})
    return out


def native_messages(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """Messages for a template that renders tool calls itself: an assistant message's
    tool_calls with their arguments as objects (and ids as the template wants them), a
    tool result with the name of the call it answers."""
    out, names = [], {}

    def cid(x):
        return _short_id(x, fmt.id_len) if fmt.id_len else x

    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = _calls_of(m, i)
            d = dict(m)
            d["tool_calls"] = [{"id": cid(c["id"]), "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}}
                               for c in calls]
            for c in calls:
                names[c["id"]] = c["name"]
            out.append(d)
        elif role == "tool":
            d = dict(m)
            if d.get("tool_call_id") is not None:
                d.setdefault("name", names.get(d["tool_call_id"]))
                d["tool_call_id"] = cid(d["tool_call_id"])
            out.append(d)
        else:
            out.append(m)
    return out


def as_template_message(m: dict, i: int) -> dict:
    """One message as the generic format renders it: tool calls and results as JSON."""
    role = m.get("role")
    if role == "assistant" and m.get("tool_calls"):
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in _calls_of(m, i)]
        d = {k: v for k, v in m.items() if k != "tool_calls"}
        d["content"] = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        return d
    if role == "tool":
        d = dict(m)
        d["content"] = json.dumps({"tool_call_id": m.get("tool_call_id"),
                                   "content": m.get("content") or ""}, ensure_ascii=False)
        return d
    return m
