"""Re-solve the GPU neuron placement of a sparse GGUF for another VRAM budget, or the
expert placement of a mixture-of-experts GGUF.

    python -m powerinfer_cpp.place MODEL.gguf --vram-budget 8G [-o OUT.gguf]
    python -m powerinfer_cpp.place MOE.gguf --vram-budget 8G --profile TEXT [--n-cpu-moe N]

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

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from . import format as F
from .gguf_write import ConvertError, TensorJob, check_output_path, write_gguf
from .sparse.pipeline import gpu_index_kv, index_jobs, solve_from_tensors
from .sparse.experts import expert_budget, expert_hot_tensors, profile_experts, solve_expert_neurons, solve_experts
from .sizes import format_size, parse_size
from .sparse.placement import Placement

log = logging.getLogger("powerinfer_cpp.place")

__all__ = ["PlaceError", "replace_index", "replace_expert_placement", "read_fields", "placement_inputs", "main"]


class PlaceError(Exception):
    """The file cannot be re-placed (message says why)."""


def read_fields(reader) -> dict:
    """{key: python value} of a GGUFReader's metadata (GGUF.* pseudo-keys left out)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def placement_inputs(reader, fields: dict, path: str) -> dict:
    """What the placement's cost model needs from a file: {n_layer, n_ff, n_embd_kv, ctx (the
    stored one), group_size (stored), freq (per layer the ffn_freq, float64), tensors
    ({name: (qtype, numpy shape)})}. PlaceError names what is missing."""
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


def _stored_expert_freq(reader, path: str, n_layer: int, n_expert: int) -> tuple[np.ndarray | None, dict]:
    """The blk.N.ffn_exp_freq of a file (its side file's first) and the keys stored with
    them, or (None, {}) when it has none."""
    side = path + F.GPUIDX_SUFFIX
    readers = [gguf.GGUFReader(side)] if os.path.isfile(side) else []
    for r in readers + [reader]:
        by_name = {t.name: t for t in r.tensors}
        if F.expert_tensor_name(F.T_FFN_EXP_FREQ, 0) not in by_name:
            continue
        out = np.zeros((n_layer, n_expert))
        for l in range(n_layer):
            name = F.expert_tensor_name(F.T_FFN_EXP_FREQ, l)
            t = by_name.get(name)
            if t is None or t.tensor_type != gguf.GGMLQuantizationType.F32 or int(t.n_elements) != n_expert:
                raise PlaceError(f"{path}: {name} missing or not F32[{n_expert}]")
            out[l] = np.asarray(t.data, dtype=np.float64).reshape(n_expert)
        return out, read_fields(r)
    return None, {}


def replace_expert_placement(path: str | os.PathLike, budget: int,
                             out_path: str | os.PathLike | None = None, *,
                             profile: str | os.PathLike | None = None, profile_tokens: int = 4096,
                             n_ctx: int = 512, n_cpu_moe: int = 0, expert_cache: int = 0,
                             method: str = "ilp", time_limit: float = 10.0, n_threads: int = 0,
                             progress: bool = False):
    """The expert placement of the mixture-of-experts GGUF ``path`` for ``budget`` bytes
    (sparse/experts.py), written with the expert frequencies as blk.N.ffn_exp_freq /
    blk.N.ffn_exp_gpu: to the side file ``path + GPUIDX_SUFFIX`` (default), or into a whole
    model file ``out_path``. The frequencies come from profiling the model over the text
    file ``profile`` (its first ``profile_tokens`` tokens), else from the file's stored
    ones. Returns the ExpertPlacement."""
    path = os.fspath(path)
    side = out_path is None
    out_path = path + F.GPUIDX_SUFFIX if side else os.fspath(out_path)
    reader = gguf.GGUFReader(path)
    fields = read_fields(reader)
    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)
    n_layer = int(fields[F.arch_key(F.KEY_BLOCK_COUNT, arch)])
    n_expert = int(fields[F.arch_key(F.KEY_EXPERT_COUNT, arch)])
    if n_cpu_moe < 0:
        raise PlaceError(f"n_cpu_moe must be >= 0 layers, got {n_cpu_moe}")
    if out_path != path or os.path.exists(out_path):
        try:
            check_output_path(os.path.abspath(out_path))
        except ConvertError as e:
            raise PlaceError(str(e)) from None
    tensors = {t.name: (t.tensor_type, tuple(int(v) for v in reversed(t.shape))) for t in reader.tensors}
    if F.sparse_expert_tensor_name(F.T_FFN_DOWN_EXPS_T, n_layer - 1) in tensors:
        return _replace_expert_neurons(path, reader, fields, tensors, budget, out_path, side,
                                       profile=profile, profile_tokens=profile_tokens, n_ctx=n_ctx,
                                       n_cpu_moe=n_cpu_moe, method=method, time_limit=time_limit,
                                       n_threads=n_threads, progress=progress)
    source = ""
    if profile is not None:
        ids = _profile_ids(path, profile, profile_tokens, n_ctx, n_threads)
        freq, n_tok = profile_experts(path, ids, n_ctx=n_ctx, n_threads=n_threads)
        source = os.path.basename(os.fspath(profile))
    else:
        freq, stored = _stored_expert_freq(reader, path, n_layer, n_expert)
        n_tok = int(stored.get(F.KEY_EXPERT_PROFILE_TOKENS, 0))
        source = str(stored.get(F.KEY_EXPERT_PROFILE_SOURCE, ""))
        if freq is None:
            raise PlaceError(f"{path} has no expert frequencies (blk.N.{F.T_FFN_EXP_FREQ}): profile "
                             "the model with --profile TEXT")
    try:
        pl = solve_experts(freq, tensors, budget, cache=expert_cache, n_cpu_moe=n_cpu_moe,
                           method=method, time_limit=time_limit)
    except (KeyError, ValueError) as e:
        raise PlaceError(f"{path}: {e}") from None

    def expert_jobs():
        jobs = []
        for l in range(n_layer):
            jobs.append(TensorJob(F.expert_tensor_name(F.T_FFN_EXP_FREQ, l), (n_expert,), Q.F32,
                                  lambda a=freq[l].astype(np.float32): a))
            jobs.append(TensorJob(F.expert_tensor_name(F.T_FFN_EXP_GPU, l), (n_expert,), Q.I32,
                                  lambda a=pl.on[l].astype(np.int32): a))
        return jobs

    def keys(w):
        w.add_key_value(F.KEY_EXPERT_PROFILE_TOKENS, int(n_tok), V.UINT32)
        w.add_key_value(F.KEY_EXPERT_PROFILE_SOURCE, source, V.STRING)
        w.add_key_value(F.KEY_EXPERT_BYTES_LEFT, int(max(pl.left, 0)), V.UINT64)
        w.add_key_value(F.KEY_EXPERT_BYTES, int(pl.bytes), V.UINT64)
        w.add_key_value(F.KEY_EXPERT_N_CPU_MOE, int(pl.n_cpu_moe), V.UINT32)
        w.add_key_value(F.KEY_EXPERT_CACHE, int(pl.cache_bytes), V.UINT64)
        w.add_key_value(F.KEY_EXPERT_SERVED_SHARE, float(pl.served_share), V.FLOAT32)
        w.add_key_value(F.KEY_EXPERT_SHARED_BYTES, int(pl.shared_bytes), V.UINT64)
        w.add_key_value(F.KEY_EXPERT_SHARED_LAYERS, int(pl.shared_layers), V.UINT32)
        w.add_key_value(F.KEY_GPU_VRAM_BUDGET, int(budget), V.UINT64)
        w.add_key_value(F.KEY_GPU_SOLVER, pl.solver, V.STRING)

    _write_expert_record(path, reader, out_path, side, arch, keys, expert_jobs(),
                         set(F.EXPERT_TENSORS), progress)
    return pl


def _profile_ids(path, profile, profile_tokens, n_ctx, n_threads) -> list[int]:
    """The first profile_tokens tokens of the text file profile, by path's tokenizer."""
    if profile_tokens < 1:
        raise PlaceError(f"profile_tokens must be >= 1, got {profile_tokens}")
    try:
        with open(profile, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PlaceError(f"cannot read the calibration text {profile}: {e}") from None
    from .model import Model
    with Model(path, n_ctx=n_ctx, n_threads=n_threads) as m:
        ids = m.tokenize(text)[:profile_tokens]
    if not ids:
        raise PlaceError(f"the calibration text {profile} holds no tokens")
    return ids


def _write_expert_record(path, reader, out_path, side, arch, keys, new_jobs, drop, progress):
    """Write an expert placement: keys(w) adds its keys, new_jobs its tensors; to the side
    file (out_path, with the model's size) or as a whole model file that copies path's other
    tensors (those whose kind is in drop left out) and fields (the expert keys left out)."""
    try:
        if side:
            model_bytes = os.path.getsize(path)

            def side_setup(w):
                keys(w)
                w.add_key_value(F.KEY_GPU_MODEL_BYTES, model_bytes, V.UINT64)

            write_gguf(out_path, side_setup, new_jobs, progress, arch=F.GPUIDX_ARCH)
            return
        jobs = []
        for t in reader.tensors:
            if F.parse_tensor_name(t.name)[0] in drop:
                continue
            shape = tuple(int(v) for v in reversed(t.shape))
            jobs.append(TensorJob(t.name, shape, t.tensor_type, lambda a=t.data: a, raw=True))

        def setup(w):
            _copy_fields(reader, w, set(F.EXPERT_KEYS))
            keys(w)

        write_gguf(out_path, setup, jobs + new_jobs, progress, arch=arch)
    except ConvertError as e:
        raise PlaceError(str(e)) from None
    stale = out_path + F.GPUIDX_SUFFIX
    if os.path.exists(stale):
        os.remove(stale)
        log.warning("removed %s: it held another placement for %s", stale, out_path)


def _replace_expert_neurons(path, reader, fields, tensors, budget, out_path, side, *, profile,
                            profile_tokens, n_ctx, n_cpu_moe, method, time_limit, n_threads,
                            progress, group_size: int = 16):
    """replace_expert_placement for a sparse-experts file (ffn_down_exps_t): the hot neurons
    of experts (docs/FORMAT.md "Hot neurons of experts", sparse/experts.py
    solve_expert_neurons), from a profile of TEXT (each expert's selection share and each
    neuron's activity inside it), written as blk.N.ffn_exp_freq, ffn_exp_hot_count,
    ffn_exp_hot and ffn_exp_nfreq with the expert keys."""
    from .sparse.expert_sparsity import profile_expert_neurons

    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)
    n_layer = int(fields[F.arch_key(F.KEY_BLOCK_COUNT, arch)])
    n_expert = int(fields[F.arch_key(F.KEY_EXPERT_COUNT, arch)])
    if profile is None:
        raise PlaceError(f"{path} has sparse experts (ffn_down_exps_t): their hot neurons are placed "
                         "from a profile of the neurons inside each expert; pass --profile TEXT")
    ids = _profile_ids(path, profile, profile_tokens, n_ctx, n_threads)
    try:
        freq, nfreq, dfreq, row_bytes = profile_expert_neurons(path, ids, n_ctx=n_ctx, n_threads=n_threads)
    except ValueError as e:
        raise PlaceError(f"{path}: {e}") from None
    n_tok = len(ids)
    # the runtime's order (model/placement.c): attention, routers, head, shared experts; the
    # expert cache is not made for sparse experts
    _, shared, n_shared, _, left, _ = expert_budget(tensors, n_layer, n_expert, budget, 0)
    pl = solve_expert_neurons(freq, nfreq, row_bytes, max(left, 0), group_size=group_size,
                              n_cpu_moe=n_cpu_moe, dfreq=dfreq, method=method, time_limit=time_limit)
    arrays = expert_hot_tensors(pl, nfreq)
    for l in range(n_layer):
        arrays[F.expert_tensor_name(F.T_FFN_EXP_FREQ, l)] = freq[l].astype(np.float32)
    qt = {np.dtype(np.float32): Q.F32, np.dtype(np.int32): Q.I32}
    new_jobs = [TensorJob(name, a.shape, qt[a.dtype], lambda a=a: a) for name, a in sorted(arrays.items())]
    source = os.path.basename(os.fspath(profile))

    def keys(w):
        w.add_key_value(F.KEY_EXPERT_PROFILE_TOKENS, int(n_tok), V.UINT32)
        w.add_key_value(F.KEY_EXPERT_PROFILE_SOURCE, source, V.STRING)
        w.add_key_value(F.KEY_EXPERT_BYTES_LEFT, int(max(left, 0)), V.UINT64)
        w.add_key_value(F.KEY_EXPERT_BYTES, int(pl.bytes), V.UINT64)
        w.add_key_value(F.KEY_EXPERT_N_CPU_MOE, int(min(n_cpu_moe, n_layer)), V.UINT32)
        w.add_key_value(F.KEY_EXPERT_CACHE, 0, V.UINT64)
        w.add_key_value(F.KEY_EXPERT_SERVED_SHARE, float(pl.value / pl.total if pl.total else 0.0), V.FLOAT32)
        w.add_key_value(F.KEY_EXPERT_SHARED_BYTES, int(shared), V.UINT64)
        w.add_key_value(F.KEY_EXPERT_SHARED_LAYERS, int(n_shared), V.UINT32)
        w.add_key_value(F.KEY_GPU_VRAM_BUDGET, int(budget), V.UINT64)
        w.add_key_value(F.KEY_GPU_SOLVER, pl.solver, V.STRING)

    _write_expert_record(path, reader, out_path, side, arch, keys, new_jobs,
                         set(F.EXPERT_TENSORS) | set(F.EXPERT_HOT_TENSORS), progress)
    return pl


def replace_index(path: str | os.PathLike, budget: int, out_path: str | os.PathLike | None = None, *,
                  ctx: int | None = None, group_size: int | None = None, min_layer_share: float = 0.05,
                  method: str = "ilp", time_limit: float = 10.0, progress: bool = False) -> Placement:
    """Solve the placement of the sparse GGUF ``path`` for ``budget`` bytes and write
    the new GPU index: to the side file ``path + GPUIDX_SUFFIX`` (default), or a whole
    model file ``out_path``. ``ctx`` / ``group_size`` default to the values stored in the
    file. Returns the Placement."""
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
    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)
    if int(fields.get(F.arch_key(F.KEY_EXPERT_COUNT, arch), 0) or 0) > 0:
        return replace_expert_placement(path, budget, None if side else out_path, method=method,
                                        time_limit=time_limit, progress=progress)
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


def _is_moe(path: str) -> bool:
    """Whether the GGUF at path is a mixture of experts (False for a file it cannot read:
    replace_index says what is wrong with it)."""
    try:
        fields = read_fields(gguf.GGUFReader(path))
    except Exception:  # gguf raises ValueError / struct errors on bad files
        return False
    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)
    return int(fields.get(F.arch_key(F.KEY_EXPERT_COUNT, arch), 0) or 0) > 0


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
    moe = ap.add_argument_group("mixture-of-experts models (whole experts on the device; sparse "
                                "experts: their hot neurons)")
    moe.add_argument("--profile", metavar="TEXT", help="count the experts' selections (sparse experts: "
                     "and their neurons' activity) over this text file (default: the frequencies stored "
                     "in the file; sparse experts need it)")
    moe.add_argument("--profile-tokens", type=int, default=4096, help="tokens of TEXT to profile (default 4096)")
    moe.add_argument("--n-cpu-moe", type=int, default=0, metavar="N",
                     help="keep the routed experts of the first N layers on the CPU (a shared "
                          "expert does not count; default 0)")
    moe.add_argument("--expert-cache", default="0", metavar="SIZE",
                     help="device bytes of the run-time expert cache to leave free (default 0)")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        budget = parse_size(args.vram_budget)
        if _is_moe(args.model):
            pl = replace_expert_placement(args.model, budget, args.outfile, profile=args.profile,
                                          profile_tokens=args.profile_tokens, n_cpu_moe=args.n_cpu_moe,
                                          expert_cache=parse_size(args.expert_cache, "expert cache"),
                                          method=args.placement, time_limit=args.time_limit)
        else:
            pl = replace_index(args.model, budget, args.outfile, ctx=args.ctx,
                               group_size=args.group_size, min_layer_share=args.min_layer_share,
                               method=args.placement, time_limit=args.time_limit, progress=False)
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
