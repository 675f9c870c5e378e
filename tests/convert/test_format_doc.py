"""docs/FORMAT.md is exact: its tables of powerinfer.* keys and sparse tensors match,
in both directions, what the writer puts into a sparse file (names, types, shapes)
and what format.py names."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from powerinfer_cpp import format as F  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

REPO = REPO_DIR
DOC = REPO / "docs" / "FORMAT.md"
HELDOUT = REPO / "models" / "tiny-relu-kjv" / "heldout.txt"

KEY_ROW = re.compile(r"^\| `(powerinfer\.[a-z0-9_.]+)` \| (\w+) \|")
TENSOR_ROW = re.compile(r"^\| `blk\.N\.([a-z0-9_]+(?:\.weight)?)` \| `\[([^\]]*)\]` \| (\w+) \|")
DOC_VALUE_TYPES = {"f32": "FLOAT32", "u32": "UINT32", "u64": "UINT64", "string": "STRING", "bool": "BOOL"}


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    nxt = text.find("\n## ", start + 1)
    return text[start:nxt if nxt >= 0 else len(text)]


def _doc_keys(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        m = KEY_ROW.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _doc_tensors(text: str) -> dict[str, tuple[list[str], str]]:
    out = {}
    for line in text.splitlines():
        m = TENSOR_ROW.match(line)
        if m:
            out[m.group(1)] = ([s.strip() for s in m.group(2).split(",")], m.group(3))
    return out


@pytest.fixture(scope="module")
def sparse_file(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_models import make_llama_model

    from powerinfer_cpp.convert import convert
    from powerinfer_cpp.sparse.placement import parse_size
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    d = tmp_path_factory.mktemp("format-doc")
    hf = make_llama_model(d / "hf", act="drelu", tied=True, seed=2, n_layer=2, d=64, n_ff=192, n_ctx=128)
    opts = SparseOptions(calib=str(HELDOUT), calib_tokens=512, vram_budget=parse_size("480K"), profile_ctx=128)
    return Path(convert(hf, d / "sparse.gguf", "f32", progress=False, sparse=True, sparse_options=opts))


def test_doc_tables_match_format_py():
    text = DOC.read_text(encoding="utf-8")
    sec = _section(text, "Sparse extension")
    keys = _doc_keys(sec)
    assert set(keys) == set(F.SPARSE_KEYS) | set(F.GPU_KEYS)
    tensors = _doc_tensors(sec)
    assert {F.parse_tensor_name("blk.0." + n)[0] for n in tensors} == set(F.SPARSE_LAYER_TENSORS)
    for n in tensors:
        kind = F.parse_tensor_name("blk.0." + n)[0]
        assert F.sparse_tensor_name(kind, 0) == "blk.0." + n
    for v in F.GPU_SOLVERS:
        assert f"`{v}`" in sec


def test_writer_matches_doc(sparse_file):
    text = DOC.read_text(encoding="utf-8")
    sec = _section(text, "Sparse extension")
    r = gguf.GGUFReader(str(sparse_file))

    # keys: every powerinfer.* key in the file is documented (sparse ones in the sparse
    # section) with its type, and every documented sparse key is in the file
    all_doc_keys = _doc_keys(text)
    sparse_doc_keys = _doc_keys(sec)
    file_keys = {k: f for k, f in r.fields.items() if k.startswith("powerinfer.")}
    for k, f in file_keys.items():
        assert k in all_doc_keys, f"{k} is written but not documented"
        assert gguf.GGUFValueType(f.types[0]).name == DOC_VALUE_TYPES[all_doc_keys[k]], k
        if k.startswith(("powerinfer.sparse.", "powerinfer.gpu.")):
            assert k in sparse_doc_keys, f"{k} documented outside the sparse section"
    for k in sparse_doc_keys:
        assert k in file_keys, f"{k} is documented but not written"
    assert r.fields[F.KEY_FORMAT_VERSION].contents() == F.FORMAT_VERSION == 1

    # tensors of every layer: the documented sparse tensors with their shapes and types
    doc_t = _doc_tensors(sec)
    fields = {k: f.contents() for k, f in r.fields.items()}
    n_layer = fields["llama.block_count"]
    dims = {"d": fields["llama.embedding_length"], "n_ff": fields["llama.feed_forward_length"]}
    by_name = {t.name: t for t in r.tensors}
    dense_kinds = set(F.LAYER_TENSORS)
    seen_bucket = False
    for l in range(n_layer):
        layer = {n[len(f"blk.{l}."):]: t for n, t in by_name.items() if n.startswith(f"blk.{l}.")}
        extra = {n for n in layer if F.parse_tensor_name("blk.0." + n)[0] not in dense_kinds}
        assert F.tensor_name(F.T_FFN_DOWN, l) not in by_name  # replaced by ffn_down_t
        fc1 = layer["fc1.weight"]
        bucket = layer.get("gpu_bucket")
        env = dict(dims, h=int(fc1.shape[1]), n_hot=int(bucket.n_elements) if bucket is not None else 0)
        expected = set(doc_t) - ({"gpu_bucket"} if bucket is None else set())
        assert extra == expected, (l, extra ^ expected)
        seen_bucket |= bucket is not None
        for n, (shape, ty) in doc_t.items():
            if n not in layer:
                continue
            t = layer[n]
            assert [int(v) for v in reversed(t.shape)] == [env[s] for s in shape], n
            want = {"W": "F32", "P": "F32"}.get(ty, ty)  # an f32 file: W and P are F32
            assert gguf.GGMLQuantizationType(t.tensor_type).name == want, n
        idx = np.asarray(layer["gpu_idx"].data)
        if bucket is not None:
            assert np.array_equal(np.asarray(bucket.data), np.flatnonzero(idx))
        else:
            assert idx.sum() == 0
    assert seen_bucket  # the budget put neurons on the GPU somewhere
