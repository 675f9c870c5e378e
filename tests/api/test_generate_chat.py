"""`python -m powerinfer_cpp.generate -cnv` as a user runs it: on a terminal (tmux), and
with its input piped."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

TMUX = shutil.which("tmux")


def _cmd(gguf, *extra):
    return [sys.executable, "-m", "powerinfer_cpp.generate", "-m", str(gguf), "-cnv",
            "-sys", "Be brief.", "-n", "12", "--temp", "0", "-t", "1", *extra]


def test_chat_with_piped_input_keeps_history(shipped_gguf):
    r = subprocess.run(_cmd(shipped_gguf), input="Who made the light?\nAnd the darkness?\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    turns = re.findall(r"\[(\d+) tokens, [\d.]+ tokens/s; prompt (\d+) tokens, (\d+) cached\]",
                       r.stderr)
    assert len(turns) == 2, r.stderr
    (n1, p1, c1), (n2, p2, c2) = [tuple(map(int, t)) for t in turns]
    assert c1 == 0 and n1 == 12
    # the second prompt repeats the first turn: all but its last token come from the cache
    assert p2 > p1 + n1 and c2 >= p1 + n1 - 2
    assert len(r.stdout.strip().splitlines()) >= 2


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_chat_on_a_terminal(shipped_gguf, tmp_path):
    sock = f"pi-test-{os.getpid()}"    # a private tmux server: our environment, our session
    tmux = [TMUX, "-L", sock]
    env_prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in os.environ.items()
                          if k in ("PYTHONPATH", "GH_LIBRARY", "PATH", "HOME"))
    cmd = f"env {env_prefix} {shlex.join(_cmd(shipped_gguf))}; echo EXITED=$?; sleep 30"
    subprocess.run([*tmux, "new-session", "-d", "-s", "chat", "-x", "160", "-y", "50", cmd],
                   check=True)

    def screen():
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "chat", "-S", "-200"],
                              capture_output=True, text=True).stdout

    def wait_for(pred, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = screen()
            if pred(s):
                return s
            time.sleep(0.1)
        raise AssertionError(f"timed out; the terminal shows:\n{screen()}")

    def send(text):
        subprocess.run([*tmux, "send-keys", "-t", "chat", "-l", text], check=True)
        subprocess.run([*tmux, "send-keys", "-t", "chat", "Enter"], check=True)

    try:
        wait_for(lambda s: "/exit or Ctrl-D quits" in s and s.rstrip().endswith(">"))
        send("Who made the light?")
        wait_for(lambda s: s.count(" cached]") == 1 and s.rstrip().endswith(">"))
        send("And the darkness?")
        s = wait_for(lambda s: s.count(" cached]") == 2 and s.rstrip().endswith(">"))
        assert "> Who made the light?" in s and "> And the darkness?" in s
        cached = [int(c) for c in re.findall(r"(\d+) cached\]", s)]
        assert cached[0] == 0 and cached[1] > 20
        send("/reset")
        wait_for(lambda s: "(history cleared)" in s)
        subprocess.run([*tmux, "send-keys", "-t", "chat", "C-d"], check=True)
        wait_for(lambda s: "EXITED=0" in s)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
