"""The rotated residual stream (sparse/rotation.py): a rotated dense file computes the same
function as its source (logits against the unrotated file's in the runtime), its norms are
folded (weights 1) and its head is untied; o's input rotated per kv head (folded into W_v
and W_o) keeps the function too; the PCA rotations are orthogonal with the pooled second
moment's eigenvectors in decreasing order (numpy); a file the folding does not hold for is
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.gguf_write import ConvertError  # noqa: E402
from powerinfer_cpp.sparse.rotation import head_rotations, pca_rotation, rotate_gguf  # noqa: E402

from conftest import SHIPPED_SWIGLU_DIR  # noqa: E402


def test_pca_rotation_vs_numpy():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((200, 6)) * np.array([5.0, 1.0, 0.2, 3.0, 0.5, 0.1])
    b = rng.standard_normal((100, 6))
    ga, gb = rng.uniform(0.5, 2.0, 6), rng.uniform(0.5, 2.0, 6)
    q = pca_rotation([a * ga, b * gb], [ga, gb])
    np.testing.assert_allclose(q.T @ q, np.eye(6), atol=1e-10)
    c = a.T @ a / 200 + b.T @ b / 100
    w = np.linalg.eigvalsh(c)[::-1]
    np.testing.assert_allclose(np.diag(q.T @ c @ q), w, rtol=1e-9)  # largest first
    with pytest.raises(ValueError):
        pca_rotation([a], [np.zeros(6)])


def test_head_rotations_vs_numpy():
    rng = np.random.default_rng(7)
    n_head, n_kv, hd = 6, 2, 4
    x = rng.standard_normal((300, n_head * hd)) * rng.uniform(0.1, 4.0, n_head * hd)
    r = head_rotations(x, n_head, n_kv)
    assert r.shape == (n_kv, hd, hd)
    for g in range(n_kv):
        np.testing.assert_allclose(r[g].T @ r[g], np.eye(hd), atol=1e-10)
        c = sum(x[:, h * hd:(h + 1) * hd].T @ x[:, h * hd:(h + 1) * hd] / len(x) for h in range(3 * g, 3 * g + 3))
        np.testing.assert_allclose(np.diag(r[g].T @ c @ r[g]), np.linalg.eigvalsh(c)[::-1], rtol=1e-9)
    with pytest.raises(ValueError, match="heads"):
        head_rotations(x, 5, 2)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = tmp_path_factory.mktemp("rotation")
    return convert(SHIPPED_SWIGLU_DIR, d / "dense-f32.gguf", "f32", progress=False), d


def _logits(path, ids):
    with Model(str(path), n_ctx=len(ids), n_threads=1, cache_type="f32") as m:
        ctx = m.create_context(n_ctx=len(ids), n_threads=1, cache_type="f32")
        out = ctx.eval(ids, logits_all=True).copy()
        ctx.close()
    return out


def test_rotated_file_computes_the_same_function(dense):
    path, d = dense
    r = gguf.GGUFReader(str(path))
    n_embd = int(r.fields["llama.embedding_length"].parts[-1][0])
    del r
    rng = np.random.default_rng(11)
    q, _ = np.linalg.qr(rng.standard_normal((n_embd, n_embd)))
    out = rotate_gguf(path, d / "rot.gguf", q)
    rr = gguf.GGUFReader(out)
    names = {t.name: t for t in rr.tensors}
    assert "output.weight" in names  # the tied head is untied
    for n, t in names.items():
        if n.endswith("norm.weight"):
            np.testing.assert_array_equal(np.asarray(t.data), 1.0)
    del rr, names
    with Model(str(path), n_ctx=16) as m:
        ids = m.tokenize((SHIPPED_SWIGLU_DIR / "heldout.txt").read_text(encoding="utf-8"))[:96]
    a, b = _logits(path, ids), _logits(out, ids)
    assert not np.array_equal(a, b)  # really another file
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * float(np.abs(a).max()))
    assert np.mean(a.argmax(1) == b.argmax(1)) == 1.0


def test_o_rotations_keep_the_function(dense):
    path, d = dense
    r = gguf.GGUFReader(str(path))
    f = {k: int(r.fields[k].parts[-1][0]) for k in ("llama.embedding_length", "llama.block_count",
                                                      "llama.attention.head_count")}
    n_kv = int(r.fields["llama.attention.head_count_kv"].parts[-1][0]) \
        if "llama.attention.head_count_kv" in r.fields else f["llama.attention.head_count"]
    del r
    n_embd, n_head = f["llama.embedding_length"], f["llama.attention.head_count"]
    hd = n_embd // n_head
    rng = np.random.default_rng(12)
    q = np.linalg.qr(rng.standard_normal((n_embd, n_embd)))[0]
    rots = [np.stack([np.linalg.qr(rng.standard_normal((hd, hd)))[0] for _ in range(n_kv)])
            for _ in range(f["llama.block_count"])]
    out = rotate_gguf(path, d / "rot-o.gguf", q, o_rotations=rots)
    plain = rotate_gguf(path, d / "rot-plain.gguf", q)
    with Model(str(path), n_ctx=16) as m:
        ids = m.tokenize((SHIPPED_SWIGLU_DIR / "heldout.txt").read_text(encoding="utf-8"))[:96]
    a, b = _logits(path, ids), _logits(out, ids)
    rv, pv = gguf.GGUFReader(out), gguf.GGUFReader(plain)
    t_o = {t.name: np.asarray(t.data) for t in rv.tensors}
    t_p = {t.name: np.asarray(t.data) for t in pv.tensors}
    assert not np.array_equal(t_o["blk.0.attn_v.weight"], t_p["blk.0.attn_v.weight"])
    assert not np.array_equal(t_o["blk.0.attn_output.weight"], t_p["blk.0.attn_output.weight"])
    np.testing.assert_array_equal(t_o["blk.0.attn_q.weight"], t_p["blk.0.attn_q.weight"])
    del rv, pv, t_o, t_p
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * float(np.abs(a).max()))
    assert np.mean(a.argmax(1) == b.argmax(1)) == 1.0
    with pytest.raises(ValueError, match="o_rotations"):
        rotate_gguf(path, d / "x.gguf", q, o_rotations=rots[:1])
    with pytest.raises(ValueError, match="orthogonal"):
        rotate_gguf(path, d / "x.gguf", q, o_rotations=[2 * x for x in rots])


def test_refusals(dense, tmp_path):
    path, d = dense
    with pytest.raises(ValueError):
        rotate_gguf(path, tmp_path / "x.gguf", np.ones((4, 4)))
    bad = tmp_path / "bias.gguf"
    w = gguf.GGUFWriter(str(bad), "llama")
    w.add_tensor("blk.0.attn_norm.weight", np.ones(4, np.float32))
    w.add_tensor("blk.0.attn_q.bias", np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match="attn_q.bias"):
        rotate_gguf(bad, tmp_path / "y.gguf", np.eye(4))
