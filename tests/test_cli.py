"""`python -m powerinfer_cpp.generate` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(*args, **kw):
    env = dict(os.environ)
    env.update(kw.pop("env", {}))
    return subprocess.run([sys.executable, "-m", "powerinfer_cpp.generate", *args],
                          capture_output=True, text=True, timeout=300, env=env, **kw)


def test_generate_streams_text_and_timings(shipped_gguf):
    r = _run("-m", str(shipped_gguf), "-p", "In the beginning", "-n", "16", "--temp", "0", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("In the beginning")
    assert len(r.stdout) > len("In the beginning") + 10
    for label in ("load time", "prompt eval", "decode", "tokens/s"):
        assert label in r.stderr


def test_prompt_from_file_and_seed_reproducible(shipped_gguf, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("And God said", encoding="utf-8")
    a = _run("-m", str(shipped_gguf), "-f", str(f), "-n", "12", "--seed", "5", "--temp", "1")
    b = _run("-m", str(shipped_gguf), "-f", str(f), "-n", "12", "--seed", "5", "--temp", "1")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("And God said")


def test_default_model_runs_from_cache(tmp_path):
    env = {"POWERINFER_CACHE": str(tmp_path / "cache")}
    r = _run("-n", "8", "--temp", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("In the beginning")
    assert list((tmp_path / "cache").glob("*.gguf")), "the shipped model was not cached"
    again = _run("-n", "8", "--temp", "0", env=env)
    assert again.stdout == r.stdout and "converting" not in again.stderr


@pytest.mark.parametrize("args,msg", [
    (["-m", "/nonexistent/model.gguf", "-p", "x"], "not found"),
    (["-m", "README.md", "-p", "x"], "magic"),
])
def test_errors_are_messages_not_tracebacks(args, msg):
    r = _run(*args, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1
    assert r.stderr.startswith("error:") and msg in r.stderr
    assert "Traceback" not in r.stderr


# -- the other command lines: their --help and their noise ------------------------------

@pytest.mark.parametrize("module", ["generate", "convert", "inspect", "place", "server"])
def test_help_has_no_literal_percent_escapes(module):
    """argparse %-formats help strings but not group titles: a `2%%` there shows as is."""
    r = subprocess.run([sys.executable, "-m", f"powerinfer_cpp.{module}", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "%%" not in r.stdout and "usage:" in r.stdout


def test_convert_keeps_library_noise_out_of_the_terminal(tmp_path):
    """gguf's "Writing the following files" with temp-file paths shows only with -v."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.join(repo, "models", "tiny-relu-kjv")
    cmd = [sys.executable, "-m", "powerinfer_cpp.convert", src, "-o", str(tmp_path / "t.gguf"),
           "--dense"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stderr and "LlamaForCausalLM" in r.stderr  # our own lines stay
    for noise in ("Writing the following files", ".tmp", "Little Endian"):
        assert noise not in r.stderr + r.stdout
    v = subprocess.run(cmd + ["-v"], capture_output=True, text=True, timeout=300)
    assert v.returncode == 0 and "Writing the following files" in v.stderr


def test_convert_logging_hides_python_mip_version_line():
    """python-mip logs its version at INFO when the placement imports it."""
    pytest.importorskip("mip")
    code = ("import logging\n"
            "from powerinfer_cpp.convert.cli import _setup_logging\n"
            "_setup_logging(quiet=False, verbose=False)\n"
            "import mip\n"
            "logging.getLogger('powerinfer_cpp.convert').info('ours')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "ours\n" and r.stdout == ""
