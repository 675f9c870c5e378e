"""The OpenAI-compatible HTTP server: FastAPI routes over a pool of slots.

Every slot is a Context over ONE shared Model. The generations of all busy slots run in
one scheduler thread that evaluates their next tokens as one batch per step (batching.py:
continuous batching; with --no-cont-batching each generation runs in a worker thread of
its own); text pieces go back to the event loop, so the loop keeps serving other requests
(and notices a client that went away) while tokens are computed. What happens before a
request reaches a slot (checks, template, tokens) is in prepare.py; what happens before it
reaches a route (host, origin, key, body) in guard.py; the connection limits under both in
connection.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import api
from ..chat import ChatTemplate, ChatTemplateError, ChatTemplateLimitError, normalize_messages
from .batching import Batcher
from .errors import APIError, error_response
from .guard import Guard
from .metrics import Metrics
from .prepare import PromptPreparer, check_logit_bias, parse_json
from .protocol import ChatBody, CompletionBody, EmbeddingBody, _Body
from . import slot_actions
from .prompt_cache import PromptCache
from .slots import Job, QueueFull, Slot, SlotPool
from .templates import TemplateCompileError, TemplateRunner

STATIC_DIR = Path(__file__).resolve().parent / "static"
# The page's files, fixed when the server starts: /static/{name} serves these names and
# nothing else (no path is built from a request, so none can be malformed or too long).
STATIC_FILES = frozenset(p.name for p in STATIC_DIR.iterdir() if p.is_file())


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
    threads: int = 0            # of a forward pass; 0 = every core with batching (one pass
                                # runs at a time), else the cores divided among the slots
    batching: bool = True       # continuous batching (batching.py); False: a thread per slot
    prompt_chunk: int = 256     # tokens per batched pass: decode tokens + a prompt chunk
    max_tokens: int = 0         # cap on a request's max_tokens; 0 = the context size
    max_body: int = 1 << 20     # bytes
    api_key: str | None = None
    ffn: str = "auto"
    device: str = "cpu"
    vram_budget: str | None = None
    n_cpu_moe: int = 0               # MoE: the experts of the first N layers stay on the CPU
    expert_cache: str | None = None  # MoE: each context's device cache of CPU experts
    chat_template: str | None = None
    chat_template_from_flag: bool = False  # --chat-template-file: over a limit, refuse to start
    template_timeout: float = 2.0    # s: a chat template's render deadline
    template_memory: int = 256       # MiB a template worker may grow by
    tokenize_timeout: float = 10.0   # s: a long prompt's tokenizing
    body_timeout: float = 30.0       # s: a POST body's arrival, from its headers
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    draft: str | None = None         # speculative decoding: "self" or a draft model's file
    draft_max: int | None = None     # most tokens drafted per verification (None: default)
    cache_ram: int = 1024            # MiB of evicted prompt prefixes kept (0: off, -1: no limit)
    slot_save_path: str | None = None  # the directory of POST /slots/{id}?action=save|restore


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
                           vram_budget=s.vram_budget, n_cpu_moe=s.n_cpu_moe,
                           expert_cache=s.expert_cache)
        if s.prompt_chunk < 1:
            raise ValueError("--prompt-chunk must be >= 1")
        cores = os.cpu_count() or 1
        threads = s.threads or (cores if s.batching else max(1, cores // s.parallel))
        try:
            self.slots = [Slot(i, self.model.create_context(n_ctx=s.n_ctx, n_threads=threads))
                          for i in range(s.parallel)]
        except BaseException:
            self.model.close()
            raise
        self.n_ctx = self.slots[0].ctx.n_ctx
        self.draft = self._check_draft(s)
        self.max_tokens = s.max_tokens or self.n_ctx
        self.name = s.alias or Path(s.model).name.removesuffix(".gguf")
        # Every name /v1/models lists for the one model: the alias first (the id), then the
        # file's name with and without .gguf, the names users copy from their disk.
        self.aliases = list(dict.fromkeys(
            [self.name, Path(s.model).name.removesuffix(".gguf"), Path(s.model).name]))
        self.preparer = PromptPreparer(self.model, self.n_ctx, s.tokenize_timeout)
        from .embeddings import EmbeddingService

        self.embeddings = EmbeddingService(self.model, self.n_ctx, threads, self.preparer)
        self.runner: TemplateRunner | None = None
        self.template_stops: list[str] = []
        self.template_warning = ""  # a template over a limit at load, for the startup line
        try:
            # compile=False: only the render worker runs the template's code (see
            # templates.py); here it is needed for its special tokens.
            self.template: ChatTemplate | None = ChatTemplate.from_model(
                self.model, s.chat_template, compile=False)
            self.template_error = ""
        except ChatTemplateError as e:
            self.template, self.template_error = None, str(e)
        self.pool: SlotPool | None = None  # made on the event loop, at startup
        if s.cache_ram < -1:
            raise ValueError("--cache-ram must be >= 0 MiB (0: off) or -1 (no limit)")
        self.prompt_cache = PromptCache(None if s.cache_ram == -1 else s.cache_ram << 20)
        if s.slot_save_path:
            d = Path(s.slot_save_path)
            if d.exists() and not d.is_dir():
                raise ValueError(f"--slot-save-path {d} is not a directory")
            d.mkdir(parents=True, exist_ok=True)
        self.batcher = Batcher(s.prompt_chunk) if s.batching else None
        self.executor = None if s.batching else concurrent.futures.ThreadPoolExecutor(
            max_workers=s.parallel, thread_name_prefix="slot")
        self.metrics = Metrics()
        self.jobs: set[Job] = set()
        self.created = int(time.time())
        if self.template is not None:
            self._start_template()

    def _start_template(self) -> None:
        """The template's workers, and a trial render: a template over a limit for a
        one-message chat is found now, not by the first request. From the file, it leaves
        the server without chat (each chat request says why); from --chat-template-file,
        it stops the server from starting."""
        s = self.settings
        # The output cap is what the context could hold: longer text cannot be a prompt.
        self.runner = TemplateRunner(self.template, s.template_timeout, s.template_memory,
                                     self.preparer.max_chars)
        self.preparer.runner = self.runner
        try:
            self.template_stops = self.runner.trial()
        except TemplateCompileError as e:
            if s.chat_template_from_flag:
                self.close()
                raise ValueError(f"--chat-template-file: {e}") from None
            self.runner.close()
            self.template, self.runner, self.template_error = None, None, str(e)
        except ChatTemplateLimitError as e:
            msg = f"{e} (at load, for a one-message chat: chat completions are disabled)"
            if s.chat_template_from_flag:
                self.close()
                raise ValueError(f"--chat-template-file: {e}") from None
            self.runner.close()
            self.template, self.runner, self.template_error = None, None, msg
            self.template_warning = msg
        except ChatTemplateError:
            # Some templates refuse some chats; requests meet that themselves.
            self.template_stops = [self.template.tokens["eos_token"]] \
                if self.template.tokens.get("eos_token") else []

    def close(self) -> None:
        """Stop every generation, wait for the workers, free the model."""
        for job in list(self.jobs):
            job.cancel.set()
        if self.batcher is not None:
            self.batcher.close()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        self.preparer.close()
        if self.runner is not None:
            self.runner.close()
        self.embeddings.close()
        self.model.close()

    # -- request handling ------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        """Any `model` is answered by the one model this server has, as llama-server does:
        clients hard-code names ("gpt-3.5-turbo") or send the file's name, and a 404 for a
        name that can only mean this model helps nobody. Replies carry the server's name,
        so a client can see which model answered."""
        return None

    def check_request(self, body: _Body, max_tokens: int | None) -> None:
        """What can be refused before the prompt is looked at."""
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
        check_logit_bias(body.logit_bias, self.model.n_vocab)

    def sampling(self, body: _Body, n_prompt: int, max_tokens: int | None) -> dict:
        """ctx.stream keyword arguments from a request, with the server's limits."""
        self.check_request(body, max_tokens)
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
        bias = check_logit_bias(body.logit_bias, self.model.n_vocab)
        if bias:
            try:
                proc = api.make_logits_processor(self.model.eos_id, logit_bias=bias)
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), param="logit_bias") from None
            kw["logits_processor"] = proc
        return kw

    async def constrain(self, body: _Body, kw: dict, response_format=None,
                        tools_grammar: str | None = None) -> None:
        """Structured output: the grammar a request's response_format, grammar or tools ask
        for, compiled off the event loop (a schema can take a while), its mask put before
        the other logits processors in kw; APIError 400 naming what is wrong with it."""
        from .. import structured

        if response_format is None and body.grammar is None and tools_grammar is None:
            return
        grammars = [("tools", tools_grammar)] if tools_grammar is not None else []
        for param, fn, value in (("response_format", structured.grammar_for_response_format,
                                  response_format),
                                 ("grammar", structured.grammar_arg, body.grammar)):
            try:
                g = fn(value, param)
            except structured.GrammarError as e:
                raise APIError(400, str(e), param=param) from None
            except structured.StructuredOutputUnavailable as e:
                raise APIError(400, str(e), param=param,
                               code="structured_output_unavailable") from None
            if g is not None:
                grammars.append((param, g))
        if not grammars:
            return
        if len(grammars) > 1:
            raise APIError(400, f"give one of {' or '.join(p for p, _ in grammars)}, not both",
                           param=grammars[-1][0])
        param, g = grammars[0]
        if body.ignore_eos:
            raise APIError(400, f"ignore_eos cannot be combined with {param} (a complete "
                           "reply ends with EOS)", param="ignore_eos")
        loop = asyncio.get_running_loop()
        try:
            c = await loop.run_in_executor(self.preparer.pool, structured.compile_grammar,
                                           self.model, g)
        except structured.GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        kw["logits_processor"] = api.chain_processors(c.processor(), kw.get("logits_processor"))

    def _check_draft(self, s: Settings):
        """The draft every request decodes with (None: none), checked at startup."""
        if s.draft is None:
            if s.draft_max is not None:
                self.model.close()
                raise ValueError("--draft-max needs a drafter: --draft self or --model-draft FILE")
            return None
        from .. import speculative

        try:
            if speculative.as_lookup_draft(s.draft) is not None:
                return s.draft
            sd = speculative.as_self_draft(s.draft)
            if sd is not None:
                speculative.check_self_draft(self.model, sd)
                return s.draft
            return speculative.load_draft_model(self.model, s.draft)
        except BaseException:
            self.model.close()
            raise

    async def run(self, request: Request, prompt_ids: list[int], kw: dict, stream: bool,
                  fmt) -> Any:
        """Wait for a slot, generate; a JSON response, or an SSE stream of fmt's chunks."""
        assert self.pool is not None
        if self.draft is not None and "logits_processor" not in kw:
            # every slot decodes speculatively (its own draft context); the batching
            # scheduler steps such a generation on its own (Generation.batchable). A request
            # with a logits processor (grammar, response_format, logit_bias) decodes plainly:
            # a grammar's matcher only moves forward and cannot see drafts rejected later
            kw = dict(kw, draft=self.draft, draft_max=self.settings.draft_max)
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
        done = job.start(self.batcher or self.executor)
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
                chunk = fmt.chunk("".join(pieces)) if pieces else None
                if chunk is not None:  # None: held back (what may still be a tool call)
                    yield _sse_line(chunk)
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
    reuse = job.reuse
    return {"prompt_n": r.n_prompt_tokens, "cached_n": getattr(r, "n_cached_tokens", 0),
            "cached_from": reuse.source if reuse is not None and reuse.n else None,
            "cache_ms": reuse.ms if reuse is not None else 0.0,
            "prompt_ms": t.get("prompt_s", 0.0) * 1e3,
            "predicted_n": len(r.tokens), "predicted_ms": t.get("decode_s", 0.0) * 1e3,
            "predicted_per_second": t.get("decode_tok_per_s", 0.0),
            "ffn_mode": st.get("ffn_mode"), "ffn_density": st.get("density") if
            st.get("n_sparse_tokens") else None,
            **({"draft_n": t["speculative"]["drafted"],
                "draft_n_accepted": t["speculative"]["accepted"]} if "speculative" in t else {})}


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
    """Chat replies; with tools (a ToolPlan) the reply is parsed into tool calls, and a
    streamed one sent as OpenAI's tool-call deltas (tools.ToolStream)."""

    def __init__(self, server: Server, body: ChatBody, plan=None):
        self.cid, self.created, self.model = api.new_id("chatcmpl"), int(time.time()), server.name
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))
        self.plan = plan
        self.tool_stream = plan.stream() if plan is not None else None

    def first(self):
        return [api.chat_chunk(self.cid, self.created, self.model,
                               {"role": "assistant", "content": ""})]

    def chunk(self, text):
        if self.tool_stream is not None:
            delta = self.tool_stream.feed(text)
            return None if delta is None else api.chat_chunk(self.cid, self.created,
                                                             self.model, delta)
        return api.chat_chunk(self.cid, self.created, self.model, {"content": text})

    def last(self, job):
        delta, fin = {}, _finish_reason(job)
        if self.tool_stream is not None:
            delta, fin = self.tool_stream.finish(fin)
        c = api.chat_chunk(self.cid, self.created, self.model, delta, fin)
        c["timings"] = timings(job)
        return c

    def usage_chunk(self, job):
        return {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": api.usage(job.result)}

    def response(self, text, job):
        r = api.chat_response(self.cid, self.created, self.model, text, _finish_reason(job),
                              job.result)
        if self.plan is not None:
            msg, fin = self.plan.parse(text, _finish_reason(job))
            r["choices"][0].update(message=msg, finish_reason=fin)
        r["timings"] = timings(job)
        return r


def _finish_reason(job: Job) -> str:
    fr = job.result.finish_reason
    return fr if fr in ("stop", "length") else "length"


def create_app(settings: Settings) -> FastAPI:
    """The FastAPI application (loads the model now; frees it at shutdown)."""
    server = Server(settings)

    async def lifespan(app):
        server.pool = SlotPool(server.slots, settings.queue, server.prompt_cache)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.close)

    app = FastAPI(title="powerinfer-cpp", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    app.add_middleware(Guard, server=server)

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
                                  n_slots=len(server.slots),
                                  batched=(b.steps, b.batched_tokens) if (b := server.batcher)
                                  else (0, 0)),
            media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.name, "object": "model", "created": server.created,
            "owned_by": "powerinfer-cpp", "aliases": server.aliases,
            "meta": {"n_ctx": server.n_ctx, "n_vocab": server.model.n_vocab,
                     "n_params": server.model.info.n_params,
                     "ffn_mode": server.slots[0].ctx.ffn_mode}}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionBody)
        server.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        server.check_request(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await server.preparer.tokenize(prompt, "prompt", server.model.tokenize)
            text = prompt
        else:
            if len(prompt) >= server.n_ctx:  # before a pass over up to a body's worth of ids
                raise APIError(400, f"This model's maximum context length is {server.n_ctx} "
                               f"tokens, but the prompt has {len(prompt)} tokens",
                               param="prompt", code="context_length_exceeded")
            bad = [t for t in prompt if not 0 <= t < server.model.n_vocab]
            if bad or not prompt:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary" if bad
                               else "the prompt is empty", param="prompt")
            ids, text = list(prompt), server.model.detokenize(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty (no tokens)", param="prompt")
        kw = server.sampling(body, len(ids), body.max_tokens)
        kw["stop"] = _stops(body.stop)
        await server.constrain(body, kw)
        return await server.run(request, ids, kw, body.stream,
                                _CompletionFormat(server, body, text))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatBody)
        server.check_model(body.model)
        if server.template is None:
            raise APIError(400, server.template_error, param="messages",
                           code="no_chat_template")
        plan = None
        if body.tools:
            from ..tools import ToolError, ToolPlan

            try:
                plan = ToolPlan(body.tools, body.tool_choice, body.parallel_tool_calls,
                                template_source=server.template.source)
            except ToolError as e:
                raise APIError(400, str(e), param="tools") from None
        elif body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        server.check_request(body, max_tokens)
        try:
            messages = normalize_messages([m.model_dump(exclude_none=False)
                                           for m in body.messages])
            if plan is not None:
                messages = plan.messages(messages)  # tool calls and results as text
        except (TypeError, ValueError) as e:  # ToolError is a ValueError
            raise APIError(400, str(e), param="messages") from None
        tools_grammar = None
        if plan is not None and plan.active:
            from ..structured import StructuredOutputUnavailable

            try:
                tools_grammar = plan.grammar(server.model.tokenizer)
            except ToolError as e:
                raise APIError(400, str(e), param="tools") from None
            except StructuredOutputUnavailable as e:
                raise APIError(400, str(e), param="tools",
                               code="structured_output_unavailable") from None
        else:
            plan = None
        template = server.template
        prompt = await server.preparer.render(
            messages, plan.template_vars().get("tools") if plan is not None else None)
        ids = await server.preparer.tokenize(prompt, "messages",
                                             lambda t: template.tokenize(server.model, t))
        kw = server.sampling(body, len(ids), max_tokens)
        stops = _stops(body.stop)
        kw["stop"] = stops + [s for s in server.template_stops if s not in stops]
        await server.constrain(body, kw, body.response_format, tools_grammar)
        return await server.run(request, ids, kw, body.stream, _ChatFormat(server, body, plan))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await _parse(request, EmbeddingBody)
        server.check_model(body.model)
        return JSONResponse(await server.embeddings.handle(body, server.name))

    slot_actions.add_routes(app, server)

    @app.get("/")
    async def index():
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/static/{name:path}")
    async def static(name: str):
        if name not in STATIC_FILES:
            shown = name if len(name) <= 80 else name[:80] + "..."
            raise APIError(404, f"no such file: {shown!r}", type="not_found_error")
        return FileResponse(STATIC_DIR / name)

    return app


async def _parse(request: Request, model: type[BaseModel]):
    """The JSON body as `model` (the guard has checked its Content-Type and size);
    APIError 400 for malformed JSON, a wrong type or a missing field."""
    data = parse_json(await request.body())
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
