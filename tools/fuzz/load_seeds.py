"""Seed files for the load-path fuzzer (tools/fuzz/load_fuzz.c): tiny, complete models
the runtime loads and runs, small enough (a few KiB) that libFuzzer mutates them fast.

    PYTHONPATH=python python tools/fuzz/load_seeds.py OUT_DIR

Written with gguf.GGUFWriter (numpy + gguf only): a 32-wide LLaMA-layout model (2 heads
of 16, one KV head, n_ff 32, 8 tokens, 1 or 2 layers) in F32, F16, Q8_0 and Q4_0, and
the same with each part of the sparse extension (transposed down projection, predictor,
neuron frequencies, GPU index, gate thresholds, input-sparse projections), with an
untied head, with Llama-3 RoPE divisors, and as qwen2 (q/k/v biases). The other
architectures' layouts come from the converter's seeds in tools/fuzz_ci.sh.
Names come from powerinfer_cpp.format, the one module that spells them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

D, N_HEAD, N_HEAD_KV, HEAD, N_FF, N_VOCAB, H_PRED = 32, 2, 1, 16, 32, 8, 8
DQ, DKV = N_HEAD * HEAD, N_HEAD_KV * HEAD


def _writer(path, arch, n_layer):
    import gguf

    from powerinfer_cpp import format as F

    w = gguf.GGUFWriter(str(path), arch)
    k = lambda t: F.arch_key(t, arch)  # noqa: E731
    w.add_uint32(k(F.KEY_EMBEDDING_LENGTH), D)
    w.add_uint32(k(F.KEY_BLOCK_COUNT), n_layer)
    w.add_uint32(k(F.KEY_FEED_FORWARD_LENGTH), N_FF)
    w.add_uint32(k(F.KEY_HEAD_COUNT), N_HEAD)
    w.add_uint32(k(F.KEY_HEAD_COUNT_KV), N_HEAD_KV)
    w.add_uint32(k(F.KEY_CONTEXT_LENGTH), 64)
    w.add_uint32(k(F.KEY_VOCAB_SIZE), N_VOCAB)
    w.add_float32(k(F.KEY_RMS_EPS), 1e-5)
    w.add_float32(k(F.KEY_ROPE_FREQ_BASE), 10000.0)
    w.add_string(F.KEY_FFN_ACTIVATION, "relu")
    w.add_uint32(F.KEY_TOKENIZER_BOS_ID, 1)
    w.add_uint32(F.KEY_TOKENIZER_EOS_ID, 2)
    return w


def _mat(rng, rows, cols, qtype):
    """A rows x cols weight (numpy shape: ne1 = rows, ne0 = cols) stored as qtype."""
    import gguf

    a = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
    if qtype == "f32":
        return a, None
    if qtype == "f16":
        return a.astype(np.float16), None
    t = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[qtype]
    return gguf.quants.quantize(a, t), t


def write_llama(path, *, qtype="f16", n_layer=2, arch="llama", tied=True, sparse=False,
                gate_thr=False, input_sparse=False, rope_freqs=False, biases=False, seed=0):
    from powerinfer_cpp import format as F

    rng = np.random.default_rng(seed)
    w = _writer(path, arch, n_layer)

    def add(name, rows, cols, q=qtype):
        a, t = _mat(rng, rows, cols, q)
        w.add_tensor(name, a, raw_dtype=t)

    def vec(name, n, lo=0.9, hi=1.1):
        w.add_tensor(name, rng.uniform(lo, hi, n).astype(np.float32))

    add(F.tensor_name(F.T_TOKEN_EMBD), N_VOCAB, D)
    vec(F.tensor_name(F.T_OUTPUT_NORM), D)
    if not tied:
        add(F.tensor_name(F.T_OUTPUT), N_VOCAB, D, "f16")
    if rope_freqs:
        vec(F.tensor_name(F.T_ROPE_FREQS), HEAD // 2, 1.0, 4.0)
    if sparse:
        w.add_uint32(F.KEY_FORMAT_VERSION, 1)
        w.add_float32(F.KEY_SPARSE_THRESHOLD, 0.0)
    if gate_thr:
        w.add_array(F.KEY_SPARSE_GATE_THRESHOLD, [0.05] * n_layer)
    for il in range(n_layer):
        vec(F.tensor_name(F.T_ATTN_NORM, il), D)
        add(F.tensor_name(F.T_ATTN_Q, il), DQ, D)
        add(F.tensor_name(F.T_ATTN_K, il), DKV, D)
        add(F.tensor_name(F.T_ATTN_V, il), DKV, D)
        if biases:
            vec(F.tensor_name(F.T_ATTN_Q, il, "bias"), DQ, -0.1, 0.1)
            vec(F.tensor_name(F.T_ATTN_K, il, "bias"), DKV, -0.1, 0.1)
            vec(F.tensor_name(F.T_ATTN_V, il, "bias"), DKV, -0.1, 0.1)
        add(F.tensor_name(F.T_ATTN_OUTPUT, il), D, DQ)
        vec(F.tensor_name(F.T_FFN_NORM, il), D)
        add(F.tensor_name(F.T_FFN_GATE, il), N_FF, D)
        add(F.tensor_name(F.T_FFN_UP, il), N_FF, D)
        if sparse:
            add(F.sparse_tensor_name(F.T_FFN_DOWN_T, il), N_FF, D)
            add(F.sparse_tensor_name(F.T_FC1, il), H_PRED, D, "f32")
            add(F.sparse_tensor_name(F.T_FC2, il), N_FF, H_PRED, "f32")
            w.add_tensor(F.sparse_tensor_name(F.T_FFN_FREQ, il), rng.uniform(0, 1, N_FF).astype(np.float32))
            hot = np.zeros(N_FF, dtype=np.int32)
            hot[::5] = 1
            w.add_tensor(F.sparse_tensor_name(F.T_GPU_IDX, il), hot)
            w.add_tensor(F.sparse_tensor_name(F.T_GPU_BUCKET, il), np.flatnonzero(hot).astype(np.int32))
        else:
            add(F.tensor_name(F.T_FFN_DOWN, il), D, N_FF)
        if input_sparse:
            add(F.tensor_name(F.T_ATTN_QKV_T, il), D, DQ + 2 * DKV, "f16")
            vec(F.tensor_name(F.T_ATTN_QKV_IN_THR, il, None), D, 0.0, 0.1)
            add(F.tensor_name(F.T_ATTN_OUTPUT_T, il), DQ, D, "f16")
            vec(F.tensor_name(F.T_ATTN_OUTPUT_IN_THR, il, None), DQ, 0.0, 0.1)
    if input_sparse:
        add(F.tensor_name(F.T_OUTPUT_T), D, N_VOCAB, "f32")
        vec(F.tensor_name(F.T_OUTPUT_IN_THR, None, None), D, 0.0, 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SEEDS = {
    **{f"llama-{q}": dict(qtype=q) for q in ("f32", "f16", "q8_0", "q4_0")},
    "llama-q4_0-1layer": dict(qtype="q4_0", n_layer=1),
    "llama-untied-ropefreqs": dict(qtype="q8_0", tied=False, rope_freqs=True),
    "llama-sparse": dict(qtype="q4_0", sparse=True),
    "llama-gate": dict(qtype="q8_0", gate_thr=True, n_layer=1),
    "llama-input-sparse": dict(qtype="q4_0", input_sparse=True, n_layer=1),
    "llama-all-sparse": dict(qtype="f16", sparse=True, gate_thr=True, input_sparse=True, n_layer=1),
    "qwen2-biases": dict(qtype="q4_0", arch="qwen2", biases=True),
}


def main(out: str) -> None:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    for name, kw in SEEDS.items():
        write_llama(d / f"load-{name}.gguf", **kw)
    print(f"   {len(SEEDS)} hand-made load seeds in {d}")


if __name__ == "__main__":
    main(sys.argv[1])
