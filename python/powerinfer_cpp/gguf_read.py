"""Reading GGUF files with the ``gguf`` package, PowerInfer's own files included.

PowerInfer writes ordinary GGUF v3 files whose magic is patched to ``PWRI``; the
``gguf`` package refuses that magic, so its reader is given the one word it expects.
"""

from __future__ import annotations

import os

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
