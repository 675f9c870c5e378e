"""numpy references and encoders for the op tests (CPU and device backends)."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from powerinfer_cpp._native import check, ffi, lib

# the type ids are the library's (lib.GH_TYPE_*), never written out here
F32, F16, Q4_0, Q8_0, BF16 = lib.GH_TYPE_F32, lib.GH_TYPE_F16, lib.GH_TYPE_Q4_0, lib.GH_TYPE_Q8_0, lib.GH_TYPE_BF16
Q4_1, Q5_0, Q5_1 = lib.GH_TYPE_Q4_1, lib.GH_TYPE_Q5_0, lib.GH_TYPE_Q5_1
Q4_K, Q5_K, Q6_K = lib.GH_TYPE_Q4_K, lib.GH_TYPE_Q5_K, lib.GH_TYPE_Q6_K
Q2_K, Q3_K = lib.GH_TYPE_Q2_K, lib.GH_TYPE_Q3_K
IQ4_NL, IQ4_XS, MXFP4 = lib.GH_TYPE_IQ4_NL, lib.GH_TYPE_IQ4_XS, lib.GH_TYPE_MXFP4
IQ2_XXS, IQ2_XS, IQ2_S = lib.GH_TYPE_IQ2_XXS, lib.GH_TYPE_IQ2_XS, lib.GH_TYPE_IQ2_S
IQ3_XXS, IQ3_S, IQ1_S, IQ1_M = lib.GH_TYPE_IQ3_XXS, lib.GH_TYPE_IQ3_S, lib.GH_TYPE_IQ1_S, lib.GH_TYPE_IQ1_M
#: the IQ1/IQ2/IQ3 lattice types (256-value blocks against Q8_K): read, never written (no
#: quantizer here or in gguf.quants); the tests store random valid blocks (lattice_blocks)
LATTICE_ALL = {"iq2_xxs": IQ2_XXS, "iq2_xs": IQ2_XS, "iq2_s": IQ2_S, "iq3_xxs": IQ3_XXS,
               "iq3_s": IQ3_S, "iq1_s": IQ1_S, "iq1_m": IQ1_M}


def _lattice_read() -> dict:
    """The lattice types this build reads (all, unless it was built without the gguf
    package's codebooks: then they are refused by name and tested as such)."""
    return {n: t for n, t in LATTICE_ALL.items() if lib.gh_type_block_size(t) > 0}


LATTICE_TYPES = _lattice_read()
LATTICE = tuple(LATTICE_TYPES.values())
TYPES = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0, "q4_0": Q4_0, "q4_1": Q4_1,
         "q5_0": Q5_0, "q5_1": Q5_1, "q4_k": Q4_K, "q5_k": Q5_K, "q6_k": Q6_K,
         "q2_k": Q2_K, "q3_k": Q3_K, "iq4_nl": IQ4_NL, "iq4_xs": IQ4_XS, "mxfp4": MXFP4,
         **LATTICE_TYPES}
#: the gguf package's type of each weight type the library reads, and of the lattice types
#: (read only in a build with their codebooks); the ids are GGUF's
GGUF_QT = {t: QT(t) for t in range(256)
           if (lib.gh_type_block_size(t) > 0 and t != lib.GH_TYPE_I32) or t in LATTICE_ALL.values()}
#: bytes per 256-value block of the lattice types (gguf.constants.GGML_QUANT_SIZES)
LATTICE_SIZE = {IQ2_XXS: 66, IQ2_XS: 74, IQ2_S: 82, IQ3_XXS: 98, IQ3_S: 110, IQ1_S: 50, IQ1_M: 56}
#: the 256-value super-block types: our quantizer (gguf.quants has none), Q8_K activations
K_QUANTS = (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K)
#: the 32-value block types with a scale (and a min) per block, beside Q8_0 / Q4_0
B32_QUANTS = (Q4_1, Q5_0, Q5_1)
#: the non-linear 4-bit types (int8 level tables): IQ4_NL / MXFP4 in 32-value blocks
#: against Q8_X4, IQ4_XS in 256-value blocks against Q8_K
IQ4_QUANTS = (IQ4_NL, IQ4_XS, MXFP4)
QUANTIZED = (Q8_0, Q4_0) + B32_QUANTS + K_QUANTS + IQ4_QUANTS + LATTICE
#: the types gguf.quants cannot quantize (it dequantizes them): our quantizer makes them
NATIVE_QUANT = K_QUANTS + (IQ4_NL, IQ4_XS)
#: elements per block: a row's length must be a multiple of it
BLOCK = {t: GGML_QUANT_SIZES[q][0] for t, q in GGUF_QT.items()}  # gguf's, not the runtime's
SILU, RELU, DRELU, GELU, GELU_ERF = lib.GH_ACT_SILU, lib.GH_ACT_RELU, lib.GH_ACT_DRELU, lib.GH_ACT_GELU, lib.GH_ACT_GELU_ERF
ACTS = {"silu": SILU, "relu": RELU, "drelu": DRELU, "gelu": GELU, "gelu_erf": GELU_ERF}


def vptr(a: np.ndarray):
    """void * to a contiguous array."""
    return ffi.cast("void *", a.ctypes.data)


def block_cols(t: int, cols: int) -> int:
    """cols rounded up to a whole number of t's blocks (the K-quants' 256)."""
    b = BLOCK[t]
    return (cols + b - 1) // b * b


def native_quantize(t: int, a: np.ndarray) -> np.ndarray:
    """The runtime's reference quantizer (gh_quantize_row), row by row: uint8 [rows, row bytes]."""
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, a.shape[-1])
    out = np.zeros((a.shape[0], lib.gh_type_row_size(t, a.shape[1])), dtype=np.uint8)
    for r in range(a.shape[0]):
        check(lib.gh_quantize_row(t, ffi.cast("float *", a[r].ctypes.data), vptr(out[r]), a.shape[1]))
    return out


def set_lattice_d(t: int, blocks: np.ndarray, d) -> None:
    """Store the fp16 super-block scale d [n] in the lattice blocks [n, size] (uint8, in
    place): the first two bytes, or IQ1_M's top nibbles of its four scale words."""
    h = np.asarray(d, dtype=np.float16).reshape(-1).view(np.uint16).astype(np.uint32)
    if t != IQ1_M:
        blocks[:, 0] = h & 0xFF
        blocks[:, 1] = h >> 8
        return
    for k in range(4):  # scale word k at bytes 48 + 2k: its top nibble is bits 4k..4k+3 of d
        blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | (((h >> (4 * k)) & 0xF) << 4).astype(np.uint8)


def lattice_blocks(t: int, rms: np.ndarray, rng) -> np.ndarray:
    """Random valid blocks of lattice type t, one per entry of rms, each scaled (its fp16 d)
    so that its values' RMS is about that entry: uint8 [len(rms), size]. Every bit pattern
    of the indices, signs and sub-block scales is a valid block (the indices' widths are the
    grids' sizes); only d is chosen, finite and of the wanted size."""
    rms = np.asarray(rms, dtype=np.float64).reshape(-1)
    raw = rng.integers(0, 256, size=(rms.size, LATTICE_SIZE[t]), dtype=np.uint8)
    set_lattice_d(t, raw, np.ones(rms.size))
    unit = quants.dequantize(raw.reshape(-1), GGUF_QT[t]).reshape(rms.size, 256).astype(np.float64)
    unit_rms = np.sqrt(np.mean(unit ** 2, axis=1))
    set_lattice_d(t, raw, np.where(unit_rms > 0, rms / np.maximum(unit_rms, 1e-30), 0.0))
    return raw


def encode(t: int, a: np.ndarray):
    """(raw bytes of a stored as type t, its dequantized float32 values). gguf.quants
    quantizes the types it can (it has no K-quant, IQ4_NL or IQ4_XS quantizer: those use
    ours, NATIVE_QUANT); it
    dequantizes every one. The lattice types (LATTICE) have no quantizer anywhere here:
    their rows are random valid blocks with a's RMS per 256 values (lattice_blocks), not
    a's values: the op tests compare against the dequantized weights, whatever they are."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if t == F32:
        return a, a
    if t in LATTICE_ALL.values():
        rows = a.reshape(-1, a.shape[-1])
        rms = np.sqrt(np.mean(rows.astype(np.float64).reshape(rows.shape[0], -1, 256) ** 2, axis=2))
        seed = int(np.abs(rows[:, :8].astype(np.float64)).sum() * 1e6) % (2**32)  # repeatable per a
        raw = lattice_blocks(t, rms, np.random.default_rng(seed)).reshape(*a.shape[:-1], -1)
        return raw, quants.dequantize(raw, GGUF_QT[t]).astype(np.float32).reshape(a.shape)
    if t in NATIVE_QUANT:
        raw = native_quantize(t, a).reshape(*a.shape[:-1], -1)
    else:
        raw = np.ascontiguousarray(quants.quantize(a, GGUF_QT[t]))
    return raw, quants.dequantize(raw, GGUF_QT[t]).astype(np.float32).reshape(a.shape)


def act_ref(act, g, u):
    """act(g, u) of the GLU kinds (gh_act)."""
    if act == RELU:
        return np.maximum(g, 0) * u
    if act == DRELU:
        return np.maximum(g, 0) * np.maximum(u, 0)
    if act == SILU:
        return g / (1 + np.exp(-g)) * u
    if act == GELU:
        return 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))) * u
    return 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2))) * u


def ref_attention(q, k, v, n_past):
    """Causal attention in float64 (gh_op_attention): queries at positions n_past..,
    grouped heads (n_head / n_head_kv queries share a key/value head)."""
    n_tokens, n_head, d = q.shape
    n_head_kv = k.shape[1]
    group = n_head // n_head_kv
    qd, kd, vd = (a.astype(np.float64) for a in (q, k, v))
    out = np.zeros(q.shape, dtype=np.float64)
    for t in range(n_tokens):
        n_kv = n_past + t + 1
        for h in range(n_head):
            kh = h // group
            s = kd[:n_kv, kh, :] @ qd[t, h] / math.sqrt(d)
            p = np.exp(s - s.max())
            out[t, h] = p @ vd[:n_kv, kh, :] / p.sum()
    return out


def attn_inputs(n_tokens, n_past, n_head, n_head_kv, d, seed, q_scale=1.0):
    """Gaussian q [n_tokens, n_head, d] (times q_scale), k, v [n_past + n_tokens, n_head_kv, d]."""
    rng = np.random.default_rng(seed)
    n_kv = n_past + n_tokens
    q = (rng.standard_normal((n_tokens, n_head, d)) * q_scale).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float32)
    return q, k, v


def id_lists(rows, rng):
    """Empty, one, all, sorted random, unsorted random with repeats, a contiguous run."""
    perm = rng.permutation(rows)
    return {
        "empty": np.zeros(0, dtype=np.int32),
        "one": np.array([rows // 2], dtype=np.int32),
        "all": np.arange(rows, dtype=np.int32),
        "sorted": np.sort(perm[: max(1, rows // 5)]).astype(np.int32),
        "unsorted": np.concatenate([perm[: max(1, rows // 3)], perm[:2]]).astype(np.int32),
        "run": np.arange(rows // 4, rows // 4 + min(rows, 9), dtype=np.int32) % rows,
    }


def nrmse(got: np.ndarray, ref: np.ndarray) -> float:
    """Root-mean-square error normalised by the reference's RMS."""
    den = float(np.sqrt(np.mean(np.square(ref, dtype=np.float64))))
    return float(np.sqrt(np.mean(np.square(got - ref, dtype=np.float64)))) / max(den, 1e-30)


def kernel_form(name: str) -> int:
    """The index of a kernel form of the CPU kernel table ("dot", "dot4", "axpy16", ...)."""
    f = 0
    while (p := lib.gh_kernel_form_name(f)) != ffi.NULL:
        if ffi.string(p).decode() == name:
            return f
        f += 1
    raise KeyError(f"the kernel table has no form {name!r}")


def has_form(t: int, name: str, level: int) -> bool:
    """Whether form `name` of type t runs at SIMD level `level` (its own or inherited)."""
    return lib.gh_kernel_source(t, kernel_form(name), level, ffi.NULL, ffi.NULL) >= 0


#: Rows per group of the int8 axpy forms (cpu/avx2/axpy_avx2.c: at the AVX2 level and up).
AXPY_INT8_GROUP = 16
#: The types whose one-token transposed matmul has the int8 form ("axpy16") at some level:
#: the kernel table's answer, not a list
AXPY_INT8_TYPES = tuple(t for t in GGUF_QT if lib.gh_type_block_size(t) > 0
                        and any(has_form(t, "axpy16", lv) for lv in range(lib.GH_SIMD_AVX512 + 1)))


def _k4_scales(sc8: np.ndarray) -> np.ndarray:
    """The 6-bit sub-block scales of Q4_K/Q5_K's 12 packed bytes [..., 12] -> [..., 8]."""
    sc8 = sc8.astype(np.int32)
    sc = np.empty(sc8.shape[:-1] + (8,), np.int32)
    for j in range(8):
        if j < 4:
            sc[..., j] = sc8[..., j] & 63
        else:
            sc[..., j] = (sc8[..., j + 4] & 0xF) | ((sc8[..., j - 4] >> 6) << 4)
    return sc


def _k_fields(t: int, raw: np.ndarray):
    """Per row of K-quant blocks: D = d * sc per sub-block [rows, sub-blocks] and |q - off|
    of the quants per value [rows, cols] (ggml's layouts; off 8 / 16 / 32 for Q4_K / Q5_K /
    Q6_K, the centring the int8 forms round)."""
    n = raw.shape[0]
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[t]
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1, size)
    if t == Q6_K:
        d = b[:, :, 208:210].copy().view(np.float16)[:, :, 0].astype(np.float64)
        sc = b[:, :, 192:208].view(np.int8).astype(np.float64)           # per 16 values
        D = (d[..., None] * sc).reshape(n, -1)
        ql = b[:, :, 0:128].astype(np.int32).reshape(n, -1, 2, 64)       # [rows, blocks, half, 64]
        qh = b[:, :, 128:192].astype(np.int32).reshape(n, -1, 2, 32)
        lo, hi = ql[..., :32], ql[..., 32:]
        q = np.stack([(lo & 0xF) | ((qh & 3) << 4), (hi & 0xF) | (((qh >> 2) & 3) << 4),
                      (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], axis=3)
        return D, np.abs(q.reshape(n, -1).astype(np.float64) - 32.0)
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    sc = _k4_scales(b[:, :, 4:16])
    D = (d[..., None] * sc).reshape(n, -1)
    qs = b[:, :, size - 128:].astype(np.int32).reshape(n, -1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3)                          # [rows, blocks, 4, 2, 32]
    if t == Q5_K:
        qh = b[:, :, 16:48].astype(np.int32)                             # [rows, blocks, 32]
        bits = np.stack([(qh >> j) & 1 for j in range(8)], axis=2).reshape(n, -1, 4, 2, 32)
        q = q | (bits << 4)
    return D, np.abs(q.reshape(n, -1).astype(np.float64) - (16.0 if t == Q5_K else 8.0))


def _int8_operands(t: int, raw: np.ndarray, wd: np.ndarray):
    """The int8 forms' per-sub-block scales D [rows, sub-blocks] and |quants| [rows, cols]."""
    if t in K_QUANTS:
        return _k_fields(t, raw)
    if t == Q4_1:  # x = d q + m: the int8 sums take d (q - 8), the rest is exact
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0], -1, 20)
        d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float64)
        qs = blocks[:, :, 4:20].astype(np.int32)
        q = np.concatenate([qs & 0xF, qs >> 4], axis=2)                 # values 0..15, 16..31
        return d, np.abs(q.reshape(raw.shape[0], -1).astype(np.float64) - 8.0)
    # Q4_0 { d, qs[16] } or Q8_0 { d, qs[32] }: the scale d first, x = d q (Q4_0's q less 8)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0], -1, 34 if t == Q8_0 else 18)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float64)  # [rows, blocks]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d != 0, 1.0 / np.abs(d), 0.0)                   # |q| = |W / d| (d may be < 0)
    return d, np.repeat(inv, 32, axis=1) * np.abs(wd.astype(np.float64))


def _int8_groups_bound(t: int, raw: np.ndarray, wd: np.ndarray, groups) -> np.ndarray:
    """Per output column, the int8 form's rounding bound summed over groups of (rows, a):
    per group and sub-block b (32 values, Q6_K's 16) each a_k * D_k,b is rounded to a multiple
    of S = max_k |a_k * D_k,b| / 127, at most S / 2 times |q| per row and value."""
    bound = np.zeros(wd.shape[1])
    D, qabs = _int8_operands(t, raw, wd)
    sub = wd.shape[1] // D.shape[1]
    for rows, a in groups:
        c = np.asarray(a, dtype=np.float64)[:, None] * D[rows]         # [<= 16, sub-blocks]
        s_half = np.abs(c).max(axis=0) / 127.0 / 2.0                   # [sub-blocks]
        bound += (np.repeat(s_half, sub)[None, :] * qabs[rows]).sum(axis=0)
    return bound * 1.001 + 1e-6


def axpy_int8_bound(t: int, level: int, raw: np.ndarray, wd: np.ndarray, ids, a) -> np.ndarray:
    """Per output column, the most the one-token transposed matmul sum_k a[k] * W[ids[k]]
    can differ from exact by the int8 form's rounding: 0 where that form is not used (other
    types, the scalar level). The form takes the nonzero a's in list order in groups of
    16 (the rest go through the float forms)."""
    ids = np.asarray(ids)
    a = np.asarray(a, dtype=np.float64)
    if not has_form(t, "axpy16", level):
        return np.zeros(wd.shape[1])
    nz = np.flatnonzero(a != 0.0)
    nz = nz[: nz.size // AXPY_INT8_GROUP * AXPY_INT8_GROUP]
    groups = [(ids[nz[g:g + AXPY_INT8_GROUP]], a[nz[g:g + AXPY_INT8_GROUP]])
              for g in range(0, nz.size, AXPY_INT8_GROUP)]
    return _int8_groups_bound(t, raw, wd, groups)


def matmul_t_int8_bound(t: int, level: int, raw: np.ndarray, wd: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Per token and output column, the same bound for a batch (h [n_tokens, rows], more than
    one token) of gh_matmul_t: its dense blocks take the rows some token needs in groups of
    16, the last one short, each token with its own factors (blocks that run in floats
    instead are within the bound too)."""
    h = np.asarray(h, dtype=np.float64)
    out = np.zeros((h.shape[0], wd.shape[1]))
    if not has_form(t, "matmul16", level) or h.shape[0] < 2:
        return out
    active = np.flatnonzero((h != 0.0).any(axis=0))
    sel = [active[g:g + AXPY_INT8_GROUP] for g in range(0, active.size, AXPY_INT8_GROUP)]
    for i in range(h.shape[0]):
        out[i] = _int8_groups_bound(t, raw, wd, [(rows, h[i, rows]) for rows in sel])
    return out
