"""Thread safety of the public API, KV prefix reuse and the logits-processor hook.

Regression tests for two defects found by trying the API as a server would: closing a
Model while another thread generates (was a segfault), and one Context used by two
threads (was wrong logits with no error).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from powerinfer_cpp import Model
from powerinfer_cpp._native import NativeBusyError, check, ffi, lib

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"


@pytest.fixture(scope="module")
def model(shipped_gguf):
    with Model(shipped_gguf, n_ctx=256, n_threads=2) as m:
        yield m


def _run_threads(fns):
    errors: list[BaseException] = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    return errors


@pytest.mark.parametrize("run", range(3))
def test_close_while_another_thread_generates(shipped_gguf, run):
    m = Model(shipped_gguf, n_ctx=256, n_threads=1)
    started = threading.Event()
    outcome: dict = {}

    def generate():
        try:
            for i, _ in enumerate(m.stream(PROMPT, max_tokens=200, temperature=0,
                                           ignore_eos=True)):
                if i == 2:
                    started.set()
            outcome["finished"] = True
        except RuntimeError as e:
            outcome["error"] = str(e)
        finally:
            started.set()

    t = threading.Thread(target=generate)
    t.start()
    started.wait(60)
    m.close()   # waits for the token in flight, then frees
    t.join(60)
    assert not t.is_alive()
    # either the stream got through before the close, or it was stopped with a clear error
    assert outcome.get("finished") or "closed" in outcome.get("error", ""), outcome
    with pytest.raises(RuntimeError, match="closed"):
        m.generate(PROMPT, max_tokens=2)


def test_close_context_while_eval_runs_elsewhere(shipped_gguf):
    m = Model(shipped_gguf, n_ctx=256, n_threads=1)
    ctx = m.create_context(n_ctx=256)
    ids = m.tokenize(PROMPT * 3)[:250]
    done = threading.Event()
    results: list = []

    def evaluate():
        for _ in range(20):
            try:
                ctx.reset()
                results.append(ctx.eval(ids))
            except RuntimeError as e:
                results.append(e)
                break
        done.set()

    t = threading.Thread(target=evaluate)
    t.start()
    ctx.close()
    done.wait(60)
    t.join(60)
    m.close()
    assert all(isinstance(r, np.ndarray) or "closed" in str(r) for r in results)


def test_one_context_two_threads_never_gives_wrong_logits(model):
    ctx = model.create_context(n_ctx=256)
    prompts = [model.tokenize(PROMPT), model.tokenize("And God said, Let there be light")]
    want = []
    for ids in prompts:
        ctx.reset()
        want.append(ctx.eval(ids))
    ok = [0, 0]
    refused = [0, 0]

    def worker(k):
        def run():
            for _ in range(40):
                try:
                    ctx.reset()
                    got = ctx.eval(prompts[k])
                except RuntimeError as e:
                    assert "another thread" in str(e)
                    refused[k] += 1
                    continue
                np.testing.assert_allclose(got, want[k], rtol=1e-5, atol=1e-5)
                ok[k] += 1
        return run

    errors = _run_threads([worker(0), worker(1)])
    assert not errors, errors
    assert sum(ok) > 0
    assert sum(ok) + sum(refused) == 80
    ctx.close()


def test_native_context_refuses_a_second_thread(model):
    """A C caller sharing one gh_context between threads gets GH_ERR_BUSY, not corruption."""
    ctx = model.create_context(n_ctx=256)
    ids = np.array(model.tokenize(PROMPT * 4)[:240], dtype=np.int32)
    with ctx._calling() as ptr:
        ref_ptr = ptr
    want = None
    busy_seen = 0
    for _ in range(50):
        status: list[int] = []

        def long_eval():
            lib.gh_context_truncate(ref_ptr, 0)
            status.append(lib.gh_eval(ref_ptr, ffi.from_buffer("int32_t[]", ids), ids.size, 0))

        t = threading.Thread(target=long_eval)
        t.start()
        while t.is_alive():
            st = lib.gh_context_reset_stats(ref_ptr)
            if st == lib.GH_ERR_BUSY:
                busy_seen += 1
                assert "another thread" in ffi.string(lib.gh_last_error()).decode()
            else:
                assert st == lib.GH_OK
        t.join()
        assert status in ([lib.GH_OK], [lib.GH_ERR_BUSY])
        if status == [lib.GH_OK]:
            got = np.frombuffer(ffi.buffer(lib.gh_get_logits(ref_ptr, -1),
                                           model.n_vocab * 4), np.float32).copy()
            if want is None:
                want = got
            np.testing.assert_array_equal(got, want)
        if busy_seen:
            break
    assert busy_seen > 0
    with pytest.raises(NativeBusyError):
        # the Python exception class of GH_ERR_BUSY
        check(lib.GH_ERR_BUSY)
    ctx.close()


def test_contexts_on_threads_match_sequential(model):
    prompts = ["And God said", "In the beginning", "The LORD is my", "And it came to pass"]
    want = [model.generate(p, max_tokens=20, temperature=0, ignore_eos=True).tokens
            for p in prompts]
    got: dict[int, list[int]] = {}

    def worker(i):
        def run():
            ctx = model.create_context(n_ctx=128, n_threads=1)
            for _ in range(2):
                got[i] = ctx.generate(prompts[i], max_tokens=20, temperature=0,
                                      ignore_eos=True).tokens
            ctx.close()
        return run

    errors = _run_threads([worker(i) for i in range(len(prompts))])
    assert not errors, errors
    assert [got[i] for i in range(len(prompts))] == want


def test_prefix_reuse_evaluates_only_new_tokens(model):
    ctx = model.create_context(n_ctx=256, ffn="dense")
    first = ctx.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    n_prompt = first.n_prompt_tokens
    assert first.n_cached_tokens == 0
    # the same prompt again: everything but the last prompt token comes from the cache
    ctx.reset_stats()
    again = ctx.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert again.n_cached_tokens == n_prompt - 1
    assert again.tokens == first.tokens
    assert ctx.stats()["n_tokens"] == 1 + len(again.tokens) - 1
    # a follow-up turn: the previous prompt + reply is kept, only the new text is evaluated
    history = model.tokenize(PROMPT) + again.tokens
    follow = history + model.tokenize(" and the Spirit of God", add_bos=False)
    ctx.reset_stats()
    turn = ctx.generate(follow, max_tokens=6, temperature=0, ignore_eos=True)
    cached_tail = len(ctx.cached_tokens)
    assert turn.n_cached_tokens == len(history) - 1  # the last reply token was never evaluated
    n_new = len(follow) - turn.n_cached_tokens
    assert ctx.stats()["n_tokens"] == n_new + len(turn.tokens) - 1
    assert cached_tail == len(follow) + len(turn.tokens) - 1
    # the same turn on a fresh context (no reuse): the same greedy reply, the same logits
    fresh = model.create_context(n_ctx=256, ffn="dense")
    assert fresh.generate(follow, max_tokens=6, temperature=0,
                          ignore_eos=True).tokens == turn.tokens
    fresh.reset()
    ctx.reset(len(follow) - 1)
    np.testing.assert_allclose(ctx.eval(follow[-1:]), fresh.eval(follow),
                               rtol=1e-3, atol=1e-3)
    # a different prompt keeps only the common prefix (BOS + shared words)
    other = ctx.generate("In the beginning was the Word", max_tokens=2, temperature=0)
    assert 0 < other.n_cached_tokens < n_prompt
    ctx.close()
    fresh.close()


def test_eval_after_another_threads_change_is_refused_until_reset(model):
    ctx = model.create_context(n_ctx=128)
    ids = model.tokenize(PROMPT)
    ctx.eval(ids[:4])
    t = threading.Thread(target=lambda: ctx.reset())
    t.start()
    t.join()
    with pytest.raises(RuntimeError, match="another thread"):
        ctx.eval(ids[4:8])
    ctx.reset()
    assert ctx.eval(ids[:4]).shape == (model.n_vocab,)
    ctx.close()


def test_logits_processor(model):
    base = model.generate(PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    seen_ids = []

    def ban_greedy(ids, logits):
        assert logits.dtype == np.float32 and logits.shape == (model.n_vocab,)
        seen_ids.append(list(ids))
        logits[base.tokens[0]] = -np.inf
        return logits

    banned = model.generate(PROMPT, max_tokens=10, temperature=0, ignore_eos=True,
                            logits_processor=ban_greedy)
    assert base.tokens[0] not in banned.tokens
    assert seen_ids[0] == model.tokenize(PROMPT)
    assert seen_ids[1] == model.tokenize(PROMPT) + banned.tokens[:1]
    forced = 7

    def force(ids, logits):
        out = np.full_like(logits, -1e9)
        out[forced] = 0.0
        return out

    got = model.generate(PROMPT, max_tokens=5, temperature=0.9, seed=3, ignore_eos=True,
                         logits_processor=force)
    assert got.tokens == [forced] * 5
    with pytest.raises(ValueError, match="shape"):
        model.generate(PROMPT, max_tokens=2, logits_processor=lambda ids, lg: lg[:10])
    with pytest.raises(TypeError, match="callable"):
        model.generate(PROMPT, max_tokens=2, logits_processor=5)


def test_max_tokens_none_runs_to_the_context(model):
    ctx = model.create_context(n_ctx=48)
    r = ctx.generate(PROMPT, max_tokens=None, temperature=0, ignore_eos=True)
    assert r.finish_reason == "length"
    assert r.n_prompt_tokens + len(r.tokens) == 48 + 1  # the last token is never evaluated
    assert ctx.n_past == 48
    ctx.close()


def test_prefix_reuse_on_a_sparse_model_gives_fresh_context_replies(shipped_sparse):
    """Tokens decoded by the sparse FFN are not reused: the next turn's reply equals a
    fresh context's, and only the exact (prompt) prefix comes from the cache."""
    with Model(shipped_sparse["sparse"], n_ctx=256, n_threads=1) as m:
        ctx = m.create_context()
        assert ctx.ffn_mode == "sparse"
        first = ctx.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
        n_prompt = first.n_prompt_tokens
        follow = m.tokenize(PROMPT) + first.tokens + m.tokenize(" and he said", add_bos=False)
        ctx.reset_stats()
        turn = ctx.generate(follow, max_tokens=12, temperature=0, ignore_eos=True)
        assert turn.n_cached_tokens == n_prompt  # the prompt, not the sparse-decoded reply
        st = ctx.stats()
        assert st["n_sparse_tokens"] == len(turn.tokens) - 1  # the prompt ran dense
        fresh = m.create_context()
        assert fresh.generate(follow, max_tokens=12, temperature=0,
                              ignore_eos=True).tokens == turn.tokens
        # a short prompt (<= the sparse batch limit) also runs dense
        fresh.reset_stats()
        fresh.generate(m.tokenize(PROMPT)[:3], max_tokens=1, temperature=0)
        assert fresh.stats()["n_sparse_tokens"] == 0


def test_idle_contexts_use_no_cpu(model):
    """Idle thread pools sleep (issue 29): a worker spins at most ~1 ms of wall time after
    a job before it blocks, so contexts that hold threads but have no work cost no CPU.
    The old pools spun 0.5-0.7 s of CPU per worker after every burst of work. A CPU-time
    bound, not a speed test: process CPU (every thread) over 1 s of idling."""
    import time

    ctxs = [model.create_context(n_ctx=64, n_threads=2) for _ in range(4)]
    try:
        for c in ctxs:
            c.generate(PROMPT, max_tokens=4, temperature=0)
        time.sleep(0.05)  # far past the spin bound
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(1.0)
        used, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        assert used < 0.1, f"4 idle contexts used {used:.3f} s of CPU in {wall:.2f} s"
        # and they still run after sleeping
        assert len(ctxs[0].generate(PROMPT, max_tokens=3, temperature=0).tokens) >= 1
    finally:
        for c in ctxs:
            c.close()
