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

REPO = Path(__file__).resolve().parents[2]


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


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
