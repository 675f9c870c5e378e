"""What an architecture module declares, and the config.json helpers they share.

An architecture module (``arch_llama.py``, ``arch_qwen2.py``, ...) builds one
``Architecture``: the Hugging Face ``architectures`` / ``model_type`` values it takes,
``read_config`` (config.json -> validated ``HFParams``), ``tensors`` (every GGUF tensor
with the HF tensor(s) it comes from and the transform between them) and ``keys`` (the
metadata it writes beyond the keys every architecture has, see metadata.py).
``registry.py`` collects them; the pipeline only talks to that interface.

To add an architecture: write ``arch_NAME.py`` with its ``ARCH``, list it in
registry.py, name its new keys and tensors in format.py and document them in
docs/FORMAT.md (docs/FORMAT.md "Adding an architecture").
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from .. import format as F
from ..gguf_write import KV, ConvertError

log = logging.getLogger("powerinfer_cpp.convert")

NORM_RMS = "rms"      # RMSNorm, weight only
NORM_LAYER = "layer"  # LayerNorm with weight and bias


@dataclass
class HFParams:
    """Hyper-parameters of a model, read from its config.json by its architecture."""
    hf_arch: str                   # the HF class (config.json architectures[0])
    arch: str                      # GGUF general.architecture (format.ARCHITECTURES)
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    norm_eps: float
    norm: str = NORM_RMS
    rope_theta: float | None = 10000.0  # None: no RoPE (learned positions)
    rope_scaling_type: str = F.ROPE_SCALING_NONE
    rope_scaling_factor: float = 1.0
    rope_freqs: np.ndarray | None = None  # llama3 scaling: f32[head_dim/2] frequency divisors
    activation: str = F.ACT_SILU
    hf_hidden_act: str = "silu"
    act_threshold: float | None = None    # fatrelu only
    gated: bool = True                    # the FFN has a gate projection
    tied: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    layout: dict = field(default_factory=dict)  # architecture-specific facts (falcon's QKV layout, ...)
    # mixture of experts (n_expert 0: a dense FFN)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0                     # an expert's FFN width
    n_ff_shexp: int = 0                   # the shared expert's width (0: none)
    expert_norm: bool = False             # renormalise the top-k routing weights
    expert_gating: int = F.EXPERT_GATING_SOFTMAX  # the router's gating (format.EXPERT_GATING_*)
    n_rot: int | None = None              # RoPE over the first n_rot dims of a head (None: all)


@dataclass
class TensorMap:
    """One GGUF tensor: where its data comes from in the HF checkpoint."""
    name: str                                 # GGUF tensor name
    kind: str                                 # format.T_* (decides the storage type)
    shape: tuple[int, ...]                    # numpy shape written
    sources: tuple[str, ...] = ()             # HF tensor names read (none: computed)
    source_shapes: tuple[tuple[int, ...], ...] = ()  # their expected shapes
    transform: Callable[..., np.ndarray] | None = None  # f(*source arrays) -> array of `shape`
    raw_type: str | None = None               # GGML type name: transform returns the tensor's
    #                                           bytes in it, written as they are (any outtype;
    #                                           sources read as stored: gpt-oss's MXFP4)
    alternatives: tuple["TensorMap", ...] = ()  # the same tensor in other checkpoint layouts,
    #                                           taken when this one's sources are absent


def direct(name: str, kind: str, hf_name: str, shape: tuple[int, ...],
           transform: Callable[..., np.ndarray] | None = None) -> TensorMap:
    """A tensor copied (or transformed in place) from one HF tensor of the same shape."""
    return TensorMap(name, kind, tuple(shape), (hf_name,), (tuple(shape),), transform)


@dataclass(frozen=True)
class Architecture:
    """One architecture: the HF models it takes and how they map to our GGUF."""
    name: str                                   # GGUF general.architecture
    hf_classes: tuple[str, ...]                 # config.json "architectures" values
    model_types: dict[str, str]                 # config.json "model_type" -> HF class (no architectures)
    read_config: Callable[["Config", str], HFParams]     # (config, HF class) -> params
    tensors: Callable[[HFParams], list[TensorMap]]       # in file order
    keys: Callable[[HFParams], list[KV]] = lambda p: []  # beyond metadata.py's common keys
    ignored: re.Pattern | None = None           # HF tensors that are not part of the model
    ignored_for: Callable[[HFParams, str], bool] | None = None  # the same, by the config
    #                                             (GLM-4.5's prediction layers past n_layer)
    tied_head: str = "lm_head.weight"           # HF head tensor, ignored when tied
    canonical: Callable[[str], str] = lambda n: n  # an HF name's spelling -> the one tensors() uses


# ==========================================================================
# config.json helpers
# ==========================================================================

class Config:
    """A parsed config.json with validating getters (errors name the key)."""

    def __init__(self, cfg: dict, folder: str):
        self.cfg = cfg
        self.folder = folder

    @property
    def name(self) -> str:
        return os.path.basename(os.path.abspath(self.folder))

    def get(self, key: str, default: Any = None) -> Any:
        return self.cfg.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.cfg

    def int(self, key: str, default: int | None = None) -> int:
        """A positive integer (``default`` when the key is absent or null)."""
        v = self.cfg.get(key)
        if v is None and default is not None:
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConvertError(f"config.json: {key!r} missing or not a positive integer ({v!r})")
        return v

    def number(self, key: str, default: float) -> float:
        """A finite number (``default`` when absent or null)."""
        v = self.cfg.get(key)
        if v is None:
            return float(default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConvertError(f"config.json: {key!r} must be a number, not {v!r}")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        """A boolean (``default`` when absent or null)."""
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConvertError(f"config.json: {key!r} must be true or false, not {v!r}")
        return v

    def token_id(self, key: str) -> int | None:
        v = self.cfg.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    def n_ctx(self) -> int:
        n = self.cfg.get("max_position_embeddings")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            log.warning("config.json has no max_position_embeddings; assuming 2048")
            return 2048
        return n

    def refuse(self, key: str, bad: Callable[[Any], bool], why: str) -> None:
        """ConvertError naming key and value when ``bad(value)``."""
        v = self.cfg.get(key)
        if bad(v):
            raise ConvertError(f"unsupported: config.json {key}={_json(v)} ({why})")


def _json(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return repr(v)


def act_kind(hidden_act: Any, use_drelu: Any = None, gated: bool = True,
             key: str = "hidden_act") -> str:
    """Our activation kind (format.ACTIVATIONS) for an HF activation name."""
    act = str(hidden_act).lower()
    if act == "drelu":
        kind = F.ACT_DRELU
    elif act == "relu":
        kind = F.ACT_RELU
    elif act == "fatrelu":
        kind = F.ACT_FATRELU
    elif act in ("silu", "swish"):
        kind = F.ACT_SILU
    elif act in ("gelu", "gelu_python"):
        kind = F.ACT_GELU_ERF
    elif act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_tanh"):
        kind = F.ACT_GELU
    elif act.startswith("gelu"):
        log.warning("%s %r: stored as %r (tanh-approximated GELU)", key, hidden_act, F.ACT_GELU)
        kind = F.ACT_GELU
    else:
        raise ConvertError(f"unsupported {key} {hidden_act!r} (supported: relu, drelu, fatrelu, "
                           "silu/swish, gelu*)")
    if use_drelu is not None and not isinstance(use_drelu, bool):
        raise ConvertError(f"config.json: use_drelu must be true or false, not {use_drelu!r}")
    if use_drelu:
        if kind not in (F.ACT_RELU, F.ACT_DRELU):
            raise ConvertError(f"config.json: use_drelu is true but {key} is {hidden_act!r} "
                               "(dReLU needs hidden_act relu or drelu)")
        kind = F.ACT_DRELU
    if not gated and kind == F.ACT_DRELU:
        raise ConvertError(f"config.json: {key} {hidden_act!r}: dReLU needs a gated FFN, "
                           "this architecture's FFN has no gate")
    return kind


def act_threshold(c: Config, kind: str) -> float | None:
    """FATReLU's threshold (ProSparse: config.json ``hidden_act_param``); None otherwise."""
    if kind != F.ACT_FATRELU:
        return None
    if c.get("hidden_act_param") is None:
        raise ConvertError("config.json: hidden_act 'fatrelu' needs hidden_act_param (its threshold)")
    return c.number("hidden_act_param", 0.0)


@dataclass
class Rope:
    theta: float
    scaling_type: str = F.ROPE_SCALING_NONE
    factor: float = 1.0
    freqs: np.ndarray | None = None  # llama3
    partial: float = 1.0             # the share of each head that rotates (partial_rotary_factor)


def read_rope(c: Config, head_dim: int, allow_llama3: bool = False,
              partial_default: float | None = None) -> Rope:
    """RoPE base and scaling from either the transformers>=5 ``rope_parameters`` dict or
    the older ``rope_theta`` + ``rope_scaling``; with ``partial_default`` (the architecture
    rotates part of each head: GLM-4.5's 0.5 when the config does not say) the
    ``partial_rotary_factor`` is read, else refused unless 1."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
        scaling = rp
    else:
        theta = c.get("rope_theta", 10000.0)
        scaling = c.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConvertError(f"config.json: malformed rope scaling {scaling!r}")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ConvertError(f"config.json: rope_theta must be a positive number, not {theta!r}")
    prf = scaling.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    partial = 1.0
    if partial_default is not None:
        partial = partial_default if prf is None else prf
        if (not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1
                or int(head_dim * partial) % 2 or int(head_dim * partial) == 0):
            raise ConvertError(f"config.json: partial_rotary_factor={partial!r} must be in (0, 1] and "
                               f"rotate an even number of the {head_dim} head dims")
        partial = float(partial)
    elif prf is not None and prf != 1 and prf != 1.0:
        raise ConvertError(f"unsupported: config.json partial_rotary_factor={prf!r} "
                           "(RoPE over part of the head)")
    rtype = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rtype in ("default", "none"):
        return Rope(float(theta), partial=partial)
    if partial != 1.0:
        raise ConvertError(f"unsupported: rope scaling {rtype!r} with partial_rotary_factor={partial} "
                           "(scaled RoPE over part of the head)")
    if rtype == "linear":
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ConvertError(f"config.json: linear rope scaling needs a positive factor, got {factor!r}")
        return Rope(float(theta), F.ROPE_SCALING_LINEAR, float(factor))
    if rtype == "llama3" and allow_llama3:
        if scaling.get("original_max_position_embeddings") is None:  # transformers' fallback
            scaling = {**scaling, "original_max_position_embeddings": c.get("max_position_embeddings")}
        return Rope(float(theta), freqs=llama3_rope_freqs(scaling, float(theta), head_dim))
    supported = "none, linear, llama3" if allow_llama3 else "none, linear"
    raise ConvertError(f"unsupported rope scaling {rtype!r} (supported: {supported})")


def llama3_rope_freqs(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama-3 scaling: per frequency i the divisor
    inv_freq[i] / inv_freq_scaled[i], with inv_freq_scaled as transformers computes it
    (``_compute_llama3_parameters``): high frequencies kept (1), low ones divided by
    ``factor``, a smooth interpolation between the two wavelength bounds."""
    def pos(key: str) -> float:
        v = scaling.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ConvertError(f"config.json: llama3 rope scaling needs a positive {key}, got {v!r}")
        return float(v)

    factor, low, high = pos("factor"), pos("low_freq_factor"), pos("high_freq_factor")
    old_ctx = pos("original_max_position_embeddings")
    if not high > low:
        raise ConvertError(f"config.json: llama3 rope scaling needs high_freq_factor ({high}) > "
                           f"low_freq_factor ({low})")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    scaled = np.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return (inv_freq / scaled).astype(np.float32)


def heads(c: Config, n_embd: int, n_head: int, kv_key: str = "num_key_value_heads",
          head_dim_key: str | None = "head_dim") -> tuple[int, int]:
    """(n_head_kv, head_dim) with GQA and an explicit head size validated."""
    n_head_kv = c.get(kv_key) or n_head
    if not isinstance(n_head_kv, int) or n_head_kv <= 0 or n_head % n_head_kv:
        raise ConvertError(f"config.json: {kv_key}={n_head_kv!r} must divide num_attention_heads={n_head}")
    head_dim = c.get(head_dim_key) if head_dim_key else None
    if head_dim is None:
        if n_embd % n_head:
            raise ConvertError(f"config.json: hidden_size {n_embd} is not a multiple of num_attention_heads {n_head}")
        head_dim = n_embd // n_head
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ConvertError(f"config.json: head_dim {head_dim!r} must be a positive even integer")
    return n_head_kv, head_dim


def sliding_window(c: Config, n_ctx: int, arch: str) -> int | None:
    """The sliding window worth keeping as a key (llama: informational), or None."""
    sw = c.get("sliding_window")
    if sw is not None and (not isinstance(sw, int) or isinstance(sw, bool) or sw <= 0):
        sw = None
    if sw is not None and sw < n_ctx:
        log.warning("config.json: sliding_window=%d < context length %d; stored as "
                    "%s, but the runtime attends to the full context", sw, n_ctx,
                    F.arch_key(F.KEY_SLIDING_WINDOW, arch))
    return sw


# ==========================================================================
# mixture of experts (shared by the MoE architectures)
# ==========================================================================

@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoints keep one layer's experts, relative to the layer prefix
    (``{e}``: the expert's index, ``{proj}``: one of gate / up / down below). These are the
    per-expert names published checkpoints (and transformers' save_pretrained) use;
    transformers >= 5 fuses them only in memory."""
    router: str                     # [n_expert, d]
    expert: str                     # e.g. "mlp.experts.{e}.{proj}.weight"
    gate: str = "gate_proj"         # Mixtral: w1
    up: str = "up_proj"             # Mixtral: w3
    down: str = "down_proj"         # Mixtral: w2
    shared: str | None = None       # the shared expert, "mlp.shared_expert.{proj}.weight"
    shared_gate: str | None = None  # its sigmoid gate [1, d]
    # The fused layout transformers >= 5 keeps in memory, which a checkpoint written from its
    # state_dict carries: "{fused}.gate_up_proj" [n_expert, 2 ff, d] (gate rows first) and
    # "{fused}.down_proj" [n_expert, d, ff]; the router then sits at fused_router.
    fused: str = "mlp.experts"
    fused_router: str = "mlp.gate.weight"


#: The expert count's names: configs spell it either way (transformers >= 5 saves Qwen3-MoE's
#: as num_local_experts, the released checkpoints say num_experts).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def read_experts(c: Config, ff_exp: int, norm: bool,
                 used_key: str = "num_experts_per_tok") -> tuple[int, int]:
    """(n_expert, n_expert_used) of a MoE config.json, validated (ff_exp: the experts'
    width, already read; norm: whether the architecture renormalises, for the log)."""
    count_key = next((k for k in EXPERT_COUNT_KEYS if c.get(k) is not None), EXPERT_COUNT_KEYS[0])
    n_expert = c.int(count_key)
    used = c.int(used_key)
    if used > n_expert:
        raise ConvertError(f"config.json: {used_key}={used} is more than {count_key}={n_expert}")
    if ff_exp <= 0:
        raise ConvertError(f"config.json: the experts' width must be positive, not {ff_exp}")
    log.info("mixture of experts: %d experts of width %d, top-%d%s", n_expert, ff_exp, used,
             ", renormalised" if norm else "")
    return n_expert, used


def refuse_dense_layers(c: Config) -> None:
    """ConvertError when some layers have a dense FFN in place of the experts (Qwen-MoE's
    decoder_sparse_step > 1 or mlp_only_layers): the runtime runs experts in every layer."""
    c.refuse("decoder_sparse_step", lambda v: v not in (None, 1),
             "some layers would have a dense FFN; every layer must be a mixture of experts")
    c.refuse("mlp_only_layers", lambda v: bool(v),
             "these layers have a dense FFN; every layer must be a mixture of experts")


def expert_tensors(p: HFParams, il: int, pre: str, names: ExpertNames) -> list[TensorMap]:
    """Layer il's MoE tensors: the router (kept F32), each of gate / up / down of all
    experts stacked into llama.cpp's 3-D tensor, and the shared expert with its gate."""
    d, ff, ne = p.n_embd, p.n_ff_exp, p.n_expert

    def stacked(kind: str, proj: str, rows: int, cols: int) -> TensorMap:
        srcs = tuple(pre + names.expert.format(e=e, proj=proj) for e in range(ne))
        return TensorMap(F.tensor_name(kind, il), kind, (ne, rows, cols), srcs, ((rows, cols),) * ne,
                         lambda *a: np.stack(a))

    gate_up, down = pre + names.fused + ".gate_up_proj", pre + names.fused + ".down_proj"

    def fused(kind: str, src: str, shape: tuple[int, ...], part: slice | None) -> TensorMap:
        rows, cols = (ff, d) if part is not None else (d, ff)
        return TensorMap(F.tensor_name(kind, il), kind, (ne, rows, cols), (src,), (shape,),
                         (lambda a: a[:, part, :]) if part is not None else None)

    router = direct(F.tensor_name(F.T_FFN_GATE_INP, il), F.T_FFN_GATE_INP, pre + names.router, (ne, d))
    if names.fused_router != names.router:
        router = replace(router, alternatives=(
            direct(router.name, router.kind, pre + names.fused_router, (ne, d)),))
    out = [router,
           replace(stacked(F.T_FFN_GATE_EXPS, names.gate, ff, d),
                   alternatives=(fused(F.T_FFN_GATE_EXPS, gate_up, (ne, 2 * ff, d), slice(0, ff)),)),
           replace(stacked(F.T_FFN_UP_EXPS, names.up, ff, d),
                   alternatives=(fused(F.T_FFN_UP_EXPS, gate_up, (ne, 2 * ff, d), slice(ff, 2 * ff)),)),
           replace(stacked(F.T_FFN_DOWN_EXPS, names.down, d, ff),
                   alternatives=(fused(F.T_FFN_DOWN_EXPS, down, (ne, d, ff), None),))]
    if names.shared is not None:
        fs = p.n_ff_shexp
        if names.shared_gate is not None:  # (DeepSeek-V3's shared experts have no gate)
            out.append(TensorMap(F.tensor_name(F.T_FFN_GATE_INP_SHEXP, il), F.T_FFN_GATE_INP_SHEXP, (d,),
                                 (pre + names.shared_gate,), ((1, d),), lambda a: a.reshape(-1)))
        for kind, proj, shape in ((F.T_FFN_GATE_SHEXP, "gate_proj", (fs, d)),
                                  (F.T_FFN_UP_SHEXP, "up_proj", (fs, d)),
                                  (F.T_FFN_DOWN_SHEXP, "down_proj", (d, fs))):
            out.append(direct(F.tensor_name(kind, il), kind, pre + names.shared.format(proj=proj), shape))
    return out

