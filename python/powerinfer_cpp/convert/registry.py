"""The architectures the converter knows, built from the architecture modules."""

from __future__ import annotations

from ..gguf_write import ConvertError
from . import (arch_dots1, arch_falcon, arch_gemma2, arch_gemma3, arch_glm4moe, arch_gptoss, arch_llama,
               arch_mixtral, arch_olmo2, arch_olmoe, arch_opt, arch_phi3, arch_qwen2, arch_qwen2moe, arch_qwen3,
               arch_qwen3moe, arch_smollm3)
from .arch import Architecture

#: Every architecture module's ARCH, in the order errors list them.
ARCHITECTURES: tuple[Architecture, ...] = (arch_llama.ARCH, arch_qwen2.ARCH, arch_falcon.ARCH, arch_opt.ARCH,
                                           arch_phi3.ARCH, arch_qwen3.ARCH, arch_olmo2.ARCH,
                                           arch_smollm3.ARCH, arch_gemma2.ARCH, arch_gemma3.ARCH,
                                           arch_mixtral.ARCH, arch_qwen2moe.ARCH,
                                           arch_qwen3moe.ARCH, arch_olmoe.ARCH, arch_gptoss.ARCH,
                                           arch_glm4moe.ARCH, arch_dots1.ARCH)

#: config.json "architectures" value -> Architecture.
BY_HF_CLASS: dict[str, Architecture] = {c: a for a in ARCHITECTURES for c in a.hf_classes}

#: config.json "model_type" (used when "architectures" is missing) -> (Architecture, HF class).
BY_MODEL_TYPE: dict[str, tuple[Architecture, str]] = {
    t: (a, cls) for a in ARCHITECTURES for t, cls in a.model_types.items()}


def lookup(cfg: dict) -> tuple[Architecture, str]:
    """(architecture, HF class) of a config.json."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if archs:
        cls = archs[0]
        if cls not in BY_HF_CLASS:
            raise ConvertError(f"unsupported architecture {cls!r} (supported: {', '.join(BY_HF_CLASS)})")
        return BY_HF_CLASS[cls], cls
    mt = cfg.get("model_type")
    if mt not in BY_MODEL_TYPE:
        raise ConvertError(f"config.json names no supported architecture (architectures missing, "
                           f"model_type={mt!r}; supported model types: {', '.join(BY_MODEL_TYPE)})")
    return BY_MODEL_TYPE[mt]
