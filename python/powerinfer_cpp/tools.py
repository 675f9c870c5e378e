"""OpenAI tool calling over any chat template (llama.cpp's "generic" way).

The tools and how to answer go into the system message, and the reply is constrained
(structured.py) to one JSON object: {"tool_calls": [{"name": ..., "arguments": {...}}]}
(each call's arguments valid under its tool's parameter schema) or {"response": "..."}.
A reply that calls tools becomes OpenAI's message.tool_calls with finish_reason
"tool_calls"; one that answers, plain content. Earlier turns go back through the template
in the same shape: an assistant message's tool_calls as that JSON, a tool message
(role "tool") as {"tool_call_id": ..., "content": ...}. So any model can call tools, and
the calls always parse; templates with a tool format of their own (Qwen's <tool_call>,
Llama 3.1's ipython) are not used in theirs, which a model trained on them would know
better.

tool_choice: "auto" (call or answer), "required" (call), {"type": "function",
"function": {"name": ...}} (call that one), "none" (the tools are left out: a plain reply).
parallel_tool_calls=False allows one call per reply.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .structured import GrammarError, json_schema_grammar


class ToolError(ValueError):
    """tools, tool_choice or a tool message that cannot be used; the message names why."""


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
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object")
    desc = f.get("description", "")
    if not isinstance(desc, str):
        raise ToolError(f"{where}.function.description must be a string")
    return {"name": name, "description": desc, "parameters": params}


class ToolPlan:
    """What one request's tools turn into: the messages to render, the grammar of the
    reply, and the parser of the reply."""

    def __init__(self, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool = True):
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
        self.parallel = bool(parallel_tool_calls)
        self.active = self.mode != "none"

    # -- the prompt ------------------------------------------------------------------

    def system_text(self) -> str:
        tools = [t for t in self.tools if self.only in (None, t["name"])]
        lines = ["You can call these tools (each one's arguments follow its JSON schema):"]
        for t in tools:
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

    def messages(self, messages: list[dict]) -> list[dict]:
        """OpenAI messages (normalised) as the template gets them: the tools in the system
        message, earlier tool calls and tool results as the JSON the model writes and
        reads."""
        out = [as_template_message(m, i) for i, m in enumerate(messages)]
        if not self.active:
            return out
        text = self.system_text()
        if out and out[0].get("role") in ("system", "developer"):
            first = dict(out[0])
            first["content"] = (first.get("content") or "") + "\n\n" + text
            return [first] + out[1:]
        return [{"role": "system", "content": text}] + out

    # -- the reply -------------------------------------------------------------------

    def schema(self) -> dict | None:
        if not self.active:
            return None
        tools = [t for t in self.tools if self.only in (None, t["name"])]
        call = {"anyOf": [{"type": "object",
                           "properties": {"name": {"const": t["name"]},
                                          "arguments": t["parameters"]},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for t in tools]}
        calls = {"type": "object",
                 "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1,
                                               **({} if self.parallel else {"maxItems": 1})}},
                 "required": ["tool_calls"], "additionalProperties": False}
        if self.mode != "auto":
            return calls
        answer = {"type": "object", "properties": {"response": {"type": "string"}},
                  "required": ["response"], "additionalProperties": False}
        return {"anyOf": [calls, answer]}

    def grammar(self) -> str | None:
        s = self.schema()
        if s is None:
            return None
        try:
            return json_schema_grammar(s, "tools")
        except GrammarError as e:  # a parameters schema the library cannot use
            raise ToolError(str(e)) from None

    def parse(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """(the assistant message, finish_reason) of a reply's text."""
        if not self.active:
            return {"role": "assistant", "content": text}, finish_reason
        try:
            value = json.loads(text)
        except ValueError:  # cut by max_tokens: the text as it is
            return {"role": "assistant", "content": text}, finish_reason
        if isinstance(value, dict) and "tool_calls" in value:
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c["name"],
                                   "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                     for c in value["tool_calls"]]
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        if isinstance(value, dict) and "response" in value:
            return {"role": "assistant", "content": value["response"]}, finish_reason
        return {"role": "assistant", "content": text}, finish_reason


    def delta(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """(a stream's last delta, finish_reason) of a whole reply: a streamed reply with
        tools is held back until it is complete (a call is sent whole, in one chunk)."""
        msg, fin = self.parse(text, finish_reason)
        if msg.get("tool_calls"):
            return {"tool_calls": [{"index": i, **c}
                                   for i, c in enumerate(msg["tool_calls"])]}, fin
        return {"content": msg["content"]}, fin


def as_template_message(m: dict, i: int) -> dict:
    """One message as the template renders it: tool calls and results as JSON text."""
    role = m.get("role")
    calls = m.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise ToolError(f"messages[{i}].tool_calls must be a list")
        out = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ToolError(f"messages[{i}].tool_calls[{j}] needs function.name")
            args = f.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                "JSON") from None
            out.append({"name": f["name"], "arguments": args})
        d = {k: v for k, v in m.items() if k != "tool_calls"}
        d["content"] = json.dumps({"tool_calls": out}, ensure_ascii=False)
        return d
    if role == "tool":
        d = dict(m)
        d["content"] = json.dumps({"tool_call_id": m.get("tool_call_id"),
                                   "content": m.get("content") or ""}, ensure_ascii=False)
        return d
    return m
