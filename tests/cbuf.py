"""Typed C pointers to numpy buffers, for tests that call gh_op_* directly."""

from __future__ import annotations

import numpy as np

from powerinfer_cpp._native import ffi


def fptr(a: np.ndarray):
    """float * to a contiguous float32 array."""
    assert a.dtype == np.float32 and a.flags.c_contiguous
    return ffi.cast("float *", a.ctypes.data)


def iptr(a: np.ndarray):
    """int32_t * to a contiguous int32 array."""
    assert a.dtype == np.int32 and a.flags.c_contiguous
    return ffi.cast("int32_t *", a.ctypes.data)
