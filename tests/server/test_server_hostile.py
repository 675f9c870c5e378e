"""The server against hostile clients and templates (issue 30): huge prompts and heavy
templates off the event loop, templates under limits, JSON 4xx for every bad input,
Host/Origin/Content-Type protection, connection timeouts and the connection cap, and a
seeded fuzz of request bodies.

Latency bounds: /health is asserted under 0.5 s while 1 MB prompts and a template that
runs to its deadline are processed. Measured on the 2-core test machine shared with other
work (load average 4-8): p50 9 ms, max ~40 ms (before this change: ~960 ms per 1 MB
prompt). The bound is >10x the measured max so that it holds on a loaded machine, and
still 2-3x below the stall it guards against (one 1 MB prompt ~1 s, one deadline 1 s).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_util import running_server  # noqa: E402

N_CTX = 128
HEALTH_BOUND_S = 0.5
JS = {"Content-Type": "application/json"}

# A chat template that is ordinary unless the first message asks for trouble: so one
# server shows the trial render passing at load and each limit being hit by a request.
TEMPLATE = (
    "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[0].content == 'mem' %}{{ 'a'|center(300000000) }}{% endif %}"
    "{% if messages[0].content == 'big' %}{{ 'a'|center(3000000) }}{% endif %}"
    "{% if messages[0].content == 'huge' %}{{ 'a' * 30000000 }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def model_file(shipped_sparse):
    return shipped_sparse["sparse"]


@pytest.fixture(scope="module")
def server(model_file, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    (d / "t.jinja").write_text(TEMPLATE)
    log = d / "server.log"
    with running_server(model_file, "--ctx", str(N_CTX), "--parallel", "2", "-t", "1",
                        "--chat-template-file", str(d / "t.jinja"), "--template-timeout", "1",
                        "--template-memory", "64", "--header-timeout", "1.5",
                        "--body-timeout", "1", "--keep-alive", "1",
                        "--max-connections", "520", "--max-body", "1100000",
                        "--allow-host", "box.lan", "--allow-origin", "http://app.example",
                        log_path=log) as url:
        yield url, log


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def _raw(url, data: bytes, timeout=5.0) -> bytes:
    """Send raw bytes on a fresh connection; everything the server sends back."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def _raw_error(reply: bytes, status: int) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), reply[:200]
    assert b"application/json" in head.lower(), head
    return json.loads(body)["error"]


def test_bad_inputs_get_json_4xx(server):
    url, _ = server
    cmpl = url + "/v1/completions"
    deep = b'{"prompt": "x", "stop": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    _error(httpx.post(cmpl, content=deep, headers=JS), 400)
    _error(httpx.post(cmpl, content=b'{"prompt": "x", "stream_options": ' + b'{"a":' * 40 +
                      b"1" + b"}" * 40 + b"}", headers=JS), 400)
    _error(httpx.post(cmpl, content=b'{"prompt": "a\\ud800b"}', headers=JS), 400, param="prompt")
    _error(httpx.post(url + "/v1/chat/completions", headers=JS, content=b'{"messages": '
                      b'[{"role": "user", "content": "\\udfff"}]}'), 400,
           param="messages[0].content")
    _error(httpx.post(cmpl, content=b'{"prompt": "x", "temperature": NaN}', headers=JS), 400)
    _error(httpx.get(url + "/static/x%00"), 404)
    _error(httpx.get(url + "/static/" + "a" * 5000), 404)
    _error(httpx.get(url + "/static/../app.py"), 404)
    assert httpx.get(url + "/static/chat.js").status_code == 200
    # a Content-Length h11 refuses: the connection layer's JSON 400
    err = _raw_error(_raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               b"Content-Type: application/json\r\nContent-Length: -1\r\n\r\n"),
                     400)
    assert "Content-Length" in err["message"]
    _raw_error(_raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: 100000000000000000000\r\n\r\n"), 400)
    # one h11 takes but the body limit does not
    _raw_error(_raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n"),
               413)
    # headers past --max-header-bytes (16 KiB) before their end
    _raw_error(_raw(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 20000),
               400)
    # logit_bias: ids inside the vocabulary, finite biases
    vocab = httpx.get(url + "/v1/models").json()["data"][0]["meta"]["n_vocab"]
    for bias in ({str(vocab): 1.0}, {"-1": 1.0}, {"abc": 1.0}, {"5": 1e999}):
        body = json.dumps({"prompt": "x", "max_tokens": 2, "logit_bias": bias}).encode()
        body = body.replace(b"Infinity", b"1e999")
        _error(httpx.post(cmpl, content=body, headers=JS), 400, param="logit_bias")
    r = httpx.post(cmpl, json={"prompt": "x", "max_tokens": 2, "logit_bias": {"5": -100}})
    assert r.status_code == 200


BAD_SAMPLING = [("temperature", -0.5), ("temperature", 1e999), ("top_p", 0.0),
                ("top_p", -1.0), ("min_p", 1.5), ("min_p", -0.1), ("top_k", 2**40),
                ("repeat_penalty", 0.0), ("repeat_penalty", -2.0)]


def test_streamed_requests_are_checked_before_the_stream(server, model_file):
    """Each bad value: 400 naming it, streamed or not; and the native sampler refuses the
    same value (the server's ranges are the runtime's, not stricter or looser)."""
    from powerinfer_cpp import Model

    url, _ = server
    for param, value in BAD_SAMPLING:
        for stream in (False, True):
            for path, extra in (("/v1/completions", {"prompt": "x"}),
                                ("/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "x"}]})):
                body = json.dumps({**extra, "max_tokens": 2, "stream": stream, param: value})
                r = httpx.post(url + path, content=body.replace("Infinity", "1e999"),
                               headers=JS)
                _error(r, 400, param=param)
    with Model(model_file, n_ctx=N_CTX, n_threads=1) as m:
        for param, value in BAD_SAMPLING:
            with pytest.raises((ValueError, TypeError)):
                m.generate("x", max_tokens=1, **{param: value})
        # the edges the server accepts, the runtime accepts too
        m.generate("x", max_tokens=1, temperature=0, top_p=1e-9, min_p=1.0, top_k=-5,
                   repeat_penalty=1e-9)


def test_host_origin_and_content_type(server):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    body = {"prompt": "x", "max_tokens": 1}
    _error(httpx.get(url + "/metrics", headers={"Host": "evil.example"}), 403,
           code="host_not_allowed")
    _error(httpx.post(url + "/v1/completions", json=body,
                      headers={"Host": f"evil.example:{port}"}), 403, code="host_not_allowed")
    for host in (f"localhost:{port}", f"[::1]:{port}", f"box.lan:{port}", "127.0.0.1"):
        assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200, host
    _error(httpx.post(url + "/v1/completions", json=body,
                      headers={"Origin": "http://evil.example"}), 403, code="origin_not_allowed")
    _error(httpx.post(url + "/v1/completions", json=body, headers={"Origin": "null"}), 403)
    # the server's own page (same origin) and an origin allowed by flag
    r = httpx.post(url + "/v1/completions", json=body,
                   headers={"Origin": f"http://127.0.0.1:{port}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": "http://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    pre = httpx.options(url + "/v1/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and "Content-Type" in pre.headers["access-control-allow-headers"]
    # what a page may send cross-site without a preflight is refused
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        _error(httpx.post(url + "/v1/completions", content=json.dumps(body),
                          headers={"Content-Type": ctype}), 415, code="unsupported_media_type")
    _error(httpx.post(url + "/v1/completions", content=json.dumps(body)), 415)


def test_templates_under_limits(server):
    url, _ = server
    chat = url + "/v1/chat/completions"

    def ask(content):
        t = time.monotonic()
        r = httpx.post(chat, json={"messages": [{"role": "user", "content": content}],
                                   "max_tokens": 2}, timeout=30)
        return r, time.monotonic() - t

    r, dt = ask("loop")
    assert "render deadline of 1 s" in _error(r, 400, code="chat_template_limit")["message"]
    assert dt < 10
    r, _ = ask("mem")
    assert "memory limit of 64 MiB" in _error(r, 400, code="chat_template_limit")["message"]
    r, _ = ask("big")
    _error(r, 400, code="context_length_exceeded", param="messages")
    r, _ = ask("huge")
    assert "sandbox's limit" in _error(r, 400, code="chat_template_limit")["message"]
    r, _ = ask("hello")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_template_limits_at_load(model_file, tmp_path, capsys):
    """Over a limit for a one-message chat: --chat-template-file stops the start, naming
    the limit; a model file's own template leaves the server without chat, saying why."""
    from gguf_rewrite import rewrite_gguf
    import gguf

    from powerinfer_cpp.server.__main__ import main
    from powerinfer_cpp.server.app import Server, Settings

    t = tmp_path / "heavy.jinja"
    t.write_text("{{ 'a' * 30000000 }}")
    assert main(["-m", str(model_file), "--ctx", "64", "-t", "1", "--chat-template-file",
                 str(t)]) == 1
    err = capsys.readouterr().err
    assert "--chat-template-file" in err and "sandbox's limit" in err
    t.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                 "{% endfor %}")
    assert main(["-m", str(model_file), "--ctx", "64", "-t", "1", "--chat-template-file",
                 str(t), "--template-timeout", "0.5"]) == 1
    assert "render deadline of 0.5 s" in capsys.readouterr().err

    heavy = rewrite_gguf(model_file, tmp_path / "heavy.gguf", kv={
        "tokenizer.chat_template": ("{{ 'a'|center(300000000) }}",
                                    gguf.GGUFValueType.STRING)})
    srv = Server(Settings(model=str(heavy), n_ctx=64, threads=1, template_memory=64))
    try:
        assert srv.template is None and "memory limit of 64 MiB" in srv.template_error
        assert srv.template_warning
    finally:
        srv.close()


def _health_times(url, stop: threading.Event, out: list):
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - t)
            time.sleep(0.01)


def test_health_and_streams_stay_quick_under_big_prompts_and_heavy_templates(server):
    url, _ = server
    big = ("And God said, Let there be light. " * 31000)[:1_000_000]
    hostile = [
        ("/v1/completions", {"prompt": big, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "loop"}]}),
    ]
    # another client's stream alone, then alongside the hostile requests
    stream_body = {"prompt": "And God said", "max_tokens": 48, "temperature": 0,
                   "stream": True, "ignore_eos": True}

    def stream_gaps():
        gaps, last = [], None
        with httpx.stream("POST", url + "/v1/completions", json=stream_body, timeout=60) as r:
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: {") and last is not None:
                    gaps.append(now - last)
                last = now
        return gaps

    solo = stream_gaps()
    stop, times = threading.Event(), []
    prober = threading.Thread(target=_health_times, args=(url, stop, times))
    prober.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(httpx.post, url + p, json=b, timeout=60) for p, b in hostile * 2]
            busy = stream_gaps()
            codes = [f.result().status_code for f in futs]
    finally:
        stop.set()
        prober.join()
    assert codes == [400] * len(codes)
    assert len(times) >= 5 and max(times) < HEALTH_BOUND_S, sorted(times)[-5:]
    # the stream's tokens keep coming: its slowest gap stays far from a prompt's stall
    assert max(busy) < max(HEALTH_BOUND_S, 10 * max(solo)), (max(solo), max(busy))


def test_idle_sockets_slow_bodies_and_the_connection_cap(server):
    url, log = server
    host, port = url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(500)]
    try:
        # past the cap (520): 503 in JSON, and a line in the log
        extra = [socket.create_connection((host, int(port)), timeout=10) for _ in range(30)]
        refused = 0
        for s in extra:
            s.settimeout(3)
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue
            finally:
                s.close()
            if data:
                assert _raw_error(data, 503)["code"] == "server_busy"
                refused += 1
        assert refused >= 10
        assert "connection limit reached" in log.read_text()
        # the idle ones are closed by the header timeout (1.5 s)
        deadline = time.monotonic() + 8
        for s in idle:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
    assert httpx.get(url + "/health").status_code == 200
    # a slow body: 408 after the body timeout (1 s), and the connection closed
    t = time.monotonic()
    reply = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                      b'{"prompt": ', timeout=10)
    assert _raw_error(reply, 408)["code"] == "request_timeout" and time.monotonic() - t < 8
    # slow headers: 408 after the header timeout, and closed
    reply = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", timeout=10)
    assert _raw_error(reply, 408)["code"] == "request_timeout"


def _fuzz_bodies(seed: int, n: int):
    """Request bodies, valid and broken, from a fixed seed."""
    rng = random.Random(seed)
    values = [None, True, 0, -1, 1, 2**70, 0.5, -0.0, 1e308, "", "x", "\u00e9\u4e16", [], {},
              [1, 2], {"a": 1}, "And God said", [0, 1, 2], [5] * 200, "a" * 3000]
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
              "repeat_penalty", "stop", "seed", "stream", "logit_bias", "n", "echo", "model",
              "stream_options", "max_completion_tokens", "ignore_eos", "suffix", "logprobs"]
    for i in range(n):
        chat = rng.random() < 0.5
        body = ({"messages": [{"role": "user", "content": "And God said"}]} if chat
                else {"prompt": "And God said"})
        body["max_tokens"] = rng.choice([1, 2, 3])
        for _ in range(rng.randrange(0, 4)):
            f = rng.choice(fields)
            if f == "messages":
                body[f] = rng.choice([[], [{"role": rng.choice(["user", "wizard", 5]),
                                            "content": rng.choice(values)}], "x", [1]])
            elif f == "logit_bias":
                body[f] = {rng.choice(["1", "-3", "99999999", "x", "7"]):
                           rng.choice([1, -100, 0.5, "a", None])}
            else:
                body[f] = rng.choice(values)
        for f in ("max_tokens", "max_completion_tokens"):
            v = body.get(f)
            if type(v) is int and v > 3:
                body[f] = 2  # a long generation would only be slow, not wrong
        raw = json.dumps(body).encode()
        mode = rng.random()
        if mode < 0.1:
            raw = raw[:rng.randrange(len(raw))]            # cut short
        elif mode < 0.2:
            k = rng.randrange(len(raw))
            raw = raw[:k] + bytes([rng.randrange(256)]) + raw[k + 1:]  # one byte flipped
        yield ("/v1/chat/completions" if chat else "/v1/completions"), raw


def test_fuzzed_bodies_get_json_4xx_or_a_valid_200(server):
    url, _ = server
    n_ok = n_err = 0
    worst_health = 0.0
    with httpx.Client(timeout=60) as c:
        for i, (path, raw) in enumerate(_fuzz_bodies(seed=30, n=300)):
            r = c.post(url + path, content=raw, headers=JS)
            if r.status_code == 200:
                if r.headers["content-type"].startswith("text/event-stream"):
                    events = [e for e in r.text.split("\n\n") if e]
                    assert events[-1] == "data: [DONE]", raw
                    assert all("error" not in json.loads(e[6:]) for e in events[:-1]), raw
                else:
                    out = r.json()
                    assert out["choices"] and "usage" in out, raw
                n_ok += 1
            else:
                assert 400 <= r.status_code < 500, (r.status_code, raw, r.text)
                _error(r, r.status_code)
                n_err += 1
            if i % 25 == 0:
                t = time.perf_counter()
                assert c.get(url + "/health").status_code == 200
                worst_health = max(worst_health, time.perf_counter() - t)
    assert n_ok >= 30 and n_err >= 30, (n_ok, n_err)
    assert worst_health < HEALTH_BOUND_S
