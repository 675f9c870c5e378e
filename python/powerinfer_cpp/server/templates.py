"""Chat templates rendered in worker processes, under a deadline, a memory limit and an
output cap.

A template comes from a model file or --chat-template-file, so it is untrusted code: the
jinja sandbox stops it reaching Python internals, but not from looping for minutes or
building a string of gigabytes ({{ 'a' * 300000000 }} grew the server to 14 GB). A single
string operation is one C call that no thread can interrupt, and a Python thread rendering
holds the GIL the event loop needs; a process can be killed at the deadline and capped by
the kernel (RLIMIT_AS). So each render is sent to a small worker process; a worker that
misses its deadline is killed and a fresh one started on the next render. A normal render
costs a pipe round trip (~0.2 ms).

Wire format on the worker's stdin/stdout: a 4-byte big-endian length, then UTF-8 JSON.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..chat import ChatTemplate, ChatTemplateError, ChatTemplateLimitError

# Workers started at most: renders beyond this many at once wait for one (within their
# deadline). A hostile template holds a worker for at most the deadline, so this many
# such requests at once are what it takes to make a normal chat request wait.
MAX_WORKERS = 4

# A new worker's start (interpreter, jinja2, compiling the template) is not the template's
# time: it has this long, on a machine as loaded as it may be, before a render's deadline.
START_TIMEOUT_S = 60.0

# The message the trial render at load uses: one user turn, as every template accepts.
TRIAL_MESSAGES = [{"role": "user", "content": "Hello"}]


class TemplateCompileError(ChatTemplateError):
    """The template does not compile (found by the worker, which alone compiles it)."""


def _write_frame(f, obj) -> None:
    data = json.dumps(obj).encode()
    f.write(struct.pack(">I", len(data)) + data)
    f.flush()


def _read_frame(f):
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    data = f.read(n)
    if len(data) < n:
        return None
    return json.loads(data)


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, init: dict):
        pkg_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"]
                                        if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "powerinfer_cpp.server.templates"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        _write_frame(self.proc.stdin, init)
        self.started = self.call(None, START_TIMEOUT_S) is not None

    def call(self, request: dict, timeout: float) -> dict | None:
        """The worker's reply, or None when it missed the deadline or died (it is then
        killed; the caller drops it)."""
        timer = threading.Timer(max(timeout, 0.0), self.proc.kill)
        timer.daemon = True
        timer.start()
        try:
            if request is not None:
                _write_frame(self.proc.stdin, request)
            return _read_frame(self.proc.stdout)
        except (OSError, ValueError):
            return None
        finally:
            timer.cancel()

    def close(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class TemplateRunner:
    """Renders one chat template in worker processes. render() blocks: call it from a
    thread, never from the event loop. Errors are ChatTemplateError; a limit that was hit
    is ChatTemplateLimitError naming it."""

    def __init__(self, template: ChatTemplate, timeout: float, memory_mib: int,
                 max_chars: int):
        self.timeout, self.memory_mib, self.max_chars = timeout, memory_mib, max_chars
        self._init = {"source": template.source, "tokens": template.tokens,
                      "memory_mib": memory_mib, "max_chars": max_chars}
        self._idle: queue.LifoQueue = queue.LifoQueue()
        for _ in range(MAX_WORKERS):
            self._idle.put(None)  # a place for a worker, started when first needed
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _limit_error(self, what: str) -> ChatTemplateLimitError:
        return ChatTemplateLimitError(
            f"the chat template did not finish {what} within the render deadline of "
            f"{self.timeout:g} s (--template-timeout)", "render deadline")

    def call(self, request: dict, what: str = "rendering") -> dict:
        deadline = time.monotonic() + self.timeout
        try:
            worker = self._idle.get(timeout=self.timeout)
        except queue.Empty:
            raise self._limit_error(what + " (every template worker was busy)") from None
        ok = False
        try:
            if worker is None or worker.proc.poll() is not None:
                if worker is not None:
                    self._drop(worker)
                worker = self._start()
                deadline = time.monotonic() + self.timeout  # the render's own time
            reply = worker.call(request, deadline - time.monotonic())
            if reply is None:
                raise self._limit_error(what)
            ok = True
        finally:
            if ok:
                self._idle.put(worker)
            else:
                if worker is not None:
                    self._drop(worker)
                # A fresh worker in the background, so the next request does not wait
                # for its start.
                threading.Thread(target=self._replace, daemon=True).start()
        if "error" in reply:
            if reply.get("limit"):
                raise ChatTemplateLimitError(reply["error"], reply["limit"])
            if reply.get("compile"):
                raise TemplateCompileError(reply["error"])
            raise ChatTemplateError(reply["error"])
        return reply

    def _start(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise ChatTemplateError("the server is shutting down")
        worker = _Worker(self._init)
        with self._lock:
            self._all.add(worker)
            closed = self._closed
        if closed or not worker.started:
            self._drop(worker)
            raise ChatTemplateError("the server is shutting down" if closed else
                                    "the chat template worker process did not start")
        return worker

    def _replace(self) -> None:
        try:
            worker = self._start()
        except ChatTemplateError:
            worker = None  # started again when next needed
        self._idle.put(worker)

    def _drop(self, worker: _Worker) -> None:
        worker.close()
        with self._lock:
            self._all.discard(worker)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list | None = None) -> str:
        """The prompt text (messages already normalized: plain dicts of strings); `tools`
        is the template's variable of that name (a native tool format's tools)."""
        req = {"op": "render", "messages": messages,
               "add_generation_prompt": bool(add_generation_prompt)}
        if tools is not None:
            req["tools"] = tools
        return self.call(req)["text"]

    def trial(self) -> list[str]:
        """Render a one-message chat and work out the stop strings, as every request will
        need them: a template over a limit shows it here, at load. Returns the stop
        strings; raises ChatTemplateLimitError or TemplateCompileError (other template
        errors are left to the requests that meet them: a template may refuse some chats
        and not others)."""
        return self.call({"op": "trial"}, "its trial render at load")["stops"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            w.close()


# -- the worker process ------------------------------------------------------------------


def _limit_memory(mib: int) -> None:
    """Cap this process's address space at what it uses now plus `mib` (Linux; elsewhere
    RLIMIT_AS is not enforced and the deadline alone bounds a render)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = now + (mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (ImportError, OSError, ValueError):
        pass


def _serve(inp, out) -> None:
    # Ctrl-C in the server's terminal reaches the whole process group; the server ends
    # its workers itself (and a worker ends when its stdin closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init = _read_frame(inp)
    if init is None:
        return
    tokens = dict(init["tokens"])
    bos, eos = tokens.pop("bos_token", ""), tokens.pop("eos_token", "")
    # Not compiled yet: compiling runs template code, so it happens in the first
    # request's time and under the memory limit.
    template = ChatTemplate(init["source"], bos_token=bos, eos_token=eos,
                            special_tokens=tokens, compile=False)
    max_chars = int(init["max_chars"])
    _limit_memory(int(init["memory_mib"]))
    _write_frame(out, {"ready": True})
    while True:
        req = _read_frame(inp)
        if req is None:
            return
        try:
            try:
                template._template
            except ChatTemplateError as e:
                raise TemplateCompileError(str(e)) from None
            if req["op"] == "trial":
                template.render(TRIAL_MESSAGES, add_generation_prompt=True,
                                max_chars=max_chars)
                reply = {"stops": template.stop_strings()}
            else:
                extra = {"tools": req["tools"]} if "tools" in req else {}
                reply = {"text": template.render(req["messages"],
                                                 add_generation_prompt=req[
                                                     "add_generation_prompt"],
                                                 max_chars=max_chars, **extra)}
        except ChatTemplateLimitError as e:
            reply = {"error": str(e), "limit": e.limit}
        except TemplateCompileError as e:
            reply = {"error": str(e), "compile": True}
        except MemoryError:
            reply = {"error": f"the chat template needed more than the memory limit of "
                              f"{init['memory_mib']} MiB (--template-memory)",
                     "limit": "memory"}
        except ChatTemplateError as e:
            reply = {"error": str(e)}
        except Exception as e:  # a template bug is the request's error, not the worker's end
            reply = {"error": f"the chat template failed: {type(e).__name__}: {e}"}
        _write_frame(out, reply)


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
