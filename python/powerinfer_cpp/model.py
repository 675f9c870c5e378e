"""Model: a GGUF file loaded by the runtime (shared by all its contexts), its
hyper-parameters, device placement, tokens and embeddings.

The pieces it is built from live beside it: handles.py (native ownership, enum names),
context.py (Context, ContextState), generation.py (Generation, the stream, eval_batch,
Sampler, Completion) and arguments.py (the generation arguments' checks). Their public names
are importable from here as before."""

from __future__ import annotations

import os
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from . import embeddings as E
from ._native import NativeError, check, ffi, lib
from .context import Context, ContextState
from .generation import Completion, Generation, Sampler, eval_batch
from .handles import (ACT_NAMES, CACHE_TYPES, FFN_MODES, LOAD_MODES, TYPE_NAMES, ModelHandle,
                      NativeHandle, cache_type_id, ffn_mode_id)
from .preflight import load_error
from .sizes import parse_size
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["Model", "ModelInfo", "Context", "ContextState", "Completion", "Generation",
           "Sampler", "eval_batch", "device_available", "parse_size", "FFN_MODES", "CACHE_TYPES"]


@dataclass(frozen=True)
class ModelInfo:
    """Hyper-parameters and sizes of a loaded model."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    ffn_act: str
    act_from_file: bool
    tied_output: bool
    bos_id: int
    eos_id: int
    weight_type: str
    rms_eps: float
    rope_theta: float
    n_params: int
    n_bytes: int
    # sparse extension (format.py "Sparse extension"); 0 for a plain dense file
    has_predictor: int = 0       # number of layers with a predictor (fc1 + fc2)
    has_down_t: int = 0          # number of layers whose down projection is ffn_down_t
    sparse_threshold: float = 0.0  # powerinfer.sparse.threshold
    has_gate_threshold: bool = False  # powerinfer.sparse.gate_threshold (the "gate" mode)
    has_input_sparsity: bool = False  # input-sparse projections (attn_qkv_t, ..., output_t)
    # mixture of experts (docs/FORMAT.md "Mixture of experts"); n_expert 0: a dense FFN
    n_expert: int = 0            # experts per layer
    n_expert_used: int = 0       # experts each token runs (top-k)
    n_ff_exp: int = 0            # an expert's FFN width
    n_ff_shexp: int = 0          # the shared expert's width (0: none)
    expert_norm: bool = False    # the top-k routing weights are renormalised


class Model(ModelHandle):
    """A model loaded from a GGUF file (shared by all its contexts).

    `Model(path, n_ctx=..., n_threads=...)` also sets up a default context, so
    `model.generate(...)`, `model.stream(...)`, `model.eval(...)` and
    `model.perplexity(...)` work directly; `create_context()` makes more.

    Loading checks the norm weights for NaN/Inf; `check_weights=True` scans every
    tensor (reads the whole file). Findings are in `model.warnings` and are also
    emitted as RuntimeWarning.

    `ffn` chooses how contexts compute the feed-forward: "dense", "sparse" (predictor;
    needs a file converted with --sparse), "oracle" (exact active set, dense results;
    for tests), "gate", "file" (the file's own mode: sparse when it has predictors in every
    layer, else gate when it has gate thresholds, else dense) or "auto" (the file's mode
    where estimated faster than dense on this machine, else dense: gh_model_ffn_auto).
    Contexts made by create_context() default to it too.

    `input_sparse` (None: on when the file has it) runs the attention's and the head's
    projections input-sparse in the sparse and gate FFN modes (files converted with
    --input-sparsity; True for a file without it raises).

    `device` puts the model on a device: "cpu" (default), "cuda" / "cuda:N" (a build
    with nvcc) or "host-device" (a simulated device in host RAM that runs the whole
    hybrid path anywhere). `vram_budget` (bytes, or a size like "6G" / "512M"; None =
    the device's free memory minus 256 MiB) bounds what goes there: attention weights,
    predictors and the output head first, then the hot FFN neurons of the file's GPU
    index, or, when that index does not fit or `reset_gpu_index` is set, hot neurons
    placed at load. `device_info()` says what was placed and why.

    A mixture-of-experts model on a device gets attention, routers and head first, then
    its shared experts (qwen2moe: every token runs them), then
    whole experts: the file's expert placement (`python -m powerinfer_cpp.place
    --profile`), else the most frequently selected first, else in layer order.
    `n_cpu_moe` keeps the routed experts of the first N layers on the CPU (llama.cpp's
    --n-cpu-moe; a shared expert does not count, as there); `expert_cache` (bytes or a size) gives each context a device cache of
    recently used CPU experts (LRU), taken from the budget before the experts are placed.
    `expert_placement()` says which experts are on the device; a context's
    `stats()["experts"]` counts device / CPU expert runs and the cache's hits and uploads.

    `load` says how the weights reach memory: "read" copies the file into private
    memory in 2 MiB (transparent huge) pages, which the scattered rows of the sparse FFN
    need to avoid TLB misses; "mmap" maps the file (shared page cache, nothing copied);
    "auto" (default) reads when the kernel offers huge pages and the file fits in the
    available memory with 1 GiB to spare, else maps. `model.load_mode` says which.
    """

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 0, n_threads: int = 0,
                 n_batch: int = 512, check_weights: bool = False, ffn: str = "auto",
                 device: str = "cpu", vram_budget: int | str | None = None,
                 reset_gpu_index: bool = False, load: str = "auto", cache_type: str = "f16",
                 input_sparse: bool | None = None, n_cpu_moe: int = 0,
                 expert_cache: int | str | None = None):
        path = os.fspath(path)
        if load not in LOAD_MODES:
            raise ValueError(f"load must be one of {', '.join(LOAD_MODES)}, not {load!r}")
        if not os.path.exists(path):
            raise FileNotFoundError(f"model file not found: '{path}'")
        if os.path.isdir(path):
            raise IsADirectoryError(
                f"'{path}' is a directory; pass a .gguf file (convert a Hugging Face folder with "
                "`python -m powerinfer_cpp.convert DIR -o MODEL.gguf`)")
        self.path = path
        if not isinstance(device, str):
            raise TypeError(f"device must be a string ({', '.join(device_names())}), not "
                            f"{type(device).__name__}")
        budget = -1 if vram_budget is None else parse_size(vram_budget, "vram_budget")
        if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
            raise ValueError(f"n_cpu_moe must be a number of layers >= 0, not {n_cpu_moe!r}")
        cache = 0 if expert_cache is None else parse_size(expert_cache, "expert_cache")
        t0 = time.perf_counter()
        out = ffi.new("gh_model **")
        params = ffi.new("gh_model_params *")
        dev = ffi.new("char[]", device.encode())
        params.device = dev
        params.vram_budget = budget
        params.reset_gpu_index = 1 if reset_gpu_index else 0
        params.load = LOAD_MODES[load]
        params.n_cpu_moe = n_cpu_moe
        params.expert_cache = cache
        try:
            check(lib.gh_model_load_ex(path.encode(), params, out))
        except NativeError as e:
            # the loader stops at the first problem; a downloaded file often has several, so
            # the header is checked (only now: a successful load never pays for it) and the
            # error names them all
            err = load_error(path, e)
            if err is e:
                raise
            raise err from None
        self._ptr = out[0]
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        try:
            info = ffi.new("gh_model_info *")
            check(lib.gh_model_info_get(self._ptr, info))
            self.info = _info_from_c(info)
            if check_weights:
                check(lib.gh_model_check_weights(self._ptr, ffi.NULL))
            text = ffi.string(lib.gh_model_warnings(self._ptr)).decode("utf-8", "replace")
            self.warnings: list[str] = text.splitlines()
            for w in self.warnings:
                warnings.warn(f"{path}: {w}", RuntimeWarning, stacklevel=2)
            self.tokenizer: Tokenizer = load_tokenizer(path)
            if self.tokenizer.n_vocab > self.info.n_vocab:
                raise ValueError(
                    f"{path}: the tokenizer has {self.tokenizer.n_vocab} tokens but the model's "
                    f"embedding only {self.info.n_vocab}")
            ffn_mode_id(ffn)  # a bad name fails here, not at the first use
            cache_type_id(cache_type)  # a bad name fails here, not at the first use
            self._ctx_defaults = dict(n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch,
                                      cache_type=cache_type, input_sparse=input_sparse)
            if input_sparse and not self.info.has_input_sparsity:
                raise ValueError(
                    f"{path}: input_sparse=True needs the input-sparse projections (transposed "
                    "attention and head weights with calibrated input thresholds), which this "
                    "file has not: convert the model with --input-sparsity S")
            self.ffn = ffn
            self._default_ctx: Context | None = None
        except BaseException:
            self.close()
            raise
        self.load_time = time.perf_counter() - t0

    # -- lifetime ---------------------------------------------------------------

    _closed_msg = "this Model has been closed"

    def close(self) -> None:
        """Free the model and every context made from it, each after the call it is running
        on another thread (a paused stream raises when resumed); later use raises."""
        with self._lock:
            for ctx in list(getattr(self, "_contexts", ())):
                ctx.close()
            super().close()

    def _free(self, ptr) -> None:
        lib.gh_model_free(ptr)

    def _load_draft(self, path) -> Model:
        d = self._ctx_defaults
        return Model(path, n_threads=d["n_threads"], n_batch=d["n_batch"])

    @property
    def load_mode(self) -> str:
        """How the weights were loaded: "read" (private memory, huge pages) or "mmap"."""
        with self._calling() as ptr:
            return "read" if lib.gh_model_load_mode(ptr) == lib.GH_LOAD_READ else "mmap"

    # -- device -----------------------------------------------------------------

    def device_info(self) -> dict:
        """Where the model runs: device, budget, bytes placed (dense parts, hot neurons),
        hot neuron count and share, what lies on the device, and the loader's note."""
        d = ffi.new("gh_device_info *")
        with self._calling() as ptr:
            check(lib.gh_model_device_info(ptr, d))
        return {
            "device": ffi.string(d.device).decode(),
            "budget": d.budget,
            "file_budget": None if d.file_budget < 0 else d.file_budget,
            "used_bytes": d.used_bytes,
            "dense_bytes": d.dense_bytes,
            "hot_bytes": d.hot_bytes,
            "n_hot": d.n_hot,
            "hot_share": d.n_hot / d.n_neurons if d.n_neurons else 0.0,
            "attention_layers": d.n_attention_layers,
            "predictor_layers": d.n_predictor_layers,
            "hot_layers": d.n_hot_layers,
            "head_on_device": bool(d.head_on_device),
            "index_source": {0: "none", 1: "file", 2: "load"}.get(d.index_source, "?"),
            "resolved": d.index_source == 2,
            "note": ffi.string(d.note).decode("utf-8", "replace"),
            "experts": {
                "n_experts": d.n_experts,
                "device": d.n_experts_device,
                "bytes": d.expert_bytes,
                "cache_bytes": d.expert_cache_bytes,
                "cache_slots": d.expert_cache_slots,
                "source": {0: "none", 1: "file", 2: "frequency", 3: "layer order"}.get(
                    d.expert_source, "?"),
                # the shared experts (qwen2moe) on the device: those of the first
                # shared_device layers, placed before the cache and the routed experts
                "shared_device": d.n_shexp_device,
                "shared_bytes": d.shexp_bytes,
                # sparse experts (ffn_down_exps_t) with hot neurons on the device (their
                # neurons in n_hot / hot_bytes; expert_hot_counts() says which)
                "hot_experts": d.n_hot_experts,
            },
        }

    def expert_placement(self) -> np.ndarray:
        """Mixture-of-experts models: bool [n_layer, n_expert], True where the expert was
        placed on the device (all False on the CPU; [n_layer, 0] without experts)."""
        out = np.zeros((self.info.n_layer, self.info.n_expert), dtype=np.int8)
        with self._calling() as ptr:
            check(lib.gh_model_expert_placement(ptr, ffi.cast("int8_t *", out.ctypes.data), out.size))
        return out.astype(bool)

    def expert_hot_counts(self) -> np.ndarray:
        """Sparse experts (ffn_down_exps_t): int32 [n_layer, n_expert], the neurons of each
        expert whose rows are on the device (docs/FORMAT.md "Hot neurons of experts"; all 0
        on the CPU)."""
        out = np.zeros((self.info.n_layer, self.info.n_expert), dtype=np.int32)
        with self._calling() as ptr:
            check(lib.gh_model_expert_hot_counts(ptr, ffi.cast("int32_t *", out.ctypes.data), out.size))
        return out

    # -- tokens -----------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.info.n_vocab

    @property
    def eos_id(self) -> int:
        eos = self.tokenizer.eos_id
        return self.info.eos_id if eos is None else eos

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text` (BOS added as the file says unless add_bos is given)."""
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    # -- contexts ---------------------------------------------------------------

    def create_context(self, n_ctx: int = 0, n_threads: int = 0, n_batch: int = 512,
                       ffn: str | None = None, cache_type: str | None = None,
                       input_sparse: bool | None = None) -> Context:
        """A new context (own KV cache) over this model; n_ctx 0 = training context;
        ffn / cache_type / input_sparse None = the model's setting."""
        with self._lock:  # not freed by a close() on another thread meanwhile
            return Context(self, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch,
                           ffn=self.ffn if ffn is None else ffn,
                           cache_type=(self._ctx_defaults["cache_type"] if cache_type is None
                                       else cache_type),
                           input_sparse=(self._ctx_defaults["input_sparse"] if input_sparse is None
                                         else input_sparse))

    @property
    def context(self) -> Context:
        """The default context, created on first use with the constructor's settings."""
        with self._lock:
            if self._default_ctx is None or self._default_ctx._ptr is None:
                self._default_ctx = self.create_context(**self._ctx_defaults)
            return self._default_ctx

    def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        """Context.generate on the default context (keeps the cached common prefix)."""
        return self.context.generate(prompt, **kw)

    def stream(self, prompt: str | Sequence[int], **kw) -> Iterator[str]:
        """Context.stream on the default context (keeps the cached common prefix)."""
        return self.context.stream(prompt, **kw)

    def eval(self, tokens: Sequence[int], logits_all: bool = False) -> np.ndarray:
        """Context.eval on the default context (appends to its cache)."""
        return self.context.eval(tokens, logits_all=logits_all)

    def perplexity(self, text: str) -> float:
        """Context.perplexity on the default context."""
        return self.context.perplexity(text)

    # -- embeddings (embeddings.py) --------------------------------------------

    @property
    def pooling(self) -> str:
        """How embed() pools tokens by default: the file's {arch}.pooling_type ("mean",
        "last", "cls", "none"), "mean" when it names none."""
        if getattr(self, "_pooling", None) is None:
            self._pooling = E.file_pooling(self.path, self.info.arch) or E.DEFAULT_POOLING
        return self._pooling

    def embed(self, input, *, pooling: str | None = None, normalize: bool = True,
              truncate: bool = False, context: Context | None = None) -> np.ndarray:
        """Embedding vectors of `input` (a str, a list of token ids, or a list of either):
        the final hidden states (after the output norm) pooled as `pooling` says (None: the
        file's, see `pooling`) and L2-normalised unless normalize=False. One input gives
        [n_embd] ([n_tokens, n_embd] with pooling "none"), a list one row per input (a list
        of arrays with "none"). An input longer than the context raises EmbeddingError, or
        is cut to it with truncate. Runs on the default context (or `context`), whose
        cache then holds the last input."""
        pooling = self.pooling if pooling is None else E.check_pooling(pooling)
        ctx = self.context if context is None else context
        n_ctx = ctx.n_ctx
        items, single = E.inputs_list(input)
        ids = [E.input_ids(self, x, n_ctx, truncate, "input" if single else f"input[{i}]")
               for i, x in enumerate(items)]
        vecs = [E.embed_ids(ctx, x, pooling, normalize) for x in ids]
        if single:
            return vecs[0]
        return vecs if pooling == "none" else np.stack(vecs)



def device_available(device: str) -> tuple[bool, str]:
    """(True, "") if `device` ("cpu", or a name of `device_kinds()`) can run here, else
    (False, the reason)."""
    if lib.gh_device_check(device.encode()) == 0:
        return True, ""
    return False, ffi.string(lib.gh_last_error()).decode("utf-8", "replace")


@dataclass(frozen=True)
class DeviceKind:
    """A kind of device the library knows: a row of its backend registry
    (ggml-hybrid/src/backend/registry.c)."""
    name: str          # "host-device", "cuda"
    indexed: bool      # "name:N" is device N
    accelerator: bool  # real hardware (what n_gpu_layers / -ngl ask for); False: simulated
    built: bool        # this build has it


def device_kinds() -> tuple[DeviceKind, ...]:
    """The library's device kinds, in its registry's order ("cpu", no device, is none)."""
    out = []
    kind = ffi.new("gh_device_kind *")
    for i in range(lib.gh_device_kind_count()):
        check(lib.gh_device_kind_get(i, kind))
        out.append(DeviceKind(ffi.string(kind.name).decode(), bool(kind.indexed),
                              bool(kind.accelerator), bool(kind.built)))
    return tuple(out)


def device_names() -> list[str]:
    """Every name a device is asked for by: "cpu", then each kind ("name" and "name:N"
    for an indexed one)."""
    names = ["cpu"]
    for k in device_kinds():
        names += [k.name, f"{k.name}:N"] if k.indexed else [k.name]
    return names


def gpu_device() -> tuple[str | None, str]:
    """The device n_gpu_layers / -ngl ask for: the first accelerator kind of the registry
    that runs here, as (its name, ""); else (None, why none does)."""
    why = []
    for k in device_kinds():
        if not k.accelerator:
            continue
        ok, reason = device_available(k.name)
        if ok:
            return k.name, ""
        why.append(f"{k.name}: {reason}")
    return None, "; ".join(why) or "this library knows no GPU backend"


def _info_from_c(c) -> ModelInfo:
    return ModelInfo(
        arch=ffi.string(c.arch).decode(), n_vocab=c.n_vocab, n_ctx_train=c.n_ctx_train,
        n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, n_head_kv=c.n_head_kv,
        head_dim=c.head_dim, n_ff=c.n_ff, ffn_act=ACT_NAMES.get(c.ffn_act, str(c.ffn_act)),
        act_from_file=bool(c.act_from_file), tied_output=bool(c.tied_output), bos_id=c.bos_id,
        eos_id=c.eos_id, weight_type=TYPE_NAMES.get(c.weight_type, str(c.weight_type)),
        rms_eps=c.rms_eps, rope_theta=c.rope_theta, n_params=c.n_params, n_bytes=c.n_bytes,
        has_predictor=c.has_predictor, has_down_t=c.has_down_t,
        sparse_threshold=c.sparse_threshold, has_gate_threshold=bool(c.has_gate_threshold),
        has_input_sparsity=bool(c.has_input_sparsity), n_expert=c.n_expert,
        n_expert_used=c.n_expert_used, n_ff_exp=c.n_ff_exp, n_ff_shexp=c.n_ff_shexp,
        expert_norm=bool(c.expert_norm))
