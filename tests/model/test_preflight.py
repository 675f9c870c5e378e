"""A file with several problems is refused with all of them at once: `inspect` lists every
reason (tensor types, pre-tokenizer, architecture, keys) and Model() raises one error that
names them all (preflight.py), where the native loader alone stops at the first."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp import Model, NativeError
from powerinfer_cpp import format as F
from powerinfer_cpp import preflight
from powerinfer_cpp._native import lib

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as VT  # noqa: E402
from gguf_rewrite import rewrite_gguf  # noqa: E402

#: a type the runtime does not read (its id in GGUF files): ternary TQ2_0, 256-value blocks
TQ2_0 = 35
RETYPED = ("blk.0.ffn_gate.weight", "blk.1.ffn_up.weight")


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    """A small f32 LLaMA whose FFN rows are 256 wide, so a tensor can be retyped to a
    256-block type with the bytes that type's shape needs."""
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    from powerinfer_cpp.convert import convert

    d = tmp_path_factory.mktemp("preflight")
    hf = make_llama_model(d / "hf", act="silu", tied=True, seed=4, n_layer=2, d=256, n_ff=256, n_ctx=64)
    return convert(hf, d / "wide.gguf", outtype="f32", progress=False)


def _tq2_0(a):
    """Random bytes of a TQ2_0 tensor of a's shape (its content never matters: the type
    is refused before any value is read)."""
    rows, cols = a.shape
    size, bytes_per_block = gguf.GGML_QUANT_SIZES[Q(TQ2_0)]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // size * bytes_per_block), dtype=np.uint8)
    return raw, Q(TQ2_0)


def _bad(src, dst, *, types=True, pre="kimi-k2", arch="mamba", drop_kv=()):
    """src with the chosen problems, and no embedded tokenizer.json (as llama.cpp writes
    files): tokenizer.ggml.pre decides the split."""
    return rewrite_gguf(
        src, dst, tensors={n: _tq2_0 for n in RETYPED} if types else None,
        drop_kv=[F.KEY_TOKENIZER_HF_JSON, *drop_kv],
        kv={**({F.KEY_TOKENIZER_PRE: (pre, VT.STRING)} if pre else {}),
            **({F.KEY_GENERAL_ARCHITECTURE: (arch, VT.STRING)} if arch else {})})


def test_clean_file_has_no_problems(wide_gguf):
    assert preflight.check(wide_gguf) == []


def test_three_problems_found_at_once(wide_gguf, tmp_path):
    problems = preflight.check(_bad(wide_gguf, tmp_path / "bad.gguf"))
    assert [p.kind for p in problems] == ["types", "architecture", "tokenizer"]
    types, arch, pre = (p.message for p in problems)
    assert "TQ2_0 (id 35) in 2 tensors ('blk.0.ffn_gate.weight', 'blk.1.ffn_up.weight')" in types
    # the list of what the runtime reads comes from its type table
    assert all(n in types for n in preflight.readable_types().values()) and "q8_0" in types
    assert "unsupported architecture 'mamba' (general.architecture; supported: llama, qwen2" in arch
    assert "pre-tokenizer 'kimi-k2' (tokenizer.ggml.pre) is not supported: llama.cpp splits it" in pre


def test_inspect_lists_every_reason(wide_gguf, tmp_path):
    from powerinfer_cpp.inspect import describe, main

    text = describe(_bad(wide_gguf, tmp_path / "bad.gguf"))
    i = text.index("loads: no (3 problems)")
    lines = text[i:].splitlines()[1:4]
    assert all(line.startswith("  - ") for line in lines)
    assert "TQ2_0" in lines[0] and "'mamba'" in lines[1] and "'kimi-k2'" in lines[2]
    assert "loads: yes" in describe(wide_gguf)
    assert main([str(wide_gguf)]) == 0


def test_model_error_names_all_reasons(wide_gguf, tmp_path):
    path = _bad(wide_gguf, tmp_path / "bad.gguf")
    with pytest.raises(NativeError) as e:
        Model(path)
    msg = str(e.value)
    assert msg.startswith(f"this runtime cannot load {path} (3 problems):")
    assert "TQ2_0" in msg and "'mamba'" in msg and "'kimi-k2'" in msg
    assert e.value.status == lib.GH_ERR_UNSUPPORTED  # the loader's own status


def test_missing_keys_and_pre_tokenizer(wide_gguf, tmp_path):
    """Two keys missing (the loader names only the first) and a refused pre-tokenizer."""
    keys = [F.arch_key(F.KEY_BLOCK_COUNT), F.arch_key(F.KEY_HEAD_COUNT)]
    path = _bad(wide_gguf, tmp_path / "keys.gguf", types=False, arch=None, drop_kv=keys)
    with pytest.raises(NativeError) as e:
        Model(path)
    msg = str(e.value)
    assert "(3 problems)" in msg
    assert all(f"missing required key '{k}'" in msg for k in keys) and "'kimi-k2'" in msg


def test_one_problem_keeps_the_loaders_message(wide_gguf, tmp_path):
    path = _bad(wide_gguf, tmp_path / "arch.gguf", types=False, pre=None)
    with pytest.raises(NativeError, match=r": unsupported architecture 'mamba' \(general.architecture"):
        Model(path)


def test_loader_problem_outside_the_preflight_is_kept(wide_gguf, tmp_path):
    """A shape only the loader checks, with a refused pre-tokenizer: both are named."""
    path = rewrite_gguf(wide_gguf, tmp_path / "shape.gguf", kv={F.KEY_TOKENIZER_PRE: ("kimi-k2", VT.STRING)},
                        drop_kv=[F.KEY_TOKENIZER_HF_JSON], tensors={"blk.0.attn_norm.weight": lambda a: a[:-1]})
    with pytest.raises(NativeError) as e:
        Model(path)
    msg = str(e.value)
    assert "(2 problems)" in msg and "'kimi-k2'" in msg and "blk.0.attn_norm.weight" in msg


def test_header_reader_agrees_with_gguf(wide_gguf):
    from powerinfer_cpp.gguf_read import StringArray, read_header

    h = read_header(wide_gguf)
    r = gguf.GGUFReader(str(wide_gguf))
    assert [(n, t, s) for n, t, s in h.tensors] == [(t.name, int(t.tensor_type), tuple(int(v) for v in t.shape))
                                                    for t in r.tensors]
    assert set(h.fields) == {k for k in r.fields if not k.startswith("GGUF.")}
    assert isinstance(h.fields[F.KEY_TOKENIZER_TOKENS], StringArray)
    assert len(h.fields[F.KEY_TOKENIZER_TOKENS]) == len(r.fields[F.KEY_TOKENIZER_TOKENS].data)
    assert h.fields[F.arch_key(F.KEY_EMBEDDING_LENGTH)] == 256


def test_truncated_header_is_a_value_error(wide_gguf, tmp_path):
    from powerinfer_cpp.gguf_read import read_header

    data = open(wide_gguf, "rb").read()
    for cut in (10, 100, 3000):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated|not a GGUF"):
            read_header(p)
