"""The model the project ships (models/), converted to GGUF in a user cache on first use."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

SHIPPED_NAME = "tiny-relu-kjv"
DEFAULT_PROMPT = "In the beginning"
DEFAULT_OUTTYPE = "f16"


def shipped_model_dir() -> Path:
    """The shipped Hugging Face folder: inside the installed package, or in the source tree."""
    pkg = Path(__file__).resolve().parent
    for cand in (pkg / "models" / SHIPPED_NAME, pkg.parent.parent / "models" / SHIPPED_NAME):
        if (cand / "config.json").is_file():
            return cand
    raise FileNotFoundError(
        f"the shipped model '{SHIPPED_NAME}' is not installed (looked in {pkg / 'models'} and "
        f"the source tree's models/); pass a model with -m MODEL.gguf")


def cache_dir() -> Path:
    """Where converted models are kept: $POWERINFER_CACHE, else ~/.cache/powerinfer_cpp."""
    env = os.environ.get("POWERINFER_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "powerinfer_cpp"


def _fingerprint(hf_dir: Path) -> str:
    from . import __version__

    h = hashlib.sha256(__version__.encode())
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith((".json", ".safetensors")):
            h.update(name.encode())
            h.update((hf_dir / name).read_bytes())
    return h.hexdigest()[:16]


def default_model_path(outtype: str = DEFAULT_OUTTYPE) -> Path:
    """Path of the shipped model as GGUF, converting it into the cache if needed."""
    hf_dir = shipped_model_dir()
    out = cache_dir() / f"{SHIPPED_NAME}-{outtype}-sparse-{_fingerprint(hf_dir)}.gguf"
    if not out.is_file():
        from .convert import ConvertError, convert

        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"cannot create the model cache folder {out.parent}: "
                          f"{e.strerror or e}; set POWERINFER_CACHE to a writable folder, "
                          "or pass a model with -m MODEL.gguf") from None
        print(f"converting the shipped model to {out} (first use: profiling and predictor "
              "training take ~10-30 s) ...", file=sys.stderr)
        # The full sparse pipeline, calibrated on the model's held-out text.
        try:
            convert(hf_dir, out, outtype=outtype, progress=False, sparse=True)
        except ConvertError as e:
            raise RuntimeError(f"converting the shipped model into {out.parent} failed: {e}; "
                               "set POWERINFER_CACHE to a writable folder, or pass a model "
                               "with -m MODEL.gguf") from None
    return out
