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
residual stream"). o's and down's inputs are not in the residual basis: the residual rotation leaves them as they are.

o's input can be rotated too, per key/value head and for free: attention is linear in v, so
with v's outputs of kv head g rotated by R_g^T (W_v's rows of head g: R_g^T W_v[g]), every
query head h reading that kv head outputs R_g^T of its old output, and W_o's columns of head h
times R_g (W_o[:, h] R_g) undo it. With R_g the PCA of the pooled inputs of o's slices of the
query heads sharing kv head g (``head_rotations``), o's input concentrates as the residual's
does (numpy, SmolLM2-135M: 3-65x less output error at the same share skipped, median 11x;
docs/BENCHMARKS.md "Per-site rotations"). Query heads sharing a kv head share its rotation,
as they share its values; a per-query-head rotation would need a copy of v per query head.

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


def head_rotations(x_o, n_head: int, n_head_kv: int) -> np.ndarray:
    """[n_head_kv, head_dim, head_dim]: per kv head g the PCA rotation (pca_rotation, largest
    first) of the pooled o-input slices [tokens, head_dim] of the query heads h with
    h // (n_head / n_head_kv) == g (the grouping llama-family attention uses); x_o [tokens,
    n_head * head_dim] is one layer's o input."""
    x_o = np.asarray(x_o)
    if n_head_kv < 1 or n_head % n_head_kv or x_o.ndim != 2 or x_o.shape[1] % n_head:
        raise ValueError(f"o inputs {x_o.shape} do not split into {n_head} heads in {n_head_kv} groups")
    hd, per = x_o.shape[1] // n_head, n_head // n_head_kv
    ones = np.ones(hd)
    return np.stack([pca_rotation([x_o[:, h * hd:(h + 1) * hd] for h in range(g * per, (g + 1) * per)],
                                  [ones] * per) for g in range(n_head_kv)])


def rotate_gguf(in_path: str | os.PathLike, out_path: str | os.PathLike, q: np.ndarray,
                progress: bool = False, o_rotations=None) -> str:
    """Write in_path's dense llama-family model with its residual stream rotated by q (see
    the module doc); weights F16 (F32 kept F32). o_rotations (optional): per layer
    [n_head_kv, head_dim, head_dim] orthogonal (head_rotations), o's input rotated per kv head
    (folded into W_v's rows and W_o's columns). Refuses what the folding does not hold
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
    n_head = int(r.fields[f"{arch}.attention.head_count"].contents())
    n_head_kv = int(r.fields[f"{arch}.attention.head_count_kv"].contents()) \
        if f"{arch}.attention.head_count_kv" in r.fields else n_head
    if o_rotations is not None:
        if len(o_rotations) != n_layer:
            raise ValueError(f"o_rotations: {len(o_rotations)} layers, the file has {n_layer}")
        o_rotations = [np.asarray(x, np.float64) for x in o_rotations]
        for x in o_rotations:
            hd = x.shape[-1]
            if x.shape != (n_head_kv, hd, hd) or hd * n_head != tensors["blk.0.attn_output.weight"].shape[0] or \
                    not np.allclose(np.einsum("gji,gjk->gik", x, x), np.eye(hd)[None], atol=1e-6):
                raise ValueError(f"o_rotations must be [{n_head_kv}, head_dim, head_dim] orthogonal per layer")
    per = n_head // n_head_kv

    def v_rows(w, l):  # R_g^T W_v[g] per kv head g
        if o_rotations is None:
            return w
        rot = o_rotations[l]
        hd = rot.shape[-1]
        return np.concatenate([rot[g].T @ w[g * hd:(g + 1) * hd] for g in range(n_head_kv)])

    def o_cols(w, l):  # W_o[:, h] R_{g(h)} per query head h
        if o_rotations is None:
            return w
        rot = o_rotations[l]
        hd = rot.shape[-1]
        return np.concatenate([w[:, h * hd:(h + 1) * hd] @ rot[h // per] for h in range(n_head)], axis=1)

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
                fold = (lambda w, l: v_rows(w, l)) if k == "attn_v" else (lambda w, l: w)
                add(n, lambda n=n, g=gname, l=l, fold=fold: fold((mat(n) * vec(g)[None, :]) @ q32, l))
        for k in WRITERS:
            n = f"blk.{l}.{k}.weight"
            fold = (lambda w, l: o_cols(w, l)) if k == "attn_output" else (lambda w, l: w)
            add(n, lambda n=n, l=l, fold=fold: q32.T @ fold(mat(n), l))
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        jobs.append(TensorJob("rope_freqs.weight", (int(t.shape[0]),), Q.F32,
                              lambda: np.asarray(t.data, np.float32)))
    kv = _kv_entries(r)
    return write_gguf(out_path, lambda w: add_kv(w, [e for e in kv if e[0] != "general.architecture"]),
                      jobs, progress=progress, arch=arch)
