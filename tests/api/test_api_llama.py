"""The llama-cpp-python-shaped API: Llama, OpenAI-shaped dicts, streams, threads."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from powerinfer_cpp import Llama, Model, UnsupportedArgumentError

N_CTX = 96


@pytest.fixture(scope="module")
def llm(shipped_gguf):
    with Llama(str(shipped_gguf), n_ctx=N_CTX, n_threads=2, verbose=False, seed=7) as l:
        yield l


@pytest.fixture(scope="module")
def reference(shipped_gguf):
    with Model(shipped_gguf, n_ctx=N_CTX, n_threads=2) as m:
        yield m


def test_completion_dict_equals_model_generate(llm, reference):
    out = llm("And God said", max_tokens=12, temperature=0)
    want = reference.generate("And God said", max_tokens=12, temperature=0)
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    (choice,) = out["choices"]
    assert choice == {"text": want.text, "index": 0, "logprobs": None, "finish_reason": "length"}
    n_prompt = len(reference.tokenize("And God said"))
    u = out["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (
        n_prompt, 12, n_prompt + 12)


def test_stream_chunks_join_to_the_text(llm):
    whole = llm.create_completion("In the beginning", max_tokens=10, temperature=0)
    chunks = list(llm.create_completion("In the beginning", max_tokens=10, temperature=0,
                                        stream=True))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_echo_and_max_tokens_none(llm):
    base = llm("And God said", max_tokens=20, temperature=0)["choices"][0]["text"]
    stop = base[5:9]
    out = llm("And God said", max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert out["choices"][0]["text"] == base[:5]
    assert out["choices"][0]["finish_reason"] == "stop"
    echo = llm("And God said", max_tokens=5, temperature=0, echo=True)["choices"][0]["text"]
    assert echo.startswith("And God said") and echo[len("And God said"):] == \
        llm("And God said", max_tokens=5, temperature=0)["choices"][0]["text"]
    for mt in (None, 0, -1):
        u = llm("And God said", max_tokens=mt, temperature=0)
        if u["choices"][0]["finish_reason"] == "length":
            assert u["usage"]["total_tokens"] == N_CTX


def test_chat_completion_and_stream(llm):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who made the light?"}]
    out = llm.create_chat_completion(msgs, max_tokens=12, temperature=0)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"]
    prompt = "system:\nBe brief.\nuser:\nWho made the light?\nassistant:\n"
    assert out["usage"]["prompt_tokens"] == len(llm.model.tokenize(prompt))
    chunks = list(llm.create_chat_completion(msgs, max_tokens=12, temperature=0, stream=True))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]


def test_tokenize_detokenize_bytes(llm):
    ids = llm.tokenize(b"And God said")
    assert ids[0] == llm.token_bos() and llm.detokenize(ids) == b"And God said"
    assert llm.tokenize(b"And God said", add_bos=False) == ids[1:]
    assert llm.detokenize(ids, special=True).startswith(b"<s>")
    with pytest.raises(TypeError, match="bytes"):
        llm.tokenize("text")
    assert llm.n_ctx() == N_CTX and llm.n_vocab() == 4096 and llm.token_eos() == 2


def test_seed_reproducible(llm):
    a = llm("And God said", max_tokens=10, temperature=1.0, seed=3)["choices"][0]["text"]
    b = llm("And God said", max_tokens=10, temperature=1.0, seed=3)["choices"][0]["text"]
    assert a == b


def test_unsupported_and_unknown_arguments(shipped_gguf, llm):
    with pytest.raises(UnsupportedArgumentError, match=r"logits_all=True.*flash_attn=True"):
        Llama(str(shipped_gguf), logits_all=True, flash_attn=True, verbose=False)
    with pytest.raises(TypeError, match="no_such_arg"):
        Llama(str(shipped_gguf), no_such_arg=1)
    with pytest.raises(UnsupportedArgumentError, match="chat_format"):
        Llama(str(shipped_gguf), chat_format="llama-2", verbose=False)
    with pytest.raises(UnsupportedArgumentError, match="mirostat_mode=2"):
        llm("x", mirostat_mode=2)
    with pytest.raises(UnsupportedArgumentError, match="functions"):
        llm.create_chat_completion([{"role": "user", "content": "x"}], functions=[{"name": "x"}])
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):  # tools: tests/api/test_tools.py
        llm.create_chat_completion([{"role": "user", "content": "x"}], tools=[{"type": "x"}])
    with pytest.raises(TypeError, match="unexpected"):
        llm("x", banana=1)
    with pytest.raises(TypeError):  # keywords only after the prompt: nothing misbound
        llm.create_completion("x", 5)
    # llama-cpp-python's defaults spelled out are fine
    out = llm("x", max_tokens=2, mirostat_mode=0, typical_p=1.0, logprobs=None, suffix=None)
    assert out["usage"]["completion_tokens"] == 2
    with pytest.raises(ValueError, match="exceed context window"):
        llm("And " * 200)


def test_n_gpu_layers_without_a_gpu(shipped_gguf):
    from powerinfer_cpp.model import gpu_device

    if gpu_device()[0]:
        pytest.skip("a GPU device is present")
    with pytest.warns(RuntimeWarning, match="n_gpu_layers=-1.*CPU"):
        with Llama(str(shipped_gguf), n_gpu_layers=-1, n_ctx=32, verbose=False) as l:
            assert l.model.device_info()["device"] == "cpu"


def test_logits_processor_bias_and_stopping_criteria(llm):
    base = llm("And God said", max_tokens=6, temperature=0)
    first = llm.tokenize(base["choices"][0]["text"].encode(), add_bos=False)[0]
    seen = []

    def ban_first(ids, logits):
        seen.append(len(ids))
        logits = logits.copy()
        logits[first] = -np.inf
        return logits

    out = llm("And God said", max_tokens=6, temperature=0, logits_processor=[ban_first])
    assert out["choices"][0]["text"] != base["choices"][0]["text"]
    assert seen[0] == len(llm.tokenize(b"And God said")) and seen == sorted(seen)
    biased = llm("And God said", max_tokens=3, temperature=0, logit_bias={"5": 1e4})
    assert llm.tokenize(biased["choices"][0]["text"].encode(), add_bos=False) == [5, 5, 5]
    stopped = llm("And God said", max_tokens=20, temperature=0,
                  stopping_criteria=[lambda ids, logits: len(ids) >= 8])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["prompt_tokens"] + stopped["usage"]["completion_tokens"] == 8


def test_threads_are_serialised(llm):
    prompts = ["And God said", "In the beginning", "And Jesus said unto them", "The LORD is"]
    want = {p: llm(p, max_tokens=10, temperature=0)["choices"][0]["text"] for p in prompts}
    got, errors = [], []

    def worker(i):
        try:
            for k in range(3):
                p = prompts[(i + k) % len(prompts)]
                if k == 1:  # a stream holds the Llama until it ends
                    text = "".join(c["choices"][0]["text"] for c in
                                   llm(p, max_tokens=10, temperature=0, stream=True))
                else:
                    text = llm(p, max_tokens=10, temperature=0)["choices"][0]["text"]
                got.append((p, text))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(got) == 12 and all(text == want[p] for p, text in got)


def test_same_thread_reentry_is_an_error_not_a_deadlock(llm):
    it = llm("And God said", max_tokens=8, temperature=0, stream=True)
    next(it)
    with pytest.raises(RuntimeError, match="unfinished stream"):
        llm("x", max_tokens=1)
    it.close()
    assert llm("x", max_tokens=1)["usage"]["completion_tokens"] == 1


def test_close_waits_for_the_call_in_flight(shipped_gguf):
    l = Llama(str(shipped_gguf), n_ctx=N_CTX, verbose=False)
    started, result = threading.Event(), {}

    def gen():
        try:
            for i, _ in enumerate(l("And God said", max_tokens=80, temperature=0, stream=True)):
                started.set()
            result["ok"] = i
        except RuntimeError as e:
            result["err"] = e

    t = threading.Thread(target=gen)
    t.start()
    started.wait(10)
    l.close()  # waits for the stream: it holds the Llama until it ends
    t.join(10)
    assert "ok" in result
    with pytest.raises(RuntimeError, match="closed"):
        l("x")


# -- the rest of llama-cpp-python's Llama ------------------------------------------------

# Every public method of llama-cpp-python's Llama (0.3.x), and the ones refused here.
LLAMA_CPP_PYTHON_METHODS = [
    "tokenize", "detokenize", "set_cache", "set_seed", "reset", "eval", "sample", "generate",
    "create_embedding", "embed", "create_completion", "__call__", "create_chat_completion",
    "create_chat_completion_openai_v1", "save_state", "load_state", "n_ctx", "n_embd",
    "n_vocab", "tokenizer", "token_eos", "token_bos", "token_nl", "pooling_type", "close",
    "logits_to_logprobs", "longest_token_prefix", "from_pretrained",
]
REFUSED = {"set_cache": ([object()], "KV cache")}


def test_every_llama_cpp_python_method_exists(llm):
    missing = [m for m in LLAMA_CPP_PYTHON_METHODS if not callable(getattr(llm, m, None))]
    assert not missing


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_unsupported_methods_raise_the_clear_error(llm, method):
    from powerinfer_cpp import UnsupportedFeatureError

    args, why = REFUSED[method]
    with pytest.raises(UnsupportedFeatureError,
                       match=rf"Llama\.{method}\(\): not supported by powerinfer-cpp: .*{why}") as e:
        getattr(llm, method)(*args)
    # one `except` for every refusal, and the exception Python code expects of a gap
    assert isinstance(e.value, UnsupportedArgumentError) and isinstance(e.value,
                                                                        NotImplementedError)
    with pytest.raises(NotImplementedError, match="download the .gguf"):
        Llama.from_pretrained("org/repo", "model.gguf")
    llm.set_cache(None)  # no cache: nothing to refuse


def test_eval_sample_generate_equal_the_completion(llm, reference):
    prompt = llm.tokenize(b"And God said")
    want = reference.generate("And God said", max_tokens=10, temperature=0).tokens
    llm.reset()
    assert llm.n_tokens == 0 and len(llm.eval_logits) == 0
    llm.eval(prompt)
    assert llm.n_tokens == len(prompt) and llm.input_ids.tolist() == prompt
    assert list(llm.eval_tokens) == prompt and len(llm.eval_logits[0]) == llm.n_vocab()
    assert llm.sample(temp=0) == want[0]
    llm.eval([want[0]])
    assert llm.sample(temp=0) == want[1] and llm.n_tokens == len(prompt) + 1

    got = []
    for tok in llm.generate(prompt, temp=0):
        got.append(tok)
        if len(got) == len(want):
            break
    assert got == want
    # the context holds the prompt and what was evaluated after it; reset=True reuses it
    assert llm.input_ids.tolist() == prompt + want[:-1]
    assert next(llm.generate(prompt + want[:3], temp=0)) == want[3]
    # stopping_criteria end the generator
    stop_at_3 = lambda ids, logits: len(ids) >= len(prompt) + 3  # noqa: E731
    assert list(llm.generate(prompt, temp=0, stopping_criteria=[stop_at_3])) == want[:3]
    with pytest.raises(UnsupportedArgumentError, match="mirostat_mode=2"):
        llm.generate(prompt, mirostat_mode=2)
    llm("And God said", max_tokens=2)  # a completion changes the cache: no stale logits
    with pytest.raises(RuntimeError, match="eval"):
        llm.sample()


def test_generate_send_and_no_reset(llm, reference):
    prompt = llm.tokenize(b"And God said")
    extra = llm.tokenize(b" unto", add_bos=False)
    gen = llm.generate(prompt, temp=0)
    first = next(gen)
    second = gen.send(extra)  # evaluated after `first`, then sampled
    gen.close()
    want = reference.generate(prompt + [first] + extra, max_tokens=1, temperature=0).tokens
    assert second == want[0]
    # reset=False: the tokens go after what the context holds
    llm.reset()
    llm.eval(prompt[:2])
    tok = next(llm.generate(prompt[2:], temp=0, reset=False))
    assert tok == reference.generate(prompt, max_tokens=1, temperature=0).tokens[0]


def test_small_methods(llm, shipped_gguf):
    import pickle

    assert llm.n_embd() == llm.model.info.n_embd
    nl = llm.token_nl()
    assert llm.detokenize([nl]) == b"\n"
    tok = llm.tokenizer()
    ids = tok.encode("And God said")
    assert ids == llm.tokenize(b"And God said") and tok.decode(ids) == "And God said"
    assert Llama.longest_token_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert Llama.longest_token_prefix([], [1]) == 0
    x = np.array([[1.0, 2.0, 3.0], [-np.inf, 0.0, 1.0]], dtype=np.float32)  # a masked logit
    lp = Llama.logits_to_logprobs(x)
    row = x[0].astype(np.float64)
    assert np.allclose(lp[0], row - row.max() - np.log(np.exp(row - row.max()).sum()))
    assert lp.dtype == np.float32 and lp[1, 0] == -np.inf
    llm.set_seed(11)
    a = llm("And God said", max_tokens=8, temperature=1.0)["choices"][0]["text"]
    llm.set_seed(11)
    assert llm("And God said", max_tokens=8, temperature=1.0)["choices"][0]["text"] == a
    with pickle.loads(pickle.dumps(llm)) as copy:
        assert copy.n_ctx() == llm.n_ctx() and copy.model_path == llm.model_path


def test_create_chat_completion_openai_v1(llm):
    openai_types = pytest.importorskip("openai.types.chat")
    msgs = [{"role": "user", "content": "Who made the light?"}]
    out = llm.create_chat_completion_openai_v1(msgs, max_tokens=6, temperature=0)
    assert isinstance(out, openai_types.ChatCompletion)
    assert out.choices[0].message.content == \
        llm.create_chat_completion(msgs, max_tokens=6, temperature=0)["choices"][0]["message"][
            "content"]
    chunks = list(llm.create_chat_completion_openai_v1(msgs, max_tokens=6, temperature=0,
                                                       stream=True))
    assert all(isinstance(c, openai_types.ChatCompletionChunk) for c in chunks)
