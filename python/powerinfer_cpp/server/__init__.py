"""OpenAI-compatible HTTP server and web chat page (`python -m powerinfer_cpp.server`).

Needs the `server` extra: `pip install "powerinfer-cpp[server]"` (FastAPI + uvicorn).
"""

from __future__ import annotations

__all__ = ["Settings", "create_app", "main"]


def __getattr__(name):
    if name in ("Settings", "create_app"):
        from . import app

        return getattr(app, name)
    if name == "main":
        from .__main__ import main

        return main
    raise AttributeError(f"module 'powerinfer_cpp.server' has no attribute '{name}'")
