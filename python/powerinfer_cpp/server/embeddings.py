"""/v1/embeddings: a request's inputs to vectors (powerinfer_cpp.embeddings does the
pooling and the normalisation).

Embeddings run on a context of their own, made at the first request (a server that never
embeds holds no extra cache), one request at a time in one worker thread, apart from the
generation slots: an embedding request does not wait for a reply to finish, and the
scheduler over the slots does not need to know about it. Every check that can refuse a
request runs before the context is touched, and text is tokenized by the prompt preparer
(the character bound first, long texts off the event loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from .. import embeddings as E
from ..protocol import EmbeddingBody, embedding_response
from .errors import APIError

MAX_INPUTS = 2048  # inputs per request, as OpenAI's API allows


class EmbeddingService:
    def __init__(self, model, n_ctx: int, n_threads: int, preparer):
        self.model, self.n_ctx, self.n_threads, self.preparer = model, n_ctx, n_threads, preparer
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embed")
        self._ctx = None
        self._lock = threading.Lock()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._ctx is not None:
                self._ctx.close()

    def _context(self):
        with self._lock:
            if self._ctx is None:
                self._ctx = self.model.create_context(n_ctx=self.n_ctx, n_threads=self.n_threads)
            return self._ctx

    def _pooling(self) -> str:
        try:
            pooling = self.model.pooling
        except E.EmbeddingError as e:
            raise APIError(400, f"this model cannot embed: {e}", param="input") from None
        if pooling == "none":
            raise APIError(400, "this model's pooling type is none (a vector per token), which "
                           "is not an OpenAI embedding", param="input")
        return pooling

    async def _ids(self, item, where: str) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"{where} is an empty string", param=where)
            tok = self.model.tokenizer
            ids = await self.preparer.tokenize(
                item, where, lambda t: tok.encode(t, add_bos=None, add_eos=None))
        else:
            ids = item
            bad = [t for t in ids if not 0 <= t < self.model.n_vocab]
            if bad:
                raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.model.n_vocab})", param=where)
        if not ids:
            raise APIError(400, f"{where} has no tokens", param=where)
        if len(ids) > self.n_ctx:
            raise APIError(400, f"This model's maximum context length is {self.n_ctx} tokens, "
                           f"but {where} has {len(ids)} tokens", param=where,
                           code="context_length_exceeded")
        return list(ids)

    async def handle(self, body: EmbeddingBody, name: str) -> dict:
        n_embd = self.model.info.n_embd
        if body.dimensions is not None and body.dimensions != n_embd:
            raise APIError(400, f"dimensions = {body.dimensions}: this model's embeddings have "
                           f"{n_embd} (shortening them is not supported)", param="dimensions")
        pooling = self._pooling()
        inp = body.input
        if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
            items, names = [inp], ["input"]
        else:
            items, names = list(inp), [f"input[{i}]" for i in range(len(inp))]
        if not items or (len(items) == 1 and not isinstance(items[0], str) and not items[0]):
            raise APIError(400, "input is empty", param="input")
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"input has {len(items)} items, more than the {MAX_INPUTS} a "
                           "request may have", param="input")
        ids = [await self._ids(x, w) for x, w in zip(items, names)]

        def work():
            ctx = self._context()
            return [E.embed_ids(ctx, x, pooling, True) for x in ids]

        loop = asyncio.get_running_loop()
        vectors = await loop.run_in_executor(self.executor, work)
        return embedding_response(vectors, name, sum(len(x) for x in ids),
                                      body.encoding_format)
