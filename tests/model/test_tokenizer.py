"""Tests of powerinfer_cpp.tokenizer against Hugging Face tokenizers."""

from __future__ import annotations

import io

import pytest

from hf_models import EXTRA_SPECIAL, QWEN2_SPLIT, TRAIN_TEXT, make_llama_model  # noqa: E402

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.tokenizer import (  # noqa: E402
    TokenizerError, load_tokenizer, read_tokenizer_metadata, tokenizer_from_metadata)

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading, and    runs of     spaces  ",
    "line one\nline two\n\n\nfour newlines\r\nwindows",
    "tabs\tand\t\tmore\ttabs",
    "Café naïve résumé façade Ångström",
    "日本語のテキスト 中文 한국어",
    "emoji 😀🚀🎉 and 👩‍👩‍👧 family, ☃ snowman",
    "unseen chars: ʘ ӂ ₪ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|im_start|>",
    "bos <s> and eos </s> inside",
    "a <custom_tok> b",
    "numbers 1234567890 3.14159",
    "\n",
    " ",
    "def f(x):\n    return x * 2\n",
]


# spm-gemma: SentencePiece-style without the "▁" prefix (Gemma's tokenizer.json; llama.cpp's
# gemma files say tokenizer.ggml.add_space_prefix = false)
@pytest.fixture(scope="module", params=["bpe", "spm", "spm-gemma"])
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"tok_{request.param}")
    d = make_llama_model(root / "hf", act="relu", n_layer=1, d=32, n_head=2, n_head_kv=1, n_ff=32,
                      tokenizer=request.param)
    out = convert(d, root / "m.gguf", "f32", progress=False)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    return request.param, d, out, hf


@pytest.fixture(params=[True, False], ids=["hf_json", "ggml_keys"])
def tok(request, model):
    kind, d, out, hf = model
    return load_tokenizer(out, use_hf_json=request.param), hf


def test_encode_matches_hf(tok):
    t, hf = tok
    for s in TEXTS:
        assert t.encode(s) == hf(s)["input_ids"], s
        assert t.encode(s, add_bos=False) == hf(s, add_special_tokens=False)["input_ids"], s
        assert t.encode(s, add_bos=True, add_eos=True) == hf(s)["input_ids"] + [t.eos_id], s


def test_decode_matches_hf(tok):
    t, hf = tok
    for s in TEXTS:
        ids = hf(s)["input_ids"]
        assert t.decode(ids) == hf.decode(ids, skip_special_tokens=True), s
        assert t.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False), s


def test_roundtrip_and_pieces(tok, model):
    t, _ = tok
    for s in TEXTS:
        ids = t.encode(s, add_bos=False, special=False)
        assert t.decode(ids) == s
        # streaming: the bytes of consecutive tokens concatenate to the text
        data = b"".join(t.token_to_bytes(i) for i in ids)
        # SentencePiece pieces keep the prefix space (none in Gemma's layout)
        expect = (" " + s) if model[0] == "spm" and s else s
        assert data.decode("utf-8") == expect, s
    assert t.token_to_piece(t.bos_id) == t.hf_tokenizer.id_to_token(t.bos_id)
    assert t.token_to_piece(t.bos_id, special=False) == ""


def test_special_flag(tok):
    t, _ = tok
    im_start = t.hf_tokenizer.token_to_id(EXTRA_SPECIAL[0])
    s = "<|im_start|>user"
    assert t.encode(s, add_bos=False)[0] == im_start
    plain = t.encode(s, add_bos=False, special=False)
    assert im_start not in plain and len(plain) > 2
    assert t.is_special(im_start) and not t.is_special(plain[-1])
    # the flag is not sticky
    assert t.encode(s, add_bos=False)[0] == im_start


def test_attributes(tok, model):
    t, hf = tok
    kind = model[0]
    assert t.n_vocab == len(t) == 384
    assert t.bos_id == hf.bos_token_id and t.eos_id == hf.eos_token_id
    assert t.add_bos is True and t.add_eos is False
    assert t.kind == ("llama" if kind.startswith("spm") else "gpt2")
    meta = read_tokenizer_metadata(model[2])
    if kind.startswith("spm"):
        assert meta[F.KEY_TOKENIZER_ADD_SPACE_PREFIX] is (kind == "spm")
    assert "im_start" in t.chat_template
    with pytest.raises(TokenizerError, match="out of range"):
        t.decode([0, 384])
    with pytest.raises(TokenizerError):
        t.decode([-1])
    with pytest.raises(TypeError):
        t.encode(b"bytes")


def _write_gguf(path, kv: dict):
    w = gguf.GGUFWriter(None, "llama")
    V = gguf.GGUFValueType
    for k, v in kv.items():
        if isinstance(v, bool):
            w.add_key_value(k, v, V.BOOL)
        elif isinstance(v, int):
            w.add_key_value(k, v, V.UINT32)
        elif isinstance(v, str):
            w.add_key_value(k, v, V.STRING)
        elif k == F.KEY_TOKENIZER_SCORES:
            w.add_key_value(k, list(v), V.ARRAY, V.FLOAT32)
        elif k == F.KEY_TOKENIZER_TOKEN_TYPE:
            w.add_key_value(k, list(v), V.ARRAY, V.INT32)
        else:
            w.add_key_value(k, list(v), V.ARRAY, V.STRING)
    w.write_header_to_file(path=str(path))
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def test_file_without_hf_json(model, tmp_path):
    """A GGUF from another tool (only tokenizer.ggml.* keys) loads the rebuilt tokenizer."""
    kind, d, out, hf = model
    meta = read_tokenizer_metadata(out)
    del meta[F.KEY_TOKENIZER_HF_JSON]
    p = tmp_path / "nojson.gguf"
    _write_gguf(p, meta)
    t = load_tokenizer(p)
    for s in TEXTS:
        assert t.encode(s) == hf(s)["input_ids"], s


def test_load_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(TokenizerError):
        load_tokenizer(bad)
    empty = tmp_path / "empty.gguf"
    _write_gguf(empty, {"general.name": "x"})
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(empty)
    with pytest.raises(TokenizerError, match="unsupported tokenizer.ggml.model"):
        tokenizer_from_metadata({F.KEY_TOKENIZER_MODEL: "bert", F.KEY_TOKENIZER_TOKENS: ["a"]})


def test_llama_rebuild_matches_sentencepiece():
    """tokenizer.ggml.* keys as llama.cpp writes them from a real
    SentencePiece BPE model (pieces, scores, types) rebuild a tokenizer that
    tokenizes exactly like SentencePiece itself."""
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT), model_writer=buf, vocab_size=420, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    types = [F.TOKEN_TYPE_UNKNOWN if sp.is_unknown(i) else F.TOKEN_TYPE_CONTROL if sp.is_control(i)
             else F.TOKEN_TYPE_BYTE if sp.is_byte(i) else F.TOKEN_TYPE_NORMAL for i in range(n)]
    meta = {
        F.KEY_TOKENIZER_MODEL: F.TOKENIZER_LLAMA,
        F.KEY_TOKENIZER_TOKENS: [sp.id_to_piece(i) for i in range(n)],
        F.KEY_TOKENIZER_SCORES: [sp.get_score(i) for i in range(n)],
        F.KEY_TOKENIZER_TOKEN_TYPE: types,
        F.KEY_TOKENIZER_BOS_ID: 1, F.KEY_TOKENIZER_EOS_ID: 2, F.KEY_TOKENIZER_UNK_ID: 0,
    }
    t = tokenizer_from_metadata(meta)
    assert t.add_bos  # llama default when the key is absent
    for s in TEXTS + TRAIN_TEXT:
        if "<" in s:
            continue  # SentencePiece does not parse special tokens in text
        ids = sp.encode(s)
        assert t.encode(s, add_bos=False) == ids, s
        assert t.decode(ids) == sp.decode(ids), s
        assert b"".join(t.token_to_bytes(i) for i in ids).decode("utf-8") == (" " + s if s else s), s


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """A byte-level BPE (gpt2) model folder and its GGUF: tokenizer.ggml.pre applies to these."""
    root = tmp_path_factory.mktemp("tok_pre")
    d = make_llama_model(root / "hf", act="relu", n_layer=1, d=32, n_head=2, n_head_kv=1, n_ff=32,
                      tokenizer="bpe")
    return d, convert(d, root / "m.gguf", "f32", progress=False)


#: Llama-3's published text split
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "falcon"])
def test_ggml_pre_tokenizers_match_hf(bpe_model, tmp_path, pre):
    """tokenizer.ggml.pre is honoured: a file from another tool with Llama-3's (llama-bpe),
    Qwen2's or Falcon's split tokenizes as transformers does with that tokenizer.json
    pre-tokenizer."""
    import json
    import shutil

    d, out = bpe_model
    ref_dir = tmp_path / "ref"
    shutil.copytree(d, ref_dir)
    tj = json.loads((ref_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if pre == "falcon":  # written out here, not taken from the table under test
        tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Punctuation", "behavior": "Contiguous"},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            {"type": "Digits", "individual_digits": False},
            {"type": "Split", "pattern": {"Regex": "[0-9][0-9][0-9]"}, "behavior": "Isolated", "invert": False}]}
    else:
        tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT if pre == "qwen2" else LLAMA3_SPLIT},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (ref_dir / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    ref = transformers.AutoTokenizer.from_pretrained(str(ref_dir))
    meta = read_tokenizer_metadata(out)
    del meta[F.KEY_TOKENIZER_HF_JSON]
    meta[F.KEY_TOKENIZER_PRE] = pre
    p = tmp_path / "pre.gguf"
    _write_gguf(p, meta)
    t = load_tokenizer(p)
    texts = TEXTS + ["I'M HERE, we'LL see 123456789 and 1,234,567", "x  \n\n  y\t\tz",
                     "hello!!! ...ok $+<=>^~|` (a) [b]", "12\u00bd3456 x\u00b2y \u043c\u0438\u0440 \u0663\u0664\u0665"]
    for s in texts:
        assert t.encode(s) == ref(s)["input_ids"], s
    # the splits themselves: digit runs in threes (llama-bpe, falcon) or ones (qwen2), where
    # GPT-2's default keeps the run whole
    pieces = [p for p, _ in t.hf_tokenizer.pre_tokenizer.pre_tokenize_str("123456789")]
    assert pieces == (list("123456789") if pre == "qwen2" else ["123", "456", "789"])
    if pre == "falcon":  # punctuation runs stand alone, even without a space before them
        pieces = [p for p, _ in t.hf_tokenizer.pre_tokenizer.pre_tokenize_str("ok!!! a")]
        assert pieces == ["ok", "!!!", "\u0120a"]
    meta[F.KEY_TOKENIZER_PRE] = F.TOKENIZER_PRE_DEFAULT
    _write_gguf(tmp_path / "default.gguf", meta)
    default = load_tokenizer(tmp_path / "default.gguf")
    assert [p for p, _ in default.hf_tokenizer.pre_tokenizer.pre_tokenize_str("123456789")] == ["123456789"]


def test_unknown_pre_tokenizer_is_refused(bpe_model, tmp_path):
    _, out = bpe_model
    meta = read_tokenizer_metadata(out)
    del meta[F.KEY_TOKENIZER_HF_JSON]
    meta[F.KEY_TOKENIZER_PRE] = "kimi-k2"
    p = tmp_path / "unknown.gguf"
    _write_gguf(p, meta)
    with pytest.raises(TokenizerError, match="pre-tokenizer 'kimi-k2'.*not supported"):
        load_tokenizer(p)
