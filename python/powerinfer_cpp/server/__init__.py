"""OpenAI-compatible HTTP server and web chat page (`python -m powerinfer_cpp.server`).

Needs the `server` extra: `pip install "powerinfer-cpp[server]"` (FastAPI + uvicorn).
"""

from __future__ import annotations

from .settings import Settings

__all__ = ["Settings", "create_app", "main"]


# create_app needs the server extra (FastAPI), imported on first use so that Settings and
# the package import without it; main is __main__.py's, which runpy runs as a script.
def __getattr__(name):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "main":
        from .__main__ import main

        return main
    raise AttributeError(f"module 'powerinfer_cpp.server' has no attribute '{name}'")
