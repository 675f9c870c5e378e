"""Activation profiling: run the native runtime densely over calibration text and record,
for every layer, the FFN input vectors and which FFN neurons were truly active.

    from powerinfer_cpp.sparse.profile import profile_model
    prof = profile_model("model.gguf", text, n_ctx=512, max_tokens=20000)
    prof.x[l]     # [N, n_embd] float32: the normed input of layer l's FFN (gate/up)
    prof.mask[l]  # [N, n_ff] bool: neuron i of layer l active for token t
    prof.freq[l]  # [n_ff] float64: fraction of the N tokens each neuron fired for

With ``inputs=K`` it also records, for K tokens (whole windows), the inputs of the
projections that input sparsity thresholds (``attn_in[l]`` [K, n_embd]: q/k/v's,
``attn_out_in[l]`` [K, n_head * head_dim]: o's, ``head_in`` [K, n_embd]: the head's), and
their token ids (``input_ids``). The windows are spread evenly over the profiled text (over
its first ``inputs_span`` share), not its first K tokens: o's inputs follow the text's style
(on the shipped SwiGLU model's heldout.txt, epistles then Revelation, thresholds fitted on
the first 4096 tokens skipped ~4 points more of o's inputs on Revelation at 50%).

``profile_inputs`` records only those projection inputs, in the context's own modes (the
runtime runs the FFN dense only while it records the FFN): what each input-sparse site sees in
the sparse mode (input_eval.refit).

"Active" (the runtime's gh_eval_profile decides): ReGLU gate > 0; FATReLU gate > t; dReLU
gate > 0 and up > 0; an ungated FFN (OPT, Falcon) act(up x + b) != 0; SwiGLU/GeGLU
act(gate) * up != 0 (nearly every neuron: those FFNs are not sparse). This is what a
predictor learns to guess from x.

The text runs in independent windows of n_ctx tokens (the cache is cleared between
windows, as Context.perplexity does), so the result is a pure function of the text, the
model and n_ctx: the same whatever the thread count or batch size.

Memory: N x n_layer x (4 n_embd + n_ff) bytes (x in float32, one byte per mask entry);
e.g. 20,000 tokens of a 22-layer d=2048, n_ff=5632 model take 6.0 GB. `max_tokens`
caps N; a profile that would not fit in the available memory is refused up front.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from .._native import check, ffi, lib
from ..model import Model


@dataclass
class Profile:
    """Per-layer FFN inputs and activation masks of N profiled tokens."""

    tokens: np.ndarray          # [N] int32: the profiled token ids
    x: np.ndarray               # [n_layer, N, n_embd] float32; x[l] is layer l's [N, n_embd]
    mask: np.ndarray            # [n_layer, N, n_ff] bool; mask[l] is layer l's [N, n_ff]
    freq: np.ndarray            # [n_layer, n_ff] float64: mask[l].mean(axis=0)
    ffn_act: str                # the model's activation kind (format.ACTIVATIONS)
    n_ctx: int                  # window length the text ran in
    meta: dict = field(default_factory=dict)
    # the projections' inputs of the first n_input_tokens tokens (profile_model(inputs=K))
    attn_in: np.ndarray | None = None      # [n_layer, K, n_embd]
    attn_out_in: np.ndarray | None = None  # [n_layer, K, n_head * head_dim]
    head_in: np.ndarray | None = None      # [K, n_embd]
    input_ids: np.ndarray | None = None    # [K] int32: their tokens, whole windows in text order

    @property
    def n_input_tokens(self) -> int:
        return 0 if self.head_in is None else int(self.head_in.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def n_layer(self) -> int:
        return int(self.x.shape[0])

    @property
    def density(self) -> np.ndarray:
        """[n_layer] mean fraction of neurons active per token."""
        return self.freq.mean(axis=1)

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes + self.mask.nbytes)

    def summary(self) -> str:
        d = self.density
        return (f"{self.n_tokens} tokens x {self.n_layer} layers profiled (windows of "
                f"{self.n_ctx}); active neurons per token: mean {d.mean():.1%}, per layer "
                f"{', '.join(f'{v:.1%}' for v in d)}; {self.nbytes / 2**20:.1f} MiB")


def profile_bytes(n_tokens: int, n_layer: int, n_embd: int, n_ff: int) -> int:
    """Bytes a profile of n_tokens takes (x float32 + one byte per mask entry)."""
    return int(n_tokens) * int(n_layer) * (4 * int(n_embd) + int(n_ff))


def _available_memory() -> int | None:
    """Bytes that can be allocated without swapping: Linux's MemAvailable (free memory plus
    the page cache it can drop; after reading a model file most memory is page cache, which
    "free" pages alone would count as used), else the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def profile_model(model: str | os.PathLike | Model, tokens: str | Sequence[int], *,
                  n_ctx: int = 512, n_threads: int = 0, n_batch: int = 512,
                  max_tokens: int | None = None, progress: bool = True, inputs: int = 0,
                  inputs_span: float = 1.0) -> Profile:
    """Profile `model` (a GGUF path or a loaded Model) over `tokens` (token ids, or a text
    that is tokenized with the model's tokenizer, BOS included as the file says).

    Runs windows of n_ctx tokens (at most the model's training context); max_tokens caps the number profiled (the first ones).
    progress shows a tqdm bar over tokens. inputs > 0 also records the projections'
    inputs of `inputs` tokens (rounded up to whole windows) in windows spread evenly over the
    first inputs_span share of the tokens (those a quality budget does not hold out). Raises
    MemoryError when the profile would not fit in the available memory (lower max_tokens)."""
    own = not isinstance(model, Model)
    m = Model(model, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch) if own else model
    try:
        if n_ctx < 1:
            raise ValueError("n_ctx must be >= 1")
        n_ctx = min(n_ctx, m.info.n_ctx_train)  # no windows longer than the model was trained for
        ids = m.tokenize(tokens) if isinstance(tokens, str) else list(tokens)
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
            ids = ids[:max_tokens]
        if not ids:
            raise ValueError("nothing to profile: no tokens")
        arr = np.asarray(ids, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= m.n_vocab:
            bad = int(arr[(arr < 0) | (arr >= m.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {m.n_vocab})")
        toks = arr.astype(np.int32)
        info = m.info
        n = toks.size
        dq = info.n_head * info.head_dim
        if not 0.0 < inputs_span <= 1.0:
            raise ValueError(f"inputs_span must be a share in (0, 1], got {inputs_span}")
        starts = list(range(0, n, n_ctx))
        rec_at: dict = {}  # window start -> its offset in the recorded arrays
        if inputs > 0:
            # whole windows inside the span (a text shorter than one window: that window)
            span = [w for w in starts if w + n_ctx <= max(int(n * inputs_span), n_ctx)] or starts[:1]
            want = min(len(span), -(-int(inputs) // n_ctx))
            pick = sorted({span[int(round(i))] for i in np.linspace(0, len(span) - 1, want)})
            off = 0
            for w in pick:
                rec_at[w] = off
                off += min(n_ctx, n - w)
        n_in = sum(min(n_ctx, n - w) for w in rec_at)
        need = profile_bytes(n, info.n_layer, info.n_embd, info.n_ff)
        need += 4 * n_in * (info.n_layer * (info.n_embd + dq) + info.n_embd)
        avail = _available_memory()
        if avail is not None and need > 0.9 * avail:
            raise MemoryError(
                f"a profile of {n} tokens needs {need / 2**30:.2f} GiB ({info.n_layer} layers x "
                f"(4 x {info.n_embd} + {info.n_ff}) bytes per token) but only "
                f"{avail / 2**30:.2f} GiB are available; pass a smaller max_tokens")

        x = np.empty((info.n_layer, n, info.n_embd), dtype=np.float32)
        # a mixture of experts has no one FFN's neuron mask: its inputs only (expert_sparsity.py)
        n_mask = 0 if info.n_expert else info.n_ff
        mask = np.empty((info.n_layer, n, n_mask), dtype=np.uint8)
        a_in = np.empty((info.n_layer, n_in, info.n_embd), dtype=np.float32) if n_in else None
        a_out = np.empty((info.n_layer, n_in, dq), dtype=np.float32) if n_in else None
        h_in = np.empty((n_in, info.n_embd), dtype=np.float32) if n_in else None
        ctx = m.create_context(n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, ffn="file")
        window = n_ctx  # the windows rec_at was planned for
        bar = None
        if progress:
            bar = tqdm(total=n, desc="profiling", unit="tok", dynamic_ncols=True)
        try:
            x_stride, m_stride = n * info.n_embd, n * n_mask
            for start in range(0, n, window):
                w = toks[start:start + window]
                ctx.reset()
                rec = start in rec_at  # this window's projection inputs too
                r0 = rec_at.get(start, 0)
                with ctx._calling() as ptr:  # a private context: its token list is not kept
                    bufs = {"ffn_in": ffi.cast("float *", x[0, start:].ctypes.data),
                            "ffn_in_stride": x_stride}
                    if n_mask:
                        bufs.update(mask=ffi.cast("uint8_t *", mask[0, start:].ctypes.data),
                                    mask_stride=m_stride)
                    if rec:
                        bufs.update(attn_in=ffi.cast("float *", a_in[0, r0:].ctypes.data),
                                    attn_in_stride=n_in * info.n_embd,
                                    attn_out_in=ffi.cast("float *", a_out[0, r0:].ctypes.data),
                                    attn_out_in_stride=n_in * dq,
                                    head_in=ffi.cast("float *", h_in[r0:].ctypes.data))
                    check(lib.gh_eval_profile(ptr, ffi.from_buffer("int32_t[]", w), int(w.size),
                                              ffi.new("gh_profile_bufs *", bufs)))
                if bar is not None:
                    bar.update(int(w.size))
        finally:
            if bar is not None:
                bar.close()
            ctx.close()
        maskb = mask.view(np.bool_)  # entries are 0/1
        freq = maskb.mean(axis=1, dtype=np.float64)
        return Profile(tokens=toks, x=x, mask=maskb, freq=freq, ffn_act=info.ffn_act,
                       n_ctx=window, meta={"model": getattr(m, "path", None)},
                       attn_in=a_in, attn_out_in=a_out, head_in=h_in,
                       input_ids=(np.concatenate([toks[w:w + window] for w in rec_at]) if n_in else None))
    finally:
        if own:
            m.close()


def profile_inputs(ctx, ids: Sequence[int], window: int,
                   progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The projections' inputs of ids, run in windows of `window` tokens (cache cleared
    between them) in ctx's FFN mode and input sparsity: attn_in [n_layer, N, n_embd],
    attn_out_in [n_layer, N, n_head * head_dim], head_in [N, n_embd]; progress(n) after
    each window."""
    info = ctx.model.info
    toks = np.asarray(ids, dtype=np.int32)
    n, dq = toks.size, info.n_head * info.head_dim
    a_in = np.empty((info.n_layer, n, info.n_embd), dtype=np.float32)
    a_out = np.empty((info.n_layer, n, dq), dtype=np.float32)
    h_in = np.empty((n, info.n_embd), dtype=np.float32)
    for start in range(0, n, window):
        w = toks[start:start + window]
        ctx.reset()
        with ctx._calling() as ptr:  # the token list is not kept: the window is reset after
            bufs = ffi.new("gh_profile_bufs *", {
                "attn_in": ffi.cast("float *", a_in[0, start:].ctypes.data),
                "attn_in_stride": n * info.n_embd,
                "attn_out_in": ffi.cast("float *", a_out[0, start:].ctypes.data),
                "attn_out_in_stride": n * dq,
                "head_in": ffi.cast("float *", h_in[start:].ctypes.data)})
            check(lib.gh_eval_profile(ptr, ffi.from_buffer("int32_t[]", w), int(w.size), bufs))
        if progress is not None:
            progress(int(w.size))
    ctx.reset()
    return a_in, a_out, h_in
