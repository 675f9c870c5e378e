"""Whether this runtime loads a GGUF file, and every reason it does not, in one pass.

The native loader stops at the first problem it meets, which suits a file this project
wrote; a file downloaded from elsewhere often has several (a tensor type, the
pre-tokenizer, the architecture), and fixing them one load at a time is a poor way to
learn that it will not run. ``check(path)`` reads the header only (gguf_read.read_header:
~40 ms on the 98 MB SmolLM2 file, whose load takes ~1.4 s) and asks, for each question,
the table that decides it:

- tensor types: the runtime's type table through cffi (``gh_type_block_size``,
  ``gh_type_row_size``, ``gh_type_name``), so a type added there is accepted here at once;
- the architecture: the loader's own registry (``gh_arch_names``);
- keys: ``general.architecture`` and format.REQUIRED_ARCH_KEYS under its name;
- the tokenizer: tokens or an embedded tokenizer.json, a ``tokenizer.ggml.model`` it
  reads, and for byte-level BPE a ``tokenizer.ggml.pre`` with a row in format.py's table
  (tokenizer.pre_tokenizer_refusal gives the reason for the refused ones).

Model() runs it when the native load fails and raises one error naming every problem
(load_error); ``inspect`` prints its verdict ("loads: yes" / "loads: no" and the list).
What the preflight does not check (shapes, values, the loader's other rules) still comes
from the native loader, whose message is kept when no problem here accounts for it.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from . import format as F
from .gguf_read import read_header
from .tokenizer import pre_tokenizer_refusal

__all__ = ["Problem", "check", "check_header", "readable_types", "merge", "load_error", "format_problems"]

#: How many tensors a type problem names before it only counts the rest.
_NAMED_TENSORS = 3


@dataclass(frozen=True)
class Problem:
    """One reason the runtime does not load a file. kind: "types", "shape",
    "architecture", "key" or "tokenizer"."""

    kind: str
    message: str


@functools.lru_cache(maxsize=None)
def readable_types() -> dict[int, str]:
    """GGML type id -> name of every type the runtime's type table reads (reads: has a
    block size, i.e. a dequantizer), in id order."""
    from ._native import ffi, lib

    # the ids GGML has used stay far below 256; asking past them costs microseconds
    return {t: ffi.string(lib.gh_type_name(t)).decode() for t in range(256) if lib.gh_type_block_size(t) > 0}


def _type_name(t: int) -> str:
    from ._native import ffi, lib

    return ffi.string(lib.gh_type_name(t)).decode() if 0 <= t < 2**31 else "unknown"


def _arch_names() -> list[str]:
    from ._native import ffi, lib

    return ffi.string(lib.gh_arch_names()).decode().split(", ")


def _types(tensors) -> list[Problem]:
    from ._native import lib

    readable = readable_types()
    bad: dict[int, list[str]] = {}
    out = []
    for name, t, shape in tensors:
        if t == lib.GH_TYPE_I32:  # index tensors (gpu_idx, gpu_bucket): the loader reads them itself
            continue
        if t not in readable:
            bad.setdefault(t, []).append(name)
        elif lib.gh_type_row_size(t, min(shape[0], 2**63 - 1)) == 0:  # a corrupt ne[0] may not fit int64
            out.append(Problem("shape", f"tensor '{name}': ne[0] = {shape[0]} is not a multiple of the "
                                        f"{readable[t]} block size {lib.gh_type_block_size(t)}"))
    if bad:
        parts = []
        for t, names in bad.items():
            shown = ", ".join(f"'{n}'" for n in names[:_NAMED_TENSORS])
            more = f" and {len(names) - _NAMED_TENSORS} more" if len(names) > _NAMED_TENSORS else ""
            parts.append(f"{_type_name(t)} (id {t}) in {len(names)} tensor{'s' * (len(names) > 1)} "
                         f"({shown}{more})")
        why = ""
        if any(_type_name(t).lower() in F.READ_ONLY_TYPES for t in bad):
            # known by name, but this build was made without their codebooks (tools/gen_iq_grids.py)
            why = ("; this build has not the codebooks of the IQ1/IQ2/IQ3 lattice types: they are "
                   "generated from the gguf package at build time, so rebuild with gguf installed")
        out.insert(0, Problem("types", "tensor types this runtime does not read: " + "; ".join(parts)
                              + f" (it reads {', '.join(readable_types().values())} and i32{why})"))
    return out


def _arch_and_keys(fields: dict) -> list[Problem]:
    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE)
    if not isinstance(arch, str):
        return [Problem("key", f"missing key '{F.KEY_GENERAL_ARCHITECTURE}'")]
    names = _arch_names()
    if arch not in names:
        # its keys are spelled under a name the loader does not know: nothing more to check
        return [Problem("architecture", f"unsupported architecture '{arch[:64]}' "
                                        f"({F.KEY_GENERAL_ARCHITECTURE}; supported: {', '.join(names)})")]
    return [Problem("key", f"missing required key '{F.arch_key(k, arch)}'")
            for k in F.REQUIRED_ARCH_KEYS if F.arch_key(k, arch) not in fields]


def _tokenizer(fields: dict) -> list[Problem]:
    if isinstance(fields.get(F.KEY_TOKENIZER_HF_JSON), str):
        return []  # the embedded tokenizer.json is used whole; the ggml keys do not matter
    if F.KEY_TOKENIZER_TOKENS not in fields:
        return [Problem("tokenizer", f"the file has no tokenizer (neither {F.KEY_TOKENIZER_HF_JSON} nor "
                                     f"{F.KEY_TOKENIZER_TOKENS})")]
    kind = fields.get(F.KEY_TOKENIZER_MODEL)
    if kind not in (F.TOKENIZER_GPT2, F.TOKENIZER_LLAMA):
        return [Problem("tokenizer", f"unsupported {F.KEY_TOKENIZER_MODEL} {kind!r} "
                                     f"(supported: {F.TOKENIZER_GPT2}, {F.TOKENIZER_LLAMA})")]
    if kind == F.TOKENIZER_GPT2:
        why = pre_tokenizer_refusal({F.KEY_TOKENIZER_PRE: fields.get(F.KEY_TOKENIZER_PRE)})
        if why:
            return [Problem("tokenizer", f"{why} (its text would be split wrongly; the "
                                         f"{len(F.TOKENIZER_PRE_TOKENIZERS)} names read are "
                                         "format.TOKENIZER_PRE_TOKENIZERS)")]
    return []


def check_header(header) -> list[Problem]:
    """Every problem of a gguf_read.Header, types first, then architecture and keys, then
    the tokenizer."""
    return _types(header.tensors) + _arch_and_keys(header.fields) + _tokenizer(header.fields)


def check(path: str | os.PathLike) -> list[Problem]:
    """Every problem this runtime would have loading the file (empty: none the preflight
    sees). A file whose header cannot be read raises ValueError / OSError."""
    return check_header(read_header(os.fspath(path)))


def _without_path(native: str, path: str | None) -> str:
    """The native message without the file name it starts with (the report names the file
    once; a quoted path would also read as a name the problems must account for)."""
    if path:
        for prefix in (f"GGUF '{path}': ", f"{path}: "):
            native = native.replace(prefix, "")
    return native


def _covered(native: str, problems: list[Problem]) -> bool:
    """Whether the problems account for the native loader's message: every name it quotes
    (tensor, key, architecture) is named by one of them."""
    names = re.findall(r"'([^']+)'", native)
    text = "\n".join(p.message for p in problems)
    return bool(names) and all(f"'{n}'" in text for n in names)


def merge(native: str | None, problems: list[Problem], path: str | os.PathLike | None = None) -> list[str]:
    """The reasons to report: the problems, and the native loader's message about ``path``
    too unless they account for it."""
    out = [p.message for p in problems]
    if native:
        native = _without_path(native, os.fspath(path) if path is not None else None)
        if not _covered(native, problems):
            out.append(native)
    return out


def format_problems(reasons: list[str], indent: str = "  ") -> str:
    return "\n".join(f"{indent}- {r}" for r in reasons)


def load_error(path: str, error: Exception) -> Exception:
    """The error Model() raises when the native load failed with ``error``: the same class
    and status, its message naming every problem the preflight finds; ``error`` itself when
    the preflight adds nothing (or cannot read the header)."""
    try:
        problems = check(path)
    except Exception:  # noqa: BLE001 -- a check that fails must not hide the loader's own error
        return error
    native = str(error)
    reasons = merge(native, problems, path)
    if len(reasons) <= 1:
        return error  # the native message alone says it all
    msg = (f"this runtime cannot load {path} ({len(reasons)} problems):\n" + format_problems(reasons))
    try:
        merged = type(error)(error.status, msg) if hasattr(error, "status") else type(error)(msg)
    except TypeError:
        return error
    return merged
