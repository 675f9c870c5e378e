"""Small random-init Hugging Face LLaMA-family models on disk, for tests.

    from hf_models import make_hf_model
    d = make_hf_model(tmp_path / "m", act="relu", tied=False)

writes config.json, model.safetensors (or shards), tokenizer.json,
tokenizer_config.json (+ special_tokens_map.json) and returns the folder.
Needs torch + transformers (the calling test is skipped when they are missing)
and tokenizers.

dReLU models: transformers has no "drelu" activation, so the config says
``hidden_act: "relu"`` plus ``use_drelu: true`` (which our converter accepts);
a model loaded by transformers computes ReGLU unless ``patch_drelu(model)`` is
applied, which makes every MLP compute down(relu(gate(x)) * relu(up(x))).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def _spm_tokenizer(vocab_size: int):
    """SentencePiece-style BPE with byte fallback (LLaMA style): ids 0..2 are
    <unk> <s> </s>, 3..258 the byte tokens <0x00>..<0xFF>, then the learnt
    pieces; merges are put in SentencePiece order (every split of a piece,
    ranked by the piece's rank), so that tokenization only depends on the
    vocabulary and the piece ranks."""
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
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([UNK, BOS, EOS] + EXTRA_SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    return tok


def make_tokenizer(path, kind: str = "bpe", vocab: int = 384) -> Path:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json
    for a tiny tokenizer into ``path``. kind: "bpe" (byte-level, GPT-2
    style) or "spm" (LLaMA/SentencePiece style with byte fallback).
    Returns the folder. The tokenizer has at most ``vocab`` - 1 tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "bpe":
        tok = _bpe_tokenizer(vocab - 1 - len(EXTRA_SPECIAL) - len(EXTRA_USER))
        pad = PAD
        cls = "PreTrainedTokenizerFast"
        extra = {}
    elif kind == "spm":
        tok = _spm_tokenizer(vocab - 1 - len(EXTRA_SPECIAL))
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
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK if kind == "spm" else None,
        "pad_token": pad, "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "additional_special_tokens": list(EXTRA_SPECIAL),
        "chat_template": CHAT_TEMPLATE, **extra,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    stm = {"bos_token": BOS, "eos_token": EOS, "additional_special_tokens": list(EXTRA_SPECIAL)}
    if pad:
        stm["pad_token"] = pad
    if kind == "spm":
        stm["unk_token"] = UNK
    (path / "special_tokens_map.json").write_text(json.dumps(stm, indent=2), encoding="utf-8")
    return path


def make_hf_model(path, *, act: str = "relu", tied: bool = True, n_layer: int = 2, d: int = 64,
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
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    model = model.to(tdtype)
    kw = {}
    if max_shard_size is not None:
        kw["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    make_tokenizer(path, tokenizer, vocab)
    return path


def patch_drelu(model) -> None:
    """Make every MLP of a loaded HF LLaMA/Mistral model compute dReLU:
    down(relu(gate(x)) * relu(up(x)))."""
    import torch

    for layer in model.model.layers:
        mlp = layer.mlp

        def fwd(x, mlp=mlp):
            return mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))

        mlp.forward = fwd


def load_hf_config(path) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)
