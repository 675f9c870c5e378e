"""Tokenizer for the runtime, loaded from a GGUF file's metadata.

    tok = load_tokenizer("model.gguf")
    ids = tok.encode("Hello")          # BOS prepended if the file says so
    text = tok.decode(ids)

If the file carries the original Hugging Face ``tokenizer.huggingface.json``
(our converter always writes it) that exact tokenizer is used. Otherwise an
equivalent ``tokenizers.Tokenizer`` is rebuilt from llama.cpp's standard
``tokenizer.ggml.*`` keys:

* ``gpt2``: byte-level BPE from tokens + merges, split as the pre-tokenizer name
  ``tokenizer.ggml.pre`` says: every name llama.cpp reads whose split is regexes, digit
  splits and the byte-level mapping (smollm, llama-bpe, qwen2, deepseek-*, gpt-4o,
  tekken, starcoder, command-r, bloom, falcon, ...: the rows of
  ``format.TOKENIZER_PRE_TOKENIZERS``, which also say where llama.cpp looks a whole
  pre-token up before merging and where BOS is prepended by default). Refused, by name
  and reason (``format.TOKENIZER_PRE_REFUSED``): gemma4, sarvam-moe and
  granite-embed-multi-311m (SentencePiece-style BPE on raw UTF-8, not byte-level),
  whitespace (no byte-level mapping), jina-v1-en, jina-v2-code and roberta-bpe (encoder
  vocabularies that append SEP), kimi-k2 and afmoe (split by hand-written code in
  llama.cpp, not a published regex), superbpe (a zero-width split) and
  granite-embed-multi-97m (llama.cpp's own approximation, no published pattern); any
  other name is refused too;
* ``llama``: SentencePiece-style BPE with byte fallback ("▁" prefix and
  space replacement done by the normalizer, as SentencePiece does). The merges are
  reconstructed from the scores: every split of a normal token into two
  normal tokens is a merge, ranked by the merged token's score (higher
  first), which is how SentencePiece BPE chooses merges.

Control / unknown tokens become special added tokens and user-defined
tokens become (non-special) added tokens, so they encode as single ids.
"""

from __future__ import annotations

import json
import operator
import os
import threading
from typing import Any, Iterable, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTok

from . import format as F

__all__ = ["TokenizerError", "Tokenizer", "load_tokenizer", "read_tokenizer_metadata",
           "tokenizer_from_metadata", "build_tokenizer_from_ggml", "pre_tokenizer_row",
           "pre_tokenizer_refusal"]


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded, or was given bad input."""


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves,
    the other bytes to code points 256, 257, ... in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_B2U = _byte_to_unicode()
_U2B = {u: b for b, u in _B2U.items()}

_META_KEYS = (
    F.KEY_TOKENIZER_MODEL, F.KEY_TOKENIZER_PRE, F.KEY_TOKENIZER_TOKENS, F.KEY_TOKENIZER_TOKEN_TYPE,
    F.KEY_TOKENIZER_SCORES, F.KEY_TOKENIZER_MERGES, F.KEY_TOKENIZER_BOS_ID, F.KEY_TOKENIZER_EOS_ID,
    F.KEY_TOKENIZER_UNK_ID, F.KEY_TOKENIZER_PAD_ID, F.KEY_TOKENIZER_ADD_BOS, F.KEY_TOKENIZER_ADD_EOS,
    F.KEY_TOKENIZER_ADD_SPACE_PREFIX, F.KEY_TOKENIZER_HF_JSON, F.KEY_TOKENIZER_CHAT_TEMPLATE,
)


def read_tokenizer_metadata(gguf_path: str | os.PathLike) -> dict[str, Any]:
    """The tokenizer.* key/values of a GGUF file as plain Python values.

    Uses the runtime's own (hardened, fast) GGUF reader: the gguf package's reader
    builds a numpy view per vocabulary string and takes seconds on a 32k vocabulary.
    """
    from ._native import NativeError, check, ffi, lib

    path = os.fspath(gguf_path)
    if not os.path.exists(path):
        raise TokenizerError(f"no such file: {path}")
    out = ffi.new("gh_gguf **")
    try:
        check(lib.gh_gguf_open(path.encode(), out))
    except NativeError as e:
        raise TokenizerError(f"cannot read GGUF metadata of {path}: {e}") from None
    g = out[0]
    try:
        meta: dict[str, Any] = {}
        for key in _META_KEYS:
            i = lib.gh_gguf_find_key(g, key.encode())
            if i >= 0:
                meta[key] = _native_value(g, i, key)
        return meta
    finally:
        lib.gh_gguf_close(g)


# GGUF value type id -> numpy dtype of array elements
_GGUF_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}


def _native_value(g, i: int, key: str) -> Any:
    from ._native import check, ffi, lib

    vtype = lib.gh_gguf_kv_type(g, i)
    if vtype == 8:
        return ffi.string(lib.gh_gguf_kv_str(g, i)).decode("utf-8", "replace")
    if vtype == 9:
        et = ffi.new("int32_t *")
        n = lib.gh_gguf_kv_arr(g, i, et)
        data, nbytes = ffi.new("void **"), ffi.new("uint64_t *")
        check(lib.gh_gguf_kv_arr_data(g, i, ffi.cast("const void **", data), nbytes))
        raw = ffi.buffer(data[0], nbytes[0])
        if et[0] == 8:  # strings: u64 length + bytes each (bounds checked by the reader)
            mv, pos, items = bytes(raw), 0, []
            for _ in range(n):
                ln = int.from_bytes(mv[pos:pos + 8], "little")
                items.append(mv[pos + 8:pos + 8 + ln].decode("utf-8", "replace"))
                pos += 8 + ln
            return items
        if et[0] not in _GGUF_NP:
            raise TokenizerError(f"key {key}: unsupported array element type {et[0]}")
        arr = np.frombuffer(raw, dtype=_GGUF_NP[et[0]], count=n)
        return [bool(v) for v in arr] if et[0] == 7 else arr.tolist()
    if vtype == 7:
        v = ffi.new("int64_t *")
        check(lib.gh_gguf_kv_int(g, i, v))
        return bool(v[0])
    if vtype in (6, 12):
        v = ffi.new("double *")
        check(lib.gh_gguf_kv_float(g, i, v))
        return v[0]
    v = ffi.new("int64_t *")
    check(lib.gh_gguf_kv_int(g, i, v))
    return v[0]


# tokenizer.json's split behaviour names -> the tokenizers library's
_SPLIT_BEHAVIOR = {"Removed": "removed", "Isolated": "isolated", "MergedWithPrevious": "merged_with_previous",
                   "MergedWithNext": "merged_with_next", "Contiguous": "contiguous"}


def _pre_tokenizer(spec: dict):
    """The ``tokenizers`` pre-tokenizer of a tokenizer.json ``pre_tokenizer`` entry of
    format.TOKENIZER_PRE_TOKENIZERS (the node types those use)."""
    t = spec["type"]
    if t == "Sequence":
        return pre_tokenizers.Sequence([_pre_tokenizer(p) for p in spec["pretokenizers"]])
    if t == "ByteLevel":
        return pre_tokenizers.ByteLevel(add_prefix_space=spec["add_prefix_space"], use_regex=spec["use_regex"])
    if t == "Split":
        return pre_tokenizers.Split(Regex(spec["pattern"]["Regex"]), behavior=_SPLIT_BEHAVIOR[spec["behavior"]],
                                    invert=spec["invert"])
    if t == "Punctuation":
        return pre_tokenizers.Punctuation(behavior=_SPLIT_BEHAVIOR[spec["behavior"]])
    if t == "Digits":
        return pre_tokenizers.Digits(individual_digits=spec["individual_digits"])
    raise TokenizerError(f"pre-tokenizer node {t!r} has no builder")


def pre_tokenizer_refusal(meta: dict[str, Any]) -> str | None:
    """Why a gpt2 file's tokenizer.ggml.pre (none = default) is refused, in one sentence;
    None when format.TOKENIZER_PRE_TOKENIZERS has its row."""
    pre = meta.get(F.KEY_TOKENIZER_PRE) or F.TOKENIZER_PRE_DEFAULT
    if pre in F.TOKENIZER_PRE_TOKENIZERS:
        return None
    why = F.TOKENIZER_PRE_REFUSED.get(pre)
    why = f": {why}" if why else " (a name this table does not know)"
    return f"pre-tokenizer '{pre}' ({F.KEY_TOKENIZER_PRE}) is not supported{why}"


def pre_tokenizer_row(meta: dict[str, Any]) -> F.PreTokenizer:
    """The format.TOKENIZER_PRE_TOKENIZERS row of a gpt2 file's tokenizer.ggml.pre (none
    = default); a name without one is refused, naming why where that is known."""
    refusal = pre_tokenizer_refusal(meta)
    if refusal:
        raise TokenizerError(
            f"{refusal}; its text would be split wrongly. Supported: {', '.join(F.TOKENIZER_PRE_TOKENIZERS)}. "
            "Convert the model from its Hugging Face folder, whose tokenizer.json is embedded")
    return F.TOKENIZER_PRE_TOKENIZERS[meta.get(F.KEY_TOKENIZER_PRE) or F.TOKENIZER_PRE_DEFAULT]


def build_tokenizer_from_ggml(meta: dict[str, Any]):
    """A ``tokenizers.Tokenizer`` equivalent to the ``tokenizer.ggml.*`` keys."""
    kind = meta.get(F.KEY_TOKENIZER_MODEL)
    tokens = meta.get(F.KEY_TOKENIZER_TOKENS)
    if not tokens:
        raise TokenizerError("the file has no tokenizer (neither tokenizer.huggingface.json nor tokenizer.ggml.tokens); "
                             "convert the model again from its Hugging Face folder (with tokenizer.json) using "
                             "`python -m powerinfer_cpp.convert HF_DIR -o MODEL.gguf`")
    tokens = [str(t) for t in tokens]
    types = list(meta.get(F.KEY_TOKENIZER_TOKEN_TYPE) or [F.TOKEN_TYPE_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries, tokens has {len(tokens)}")

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if kind == F.TOKENIZER_GPT2:
        merges = []
        for m in meta.get(F.KEY_TOKENIZER_MERGES) or []:
            a, sep, b = str(m).partition(" ")
            if not sep:
                raise TokenizerError(f"malformed merge {m!r}")
            merges.append((a, b))
        row = pre_tokenizer_row(meta)
        try:
            tok = HFTok(models.BPE(vocab=vocab, merges=merges, ignore_merges=row.ignore_merges))
        except Exception as e:
            raise TokenizerError(f"invalid gpt2 vocabulary: {e}") from None
        tok.pre_tokenizer = _pre_tokenizer(row.split)
        tok.decoder = decoders.ByteLevel()
    elif kind == F.TOKENIZER_LLAMA:
        scores = list(meta.get(F.KEY_TOKENIZER_SCORES) or [])
        if len(scores) != len(tokens):
            raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries, tokens has {len(tokens)}")
        normal = {}
        for i, t in enumerate(tokens):
            if types[i] == F.TOKEN_TYPE_NORMAL:
                normal.setdefault(t, i)
        cands = []
        for t, i in normal.items():
            for k in range(1, len(t)):
                li, ri = normal.get(t[:k]), normal.get(t[k:])
                if li is not None and ri is not None:
                    cands.append((-float(scores[i]), li, ri))
        cands.sort()
        merges = [(tokens[li], tokens[ri]) for _, li, ri in cands]
        unk_id = meta.get(F.KEY_TOKENIZER_UNK_ID)
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
        try:
            tok = HFTok(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        except Exception as e:
            raise TokenizerError(f"invalid llama vocabulary: {e}") from None
        # SentencePiece semantics (also llama.cpp's): spaces become "▁" and,
        # with add_space_prefix, every text segment (the start, and the text
        # after each special token) gets a "▁" prefix, even if it already
        # starts with a space.
        prefix = meta.get(F.KEY_TOKENIZER_ADD_SPACE_PREFIX, True)
        norms = [normalizers.Prepend("▁")] if prefix else []
        tok.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
        parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            parts.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(parts)
    else:
        raise TokenizerError(f"unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama)")

    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty in (F.TOKEN_TYPE_CONTROL, F.TOKEN_TYPE_UNKNOWN)]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(types) if ty == F.TOKEN_TYPE_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


class Tokenizer:
    """Encode/decode text for a model. Wraps a ``tokenizers.Tokenizer``."""

    def __init__(self, hf_tokenizer, *, bos_id: int | None = None, eos_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, n_vocab: int | None = None,
                 kind: str | None = None, tokens: Sequence[str] | None = None,
                 token_types: Sequence[int] | None = None, chat_template: str | None = None,
                 pad_id: int | None = None, unk_id: int | None = None):
        self._tok = hf_tokenizer
        self._lock = threading.Lock()
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.chat_template = chat_template
        n_tok = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.n_vocab = max(n_vocab or 0, n_tok, len(tokens or ()))
        if tokens is None:
            tokens = [hf_tokenizer.id_to_token(i) or "" for i in range(self.n_vocab)]
        self._tokens = list(tokens)
        special_ids = {int(i) for i in _added_ids(hf_tokenizer, special=True)}
        if token_types is None:
            token_types = [F.TOKEN_TYPE_CONTROL if i in special_ids else F.TOKEN_TYPE_NORMAL
                           for i in range(len(self._tokens))]
        self._types = list(token_types)
        self._special_ids = special_ids | {i for i, t in enumerate(self._types)
                                           if t in (F.TOKEN_TYPE_CONTROL, F.TOKEN_TYPE_UNKNOWN)}
        self.kind = kind or _guess_kind(hf_tokenizer)

    @property
    def hf_tokenizer(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    # Texts at least this long are encoded without holding the GIL (below it, the
    # batch call's thread hand-over costs more than the encoding).
    GIL_FREE_CHARS = 4096

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True,
               add_eos: bool | None = False) -> list[int]:
        """Token ids of ``text``. ``add_bos``/``add_eos``: None = what the
        file says (tokenizer.ggml.add_bos_token / add_eos_token); ``add_eos``
        defaults to False. ``special``: special-token text inside ``text``
        (e.g. "<|im_end|>") becomes the special token; if False it is
        tokenized as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        if add_bos is None:
            add_bos = self.add_bos
        if add_eos is None:
            add_eos = self.add_eos
        with self._lock:
            self._tok.encode_special_tokens = not special
            try:
                if len(text) < self.GIL_FREE_CHARS:
                    ids = self._tok.encode(text, add_special_tokens=False).ids
                else:
                    # Same result; encode() holds the GIL for the whole text (a 1 MB
                    # prompt stalled a server's event loop ~1 s), encode_batch releases it.
                    ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
            finally:
                self._tok.encode_special_tokens = False
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos requested but the tokenizer has no BOS token")
            ids = [self.bos_id] + ids
        if add_eos:
            if self.eos_id is None:
                raise TokenizerError("add_eos requested but the tokenizer has no EOS token")
            ids = ids + [self.eos_id]
        return ids

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        out = []
        for i in ids:
            try:
                if isinstance(i, bool) or type(i).__name__ == "bool_":
                    raise TypeError
                i = operator.index(i)
            except TypeError:
                raise TypeError(f"token ids must be integers, got {i!r}") from None
            if not 0 <= i < self.n_vocab:
                raise TokenizerError(f"token id {i} out of range [0, {self.n_vocab})")
            out.append(i)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; special/control tokens are dropped when
        ``skip_special``."""
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=skip_special)

    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The exact bytes one token stands for (may be a partial UTF-8
        sequence; concatenate the bytes of consecutive tokens to stream
        text). Control tokens give their text, or b"" when not ``special``.
        SentencePiece-style tokens keep their leading space ("▁" -> " ")."""
        (i,) = self._check_ids([token_id])
        piece = self._tokens[i] if i < len(self._tokens) else ""
        ty = self._types[i] if i < len(self._types) else F.TOKEN_TYPE_NORMAL
        if i in self._special_ids:
            return piece.encode("utf-8") if special else b""
        if ty == F.TOKEN_TYPE_USER_DEFINED or ty == F.TOKEN_TYPE_UNUSED:
            return piece.encode("utf-8")
        if self.kind == F.TOKENIZER_GPT2:
            return b"".join(bytes([_U2B[c]]) if c in _U2B else c.encode("utf-8") for c in piece)
        if self.kind == F.TOKENIZER_LLAMA:
            if ty == F.TOKEN_TYPE_BYTE or (len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("▁", " ").encode("utf-8")
        return self._tok.decode([i], skip_special_tokens=False).encode("utf-8")

    def token_to_piece(self, token_id: int, special: bool = True) -> str:
        """The text of one token (token_to_bytes decoded as UTF-8, invalid
        partial sequences replaced by U+FFFD)."""
        return self.token_to_bytes(token_id, special).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def __len__(self) -> int:
        return self.n_vocab

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, n_vocab={self.n_vocab}, bos_id={self.bos_id}, eos_id={self.eos_id})"


def _added_ids(tok, special: bool) -> list[int]:
    try:
        dec = tok.get_added_tokens_decoder()
    except AttributeError:
        return []
    return [i for i, a in dec.items() if bool(a.special) == special]


def _guess_kind(tok) -> str | None:
    try:
        j = json.loads(tok.to_str())
    except Exception:
        return None
    if (j.get("model") or {}).get("byte_fallback"):
        return F.TOKENIZER_LLAMA
    s = json.dumps([j.get("pre_tokenizer"), j.get("decoder")])
    return F.TOKENIZER_GPT2 if '"ByteLevel"' in s else None


def tokenizer_from_metadata(meta: dict[str, Any], use_hf_json: bool = True) -> Tokenizer:
    """Build a Tokenizer from tokenizer.* key/values (see
    read_tokenizer_metadata). ``use_hf_json=False`` ignores a stored
    tokenizer.huggingface.json and rebuilds from tokenizer.ggml.*."""
    hf_json = meta.get(F.KEY_TOKENIZER_HF_JSON) if use_hf_json else None
    if hf_json:
        try:
            tok = HFTok.from_str(hf_json)
        except Exception as e:
            raise TokenizerError(f"invalid tokenizer.huggingface.json: {e}") from None
    else:
        tok = build_tokenizer_from_ggml(meta)
    kind = meta.get(F.KEY_TOKENIZER_MODEL)
    tokens = meta.get(F.KEY_TOKENIZER_TOKENS)
    types = meta.get(F.KEY_TOKENIZER_TOKEN_TYPE)
    if tokens is not None and types is not None and len(types) != len(tokens):
        types = None
    if tokens is not None and not hf_json:
        tokens = [str(t) for t in tokens]

    def tid(key):
        v = meta.get(key)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    add_bos = meta.get(F.KEY_TOKENIZER_ADD_BOS)
    if add_bos is None:  # llama.cpp's default: SentencePiece files and some pre-tokenizers
        row = F.TOKENIZER_PRE_TOKENIZERS.get(meta.get(F.KEY_TOKENIZER_PRE) or F.TOKENIZER_PRE_DEFAULT)
        by_pre = kind == F.TOKENIZER_GPT2 and row is not None and row.add_bos
        add_bos = (kind == F.TOKENIZER_LLAMA or by_pre) and tid(F.KEY_TOKENIZER_BOS_ID) is not None
    return Tokenizer(
        tok, bos_id=tid(F.KEY_TOKENIZER_BOS_ID), eos_id=tid(F.KEY_TOKENIZER_EOS_ID),
        pad_id=tid(F.KEY_TOKENIZER_PAD_ID), unk_id=tid(F.KEY_TOKENIZER_UNK_ID),
        add_bos=bool(add_bos), add_eos=bool(meta.get(F.KEY_TOKENIZER_ADD_EOS, False)),
        n_vocab=len(tokens) if tokens is not None else None,
        kind=kind if kind in (F.TOKENIZER_GPT2, F.TOKENIZER_LLAMA) else None,
        tokens=[str(t) for t in tokens] if tokens is not None else None,
        token_types=[int(t) for t in types] if types is not None else None,
        chat_template=meta.get(F.KEY_TOKENIZER_CHAT_TEMPLATE))


def load_tokenizer(gguf_path: str | os.PathLike, use_hf_json: bool = True) -> Tokenizer:
    """Load the tokenizer stored in a GGUF file."""
    return tokenizer_from_metadata(read_tokenizer_metadata(gguf_path), use_hf_json=use_hf_json)
