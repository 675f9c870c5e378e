"""Start `python -m powerinfer_cpp.server` on 127.0.0.1 and a free port; stop it after."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model, *args: str, timeout: float = 60.0, log_path=None):
    """Yield the base URL of a server for `model` started with extra `args`; the server
    is terminated (then killed) when the block ends, and its log is shown on failure
    (or written to `log_path`, for tests that read it)."""
    port = free_port()
    log = open(os.devnull, "w") if os.environ.get("PI_QUIET_SERVER") else None
    out = open(log_path, "w") if log_path is not None else subprocess.PIPE
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerinfer_cpp.server", "-m", str(model), "--host", "127.0.0.1",
         "--port", str(port), *args],
        stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                text = proc.stdout.read() if proc.stdout else open(log_path).read()
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{text}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            log.close()
        if log_path is not None:
            out.close()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled metric in /metrics output."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def sse_texts(lines):
    """The text pieces of a streamed completion's server-sent events."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                yield chunk["choices"][0]["text"]
