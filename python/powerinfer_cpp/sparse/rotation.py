"""A rotated residual stream: the same model in a basis where input sparsity loses less
(LaRoSA's observation, applied as QuaRot folds its rotations: into the weights, nothing
added at run time).

In a pre-norm llama-family model the residual stream h is only read through RMSNorm
(``norm(h) = gamma * h / rms(h)``) and only written by adding the embedding row, o's and
down's outputs. For an orthogonal Q, rms(Q^T h) = rms(h), so with every norm's gamma folded
into the projections that read it, the model computes the same function on h' = Q^T h:

    token_embd rows        e' = Q^T e              (E' = E Q)
    attn_output, ffn_down  W' = Q^T W              (the writers)
    q, k, v, gate, up      W' = W diag(gamma) Q    (the readers; RoPE acts on their outputs)
    head                   W' = W diag(gamma_out) Q, its own output.weight (a tied head is
                           untied: E' and the head now differ)
    attn_norm, ffn_norm, output_norm weights = 1

The inputs of the q/k/v, FFN and head sites become ``Q^T (h / rms(h))``. With Q the
eigenvectors of their pooled second moment (PCA over every such site's calibration inputs,
largest first), the energy that the SmolLM2-135M residual stream spreads over hundreds of
channels around a few massive ones concentrates in few coordinates, and skipping the small
ones costs far less output error at the same share skipped (docs/BENCHMARKS.md, "Rotated
residual stream"). o's and down's inputs are not in the residual basis and do not change.

The runtime is untouched: the rotated file is an ordinary dense GGUF (F16 or F32 weights),
whose input-sparse conversion runs as for any other.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from .. import format as F
from ..convert.from_gguf import _kv_entries
from ..gguf_write import ConvertError, TensorJob, add_kv, decode_matrix, write_gguf

#: The readers of each norm (tensor kinds without the "blk.N." prefix and ".weight").
ATTN_READERS = ("attn_q", "attn_k", "attn_v")
FFN_READERS = ("ffn_gate", "ffn_up")
WRITERS = ("attn_output", "ffn_down")


def pca_rotation(inputs, gammas) -> np.ndarray:
    """Q [d, d] orthogonal, columns the eigenvectors of sum_s E[u u^T] for u = x_s / gamma_s
    (each site's inputs x_s [tokens, d] divided by its norm's weight, i.e. h / rms(h)),
    in decreasing eigenvalue order. inputs and gammas: parallel sequences."""
    c = None
    for x, g in zip(inputs, gammas):
        g = np.asarray(g, np.float64)
        if np.any(g == 0):
            raise ValueError("a norm weight of 0 cannot be folded (its channel is lost)")
        u = np.asarray(x, np.float64) / g[None, :]
        m = u.T @ u / max(len(u), 1)
        c = m if c is None else c + m
    if c is None:
        raise ValueError("pca_rotation needs at least one site's inputs")
    w, q = np.linalg.eigh(c)
    return np.ascontiguousarray(q[:, ::-1])


def rotate_gguf(in_path: str | os.PathLike, out_path: str | os.PathLike, q: np.ndarray,
                progress: bool = False) -> str:
    """Write in_path's dense llama-family model with its residual stream rotated by q (see
    the module doc); weights F16 (F32 kept F32). Refuses what the folding does not hold
    for: biases on the readers or writers, extra norms, mixture of experts."""
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    r = gguf.GGUFReader(in_path)
    arch = str(r.fields["general.architecture"].contents())
    if arch != F.ARCH_LLAMA:
        raise ConvertError(f"{in_path}: rotating the residual stream is implemented for llama-family "
                           f"files, not {arch!r}")
    tensors = {t.name: t for t in r.tensors}
    n_layer = 0
    while f"blk.{n_layer}.attn_norm.weight" in tensors:
        n_layer += 1
    allowed = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for l in range(n_layer):
        allowed |= {f"blk.{l}.{k}.weight" for k in ATTN_READERS + FFN_READERS + WRITERS + ("attn_norm", "ffn_norm")}
    extra = sorted(set(tensors) - allowed - {"rope_freqs.weight"})
    if extra:
        raise ConvertError(f"{in_path}: tensors the rotation does not know how to fold: {', '.join(extra[:5])}")
    d = int(q.shape[0])
    if q.shape != (d, d) or not np.allclose(q.T @ q, np.eye(d), atol=1e-6):
        raise ValueError("q must be a square orthogonal matrix")
    q32 = np.asarray(q, np.float64)

    def mat(name):
        t = tensors[name]
        return decode_matrix(np.asarray(t.data), t.tensor_type,
                             tuple(int(v) for v in reversed(t.shape))).astype(np.float64)

    def vec(name):
        return np.asarray(tensors[name].data, np.float64).reshape(-1)

    def out_type(name):
        return Q.F32 if tensors[name].tensor_type == Q.F32 else Q.F16

    jobs = []

    def add(name, fn, like=None):
        t = tensors[like or name]
        shape = tuple(int(v) for v in reversed(t.shape))
        jobs.append(TensorJob(name, shape, out_type(like or name),
                              lambda fn=fn: np.ascontiguousarray(fn(), dtype=np.float32)))

    add("token_embd.weight", lambda: mat("token_embd.weight") @ q32)
    head_src = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    add("output.weight", lambda: (mat(head_src) * vec("output_norm.weight")[None, :]) @ q32, like=head_src)
    jobs.append(TensorJob("output_norm.weight", (d,), Q.F32, lambda: np.ones(d, np.float32)))
    for l in range(n_layer):
        for norm, readers in (("attn_norm", ATTN_READERS), ("ffn_norm", FFN_READERS)):
            gname = f"blk.{l}.{norm}.weight"
            jobs.append(TensorJob(gname, (d,), Q.F32, lambda: np.ones(d, np.float32)))
            for k in readers:
                n = f"blk.{l}.{k}.weight"
                add(n, lambda n=n, g=gname: (mat(n) * vec(g)[None, :]) @ q32)
        for k in WRITERS:
            n = f"blk.{l}.{k}.weight"
            add(n, lambda n=n: q32.T @ mat(n))
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        jobs.append(TensorJob("rope_freqs.weight", (int(t.shape[0]),), Q.F32,
                              lambda: np.asarray(t.data, np.float32)))
    kv = _kv_entries(r)
    return write_gguf(out_path, lambda w: add_kv(w, [e for e in kv if e[0] != "general.architecture"]),
                      jobs, progress=progress, arch=arch)
