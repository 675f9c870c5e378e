"""Print what a GGUF file holds.

    python -m powerinfer_cpp.inspect MODEL.gguf [--tensors] [--plot OUT.png]

Architecture and hyper-parameters, tensor types and sizes, and for sparse
files (convert --sparse) the sparse metadata, per-layer predictor sizes and
GPU neuron counts (read with the ``gguf`` package), and whether this runtime can load the
file and its tokenizer: "loads: yes", or "loads: no" and every reason at once (tensor types,
architecture, keys, pre-tokenizer: preflight.py; what only the native loader checks, in its
own words).

``--plot OUT.png`` (needs matplotlib) draws a sparse file's neuron statistics
(``blk.N.ffn_freq``): each layer's firing frequency against the neuron's rank (log-log),
and the share of the activations the GPU would serve against a VRAM budget, from the
placement's own cost model (sparse.placement: dense parts first, then neuron groups by
frequency per byte, the greedy rule the runtime also applies at load).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import gguf
import numpy as np

from . import format as F
from . import preflight
from .gguf_read import is_pwri, open_gguf
from .place import PlaceError, placement_inputs, read_fields
from .sizes import format_size
from .sparse.placement import greedy_placement, make_problem, model_costs
from .tokenizer import TokenizerError, load_tokenizer

__all__ = ["describe", "plot_statistics", "served_curve", "main"]


def describe(path: str | os.PathLike, tensors: bool = False) -> str:
    """The report as text (raises ValueError / OSError on unreadable files)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError("it is a directory; pass a .gguf file")

    r = _open(path)
    fields = read_fields(r)
    arch = fields.get(F.KEY_GENERAL_ARCHITECTURE, "?")
    pwri = is_pwri(path)
    magic = "PowerInfer's PWRI-magic GGUF" if pwri else "GGUF"
    out = [f"file: {path} ({format_size(os.path.getsize(path))}), {magic} v{int(r.fields['GGUF.version'].contents())}, "
           f"{len(r.tensors)} tensors, {len(fields)} keys"]

    def ak(t):
        return fields.get(F.arch_key(t, arch))

    ftype = fields.get(F.KEY_GENERAL_FILE_TYPE, "?")
    try:  # llama.cpp's name too: the mixes (MOSTLY_Q4_K_M) are told apart by it alone
        ftype = f"{ftype} ({gguf.LlamaFileType(int(ftype)).name})"
    except (ValueError, TypeError):
        pass
    out.append(f"architecture: {arch}  name: {fields.get(F.KEY_GENERAL_NAME, '?')}  file type: {ftype}")
    out.append(f"  layers {ak(F.KEY_BLOCK_COUNT)}, d {ak(F.KEY_EMBEDDING_LENGTH)}, n_ff {ak(F.KEY_FEED_FORWARD_LENGTH)}, "
               f"heads {ak(F.KEY_HEAD_COUNT)}/{ak(F.KEY_HEAD_COUNT_KV)} (kv), vocab {ak(F.KEY_VOCAB_SIZE)}, "
               f"context {ak(F.KEY_CONTEXT_LENGTH)}, activation "
               f"{fields.get(F.KEY_FFN_ACTIVATION, 'relu (absent: a PowerInfer file)' if pwri else 'silu (absent)')}")
    out.append(f"  powerinfer.format_version {fields.get(F.KEY_FORMAT_VERSION, '(absent)')}, "
               f"tokenizer {fields.get(F.KEY_TOKENIZER_MODEL, '(none)')}")
    types = Counter()
    tbytes = Counter()
    for t in r.tensors:
        n = gguf.GGMLQuantizationType(t.tensor_type).name
        types[n] += 1
        tbytes[n] += int(t.n_bytes)
    total = sum(tbytes.values())
    out.append("tensor types: " + ", ".join(f"{k} x{types[k]} ({format_size(tbytes[k])})" for k in sorted(types))
               + f"; total {format_size(total)}")

    gate = F.KEY_SPARSE_GATE_THRESHOLD in fields
    sparse = F.is_sparse(fields)
    calib = (f"calibration {fields.get(F.KEY_SPARSE_CALIB_TOKENS, '?')} tokens of "
             f"{fields.get(F.KEY_SPARSE_CALIB_SOURCE, '?')}")
    if pwri and F.KEY_PWRI_SPARSE_THRESHOLD in fields:
        side = path + F.GPUIDX_SUFFIX
        out.append(f"sparse: yes (PowerInfer's layout: predictors on the residual stream)  threshold "
                   f"{float(fields[F.KEY_PWRI_SPARSE_THRESHOLD]):g}; gpu index: "
                   + (f"side file {side}" if os.path.exists(side) else "none (no side file)"))
    elif not sparse:
        out.append("sparse: no (dense file)")
    else:
        if gate:
            thr = ", ".join(f"{float(t):.3g}" for t in np.atleast_1d(fields[F.KEY_SPARSE_GATE_THRESHOLD]))
            out.append(f"sparse: yes (gate magnitude, no predictors)  target sparsity "
                       f"{float(fields.get(F.KEY_SPARSE_TARGET, 'nan')):.3g}, thresholds per "
                       f"layer {thr}; {calib}")
        else:
            out.append(f"sparse: yes  threshold {fields[F.KEY_SPARSE_THRESHOLD]:g}, recall target "
                       f"{float(fields.get(F.KEY_SPARSE_RECALL_TARGET, 'nan')):.4g}, {calib}")
        idx, idx_tensors, idx_from = _side_index(path, out)
        g = idx if idx is not None else fields
        b = g.get(F.KEY_GPU_VRAM_BUDGET)
        if b is not None:
            out.append(f"gpu index: budget {format_size(int(b))} (solver {g.get(F.KEY_GPU_SOLVER, '?')}, "
                       f"groups of {g.get(F.KEY_GPU_GROUP_SIZE, '?')}, ctx {g.get(F.KEY_GPU_CTX, '?')}): "
                       f"dense parts {format_size(int(g.get(F.KEY_GPU_DENSE_BYTES, 0)))}, "
                       f"neurons {format_size(int(g.get(F.KEY_GPU_NEURON_BYTES, 0)))}, "
                       f"served activation mass {float(g.get(F.KEY_GPU_SERVED_SHARE, 0)):.1%}{idx_from}")
    by_name = {t.name: t for t in r.tensors}
    gpu_idx = by_name if not sparse or idx_tensors is None else idx_tensors
    n_layer = int(ak(F.KEY_BLOCK_COUNT) or 0)
    if F.KEY_INPUT_CRITERION in fields:
        copies = sum(int(t.n_bytes) for t in r.tensors if F.parse_tensor_name(t.name)[0] in
                     (F.T_ATTN_QKV_T, F.T_ATTN_OUTPUT_T, F.T_OUTPUT_T))
        budget = fields.get(F.KEY_INPUT_MAX_PPL_INCREASE)
        chosen = (f" (chosen by the quality budget {float(budget):.1%}: held-out ppl "
                  f"{float(fields.get(F.KEY_INPUT_PPL_INCREASE, 'nan')):+.2%})" if budget is not None else "")
        out.append(f"input sparsity: attention q/k/v, o and head, criterion {fields[F.KEY_INPUT_CRITERION]}, "
                   f"target {float(fields.get(F.KEY_INPUT_SPARSITY, 'nan')):.3g}{chosen}; transposed copies "
                   f"{format_size(copies)}")
    if sparse and n_layer:
        out.append("layer  predictor h  pred bytes  pred/FFN  types(fc1,fc2)  mean freq  GPU neurons")
        for l in range(n_layer):
            fc1 = by_name.get(F.sparse_tensor_name(F.T_FC1, l))
            fc2 = by_name.get(F.sparse_tensor_name(F.T_FC2, l))
            ffn = sum(int(by_name[n].n_bytes) for n in (F.tensor_name(F.T_FFN_GATE, l), F.tensor_name(F.T_FFN_UP, l),
                                                        F.sparse_tensor_name(F.T_FFN_DOWN_T, l),
                                                        F.tensor_name(F.T_FFN_DOWN, l)) if n in by_name)
            if fc1 is not None and fc2 is not None:
                h = int(fc1.shape[1])
                pb = int(fc1.n_bytes + fc2.n_bytes)
                ty = f"{gguf.GGMLQuantizationType(fc1.tensor_type).name},{gguf.GGMLQuantizationType(fc2.tensor_type).name}"
                share = f"{pb / ffn:.1%}" if ffn else "-"
            else:
                h, pb, ty, share = "-", 0, "-", "-"
            fr = by_name.get(F.sparse_tensor_name(F.T_FFN_FREQ, l))
            mf = f"{float(np.asarray(fr.data).mean()):.3f}" if fr is not None else "-"
            gi = gpu_idx.get(F.sparse_tensor_name(F.T_GPU_IDX, l))
            ng = int(np.asarray(gi.data).sum()) if gi is not None else "-"
            out.append(f"{l:5d}  {h!s:>11}  {format_size(pb):>10}  {share:>8}  {ty:>14}  {mf:>9}  {ng!s:>11}")
    n_expert = int(ak(F.KEY_EXPERT_COUNT) or 0)
    if n_expert and n_layer:
        _experts(path, out, fields, by_name, n_layer, n_expert, int(ak(F.KEY_EXPERT_USED_COUNT) or 0))
    out.append(loadable(path))
    mode = auto_mode(path)
    if mode:
        out.append(mode)
    if tensors:
        out.append("tensors:")
        for t in r.tensors:
            shape = [int(v) for v in reversed(t.shape)]
            out.append(f"  {t.name:32s} {gguf.GGMLQuantizationType(t.tensor_type).name:6s} {str(shape):16s} "
                       f"{format_size(int(t.n_bytes))}")
    return "\n".join(out)


def loadable(path: str | os.PathLike) -> str:
    """Whether this runtime loads the file (weights mapped, nothing computed) and its
    tokenizer: "loads: yes ..." or "loads: no (N problems):" and one line per problem,
    every one the preflight (preflight.py) finds, not only the first the loader meets."""
    from ._native import NativeError, check, ffi, lib

    path = os.fspath(path)
    try:
        problems = preflight.check(path)
    except ValueError as e:
        return f"loads: no\n  - the header cannot be read: {e}"
    native = None
    out = ffi.new("gh_model **")
    params = lib.gh_model_default_params()
    params.load = lib.GH_LOAD_MMAP
    try:
        check(lib.gh_model_load_ex(path.encode(), ffi.new("gh_model_params *", params), out))
        lib.gh_model_free(out[0])
    except NativeError as e:
        native = str(e)
    reasons = preflight.merge(native, problems, path)
    if not reasons:
        try:
            load_tokenizer(path)
        except TokenizerError as e:
            reasons.append(f"the weights load, but the tokenizer does not: {e}")
    if not reasons:
        return "loads: yes (weights and tokenizer)"
    n = f" ({len(reasons)} problems)" if len(reasons) > 1 else ""
    return f"loads: no{n}\n" + preflight.format_problems(reasons)


def auto_mode(path: str | os.PathLike) -> str | None:
    """The FFN mode a new context starts in (`auto`) on this machine and why: "ffn mode
    (auto): dense: gate at density 83% is estimated at 1.31x the dense FFN's time ...",
    or None when the runtime does not load the file."""
    from ._native import NativeError, check, ffi, lib

    out = ffi.new("gh_model **")
    params = lib.gh_model_default_params()
    params.load = lib.GH_LOAD_MMAP
    try:
        check(lib.gh_model_load_ex(os.fspath(path).encode(), ffi.new("gh_model_params *", params), out))
    except NativeError:
        return None
    try:
        ch = ffi.new("gh_ffn_auto_choice *")
        check(lib.gh_model_ffn_auto(out[0], ch))
        return f"ffn mode (auto): {ffi.string(ch.why).decode()}"
    finally:
        lib.gh_model_free(out[0])


class PlotError(ValueError):
    """The plot cannot be drawn (no neuron statistics, or matplotlib missing)."""


def _experts(path: str, out: list[str], fields: dict, by_name: dict, n_layer: int, n_expert: int,
             k: int) -> None:
    """The experts of a mixture-of-experts file: per layer one expert's bytes, and where `place`
    wrote them (the side file first, as the runtime reads it) each expert's selection
    frequency and placement ("*" = on the device), most frequent first."""
    idx, idx_tensors, idx_from = _side_index(path, [])
    src, t = (idx, idx_tensors) if idx_tensors is not None and \
        F.expert_tensor_name(F.T_FFN_EXP_FREQ, 0) in idx_tensors else (fields, by_name)
    eb = [sum(int(by_name[n].n_bytes) for n in (F.tensor_name(kind, l) for kind in
                                                 (F.T_FFN_GATE_EXPS, F.T_FFN_UP_EXPS, F.T_FFN_DOWN_EXPS,
                                                  F.T_FFN_DOWN_EXPS_T))
              if n in by_name) // n_expert for l in range(n_layer)]
    moe = [b for b in eb if b]  # (leading dense layers have none)
    out.append(f"experts: {n_expert} per layer{'' if len(moe) == n_layer else f' in {len(moe)} of {n_layer} layers'}, "
               f"{k} per token; one expert {format_size(moe[0] if moe else 0)}, "
               f"all {format_size(sum(eb) * n_expert)}")
    sb = [sum(int(by_name[n].n_bytes) for n in (F.tensor_name(kind, l) for kind in
                                                 (F.T_FFN_GATE_SHEXP, F.T_FFN_UP_SHEXP, F.T_FFN_DOWN_SHEXP))
              if n in by_name) for l in range(n_layer)]
    if sb[0]:
        sl = src.get(F.KEY_EXPERT_SHARED_LAYERS) if F.expert_tensor_name(F.T_FFN_EXP_FREQ, 0) in t else None
        where_sh = (f"the placement puts {int(sl)} of {n_layer} layers' on the device" if sl is not None
                    else "placed on the device before the routed experts, as the budget allows")
        out.append(f"  shared expert: one per layer, {format_size(sb[0])} (every token runs it); "
                   f"{where_sh}")
    if F.expert_tensor_name(F.T_FFN_EXP_FREQ, 0) not in t:
        out.append("  expert frequencies: none (profile them: python -m powerinfer_cpp.place MODEL "
                   "--vram-budget SIZE --profile TEXT)")
        return
    where = idx_from if t is not by_name else ""
    b = src.get(F.KEY_GPU_VRAM_BUDGET)
    # sparse experts: the hot neurons of each expert on the device (docs/FORMAT.md "Hot
    # neurons of experts") in place of whole experts
    hot = F.expert_hot_tensor_name(F.T_FFN_EXP_HOT_COUNT, 0) in t
    served = "CPU expert bytes per token moved to the device" if hot else "served selections"
    out.append(f"  profiled over {src.get(F.KEY_EXPERT_PROFILE_TOKENS, '?')} tokens of "
               f"{src.get(F.KEY_EXPERT_PROFILE_SOURCE, '?') or '?'}; placement for "
               f"{format_size(int(b)) if b is not None else '?'} (solver {src.get(F.KEY_GPU_SOLVER, '?')}, "
               f"n_cpu_moe {src.get(F.KEY_EXPERT_N_CPU_MOE, '?')}, expert cache "
               f"{format_size(int(src.get(F.KEY_EXPERT_CACHE, 0)))}): "
               f"{format_size(int(src.get(F.KEY_EXPERT_BYTES, 0)))} of {'hot neurons of ' if hot else ''}"
               f"experts, {served} {float(src.get(F.KEY_EXPERT_SERVED_SHARE, 0)):.1%}{where}")
    if hot:
        out.append("  layer  device  expert:frequency[hot neurons on the device/neurons] by falling frequency")
    else:
        out.append("  layer  device  expert:frequency by falling frequency (* = on the device)")
    for l in range(n_layer):
        fr = t.get(F.expert_tensor_name(F.T_FFN_EXP_FREQ, l))
        gp = t.get(F.expert_tensor_name(F.T_FFN_EXP_GPU, l))
        f = np.asarray(fr.data, dtype=np.float64) if fr is not None else np.zeros(n_expert)
        g = np.asarray(gp.data) if gp is not None else np.zeros(n_expert, dtype=np.int32)
        order = np.argsort(-f, kind="stable")
        if hot:
            hc = t.get(F.expert_hot_tensor_name(F.T_FFN_EXP_HOT_COUNT, l))
            c = np.asarray(hc.data, dtype=np.int64).reshape(-1) if hc is not None else np.zeros(n_expert, np.int64)
            ff = int(fields.get(F.arch_key(F.KEY_EXPERT_FEED_FORWARD_LENGTH,
                                           fields.get(F.KEY_GENERAL_ARCHITECTURE, F.ARCH_LLAMA)), 0) or 0)
            cells = " ".join(f"{int(e)}:{f[e]:.3f}[{int(c[e])}/{ff}]" for e in order)
            out.append(f"  {l:5d}  {int((c > 0).sum()):>3}/{n_expert:<3} {cells}")
            continue
        cells = " ".join(f"{int(e)}{'*' if g[e] else ''}:{f[e]:.3f}" for e in order)
        out.append(f"  {l:5d}  {int(g.sum()):>3}/{n_expert:<3} {cells}")


def _side_index(path: str, out: list[str]) -> tuple[dict | None, dict | None, str]:
    """The GPU index `place` wrote beside the model ("<model>.generated.gpuidx"), which the
    runtime loads instead of the file's own: (its keys, its tensors by name, the words
    that say where the index came from), or (None, None, "") when there is none or the
    runtime would refuse it (a line in `out` says why)."""
    side = path + F.GPUIDX_SUFFIX
    if not os.path.exists(side):
        return None, None, ""
    try:
        r = _open(side)
    except (OSError, ValueError) as e:
        out.append(f"gpu index: side file {side} cannot be read ({e}); the runtime refuses it")
        return None, None, ""
    keys = read_fields(r)
    made_for = keys.get(F.KEY_GPU_MODEL_BYTES)
    if made_for is not None and int(made_for) != os.path.getsize(path):
        out.append(f"gpu index: side file {side} was made for a model file of {int(made_for)} bytes, "
                   f"not this one's {os.path.getsize(path)}: the runtime refuses it (re-run "
                   "`python -m powerinfer_cpp.place` or delete it)")
        return None, None, ""
    return (keys, {t.name: t for t in r.tensors},
            f"; from the side file {side} (place), used instead of the file's own")


def _open(path: str):
    """The file's gguf reader (PWRI magic too); a corrupt file is a ValueError saying so."""
    try:
        return open_gguf(path)
    except OSError:
        raise
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors on bad files
        raise ValueError(f"not a valid GGUF file (truncated or corrupt: {e})") from None


def _statistics(path: str) -> tuple[dict, dict]:
    """(fields, placement inputs) of a file with neuron frequencies; PlotError otherwise."""
    r = _open(path)
    fields = read_fields(r)
    if not any(F.parse_tensor_name(t.name)[0] == F.T_FFN_FREQ for t in r.tensors):
        raise PlotError(f"{path} has no neuron statistics (no {F.sparse_tensor_name(F.T_FFN_FREQ, 0)}): "
                        "it is a dense file; convert the model with `python -m powerinfer_cpp.convert "
                        "HF_DIR --sparse` (or --sparsity S) to profile its neurons")
    try:
        return fields, placement_inputs(r, fields, path)
    except PlaceError as e:
        raise PlotError(str(e)) from None


def served_curve(pin: dict, budgets, group_size: int | None = None) -> np.ndarray:
    """Share of the activation mass the GPU serves at each budget (bytes), by the greedy
    placement of sparse.placement on the file's costs (model_costs) and frequencies."""
    dense, per_neuron = model_costs(pin["tensors"], pin["n_layer"], pin["n_embd_kv"], pin["ctx"])
    gs = group_size or pin["group_size"]
    return np.array([greedy_placement(make_problem(pin["freq"], per_neuron, dense, int(b), gs)).served_share
                     for b in budgets])


def plot_statistics(path: str | os.PathLike, out: str | os.PathLike, points: int = 48) -> dict:
    """Draw the file's neuron statistics into the PNG ``out`` (see the module docstring);
    returns {"budgets": bytes, "served": shares, "total_bytes": everything on the GPU}."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                        "(or pip install 'powerinfer-cpp[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError("it is a directory; pass a .gguf file")
    fields, pin = _statistics(path)
    dense, per_neuron = model_costs(pin["tensors"], pin["n_layer"], pin["n_embd_kv"], pin["ctx"])
    dense_b = sum(d.nbytes for d in dense)
    total = dense_b + sum(b * len(f) for b, f in zip(per_neuron, pin["freq"]))
    budgets = np.linspace(0, total, points).astype(np.int64)
    served = served_curve(pin, budgets)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("viridis")
    nl = pin["n_layer"]
    for l, f in enumerate(pin["freq"]):
        sf = np.sort(f)[::-1]
        rank = np.arange(1, len(sf) + 1)
        keep = sf > 0  # log axes: a neuron that never fired has no point
        a1.loglog(rank[keep], sf[keep], color=cmap(l / max(nl - 1, 1)), lw=1.2, label=f"layer {l}")
    a1.set_xlabel("neuron rank (by frequency)")
    a1.set_ylabel("firing frequency (share of calibration tokens)")
    gate = F.KEY_SPARSE_GATE_THRESHOLD in fields
    a1.set_title("active: |act(gate)| above the layer's threshold" if gate
                 else "active: a nonzero activation", fontsize=10)
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7, ncol=2 if nl > 8 else 1, loc="lower left")

    unit, uname = (1 << 30, "GiB") if total >= (1 << 30) else (1 << 20, "MiB")
    a2.plot(budgets / unit, served, color="C3", lw=1.8, label="greedy placement (as the runtime's)")
    a2.axvline(dense_b / unit, color="gray", ls="--", lw=1,
               label=f"dense parts + KV cache ({format_size(dense_b)}, ctx {pin['ctx']})")
    b = fields.get(F.KEY_GPU_VRAM_BUDGET)
    if b is not None and int(b) > 0 and F.KEY_GPU_SERVED_SHARE in fields:
        a2.plot([int(b) / unit], [float(fields[F.KEY_GPU_SERVED_SHARE])], "ko",
                label=f"the file's index ({fields.get(F.KEY_GPU_SOLVER, '?')}, {format_size(int(b))})")
    a2.text(0.53, 0.45, "left of the dashed line the dense parts take\nthe budget in priority order (attention,\n"
            "predictors, norms, head, KV cache) as long as\nthe next fits; what they leave goes to neurons",
            transform=a2.transAxes, fontsize=7, va="top", color="0.3")
    a2.set_xlabel(f"VRAM budget ({uname})")
    a2.set_ylabel("share of activations served by the GPU")
    a2.set_ylim(0, 1.02)
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{os.path.basename(path)}: neuron statistics ({nl} layers x {pin['n_ff']} neurons)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(os.fspath(out), dpi=110)
    plt.close(fig)
    return {"budgets": budgets, "served": served, "total_bytes": int(total), "dense_bytes": int(dense_b)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer_cpp.inspect", description="Describe a GGUF file.")
    ap.add_argument("model")
    ap.add_argument("--tensors", action="store_true", help="also list every tensor")
    ap.add_argument("--plot", metavar="OUT.png", help="draw the neuron statistics of a sparse file: firing "
                    "frequency against rank per layer, and the activations served against a VRAM budget "
                    "(needs matplotlib)")
    args = ap.parse_args(argv)
    try:
        print(describe(args.model, args.tensors))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read {args.model}: {e}", file=sys.stderr)
        return 1
    if args.plot:
        try:
            plot_statistics(args.model, args.plot)
        except PlotError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"error: cannot write {args.plot}: {e}", file=sys.stderr)
            return 1
        print(f"wrote {os.path.abspath(args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
