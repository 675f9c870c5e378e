"""Mixed batches (gh_eval_batch_ex: decode tokens and prompt chunks of several contexts in
ONE forward pass) checked against gh_eval of the same tokens on twin contexts; shared by
tests/model/test_batch.py (the shipped f16 model, SmolLM2 Q4_1) and tests/model/test_architectures.py
(every architecture's f32 test model)."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_cpp._native import NativeError, NativeValueError, check, ffi, lib


def native_batch_ex(ctxs, counts, tokens, logits_all: bool = False) -> None:
    """gh_eval_batch_ex itself: counts[i] tokens for ctxs[i], given one context after
    another in tokens (no Python bookkeeping: these contexts are driven by eval() and this
    only)."""
    ptrs = ffi.new("gh_context *[]", [c._handle() for c in ctxs])
    n = np.asarray(counts, dtype=np.int32)
    t = np.asarray(tokens, dtype=np.int32)
    check(lib.gh_eval_batch_ex(ptrs, len(ctxs), ffi.from_buffer("int32_t[]", n),
                               ffi.from_buffer("int32_t[]", t), 1 if logits_all else 0))


def check_splits_equal_tokens(path, ids) -> None:
    """A prompt evaluated whole, in batches of 5 and token by token (f32 cache) gives the
    same logits within 1e-5 of their range."""
    from powerinfer_cpp import Model

    with Model(path, n_ctx=64, cache_type="f32", n_threads=2) as m:
        whole = m.create_context(n_ctx=64, cache_type="f32").eval(ids, logits_all=True)
        parts = m.create_context(n_ctx=64, n_batch=5, cache_type="f32").eval(ids, logits_all=True)
        one = m.create_context(n_ctx=64, cache_type="f32", n_threads=1)
        steps = np.stack([one.eval([t]) for t in ids])
    scale = np.ptp(whole)
    np.testing.assert_allclose(parts, whole, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-5 * scale)


def logit_rows(ctx) -> np.ndarray:
    nv = ctx.model.n_vocab
    with ctx._calling() as ptr:
        rows = lib.gh_n_logit_rows(ptr)
        return np.stack([np.frombuffer(ffi.buffer(lib.gh_get_logits(ptr, i), nv * 4),
                                       np.float32).copy() for i in range(rows)])


def compare(got: np.ndarray, ref: np.ndarray, bound: float, what: str) -> float:
    """got and ref [rows][n_vocab]: each row within bound of ref's logit range, the same
    greedy token. Returns the largest relative error."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), what
    worst = 0.0
    for r, (g, w) in enumerate(zip(got, ref)):
        err = float(np.abs(g.astype(np.float64) - w).max()) / max(float(np.ptp(w)), 1e-6)
        assert err <= bound, f"{what}, row {r}: relative logit error {err:.3g}"
        assert int(g.argmax()) == int(w.argmax()), f"{what}, row {r}: greedy token"
        worst = max(worst, err)
    return worst


# (prefix already cached, tokens this batch gives, n_ctx): decode contexts give 1 token,
# prefilling ones a chunk (from an empty cache too); the last chunk fills its context to the
# last row. The first context lends the pass its buffers.
LAYOUT = [(5, 1, 48), (0, 7, 48), (3, 4, 48), (10, 1, 48), (11, 5, 16), (2, 2, 48)]


def check_mixed_batches(m, cache_type: str, bound: float, seed: int = 3) -> float:
    """A pass of LAYOUT's decode tokens and prompt chunks, all logits kept, then one of the
    last token's logits only, then a decode step of every context with room (which reads
    the caches the mixed passes wrote): each context's rows equal gh_eval of its own tokens
    on a twin context. Returns the largest relative error seen."""
    rng = np.random.default_rng(seed)
    new = lambda n_ctx: m.create_context(n_ctx=n_ctx, cache_type=cache_type)  # noqa: E731
    worst = 0.0
    for logits_all in (True, False):
        ctxs = [new(n_ctx) for _, _, n_ctx in LAYOUT]
        twins = [new(n_ctx) for _, _, n_ctx in LAYOUT]
        chunks = []
        for c, t, (pre, k, n_ctx) in zip(ctxs, twins, LAYOUT):
            ids = [int(x) for x in rng.integers(3, m.n_vocab, size=pre + k)]
            if pre:
                c.eval(ids[:pre])
                t.eval(ids[:pre])
            chunks.append(ids[pre:])
        native_batch_ex(ctxs, [len(ch) for ch in chunks], [x for ch in chunks for x in ch],
                        logits_all)
        for i, (c, t, ch) in enumerate(zip(ctxs, twins, chunks)):
            ref = t.eval(ch, logits_all=logits_all)
            ref = ref.reshape(len(ch) if logits_all else 1, m.n_vocab)
            worst = max(worst, compare(logit_rows(c), ref, bound,
                                       f"mixed batch (logits_all {logits_all}), context {i}"))
            assert c.n_past == t.n_past == LAYOUT[i][0] + LAYOUT[i][1]
        # the next step of each context with room: its new token attends over the cache
        # the mixed pass wrote
        room = [i for i, (pre, k, n_ctx) in enumerate(LAYOUT) if pre + k < n_ctx]
        assert len(room) == len(LAYOUT) - 1  # the context filled to its last row has none
        toks = [int(logit_rows(ctxs[i])[-1].argmax()) for i in room]
        native_batch_ex([ctxs[i] for i in room], [1] * len(room), toks)
        for i, tok in zip(room, toks):
            ref = twins[i].eval([tok])[None, :]
            worst = max(worst, compare(logit_rows(ctxs[i]), ref, bound,
                                       f"step after the mixed batch, context {i}"))
    return worst


def check_bad_mixed_batches(m) -> None:
    """Chunks that overflow a context, a context given 0 tokens, a context given twice, more
    tokens than the lending context's n_batch: each refused by name, and no context
    changes (positions, logits)."""
    a = m.create_context(n_ctx=16, n_batch=8)
    b = m.create_context(n_ctx=16)
    a.eval([3, 4, 5])
    b.eval([3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    before = [(c.n_past, logit_rows(c)) for c in (a, b)]
    cases = [
        ([a, b], [1, 7], NativeValueError, "context full"),          # 10 + 7 > 16
        ([a, b], [2, 0], NativeValueError, "context 1 is given 0 tokens"),
        ([a, b, a], [1, 1, 1], NativeValueError, "contexts 0 and 2 are the same"),
        ([a, b], [6, 3], NativeValueError, "9 tokens in all.*n_batch = 8"),
    ]
    for ctxs, counts, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            native_batch_ex(ctxs, counts, [5] * sum(counts))
    with pytest.raises(NativeError, match="outside the vocabulary"):
        native_batch_ex([a, b], [2, 2], [5, 6, 7, m.n_vocab])
    for c, (n_past, rows) in zip((a, b), before):
        assert c.n_past == n_past
        assert np.array_equal(logit_rows(c), rows)
