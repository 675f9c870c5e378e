"""The Python API: generation, streaming, sampling, contexts, and bad input."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from powerinfer_cpp import Model, NativeError


@pytest.fixture(scope="module")
def model(shipped_gguf):
    with Model(shipped_gguf, n_ctx=256, n_threads=2) as m:
        yield m


def test_info_and_tokens(model):
    info = model.info
    assert info.arch == "llama" and info.ffn_act == "relu" and info.act_from_file
    assert info.n_head_kv < info.n_head  # the shipped model uses GQA
    ids = model.tokenize("In the beginning God created the heaven and the earth.")
    assert ids[0] == info.bos_id
    assert model.detokenize(ids) == "In the beginning God created the heaven and the earth."


def test_greedy_is_deterministic_and_stream_matches(model):
    a = model.generate("And God said", max_tokens=24, temperature=0)
    b = model.generate("And God said", max_tokens=24, temperature=0)
    assert a.tokens == b.tokens and len(a.tokens) > 0
    pieces = list(model.stream("And God said", max_tokens=24, temperature=0))
    assert "".join(pieces) == a.text
    assert a.text == model.detokenize(a.tokens)
    assert a.finish_reason in ("stop", "length")
    assert a.timings["prompt_tokens"] == a.n_prompt_tokens > 0


def test_seeded_sampling_is_reproducible(model):
    kw = dict(max_tokens=32, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    a = model.generate("In the beginning", seed=42, **kw)
    b = model.generate("In the beginning", seed=42, **kw)
    c = model.generate("In the beginning", seed=43, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_top_k_one_is_greedy(model):
    greedy = model.generate("The LORD", max_tokens=16, temperature=0, ignore_eos=True)
    topk1 = model.generate("The LORD", max_tokens=16, temperature=1.5, top_k=1, seed=9,
                           ignore_eos=True)
    assert greedy.tokens == topk1.tokens


def test_repeat_penalty_changes_output(model):
    plain = model.generate("and and and and", max_tokens=24, temperature=0, ignore_eos=True)
    pen = model.generate("and and and and", max_tokens=24, temperature=0, ignore_eos=True,
                         repeat_penalty=1.8)
    assert plain.tokens != pen.tokens


def test_stop_string_and_max_tokens(model):
    full = model.generate("And God said", max_tokens=40, temperature=0, ignore_eos=True)
    assert full.finish_reason == "length" and len(full.tokens) == 40
    # stop at the second word of the greedy continuation
    words = full.text.split()
    assert len(words) >= 3
    stop = words[1]
    out = model.generate("And God said", max_tokens=40, temperature=0, stop=[stop])
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert full.text.startswith(out.text)
    assert "".join(model.stream("And God said", max_tokens=40, temperature=0, stop=[stop])) == out.text


def test_perplexity_matches_transformers(model, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from conftest import SHIPPED_DIR

    text = (SHIPPED_DIR / "heldout.txt").read_text(encoding="utf-8")[:3000]
    ppl = model.perplexity(text)
    ids = model.tokenize(text)
    ref = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_DIR, torch_dtype=torch.float32)
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, model.context.n_ctx):
            w = ids[s:s + model.context.n_ctx]
            if len(w) < 2:
                break
            logp = torch.log_softmax(ref(torch.tensor([w])).logits[0].double(), -1)
            nll -= logp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum().item()
            n += len(w) - 1
    want = float(np.exp(nll / n))
    assert abs(ppl - want) / want < 2e-3, (ppl, want)


def test_contexts_share_a_model(model):
    a = model.create_context(n_ctx=64)
    b = model.create_context(n_ctx=64)
    ids = model.tokenize("Let there be light")
    la = a.eval(ids)
    b.eval(model.tokenize("and there was light"))
    lb = b.eval(ids[1:2])  # b's cache differs, so b's logits differ
    assert not np.allclose(la, lb)
    a.reset()
    np.testing.assert_allclose(a.eval(ids), la, rtol=0, atol=1e-6)
    assert a.n_past == len(ids)
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.eval(ids)


def test_closing_model_closes_its_contexts(shipped_gguf):
    m = Model(shipped_gguf, n_ctx=32)
    ctx = m.create_context()
    m.close()
    with pytest.raises(RuntimeError, match="closed"):
        ctx.eval([1, 2])
    with pytest.raises(RuntimeError, match="closed"):
        m.create_context()


# ---- bad input -----------------------------------------------------------------


def test_token_out_of_range(model):
    ctx = model.create_context(n_ctx=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ctx.eval([1, model.n_vocab])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ctx.eval([-1])
    assert ctx.n_past == 0  # nothing was appended


def test_prompt_longer_than_context(model):
    ctx = model.create_context(n_ctx=8)
    with pytest.raises(ValueError, match="context holds only 8"):
        ctx.generate("In the beginning God created the heaven and the earth. " * 3)
    with pytest.raises(ValueError, match="context full"):
        ctx.eval(list(range(1, 10)))
    ctx.eval(list(range(1, 9)))
    with pytest.raises(ValueError, match="context full"):
        ctx.eval([1])


def test_generation_stops_when_context_is_full(model):
    ctx = model.create_context(n_ctx=12)
    out = ctx.generate([1, 5, 7], max_tokens=100, temperature=0, ignore_eos=True)
    assert out.finish_reason == "length"
    assert len(out.tokens) == 12 - 3 + 1  # the last sampled token needs no cache slot


@pytest.mark.parametrize("n", [-1, 100000])
def test_bad_thread_count(model, n):
    with pytest.raises(ValueError, match="n_threads"):
        model.create_context(n_threads=n)


def test_bad_sampling_params(model):
    with pytest.raises(ValueError, match="temperature"):
        model.generate("x", temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate("x", top_p=0)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Model(tmp_path / "nope.gguf")
    with pytest.raises(IsADirectoryError):
        Model(tmp_path)


def _corrupt(src, dst, mutate):
    data = bytearray(open(src, "rb").read())
    data = mutate(data)
    with open(dst, "wb") as fh:
        fh.write(data)
    return dst


def test_truncated_file(random_gguf, tmp_path):
    size = os.path.getsize(random_gguf)
    for cut in (0, 3, 24, 200, size // 2, size - 1):
        p = _corrupt(random_gguf, tmp_path / f"cut{cut}.gguf", lambda d: d[:cut])
        with pytest.raises(NativeError) as e:
            Model(p)
        assert str(p) in str(e.value) or "empty" in str(e.value) or "truncated" in str(e.value)


def test_wrong_magic(random_gguf, tmp_path):
    p = _corrupt(random_gguf, tmp_path / "magic.gguf", lambda d: b"GGML" + d[4:])
    with pytest.raises(NativeError, match="(?i)magic|not a GGUF"):
        Model(p)


def _one_tensor_gguf(path, arch: str):
    """A GGUF of architecture `arch` holding only a 4x8 f32 token_embd.weight."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_absurd_dimensions_and_data_past_end(tmp_path):
    path = _one_tensor_gguf(tmp_path / "absurd.gguf", "llama")
    data = bytearray(path.read_bytes())
    # token_embd.weight's dims follow its name; make them absurd (2^40 x 2^40)
    name = b"token_embd.weight"
    i = data.index(name) + len(name)
    assert struct.unpack_from("<I", data, i)[0] == 2
    struct.pack_into("<QQ", data, i + 4, 1 << 40, 1 << 40)
    path.write_bytes(data)
    with pytest.raises(NativeError):
        Model(path)
    # plausible dims whose data would lie past the end of the file
    struct.pack_into("<QQ", data, i + 4, 8, 4096)
    path.write_bytes(data)
    with pytest.raises(NativeError, match="(?i)past|beyond|end of|outside|exceeds"):
        Model(path)


def test_unknown_architecture(tmp_path):
    path = _one_tensor_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(NativeError, match="unsupported architecture 'gpt2'"):
        Model(path)


def test_missing_tensor_and_wrong_shape(random_gguf, tmp_path):
    pytest.importorskip("gguf")
    from gguf_rewrite import rewrite_gguf

    with pytest.raises(NativeError, match="missing tensor 'blk.1.ffn_up.weight'"):
        Model(rewrite_gguf(random_gguf, tmp_path / "drop.gguf", drop=["blk.1.ffn_up.weight"]))
    with pytest.raises(NativeError, match="blk.0.attn_k.weight.*expected"):
        Model(rewrite_gguf(random_gguf, tmp_path / "shape.gguf",
                           tensors={"blk.0.attn_k.weight": lambda a: a[:-1]}))
