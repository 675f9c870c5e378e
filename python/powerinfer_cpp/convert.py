"""Convert a Hugging Face LLaMA-family model folder to GGUF.

    python -m powerinfer_cpp.convert HF_DIR -o OUT.gguf --outtype f32|f16|bf16|q8_0|q4_0

or, from Python, ``convert(hf_dir, out_path, outtype="f16")``.

Everything that can be checked (config, architecture, tensor names and
shapes, tokenizer) is checked before any output is written; the file is
written to a temporary file next to the output and renamed into place only
when complete. Tensors are streamed one at a time (memmap in, convert,
write), so peak memory stays around the size of the largest tensor.

Key names, tensor names and activation kinds come from ``format.py``; the
file layout is documented in docs/FORMAT.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import format as F
from .scratch import remove_stale, scratch_file
from .safetensors_io import SafetensorsError, open_safetensors_dir

log = logging.getLogger("powerinfer_cpp.convert")

__all__ = ["ConvertError", "HFParams", "read_hf_config", "read_hf_tokenizer", "convert",
           "permute_qk", "unpermute_qk", "main"]


class ConvertError(Exception):
    """The model folder cannot be converted (message says why)."""


# ==========================================================================
# config.json
# ==========================================================================

@dataclass
class HFParams:
    """Hyper-parameters read from a Hugging Face config.json."""
    hf_arch: str
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    rms_eps: float
    rope_theta: float
    rope_scaling_type: str = F.ROPE_SCALING_NONE
    rope_scaling_factor: float = 1.0
    activation: str = F.ACT_SILU
    hf_hidden_act: str = "silu"
    tied: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None


def _act_kind(hidden_act: Any, use_drelu: Any) -> str:
    act = str(hidden_act).lower()
    if act == "drelu":
        kind = F.ACT_DRELU
    elif act == "relu":
        kind = F.ACT_RELU
    elif act in ("silu", "swish"):
        kind = F.ACT_SILU
    elif act in ("gelu", "gelu_python"):
        kind = F.ACT_GELU_ERF
    elif act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_tanh"):
        kind = F.ACT_GELU
    elif act.startswith("gelu"):
        log.warning("hidden_act %r: stored as %r (tanh-approximated GELU)", hidden_act, F.ACT_GELU)
        kind = F.ACT_GELU
    else:
        raise ConvertError(f"unsupported hidden_act {hidden_act!r} (supported: relu, drelu, silu/swish, gelu*)")
    if use_drelu is not None and not isinstance(use_drelu, bool):
        raise ConvertError(f"config.json: use_drelu must be true or false, not {use_drelu!r}")
    if use_drelu:
        if kind not in (F.ACT_RELU, F.ACT_DRELU):
            raise ConvertError(f"config.json: use_drelu is true but hidden_act is {hidden_act!r} "
                               "(dReLU needs hidden_act relu or drelu)")
        kind = F.ACT_DRELU
    return kind


def _rope(cfg: dict) -> tuple[float, str, float]:
    """(theta, scaling type, scaling factor) from either the transformers>=5
    ``rope_parameters`` dict or the older ``rope_theta`` + ``rope_scaling``."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rp
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConvertError(f"config.json: malformed rope scaling {scaling!r}")
    rtype = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rtype in ("default", "none"):
        return float(theta), F.ROPE_SCALING_NONE, 1.0
    if rtype == "linear":
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ConvertError(f"config.json: linear rope scaling needs a positive factor, got {factor!r}")
        return float(theta), F.ROPE_SCALING_LINEAR, float(factor)
    raise ConvertError(f"unsupported rope scaling {rtype!r} (supported: none, linear)")


def read_hf_config(hf_dir: str | os.PathLike) -> HFParams:
    """Parse and validate ``config.json`` of a Hugging Face model folder."""
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

    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if archs:
        arch = archs[0]
        if arch not in F.HF_ARCHITECTURES:
            raise ConvertError(f"unsupported architecture {arch!r} (supported: {', '.join(F.HF_ARCHITECTURES)})")
    else:
        mt = cfg.get("model_type")
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
        if mt not in by_type:
            raise ConvertError(f"config.json names no supported architecture (architectures missing, model_type={mt!r})")
        arch = by_type[mt]

    def need(key: str) -> int:
        v = cfg.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConvertError(f"config.json: {key!r} missing or not a positive integer ({v!r})")
        return v

    n_embd = need("hidden_size")
    n_layer = need("num_hidden_layers")
    n_ff = need("intermediate_size")
    n_head = need("num_attention_heads")
    n_vocab = need("vocab_size")
    n_head_kv = cfg.get("num_key_value_heads") or n_head
    if not isinstance(n_head_kv, int) or n_head_kv <= 0 or n_head % n_head_kv:
        raise ConvertError(f"config.json: num_key_value_heads={n_head_kv!r} must divide num_attention_heads={n_head}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if n_embd % n_head:
            raise ConvertError(f"config.json: hidden_size {n_embd} is not a multiple of num_attention_heads {n_head}")
        head_dim = n_embd // n_head
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ConvertError(f"config.json: head_dim {head_dim!r} must be a positive even integer")

    if cfg.get("attention_bias"):
        raise ConvertError("unsupported: attention_bias is true (biased q/k/v/o projections)")
    if cfg.get("mlp_bias"):
        raise ConvertError("unsupported: mlp_bias is true (biased FFN projections)")
    theta, rtype, rfactor = _rope(cfg)
    hidden_act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    act = _act_kind(hidden_act, cfg.get("use_drelu"))

    n_ctx = cfg.get("max_position_embeddings")
    if not isinstance(n_ctx, int) or n_ctx <= 0:
        log.warning("config.json has no max_position_embeddings; assuming 2048")
        n_ctx = 2048
    sw = cfg.get("sliding_window")
    if sw is not None and (not isinstance(sw, int) or sw <= 0):
        sw = None
    if sw is not None and sw < n_ctx:
        log.warning("config.json: sliding_window=%d < context length %d; stored as "
                    "llama.attention.sliding_window, but the runtime attends to the full context", sw, n_ctx)

    def tok_id(key: str) -> int | None:
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    eps = cfg.get("rms_norm_eps", 1e-6)
    return HFParams(
        hf_arch=arch, name=os.path.basename(os.path.abspath(d)), n_vocab=n_vocab, n_embd=n_embd,
        n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ctx=n_ctx, rms_eps=float(eps), rope_theta=theta, rope_scaling_type=rtype,
        rope_scaling_factor=rfactor, activation=act, hf_hidden_act=str(hidden_act),
        tied=bool(cfg.get("tie_word_embeddings", False)), sliding_window=sw,
        bos_token_id=tok_id("bos_token_id"), eos_token_id=tok_id("eos_token_id"),
        pad_token_id=tok_id("pad_token_id"))


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


def _open_weights(d: str):
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


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of an HF q_proj/k_proj weight [n_heads*head_dim, d]
    so that rotary embedding rotates adjacent pairs (2i, 2i+1) ("normal"
    RoPE) instead of HF's rotate_half pairs (i, i + head_dim/2)."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of permute_qk."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


# HF tensor names per GGUF tensor kind
_HF_LAYER = {
    F.T_ATTN_NORM: "model.layers.{}.input_layernorm.weight",
    F.T_ATTN_Q: "model.layers.{}.self_attn.q_proj.weight",
    F.T_ATTN_K: "model.layers.{}.self_attn.k_proj.weight",
    F.T_ATTN_V: "model.layers.{}.self_attn.v_proj.weight",
    F.T_ATTN_OUTPUT: "model.layers.{}.self_attn.o_proj.weight",
    F.T_FFN_NORM: "model.layers.{}.post_attention_layernorm.weight",
    F.T_FFN_GATE: "model.layers.{}.mlp.gate_proj.weight",
    F.T_FFN_UP: "model.layers.{}.mlp.up_proj.weight",
    F.T_FFN_DOWN: "model.layers.{}.mlp.down_proj.weight",
}
_HF_GLOBAL = {
    F.T_TOKEN_EMBD: "model.embed_tokens.weight",
    F.T_OUTPUT_NORM: "model.norm.weight",
    F.T_OUTPUT: "lm_head.weight",
}
_IGNORED_HF = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@dataclass
class TensorJob:
    """One output tensor: where it comes from and how it is stored."""
    name: str                       # GGUF tensor name
    shape: tuple[int, ...]          # numpy (row-major) shape of the logical tensor
    qtype: Any                      # gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]  # returns float32 data of `shape` (int32 for I32)
    note: str = ""
    raw: bool = False               # load() returns the already encoded bytes (copied as is)

    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES
        bs, ts = GGML_QUANT_SIZES[self.qtype]
        n = int(np.prod(self.shape))
        return n // bs * ts


def _expected_shapes(p: HFParams) -> dict[str, tuple[str, str, int | None, tuple[int, ...]]]:
    """HF name -> (GGUF kind, GGUF name, layer, shape)."""
    q_rows, kv_rows = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    shapes = {
        F.T_ATTN_NORM: (p.n_embd,), F.T_FFN_NORM: (p.n_embd,),
        F.T_ATTN_Q: (q_rows, p.n_embd), F.T_ATTN_K: (kv_rows, p.n_embd),
        F.T_ATTN_V: (kv_rows, p.n_embd), F.T_ATTN_OUTPUT: (p.n_embd, q_rows),
        F.T_FFN_GATE: (p.n_ff, p.n_embd), F.T_FFN_UP: (p.n_ff, p.n_embd),
        F.T_FFN_DOWN: (p.n_embd, p.n_ff),
    }
    out = {_HF_GLOBAL[F.T_TOKEN_EMBD]: (F.T_TOKEN_EMBD, F.tensor_name(F.T_TOKEN_EMBD), None, (p.n_vocab, p.n_embd))}
    for il in range(p.n_layer):
        for kind in F.LAYER_TENSORS:
            out[_HF_LAYER[kind].format(il)] = (kind, F.tensor_name(kind, il), il, shapes[kind])
    out[_HF_GLOBAL[F.T_OUTPUT_NORM]] = (F.T_OUTPUT_NORM, F.tensor_name(F.T_OUTPUT_NORM), None, (p.n_embd,))
    if not p.tied:
        out[_HF_GLOBAL[F.T_OUTPUT]] = (F.T_OUTPUT, F.tensor_name(F.T_OUTPUT), None, (p.n_vocab, p.n_embd))
    return out


def _storage_type(kind: str, shape: tuple[int, ...], outtype: str):
    from gguf import GGMLQuantizationType as Q
    if len(shape) == 1:
        return Q.F32, ""
    t = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[outtype]
    if t == Q.Q4_0 and kind in (F.T_TOKEN_EMBD, F.T_OUTPUT):
        t = Q.Q8_0
    if t in (Q.Q8_0, Q.Q4_0) and shape[-1] % F.QUANT_BLOCK:
        return Q.F16, f"row length {shape[-1]} is not a multiple of {F.QUANT_BLOCK}: stored as F16, not {t.name}"
    return t, ""


def _plan_tensors(p: HFParams, src, outtype: str) -> list[TensorJob]:
    expected = _expected_shapes(p)
    keys = set(src.keys())
    missing = [k for k in expected if k not in keys]
    if missing:
        if not p.tied and missing == [_HF_GLOBAL[F.T_OUTPUT]]:
            raise ConvertError("tie_word_embeddings is false but the weights have no lm_head.weight")
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConvertError(f"missing tensors: {', '.join(missing[:5])}{more}")
    extra = sorted(k for k in keys if k not in expected and not _IGNORED_HF.match(k)
                   and not (p.tied and k == _HF_GLOBAL[F.T_OUTPUT]))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise ConvertError(f"unexpected tensors (not part of a {p.hf_arch} with this config): "
                           f"{', '.join(extra[:5])}{more}")
    jobs = []
    for hf_name, (kind, name, _il, shape) in expected.items():
        got = tuple(src.shape(hf_name))
        if got != shape:
            raise ConvertError(f"shape mismatch: {hf_name} is {list(got)}, config.json implies {list(shape)}")
        if p.tied and kind == F.T_OUTPUT:
            continue
        qtype, note = _storage_type(kind, shape, outtype)
        heads = p.n_head if kind == F.T_ATTN_Q else p.n_head_kv if kind == F.T_ATTN_K else 0

        def load(hf_name=hf_name, heads=heads):
            a = src.get(hf_name, np.float32)
            if heads:
                a = permute_qk(a, heads)
            return np.ascontiguousarray(a, dtype=np.float32)

        jobs.append(TensorJob(name, shape, qtype, load, note))
    return jobs


def _encode(job: TensorJob) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    a = job.load()
    if job.raw:
        return np.asarray(a)
    if a.shape != job.shape:
        raise ConvertError(f"{job.name}: loaded shape {a.shape} != planned {job.shape}")
    if job.qtype == Q.F32:
        return a
    if job.qtype == Q.F16:
        return a.astype(np.float16)
    if job.qtype == Q.I32:
        return np.ascontiguousarray(a, dtype=np.int32)
    return quantize(a, job.qtype)


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


def read_hf_tokenizer(hf_dir: str | os.PathLike, n_vocab: int, params: HFParams | None = None) -> TokenizerMeta:
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


# ==========================================================================
# Writing
# ==========================================================================

def _add_metadata(w, p: HFParams, tm: TokenizerMeta, outtype: str) -> None:
    from gguf import GGUFValueType as V
    A = F.ARCH_LLAMA

    def u32(key, v):
        w.add_key_value(key, int(v), V.UINT32)

    def f32(key, v):
        w.add_key_value(key, float(v), V.FLOAT32)

    w.add_key_value(F.KEY_GENERAL_NAME, p.name or "model", V.STRING)
    u32(F.KEY_GENERAL_FILE_TYPE, F.OUTTYPE_FILE_TYPE[outtype])
    u32(F.KEY_GENERAL_QUANTIZATION_VERSION, 2)
    u32(F.arch_key(F.KEY_CONTEXT_LENGTH, A), p.n_ctx)
    u32(F.arch_key(F.KEY_EMBEDDING_LENGTH, A), p.n_embd)
    u32(F.arch_key(F.KEY_BLOCK_COUNT, A), p.n_layer)
    u32(F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A), p.n_ff)
    u32(F.arch_key(F.KEY_HEAD_COUNT, A), p.n_head)
    u32(F.arch_key(F.KEY_HEAD_COUNT_KV, A), p.n_head_kv)
    f32(F.arch_key(F.KEY_RMS_EPS, A), p.rms_eps)
    f32(F.arch_key(F.KEY_ROPE_FREQ_BASE, A), p.rope_theta)
    u32(F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A), p.head_dim)
    u32(F.arch_key(F.KEY_VOCAB_SIZE, A), p.n_vocab)
    if p.head_dim * p.n_head != p.n_embd:
        u32(F.arch_key(F.KEY_KEY_LENGTH, A), p.head_dim)
        u32(F.arch_key(F.KEY_VALUE_LENGTH, A), p.head_dim)
    if p.rope_scaling_type == F.ROPE_SCALING_LINEAR:
        w.add_key_value(F.arch_key(F.KEY_ROPE_SCALING_TYPE, A), F.ROPE_SCALING_LINEAR, V.STRING)
        f32(F.arch_key(F.KEY_ROPE_SCALING_FACTOR, A), p.rope_scaling_factor)
    if p.sliding_window is not None:
        u32(F.arch_key(F.KEY_SLIDING_WINDOW, A), p.sliding_window)
    u32(F.KEY_FORMAT_VERSION, F.FORMAT_VERSION)
    w.add_key_value(F.KEY_FFN_ACTIVATION, p.activation, V.STRING)
    w.add_key_value(F.KEY_HF_HIDDEN_ACT, p.hf_hidden_act, V.STRING)

    # tokenizer (written with add_key_value so that empty lists are kept)
    w.add_key_value(F.KEY_TOKENIZER_MODEL, tm.model, V.STRING)
    w.add_key_value(F.KEY_TOKENIZER_PRE, F.TOKENIZER_PRE_DEFAULT, V.STRING)
    w.add_key_value(F.KEY_TOKENIZER_TOKENS, tm.tokens, V.ARRAY, V.STRING)
    w.add_key_value(F.KEY_TOKENIZER_TOKEN_TYPE, tm.types, V.ARRAY, V.INT32)
    if tm.model == F.TOKENIZER_GPT2:
        w.add_key_value(F.KEY_TOKENIZER_MERGES, tm.merges, V.ARRAY, V.STRING)
    else:
        w.add_key_value(F.KEY_TOKENIZER_SCORES, tm.scores, V.ARRAY, V.FLOAT32)
        w.add_key_value(F.KEY_TOKENIZER_ADD_SPACE_PREFIX, bool(tm.add_space_prefix), V.BOOL)
    for key, v in ((F.KEY_TOKENIZER_BOS_ID, tm.bos_id), (F.KEY_TOKENIZER_EOS_ID, tm.eos_id),
                   (F.KEY_TOKENIZER_UNK_ID, tm.unk_id), (F.KEY_TOKENIZER_PAD_ID, tm.pad_id)):
        if v is not None:
            u32(key, v)
    w.add_key_value(F.KEY_TOKENIZER_ADD_BOS, bool(tm.add_bos), V.BOOL)
    w.add_key_value(F.KEY_TOKENIZER_ADD_EOS, bool(tm.add_eos), V.BOOL)
    if tm.chat_template:
        w.add_key_value(F.KEY_TOKENIZER_CHAT_TEMPLATE, tm.chat_template, V.STRING)
    w.add_key_value(F.KEY_TOKENIZER_HF_JSON, tm.hf_json, V.STRING)


def write_gguf(out_path: str, setup: Callable[[Any], None], jobs: list[TensorJob],
               progress: bool = True) -> str:
    """Write a GGUF file atomically: ``setup(writer)`` adds the metadata,
    then the tensors of ``jobs`` are produced, encoded and written one at a
    time. Output goes to a temp file in the same folder, renamed on success
    and removed on any failure."""
    import gguf
    from tqdm import tqdm

    out_path = os.path.abspath(os.fspath(out_path))
    out_dir = os.path.dirname(out_path)
    check_output_path(out_path)
    try:
        remove_stale(out_dir)
        fd, tmp = scratch_file(out_path)
    except OSError as e:
        raise ConvertError(f"cannot create a file in {out_dir}: {e.strerror or e}") from None
    try:  # the permissions a plain new file would get (mkstemp makes it private, 0600)
        if os.path.isfile(out_path):
            mode = os.stat(out_path).st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
    except OSError:
        pass
    os.close(fd)
    w = None
    try:
        w = gguf.GGUFWriter(None, F.ARCH_LLAMA)
        setup(w)
        for j in jobs:
            Q = gguf.GGMLQuantizationType
            if j.qtype == Q.F32:
                w.add_tensor_info(j.name, j.shape, np.dtype(np.float32), j.nbytes())
            elif j.qtype == Q.F16:
                w.add_tensor_info(j.name, j.shape, np.dtype(np.float16), j.nbytes())
            elif j.qtype == Q.I32:
                w.add_tensor_info(j.name, j.shape, np.dtype(np.int32), j.nbytes())
            else:
                byte_shape = gguf.quants.quant_shape_to_byte_shape(j.shape, j.qtype)
                w.add_tensor_info(j.name, byte_shape, np.dtype(np.uint8), j.nbytes(), raw_dtype=j.qtype)
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for j in tqdm(jobs, desc="converting", unit="tensor", disable=not progress):
            data = _encode(j)
            if data.nbytes != j.nbytes():
                raise ConvertError(f"{j.name}: encoded {data.nbytes} bytes, expected {j.nbytes()}")
            w.write_tensor_data(data)
            del data
        w.close()
        w = None
        os.replace(tmp, out_path)
    except BaseException as e:
        if w is not None:
            try:
                w.close()
            except Exception:
                pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ConvertError(f"writing {out_path} failed: {e}") from e
        raise
    return out_path


def check_output_path(out_path: str, inputs: list[str] | None = None) -> None:
    """ConvertError unless out_path can be (re)written as a regular file: its folder
    exists, it is not a folder, device or other special file, and it is none of
    ``inputs`` (files the conversion reads, which it would destroy)."""
    out_dir = os.path.dirname(out_path)
    if os.path.isdir(out_path):
        raise ConvertError(f"output path {out_path} is a directory; give a file name, "
                           f"e.g. {os.path.join(out_path, 'model.gguf')}")
    if not os.path.isdir(out_dir):
        raise ConvertError(f"output folder {out_dir} does not exist")
    if os.path.exists(out_path) and not os.path.isfile(out_path):
        raise ConvertError(f"output path {out_path} exists and is not a regular file "
                           "(a device, pipe or socket); give a file path")
    for src in inputs or ():
        try:
            same = os.path.exists(out_path) and os.path.samefile(out_path, src)
        except OSError:
            same = False
        if same:
            raise ConvertError(f"output path {out_path} is one of the input files ({src}); "
                               "writing it would destroy the model being converted; "
                               "choose another -o")


def _input_files(hf_dir: str, sparse_options=None) -> list[str]:
    """The files a conversion of hf_dir may read: everything in the folder except GGUF
    outputs, plus the calibration text."""
    out = []
    try:
        for name in os.listdir(hf_dir):
            p = os.path.join(hf_dir, name)
            if os.path.isfile(p) and not name.endswith(".gguf"):
                out.append(p)
    except OSError:
        pass
    calib = getattr(sparse_options, "calib", None)
    if calib:
        out.append(os.fspath(calib))
    return out


def convert(hf_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f16",
            progress: bool = True, sparse: bool = False, sparse_options=None,
            report: list | None = None) -> str:
    """Convert the Hugging Face model folder ``hf_dir`` to a GGUF file at
    ``out_path`` with 2-D weights stored as ``outtype`` (one of
    format.OUTTYPES). Returns the absolute output path. Raises ConvertError.

    ``sparse=True`` runs the sparse pipeline (profile, predictors, placement;
    ReLU-family models only) with ``sparse_options``
    (sparse_convert.SparseOptions) and writes one extended GGUF; its
    SparseReport is appended to ``report`` when a list is given. (The CLI makes
    sparse the default for ReLU-family models; this function does not.)"""
    if outtype not in F.OUTTYPES:
        raise ConvertError(f"unknown outtype {outtype!r} (expected one of: {', '.join(F.OUTTYPES)})")
    out_path = os.path.abspath(os.fspath(out_path))
    check_output_path(out_path, _input_files(os.fspath(hf_dir), sparse_options))

    params = read_hf_config(hf_dir)
    tok = read_hf_tokenizer(hf_dir, params.n_vocab, params)
    src = _open_weights(os.fspath(hf_dir))
    try:
        jobs = _plan_tensors(params, src, outtype)
        for j in jobs:
            if j.note:
                log.warning("%s: %s", j.name, j.note)
        log.info("%s: %s, %d layers, d=%d, n_ff=%d, act=%s, %d tensors -> %s (%s)", params.name,
                 params.hf_arch, params.n_layer, params.n_embd, params.n_ff, params.activation,
                 len(jobs), out_path, outtype)
        try:
            if sparse:
                from .sparse_convert import SparseOptions, convert_sparse
                path, rep = convert_sparse(os.fspath(hf_dir), out_path, outtype, params, tok, src, jobs,
                                           sparse_options or SparseOptions(), progress)
                if report is not None:
                    report.append(rep)
                return path
            return write_gguf(out_path, lambda w: _add_metadata(w, params, tok, outtype), jobs, progress)
        except SafetensorsError as e:
            raise ConvertError(str(e)) from None
    finally:
        src.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer_cpp.convert",
                                 description="Convert a Hugging Face LLaMA/Mistral model folder to GGUF.")
    ap.add_argument("hf_dir", help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    ap.add_argument("-o", "--outfile", help="output GGUF path (default: HF_DIR/model-OUTTYPE.gguf)")
    ap.add_argument("--outtype", default="f16", help="f32 | f16 | bf16 | q8_0 | q4_0 (default f16)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar or info messages")
    sp = ap.add_argument_group("sparse conversion (default for ReLU-family models: relu, drelu)")
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--sparse", dest="sparse", action="store_true", default=None,
                      help="profile, train predictors, place neurons and write one extended GGUF "
                           "(default for relu/drelu models; an error for others)")
    mode.add_argument("--dense", dest="sparse", action="store_false", help="plain dense GGUF (no profiling)")
    sp.add_argument("--calib", metavar="FILE",
                    help="calibration text (default: HF_DIR/heldout.txt when the folder ships one; "
                         "required otherwise)")
    sp.add_argument("--calib-tokens", type=int, default=16384, metavar="N",
                    help="tokens of calibration text to profile (default 16384; capped by the text); "
                         "the last 20%% are held out of predictor training")
    sp.add_argument("--predictor-recall", type=float, default=0.99, metavar="R",
                    help="predictor recall target on held-out tokens (default 0.99)")
    sp.add_argument("--predictor-type", choices=("f32", "f16", "q8_0", "q4_0"), default=None,
                    help="storage of the predictors (default: f32 for f32 models, f16 for f16/bf16, "
                         "q8_0 for q8_0/q4_0; q4_0 halves their bytes, pair it with a lower "
                         "--predictor-threshold)")
    sp.add_argument("--predictor-threshold", type=float, default=0.0, metavar="T",
                    help="a neuron is predicted active when its score is >= T (default 0); a lower "
                         "T raises recall and the predicted density")
    sp.add_argument("--sparsity", type=float, default=None, metavar="S",
                    help="training-free gate-magnitude sparsity for any gated FFN (SwiGLU, GeGLU, "
                         "ReGLU): calibrate per layer the |act(gate)| threshold that zeroes the "
                         "share S of the neurons (e.g. 0.5) instead of training predictors; implies "
                         "--sparse")
    sp.add_argument("--vram-budget", default="0", metavar="SIZE",
                    help="GPU memory for the model, e.g. 4G, 512M (default 0: CPU only; "
                         "re-solve later with python -m powerinfer_cpp.place)")
    sp.add_argument("--ctx", type=int, default=None, metavar="N",
                    help="context length whose KV cache the budget reserves (default: the model's)")
    sp.add_argument("--group-size", type=int, default=64, metavar="N", help="neurons per placement group (default 64)")
    sp.add_argument("--placement", choices=("ilp", "greedy"), default="ilp", help="placement solver (default ilp)")
    sp.add_argument("--threads", type=int, default=0, help="threads for profiling (default: all cores)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    out = args.outfile or os.path.join(args.hf_dir, f"model-{args.outtype}.gguf")
    try:
        sparse = args.sparse
        sopts = None
        if args.sparsity is not None and sparse is False:
            raise ConvertError("--sparsity calibrates a sparse file; it cannot be combined with --dense")
        if sparse is not False:
            params = read_hf_config(args.hf_dir)
            if sparse is None:
                sparse = params.activation in F.SPARSE_ACTIVATIONS or args.sparsity is not None
            if sparse:
                from .placement import parse_size
                from .sparse_convert import SparseOptions
                try:
                    budget = parse_size(args.vram_budget)
                except ValueError as e:
                    raise ConvertError(f"--vram-budget: {e}") from None
                if budget >= 2**63:
                    raise ConvertError(f"--vram-budget {args.vram_budget} is too large "
                                       "(at most 8 EiB)")
                if args.ctx is not None and not 1 <= args.ctx < 2**31:
                    raise ConvertError(f"--ctx must be a positive number of tokens, got {args.ctx}")
                if not 0 <= args.threads <= 512:
                    raise ConvertError(f"--threads must be between 0 (all cores) and 512, "
                                       f"got {args.threads}")
                sopts = SparseOptions(calib=args.calib, calib_tokens=args.calib_tokens,
                                      predictor_recall=args.predictor_recall, vram_budget=budget, ctx=args.ctx,
                                      group_size=args.group_size, placement=args.placement,
                                      n_threads=args.threads, predictor_type=args.predictor_type,
                                      threshold=args.predictor_threshold, sparsity=args.sparsity)
        path = convert(args.hf_dir, out, args.outtype, progress=not args.quiet, sparse=bool(sparse),
                       sparse_options=sopts)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RuntimeError) as e:  # e.g. the native runtime while profiling
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # run the package's module, not this __main__ copy, so that ConvertError raised by
    # the modules it imports (sparse_convert imports powerinfer_cpp.convert) is caught
    from powerinfer_cpp.convert import main as _main
    sys.exit(_main())
