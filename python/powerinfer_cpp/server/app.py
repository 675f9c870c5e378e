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
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import arguments as A
from .. import speculative, structured
from ..chat import ChatTemplate, ChatTemplateError, ChatTemplateLimitError
from ..model import Model
from ..protocol import Body, ChatBody
from . import routes
from .batching import Batcher
from .embeddings import EmbeddingService
from .errors import APIError, add_handlers, as_api_error
from .guard import Guard
from .metrics import Metrics
from .prepare import PromptPreparer, check_logit_bias
from .prompt_cache import PromptCache
from .settings import Settings
from .slots import Job, QueueFull, Slot, SlotPool
from .templates import TemplateCompileError, TemplateRunner

__all__ = ["Server", "Settings", "create_app"]


class Server:
    """The loaded model, its slots and what the routes share."""

    def __init__(self, settings: Settings):
        self.settings = s = settings
        s.check()
        self.model = Model(s.model, n_ctx=s.n_ctx, ffn=s.ffn, device=s.device,
                           vram_budget=s.vram_budget, n_cpu_moe=s.n_cpu_moe,
                           expert_cache=s.expert_cache)
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
        if speculative.serves_dense(self.draft, s.ffn):
            for slot in self.slots:
                slot.ctx.set_ffn_mode("dense")
        self.max_tokens = s.max_tokens or self.n_ctx
        self.name = s.alias or Path(s.model).name.removesuffix(".gguf")
        # Every name /v1/models lists for the one model: the alias first (the id), then the
        # file's name with and without .gguf, the names users copy from their disk.
        self.aliases = list(dict.fromkeys(
            [self.name, Path(s.model).name.removesuffix(".gguf"), Path(s.model).name]))
        self.preparer = PromptPreparer(self.model, self.n_ctx, s.tokenize_timeout)
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
        self.prompt_cache = PromptCache(None if s.cache_ram == -1 else s.cache_ram << 20)
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

    def check_request(self, body: Body, max_tokens: int | None) -> None:
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

    def sampling(self, body: Body, n_prompt: int, max_tokens: int | None) -> dict:
        """ctx.stream keyword arguments from a request, with the server's limits."""
        self.check_request(body, max_tokens)
        if n_prompt >= self.n_ctx:
            raise APIError(400, f"This model's maximum context length is {self.n_ctx} tokens, "
                           f"but the prompt has {n_prompt} tokens", param="messages"
                           if isinstance(body, ChatBody) else "prompt",
                           code="context_length_exceeded")
        kw = A.stream_kwargs(max_tokens, n_prompt, self.n_ctx, temperature=body.temperature,
                             top_p=body.top_p, min_p=body.min_p, top_k=body.top_k,
                             repeat_penalty=body.repeat_penalty, seed=body.seed,
                             limit=self.max_tokens, ignore_eos=body.ignore_eos)
        bias = check_logit_bias(body.logit_bias, self.model.n_vocab)
        if bias:
            try:
                proc = A.make_logits_processor(self.model.eos_id, logit_bias=bias)
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), param="logit_bias") from None
            kw["logits_processor"] = proc
        return kw

    async def constrain(self, body: Body, kw: dict, response_format=None,
                        tools_grammar: str | None = None) -> None:
        """Structured output: the grammar a request's response_format, grammar or tools ask
        for, compiled off the event loop (a schema can take a while), its mask put before
        the other logits processors in kw; APIError 400 naming what is wrong with it."""
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
        kw["logits_processor"] = A.chain_processors(c.processor(), kw.get("logits_processor"))

    def _check_draft(self, s: Settings):
        """The draft every request decodes with (None: none), checked at startup."""
        if s.draft is None:
            return None
        try:
            return speculative.resolve_draft(self.model, s.draft)
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
            raise as_api_error(job.error)
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
                yield _sse_line(as_api_error(job.error).body())
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
    add_handlers(app)
    routes.add_routes(app, server)
    return app


