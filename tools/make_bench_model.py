#!/usr/bin/env python3
"""Make the benchmark models of tools/bench.py and their GGUF files.

    python tools/make_bench_model.py [--layers 22 ...] [--types f16,q4_0] [--force]
                                     [--no-sparse] [--verify [N]]        # issue-5 model (default)
    python tools/make_bench_model.py --plain [--layers 8 ...]            # dense bench model
    python tools/make_bench_model.py --plain --arch qwen2|falcon|llama3  # dense ~1B of that shape
    python tools/make_bench_model.py --arch qwen3moe --types q4_k_m     # MoE, Qwen3-30B-A3B block
    python tools/make_bench_model.py --arch opt [...]                    # OPT-shaped issue-5 model
    python tools/make_bench_model.py --swiglu [--sparsity 0.5]           # SwiGLU 1.1B, gate mode
    python tools/make_bench_model.py ... --hf-only                       # the HF folder, no GGUFs

Three kinds of model, all written as a Hugging Face LLaMA folder (config.json,
model.safetensors in fp16 written tensor by tensor with numpy, tokenizer.json +
tokenizer_config.json) and converted by the project's converter
(powerinfer_cpp.convert) into GGUF files next to it:

* ``--sparse-construction`` (the default): the issue-5 model. A ReGLU ("relu")
  LLaMA at a realistic shape (d=2048, n_ff=5632, 22 layers, 32 heads / 4 KV heads,
  head_dim 64, vocab 32000, untied: 1.1B parameters) whose weights are CONSTRUCTED
  so that, on real text, >= 90% of the FFN neurons are zero per token with a
  skewed per-neuron firing frequency (see "Construction" below). It goes through
  the real pipeline: dense GGUF per type (for llama.cpp and our dense mode) and
  ``convert --sparse`` per type (profile -> predictors -> placement -> one extended
  GGUF), each stage timed into pipeline.json.
* ``--plain``: the foundation's dense bench model: random weights (normal, std
  0.02, norms = 1, seeded), default d=2048, 8 layers, 16 heads (16 KV heads),
  n_ff=5632, vocab 32000, ReLU (~542M params); dense GGUFs only.
* ``--swiglu``: random weights as ``--plain`` at the issue-5 shape with a SwiGLU FFN,
  dense and gate-mode GGUFs (below).

SwiGLU variant (``--swiglu``)
----------------------------
The 1.1B shape of the default model (d=2048, 22 layers, 32 heads / 4 KV heads, n_ff=5632,
vocab 32000, untied) with a SiLU-gated FFN and random weights as ``--plain`` (std 0.02,
norms 1): the dense GGUF per type (the same file names as ``--plain --act silu --layers 22
--heads 32 --kv-heads 4``, so either command reuses the other's), and per type the
gate-magnitude file ``convert --sparsity S`` (default ``--sparsity 0.5``: per layer the
|silu(gate)| threshold that zeroes half the neurons on the first ``--calib-tokens`` tokens of
the held-out text; no predictors), ``<name>-<type>-gate<S>.gguf``. Random weights have no
quality to lose and a flat firing frequency (no hot neurons), so this model measures the gate
mode's speed only (the dense gate, then up and down_t over the passing half), not what a
trained SwiGLU model keeps at that sparsity (models/tiny-swiglu-kjv and
tools/eval_sparsity.py measure that).

Dense models of the other architectures (``--plain --arch qwen2 | falcon | llama3``)
-------------------------------------------------------------------------------------
The same random weights (std ``--std``, norm weights 1, every bias -- q/k/v, LayerNorm --
random with std ``--std``: nonzero, so a file or runtime that drops one shows in the
logits), in the folder layout and config of the real architecture, at published ~1B
shapes except for the vocab (32000 rows and the shipped tokenizer, as every bench model:
the embedding is one row per token and the tied head is the same bytes for both engines,
so the vocab size is not what is compared); all three tie the head to the embedding as
their published models do:

* ``qwen2``: Qwen2.5-1.5B (and Qwen2-1.5B): d=1536, 28 layers, 12 heads / 2 KV heads
  (head_dim 128), n_ff=8960, SwiGLU, q/k/v biases, RMSNorm eps 1e-6, rope_theta 1e6,
  no sliding window: 1.36B parameters at vocab 32000 (1.54B at its own 151936);
* ``falcon``: Falcon's ``new_decoder_architecture`` layout (Falcon-40B/180B: GQA, fused
  QKV in its grouped row order, ``ln_attn`` + ``ln_mlp``, parallel attention + FFN, no
  linear biases, ungated exact-GELU FFN of 4d, NeoX RoPE theta 1e4) at Falcon-RW-1B's
  sizes (d=2048, 24 layers, 32 heads; Falcon-40B's head_dim 64 and 8 KV heads): no
  published Falcon of ~1B has this layout (Falcon-RW-1B is ALiBi MHA, Falcon3-1B is a
  llama), so this is the 40B block at 1.12B parameters;
* ``llama3``: Llama-3.2-1B: d=2048, 16 layers, 32 heads / 8 KV heads, n_ff=8192, SwiGLU,
  RMSNorm eps 1e-5, rope_theta 500000 with its ``llama3`` rope_scaling (factor 32,
  low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192; the
  converter writes rope_freqs.weight): 1.04B parameters at vocab 32000 (1.24B at 128256).

``--layers``, ``--d``, ``--heads``, ``--kv-heads``, ``--ff`` scale them down (the
architecture's layout and keys stay); ``--arch qwen2|falcon|llama3`` implies ``--plain``.

Mixture of experts (``--arch qwen3moe``)
----------------------------------------
Qwen3-30B-A3B's block with random weights as ``--plain`` (``Qwen3MoeForCausalLM``: d=2048,
32 heads / 4 KV heads of head_dim 128 (wider than d / heads, as published), per-head q/k
RMSNorm, 128 experts of width ``--ff`` 768 (``moe_intermediate_size``), 8 used per token
(``--experts``, ``--experts-used``), renormalised top-k weights, RMSNorm eps 1e-6,
rope_theta 1e6, untied head) at 20 layers instead of 48 (``--layers``): 12.5B parameters,
~7.6 GB in Q4_K_M, so the experts' bytes are far beyond any cache as in the real model,
while the HF folder (fp16, 25 GB) still fits the disk. A token reads 8 of 128 experts:
~0.39 GB of weights per token in Q4_K_M. The router is random, so routing is near uniform
(no hot experts): this model measures expert execution speed, not placement.
``--act relu`` (ReGLU experts, SmallThinker's) and ``--act drelu`` (``use_drelu``:
TurboSparse-Mixtral's relu(gate x) * relu(up x)) give ReLU-family experts; besides the dense
GGUF per type the script then writes the sparse experts' file (``convert --sparse``: each
expert's exact zeros; docs/FORMAT.md "Sparse experts") and, with ``--expert-sparsity S``,
one with a gate threshold per expert at S. Random weights make about half the gates
positive, so the exact file skips ~50% of the up rows and (dReLU) ~75% of the down rows,
well short of the ~90% trained TurboSparse experts reach; the ``--expert-sparsity 0.9`` file
reads what a 90%-sparse expert would (its outputs are not the dense model's).

Construction (``--sparse-construction``)
----------------------------------------
Let u be a fixed random unit vector of R^d and S a random orthonormal basis of a
k-dimensional subspace orthogonal to u (``--subspace``, default k=128) — the
"token space". The residual stream is kept at h = c*u + s, with s in S:

* embedding row t = c*u + S z_t * std*sqrt(d/k), z_t ~ N(0, I_k): every token shares
  the constant component c*u, |c*u| = ``--const`` (1.5) x |token part|;
* norms are 1, so the RMS-normed input of every block keeps the c*u component;
* attention: q, k random (std 0.02); v reads only the token part (v_proj projected
  off u); o_proj = S M (M random) writes into S only, scaled so that the attention
  output's RMS is ``--attn-scale`` (0.2) x the RMS of the embedding's token part (a
  fixed amount per layer, so the token part grows additively with depth and the
  constant component stays dominant: u.x ~ 0.6 |x| at layer 21);
* FFN (ReGLU: relu(gate.x) * (up.x)): gate row i = g_i - b_i*u with g_i random
  (std 0.02, projected off u: full rank, but only its part in S sees the data), up
  random (projected off u, so no constant leaks into the activations), down = S D
  (D random) scaled to ``--ffn-scale`` (0.2) x the embedding token part's RMS. Since the
  normed input x has u.x > 0, neuron i fires iff g_i.x / u.x > b_i: the offset
  along u decides how often it fires, the random part g_i decides for WHICH inputs
  (the active set depends on x, and a predictor has to learn the boundary).
* the offsets b_i are calibrated layer by layer on real text: the tail of the
  shipped held-out text (models/tiny-relu-kjv/heldout.txt, its last
  ``--construct-tokens`` tokens, in windows of 512 like the profiler; the profiler
  and the predictors use the first tokens of that text, so the two do not overlap)
  runs through a numpy forward pass of the weights made so far (fp16-rounded, HF
  rotate-half RoPE, GQA, causal); for each neuron, g_i.x / u.x over those tokens is
  fitted by a normal distribution N(mu_i, sd_i) and b_i = mu_i + sd_i * Phi^-1(1 - p_i);
* target firing probabilities p_i: a power law over a random ranking of the
  neurons, p_(r) = min(``--p-max`` (0.9), a r^-alpha), alpha = ``--alpha`` (1.1), a
  chosen so that the layer's mean is rho_l; rho_l rises linearly with depth from
  0.75 rho to 1.25 rho, rho = ``--density`` (0.06). On text other than the
  calibration tokens the deeper layers come out higher (--verify on the first 512
  held-out tokens, default 22-layer model, F16: 4.5% in layer 0 ... 9.5% in layer 21,
  mean 6.9%, i.e. up to ~1.25x the targets; Q4_0 weights add ~10%). With alpha 1.1
  one to a few hundred neurons per layer fire for most tokens, the top 10% of
  neurons carry 56-66% of all firings and the top 20% 75-79% (PowerInfer reports
  26% of OPT-30B's neurons carrying 80%), and a third or more of the neurons fire
  for < 1% of tokens.

OPT-shaped variant (``--arch opt``)
-----------------------------------
The same construction in an ``OPTForCausalLM`` folder (pre-LN, as OPT-125m...66B): the
sizes of the default model where they apply (d=2048, n_ff=5632, 22 layers, 32 heads,
vocab 32000, untied head), but MHA (OPT has no GQA: 32 KV heads), no RoPE, learned
absolute positions (2048 + OPT's 2 offset rows), LayerNorm, biases on every linear
layer, and the ungated FFN fc2(relu(fc1 x + b1)) + b2: 1.01B parameters (2.0 GB in fp16).
What changes:

* u and S are made of zero-mean vectors, so LayerNorm's mean subtraction leaves the
  stream (every write lies in S) alone and LayerNorm acts as RMSNorm on it; the
  LayerNorm weights are 1 and their biases small random vectors off u;
* the position rows lie in S, with ``POS_SCALE`` (0.5) x the token part's RMS; the
  forward pass restarts positions with every window of 512, as the profiler does;
* q, k, v biases are random (std 0.02); out_proj and fc2 write into S as o_proj and
  down do, and their biases are minus the mean write over the construction tokens;
* fc1 row i = g_i - b_i*u as the gate row above, with b1_i = -mean(g_i.x) over the
  construction tokens, and b_i calibrated on (g_i.x + b1_i) / u.x the same way: the
  neuron fires iff (g_i.x + b1_i) / u.x > b_i.

Checked at d=256 and d=2048 with fewer layers: the density of transformers' forward on the
construction tokens equals the construction's own forward's; with d=256, 22 layers, on the
first 512 held-out tokens 4.6% in layer 0 ... 9.4% in layer 21 (like the LLaMA model's ~1.25x
the targets), the top 10% of neurons carry 58-63% of the firings, u.x ~ 0.71 |x| in layer 21.
The GGUF steps need the converter to know OPT; ``--hf-only`` stops after the HF folder.

The token part lives in a 128-dimensional subspace, as the hidden states of real
models are dominated by few directions; every neuron's firing is then a linear
threshold function of the normed input x, which the predictor's
W2 relu(W1 x) can represent (the u component of x acts as its bias).

Predictors: real ones are ~11-23% of the FFN's parameters (PowerInfer,
ReluLLaMA-7B). The converter's adaptive hidden size starts at 32 and doubles while
held-out recall is short of the target, up to min(d, n_ff/2) = 2048 (45% of the
FFN); in trials on single synthetic layers of this kind (4096 tokens) recall stayed
at 0.93-0.95 for h = 512, 1024 and 2048 alike, so growing h buys bytes, not recall.
The sparse conversion fixes the hidden size through the converter's PredictorConfig
(h_start = h_max = ``--pred-h``, default 512: fc1 512x2048 + fc2 5632x512 = 11.4%
of the 3 x 2048 x 5632 FFN weights, the low end of PowerInfer's range;
``--pred-h-max`` lets it grow).

For ReGLU the converter first tries the
gate's own data-weighted rank-256 approximation as the h = 512 predictor
(predictor._gate_lowrank). Every neuron here is a linear threshold of the normed input,
which lives in span(u, S) (129 dimensions), so in F16 that approximation is exact up to
rounding: held-out recall and precision 0.993-0.995 with the predictors stored in Q8_0,
predicted density = true density. In Q4_0 the weights' rounding noise puts the hidden
state slightly outside the subspace: recall 0.975-0.99 at the true density. (Trained
instead, the predictors reached 0.85-0.94 recall at 1.4-1.8x the true density in F16, and
in Q4_0 the training went after that rounding noise and bought recall with density:
56-78% of the neurons predicted active.) This script turns the converter's training
fallback off (``--pred-train`` turns it on): in Q4_0 it costs ~1 minute per layer and
ends with the approximation anyway (the converter keeps it unless the trained net has
higher recall at no higher density). ``--pred-type`` (default q8_0) stores the
predictors in Q8_0 also for the F16 model: half the bytes of F16 (6.0% of the F16
FFN's bytes, 21.5% of the Q4_0 FFN's; the parameter count is unchanged) for ~0.5% of
recall. ``--pred-type q4_0`` halves the predictor bytes again; at the default threshold it
costs ~7% of recall, so pair it with ``--pred-threshold -0.15`` (recall 0.989-0.994 on the
Q4_0 model, above Q8_0's 0.97-0.99 at 0, at a predicted density 1.4x the true one; measured
trade-off in docs/BENCHMARKS.md, "Predictor storage and threshold").

``--verify [N]`` profiles the dense F16 GGUF with the runtime
(powerinfer_cpp.profile.profile_model) over the first N (default 512) tokens of
the held-out text and prints per-layer density, the share of firings carried by
the top 10% / 20% of neurons, and the density a fixed (input-independent) set of
neurons would need for 99% recall; written to verify.json.

Files go to CACHE/<shape-name>/ (hf/, <name>-<type>.gguf dense,
<name>-<type>-sparse.gguf, pipeline.json, verify.json); existing files are
reused unless --force. Never commit them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "models" / "tiny-relu-kjv"
HELDOUT = TOKENIZER_DIR / "heldout.txt"
DEFAULT_CACHE = "/tmp/pi-bench"
# predictor storage and threshold of the sparse files (--pred-type q4_0 --pred-threshold
# -0.15 is the measured alternative in docs/BENCHMARKS.md)
PRED_TYPE = "q8_0"
PRED_THRESHOLD = 0.0
CHUNK_ELEMS = 1 << 24  # 16M elements (64 MB of f32) per generated chunk
CONSTRUCT_WINDOW = 512
MAX_POS = 2048
# --arch opt: RMS of the learned position rows / RMS of the embedding's token part; below 1
# so that which token it is weighs more than where it stands, and the constant component
# stays dominant over the two together
POS_SCALE = 0.5

# shape defaults per (kind, arch) (None in argparse = take these; kv_heads None = heads)
_BASE = {"d": 2048, "ff": 5632, "act": "relu", "rope_theta": 10000.0, "rms_eps": 1e-5, "tied": False,
         "max_pos": MAX_POS}
SHAPE_DEFAULTS = {
    ("sparse", "llama"): {**_BASE, "layers": 22, "heads": 32, "kv_heads": 4},
    ("sparse", "opt"): {**_BASE, "layers": 22, "heads": 32, "kv_heads": None},
    ("plain", "llama"): {**_BASE, "layers": 8, "heads": 16, "kv_heads": None},
    ("swiglu", "llama"): {**_BASE, "layers": 22, "heads": 32, "kv_heads": 4, "act": "silu"},
    # Qwen2.5-1.5B
    ("plain", "qwen2"): {**_BASE, "d": 1536, "ff": 8960, "layers": 28, "heads": 12, "kv_heads": 2, "act": "silu",
                         "rope_theta": 1e6, "rms_eps": 1e-6, "tied": True, "max_pos": 32768},
    # Falcon-40B's block at Falcon-RW-1B's sizes
    ("plain", "falcon"): {**_BASE, "d": 2048, "ff": None, "layers": 24, "heads": 32, "kv_heads": 8,
                          "act": "gelu", "tied": True},
    # Llama-3.2-1B
    ("plain", "llama3"): {**_BASE, "d": 2048, "ff": 8192, "layers": 16, "heads": 32, "kv_heads": 8, "act": "silu",
                          "rope_theta": 500000.0, "tied": True, "max_pos": 131072},
    # Qwen3-30B-A3B's block at 20 of its 48 layers; ff = moe_intermediate_size
    ("plain", "qwen3moe"): {**_BASE, "d": 2048, "ff": 768, "layers": 20, "heads": 32, "kv_heads": 4,
                            "act": "silu", "rope_theta": 1e6, "rms_eps": 1e-6, "tied": False,
                            "max_pos": 40960},
}
PLAIN_ONLY = ("qwen2", "falcon", "llama3", "qwen3moe")
QWEN3MOE_HEAD_DIM = 128
# Llama-3.2-1B's rope_scaling
LLAMA3_ROPE_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def shape_name(a) -> str:
    kv = f"-kv{a.kv_heads}" if a.arch != "opt" else ""   # OPT: always one KV head per head
    if a.arch == "qwen3moe":
        kv += f"-e{a.experts}x{a.experts_used}"
    base = (f"{a.arch}-d{a.d}-l{a.layers}-h{a.heads}{kv}-ff{a.ff}-v{a.vocab}"
            f"-{a.act}-s{a.seed}")
    if a.kind in ("plain", "swiglu"):
        return base
    return (base + f"-sc2-k{a.subspace}-r{a.density:g}-a{a.alpha:g}"   # sc2: construction version 2
            + (f"-c{a.const:g}" if a.const != 1.5 else "")
            + (f"-as{a.attn_scale:g}-fs{a.ffn_scale:g}" if (a.attn_scale, a.ffn_scale) != (0.2, 0.2) else ""))


def sparse_name(a, t: str) -> str:
    """File name of the sparse GGUF of type t. Other predictor options than the defaults
    are part of it, so that a file made with other options is not reused."""
    if a.kind == "swiglu":
        return f"{shape_name(a)}-{t}-gate{a.sparsity:g}.gguf"
    opts = "" if (a.pred_type, a.pred_threshold) == (PRED_TYPE, PRED_THRESHOLD) else \
        f"-p{a.pred_type}-t{a.pred_threshold:g}"
    return f"{shape_name(a)}-{t}-sparse{opts}.gguf"


def hf_tensors(a) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes in the usual (sorted-by-layer) order."""
    if a.arch == "opt":
        return hf_tensors_opt(a)
    if a.arch == "falcon":
        return hf_tensors_falcon(a)
    hd = QWEN3MOE_HEAD_DIM if a.arch == "qwen3moe" else a.d // a.heads
    q_rows, kv_rows = a.heads * hd, a.kv_heads * hd
    qkv_bias = a.arch == "qwen2"
    out = [("model.embed_tokens.weight", (a.vocab, a.d))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (a.d,)))
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            out.append((p + f"self_attn.{proj}.weight", (rows, a.d)))
            if qkv_bias:
                out.append((p + f"self_attn.{proj}.bias", (rows,)))
        if a.arch == "qwen3moe":
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                    (p + "self_attn.o_proj.weight", (a.d, q_rows)),
                    (p + "post_attention_layernorm.weight", (a.d,)),
                    (p + "mlp.gate.weight", (a.experts, a.d))]
            for e in range(a.experts):
                out += [(p + f"mlp.experts.{e}.gate_proj.weight", (a.ff, a.d)),
                        (p + f"mlp.experts.{e}.up_proj.weight", (a.ff, a.d)),
                        (p + f"mlp.experts.{e}.down_proj.weight", (a.d, a.ff))]
            continue
        out += [
            (p + "self_attn.o_proj.weight", (a.d, q_rows)),
            (p + "post_attention_layernorm.weight", (a.d,)),
            (p + "mlp.gate_proj.weight", (a.ff, a.d)),
            (p + "mlp.up_proj.weight", (a.ff, a.d)),
            (p + "mlp.down_proj.weight", (a.d, a.ff)),
        ]
    out.append(("model.norm.weight", (a.d,)))
    if not a.tied:
        out.append(("lm_head.weight", (a.vocab, a.d)))
    return out


def hf_tensors_falcon(a) -> list[tuple[str, tuple[int, ...]]]:
    """FalconForCausalLM's tensors in the new_decoder_architecture layout (ln_attn + ln_mlp,
    fused grouped QKV, no linear biases: bias false, as Falcon-40B/180B), tied head."""
    d, hd = a.d, a.d // a.heads
    out = [("transformer.word_embeddings.weight", (a.vocab, d))]
    for i in range(a.layers):
        p = f"transformer.h.{i}."
        out += [(p + "ln_attn.weight", (d,)), (p + "ln_attn.bias", (d,)),
                (p + "ln_mlp.weight", (d,)), (p + "ln_mlp.bias", (d,)),
                (p + "self_attention.query_key_value.weight", ((a.heads + 2 * a.kv_heads) * hd, d)),
                (p + "self_attention.dense.weight", (d, a.heads * hd)),
                (p + "mlp.dense_h_to_4h.weight", (a.ff, d)),
                (p + "mlp.dense_4h_to_h.weight", (d, a.ff))]
    out += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    if not a.tied:
        out.append(("lm_head.weight", (a.vocab, d)))
    return out


def hf_tensors_opt(a) -> list[tuple[str, tuple[int, ...]]]:
    """OPTForCausalLM's tensors (pre-LN, biases, learned positions with OPT's offset of 2
    rows, untied head), in the order the construction writes them."""
    d = a.d
    out = [("model.decoder.embed_tokens.weight", (a.vocab, d)),
           ("model.decoder.embed_positions.weight", (MAX_POS + 2, d))]
    for i in range(a.layers):
        p = f"model.decoder.layers.{i}."
        out += [(p + "self_attn_layer_norm.weight", (d,)), (p + "self_attn_layer_norm.bias", (d,))]
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += [(p + f"self_attn.{proj}.weight", (d, d)), (p + f"self_attn.{proj}.bias", (d,))]
        out += [(p + "final_layer_norm.weight", (d,)), (p + "final_layer_norm.bias", (d,)),
                (p + "fc1.weight", (a.ff, d)), (p + "fc1.bias", (a.ff,)),
                (p + "fc2.weight", (d, a.ff)), (p + "fc2.bias", (d,))]
    out += [("model.decoder.final_layer_norm.weight", (d,)), ("model.decoder.final_layer_norm.bias", (d,)),
            ("lm_head.weight", (a.vocab, d))]
    return out


class SafetensorsWriter:
    """Writes an fp16 safetensors file whose tensors (names, shapes, order) are known
    up front; data is appended tensor by tensor (chunks allowed) in that order."""

    def __init__(self, path: Path, tensors, generator: str):
        header: dict = {"__metadata__": {"format": "pt", "generator": generator}}
        off = 0
        for name, shape in tensors:
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)
        self.path, self.tmp = path, path.with_suffix(".tmp")
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(hjson)))
        self.f.write(hjson)
        self.expect = [(n, int(np.prod(s))) for n, s in tensors]
        self.i, self.left = 0, self.expect[0][1] if self.expect else 0
        self.n_params = sum(n for _, n in self.expect)

    def write(self, name: str, arr: np.ndarray) -> None:
        exp_name, _ = self.expect[self.i]
        if name != exp_name or arr.size > self.left:
            raise RuntimeError(f"safetensors writer: got {name} ({arr.size}), expected {exp_name} ({self.left} left)")
        self.f.write(np.ascontiguousarray(arr, dtype="<f2").tobytes())
        self.left -= arr.size
        if self.left == 0:
            self.i += 1
            self.left = self.expect[self.i][1] if self.i < len(self.expect) else 0

    def close(self) -> None:
        if self.i != len(self.expect):
            raise RuntimeError("safetensors writer: not every tensor was written")
        self.f.close()
        os.replace(self.tmp, self.path)


def _random_chunks(rng, n: int, std: float):
    left = n
    while left:
        k = min(left, CHUNK_ELEMS)
        x = rng.standard_normal(k, dtype=np.float32)
        x *= std
        yield x
        left -= k


def write_plain_safetensors(path: Path, tensors, seed: int, std: float) -> int:
    """Random fp16 tensors: 1-D weights (norms) 1.0, biases and matrices random. Returns
    the parameter count."""
    w = SafetensorsWriter(path, tensors, "powerinfer-cpp tools/make_bench_model.py --plain")
    for ti, (name, shape) in enumerate(tensors):
        n = int(np.prod(shape))
        if len(shape) == 1 and not name.endswith(".bias"):
            w.write(name, np.ones(n, np.float32))
            continue
        for x in _random_chunks(np.random.default_rng([seed, ti]), n, std):
            w.write(name, x)
    w.close()
    return w.n_params


# --------------------------------------------------------------------------
# Sparse construction
# --------------------------------------------------------------------------

def _f16(x: np.ndarray) -> np.ndarray:
    """Round to fp16 and back (the forward pass uses the weights as written)."""
    return x.astype(np.float16).astype(np.float32)


def _rmsnorm(h: np.ndarray, eps: float) -> np.ndarray:
    return h / np.sqrt((h.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps).astype(np.float32)


def _layernorm(h: np.ndarray, eps: float, beta: np.ndarray) -> np.ndarray:
    """LayerNorm with weight 1 (the OPT construction's: a weight other than 1 would turn
    the constant direction u) and bias beta."""
    h64 = h.astype(np.float64)
    h64 -= h64.mean(axis=1, keepdims=True)
    return (h64 / np.sqrt((h64 ** 2).mean(axis=1, keepdims=True) + eps)).astype(np.float32) + beta[None, :]


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """HF LLaMA rotate-half RoPE on x [n, heads, hd]."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=1).astype(np.float32)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=1).astype(np.float32)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + np.concatenate([-x2, x1], axis=-1) * sin


def _attention(xa, wq, wk, wv, a, theta, window, biases=None) -> np.ndarray:
    """Causal GQA attention over windows of `window` tokens (cache cleared between
    windows, as the profiler runs); returns [n, heads*hd] before o_proj. theta None:
    no RoPE (OPT: the positions are in the input); biases: (bq, bk, bv) or None."""
    n = xa.shape[0]
    hd = a.d // a.heads
    rep = a.heads // a.kv_heads
    out = np.empty((n, a.heads * hd), np.float32)
    for s in range(0, n, window):
        x = xa[s:s + window]
        m = x.shape[0]
        pos = np.arange(m)
        q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
        if biases is not None:
            q, k, v = q + biases[0], k + biases[1], v + biases[2]
        q = q.reshape(m, a.heads, hd)
        k = k.reshape(m, a.kv_heads, hd)
        v = v.reshape(m, a.kv_heads, hd)
        if theta is not None:
            q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        sc = np.einsum("qhd,khd->hqk", q, k) / np.float32(math.sqrt(hd))
        sc[:, np.triu_indices(m, 1)[0], np.triu_indices(m, 1)[1]] = -np.inf
        sc -= sc.max(axis=2, keepdims=True)
        np.exp(sc, out=sc)
        sc /= sc.sum(axis=2, keepdims=True)
        out[s:s + m] = np.einsum("hqk,khd->qhd", sc, v).reshape(m, a.heads * hd)
    return out


def firing_targets(n_ff: int, mean: float, alpha: float, p_max: float, rng) -> np.ndarray:
    """Per-neuron firing probabilities: a power law min(p_max, c r^-alpha) over a random
    ranking, c chosen (bisection) so that the mean is `mean`."""
    r = np.arange(1, n_ff + 1, dtype=np.float64)
    lo, hi = 1e-9, 1e6
    for _ in range(200):
        c = math.sqrt(lo * hi)
        m = np.minimum(p_max, c * r ** -alpha).mean()
        lo, hi = (c, hi) if m < mean else (lo, c)
    p = np.minimum(p_max, c * r ** -alpha)
    return rng.permutation(p)


def _inv_norm_cdf(p: np.ndarray) -> np.ndarray:
    from statistics import NormalDist
    nd = NormalDist()
    return np.array([nd.inv_cdf(float(min(max(v, 1e-9), 1 - 1e-9))) for v in p])


def construction_tokens(n: int) -> np.ndarray:
    """The last n tokens of the shipped held-out text (BOS-prefixed tokenization as the
    runtime does; the profiler uses the FIRST tokens of the same text)."""
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids = np.asarray(tok.encode(HELDOUT.read_text(encoding="utf-8")).ids, dtype=np.int64)
    if len(ids) < 2 * n:
        sys.exit(f"error: {HELDOUT} has only {len(ids)} tokens; --construct-tokens must be <= {len(ids) // 2}")
    return ids[-n:]


def tok_rms_of(x: np.ndarray, u: np.ndarray) -> float:
    """RMS (over tokens and d) of the part of x off the unit vector u."""
    t = x - np.outer(x @ u, u)
    return float(np.sqrt((t.astype(np.float64) ** 2).mean()))


def _thresholds(z: np.ndarray, ptar: np.ndarray) -> np.ndarray:
    """Offsets b_i along u: z[:, i] (a neuron's input over u.x, over the construction
    tokens) fitted by N(mu_i, sd_i), b_i = mu_i + sd_i * Phi^-1(1 - p_i)."""
    mu, sd = z.mean(axis=0, dtype=np.float64), z.std(axis=0, dtype=np.float64)
    return (mu + sd * _inv_norm_cdf(1.0 - ptar)).astype(np.float32)


def _layer_density(a, il: int) -> float:
    return a.density * (0.75 + 0.5 * (il / (a.layers - 1) if a.layers > 1 else 0.5))


def _scaled_write(act: np.ndarray, m: np.ndarray, s_basis: np.ndarray, rms: float) -> np.ndarray:
    """The write matrix S M [d, n_in], scaled so that act @ (S M).T has RMS `rms`."""
    raw = (act @ m.T) @ s_basis.T
    scale = rms / max(float(np.sqrt((raw.astype(np.float64) ** 2).mean())), 1e-30)
    return _f16(s_basis @ (m * np.float32(scale)))


def write_sparse_safetensors(a, path: Path, log=print) -> tuple[int, dict]:
    """The constructed model (see the module docstring). Returns (params, info)."""
    opt = a.arch == "opt"
    tensors = hf_tensors(a)
    w = SafetensorsWriter(path, tensors, "powerinfer-cpp tools/make_bench_model.py --sparse-construction"
                          + (" --arch opt" if opt else ""))
    d, k, std = a.d, a.subspace, a.std
    rng = np.random.default_rng([a.seed, 1000])
    u = rng.standard_normal(d)
    if opt:   # LayerNorm subtracts each vector's mean: with u and S of zero mean that is a no-op
        u -= u.mean()
    u /= np.linalg.norm(u)
    s_basis = rng.standard_normal((d, k))
    if opt:
        s_basis -= s_basis.mean(axis=0, keepdims=True)
    s_basis -= np.outer(u, u @ s_basis)
    s_basis = np.linalg.qr(s_basis)[0].astype(np.float32)          # [d, k], orthonormal, _|_ u
    u = u.astype(np.float32)

    tok_scale = std * math.sqrt(d / k)                 # token part: |S z| ~ std sqrt(d)
    c = a.const * std * math.sqrt(d)

    # embedding, in row chunks; the construction tokens' rows are kept
    ids = construction_tokens(a.construct_tokens)
    emb_rows = {}
    need = set(int(t) for t in ids)
    rows_per = max(1, CHUNK_ELEMS // d)
    erng = np.random.default_rng([a.seed, 1001])
    emb_name = "model.decoder.embed_tokens.weight" if opt else "model.embed_tokens.weight"
    for r0 in range(0, a.vocab, rows_per):
        r1 = min(a.vocab, r0 + rows_per)
        z = erng.standard_normal((r1 - r0, k), dtype=np.float32)
        e = (z @ s_basis.T) * np.float32(tok_scale) + np.float32(c) * u[None, :]
        e = _f16(e)
        for t in need:
            if r0 <= t < r1:
                emb_rows[t] = e[t - r0]
        w.write(emb_name, e)
    h = np.stack([emb_rows[int(t)] for t in ids]).astype(np.float32)
    if opt:
        # learned positions live in the token space too; row p + 2 is position p (OPT's
        # offset), and positions restart with every window, as the profiler's do
        z = np.random.default_rng([a.seed, 1002]).standard_normal((MAX_POS + 2, k), dtype=np.float32)
        pe = _f16((z @ s_basis.T) * np.float32(tok_scale * POS_SCALE))
        w.write("model.decoder.embed_positions.weight", pe)
        h = h + pe[np.arange(len(ids)) % CONSTRUCT_WINDOW + 2]
        del z, pe
    tok0 = tok_rms_of(h, u)      # the input's token-part RMS: the unit of every layer's writes
    info = {"u_norm_of_embedding": float(c), "token_part_rms": float(tok_scale * math.sqrt(k / d)),
            "layers": []}
    cx = {"u": u, "s_basis": s_basis, "tok0": tok0, "ones": np.ones(d, np.float32)}
    layer = _opt_layer if opt else _llama_layer
    for il in range(a.layers):
        t0 = time.perf_counter()
        h, li = layer(a, il, h, cx, w)
        li["seconds"] = time.perf_counter() - t0
        info["layers"].append(li)
        log(f"  layer {il:2d}: density on the construction tokens {li['construction_density']:.3f} "
            f"(target {li['target_density']:.3f}), u.x/|x| {li['u_share']:.2f}, {li['seconds']:.1f} s")
    if opt:
        w.write("model.decoder.final_layer_norm.weight", cx["ones"])
        w.write("model.decoder.final_layer_norm.bias", _small_off_u(np.random.default_rng([a.seed, 3001]), a, u))
    else:
        w.write("model.norm.weight", cx["ones"])
    for x in _random_chunks(np.random.default_rng([a.seed, 3000]), a.vocab * d, std):
        w.write("lm_head.weight", x)
    w.close()
    return w.n_params, info


def _off_u(m: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Rows of m [rows, d] projected off the unit vector u."""
    return m - np.outer(m @ u, u)


def _small_off_u(rng, a, u: np.ndarray) -> np.ndarray:
    """A LayerNorm bias: random (std --std), off u, since a part along u would shift u.x,
    the quantity every neuron's offset is measured against."""
    return _f16(_off_u(rng.standard_normal((1, a.d), dtype=np.float32) * np.float32(a.std), u)[0])


def _llama_layer(a, il: int, h: np.ndarray, cx: dict, w) -> tuple[np.ndarray, dict]:
    """One constructed LLaMA (ReGLU, RMSNorm, RoPE, GQA) layer: writes its tensors and
    returns the residual stream of the construction tokens after it."""
    u, s_basis, tok0, ones = cx["u"], cx["s_basis"], cx["tok0"], cx["ones"]
    d, n_ff, k, std = a.d, a.ff, a.subspace, a.std
    hd = d // a.heads
    q_rows, kv_rows = a.heads * hd, a.kv_heads * hd
    lrng = np.random.default_rng([a.seed, 2000 + il])
    p = f"model.layers.{il}."
    # attention
    wq = _f16(lrng.standard_normal((q_rows, d), dtype=np.float32) * np.float32(std))
    wk = _f16(lrng.standard_normal((kv_rows, d), dtype=np.float32) * np.float32(std))
    wv = _f16(_off_u(lrng.standard_normal((kv_rows, d), dtype=np.float32) * np.float32(std), u))
    mo = lrng.standard_normal((k, q_rows), dtype=np.float32)
    xa = _rmsnorm(h, a.rms_eps)
    att = _attention(xa, wq, wk, wv, a, a.rope_theta, CONSTRUCT_WINDOW)
    wo = _scaled_write(att, mo, s_basis, a.attn_scale * tok0)      # [d, q_rows]
    h = h + att @ wo.T
    for name, arr in (("input_layernorm", ones), ("self_attn.q_proj", wq), ("self_attn.k_proj", wk),
                      ("self_attn.v_proj", wv), ("self_attn.o_proj", wo),
                      ("post_attention_layernorm", ones)):
        w.write(p + name + ".weight", arr)
    del wq, wk, wv, wo, mo, att
    # FFN
    rho = _layer_density(a, il)
    ptar = firing_targets(n_ff, rho, a.alpha, a.p_max, lrng)
    g = _off_u(lrng.standard_normal((n_ff, d), dtype=np.float32) * np.float32(std), u)
    xf = _rmsnorm(h, a.rms_eps)
    ux = xf @ u
    if ux.min() <= 0:
        sys.exit(f"error: layer {il}: the constant component vanished (u.x <= 0); raise --const")
    b = _thresholds((xf @ g.T) / ux[:, None], ptar)
    gate = _f16(g - np.outer(b, u))
    del g
    up = _f16(_off_u(lrng.standard_normal((n_ff, d), dtype=np.float32) * np.float32(std), u))
    pre = xf @ gate.T
    act = np.maximum(pre, 0) * (xf @ up.T)
    dens = float((pre > 0).mean())
    md = lrng.standard_normal((k, n_ff), dtype=np.float32)
    down = _scaled_write(act, md, s_basis, a.ffn_scale * tok0)     # [d, n_ff]
    h = h + act @ down.T
    w.write(p + "mlp.gate_proj.weight", gate)
    w.write(p + "mlp.up_proj.weight", up)
    w.write(p + "mlp.down_proj.weight", down)
    return h, {"layer": il, "target_density": rho, "construction_density": dens,
               "u_share": float(np.mean(ux / np.sqrt(d)))}


def _opt_layer(a, il: int, h: np.ndarray, cx: dict, w) -> tuple[np.ndarray, dict]:
    """One constructed OPT layer (pre-LN, MHA without RoPE, ungated relu(fc1 x + b1) FFN,
    biases everywhere), made as the LLaMA one: the threshold of neuron i is its fc1 row's
    offset along u; the reading biases are random (q, k, v) or centre the neuron's input
    (fc1), the writing ones (out_proj, fc2) centre the layer's write over the construction
    tokens, so they stay in the token space and the stream's constant component is kept."""
    u, s_basis, tok0, ones = cx["u"], cx["s_basis"], cx["tok0"], cx["ones"]
    d, n_ff, k, std = a.d, a.ff, a.subspace, a.std
    lrng = np.random.default_rng([a.seed, 2000 + il])
    p = f"model.decoder.layers.{il}."

    def rnd(*shape):
        return lrng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    # attention
    ln1 = _small_off_u(lrng, a, u)
    wq, bq = _f16(rnd(d, d)), _f16(rnd(d))
    wk, bk = _f16(rnd(d, d)), _f16(rnd(d))
    wv, bv = _f16(_off_u(rnd(d, d), u)), _f16(rnd(d))
    mo = lrng.standard_normal((k, d), dtype=np.float32)
    xa = _layernorm(h, a.ln_eps, ln1)
    att = _attention(xa, wq, wk, wv, a, None, CONSTRUCT_WINDOW, biases=(bq, bk, bv))
    wo = _scaled_write(att, mo, s_basis, a.attn_scale * tok0)
    o = att @ wo.T
    bo = _f16(-o.mean(axis=0))
    h = h + o + bo
    for name, arr in (("self_attn_layer_norm.weight", ones), ("self_attn_layer_norm.bias", ln1),
                      ("self_attn.q_proj.weight", wq), ("self_attn.q_proj.bias", bq),
                      ("self_attn.k_proj.weight", wk), ("self_attn.k_proj.bias", bk),
                      ("self_attn.v_proj.weight", wv), ("self_attn.v_proj.bias", bv),
                      ("self_attn.out_proj.weight", wo), ("self_attn.out_proj.bias", bo)):
        w.write(p + name, arr)
    del wq, wk, wv, wo, mo, att, o
    # FFN
    rho = _layer_density(a, il)
    ptar = firing_targets(n_ff, rho, a.alpha, a.p_max, lrng)
    ln2 = _small_off_u(lrng, a, u)
    g = _off_u(rnd(n_ff, d), u)
    xf = _layernorm(h, a.ln_eps, ln2)
    ux = xf @ u
    if ux.min() <= 0:
        sys.exit(f"error: layer {il}: the constant component vanished (u.x <= 0); raise --const")
    gx = xf @ g.T
    b1 = _f16(-gx.mean(axis=0))
    b = _thresholds((gx + b1) / ux[:, None], ptar)
    fc1 = _f16(g - np.outer(b, u))
    del g, gx
    pre = xf @ fc1.T + b1
    act = np.maximum(pre, 0)
    dens = float((pre > 0).mean())
    md = lrng.standard_normal((k, n_ff), dtype=np.float32)
    fc2 = _scaled_write(act, md, s_basis, a.ffn_scale * tok0)
    f = act @ fc2.T
    b2 = _f16(-f.mean(axis=0))
    h = h + f + b2
    for name, arr in (("final_layer_norm.weight", ones), ("final_layer_norm.bias", ln2),
                      ("fc1.weight", fc1), ("fc1.bias", b1), ("fc2.weight", fc2), ("fc2.bias", b2)):
        w.write(p + name, arr)
    return h, {"layer": il, "target_density": rho, "construction_density": dens,
               "u_share": float(np.mean(ux / np.sqrt(d)))}


# --------------------------------------------------------------------------
# HF folder, GGUF files, pipeline
# --------------------------------------------------------------------------

def hf_config(a) -> dict:
    if a.arch == "opt":
        return {
            "architectures": ["OPTForCausalLM"],
            "model_type": "opt",
            "hidden_size": a.d,
            "word_embed_proj_dim": a.d,
            "ffn_dim": a.ff,
            "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads,
            "vocab_size": a.vocab,
            "activation_function": a.act,
            "max_position_embeddings": MAX_POS,
            "do_layer_norm_before": True,
            "_remove_final_layer_norm": False,
            "layer_norm_elementwise_affine": True,
            "enable_bias": True,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "layerdrop": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "torch_dtype": "float16",
        }
    if a.arch == "falcon":
        return {
            "architectures": ["FalconForCausalLM"],
            "model_type": "falcon",
            "hidden_size": a.d,
            "ffn_hidden_size": a.ff,
            "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads,
            "num_kv_heads": a.kv_heads,
            "new_decoder_architecture": True,
            "num_ln_in_parallel_attn": 2,
            "parallel_attn": True,
            "multi_query": True,     # as Falcon-40B's config: ignored by the new layout
            "alibi": False,
            "bias": False,
            "activation": a.act,
            "layer_norm_epsilon": a.ln_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_pos,
            "vocab_size": a.vocab,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "tie_word_embeddings": a.tied,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float16",
        }
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if a.arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": "qwen2" if a.arch == "qwen2" else "llama",
        "hidden_size": a.d,
        "intermediate_size": a.ff,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "vocab_size": a.vocab,
        "hidden_act": "relu" if a.act == "drelu" else a.act,
        "max_position_embeddings": a.max_pos,
        "rms_norm_eps": a.rms_eps,
        "rope_theta": a.rope_theta,
        "tie_word_embeddings": a.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    if a.arch == "qwen3moe":
        cfg.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                    "head_dim": QWEN3MOE_HEAD_DIM, "num_experts": a.experts,
                    "num_experts_per_tok": a.experts_used, "moe_intermediate_size": a.ff,
                    "intermediate_size": 6144, "norm_topk_prob": True, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": False,
                    "sliding_window": None})
        if a.act == "drelu":  # TurboSparse's experts: relu on gate and up
            cfg["use_drelu"] = True
    if a.arch == "qwen2":
        # Qwen2.5-1.5B's: sliding-window attention switched off
        cfg.update({"use_sliding_window": False, "sliding_window": a.max_pos, "max_window_layers": 21})
    elif a.arch == "llama3":
        cfg.update({"head_dim": a.d // a.heads, "rope_scaling": dict(LLAMA3_ROPE_SCALING),
                    "attention_bias": False, "mlp_bias": False})
    return cfg


def make_hf(a, hf_dir: Path) -> dict:
    hf_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(a)
    tok_json = TOKENIZER_DIR / "tokenizer.json"
    if not tok_json.is_file():
        sys.exit(f"error: {tok_json} not found (the shipped tokenizer is reused for the bench model)")
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        if (TOKENIZER_DIR / fn).is_file():
            shutil.copyfile(TOKENIZER_DIR / fn, hf_dir / fn)
    (hf_dir / "config.json").unlink(missing_ok=True)   # written last: marks a complete folder
    t0 = time.time()
    info: dict = {}
    if a.kind in ("plain", "swiglu"):
        n = write_plain_safetensors(hf_dir / "model.safetensors", hf_tensors(a), a.seed, a.std)
    else:
        print(f"constructing {hf_dir} (sparse construction, {a.layers} layers)", file=sys.stderr)
        n, info = write_sparse_safetensors(a, hf_dir / "model.safetensors",
                                           log=lambda s: print(s, file=sys.stderr))
        info["construction"] = {k: getattr(a, k) for k in ("arch", "subspace", "density", "alpha", "p_max",
                                                            "const", "attn_scale", "ffn_scale",
                                                            "construct_tokens", "seed", "std")}
        (hf_dir / "construction.json").write_text(json.dumps(info, indent=1) + "\n")
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    info["n_params"] = n
    info["seconds"] = time.time() - t0
    print(f"wrote {hf_dir} ({n / 1e6:.1f}M params, {info['seconds']:.0f} s)", file=sys.stderr)
    return info


def _stale(path: Path, ref: Path) -> bool:
    return not path.is_file() or path.stat().st_mtime < ref.stat().st_mtime


def model_root(a) -> Path:
    return Path(a.cache) / shape_name(a)


def _load_pipeline(root: Path) -> dict:
    try:
        return json.loads((root / "pipeline.json").read_text())
    except (OSError, ValueError):
        return {}


def _save_pipeline(root: Path, pl: dict) -> None:
    (root / "pipeline.json").write_text(json.dumps(pl, indent=1) + "\n")


def ensure_hf(a) -> Path:
    """Make (or reuse) the HF folder; returns it."""
    root = model_root(a)
    hf_dir = root / "hf"
    if a.force or not (hf_dir / "config.json").is_file():
        _save_pipeline(root, {"make_hf": make_hf(a, hf_dir)})
    return hf_dir


def ensure_models(a) -> dict[str, Path]:
    """Make (or reuse) the HF folder and one DENSE GGUF per type; returns type -> path."""
    root = model_root(a)
    hf_dir = ensure_hf(a)
    pl = _load_pipeline(root)
    sys.path.insert(0, str(REPO / "python"))
    out = {}
    for t in a.types:
        g = root / f"{shape_name(a)}-{t}.gguf"
        if a.force or _stale(g, hf_dir / "config.json"):
            from powerinfer_cpp.convert import convert  # noqa: E402
            t0 = time.time()
            convert(hf_dir, g, outtype=t, progress=a.progress)
            dt = time.time() - t0
            pl.setdefault("dense", {})[t] = {"seconds": dt, "bytes": g.stat().st_size}
            _save_pipeline(root, pl)
            print(f"wrote {g} ({g.stat().st_size / 1e6:.0f} MB, {dt:.0f} s)", file=sys.stderr)
        out[t] = g
    return out


def ensure_sparse_models(a) -> dict[str, Path]:
    """Make (or reuse) one SPARSE GGUF per type (convert --sparse: profile, predictors,
    placement; --swiglu: convert --sparsity, gate thresholds); returns type -> path. Needs the
    HF folder (ensure_models)."""
    if a.arch == "qwen3moe" and (a.act in ("relu", "drelu") or a.expert_sparsity is not None):
        return ensure_expert_models(a)
    if a.kind == "plain":
        return {}
    if a.kind == "swiglu":
        return ensure_gate_models(a)
    root = model_root(a)
    hf_dir = root / "hf"
    sys.path.insert(0, str(REPO / "python"))
    out = {}
    for t in a.types:
        g = root / sparse_name(a, t)
        if a.force or _stale(g, hf_dir / "config.json"):
            import logging

            from powerinfer_cpp.convert import convert  # noqa: E402
            from powerinfer_cpp.sparse.pipeline import SparseOptions
            from powerinfer_cpp.sparse.predictor import PredictorConfig
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            opts = SparseOptions(calib=str(HELDOUT), calib_tokens=a.calib_tokens, predictor_recall=a.recall,
                                 vram_budget=0, n_threads=a.pipeline_threads,
                                 predictor_type=None if a.pred_type == "auto" else a.pred_type,
                                 threshold=a.pred_threshold,
                                 predictor=PredictorConfig(h_start=a.pred_h, h_max=a.pred_h_max or a.pred_h,
                                                           train_fallback=a.pred_train))
            rep: list = []
            t0 = time.time()
            convert(hf_dir, g, outtype=t, progress=a.progress, sparse=True, sparse_options=opts, report=rep)
            dt = time.time() - t0
            r = rep[0]
            pl = _load_pipeline(root)
            pl.setdefault("sparse", {})[t] = {
                "seconds_total": dt, "seconds": r.seconds, "bytes": g.stat().st_size,
                "calib_tokens": r.n_calib_tokens, "calib_source": r.calib_source,
                "density": r.density,
                "predictors": [{"layer": p.layer, "h": p.h, "recall": s[0], "precision": s[1],
                                "pred_density": s[2], "true_density": p.true_density,
                                "pred_bytes": pb, "ffn_bytes": fb, "seconds": p.seconds}
                               for p, s, pb, fb in zip(r.predictors, r.stored_recall, r.pred_bytes,
                                                       r.ffn_bytes)],
            }
            _save_pipeline(root, pl)
            print(f"wrote {g} ({g.stat().st_size / 1e6:.0f} MB, {dt:.0f} s: "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in r.seconds.items()) + ")", file=sys.stderr)
        out[t] = g
    return out


def ensure_expert_models(a) -> dict[str, Path]:
    """The sparse experts' GGUFs of a ReLU-family MoE bench model (docs/FORMAT.md "Sparse
    experts") per type: ``-sparse`` (convert --sparse: each expert's exact zeros) and, with
    --expert-sparsity S, ``-gate<S>`` (convert --sparsity S: a gate threshold per expert);
    returns name -> path."""
    root = model_root(a)
    hf_dir = root / "hf"
    sys.path.insert(0, str(REPO / "python"))
    out = {}
    # SwiGLU experts have no exact zeros: their gate file only
    levels = ([None] if a.act in ("relu", "drelu") else []) + \
        ([a.expert_sparsity] if a.expert_sparsity is not None else [])
    for t in a.types:
        for lv in levels:
            g = root / f"{shape_name(a)}-{t}-{'sparse' if lv is None else f'gate{lv:g}'}.gguf"
            if a.force or _stale(g, hf_dir / "config.json"):
                from powerinfer_cpp.convert import convert  # noqa: E402
                from powerinfer_cpp.sparse.pipeline import SparseOptions
                opts = SparseOptions(calib=str(HELDOUT), calib_tokens=a.calib_tokens, sparsity=lv,
                                     n_threads=a.pipeline_threads)
                rep: list = []
                t0 = time.time()
                convert(hf_dir, g, outtype=t, progress=a.progress, sparse=True, sparse_options=opts, report=rep)
                pl = _load_pipeline(root)
                pl.setdefault("experts", {})[g.name] = {
                    "seconds_total": time.time() - t0, "bytes": g.stat().st_size, "sparsity": lv,
                    "calib_tokens": rep[0].n_calib_tokens, "holdout_sparsity": rep[0].expert_holdout_sparsity}
                _save_pipeline(root, pl)
                print(f"wrote {g} ({g.stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
            out[t if lv is None else f"{t}-gate{lv:g}"] = g
    return out


def ensure_gate_models(a) -> dict[str, Path]:
    """Make (or reuse) one gate-magnitude GGUF per type (convert --sparsity a.sparsity);
    returns type -> path."""
    root = model_root(a)
    hf_dir = root / "hf"
    sys.path.insert(0, str(REPO / "python"))
    out = {}
    for t in a.types:
        g = root / sparse_name(a, t)
        if a.force or _stale(g, hf_dir / "config.json"):
            import logging

            from powerinfer_cpp.convert import convert  # noqa: E402
            from powerinfer_cpp.sparse.pipeline import SparseOptions
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            opts = SparseOptions(calib=str(HELDOUT), calib_tokens=a.calib_tokens, sparsity=a.sparsity,
                                 vram_budget=0, n_threads=a.pipeline_threads)
            rep: list = []
            t0 = time.time()
            convert(hf_dir, g, outtype=t, progress=a.progress, sparse=True, sparse_options=opts, report=rep)
            dt = time.time() - t0
            r = rep[0]
            pl = _load_pipeline(root)
            pl.setdefault("gate", {})[t] = {
                "seconds_total": dt, "seconds": r.seconds, "bytes": g.stat().st_size, "sparsity": a.sparsity,
                "calib_tokens": r.n_calib_tokens, "calib_source": r.calib_source,
                "thresholds": list(map(float, r.gate_thresholds)), "density": list(map(float, r.gate_density)),
            }
            _save_pipeline(root, pl)
            print(f"wrote {g} ({g.stat().st_size / 1e6:.0f} MB, {dt:.0f} s: "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in r.seconds.items()) + ")", file=sys.stderr)
        out[t] = g
    return out


def skew_stats(freq: np.ndarray) -> dict:
    """Firing-frequency skew of one layer: shares of all firings carried by the top 10% /
    20% of neurons, and the density a fixed neuron set needs for 99% recall."""
    f = np.sort(np.asarray(freq, dtype=np.float64))[::-1]
    tot = f.sum()
    n = f.size
    if tot <= 0:
        return {"density": 0.0, "top10": 0.0, "top20": 0.0, "static99": 0.0, "hot50": 0}
    cum = np.cumsum(f) / tot
    return {"density": float(f.mean()), "top10": float(cum[max(1, n // 10) - 1]),
            "top20": float(cum[max(1, n // 5) - 1]),
            "static99": float((np.searchsorted(cum, 0.99) + 1) / n),
            "hot50": int((f >= 0.5).sum()), "cold01": float((f < 0.01).mean())}


def verify(a, gguf_path: Path, n_tokens: int) -> dict:
    """Profile the dense GGUF over the first n_tokens of the held-out text (runtime's
    profiler) and report density and skew per layer (verify.json)."""
    from powerinfer_cpp.sparse.profile import profile_model
    t0 = time.time()
    prof = profile_model(str(gguf_path), HELDOUT.read_text(encoding="utf-8"), n_ctx=512,
                         max_tokens=n_tokens, progress=False, n_threads=a.pipeline_threads)
    layers = []
    for il in range(prof.n_layer):
        s = skew_stats(prof.freq[il])
        m = prof.mask[il]
        # how much the active set moves: mean Jaccard overlap of consecutive tokens' sets
        inter = (m[1:] & m[:-1]).sum(axis=1)
        union = (m[1:] | m[:-1]).sum(axis=1)
        s["jaccard_consecutive"] = float(np.mean(inter / np.maximum(union, 1)))
        s["layer"] = il
        layers.append(s)
    res = {"model": str(gguf_path), "tokens": prof.n_tokens, "seconds": time.time() - t0, "layers": layers,
           "mean_density": float(np.mean([x["density"] for x in layers]))}
    (gguf_path.parent / "verify.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def format_verify(res: dict) -> str:
    lines = [f"profile of {Path(res['model']).name} over {res['tokens']} held-out tokens "
             f"({res['seconds']:.0f} s): mean density {res['mean_density']:.3f}",
             "layer  density  top10%  top20%  fixed-set@99%  neurons>=50%  <1%   consecutive Jaccard"]
    for x in res["layers"]:
        lines.append(f"{x['layer']:5d}  {x['density']:7.3f}  {x['top10']:6.2f}  {x['top20']:6.2f}  "
                     f"{x['static99']:13.3f}  {x['hot50']:12d}  {x['cold01']:4.2f}  {x['jaccard_consecutive']:.2f}")
    return "\n".join(lines)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("bench model")
    kind = g.add_mutually_exclusive_group()
    kind.add_argument("--sparse-construction", dest="kind", action="store_const", const="sparse", default=None,
                      help="the issue-5 model with constructed activation sparsity (default)")
    kind.add_argument("--plain", dest="kind", action="store_const", const="plain",
                      help="the foundation's random dense bench model (8 layers, 16 heads by default)")
    kind.add_argument("--swiglu", dest="kind", action="store_const", const="swiglu",
                      help="random SwiGLU LLaMA at the default model's 1.1B shape: dense GGUFs and gate-mode "
                           "ones (convert --sparsity, see --sparsity)")
    g.add_argument("--arch", choices=("llama", "opt") + PLAIN_ONLY, default="llama",
                   help="llama: ReGLU LLaMA (default); opt: pre-LN OPT, ungated ReLU FFN with biases, "
                        "LayerNorm, learned positions, MHA (--kv-heads = --heads); sparse construction only; "
                        "qwen2 (Qwen2.5-1.5B), falcon (40B layout, ~1B), llama3 (Llama-3.2-1B): --plain "
                        "only (implied)")
    g.add_argument("--d", type=int, default=None, help="hidden size (default 2048; qwen2: 1536)")
    g.add_argument("--layers", type=int, default=None,
                   help="layers (default 22; --plain: 8; qwen2 28, falcon 24, llama3 16)")
    g.add_argument("--heads", type=int, default=None,
                   help="attention heads (default 32; --plain: 16; qwen2 12, falcon and llama3 32)")
    g.add_argument("--kv-heads", type=int, default=None,
                   help="KV heads (default 4; --plain and --arch opt: = heads; qwen2 2, falcon and llama3 8)")
    g.add_argument("--ff", type=int, default=None,
                   help="FFN size n_ff (default 5632; qwen2 8960, falcon 4d, llama3 8192)")
    g.add_argument("--vocab", type=int, default=32000, help="vocab rows (default 32000; >= 4096)")
    g.add_argument("--experts", type=int, default=128, help="--arch qwen3moe: experts per layer (default 128)")
    g.add_argument("--experts-used", type=int, default=8,
                   help="--arch qwen3moe: experts per token (default 8)")
    g.add_argument("--act", default=None, choices=["relu", "silu", "gelu", "drelu"],
                   help="hidden_act (default relu; qwen2 and llama3 silu, falcon gelu); --arch qwen3moe: "
                        "silu (default), relu (ReGLU experts, SmallThinker's) or drelu (TurboSparse's)")
    g.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    g.add_argument("--std", type=float, default=0.02, help="weight std (default 0.02)")
    g.add_argument("--cache", default=DEFAULT_CACHE, help=f"output folder (default {DEFAULT_CACHE})")
    g.add_argument("--force", action="store_true", help="rewrite the model and GGUF files")
    c = ap.add_argument_group("sparse construction (see the module docstring)")
    c.add_argument("--density", type=float, default=0.06, help="mean target share of active neurons (default 0.06)")
    c.add_argument("--alpha", type=float, default=1.1, help="power-law exponent of firing frequency (default 1.1)")
    c.add_argument("--p-max", type=float, default=0.9, help="firing probability of the hottest neurons (default 0.9)")
    c.add_argument("--subspace", type=int, default=128, help="dimension k of the token space (default 128)")
    c.add_argument("--const", type=float, default=1.5, help="|constant component| / |token part| (default 1.5)")
    c.add_argument("--attn-scale", type=float, default=0.2,
                   help="attention output RMS / the embedding token part's RMS (default 0.2)")
    c.add_argument("--ffn-scale", type=float, default=0.2,
                   help="FFN output RMS / the embedding token part's RMS (default 0.2)")
    c.add_argument("--construct-tokens", type=int, default=2048,
                   help="tokens (the held-out text's last ones) the offsets are calibrated on (default 2048)")
    s = ap.add_argument_group("sparse pipeline (convert --sparse)")
    s.add_argument("--calib-tokens", type=int, default=4096,
                   help="tokens profiled for the predictors (the held-out text's first ones; default 4096)")
    s.add_argument("--recall", type=float, default=0.99, help="predictor recall target (default 0.99)")
    s.add_argument("--pred-h", type=int, default=512,
                   help="predictor hidden size (minimum; default 512 = 11.4%% of the FFN at d=2048, n_ff=5632)")
    s.add_argument("--pred-h-max", type=int, default=None,
                   help="let the converter grow h up to this when recall is short (default: = --pred-h)")
    s.add_argument("--pred-type", default=PRED_TYPE, choices=("auto", "f16", "q8_0", "q4_0"),
                   help=f"storage of the predictors (default {PRED_TYPE} for every model type; auto: the "
                        "converter's rule, f16 for F16 models)")
    s.add_argument("--pred-threshold", type=float, default=PRED_THRESHOLD,
                   help=f"predictor threshold (default {PRED_THRESHOLD:g}; see the module docstring)")
    s.add_argument("--pred-train", action="store_true",
                   help="train a predictor where the gate's low-rank approximation misses the recall "
                        "target (the converter's default; off here: see the module docstring)")
    s.add_argument("--pipeline-threads", type=int, default=0, help="threads for profiling (default: all)")
    s.add_argument("--sparsity", type=float, default=0.5,
                   help="--swiglu: gate-magnitude sparsity of the gate-mode files (convert --sparsity; default 0.5)")
    s.add_argument("--expert-sparsity", type=float, default=None,
                   help="--arch qwen3moe: the file of expert gate thresholds at this sparsity (convert "
                        "--sparsity; with --act relu|drelu the exact-zeros file is always made)")


def finish_shape_args(a) -> None:
    if a.kind is None:
        a.kind = "plain" if a.arch in PLAIN_ONLY else "sparse"
    if a.arch in PLAIN_ONLY and a.kind != "plain":
        sys.exit(f"error: --arch {a.arch} is a random dense model (--plain); the sparse construction is "
                 "made for --arch llama and opt")
    if a.arch == "opt" and a.kind == "plain":
        sys.exit("error: --arch opt is made by the sparse construction only (not --plain)")
    if a.kind == "swiglu" and a.arch != "llama":
        sys.exit("error: --swiglu is a LLaMA (--arch llama)")
    if a.kind == "swiglu" and not 0 <= a.sparsity < 1:
        sys.exit(f"error: --sparsity must be in [0, 1), got {a.sparsity:g}")
    dflt = SHAPE_DEFAULTS[(a.kind, a.arch)]
    for k in ("d", "layers", "heads", "act"):
        if getattr(a, k) is None:
            setattr(a, k, dflt[k])
    if a.ff is None:
        a.ff = dflt["ff"] or 4 * a.d      # Falcon's ffn_hidden_size default
    if a.arch == "opt":
        if a.kv_heads not in (None, a.heads):
            sys.exit("error: OPT has no GQA: --arch opt needs --kv-heads = --heads (or no --kv-heads)")
        a.kv_heads = a.heads
    if a.kv_heads is None:
        kv = dflt["kv_heads"]
        if kv is not None and a.arch in PLAIN_ONLY:
            kv = max(1, kv * a.heads // dflt["heads"])   # a scaled-down --heads keeps the published ratio
        a.kv_heads = a.heads if kv is None else kv
    a.rms_eps, a.rope_theta, a.tied, a.max_pos = dflt["rms_eps"], dflt["rope_theta"], dflt["tied"], dflt["max_pos"]
    a.ln_eps = 1e-5     # OPT's LayerNorm (torch's default; OPT's config has no key for it) and Falcon's
    if a.d % a.heads or a.heads % a.kv_heads or a.vocab < 4096:
        sys.exit("error: need d % heads == 0, heads % kv_heads == 0, vocab >= 4096")
    if a.arch == "qwen3moe" and not 1 <= a.experts_used <= a.experts:
        sys.exit("error: need 1 <= --experts-used <= --experts")
    if a.act == "drelu" and a.arch != "qwen3moe":
        sys.exit("error: --act drelu is for --arch qwen3moe (TurboSparse-style experts)")
    if a.expert_sparsity is not None and not (a.arch == "qwen3moe" and 0 < a.expert_sparsity < 1):
        sys.exit("error: --expert-sparsity S (0 < S < 1) is for --arch qwen3moe")
    if a.arch in ("qwen2", "falcon", "llama3") and (a.d // a.heads) % 2:
        sys.exit("error: RoPE needs an even head size (d / heads)")
    if a.kind == "sparse":
        if a.act != "relu":
            sys.exit("error: the sparse construction needs --act relu")
        if not 0 < a.density < a.p_max <= 1 or a.subspace < 1 or a.subspace >= a.d:
            sys.exit("error: need 0 < --density < --p-max <= 1 and 1 <= --subspace < d")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--types", default="f16,q4_0", help="GGUF types to convert to (default f16,q4_0)")
    ap.add_argument("--no-sparse", action="store_true", help="dense GGUFs only (skip convert --sparse)")
    ap.add_argument("--hf-only", action="store_true",
                    help="make the Hugging Face folder only (no GGUF files); prints its path")
    ap.add_argument("--verify", type=int, nargs="?", const=512, default=0, metavar="N",
                    help="profile the dense F16 GGUF over N held-out tokens (default 512) and print "
                         "density and skew per layer")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    finish_shape_args(a)
    a.types = [t.strip() for t in a.types.split(",") if t.strip()]
    a.progress = not a.quiet
    if a.hf_only:
        print(f"hf\t{ensure_hf(a)}")
        return 0
    dense = ensure_models(a)
    for t, p in dense.items():
        print(f"{t}\t{p}")
    if a.verify:
        vt = "f16" if "f16" in dense else a.types[0]
        print(format_verify(verify(a, dense[vt], a.verify)), file=sys.stderr)
    if not a.no_sparse:
        for t, p in ensure_sparse_models(a).items():
            print(f"{t}-sparse\t{p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
