"""The prompt cache beyond one slot: before a slot evaluates a prompt, the longest prefix of
it already computed anywhere is put into the slot's KV cache: the slot's own cache, another
slot's (idle or generating: the prefix of its cache does not change while it appends), or
a RAM cache of prefixes evicted from slots (--cache-ram MiB, least recently used out first,
bounded by bytes). Copies are the runtime's context states (Context.save_state /
load_state: the keys and values themselves, so a reply equals a cold run's bit for bit).

Only the exactly computed part of a cache is reused (Context.reusable_tokens): tokens a
sparse FFN decoded are not, as within one slot (Generation.prefill)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("uvicorn.error")

# A copy pays when it saves evaluating at least this many tokens more than the slot's own
# cache holds: below it the state's memcpy and checksum cost about what the forward pass of
# the tokens does on a small model.
MIN_GAIN = 8


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """Context states of evicted prefixes in RAM, at most `capacity` bytes (None: no limit;
    0: off), the least recently used dropped first. Thread-safe."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.hits = 0       # prompts that got their prefix from here
        self.evictions = 0  # entries dropped for room

    @property
    def enabled(self) -> bool:
        return self.capacity is None or self.capacity > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def states(self) -> list:
        """The entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def put(self, state) -> bool:
        """Keep `state` (a ContextState holding its exact tokens only): dropped are the
        entries it covers (their tokens a prefix of its), then the least recently used until
        it fits. Refused (False) when it is larger than the capacity or an entry covers it."""
        if not self.enabled or state.n_tokens == 0:
            return False
        size = state.nbytes
        if self.capacity is not None and size > self.capacity:
            return False
        toks = state.tokens
        with self._lock:
            for key, e in list(self._entries.items()):
                n = common_prefix(e.tokens, toks)
                if n == len(toks):  # already here, as this or a longer prefix
                    self._entries.move_to_end(key)
                    return False
                if n == len(e.tokens):
                    self._drop(key)
            while self.capacity is not None and self.nbytes + size > self.capacity:
                self._drop(next(iter(self._entries)))
                self.evictions += 1
            self._entries[self._next] = state
            self._next += 1
            self.nbytes += size
            return True

    def _drop(self, key) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def best(self, prompt) -> tuple[object | None, int]:
        """The entry sharing the longest prefix with `prompt` (marked as just used), and
        that length; (None, 0) if none shares any."""
        with self._lock:
            best, best_n, best_key = None, 0, None
            for key, e in self._entries.items():
                n = common_prefix(e.tokens, prompt)
                if n > best_n:
                    best, best_n, best_key = e, n, key
            if best_key is not None:
                self._entries.move_to_end(best_key)
            return best, best_n


@dataclass
class Reuse:
    """Where a prompt's cached prefix came from: "slot" (this slot's own cache), "slot N"
    (copied from slot N), "ram" (the RAM cache) or None; n: its tokens; ms: the time spent
    on it (the look, the copy, and saving what the slot held to the RAM cache)."""

    source: str | None = None
    n: int = 0
    ms: float = 0.0


def load_prefix(slot, prompt_ids: list[int], slots, cache: PromptCache | None) -> Reuse:
    """Before `slot` evaluates `prompt_ids`: put the longest prefix of the prompt found in
    any slot or in the cache into the slot's context (run where the slot's context is
    driven: the batching thread, or the slot's worker). What the slot held beyond it goes
    to the cache first, so it is not lost. At least the prompt's last token is left to
    evaluate (its logits start the reply)."""
    t0 = time.perf_counter()
    r = _load_prefix(slot, prompt_ids, slots, cache)
    r.ms = (time.perf_counter() - t0) * 1e3
    return r


def _load_prefix(slot, prompt_ids, slots, cache) -> Reuse:
    ctx = slot.ctx
    want = prompt_ids[:-1]
    mine = ctx.reusable_tokens
    own = common_prefix(mine, want)
    best_n, source, state = own, None, None
    for other in slots:
        if other is slot:
            continue
        theirs = other.ctx.peek_reusable_tokens()  # a slot in a call now is passed over
        n = common_prefix(theirs, want) if theirs is not None else 0
        if n >= best_n + MIN_GAIN:
            best_n, source = n, other
    if cache is not None and cache.enabled:
        entry, n = cache.best(want)
        n = min(n, entry.n_exact) if entry is not None else 0
        if n >= best_n + MIN_GAIN:
            best_n, source, state = n, "ram", entry
    if cache is not None and cache.enabled and len(mine) > own:
        # the slot's cache beyond the shared prefix is about to be overwritten: keep it
        try:
            cache.put(ctx.save_state(len(mine)))
        except (RuntimeError, ValueError, MemoryError) as e:  # only a lost reuse
            log.warning("prompt cache: could not save slot %d's prefix: %s", slot.index, e)
    if source is None:
        return Reuse("slot" if own else None, own)
    try:
        if state is None:
            state = source.ctx.save_state(best_n)
            # the other slot may have moved on between the look and the copy
            best_n = min(common_prefix(state.tokens[:state.n_exact], want), best_n)
            if best_n < own + MIN_GAIN:
                return Reuse("slot" if own else None, own)
        ctx.load_state(state)
        ctx.reset(best_n)
    except (RuntimeError, ValueError, MemoryError) as e:  # unchanged: evaluate it all
        log.warning("prompt cache: could not restore a prefix into slot %d: %s", slot.index, e)
        return Reuse("slot" if own else None, own)
    if source == "ram":
        cache.hits += 1
        return Reuse("ram", best_n)
    return Reuse(f"slot {source.index}", best_n)
