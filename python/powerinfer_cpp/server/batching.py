"""Continuous batching: ONE scheduler thread runs the generations of every busy slot.

Each step it
  1. admits the requests that arrived since the last step and drops those whose client
     went away (the slot is free for the next request);
  2. samples the next token of every generation whose logits are ready and sends its text
     (a generation that ends here answers its client now);
  3. evaluates, in ONE forward pass (model.eval_batch: each weight is read once per step,
     not once per slot), the next token of every decoding generation and a chunk of the
     oldest prompt still being read: the pass takes `prompt_chunk` tokens (--prompt-chunk,
     -b), the decode tokens first, the prompt the rest. So a long prompt is spread over
     several steps and the others' tokens come at the pace of one pass of that size, not
     after the whole prompt (with no other generation decoding, the whole prompt at once).
In the sparse FFN modes (sparse, gate, oracle) each row of a pass selects its own neurons
and gate/up run over the union of the rows' lists (ffn/exec.c), so a slot gets the reply it
gets alone. One pass runs one FFN, so the decoding generations are grouped by batch_key():
the dense ones' pass also takes the prompt chunk (a prompt reads through the dense FFN);
each sparse mode's generations get a pass of their own (without them, the chunk too).

A speculative generation (speculative.py) takes part in the same passes, one part of a
round per step: each draft step joins the pass of the drafter's FFN (draft="self": the
sparse mode's pass, beside the sparse generations; a draft model: a pass of the draft
model's contexts), the verification of its k drafts (k + 1 tokens, every row's logits
kept) the dense pass; the tokens a verification decides are all handed out at the next
step's sampling. Its greedy reply is the one it gets alone.

Each slot keeps its own context (its KV cache and cached prefix); the batched pass borrows
the first member's buffers and threads, so the slots' contexts take every core (one pass
runs at a time) instead of a share each."""

from __future__ import annotations

import concurrent.futures
import threading

from ..model import eval_batch


class Batcher:
    """The scheduler thread. submit_job() hands it a Job whose slot the pool gave out; the
    returned future completes when the job has ended and its slot may be reused."""

    def __init__(self, prompt_chunk: int = 256):
        if prompt_chunk < 1:
            raise ValueError("--prompt-chunk must be >= 1")
        self.prompt_chunk = prompt_chunk  # tokens per batched pass (decode tokens + a chunk)
        self._cond = threading.Condition()
        self._inbox: list = []
        self._stop = False
        self.steps = 0          # batched forward passes run (each of 2 or more contexts)
        self.batched_tokens = 0  # tokens they evaluated (decode tokens and prompt chunks)
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self._thread.start()

    def submit_job(self, job) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop:
                raise RuntimeError("the server is shutting down")
            self._inbox.append((job, fut))
            self._cond.notify()
        return fut

    def close(self) -> None:
        """End every job (as cancelled) and stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    # -- the scheduler thread ---------------------------------------------------------

    def _loop(self) -> None:
        active: list = []
        while True:
            with self._cond:
                while not self._inbox and not active and not self._stop:
                    self._cond.wait()
                new, self._inbox = self._inbox, []
                stop = self._stop
            for job, fut in new:
                job.batch_future = fut
                active.append(job)
                if not job.cancel.is_set():
                    _guard(job, job.begin)
            for job in active:
                if stop:
                    job.cancel.set()
                if job.cancel.is_set() and not job.ended:
                    job.end(cancelled=True)
            active = [j for j in active if not j.ended]
            if stop and not active:
                return
            try:
                self._step(active)
            except BaseException as e:  # a bug here must not leave every client waiting
                for job in active:
                    try:
                        job.end(error=e)
                    except BaseException:
                        pass
            active = [j for j in active if not j.ended]

    def _step(self, active: list) -> None:
        for job in active:  # 2. sample where the logits are ready
            g = job.gen
            if g.prefilled and g.next_token is None and not g.done:
                _guard(job, lambda: _sample(job))
            if not job.ended and g.done and g.prefilled:  # (max_tokens 0: after its prompt)
                job.end()
        decoding = [j for j in active if not j.ended and j.gen.next_token is not None]
        groups: dict = {}  # batch key -> (jobs whose next_token joins, (job, part) pairs)
        room: dict = {}  # batch key -> tokens its pass may still take (its first's n_batch)
        alone: list = []  # (job, part) of parts with no room left in their pass
        speculative = [j for j in decoding if hasattr(j.gen, "batch_part")]
        for job in decoding:  # 3. the next tokens: together, one pass per FFN (batch key)
            if job in speculative:
                continue
            try:
                if job.gen.batchable():
                    key = job.gen.batch_key()
                    room[key] = room.setdefault(key, job.gen.ctx.n_batch) - 1
                    groups.setdefault(key, ([], []))[0].append(job)
            except BaseException as e:
                job.end(error=e)
        for job in speculative:  # a draft step or a verification: into its FFN's pass
            try:
                part = job.gen.batch_part()
                if part is None:
                    continue
                left = room.setdefault(part.key, part.ctx.n_batch)
                if part.n > left:
                    alone.append((job, part))
                    continue
                room[part.key] = left - part.n
                groups.setdefault(part.key, ([], []))[1].append((job, part))
            except BaseException as e:
                job.end(error=e)
        batch, parts = groups.pop(("dense",), ([], []))  # the pass the prompt chunk joins
        reading = next((j for j in active if not j.ended and not j.gen.prefilled), None)
        chunk = None
        if reading is not None and not decoding:
            # alone, the whole prompt at once (in n_batch passes: gh_eval)
            _guard(reading, reading.gen.prefill)
            reading = None
        elif reading is not None:
            # the oldest prompt's chunk: the rest of the pass's token budget, which the first
            # member's buffers bound (n_batch)
            first = batch[0].gen.ctx if batch else parts[0][1].ctx if parts else \
                reading.gen.ctx
            n_batch = first.n_batch
            chunk = min(self.prompt_chunk, n_batch) - len(batch) - sum(p.n for _, p in parts)
            if chunk < 1 or not (batch or parts) or any(p.logits_all for _, p in parts):
                # no room beside the decode tokens, no batchable one, or a verification in
                # the pass (which keeps every row's logits: the chunk's would cost the head
                # over all its tokens): a pass of its own
                _guard(reading, lambda: reading.gen.prefill(min(self.prompt_chunk, n_batch)))
                reading = None
        members = batch + ([reading] if reading is not None else [])
        handled = set()  # jobs whose tokens were evaluated here
        for job, part in alone:
            _guard(job, lambda: job.gen.run_part(part))
            handled.add(job)
        for members, parts, chunk in [(members, parts, chunk)] + [
                (g, p, None) for g, p in groups.values()]:
            if len(members) + len(parts) < 2:
                for job, part in parts:  # a part alone: evaluated alone
                    _guard(job, lambda: job.gen.run_part(part))
                    handled.add(job)
                continue
            try:
                self.batched_tokens += eval_batch([j.gen for j in members], chunk,
                                                  [p for _, p in parts])
                self.steps += 1
            except BaseException as e:  # a failed pass changes no context
                for job in members + [j for j, _ in parts]:
                    job.end(error=e)
            handled.update(j for j, _ in parts)
        for job in decoding:  # the rest (and a batch of one) one by one
            if job not in handled and not job.ended and job.gen.next_token is not None:
                _guard(job, job.gen.step)
        for job in decoding:  # a context that filled up ends its generation
            if not job.ended and job.gen.done:
                job.end()


def _sample(job) -> None:
    """The job's next token; a speculative generation hands out every verified token at
    once (the kept drafts are in the cache already: nothing to evaluate in between)."""
    job.sample()
    skip_cached = getattr(job.gen, "skip_cached", None)
    while skip_cached is not None and not job.ended and skip_cached():
        job.sample()


def _guard(job, fn) -> None:
    """Run one job's part of a step; an error ends that job (reported to its client) and
    the others carry on."""
    try:
        fn()
    except BaseException as e:
        job.end(error=e)
