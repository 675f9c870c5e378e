"""The hybrid runtime on the host-device backend: placement under a VRAM budget, the
neuron split (hot rows on the "device", cold rows on the CPU, at the same time) and
the merge must give the CPU-only results, never exceed the budget, and count what
they did. The host-device backend runs the reference math on a thread of its own, so
everything except the CUDA kernels runs here for real."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from powerinfer_cpp import Model, device_available, parse_size
from powerinfer_cpp._native import ffi, lib

from hybrid_sizes import part_sizes

MiB = 1 << 20
N_TOK = 40  # decode steps compared per budget


@pytest.fixture(scope="module")
def sparse_path(shipped_sparse):
    return str(shipped_sparse["sparse"])


@pytest.fixture(scope="module")
def tokens(sparse_path):
    with Model(sparse_path) as m:
        return m.tokenize("In the beginning God created the heaven and the earth. And the earth "
                          "was without form, and void; and darkness was upon the face")[:N_TOK]


def decode_logits(m: Model, tokens, mode="sparse"):
    ctx = m.create_context(n_ctx=128, n_threads=2, ffn=mode)
    out = np.stack([ctx.eval([t]) for t in tokens])
    return out, ctx


@pytest.fixture(scope="module")
def cpu_ref(sparse_path, tokens):
    with Model(sparse_path) as m:
        sparse, _ = decode_logits(m, tokens, "sparse")
        oracle, _ = decode_logits(m, tokens, "oracle")
        dense, _ = decode_logits(m, tokens, "dense")
        ctx = m.create_context(n_ctx=128, n_threads=2)
        prompt = ctx.eval(tokens, logits_all=True)
    return {"sparse": sparse, "oracle": oracle, "dense": dense, "prompt": prompt}


def sizes(m: Model) -> dict:
    """Bytes of the model's parts (hybrid_sizes.part_sizes), read once."""
    return part_sizes(m.path, m.info.n_layer, m.info.n_ff)


def close(a, b, tol=2e-4):
    scale = max(float(np.abs(b).max()), 1.0)
    return float(np.abs(a - b).max()) / scale <= tol


# Budgets: nothing; two layers' attention; all dense parts but a few neurons; all of it.
BUDGETS = ["zero", "two-layers", "dense+some", "all"]


def budget_bytes(m: Model, which: str) -> int | None:
    z = sizes(m)
    return {"zero": 0, "two-layers": 2 * z["attention"] + 1000,
            "dense+some": z["dense"] + 700 * z["neuron"], "all": None}[which]


@pytest.mark.parametrize("which", BUDGETS)
def test_hybrid_decode_equals_cpu(sparse_path, tokens, cpu_ref, which):
    with Model(sparse_path, ffn="sparse") as probe:
        budget = budget_bytes(probe, which)
    with Model(sparse_path, device="host-device", vram_budget=budget) as m:
        info = m.device_info()
        assert info["device"] == "host-device"
        if budget is not None:
            assert info["budget"] == budget
        assert info["used_bytes"] <= info["budget"]
        assert info["used_bytes"] == info["dense_bytes"] + info["hot_bytes"]
        got, ctx = decode_logits(m, tokens)
        assert close(got, cpu_ref["sparse"]), np.abs(got - cpu_ref["sparse"]).max()
        # the argmax (greedy token) agrees everywhere
        assert (got.argmax(1) == cpu_ref["sparse"].argmax(1)).all()
        st = ctx.stats()
        dv = st["device"]
        assert dv["neurons_device"] + dv["neurons_cpu"] == st["n_active"] > 0
        if which == "zero":
            assert info["used_bytes"] == 0 and info["n_hot"] == 0
            assert dv["neurons_device"] == 0 and dv["bytes_uploaded"] == 0
        elif which == "two-layers":
            assert info["attention_layers"] == 2 and info["predictor_layers"] == 0
            assert info["n_hot"] == 0 and not info["head_on_device"]
            assert dv["neurons_device"] == 0 and dv["bytes_uploaded"] > 0
        elif which == "dense+some":
            assert info["attention_layers"] == info["predictor_layers"] == m.info.n_layer
            assert info["head_on_device"] and 0 < info["n_hot"] <= 700
            assert 0 < dv["neurons_device"] and 0 < dv["neurons_cpu"]
            assert dv["device_share"] == pytest.approx(dv["neurons_device"] / st["n_active"])
        else:
            assert info["hot_share"] == 1.0 and info["head_on_device"]
            assert dv["neurons_cpu"] == 0 and dv["device_share"] == 1.0
        if info["used_bytes"]:
            assert dv["bytes_device"] > 0 and dv["time_s"]["device"] > 0


@pytest.mark.parametrize("which", ["dense+some", "all"])
def test_hybrid_oracle_and_dense_modes(sparse_path, tokens, cpu_ref, which):
    """Oracle mode through the split equals the dense result; dense mode and prompt
    batches (dense FFN on the CPU, projections on the device) equal the CPU's."""
    with Model(sparse_path, ffn="sparse") as probe:
        budget = budget_bytes(probe, which)
    with Model(sparse_path, device="host-device", vram_budget=budget) as m:
        oracle, _ = decode_logits(m, tokens, "oracle")
        assert close(oracle, cpu_ref["dense"])
        dense, _ = decode_logits(m, tokens, "dense")
        assert close(dense, cpu_ref["dense"])
        ctx = m.create_context(n_ctx=128, n_threads=2)
        assert close(ctx.eval(tokens, logits_all=True), cpu_ref["prompt"])


def test_budget_sweep_never_exceeds_and_keeps_priority(sparse_path):
    with Model(sparse_path) as probe:
        z = sizes(probe)
        att, pred, head = z["attention"], z["predictor"], z["head"]
        nl = probe.info.n_layer
        full = z["dense"] + nl * probe.info.n_ff * z["neuron"]
    last_hot = -1
    for budget in np.linspace(0, full * 1.05, 23).astype(np.int64):
        with Model(sparse_path, device="host-device", vram_budget=int(budget)) as m:
            info = m.device_info()
        assert info["used_bytes"] <= budget
        # strict priority: attention of every layer before any predictor, then the head
        if info["predictor_layers"]:
            assert info["attention_layers"] == nl
        if info["head_on_device"]:
            assert info["predictor_layers"] == nl
        # what the dense parts leave goes to neurons (as in placement.py): a stop at the
        # first dense part that does not fit leaves less than that part for them
        if info["n_hot"] and not info["head_on_device"]:
            assert budget - info["dense_bytes"] < max(att, pred, head)
        last_hot = info["n_hot"]
    assert last_hot == nl * probe.info.n_ff


def test_load_time_greedy_matches_offline_greedy(sparse_path):
    """The runtime's placement of the neurons is the offline greedy rule."""
    import gguf

    from powerinfer_cpp.sparse.placement import greedy_placement, make_problem
    r = gguf.GGUFReader(sparse_path)
    t = {x.name: x for x in r.tensors}
    with Model(sparse_path) as probe:
        z = sizes(probe)
        nl, neuron, dense = probe.info.n_layer, z["neuron"], z["dense"]
    freq = [np.asarray(t[f"blk.{l}.ffn_freq"].data, dtype=np.float64) for l in range(nl)]
    group = int(r.fields["powerinfer.gpu.group_size"].contents())
    for left in (100 * neuron, 1000 * neuron + 5, 2500 * neuron):
        with Model(sparse_path, device="host-device", vram_budget=dense + left) as m:
            info = m.device_info()
        assert info["dense_bytes"] == dense and info["index_source"] == "load"
        pl = greedy_placement(make_problem(freq, [neuron] * nl, [], left, group, 0.05))
        assert info["n_hot"] == sum(len(h) for h in pl.hot)
        assert info["hot_bytes"] == pl.neuron_bytes


def test_file_index_used_when_it_fits(sparse_path, tmp_path, tokens, cpu_ref):
    from powerinfer_cpp.place import replace_index
    placed = tmp_path / "placed.gguf"
    pl = replace_index(sparse_path, parse_size("3M"), placed, ctx=64)
    n_file = sum(len(h) for h in pl.hot)
    assert n_file > 0
    with Model(placed, device="host-device", vram_budget="3M") as m:
        info = m.device_info()
        assert info["index_source"] == "file" and info["n_hot"] == n_file
        assert info["file_budget"] == parse_size("3M") and info["note"] == ""
        got, _ = decode_logits(m, tokens)
        assert close(got, cpu_ref["sparse"])
    # less budget than the index needs: re-placed at load, and the note says so
    with Model(placed, device="host-device", vram_budget=info["dense_bytes"] + 200000) as m:
        small = m.device_info()
        assert small["index_source"] == "load" and "re-placed" in small["note"]
        assert 0 < small["n_hot"] < n_file
        assert small["used_bytes"] <= small["budget"]
    with Model(placed, device="host-device", vram_budget="3M", reset_gpu_index=True) as m:
        assert m.device_info()["index_source"] == "load"
        assert "reset" in m.device_info()["note"]


def test_budget_above_capacity_is_lowered(sparse_path, monkeypatch):
    monkeypatch.setenv("GH_HOST_DEVICE_MEM", "3M")
    with Model(sparse_path, device="host-device", vram_budget="1G") as m:
        info = m.device_info()
    assert info["budget"] == 3 * MiB and "more than the device's free" in info["note"]
    assert info["used_bytes"] <= 3 * MiB
    with Model(sparse_path, device="host-device") as m:  # default: free - 256 MiB margin
        assert m.device_info()["budget"] == 0


def test_dense_only_file_on_a_device(shipped_sparse, tokens):
    """A file without sparse tensors: the projections go to the device, the FFN stays on
    the CPU, and the note says why."""
    dense = str(shipped_sparse["dense"])
    with Model(dense) as m:
        ref = m.create_context(n_ctx=128, n_threads=2).eval(tokens, logits_all=True)
    with Model(dense, device="host-device", vram_budget="64M") as m:
        info = m.device_info()
        assert info["attention_layers"] == m.info.n_layer and info["n_hot"] == 0
        assert "no neuron frequencies" in info["note"]
        got = m.create_context(n_ctx=128, n_threads=2).eval(tokens, logits_all=True)
    assert close(got, ref)


def test_contexts_on_threads_share_the_device(sparse_path, tokens, cpu_ref):
    with Model(sparse_path, device="host-device", vram_budget=None) as m:
        res = [None, None]

        def run(i):
            res[i] = decode_logits(m, tokens)[0]
        ths = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    for r in res:
        assert close(r, cpu_ref["sparse"])


def test_model_freed_before_its_context(sparse_path, tokens):
    """The C API keeps a model alive while a context uses it (garbage collectors free
    in any order)."""
    p = lib.gh_model_default_params()
    dev = ffi.new("char[]", b"host-device")
    p.device = dev
    p.vram_budget = -1
    mp = ffi.new("gh_model **")
    assert lib.gh_model_load_ex(sparse_path.encode(), ffi.new("gh_model_params *", p), mp) == 0
    cp = ffi.new("gh_context **")
    params = lib.gh_context_default_params()
    params.n_ctx = 64
    assert lib.gh_context_new(mp[0], ffi.new("gh_context_params *", params), cp) == 0
    lib.gh_model_free(mp[0])
    toks = ffi.new("int32_t[]", tokens[:8])
    assert lib.gh_eval(cp[0], toks, 8, 0) == 0
    assert np.isfinite(np.frombuffer(ffi.buffer(lib.gh_get_logits(cp[0], -1), 4 * 16), np.float32)).all()
    lib.gh_context_free(cp[0])


@pytest.mark.parametrize("device, budget, match", [
    ("gpu", None, "unknown device 'gpu'"),
    ("cuda:x", None, "cuda:N"),
    ("host-device", -5, "out of range"),
    ("host-device", "lots", "is not a size"),
])
def test_bad_device_arguments(sparse_path, device, budget, match):
    with pytest.raises(ValueError, match=match):
        Model(sparse_path, device=device, vram_budget=budget)


def test_cuda_without_a_gpu_is_a_clear_error(sparse_path):
    ok, why = device_available("cuda")
    if ok:
        pytest.skip("a CUDA device is present: tests/gpu covers it")
    assert why
    with pytest.raises((RuntimeError, ValueError, OSError), match="cuda|CUDA"):
        Model(sparse_path, device="cuda")


def test_host_device_memory_env_is_checked(sparse_path, monkeypatch):
    monkeypatch.setenv("GH_HOST_DEVICE_MEM", "12 parsecs")
    with pytest.raises(ValueError, match="GH_HOST_DEVICE_MEM"):
        Model(sparse_path, device="host-device")


def test_a_type_the_device_lacks_is_refused_at_placement(sparse_path, monkeypatch):
    """A file with a weight of a type the device does not read is refused when it is placed
    (whatever the budget, before any upload), naming the device, the type, the tensor and
    the types the device reads. The simulated device reads the types GH_HOST_DEVICE_TYPES
    lists; CUDA's list is dev_types.cuh's (cuda_emu.cu checks it)."""
    monkeypatch.setenv("GH_HOST_DEVICE_TYPES", "f32, Q8_0")
    for budget in (0, None):
        with pytest.raises(RuntimeError) as e:
            Model(sparse_path, device="host-device", vram_budget=budget)
        msg = str(e.value)
        assert "device 'host-device' does not read type f16" in msg, msg
        assert "of tensor 'blk.0.attn_q.weight'" in msg, msg
        assert "it reads f32 and q8_0" in msg and "device 'cpu'" in msg, msg
    monkeypatch.setenv("GH_HOST_DEVICE_TYPES", "F16,f32")  # the file's types: it loads
    with Model(sparse_path, device="host-device", vram_budget=None) as m:
        assert m.device_info()["attention_layers"] == m.info.n_layer
    monkeypatch.setenv("GH_HOST_DEVICE_TYPES", "f16,q9_9")
    with pytest.raises(ValueError, match="GH_HOST_DEVICE_TYPES.*'q9_9' is not a type"):
        Model(sparse_path, device="host-device")


def test_generate_cli_on_host_device(sparse_path, capsys):
    from powerinfer_cpp.generate import main
    rc = main(["-m", sparse_path, "-p", "In the beginning", "-n", "8", "--temp", "0",
               "--device", "host-device", "--vram-budget", "2M", "-t", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "device      = host-device" in err and "of active neurons on the device" in err
    assert "note:" in err  # the shipped file's index is empty: placed at load


def test_reading_a_copied_file_is_unaffected(sparse_path, tmp_path):
    """Placement never writes to the model file."""
    copy = tmp_path / "copy.gguf"
    shutil.copy(sparse_path, copy)
    before = copy.read_bytes()
    with Model(copy, device="host-device", vram_budget="4M", reset_gpu_index=True):
        pass
    assert copy.read_bytes() == before


def test_place_side_file_is_the_index(sparse_path, tmp_path):
    """`place MODEL` writes only MODEL.generated.gpuidx; the runtime takes it over the file's
    own index (the device places exactly its neurons, and equals the CPU), and refuses it
    once the model file changes."""
    from powerinfer_cpp.place import main as place_main

    model = tmp_path / "m.gguf"
    shutil.copy(sparse_path, model)
    assert place_main([str(model), "--vram-budget", "3M", "-q", "--ctx", "64"]) == 0
    side = str(model) + ".generated.gpuidx"
    from gguf import GGUFReader
    r = GGUFReader(side)
    n_hot = sum(int(np.asarray(t.data).sum()) for t in r.tensors if t.name.endswith(".gpu_idx"))
    assert n_hot > 0
    with Model(str(model), device="host-device", vram_budget="64M") as m:
        info = m.device_info()
        assert info["n_hot"] == n_hot and info["index_source"] == "file"
        assert info["file_budget"] == parse_size("3M") and "GPU index from" in info["note"]
    with open(model, "ab") as f:  # the model changes: the side file no longer fits it
        f.write(b"\0" * 32)
    with pytest.raises(Exception, match="was made for a model file of"):
        Model(str(model))


def test_inspect_shows_the_side_file_index(sparse_path, tmp_path):
    """After `place`, inspect reports the index the runtime uses (the side file's), not the
    file's own empty one ("budget 0 B", 0 GPU neurons), and says when it is stale."""
    from gguf import GGUFReader

    from powerinfer_cpp.inspect import describe
    from powerinfer_cpp.place import main as place_main

    model = tmp_path / "m.gguf"
    shutil.copy(sparse_path, model)
    side = str(model) + ".generated.gpuidx"
    assert place_main([str(model), "--vram-budget", "3M", "-q", "--ctx", "64"]) == 0
    per_layer = [int(np.asarray(t.data).sum()) for t in GGUFReader(side).tensors
                 if t.name.endswith(".gpu_idx")]
    text = describe(model)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("gpu index:")]
    assert line.startswith("gpu index: budget 3.00 MiB") and f"side file {side}" in line
    rows = text.split("GPU neurons\n")[1].splitlines()[:len(per_layer)]
    assert [int(r.split()[-1]) for r in rows] == per_layer and sum(per_layer) > 0
    with open(model, "ab") as f:  # the model changes: the runtime refuses the side file
        f.write(b"\0" * 32)
    stale = describe(model)
    assert "was made for a model file of" in stale and "budget 3.00 MiB" not in stale
