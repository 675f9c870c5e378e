"""The slot routes, as llama-server has them: `GET /slots` lists the slots, and
`POST /slots/{id}?action=save|restore|erase` saves a slot's KV cache to a file under
--slot-save-path (body {"filename": NAME}), restores one into a slot, or empties a slot.

Refusals in llama-server's statuses: 501 without --slot-save-path; 400 for a slot id that
is not a slot, an unknown action, a file name that is not a plain name in that directory
(a path, "..", a hidden or control-character name) or a file that is not a state of this
model and cache type; 503 while the slot is generating."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from fastapi import Request

from ..context import ContextState
from .errors import APIError
from .prepare import parse_json

MAX_NAME = 255


def check_filename(name) -> str:
    """A plain file name in the save directory, or APIError 400: no separators, no "." or
    "..", no leading dot or space, no trailing dot or space, no control characters."""
    if not isinstance(name, str) or not name:
        raise APIError(400, "filename must be a non-empty string", param="filename")
    bad = ("/" in name or "\\" in name or name in (".", "..") or name[0] in ". " or
           name[-1] in ". " or any(ord(c) < 32 or ord(c) == 127 for c in name) or
           "\ufeff" in name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME)
    if bad:
        raise APIError(400, f"Invalid filename {name[:80]!r}: give a plain file name (no "
                       "directories, no leading dot) of at most 255 bytes; it is stored under "
                       "--slot-save-path", param="filename")
    return name


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def add_routes(app, server) -> None:
    """Register GET /slots and POST /slots/{id_slot} on the app."""

    @app.get("/slots")
    async def list_slots():
        pool = server.pool
        free = set(id(s) for s in pool.free) if pool else set()
        return [{"id": s.index, "n_ctx": server.n_ctx, "busy": id(s) not in free,
                 "is_processing": id(s) not in free, "n_past": len(s.cached)}
                for s in server.slots]

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: str, request: Request):
        save_dir = server.settings.slot_save_path
        if not save_dir:
            raise APIError(501, "This server does not support slots action: start it with "
                           "--slot-save-path DIR", type="not_supported_error")
        try:
            slot = server.slots[int(id_slot)] if int(id_slot) >= 0 else None
        except (ValueError, IndexError):
            slot = None
        if slot is None:
            raise APIError(400, f"Invalid slot ID {id_slot[:40]!r}: this server has slots 0 to "
                           f"{len(server.slots) - 1}", param="id_slot")
        action = request.query_params.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise APIError(400, f"Invalid action {action[:40]!r}: save, restore or erase",
                           param="action")
        path = None
        if action != "erase":
            body = parse_json(await request.body())
            path = Path(save_dir) / check_filename(body.get("filename"))
        pool = server.pool
        if not pool.take(slot):
            raise APIError(503, f"Slot {slot.index} is busy: retry when it is idle",
                           type="unavailable_error", code="slot_busy")
        loop = asyncio.get_running_loop()
        try:
            work = {"save": _save, "restore": _restore, "erase": _erase}[action]
            return await loop.run_in_executor(None, work, slot, path)
        finally:
            pool.release(slot)


def _save(slot, path: Path) -> dict:
    t0 = time.perf_counter()
    state = slot.ctx.save_state()
    blob = state.to_bytes()
    try:
        _write_atomic(path, blob)
    except OSError as e:
        raise APIError(500, f"could not write {path.name}: {e.strerror or e}",
                       type="server_error") from None
    return {"id_slot": slot.index, "filename": path.name, "n_saved": state.n_tokens,
            "n_written": len(blob), "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def _restore(slot, path: Path) -> dict:
    t0 = time.perf_counter()
    try:
        blob = _read(path)
    except FileNotFoundError:
        raise APIError(400, f"no saved slot named {path.name!r} under --slot-save-path",
                       param="filename") from None
    except OSError as e:
        raise APIError(400, f"could not read {path.name!r}: {e.strerror or e}",
                       param="filename") from None
    try:
        state = ContextState.from_bytes(blob)
        slot.ctx.load_state(state)
    except (ValueError, RuntimeError) as e:  # the runtime's refusals: the slot is unchanged
        raise APIError(400, f"cannot restore {path.name!r} into slot {slot.index}: {e}",
                       param="filename") from None
    slot.cached = slot.ctx.cached_tokens
    return {"id_slot": slot.index, "filename": path.name, "n_restored": state.n_tokens,
            "n_read": len(blob), "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def _erase(slot, path) -> dict:
    n = len(slot.ctx.cached_tokens)
    slot.ctx.reset()
    slot.cached = []
    return {"id_slot": slot.index, "n_erased": n}
