"""The OpenAI-compatible HTTP server: FastAPI routes over a pool of slots.

Every slot is a Context over ONE shared Model; a generation runs in a worker thread of
its own and sends its text pieces back to the event loop, so the loop keeps serving
other requests (and notices a client that went away) while tokens are computed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import api
from ..chat import ChatTemplate, ChatTemplateError
from .metrics import Metrics
from .slots import Job, QueueFull, Slot, SlotPool

STATIC_DIR = Path(__file__).resolve().parent / "static"


@dataclass
class Settings:
    """What `python -m powerinfer_cpp.server` was started with."""

    model: str
    alias: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 1
    queue: int = 16
    n_ctx: int = 0
    threads: int = 0            # per slot; 0 = the cores divided among the slots
    max_tokens: int = 0         # cap on a request's max_tokens; 0 = the context size
    max_body: int = 1 << 20     # bytes
    api_key: str | None = None
    ffn: str = "auto"
    device: str = "cpu"
    vram_budget: str | None = None
    chat_template: str | None = None


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """An OpenAI-style error as a JSON response."""
    return JSONResponse(APIError(status, message, type, param, code).body(), status_code=status)


# -- request bodies ---------------------------------------------------------------------
# strict: "16" is not an integer and 1 is not a bool, as OpenAI's API answers them with 400


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
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
    temperature: float = 0.2
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None


# -- the app -----------------------------------------------------------------------------


class Server:
    """The loaded model, its slots and what the routes share."""

    def __init__(self, settings: Settings):
        from ..model import Model

        self.settings = s = settings
        if s.parallel < 1:
            raise ValueError("--parallel must be >= 1")
        if s.queue < 0:
            raise ValueError("--queue must be >= 0")
        self.model = Model(s.model, n_ctx=s.n_ctx, ffn=s.ffn, device=s.device,
                           vram_budget=s.vram_budget)
        threads = s.threads or max(1, (os.cpu_count() or 1) // s.parallel)
        try:
            self.slots = [Slot(i, self.model.create_context(n_ctx=s.n_ctx, n_threads=threads))
                          for i in range(s.parallel)]
        except BaseException:
            self.model.close()
            raise
        self.n_ctx = self.slots[0].ctx.n_ctx
        self.max_tokens = s.max_tokens or self.n_ctx
        self.name = s.alias or Path(s.model).name.removesuffix(".gguf")
        try:
            self.template: ChatTemplate | None = ChatTemplate.from_model(self.model,
                                                                         s.chat_template)
            self.template_error = ""
        except ChatTemplateError as e:
            self.template, self.template_error = None, str(e)
        self.pool: SlotPool | None = None  # made on the event loop, at startup
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=s.parallel, thread_name_prefix="slot")
        self.metrics = Metrics()
        self.jobs: set[Job] = set()
        self.created = int(time.time())

    def close(self) -> None:
        """Stop every generation, wait for the workers, free the model."""
        for job in list(self.jobs):
            job.cancel.set()
        self.executor.shutdown(wait=True)
        self.model.close()

    # -- request handling ------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name != self.name:
            raise APIError(404, f"The model '{name}' does not exist (this server has "
                           f"'{self.name}')", param="model", code="model_not_found")

    def sampling(self, body: _Body, n_prompt: int, max_tokens: int | None) -> dict:
        """ctx.stream keyword arguments from a request, with the server's limits."""
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported (use repeat_penalty)", param=name)
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if max_tokens is not None and max_tokens > self.max_tokens:
            raise APIError(400, f"max_tokens = {max_tokens} is above this server's limit of "
                           f"{self.max_tokens}", param="max_tokens")
        if max_tokens is not None and max_tokens < 0:
            raise APIError(400, "max_tokens must be >= 0", param="max_tokens")
        if n_prompt >= self.n_ctx:
            raise APIError(400, f"This model's maximum context length is {self.n_ctx} tokens, "
                           f"but the prompt has {n_prompt} tokens", param="messages"
                           if isinstance(body, ChatBody) else "prompt",
                           code="context_length_exceeded")
        n = api.resolve_max_tokens(max_tokens, n_prompt, self.n_ctx)
        kw = dict(max_tokens=min(n, self.max_tokens), temperature=body.temperature,
                  top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                  repeat_penalty=body.repeat_penalty, seed=body.seed,
                  ignore_eos=body.ignore_eos)
        if body.logit_bias:
            try:
                proc = api.make_logits_processor(self.model.eos_id, logit_bias=body.logit_bias)
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), param="logit_bias") from None
            kw["logits_processor"] = proc
        return kw

    async def run(self, request: Request, prompt_ids: list[int], kw: dict, stream: bool,
                  fmt) -> Any:
        """Wait for a slot, generate; a JSON response, or an SSE stream of fmt's chunks."""
        assert self.pool is not None
        try:
            slot = await self.pool.acquire(prompt_ids)
        except QueueFull:
            self.metrics.rejected += 1
            raise APIError(503, "the server is busy (every slot is generating and the queue "
                           "is full); retry later", type="server_error",
                           code="server_busy") from None
        loop = asyncio.get_running_loop()
        job = Job(loop, self.pool, slot, prompt_ids, kw)
        self.jobs.add(job)
        done = job.start(self.executor)
        done.add_done_callback(lambda _: self._finish(job))
        if stream:
            return _SSEResponse(self._sse(job, fmt), on_close=job.cancel.set)
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        try:
            text = []
            while True:
                item = await job.queue.get()
                if item is Job.DONE:
                    break
                text.append(item)
        finally:
            watcher.cancel()
            job.cancel.set()  # a no-op when done; stops the worker if we were cancelled
        if job.error is not None:
            raise _as_api_error(job.error)
        return JSONResponse(fmt.response("".join(text), job))

    async def _sse(self, job: Job, fmt):
        try:
            for chunk in fmt.first():
                yield _sse_line(chunk)
            done = False
            while not done:
                pieces = [await job.queue.get()]
                while not job.queue.empty():  # what is already here goes out in one chunk
                    pieces.append(job.queue.get_nowait())
                if pieces[-1] is Job.DONE:
                    pieces.pop()
                    done = True
                if pieces:
                    yield _sse_line(fmt.chunk("".join(pieces)))
            if job.error is not None:
                yield _sse_line(_as_api_error(job.error).body())
            else:
                yield _sse_line(fmt.last(job))
                if fmt.include_usage:
                    yield _sse_line(fmt.usage_chunk(job))
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()

    def _finish(self, job: Job) -> None:
        self.jobs.discard(job)
        if job.result is not None and job.error is None:
            self.metrics.record(job.result, job.stats)


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _as_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e))
    return APIError(500, f"generation failed: {e}", type="server_error")


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel a non-streamed generation whose client has gone away."""
    while not job.cancel.is_set():
        if await request.is_disconnected():
            job.cancel.set()
            return
        await asyncio.sleep(0.05)


class _SSEResponse(StreamingResponse):
    """text/event-stream whose on_close runs however the stream ends: a client that
    disconnects cancels the send task, and on_close then stops the generation."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def timings(job: Job) -> dict:
    """The reply's timings and FFN density, as llama.cpp's server reports them (plus the
    density) for the web page."""
    r, st = job.result, job.stats
    t = r.timings or {}
    return {"prompt_n": r.n_prompt_tokens, "cached_n": getattr(r, "n_cached_tokens", 0),
            "prompt_ms": t.get("prompt_s", 0.0) * 1e3,
            "predicted_n": len(r.tokens), "predicted_ms": t.get("decode_s", 0.0) * 1e3,
            "predicted_per_second": t.get("decode_tok_per_s", 0.0),
            "ffn_mode": st.get("ffn_mode"), "ffn_density": st.get("density") if
            st.get("n_sparse_tokens") else None}


class _CompletionFormat:
    def __init__(self, server: Server, body: CompletionBody, prompt_text: str):
        self.cid, self.created, self.model = api.new_id("cmpl"), int(time.time()), server.name
        self.head = prompt_text if body.echo else ""
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))

    def first(self):
        return [api.completion_chunk(self.cid, self.created, self.model, self.head)] \
            if self.head else []

    def chunk(self, text):
        return api.completion_chunk(self.cid, self.created, self.model, text)

    def last(self, job):
        c = api.completion_chunk(self.cid, self.created, self.model, "",
                                 _finish_reason(job))
        c["timings"] = timings(job)
        return c

    def usage_chunk(self, job):
        return {"id": self.cid, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [], "usage": api.usage(job.result)}

    def response(self, text, job):
        r = api.completion_response(self.cid, self.created, self.model, self.head + text,
                                    _finish_reason(job), job.result)
        r["timings"] = timings(job)
        return r


class _ChatFormat:
    def __init__(self, server: Server, body: ChatBody):
        self.cid, self.created, self.model = api.new_id("chatcmpl"), int(time.time()), server.name
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))

    def first(self):
        return [api.chat_chunk(self.cid, self.created, self.model,
                               {"role": "assistant", "content": ""})]

    def chunk(self, text):
        return api.chat_chunk(self.cid, self.created, self.model, {"content": text})

    def last(self, job):
        c = api.chat_chunk(self.cid, self.created, self.model, {}, _finish_reason(job))
        c["timings"] = timings(job)
        return c

    def usage_chunk(self, job):
        return {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": api.usage(job.result)}

    def response(self, text, job):
        r = api.chat_response(self.cid, self.created, self.model, text, _finish_reason(job),
                              job.result)
        r["timings"] = timings(job)
        return r


def _finish_reason(job: Job) -> str:
    fr = job.result.finish_reason
    return fr if fr in ("stop", "length") else "length"


def create_app(settings: Settings) -> FastAPI:
    """The FastAPI application (loads the model now; frees it at shutdown)."""
    server = Server(settings)

    async def lifespan(app):
        server.pool = SlotPool(server.slots, settings.queue)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.close)

    app = FastAPI(title="powerinfer-cpp", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    app.add_middleware(_Guard, server=server)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: "
                                  f"{first.get('ctx', {}).get('error', first.get('msg'))}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}"
                        f": {e.get('msg')}" for e in errs[:5])
        return error_response(400, f"invalid request: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=kind)

    @app.get("/health")
    async def health():
        pool = server.pool
        busy = pool.n_busy if pool else 0
        return {"status": "ok", "slots_idle": len(server.slots) - busy,
                "slots_processing": busy, "queue": pool.n_waiting if pool else 0}

    @app.get("/metrics")
    async def metrics():
        pool = server.pool
        return PlainTextResponse(
            server.metrics.render(busy=pool.n_busy if pool else 0,
                                  waiting=pool.n_waiting if pool else 0,
                                  n_slots=len(server.slots)),
            media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.name, "object": "model", "created": server.created,
            "owned_by": "powerinfer-cpp", "meta": {"n_ctx": server.n_ctx,
                                                   "n_vocab": server.model.n_vocab,
                                                   "n_params": server.model.info.n_params}}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionBody)
        server.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = server.model.tokenize(prompt), prompt
        else:
            bad = [t for t in prompt if not 0 <= t < server.model.n_vocab]
            if bad or not prompt:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary" if bad
                               else "the prompt is empty", param="prompt")
            ids, text = list(prompt), server.model.detokenize(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty (no tokens)", param="prompt")
        kw = server.sampling(body, len(ids), body.max_tokens)
        kw["stop"] = _stops(body.stop)
        return await server.run(request, ids, kw, body.stream,
                                _CompletionFormat(server, body, text))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatBody)
        server.check_model(body.model)
        if server.template is None:
            raise APIError(400, server.template_error, param="messages",
                           code="no_chat_template")
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if body.response_format not in (None, {"type": "text"}):
            raise APIError(400, "only response_format {'type': 'text'} is supported",
                           param="response_format")
        messages = [m.model_dump(exclude_none=False) for m in body.messages]
        try:
            prompt = server.template.render(messages, add_generation_prompt=True)
        except (ChatTemplateError, TypeError, ValueError) as e:
            raise APIError(400, str(e), param="messages") from None
        ids = server.template.tokenize(server.model, prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        kw = server.sampling(body, len(ids), max_tokens)
        stops = _stops(body.stop)
        kw["stop"] = stops + [s for s in server.template.stop_strings() if s not in stops]
        return await server.run(request, ids, kw, body.stream, _ChatFormat(server, body))

    @app.get("/")
    async def index():
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/static/{name}")
    async def static(name: str):
        path = (STATIC_DIR / name).resolve()
        if path.parent != STATIC_DIR or not path.is_file():
            raise APIError(404, f"no such file: {name}", type="not_found_error")
        return FileResponse(path)

    return app


async def _parse(request: Request, model: type[BaseModel]):
    """The JSON body as `model` (whatever the Content-Type says, as OpenAI's API reads it);
    APIError 400 for malformed JSON, a wrong type or a missing field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errs = exc.errors()
        where = [".".join(str(x) for x in e.get("loc", ())) or "body" for e in errs]
        msg = "; ".join(f"{w}: {e.get('msg')}" for w, e in list(zip(where, errs))[:5])
        raise APIError(400, f"invalid request: {msg}", param=where[0] if errs else None) \
            from None


def _stops(stop) -> list[str]:
    try:
        return api.stop_list(stop)
    except TypeError as e:
        raise APIError(400, str(e), param="stop") from None


class _Guard:
    """ASGI middleware in front of every route: the API key (Bearer) on /v1 and /metrics,
    the body-size limit (413 before the route reads anything), and request counting."""

    OPEN = ("/", "/health")

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        s = self.server.settings
        status_seen = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
            await send(message)

        try:
            if s.api_key and path not in self.OPEN and not path.startswith("/static/"):
                auth = _header(scope, b"authorization")
                token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(token.encode(), s.api_key.encode()):
                    resp = error_response(401, "Incorrect API key provided (send it as "
                                          "'Authorization: Bearer KEY')",
                                          code="invalid_api_key")
                    return await resp(scope, receive, counting_send)
            length = _header(scope, b"content-length")
            if length.isdigit() and int(length) > s.max_body:
                return await _too_large(s.max_body)(scope, receive, counting_send)
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                # Read the body here, bounded, so a chunked upload cannot exceed the limit.
                chunks, size = [], 0
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > s.max_body:
                        return await _too_large(s.max_body)(scope, receive, counting_send)
                    chunks.append(chunk)
                    if not message.get("more_body"):
                        break
                body = b"".join(chunks)
                replayed = False

                async def replay():
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": body, "more_body": False}
                    return await receive()

                return await self.app(scope, replay, counting_send)
            return await self.app(scope, receive, counting_send)
        finally:
            self.server.metrics.count(path, status_seen.get("status", 0))


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is larger than this server's limit of "
                          f"{limit} bytes", code="request_too_large")


def _header(scope, name: bytes) -> str:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return ""
