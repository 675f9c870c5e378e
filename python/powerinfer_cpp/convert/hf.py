"""Readers of a Hugging Face model folder: config.json, the weights (safetensors via
numpy memmap, or pytorch_model.bin through torch when it is installed) and the
tokenizer (tokenizer.json + tokenizer_config.json -> GGUF vocabulary metadata).

Nothing here knows an architecture: the architecture modules interpret the config.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import format as F
from ..gguf_write import ConvertError
from .safetensors_io import SafetensorsError, open_safetensors_dir

log = logging.getLogger("powerinfer_cpp.convert")

__all__ = ["read_config_json", "open_weights", "TokenizerMeta", "read_hf_tokenizer", "SafetensorsError"]


# ==========================================================================
# config.json
# ==========================================================================

def read_config_json(hf_dir: str | os.PathLike) -> dict:
    """The parsed config.json of a model folder (a JSON object)."""
    d = os.fspath(hf_dir)
    if not os.path.isdir(d):
        raise ConvertError(f"model folder not found: {d}")
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"no config.json in {d}")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return cfg


# ==========================================================================
# Weights
# ==========================================================================

class _TorchBinSource:
    """pytorch_model.bin weights (needs torch)."""

    def __init__(self, paths: list[str]):
        import torch
        self._t: dict[str, Any] = {}
        for p in paths:
            try:
                sd = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            except Exception:
                sd = torch.load(p, map_location="cpu", weights_only=True)
            self._t.update(sd)
        self._torch = torch

    def keys(self) -> list[str]:
        return list(self._t)

    def __contains__(self, k: str) -> bool:
        return k in self._t

    def shape(self, k: str) -> tuple[int, ...]:
        return tuple(self._t[k].shape)

    def get(self, k: str, dtype=None) -> np.ndarray:
        t = self._t[k]
        if not t.is_floating_point() or t.dtype not in (self._torch.float32, self._torch.float16):
            t = t.to(self._torch.float32)
        a = t.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def close(self) -> None:
        self._t = {}


def open_weights(d: str):
    """The weights of folder d: a safetensors source, or torch-loaded .bin files."""
    try:
        st = open_safetensors_dir(d)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    if st is not None:
        return st
    bins = []
    idx = os.path.join(d, "pytorch_model.bin.index.json")
    if os.path.isfile(idx):
        try:
            with open(idx, encoding="utf-8") as f:
                bins = sorted({os.path.join(d, n) for n in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{idx}: malformed index ({e})") from None
    elif os.path.isfile(os.path.join(d, "pytorch_model.bin")):
        bins = [os.path.join(d, "pytorch_model.bin")]
    if not bins:
        raise ConvertError(f"no weights in {d} (expected model.safetensors or model-*-of-*.safetensors "
                           "with model.safetensors.index.json)")
    for b in bins:
        if not os.path.isfile(b):
            raise ConvertError(f"weight file {b} is missing")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConvertError(
            f"{d} has only pytorch_model.bin weights and torch is not installed; either install torch, "
            "or re-save the model as safetensors (with transformers: "
            "AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, safe_serialization=True))") from None
    try:
        return _TorchBinSource(bins)
    except Exception as e:  # torch raises many kinds on bad files
        raise ConvertError(f"cannot load {bins[0]}: {e}") from None


# ==========================================================================
# Tokenizer
# ==========================================================================

@dataclass
class TokenizerMeta:
    model: str                           # F.TOKENIZER_GPT2 / F.TOKENIZER_LLAMA
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)   # gpt2
    scores: list[float] = field(default_factory=list)  # llama
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    hf_json: str = ""
    pre: str = F.TOKENIZER_PRE_DEFAULT   # tokenizer.ggml.pre (gpt2 models)


_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _find_type(node: Any, tname: str) -> list[dict]:
    """All JSON objects with "type" == tname below node."""
    found = []
    if isinstance(node, dict):
        if node.get("type") == tname:
            found.append(node)
        for v in node.values():
            found += _find_type(v, tname)
    elif isinstance(node, list):
        for v in node:
            found += _find_type(v, tname)
    return found


def _token_content(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _canonical_pre(node: Any) -> Any:
    """A tokenizer.json pre-tokenizer reduced to what decides the split (defaults filled
    in, offset-only options such as ByteLevel's trim_offsets dropped), so that two that
    split alike compare equal."""
    if not isinstance(node, dict):
        return node
    t = node.get("type")
    if t == "Sequence":
        return {"type": t, "pretokenizers": [_canonical_pre(p) for p in node.get("pretokenizers") or []]}
    if t == "ByteLevel":
        return {"type": t, "add_prefix_space": bool(node.get("add_prefix_space", True)),
                "use_regex": bool(node.get("use_regex", True))}
    if t == "Split":
        return {"type": t, "pattern": node.get("pattern"), "behavior": node.get("behavior"),
                "invert": bool(node.get("invert", False))}
    if t == "Punctuation":
        return {"type": t, "behavior": node.get("behavior", "Isolated")}
    if t == "Digits":
        return {"type": t, "individual_digits": bool(node.get("individual_digits", False))}
    return node


def _pre_tokenizer_name(pre: Any) -> str:
    """llama.cpp's tokenizer.ggml.pre name of a byte-level BPE's pre-tokenizer: GPT-2's
    own split (a lone ByteLevel with its regex) is "default"; one that splits exactly as
    a row of format.TOKENIZER_PRE_TOKENIZERS is that row's name. Anything else cannot be
    named, and a file naming the wrong one would be split wrongly by every other GGUF
    tool: refused."""
    if isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return F.TOKENIZER_PRE_DEFAULT
    got = _canonical_pre(pre)
    for name, row in F.TOKENIZER_PRE_TOKENIZERS.items():
        if name != F.TOKENIZER_PRE_DEFAULT and got == _canonical_pre(row.split):
            return name
    desc = json.dumps(pre)
    if len(desc) > 200:
        desc = desc[:200] + "..."
    named = ", ".join(n for n in F.TOKENIZER_PRE_TOKENIZERS if n != F.TOKENIZER_PRE_DEFAULT)
    raise ConvertError(f"unsupported tokenizer: tokenizer.json pre_tokenizer {desc} is none this "
                       f"converter can store as {F.KEY_TOKENIZER_PRE} (supported: GPT-2's ByteLevel, "
                       f"and the {named} pre-tokenizers)")


def read_hf_tokenizer(hf_dir: str | os.PathLike, n_vocab: int, params: Any = None) -> TokenizerMeta:
    """Read tokenizer.json (+ tokenizer_config.json) into GGUF vocab metadata."""
    d = os.fspath(hf_dir)
    tpath = os.path.join(d, "tokenizer.json")
    if not os.path.isfile(tpath):
        raise ConvertError(f"no tokenizer.json in {d} (with transformers: "
                           "AutoTokenizer.from_pretrained(d).save_pretrained(d) writes one)")
    try:
        with open(tpath, encoding="utf-8") as f:
            text = f.read()
        tj = json.loads(text)
        model = tj["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"cannot read {tpath}: {e}") from None
    tcfg: dict = {}
    cpath = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(cpath):
        try:
            with open(cpath, encoding="utf-8") as f:
                tcfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ConvertError(f"cannot read {cpath}: {e}") from None

    if model.get("type", "BPE") != "BPE":
        raise ConvertError(f"unsupported tokenizer model {model.get('type')!r} (only BPE)")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ConvertError(f"{tpath}: model.vocab is not a mapping")
    byte_level = bool(_find_type(tj.get("pre_tokenizer"), "ByteLevel") or _find_type(tj.get("decoder"), "ByteLevel"))
    if model.get("byte_fallback"):
        kind = F.TOKENIZER_LLAMA
    elif byte_level:
        kind = F.TOKENIZER_GPT2
    else:
        raise ConvertError("unsupported tokenizer: BPE that is neither byte-level nor byte-fallback")

    id_to_tok: dict[int, str] = {}
    for tok, i in vocab.items():
        id_to_tok[int(i)] = tok
    added = tj.get("added_tokens") or []
    special_ids, user_ids = set(), set()
    for a in added:
        i, c = int(a["id"]), a["content"]
        id_to_tok[i] = c
        (special_ids if a.get("special") else user_ids).add(i)
    top = max(id_to_tok) + 1 if id_to_tok else 0
    if top > n_vocab:
        raise ConvertError(f"the tokenizer has token ids up to {top - 1} but the model's vocab_size is {n_vocab}")
    tok_to_id = {t: i for i, t in id_to_tok.items()}
    unk_id = tok_to_id.get(model.get("unk_token")) if model.get("unk_token") else None

    tokens, types = [], []
    for i in range(n_vocab):
        t = id_to_tok.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(F.TOKEN_TYPE_UNUSED)
        else:
            tokens.append(t)
            if i == unk_id:
                types.append(F.TOKEN_TYPE_UNKNOWN)
            elif i in special_ids:
                types.append(F.TOKEN_TYPE_CONTROL)
            elif i in user_ids:
                types.append(F.TOKEN_TYPE_USER_DEFINED)
            elif kind == F.TOKENIZER_LLAMA and _BYTE_TOKEN.match(t):
                types.append(F.TOKEN_TYPE_BYTE)
            else:
                types.append(F.TOKEN_TYPE_NORMAL)

    merges = []
    for m in model.get("merges") or []:
        if isinstance(m, str):
            merges.append(m)
        elif isinstance(m, (list, tuple)) and len(m) == 2:
            merges.append(f"{m[0]} {m[1]}")
        else:
            raise ConvertError(f"{tpath}: malformed merge {m!r}")
    meta = TokenizerMeta(model=kind, tokens=tokens, types=types, unk_id=unk_id, hf_json=text)
    if kind == F.TOKENIZER_GPT2:
        meta.merges = merges
        meta.pre = _pre_tokenizer_name(tj.get("pre_tokenizer"))
    else:
        # SentencePiece-style scores: a token made by the merge of rank r
        # scores -r (earlier merge = higher score); other normal tokens score
        # below every merge; control/byte/unknown tokens score 0.
        n_m = len(merges)
        scores = [0.0] * n_vocab
        for i, ty in enumerate(types):
            if ty in (F.TOKEN_TYPE_NORMAL, F.TOKEN_TYPE_USER_DEFINED, F.TOKEN_TYPE_UNUSED):
                scores[i] = -float(n_m + i)
        seen = set()
        for r, m in enumerate(merges):
            left, _, right = m.partition(" ")
            i = tok_to_id.get(left + right)
            if i is not None and i not in seen and types[i] == F.TOKEN_TYPE_NORMAL:
                seen.add(i)
                scores[i] = -float(r)
        meta.scores = scores
        prep = _find_type(tj.get("normalizer"), "Prepend")
        ms = _find_type(tj.get("pre_tokenizer"), "Metaspace")
        meta.add_space_prefix = bool(prep) or any(
            m.get("prepend_scheme", "always" if m.get("add_prefix_space", True) else "never") != "never" for m in ms)

    # special token ids: tokenizer_config.json, then config.json
    def lookup(key: str) -> int | None:
        c = _token_content(tcfg.get(key))
        return tok_to_id.get(c) if c is not None else None

    meta.bos_id = lookup("bos_token")
    meta.eos_id = lookup("eos_token")
    meta.pad_id = lookup("pad_token")
    if meta.unk_id is None:
        meta.unk_id = lookup("unk_token")
    if params is not None:
        if meta.bos_id is None:
            meta.bos_id = params.bos_token_id
        if meta.eos_id is None:
            meta.eos_id = params.eos_token_id
        if meta.pad_id is None:
            meta.pad_id = params.pad_token_id
    for k in ("bos_id", "eos_id", "pad_id", "unk_id"):
        v = getattr(meta, k)
        if v is not None and not (0 <= v < n_vocab):
            log.warning("tokenizer %s=%d is out of range; dropped", k, v)
            setattr(meta, k, None)

    # add_bos / add_eos: tokenizer_config.json, else what the post-processor does
    post_ids = set()
    for tp in _find_type(tj.get("post_processor"), "TemplateProcessing"):
        for piece in tp.get("single") or []:
            st = piece.get("SpecialToken") if isinstance(piece, dict) else None
            if st and st.get("id") in tok_to_id:
                post_ids.add(tok_to_id[st["id"]])
    single = [p for tp in _find_type(tj.get("post_processor"), "TemplateProcessing") for p in tp.get("single") or []]
    first_special = bool(single) and isinstance(single[0], dict) and "SpecialToken" in single[0]
    last_special = bool(single) and isinstance(single[-1], dict) and "SpecialToken" in single[-1]
    ab, ae = tcfg.get("add_bos_token"), tcfg.get("add_eos_token")
    meta.add_bos = bool(ab) if isinstance(ab, bool) else (first_special and meta.bos_id in post_ids)
    meta.add_eos = bool(ae) if isinstance(ae, bool) else (last_special and meta.eos_id in post_ids)

    ct = tcfg.get("chat_template")
    if isinstance(ct, list):  # [{"name": ..., "template": ...}]
        named = {e.get("name"): e.get("template") for e in ct if isinstance(e, dict)}
        ct = named.get("default") or next(iter(named.values()), None)
    if not isinstance(ct, str):
        jpath = os.path.join(d, "chat_template.jinja")
        ct = None
        if os.path.isfile(jpath):
            with open(jpath, encoding="utf-8") as f:
                ct = f.read()
    meta.chat_template = ct or None
    return meta
