#!/usr/bin/env python3
"""Make the synthetic LLaMA used by tools/bench.py, and its GGUF files.

    python tools/make_bench_model.py [--cache /tmp/pi-bench] [--d 2048 --layers 8 ...]
                                     [--types f16,q4_0] [--force]

Writes a Hugging Face-format folder (config.json, model.safetensors in fp16,
tokenizer.json + tokenizer_config.json) with random weights (normal, std 0.02,
norms = 1, seeded), then converts it with the project's converter
(powerinfer_cpp.convert) into GGUF files next to it. The default shape is the
one of docs/BENCHMARKS.md and /work/shared/REFERENCE.md: d=2048, 8 layers,
16 heads (16 KV heads), n_ff=5632, vocab 32000, ReLU, untied (~542M params).

Speed does not depend on the tokenizer, so the shipped 4096-token byte-level
tokenizer (models/tiny-relu-kjv) is reused; the converter pads its vocab to the
model's 32000 rows with unused tokens. Nothing is held in RAM beyond one chunk
of one tensor: the safetensors file is written tensor by tensor with numpy.

Files go to CACHE/<shape-name>/ (hf/ and <name>-<type>.gguf); existing files
are reused unless --force. Never commit them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "models" / "tiny-relu-kjv"
DEFAULT_CACHE = "/tmp/pi-bench"
CHUNK_ELEMS = 1 << 24  # 16M elements (64 MB of f32) per generated chunk


def shape_name(a) -> str:
    return (f"llama-d{a.d}-l{a.layers}-h{a.heads}-kv{a.kv_heads}-ff{a.ff}-v{a.vocab}"
            f"-{a.act}-s{a.seed}")


def hf_tensors(a) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes in the usual (sorted-by-layer) order."""
    hd = a.d // a.heads
    q_rows, kv_rows = a.heads * hd, a.kv_heads * hd
    out = [("model.embed_tokens.weight", (a.vocab, a.d))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (a.d,)),
            (p + "self_attn.q_proj.weight", (q_rows, a.d)),
            (p + "self_attn.k_proj.weight", (kv_rows, a.d)),
            (p + "self_attn.v_proj.weight", (kv_rows, a.d)),
            (p + "self_attn.o_proj.weight", (a.d, q_rows)),
            (p + "post_attention_layernorm.weight", (a.d,)),
            (p + "mlp.gate_proj.weight", (a.ff, a.d)),
            (p + "mlp.up_proj.weight", (a.ff, a.d)),
            (p + "mlp.down_proj.weight", (a.d, a.ff)),
        ]
    out += [("model.norm.weight", (a.d,)), ("lm_head.weight", (a.vocab, a.d))]
    return out


def write_safetensors(path: Path, tensors, seed: int, std: float) -> int:
    """Write fp16 random tensors (1-D ones = norms = 1.0) to a safetensors file,
    tensor by tensor and chunk by chunk. Returns the parameter count."""
    header: dict = {"__metadata__": {"format": "pt", "generator": "powerinfer-cpp tools/make_bench_model.py"}}
    off = 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    tmp = path.with_suffix(".tmp")
    n_params = 0
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for ti, (name, shape) in enumerate(tensors):
            n = int(np.prod(shape))
            n_params += n
            if len(shape) == 1:
                f.write(np.ones(n, dtype="<f2").tobytes())
                continue
            rng = np.random.default_rng([seed, ti])
            left = n
            while left:
                k = min(left, CHUNK_ELEMS)
                x = rng.standard_normal(k, dtype=np.float32)
                x *= std
                f.write(x.astype("<f2").tobytes())
                left -= k
    os.replace(tmp, path)
    return n_params


def make_hf(a, hf_dir: Path) -> None:
    hf_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.d,
        "intermediate_size": a.ff,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "vocab_size": a.vocab,
        "hidden_act": a.act,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    tok_json = TOKENIZER_DIR / "tokenizer.json"
    if not tok_json.is_file():
        sys.exit(f"error: {tok_json} not found (the shipped tokenizer is reused for the bench model)")
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        if (TOKENIZER_DIR / fn).is_file():
            shutil.copyfile(TOKENIZER_DIR / fn, hf_dir / fn)
    t0 = time.time()
    n = write_safetensors(hf_dir / "model.safetensors", hf_tensors(a), a.seed, a.std)
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"wrote {hf_dir} ({n / 1e6:.1f}M params, {time.time() - t0:.0f} s)", file=sys.stderr)


def ensure_models(a) -> dict[str, Path]:
    """Make (or reuse) the HF folder and one GGUF per type; returns type -> path."""
    root = Path(a.cache) / shape_name(a)
    hf_dir = root / "hf"
    if a.force or not (hf_dir / "config.json").is_file():
        make_hf(a, hf_dir)
    sys.path.insert(0, str(REPO / "python"))
    out = {}
    for t in a.types:
        g = root / f"{shape_name(a)}-{t}.gguf"
        if a.force or not g.is_file() or g.stat().st_mtime < (hf_dir / "config.json").stat().st_mtime:
            from powerinfer_cpp.convert import convert  # noqa: E402
            t0 = time.time()
            convert(hf_dir, g, outtype=t, progress=a.progress)
            print(f"wrote {g} ({g.stat().st_size / 1e6:.0f} MB, {time.time() - t0:.0f} s)", file=sys.stderr)
        out[t] = g
    return out


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("bench model shape")
    g.add_argument("--d", type=int, default=2048, help="hidden size (default 2048)")
    g.add_argument("--layers", type=int, default=8, help="layers (default 8)")
    g.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    g.add_argument("--kv-heads", type=int, default=None, help="KV heads (default = heads)")
    g.add_argument("--ff", type=int, default=5632, help="FFN size n_ff (default 5632)")
    g.add_argument("--vocab", type=int, default=32000, help="vocab rows (default 32000; >= 4096)")
    g.add_argument("--act", default="relu", choices=["relu", "silu"], help="hidden_act (default relu)")
    g.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    g.add_argument("--std", type=float, default=0.02, help="weight std (default 0.02)")
    g.add_argument("--cache", default=DEFAULT_CACHE, help=f"output folder (default {DEFAULT_CACHE})")
    g.add_argument("--force", action="store_true", help="rewrite the model and GGUF files")


def finish_shape_args(a) -> None:
    if a.kv_heads is None:
        a.kv_heads = a.heads
    if a.d % a.heads or a.heads % a.kv_heads or a.vocab < 4096:
        sys.exit("error: need d % heads == 0, heads % kv_heads == 0, vocab >= 4096")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--types", default="f16,q4_0", help="GGUF types to convert to (default f16,q4_0)")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    finish_shape_args(a)
    a.types = [t.strip() for t in a.types.split(",") if t.strip()]
    a.progress = not a.quiet
    for t, p in ensure_models(a).items():
        print(f"{t}\t{p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
