"""Model-level bad input through the Python API: files whose tensors or keys do not fit
the declared hyper-parameters, NaN/Inf weights (a warning, not an error), context and
batch limits, token ids, thread counts, and contexts used after their model was closed.
Every case must give a clear Python exception (or warning), never a crash.

Complements tests/api/test_api.py (truncated files, bad magic, absurd dimensions, unknown
architecture, one missing tensor and one wrong shape, out-of-range tokens in eval,
context overflow, bad n_threads for create_context)."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

from powerinfer_cpp import Context, Model, NativeError
from powerinfer_cpp import format as F

gguf = pytest.importorskip("gguf")
from gguf_rewrite import rewrite_gguf  # noqa: E402

VT = gguf.GGUFValueType
# The random_gguf fixture (conftest): relu LLaMA, n_layer=2, n_embd=64, n_head=4,
# n_head_kv=2, n_ff=128, vocab 384, tied head, f32.
D, N_FF, N_VOCAB = 64, 128, 384


@pytest.fixture(scope="module")
def model(random_gguf):
    with Model(random_gguf, n_ctx=64, n_threads=2) as m:
        yield m


def _load(src, dst, **changes) -> Model:
    return Model(rewrite_gguf(src, dst, **changes))


# ---- tensors that do not fit the hyper-parameters ------------------------------


@pytest.mark.parametrize("name, change, match", [
    ("token_embd.weight", lambda a: a[:, :-1], r"token_embd\.weight.*expected \[64, 384\]"),
    ("blk.1.ffn_gate.weight", lambda a: a[:-1], r"blk\.1\.ffn_gate\.weight.*expected \[64, 128\]"),
    ("blk.0.ffn_down.weight", lambda a: a[:, :-1], r"blk\.0\.ffn_down\.weight.*expected \[128, 64\]"),
    ("blk.0.attn_q.weight", lambda a: a.reshape(2, 32, 64), r"blk\.0\.attn_q\.weight.*\[64, 32, 2, 1\]"),
    ("blk.0.attn_output.weight", lambda a: a.T[:, :32].copy(), r"blk\.0\.attn_output\.weight"),
    ("blk.0.attn_norm.weight", lambda a: a[:-1], r"blk\.0\.attn_norm\.weight.*expected \[64\]"),
    ("output_norm.weight", lambda a: np.stack([a, a]), r"output_norm\.weight.*expected \[64\]"),
])
def test_tensor_shape_does_not_fit(random_gguf, tmp_path, name, change, match):
    with pytest.raises(NativeError, match=match) as e:
        _load(random_gguf, tmp_path / "bad.gguf", tensors={name: change})
    assert "bad.gguf" in str(e.value)  # the message names the file


def test_vocabulary_smaller_than_tokenizer(random_gguf, tmp_path):
    # One embedding row fewer is a consistent model of 383 tokens, but the file says 384
    # (llama.vocab_size) and its tokenizer has 384: token 383 would index past the
    # embedding. Refused natively by the key, and by the token list without it.
    cut = {"token_embd.weight": lambda a: a[:-1]}
    with pytest.raises(NativeError, match="key 'llama.vocab_size' = 384 but token_embd.weight "
                                          "has 383 rows"):
        _load(random_gguf, tmp_path / "vocab.gguf", tensors=cut)
    with pytest.raises(NativeError, match="key 'tokenizer.ggml.tokens' has 384 tokens but "
                                          "token_embd.weight has only 383 rows"):
        _load(random_gguf, tmp_path / "tokens.gguf", tensors=cut, drop_kv=["llama.vocab_size"])


@pytest.mark.parametrize("name", ["token_embd.weight", "output_norm.weight",
                                  "blk.0.attn_norm.weight", "blk.1.ffn_down.weight",
                                  "blk.1.attn_v.weight"])
def test_missing_tensor(random_gguf, tmp_path, name):
    with pytest.raises(NativeError, match=f"missing tensor '{name}'"):
        _load(random_gguf, tmp_path / "drop.gguf", drop=[name])


# ---- keys: wrong types, missing, values that contradict the tensors --------------


@pytest.mark.parametrize("kv, match", [
    ({"llama.block_count": ("2", VT.STRING)},
     "key 'llama.block_count': expected an unsigned integer, found string"),
    ({"llama.embedding_length": (64.0, VT.FLOAT32)},
     "key 'llama.embedding_length': expected an unsigned integer, found float32"),
    ({"llama.attention.head_count": (-4, VT.INT32)},
     "key 'llama.attention.head_count': value out of range"),
    ({"llama.attention.layer_norm_rms_epsilon": ("small", VT.STRING)},
     "layer_norm_rms_epsilon': expected a number"),
    ({"llama.block_count": (0, VT.UINT32)},
     r"key 'llama.block_count' = 0 is out of range \(must be 1 to 4096\)"),
    ({"llama.embedding_length": (1 << 31, VT.UINT32)},
     "key 'llama.embedding_length' = 2147483648 is out of range"),
    ({"llama.context_length": (0, VT.UINT32)}, "key 'llama.context_length' = 0 is out of range"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), VT.FLOAT32)}, "bad norm epsilon"),
    ({"llama.rope.freq_base": (float("inf"), VT.FLOAT32)}, "rope base"),
    # more layers than the file holds
    ({"llama.block_count": (3, VT.UINT32)},
     r"key 'llama.block_count' = 3 but the file has no tensors of layer 2 \(blk\.2\.\*\)"),
    # a different n_ff than the FFN tensors have
    ({"llama.feed_forward_length": (129, VT.UINT32)},
     r"blk\.0\.ffn_gate\.weight.*expected \[64, 129\].*llama.feed_forward_length = 129"),
    # n_head that divides n_embd but gives another head size: the rotary size, then the
    # Q/K shapes disagree
    ({"llama.attention.head_count": (8, VT.UINT32)},
     r"partial rotary embeddings \(llama.rope.dimension_count = 16 of 8 head dims\)"),
    ({"llama.attention.head_count": (8, VT.UINT32), "llama.rope.dimension_count": (8, VT.UINT32)},
     r"blk\.0\.attn_[qk]\.weight.*expected.*llama.attention.head_count = 8 and head_count_kv = 2 "
     r"of head size 8"),
    # n_head not dividing n_embd, no explicit head size
    ({"llama.attention.head_count": (5, VT.UINT32), "llama.attention.head_count_kv": (5, VT.UINT32)},
     "llama.embedding_length = 64 is not divisible by llama.attention.head_count = 5"),
    # n_head_kv not dividing n_head
    ({"llama.attention.head_count_kv": (3, VT.UINT32)},
     "key 'llama.attention.head_count_kv' = 3 does not divide llama.attention.head_count = 4"),
    ({"llama.attention.key_length": (15, VT.UINT32)}, "unsupported head size 15"),
    ({"powerinfer.ffn_activation": ("swish2", VT.STRING)}, "unknown FFN activation 'swish2'"),
])
def test_bad_key(random_gguf, tmp_path, kv, match):
    with pytest.raises(NativeError, match=match):
        _load(random_gguf, tmp_path / "key.gguf", kv=kv)


# ---- files that lie: every count and size key bounded and checked against the tensors ----


@pytest.mark.parametrize("kv, match", [
    # fewer layers than the file holds: was loaded silently as a smaller model
    ({"llama.block_count": (1, VT.UINT32)},
     r"key 'llama.block_count' = 1 but the file has tensor 'blk\.1\..*' of layer 1"),
    ({"llama.block_count": (5000, VT.UINT32)}, "key 'llama.block_count' = 5000 is out of range"),
    ({"llama.block_count": (1 << 32, VT.UINT64)},
     "key 'llama.block_count': value out of range for uint32"),
    ({"llama.embedding_length": (0, VT.UINT32)}, "key 'llama.embedding_length' = 0 is out of range"),
    ({"llama.feed_forward_length": (0, VT.UINT32)},
     "key 'llama.feed_forward_length' = 0 is out of range"),
    ({"llama.feed_forward_length": ((1 << 24) + 1, VT.UINT32)},
     "key 'llama.feed_forward_length' = 16777217 is out of range"),
    ({"llama.attention.head_count": (0, VT.UINT32)},
     "key 'llama.attention.head_count' = 0 is out of range"),
    ({"llama.attention.head_count": (1 << 31, VT.UINT32)},
     "key 'llama.attention.head_count' = 2147483648 is out of range"),
    ({"llama.attention.head_count_kv": (0, VT.UINT32)},
     "key 'llama.attention.head_count_kv' = 0 is out of range"),
    ({"llama.attention.head_count_kv": (8, VT.UINT32)},
     r"key 'llama.attention.head_count_kv' = 8 is out of range \(must be 1 to 4\)"),
    ({"llama.context_length": (1 << 32, VT.UINT64)},
     "key 'llama.context_length': value out of range for uint32"),
    ({"llama.context_length": (-1, VT.INT32)}, "key 'llama.context_length': value out of range"),
    # a head size that keeps q's rows (8 heads of 8 = 64) but not k's (2 kv heads of 8)
    ({"llama.attention.head_count": (8, VT.UINT32), "llama.attention.key_length": (8, VT.UINT32),
      "llama.rope.dimension_count": (8, VT.UINT32)},
     r"blk\.0\.attn_k\.weight.*expected \[64, 16\].*head_count_kv = 2 of head size 8"),
    ({"llama.attention.key_length": (0, VT.UINT32)}, "unsupported head size 0"),
    ({"llama.attention.key_length": (4096, VT.UINT32)}, "unsupported head size 4096"),
    ({"llama.attention.value_length": (8, VT.UINT32)}, r"unsupported head size 16 \(value size 8"),
    ({"llama.rope.dimension_count": (1 << 31, VT.UINT32)},
     r"llama.rope.dimension_count = 2147483648 of 16 head dims"),
    ({"llama.vocab_size": (385, VT.UINT32)},
     "key 'llama.vocab_size' = 385 but token_embd.weight has 384 rows"),
    ({"llama.vocab_size": (1 << 31, VT.UINT32)},
     "key 'llama.vocab_size' = 2147483648 but token_embd.weight has 384 rows"),
    ({"tokenizer.ggml.eos_token_id": (384, VT.UINT32)},
     "key 'tokenizer.ggml.eos_token_id' = 384 is outside the vocabulary: token_embd.weight has 384 rows"),
    ({"tokenizer.ggml.bos_token_id": (1 << 31, VT.UINT32)},
     "key 'tokenizer.ggml.bos_token_id' = 2147483648 is outside the vocabulary"),
    ({"tokenizer.ggml.bos_token_id": ("1", VT.STRING)},
     "key 'tokenizer.ggml.bos_token_id': expected an integer token id, found string"),
    # experts (Mixtral is a llama file with them): the keys they need, and their tensors in
    # place of the dense FFN's
    ({"llama.expert_count": (8, VT.UINT32)}, "missing required key 'llama.expert_used_count'"),
    ({"llama.expert_count": (8, VT.UINT32), "llama.expert_used_count": (9, VT.UINT32)},
     r"key 'llama.expert_used_count' = 9 is out of range \(must be 1 to 8\)"),
    ({"llama.expert_count": (8, VT.UINT32), "llama.expert_used_count": (2, VT.UINT32)},
     r"tensor 'blk\.0\.ffn_gate\.weight' in a mixture-of-experts layer \(llama.expert_count = 8\)"),
])
def test_lying_key_is_refused_by_name(random_gguf, tmp_path, kv, match):
    with pytest.raises(NativeError, match=match) as e:
        _load(random_gguf, tmp_path / "lie.gguf", kv=kv)
    assert "lie.gguf" in str(e.value)


@pytest.mark.parametrize("n_ctx_train", [1 << 31, (1 << 32) - 1])
def test_huge_context_length_loads_and_allocates_what_is_asked(random_gguf, tmp_path, n_ctx_train):
    """A context_length past INT32_MAX is legal in the file (a u32): it loads, is reported
    saturated at INT32_MAX, never negative; a context of the size asked for works, and the
    default (the training context) is refused by name instead of allocating -2^31 tokens."""
    with _load(random_gguf, tmp_path / "long.gguf",
               kv={"llama.context_length": (n_ctx_train, VT.UINT32)}) as m:
        assert m.info.n_ctx_train == (1 << 31) - 1
        ctx = m.create_context(n_ctx=64)
        assert ctx.n_ctx == 64
        assert ctx.eval([1, 2, 3]).shape == (N_VOCAB,)
        assert len(ctx.generate([1, 2], max_tokens=3, temperature=0).tokens) <= 3
        with pytest.raises(ValueError, match=r"n_ctx = 0 asks for the model's training context "
                           r"\(llama.context_length = 2147483647 or more tokens\), more than the "
                           r"1048576 a context can hold: pass a smaller n_ctx"):
            m.create_context()


def test_block_count_checked_against_the_gpu_index_side_file(random_gguf, tmp_path):
    """A GPU index side file (<model>.generated.gpuidx) with a layer the model does not
    have was made for another model: refused by name."""
    import shutil

    path = tmp_path / "m.gguf"
    shutil.copy(random_gguf, path)
    w = gguf.GGUFWriter(str(path) + ".generated.gpuidx", "generic.gpu_index")
    for il in range(3):
        w.add_tensor(f"blk.{il}.gpu_idx", np.zeros(N_FF, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NativeError, match=r"key 'llama.block_count' = 2 but its GPU index file "
                                          r"has tensor 'blk\.2\.gpu_idx' of layer 2"):
        Model(path)


def test_legal_file_still_loads_with_every_key_checked(random_gguf):
    with Model(random_gguf) as m:
        i = m.info
        assert (i.n_layer, i.n_embd, i.n_head, i.n_head_kv, i.head_dim, i.n_ff, i.n_vocab) == \
            (2, D, 4, 2, D // 4, N_FF, N_VOCAB)
        assert 0 < i.n_ctx_train <= 1 << 20
        assert m.create_context().eval([1, 2]).shape == (N_VOCAB,)


@pytest.mark.parametrize("key", [F.arch_key(k) for k in F.REQUIRED_ARCH_KEYS])
def test_missing_required_key(random_gguf, tmp_path, key):
    """Each key format.py (and so the preflight) calls required is one the loader refuses
    a file without."""
    with pytest.raises(NativeError, match=f"missing required key '{key}'"):
        _load(random_gguf, tmp_path / "nokey.gguf", drop_kv=[key])


# ---- NaN / Inf in the weights: a warning ------------------------------------------


def _poison(value, where=(0,)):
    def f(a):
        a = a.copy()
        a[where] = value
        return a
    return f


def test_clean_model_has_no_warnings(random_gguf):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Model(random_gguf, check_weights=True) as m:
            assert m.warnings == []


@pytest.mark.parametrize("name, value", [("blk.0.attn_norm.weight", np.nan),
                                         ("output_norm.weight", np.inf),
                                         ("blk.1.ffn_norm.weight", -np.inf)])
def test_nonfinite_norm_warns_at_load(random_gguf, tmp_path, name, value):
    path = rewrite_gguf(random_gguf, tmp_path / "nan.gguf", tensors={name: _poison(value)})
    with pytest.warns(RuntimeWarning, match=rf"nan\.gguf: tensor '{name}': 1 of 64 values are NaN or Inf"):
        m = Model(path)
    with m:
        assert m.warnings == [f"tensor '{name}': 1 of 64 values are NaN or Inf"]
        m.create_context(n_ctx=8).eval([1, 2])  # still usable: a warning, not an error


def test_nonfinite_matrix_warns_with_check_weights(random_gguf, tmp_path):
    name = "blk.1.ffn_up.weight"
    path = rewrite_gguf(random_gguf, tmp_path / "nan.gguf",
                        tensors={name: _poison(np.nan, (slice(3, 5), slice(None)))})
    # The default load checks only what it copies anyway (the norms): no full read.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Model(path) as m:
            assert m.warnings == []
    with pytest.warns(RuntimeWarning, match=rf"'{name}': 128 of 8192 values are NaN or Inf"):
        with Model(path, check_weights=True) as m:
            assert len(m.warnings) == 1


def test_nonfinite_quantized_scale_warns_with_check_weights(random_gguf, tmp_path):
    # A Q8_0 tensor whose first block scale (f16) is NaN: the whole block dequantizes to NaN.
    name = "blk.0.ffn_gate.weight"

    def to_q8_0_with_nan_scale(a):
        q = gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q8_0).copy()
        q[0, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
        return q, gguf.GGMLQuantizationType.Q8_0

    path = rewrite_gguf(random_gguf, tmp_path / "q8.gguf", tensors={name: to_q8_0_with_nan_scale})
    with pytest.warns(RuntimeWarning, match=rf"'{name}': 32 of 8192 values are NaN or Inf"):
        with Model(path, check_weights=True) as m:
            assert m.warnings == [f"tensor '{name}': 32 of 8192 values are NaN or Inf"]


# ---- context and batch limits --------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(n_ctx=-1), "n_ctx must be between"),
    (dict(n_ctx=(1 << 20) + 1), "n_ctx must be between"),
    (dict(n_ctx=1 << 40), "n_ctx = 1099511627776 is out of range"),
    (dict(n_batch=-2), "n_batch must be >= 0"),
    (dict(n_batch=1 << 33), "n_batch = 8589934592 is out of range"),
])
def test_bad_context_params(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.create_context(**kw)


def test_eval_longer_than_batch_is_split(model):
    ids = [int(t) for t in np.random.default_rng(1).integers(0, N_VOCAB, size=13)]
    whole = model.create_context(n_ctx=32, n_batch=512).eval(ids, logits_all=True)
    small = model.create_context(n_ctx=32, n_batch=3)
    np.testing.assert_allclose(small.eval(ids, logits_all=True), whole, rtol=0, atol=1e-5)
    assert small.n_past == 13


def test_eval_at_exactly_full_context_then_overflow(model):
    ctx = model.create_context(n_ctx=6, n_batch=4)
    ctx.eval([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="context full: 6 tokens cached \\+ 1 new > n_ctx = 6"):
        ctx.eval([1])
    ctx.reset(2)
    ctx.eval([7, 8, 9, 10])  # room again after truncation
    with pytest.raises(ValueError, match="cannot truncate to 7"):
        ctx.reset(7)
    with pytest.raises(ValueError, match="cannot truncate to -1"):
        ctx.reset(-1)


# ---- token ids -----------------------------------------------------------------------


@pytest.mark.parametrize("tokens, match", [
    ([N_VOCAB], "outside the vocabulary"),
    ([5, -3], "outside the vocabulary"),
    ([1 << 40], "outside the vocabulary"),
    ([], "non-empty"),
    ([[1, 2]], "1-D"),
])
def test_bad_tokens(model, tokens, match):
    ctx = model.create_context(n_ctx=16)
    with pytest.raises(ValueError, match=match):
        ctx.eval(tokens)
    assert ctx.n_past == 0


def test_prompt_ids_outside_vocabulary(model):
    with pytest.raises(ValueError, match=f"token id {N_VOCAB + 5} is outside the vocabulary"):
        model.generate([1, N_VOCAB + 5], max_tokens=4)


def test_native_eval_checks_tokens_itself(model):
    # The C API does not rely on the Python check.
    from powerinfer_cpp._native import ffi, last_error, lib

    ctx = model.create_context(n_ctx=16)
    toks = ffi.new("int32_t[]", [1, N_VOCAB])
    assert lib.gh_eval(ctx._handle(), toks, 2, 0) == lib.GH_ERR_RANGE
    assert "token id 384 at index 1 is outside the vocabulary [0, 384)" in last_error()
    assert lib.gh_eval(ctx._handle(), toks, 0, 0) == lib.GH_ERR_INVALID_ARG  # no tokens
    assert lib.gh_eval(ctx._handle(), ffi.NULL, 1, 0) == lib.GH_ERR_INVALID_ARG
    assert ctx.n_past == 0


# ---- thread counts ---------------------------------------------------------------------


@pytest.mark.parametrize("n, exc, match", [
    (-1, ValueError, "n_threads must be between 1 and 512"),
    (513, ValueError, "n_threads must be between 1 and 512"),
    (1 << 40, ValueError, "n_threads = 1099511627776 is out of range"),
])
def test_bad_thread_counts(model, random_gguf, n, exc, match):
    ctx = model.create_context(n_ctx=8)
    with pytest.raises(exc, match=match):
        ctx.set_threads(n)
    ctx.eval([1, 2])  # the context still works with its old thread pool
    with Model(random_gguf, n_threads=n) as m:  # the default context is made on first use
        with pytest.raises(exc, match=match):
            m.generate("hi", max_tokens=1)


def test_thread_counts_that_work(model):
    ctx = model.create_context(n_ctx=16, n_threads=1)
    want = ctx.eval([1, 2, 3])
    for n in (3, 0, 7, 1):
        ctx.set_threads(n)
        ctx.reset()
        np.testing.assert_allclose(ctx.eval([1, 2, 3]), want, rtol=0, atol=1e-5)


# ---- contexts after their model is closed or dropped -----------------------------------


def test_directly_made_context_is_closed_with_its_model(random_gguf):
    m = Model(random_gguf, n_ctx=16)
    ctx = Context(m, n_ctx=8)  # not through create_context
    ctx.eval([1, 2])
    m.close()
    for use in (lambda: ctx.eval([1]), lambda: ctx.n_past, lambda: ctx.reset(),
                lambda: ctx.set_threads(1), lambda: ctx.generate([1], max_tokens=1)):
        with pytest.raises(RuntimeError, match="closed"):
            use()
    with pytest.raises(RuntimeError, match="closed"):
        m.generate("x", max_tokens=1)
    m.close()  # twice is fine
    ctx.close()


def test_closing_the_model_during_a_stream(random_gguf):
    m = Model(random_gguf, n_ctx=64)
    it = m.stream([1, 5, 9], max_tokens=40, temperature=0, ignore_eos=True)
    piece = next(it)
    assert isinstance(piece, str)
    m.close()
    with pytest.raises(RuntimeError, match="closed"):
        for _ in it:
            pass


def test_dropping_the_model_keeps_it_alive_for_its_contexts(random_gguf):
    m = Model(random_gguf, n_ctx=16)
    ctx = m.create_context(n_ctx=8)
    want = ctx.eval([1, 2, 3])
    del m
    gc.collect()
    ctx.reset()
    np.testing.assert_allclose(ctx.eval([1, 2, 3]), want, rtol=0, atol=0)
    ctx.close()


def test_rope_frequency_divisors_are_used_and_checked(random_gguf, tmp_path):
    """A llama.cpp Llama-3.1 file stores its rope scaling as rope_freqs.weight: divisors of 1
    change nothing, others change every position but the first, and a bad table is refused
    by name (running without it would be wrong at every position)."""
    hd = D // 4
    toks = [1, 5, 9, 2]
    want = Model(random_gguf).create_context().eval(toks, logits_all=True)
    ones = _load(random_gguf, tmp_path / "ones.gguf",
                 add={"rope_freqs.weight": np.ones(hd // 2, dtype=np.float32)})
    np.testing.assert_array_equal(ones.create_context().eval(toks, logits_all=True), want)
    div = np.linspace(1, 8, hd // 2).astype(np.float32)
    got = _load(random_gguf, tmp_path / "div.gguf", add={"rope_freqs.weight": div}
                ).create_context().eval(toks, logits_all=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)  # position 0: no rotation
    assert np.abs(got[1:] - want[1:]).max() > 1e-4  # (a random model attends weakly)
    with pytest.raises(NativeError, match=r"rope_freqs\.weight.*expected a vector of"):
        _load(random_gguf, tmp_path / "short.gguf",
              add={"rope_freqs.weight": np.ones(hd // 2 - 1, dtype=np.float32)})
    bad = np.ones(hd // 2, dtype=np.float32)
    bad[2] = 0.0
    with pytest.raises(NativeError, match=r"rope_freqs\.weight.*entry 2 is 0"):
        _load(random_gguf, tmp_path / "zero.gguf", add={"rope_freqs.weight": bad})


def test_inspect_says_whether_the_runtime_loads_a_file(random_gguf, tmp_path):
    from powerinfer_cpp.inspect import describe

    assert "loads: yes (weights and tokenizer)" in describe(random_gguf)
    bad = rewrite_gguf(random_gguf, tmp_path / "freqs.gguf",
                       add={"rope_freqs.weight": np.ones(3, dtype=np.float32)})
    assert "loads: no\n  - " in describe(bad)
    assert "rope_freqs.weight" in describe(bad).splitlines()[-1]


def test_load_fuzzer_seeds_load_and_run(tmp_path):
    """The load-path fuzzer's seeds (tools/fuzz/load_seeds.py) are models the runtime
    loads and runs: a seed that stopped loading would leave the forward pass unfuzzed."""
    from conftest import load_tool

    seeds = load_tool("fuzz/load_seeds.py")
    seeds.main(str(tmp_path))
    files = sorted(tmp_path.glob("load-*.gguf"))
    assert len(files) == len(seeds.SEEDS)
    from powerinfer_cpp._native import check, ffi, lib

    for f in files:  # through the C API, as the fuzzer does (the seeds have no tokenizer)
        assert f.stat().st_size <= 65536, f.name  # under the fuzzer's -max_len
        mp, cp = ffi.new("gh_model **"), ffi.new("gh_context **")
        check(lib.gh_model_load(str(f).encode(), mp))
        try:
            assert ffi.string(lib.gh_model_warnings(mp[0])) == b"", f.name
            bad = ffi.new("int64_t *")
            check(lib.gh_model_check_weights(mp[0], bad))
            assert bad[0] == 0, f.name
            p = lib.gh_context_default_params()
            p.n_ctx, p.n_threads = 8, 1
            check(lib.gh_context_new(mp[0], ffi.new("gh_context_params *", p), cp))
            toks = ffi.new("int32_t[]", [1, seeds.N_VOCAB - 1])
            check(lib.gh_eval(cp[0], toks, 2, 0))
            logits = np.frombuffer(ffi.buffer(lib.gh_get_logits(cp[0], -1), 4 * seeds.N_VOCAB),
                                   dtype=np.float32)
            assert np.isfinite(logits).all() and logits.std() > 0, f.name
            lib.gh_context_free(cp[0])
        finally:
            lib.gh_model_free(mp[0])
