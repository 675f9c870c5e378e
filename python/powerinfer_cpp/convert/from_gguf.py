"""A GGUF made elsewhere (llama.cpp's, PowerInfer's PWRI, or one of ours) as the sparse
pipeline's starting point: ``python -m powerinfer_cpp.convert model.gguf -o sparse.gguf``.

The input is checked by loading it with the native runtime (so whatever the runtime
cannot compute with is refused here, by name, before any work), then described as a
``DenseModel`` whose tensors are the input's own bytes: every tensor keeps its type (a
Q4_K_M file in, a sparse Q4_K_M file out). The one tensor that changes is the down
projection, which the sparse FFN reads transposed (``ffn_down_t``): a file that has it
already (PowerInfer's, a sparse file of ours) keeps its bytes; otherwise ``ffn_down`` is
dequantized, transposed and quantized again in its own type, the only re-quantization
(K-quant rows need n_embd % 256 == 0, else the next type down: Q8_0, F16).

Whatever a previous sparse conversion added (predictors, neuron statistics, the GPU index,
input sparsity's transposed copies and thresholds, their keys, PowerInfer's threshold) is
dropped and made anew from the calibration text; a
PWRI file's implicit ReLU and a llama.cpp file's implicit SiLU become an explicit
``powerinfer.ffn_activation`` key, so the output means what the input meant.

With an ``outtype`` (``convert model.gguf --outtype q8_0``) the types are not kept: every
tensor is dequantized (gguf.quants) and stored as an HF conversion to that outtype would
store it (gguf_write.storage_type: embeddings and head, the ``_m`` mixes, the row
fallbacks), as llama.cpp's ``llama-quantize --allow-requantize`` does; with ``sparse=False``
the result is a plain dense file. Re-quantizing an already-quantized file adds the new
type's error to the old one's, so it is logged as a warning: convert from the Hugging Face
folder when there is one.

A mixture of experts (llama.cpp's stacked ``ffn_{gate,up,down}_exps``, ``ffn_gate_inp``,
shared experts, ``exp_probs_b``) goes the same way: re-quantized, each expert's rows by the
rule of its kind (storage_type: llama.cpp's MoE choices in the mixes; MXFP4 experts kept);
made sparse, by the sparse experts' pipeline (sparse/expert_sparsity.py: per-expert gate
thresholds, ffn_down_exps transposed per expert).
"""

from __future__ import annotations

import logging
import os

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from .. import format as F
from ..gguf_read import is_pwri, open_gguf
from ..gguf_write import (ConvertError, QuantMix, TensorJob, add_kv, check_output_path, decode_matrix,
                          k_quant_types, quant_block, storage_type, write_gguf)
from ..sparse.ffn_view import ffn_view
from ..sparse.pipeline import DenseModel, SparseOptions, convert_sparse

log = logging.getLogger("powerinfer_cpp.convert")

__all__ = ["is_gguf_file", "dense_from_gguf", "convert_from_gguf"]

#: The types a re-quantization reads without loss (anything else was quantized already).
_FLOAT_TYPES = ("F32", "F16", "BF16")

#: Keys a sparse conversion writes anew (and PowerInfer's own threshold key).
_SPARSE_KEY_PREFIXES = ("powerinfer.sparse.", "powerinfer.gpu.", "powerinfer.input_sparsity.")
#: Keys the writer makes itself, or that describe the input's own layout.
_WRITER_KEYS = (F.KEY_GENERAL_ARCHITECTURE, F.KEY_GENERAL_ALIGNMENT)
#: Tensors a previous sparse conversion added (ffn_down_t is kept): predictors, neuron
#: statistics, GPU index, and input sparsity's transposed copies and thresholds.
_DROPPED_TENSORS = (tuple(k for k in F.SPARSE_LAYER_TENSORS if k != F.T_FFN_DOWN_T)
                    + F.INPUT_SPARSE_LAYER_TENSORS + F.INPUT_SPARSE_GLOBAL_TENSORS
                    + F.FFN_INPUT_SPARSE_TENSORS)


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether path is a file starting with the GGUF (or PowerInfer's PWRI) magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) in (b"GGUF", b"PWRI")
    except OSError:
        return False


def _kv_entries(reader) -> list:
    """The input's metadata as gguf_write.KV entries, minus what the output makes anew."""
    out = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _WRITER_KEYS or key == F.KEY_PWRI_SPARSE_THRESHOLD:
            continue
        if key.startswith(_SPARSE_KEY_PREFIXES):
            continue
        vtype = field.types[0]
        if vtype == V.ARRAY:
            sub = field.types[1] if len(field.types) > 1 else V.INT32
            out.append((key, list(field.contents()), V.ARRAY, sub))
        else:
            out.append((key, field.contents(), vtype, None))
    return out


def _down_t_type(qtype, n_embd: int):
    """Storage of a transposed down projection whose input is in qtype: the same type
    when its rows (n_embd long) are whole blocks, else the next one that fits."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return qtype
    block = quant_block(qtype)
    if n_embd % block == 0:
        return qtype
    fallback = Q.Q8_0 if n_embd % F.QUANT_BLOCK == 0 else Q.F16
    log.warning("ffn_down is %s but its transposed rows (n_embd = %d) are not whole %d-blocks: "
                "ffn_down_t is stored as %s", qtype.name, n_embd, block, fallback.name)
    return fallback


def _check_experts(path: str, tensors: dict) -> None:
    """A mixture's file the runtime loaded (its loader checked each layer's router and the
    stacked experts against expert_count, by name): refused if it is a sparse-experts file
    of ours (its down projection is transposed per expert: convert its source instead)."""
    sparse = sorted(n for n in tensors if F.parse_tensor_name(n)[0] in F.SPARSE_EXPERT_TENSORS)
    if sparse:
        raise ConvertError(f"{path}: a sparse-experts file ({sparse[0]}): convert the dense file or the "
                           "Hugging Face folder it was made from instead")


def dense_from_gguf(path: str | os.PathLike, outtype: str | None = None) -> DenseModel:
    """The sparse pipeline's DenseModel of a GGUF file (checked by loading it natively):
    its tensors in their own types, or with ``outtype`` (format.OUTTYPES) re-quantized by
    storage_type's rule."""
    from .._native import NativeError
    from ..model import Model

    path = os.path.abspath(os.fspath(path))
    if outtype is not None and outtype not in F.OUTTYPES:
        raise ConvertError(F.outtype_refusal(outtype))
    if not os.path.isfile(path):
        raise ConvertError(f"model file not found: {path}")
    try:
        with Model(path, load="mmap") as m:
            info = m.info
    except (NativeError, ValueError) as e:
        what = "re-quantized" if outtype is not None else "made sparse"
        raise ConvertError(f"{path}: this runtime cannot load it, so it cannot be {what}: {e}") from None
    try:
        reader = open_gguf(path)
    except (ValueError, OSError) as e:
        raise ConvertError(f"{path}: not a readable GGUF file: {e}") from None
    pwri = is_pwri(path)
    tensors = {t.name: t for t in reader.tensors}
    if info.n_expert:
        _check_experts(path, tensors)
    n_layer, d, n_ff = info.n_layer, info.n_embd, info.n_ff
    # what llama.cpp's _m mixes look at, as for an HF conversion (no output.weight: tied)
    mix = QuantMix(arch=info.arch, n_layer=n_layer, tied=F.tensor_name(F.T_OUTPUT) not in tensors,
                   n_head=info.n_head, n_head_kv=info.n_head_kv, n_expert=info.n_expert)

    jobs: list[TensorJob] = []
    down_types: list = [None] * n_layer
    quantized_in = set()
    for t in reader.tensors:
        kind, il, suffix = F.parse_tensor_name(t.name)
        if kind in _DROPPED_TENSORS:
            continue
        qtype = Q(t.tensor_type)
        shape = tuple(int(v) for v in reversed(t.shape))

        def load(t=t, qtype=qtype, shape=shape):  # float values (re-quantization, transposition)
            return decode_matrix(np.asarray(t.data), qtype, shape)

        if outtype is not None and qtype == Q.MXFP4:
            # gpt-oss's released experts: kept bit for bit in any outtype, as from the HF folder
            jobs.append(TensorJob(t.name, shape, qtype, lambda t=t: t.data, f"kept {qtype.name}", raw=True))
            continue
        if outtype is not None and qtype != Q.I32:
            if qtype.name not in _FLOAT_TYPES and len(shape) > 1:
                quantized_in.add(qtype.name)
            # a transposed down projection has rows of n_embd: the down rule for that length
            rule_kind = F.T_FFN_DOWN if kind == F.T_FFN_DOWN_T else kind
            new, note = storage_type(rule_kind, shape, outtype, il, mix, suffix)
            if note:
                log.warning("%s: %s", t.name, note)
            if il is not None and kind == F.T_FFN_DOWN and suffix == "weight":
                down_types[il] = storage_type(F.T_FFN_DOWN, (n_ff, d), outtype, il, mix)[0]
            elif il is not None and kind == F.T_FFN_DOWN_T:
                down_types[il] = new
            jobs.append(TensorJob(t.name, shape, new, load, note))
            continue
        if il is not None and kind == F.T_FFN_DOWN and suffix == "weight":
            down_types[il] = _down_t_type(qtype, d)
            jobs.append(TensorJob(t.name, shape, qtype, load))
            continue
        if il is not None and kind == F.T_FFN_DOWN_T:
            down_types[il] = qtype
        if kind == F.T_FFN_DOWN_EXPS and suffix == "weight":
            # the sparse experts transpose it per expert (expert_sparsity.py): float values
            jobs.append(TensorJob(t.name, shape, qtype, load))
            continue
        jobs.append(TensorJob(t.name, shape, qtype, lambda t=t: t.data, raw=True))
    missing = [il for il, q in enumerate(down_types) if q is None]
    if info.n_expert:
        # a mixture's layers have ffn_down_exps (the sparse experts transpose it themselves,
        # in its type refitted: expert_sparsity.py); down_types covers the dense leading
        # layers (glm4moe, dots1) and is not read for the others
        missing = []
    if missing:
        raise ConvertError(f"{path}: layer {missing[0]} has neither ffn_down nor ffn_down_t")
    if quantized_in:
        log.warning("%s holds quantized weights (%s): re-quantizing them to %s adds its error to theirs "
                    "(as llama-quantize --allow-requantize warns); convert the Hugging Face folder "
                    "instead when there is one", path, ", ".join(sorted(quantized_in)), outtype)

    keys = set(reader.fields)
    kv = _kv_entries(reader)
    if outtype is not None:  # the file type says what the weights now are
        kv = [e for e in kv if e[0] not in (F.KEY_GENERAL_FILE_TYPE, F.KEY_GENERAL_QUANTIZATION_VERSION)]
        kv.append((F.KEY_GENERAL_FILE_TYPE, F.OUTTYPE_FILE_TYPE[outtype], V.UINT32, None))
        kv.append((F.KEY_GENERAL_QUANTIZATION_VERSION, 2, V.UINT32, None))
    act = info.ffn_act
    if act not in F.ACTIVATIONS:
        raise ConvertError(f"{path}: FFN activation {act!r} cannot be made sparse here")
    if F.KEY_FFN_ACTIVATION not in keys:
        # implicit in the input (PWRI: ReLU; llama.cpp: the architecture's own): explicit in ours
        kv.append((F.KEY_FFN_ACTIVATION, act, V.STRING, None))
    if F.KEY_FORMAT_VERSION not in keys:
        kv.append((F.KEY_FORMAT_VERSION, F.FORMAT_VERSION, V.UINT32, None))
    act_t = None
    if act == F.ACT_FATRELU and F.KEY_FFN_ACT_THRESHOLD in keys:
        act_t = float(reader.fields[F.KEY_FFN_ACT_THRESHOLD].contents())
    def rows(name):
        t = tensors.get(name)
        return None if t is None else int(t.shape[-1])

    # gated: layer 0's FFN in whatever layout (sparse/ffn_view.py); a mixture's: its experts'
    gated = rows(F.tensor_name(F.T_FFN_GATE, 0)) is not None or (
        rows(F.tensor_name(F.T_FFN_UP, 0)) is not None and ffn_view(rows, 0, n_ff).gated) or (
        info.n_expert > 0 and any(F.parse_tensor_name(n)[0] == F.T_FFN_GATE_EXPS for n in tensors))
    # the FFN weights' type name (the predictors' storage rule)
    ffn_type = outtype or str(info.weight_type).lower()
    log.info("%s: %s%s, %d layers, d=%d, n_ff=%d, act=%s, FFN weights %s, %d tensors", path, info.arch,
             " (PowerInfer PWRI file)" if pwri else "", n_layer, d, n_ff, act,
             ffn_type.upper() + (f" (re-quantized from {str(info.weight_type).upper()})" if outtype else ""),
             len(jobs))
    return DenseModel(arch=info.arch, kv=kv, jobs=jobs, outtype=ffn_type, n_layer=n_layer, n_embd=d,
                      n_ff=n_ff, n_embd_kv=info.n_head_kv * info.head_dim, n_ctx=info.n_ctx_train,
                      activation=act, gated=gated, hf_dir="",
                      act_threshold=act_t, path=path, down_types=down_types, n_expert=info.n_expert,
                      n_expert_used=info.n_expert_used, n_ff_exp=info.n_ff_exp)


def _dense_jobs(dense: DenseModel, outtype: str) -> list[TensorJob]:
    """The jobs of a dense file: a transposed down projection (a sparse or PowerInfer
    input's ffn_down_t) becomes ffn_down again, stored by the down rule for its rows."""
    # the down rule looks at the architecture and the layer count only
    mix = QuantMix(arch=dense.arch, n_layer=dense.n_layer,
                   tied=not any(j.name == F.tensor_name(F.T_OUTPUT) for j in dense.jobs))
    out = []
    for j in dense.jobs:
        kind, il, _ = F.parse_tensor_name(j.name)
        if kind == F.T_FFN_DOWN_T:
            shape = (j.shape[1], j.shape[0])
            qtype, note = storage_type(F.T_FFN_DOWN, shape, outtype, il, mix)
            j = TensorJob(F.tensor_name(F.T_FFN_DOWN, il), shape, qtype,
                          lambda j=j: np.ascontiguousarray(j.load().T), note)
        out.append(j)
    return out


def convert_from_gguf(in_path: str | os.PathLike, out_path: str | os.PathLike, progress: bool = True,
                      sparse_options=None, report: list | None = None,
                      dense: DenseModel | None = None, outtype: str | None = None, sparse: bool = True) -> str:
    """Make the GGUF at ``in_path`` sparse (sparse.pipeline.convert_sparse with
    ``sparse_options``), keeping its tensor types, or re-quantized to ``outtype``; with
    ``sparse=False`` (which needs an outtype: the input is dense already) write the
    re-quantized dense file. Returns the output path. ``dense`` is its DenseModel when the
    caller already built it (with the same outtype)."""
    if not sparse and outtype is None:
        raise ConvertError("a GGUF input is dense already: without an outtype there is nothing to write "
                           "but a sparse file")
    in_path = os.path.abspath(os.fspath(in_path))
    out_path = os.path.abspath(os.fspath(out_path))
    inputs = [in_path] + ([os.fspath(sparse_options.calib)] if getattr(sparse_options, "calib", None) else [])
    check_output_path(out_path, inputs)
    dense = dense or dense_from_gguf(in_path, outtype)
    if not sparse:
        return write_gguf(out_path, lambda w: add_kv(w, dense.kv), _dense_jobs(dense, outtype), progress,
                          arch=dense.arch)
    path, rep = convert_sparse(dense, out_path, sparse_options or SparseOptions(), progress)
    if report is not None:
        report.append(rep)
    return path
