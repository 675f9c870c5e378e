"""Input sparsity of the attention's and the head's projections (convert --input-sparsity,
docs/FORMAT.md "Input sparsity"): the sparse column kernel's bad arguments (against numpy
for every type, SIMD level and thread count: test_op_table.py's sparse_cols row); on the
shipped SwiGLU model the calibration's held-out
sparsity, results independent of the thread count, sparsity 0 equal to dense, dense mode
untouched (equal to a dense file's), the quality bound at the recommended level, the statistics; a file without the
thresholds asked for the mode gives a clear error; FORMAT.md's section matches format.py; a
profile of the projections' inputs alone runs the sparse mode and records what its thresholds
compare (the FFN's recording forces dense), and the refit's passes reach the target."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp._native import check, ffi, lib  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.gate_eval import patch_gate_thresholds  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402

from cbuf import fptr  # noqa: E402
from conftest import REPO_DIR, SHIPPED_SWIGLU_DIR  # noqa: E402
from opref import TYPES, vptr  # noqa: E402

HELDOUT = SHIPPED_SWIGLU_DIR / "heldout.txt"
DOC = REPO_DIR / "docs" / "FORMAT.md"
S_IN = 0.25       # the input sparsity the module's file is calibrated to (the recommended level)
CALIB = 3072      # profiled tokens (the projections' inputs of the first INPUTS of them)
INPUTS = 2048


# ---- the kernel: y = sum over |x_i| > thr_i of x_i * W[i] (vs numpy: test_op_table.py) -------


def test_sparse_cols_bad_args():
    x = np.ones(4, np.float32)
    y = np.zeros(32, np.float32)
    w = np.zeros((4, 32), np.float32)
    with pytest.raises(ValueError, match="multiple"):
        check(lib.gh_op_sparse_cols(TYPES["q8_0"], vptr(w), 4, 33, fptr(x), ffi.NULL, fptr(y), ffi.NULL, 1))
    with pytest.raises(ValueError, match="NULL"):
        check(lib.gh_op_sparse_cols(lib.GH_TYPE_F32, vptr(w), 4, 32, ffi.NULL, ffi.NULL, fptr(y), ffi.NULL, 1))
    with pytest.raises(ValueError, match="n_threads"):
        check(lib.gh_op_sparse_cols(lib.GH_TYPE_F32, vptr(w), 4, 32, fptr(x), ffi.NULL, fptr(y), ffi.NULL, 0))


# ---- the shipped SwiGLU model, gate FFN + input-sparse attention and head ----------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("input-sparsity")
    rep: list = []
    path = convert(SHIPPED_SWIGLU_DIR, d / "in.gguf", "f16", progress=False, sparse=True, report=rep,
                   sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=CALIB, profile_ctx=256,
                                                sparsity=0.25, input_sparsity=S_IN, input_tokens=INPUTS,
                                                n_threads=1))
    # a gate file without input sparsity (its dense mode does not depend on the calibration)
    plain = convert(SHIPPED_SWIGLU_DIR, d / "gate.gguf", "f16", progress=False, sparse=True,
                    sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=512, profile_ctx=256,
                                                 sparsity=0.25, n_threads=1))
    with Model(path, n_ctx=16) as m:
        later = m.tokenize(HELDOUT.read_text(encoding="utf-8"))[rep[0].n_calib_tokens:]
    return {"path": Path(path), "plain": Path(plain), "rep": rep[0], "later": later, "dir": d}


def _run(path, ids, threads=1, ffn="file", input_sparse=None, window=256):
    """Logits of ids (windows, every token in the file's sparse mode: "file", since `auto`
    picks dense where the estimate says so) and the stats (one thread unless asked: a
    busy machine stalls a pool's every call)."""
    with Model(path, n_ctx=window, n_threads=threads, cache_type="f32") as m:
        ctx = m.create_context(n_ctx=window, n_threads=threads, cache_type="f32", ffn=ffn,
                               input_sparse=input_sparse)
        ctx.sparse_batch = window
        out = []
        for s in range(0, len(ids), window):
            ctx.reset()
            out.append(ctx.eval(ids[s:s + window], logits_all=True).copy())
        st = ctx.stats()
        ctx.close()
    return np.concatenate(out), st


def test_file_and_heldout_sparsity(files):
    rep = files["rep"].input_calibration
    assert rep.criterion == "wina" and rep.sparsity == S_IN
    r = gguf.GGUFReader(files["path"])
    names = {t.name for t in r.tensors}
    for l in range(4):
        for k in F.INPUT_SPARSE_LAYER_TENSORS:
            assert F.input_sparse_tensor_name(k, l) in names
    assert {F.input_sparse_tensor_name(k) for k in F.INPUT_SPARSE_GLOBAL_TENSORS} <= names
    assert F.tensor_name(F.T_ATTN_Q, 0) in names  # the row-major copies stay (prompts, dense)
    assert str(bytes(r.fields[F.KEY_INPUT_CRITERION].parts[-1]), "utf-8") == "wina"
    # held-out text (after the calibration tokens): the requested share within 3 points
    _, st = _run(files["path"], files["later"][:1024])
    dens = st["input_sparse"]
    assert abs(dens["attention_density"] - (1 - S_IN)) <= 0.03, dens
    assert abs(dens["head_density"] - (1 - S_IN)) <= 0.03, dens
    # the bytes follow: q/k/v/o and the head read only the used inputs' rows
    nb = {t.name: int(t.n_bytes) for t in r.tensors}
    att = sum(nb[F.input_sparse_tensor_name(k, l)] for l in range(4)
              for k in (F.T_ATTN_QKV_T, F.T_ATTN_OUTPUT_T))
    head = nb[F.input_sparse_tensor_name(F.T_OUTPUT_T)]
    for stage, full, density in (("attention", att, dens["attention_density"]),
                                 ("head", head, dens["head_density"])):
        ratio = st["bytes_per_token_stage"][stage] / full
        assert abs(ratio - density) < 0.05, (stage, ratio, density)


def test_threads_and_dense_unchanged(files):
    ids = files["later"][:300]
    l1, _ = _run(files["path"], ids, threads=1)
    l2, _ = _run(files["path"], ids, threads=2)
    np.testing.assert_array_equal(l1, l2)
    d_in, _ = _run(files["path"], ids, ffn="dense")
    d_plain, _ = _run(files["plain"], ids, ffn="dense")
    np.testing.assert_array_equal(d_in, d_plain)  # dense mode reads the row-major tensors only
    off, st = _run(files["path"], ids, input_sparse=False)
    assert st["input_sparse"]["attention_inputs"] == 0 and st["ffn_mode"] == "gate"
    assert not np.array_equal(l1, off)


def test_sparsity_zero_equals_dense(files):
    z = files["dir"] / "zero.gguf"
    shutil.copy(files["path"], z)
    patch_gate_thresholds(str(z), [0.0] * 4)
    r = gguf.GGUFReader(z, "r+")
    for t in r.tensors:
        if t.name.endswith("_in_thr"):
            t.data[:] = 0.0
    r.data.flush()
    del r
    ids = files["later"][:200]
    zs, st = _run(z, ids)
    assert st["ffn_mode"] == "gate"
    zd, _ = _run(z, ids, ffn="dense")
    np.testing.assert_array_equal(zs, zd)


def test_quality_bound(files):
    """At the recommended level (docs/BENCHMARKS.md "Input sparsity") on top of the gate FFN,
    held-out perplexity stays within 2% of the gate FFN alone and top-1 agreement >= 90%."""
    ids = files["later"][:1025]
    tgt = np.asarray(ids[1:])

    def nll(lg):
        z = lg[:-1].astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return -lp[np.arange(len(tgt)), tgt].mean(), lp.argmax(1)

    on, _ = _run(files["path"], ids)
    off, _ = _run(files["path"], ids, input_sparse=False)
    (a, ta), (b, tb) = nll(on), nll(off)
    inc = np.exp(a - b) - 1
    print(f"input sparsity {S_IN:.0%} (wina) over the gate FFN: ppl {np.exp(a):.3f} vs {np.exp(b):.3f} "
          f"({inc:+.2%}), top-1 {np.mean(ta == tb):.1%}")
    assert inc < 0.02 and np.mean(ta == tb) >= 0.90


def test_file_without_thresholds_is_a_clear_error(files):
    with pytest.raises(ValueError, match="--input-sparsity"):
        Model(files["plain"], n_ctx=16, input_sparse=True)
    with Model(files["plain"], n_ctx=16) as m:
        ctx = m.create_context(n_ctx=16)
        assert ctx.input_sparse is False
        with pytest.raises(NativeError, match="--input-sparsity") as e:
            ctx.input_sparse = True
        assert e.value.status == lib.GH_ERR_UNSUPPORTED


def test_partial_file_is_refused(files, tmp_path):
    from gguf_rewrite import rewrite_gguf
    bad = tmp_path / "partial.gguf"
    rewrite_gguf(files["path"], bad, drop=[F.input_sparse_tensor_name(F.T_OUTPUT_IN_THR)])
    with pytest.raises(NativeError, match="output_t.weight' without 'output_in_thr"):
        Model(bad, n_ctx=16)


def test_format_doc_section():
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## Input sparsity\n")
    nxt = text.find("\n## ", start + 1)
    sec = text[start:nxt if nxt >= 0 else len(text)]
    keys = set(re.findall(r"^\| `(powerinfer\.[a-z0-9_.]+)` \|", sec, re.M))
    assert keys == set(F.INPUT_KEYS)
    names = set(re.findall(r"^\| `((?:blk\.N\.)?[a-z0-9_]+(?:\.weight)?)` \|", sec, re.M))
    want = {F.input_sparse_tensor_name(k, 0).replace("blk.0.", "blk.N.") for k in F.INPUT_SPARSE_LAYER_TENSORS}
    want |= {F.input_sparse_tensor_name(k) for k in F.INPUT_SPARSE_GLOBAL_TENSORS}
    want |= {F.input_sparse_tensor_name(k, 0).replace("blk.0.", "blk.N.") for k in F.FFN_INPUT_SPARSE_TENSORS}
    assert names == want
    for c in F.INPUT_CRITERIA:
        assert f"`{c}`" in sec


def test_host_device_stays_correct(files):
    """On a device the attention and head placed there run dense: with all of them placed,
    the hybrid run equals the CPU with input sparsity off."""
    ids = files["later"][:64]
    cpu, _ = _run(files["path"], ids, input_sparse=False, window=64)
    with Model(files["path"], n_ctx=64, n_threads=1, cache_type="f32", device="host-device",
               vram_budget="256M") as m:
        info = m.device_info()
        assert info["attention_layers"] == 4 and info["head_on_device"]
        ctx = m.create_context(n_ctx=64, n_threads=1, cache_type="f32", ffn="file")
        assert ctx.input_sparse
        ctx.sparse_batch = 64
        dev = ctx.eval(ids, logits_all=True).copy()
        st = ctx.stats()
    np.testing.assert_allclose(dev, cpu, rtol=1e-5, atol=1e-5)
    assert st["input_sparse"]["attention_inputs"] == 0 and st["input_sparse"]["head_inputs"] == 0


def _file_tensors(path):
    """The file's tensors as float arrays in their logical shape (rows first)."""
    from powerinfer_cpp.gguf_write import decode_matrix
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(v) for v in reversed(t.shape))
        a = np.asarray(t.data)
        out[t.name] = (decode_matrix(a, t.tensor_type, shape) if len(shape) == 2 else a).astype(np.float64)
    return out


def _profile(path, ids, window, ffn="file", record_ffn=False):
    """profile_inputs in the file's mode (ffn), or gh_eval_profile with the FFN's input
    recorded too (record_ffn, one window); the recorded inputs and the stats."""
    from powerinfer_cpp.sparse.profile import profile_inputs
    with Model(path, n_ctx=window, n_threads=1, cache_type="f32") as m:
        ctx = m.create_context(n_ctx=window, n_threads=1, cache_type="f32", ffn=ffn)
        ctx.sparse_batch = window
        if not record_ffn:
            rec = profile_inputs(ctx, ids, window)
        else:
            info = m.info
            n, dq = len(ids), info.n_head * info.head_dim
            x = np.empty((info.n_layer, n, info.n_embd), np.float32)
            rec = (np.empty((info.n_layer, n, info.n_embd), np.float32),
                   np.empty((info.n_layer, n, dq), np.float32), np.empty((n, info.n_embd), np.float32))
            with ctx._calling() as ptr:
                bufs = ffi.new("gh_profile_bufs *", {"ffn_in": fptr(x), "attn_in": fptr(rec[0]),
                                                     "attn_out_in": fptr(rec[1]),
                                                     "head_in": fptr(rec[2])})
                check(lib.gh_eval_profile(ptr, ffi.from_buffer("int32_t[]", np.asarray(ids, np.int32)), n,
                                          bufs))
        st = ctx.stats()
        ctx.close()
    return rec, st


def test_profile_records_the_sparse_mode_inputs(files):
    """Without the FFN's recording, a profile runs the file's sparse mode and records the
    inputs each input-sparse site compares with its thresholds there: the runtime's used
    counts follow from them, o's input of a lone token is the v the sparse q/k/v projection
    makes (numpy), the head's reproduces the sparse forward's logits, and they differ from the
    dense mode's. Recording the FFN's input forces the dense path."""
    path, ids = files["path"], files["later"][:64]
    w = _file_tensors(path)
    thr = {(s, l): w[F.input_sparse_tensor_name(k, l)] for l in range(4)
           for s, k in (("qkv", F.T_ATTN_QKV_IN_THR), ("o", F.T_ATTN_OUTPUT_IN_THR))}
    thr_head = w[F.input_sparse_tensor_name(F.T_OUTPUT_IN_THR)]
    (a_in, a_out, h_in), st = _profile(path, ids, 64)
    assert st["ffn_mode"] == "gate" and st["n_sparse_tokens"] == 64
    used = sum(int((np.abs(x) > thr[(s, l)]).sum()) for l in range(4) for s, x in (("qkv", a_in[l]), ("o", a_out[l])))
    assert st["input_sparse"]["attention_inputs_used"] == used
    assert st["input_sparse"]["head_inputs_used"] == int((np.abs(h_in[-1]) > thr_head).sum())  # the last token's
    (d_in, d_out, d_head), st_d = _profile(path, ids, 64, ffn="dense")
    assert st_d["input_sparse"]["attention_inputs"] == 0
    np.testing.assert_array_equal(a_in[0], d_in[0])  # the embedding: no site before it
    for l in range(4):
        assert not np.allclose(a_out[l], d_out[l], rtol=1e-3, atol=1e-3), l
    assert not np.allclose(h_in, d_head, rtol=1e-3, atol=1e-3)
    # the head: the sparse forward's logits of the last token from its recorded input
    head_t = w[F.input_sparse_tensor_name(F.T_OUTPUT_T)]
    keep = np.abs(h_in[-1]) > thr_head
    with Model(path, n_ctx=64, n_threads=1, cache_type="f32") as m:
        ctx = m.create_context(n_ctx=64, n_threads=1, cache_type="f32", ffn="file")
        ctx.sparse_batch = 64
        logits = ctx.eval(ids, logits_all=False).copy().reshape(-1)
        ctx.close()
    ref = h_in[-1][keep].astype(np.float64) @ head_t[keep]
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # o's input at position 0 (windows of one token): each head's v from the used inputs
    (b_in, b_out, _), _ = _profile(path, ids[:8], 1)
    n_head, n_kv, hd = 8, 4, 32
    qkv_t = w[F.input_sparse_tensor_name(F.T_ATTN_QKV_T, 0)]
    for t in range(8):
        keep = np.abs(b_in[0][t]) > thr[("qkv", 0)]
        v = (b_in[0][t][keep].astype(np.float64) @ qkv_t[keep])[n_head * hd + n_kv * hd:]
        ref = np.repeat(v.reshape(n_kv, hd), n_head // n_kv, axis=0).reshape(-1)
        np.testing.assert_allclose(b_out[0][t], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the FFN's input recorded: dense throughout, the same inputs as the dense mode's
    (f_in, f_out, f_head), st_f = _profile(path, ids, 64, record_ffn=True)
    assert st_f["n_sparse_tokens"] == 0 and st_f["input_sparse"]["attention_inputs"] == 0
    np.testing.assert_array_equal(f_out, d_out)
    np.testing.assert_array_equal(f_head, d_head)


def test_refit_passes_reach_the_target(files, tmp_path):
    """Near the target (the file's thresholds, refit on other tokens) one profile pass leaves
    every site within the refit's tolerance when a fresh pass measures it on the same tokens
    (the sites before it having moved too); from far off (every criterion threshold x1.3) the
    second pass refits again where the first fell short and reaches it too."""
    import copy

    from powerinfer_cpp.sparse.input_eval import REFIT_TOL, refit, site_shares

    ids = files["later"][1024:1536]
    for scale, passes in ((1.0, 1), (1.3, 2)):
        path = tmp_path / f"refit-{scale}.gguf"
        shutil.copy(files["path"], path)
        cal = copy.deepcopy(files["rep"].input_calibration)
        for key in cal.keys():
            cal.set_t(key, cal.t[key] * scale)
        assert refit(str(path), cal, ids, 256, 1, max_passes=2 if scale > 1 else 1) == passes
        shares = site_shares(str(path), ids, 256, cal, 1)
        assert set(shares) == set(cal.sparse_mode) == set(cal.keys())
        for key, v in shares.items():
            assert abs(v - S_IN) <= REFIT_TOL, (scale, key, v, cal.sparse_mode[key])
        if scale > 1:
            assert min(before for before, _ in cal.sparse_mode.values()) > S_IN + 0.05


def test_bad_thresholds_are_refused(files, tmp_path):
    from gguf_rewrite import rewrite_gguf
    bad = tmp_path / "negative.gguf"
    name = F.input_sparse_tensor_name(F.T_ATTN_OUTPUT_IN_THR, 2)
    rewrite_gguf(files["path"], bad, tensors={name: lambda a: np.where(np.arange(a.size) == 7, -1.0, a)})
    with pytest.raises(NativeError, match=r"blk\.2\.attn_output_in_thr': entry 7 is -1"):
        Model(bad, n_ctx=16)


def test_cli(tmp_path):
    from powerinfer_cpp.convert import main
    base = [str(SHIPPED_SWIGLU_DIR), "-q", "--threads", "1", "--calib-tokens", "512", "--sparsity", "0.5"]
    assert main(base + ["-o", str(tmp_path / "a.gguf"), "--input-criterion", "wina"]) == 1
    assert main(base + ["-o", str(tmp_path / "a.gguf"), "--input-sparsity", "1.5"]) == 1
    assert not (tmp_path / "a.gguf").exists()
    out = tmp_path / "m.gguf"
    assert main(base + ["-o", str(out), "--input-sparsity", "0.3", "--input-criterion", "magnitude"]) == 0
    r = gguf.GGUFReader(out)
    assert str(bytes(r.fields[F.KEY_INPUT_CRITERION].parts[-1]), "utf-8") == "magnitude"
    assert abs(float(r.fields[F.KEY_INPUT_SPARSITY].parts[-1][0]) - 0.3) < 1e-6
    thr = {t.name: np.asarray(t.data) for t in r.tensors if t.name.endswith("_in_thr")}
    assert len(thr) == 2 * 4 + 1 and all(np.all(v == v[0]) for v in thr.values())  # one value per site
    from powerinfer_cpp.inspect import describe
    assert "input sparsity: attention q/k/v, o and head, criterion magnitude, target 0.3" in describe(out)
    # --no-input-refit keeps the dense-mode fit: the sites whose inputs the sparse modes
    # change (o, later layers, the head) get other thresholds than the refit gave them
    plain = tmp_path / "plain.gguf"
    assert main(base + ["-o", str(plain), "--input-sparsity", "0.3", "--input-criterion", "magnitude",
                        "--no-input-refit"]) == 0
    thr_plain = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(plain).tensors if t.name.endswith("_in_thr")}
    assert thr_plain.keys() == thr.keys()
    assert any(not np.array_equal(thr_plain[n], thr[n]) for n in thr)
