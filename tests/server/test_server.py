"""The OpenAI-compatible server, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_util import metric, running_server  # noqa: E402

N_CTX = 128
PROMPTS = ["And God said", "In the beginning", "And Jesus said unto them", "The LORD is my",
           "Blessed are the", "And the king", "Thus saith the LORD", "For God so loved"]
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def model_file(shipped_sparse):
    return shipped_sparse["sparse"]


@pytest.fixture(scope="module")
def server(model_file):
    with running_server(model_file, "--parallel", "2", "--queue", "32", "--ctx", str(N_CTX),
                        "--alias", "tiny", "-t", "1") as url:
        yield url


@pytest.fixture(scope="module")
def small(model_file):
    """One slot, no queue, a key and a small body limit: for 503, 401, 413, disconnects."""
    with running_server(model_file, "--parallel", "1", "--queue", "0", "--ctx", "512",
                        "--api-key", KEY, "--max-body", "4096", "-t", "1") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_file):
    """Greedy completions from the Python API, computed one after another."""
    from powerinfer_cpp import Model

    with Model(model_file, n_ctx=N_CTX, n_threads=1) as m:
        yield {(p, n): m.generate(p, max_tokens=n, temperature=0).text
               for p in PROMPTS for n in (8, 16)}


def test_models_health_and_page(server):
    models = httpx.get(server + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert httpx.get(server + "/health").json()["status"] == "ok"
    page = httpx.get(server + "/")
    assert page.status_code == 200 and "chat.js" in page.text


def test_any_model_name_is_answered_by_the_one_model(server, client, model_file, reference):
    """Clients hard-code "gpt-3.5-turbo" or send the file's name: the one model answers,
    and /v1/models lists the names it goes by."""
    path = Path(model_file)
    (entry,) = httpx.get(server + "/v1/models").json()["data"]
    assert entry["aliases"] == ["tiny", path.stem, path.name]
    want = reference[("And God said", 8)]
    for name in ("gpt-3.5-turbo", path.name, path.stem, "tiny"):
        out = client.completions.create(model=name, prompt="And God said", max_tokens=8,
                                        temperature=0)
        assert out.choices[0].text == want and out.model == "tiny"
    chat = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "Who made the light?"}],
        max_tokens=4, temperature=0)
    assert chat.model == "tiny" and chat.choices[0].message.content is not None


def test_completion_with_the_openai_client(client, reference):
    out = client.completions.create(model="tiny", prompt="And God said", max_tokens=16,
                                    temperature=0)
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == reference[("And God said", 16)]
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens,
            out.usage.total_tokens) == (4, 16, 20)
    stream = client.completions.create(model="tiny", prompt="And God said", max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[("And God said", 16)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == 4


def test_stop_strings_and_max_tokens(client, reference):
    full = reference[("In the beginning", 16)]
    stop = full[6:10]
    out = client.completions.create(model="tiny", prompt="In the beginning", max_tokens=16,
                                    temperature=0, stop=[stop])
    assert out.choices[0].text == full[:6] and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="tiny", prompt="In the beginning", max_tokens=3,
                                    temperature=0)
    assert out.usage.completion_tokens == 3


def test_chat_with_the_openai_client(client, model_file):
    from powerinfer_cpp import Llama

    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who made the light?"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                         temperature=0)
    with Llama(str(model_file), n_ctx=N_CTX, n_threads=1, verbose=False) as llm:
        want = llm.create_chat_completion(msgs, max_tokens=12, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert out.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert out.usage.completion_tokens == want["usage"]["completion_tokens"]
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_sse_wire_format(server):
    with httpx.stream("POST", server + "/v1/completions", json={
            "prompt": "And God said", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["timings"]["predicted_n"] == 4 and 0 < last["timings"]["ffn_density"] < 1


def test_concurrent_clients_get_their_sequential_results(server, client, reference):
    """8 clients x 4 requests on 2 slots: every reply complete and equal to the greedy
    result computed alone, streams and plain requests mixed."""
    def one_client(i):
        got = []
        for k in range(4):
            p, n = PROMPTS[(i + k) % len(PROMPTS)], (8, 16)[(i + k) % 2]
            if k % 2:
                chunks = list(client.completions.create(
                    model="tiny", prompt=p, max_tokens=n, temperature=0, stream=True))
                text = "".join(c.choices[0].text for c in chunks)
                fin = chunks[-1].choices[0].finish_reason
            else:
                out = client.completions.create(model="tiny", prompt=p, max_tokens=n,
                                                temperature=0)
                text, fin = out.choices[0].text, out.choices[0].finish_reason
                assert out.usage.completion_tokens == n
            got.append((p, n, text, fin))
        return got

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = [r for f in [ex.submit(one_client, i) for i in range(8)] for r in f.result()]
    assert len(results) == 32
    for p, n, text, fin in results:
        assert fin == "length" and text == reference[(p, n)], (p, n)
    health = httpx.get(server + "/health").json()
    assert health["slots_processing"] == 0 and health["slots_idle"] == 2
    m = httpx.get(server + "/metrics").text
    assert metric(m, "powerinfer_slots_busy") == 0 and metric(m, "powerinfer_queue_length") == 0


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def test_bad_requests_get_openai_errors(server):
    url = server + "/v1/completions"
    js = {"Content-Type": "application/json"}
    _error(httpx.post(url, content=b'{"prompt": "x", ', headers=js), 400)
    _error(httpx.post(url, content=b'[1, 2]', headers=js), 400)
    _error(httpx.post(url, json={"prompt": "x", "max_tokens": "8"}), 400, param="max_tokens")
    _error(httpx.post(url, json={"prompt": "x", "temperature": "hot"}), 400, param="temperature")
    _error(httpx.post(url, json={"prompt": "x", "stream": 1}), 400, param="stream")
    _error(httpx.post(url, json={"max_tokens": 3}), 400, param="prompt")
    _error(httpx.post(url, json={"prompt": "And God said " * 60}), 400,
           code="context_length_exceeded")
    _error(httpx.post(url, json={"prompt": "x", "max_tokens": 10_000}), 400, param="max_tokens")
    _error(httpx.post(url, json={"prompt": [999999]}), 400, param="prompt")
    chat = server + "/v1/chat/completions"
    _error(httpx.post(chat, json={"messages": []}), 400)
    _error(httpx.post(chat, json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    _error(httpx.post(chat, json={"messages": [{"role": "user", "content": 5}]}), 400)
    _error(httpx.get(server + "/v1/nothing"), 404)
    # the server is fine afterwards
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_api_key_and_body_limit(small):
    url = small + "/v1/completions"
    _error(httpx.post(url, json={"prompt": "x"}), 401, code="invalid_api_key")
    _error(httpx.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
    _error(httpx.get(small + "/metrics"), 401)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200
    assert httpx.get(small + "/health").status_code == 200  # open, for probes
    _error(httpx.post(url, json={"prompt": "x" * 5000}, headers=auth), 413)

    def chunked():  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    _error(httpx.post(url, content=chunked(),
                      headers={**auth, "Content-Type": "application/json"}), 413)


def _wait_idle(url, auth, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health").json()
        if h["slots_processing"] == 0:
            return httpx.get(url + "/metrics", headers=auth).text
        time.sleep(0.02)
    raise AssertionError("the slot was not freed")


def test_busy_server_answers_503_and_a_disconnect_frees_the_slot(small):
    auth = {"Authorization": f"Bearer {KEY}"}
    url = small + "/v1/completions"
    before = metric(_wait_idle(small, auth), "powerinfer_generations_cancelled_total")
    body = {"prompt": "And God said", "max_tokens": 480, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url, json=body, headers=auth, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        # the one slot is generating and the queue holds none: 503 now
        _error(httpx.post(url, json={"prompt": "x", "max_tokens": 2}, headers=auth), 503,
               code="server_busy")
        next(lines)
    # the client left after two events: the slot is freed at the next token
    m = _wait_idle(small, auth)
    assert metric(m, "powerinfer_generations_cancelled_total") == before + 1
    assert metric(m, "powerinfer_requests_rejected_total") >= 1
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2},
                      headers=auth).status_code == 200


def test_metrics(server):
    m = httpx.get(server + "/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("requests_total", "prompt_tokens_total", "completion_tokens_total",
                 "decode_tokens_per_second", "queue_length", "ffn_density", "slots"):
        assert f"# TYPE powerinfer_{name} " in text
    assert metric(text, "powerinfer_completion_tokens_total") > 0
    assert 0 < metric(text, "powerinfer_ffn_density") < 1
    assert 'powerinfer_requests_total{route="/v1/completions",status="200"}' in text


def test_default_model_has_a_readable_name(monkeypatch):
    """Without -m the server runs the default model under its name, not the file's stem
    (which carries the quantization); uvicorn is not started, only the app is built."""
    import uvicorn

    from powerinfer_cpp import default_model
    from powerinfer_cpp.server.__main__ import main

    if default_model.package_file() is None:
        pytest.skip(f"the default model's package is not installed: {default_model.INSTALL}")
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert main(["--ctx", "64", "-t", "1"]) == 0
    srv = apps[0].state.server
    assert srv.name == default_model.NAME == "SmolLM2-135M-Instruct"
    srv.close()
