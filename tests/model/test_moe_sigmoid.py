"""DeepSeek-V3's sigmoid router (glm4moe, dots1; ffn/moe.c route), beyond the architecture
table (test_architectures.py: logits against transformers in f32 and quantized, greedy text,
batches):

- the experts chosen are transformers' (its routers' own indices, caught by hooks), the
  leading dense layers choose none;
- the selection bias, the group limit, the renormalisation and the scale each move the
  logits (the tiny models route for real: hf_models.sigmoid_router);
- exact ties (equal router rows, equal groups) resolve as torch.topk resolves them;
- any batch split equals token by token;
- llama.cpp's file (its keys only, GLM's prediction layer kept as blk.N..) runs alike; a
  checkpoint's prediction layer is left out by the converter;
- bad files and configs refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batch_util import check_splits_equal_tokens  # noqa: E402
from gguf import GGUFValueType as VT  # noqa: E402
from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import hf_reference_model, make_hf_model  # noqa: E402

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp.convert import ConvertError, convert  # noqa: E402

torch.set_num_threads(1)

N_POS = 24


@pytest.fixture(scope="module", params=["glm4moe", "dots1"])
def case(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(variant)
    hf = make_hf_model(variant, d / "hf", seed=7)
    path = convert(hf, d / "f32.gguf", "f32", progress=False)
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 384, size=N_POS)]
    return {"variant": variant, "hf": hf, "gguf": path, "ids": ids, "dir": d, "arch": variant[:7].rstrip("-")}


def _logits(path, ids):
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        return m.eval(ids, logits_all=True).astype(np.float64)


def hf_choices(hf_dir, ids) -> dict[int, np.ndarray]:
    """Layer -> the experts transformers' sigmoid router picks for each token [n_tok, k]
    (the router's own top-k indices), for the layers that have experts."""
    ref = hf_reference_model(hf_dir)
    got = {}
    hooks = []
    for il, layer in enumerate(ref.model.layers):
        router = getattr(layer.mlp, "gate", None)
        if router is None or not hasattr(router, "e_score_correction_bias"):
            continue
        hooks.append(router.register_forward_hook(
            lambda mod, inp, out, il=il: got.__setitem__(il, out[2].numpy().copy())))
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return got


def _counts(path, ids):
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        ctx = m.context
        ctx.eval(ids)
        return ctx.expert_counts(), m.info


def test_expert_counts_are_transformers_choices(case):
    counts, info = _counts(case["gguf"], case["ids"])
    choices = hf_choices(case["hf"], case["ids"])
    want = np.zeros_like(counts)
    for il, c in choices.items():
        want[il] = np.bincount(c.reshape(-1), minlength=info.n_expert)
    np.testing.assert_array_equal(counts, want)
    lead = json.loads((case["hf"] / "config.json").read_text())["first_k_dense_replace"]
    assert not counts[:lead].any() and (counts[lead:].sum(axis=1) == N_POS * info.n_expert_used).all()


def test_router_features_move_the_logits(case):
    """Without the selection bias, the group limit, the renormalisation or the scale the
    logits move: each is read and applied."""
    src, d, A, ids = case["gguf"], case["dir"], case["arch"], case["ids"]
    base = _logits(src, ids)
    cut = {
        "exp_probs_b": dict(tensors={"blk.1.exp_probs_b.bias": lambda a: a * 0}),
        "groups": dict(kv={f"{A}.expert_group_count": (1, VT.UINT32),
                           f"{A}.expert_group_used_count": (1, VT.UINT32)}),
        "norm": dict(kv={f"{A}.expert_weights_norm": (False, VT.BOOL)}),
        "scale": dict(kv={f"{A}.expert_weights_scale": (1.0, VT.FLOAT32)}),
    }
    for name, kw in cut.items():
        got = _logits(rewrite_gguf(src, d / f"no-{name}.gguf", **kw), ids)
        moved = np.abs(got - base).max() / np.ptp(base)
        print(f"{case['variant']} without {name}: logits move {moved:.3f} of their range")
        assert moved > 5e-4, name


def test_any_batch_split_equals_token_by_token(case):
    check_splits_equal_tokens(case["gguf"], case["ids"])


def test_ties_resolved_as_transformers(tmp_path):
    """Groups 0 and 1 made identical (router rows and selection biases), and experts 4 and 5
    alike: every score ties with its twin, so which group and expert survive each cut is
    torch.topk's resolution of equal values (not the lower id); the choices and the logits
    are transformers'."""
    from safetensors.numpy import load_file, save_file

    src = make_hf_model("glm4moe", tmp_path / "src", seed=6)
    d = tmp_path / "tie"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    for k in [k for k in sd if k.endswith("mlp.gate.weight") or k.endswith("e_score_correction_bias")]:
        sd[k] = sd[k].copy()
        sd[k][2:4] = sd[k][0:2]
        sd[k][5] = sd[k][4]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    path = convert(d, tmp_path / "tie.gguf", "f32", progress=False)
    ids = list(range(3, 3 + N_POS))
    counts, info = _counts(path, ids)
    choices = hf_choices(d, ids)
    asym = sum(int(((c < 2).any(axis=1) != ((c >= 2) & (c < 4)).any(axis=1)).sum()) +
               int(((c == 4).any(axis=1) != (c == 5).any(axis=1)).sum()) for c in choices.values())
    assert asym > 0  # some tie met at a cut, and resolved one way
    want = np.zeros_like(counts)
    for il, c in choices.items():
        want[il] = np.bincount(c.reshape(-1), minlength=info.n_expert)
    np.testing.assert_array_equal(counts, want)
    with torch.no_grad():
        ref = hf_reference_model(d)(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(_logits(path, ids) - ref).max() <= 1e-4 * np.ptp(ref)


def _nextn_layer(n_layer: int, d: int) -> dict:
    """GLM-4.5's multi-token prediction layer as llama.cpp keeps it (blk.n_layer: its own
    block and the nextn.* tensors), random: nobody may read it."""
    rng = np.random.default_rng(3)
    b = f"blk.{n_layer}."
    shapes = {"attn_norm.weight": (d,), "attn_q.weight": (d, d), "post_attention_norm.weight": (d,),
              "nextn.eh_proj.weight": (d, 2 * d), "nextn.enorm.weight": (d,), "nextn.hnorm.weight": (d,),
              "nextn.shared_head_norm.weight": (d,)}
    return {b + k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_llama_cpp_file(case):
    """llama.cpp's file: its keys only (none of ours, no expert_shared_feed_forward_length:
    the width follows expert_shared_count); GLM's with block_count counting the prediction
    layer (nextn_predict_layers) whose tensors follow: the same logits. That layer read as
    one of the model's (no nextn_predict_layers) is refused by its first missing tensor."""
    src, d, ids, A = case["gguf"], case["dir"], case["ids"], case["arch"]
    drop = ["powerinfer.format_version", "powerinfer.ffn_activation", "powerinfer.hf_hidden_act",
            f"{A}.expert_shared_feed_forward_length"]
    glm = A == "glm4moe"
    extra = dict(add=_nextn_layer(2, 64), kv={"glm4moe.block_count": (3, VT.UINT32),
                                               "glm4moe.nextn_predict_layers": (1, VT.UINT32)}) if glm else {}
    lcpp = rewrite_gguf(src, d / "lcpp.gguf", drop_kv=drop, **extra)
    np.testing.assert_array_equal(_logits(lcpp, ids), _logits(src, ids))
    with Model(lcpp) as m:
        info = m.info
        assert (info.arch, info.n_layer, info.n_expert, info.n_ff_shexp) == (A, 2, 8, 32)
    if glm:
        bad = rewrite_gguf(lcpp, d / "lcpp-no-nextn.gguf", drop_kv=["glm4moe.nextn_predict_layers"])
        with pytest.raises(NativeError, match=r"blk\.2\.attn_k\.weight"):
            Model(bad)


BAD = {
    "no-probs-b": (dict(drop=["blk.1.exp_probs_b.bias"]),
                   r"missing tensor 'blk\.1\.exp_probs_b\.bias' \(architecture 'glm4moe' chooses its experts "
                   r"by sigmoid score plus this bias: \[8\] values\)"),
    "probs-b-shape": (dict(tensors={"blk.1.exp_probs_b.bias": lambda a: a[:6]}),
                      r"tensor 'blk\.1\.exp_probs_b\.bias' has shape \[6, 1, 1, 1\], expected \[8, 1\]"),
    "gating": (dict(kv={"glm4moe.expert_gating_func": (3, VT.UINT32)}),
               r"key 'glm4moe\.expert_gating_func' = 3: only the softmax \(1\) and sigmoid \(2\)"),
    "groups": (dict(kv={"glm4moe.expert_group_count": (3, VT.UINT32),
                        "glm4moe.expert_group_used_count": (1, VT.UINT32)}),
               r"key 'glm4moe\.expert_group_count' = 3: the 8 experts \(glm4moe\.expert_count\) must split"),
    "groups-used": (dict(kv={"glm4moe.expert_group_used_count": (5, VT.UINT32)}),
                    r"key 'glm4moe\.expert_group_used_count' = 5 is out of range \(must be 1 to 4\)"),
    "capacity": (dict(kv={"glm4moe.expert_group_used_count": (1, VT.UINT32),
                          "glm4moe.expert_used_count": (3, VT.UINT32)}),
                 r"key 'glm4moe\.expert_used_count' = 3 is more than the 2 experts of the 1 groups kept"),
    "router-in-dense": (dict(add={"blk.0.ffn_gate_inp.weight": np.zeros((8, 64), np.float32)}),
                        r"tensor 'blk\.0\.ffn_gate_inp\.weight' in layer 0, a dense layer "
                        r"\(glm4moe\.leading_dense_block_count = 1\)"),
    "lead": (dict(kv={"glm4moe.leading_dense_block_count": (2, VT.UINT32)}),
             r"tensor 'blk\.1\.ffn_gate_inp\.weight' in layer 1, a dense layer"),
    "no-dense": (dict(kv={"glm4moe.leading_dense_block_count": (0, VT.UINT32)}),
                 r"tensor 'blk\.0\.ffn_gate\.weight' in a mixture-of-experts layer"),
    "shared-count": (dict(kv={"glm4moe.expert_shared_count": (2, VT.UINT32)},
                          drop_kv=["glm4moe.expert_shared_feed_forward_length"]),
                     r"blk\.1\.ffn_gate_shexp\.weight"),
    "shared-gate": (dict(add={"blk.1.ffn_gate_inp_shexp.weight": np.zeros(64, np.float32)}),
                    r"tensor 'blk\.1\.ffn_gate_inp_shexp\.weight': architecture 'glm4moe' adds its shared "
                    r"experts unweighted"),
    "rope-dim": (dict(kv={"glm4moe.rope.dimension_count": (7, VT.UINT32)}),
                 r"key 'glm4moe\.rope\.dimension_count' = 7 \(must be even, 2 to the head size 16\)"),
    "qk-norm-one-layer": (dict(add={"blk.1.attn_q_norm.weight": np.ones(16, np.float32),
                                    "blk.1.attn_k_norm.weight": np.ones(16, np.float32)}),
                          r"tensor 'blk\.1\.attn_q_norm\.weight' but layer 0 has no q/k norms"),
    "nextn": (dict(kv={"glm4moe.nextn_predict_layers": (2, VT.UINT32)}),
              r"key 'glm4moe\.nextn_predict_layers' = 2 is out of range \(must be 0 to 1\)"),
}


@pytest.fixture(scope="module")
def glm_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-glm")
    hf = make_hf_model("glm4moe", d / "hf", seed=1)
    return convert(hf, d / "f32.gguf", "f32", progress=False), d


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_glm4moe_files(glm_gguf, bad):
    src, d = glm_gguf
    kw, match = BAD[bad]
    with pytest.raises(NativeError, match=match):
        Model(rewrite_gguf(src, d / f"{bad}.gguf", **kw))


def test_partial_rope_with_yarn_refused(glm_gguf):
    """YaRN's ramp over part of the head is not computed here: refused by key."""
    src, d = glm_gguf
    with pytest.raises(NativeError, match=r"YaRN RoPE scaling over part of the head \(glm4moe\.rope\."
                                          r"dimension_count = 8 of 16\)"):
        Model(rewrite_gguf(src, d / "yarn.gguf", kv={
            "glm4moe.rope.scaling.type": ("yarn", VT.STRING), "glm4moe.rope.scaling.factor": (4.0, VT.FLOAT32),
            "glm4moe.rope.scaling.original_context_length": (32, VT.UINT32)}))


def _edit(hf, tmp_path, name, **upd):
    d = tmp_path / name
    shutil.copytree(hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(upd)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_config_refusals(tmp_path):
    hf = make_hf_model("glm4moe", tmp_path / "hf", seed=3)
    cases = {
        "capacity": (dict(topk_group=1, num_experts_per_tok=3),
                     r"num_experts_per_tok=3 is more than the 2 experts of the topk_group=1 groups kept"),
        "groups": (dict(n_group=3), r"n_routed_experts=8 must split into n_group=3 groups"),
        "topk-group": (dict(topk_group=5), r"topk_group=5 is more than n_group=4"),
        "partial": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2}),
                    r"partial_rotary_factor=0\.2 must be in \(0, 1\] and rotate an even number"),
        "act": (dict(hidden_act="gelu"), r"hidden_act 'gelu' \(the experts run SwiGLU\)"),
        "lead": (dict(first_k_dense_replace=3), r"'first_k_dense_replace' must be 0 to num_hidden_layers=2"),
    }
    for name, (upd, match) in cases.items():
        with pytest.raises(ConvertError, match=match):
            convert(_edit(hf, tmp_path, name, **upd), tmp_path / f"{name}.gguf", "f32", progress=False)
    from powerinfer_cpp.sparse.pipeline import SparseOptions

    # sparse experts are made (tests/sparse/test_moe_sparse_sigmoid.py), but SwiGLU experts
    # have no exact zeros: a level is needed
    with pytest.raises(ConvertError, match=r"a mixture of silu experts has no exact zeros: pass --sparsity S"):
        convert(hf, tmp_path / "sparse.gguf", "f32", progress=False, sparse=True,
                sparse_options=SparseOptions())
    assert not (tmp_path / "sparse.gguf").exists()
    dots = make_hf_model("dots1-top1", tmp_path / "dots", seed=3)
    with pytest.raises(ConvertError, match=r"attention_bias=true \(biased q/k/v/o projections"):
        convert(_edit(dots, tmp_path, "bias", attention_bias=True), tmp_path / "b.gguf", "f32", progress=False)
    with pytest.raises(ConvertError, match=r"sliding_window=16 < max_position_embeddings=128 in layers 1"):
        convert(_edit(dots, tmp_path, "swa", sliding_window=16, max_window_layers=1,
                      layer_types=["full_attention", "sliding_attention"]),
                tmp_path / "s.gguf", "f32", progress=False)


def test_checkpoint_prediction_layer_left_out(tmp_path):
    """A GLM-4.5 checkpoint carries its prediction layer as model.layers.num_hidden_layers..
    (num_nextn_predict_layers of them): the converter leaves it out, so the file is the same;
    without the key those tensors are unexpected."""
    from safetensors.numpy import load_file, save_file

    hf = make_hf_model("glm4moe", tmp_path / "hf", seed=4)
    base = convert(hf, tmp_path / "base.gguf", "f32", progress=False)
    d = tmp_path / "mtp"
    shutil.copytree(hf, d)
    sd = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(0)
    for k in [k for k in sd if k.startswith("model.layers.1.")]:
        sd[k.replace("model.layers.1.", "model.layers.2.")] = rng.standard_normal(sd[k].shape).astype(np.float32)
    sd["model.layers.2.eh_proj.weight"] = rng.standard_normal((64, 128)).astype(np.float32)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    ids = list(range(3, 3 + N_POS))
    np.testing.assert_array_equal(_logits(convert(d, tmp_path / "mtp.gguf", "f32", progress=False), ids),
                                  _logits(base, ids))
    no_key = _edit(d, tmp_path, "no-key", num_nextn_predict_layers=0)
    with pytest.raises(ConvertError, match=r"unexpected tensors .*model\.layers\.2\."):
        convert(no_key, tmp_path / "nokey.gguf", "f32", progress=False)


@pytest.mark.parametrize("which", ["none", "all", "n_cpu_moe", "some+cache"])
def test_host_device_equals_cpu(case, which):
    """On the host-device backend (the placement and the expert cache of test_moe_device.py)
    the leading dense layers have no experts to place (nor shared ones): the rest are placed,
    cached or left on the CPU, and the logits and the experts chosen are the CPU's."""
    ids = case["ids"]
    with Model(case["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        want = m.context.eval(ids, logits_all=True)
        want_counts = m.context.expert_counts()
    with Model(case["gguf"], device="host-device") as m:
        info = m.device_info()
        n_moe = (want_counts.sum(axis=1) > 0).sum()
        assert info["experts"]["n_experts"] == info["experts"]["device"] == n_moe * m.info.n_expert
        # (the shared experts, every token's, are placed before the routed ones)
        eb = info["experts"]["bytes"] // info["experts"]["device"]
        dense = info["dense_bytes"] + info["experts"]["shared_bytes"]
        assert info["experts"]["shared_device"] == n_moe  # one per layer with experts
    kw = {"none": dict(vram_budget=dense), "all": dict(), "n_cpu_moe": dict(n_cpu_moe=2),
          "some+cache": dict(vram_budget=dense + 4 * eb, expert_cache=2 * eb)}[which]
    with Model(case["gguf"], n_ctx=64, cache_type="f32", n_threads=2, device="host-device", **kw) as m:
        ctx = m.create_context(n_ctx=64, cache_type="f32", n_threads=2)
        whole = ctx.eval(ids, logits_all=True)
        one = m.create_context(n_ctx=64, cache_type="f32", n_threads=2)
        steps = np.stack([one.eval([t]) for t in ids])
        on = m.expert_placement()
        np.testing.assert_array_equal(ctx.expert_counts(), want_counts)
    scale = np.ptp(want)
    for got in (whole, steps):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    lead = (want_counts.sum(axis=1) == 0)
    assert not on[lead].any()
    if which == "all":
        assert on[~lead].all()
    elif which == "n_cpu_moe":
        assert not on.any()  # the first 2 layers: the dense one and the only mixture
    elif which == "none":
        assert not on.any()
    else:
        assert on.sum() == 2


# profiling runs 512-token windows, past the tiny models' 128-token context: said, harmless here
@pytest.mark.filterwarnings("ignore:n_ctx = 512 is larger:RuntimeWarning")
def test_place_profiles_and_places_past_the_dense_layers(case, tmp_path):
    """`place --profile` over a model with a leading dense layer: that layer has no experts
    to count or place (frequencies 0, nothing on the device), the mixture's most chosen
    experts go to the device, and the placed model computes the CPU's logits."""
    from conftest import REPO_DIR
    from powerinfer_cpp.place import main

    src = shutil.copy(case["gguf"], tmp_path / "m.gguf")
    calib = str(REPO_DIR / "models" / "tiny-relu-kjv" / "heldout.txt")
    assert main([str(src), "--vram-budget", "300K", "--profile", calib]) == 0
    ids = case["ids"]
    with Model(src, n_ctx=64, cache_type="f32", n_threads=2, device="host-device", vram_budget=300 * 1024) as m:
        on, info = m.expert_placement(), m.device_info()["experts"]
        got = m.eval(ids, logits_all=True)
    with Model(case["gguf"], n_ctx=64, cache_type="f32", n_threads=2) as m:
        want = m.eval(ids, logits_all=True)
    assert info["source"] == "file" and not on[0].any() and on[1].any(), (info, on)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.ptp(want))
