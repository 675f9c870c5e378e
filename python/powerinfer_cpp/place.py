"""Re-solve the GPU neuron placement of a sparse GGUF for another VRAM budget.

    python -m powerinfer_cpp.place MODEL.gguf --vram-budget 8G [-o OUT.gguf]

Uses the neuron frequencies stored in the file (``blk.N.ffn_freq``), so no
profiling is needed. Only the GPU index changes: the ``blk.N.gpu_idx`` /
``blk.N.gpu_bucket`` tensors and the ``powerinfer.gpu.*`` keys. Without ``-o`` only
that is written, as the side file ``MODEL.gguf.generated.gpuidx`` (PowerInfer's
layout; the runtime reads it in place of the file's own index, and refuses one made
for another file): the model is not copied. With ``-o`` a whole new model file is
written with the new index (every other key and tensor copied unchanged).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

from . import format as F
from .gguf_write import ConvertError, TensorJob, check_output_path, write_gguf
from .sparse.pipeline import gpu_index_kv, index_jobs, solve_from_tensors
from .sizes import format_size, parse_size
from .sparse.placement import Placement

log = logging.getLogger("powerinfer_cpp.place")

__all__ = ["PlaceError", "replace_index", "read_fields", "placement_inputs", "main"]


class PlaceError(Exception):
    """The file cannot be re-placed (message says why)."""


def read_fields(reader) -> dict:
    """{key: python value} of a GGUFReader's metadata (GGUF.* pseudo-keys left out)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def placement_inputs(reader, fields: dict, path: str) -> dict:
    """What the placement's cost model needs from a file: {n_layer, n_ff, n_embd_kv, ctx (the
    stored one), group_size (stored), freq (per layer the ffn_freq, float64), tensors
    ({name: (qtype, numpy shape)})}. PlaceError names what is missing."""
    import gguf

    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)
    try:
        n_layer = int(fields[F.arch_key(F.KEY_BLOCK_COUNT, arch)])
        n_ff = int(fields[F.arch_key(F.KEY_FEED_FORWARD_LENGTH, arch)])
        n_embd = int(fields[F.arch_key(F.KEY_EMBEDDING_LENGTH, arch)])
        n_head = int(fields[F.arch_key(F.KEY_HEAD_COUNT, arch)])
        n_head_kv = int(fields.get(F.arch_key(F.KEY_HEAD_COUNT_KV, arch), n_head))
        head_dim = int(fields.get(F.arch_key(F.KEY_KEY_LENGTH, arch), n_embd // n_head))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise PlaceError(f"{path}: missing or bad hyper-parameter ({e})") from None
    ctx = int(fields.get(F.KEY_GPU_CTX, fields.get(F.arch_key(F.KEY_CONTEXT_LENGTH, arch), 2048)))
    by_name = {t.name: t for t in reader.tensors}
    freq = []
    for l in range(n_layer):
        name = F.sparse_tensor_name(F.T_FFN_FREQ, l)
        t = by_name.get(name)
        if t is None or t.tensor_type != gguf.GGMLQuantizationType.F32 or int(t.n_elements) != n_ff:
            raise PlaceError(f"{path}: {name} missing or not F32[{n_ff}]")
        freq.append(np.asarray(t.data, dtype=np.float64).reshape(n_ff))
    tensors = {t.name: (t.tensor_type, tuple(int(v) for v in reversed(t.shape))) for t in reader.tensors}
    return {"n_layer": n_layer, "n_ff": n_ff, "n_embd_kv": n_head_kv * head_dim, "ctx": ctx,
            "group_size": int(fields.get(F.KEY_GPU_GROUP_SIZE, 64)), "freq": freq, "tensors": tensors}


def _copy_fields(reader, w, skip: set[str]) -> None:
    from gguf import GGUFValueType as V
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in skip or name == F.KEY_GENERAL_ARCHITECTURE:
            continue
        if name == F.KEY_GENERAL_ALIGNMENT:
            w.add_custom_alignment(int(f.contents()))
            continue
        main = V(f.types[0])
        if main == V.ARRAY:
            w.add_key_value(name, f.contents(), V.ARRAY, V(f.types[-1]))
        else:
            w.add_key_value(name, f.contents(), main)


def replace_index(path: str | os.PathLike, budget: int, out_path: str | os.PathLike | None = None, *,
                  ctx: int | None = None, group_size: int | None = None, min_layer_share: float = 0.05,
                  method: str = "ilp", time_limit: float = 10.0, progress: bool = False) -> Placement:
    """Solve the placement of the sparse GGUF ``path`` for ``budget`` bytes and write
    the new GPU index: to the side file ``path + GPUIDX_SUFFIX`` (default), or a whole
    model file ``out_path``. ``ctx`` / ``group_size`` default to the values stored in the
    file. Returns the Placement."""
    import gguf

    path = os.fspath(path)
    side = out_path is None
    out_path = path + F.GPUIDX_SUFFIX if side else os.fspath(out_path)
    if not os.path.isfile(path):
        raise PlaceError(f"model file not found: {path}" if not os.path.exists(path)
                         else f"{path} is not a regular file; pass a .gguf file")
    if not 0 <= int(budget) < 2**63:
        raise PlaceError(f"VRAM budget {budget} bytes is out of range (0 to 8 EiB)")
    if ctx is not None and not 1 <= int(ctx) < 2**31:
        raise PlaceError(f"ctx must be a positive number of tokens, got {ctx}")
    if not time_limit > 0:
        raise PlaceError(f"time_limit must be > 0 seconds, got {time_limit}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError / struct errors on bad files
        raise PlaceError(f"cannot read {path}: not a valid GGUF file (truncated or corrupt: "
                         f"{e})") from None
    fields = read_fields(reader)
    if not F.is_sparse(fields):
        raise PlaceError(f"{path} is not a sparse file (no {F.KEY_SPARSE_THRESHOLD} or "
                         f"{F.KEY_SPARSE_GATE_THRESHOLD}); convert the model with "
                         "`python -m powerinfer_cpp.convert HF_DIR --sparse`")
    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)
    if out_path != path or os.path.exists(out_path):
        try:
            check_output_path(os.path.abspath(out_path))
        except ConvertError as e:
            raise PlaceError(str(e)) from None
    pin = placement_inputs(reader, fields, path)
    n_layer, n_ff, freq, tensors = pin["n_layer"], pin["n_ff"], pin["freq"], pin["tensors"]
    if ctx is None:
        ctx = pin["ctx"]
    if group_size is None:
        group_size = pin["group_size"]
    try:
        pl = solve_from_tensors(tensors, freq, n_layer, pin["n_embd_kv"], ctx, budget, group_size,
                                min_layer_share, method, time_limit)
    except KeyError as e:
        raise PlaceError(f"{path}: tensor {e} missing") from None

    if side:
        jobs = []
        for il in range(n_layer):
            jobs += index_jobs(il, freq[il], pl.hot[il], n_ff)[1:]  # gpu_idx (+ gpu_bucket)
        model_bytes = os.path.getsize(path)

        def side_setup(w):
            from gguf import GGUFValueType as V
            for k, v, ty in gpu_index_kv(pl, group_size, ctx):
                w.add_key_value(k, v, ty)
            w.add_key_value(F.KEY_GPU_MODEL_BYTES, model_bytes, V.UINT64)

        try:
            write_gguf(out_path, side_setup, jobs, progress, arch=F.GPUIDX_ARCH)
        except ConvertError as e:
            raise PlaceError(str(e)) from None
        return pl

    idx_kinds = set(F.GPU_INDEX_TENSORS)
    jobs = []
    for t in reader.tensors:
        kind, il, _ = F.parse_tensor_name(t.name)
        if il is not None and kind in idx_kinds:
            if kind == F.T_GPU_IDX:
                jobs += index_jobs(il, freq[il], pl.hot[il], n_ff)[1:]  # gpu_idx (+ gpu_bucket)
            continue
        shape = tuple(int(v) for v in reversed(t.shape))
        jobs.append(TensorJob(t.name, shape, t.tensor_type, lambda a=t.data: a, raw=True))

    def setup(w):
        _copy_fields(reader, w, set(F.GPU_KEYS))
        for k, v, ty in gpu_index_kv(pl, group_size, ctx):
            w.add_key_value(k, v, ty)

    try:
        write_gguf(out_path, setup, jobs, progress, arch=arch)
    except ConvertError as e:
        raise PlaceError(str(e)) from None
    stale = out_path + F.GPUIDX_SUFFIX
    if os.path.exists(stale):
        # the runtime would take it over the index just written
        os.remove(stale)
        log.warning("removed %s: it held another GPU index for %s", stale, out_path)
    return pl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer_cpp.place",
                                 description="Re-solve the GPU neuron placement of a sparse GGUF "
                                             "from its stored neuron frequencies (no re-profiling).")
    ap.add_argument("model", help="sparse GGUF (written by convert --sparse)")
    ap.add_argument("--vram-budget", required=True, metavar="SIZE", help="GPU memory, e.g. 8G, 512M, 0 (a bare number is GiB)")
    ap.add_argument("-o", "--outfile", help="write a whole model file with the new index here (default: "
                                            "only the index, as MODEL.generated.gpuidx next to MODEL)")
    ap.add_argument("--ctx", type=int, default=None, help="KV cache context to reserve (default: as stored)")
    ap.add_argument("--group-size", type=int, default=None, help="neurons per group (default: as stored)")
    ap.add_argument("--min-layer-share", type=float, default=0.05,
                    help="a layer gets no GPU neurons or at least this share of them (default 0.05)")
    ap.add_argument("--placement", choices=("ilp", "greedy"), default="ilp")
    ap.add_argument("--time-limit", type=float, default=10.0, help="ILP time limit in seconds (default 10)")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        budget = parse_size(args.vram_budget)
        pl = replace_index(args.model, budget, args.outfile, ctx=args.ctx, group_size=args.group_size,
                           min_layer_share=args.min_layer_share, method=args.placement,
                           time_limit=args.time_limit, progress=False)
    except (PlaceError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(pl.summary())
        out = args.outfile or args.model + F.GPUIDX_SUFFIX
        print(f"wrote {os.path.abspath(out)} (budget {format_size(budget)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
