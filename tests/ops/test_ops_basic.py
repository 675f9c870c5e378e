"""Dense CPU ops (RMSNorm, LayerNorm, RoPE, GLU activations, attention) against numpy references.

References are computed in float64; errors are bounded by the normalized MSE
(sum((out - ref)^2) / sum(ref^2)) and, where it is meaningful, elementwise. Every op runs
at every SIMD level this CPU has (the scalar path is the reference implementation)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from powerinfer_cpp._native import NativeError, check, ffi, lib
from cbuf import fptr, iptr  # noqa: E402
from conftest import simd_levels  # noqa: E402  (the simd fixture is conftest's)
from opref import attn_inputs, ref_attention  # noqa: E402


# ---------------------------------------------------------------------------- helpers

def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    out = out.astype(np.float64)
    ref = ref.astype(np.float64)
    den = float(np.sum(ref * ref))
    return float(np.sum((out - ref) ** 2)) / max(den, 1e-300)


# ---------------------------------------------------------------------------- rmsnorm

def ref_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w.astype(np.float64)


def run_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, y: np.ndarray | None = None):
    n_rows, n = x.shape
    if y is None:
        y = np.empty_like(x)
    check(lib.gh_op_rmsnorm(fptr(x), fptr(w), n, n_rows, eps, fptr(y)))
    return y


@pytest.mark.parametrize("n", [1, 7, 33, 4097])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_rmsnorm(n, scale):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, n)) * scale).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    for eps in (1e-6, 1e-5):
        y = run_rmsnorm(x, w, eps)
        ref = ref_rmsnorm(x, w, eps)
        assert nmse(y, ref) < 1e-13
        np.testing.assert_allclose(y, ref, rtol=5e-7, atol=0)


def test_rmsnorm_in_place_and_zero_row():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    x[1] = 0.0
    w = rng.standard_normal(64).astype(np.float32)
    ref = ref_rmsnorm(x, w, 1e-5)
    run_rmsnorm(x, w, 1e-5, y=x)  # y aliases x
    np.testing.assert_allclose(x, ref, rtol=5e-7, atol=0)
    assert np.all(x[1] == 0.0)


# ---------------------------------------------------------------------------- layernorm

def ref_layernorm(x, w, b, eps):
    x = x.astype(np.float64)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w.astype(np.float64)
    return y if b is None else y + b.astype(np.float64)


@pytest.mark.parametrize("n", [1, 7, 33, 4097])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm(n, bias):
    rng = np.random.default_rng(n + bias)
    x = (rng.standard_normal((3, n)) * 5 + 3).astype(np.float32)  # a mean to take away
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    for eps in (1e-5, 1e-3):
        y = np.empty_like(x)
        check(lib.gh_op_layernorm(fptr(x), fptr(w), fptr(b) if bias else ffi.NULL, n, 3, eps,
                                  fptr(y)))
        ref = ref_layernorm(x, w, b, eps)
        np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


# ---------------------------------------------------------------------------- rope

def run_rope(x: np.ndarray, pos: np.ndarray, theta: float, neox: int) -> np.ndarray:
    n_tokens, n_head, head_dim = x.shape
    y = x.copy()
    check(lib.gh_op_rope(fptr(y), n_tokens, n_head, head_dim, iptr(pos), theta, 1.0, ffi.NULL, neox))
    return y


def rope_pairs(head_dim: int, neox: int):
    half = head_dim // 2
    i = np.arange(half)
    return (i, i + half) if neox else (2 * i, 2 * i + 1)


def ref_rope(x, pos, theta, neox, hf_angles: bool):
    """Float64 rotation. hf_angles: angles rounded as HF computes them in float32
    (inv_freq = 1 / base^(2i/d) and pos * inv_freq in float32); else exact angles."""
    head_dim = x.shape[-1]
    if hf_angles:
        inv = inv_freq_f32(theta, head_dim)
        ang = (pos.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)
    else:
        inv = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        ang = pos.astype(np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = rope_pairs(head_dim, neox)
    xd = x.astype(np.float64)
    y = xd.copy()
    y[..., a] = xd[..., a] * c - xd[..., b] * s
    y[..., b] = xd[..., b] * c + xd[..., a] * s
    return y


def inv_freq_f32(theta, head_dim):
    """HF's float32 inv_freq = 1 / base^(arange(0, d, 2) / d), with the power correctly
    rounded to float32 (numpy's own float32 power is often 1 ulp off)."""
    exps = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    return np.float32(1.0) / (np.float64(theta) ** exps.astype(np.float64)).astype(np.float32)


def hf_rope_f32(x, pos, theta):
    """transformers' Llama rotary embedding (rotate_half) in numpy float32."""
    head_dim = x.shape[-1]
    inv_freq = inv_freq_f32(theta, head_dim)
    freqs = pos.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    half = head_dim // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rot * sin).astype(np.float32)


POSITIONS = np.array([0, 1, 1000, 4095], dtype=np.int32)


@pytest.mark.parametrize("neox", [0, 1])
@pytest.mark.parametrize("head_dim", [2, 8, 64, 128, 1026])  # 1026: past the loader's limit
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope(neox, head_dim, theta):
    rng = np.random.default_rng(head_dim + neox)
    n_head = 3
    x = rng.standard_normal((len(POSITIONS), n_head, head_dim)).astype(np.float32)
    y = run_rope(x, POSITIONS, theta, neox)
    # Against HF's float32 angles, rotated in double: only cos/sin/rotation rounding left.
    ref = ref_rope(x, POSITIONS, theta, neox, hf_angles=True)
    assert nmse(y, ref) < 1e-13
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(x).max())
    # Against exact angles: the float32 angle at position 4095 is off by up to ~2.4e-4
    # rad (HF has the same error); a looser bound.
    exact = ref_rope(x, POSITIONS, theta, neox, hf_angles=False)
    assert nmse(y, exact) < 1e-7
    # Position 0 is the identity.
    assert np.array_equal(y[0], x[0])


def test_rope_repeated_and_changing_positions():
    """Repeated positions, and a new base or head size at the same position, in one
    call and from call to call: each token gets its own position's angles."""
    rng = np.random.default_rng(7)
    pos = np.array([5, 5, 9, 5, 5], dtype=np.int32)
    for head_dim, theta in [(64, 10000.0), (64, 500000.0), (32, 500000.0), (64, 10000.0)]:
        x = rng.standard_normal((len(pos), 2, head_dim)).astype(np.float32)
        y = run_rope(x, pos, theta, 0)
        np.testing.assert_allclose(y, ref_rope(x, pos, theta, 0, hf_angles=True), rtol=0,
                                   atol=2e-6 * np.abs(x).max())


@pytest.mark.parametrize("head_dim", [2, 8, 64, 128])
def test_rope_neox_matches_hf_rotate_half(head_dim):
    rng = np.random.default_rng(7)
    pos = np.array([0, 1, 17, 1000, 4095, 8191], dtype=np.int32)
    x = rng.standard_normal((len(pos), 4, head_dim)).astype(np.float32)
    y = run_rope(x, pos, 10000.0, 1)
    hf = hf_rope_f32(x, pos, 10000.0)
    np.testing.assert_allclose(y, hf, rtol=0, atol=2e-6 * np.abs(x).max())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_neox_matches_torch(head_dim, theta):
    """The rotary code of transformers' Llama, run with torch (float32 on the CPU)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    pos = np.array([0, 1, 17, 1000, 4095, 8191], dtype=np.int32)
    x = rng.standard_normal((len(pos), 4, head_dim)).astype(np.float32)
    y = run_rope(x, pos, theta, 1)

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    position_ids = torch.from_numpy(pos.astype(np.int64))[None, :]
    freqs = (inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[0][:, None, :], emb.sin()[0][:, None, :]
    xt = torch.from_numpy(x)
    rot = torch.cat((-xt[..., head_dim // 2:], xt[..., : head_dim // 2]), dim=-1)
    hf = (xt * cos + rot * sin).numpy()
    # torch's pow is occasionally 1 ulp off the correctly rounded value we compute, which
    # moves an angle at position 8191 by up to ~1e-5 rad.
    np.testing.assert_allclose(y, hf, rtol=0, atol=2e-5 * np.abs(x).max())
    assert nmse(y, hf) < 1e-12


@pytest.mark.parametrize("head_dim", [2, 8, 64, 128])
def test_rope_layouts_are_a_permutation(head_dim):
    """neox=0 on (x[i], x[i+half]) interleaved as adjacent pairs == neox=1 on x: the
    converter's q/k row permutation makes the two layouts the same model."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((len(POSITIONS), 2, head_dim)).astype(np.float32)
    half = head_dim // 2
    perm = np.empty(head_dim, dtype=np.int64)
    perm[0::2] = np.arange(half)
    perm[1::2] = np.arange(half) + half
    y_neox = run_rope(x, POSITIONS, 10000.0, 1)
    y_norm = run_rope(np.ascontiguousarray(x[..., perm]), POSITIONS, 10000.0, 0)
    assert np.array_equal(y_norm, y_neox[..., perm])


# ---------------------------------------------------------------------------- glu

def ref_glu(act, g, u):
    g = g.astype(np.float64)
    u = u.astype(np.float64)
    with np.errstate(over="ignore"):
        if act == lib.GH_ACT_SILU:
            return g / (1.0 + np.exp(-g)) * u
        if act == lib.GH_ACT_GELU:
            # 0.5 * (1 + tanh(z)) written as sigmoid(2z): no cancellation for z << 0.
            z = math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)
            return g / (1.0 + np.exp(-2.0 * z)) * u
    if act == lib.GH_ACT_RELU:
        return np.maximum(g, 0.0) * u
    if act == lib.GH_ACT_DRELU:
        return np.maximum(g, 0.0) * np.maximum(u, 0.0)
    if act == lib.GH_ACT_GELU_ERF:
        return 0.5 * g * np.vectorize(math.erfc)(-g / math.sqrt(2.0)) * u
    raise ValueError(act)


def glu_inputs(n, seed):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 3).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-3, -1e-3, 20.0, -20.0, 87.5, -87.5, 100.0, -100.0, 1e4, -1e4],
                       dtype=np.float32)
    k = min(n, len(special))
    g[:k] = special[:k]
    return g, u


def run_glu(act, g, u, out=None):
    if out is None:
        out = np.empty_like(g)
    check(lib.gh_op_glu(act, 0.0, fptr(g), fptr(u), fptr(out), len(g)))
    return out


ACTS = {"silu": lib.GH_ACT_SILU, "relu": lib.GH_ACT_RELU, "drelu": lib.GH_ACT_DRELU, "gelu": lib.GH_ACT_GELU,
        "gelu_erf": lib.GH_ACT_GELU_ERF}


@pytest.mark.parametrize("act", list(ACTS), ids=list(ACTS))
@pytest.mark.parametrize("n", [1, 7, 33, 4097])
def test_glu(simd, act, n):
    a = ACTS[act]
    g, u = glu_inputs(n, n)
    out = run_glu(a, g, u)
    ref = ref_glu(a, g, u)
    assert np.all(np.isfinite(out))
    if a in (lib.GH_ACT_RELU, lib.GH_ACT_DRELU):
        # Exact: one float multiply.
        exp32 = ref_glu(a, g, u).astype(np.float32)
        assert np.array_equal(out, exp32)
    else:
        assert nmse(out, ref) < 1e-12
        err = np.abs(out - ref)
        if a == lib.GH_ACT_SILU:
            # exp(-g) overflows float for g < -88.7: the result is then 0, not the
            # subnormal it should be (torch does the same).
            bound = 1e-6 * np.abs(ref) + 1e-37 * np.abs(u)
        elif a == lib.GH_ACT_GELU:
            # GELU's argument g*(a + b*g^2) is rounded to float first (as in HF): an
            # absolute error of ~1e-7 in it moves gelu by ~1e-7 * |g| relative to |g*u|.
            bound = 1e-6 * np.abs(ref) + 1e-7 * np.abs(g.astype(np.float64) * u)
        else:
            # the SIMD erf (A&S 7.1.26) is within 1.5e-7 of erf: gelu within 0.75e-7 |g u|
            bound = 1e-6 * np.abs(ref) + 1e-7 * np.abs(g.astype(np.float64) * u)
        assert np.all(err <= bound), (err / np.maximum(bound, 1e-300)).max()


@pytest.mark.parametrize("limit", [0.5, 7.0])
def test_glu_swiglu_oai(limit):
    """gpt-oss's clamped SwiGLU against numpy: g = min(gate, limit), u = clamp(up, -limit,
    limit), (u + 1) * g * sigmoid(1.702 g), as transformers' GptOssExperts; gate and up
    range past the limit on both sides. It has no ungated form."""
    g, u = glu_inputs(4097, 3)
    u = u * 10  # up beyond +-limit too
    out = np.empty_like(g)
    check(lib.gh_op_glu(lib.GH_ACT_SWIGLU_OAI, limit, fptr(g), fptr(u), fptr(out), len(g)))
    gg = np.minimum(g.astype(np.float64), limit)
    uu = np.clip(u.astype(np.float64), -limit, limit)
    with np.errstate(over="ignore"):
        glu = gg / (1.0 + np.exp(-float(np.float32(1.702)) * gg))  # the gain as the float it is
    ref = (uu + 1.0) * glu
    assert np.all(np.isfinite(out))
    # u + 1 is rounded to float (as in torch): near u = -1 an absolute 6e-8 of (|u| + 1) |glu|
    bound = 1e-6 * np.abs(ref) + 2e-7 * (np.abs(uu) + 1.0) * np.abs(glu) + 1e-37
    assert np.all(np.abs(out - ref) <= bound), (np.abs(out - ref) / bound).max()
    assert (g > limit).any() and (np.abs(u) > limit).any()
    expect_invalid(lib.gh_op_glu(lib.GH_ACT_SWIGLU_OAI, limit, fptr(g), ffi.NULL, fptr(out), len(g)),
                   "the clamped SwiGLU needs up")


@pytest.mark.parametrize("act", list(ACTS), ids=list(ACTS))
def test_glu_in_place(act):
    a = ACTS[act]
    g, u = glu_inputs(1000, 5)
    expected = run_glu(a, g, u)
    g2 = g.copy()
    run_glu(a, g2, u, out=g2)  # out aliases gate
    assert np.array_equal(g2, expected)


def test_glu_simd_levels_agree():
    g, u = glu_inputs(4097, 11)
    outs = {}
    for level in simd_levels():
        prev = lib.gh_simd_set(level)
        try:
            outs[level] = [run_glu(a, g, u) for a in ACTS.values()]
        finally:
            lib.gh_simd_set(prev)
    for level, res in outs.items():
        for o, o0 in zip(res, outs[0]):
            np.testing.assert_allclose(o, o0, rtol=2e-6, atol=1e-7 * np.abs(g * u).max())


# ---------------------------------------------------------------------------- attention

def run_attention(q, k, v, n_past, n_threads):
    n_tokens, n_head, d = q.shape
    n_head_kv = k.shape[1]
    assert k.shape[0] == n_past + n_tokens
    out = np.full(q.shape, np.nan, dtype=np.float32)
    check(lib.gh_op_attention(fptr(q), fptr(k), fptr(v), fptr(out), n_tokens, n_past,
                              n_head, n_head_kv, d, n_threads))
    return out


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_attention_long_context_large_scores(simd, n_threads):
    """Long cache and large logits (|score| up to ~100): the softmax must stay stable."""
    q, k, v = attn_inputs(3, 600, 8, 2, 64, seed=1, q_scale=12.0)
    ref = ref_attention(q, k, v, 600)
    out = run_attention(q, k, v, 600, n_threads)
    assert np.all(np.isfinite(out))
    assert nmse(out, ref) < 1e-10


@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64, 128: the per-query block kernels
def test_attention_is_causal(simd, head_dim):
    """Query t must not read keys/values after position n_past + t."""
    n_past, n_tokens = 4, 3
    q, k, v = attn_inputs(n_tokens, n_past, 4, 2, head_dim, seed=2)
    k[n_past + 1:] = np.nan
    v[n_past + 1:] = np.nan
    out = run_attention(q, k, v, n_past, 2)
    ref = ref_attention(q[:1], k[:n_past + 1], v[:n_past + 1], n_past)
    np.testing.assert_allclose(out[0], ref[0], rtol=0, atol=1e-5)
    assert np.all(np.isnan(out[1:]))


def test_attention_single_key_returns_value():
    q, k, v = attn_inputs(1, 0, 4, 1, 8, seed=4)
    out = run_attention(q, k, v, 0, 1)
    np.testing.assert_allclose(out[0], np.broadcast_to(v[0, 0], (4, 8)), rtol=1e-6, atol=0)


def test_attention_simd_levels_agree():
    q, k, v = attn_inputs(7, 50, 8, 2, 128, seed=9)
    outs = []
    for level in simd_levels():
        prev = lib.gh_simd_set(level)
        try:
            outs.append(run_attention(q, k, v, 50, 2))
        finally:
            lib.gh_simd_set(prev)
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=0, atol=2e-6)


# KV cache types (gh_op_attention_kv): the cache rows in F16 / Q8_0, made by numpy and by
# gguf's reference quantizer (the ggml layouts), read through f32 tiles.
KV_TYPES = {"f16": lib.GH_TYPE_F16, "q8_0": lib.GH_TYPE_Q8_0}


def kv_store(kind, a):
    """(bytes of `a`'s rows in the cache type, their dequantized f32 values)."""
    import gguf

    if kind == "f16":
        h = a.astype(np.float16)
        return h, h.astype(np.float32)
    qt = gguf.GGMLQuantizationType.Q8_0
    rows = a.reshape(a.shape[0], -1)
    with np.errstate(invalid="ignore"):  # the NaN rows of the causality test
        q = gguf.quants.quantize(rows, qt)
    return q, gguf.quants.dequantize(q, qt).reshape(a.shape).astype(np.float32)


def run_attention_kv(kind, q, kq, vq, n_head_kv, n_past, n_threads):
    n_tokens, n_head, d = q.shape
    out = np.full(q.shape, np.nan, dtype=np.float32)
    check(lib.gh_op_attention_kv(KV_TYPES[kind], fptr(q), ffi.from_buffer(kq),
                                 ffi.from_buffer(vq), fptr(out), n_tokens, n_past, n_head,
                                 n_head_kv, d, n_threads))
    return out


@pytest.mark.parametrize("kind", list(KV_TYPES))
def test_attention_kv_cache_is_causal(simd, kind):
    n_past, n_tokens = 70, 3   # the hidden rows lie in the second block of 64 keys
    q, k, v = attn_inputs(n_tokens, n_past, 4, 2, 64, seed=5)
    k[n_past + 1:] = np.nan
    v[n_past + 1:] = np.nan
    kq, kd = kv_store(kind, k)
    vq, vd = kv_store(kind, v)
    out = run_attention_kv(kind, q, kq, vq, 2, n_past, 2)
    ref = ref_attention(q[:1], kd[:n_past + 1], vd[:n_past + 1], n_past)
    np.testing.assert_allclose(out[0], ref[0], rtol=0, atol=1e-5)
    assert np.all(np.isnan(out[1:]))


def test_attention_kv_refuses_other_types():
    q, k, v = attn_inputs(1, 0, 4, 2, 16, seed=1)
    with pytest.raises(NativeError, match="KV cache type q4_0 is not supported"):
        check(lib.gh_op_attention_kv(lib.GH_TYPE_Q4_0, fptr(q), fptr(k), fptr(v), fptr(q.copy()), 1, 0, 4, 2,
                                     16, 1))
    with pytest.raises(NativeError, match="multiple of 32"):
        check(lib.gh_op_attention_kv(lib.GH_TYPE_Q8_0, fptr(q), fptr(k), fptr(v), fptr(q.copy()), 1, 0, 4, 2,
                                     16, 1))


# Gemma's attention (gh_op_attention_ext): the scores' own scale, soft-capping c tanh(s / c)
# of the scaled scores, and a sliding window (query at position p sees keys p - W + 1 .. p);
# gpt-oss's sinks: a logit per head in the softmax whose share is dropped.

def ref_attention_ext(q, k, v, n_past, scale, softcap, window, sinks=None):
    n_tokens, n_head, d = q.shape
    group = n_head // k.shape[1]
    qd, kd, vd = (a.astype(np.float64) for a in (q, k, v))
    out = np.zeros(q.shape, dtype=np.float64)
    for t in range(n_tokens):
        p = n_past + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(n_head):
            s = kd[lo:p + 1, h // group, :] @ qd[t, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            mx = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - mx)
            den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - mx))
            out[t, h] = e @ vd[lo:p + 1, h // group, :] / den
    return out


def run_attention_ext(kind, q, kq, vq, n_head_kv, n_past, n_threads, scale, softcap, window,
                      sinks=None):
    n_tokens, n_head, d = q.shape
    out = np.full(q.shape, np.nan, dtype=np.float32)
    check(lib.gh_op_attention_ext(KV_TYPES.get(kind, 0), fptr(q), ffi.from_buffer(kq),
                                  ffi.from_buffer(vq), fptr(out), n_tokens, n_past, n_head,
                                  n_head_kv, d, n_threads, scale, softcap, window,
                                  ffi.NULL if sinks is None else fptr(sinks)))
    return out


@pytest.mark.parametrize("kind", ["f32"] + list(KV_TYPES))
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64, 128: the per-query block kernels
@pytest.mark.parametrize("n_tokens,n_past,window", [(1, 0, 4), (1, 150, 4), (1, 150, 70), (13, 60, 5),
                                                    (20, 130, 64), (9, 3, 0), (40, 0, 12)])
def test_attention_ext_window_scale_softcap(simd, kind, head_dim, n_tokens, n_past, window):
    """Windows inside one block of 64 keys, across block boundaries and wider than the
    context; with q's scale and a cap that bends the scores; 1 and 3 threads agree bit
    for bit."""
    if kind == "q8_0" and head_dim % 32:
        pytest.skip("a Q8_0 cache holds heads of whole blocks of 32")
    q, k, v = attn_inputs(n_tokens, n_past, 8, 2, head_dim, seed=head_dim + n_tokens + n_past + window,
                          q_scale=3.0)
    if kind == "f32":
        kq, kd, vq, vd = k, k, v, v
    else:
        (kq, kd), (vq, vd) = kv_store(kind, k), kv_store(kind, v)
    scale, softcap = 0.7 / math.sqrt(head_dim), 2.5
    out1 = run_attention_ext(kind, q, kq, vq, 2, n_past, 1, scale, softcap, window)
    out3 = run_attention_ext(kind, q, kq, vq, 2, n_past, 3, scale, softcap, window)
    ref = ref_attention_ext(q, kd, vd, n_past, scale, softcap, window)
    np.testing.assert_allclose(out1, ref, rtol=0, atol=2e-5)
    assert np.array_equal(out1, out3)


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("n_tokens,n_past,window", [(1, 0, 0), (1, 150, 4), (13, 60, 5), (20, 130, 0)])
def test_attention_ext_sinks(simd, kind, n_tokens, n_past, window):
    """gpt-oss's attention sinks, per head: some far below the scores (no effect), some among
    them, some far above (they take almost all the weight: the running max must move to the
    sink before the sum is taken), with and without a window; 1 and 3 threads agree."""
    head_dim = 64
    q, k, v = attn_inputs(n_tokens, n_past, 8, 2, head_dim, seed=n_tokens + n_past, q_scale=3.0)
    kq, kd, vq, vd = (k, k, v, v) if kind == "f32" else (*kv_store(kind, k), *kv_store(kind, v))
    sinks = np.array([-30.0, -1.0, 0.0, 0.5, 2.0, 5.0, 40.0, 90.0], dtype=np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    out1 = run_attention_ext(kind, q, kq, vq, 2, n_past, 1, scale, 0.0, window, sinks)
    out3 = run_attention_ext(kind, q, kq, vq, 2, n_past, 3, scale, 0.0, window, sinks)
    ref = ref_attention_ext(q, kd, vd, n_past, scale, 0.0, window, sinks)
    np.testing.assert_allclose(out1, ref, rtol=0, atol=2e-5)
    assert np.array_equal(out1, out3)
    plain = ref_attention_ext(q, kd, vd, n_past, scale, 0.0, window)
    assert np.abs(ref - plain).max() > 0.1  # the sinks matter
    bad = sinks.copy()
    bad[3] = np.inf
    with pytest.raises(NativeError, match="sink 3"):
        run_attention_ext(kind, q, kq, vq, 2, n_past, 1, scale, 0.0, window, bad)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_attention_ext_window_reads_nothing_outside(simd, head_dim):
    """Keys before the window (here NaN, in the blocks of 64 before it and in its own) are
    never read."""
    n_past, n_tokens, window = 140, 4, 6
    q, k, v = attn_inputs(n_tokens, n_past, 4, 2, head_dim, seed=11)
    first = n_past - window + 1  # the first token's window starts here
    k[:first] = np.nan
    v[:first] = np.nan
    out = run_attention_ext("f32", q, k, v, 2, n_past, 2, 0.25, 0.0, window)
    assert np.all(np.isfinite(out))
    ref = ref_attention_ext(q, k, v, n_past, 0.25, 0.0, window)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)


def test_attention_ext_invalid_args():
    q, k, v = attn_inputs(1, 0, 4, 2, 16, seed=1)
    for scale, cap, window, word in ((0.0, 0.0, 0, "scale"), (float("nan"), 0.0, 0, "scale"),
                                     (1.0, -1.0, 0, "softcap"), (1.0, float("inf"), 0, "softcap"),
                                     (1.0, 0.0, -3, "window")):
        with pytest.raises(NativeError, match=word):
            check(lib.gh_op_attention_ext(lib.GH_TYPE_F32, fptr(q), fptr(k), fptr(v), fptr(q.copy()), 1, 0, 4, 2,
                                          16, 1, scale, cap, window, ffi.NULL))


# ---------------------------------------------------------------------------- bad arguments

def expect_invalid(status, *words):
    with pytest.raises(NativeError) as ei:
        check(status)
    assert ei.value.status == lib.GH_ERR_INVALID_ARG
    msg = str(ei.value)
    for w in words:
        assert w in msg, msg


def test_rmsnorm_invalid_args():
    x = np.ones((2, 8), np.float32)
    w = np.ones(8, np.float32)
    y = np.empty_like(x)
    expect_invalid(lib.gh_op_rmsnorm(ffi.NULL, fptr(w), 8, 2, 1e-5, fptr(y)), "rmsnorm", "NULL")
    expect_invalid(lib.gh_op_rmsnorm(fptr(x), ffi.NULL, 8, 2, 1e-5, fptr(y)), "NULL")
    expect_invalid(lib.gh_op_rmsnorm(fptr(x), fptr(w), 8, 2, 1e-5, ffi.NULL), "NULL")
    expect_invalid(lib.gh_op_rmsnorm(fptr(x), fptr(w), 0, 2, 1e-5, fptr(y)), "positive")
    expect_invalid(lib.gh_op_rmsnorm(fptr(x), fptr(w), 8, -1, 1e-5, fptr(y)), "positive")
    expect_invalid(lib.gh_op_rmsnorm(fptr(x), fptr(w), 8, 2, -1.0, fptr(y)), "eps")
    expect_invalid(lib.gh_op_rmsnorm(fptr(x), fptr(w), 8, 2, float("nan"), fptr(y)), "eps")
    expect_invalid(lib.gh_op_rmsnorm(fptr(x), fptr(w), 2**62, 2**62, 1e-5, fptr(y)), "overflow")


def test_rope_invalid_args():
    x = np.ones((2, 2, 8), np.float32)
    pos = np.array([0, 1], np.int32)
    expect_invalid(lib.gh_op_rope(ffi.NULL, 2, 2, 8, iptr(pos), 1e4, 1.0, ffi.NULL, 0), "rope", "NULL")
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 8, ffi.NULL, 1e4, 1.0, ffi.NULL, 0), "NULL")
    expect_invalid(lib.gh_op_rope(fptr(x), 0, 2, 8, iptr(pos), 1e4, 1.0, ffi.NULL, 0), "positive")
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 0, 8, iptr(pos), 1e4, 1.0, ffi.NULL, 0), "positive")
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 0, iptr(pos), 1e4, 1.0, ffi.NULL, 0), "positive")
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 7, iptr(pos), 1e4, 1.0, ffi.NULL, 0), "head_dim (7)", "even")
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 8, iptr(pos), 0.0, 1.0, ffi.NULL, 0), "theta")
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 8, iptr(pos), 1e4, 1.0, ffi.NULL, 2), "neox")
    bad = np.array([0, -5], np.int32)
    before = x.copy()
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 8, iptr(bad), 1e4, 1.0, ffi.NULL, 0), "pos[1]", "negative")
    assert np.array_equal(x, before)  # rejected before touching x


def test_glu_invalid_args():
    g = np.ones(4, np.float32)
    expect_invalid(lib.gh_op_glu(99, 0.0, fptr(g), fptr(g), fptr(g), 4), "unknown activation 99")
    expect_invalid(lib.gh_op_glu(-1, 0.0, fptr(g), fptr(g), fptr(g), 4), "unknown activation")
    expect_invalid(lib.gh_op_glu(lib.GH_ACT_SILU, 0.0, ffi.NULL, fptr(g), fptr(g), 4), "NULL")
    expect_invalid(lib.gh_op_glu(lib.GH_ACT_DRELU, 0.0, fptr(g), ffi.NULL, fptr(g), 4), "dReLU", "up")
    expect_invalid(lib.gh_op_glu(lib.GH_ACT_SILU, 0.0, fptr(g), fptr(g), ffi.NULL, 4), "NULL")
    expect_invalid(lib.gh_op_glu(lib.GH_ACT_SILU, 0.0, fptr(g), fptr(g), fptr(g), 0), "positive")
    expect_invalid(lib.gh_op_glu(lib.GH_ACT_FATRELU, float("nan"), fptr(g), fptr(g), fptr(g), 4), "threshold")
    expect_invalid(lib.gh_op_layernorm(ffi.NULL, fptr(g), ffi.NULL, 4, 1, 1e-5, fptr(g)), "layernorm", "NULL")
    expect_invalid(lib.gh_op_layernorm(fptr(g), fptr(g), ffi.NULL, 0, 1, 1e-5, fptr(g)), "positive")
    expect_invalid(lib.gh_op_layernorm(fptr(g), fptr(g), ffi.NULL, 4, 1, -1.0, fptr(g)), "eps")
    pos = np.array([0, 1], dtype=np.int32)
    x = np.zeros(32, dtype=np.float32)
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 8, iptr(pos), 1e4, 0.0, ffi.NULL, 0), "freq_scale")
    bad_div = np.array([1.0, 0.0, 1.0, 1.0], dtype=np.float32)
    expect_invalid(lib.gh_op_rope(fptr(x), 2, 2, 8, iptr(pos), 1e4, 1.0, fptr(bad_div), 0), "freq_div[1]")


def test_attention_invalid_args():
    q, k, v = attn_inputs(2, 1, 4, 2, 8, seed=0)
    o = np.empty_like(q)
    P = fptr
    expect_invalid(lib.gh_op_attention(ffi.NULL, P(k), P(v), P(o), 2, 1, 4, 2, 8, 1), "attention", "NULL")
    expect_invalid(lib.gh_op_attention(P(q), ffi.NULL, P(v), P(o), 2, 1, 4, 2, 8, 1), "NULL")
    expect_invalid(lib.gh_op_attention(P(q), P(k), ffi.NULL, P(o), 2, 1, 4, 2, 8, 1), "NULL")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), ffi.NULL, 2, 1, 4, 2, 8, 1), "NULL")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 0, 1, 4, 2, 8, 1), "positive")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 2, -1, 4, 2, 8, 1), "n_past")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 2, 1, 0, 2, 8, 1), "positive")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 2, 1, 4, 0, 8, 1), "positive")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 2, 1, 4, 2, 0, 1), "positive")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 2, 1, 4, 3, 8, 1),
                   "n_head (4)", "n_head_kv (3)")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 2, 1, 4, 2, 8, 0), "n_threads")
    expect_invalid(lib.gh_op_attention(P(q), P(k), P(v), P(o), 2**40, 2**62, 4, 2, 8, 1), "overflow")


@pytest.mark.parametrize("neox", [0, 1])
def test_rope_scaled_frequencies(neox):
    """freq_scale (linear scaling) and per-pair divisors (Llama-3's rope_freqs) change the
    angle of pair i to pos * theta^(-2i/d) / div[i] * scale."""
    rng = np.random.default_rng(8)
    head_dim, theta = 16, 500000.0
    pos = np.array([0, 1, 7, 300, 4095], dtype=np.int32)
    x = rng.standard_normal((len(pos), 3, head_dim)).astype(np.float32)
    div = np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32)
    for scale, d in ((0.25, None), (1.0, div), (0.5, div)):
        y = x.copy()
        check(lib.gh_op_rope(fptr(y), len(pos), 3, head_dim, iptr(pos), theta, scale,
                             fptr(d) if d is not None else ffi.NULL, neox))
        inv = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        inv = inv / (d.astype(np.float64) if d is not None else 1.0) * scale
        ang = pos.astype(np.float64)[:, None] * inv[None, :]
        c, s_ = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = rope_pairs(head_dim, neox)
        ref = x.astype(np.float64).copy()
        ref[..., a] = x[..., a] * c - x[..., b] * s_
        ref[..., b] = x[..., b] * c + x[..., a] * s_
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-3 * np.abs(x).max())


def ref_act(act, g, t=0.0):
    """act(g) alone: an ungated FFN's activation."""
    g = g.astype(np.float64)
    if act == lib.GH_ACT_RELU:
        return np.maximum(g, 0.0)
    if act == lib.GH_ACT_FATRELU:
        return np.where(g > t, g, 0.0)
    if act == lib.GH_ACT_SILU:
        with np.errstate(over="ignore"):
            return g / (1.0 + np.exp(-g))
    if act == lib.GH_ACT_GELU:
        z = math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)
        with np.errstate(over="ignore"):
            return g / (1.0 + np.exp(-2.0 * z))
    return 0.5 * g * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0)))


@pytest.mark.parametrize("act", [lib.GH_ACT_RELU, lib.GH_ACT_FATRELU, lib.GH_ACT_SILU, lib.GH_ACT_GELU,
                                 lib.GH_ACT_GELU_ERF])
@pytest.mark.parametrize("n", [1, 33, 4097])
def test_act_ungated_and_fatrelu(simd, act, n):
    """up = NULL: act(gate) alone (OPT, Falcon); FATReLU keeps g only above t."""
    g, u = glu_inputs(n, n + 1)
    t = 0.37
    out = np.empty_like(g)
    check(lib.gh_op_glu(act, t, fptr(g), ffi.NULL, fptr(out), n))
    ref = ref_act(act, g, t)
    # as test_glu: GELU's rounded argument moves it by ~1e-7 * |g|
    gd = np.abs(g.astype(np.float64))
    assert np.all(np.abs(out - ref) <= 2e-6 * np.abs(ref) + 1e-7 * gd + 1e-37)
    # the gated form multiplies the same value by up
    out2 = np.empty_like(g)
    check(lib.gh_op_glu(act, t, fptr(g), fptr(u), fptr(out2), n))
    ud = np.abs(u.astype(np.float64))
    assert np.all(np.abs(out2 - ref * u) <= 2e-6 * np.abs(ref * u) + 1e-7 * gd * ud + 1e-37)
    if act == lib.GH_ACT_FATRELU:
        assert np.all(out[g <= t] == 0) and np.all(out[g > t] == g[g > t])
