"""Reading GGUF files with the ``gguf`` package, PowerInfer's own files included.

PowerInfer writes ordinary GGUF v3 files whose magic is patched to ``PWRI``; the
``gguf`` package refuses that magic, so its reader is given the one word it expects.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

PWRI_MAGIC = 0x49525750  # b"PWRI" read as a little-endian u32
GGUF_MAGIC = 0x46554747  # b"GGUF"


def is_pwri(path: str | os.PathLike) -> bool:
    """Whether the file at path starts with PowerInfer's PWRI magic."""
    with open(path, "rb") as f:
        return f.read(4) == b"PWRI"


def open_gguf(path: str | os.PathLike):
    """A gguf.GGUFReader of the file (GGUF or PWRI magic); gguf's errors pass through."""
    import gguf

    class _Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            v = super()._get(offset, dtype, count, override_order)
            if offset == 0 and np.dtype(dtype) == np.uint32 and v.size == 1 and int(v[0]) == PWRI_MAGIC:
                return np.array([GGUF_MAGIC], dtype=np.uint32)
            return v

    return _Reader(os.fspath(path))


# GGUF value type id -> (struct format, size) of the fixed-size scalars
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9


class StringArray:
    """A string array read_header skipped (only its length kept): the vocabulary and merges
    are most of a header, and building them costs what the check is meant to save."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"StringArray({self.n})"


class Header:
    """What read_header found: ``version``, ``fields`` (key -> value: int, float, bool, str,
    a numpy array for numeric arrays, a StringArray for string arrays) and ``tensors``
    (name, GGML type id, shape as GGUF stores it: ne[0] first)."""

    def __init__(self, version: int, fields: dict, tensors: list[tuple[str, int, tuple[int, ...]]]):
        self.version, self.fields, self.tensors = version, fields, tensors


def read_header(path: str | os.PathLike) -> Header:
    """The key/values and tensor list of a GGUF (or PWRI) file, without the tensor data
    and without decoding string arrays; for checks that must cost little next to a load
    (the gguf package's reader builds a numpy view per vocabulary string: ~10 s on a 49k
    vocabulary against a 1.4 s load of the same file). Every length is checked against the
    file; a malformed header is a ValueError saying where."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"not a GGUF file ({size} bytes: shorter than a GGUF header)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos = 0

        def take(n: int, what: str) -> int:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise ValueError(f"truncated or corrupt header: {what} at byte {pos} runs past the end "
                                 f"of the file ({size} bytes)")
            p, pos = pos, pos + n
            return p

        def scalar(vtype: int, what: str):
            fmt, n = _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, take(n, what))[0]

        def string(what: str) -> str:
            n = scalar(10, what)
            p = take(n, what)
            return bytes(buf[p:p + n]).decode("utf-8", "replace")

        magic = scalar(4, "the magic")
        if magic not in (GGUF_MAGIC, PWRI_MAGIC):
            raise ValueError(f"not a GGUF file (magic {magic:#010x})")
        version = scalar(4, "the version")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = scalar(10, "the tensor count"), scalar(10, "the key count")
        fields: dict = {}
        for _ in range(n_kv):
            key = string("a key")
            vtype = scalar(4, f"the type of {key}")
            if vtype in _SCALARS:
                fields[key] = scalar(vtype, key)
            elif vtype == _STRING:
                fields[key] = string(key)
            elif vtype == _ARRAY:
                et, n = scalar(4, key), scalar(10, key)
                if et in _SCALARS:
                    fmt, esz = _SCALARS[et]
                    p = take(n * esz, key)
                    fields[key] = np.frombuffer(buf, dtype=np.dtype(fmt), count=n, offset=p).copy()
                elif et == _STRING:
                    # the hot loop of the whole read (100k strings in a real vocabulary):
                    # plain locals, one bounds check per string
                    u64, p, end = struct.Struct("<Q").unpack_from, pos, size
                    for _ in range(n):
                        if p + 8 > end:
                            break
                        p += 8 + u64(buf, p)[0]
                    else:
                        if p <= end:
                            pos = p
                            fields[key] = StringArray(n)
                            continue
                    raise ValueError(f"truncated or corrupt header: the strings of {key} run past "
                                     f"the end of the file ({size} bytes)")
                else:
                    raise ValueError(f"key {key}: array element type {et} is not a GGUF value type")
            else:
                raise ValueError(f"key {key}: value type {vtype} is not a GGUF value type")
        tensors = []
        for _ in range(n_tensors):
            name = string("a tensor name")
            nd = scalar(4, f"tensor {name}'s dimension count")
            if not 1 <= nd <= 4:
                raise ValueError(f"tensor '{name}': n_dims {nd} is not in 1..4")
            shape = tuple(scalar(10, f"tensor {name}'s shape") for _ in range(nd))
            ttype = scalar(4, f"tensor {name}'s type")
            scalar(10, f"tensor {name}'s offset")
            tensors.append((name, ttype, shape))
        return Header(version, fields, tensors)
    finally:
        buf.close()
