"""Byte sizes of a sparse model's parts, as the runtime's placement counts them (tests of
the hybrid path on host-device and on CUDA)."""

from __future__ import annotations


def part_sizes(path: str, n_layer: int, n_ff: int) -> dict:
    """{"attention": one layer's q/k/v/o bytes, "predictor": the largest layer's fc1 + fc2,
    "head": output (or tied token_embd) bytes, "neuron": one neuron's gate + up + down_t
    row bytes, "dense": every layer's attention and predictor plus the head}. Layers share
    shapes and types except the predictor's hidden size."""
    import gguf

    nb = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    att = sum(nb[f"blk.0.attn_{k}.weight"] for k in ("q", "k", "v", "output"))
    preds = [nb[f"blk.{l}.fc1.weight"] + nb[f"blk.{l}.fc2.weight"] for l in range(n_layer)]
    head = nb.get("output.weight", nb["token_embd.weight"])
    neuron = sum(nb[f"blk.0.{k}.weight"] for k in ("ffn_gate", "ffn_up", "ffn_down_t")) // n_ff
    return {"attention": att, "predictor": max(preds), "head": head, "neuron": neuron,
            "dense": n_layer * att + sum(preds) + head}
