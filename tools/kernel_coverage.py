#!/usr/bin/env python3
"""The CPU kernel table's coverage, read from the tables themselves (gh_kernel_source), not
from a list kept by hand: for every type with kernels, every kernel form (the dot family
with its gemm tile, the gathered-row dot4, the axpy forms of the transposed matmul) and
every SIMD level, which level's table supplies the kernel that runs there.

A cell holds one character per level, scalar / AVX2 / AVX-512: the level whose kernel
runs at that level (S scalar, 2 AVX2, 5 AVX-512) or - (none: the callers use the next
smaller form, e.g. axpy4 -> four axpy calls). "S25" is a form with its own kernel at every
level; "S22" runs AVX2's kernel at AVX-512; "SSS" runs the scalar reference everywhere.
The dot column adds the gemm tiles (rows x tokens) per level. Gaps (--gaps lists them): a
SIMD level running a lower level's kernel (inherited) or the scalar one, or without a
kernel of a form every type's paths take (REQUIRED).

    PYTHONPATH=python GH_LIBRARY=build/libggml_hybrid.so python tools/kernel_coverage.py
        [--markdown] [--gaps]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from powerinfer_cpp._native import ffi, lib  # noqa: E402

LEVELS = [(lib.GH_SIMD_SCALAR, "scalar", "S"), (lib.GH_SIMD_AVX2, "avx2", "2"),
          (lib.GH_SIMD_AVX512, "avx512", "5")]
MAX_TYPE_ID = 256
#: the forms every weight type's paths take (the dense and prompt matmul, the gathered-row
#: dots, the transposed matmul's one- and four-row axpy); the others (axpy16, matmul16:
#: int8 forms; tiles: the F32 row's dense blocks) are optional, a type's own choice
REQUIRED = ("dot", "dot4", "axpy", "axpy4", "axpy4pf")


def forms() -> list[str]:
    out = []
    while True:
        name = lib.gh_kernel_form_name(len(out))
        if name == ffi.NULL:
            return out
        out.append(ffi.string(name).decode())


def coverage() -> dict:
    """{type name: {form: [(source level, mr, nt) per level]}} for every type with kernels."""
    fs = forms()
    mr, nt = ffi.new("int *"), ffi.new("int *")
    out = {}
    for t in range(MAX_TYPE_ID):
        if lib.gh_kernel_source(t, 0, 0, ffi.NULL, ffi.NULL) == -2:
            continue
        name = ffi.string(lib.gh_type_name(t)).decode()
        out[name] = {f: [(lib.gh_kernel_source(t, i, lv, mr, nt), mr[0], nt[0]) for lv, _, _ in LEVELS]
                     for i, f in enumerate(fs)}
    return out


def cell(srcs) -> str:
    return "".join("-" if s < 0 else LEVELS[s][2] for s, _, _ in srcs)


def tiles(srcs) -> str:
    return "/".join(f"{m}x{n}" if s >= 0 else "-" for s, m, n in srcs)


def gaps(cov: dict) -> list[str]:
    """'type form @level: runs X's' for every SIMD level that has no kernel of its own
    where a lower level has one ('none' where the level lost the lower level's: a dot row
    without the dot4 of the row below)."""
    out = []
    for name, fm in cov.items():
        for f, srcs in fm.items():
            for i, ((lv, lname, _), (s, _, _)) in enumerate(zip(LEVELS[1:], srcs[1:])):
                if 0 <= s < lv:
                    out.append(f"{name} {f} @{lname}: runs {LEVELS[s][1]}'s")
                elif s < 0 and (f in REQUIRED or any(p >= 0 for p, _, _ in srcs[:i + 1])):
                    out.append(f"{name} {f} @{lname}: none")
    return out


def table(cov: dict, markdown: bool) -> str:
    fs = forms()
    head = ["type", "dot", "dot tiles"] + fs[1:]
    rows = [[name, cell(fm["dot"]), tiles(fm["dot"])] + [cell(fm[f]) for f in fs[1:]]
            for name, fm in cov.items()]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    width = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in [head] + rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="a markdown table")
    ap.add_argument("--gaps", action="store_true", help="also list every inherited cell")
    a = ap.parse_args()
    cov = coverage()
    print("levels per cell: scalar/AVX2/AVX-512; S, 2, 5: whose kernel runs there; -: none")
    print(table(cov, a.markdown))
    g = gaps(cov)
    by_level = {lname: sum(f"@{lname}:" in x for x in g) for _, lname, _ in LEVELS[1:]}
    scalar = sum("runs scalar's" in x for x in g)
    none = sum(x.endswith(": none") for x in g)
    print(f"\nSIMD cells without a kernel of their level: {len(g)} "
          f"({', '.join(f'{k} {v}' for k, v in by_level.items())}); running the scalar reference: "
          f"{scalar}; no kernel (required forms: {', '.join(REQUIRED)}): {none}")
    if a.gaps:
        print("\n".join(g))


if __name__ == "__main__":
    main()
