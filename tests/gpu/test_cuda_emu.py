"""The CUDA kernels' row math replayed on the CPU (cuda_emu.cu): needs nvcc, not a GPU.

On a machine without a GPU this is the only check of the kernels' element indexing (for
every type of the device's list, dev_types.cuh: its block and bytes against the type table,
its unit and element reads bit for bit against gh_dequantize_row, the lanes' partial sums;
the activations, the slicing of row lists); the GPU tests (test_cuda_ops.py) then check
the kernels themselves. The output lists the runtime's types the device does not read."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from powerinfer_cpp import _native
from powerinfer_cpp._native import ffi, lib

from opref import TYPES

REPO = Path(__file__).resolve().parents[2]

#: Read by the CPU runtime, not by the CUDA backend (refused at placement by name).
CUDA_REFUSED = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def gh_name(t: str) -> str:
    """The type table's spelling of an opref type name (as the emulation prints it)."""
    return ffi.string(lib.gh_type_name(TYPES[t])).decode()


def test_row_math_on_the_cpu(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc (the CUDA toolkit) is not installed: the emulation needs it to compile")
    lib = Path(_native.lib_path).resolve()
    exe = tmp_path / "cuda_emu"
    cmd = [nvcc, "-std=c++17", "-O2", "-I", str(REPO / "ggml-hybrid" / "include"),
           "-I", str(REPO / "ggml-hybrid" / "src"), str(REPO / "tests" / "gpu" / "cuda_emu.cu"),
           str(lib), "-Xlinker", f"-rpath,{lib.parent}", "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"{' '.join(cmd)}\n{build.stdout}\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ", 0 failed" in run.stdout
    # every type the op tests cover (opref.TYPES: those the CPU runtime reads, issue 25's
    # presets among them) is on the device's list; the runtime's others are refused by name
    # but the IQ lattice types, which the device refuses at placement, by name (their
    # codebooks are not on the device yet)
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("runtime types the CUDA"))
    missing = {t.lower() for t in line.split(":", 1)[1].split()} - {"none"}
    assert missing & set(TYPES) == set(CUDA_REFUSED) & set(TYPES), line
    for t in TYPES:
        if t not in CUDA_REFUSED:
            assert f"{gh_name(t)}: ok" in run.stdout, f"{t} is not on the CUDA type list"
