"""tools/moefy.py: a dense llama file split into a mixture of experts (MoEfication), run by
the runtime as the Mixtral layout it writes.

- With every expert selected (top-k = E) the MoE file's logits are the dense file's within
  a stated bound: the dense FFN is exactly the sum of its experts, and the stored router
  makes each expert's weight k * softmax over the chosen = 1 within --flat (module doc).
- The experts partition the dense FFN's neurons: each neuron's gate/up rows and down
  column in exactly one expert, bit for bit.
- With top-k < E the runtime's expert choices are numpy's top k of the stored router on
  the runtime's own FFN inputs (its profile of the MoE file), and so are
  tools/moe_cache_sim.py routed_on's (--route-on).
- A second k's file differs only in expert_used_count and expert_weights_scale.
- Files it cannot split are refused by name."""

from __future__ import annotations


import gguf
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import make_hf_model  # noqa: E402

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.gguf_write import ConvertError  # noqa: E402
from powerinfer_cpp.sparse.experts import selection_trace  # noqa: E402
from powerinfer_cpp.sparse.profile import profile_model  # noqa: E402
from conftest import REPO_DIR, load_tool  # noqa: E402

N_EXPERT = 4
N_POS = 24


moefy = load_tool("moefy.py")


def _sim():
    return load_tool("moe_cache_sim.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moefy")
    hf = make_hf_model("llama", d / "hf", seed=5)
    dense = convert(hf, d / "dense.gguf", "f32", progress=False)
    with Model(dense, n_ctx=16) as m:
        calib = m.tokenize(open(REPO_DIR / "models/tiny-relu-kjv/heldout.txt", encoding="utf-8").read())[:1024]
        vocab = m.n_vocab
    ids = [int(t) for t in np.random.default_rng(3).integers(3, vocab, size=N_POS)]
    # --flat 1e-5: all-experts weights 1 within ~1e-5 (the test of the split, not of eps)
    tight = moefy.moefy(str(dense), str(d / "tight.gguf"), calib, N_EXPERT, [N_EXPERT], flat=1e-5,
                        outtype="f32", n_threads=2, n_ctx=128, log=lambda *_: None)
    out = moefy.moefy(str(dense), str(d / "moe.gguf"), calib, N_EXPERT, [2, N_EXPERT],
                      outtype="f32", n_threads=2, n_ctx=128, log=lambda *_: None)
    return {"dense": str(dense), "tight": tight[0], "top2": out[0], "all": out[1], "ids": ids, "calib": calib}


def logits(path, ids):
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        return m.context.eval(ids, logits_all=True)


@pytest.mark.parametrize("which,bound", [("tight", 1e-4), ("all", 2e-3)])
def test_all_experts_equal_the_dense_model(files, which, bound):
    """Rounding (the experts' partial sums add in another order) and weights 1 within
    --flat: 1e-5 (tight) holds the architecture rows' 1e-4 of the logit range; the
    default 1e-3 moves each FFN output by up to 0.1%, within 2e-3 of the range."""
    ref = logits(files["dense"], files["ids"])
    got = logits(files[which], files["ids"])
    span = float(ref.max() - ref.min())
    assert np.abs(got - ref).max() <= bound * span


def _tensors(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: np.asarray(t.data, np.float32) for t in r.tensors}


def test_experts_partition_the_dense_ffn(files):
    _, dense = _tensors(files["dense"])
    r, moe = _tensors(files["all"])
    assert int(r.fields["llama.expert_count"].contents()) == N_EXPERT
    n_layer = sum(1 for n in dense if n.endswith("ffn_up.weight"))
    for l in range(n_layer):
        up, gate, down = (dense[f"blk.{l}.ffn_{k}.weight"] for k in ("up", "gate", "down"))
        eu, eg, ed = (moe[f"blk.{l}.ffn_{k}_exps.weight"] for k in ("up", "gate", "down"))
        ff = up.shape[0]
        d, ffe = up.shape[1], ff // N_EXPERT
        assert eu.shape == (N_EXPERT, ffe, d) and ed.shape == (N_EXPERT, d, ffe)
        # each expert row is one dense neuron: find it by its up row, then gate and down agree
        rows = eu.reshape(ff, -1)
        where = [int(np.flatnonzero((up == row).all(axis=1))[0]) for row in rows]
        assert sorted(where) == list(range(ff))
        np.testing.assert_array_equal(eg.reshape(ff, -1), gate[where])
        np.testing.assert_array_equal(ed.transpose(0, 2, 1).reshape(ff, -1), down[:, where].T)
        assert f"blk.{l}.ffn_up.weight" not in moe


def test_top_k_choices_are_the_routers(files):
    r, moe = _tensors(files["top2"])
    assert int(r.fields["llama.expert_used_count"].contents()) == 2
    assert float(r.fields["llama.expert_weights_scale"].contents()) == 2.0
    prof = profile_model(files["top2"], files["ids"], n_ctx=64, n_threads=2, progress=False)
    chosen = selection_trace(files["top2"], files["ids"], n_ctx=64, n_threads=2)  # [tok, layer, E]
    routed = _sim().routed_on(files["top2"], files["top2"], files["ids"], 64)
    decided = 0
    for l in range(prof.n_layer):
        s = prof.x[l].astype(np.float64) @ moe[f"blk.{l}.ffn_gate_inp.weight"].astype(np.float64).T
        order = np.argsort(-s, axis=1, kind="stable")
        srt = np.take_along_axis(s, order, 1)
        # the runtime ranks float32 softmax values: a 2nd/3rd gap under 1e-3 of the logits'
        # spread may fall either way (module doc of moefy: resolution ~6e-5 of it)
        clear = srt[:, 1] - srt[:, 2] > 1e-3 * (srt[:, 0] - srt[:, -1])
        want = np.zeros_like(chosen[:, l])
        np.put_along_axis(want, order[:, :2], True, 1)
        np.testing.assert_array_equal(chosen[clear, l], want[clear])
        np.testing.assert_array_equal(routed[:, l], want)  # moe_cache_sim --route-on's choices
        decided += int(clear.sum())
    assert decided >= 0.9 * prof.n_layer * len(files["ids"])


def test_second_k_differs_only_in_its_keys(files):
    ra, rb = gguf.GGUFReader(files["all"]), gguf.GGUFReader(files["top2"])
    diff = {k for k in ra.fields if k in rb.fields and not k.startswith("GGUF.")
            and ra.fields[k].contents() != rb.fields[k].contents()}
    assert diff == {"llama.expert_used_count", "llama.expert_weights_scale"}
    for ta, tb in zip(ra.tensors, rb.tensors):
        assert ta.name == tb.name and np.array_equal(np.asarray(ta.data), np.asarray(tb.data))


def test_refusals_name_the_problem(files, tmp_path):
    with pytest.raises(ConvertError, match="already a mixture of experts"):
        moefy.moefy(files["top2"], str(tmp_path / "x.gguf"), files["calib"], 2, [1], log=lambda *_: None)
    with pytest.raises(ValueError, match="does not split into 3 equal experts"):
        moefy.moefy(files["dense"], str(tmp_path / "x.gguf"), files["calib"], 3, [1], log=lambda *_: None)
    with pytest.raises(ValueError, match="top-k 5 outside"):
        moefy.moefy(files["dense"], str(tmp_path / "x.gguf"), files["calib"], N_EXPERT, [5], log=lambda *_: None)



def test_random_router_copy_replaces_only_the_routers(files, tmp_path):
    out = moefy.random_router_copy(files["top2"], str(tmp_path / "ctl.gguf"), seed=1)
    ra, rb = gguf.GGUFReader(files["top2"]), gguf.GGUFReader(out)
    for ta, tb in zip(ra.tensors, rb.tensors):
        a, b = np.asarray(ta.data), np.asarray(tb.data)
        if ta.name.endswith("ffn_gate_inp.weight"):
            assert not np.array_equal(a, b) and np.linalg.norm(b) == pytest.approx(np.linalg.norm(a), rel=1e-5)
        else:
            assert np.array_equal(a, b)
    with Model(out, n_ctx=16) as m:  # still a file the runtime runs
        assert np.isfinite(m.context.eval(files["ids"][:4])).all()


def test_weight_clustering_and_router_bias(files, tmp_path):
    """--cluster weights and --router-bias: the file (its router bias read by the runtime)
    is the dense model with every expert chosen, and the biased router's top 2 are the
    runtime's choices on clear tokens."""
    out = moefy.moefy(files["dense"], str(tmp_path / "wb.gguf"), files["calib"], N_EXPERT, [N_EXPERT, 2],
                      cluster="weights", router_bias=True, outtype="f32", n_threads=2, n_ctx=128,
                      log=lambda *_: None)
    ref = logits(files["dense"], files["ids"])
    assert np.abs(logits(out[0], files["ids"]) - ref).max() <= 2e-3 * float(ref.max() - ref.min())
    assert any(t.name.endswith("ffn_gate_inp.bias") for t in gguf.GGUFReader(out[1]).tensors)
    chosen = selection_trace(out[1], files["ids"], n_ctx=64, n_threads=2)
    routed = _sim().routed_on(out[1], out[1], files["ids"], 64)
    assert (chosen == routed).all(axis=2).mean() >= 0.9  # near-ties aside (see above)
