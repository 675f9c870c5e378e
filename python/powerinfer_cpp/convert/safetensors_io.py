"""Reading safetensors files with numpy memmap (no torch needed).

File layout (safetensors spec): an 8-byte little-endian unsigned header length
N, then N bytes of UTF-8 JSON mapping tensor name -> {"dtype", "shape",
"data_offsets": [begin, end]} (offsets relative to the end of the header),
plus an optional "__metadata__" entry, then the raw little-endian data.

Every offset and size is checked against the file size when the file is
opened, so truncated or corrupt files fail early with SafetensorsError.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from typing import Iterator

import numpy as np

__all__ = ["SafetensorsError", "TensorEntry", "SafetensorsFile", "ShardedSafetensors",
           "open_safetensors_dir", "bf16_to_f32"]

# safetensors dtype string -> (numpy dtype of the stored data, element size)
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits; widened to f32 on load
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

_MAX_HEADER = 256 * 1024 * 1024


class SafetensorsError(Exception):
    """A safetensors file is missing, truncated or malformed."""


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str            # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int            # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One .safetensors file, memory-mapped lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise SafetensorsError(f"cannot open {self.path}: {e.strerror or e}") from None
        if size < 8:
            raise SafetensorsError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
        with open(self.path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > size - 8 or hlen > _MAX_HEADER:
                raise SafetensorsError(
                    f"{self.path}: header length {hlen} exceeds the file size ({size} bytes): "
                    "truncated or not a safetensors file")
            raw = f.read(hlen)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{self.path}: malformed safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: malformed safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + hlen
        data_size = size - data_start
        self._entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            try:
                dtype = info["dtype"]
                shape = tuple(int(x) for x in info["shape"])
                b, e = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: malformed header entry for tensor {name!r}") from None
            if dtype not in _DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            if any(d < 0 for d in shape):
                raise SafetensorsError(f"{self.path}: tensor {name!r} has a negative dimension")
            nbytes = prod(shape) * _DTYPES[dtype].itemsize
            if not (0 <= b <= e) or e - b != nbytes:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} data offsets [{b}, {e}] do not match "
                    f"its dtype {dtype} and shape {list(shape)}")
            if e > data_size:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} ends at byte {data_start + e} but the file has "
                    f"only {size} bytes: truncated file")
            self._entries[name] = TensorEntry(name, dtype, shape, data_start + b, data_start + e)

    # -- queries ---------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> str:
        return self.entry(name).dtype

    # -- data ------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The stored data as a read-only memmap (BF16 as uint16 bits).
        Each call maps just this tensor's bytes; the mapping goes away when
        the array is dropped, so streaming over tensors keeps RSS low."""
        ent = self.entry(name)
        dt = _DTYPES[ent.dtype]
        if ent.end == ent.begin:
            return np.zeros(ent.shape, dtype=dt)
        mm = np.memmap(self.path, dtype=dt, mode="r", offset=ent.begin, shape=ent.shape or (1,))
        return mm if ent.shape else mm.reshape(())

    def get(self, name: str, dtype=None) -> np.ndarray:
        """The tensor as a numpy array. F32/F16/F64 and integer tensors are
        zero-copy memmap views unless ``dtype`` asks for a conversion; BF16
        is widened to float32 (a copy)."""
        ent = self.entry(name)
        a = self.raw(name)
        if ent.dtype == "BF16":
            a = bf16_to_f32(a)
        if dtype is not None:
            a = a.astype(dtype, copy=False)
        return a

    def close(self) -> None:
        pass


class ShardedSafetensors:
    """A set of safetensors files seen as one tensor namespace."""

    def __init__(self, files: list[SafetensorsFile]):
        self.files = files
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            for k in f.keys():
                if k in self._where:
                    raise SafetensorsError(f"tensor {k!r} appears in both {self._where[k].path} and {f.path}")
                self._where[k] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise SafetensorsError(f"no tensor named {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> str:
        return self._file(name).dtype(name)

    def get(self, name: str, dtype=None) -> np.ndarray:
        return self._file(name).get(name, dtype)

    def close(self) -> None:
        for f in self.files:
            f.close()


def open_safetensors_dir(model_dir: str | os.PathLike) -> ShardedSafetensors | None:
    """Open the weights of a Hugging Face model folder: ``model.safetensors``,
    or the shards listed in ``model.safetensors.index.json``, or (no index)
    every ``model*.safetensors`` file. Returns None when the folder has no
    safetensors weights."""
    d = os.fspath(model_dir)
    index = os.path.join(d, "model.safetensors.index.json")
    single = os.path.join(d, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{index}: malformed index file ({e})") from None
        names = sorted(set(wm.values()))
        for n in names:
            if not os.path.isfile(os.path.join(d, n)):
                raise SafetensorsError(f"{index} lists shard {n!r} which does not exist")
        st = ShardedSafetensors([SafetensorsFile(os.path.join(d, n)) for n in names])
        for k, n in wm.items():
            if k not in st:
                raise SafetensorsError(f"{index} says tensor {k!r} is in {n!r}, but it is not there")
        return st
    if os.path.isfile(single):
        return ShardedSafetensors([SafetensorsFile(single)])
    shards = sorted(n for n in os.listdir(d) if n.endswith(".safetensors") and n.startswith("model"))
    if shards:
        return ShardedSafetensors([SafetensorsFile(os.path.join(d, n)) for n in shards])
    return None
