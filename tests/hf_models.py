"""Small random-init Hugging Face models on disk, for tests.

    from hf_models import make_hf_model, make_llama_model
    d = make_hf_model("falcon-40b", tmp_path / "m")          # one of VARIANTS
    d = make_llama_model(tmp_path / "m", act="relu", tied=False)  # any LLaMA/Mistral shape

writes config.json, model.safetensors (or shards), tokenizer.json,
tokenizer_config.json (+ special_tokens_map.json) and returns the folder.
Needs torch + transformers (the calling test is skipped when they are missing)
and tokenizers. Weights are seeded; every 1-D parameter is perturbed (norm weights
1 + 0.1·N(0,1), biases 0.1·N(0,1): HF initializes them to 1 and 0, which would hide
mix-ups).

dReLU models: transformers has no "drelu" activation, so the config says
``hidden_act: "relu"`` plus ``use_drelu: true`` (which our converter accepts);
a model loaded by transformers computes ReGLU unless ``patch_drelu(model)`` is
applied, which makes every MLP compute down(relu(gate(x)) * relu(up(x))).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

import pytest

# Fixed training text for the tiny tokenizers: English prose, code, numbers,
# whitespace runs and some non-ASCII so that merges exist for all of them.
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Once upon a time there was a little model that wanted to be sparse. It learned "
    "that most of its neurons were quiet most of the time, and only a few fired.",
    "def forward(self, x):\n    return self.down(relu(self.gate(x)) * self.up(x))\n",
    "for i in range(10):\n\tprint(i, i * i)\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828 -1e-5",
    "Activation sparsity means that in ReLU models most FFN neurons output zero.",
    "    indented    text   with    several     spaces\n\n\nand blank lines",
    "Café, naïve, résumé, über, façade, Ångström, señor.",
    "日本語のテキストと中文文本。한국어 문장도 있습니다.",
    "Emoji: 😀 🚀 🎉 and symbols © ® ™ € £ ¥ → ∑ ∫.",
    "the the the and and and of of of to to in in is is that that it it was was",
    "Hello world! Hello there. How are you today? I am fine, thank you.",
    "<html><body><p>Some markup &amp; entities</p></body></html>",
]

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
EXTRA_SPECIAL = ["<|im_start|>", "<|im_end|>"]
EXTRA_USER = ["<custom_tok>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _bpe_tokenizer(vocab_size: int):
    """Byte-level BPE (GPT-2 style), <s> prepended by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.add_special_tokens(EXTRA_SPECIAL)
    tok.add_tokens(EXTRA_USER)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    return tok


def _spm_tokenizer(vocab_size: int, space_prefix: bool = True):
    """SentencePiece-style BPE with byte fallback (LLaMA style): ids 0..2 are
    <unk> <s> </s>, 3..258 the byte tokens <0x00>..<0xFF>, then the learnt
    pieces; merges are put in SentencePiece order (every split of a piece,
    ranked by the piece's rank), so that tokenization only depends on the
    vocabulary and the piece ranks. space_prefix False: Gemma's layout (spaces
    become "▁" but no "▁" is prepended to the text)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    base = Tokenizer(models.BPE(unk_token=UNK))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size - 256, 64), special_tokens=[UNK, BOS, EOS],
                                  show_progress=False)
    base.train_from_iterator(TRAIN_TEXT, trainer)
    j = json.loads(base.to_str())
    old_vocab: dict[str, int] = j["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in j["model"]["merges"]]

    vocab: dict[str, int] = {UNK: 0, BOS: 1, EOS: 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(old_vocab.items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    rank: dict[str, int] = {}
    for r, (a, b) in enumerate(merges):
        rank.setdefault(a + b, r)
    pairs = []
    for piece, r in rank.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                pairs.append((r, vocab[left], vocab[right], left, right))
    pairs.sort()

    model = models.BPE(vocab=vocab, merges=[(p[3], p[4]) for p in pairs], unk_token=UNK,
                       fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    # "legacy" LLaMA tokenizer.json layout (as SentencePiece / llama.cpp do):
    # the normalizer prepends "▁" to each text segment and replaces spaces.
    prepend = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence(prepend + [normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()] + strip)
    tok.add_special_tokens([UNK, BOS, EOS] + EXTRA_SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    return tok


#: Qwen2's published text split (the "qwen2" row of format.TOKENIZER_PRE_TOKENIZERS).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def make_tokenizer(path, kind: str = "bpe", vocab: int = 384) -> Path:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json
    for a tiny tokenizer into ``path``. kind: "bpe" (byte-level, GPT-2
    style), "bpe-qwen2" (byte-level after Qwen2's regex split), "bpe-falcon" (Falcon's published
    pre-tokenizer, format.TOKENIZER_PRE_TOKENIZERS["falcon"]), "spm"
    (LLaMA/SentencePiece style with byte fallback) or "spm-gemma" (the same without the
    "▁" prefix, as Gemma's tokenizer.json).
    Returns the folder. The tokenizer has at most ``vocab`` - 1 tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind in ("bpe", "bpe-qwen2", "bpe-falcon"):
        tok = _bpe_tokenizer(vocab - 1 - len(EXTRA_SPECIAL) - len(EXTRA_USER))
        if kind == "bpe-qwen2":
            from tokenizers import Regex, pre_tokenizers
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif kind == "bpe-falcon":
            from tokenizers import Regex, pre_tokenizers
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Punctuation(behavior="contiguous"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                pre_tokenizers.Digits(individual_digits=False),
                pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated", invert=False)])
        pad = PAD
        cls = "PreTrainedTokenizerFast"
        extra = {}
    elif kind in ("spm", "spm-gemma"):
        tok = _spm_tokenizer(vocab - 1 - len(EXTRA_SPECIAL), space_prefix=kind == "spm")
        pad = None
        # PreTrainedTokenizerFast uses tokenizer.json as is; transformers>=5's
        # LlamaTokenizer class would rebuild the pipeline in its own
        # (non-legacy Metaspace) way and ignore the normalizer written here.
        cls = "PreTrainedTokenizerFast"
        extra = {"legacy": True}
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    n = tok.get_vocab_size(with_added_tokens=True)
    assert n < vocab, (n, vocab)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": cls,
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK if kind.startswith("spm") else None,
        "pad_token": pad, "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "additional_special_tokens": list(EXTRA_SPECIAL),
        "chat_template": CHAT_TEMPLATE, **extra,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    stm = {"bos_token": BOS, "eos_token": EOS, "additional_special_tokens": list(EXTRA_SPECIAL)}
    if pad:
        stm["pad_token"] = pad
    if kind.startswith("spm"):
        stm["unk_token"] = UNK
    (path / "special_tokens_map.json").write_text(json.dumps(stm, indent=2), encoding="utf-8")
    return path


def make_llama_model(path, *, act: str = "relu", tied: bool = True, n_layer: int = 2, d: int = 64,
                     n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, vocab: int = 384,
                     seed: int = 0, arch: str = "LlamaForCausalLM", dtype: str = "float32",
                     head_dim: int | None = None, tokenizer: str = "bpe", n_ctx: int = 256,
                     rope_theta: float = 10000.0, rms_eps: float = 1e-5,
                     max_shard_size: str | int | None = None) -> Path:
    """Save a random-init HF causal LM (LLaMA or Mistral) plus a tiny
    tokenizer to ``path`` and return the folder.

    act: "relu" | "silu" | "gelu" | "drelu" (see module doc for dReLU);
    tied: tie_word_embeddings; dtype: "float32" | "float16" | "bfloat16"
    (storage dtype of the safetensors); head_dim: None = d // n_head;
    tokenizer: "bpe" (byte-level) | "spm" (LLaMA style); max_shard_size:
    e.g. "20KB" to get sharded model-0000x-of-0000y.safetensors files.
    Norm weights are randomized too (1 + 0.1·N(0,1)) so tests catch mix-ups.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden_act = "relu" if act == "drelu" else act
    common = dict(
        vocab_size=vocab, hidden_size=d, intermediate_size=n_ff, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_head_kv, hidden_act=hidden_act,
        max_position_embeddings=n_ctx, rms_norm_eps=rms_eps, tie_word_embeddings=tied,
        bos_token_id=1 if tokenizer == "spm" else 0, eos_token_id=2 if tokenizer == "spm" else 1,
        rope_theta=rope_theta,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if arch == "LlamaForCausalLM":
        cfg = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "MistralForCausalLM":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        model_cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    if act == "drelu":
        cfg.use_drelu = True
    _save(model_cls, cfg, path, seed, dtype, tokenizer, vocab, max_shard_size)
    return path


def _save(model_cls, cfg, path: Path, seed: int, dtype: str = "float32", tokenizer: str = "bpe",
          vocab: int = 384, max_shard_size=None, prepare=None) -> None:
    """Build a seeded model_cls(cfg), perturb its 1-D parameters (then ``prepare(model,
    generator)``, if given), save it and a tokenizer."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):  # gpt-oss's expert biases are 2-D
                noise = 0.1 * torch.randn(p.shape, generator=g)
                p.copy_(noise if name.endswith("bias") else 1.0 + noise)
        if prepare is not None:
            prepare(model, g)
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    model = model.to(tdtype)
    kw = {}
    if max_shard_size is not None:
        kw["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    make_tokenizer(path, tokenizer, vocab)


def _edit_config(path: Path, **upd) -> None:
    cfg = load_hf_config(path)
    cfg.update(upd)
    (path / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")


# Gemma's soft-caps, small enough that tanh bends the tiny random models' scores and logits.
GEMMA_ATTN_CAP, GEMMA_FINAL_CAP = 0.05, 0.5

# Tiny models of every architecture the converter takes: name -> (family, config overrides).
# Sizes stay <= 2 layers and hidden <= 64. Ids: <s>=0 (BOS), </s>=1 (EOS), <pad>=2.
_IDS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
VARIANTS: dict[str, tuple[str, dict]] = {
    # llama family (make_llama_model keywords)
    "llama": ("llama", dict(act="silu", tied=False)),
    "llama-relu": ("llama", dict(act="relu", tied=True)),                        # ReluLLaMA
    "llama3": ("llama", dict(act="silu", tied=True, n_ctx=256, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "prosparse": ("llama", dict(act="fatrelu", tied=False)),                      # fatrelu, t = 0.01
    "bamboo": ("llama", dict(act="bamboo", tied=False, arch="MistralForCausalLM")),  # dReLU
    # Mistral-Nemo: the head size is head_dim (24), not hidden_size / heads (64 / 4); GQA
    "mistral-nemo": ("llama", dict(act="silu", tied=False, arch="MistralForCausalLM", head_dim=24)),
    # qwen2: q/k/v biases; an explicit head size (24 != 64 / 4) and GQA; tied with MQA
    "qwen2": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                            intermediate_size=96, tie_word_embeddings=False)),
    "qwen2-tied": ("qwen2", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1,
                                 intermediate_size=80, tie_word_embeddings=True)),
    # qwen3: per-head q/k norms; an explicit head size (24 != 64 / 4) and GQA; tied with MQA
    "qwen3": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                            intermediate_size=96, tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                                 intermediate_size=80, tie_word_embeddings=True)),
    # olmo2: output norms instead of input norms, q/k norms over the projection; GQA untied;
    # MHA tied with an explicit head size (20 != 48 / 4)
    "olmo2": ("olmo2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=96, tie_word_embeddings=False)),
    "olmo2-tied": ("olmo2", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, head_dim=20,
                                 intermediate_size=80, tie_word_embeddings=True)),
    # smollm3: llama's block, layer 3 of 4 without RoPE (NoPE); GQA tied, MQA untied
    "smollm3": ("smollm3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=96, num_hidden_layers=4, tie_word_embeddings=True)),
    "smollm3-untied": ("smollm3", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1,
                                       intermediate_size=80, num_hidden_layers=4, tie_word_embeddings=False)),
    # phi3: fused qkv_proj and gate_up_proj, GQA
    # gemma2: sandwich norms, GeGLU, head size 16 != 48 / 4, query_pre_attn_scalar 20 != 16,
    # soft-caps small enough to bite, a window of 4 on layers 0 and 2; GQA (layers 0-2) and
    # MQA with a window of 6; always tied (llama.cpp's gemma2 has no output.weight)
    "gemma2": ("gemma2", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=80, num_hidden_layers=3, query_pre_attn_scalar=20,
                              sliding_window=4, attn_logit_softcapping=GEMMA_ATTN_CAP,
                              final_logit_softcapping=GEMMA_FINAL_CAP)),
    "gemma2-mqa": ("gemma2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                  intermediate_size=96, query_pre_attn_scalar=24, sliding_window=6,
                                  attn_logit_softcapping=GEMMA_ATTN_CAP,
                                  final_logit_softcapping=GEMMA_FINAL_CAP)),
    # gemma3: per-head q/k norms, 5 local layers : 1 global (6 layers, window 4), local RoPE
    # base 10000 and global 1e6 with linear scaling 2; GQA tied. Untied MQA with its own layer
    # pattern (a sliding_window_pattern array in the file) and a final soft-cap
    "gemma3": ("gemma3", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=80, num_hidden_layers=6, query_pre_attn_scalar=24,
                              sliding_window=4, rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma3-untied": ("gemma3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=20,
                                     intermediate_size=96, num_hidden_layers=4, sliding_window=5,
                                     tie_word_embeddings=False, final_logit_softcapping=GEMMA_FINAL_CAP,
                                     layer_types=["sliding_attention", "full_attention",
                                                  "sliding_attention", "sliding_attention"])),
    "phi3": ("phi3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=96, tie_word_embeddings=False)),
    # opt: pre-LN, learned positions, ungated ReLU FFN
    "opt": ("opt", dict(hidden_size=64, num_attention_heads=4, ffn_dim=160, tie_word_embeddings=True)),
    "opt-untied": ("opt", dict(hidden_size=48, num_attention_heads=3, ffn_dim=96, tie_word_embeddings=False)),
    # falcon: the three block layouts, biased and not, MQA / MHA / GQA
    "falcon-7b": ("falcon", dict(hidden_size=64, num_attention_heads=4, multi_query=True, parallel_attn=True,
                                 new_decoder_architecture=False, bias=False, tie_word_embeddings=True)),
    "falcon-7b-bias": ("falcon", dict(hidden_size=48, num_attention_heads=4, multi_query=True, parallel_attn=True,
                                      new_decoder_architecture=False, bias=True, tie_word_embeddings=False)),
    "falcon-mha": ("falcon", dict(hidden_size=64, num_attention_heads=4, multi_query=False, parallel_attn=True,
                                  new_decoder_architecture=False, bias=True, tie_word_embeddings=True)),
    "falcon-40b": ("falcon", dict(hidden_size=64, num_attention_heads=8, num_kv_heads=2, multi_query=True,
                                  new_decoder_architecture=True, parallel_attn=True, bias=False,
                                  tie_word_embeddings=False)),
    "falcon-40b-1ln": ("falcon", dict(hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                                      new_decoder_architecture=True, num_ln_in_parallel_attn=1, bias=True,
                                      tie_word_embeddings=True)),
    "falcon-rw-like": ("falcon", dict(hidden_size=64, num_attention_heads=4, multi_query=False,
                                      parallel_attn=False, new_decoder_architecture=False, bias=True,
                                      alibi=False, tie_word_embeddings=True)),
    "falcon-relu": ("falcon", dict(hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                                   new_decoder_architecture=True, activation="relu", bias=False,
                                   tie_word_embeddings=False)),                  # ReluFalcon-40B shape
    # mixtures of experts (MOE_VARIANTS): top-1 and top-2 of 4 to 8 experts, renormalised
    # routing weights and not, a shared expert (qwen2moe)
    # mixtral: llama with experts; always renormalised (top-1: weight 1)
    "mixtral": ("mixtral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False)),
    "mixtral-top1": ("mixtral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                     intermediate_size=32, num_local_experts=8, num_experts_per_tok=1,
                                     tie_word_embeddings=True)),
    # ReLU-family experts (sparse inside experts): ReGLU (hidden_act relu, which transformers'
    # Mixtral computes as relu(w1 x) * w3 x) and TurboSparse-Mixtral's dReLU (use_drelu:
    # relu(w1 x) * relu(w3 x); transformers has no such class: hf_reference_model runs its
    # experts in numpy, patch_moe_drelu)
    "mixtral-relu": ("mixtral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                     hidden_act="relu", tie_word_embeddings=False)),
    "mixtral-drelu": ("mixtral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                                      hidden_act="relu", use_drelu=True, tie_word_embeddings=False)),
    # qwen2moe: q/k/v biases, a shared expert behind its sigmoid gate; norm_topk_prob off (its
    # default) and on
    "qwen2moe": ("qwen2moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, num_experts=6, num_experts_per_tok=2,
                                  norm_topk_prob=False, tie_word_embeddings=False)),
    "qwen2moe-norm": ("qwen2moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                       intermediate_size=96, moe_intermediate_size=64,
                                       shared_expert_intermediate_size=32, num_experts=8,
                                       num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True)),
    # qwen3moe: per-head q/k norms, an explicit head size (24 != 64 / 4); renormalised top-2,
    # and top-1 without renormalisation (the weight is the expert's probability)
    "qwen3moe": ("qwen3moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                  intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                  num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen3moe-top1": ("qwen3moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                       intermediate_size=96, moe_intermediate_size=64, num_experts=4,
                                       num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=True)),
    # olmoe: q/k norms over the projection; not renormalised (its default) and renormalised
    "olmoe": ("olmoe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                            tie_word_embeddings=False)),
    "olmoe-norm": ("olmoe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                 intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                 tie_word_embeddings=True)),
    # gpt-oss: attention sinks (1 + noise: nonzero), biased q/k/v/o, router and experts
    # (the fused, interleaved gate_up_proj), YaRN RoPE, windows shorter than the 40 test
    # positions on the even layers, its clamped SwiGLU with a limit small enough to bite
    # (gate and up reach ~0.5 here); top-2 of 4 (GQA), top-1 of 8 (MQA, tied, window 6),
    # top-4 of 8 with its own layer pattern and the released limit 7
    "gptoss": ("gptoss", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=4, swiglu_limit=0.2, tie_word_embeddings=False)),
    "gptoss-top1": ("gptoss", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                                   intermediate_size=64, num_local_experts=8, num_experts_per_tok=1,
                                   sliding_window=6, swiglu_limit=0.3, tie_word_embeddings=True)),
    "gptoss-top4": ("gptoss", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
                                   num_hidden_layers=3, sliding_window=5, tie_word_embeddings=False,
                                   layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    # DeepSeek-V3's sigmoid router (sigmoid_router: spread-out scores, a selection bias that
    # moves the choice): glm4moe with 4 groups of 2 keeping 2, renormalised, scaled, a dense
    # first layer, q/k/v biases, half the head rotating; and with no groups, not
    # renormalised, every layer experts, q/k norms, 2 shared experts, 3/4 of the head
    # rotating, MQA, tied
    "glm4moe": ("glm4moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5, first_k_dense_replace=1, n_shared_experts=1,
                                attention_bias=True, use_qk_norm=False, tie_word_embeddings=False)),
    "glm4moe-qknorm": ("glm4moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                       intermediate_size=64, moe_intermediate_size=16, n_routed_experts=6,
                                       num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=False,
                                       routed_scaling_factor=1.0, first_k_dense_replace=0, n_shared_experts=2,
                                       attention_bias=False, use_qk_norm=True, partial_rotary_factor=0.75,
                                       tie_word_embeddings=True)),
    # dots1: the same router, q/k norms, full RoPE; 2 groups of 4 keeping 1, renormalised,
    # a dense first layer; and no groups, not renormalised, top-1
    "dots1": ("dots1", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                            num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
                            routed_scaling_factor=1.5, first_k_dense_replace=1, n_shared_experts=1,
                            tie_word_embeddings=False)),
    "dots1-top1": ("dots1", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                 intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                 num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=False,
                                 first_k_dense_replace=0, n_shared_experts=1, tie_word_embeddings=True)),
}
#: The mixture-of-experts variants (their FFN is experts: no sparse modes yet).
MOE_VARIANTS = tuple(v for v, (family, _) in VARIANTS.items()
                     if family in ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "gptoss", "glm4moe", "dots1"))


def sigmoid_router(model, g) -> None:
    """A DeepSeek-V3 router's tiny random model made to route: router weights 20x their
    initial 0.02 (sigmoid scores spread over (0, 1), not all near 0.5) and a selection bias
    (a buffer, zero at init) of the scores' own spread, so that it changes which experts run."""
    import torch

    for name, mod in model.named_modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.weight.mul_(20.0)
            mod.e_score_correction_bias.copy_(0.3 * torch.randn(mod.e_score_correction_bias.shape, generator=g))


def make_hf_model(variant: str, path, seed: int = 0, **overrides) -> Path:
    """Save the tiny HF model ``variant`` (a key of VARIANTS) to ``path`` and return the
    folder; ``overrides`` replace config values (for llama variants: make_llama_model
    keywords). Load it back with transformers' AutoModelForCausalLM, except:
    "prosparse" (hidden_act fatrelu, which transformers lacks: hf_reference_model patches
    it in) and "bamboo" (saved as BambooForCausalLM: load with hf_reference_model)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
    family, kw = VARIANTS[variant]
    kw = {**kw, **overrides}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if family == "llama":
        kw = dict(kw)
        act, rope = kw.pop("act"), kw.pop("rope_parameters", None)
        real_act = {"fatrelu": "relu", "bamboo": "relu"}.get(act, act)
        make_llama_model(path, act=real_act, seed=seed, **kw)
        if rope is not None:
            _edit_config(path, rope_parameters=rope, rope_theta=rope["rope_theta"])
        if act == "fatrelu":  # ProSparse's published keys
            _edit_config(path, hidden_act="fatrelu", hidden_act_param=0.01,
                         architectures=["SparseLlamaForCausalLM"], model_type="sparsellama")
        elif act == "bamboo":  # Bamboo / TurboSparse-Mistral: dReLU with no use_drelu key
            _edit_config(path, architectures=["BambooForCausalLM"], model_type="bamboo")
        return path
    common = dict(vocab_size=384, num_hidden_layers=2, max_position_embeddings=128, **_IDS)
    if family == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                          "rope_theta": 10000.0, **kw})
        _save(transformers.Qwen2ForCausalLM, cfg, path, seed, tokenizer="bpe-qwen2")
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                          "rope_theta": 10000.0, **kw})
        _save(transformers.Qwen3ForCausalLM, cfg, path, seed, tokenizer="bpe-qwen2")
    elif family == "olmo2":
        cfg = transformers.Olmo2Config(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                          "rope_theta": 10000.0, **kw})
        _save(transformers.Olmo2ForCausalLM, cfg, path, seed)
    elif family == "smollm3":
        cfg = transformers.SmolLM3Config(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                            "rope_theta": 10000.0, **kw})
        _save(transformers.SmolLM3ForCausalLM, cfg, path, seed)
    elif family in ("gemma2", "gemma3"):
        ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the spm tokenizer's
        cls = transformers.Gemma2Config if family == "gemma2" else transformers.Gemma3TextConfig
        model = transformers.Gemma2ForCausalLM if family == "gemma2" else transformers.Gemma3ForCausalLM
        cfg = cls(**{**common, **ids, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 256, **kw})
        _save(model, cfg, path, seed, tokenizer="spm-gemma")
    elif family == "phi3":
        cfg = transformers.Phi3Config(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                         "rope_theta": 10000.0, "sliding_window": None,
                                         "pad_token_id": 2, **kw})
        _save(transformers.Phi3ForCausalLM, cfg, path, seed)
    elif family == "opt":
        cfg = transformers.OPTConfig(**{**common, "activation_function": "relu", "do_layer_norm_before": True,
                                        **kw})
        _save(transformers.OPTForCausalLM, cfg, path, seed)
    elif family == "falcon":
        cfg = transformers.FalconConfig(**{**common, "ffn_hidden_size": 3 * kw["hidden_size"],
                                           "rope_theta": 10000.0, **kw})
        _save(transformers.FalconForCausalLM, cfg, path, seed, tokenizer="bpe-falcon")
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                            "rope_theta": 10000.0, "sliding_window": None, **kw})
        _save(transformers.MixtralForCausalLM, cfg, path, seed)
    elif family == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                             "rope_theta": 10000.0, **kw})
        _save(transformers.Qwen2MoeForCausalLM, cfg, path, seed, tokenizer="bpe-qwen2")
    elif family == "qwen3moe":
        cfg = transformers.Qwen3MoeConfig(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                             "rope_theta": 10000.0, **kw})
        _save(transformers.Qwen3MoeForCausalLM, cfg, path, seed, tokenizer="bpe-qwen2")
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                          "rope_theta": 10000.0, **kw})
        _save(transformers.OlmoeForCausalLM, cfg, path, seed)
    elif family == "gptoss":
        cfg = transformers.GptOssConfig(**{**common, "rms_norm_eps": 1e-5, **kw})
        _save(transformers.GptOssForCausalLM, cfg, path, seed)
    elif family == "glm4moe":
        kw = dict(kw)
        rope = {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": kw.pop("partial_rotary_factor", 0.5)}
        cfg = transformers.Glm4MoeConfig(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                            "rope_parameters": rope, **kw})
        _save(transformers.Glm4MoeForCausalLM, cfg, path, seed, prepare=sigmoid_router)
    elif family == "dots1":
        cfg = transformers.Dots1Config(**{**common, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                                          "rope_theta": 10000.0, **kw})
        _save(transformers.Dots1ForCausalLM, cfg, path, seed, prepare=sigmoid_router)
    return path


def hf_reference_model(path):
    """The transformers model of a folder written by make_hf_model, in float32 and eval mode,
    computing what our converter reads from its config (fatrelu, dReLU)."""
    import torch
    import transformers

    cfg = load_hf_config(path)
    archs = cfg.get("architectures") or []
    if archs and archs[0] in ("SparseLlamaForCausalLM", "BambooForCausalLM"):
        cls = transformers.LlamaForCausalLM if archs[0] == "SparseLlamaForCausalLM" else transformers.MistralForCausalLM
        conf = (transformers.LlamaConfig if cls is transformers.LlamaForCausalLM else transformers.MistralConfig)(
            **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "hidden_act_param")})
        conf.hidden_act = "relu"
        model = cls.from_pretrained(str(path), config=conf, dtype=torch.float32).eval()
        if archs[0] == "BambooForCausalLM":
            patch_drelu(model)
        else:
            patch_fatrelu(model, float(cfg["hidden_act_param"]))
        return model
    if cfg.get("model_type") == "mixtral" and cfg.get("use_drelu"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        patch_moe_drelu(model)
        return model
    kw = {}
    if cfg.get("model_type") in ("gemma2", "gemma3_text"):
        # the soft-capping of the attention scores is applied by the eager attention only
        kw["attn_implementation"] = "eager"
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()


def patch_fatrelu(model, t: float) -> None:
    """Make every MLP of a loaded HF LLaMA model compute ProSparse's FATReLU GLU:
    down(fatrelu(gate(x)) * up(x)), fatrelu(g) = g if g > t else 0."""
    import torch

    for layer in model.model.layers:
        mlp = layer.mlp

        def fwd(x, mlp=mlp):
            g = mlp.gate_proj(x)
            return mlp.down_proj(torch.where(g > t, g, torch.zeros_like(g)) * mlp.up_proj(x))

        mlp.forward = fwd


def patch_drelu(model) -> None:
    """Make every MLP of a loaded HF LLaMA/Mistral model compute dReLU:
    down(relu(gate(x)) * relu(up(x)))."""
    import torch

    for layer in model.model.layers:
        mlp = layer.mlp

        def fwd(x, mlp=mlp):
            return mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))

        mlp.forward = fwd


def moe_drelu_numpy(x, top_k_index, top_k_weights, gate_up, down) -> "np.ndarray":
    """The numpy reference of dReLU experts: y_t = sum_j w_tj down_e (relu(g) * relu(u)),
    [g; u] = gate_up_e x_t, e = top_k_index[t, j] (float64; transformers' expert layout:
    gate_up [n_expert, 2 ff, d], down [n_expert, d, ff])."""
    x = np.asarray(x, dtype=np.float64)
    ff = gate_up.shape[1] // 2
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(top_k_index[t], top_k_weights[t]):
            gu = gate_up[e].astype(np.float64) @ x[t]
            a = np.maximum(gu[:ff], 0.0) * np.maximum(gu[ff:], 0.0)
            y[t] += float(w) * (down[e].astype(np.float64) @ a)
    return y


def patch_moe_drelu(model) -> None:
    """Make every Mixtral experts module of a loaded model compute dReLU experts, in numpy
    (moe_drelu_numpy) on the router's own choices and weights."""
    import torch

    for layer in model.model.layers:
        ex = layer.mlp.experts

        def fwd(hidden_states, top_k_index, top_k_weights, ex=ex):
            y = moe_drelu_numpy(hidden_states.detach().numpy(), top_k_index.numpy(),
                                top_k_weights.detach().numpy(), ex.gate_up_proj.detach().numpy(),
                                ex.down_proj.detach().numpy())
            return torch.from_numpy(y).to(hidden_states.dtype)

        ex.forward = fwd


def load_hf_config(path) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)
