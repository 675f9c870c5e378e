"""Mixture-of-experts models on a device (model/placement.c's expert placement, ffn/moe.c's
device half and expert cache), on the host-device backend, against the CPU-only runtime:

- any placement (no experts, some, all, n_cpu_moe, the expert cache, cache and placed
  experts together) gives the CPU's logits within a tight bound (the host-device's
  reference dot products sum in another order than the CPU kernels) and the same expert
  choices; with no expert on the device the result is the CPU's bit for bit, and an expert
  run from the cache is bit for bit one run from its placed copy;
- the placement keeps to the budget, in the runtime's order (attention, routers, head,
  shared experts, cache, experts), and n_cpu_moe's layers get no routed experts (their
  shared expert is placed all the same); a shared expert on the device or not, with
  routed experts and the cache or not, gives the CPU's logits within the same bound;
- the cache's hits, misses and uploads are those of replaying the selection trace
  (sparse/experts.py replay_cache);
- place --profile writes a placement the loader uses, which the ILP never makes worse than
  the greedy rule; inspect shows it; bad placement data is refused by name.

The tiny random MoE configs route by random routers over random embeddings: their
selection statistics say nothing about a real model's (docs/BENCHMARKS.md)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf_rewrite import rewrite_gguf  # noqa: E402
from hf_models import make_hf_model  # noqa: E402

from powerinfer_cpp import Model, NativeError  # noqa: E402
from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

torch.set_num_threads(1)

N_POS = 24
CALIB = "models/tiny-relu-kjv/heldout.txt"


@pytest.fixture(scope="module", params=["mixtral", "qwen2moe", "qwen3moe-top1", "olmoe", "gptoss"])
def case(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(variant + "-dev")
    hf = make_hf_model(variant, d / "hf", seed=7)
    path = convert(hf, d / "f32.gguf", "f32", progress=False)
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        ids = [int(t) for t in np.random.default_rng(3).integers(3, m.n_vocab, size=N_POS)]
        ctx = m.context
        whole = ctx.eval(ids, logits_all=True)
        counts = ctx.expert_counts()
    with Model(path, device="host-device") as m:
        info = m.device_info()
        assert info["experts"]["device"] == info["experts"]["n_experts"]  # everything fits
        eb = info["experts"]["bytes"] // info["experts"]["device"]
        n_layer = m.info.n_layer
    ex = info["experts"]
    # a model with shared experts has them all on the device when everything fits
    assert ex["shared_device"] == (n_layer if variant == "qwen2moe" else 0)
    assert (ex["shared_bytes"] > 0) == (variant == "qwen2moe")
    # "dense": everything placed before the routed experts (attention, routers, head, the
    # shared experts); "attn": without the shared experts
    return {"gguf": path, "ids": ids, "whole": whole, "counts": counts,
            "dense": info["dense_bytes"] + ex["shared_bytes"], "attn": info["dense_bytes"],
            "sh": ex["shared_bytes"], "n_layer": n_layer, "eb": eb, "dir": d}


def run(path, ids, **kw):
    """(prompt logits, token-by-token logits, model device info, placement, both contexts'
    stats and expert counts) on host-device."""
    with Model(path, n_ctx=64, cache_type="f32", n_threads=2, device="host-device", **kw) as m:
        ctx = m.create_context(n_ctx=64, cache_type="f32", n_threads=2)
        whole = ctx.eval(ids, logits_all=True)
        one = m.create_context(n_ctx=64, cache_type="f32", n_threads=2)
        steps = np.stack([one.eval([t]) for t in ids])
        return dict(whole=whole, steps=steps, info=m.device_info(), on=m.expert_placement(),
                    st_whole=ctx.stats(), st_steps=one.stats(), counts=ctx.expert_counts(),
                    counts_steps=one.expert_counts())


def placements(c) -> dict[str, dict]:
    d, eb = c["dense"], c["eb"]
    return {
        "none": dict(vram_budget=d),
        "some": dict(vram_budget=d + 3 * eb),
        "all": dict(),
        "n_cpu_moe": dict(n_cpu_moe=1),
        "cache": dict(vram_budget=d + 2 * eb, expert_cache=2 * eb),
        "some+cache": dict(vram_budget=d + 4 * eb, expert_cache=2 * eb),
        # no room for a shared expert (one is two routed experts' bytes in the qwen2moe
        # config): they run on the CPU, beside a cached expert in the second
        "no-shared": dict(vram_budget=c["attn"]),
        "no-shared+cache": dict(vram_budget=c["attn"] + eb, expert_cache=eb),
        # room for the first layer's shared expert only, and a cache of one expert
        "half-shared+cache": dict(vram_budget=c["attn"] + c["sh"] // c["n_layer"] + eb,
                                  expert_cache=eb),
    }


def shared_layers(c, budget) -> int:
    """Layers whose shared expert a budget places: the first ones that fit after attention,
    routers and head."""
    if not c["sh"]:
        return 0
    return c["n_layer"] if budget is None else min(c["n_layer"], (budget - c["attn"]) // (c["sh"] // c["n_layer"]))


@pytest.mark.parametrize("which", ["none", "some", "all", "n_cpu_moe", "cache", "some+cache",
                                   "no-shared", "no-shared+cache", "half-shared+cache"])
def test_host_device_equals_cpu(case, which):
    kw = placements(case)[which]
    r = run(case["gguf"], case["ids"], **kw)
    scale = np.ptp(case["whole"])
    for got in (r["whole"], r["steps"]):
        np.testing.assert_allclose(got, case["whole"], rtol=0, atol=1e-5 * scale)
        assert (got.argmax(1) == case["whole"].argmax(1)).all()
    # the same experts ran for every token
    np.testing.assert_array_equal(r["counts"], case["counts"])
    np.testing.assert_array_equal(r["counts_steps"], case["counts"])

    info, on, ex = r["info"], r["on"], r["info"]["experts"]
    n_layer, n_expert = on.shape
    assert info["used_bytes"] == info["dense_bytes"] + ex["shared_bytes"] + ex["bytes"] \
        <= info["budget"] - ex["cache_bytes"]
    assert ex["device"] == on.sum() and ex["bytes"] == on.sum() * case["eb"]
    # the shared experts (qwen2moe) are on the device unless there is no room for them;
    # n_cpu_moe does not keep them
    want_sh = shared_layers(case, kw.get("vram_budget"))
    if case["sh"]:
        assert want_sh == {"no-shared": 0, "no-shared+cache": 0, "half-shared+cache": 1}.get(which, n_layer)
    assert ex["shared_device"] == want_sh
    assert ex["shared_bytes"] == want_sh * (case["sh"] // n_layer)
    st = r["st_steps"]["experts"]
    # one run per token per chosen expert in a decode
    assert st["runs_device"] + st["runs_cpu"] == N_POS * n_layer * (case["counts"][0].sum() // N_POS)
    pw = r["st_whole"]["experts"]
    assert pw["runs_device"] + pw["runs_cpu"] == (case["counts"] > 0).sum()
    if which in ("none", "no-shared"):
        assert not on.any() and st["runs_device"] == 0
    elif which == "some":
        assert on.sum() == 3 and 0 < st["runs_device"] and 0 < st["runs_cpu"]
        assert ex["source"] == "layer order"  # no frequencies in the file
    elif which == "all":
        assert on.all() and st["runs_cpu"] == 0
    elif which == "n_cpu_moe":
        assert not on[0].any() and on[1:].all()
    else:
        slots = 2 if which in ("cache", "some+cache") else 1
        assert ex["cache_slots"] == slots and ex["cache_bytes"] == slots * case["eb"]
        assert on.sum() == (2 if which == "some+cache" else 0)
        assert st["cache_hits"] + st["cache_misses"] > 0
        assert st["bytes_cache_uploaded"] > 0
        assert st["cache_hit_rate"] == st["cache_hits"] / (st["cache_hits"] + st["cache_misses"])
    if which in ("none", "some", "all", "n_cpu_moe", "no-shared"):
        assert st["cache_hits"] == st["cache_misses"] == st["bytes_cache_uploaded"] == 0


def test_no_device_expert_is_the_cpu_bit_for_bit(case):
    """Nothing on the device (a zero budget): the hybrid expert loop (outputs kept, merged
    in expert order) gives the CPU-only loop's logits exactly."""
    r = run(case["gguf"], case["ids"], vram_budget=0)
    assert r["info"]["used_bytes"] == 0
    np.testing.assert_array_equal(r["whole"], case["whole"])


def test_cached_expert_is_its_placed_copy_bit_for_bit(case):
    """A cache of every expert (nothing placed) runs each expert from the cache with the same
    device kernels as a placed copy: equal bits; every decode lookup after the first few is
    a hit."""
    n_all = int(case["counts"].size)
    cached = run(case["gguf"], case["ids"], vram_budget=case["dense"] + n_all * case["eb"],
                 expert_cache=n_all * case["eb"])
    placed = run(case["gguf"], case["ids"])
    assert not cached["on"].any() and placed["on"].all()
    np.testing.assert_array_equal(cached["whole"], placed["whole"])
    np.testing.assert_array_equal(cached["steps"], placed["steps"])
    st = cached["st_steps"]["experts"]
    assert st["runs_cpu"] == 0 and st["cache_misses"] == (case["counts"] > 0).sum()
    assert st["bytes_cache_uploaded"] == st["cache_misses"] * case["eb"]


def test_cache_counts_are_the_replayed_trace(case):
    """The runtime's LRU cache (and a static part beside it) hits, misses and uploads as
    replay_cache says over the selection trace of the same tokens."""
    from powerinfer_cpp.sparse.experts import replay_cache, selection_trace

    trace = selection_trace(case["gguf"], case["ids"], n_ctx=64)
    assert (trace.sum(axis=2) == case["counts"][0].sum() // N_POS).all()
    np.testing.assert_array_equal(trace.sum(axis=0), case["counts"])
    for kw in (placements(case)["cache"], placements(case)["some+cache"]):
        r = run(case["gguf"], case["ids"], **kw)
        rep = replay_cache(trace, r["on"], r["info"]["experts"]["cache_slots"], "lru")
        st = r["st_steps"]["experts"]
        assert (st["cache_hits"], st["cache_misses"]) == (rep.hits, rep.misses)
        assert (st["runs_device"], st["runs_cpu"]) == (rep.runs_device, rep.runs_cpu)
        assert st["bytes_cache_uploaded"] == rep.uploads * case["eb"]


def test_budget_sweep_keeps_to_the_budget_and_the_order(case):
    d, eb = case["dense"], case["eb"]
    with Model(case["gguf"]) as m:
        n_all = m.info.n_layer * m.info.n_expert
    for budget in (0, d // 3, case["attn"] - 1, case["attn"] + case["sh"] // 2, d - 1, d, d + eb - 1,
                   d + eb, d + 5 * eb + 7, d + n_all * eb):
        for cache in (0, eb, 3 * eb - 1):
            with Model(case["gguf"], device="host-device", vram_budget=budget, expert_cache=cache) as m:
                info = m.device_info()
                ex = info["experts"]
                assert info["used_bytes"] + ex["cache_bytes"] <= budget
                assert info["used_bytes"] == info["dense_bytes"] + ex["shared_bytes"] + ex["bytes"]
                if budget >= case["attn"]:  # the shared experts next, in layer order
                    assert ex["shared_device"] == shared_layers(case, budget)
                else:
                    assert ex["shared_device"] == 0
                if budget >= d:  # attention, routers, head and shared experts all fit first
                    assert info["dense_bytes"] + ex["shared_bytes"] == d and info["head_on_device"]
                    want_slots = min((budget - d) // eb, max(1, cache // eb)) if cache else 0
                    assert ex["cache_slots"] == want_slots
                    assert ex["device"] == min(n_all, (budget - d - want_slots * eb) // eb)
                else:  # the dense parts stop at the first that does not fit; the cache
                    # and experts take what is left
                    left = budget - info["dense_bytes"] - ex["shared_bytes"]
                    assert ex["device"] + ex["cache_slots"] <= left // eb


def test_n_cpu_moe_and_cache_arguments(case):
    with pytest.raises(ValueError, match="n_cpu_moe must be a number of layers >= 0"):
        Model(case["gguf"], device="host-device", n_cpu_moe=-1)
    with pytest.raises(ValueError, match="expert_cache"):
        Model(case["gguf"], device="host-device", expert_cache="lots")
    with Model(case["gguf"], device="host-device", n_cpu_moe=99) as m:  # all layers: none placed
        assert not m.expert_placement().any() and m.device_info()["experts"]["device"] == 0
    with Model(case["gguf"], n_cpu_moe=1, expert_cache="1M") as m:  # the CPU: nothing to place
        assert not m.expert_placement().any()
        assert m.context.stats()["experts"]["runs_device"] == 0


def test_place_profile_writes_the_placement_the_loader_uses(case, tmp_path):
    """place --profile: frequencies from the selection counts over real text, the ILP's
    placement (never worse than greedy) in the side file; the loader places exactly those
    experts (source "file") when they fit, and by those frequencies when they do not; a
    whole file (-o) carries the same."""
    import shutil

    from powerinfer_cpp.inspect import describe
    from powerinfer_cpp.place import main, replace_expert_placement
    from powerinfer_cpp.sparse.experts import profile_experts

    path = str(tmp_path / "m.gguf")
    shutil.copy(case["gguf"], path)
    d, eb = case["dense"], case["eb"]
    pl = replace_expert_placement(path, d + 3 * eb, profile=CALIB, profile_tokens=200, n_ctx=64)
    with Model(path, n_ctx=64) as m:
        ids = m.tokenize(open(CALIB, encoding="utf-8").read())[:200]
        k = m.info.n_expert_used
    freq, n = profile_experts(path, ids, n_ctx=64)
    assert n == 200
    np.testing.assert_allclose(pl.freq, freq)
    np.testing.assert_allclose(freq.sum(axis=1), k)
    assert pl.on.sum() == 3 and pl.value >= pl.greedy_value - 1e-12
    # the most frequent experts: with equal sizes the greedy order is optimal
    top = np.sort(freq.ravel())[::-1][:3]
    np.testing.assert_allclose(np.sort(freq[pl.on])[::-1], top)
    with Model(path, device="host-device", vram_budget=d + 3 * eb) as m:
        assert m.device_info()["experts"]["source"] == "file"
        np.testing.assert_array_equal(m.expert_placement(), pl.on)
    with Model(path, device="host-device", vram_budget=d + 2 * eb) as m:  # too small: re-placed
        info = m.device_info()
        assert info["experts"]["source"] == "frequency" and "re-placed" in info["note"]
        on = m.expert_placement()
        np.testing.assert_allclose(np.sort(freq[on])[::-1], top[:2])
    text = describe(path)
    assert "profiled over 200 tokens of heldout.txt" in text and "*:" in text
    assert pl.shared_bytes == case["sh"] and pl.shared_layers == (case["n_layer"] if case["sh"] else 0)
    if case["sh"]:  # the placement put every layer's shared expert on the device first
        assert f"the placement puts {case['n_layer']} of {case['n_layer']} layers' on the device" in text
    else:
        assert "shared expert" not in text
    out = str(tmp_path / "o.gguf")
    assert main([path, "--vram-budget", f"{(d + 4 * eb) / 1024}K", "--n-cpu-moe", "1", "-o", out, "-q"]) == 0
    with Model(out, device="host-device", vram_budget=d + 4 * eb) as m:
        on = m.expert_placement()
        assert m.device_info()["experts"]["source"] == "file"
        assert not on[0].any() and on.sum() == min(4, on[1:].size)


BAD_PLACEMENT = {
    "gpu-value": (dict(add={"blk.0.ffn_exp_gpu": np.array([2, 0, 0, 0, 0, 0], np.int32),
                            "blk.1.ffn_exp_gpu": np.zeros(6, np.int32)}),
                  r"tensor 'blk\.0\.ffn_exp_gpu': expert 0's entry is 2 \(must be 0 or 1\)"),
    "gpu-length": (dict(add={"blk.0.ffn_exp_gpu": np.zeros(5, np.int32),
                             "blk.1.ffn_exp_gpu": np.zeros(6, np.int32)}),
                   r"tensor 'blk\.0\.ffn_exp_gpu' has shape \[5, 1, 1, 1\], expected a vector of 6"),
    "gpu-type": (dict(add={"blk.0.ffn_exp_gpu": np.zeros(6, np.float32),
                           "blk.1.ffn_exp_gpu": np.zeros(6, np.int32)}),
                 r"tensor 'blk\.0\.ffn_exp_gpu' must be i32, not f32"),
    "gpu-layer-missing": (dict(add={"blk.0.ffn_exp_gpu": np.zeros(6, np.int32)}),
                          r"tensor 'blk\.1\.ffn_exp_gpu' is missing"),
    "gpu-layer0-missing": (dict(add={"blk.1.ffn_exp_gpu": np.zeros(6, np.int32)}),
                           r"tensor 'blk\.1\.ffn_exp_gpu' places layer 1's experts but "
                           r"'blk\.0\.ffn_exp_gpu' is missing"),
    "freq-range": (dict(add={"blk.1.ffn_exp_freq": np.array([0, 0, 1.5, 0, 0, 0], np.float32)}),
                   r"tensor 'blk\.1\.ffn_exp_freq': expert 2's frequency is 1\.5 \(must be in \[0, 1\]\)"),
    "freq-nan": (dict(add={"blk.0.ffn_exp_freq": np.array([0, np.nan, 0, 0, 0, 0], np.float32)}),
                 r"tensor 'blk\.0\.ffn_exp_freq': expert 1's frequency is nan"),
    "freq-length": (dict(add={"blk.0.ffn_exp_freq": np.zeros(7, np.float32)}),
                    r"tensor 'blk\.0\.ffn_exp_freq' has shape \[7, 1, 1, 1\], expected a vector of 6"),
}


@pytest.fixture(scope="module")
def qwen2moe_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-moe-placement")
    hf = make_hf_model("qwen2moe", d / "hf", seed=1)
    return convert(hf, d / "f32.gguf", "f32", progress=False), d


@pytest.mark.parametrize("bad", list(BAD_PLACEMENT))
def test_bad_placement_data_refused_by_name(qwen2moe_gguf, bad):
    src, d = qwen2moe_gguf
    kw, match = BAD_PLACEMENT[bad]
    path = rewrite_gguf(src, d / f"{bad}.gguf", **kw)
    with pytest.raises(NativeError, match=match):
        Model(path)  # refused at load, on the CPU as on a device


def test_stale_side_file_refused(qwen2moe_gguf, tmp_path):
    """A placement side file made for another file is refused as a neuron index one is."""
    import shutil

    from powerinfer_cpp.place import replace_expert_placement

    src, _ = qwen2moe_gguf
    path = str(tmp_path / "m.gguf")
    shutil.copy(src, path)
    replace_expert_placement(path, 1 << 20, profile=CALIB, profile_tokens=64, n_ctx=64)
    with open(path, "ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(NativeError, match="generated.gpuidx"):
        Model(path)
    assert F.GPUIDX_SUFFIX == ".generated.gpuidx"


def test_place_without_frequencies_says_to_profile(qwen2moe_gguf):
    from powerinfer_cpp.place import PlaceError, replace_expert_placement

    src, _ = qwen2moe_gguf
    with pytest.raises(PlaceError, match="no expert frequencies .* --profile TEXT"):
        replace_expert_placement(src, 1 << 20)


def test_budget_kv_of_the_runtime_order(qwen2moe_gguf):
    """expert_budget (the offline accounting) equals what the loader placed before the
    experts, for every budget of a sweep."""
    import gguf

    from powerinfer_cpp.sparse.experts import expert_budget

    src, _ = qwen2moe_gguf
    r = gguf.GGUFReader(src)
    tensors = {t.name: (t.tensor_type, tuple(int(v) for v in reversed(t.shape))) for t in r.tensors}
    with Model(src, device="host-device") as m:
        full = m.device_info()
        nl, ne = m.info.n_layer, m.info.n_expert
    sh = full["experts"]["shared_bytes"]
    assert sh > 0 and full["experts"]["shared_device"] == nl
    for budget in (0, 5000, full["dense_bytes"] - 1, full["dense_bytes"] + 10,
                   full["dense_bytes"] + sh // nl, full["dense_bytes"] + sh - 1, full["used_bytes"]):
        dense, shared, n_shared, cache, left, eb = expert_budget(tensors, nl, ne, budget, cache=1)
        with Model(src, device="host-device", vram_budget=budget, expert_cache=1) as m:
            info = m.device_info()
        assert info["dense_bytes"] == dense
        assert info["experts"]["shared_bytes"] == shared
        assert info["experts"]["shared_device"] == n_shared
        assert info["experts"]["cache_bytes"] == cache
        assert info["experts"]["bytes"] == min(max(left, 0) // int(eb[0]), nl * ne) * int(eb[0])


def test_format_doc_lists_the_expert_placement():
    """docs/FORMAT.md "Expert placement" names exactly format.py's tensors and keys."""
    import re
    from pathlib import Path

    text = (REPO_DIR / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    start = text.index("## Expert placement\n")
    sec = text[start:text.index("\n## ", start + 1)]
    tensors = set(re.findall(r"^\| `blk\.N\.([a-z_]+)` \|", sec, re.M))
    keys = set(re.findall(r"^\| `(powerinfer\.[a-z_.]+)` \|", sec, re.M))
    assert tensors == set(F.EXPERT_TENSORS)
    assert keys | {F.KEY_GPU_VRAM_BUDGET, F.KEY_GPU_SOLVER} == set(F.EXPERT_KEYS)


def test_generate_and_llama_take_the_moe_knobs(case, capsys):
    """generate's --n-cpu-moe / --expert-cache and Llama(n_cpu_moe=, expert_cache=) reach the
    placement; generate's timing block says where the experts ran."""
    from powerinfer_cpp.api import Llama
    from powerinfer_cpp.generate import main

    eb = case["eb"]
    rc = main(["-m", case["gguf"], "-p", "In the beginning", "-n", "6", "--temp", "0", "-t", "2",
               "--device", "host-device", "--n-cpu-moe", "1", "--expert-cache", f"{2 * eb / 1024}K"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "expert cache 2 experts" in err and "of expert runs on the device" in err
    # n_cpu_moe keeps routed experts only: every layer's shared expert is on the device
    assert (f"shared experts {case['sh'] / 2**20:.1f}: {case['n_layer']} layers" in err) == bool(case["sh"])
    llm = Llama(case["gguf"], n_ctx=64, device="host-device", n_cpu_moe=1, expert_cache=2 * eb,
                verbose=False)
    try:
        on = llm._model.expert_placement()
        assert not on[0].any() and on[1:].all()
        assert llm._model.device_info()["experts"]["cache_slots"] == 2
        assert llm._init_args["n_cpu_moe"] == 1 and llm._init_args["expert_cache"] == 2 * eb
    finally:
        llm.close()


def test_batched_decode_on_the_device(case):
    """gh_eval_batch (several contexts' next tokens in one pass, the server's continuous
    batching) with placed and cached experts: each context's logits are its own gh_eval's
    within rounding."""
    from powerinfer_cpp._native import check, ffi, lib

    ids = case["ids"]
    kw = placements(case)["some+cache"]
    with Model(case["gguf"], n_ctx=64, cache_type="f32", n_threads=2, device="host-device", **kw) as m:
        ctxs = [m.create_context(n_ctx=64, cache_type="f32", n_threads=2) for _ in range(3)]
        twins = [m.create_context(n_ctx=64, cache_type="f32", n_threads=2) for _ in range(3)]
        for i, (c, t) in enumerate(zip(ctxs, twins)):
            c.eval(ids[i:i + 4])
            t.eval(ids[i:i + 4])
        nxt = [ids[10], ids[11], ids[12]]
        ptrs = ffi.new("gh_context *[]", [c._handle() for c in ctxs])
        arr = np.asarray(nxt, dtype=np.int32)
        check(lib.gh_eval_batch(ptrs, 3, ffi.from_buffer("int32_t[]", arr)))
        nv = m.n_vocab
        for c, t, tok in zip(ctxs, twins, nxt):
            want = t.eval([tok])
            with c._calling() as ptr:
                got = np.frombuffer(ffi.buffer(lib.gh_get_logits(ptr, 0), nv * 4), np.float32)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.ptp(want))


def test_an_empty_file_placement_is_replaced_at_load(case, tmp_path):
    """A placement solved for no room (every ffn_exp_gpu 0) does not keep a bigger budget's
    device empty: the experts are placed at load, by the file's frequencies, and the note
    says so."""
    import shutil

    from powerinfer_cpp.place import replace_expert_placement

    path = str(tmp_path / "m.gguf")
    shutil.copy(case["gguf"], path)
    pl = replace_expert_placement(path, 0, profile=CALIB, profile_tokens=64, n_ctx=64)
    assert not pl.on.any() and pl.solver == "none"
    with Model(path, device="host-device", vram_budget=case["dense"] + 2 * case["eb"]) as m:
        info = m.device_info()
        assert info["experts"]["device"] == 2 and info["experts"]["source"] == "frequency"
        assert "puts none on the device" in info["note"]


def test_prompt_longer_than_a_device_chunk(case):
    """A prompt of more tokens than a device call takes (GH_DEVICE_CHUNK, 32) runs the device
    experts and the shared expert (qwen2moe) in chunks, in one batch and in batches of 8:
    the CPU's logits within the host-device bound."""
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 300, size=70)]
    with Model(case["gguf"], n_ctx=128, cache_type="f32", n_threads=2) as m:
        want = m.create_context(n_ctx=128, cache_type="f32", n_threads=2).eval(ids, logits_all=True)
    for kw in (dict(), dict(n_batch=8)):
        with Model(case["gguf"], n_ctx=128, cache_type="f32", n_threads=2, device="host-device", **kw) as m:
            assert m.device_info()["experts"]["shared_device"] == (case["n_layer"] if case["sh"] else 0)
            got = m.create_context(n_ctx=128, cache_type="f32", n_threads=2).eval(ids, logits_all=True)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.ptp(want))
