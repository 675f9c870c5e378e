"""The IQ1/IQ2/IQ3 lattice types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M):
rows of the type and kernel tables whose codebooks are generated at build time from the
gguf package's tables (tools/gen_iq_grids.py). They are read, never written, so every
test stores random valid blocks (opref.lattice_blocks: random indices, signs and
sub-block scales, a chosen fp16 d) and compares against gguf.quants' dequantization:

* dequantization bit for bit equal to gguf.quants.dequantize;
* the dot (gh_op_matmul: the type's vec_dot against Q8_K activations) and the axpy
  (gh_op_matmul_t: the down_t and input-sparse column form) against numpy at every SIMD
  level: rows of the op table (test_op_table.py, which runs every type the kernel table
  has); here the levels against each other within SIMD_BOUND (the same integer sums,
  another float order);
* a batch equals its tokens one by one, bit for bit;
* a small model whose FFN weights are in the type loads, and its logits equal those of
  the same model with those weights dequantized to F32 within MODEL_BOUND;
* without the codebooks (a build where gguf was not importable) the generator writes
  the reason, and the runtime would refuse the types by name with it.
The op table (test_op_table.py) runs these types through every op and backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from gguf import quants

from powerinfer_cpp._native import check, ffi, lib
from cbuf import fptr  # noqa: E402
from conftest import REPO_DIR, simd_levels  # noqa: E402

from opref import GGUF_QT, LATTICE, LATTICE_ALL, LATTICE_SIZE, lattice_blocks, vptr  # noqa: E402

REPO = REPO_DIR
NAME = {t: n for n, t in LATTICE_ALL.items()}
# Q8_K activations (one scale per 256 values, 8 bits): the K-quants' bound
# (test_op_table.NMSE_BOUND); measured worst 5.7e-5 (IQ1_M) .. 1.2e-4 (IQ2_XXS), the
# same at every level (test_op_table's matmul rows print it)
SIMD_BOUND = 1e-8
# logits of the lattice file against the F32 file of the same values, over the logit
# range: the difference is only the activations' 8-bit rounding in the FFN's dots
# (measured 2.8e-3 .. 3.4e-3 over the seven types)
MODEL_BOUND = 1e-2

needs_lattice = pytest.mark.skipif(not LATTICE, reason="built without the gguf package's codebooks")
types = pytest.mark.parametrize("t", LATTICE, ids=lambda t: NAME[t])


def random_blocks(t: int, n_blocks: int, rng, rms=1.0) -> np.ndarray:
    return lattice_blocks(t, np.full(n_blocks, rms), rng)


def dequantize(t: int, raw: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float32)
    check(lib.gh_dequantize_row(t, vptr(np.ascontiguousarray(raw)), fptr(out), n))
    return out


def matmul(t, raw, rows, cols, x, n_threads=1):
    y = np.full((x.shape[0], rows), np.nan, dtype=np.float32)
    check(lib.gh_op_matmul(t, vptr(raw), rows, cols, fptr(x), x.shape[0], fptr(y), n_threads))
    return y


def nmse(y, ref, wd, x) -> float:
    expected = float(np.sum(wd.astype(np.float64) ** 2) * np.sum(x.astype(np.float64) ** 2)) / wd.shape[1]
    return float(np.sum((y - ref) ** 2)) / max(float(np.sum(ref ** 2)), expected, 1e-300)


@needs_lattice
@types
def test_dequantize_matches_gguf(t):
    """Bit for bit on random blocks: random bytes everywhere but the fp16 d (finite, of
    several magnitudes, both signs, subnormal halves too), whose other bits are every
    index, sign and sub-block scale the layout can hold."""
    rng = np.random.default_rng(t)
    nb = 2000
    raw = rng.integers(0, 256, size=(nb, LATTICE_SIZE[t]), dtype=np.uint8)
    from opref import set_lattice_d

    d = rng.standard_normal(nb) * np.exp(rng.uniform(-12, 6, nb))
    d[:8] = [0.0, -0.0, 6e-8, -6e-8, 1e-6, 65504.0, -65504.0, 1.0]
    set_lattice_d(t, raw, d)
    ours = dequantize(t, raw, nb * 256)
    with np.errstate(over="ignore"):
        ref = quants.dequantize(raw.reshape(-1), GGUF_QT[t]).astype(np.float32).reshape(-1)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), np.flatnonzero(ours != ref)[:8]
    assert np.isfinite(ours).all()


@needs_lattice
@types
def test_type_row(t):
    assert ffi.string(lib.gh_type_name(t)).decode() == NAME[t]
    assert lib.gh_type_block_size(t) == 256
    assert lib.gh_type_row_size(t, 512) == 2 * LATTICE_SIZE[t]
    assert lib.gh_type_row_size(t, 300) == 0


@needs_lattice
@types
def test_simd_levels_agree(t, restore_simd):
    levels = simd_levels()
    if len(levels) == 1:
        pytest.skip("this CPU has no SIMD level")
    rng = np.random.default_rng(200 + t)
    rows, cols = 13, 256 * 9
    raw = random_blocks(t, rows * cols // 256, rng).reshape(rows, -1)
    wd = quants.dequantize(raw, GGUF_QT[t]).astype(np.float64).reshape(rows, cols)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    lib.gh_simd_set(lib.GH_SIMD_SCALAR)
    ys = matmul(t, raw, rows, cols, x).astype(np.float64)
    for level in levels[1:]:
        lib.gh_simd_set(level)
        y = matmul(t, raw, rows, cols, x, 2).astype(np.float64)
        assert nmse(y, ys, wd, x) < SIMD_BOUND, (NAME[t], level)


@needs_lattice
@types
@pytest.mark.parametrize("level", simd_levels())
def test_batch_equals_tokens(t, level, restore_simd):
    """A prompt's matmul (tiles of tokens) gives each token the bits of its own decode."""
    assert lib.gh_simd_set(level) != -2
    rng = np.random.default_rng(300 + t)
    rows, cols, n_tokens = 11, 768, 9
    raw = random_blocks(t, rows * cols // 256, rng).reshape(rows, -1)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    batch = matmul(t, raw, rows, cols, x, 2)
    one = np.concatenate([matmul(t, raw, rows, cols, x[i:i + 1]) for i in range(n_tokens)])
    assert np.array_equal(batch, one)


@needs_lattice
def test_quantize_refused():
    x = np.zeros(256, dtype=np.float32)
    buf = np.zeros(256, dtype=np.uint8)
    for t in LATTICE:
        assert lib.gh_quantize_row(t, fptr(x), vptr(buf), 256) != 0
        msg = ffi.string(lib.gh_last_error()).decode()
        assert f"{NAME[t]} is read but not written" in msg and "importance matrix" in msg


def test_convert_refuses_lattice_outtypes():
    from powerinfer_cpp import format as F

    for name in LATTICE_ALL:
        why = F.outtype_refusal(name)
        assert "read but not written" in why and "importance matrix" in why and name not in F.OUTTYPES


def test_generator_without_gguf(tmp_path):
    """A Python where gguf is not importable: the header says so (GH_IQ_GRIDS 0 and the
    reason), and CMake's build goes on with it (the types become layout rows, refused by
    name: the read list carries the reason)."""
    fake = tmp_path / "site"
    (fake / "gguf").mkdir(parents=True)
    (fake / "gguf" / "__init__.py").write_text("raise ImportError('no gguf here')\n")
    out = tmp_path / "iq_grids.h"
    env = dict(os.environ, PYTHONPATH=str(fake))
    subprocess.run([sys.executable, str(REPO / "tools" / "gen_iq_grids.py"), str(out)], env=env, check=True)
    text = out.read_text()
    assert "#define GH_IQ_GRIDS 0" in text and "no gguf here" in text and "gh_iq2xxs_grid" not in text


def test_generator_with_gguf(tmp_path):
    out = tmp_path / "iq_grids.h"
    subprocess.run([sys.executable, str(REPO / "tools" / "gen_iq_grids.py"), str(out)], check=True)
    text = out.read_text()
    assert "#define GH_IQ_GRIDS 1" in text
    for name, n in (("gh_iq2xxs_grid", 256), ("gh_iq2xs_grid", 512), ("gh_iq2s_grid", 1024),
                    ("gh_iq3xxs_grid", 256), ("gh_iq3s_grid", 512), ("gh_iq1s_grid", 2048),
                    ("gh_iq2_ksigns", 128), ("gh_iq2_signs64", 128)):
        assert f"{name}[{n}] = {{" in text


def test_read_list_names_them():
    """The refusal list comes from the table: with the codebooks it lists the lattice types,
    without them it says why they are not read."""
    from powerinfer_cpp import preflight

    names = set(preflight.readable_types().values())
    if LATTICE:
        assert set(LATTICE_ALL) <= names
    else:
        assert not set(LATTICE_ALL) & names


def test_file_of_lattice_tensor():
    """A GGUF holding an IQ2_XXS tensor opens (its bytes as the layout says); in a build
    without the codebooks it is refused by name, with the reason."""
    from test_gguf_reader import expect_error, image, open_mem, tinfo

    t = LATTICE_ALL["iq2_xxs"]
    img = image(tensors=[tinfo("w", [512, 2], t)], data=bytes(4 * LATTICE_SIZE[t]))
    if t in LATTICE:
        with open_mem(img) as g:
            (info,) = g.tensors()
            assert info["type"] == t and info["nbytes"] == 4 * LATTICE_SIZE[t]
    else:
        expect_error(img, lib.GH_ERR_UNSUPPORTED, "tensor 'w' has type iq2_xxs (id 16), which this runtime does "
                     "not read", "not the IQ1/IQ2/IQ3 lattice types: the gguf package was not importable")


# ---------------------------------------------------------------- a model in the type

@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    """A small f32 LLaMA (SwiGLU) whose FFN rows are whole 256-blocks."""
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    from powerinfer_cpp.convert import convert

    d = tmp_path_factory.mktemp("iqlat")
    hf = make_llama_model(d / "hf", act="silu", tied=True, seed=5, n_layer=2, d=256, n_ff=512, n_ctx=64)
    return convert(hf, d / "f32.gguf", outtype="f32", progress=False)


@needs_lattice
@types
def test_model_in_type_matches_f32(t, f32_gguf, tmp_path):
    """ffn_gate, ffn_up and ffn_down of every layer as random valid blocks of t (the RMS of
    the weights they replace) against the same values stored as F32: the logits agree."""
    from gguf_rewrite import rewrite_gguf

    from powerinfer_cpp import Model
    from powerinfer_cpp import format as F

    lattice, plain = {}, {}
    for il in range(2):
        for kind in (F.T_FFN_GATE, F.T_FFN_UP, F.T_FFN_DOWN):
            name = F.tensor_name(kind, il)

            def make(a, name=name):
                rows, cols = a.shape
                rms = float(np.sqrt(np.mean(a.astype(np.float64) ** 2)))
                raw = random_blocks(t, rows * cols // 256, np.random.default_rng(zlib.crc32(name.encode())), rms)
                raw = raw.reshape(rows, -1)
                deq = quants.dequantize(raw, GGUF_QT[t]).astype(np.float32).reshape(rows, cols)
                plain[name] = deq
                return raw, GGUF_QT[t]

            lattice[name] = make
    iq_path = rewrite_gguf(f32_gguf, tmp_path / "iq.gguf", tensors=lattice)
    ref_path = rewrite_gguf(f32_gguf, tmp_path / "ref.gguf",
                            tensors={n: (lambda a, n=n: plain[n]) for n in lattice})
    tokens = [1, 17, 42, 99, 3, 250, 7, 7, 100, 300, 12, 64]
    with Model(iq_path, n_ctx=64, n_threads=2, ffn="dense") as m:
        got = m.eval(tokens, logits_all=True)
        m.context.reset()
        step = np.stack([m.eval([tok]) for tok in tokens])
    with Model(ref_path, n_ctx=64, n_threads=2, ffn="dense") as m:
        ref = m.eval(tokens, logits_all=True)
    span = float(ref.max() - ref.min())
    err = float(np.abs(got - ref).max()) / span
    print(f"{NAME[t]}: logits max |diff| / range {err:.2e}")
    assert err < MODEL_BOUND, err
    # the prompt's batch and its tokens one at a time: the same dots, the same logits
    np.testing.assert_allclose(step, got, rtol=0, atol=1e-4 * span)
