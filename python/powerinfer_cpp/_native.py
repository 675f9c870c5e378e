"""cffi binding of the ggml-hybrid runtime (ABI mode; the cdef is read from the one public header)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import cffi

_PKG_DIR = Path(__file__).resolve().parent
_REPO_DIR = _PKG_DIR.parent.parent
_LIB_NAME = "libggml_hybrid.so"


class NativeError(RuntimeError):
    """An error reported by the native runtime; the message is the runtime's own."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class NativeIOError(NativeError, OSError):
    """The runtime could not open, read or map a file."""


class NativeValueError(NativeError, ValueError):
    """A bad argument or an out-of-range value (token id, context overflow, ...)."""


class NativeBusyError(NativeError):
    """The context is running a call on another thread (GH_ERR_BUSY)."""


# gh_status -> exception class; statuses not listed raise NativeError.
_STATUS_ERRORS = {1: NativeIOError, 4: NativeValueError, 6: NativeValueError,
                  7: NativeBusyError}


def _find(candidates: list[Path], what: str) -> Path:
    for path in candidates:
        if path.is_file():
            return path
    tried = "\n  ".join(str(p) for p in candidates)
    raise ImportError(
        f"powerinfer_cpp: cannot find the native {what}; tried:\n  {tried}\n"
        "Install the package with `pip install .` (builds it with CMake), or build it in "
        "place with `cmake -B build && cmake --build build`, or point GH_LIBRARY at it."
    )


def _library_candidates() -> list[Path]:
    env = os.environ.get("GH_LIBRARY")
    if env:
        return [Path(env)]
    # Installed wheel first; then a developer build in the source tree.
    return [_PKG_DIR / _LIB_NAME, _REPO_DIR / "build" / _LIB_NAME]


def _header_candidates() -> list[Path]:
    return [_PKG_DIR / "include" / "ggml-hybrid.h",
            _REPO_DIR / "ggml-hybrid" / "include" / "ggml-hybrid.h"]


def _cdef_from_header(text: str) -> str:
    m = re.search(r"/\* CFFI-BEGIN \*/(.*)/\* CFFI-END \*/", text, re.S)
    if not m:
        raise ImportError("powerinfer_cpp: ggml-hybrid.h has no CFFI-BEGIN/CFFI-END region")
    return m.group(1)


ffi = cffi.FFI()
ffi.cdef(_cdef_from_header(_find(_header_candidates(), "header").read_text()))
lib_path = _find(_library_candidates(), "library")
lib = ffi.dlopen(str(lib_path))


def last_error() -> str:
    """The calling thread's last native error message."""
    return ffi.string(lib.gh_last_error()).decode("utf-8", "replace")


def check(status: int) -> None:
    """Raise NativeError with the native message if a gh_* call failed."""
    if status != 0:
        cls = _STATUS_ERRORS.get(status, NativeError)
        raise cls(status, last_error() or f"native call failed with status {status}")
