"""The CPU kernel table's coverage, read from the tables (gh_kernel_source,
tools/kernel_coverage.py): every weight type has a SIMD kernel of its own for every path
that takes a weight type (the dense matmul and its prompt tiles, the gathered-row dot4, the
transposed matmul's one- and four-row axpy) at both SIMD levels, and the cells where a
level runs a lower level's kernel are exactly the listed ones, each with its reason. The
numerics of every kernel are tested elsewhere (test_types_matmul.py, test_sparse_*.py,
test_input_sparsity.py) at every SIMD level."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from powerinfer_cpp import _native
from powerinfer_cpp._native import ffi, lib

from opref import LATTICE_TYPES, TYPES  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

ROOT = REPO_DIR
SCALAR, AVX2, AVX512 = lib.GH_SIMD_SCALAR, lib.GH_SIMD_AVX2, lib.GH_SIMD_AVX512
#: the forms every type needs at every SIMD level (a weight type's paths)
REQUIRED = ("dot", "dot4", "axpy", "axpy4", "axpy4pf")

#: (type, form, level) cells that run a lower level's kernel, and why
INHERITED = {
    # Q4_1's one- and four-row axpy: AVX-512 forms of them measured 3-10% slower than
    # AVX2's widening loads (avx512/axpy_avx512.c), so the table keeps AVX2's
    ("q4_1", "axpy", AVX512): "AVX2's measured faster",
    ("q4_1", "axpy4", AVX512): "AVX2's measured faster",
    ("q4_1", "axpy4pf", AVX512): "AVX2's measured faster",
    # the sixteen-row int8 forms are AVX2 code; AVX-512 has Q4_0's and Q4_1's one-token
    # and batch forms in VNNI, Q8_0's batch form (its one-token VNNI form read DRAM slower
    # than AVX2's: avx512/axpy_avx512.c), the K-quants' run AVX2's
    ("q8_0", "axpy16", AVX512): "int8 form in AVX2 (measured faster from DRAM)",
    ("q4_k", "axpy16", AVX512): "int8 form in AVX2",
    ("q5_k", "axpy16", AVX512): "int8 form in AVX2",
    ("q6_k", "axpy16", AVX512): "int8 form in AVX2",
    ("q4_k", "matmul16", AVX512): "int8 form in AVX2",
    ("q5_k", "matmul16", AVX512): "int8 form in AVX2",
    ("q6_k", "matmul16", AVX512): "int8 form in AVX2",
    # the IQ lattice types (kernels_iqlat_avx2.c): AVX2 dot and one-row axpy, which the
    # AVX-512 level runs (no AVX-512 kernels of theirs yet)
    **{(n, f, AVX512): "lattice types: AVX2's" for n in LATTICE_TYPES for f in ("dot", "axpy")},
}
#: (type, form) without a kernel at any SIMD level: the callers use the next smaller form
#: (the lattice types: their gathered rows run the row dot one row at a time, their four
#: rows the one-row axpy four times)
NONE: dict = {(n, f): "lattice types: one-row forms only" for n in LATTICE_TYPES for f in ("dot4", "axpy4", "axpy4pf")}


def forms() -> list[str]:
    out = []
    while (name := lib.gh_kernel_form_name(len(out))) != ffi.NULL:
        out.append(ffi.string(name).decode())
    return out


def source(t: int, form: str, level: int) -> int:
    return lib.gh_kernel_source(t, forms().index(form), level, ffi.NULL, ffi.NULL)


def test_bad_arguments():
    assert forms()[:3] == ["dot", "dot4", "axpy"]
    assert lib.gh_kernel_form_name(-1) == ffi.NULL
    assert lib.gh_kernel_source(99, 0, 0, ffi.NULL, ffi.NULL) == -2        # no such type
    assert lib.gh_kernel_source(TYPES["f32"], 99, 0, ffi.NULL, ffi.NULL) == -2
    assert lib.gh_kernel_source(TYPES["f32"], 0, 3, ffi.NULL, ffi.NULL) == -2
    assert lib.gh_kernel_source(TYPES["f32"], 0, -1, ffi.NULL, ffi.NULL) == -2
    mr, nt = ffi.new("int *"), ffi.new("int *")
    assert lib.gh_kernel_source(TYPES["q4_0"], 0, SCALAR, mr, nt) == SCALAR and (mr[0], nt[0]) == (1, 1)


def test_every_type_has_simd_kernels_for_every_path():
    missing = []
    for name, t in TYPES.items():
        for form in REQUIRED:
            if (name, form) in NONE:
                assert all(source(t, form, lv) == -1 for lv in (SCALAR, AVX2, AVX512)), (name, form)
                continue
            for lv in (AVX2, AVX512):
                if source(t, form, lv) < AVX2:
                    missing.append(f"{name} {form} @{lv}: {source(t, form, lv)}")
    assert not missing, missing


def test_inherited_cells_are_the_listed_ones():
    got, lost = set(), []
    for name, t in TYPES.items():
        for form in forms():
            for lv in (AVX2, AVX512):
                s = source(t, form, lv)
                if 0 <= s < lv:
                    got.add((name, form, lv))
                if s < 0 and source(t, form, lv - 1) >= 0:  # a dot row without the dot4 below it
                    lost.append((name, form, lv))
    assert got == set(INHERITED), (sorted(got - set(INHERITED)), sorted(set(INHERITED) - got))
    assert not lost, lost


def test_prompt_tiles():
    """Every quantized type's dot at the SIMD levels runs tiles of several tokens (a prompt
    reads a weight once per tile, not once per token)."""
    mr, nt = ffi.new("int *"), ffi.new("int *")
    for name, t in TYPES.items():
        for lv in (AVX2, AVX512):
            assert lib.gh_kernel_source(t, 0, lv, mr, nt) >= AVX2
            assert mr[0] >= 3 and nt[0] >= 4, (name, lv, mr[0], nt[0])


def test_tool_prints_the_matrix():
    # the tool imports the repository's python/ (as its users run it); the library is the
    # one these tests load (an installed package's, or GH_LIBRARY's)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"),
               GH_LIBRARY=str(Path(_native.lib_path).resolve()))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_coverage.py"), "--gaps"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    table = r.stdout.split("\n\n")[0].splitlines()[2:]  # after the legend and the header
    rows = {line.split()[0]: line.split() for line in table}
    for name, t in TYPES.items():
        tname = ffi.string(lib.gh_type_name(t)).decode()
        assert rows[tname][1] == "".join("S25"[source(t, "dot", lv)] for lv in (SCALAR, AVX2, AVX512)), tname
    # the inherited cells, and the NONE forms at both SIMD levels
    assert f"SIMD cells without a kernel of their level: {len(INHERITED) + 2 * len(NONE)} " in r.stdout
