"""Writing our GGUF files: tensor jobs, storage types, encoding, the atomic writer.

Shared by the converter (dense files), the sparse pipeline (the extended file) and
``place`` (a rewritten GPU index), so none of them has to import another to write.
Key and tensor names come from ``format.py``.

A file is written to a scratch file next to the output and renamed into place only
when complete; tensors are produced and encoded one at a time (``TensorJob.load``), so
peak memory stays around the size of the largest tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize
from tqdm import tqdm

from . import format as F
from .scratch import remove_stale, scratch_file

__all__ = ["ConvertError", "TensorJob", "KV", "QuantMix", "use_more_bits", "storage_type", "fit_rows",
           "encode_job", "encode_matrix", "decode_matrix", "add_kv", "write_gguf", "check_output_path"]


class ConvertError(Exception):
    """The model cannot be converted or its file cannot be written (message says why)."""


@dataclass
class TensorJob:
    """One output tensor: where it comes from and how it is stored."""
    name: str                       # GGUF tensor name
    shape: tuple[int, ...]          # numpy (row-major) shape of the logical tensor
    qtype: Any                      # gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]  # returns float32 data of `shape` (int32 for I32)
    note: str = ""
    raw: bool = False               # load() returns the already encoded bytes (copied as is)

    def nbytes(self) -> int:
        """Bytes of the encoded tensor."""
        bs, ts = GGML_QUANT_SIZES[self.qtype]
        n = int(np.prod(self.shape))
        return n // bs * ts


#: One metadata entry: (key, value, GGUFValueType, element GGUFValueType for arrays or None).
KV = tuple


@dataclass(frozen=True)
class QuantMix:
    """What llama.cpp's ``_m`` mixes look at besides a tensor's kind, layer and shape."""
    arch: str = F.ARCH_LLAMA
    n_layer: int = 1
    tied: bool = False     # no output.weight: token_embd is the head as well
    n_head: int = 1
    n_head_kv: int = 1
    n_expert: int = 0      # experts per layer (llama.cpp's 8-expert rule)


def use_more_bits(layer: int, n_layer: int) -> bool:
    """The layers llama.cpp's _m mixes give more bits: the first and last eighth of the
    layers and every third layer between them."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


_OUTTYPE_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
                 "q5_0": "Q5_0", "q5_1": "Q5_1", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K",
                 "q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q2_k": "Q2_K", "q3_k_m": "Q3_K", "iq4_nl": "IQ4_NL",
                 "iq4_xs": "IQ4_XS"}


def storage_type(kind: str, shape: tuple[int, ...], outtype: str, layer: int | None = None,
                 mix: QuantMix | None = None, suffix: str | None = "weight"):
    """(GGML type, note) a dense tensor of this kind, layer and numpy shape is stored as.

    1-D tensors (norms, biases, frequencies), every bias (``suffix``; gpt-oss's expert biases
    are 2-D) and the expert routers are always F32. A 3-D
    expert tensor [n_expert, rows, cols] is stored as its rows (their length is the last
    axis), by the rule of its kind. In the mixes an expert or shared-expert down projection
    (``ffn_down_exps``, ``ffn_down_shexp``) follows ffn_down's rule, as llama.cpp's quantizer
    matches every name holding "ffn_down" (its layer from the name, over all n_layer), and a
    model with 8 experts gets llama.cpp's 8-expert choices (_moe8_type). Q4_0 / Q4_1 / Q5_0 / Q5_1
    embeddings and heads are stored as Q8_0, Q4_K and Q5_K ones as Q6_K (they dominate the quality loss
    otherwise, as in llama.cpp). The mixes q4_k_m, q5_k_m, q2_k, q3_k_m, iq4_nl and iq4_xs
    choose per tensor as llama.cpp's quantizer does (_mix_type, _low_mix_type, _iq4_mix_type;
    ``mix`` says the model's layer count, whether the head is tied, ...). Block-quantized rows
    need a length divisible by the block size (32; K-quants and IQ4_XS 256): other rows fall
    back as llama.cpp's quantizer does (fit_rows)."""
    if len(shape) == 1 or kind in F.F32_KINDS or suffix == "bias":
        return Q.F32, ""
    t = Q[_OUTTYPE_TYPE[outtype]]
    if outtype in ("iq4_nl", "iq4_xs") or outtype in F.OUTTYPE_MIXES:
        mix = mix or QuantMix()
        rule = F.T_FFN_DOWN if kind in (F.T_FFN_DOWN_EXPS, F.T_FFN_DOWN_SHEXP) else kind
        t = (_iq4_mix_type if outtype in ("iq4_nl", "iq4_xs") else _mix_type)(rule, layer, t, mix)
        if mix.n_expert == 8 and layer is not None:
            t = _moe8_type(kind, t, outtype, mix)
    elif kind in (F.T_TOKEN_EMBD, F.T_OUTPUT, F.T_POSITION_EMBD):
        t = {Q.Q4_0: Q.Q8_0, Q.Q4_1: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.Q5_1: Q.Q8_0, Q.Q4_K: Q.Q6_K,
             Q.Q5_K: Q.Q6_K}.get(t, t)
    return fit_rows(t, shape[-1])


def _moe8_type(kind: str, t, outtype: str, mix: QuantMix):
    """llama.cpp's choices for a model of 8 experts (Mixtral 8x7B's), over the preset's own:
    attn_v and attn_k Q8_0 (little memory beside the experts); attn_output Q5_K in the
    presets Q2_K, Q3_K_M, Q4_K_M, IQ4_NL and IQ4_XS, except Falcon's."""
    if kind in (F.T_ATTN_V, F.T_ATTN_K):
        return Q.Q8_0
    if kind == F.T_ATTN_OUTPUT and mix.arch != F.ARCH_FALCON and outtype in (
            "q2_k", "q3_k_m", "q4_k_m", "iq4_nl", "iq4_xs"):
        return Q.Q5_K
    return t


def _llama_70b(mix: QuantMix) -> bool:
    """llama.cpp's 70B LLaMA test, as far as a file tells: 80 layers, grouped-query attention."""
    return mix.arch == F.ARCH_LLAMA and mix.n_layer == 80 and mix.n_head_kv < mix.n_head


def _mix_type(kind: str, layer: int | None, base, mix: QuantMix):
    """llama.cpp's Q4_K_M / Q5_K_M choice (``base`` Q4_K / Q5_K) for one matrix, before
    the row-length fallback. Its rule for a dense, non-MoE model: the head (the tied
    embedding too) Q6_K, Falcon's Q8_0; attn_v Q6_K where use_more_bits; a fused attn_qkv
    one step up (Q5_K / Q6_K); ffn_down Q6_K where use_more_bits, except Falcon's Q4_K_M
    (Q6_K in the first sixteenth of the layers, Q5_K where use_more_bits); a 70B LLaMA's
    (80 layers, grouped-query attention) other attn_v Q5_K in Q4_K_M; all else ``base``.
    Q2_K / Q3_K_M (``base`` Q2_K / Q3_K): _low_mix_type."""
    if kind == F.T_OUTPUT or (kind == F.T_TOKEN_EMBD and mix.tied):
        return Q.Q8_0 if mix.arch == F.ARCH_FALCON else Q.Q6_K
    if layer is None:
        return base
    if base in (Q.Q2_K, Q.Q3_K):
        return _low_mix_type(kind, layer, base, mix)
    more = use_more_bits(layer, mix.n_layer)
    if kind == F.T_ATTN_V:
        if more:
            return Q.Q6_K
        if base == Q.Q4_K and _llama_70b(mix):
            return Q.Q5_K
        return base
    if kind == F.T_ATTN_QKV:
        return Q.Q5_K if base == Q.Q4_K else Q.Q6_K
    if kind == F.T_FFN_DOWN:
        if mix.arch == F.ARCH_FALCON and base == Q.Q4_K:
            return Q.Q6_K if layer < mix.n_layer // 16 else Q.Q5_K if more else Q.Q4_K
        return Q.Q6_K if more else base
    return base


def _low_mix_type(kind: str, layer: int, base, mix: QuantMix):
    """llama.cpp's Q2_K (``base`` Q2_K) / Q3_K_M (``base`` Q3_K) choice for a layer's matrix
    of a dense, non-MoE model (the head: _mix_type): attn_v Q4_K where n_head / n_head_kv
    >= 4, else Q3_K (Q2_K), or Q5_K in the first two layers, else Q4_K (Q3_K_M), either
    Q5_K for a 70B LLaMA where it would be Q3_K or Q4_K; a fused attn_qkv Q4_K in Q3_K_M;
    ffn_down Q3_K (Q2_K), or Q5_K in the first sixteenth of the layers, else Q4_K, except
    Falcon's Q3_K outside the use_more_bits layers (Q3_K_M); attn_output one step up, Q3_K
    / Q4_K, except Falcon's; all else ``base``. (llama.cpp's rule before it counted
    attn_qkv as an attn_v, as the Q4_K_M / Q5_K_M rule above.)"""
    falcon = mix.arch == F.ARCH_FALCON
    if kind == F.T_ATTN_V:
        if base == Q.Q2_K:
            t = Q.Q4_K if mix.n_head >= 4 * mix.n_head_kv else Q.Q3_K
        else:
            t = Q.Q5_K if layer < 2 else Q.Q4_K
        return Q.Q5_K if t in (Q.Q3_K, Q.Q4_K) and _llama_70b(mix) else t
    if kind == F.T_ATTN_QKV:
        return Q.Q4_K if base == Q.Q3_K else base
    if kind == F.T_FFN_DOWN:
        if base == Q.Q2_K:
            return Q.Q3_K
        if layer < mix.n_layer // 16:
            return Q.Q5_K
        return Q.Q4_K if not falcon or use_more_bits(layer, mix.n_layer) else Q.Q3_K
    if kind == F.T_ATTN_OUTPUT and not falcon:
        return Q.Q3_K if base == Q.Q2_K else Q.Q4_K
    return base


def low_bit_fallback():
    """What llama.cpp stores a Q2_K / Q3_K matrix as when its rows are not whole 256-blocks:
    IQ4_NL (32-value blocks, 4.5 bits), when this runtime reads it (its type table has a
    row: gh_type_row_size is not 0); else Q5_0, the 32-value type of Q4_K's fallback."""
    from ._native import lib
    return Q.IQ4_NL if lib.gh_type_row_size(int(Q.IQ4_NL), F.QUANT_BLOCK) != 0 else Q.Q5_0


def _iq4_mix_type(kind: str, layer: int | None, base, mix: QuantMix):
    """llama.cpp's IQ4_NL / IQ4_XS preset (``base`` IQ4_NL / IQ4_XS) for one matrix of a
    dense model without an importance matrix, before the row-length fallback: the head (the
    tied embedding too) Q6_K, Falcon's Q8_0; attn_v Q5_K where n_head / n_head_kv >= 4;
    ffn_down Q5_K in the first eighth of the layers; all else ``base`` (an untied token
    embedding too)."""
    if kind == F.T_OUTPUT or (kind == F.T_TOKEN_EMBD and mix.tied):
        return Q.Q8_0 if mix.arch == F.ARCH_FALCON else Q.Q6_K
    if layer is None:
        return base
    if kind == F.T_ATTN_V and mix.n_head // max(mix.n_head_kv, 1) >= 4:
        return Q.Q5_K
    if kind == F.T_FFN_DOWN and layer < mix.n_layer // 8:
        return Q.Q5_K
    return base


def fit_rows(t, row_len: int):
    """(type, note): ``t`` if rows of ``row_len`` are whole blocks of it, else the fallback:
    llama.cpp's for a K-quant (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0: 32-value blocks of
    about the same bits; Q2_K, Q3_K -> low_bit_fallback()) and IQ4_XS (-> IQ4_NL), then F16."""
    if t in (Q.F32, Q.F16, Q.BF16):
        return t, ""
    block = quant_block(t)
    if row_len % block == 0:
        return t, ""
    k_fallback = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}
    if t in (Q.Q2_K, Q.Q3_K):
        k_fallback[t] = low_bit_fallback()
    fb = k_fallback[t] if t in k_fallback and row_len % F.QUANT_BLOCK == 0 else Q.F16
    return fb, f"row length {row_len} is not a multiple of {block}: stored as {fb.name}, not {t.name}"


def k_quant_types():
    """The K-quant types: gguf.quants dequantizes them but cannot quantize them, so the
    runtime's reference quantizer (gh_quantize_row) encodes them."""
    return (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K)


def native_quant_types():
    """The types gguf.quants dequantizes but cannot quantize (the K-quants, IQ4_NL, IQ4_XS):
    the runtime's reference quantizer (gh_quantize_row) encodes them."""
    return (*k_quant_types(), Q.IQ4_NL, Q.IQ4_XS)


def quant_block(qtype) -> int:
    """Elements per block of a block-quantized type (32, or 256 for the K-quants and IQ4_XS)."""
    return GGML_QUANT_SIZES[qtype][0]


def quantize(a: np.ndarray, qtype) -> np.ndarray:
    """a (float32, rows whole blocks) as qtype's blocks: uint8 [..., row bytes]."""
    if qtype not in native_quant_types():
        return gguf_quantize(a, qtype)
    from ._native import check, ffi, lib
    a = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty((*a.shape[:-1], lib.gh_type_row_size(int(qtype), a.shape[-1])), dtype=np.uint8)
    # rows are whole blocks, so the tensor is one long row of blocks
    check(lib.gh_quantize_row(int(qtype), ffi.cast("float *", a.ctypes.data), ffi.cast("void *", out.ctypes.data),
                              a.size))
    return out


def encode_job(job: TensorJob) -> np.ndarray:
    """The bytes (as a numpy array) of a job's tensor in its storage type."""
    a = job.load()
    if job.raw:
        return np.asarray(a)
    if a.shape != job.shape:
        raise ConvertError(f"{job.name}: loaded shape {a.shape} != planned {job.shape}")
    if job.qtype == Q.F32:
        return a
    if job.qtype == Q.F16:
        return a.astype(np.float16)
    if job.qtype == Q.I32:
        return np.ascontiguousarray(a, dtype=np.int32)
    return quantize(a, job.qtype)


def encode_matrix(a: np.ndarray, qtype) -> np.ndarray:
    """A float matrix encoded as ``qtype`` (F32, F16 or a block type)."""
    if qtype == Q.F32:
        return np.ascontiguousarray(a, dtype=np.float32)
    if qtype == Q.F16:
        return a.astype(np.float16)
    return quantize(np.ascontiguousarray(a, dtype=np.float32), qtype)


def decode_matrix(data: np.ndarray, qtype, shape) -> np.ndarray:
    """Inverse of encode_matrix: float32 of ``shape``."""
    if qtype in (Q.F32, Q.F16):
        return np.asarray(data, dtype=np.float32).reshape(shape)
    return dequantize(np.asarray(data), qtype).reshape(shape).astype(np.float32)


def add_kv(w, kvs: Iterable[KV]) -> None:
    """Add metadata entries (see KV) to a gguf.GGUFWriter."""
    for key, value, vtype, sub in kvs:
        if sub is None:
            w.add_key_value(key, value, vtype)
        else:  # add_key_value keeps empty lists, which add_array cannot type
            w.add_key_value(key, value, vtype, sub)


def write_gguf(out_path: str, setup: Callable[[Any], None], jobs: list[TensorJob],
               progress: bool = True, arch: str = F.ARCH_LLAMA) -> str:
    """Write a GGUF file atomically: general.architecture is ``arch``, ``setup(writer)``
    adds the other metadata, then the tensors of ``jobs`` are produced, encoded and
    written one at a time. Output goes to a temp file in the same folder, renamed on
    success and removed on any failure."""
    out_path = os.path.abspath(os.fspath(out_path))
    out_dir = os.path.dirname(out_path)
    check_output_path(out_path)
    try:
        remove_stale(out_dir)
        fd, tmp = scratch_file(out_path)
    except OSError as e:
        raise ConvertError(f"cannot create a file in {out_dir}: {e.strerror or e}") from None
    try:  # the permissions a plain new file would get (mkstemp makes it private, 0600)
        if os.path.isfile(out_path):
            mode = os.stat(out_path).st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
    except OSError:
        pass
    os.close(fd)
    w = None
    try:
        w = gguf.GGUFWriter(None, arch)
        setup(w)
        for j in jobs:
            Q = gguf.GGMLQuantizationType
            if j.qtype == Q.F32:
                w.add_tensor_info(j.name, j.shape, np.dtype(np.float32), j.nbytes())
            elif j.qtype == Q.F16:
                w.add_tensor_info(j.name, j.shape, np.dtype(np.float16), j.nbytes())
            elif j.qtype == Q.I32:
                w.add_tensor_info(j.name, j.shape, np.dtype(np.int32), j.nbytes())
            else:
                byte_shape = gguf.quants.quant_shape_to_byte_shape(j.shape, j.qtype)
                w.add_tensor_info(j.name, byte_shape, np.dtype(np.uint8), j.nbytes(), raw_dtype=j.qtype)
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for j in tqdm(jobs, desc="converting", unit="tensor", disable=not progress):
            data = encode_job(j)
            if data.nbytes != j.nbytes():
                raise ConvertError(f"{j.name}: encoded {data.nbytes} bytes, expected {j.nbytes()}")
            w.write_tensor_data(data)
            del data
        w.close()
        w = None
        os.replace(tmp, out_path)
    except BaseException as e:
        if w is not None:
            try:
                w.close()
            except Exception:
                pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ConvertError(f"writing {out_path} failed: {e}") from e
        raise
    return out_path


def check_output_path(out_path: str, inputs: list[str] | None = None) -> None:
    """ConvertError unless out_path can be (re)written as a regular file: its folder
    exists, it is not a folder, device or other special file, and it is none of
    ``inputs`` (files the conversion reads, which it would destroy)."""
    out_dir = os.path.dirname(out_path)
    if os.path.isdir(out_path):
        raise ConvertError(f"output path {out_path} is a directory; give a file name, "
                           f"e.g. {os.path.join(out_path, 'model.gguf')}")
    if not os.path.isdir(out_dir):
        raise ConvertError(f"output folder {out_dir} does not exist")
    if os.path.exists(out_path) and not os.path.isfile(out_path):
        raise ConvertError(f"output path {out_path} exists and is not a regular file "
                           "(a device, pipe or socket); give a file path")
    for src in inputs or ():
        try:
            same = os.path.exists(out_path) and os.path.samefile(out_path, src)
        except OSError:
            same = False
        if same:
            raise ConvertError(f"output path {out_path} is one of the input files ({src}); "
                               "writing it would destroy the model being converted; "
                               "choose another -o")
