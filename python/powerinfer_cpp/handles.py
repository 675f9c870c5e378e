"""The ownership layer over the native binding (_native.py): a handle that owns one native
object (Model and Context are handles; ModelHandle is the model's type as the modules below
model.py see it), and the Python names of the runtime's enums that the handles'
constructors and setters take."""

from __future__ import annotations

import contextlib
import threading

from ._native import lib

ACT_NAMES = {0: "silu", 1: "relu", 2: "drelu", 3: "gelu", 4: "gelu_erf", 5: "fatrelu", 6: "swiglu_oai"}
TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16",
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
CACHE_NAMES = {v: k for k, v in CACHE_TYPES.items()}
FFN_NAMES = {v: k for k, v in FFN_MODES.items()}
# gh_model_params.load
LOAD_MODES = {"auto": lib.GH_LOAD_AUTO, "mmap": lib.GH_LOAD_MMAP, "read": lib.GH_LOAD_READ}


def ffn_mode_id(name: str) -> int | None:
    """gh_ffn_mode of a mode name; None for "auto", -1 for "file" (both: per model)."""
    if name == "auto":
        return None
    if name == "file":
        return -1
    if name not in FFN_MODES:
        raise ValueError(f"unknown FFN mode {name!r} (choose from auto, file, dense, sparse, "
                         "oracle, gate)")
    return FFN_MODES[name]


def cache_type_id(name: str) -> int:
    """gh_context_params.cache_type of a KV cache type name."""
    if name not in CACHE_TYPES:
        raise ValueError(f"unknown KV cache type {name!r} (choose from {', '.join(CACHE_TYPES)})")
    return CACHE_TYPES[name]



class NativeHandle:
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


class ModelHandle(NativeHandle):
    """A loaded model file: the type of model.Model, its one implementation, for the modules
    that model.py imports and that need to recognise a model or load another file as one
    (speculative.py: a draft given as a Model or as a path) without importing model.py back."""

    def _load_draft(self, path) -> ModelHandle:
        """The model in file `path` loaded as a draft for this one (its thread count and batch
        size)."""
        raise NotImplementedError
