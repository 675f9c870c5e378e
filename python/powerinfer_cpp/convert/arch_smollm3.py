"""SmolLM3 -> GGUF architecture ``smollm3`` (llama.cpp's).

The llama block and tensors (q/k rows permuted for normal RoPE, as llama.cpp's converter
writes them for this architecture too) with one difference: some layers apply no RoPE
("NoPE"). HF's ``no_rope_layers[i]`` is 1 where layer i *uses* RoPE (transformers reads it
as ``use_rope``), built from ``no_rope_layer_interval`` when absent. llama.cpp's smollm3 has
no key for the pattern: it skips RoPE on every 4th layer (i + 1 divisible by 4), so a
config whose pattern differs from that is refused rather than written as a file every
reader would run wrong.

Refused as well: sliding windows shorter than the context, ``attention_bias`` / ``mlp_bias``
(as llama), RoPE scaling other than none/linear/llama3.
"""

from __future__ import annotations

import dataclasses

from .. import format as F
from ..gguf_write import ConvertError
from .arch import Architecture, Config, HFParams
from . import arch_llama


def rope_layers(n_layer: int) -> list[int]:
    """HF's no_rope_layers for llama.cpp's fixed pattern: 1 (RoPE) except every 4th layer."""
    return [int((i + 1) % F.SMOLLM3_NOPE_EVERY != 0) for i in range(n_layer)]


def read_config(c: Config, hf_arch: str) -> HFParams:
    """Validated hyper-parameters of a SmolLM3 config.json."""
    n_layer = c.int("num_hidden_layers")
    want = rope_layers(n_layer)
    got = c.get("no_rope_layers")
    if got is None:
        interval = c.int("no_rope_layer_interval", 4)
        got = [int((i + 1) % interval != 0) for i in range(n_layer)]
    if not isinstance(got, list) or [int(bool(v)) for v in got] != want:
        raise ConvertError(f"unsupported: config.json no_rope_layers={got!r} (llama.cpp's smollm3 "
                           f"files skip RoPE on every {F.SMOLLM3_NOPE_EVERY}th layer, {want!r}, and "
                           "have no key for another pattern)")
    c.refuse("use_sliding_window", lambda v: v is True and isinstance(c.get("sliding_window"), int)
             and c.get("sliding_window") < c.n_ctx(),
             "some layers attend to a window shorter than the context; the runtime attends to "
             "the full context")
    # the llama reader, for everything the two share (its sliding_window key is not written:
    # a window is refused above)
    p = arch_llama.read_config(c, "LlamaForCausalLM")
    return dataclasses.replace(p, hf_arch=hf_arch, arch=F.ARCH_SMOLLM3, sliding_window=None,
                               tied=c.flag("tie_word_embeddings", True))


ARCH = Architecture(
    name=F.ARCH_SMOLLM3, hf_classes=("SmolLM3ForCausalLM",),
    model_types={"smollm3": "SmolLM3ForCausalLM"}, read_config=read_config,
    tensors=arch_llama.tensors, ignored=arch_llama.ARCH.ignored)
