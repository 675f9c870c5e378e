"""The metadata every converted file carries: general.*, the hyper-parameter keys common
to all architectures, our powerinfer.* keys, the tokenizer; plus what the architecture
adds (Architecture.keys)."""

from __future__ import annotations

from gguf import GGUFValueType as V

from .. import format as F
from ..gguf_write import KV
from .arch import NORM_RMS, Architecture, HFParams
from .hf import TokenizerMeta


def model_kv(arch: Architecture, p: HFParams, tm: TokenizerMeta, outtype: str) -> list[KV]:
    """All metadata entries of a dense file (general.architecture is the writer's)."""
    A = p.arch
    out: list[KV] = []

    def u32(key, v):
        out.append((key, int(v), V.UINT32, None))

    def f32(key, v):
        out.append((key, float(v), V.FLOAT32, None))

    def s(key, v):
        out.append((key, str(v), V.STRING, None))

    s(F.KEY_GENERAL_NAME, p.name or "model")
    u32(F.KEY_GENERAL_FILE_TYPE, F.OUTTYPE_FILE_TYPE[outtype])
    u32(F.KEY_GENERAL_QUANTIZATION_VERSION, 2)
    u32(F.arch_key(F.KEY_CONTEXT_LENGTH, A), p.n_ctx)
    u32(F.arch_key(F.KEY_EMBEDDING_LENGTH, A), p.n_embd)
    u32(F.arch_key(F.KEY_BLOCK_COUNT, A), p.n_layer)
    u32(F.arch_key(F.KEY_FEED_FORWARD_LENGTH, A), p.n_ff)
    u32(F.arch_key(F.KEY_HEAD_COUNT, A), p.n_head)
    u32(F.arch_key(F.KEY_HEAD_COUNT_KV, A), p.n_head_kv)
    f32(F.arch_key(F.KEY_RMS_EPS if p.norm == NORM_RMS else F.KEY_LAYERNORM_EPS, A), p.norm_eps)
    if p.rope_theta is not None:
        f32(F.arch_key(F.KEY_ROPE_FREQ_BASE, A), p.rope_theta)
        u32(F.arch_key(F.KEY_ROPE_DIMENSION_COUNT, A), p.n_rot or p.head_dim)
    u32(F.arch_key(F.KEY_VOCAB_SIZE, A), p.n_vocab)
    if p.head_dim * p.n_head != p.n_embd:
        u32(F.arch_key(F.KEY_KEY_LENGTH, A), p.head_dim)
        u32(F.arch_key(F.KEY_VALUE_LENGTH, A), p.head_dim)
    if p.rope_scaling_type == F.ROPE_SCALING_LINEAR:
        s(F.arch_key(F.KEY_ROPE_SCALING_TYPE, A), F.ROPE_SCALING_LINEAR)
        f32(F.arch_key(F.KEY_ROPE_SCALING_FACTOR, A), p.rope_scaling_factor)
    if p.sliding_window is not None:
        u32(F.arch_key(F.KEY_SLIDING_WINDOW, A), p.sliding_window)
    if p.n_expert:
        u32(F.arch_key(F.KEY_EXPERT_COUNT, A), p.n_expert)
        u32(F.arch_key(F.KEY_EXPERT_USED_COUNT, A), p.n_expert_used)
        u32(F.arch_key(F.KEY_EXPERT_FEED_FORWARD_LENGTH, A), p.n_ff_exp)
        if p.n_ff_shexp:
            u32(F.arch_key(F.KEY_EXPERT_SHARED_FEED_FORWARD_LENGTH, A), p.n_ff_shexp)
        out.append((F.arch_key(F.KEY_EXPERT_WEIGHTS_NORM, A), bool(p.expert_norm), V.BOOL, None))
        u32(F.arch_key(F.KEY_EXPERT_GATING_FUNC, A), p.expert_gating)
    out += arch.keys(p)
    u32(F.KEY_FORMAT_VERSION, F.FORMAT_VERSION)
    s(F.KEY_FFN_ACTIVATION, p.activation)
    if p.act_threshold is not None:
        f32(F.KEY_FFN_ACT_THRESHOLD, p.act_threshold)
    s(F.KEY_HF_HIDDEN_ACT, p.hf_hidden_act)
    return out + tokenizer_kv(tm)


def tokenizer_kv(tm: TokenizerMeta) -> list[KV]:
    """The tokenizer.* entries (empty lists kept: add_key_value, not add_array)."""
    out: list[KV] = [
        (F.KEY_TOKENIZER_MODEL, tm.model, V.STRING, None),
        (F.KEY_TOKENIZER_PRE, tm.pre, V.STRING, None),
        (F.KEY_TOKENIZER_TOKENS, tm.tokens, V.ARRAY, V.STRING),
        (F.KEY_TOKENIZER_TOKEN_TYPE, tm.types, V.ARRAY, V.INT32),
    ]
    if tm.model == F.TOKENIZER_GPT2:
        out.append((F.KEY_TOKENIZER_MERGES, tm.merges, V.ARRAY, V.STRING))
    else:
        out.append((F.KEY_TOKENIZER_SCORES, tm.scores, V.ARRAY, V.FLOAT32))
        out.append((F.KEY_TOKENIZER_ADD_SPACE_PREFIX, bool(tm.add_space_prefix), V.BOOL, None))
    for key, v in ((F.KEY_TOKENIZER_BOS_ID, tm.bos_id), (F.KEY_TOKENIZER_EOS_ID, tm.eos_id),
                   (F.KEY_TOKENIZER_UNK_ID, tm.unk_id), (F.KEY_TOKENIZER_PAD_ID, tm.pad_id)):
        if v is not None:
            out.append((key, int(v), V.UINT32, None))
    out.append((F.KEY_TOKENIZER_ADD_BOS, bool(tm.add_bos), V.BOOL, None))
    out.append((F.KEY_TOKENIZER_ADD_EOS, bool(tm.add_eos), V.BOOL, None))
    if tm.chat_template:
        out.append((F.KEY_TOKENIZER_CHAT_TEMPLATE, tm.chat_template, V.STRING, None))
    out.append((F.KEY_TOKENIZER_HF_JSON, tm.hf_json, V.STRING, None))
    return out
