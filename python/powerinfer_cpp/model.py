"""Model and Context: load a GGUF, tokenize, evaluate, generate and stream text."""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ._native import NativeError, NativeValueError, check, ffi, lib
from .sizes import parse_size
from .tokenizer import Tokenizer, load_tokenizer

_ACT_NAMES = {0: "silu", 1: "relu", 2: "drelu", 3: "gelu", 4: "gelu_erf", 5: "fatrelu", 6: "swiglu_oai"}
_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16",
               12: "q4_k", 13: "q5_k", 14: "q6_k", 10: "q2_k", 11: "q3_k", 20: "iq4_nl", 23: "iq4_xs",
               39: "mxfp4", 16: "iq2_xxs", 17: "iq2_xs", 22: "iq2_s", 18: "iq3_xxs", 21: "iq3_s",
               19: "iq1_s", 29: "iq1_m"}
# FFN modes (gh_ffn_mode); "file" = the file's own mode (sparse when every layer has a
# predictor and ffn_down_t, else gate when it has gate thresholds, else dense); "auto" (a new
# context's) = the file's mode where estimated faster than dense on this machine, else dense
# (gh_model_ffn_auto; `python -m powerinfer_cpp.inspect FILE` says which and why)
FFN_MODES = {"dense": 0, "sparse": 1, "oracle": 2, "gate": 3}
# KV cache storage types (gh_context_params.cache_type); f16 is the default, as llama.cpp's
CACHE_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
_CACHE_NAMES = {v: k for k, v in CACHE_TYPES.items()}
_FFN_NAMES = {v: k for k, v in FFN_MODES.items()}


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


@dataclass
class Completion:
    """The result of Context.generate."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_tokens or context full)
    n_prompt_tokens: int
    timings: dict = field(default_factory=dict)
    # prompt tokens whose KV entries were kept from the context's previous use (the longest
    # common prefix); only the other n_prompt_tokens - n_cached_tokens were evaluated
    n_cached_tokens: int = 0


class ContextState:
    """A saved KV cache (Context.save_state): the token ids it holds, how many of them were
    computed exactly (the prefix a later prompt may reuse, see Generation.prefill) and the
    runtime's state of their keys and values (gh_context_state_save: tagged with the model,
    the cache type and a checksum). to_bytes() / from_bytes() keep one on disk."""

    MAGIC = b"GHSLOT01"

    __slots__ = ("tokens", "n_exact", "data")

    def __init__(self, tokens: Sequence[int], n_exact: int, data: bytes | bytearray):
        self.tokens = [int(t) for t in tokens]
        self.n_exact = int(n_exact)
        self.data = data

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """What the state holds in memory (its keys and values, and the token ids)."""
        return len(self.data) + 4 * len(self.tokens)

    def to_bytes(self) -> bytes:
        """MAGIC, the token count and n_exact (uint32 little-endian), the ids (int32), then
        the runtime's state."""
        head = np.array([len(self.tokens), self.n_exact], dtype="<u4").tobytes()
        return (self.MAGIC + head + np.asarray(self.tokens, dtype="<i4").tobytes()
                + bytes(self.data))

    @classmethod
    def from_bytes(cls, blob) -> "ContextState":
        """The state to_bytes() wrote; ValueError naming the problem for anything else (the
        runtime checks the rest when it is loaded)."""
        mv = memoryview(blob)
        if len(mv) < 16 or bytes(mv[:8]) != cls.MAGIC:
            raise ValueError("not a saved context state (it does not start with "
                             f"{cls.MAGIC.decode()})")
        n, n_exact = (int(x) for x in np.frombuffer(mv[8:16], dtype="<u4"))
        if n_exact > n or len(mv) < 16 + 4 * n:
            raise ValueError(f"a truncated or corrupt context state ({len(mv)} bytes for "
                             f"{n} tokens)")
        tokens = np.frombuffer(mv[16:16 + 4 * n], dtype="<i4").tolist()
        return cls(tokens, n_exact, bytes(mv[16 + 4 * n:]))

    def __repr__(self) -> str:
        return f"ContextState(n_tokens={self.n_tokens}, n_exact={self.n_exact}, nbytes={self.nbytes})"


class _NativeHandle:
    """Owns one native object: freed by close(), a with-block or garbage collection;
    use after close raises instead of touching freed memory.

    Every native call on the object runs under its lock (`with self._calling() as ptr`),
    so calls from several threads are serialised and close() waits for the call in
    flight instead of freeing memory under it."""

    _ptr = None
    _closed_msg = "this object has been closed"

    def __new__(cls, *args, **kw):
        obj = super().__new__(cls)
        obj._lock = threading.RLock()
        return obj

    def _free(self, ptr) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Free the native object (after any call in flight on another thread); later use
        raises."""
        with self._lock:
            if self._ptr is not None:
                ptr, self._ptr = self._ptr, None
                self._free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _handle(self):
        if self._ptr is None:
            raise RuntimeError(self._closed_msg)
        return self._ptr

    @contextlib.contextmanager
    def _calling(self):
        """The native pointer, held under the lock for the duration of a call."""
        with self._lock:
            yield self._handle()


class Model(_NativeHandle):
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
    whole experts: the file's expert placement (`python -m powerinfer_cpp.place
    --profile`), else the most frequently selected first, else in layer order.
    `n_cpu_moe` keeps the experts of the first N layers on the CPU (llama.cpp's
    --n-cpu-moe); `expert_cache` (bytes or a size) gives each context a device cache of
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
        if load not in _LOAD_MODES:
            raise ValueError(f"load must be one of {', '.join(_LOAD_MODES)}, not {load!r}")
        if not os.path.exists(path):
            raise FileNotFoundError(f"model file not found: '{path}'")
        if os.path.isdir(path):
            raise IsADirectoryError(
                f"'{path}' is a directory; pass a .gguf file (convert a Hugging Face folder with "
                "`python -m powerinfer_cpp.convert DIR -o MODEL.gguf`)")
        self.path = path
        if not isinstance(device, str):
            raise TypeError(f"device must be a string (cpu, host-device, cuda, cuda:N), not "
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
        params.load = _LOAD_MODES[load]
        params.n_cpu_moe = n_cpu_moe
        params.expert_cache = cache
        try:
            check(lib.gh_model_load_ex(path.encode(), params, out))
        except NativeError as e:
            # the loader stops at the first problem; a downloaded file often has several, so
            # the header is checked (only now: a successful load never pays for it) and the
            # error names them all
            from .preflight import load_error

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
            _ffn_mode(ffn)  # a bad name fails here, not at the first use
            _cache_type(cache_type)  # a bad name fails here, not at the first use
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
            },
        }

    def expert_placement(self) -> np.ndarray:
        """Mixture-of-experts models: bool [n_layer, n_expert], True where the expert was
        placed on the device (all False on the CPU; [n_layer, 0] without experts)."""
        out = np.zeros((self.info.n_layer, self.info.n_expert), dtype=np.int8)
        with self._calling() as ptr:
            check(lib.gh_model_expert_placement(ptr, ffi.cast("int8_t *", out.ctypes.data), out.size))
        return out.astype(bool)

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
        from .embeddings import DEFAULT_POOLING, file_pooling

        if getattr(self, "_pooling", None) is None:
            self._pooling = file_pooling(self.path, self.info.arch) or DEFAULT_POOLING
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
        from . import embeddings as E

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




_LOAD_MODES = {"auto": lib.GH_LOAD_AUTO, "mmap": lib.GH_LOAD_MMAP, "read": lib.GH_LOAD_READ}


def device_available(device: str) -> tuple[bool, str]:
    """(True, "") if `device` ("cpu", "host-device", "cuda", "cuda:N") can run here, else
    (False, the reason)."""
    if lib.gh_device_check(device.encode()) == 0:
        return True, ""
    return False, ffi.string(lib.gh_last_error()).decode("utf-8", "replace")


def _info_from_c(c) -> ModelInfo:
    return ModelInfo(
        arch=ffi.string(c.arch).decode(), n_vocab=c.n_vocab, n_ctx_train=c.n_ctx_train,
        n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, n_head_kv=c.n_head_kv,
        head_dim=c.head_dim, n_ff=c.n_ff, ffn_act=_ACT_NAMES.get(c.ffn_act, str(c.ffn_act)),
        act_from_file=bool(c.act_from_file), tied_output=bool(c.tied_output), bos_id=c.bos_id,
        eos_id=c.eos_id, weight_type=_TYPE_NAMES.get(c.weight_type, str(c.weight_type)),
        rms_eps=c.rms_eps, rope_theta=c.rope_theta, n_params=c.n_params, n_bytes=c.n_bytes,
        has_predictor=c.has_predictor, has_down_t=c.has_down_t,
        sparse_threshold=c.sparse_threshold, has_gate_threshold=bool(c.has_gate_threshold),
        has_input_sparsity=bool(c.has_input_sparsity), n_expert=c.n_expert,
        n_expert_used=c.n_expert_used, n_ff_exp=c.n_ff_exp, n_ff_shexp=c.n_ff_shexp,
        expert_norm=bool(c.expert_norm))


class _Detokenizer:
    """Turns a growing token list into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0   # ids[prefix:read] decode to the text already emitted (a window)
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if full.endswith("\ufffd") or len(full) <= len(done):
            return ""  # a multi-byte character is still incomplete (or a special token)
        # Keep a short window so decode cost stays constant per token.
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
        return full[len(done):]


class Context(_NativeHandle):
    """A KV cache and scratch buffers over a Model.

    Safe from several threads: calls are serialised, and close() waits for the call in
    flight. The cache is shared state, though: eval() appends to what this thread last
    left there, so when another thread changed the cache since this thread's last call,
    eval() raises RuntimeError instead of computing logits of someone else's tokens
    (call reset() to start over). stream() and generate() manage the cache themselves
    and work from any thread; give threads that run side by side a context each
    (Model.create_context).
    """

    def __init__(self, model: Model, *, n_ctx: int = 0, n_threads: int = 0, n_batch: int = 512,
                 ffn: str = "auto", cache_type: str = "f16", input_sparse: bool | None = None):
        self.model = model
        mode = _ffn_mode(ffn)
        p = lib.gh_context_default_params()
        p.n_ctx, p.n_threads, p.n_batch = (_int32("n_ctx", n_ctx), _int32("n_threads", n_threads),
                                           _int32("n_batch", n_batch))
        p.cache_type = _cache_type(cache_type)
        out = ffi.new("gh_context **")
        check(lib.gh_context_new(model._handle(), ffi.new("gh_context_params *", p), out))
        self._ptr = out[0]
        # tokens one forward pass takes (gh_context_new's rule: 0 or more than n_ctx = n_ctx)
        n_ctx_now = lib.gh_context_n_ctx(self._ptr)
        self.n_batch = min(n_batch, n_ctx_now) if n_batch > 0 else n_ctx_now
        model._contexts.add(self)  # closed with the model, however it was made
        self._use = 0  # bumped by every eval/reset; a stream stops if it changed under it
        self._seen = threading.local()  # .use: self._use after this thread's last call
        self._cached: list[int] = []    # the tokens in the KV cache, in order
        # _cached[:_n_exact] were computed with the exact (dense-result) FFN; tokens decoded
        # by the sparse FFN after them are not reused by the next prompt, so a reply does
        # not depend on what the context computed before (see Generation.prefill)
        self._n_exact = 0
        self._out = ffi.new("int32_t *")
        if mode is not None or input_sparse is not None:
            try:
                if mode is not None:
                    self.set_ffn_mode(ffn)
                if input_sparse is not None:
                    self.input_sparse = input_sparse
            except BaseException:
                self.close()
                raise
        n_train = model.info.n_ctx_train
        if n_train > 0 and self.n_ctx > n_train:
            warnings.warn(
                f"n_ctx = {self.n_ctx} is larger than the context the model was trained with "
                f"({n_train}); output past {n_train} tokens is likely garbage", RuntimeWarning,
                stacklevel=3)

    _closed_msg = "this Context has been closed (or its Model was closed)"

    def _free(self, ptr) -> None:
        lib.gh_context_free(ptr)

    @property
    def n_ctx(self) -> int:
        with self._calling() as ptr:
            return lib.gh_context_n_ctx(ptr)

    @property
    def n_past(self) -> int:
        with self._calling() as ptr:
            return lib.gh_context_n_past(ptr)

    @property
    def cache_type(self) -> str:
        """How the KV cache is stored: "f16", "f32" or "q8_0"."""
        with self._calling() as ptr:
            return _CACHE_NAMES[lib.gh_context_cache_type(ptr)]

    @property
    def cached_tokens(self) -> list[int]:
        """The token ids whose keys and values are in the cache (a copy)."""
        with self._lock:
            return list(self._cached)

    @property
    def reusable_tokens(self) -> list[int]:
        """The cached tokens a later prompt may reuse: those computed exactly (by the dense
        FFN's result, see Generation.prefill), a prefix of cached_tokens (a copy)."""
        with self._lock:
            return self._cached[:self._n_exact]

    def peek_reusable_tokens(self) -> list[int] | None:
        """reusable_tokens, or None at once when another thread is in a call on this
        context (a look that must not wait for someone else's prompt)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._cached[:self._n_exact]
        finally:
            self._lock.release()

    def set_threads(self, n_threads: int) -> None:
        """Change the number of threads the forward pass uses (0 = all cores)."""
        with self._calling() as ptr:
            check(lib.gh_context_set_threads(ptr, _int32("n_threads", n_threads)))

    def reset(self, n_past: int = 0) -> None:
        """Forget cached tokens after position n_past (default: all)."""
        with self._calling() as ptr:
            check(lib.gh_context_truncate(ptr, _int32("n_past", n_past)))
            del self._cached[n_past:]
            self._n_exact = min(self._n_exact, n_past)
            self._changed()

    def state_size(self, n_tokens: int | None = None) -> int:
        """Bytes of the runtime's state of n_tokens cached tokens (default: all of them)."""
        with self._calling() as ptr:
            n = len(self._cached) if n_tokens is None else _int32("n_tokens", n_tokens)
            out = ffi.new("uint64_t *")
            check(lib.gh_context_state_size(ptr, n, out))
            return int(out[0])

    def save_state(self, n_tokens: int | None = None) -> ContextState:
        """The keys and values of the first n_tokens cached tokens (default: all) and their
        ids, to restore into this or another context of the same model (load_state). The
        cache is not changed."""
        with self._calling() as ptr:
            n = len(self._cached) if n_tokens is None else _int32("n_tokens", n_tokens)
            size = ffi.new("uint64_t *")
            check(lib.gh_context_state_size(ptr, n, size))
            buf = bytearray(size[0])
            written = ffi.new("uint64_t *")
            check(lib.gh_context_state_save(ptr, n, ffi.from_buffer(buf), len(buf), written))
            # the buffer itself (no copy: a long cache's state is tens of MB)
            return ContextState(self._cached[:n], min(self._n_exact, n), buf)

    def load_state(self, state: ContextState) -> None:
        """Replace the cache by a saved state (of this model and cache type; n_ctx must hold
        it). ValueError or NativeError naming the problem, the cache unchanged, for a state
        that is corrupt, truncated or of another model. The next eval() continues after the
        state's tokens (its logits are not kept: evaluate at least one token)."""
        if not isinstance(state, ContextState):
            raise TypeError(f"load_state() takes a ContextState, not {type(state).__name__}")
        ids = state.tokens
        if ids and (min(ids) < 0 or max(ids) >= self.model.n_vocab):
            raise ValueError("the state holds a token id outside this model's vocabulary")
        if not 0 <= state.n_exact <= len(ids):
            raise ValueError(f"the state's n_exact ({state.n_exact}) is not within its "
                             f"{len(ids)} tokens")
        with self._calling() as ptr:
            size = ffi.new("uint64_t *")
            if len(ids) > lib.gh_context_n_ctx(ptr):
                raise ValueError(f"the state holds {len(ids)} tokens, more than this "
                                 f"context's {lib.gh_context_n_ctx(ptr)}")
            check(lib.gh_context_state_size(ptr, len(ids), size))
            data = state.data
            if len(data) != size[0]:
                raise ValueError(f"the state's data is {len(data)} bytes; {len(ids)} tokens "
                                 f"of this context take {size[0]} (truncated, or saved from "
                                 "another model or cache type)")
            n = ffi.new("int32_t *")
            check(lib.gh_context_state_load(ptr, ffi.from_buffer(data), len(data), n))
            self._cached = list(ids)
            self._n_exact = state.n_exact
            self._changed()

    def _changed(self) -> None:
        """Record a change of the cache made by this thread."""
        self._use += 1
        self._seen.use = self._use

    # -- sparse FFN ------------------------------------------------------------

    @property
    def ffn_mode(self) -> str:
        """The FFN mode: "dense", "sparse" or "oracle"."""
        with self._calling() as ptr:
            return _FFN_NAMES[lib.gh_context_get_ffn_mode(ptr)]

    def set_ffn_mode(self, mode: str) -> None:
        """Switch the FFN mode ("dense", "sparse", "oracle", "gate", "file" = the file's own
        mode, or "auto" = the file's mode where estimated faster than dense here, else
        dense); NativeError if the file lacks what the mode needs (predictors, ffn_down_t).
        Takes effect at the next eval; the cache stays valid."""
        m = _ffn_mode(mode)
        if m is None or m == -1:
            ch = ffi.new("gh_ffn_auto_choice *")
            check(lib.gh_model_ffn_auto(self.model._handle(), ch))
            m = ch.mode if m is None else ch.file_mode
        with self._calling() as ptr:
            check(lib.gh_context_set_ffn_mode(ptr, m))

    @property
    def input_sparse(self) -> bool:
        """Whether the sparse and gate FFN modes also run the attention's and the head's
        projections input-sparse (on by default for a file converted with --input-sparsity)."""
        with self._calling() as ptr:
            return bool(lib.gh_context_get_input_sparse(ptr))

    @input_sparse.setter
    def input_sparse(self, on: bool) -> None:
        with self._calling() as ptr:
            check(lib.gh_context_set_input_sparse(ptr, 1 if on else 0))

    @property
    def sparse_batch(self) -> int:
        """Largest batch (tokens per eval) that runs the sparse FFN; bigger ones run dense."""
        with self._calling() as ptr:
            return lib.gh_context_get_sparse_batch(ptr)

    @sparse_batch.setter
    def sparse_batch(self, n_max: int) -> None:
        with self._calling() as ptr:
            check(lib.gh_context_set_sparse_batch(ptr, _int32("sparse_batch", n_max)))

    def stats(self) -> dict:
        """What this context did since it was made or reset_stats(): token counts, the
        FFN density (per layer too), weight bytes read per stage and per token, and
        seconds per stage (attention / predictor / ffn / other)."""
        n_layer = self.model.info.n_layer
        st = ffi.new("gh_context_stats *")
        dens = ffi.new("double[]", n_layer)
        with self._calling() as ptr:
            check(lib.gh_context_get_stats(ptr, st, dens, n_layer))
        n = max(st.n_tokens, 1)
        return {
            "ffn_mode": _FFN_NAMES.get(st.ffn_mode, str(st.ffn_mode)),
            "n_tokens": st.n_tokens,
            "n_sparse_tokens": st.n_sparse_tokens,
            "n_active": st.n_active,
            "n_up_rows": st.n_up_rows,
            "n_down_rows": st.n_down_rows,
            "density": st.density,
            "layer_density": [dens[i] for i in range(n_layer)],
            "input_sparse": {"attention_density": st.attn_input_density,
                             "head_density": st.head_input_density,
                             "attention_inputs": st.n_attn_inputs,
                             "attention_inputs_used": st.n_attn_inputs_used,
                             "head_inputs": st.n_head_inputs, "head_inputs_used": st.n_head_inputs_used},
            "bytes": {"attention": st.bytes_attention, "predictor": st.bytes_predictor,
                      "ffn": st.bytes_ffn, "head": st.bytes_head},
            "bytes_per_token": st.bytes_per_token,
            "bytes_per_token_stage": {"attention": st.bytes_attention / n,
                                      "predictor": st.bytes_predictor / n,
                                      "ffn": st.bytes_ffn / n, "head": st.bytes_head / n},
            "time_s": {"attention": st.t_attention, "predictor": st.t_predictor,
                       "ffn": st.t_ffn, "other": st.t_other, "total": st.t_total},
            "device": {
                "neurons_device": st.n_active_device,
                "neurons_cpu": st.n_active_cpu,
                "device_share": st.n_active_device / st.n_active if st.n_active else 0.0,
                "bytes_device": st.bytes_device,
                "bytes_uploaded": st.bytes_uploaded,
                "bytes_downloaded": st.bytes_downloaded,
                "time_s": {"device": st.t_device, "cpu_ffn": st.t_cpu_ffn, "wait": st.t_wait},
            },
            "experts": {
                "runs_device": st.n_expert_runs_device,
                "runs_cpu": st.n_expert_runs_cpu,
                "cache_hits": st.n_cache_hits,
                "cache_misses": st.n_cache_misses,
                "cache_hit_rate": (st.n_cache_hits / (st.n_cache_hits + st.n_cache_misses)
                                   if st.n_cache_hits + st.n_cache_misses else 0.0),
                "bytes_cache_uploaded": st.bytes_cache_uploaded,
            },
        }

    def expert_counts(self) -> np.ndarray:
        """Mixture-of-experts models: int64 [n_layer, n_expert], how many times each expert of
        each layer was chosen since the context was made or reset_stats() (a token counts
        once for each of its top-k experts); [n_layer, 0] for a model without experts."""
        info = self.model.info
        out = np.zeros((info.n_layer, info.n_expert), dtype=np.int64)
        with self._calling() as ptr:
            check(lib.gh_context_get_expert_counts(ptr, ffi.cast("int64_t *", out.ctypes.data), out.size))
        return out

    def reset_stats(self) -> None:
        """Zero the counters stats() and expert_counts() report."""
        with self._calling() as ptr:
            check(lib.gh_context_reset_stats(ptr))

    # -- evaluation ------------------------------------------------------------

    def _eval_ids(self, ptr, ids: list[int], logits_all: bool) -> None:
        """Evaluate checked token ids after the cache (caller holds the lock)."""
        arr32 = np.asarray(ids, dtype=np.int32)
        self._before_eval(ptr, len(ids))
        try:
            check(lib.gh_eval(ptr, ffi.from_buffer("int32_t[]", arr32), arr32.size,
                              1 if logits_all else 0))
        finally:
            self._after_eval(ptr, ids)

    def _before_eval(self, ptr, n: int) -> None:
        """Count n tokens about to be evaluated as exact (reusable by a later prompt)
        unless the context's FFN runs them sparse (caller holds the lock)."""
        mode = lib.gh_context_get_ffn_mode(ptr)
        exact = (not (mode == FFN_MODES["sparse"] or
                      (mode == FFN_MODES["gate"] and lib.gh_context_get_input_sparse(ptr))) or
                 n > lib.gh_context_get_sparse_batch(ptr))
        if exact and self._n_exact == len(self._cached):
            self._n_exact += n  # lowered by _after_eval if the runtime keeps fewer

    def _after_eval(self, ptr, ids: list[int]) -> None:
        """Keep the token list equal to the cache after an evaluation of ids, which on
        failure leaves the cache as it was (or truncated after a device error)."""
        n = lib.gh_context_n_past(ptr)
        self._cached.extend(ids[:max(n - len(self._cached), 0)])
        del self._cached[n:]
        self._n_exact = min(self._n_exact, n)
        self._changed()

    def _check_ids(self, tokens) -> list[int]:
        arr = _token_array(tokens)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence of ids")
        if arr.min() < 0 or arr.max() >= self.model.n_vocab:
            bad = int(arr[(arr < 0) | (arr >= self.model.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.model.n_vocab})")
        return [int(t) for t in arr]

    def eval(self, tokens: Sequence[int], logits_all: bool = False) -> np.ndarray:
        """Run tokens after the cached ones; logits of the last token [n_vocab], or of
        every token [n_tokens, n_vocab] with logits_all (a copy)."""
        ids = self._check_ids(tokens)
        with self._calling() as ptr:
            seen = getattr(self._seen, "use", None)
            if seen is not None and seen != self._use:
                raise RuntimeError(
                    "another thread changed this context's cache since this thread last used "
                    "it, so eval() would continue someone else's tokens; call reset() first, "
                    "or give each thread its own context (Model.create_context)")
            self._eval_ids(ptr, ids, logits_all)
            rows = lib.gh_n_logit_rows(ptr)
            nv = self.model.n_vocab
            buf = ffi.buffer(lib.gh_get_logits(ptr, 0), rows * nv * 4)
            out = np.frombuffer(buf, dtype=np.float32).reshape(rows, nv).copy()
        return out if logits_all else out[0]

    def hidden_states(self, tokens: Sequence[int]) -> np.ndarray:
        """The final hidden state of every token of `tokens` (the output norm's output, what
        the head reads), run from an empty cache with the dense FFN: [n_tokens, n_embd]
        float32. The cache then holds the tokens (a next prompt starting with them reuses
        them)."""
        ids = self._check_ids(tokens)
        d = self.model.info.n_embd
        with self._calling() as ptr:
            n_ctx = lib.gh_context_n_ctx(ptr)
            if len(ids) > n_ctx:
                raise ValueError(f"{len(ids)} tokens do not fit the context's {n_ctx}")
            out = np.empty((len(ids), d), dtype=np.float32)
            arr32 = np.asarray(ids, dtype=np.int32)
            check(lib.gh_context_truncate(ptr, 0))
            self._cached.clear()
            self._n_exact = 0
            sparse_batch = lib.gh_context_get_sparse_batch(ptr)
            check(lib.gh_context_set_sparse_batch(ptr, 0))  # the dense FFN's states
            try:
                check(lib.gh_eval_embd(ptr, ffi.from_buffer("int32_t[]", arr32), arr32.size,
                                       ffi.from_buffer("float[]", out, require_writable=True)))
            finally:
                check(lib.gh_context_set_sparse_batch(ptr, sparse_batch))
                n = lib.gh_context_n_past(ptr)
                self._cached.extend(ids[:n])
                self._n_exact = n
                self._changed()
        return out

    def perplexity(self, text: str) -> float:
        """exp(mean negative log-likelihood) of `text`, in windows of n_ctx tokens."""
        ids = self.model.tokenize(text)
        if len(ids) < 2:
            raise ValueError("perplexity needs a text of at least 2 tokens")
        with self._lock:  # the windows' reset + eval pairs stay together
            n_ctx = self.n_ctx
            nll, count = 0.0, 0
            for start in range(0, len(ids) - 1, n_ctx):
                window = ids[start:start + n_ctx]
                if len(window) < 2:
                    break
                self.reset()
                logits = self.eval(window, logits_all=True).astype(np.float64)
                logits -= logits.max(axis=1, keepdims=True)
                logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
                tgt = np.asarray(window[1:])
                nll -= float(logp[np.arange(len(tgt)), tgt].sum())
                count += len(tgt)
            self.reset()
        return math.exp(nll / count)

    # -- generation ------------------------------------------------------------

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
               temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
               min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
               seed: int | None = None, stop: str | Sequence[str] | None = None,
               ignore_eos: bool = False, stats: Completion | None = None,
               logits_processor=None, draft=None, draft_max: int | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated.

        The cache keeps the longest common prefix of its tokens and the prompt (a chat
        turn or a repeated system prompt is not evaluated again); only the rest of the
        prompt is evaluated. The prompt always runs through the dense FFN and generated
        tokens through the context's FFN mode; tokens a sparse FFN decoded are not reused
        (they are evaluated again, densely, as part of the next prompt), so a reply is
        the same as on a fresh context. temperature <= 0 is greedy. Generation ends at EOS, a stop
        string (not included in the text), max_tokens (None: until the context is full),
        or when the context is full. Pass a Completion as `stats` to receive tokens,
        finish reason, timings and how many prompt tokens came from the cache.
        `logits_processor(input_ids, logits) -> logits` (a float32 array of n_vocab) may
        change each token's logits before sampling. `draft` ("self", a draft Model or its
        file) decodes speculatively, `draft_max` tokens drafted at most per verification
        (see powerinfer_cpp.speculative: the output is the dense model's); the Completion's
        timings["speculative"] then reports acceptance and the draft/verify split.

        The arguments are checked here, before the first piece is asked for (a bad
        one raises at once). A stream owns its context while it runs: evaluating,
        resetting or streaming on the same context meanwhile makes the old stream
        raise RuntimeError when resumed (use create_context() for concurrent streams).
        """
        return _run_stream(self.start_generation(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed,
            stop=stop, ignore_eos=ignore_eos, stats=stats, logits_processor=logits_processor,
            draft=draft, draft_max=draft_max))

    def start_generation(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
                         temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                         min_p: float = 0.05, repeat_penalty: float = 1.0,
                         repeat_last_n: int = 64, seed: int | None = None,
                         stop: str | Sequence[str] | None = None, ignore_eos: bool = False,
                         stats: Completion | None = None,
                         logits_processor=None, draft=None,
                         draft_max: int | None = None) -> Generation:
        """stream()'s generation as a Generation, run a step at a time by the caller (the
        server's batching scheduler): same arguments, checked here."""
        model = self.model
        self._handle()
        if isinstance(prompt, str):
            prompt_ids = model.tokenize(prompt)
        elif isinstance(prompt, (bytes, bytearray)) or not _is_sequence(prompt):
            raise TypeError(f"prompt must be a str or a sequence of token ids, not "
                            f"{type(prompt).__name__}")
        else:
            arr = _token_array(prompt)
            if arr.ndim != 1 and arr.size:
                raise ValueError("a prompt of token ids must be a flat sequence of ints")
            prompt_ids = [int(t) for t in arr.reshape(-1)]
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens)")
        bad = [t for t in prompt_ids if not 0 <= t < model.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {model.n_vocab})")
        if len(prompt_ids) >= self.n_ctx:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds only {self.n_ctx}; "
                f"use a shorter prompt or a larger n_ctx (the model was trained with "
                f"{model.info.n_ctx_train})")
        max_tokens = self.n_ctx if max_tokens is None else _int_arg("max_tokens", max_tokens)
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0 (or None: until the context is full)")
        if logits_processor is not None and not callable(logits_processor):
            raise TypeError("logits_processor must be a callable (input_ids, logits) -> logits")
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (bytes, bytearray)) or not _is_sequence(stop):
            raise TypeError(f"stop must be a str or a list of str, not {type(stop).__name__}")
        else:
            stops = list(stop)
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, not {type(s).__name__} ({s!r})")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")

        repeat_last_n = _int_arg("repeat_last_n", repeat_last_n)
        sampler = _new_sampler(model.n_vocab, temperature, top_k, top_p, min_p, repeat_penalty,
                               repeat_last_n, seed)
        if draft is not None or draft_max is not None:
            from .speculative import start_speculative

            return start_speculative(self, draft, draft_max, float(temperature) <= 0,
                                     prompt_ids, sampler, max_tokens,
                                     repeat_last_n, stops, bool(ignore_eos), stats,
                                     logits_processor)
        return Generation(self, prompt_ids, sampler, max_tokens, repeat_last_n, stops,
                          bool(ignore_eos), stats, logits_processor)

    def _sample(self, ptr, sampler, prompt_ids: list[int], generated: list[int],
                logits_processor) -> int:
        """The next token from the last logits (caller holds the lock)."""
        logits = lib.gh_get_logits(ptr, -1)
        if logits_processor is not None:
            nv = self.model.n_vocab
            arr = np.frombuffer(ffi.buffer(logits, nv * 4), dtype=np.float32).copy()
            arr = np.ascontiguousarray(logits_processor(prompt_ids + generated, arr),
                                       dtype=np.float32)
            if arr.shape != (nv,):
                raise ValueError(f"logits_processor returned shape {arr.shape}; it must return "
                                 f"the logits it was given, shape ({nv},)")
            logits = ffi.from_buffer("float[]", arr)
        check(lib.gh_sampler_sample(sampler, logits, self._out))
        return self._out[0]

    def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        """Generate a completion; same arguments as stream()."""
        result = Completion("", [], "length", 0)
        for _ in self.stream(prompt, stats=result, **kw):
            pass
        return result


_INTERFERED = ("this stream's context was used by another call (eval, reset, perplexity or "
               "another stream) while the stream was paused, so it cannot continue; use "
               "create_context() for streams that run side by side")


class Generation:
    """One generation on a context, a step at a time: what Context.stream() runs, split so
    that a scheduler can evaluate the next tokens of several generations together
    (eval_batch: the server's continuous batching). Made by Context.start_generation.

    The order: prefill() until it returns True (the prompt, in chunks of any size); then
    per token sample(), which picks the next token from the context's logits and returns
    the text it completes, and, unless `done`, the evaluation of that token (`next_token`,
    None again once evaluated) by step() alone or by eval_batch() with other generations;
    at the end flush() (the text held back for stop strings) and finish() (timings).
    `result` is the Completion."""

    def __init__(self, ctx: "Context", prompt_ids: list[int], sampler, max_tokens: int,
                 repeat_last_n: int, stops: list[str], ignore_eos: bool,
                 stats: Completion | None, logits_processor):
        self.ctx = ctx
        self.prompt_ids = prompt_ids
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stops = stops
        self.ignore_eos = ignore_eos
        self.logits_processor = logits_processor
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.result = stats if stats is not None else Completion("", [], "length", 0)
        self.result.n_prompt_tokens = len(prompt_ids)
        self.result.tokens, self.result.text = [], ""
        for t in prompt_ids[-repeat_last_n:] if repeat_last_n > 0 else []:
            lib.gh_sampler_accept(sampler, t)
        self.eos = ctx.model.eos_id
        self.detok = _Detokenizer(ctx.model.tokenizer)
        self.pending = ""    # text held back because it may be the start of a stop string
        self.finish_reason = "length"
        self.n_gen = 0
        self.next_token: int | None = None  # sampled, to be evaluated next
        self.done = max_tokens <= 0
        self._at: int | None = None  # prompt tokens in the cache (None: not started)
        self._mine = None            # ctx._use after our last evaluation
        self._t0: float | None = None  # when the prompt's evaluation began
        self._t1: float | None = None  # ... and ended

    @property
    def prefilled(self) -> bool:
        return self._at == len(self.prompt_ids)

    def prefill(self, n_max: int | None = None) -> bool:
        """Evaluate the next n_max prompt tokens (None: the rest); True once the whole
        prompt is in the cache and its last token's logits are there."""
        ctx = self.ctx
        with ctx._calling() as ptr:
            chunk = self._prompt_chunk(ptr, n_max)
            with _dense_prompt(ptr):
                ctx._eval_ids(ptr, chunk, False)
            self._prompt_done(len(chunk))
        return self.prefilled

    def _prompt_chunk(self, ptr, n_max: int | None) -> list[int]:
        """The next n_max prompt tokens (None: the rest) to evaluate, the cached prefix
        kept at the first call (the context's lock held)."""
        ctx = self.ctx
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self._at is None:
            # Keep the cached prefix, as far as it was computed exactly: a prompt (reused or
            # not) always runs through the dense FFN, so the reply is the one a fresh
            # context gives, whatever this context did before. At least the last prompt
            # token is evaluated (its logits start the generation).
            keep = 0
            limit = min(ctx._n_exact, len(self.prompt_ids) - 1)
            while keep < limit and ctx._cached[keep] == self.prompt_ids[keep]:
                keep += 1
            check(lib.gh_context_truncate(ptr, keep))
            del ctx._cached[keep:]
            ctx._n_exact = min(ctx._n_exact, keep)
            self.result.n_cached_tokens = keep
            self._at = keep
        elif ctx._use != self._mine:
            raise RuntimeError(_INTERFERED)
        end = len(self.prompt_ids) if n_max is None else min(len(self.prompt_ids),
                                                              self._at + max(n_max, 1))
        return self.prompt_ids[self._at:end]

    def _prompt_done(self, n: int) -> None:
        """n more prompt tokens are in the cache (after _prompt_chunk's)."""
        self._at += n
        self._mine = self.ctx._use
        if self.prefilled:
            self._t1 = time.perf_counter()

    def sample(self) -> str:
        """Pick the next token from the context's logits; returns the text it completes
        ("" while a character or a possible stop string is incomplete) and sets `done` at
        EOS, a stop string or max_tokens, else `next_token`."""
        token = self._pick()
        self.next_token = None
        if token == self.eos and not self.ignore_eos:
            self.finish_reason, self.done = "stop", True
            return ""
        self.n_gen += 1
        self.result.tokens.append(token)
        lib.gh_sampler_accept(self.sampler, token)
        self.pending += self.detok.push(token)
        cut = _find_stop(self.pending, self.stops)
        if cut is not None:
            piece, self.finish_reason, self.done = self.pending[:cut], "stop", True
            self.result.text += piece
            self.pending = ""
            return piece
        piece = ""
        emit = len(self.pending) - self.hold if self.stops else len(self.pending)
        if emit > 0:
            piece, self.pending = self.pending[:emit], self.pending[emit:]
            self.result.text += piece
        if self.n_gen >= self.max_tokens:
            self.done = True
        else:
            self.next_token = token
        return piece

    def _pick(self) -> int:
        """The next token, sampled from the context's logits (speculative decoding's
        Generation hands out the tokens its last verification decided first)."""
        ctx = self.ctx
        with ctx._calling() as ptr:  # the caller may have closed the context meanwhile
            if ctx._use != self._mine:
                raise RuntimeError(_INTERFERED)
            return ctx._sample(ptr, self.sampler, self.prompt_ids, self.result.tokens,
                               self.logits_processor)

    def _claim(self, ptr) -> bool:
        """Before next_token is evaluated (the context's lock held): raise if another call
        used the context meanwhile; False (and done) if the context is full."""
        if self.ctx._use != self._mine:
            raise RuntimeError(_INTERFERED)
        if lib.gh_context_n_past(ptr) >= lib.gh_context_n_ctx(ptr):
            self.done, self.next_token = True, None
            return False
        return True

    def step(self) -> None:
        """Evaluate next_token alone (gh_eval)."""
        ctx = self.ctx
        with ctx._calling() as ptr:
            if self._claim(ptr):
                ctx._eval_ids(ptr, [self.next_token], False)
                self._mine = ctx._use
                self.next_token = None  # its logits are ready for sample()

    def batchable(self) -> bool:
        """Whether eval_batch can take this generation's next token: in every FFN mode (in
        the sparse modes each row of the batched pass selects its own neurons and gives what
        the context gets alone); contexts batched together must share batch_key()."""
        return True

    def batch_key(self, n_tokens: int = 1) -> tuple:
        """What the generations of one eval_batch must share (gh_eval_batch_ex refuses a
        mix): whether its n_tokens run through the dense FFN (the dense mode, a sparse batch
        below n_tokens, or a prompt: prefill reads it densely), else its sparse mode and
        input sparsity. A decode step is one token; a prompt chunk reads as ("dense",)."""
        with self.ctx._calling() as ptr:
            mode = int(lib.gh_context_get_ffn_mode(ptr))
            if mode == FFN_MODES["dense"] or lib.gh_context_get_sparse_batch(ptr) < n_tokens:
                return ("dense",)
            return (mode, bool(lib.gh_context_get_input_sparse(ptr)))

    def flush(self) -> str:
        """At a normal end: the held-back text that turned out not to start a stop string."""
        piece, self.pending = self.pending, ""
        self.result.text += piece
        return piece

    def finish(self) -> None:
        """Record the finish reason and the timings in `result`."""
        t2 = time.perf_counter()
        t0 = self._t0 if self._t0 is not None else t2
        t1 = self._t1 if self._t1 is not None else t2
        r, n_gen = self.result, self.n_gen
        r.finish_reason = self.finish_reason
        r.timings = {
            "load_s": self.ctx.model.load_time,
            "prompt_s": t1 - t0,
            "prompt_tokens": len(self.prompt_ids),
            "prompt_tok_per_s": len(self.prompt_ids) / max(t1 - t0, 1e-9),
            "decode_s": t2 - t1,
            "decode_tokens": n_gen,
            "decode_tok_per_s": max(n_gen - 1, 0) / max(t2 - t1, 1e-9) if n_gen > 1 else 0.0,
        }


def _run_stream(gen: Generation) -> Iterator[str]:
    """Context.stream's generator: the generation's steps, one token at a time."""
    gen.prefill()
    try:
        while not gen.done:
            piece = gen.sample()
            if piece:
                yield piece
            if not gen.done:
                gen.step()
        tail = gen.flush()
        if tail:
            yield tail
    finally:
        gen.finish()


@contextlib.contextmanager
def _dense_prompt(ptr):
    """A prompt runs through the dense FFN (sparse batch 0 while it is evaluated), so a
    reply does not depend on how its prompt was split (Generation.prefill)."""
    sparse_batch = lib.gh_context_get_sparse_batch(ptr)
    check(lib.gh_context_set_sparse_batch(ptr, 0))
    try:
        yield
    finally:
        check(lib.gh_context_set_sparse_batch(ptr, sparse_batch))


def eval_batch(gens: Sequence[Generation], prompt_chunk: int | None = None,
               parts: Sequence = ()) -> int:
    """Evaluate every generation's next tokens in ONE forward pass (gh_eval_batch_ex: each
    weight read once for all of them; each context's tokens attend over its own cache): a
    decoding generation's next_token (it must be batchable(); all must share one
    batch_key()), a generation still reading
    its prompt its next prompt_chunk prompt tokens (None: the rest; through the dense FFN,
    as prefill() reads them). Each must be on a context of its own of the same model, and
    all the tokens together within the first one's n_batch; a decoding generation whose
    context is full is marked done and left out. On an error no context has advanced and
    each generation may be stepped (or prefilled) again. Returns the tokens evaluated.

    `parts` join the pass with tokens of their own choosing (speculative decoding's drafts
    and verifications, speculative.py): each has `ctx`, `logits_all` (every token's logits
    kept: then every context of the pass keeps them, its last row being what a lone
    evaluation leaves), begin(ptr, stack) -> its tokens (the context's lock held; undo
    what it sets on `stack`), settle() after the pass whatever happened, and end(ptr) after
    a pass that succeeded."""
    owners = list(gens) + list(parts)
    if len({id(o.ctx) for o in owners}) != len(owners):
        raise ValueError("eval_batch: two generations share a context")
    if any(g.prefilled and g.next_token is None for g in gens):
        raise ValueError("eval_batch: a generation has no token to evaluate (sample() first)")
    with contextlib.ExitStack() as stack:
        # every context's lock, in one global order (another thread takes one at a time)
        ptrs = {id(o): stack.enter_context(o.ctx._calling())
                for o in sorted(owners, key=lambda o: id(o.ctx))}
        live = []  # (generation, its pointer, its tokens, whether they are prompt tokens)
        for g in gens:
            p = ptrs[id(g)]
            if not g.prefilled:
                live.append((g, p, g._prompt_chunk(p, prompt_chunk), True))
            elif g._claim(p):
                live.append((g, p, [g.next_token], False))
        for part in parts:
            live.append((part, ptrs[id(part)], part.begin(ptrs[id(part)], stack), None))
        if not live:
            return 0
        counts = np.array([len(ids) for _, _, ids, _ in live], dtype=np.int32)
        tokens = np.array([t for _, _, ids, _ in live for t in ids], dtype=np.int32)
        cptrs = ffi.new("gh_context *[]", [p for _, p, _, _ in live])
        for _, p, _, prompt in live:
            if prompt:
                stack.enter_context(_dense_prompt(p))
        for g, p, ids, _ in live:
            g.ctx._before_eval(p, len(ids))
        logits_all = any(part.logits_all for part in parts)
        try:
            check(lib.gh_eval_batch_ex(cptrs, len(live), ffi.from_buffer("int32_t[]", counts),
                                       ffi.from_buffer("int32_t[]", tokens),
                                       1 if logits_all else 0))
        finally:
            for g, p, ids, prompt in live:
                g.ctx._after_eval(p, ids)
                if prompt is None:
                    g.settle()
                else:
                    g._mine = g.ctx._use  # our own call: the generation carries on
        for g, p, ids, prompt in live:
            if prompt is None:
                g.end(p)
            elif prompt:
                g._prompt_done(len(ids))
            else:
                g.next_token = None  # its logits are ready for sample()
    return int(tokens.size)


def _new_sampler(n_vocab: int, temperature, top_k, top_p, min_p, repeat_penalty,
                 repeat_last_n, seed):
    """A native sampler (freed with its last reference) from checked arguments; seed None
    = random."""
    sp = lib.gh_sampler_default_params()
    sp.temperature = _float_arg("temperature", temperature)
    sp.top_k = _int32("top_k", _int_arg("top_k", top_k))
    sp.top_p = _float_arg("top_p", top_p)
    sp.min_p = _float_arg("min_p", min_p)
    sp.repeat_penalty = _float_arg("repeat_penalty", repeat_penalty)
    sp.repeat_last_n = _int32("repeat_last_n", _int_arg("repeat_last_n", repeat_last_n))
    sp.seed = (int.from_bytes(os.urandom(8), "little") if seed is None
               else _int_arg("seed", seed)) % 2**64
    out = ffi.new("gh_sampler **")
    check(lib.gh_sampler_new(ffi.new("gh_sampler_params *", sp), n_vocab, out))
    return ffi.gc(out[0], lib.gh_sampler_free)


class Sampler:
    """The sampler of stream(), on its own: for callers that run eval() themselves
    (llama-cpp-python's Llama.sample / Llama.generate). accept() feeds the repeat
    penalty's window; sample() picks a token from a row of logits (temperature <= 0:
    greedy)."""

    def __init__(self, n_vocab: int, *, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, seed: int | None = None):
        self.n_vocab = int(n_vocab)
        self._s = _new_sampler(self.n_vocab, temperature, top_k, top_p, min_p, repeat_penalty,
                               repeat_last_n, seed)
        self._out = ffi.new("int32_t *")

    def accept(self, token: int) -> None:
        lib.gh_sampler_accept(self._s, int(token))

    def sample(self, logits) -> int:
        arr = np.ascontiguousarray(logits, dtype=np.float32)
        if arr.shape != (self.n_vocab,):
            raise ValueError(f"logits must have shape ({self.n_vocab},), not {arr.shape}")
        check(lib.gh_sampler_sample(self._s, ffi.from_buffer("float[]", arr), self._out))
        return int(self._out[0])


def _ffn_mode(name: str) -> int | None:
    """gh_ffn_mode of a mode name; None for "auto", -1 for "file" (both: per model)."""
    if name == "auto":
        return None
    if name == "file":
        return -1
    if name not in FFN_MODES:
        raise ValueError(f"unknown FFN mode {name!r} (choose from auto, file, dense, sparse, "
                         "oracle, gate)")
    return FFN_MODES[name]


def _cache_type(name: str) -> int:
    """gh_context_params.cache_type of a KV cache type name."""
    if name not in CACHE_TYPES:
        raise ValueError(f"unknown KV cache type {name!r} (choose from {', '.join(CACHE_TYPES)})")
    return CACHE_TYPES[name]


def _int32(name: str, value) -> int:
    """value as a C int32 argument; ValueError (not cffi's OverflowError) if it cannot be."""
    v = int(value)
    if not -2**31 <= v < 2**31:
        raise ValueError(f"{name} = {v} is out of range")
    return v


def _int_arg(name: str, value) -> int:
    """value as a Python int; TypeError for floats, bools, None, strings (no silent
    truncation of 2.5 to 2)."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def _float_arg(name: str, value) -> float:
    """value as a float; TypeError for strings, None and the like."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def _is_sequence(x) -> bool:
    return isinstance(x, (Sequence, np.ndarray)) or (hasattr(x, "__len__") and
                                                     hasattr(x, "__getitem__"))


def _token_array(tokens) -> np.ndarray:
    """Token ids as an int64 array; TypeError for floats, bools, strings; ValueError for
    ids too large for any vocabulary."""
    if isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise TypeError(f"tokens must be a sequence of token ids (ints), not "
                        f"{type(tokens).__name__}; use model.tokenize(text) for text")
    arr = np.asarray(tokens)
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == object:
        vals = arr.reshape(-1).tolist()
        for v in vals:
            _int_arg("a token id", v)
        big = [v for v in vals if not -2**63 <= int(v) < 2**63]
        if big:
            raise ValueError(f"token id {big[0]} is outside the vocabulary")
        return np.array([int(v) for v in vals], dtype=np.int64).reshape(arr.shape)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got an array of {arr.dtype} "
                        "(floats and bools are not token ids)")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 2**63:
        raise ValueError(f"token id {int(arr.max())} is outside the vocabulary")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
