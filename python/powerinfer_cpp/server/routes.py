"""The OpenAI routes and the page: each request's body parsed and checked, its prompt
prepared, and the reply shaped (text_completion or chat.completion, streamed or whole) from
protocol.py's builders; the generation itself is the Server's (app.py)."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError

from .. import arguments as A
from .. import protocol as P
from ..chat import normalize_messages
from ..protocol import ChatBody, CompletionBody, EmbeddingBody
from ..structured import StructuredOutputUnavailable
from ..tools import ToolError, ToolPlan
from . import slot_actions
from .errors import APIError
from .prepare import parse_json
from .slots import Job

STATIC_DIR = Path(__file__).resolve().parent / "static"
# The page's files, fixed when the server starts: /static/{name} serves these names and
# nothing else (no path is built from a request, so none can be malformed or too long).
STATIC_FILES = frozenset(p.name for p in STATIC_DIR.iterdir() if p.is_file())


def add_routes(app, server) -> None:
    """The routes over `server` (app.py's Server)."""
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
        return A.stop_list(stop)
    except TypeError as e:
        raise APIError(400, str(e), param="stop") from None


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
    def __init__(self, server, body: CompletionBody, prompt_text: str):
        self.cid, self.created, self.model = P.new_id("cmpl"), int(time.time()), server.name
        self.head = prompt_text if body.echo else ""
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))

    def first(self):
        return [P.completion_chunk(self.cid, self.created, self.model, self.head)] \
            if self.head else []

    def chunk(self, text):
        return P.completion_chunk(self.cid, self.created, self.model, text)

    def last(self, job):
        c = P.completion_chunk(self.cid, self.created, self.model, "",
                                 _finish_reason(job))
        c["timings"] = timings(job)
        return c

    def usage_chunk(self, job):
        return P.usage_chunk(self.cid, "text_completion", self.created, self.model, job.result)

    def response(self, text, job):
        r = P.completion_response(self.cid, self.created, self.model, self.head + text,
                                    _finish_reason(job), job.result)
        r["timings"] = timings(job)
        return r


class _ChatFormat:
    """Chat replies; with tools (a ToolPlan) the reply is parsed into tool calls, and a
    streamed one sent as OpenAI's tool-call deltas (tools.ToolStream)."""

    def __init__(self, server, body: ChatBody, plan=None):
        self.cid, self.created, self.model = P.new_id("chatcmpl"), int(time.time()), server.name
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))
        self.plan = plan
        self.tool_stream = plan.stream() if plan is not None else None

    def first(self):
        return [P.chat_chunk(self.cid, self.created, self.model,
                               {"role": "assistant", "content": ""})]

    def chunk(self, text):
        if self.tool_stream is not None:
            delta = self.tool_stream.feed(text)
            return None if delta is None else P.chat_chunk(self.cid, self.created,
                                                           self.model, delta)
        return P.chat_chunk(self.cid, self.created, self.model, {"content": text})

    def last(self, job):
        delta, fin = {}, _finish_reason(job)
        if self.tool_stream is not None:
            delta, fin = self.tool_stream.finish(fin)
        c = P.chat_chunk(self.cid, self.created, self.model, delta, fin)
        c["timings"] = timings(job)
        return c

    def usage_chunk(self, job):
        return P.usage_chunk(self.cid, "chat.completion.chunk", self.created, self.model,
                             job.result)

    def response(self, text, job):
        r = P.chat_response(self.cid, self.created, self.model, text, _finish_reason(job),
                              job.result)
        if self.plan is not None:
            msg, fin = self.plan.parse(text, _finish_reason(job))
            r["choices"][0].update(message=msg, finish_reason=fin)
        r["timings"] = timings(job)
        return r


def _finish_reason(job: Job) -> str:
    fr = job.result.finish_reason
    return fr if fr in ("stop", "length") else "length"
