"""How weights reach memory: mapped (GH_LOAD_MMAP) or read into huge pages (GH_LOAD_READ)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from powerinfer_cpp import Model, NativeError
from powerinfer_cpp._native import ffi, lib


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def _proc_bytes(path: str, key: str) -> int:
    """A "Key:  N kB" line of a /proc file, in bytes (0 if absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _mem_available() -> int:
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def _anon_huge_bytes() -> int:
    return _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages")


def _logits(path, load, mode):
    with Model(path, n_ctx=64, n_threads=2, ffn=mode, load=load) as m:
        assert m.load_mode == load
        ids = m.tokenize("And God said, Let there be light: and there was light.")
        first = m.eval(ids).copy()
        steps = [m.eval([t]).copy() for t in ids[:6]]  # decode: the sparse path
        return np.stack([first, *steps])


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_read_and_mmap_give_the_same_logits(shipped_sparse, mode):
    path = shipped_sparse["sparse"]
    a = _logits(path, "mmap", mode)
    b = _logits(path, "read", mode)
    assert np.array_equal(a, b)


def test_auto_reads_when_huge_pages_are_on_and_the_file_fits(shipped_gguf):
    with Model(shipped_gguf, n_ctx=32) as m:
        fits = os.path.getsize(shipped_gguf) + (1 << 30) < _mem_available()
        assert m.load_mode == ("read" if _thp_enabled() and fits else "mmap")


@pytest.mark.skipif(not _thp_enabled(), reason="transparent huge pages are off on this machine")
def test_read_puts_the_weights_in_huge_pages(shipped_sparse):
    path = shipped_sparse["sparse"]
    size = os.path.getsize(path)
    assert size >= 4 << 20, "the test needs a file of a few huge pages"
    before = _anon_huge_bytes()
    with Model(path, n_ctx=32, load="read"):
        grown = _anon_huge_bytes() - before
    # all whole 2 MiB pages of the file, allowing one page the kernel could not assemble
    assert grown >= (size // (2 << 20) - 1) * (2 << 20), (grown, size)


def test_bad_load_mode(shipped_gguf):
    with pytest.raises(ValueError, match="load must be one of auto, mmap, read"):
        Model(shipped_gguf, load="hugepages")
    out = ffi.new("gh_gguf **")
    assert lib.gh_gguf_open_ex(str(shipped_gguf).encode(), 7, out) != 0
    assert "unknown load mode 7" in ffi.string(lib.gh_last_error()).decode()
    assert out[0] == ffi.NULL


@pytest.mark.parametrize("load", ["mmap", "read"])
def test_truncated_file_fails_cleanly_in_both_modes(random_gguf, tmp_path, load):
    data = random_gguf.read_bytes()
    for cut in (24, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(NativeError) as e:
            Model(p, load=load)
        assert str(p) in str(e.value)


def test_generate_load_flag(shipped_gguf):
    outs = []
    for load in ("mmap", "read"):
        r = subprocess.run([sys.executable, "-m", "powerinfer_cpp.generate", "-m", str(shipped_gguf),
                            "-p", "In the beginning", "-n", "8", "--temp", "0", "--load", load],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert ("weights read into memory" if load == "read" else "weights mapped from the file") in r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1]
    r = subprocess.run([sys.executable, "-m", "powerinfer_cpp.generate", "-m", str(shipped_gguf),
                        "--load", "bogus"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--load" in r.stderr


def test_read_without_memory_says_to_map(shipped_sparse):
    """Reading needs the file's size in fresh memory: when the address space is capped
    below that, loading fails with an error that names the way out (load=mmap)."""
    script = f"""
import os, resource
from powerinfer_cpp import Model, NativeError
path = {str(shipped_sparse["sparse"])!r}
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 4 * 2**20, resource.RLIM_INFINITY))
try:
    Model(path, n_ctx=16, load="read")
except NativeError as e:
    print("ERR", e)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cannot read" in r.stdout and "load=mmap" in r.stdout, r.stdout


def test_read_of_a_file_larger_than_memory_is_refused(tmp_path):
    """A forced read of more than the available memory fails before reading (it would end
    in the OOM killer); auto maps such a file instead."""
    p = tmp_path / "huge.gguf"
    with open(p, "wb") as f:  # sparse: takes no disk space
        f.truncate(_mem_available() + (64 << 30))
    with pytest.raises(NativeError, match=r"cannot read .* it needs \d+ MiB and \d+ MiB are available .*load=mmap"):
        Model(p, load="read")
    # auto maps it, and the zeros are then rejected as not a GGUF file
    with pytest.raises(NativeError, match="(?i)magic|not a GGUF"):
        Model(p, load="auto")
