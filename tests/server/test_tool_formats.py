"""Template-native tool formats (tools.py FORMATS): the format a template writes is found
from its source; each native syntax parses from hand-written model outputs (whole and
streamed as OpenAI's deltas); the template renders the tools and earlier calls in its own
syntax; bad tool schemas are refused naming what is wrong; and each format round-trips
through the official openai client against a running server whose constrained sampling
makes the tiny test model write a valid call in that syntax."""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from powerinfer_cpp.chat import ChatTemplate, normalize_messages  # noqa: E402
from powerinfer_cpp.tools import (FORMAT_NAMES, ToolError, ToolPlan,  # noqa: E402
                                  format_for_template)
from tool_templates import PARAMS, TEMPLATES, TOOLS  # noqa: E402


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Hand-written replies in each native syntax, as models of the family write them (spacing
# included), and the calls (name, arguments text) each one holds.
W1 = '{"city": "Paris", "unit": "celsius"}'
T1 = '{"zone":"CET"}'
OUTPUTS = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W1}}}\n</tool_call>',
         [("get_weather", W1)]),
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W1}}}\n</tool_call>\n'
         f'<tool_call>\n{{"name": "get_time", "arguments": {T1}}}\n</tool_call>\n',
         [("get_weather", W1), ("get_time", T1)])],
    "mistral": [
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W1}}}, '
         f'{{"name": "get_time", "arguments": {T1}}}]',
         [("get_weather", W1), ("get_time", T1)]),
        (f'[TOOL_CALLS][{{"name":"get_time","arguments":{T1}}}]', [("get_time", T1)])],
    "llama3": [
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {W1}}}', [("get_weather", W1)]),
        (f'{{"name": "get_time", "parameters": {T1}}}', [("get_time", T1)])],
    "generic": [
        (f'{{"tool_calls": [{{"name": "get_time", "arguments": {T1}}}]}}', [("get_time", T1)])],
}
ANSWERS = {"hermes": "It is <b>sunny</b> {really}.", "mistral": "[1, 2] are numbers",
           "llama3": "Sunny, 21 C {approx}",
           "generic": '{"response": "Sunny \\"21\\" C \\ud83d\\ude00 \\u00e9\\n\\\\"}'}


def test_format_for_template():
    for name, src in TEMPLATES.items():
        assert format_for_template(src).name == name
    assert format_for_template(CHATML).name == "generic"
    assert format_for_template(None).name == "generic"
    # a marker alone, in a template that never renders tools, is not a tool format
    assert format_for_template("{{ '<tool_call>' }}{{ messages }}").name == "generic"


def _assemble(deltas):
    """The tool calls and content the openai client builds from a stream's deltas."""
    calls, content = {}, ""
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", []):
            cur = calls.setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in c:
                assert cur["id"] is None and c["id"].startswith("call_") and c["type"] == \
                    "function" and c["function"]["name"], c  # the head comes first, once
                cur["id"], cur["name"] = c["id"], c["function"]["name"]
            assert cur["id"] is not None, "arguments before the call's head"
            cur["arguments"] += c["function"].get("arguments", "")
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], content


def _stream(plan, text, seed):
    rng, st, deltas, i = random.Random(seed), plan.stream(), [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 7])
        d = st.feed(text[i:i + n])
        i += n
        if d is not None:
            deltas.append(d)
    last, fin = st.finish("stop")
    return deltas + [last], fin


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
def test_parse_native_outputs(fmt):
    plan = ToolPlan(TOOLS, "auto", fmt=FORMAT_NAMES[fmt])
    for text, calls in OUTPUTS[fmt]:
        msg, fin = plan.parse(text, "stop")
        assert fin == "tool_calls" and msg["content"] is None, (text, msg)
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
        assert got == calls
        for c in msg["tool_calls"]:
            assert c["type"] == "function" and c["id"].startswith("call_")
            jsonschema.validate(json.loads(c["function"]["arguments"]),
                                PARAMS[c["function"]["name"]])
        for seed in range(5):  # streamed in pieces of any size: the same calls
            deltas, fin = _stream(plan, text, seed)
            assert fin == "tool_calls" and _assemble(deltas) == (calls, ""), (seed, deltas)
    # a plain answer: the content (the generic format's unwrapped), whole and streamed
    answer = ANSWERS[fmt]
    want = json.loads(answer)["response"] if fmt == "generic" else answer
    assert plan.parse(answer, "stop") == ({"role": "assistant", "content": want}, "stop")
    for seed in range(5):
        deltas, fin = _stream(plan, answer, seed)
        assert fin == "stop" and _assemble(deltas) == ([], want), deltas
    # calls cut short (max_tokens) are not calls: the text comes back as content
    text = OUTPUTS[fmt][0][0]
    cut = text[:len(text) * 2 // 3]
    assert plan.parse(cut, "length") == ({"role": "assistant", "content": cut}, "length")


def test_markers_that_are_special_tokens():
    # a reply's text drops special tokens: Mistral's [TOOL_CALLS] then is not in the text,
    # and the calls parse without it
    plan = ToolPlan(TOOLS, "auto", fmt=FORMAT_NAMES["mistral"])
    plan.use_special_tokens({"[TOOL_CALLS]": 5})
    text = f'[{{"name": "get_time", "arguments": {T1}}}]'
    msg, fin = plan.parse(text, "stop")
    assert fin == "tool_calls" and msg["tool_calls"][0]["function"]["arguments"] == T1
    deltas, fin = _stream(plan, text, 0)
    assert fin == "tool_calls" and _assemble(deltas) == ([("get_time", T1)], "")
    assert "<[5]>" in plan.grammar_text()  # ... and the grammar asks for that token


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_template_renders_native_calls(fmt):
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    src = TEMPLATES[fmt]
    plan = ToolPlan(TOOLS, "auto", template_source=src)
    assert plan.fmt.name == fmt
    text = ChatTemplate(src, bos_token="<s>", eos_token="</s>").render(
        plan.messages(normalize_messages(history)), **plan.template_vars())
    # the tools, rendered by the template itself
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    call = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": '
                      '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
            "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": '
                      '"celsius"}}',
            "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
                       '"unit": "celsius"}, "id": "'}[fmt]
    assert call in text, text
    assert "-3 C" in text
    if fmt == "mistral":  # OpenAI's id, as 9 letters and digits, on the call and its result
        assert "call_1" not in text
        short = text.split('"id": "')[1][:9]
        assert short.isalnum() and text.count(short) == 2
    # the generic format (a template without tools) keeps the tools in the system message
    plan = ToolPlan(TOOLS, "auto", template_source=CHATML)
    msgs = plan.messages(normalize_messages(history))
    assert plan.template_vars() == {} and msgs[0]["role"] == "system"
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]}


BAD_TOOLS = [
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
     r"tools\[0\].function.parameters must describe an object"),
    ({"type": "function", "function": {"name": "f", "parameters": "city: str"}},
     r"tools\[0\].function.parameters must be a JSON schema object, not str"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}},
     r"tools\[0\].function.parameters"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "a"}}}, r"required must be a list"),
    ({"type": "function", "function": {"name": "get weather"}}, "letters, digits"),
]


def test_bad_tool_schemas():
    for tool, msg in BAD_TOOLS:
        with pytest.raises(ToolError, match=msg):
            ToolPlan([tool], "auto").grammar()


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_openai_client_round_trip(fmt, shipped_gguf, tmp_path):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from server_util import running_server

    tmpl = tmp_path / f"{fmt}.jinja"
    tmpl.write_text(TEMPLATES[fmt])
    with running_server(shipped_gguf, "--ctx", "1024", "-t", "2",
                        "--chat-template-file", str(tmpl)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        kw = dict(model="x", tools=TOOLS, temperature=0, max_tokens=200,
                  parallel_tool_calls=False)
        # the test model knows no JSON: the constraint alone makes its call valid
        r = client.chat.completions.create(messages=messages, tool_choice="required", **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        # streamed through the client: OpenAI's deltas give the same call
        deltas = []
        for chunk in client.chat.completions.create(messages=messages, tool_choice="required",
                                                    stream=True, **kw):
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.model_dump(exclude_none=True))
                fin = chunk.choices[0].finish_reason
        assert fin == "tool_calls"
        calls, _ = _assemble(deltas)
        assert calls == [(call.function.name, call.function.arguments)]
        # one named function
        r = client.chat.completions.create(messages=messages, tool_choice={
            "type": "function", "function": {"name": "get_time"}}, **kw)
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
        # the client's own message goes back with the tool's result: the template renders
        # them in its syntax (the mistral one refuses ids that are not 9 characters)
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id,
                                      "content": json.dumps({"temperature": 21})}]
        r = client.chat.completions.create(messages=messages, **kw)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            for c in choice.message.tool_calls:
                jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
        else:
            assert choice.message.content and not choice.message.tool_calls
        for tool, msg in BAD_TOOLS:
            r = httpx.post(url + "/v1/chat/completions",
                           json={"messages": messages[:1], "tools": [tool]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "tools", err
            assert re.search(msg, err["message"]), err
