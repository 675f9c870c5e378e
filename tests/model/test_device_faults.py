"""Device failures during evaluation. GH_HOST_DEVICE_FAULT=op:N makes the host-device
backend fail its N-th matmul, predict, hot_ffn, sync or upload (counted over the model's
contexts from the first one on), as a device's failing call would. Every function through
which the forward pass runs device work returns that error up to gh_eval / gh_eval_batch,
which fail with

    device 'host-device' failed during gh_eval (the context is back at P tokens): <the op's error>
    device 'host-device' failed during gh_eval_batch (no context changed): <the op's error>

and keep what the public header promises: the tokens are not in the cache (n_past where it
was, every batch context's too), no logits are kept, and the context stays usable: the
same tokens evaluated again give, bit for bit, what a context that never failed gives.

Each failure point is a case, found by counting the calls of a placement the test asserts
(device_info): the attention's projections and their sync (forward.c project), the head,
a later batch of a prompt split by n_batch, the sparse predictor on the device (the sparse
strategy's select), the executor's hot rows and the gate mode's device gate (ffn/exec.c),
a batched decode's union path (select through batch_union), and a mixture's router, device
experts, their sync and the expert cache's refill (ffn/moe.c)."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp import Model, NativeError
from powerinfer_cpp._native import check, ffi, lib

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form"
DEV = "device 'host-device' failed during"


def load(path, fault: str | None, monkeypatch, **kw) -> Model:
    """The model on host-device with the fault (read when the device opens, at load)."""
    if fault:
        monkeypatch.setenv("GH_HOST_DEVICE_FAULT", fault)
    else:
        monkeypatch.delenv("GH_HOST_DEVICE_FAULT", raising=False)
    try:
        return Model(path, device="host-device", **kw)
    finally:
        monkeypatch.delenv("GH_HOST_DEVICE_FAULT", raising=False)


def injected(fault: str) -> str:
    op = fault.split(":")[0]
    return f"host-device: {op} failed: injected fault (GH_HOST_DEVICE_FAULT={fault})"


def n_logit_rows(ctx) -> int:
    with ctx._calling() as ptr:
        return lib.gh_n_logit_rows(ptr)


def eval_batch(ctxs, tokens) -> list[np.ndarray]:
    """gh_eval_batch itself (one token per context); each context's logits."""
    ptrs = ffi.new("gh_context *[]", [c._handle() for c in ctxs])
    arr = np.asarray(tokens, dtype=np.int32)
    check(lib.gh_eval_batch(ptrs, len(ctxs), ffi.from_buffer("int32_t[]", arr)))
    out = []
    for c in ctxs:
        with c._calling() as ptr:
            nv = c.model.n_vocab
            out.append(np.frombuffer(ffi.buffer(lib.gh_get_logits(ptr, 0), nv * 4), np.float32).copy())
    return out


def eval_then_fail(path, fault, monkeypatch, prefix, tokens, kw, ctx_kw):
    """On a clean model and on one with the fault: prefix evaluated (no failure), then
    tokens. The faulted context's tokens fail with the fault's error, leaving the context
    back at len(prefix) tokens without logits; evaluated again they equal the clean run's,
    and so does the next token (which reads the cache the retry wrote)."""
    with load(path, None, monkeypatch, **kw) as m:
        c = m.create_context(**ctx_kw)
        if prefix:
            c.eval(prefix)
        want = c.eval(tokens)
        nxt = [int(want.argmax())]
        want_next = c.eval(nxt)
    with load(path, fault, monkeypatch, **kw) as m:
        c = m.create_context(**ctx_kw)
        if prefix:
            c.eval(prefix)
        with pytest.raises(NativeError) as e:
            c.eval(tokens)
        assert str(e.value) == (f"{DEV} gh_eval (the context is back at {len(prefix)} tokens): "
                                f"{injected(fault)}")
        assert c.n_past == len(prefix) and n_logit_rows(c) == 0
        np.testing.assert_array_equal(c.eval(tokens), want)
        assert c.n_past == len(prefix) + len(tokens)
        np.testing.assert_array_equal(c.eval(nxt), want_next)


# ------------------------------------------------------------ a sparse file, all on device --

@pytest.fixture(scope="module")
def sparse_path(shipped_sparse):
    return str(shipped_sparse["sparse"])


@pytest.fixture(scope="module")
def placed(sparse_path):
    """Everything on the device: per decoded token each layer calls matmul 4 times (q, k,
    v; o), sync 4 times (q/k/v, o, the predictor, the hot rows), predict and hot_ffn once;
    the head one matmul and one sync."""
    with Model(sparse_path, device="host-device") as m:
        info, n_layer, n_ff = m.device_info(), m.info.n_layer, m.info.n_ff
        toks = m.tokenize(TEXT)
    assert info["attention_layers"] == info["predictor_layers"] == info["hot_layers"] == n_layer
    assert info["head_on_device"] and info["n_hot"] == n_layer * n_ff
    per_token = {"matmul": 4 * n_layer + 1, "sync": 4 * n_layer + 1, "predict": n_layer,
                 "hot_ffn": n_layer}
    return {"L": n_layer, "per_token": per_token, "toks": toks}


# (op, the call of the second decoded token that fails: 1 = its first of that op)
DECODE_FAULTS = {
    "attention-q": ("matmul", lambda L: 1),        # layer 0's q: project's enqueue
    "attention-o": ("matmul", lambda L: 4),        # layer 0's o, after its q/k/v ran
    "attention-sync": ("sync", lambda L: 1),       # project's wait
    "predictor": ("predict", lambda L: 1),         # the sparse strategy's device part
    "predictor-sync": ("sync", lambda L: 3),       # its wait
    "hot-rows": ("hot_ffn", lambda L: 1),          # the executor's device part
    "hot-rows-sync": ("sync", lambda L: 4),        # the executor's wait
    "last-layer": ("hot_ffn", lambda L: L),
    "head": ("matmul", lambda L: 4 * L + 1),       # after n_past moved: put back
    "head-sync": ("sync", lambda L: 4 * L + 1),
}


@pytest.mark.parametrize("point", list(DECODE_FAULTS))
def test_decode_fault(sparse_path, placed, monkeypatch, point):
    op, k = DECODE_FAULTS[point]
    fault = f"{op}:{placed['per_token'][op] + k(placed['L'])}"
    toks = placed["toks"]
    eval_then_fail(sparse_path, fault, monkeypatch, toks[:1], toks[1:2], {},
                   dict(n_ctx=64, n_threads=2, ffn="sparse"))


def test_prompt_fault_in_a_later_batch(sparse_path, placed, monkeypatch):
    """A prompt evaluated in batches of n_batch = 4 (dense FFN: 4 matmuls per layer per
    batch, the head's only in the last): a fault in the second batch puts the context back
    where the call began, not after the first batch."""
    L, toks = placed["L"], placed["toks"]
    prefix, prompt = toks[:3], toks[3:13]
    fault = f"matmul:{(4 * L + 1) + 4 * L + 1}"  # the prefix's; the first batch's; then the second's first
    eval_then_fail(sparse_path, fault, monkeypatch, prefix, prompt, {},
                   dict(n_ctx=64, n_threads=2, n_batch=4, ffn="dense"))


def batch_then_fail(path, fault, monkeypatch, toks, kw):
    """Two contexts with a token each, then one gh_eval_batch of a token each: on the
    faulted model it fails with the fault's error, no context changed (n_past, no logits);
    again, it equals the clean model's batch."""
    ctx_kw = dict(n_ctx=64, n_threads=2, ffn="sparse")
    with load(path, None, monkeypatch, **kw) as m:
        a, b = m.create_context(**ctx_kw), m.create_context(**ctx_kw)
        a.eval(toks[:1])
        b.eval(toks[1:2])
        want = eval_batch([a, b], toks[2:4])
    with load(path, fault, monkeypatch, **kw) as m:
        a, b = m.create_context(**ctx_kw), m.create_context(**ctx_kw)
        a.eval(toks[:1])
        b.eval(toks[1:2])
        with pytest.raises(NativeError) as e:
            eval_batch([a, b], toks[2:4])
        assert str(e.value) == f"{DEV} gh_eval_batch (no context changed): {injected(fault)}"
        assert a.n_past == b.n_past == 1 and n_logit_rows(a) == n_logit_rows(b) == 0
        got = eval_batch([a, b], toks[2:4])
        assert a.n_past == b.n_past == 2
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_batched_decode_fault(sparse_path, placed, monkeypatch):
    """A batch of two contexts (the hot split runs token by token): after the contexts'
    own tokens (a layer's predictor each), layer 0's predictor of the batch's second row
    fails."""
    batch_then_fail(sparse_path, f"predict:{2 * placed['L'] + 2}", monkeypatch, placed["toks"], {})


def test_batched_decode_union_fault(sparse_path, placed, monkeypatch):
    """Predictors on the device and no hot neurons: a batch of two contexts selects through
    the union path (exec.c batch_union), whose selection's device predictor fails."""
    with Model(sparse_path, device="host-device") as m:
        dense = m.device_info()["dense_bytes"]
    with Model(sparse_path, device="host-device", vram_budget=dense) as m:
        info = m.device_info()
    L = placed["L"]
    assert info["predictor_layers"] == L and info["n_hot"] == 0
    batch_then_fail(sparse_path, f"predict:{2 * L + 2}", monkeypatch, placed["toks"],
                    dict(vram_budget=dense))


def test_fault_spec_is_checked(sparse_path, monkeypatch):
    for bad in ("bogus:1", "matmul:0", "matmul", "sync:2x"):
        with pytest.raises(ValueError, match=f"GH_HOST_DEVICE_FAULT='{bad}': expected OP:N"):
            load(sparse_path, bad, monkeypatch)


# ------------------------------------------------------------------------- the gate mode --

def test_gate_mode_device_gate_fault(swiglu_default, monkeypatch):
    """The gate mode with every neuron hot: per layer q, k, v, o, then the device's gate
    rows (exec.c dense_gate); the second token's layer 0 gate fails."""
    path = str(swiglu_default["sparse"])
    with Model(path, device="host-device") as m:
        info, L, toks = m.device_info(), m.info.n_layer, m.tokenize(TEXT)
    assert info["attention_layers"] == info["hot_layers"] == L and info["head_on_device"]
    eval_then_fail(path, f"matmul:{5 * L + 1 + 5}", monkeypatch, toks[:1], toks[1:2], {},
                   dict(n_ctx=64, n_threads=2, ffn="gate"))


# -------------------------------------------------------------------- mixture of experts --

@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_models import make_hf_model

    from powerinfer_cpp.convert import convert

    d = tmp_path_factory.mktemp("moe-faults")
    path = convert(make_hf_model("qwen2moe", d / "hf", seed=7), d / "f32.gguf", "f32",
                   progress=False)
    with Model(path, device="host-device") as m:
        info = m.device_info()
        ids = [int(t) for t in np.random.default_rng(3).integers(3, m.n_vocab, size=6)]
        c = m.create_context(n_ctx=64, n_threads=2, cache_type="f32")
        c.eval(ids)
        n_sel = int((c.expert_counts()[0] > 0).sum())  # layer 0's experts the prompt chose
    eb = info["experts"]["bytes"] // info["experts"]["device"]
    assert info["experts"]["shared_device"] == m.info.n_layer  # the placement MOE_FAULTS counts
    return {"path": str(path), "ids": ids, "dense": info["dense_bytes"], "eb": eb, "n_sel": n_sel,
            "shared": info["experts"]["shared_bytes"]}


# (placement, fault given layer 0's n_sel chosen experts): the first call's layer 0 runs
# q, k, v (synced), o (synced), the router (the fifth matmul, the third sync), the shared
# expert's gate and up (the sixth and seventh), each chosen expert's gate and up (synced:
# the fourth), the shared expert's down, then the experts' down projections (synced: the
# fifth)
MOE_FAULTS = {
    "router": ("all", lambda n_sel: "matmul:5"),
    "router-sync": ("all", lambda n_sel: "sync:3"),
    "shared-gate": ("all", lambda n_sel: "matmul:6"),
    "expert-gate": ("all", lambda n_sel: "matmul:8"),
    "expert-up-last": ("all", lambda n_sel: f"matmul:{7 + 2 * n_sel}"),
    "experts-sync": ("all", lambda n_sel: "sync:4"),
    "shared-down": ("all", lambda n_sel: f"matmul:{7 + 2 * n_sel + 1}"),
    "expert-down": ("all", lambda n_sel: f"matmul:{7 + 2 * n_sel + 2}"),
    "expert-down-sync": ("all", lambda n_sel: "sync:5"),
    "cache-refill": ("cache", lambda n_sel: "upload:1"),
}


@pytest.mark.parametrize("point", list(MOE_FAULTS))
def test_moe_fault(moe, monkeypatch, point):
    which, spec = MOE_FAULTS[point]
    fault = spec(moe["n_sel"])
    # the cache's room: after the dense parts and the shared experts, which are placed first
    kw = {"all": {}, "cache": dict(vram_budget=moe["dense"] + moe["shared"] + 2 * moe["eb"],
                                   expert_cache=2 * moe["eb"])}[which]
    with Model(moe["path"], device="host-device", **kw) as m:
        info, n_layer = m.device_info(), m.info.n_layer
    assert info["attention_layers"] == n_layer
    if which == "cache":
        assert info["experts"]["device"] == 0 and info["experts"]["cache_slots"] == 2
    else:
        assert info["experts"]["device"] == info["experts"]["n_experts"]
    eval_then_fail(moe["path"], fault, monkeypatch, [], moe["ids"], kw,
                   dict(n_ctx=64, n_threads=2, cache_type="f32"))
