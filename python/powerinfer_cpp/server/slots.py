"""Slots: the contexts a server generates with, handed out to requests through a bounded
queue, and the worker that runs one generation on a slot in a thread."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field

from ..generation import Completion
from .prompt_cache import load_prefix


class QueueFull(Exception):
    """Every slot is busy and the wait queue is full."""


@dataclass
class Slot:
    """One Context over the shared Model, and the tokens its cache holds."""

    index: int
    ctx: object
    cached: list[int] = field(default_factory=list)
    last_used: float = 0.0  # when it was last handed out (time.monotonic)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    """Hands free slots to requests (the one whose cache shares the longest prefix with
    the prompt, so a chat's next turn lands where its history is cached; among equals the
    least recently used); requests that find none wait in a FIFO of at most `max_queue`,
    beyond which acquire() raises QueueFull. Used from the event loop only; release() is
    scheduled onto it by workers. `cache`: the RAM cache of evicted prefixes (None: off);
    the prefix a prompt reuses may come from any slot or from it (prompt_cache.py)."""

    def __init__(self, slots: list[Slot], max_queue: int, cache=None):
        self.slots = slots
        self.free = list(slots)
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.max_queue = max_queue
        self.cache = cache

    @property
    def n_busy(self) -> int:
        return len(self.slots) - len(self.free)

    @property
    def n_waiting(self) -> int:
        return sum(1 for w in self.waiters if not w.done())

    async def acquire(self, prompt_ids: list[int]) -> Slot:
        """A free slot, waiting in the queue if there is none."""
        if self.free and not self.waiters:
            best = max(self.free, key=lambda s: (_common_prefix(s.cached, prompt_ids),
                                                 -s.last_used))
            self.free.remove(best)
            best.last_used = time.monotonic()
            return best
        if self.n_waiting >= self.max_queue:
            raise QueueFull
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed over just as the waiter gave up
            else:
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def take(self, slot: Slot) -> bool:
        """Claim one slot by its id for a slot action (save, restore, erase): False when it
        is busy (or promised to a waiting request)."""
        if slot not in self.free or self.waiters:
            return False
        self.free.remove(slot)
        return True

    def release(self, slot: Slot) -> None:
        """Give a slot back: to the oldest waiter, else to the free list."""
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self.free.append(slot)


class Job:
    """One generation on a slot, run by the batching scheduler (batching.py: begin, then
    sample and evaluation steps, then end) or, without batching, in a worker thread of its
    own (_run). Text pieces go to `queue` on the event loop as they come; `cancel` (set
    when the client goes away) stops the generation at the next token. The slot is
    released only when the scheduler or the thread is done with its context."""

    DONE = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: SlotPool, slot: Slot,
                 prompt_ids: list[int], kwargs: dict):
        self.loop, self.pool, self.slot = loop, pool, slot
        self.prompt_ids, self.kwargs = prompt_ids, kwargs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._pending: list = []
        self._wake_pending = False
        self._last_wake = 0.0
        self.result = None      # the model's Completion
        self.stats: dict = {}   # ctx.stats() of this generation
        self.error: BaseException | None = None
        self.gen = None         # the Generation (batched runs)
        self.reuse = None       # where the prompt's cached prefix came from (prompt_cache)
        self.ended = False
        self.batch_future = None  # completed by end() (batched runs)

    def start(self, runner) -> "asyncio.Future":
        """Hand the job to the batching scheduler (runner.submit_job) or to a worker thread
        of an executor; the returned future completes when the slot's context is free."""
        cf = (runner.submit_job(self) if hasattr(runner, "submit_job")
              else runner.submit(self._run))
        cf.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self.pool.release,
                                                                       self.slot))
        return asyncio.wrap_future(cf, loop=self.loop)

    # Wake the event loop at most this often while pieces keep coming (DONE always wakes).
    # Each wake-up costs the worker the GIL hand-over to the loop thread and back: with the
    # shipped 5M model (a token every ~0.4 ms) one per token slowed decode by ~15%
    # (measured: Job vs ctx.generate, alternated). A held piece waits for the next one, so
    # a reply is late by at most one token's time and never more than this.
    WAKE_INTERVAL_S = 0.002

    def _emit(self, item) -> None:
        now = time.perf_counter()
        with self._lock:
            self._pending.append(item)
            if self._wake_pending or (item is not self.DONE and
                                      now - self._last_wake < self.WAKE_INTERVAL_S):
                return
            self._wake_pending = True
            self._last_wake = now
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._pending, self._wake_pending = self._pending, [], False
        for item in items:
            self.queue.put_nowait(item)

    # -- the batching scheduler's side (its thread only) --------------------------------

    def begin(self) -> None:
        """Check the arguments and set up the generation (nothing is evaluated yet)."""
        self.result = Completion("", [], "length", 0)
        self._load_prefix()
        self.slot.ctx.reset_stats()
        self.gen = self.slot.ctx.start_generation(self.prompt_ids, stats=self.result,
                                                  **self.kwargs)

    def _load_prefix(self) -> None:
        """The longest prefix of the prompt cached in any slot or the RAM cache, into this
        slot's context (on the thread that drives it)."""
        self.reuse = load_prefix(self.slot, self.prompt_ids, self.pool.slots, self.pool.cache)

    def sample(self) -> None:
        """The next token from the logits, its text to the client."""
        piece = self.gen.sample()
        if piece:
            self._emit(piece)

    def end(self, error: BaseException | None = None, cancelled: bool = False) -> None:
        """Finish: the held-back text (at a normal end), the result and statistics, the
        slot's cached tokens; then DONE to the client and the slot back to the pool."""
        if self.ended:
            return
        self.ended = True
        ctx = self.slot.ctx
        try:
            if self.gen is not None:
                if error is None and not cancelled:
                    tail = self.gen.flush()
                    if tail:
                        self._emit(tail)
                self.gen.finish()
            if self.result is None:
                self.result = Completion("", [], "length", 0)
            if cancelled:
                self.result.finish_reason = "cancelled"
            if error is None:
                self.stats = ctx.stats()
        except BaseException as e:  # e.g. the context closed at shutdown
            error = error or e
        self.error = error
        try:
            self.slot.cached = list(ctx.cached_tokens)
        except (AttributeError, RuntimeError):
            self.slot.cached = self.prompt_ids + list(self.result.tokens)
        self._emit(self.DONE)
        if self.batch_future is not None:
            self.batch_future.set_result(None)

    # -- without batching: a worker thread runs the whole generation ---------------------

    def _run(self) -> None:
        ctx = self.slot.ctx
        self.result = Completion("", [], "length", 0)
        try:
            if self.cancel.is_set():
                return
            self._load_prefix()
            ctx.reset_stats()
            pieces = ctx.stream(self.prompt_ids, stats=self.result, **self.kwargs)
            cancelled = False
            try:
                for piece in pieces:
                    if self.cancel.is_set():
                        cancelled = True
                        break
                    self._emit(piece)
            finally:
                pieces.close()
            if cancelled:
                self.result.finish_reason = "cancelled"
            self.stats = ctx.stats()
        except BaseException as e:  # reported to the client; the server carries on
            self.error = e
        finally:
            try:
                self.slot.cached = list(ctx.cached_tokens)
            except (AttributeError, RuntimeError):  # an older Context, or closed at shutdown
                self.slot.cached = self.prompt_ids + list(self.result.tokens)
            self._emit(self.DONE)
