"""The runtime side of the extended (sparse) GGUF: the transposed down projection
(gh_op_matmul_t and models whose layers store ffn_down_t), validation of the sparse
metadata (predictors, neuron frequencies, GPU index, format version) and the profiling
mode (gh_eval_profile / powerinfer_cpp.sparse.profile).

Sparse files are made here from the converted random model (conftest's random_gguf) by
rewriting it with tests/gguf_rewrite.py: ffn_down dropped, ffn_down_t (the transpose,
stored in every type: quantized types along its n_embd-long rows) added, plus random
predictors, frequencies and a GPU index.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, quants

from powerinfer_cpp import Model, NativeError
from powerinfer_cpp import format as F
from powerinfer_cpp._native import check, ffi, lib
from powerinfer_cpp.sparse.profile import profile_model
from cbuf import fptr  # noqa: E402

from opref import (AXPY_INT8_TYPES, BF16, BLOCK, F16, F32, GGUF_QT, IQ4_NL, LATTICE, MXFP4, NATIVE_QUANT,  # noqa: E402
                   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TYPES, block_cols, has_form, native_quantize)
from opref import encode as opref_encode  # noqa: E402

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 100, 383, 12, 64]


def encode(t: int, a: np.ndarray):
    """a (float32 [rows, cols]) stored as type t: (raw data, GGUF type), and its
    dequantized float32 values."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if t == F32:
        return a, a
    if t in LATTICE:  # no quantizer: random valid blocks of a's magnitude (opref.encode)
        raw, wd = opref_encode(t, a)
        return (raw, GGUF_QT[t]), wd
    raw = native_quantize(t, a) if t in NATIVE_QUANT else quants.quantize(a, GGUF_QT[t])
    return (raw, GGUF_QT[t]), quants.dequantize(raw, GGUF_QT[t]).astype(np.float32).reshape(a.shape)


# ---- gh_op_matmul_t (against numpy: test_op_table.py's matmul_t row) ----------------


def matmul_t(t: int, raw: np.ndarray, rows: int, cols: int, h: np.ndarray, n_threads: int):
    y = np.full((h.shape[0], cols), np.nan, dtype=np.float32)
    check(lib.gh_op_matmul_t(t, ffi.cast("void *", raw.ctypes.data), rows, cols, fptr(h),
                             h.shape[0], fptr(y), n_threads))
    return y


@pytest.mark.parametrize("t", AXPY_INT8_TYPES)
def test_matmul_t_int8_batch_equals_tokens(t):
    """The int8 batch forms: each token of a dense batch sums as the one-token form does
    over the same groups of 16 rows, bit for bit (rows a multiple of 16, no zero h)."""
    rng = np.random.default_rng(11)
    rows, cols, n_tokens = 96, block_cols(t, 544), 9
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    data, wd = encode(t, w)
    raw = np.ascontiguousarray(data[0] if isinstance(data, tuple) else data)
    h = rng.standard_normal((n_tokens, rows)).astype(np.float32)
    prev = lib.gh_simd_get()
    try:
        for level in range(1, int(lib.gh_simd_supported()) + 1):
            assert lib.gh_simd_set(level) != -2
            batch = matmul_t(t, raw, rows, cols, h, 2)
            one = np.concatenate([matmul_t(t, raw, rows, cols, h[i:i + 1], 1) for i in range(n_tokens)])
            np.testing.assert_array_equal(batch, one)
    finally:
        lib.gh_simd_set(prev)


def test_matmul_t_odd_cols_and_many_threads():
    rng = np.random.default_rng(5)
    for cols in (1, 15, 17, 33):
        w = rng.standard_normal((9, cols)).astype(np.float32)
        h = rng.standard_normal((2, 9)).astype(np.float32)
        for nt in (1, 2, 3, 8):
            np.testing.assert_allclose(matmul_t(F32, w, 9, cols, h, nt), h @ w, rtol=1e-5, atol=1e-5)
    w16 = rng.standard_normal((5, 17)).astype(np.float16)
    h = rng.standard_normal((1, 5)).astype(np.float32)
    np.testing.assert_allclose(matmul_t(F16, w16, 5, 17, h, 2), h @ w16.astype(np.float32),
                               rtol=1e-5, atol=1e-5)


def test_matmul_t_bad_args():
    w = np.zeros((4, 32), dtype=np.float32)
    h = np.zeros((1, 4), dtype=np.float32)
    y = np.zeros((1, 32), dtype=np.float32)
    p = ffi.cast("void *", w.ctypes.data)
    # 4: no ggml type (the removed Q4_2)
    assert lib.gh_op_matmul_t(4, p, 4, 32, fptr(h), 1, fptr(y), 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_matmul_t(Q8_0, p, 4, 16, fptr(h), 1, fptr(y), 1) == lib.GH_ERR_INVALID_ARG
    assert "block size" in ffi.string(lib.gh_last_error()).decode()
    assert lib.gh_op_matmul_t(F32, p, 0, 32, fptr(h), 1, fptr(y), 1) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_matmul_t(F32, p, 4, 32, fptr(h), 1, fptr(y), 0) == lib.GH_ERR_INVALID_ARG
    assert lib.gh_op_matmul_t(F32, ffi.NULL, 4, 32, fptr(h), 1, fptr(y), 1) == lib.GH_ERR_INVALID_ARG


# ---- sparse files --------------------------------------------------------------------


def _tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32 (dequantized) or its stored integers."""
    out = {}
    for t in GGUFReader(str(path)).tensors:
        if t.tensor_type in (QT.Q8_0, QT.Q4_0, QT.BF16):
            out[t.name] = quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32)
        else:
            out[t.name] = np.array(t.data)
    return out


def _info(path):
    r = GGUFReader(str(path))
    get = lambda k: int(r.fields[k].parts[-1][0])  # noqa: E731
    return get("llama.block_count"), get("llama.embedding_length"), get("llama.feed_forward_length")


def sparsify(src, dst, *, down_type=F32, pred_h=16, pred_type=F32, hot=(5, 0, 17),
             kv=None, drop=(), add=None, replace=None, keep_down=False):
    """src rewritten as a sparse file: ffn_down -> ffn_down_t (stored as down_type),
    predictors of hidden size pred_h (None: none), frequencies, and a GPU index marking
    the neuron ids in `hot` (sorted into the bucket; () = no bucket). kv/drop/add go to
    rewrite_gguf; replace: name -> array overriding what sparsify would add. Returns
    (dst, {layer: dequantized down_t [n_ff, n_embd]})."""
    from gguf_rewrite import rewrite_gguf

    n_layer, d, ff = _info(src)
    ts = _tensors(src)
    rng = np.random.default_rng(7)
    new, deq = {}, {}
    for il in range(n_layer):
        down = ts[F.tensor_name(F.T_FFN_DOWN, il)].astype(np.float32)  # [d, ff]
        new[F.sparse_tensor_name(F.T_FFN_DOWN_T, il)], deq[il] = encode(down_type, down.T)
        if pred_h is not None:
            new[F.sparse_tensor_name(F.T_FC1, il)] = encode(
                pred_type, rng.standard_normal((pred_h, d)).astype(np.float32) / 8)[0]
            new[F.sparse_tensor_name(F.T_FC2, il)] = encode(
                pred_type, rng.standard_normal((ff, pred_h)).astype(np.float32) / 4)[0]
        new[F.sparse_tensor_name(F.T_FFN_FREQ, il)] = rng.random(ff).astype(np.float32)
        idx = np.zeros(ff, dtype=np.int32)
        idx[list(hot)] = 1
        new[F.sparse_tensor_name(F.T_GPU_IDX, il)] = idx
        if hot:
            new[F.sparse_tensor_name(F.T_GPU_BUCKET, il)] = np.array(sorted(hot), dtype=np.int32)
    new.update(replace or {})
    new = {k: v for k, v in new.items() if v is not None}
    new.update(add or {})
    kvs = {F.KEY_SPARSE_THRESHOLD: (0.25, GGUFValueType.FLOAT32)}
    kvs.update(kv or {})
    drops = list(drop) + ([] if keep_down else [F.tensor_name(F.T_FFN_DOWN, il)
                                                for il in range(n_layer)])
    rewrite_gguf(src, dst, drop=drops, add=new, kv=kvs)
    return dst, deq


def logits_of(path, n_threads=2, tokens=PROMPT):
    with Model(path, n_ctx=64, n_threads=n_threads, ffn="dense") as m:
        return m.eval(tokens, logits_all=True), m.info


@pytest.fixture(scope="module")
def dense_logits(random_gguf):
    return logits_of(random_gguf)[0]


@pytest.mark.parametrize("tname", [n for n, t in TYPES.items() if BLOCK[t] <= 64])  # d = 64
def test_down_t_file_matches_dense(random_gguf, tmp_path, dense_logits, tname):
    t = TYPES[tname]
    sparse, deq = sparsify(random_gguf, tmp_path / "sparse.gguf", down_type=t)
    got, info = logits_of(sparse)
    assert info.has_down_t == info.n_layer == 2 and info.has_predictor == 2
    assert info.sparse_threshold == pytest.approx(0.25)
    # Q4_0's and Q4_1's down_t run through the int8 forms (a step's groups of 16 nonzero
    # rows, a batch's of 16 rows some token needs), which round the scaled rows
    int8 = has_form(t, "axpy16", lib.gh_simd_get())
    tol = 3e-3 * np.abs(got).max() if int8 else 1e-4
    if t == F32:
        np.testing.assert_allclose(got, dense_logits, rtol=0, atol=1e-4)
    else:
        # the same (dequantized) weights as a dense f32 ffn_down give the same logits
        from gguf_rewrite import rewrite_gguf
        n_layer = info.n_layer
        ref_path = rewrite_gguf(random_gguf, tmp_path / "ref.gguf", tensors={
            F.tensor_name(F.T_FFN_DOWN, il): (lambda a, il=il: np.ascontiguousarray(deq[il].T))
            for il in range(n_layer)})
        ref = logits_of(ref_path)[0]
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
        err = np.abs(got - dense_logits).max() / np.abs(dense_logits).max()
        assert err < {F16: 1e-2, BF16: 3e-2, Q8_0: 3e-2, Q4_0: 0.2, Q4_1: 0.2, Q5_0: 0.1, Q5_1: 0.1,
                       IQ4_NL: 0.2, MXFP4: 0.3}[t]
    # thread count does not change the result, and neither does the batch split
    np.testing.assert_array_equal(logits_of(sparse, n_threads=1)[0], got)
    # (dense FFN: the file's predictors are random; the sparse modes: test_sparse_ffn.py)
    with Model(sparse, n_ctx=64, n_threads=2, n_batch=5, ffn="dense") as m:
        np.testing.assert_allclose(m.eval(PROMPT, logits_all=True), got, rtol=0, atol=tol)
        m.context.reset()
        step = np.stack([m.eval([tok]) for tok in PROMPT])
        np.testing.assert_allclose(step, got, rtol=0, atol=tol)


def test_dense_file_info(random_gguf):
    info = logits_of(random_gguf)[1]
    assert info.has_down_t == 0 and info.has_predictor == 0 and info.sparse_threshold == 0.0


def test_sparse_without_index_or_bucket(random_gguf, tmp_path, dense_logits):
    """No predictor, no frequencies, an all-zero GPU index without a bucket: loads."""
    n_layer, _, _ = _info(random_gguf)
    p, _ = sparsify(random_gguf, tmp_path / "plain.gguf", pred_h=None, hot=(),
                    replace={F.sparse_tensor_name(F.T_FFN_FREQ, il): None for il in range(n_layer)})
    got, info = logits_of(p)
    assert info.has_predictor == 0 and info.has_down_t == 2
    np.testing.assert_allclose(got, dense_logits, rtol=0, atol=1e-4)
    # quantized predictors of another hidden size also load
    p, _ = sparsify(random_gguf, tmp_path / "q.gguf", pred_h=64, pred_type=Q8_0)
    assert logits_of(p)[1].has_predictor == 2


def test_mixed_layers(random_gguf, tmp_path, dense_logits):
    """One layer keeps ffn_down, the other uses ffn_down_t."""
    p, _ = sparsify(random_gguf, tmp_path / "mixed.gguf", keep_down=True,
                    drop=[F.tensor_name(F.T_FFN_DOWN, 1)],
                    replace={F.sparse_tensor_name(F.T_FFN_DOWN_T, 0): None})
    got, info = logits_of(p)
    assert info.has_down_t == 1
    np.testing.assert_allclose(got, dense_logits, rtol=0, atol=1e-4)


def _bad_cases(d, ff):
    i32 = lambda v: np.array(v, dtype=np.int32)  # noqa: E731
    f32 = lambda *s: np.zeros(s, dtype=np.float32)  # noqa: E731
    idx = np.zeros(ff, dtype=np.int32)
    idx[[5, 17]] = 1
    name = F.sparse_tensor_name
    return {
        "both downs": (dict(keep_down=True), r"layer 0 has both 'blk.0.ffn_down.weight' and "
                       r"'blk.0.ffn_down_t.weight'"),
        "no down": (dict(replace={name(F.T_FFN_DOWN_T, 1): None}),
                    r"missing tensor 'blk.1.ffn_down.weight' \(or its transposed form"),
        "down_t shape": (dict(replace={name(F.T_FFN_DOWN_T, 0): f32(d, ff)}),
                         r"'blk.0.ffn_down_t.weight' has shape \[%d, %d" % (ff, d)),
        "fc1 alone": (dict(replace={name(F.T_FC2, 1): None}),
                      r"predictor of layer 1: tensor 'blk.1.fc1.weight' without 'blk.1.fc2.weight'"),
        "fc1 cols": (dict(replace={name(F.T_FC1, 0): f32(16, d + 1)}),
                     r"predictor tensor 'blk.0.fc1.weight' has shape \[%d, 16" % (d + 1)),
        "fc2 h": (dict(replace={name(F.T_FC2, 0): f32(ff, 15)}),
                  r"'blk.0.fc2.weight' has shape \[15, %d.*h = 16" % ff),
        "fc2 rows": (dict(replace={name(F.T_FC2, 0): f32(ff - 1, 16)}),
                     r"'blk.0.fc2.weight'.*n_ff = %d" % ff),
        "fc1 i32": (dict(replace={name(F.T_FC1, 0): np.zeros((16, d), dtype=np.int32)}),
                    r"'blk.0.fc1.weight': type I32 cannot hold a weight matrix"),
        "freq length": (dict(replace={name(F.T_FFN_FREQ, 1): f32(ff - 1)}),
                        r"'blk.1.ffn_freq' has shape \[%d, 1, 1, 1\], expected a vector of %d"
                        % (ff - 1, ff)),
        "freq type": (dict(replace={name(F.T_FFN_FREQ, 0): np.zeros(ff, dtype=np.int32)}),
                      r"'blk.0.ffn_freq' must be f32"),
        "freq range": (dict(replace={name(F.T_FFN_FREQ, 0): np.full(ff, 1.5, np.float32)}),
                       r"'blk.0.ffn_freq': frequency of neuron 0 is 1.5"),
        "idx length": (dict(replace={name(F.T_GPU_IDX, 0): i32([0] * (ff + 1))}),
                       r"'blk.0.gpu_idx' has shape \[%d" % (ff + 1)),
        "idx type": (dict(replace={name(F.T_GPU_IDX, 0): idx.astype(np.float32)}),
                     r"'blk.0.gpu_idx' must be i32"),
        "idx value": (dict(replace={name(F.T_GPU_IDX, 1): np.where(idx, 2, 0).astype(np.int32)}),
                      r"'blk.1.gpu_idx': entry 5 is 2 \(must be 0 or 1\)"),
        "bucket missing": (dict(replace={name(F.T_GPU_BUCKET, 0): None}),
                           r"'blk.0.gpu_idx' marks 3 neurons for the GPU but tensor "
                           r"'blk.0.gpu_bucket' is missing"),
        "bucket without idx": (dict(replace={name(F.T_GPU_IDX, 0): None}),
                               r"'blk.0.gpu_bucket' without 'blk.0.gpu_idx'"),
        "bucket count": (dict(replace={name(F.T_GPU_BUCKET, 0): i32([0, 5])}),
                         r"'blk.0.gpu_bucket' holds 2 ids but 'blk.0.gpu_idx' marks 3"),
        "bucket unsorted": (dict(replace={name(F.T_GPU_BUCKET, 0): i32([5, 0, 17])}),
                            r"'blk.0.gpu_bucket' is not sorted and unique: entry 1 \(0\) follows 5"),
        "bucket duplicate": (dict(replace={name(F.T_GPU_BUCKET, 1): i32([0, 5, 5])}),
                             r"'blk.1.gpu_bucket' is not sorted and unique"),
        "bucket range": (dict(replace={name(F.T_GPU_BUCKET, 0): i32([0, 5, ff])}),
                         r"'blk.0.gpu_bucket': entry 2 is neuron %d, outside \[0, %d\)" % (ff, ff)),
        "bucket negative": (dict(replace={name(F.T_GPU_BUCKET, 0): i32([-1, 5, 17])}),
                            r"'blk.0.gpu_bucket': entry 0 is neuron -1"),
        "bucket vs idx": (dict(replace={name(F.T_GPU_BUCKET, 0): i32([0, 5, 18])}),
                          r"'blk.0.gpu_bucket' lists neuron 18, which 'blk.0.gpu_idx' does not mark"),
        "bucket 2-D": (dict(replace={name(F.T_GPU_BUCKET, 0): i32([[0, 5, 17]] * 2)}),
                       r"'blk.0.gpu_bucket' has shape \[3, 2, 1, 1\]"),
        "version": (dict(kv={F.KEY_FORMAT_VERSION: (F.FORMAT_VERSION + 1, GGUFValueType.UINT32)}),
                    r"powerinfer.format_version is %d but this runtime reads versions up to %d"
                    % (F.FORMAT_VERSION + 1, F.FORMAT_VERSION)),
        "threshold type": (dict(kv={F.KEY_SPARSE_THRESHOLD: ("high", GGUFValueType.STRING)}),
                           r"powerinfer.sparse.threshold"),
        "threshold nan": (dict(kv={F.KEY_SPARSE_THRESHOLD: (float("nan"), GGUFValueType.FLOAT32)}),
                          r"powerinfer.sparse.threshold is nan"),
        "i32 as norm": (dict(tensors_i32="blk.0.ffn_norm.weight"), r"blk.0.ffn_norm.weight"),
    }


BAD = list(_bad_cases(64, 128))


@pytest.mark.parametrize("case", BAD)
def test_inconsistent_sparse_metadata(random_gguf, tmp_path, case):
    n_layer, d, ff = _info(random_gguf)
    kw, msg = _bad_cases(d, ff)[case]
    path = tmp_path / "bad.gguf"
    if "tensors_i32" in kw:
        from gguf_rewrite import rewrite_gguf
        rewrite_gguf(random_gguf, path, tensors={
            kw["tensors_i32"]: lambda a: (np.zeros(a.shape, dtype=np.int32), QT.I32)})
    else:
        sparsify(random_gguf, path, **kw)
    with pytest.raises(NativeError, match=msg) as e:
        Model(path)
    assert str(path) in str(e.value)


# ---- profiling -----------------------------------------------------------------------


TEXT_IDS = list(np.random.default_rng(3).integers(3, 384, size=150))


def _reference_mask(x, gate, up, act):
    g = x.astype(np.float64) @ gate.T.astype(np.float64)
    u = x.astype(np.float64) @ up.T.astype(np.float64)
    tol = 1e-4 * np.sqrt((x.astype(np.float64) ** 2).sum(1, keepdims=True) *
                         (gate.astype(np.float64) ** 2).sum(1)[None, :])
    if act == "drelu":
        ref = (g > 0) & (u > 0)
        sure = (np.abs(g) > tol) & (np.abs(u) > tol)
    else:
        ref = g > 0
        sure = np.abs(g) > tol
    return ref, sure


def test_profile_masks_match_numpy(random_gguf):
    prof = profile_model(random_gguf, TEXT_IDS, n_ctx=64, n_threads=2, progress=False)
    n_layer, d, ff = _info(random_gguf)
    assert prof.x.shape == (n_layer, 150, d) and prof.mask.shape == (n_layer, 150, ff)
    assert prof.x.dtype == np.float32 and prof.mask.dtype == np.bool_
    assert prof.tokens.tolist() == TEXT_IDS and prof.n_ctx == 64
    ts = _tensors(random_gguf)
    for il in range(n_layer):
        ref, sure = _reference_mask(prof.x[il], ts[f"blk.{il}.ffn_gate.weight"],
                                    ts[f"blk.{il}.ffn_up.weight"], "relu")
        assert sure.mean() > 0.99
        np.testing.assert_array_equal(prof.mask[il][sure], ref[sure])
        np.testing.assert_allclose(prof.freq[il], prof.mask[il].mean(0))
        # x is RMS-normed (times the norm weights): rms(x / w) == 1
        w = ts[f"blk.{il}.ffn_norm.weight"]
        np.testing.assert_allclose(np.sqrt(((prof.x[il] / w) ** 2).mean(1)), 1, rtol=0.05)
    assert 0.2 < prof.density.mean() < 0.8  # random ReLU model: about half active
    assert "tokens" in prof.summary()


def test_profile_first_window_matches_eval(random_gguf):
    """The windows are independent: token t of window 2 sees only window 2."""
    a = profile_model(random_gguf, TEXT_IDS, n_ctx=64, n_threads=1, progress=False)
    b = profile_model(random_gguf, TEXT_IDS[64:128], n_ctx=64, n_threads=1, progress=False)
    np.testing.assert_array_equal(a.x[:, 64:128], b.x)
    np.testing.assert_array_equal(a.mask[:, 64:128], b.mask)


def test_profile_deterministic(random_gguf):
    a = profile_model(random_gguf, TEXT_IDS, n_ctx=64, n_threads=2, progress=False)
    b = profile_model(random_gguf, TEXT_IDS, n_ctx=64, n_threads=2, progress=False)
    c = profile_model(random_gguf, TEXT_IDS, n_ctx=64, n_threads=1, n_batch=7, progress=False)
    for o in (b, c):
        np.testing.assert_array_equal(a.x, o.x)
        np.testing.assert_array_equal(a.mask, o.mask)
        np.testing.assert_array_equal(a.freq, o.freq)
    d = profile_model(random_gguf, TEXT_IDS, n_ctx=64, max_tokens=40, progress=False)
    np.testing.assert_array_equal(d.x, a.x[:, :40])
    assert d.n_tokens == 40


def test_profile_of_sparse_file(random_gguf, tmp_path):
    sparse, _ = sparsify(random_gguf, tmp_path / "sparse.gguf")
    a = profile_model(random_gguf, TEXT_IDS[:60], n_ctx=64, progress=False)
    b = profile_model(sparse, TEXT_IDS[:60], n_ctx=64, progress=False)
    np.testing.assert_allclose(a.x, b.x, rtol=0, atol=1e-4)
    assert (a.mask != b.mask).mean() < 1e-3


@pytest.mark.parametrize("act", ["drelu", "silu"])
def test_profile_other_activations(tmp_path, act):
    from hf_models import make_llama_model

    from powerinfer_cpp.convert import convert

    hf = make_llama_model(tmp_path / "hf", act=act, seed=4)
    path = convert(hf, tmp_path / "m.gguf", outtype="f32", progress=False)
    prof = profile_model(path, TEXT_IDS[:50], n_ctx=64, progress=False)
    ts = _tensors(path)
    for il in range(prof.n_layer):
        if act == "silu":  # SwiGLU never outputs an exact zero: every neuron is "active"
            assert prof.mask[il].mean() > 0.999
            continue
        ref, sure = _reference_mask(prof.x[il], ts[f"blk.{il}.ffn_gate.weight"],
                                    ts[f"blk.{il}.ffn_up.weight"], act)
        np.testing.assert_array_equal(prof.mask[il][sure], ref[sure])
        assert 0.1 < prof.mask[il].mean() < 0.4  # both gate and up positive: about 1/4


def test_profile_text_and_errors(random_gguf):
    with Model(random_gguf) as m:
        text = "Once upon a time there was a little model that wanted to be sparse."
        prof = profile_model(m, text, n_ctx=16, progress=False)
        assert prof.tokens.tolist() == m.tokenize(text)
        assert m._ptr is not None  # a Model passed in stays open
        with pytest.raises(ValueError, match="outside the vocabulary"):
            profile_model(m, [1, 10_000], progress=False)
        with pytest.raises(ValueError, match="no tokens"):
            profile_model(m, [], progress=False)
        # the C API checks its strides
        ctx = m.create_context(n_ctx=16)
        x = np.zeros(m.info.n_embd * 4, dtype=np.float32)
        toks = np.array([1, 2, 3], dtype=np.int32)
        bufs = ffi.new("gh_profile_bufs *", {"ffn_in": ffi.cast("float *", x.ctypes.data),
                                             "ffn_in_stride": m.info.n_embd * 2})
        st = lib.gh_eval_profile(ctx._handle(), ffi.from_buffer("int32_t[]", toks), 3, bufs)
        assert st == lib.GH_ERR_INVALID_ARG
        assert "strides" in ffi.string(lib.gh_last_error()).decode()
        assert ctx.n_past == 0


def test_process_exits_cleanly_after_threaded_matmul_t():
    """gh_op_matmul_t keeps a thread pool too: it is joined when the library unloads."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from powerinfer_cpp._native import ffi, lib, check\n"
        "w = np.ones((64, 256), np.float32); h = np.ones((1, 64), np.float32)\n"
        "y = np.empty((1, 256), np.float32)\n"
        "for _ in range(20):\n"
        "    check(lib.gh_op_matmul_t(lib.GH_TYPE_F32, ffi.cast('void *', w.ctypes.data), 64, 256,\n"
        "          ffi.cast('float *', h.ctypes.data), 1, ffi.cast('float *', y.ctypes.data), 2))\n"
        "assert (y == 64).all()\n"
    )
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True,
                           text=True)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
