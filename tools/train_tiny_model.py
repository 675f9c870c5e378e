#!/usr/bin/env python3
"""Train the tiny models that powerinfer-cpp ships for tests (ReLU-sparse, and one SwiGLU).

Dev-time tool (needs torch, transformers, tokenizers, safetensors). It:

  1. gathers public-domain English text (by default the King James Bible from
     the Debian packages ``bible-kjv-text`` + ``bible-kjv``, decoded with the
     ``bible`` program; or any plain-text files given with ``--text``),
  2. holds out the last ~2% of the text (cut at a chapter / paragraph
     boundary) as validation text and writes it to ``<out>/heldout.txt``;
     it is never seen by the tokenizer trainer or the model trainer,
  3. trains a byte-level BPE tokenizer (vocab 4096) on the training part,
  4. trains a small causal LM with a ProSparse-style L1 penalty on the FFN's
     ReLU activations (lambda ramped linearly from 0 to ``--l1`` over the first
     half); ``--arch`` picks the shape:
       llama (default): ``LlamaForCausalLM`` with ReLU gating (ReGLU FFN), GQA,
                        RMSNorm, RoPE, no biases; penalty on relu(gate_proj(x));
                        ``--act silu`` makes it SwiGLU (the Llama/Qwen/Mistral FFN,
                        trained without the penalty: ``--l1 0``), the model of the
                        training-free gate-magnitude sparsity;
       opt:             ``OPTForCausalLM`` (pre-LN) with an ungated ReLU FFN,
                        biases, LayerNorm, learned positions, MHA; penalty on
                        relu(fc1(x) + b1);
  5. saves the model in fp16 safetensors, reloads the shipped fp16 weights
     and measures validation loss / perplexity and per-layer activation
     sparsity in fp32 arithmetic, plus per-neuron firing skew,
  6. writes ``training_stats.json`` and a ``README.md`` model card.

The commands used for the shipped models:

    python tools/train_tiny_model.py --out models/tiny-relu-kjv --l1 0.2 --threads 1
    python tools/train_tiny_model.py --arch opt --out models/tiny-opt-kjv --l1 0.2 --threads 1
    python tools/train_tiny_model.py --act silu --out models/tiny-swiglu-kjv --l1 0 --threads 1

Prerequisite for the default text source (Debian/Ubuntu):

    apt-get install bible-kjv-text bible-kjv
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time

import torch

# ---------------------------------------------------------------------------
# Text gathering
# ---------------------------------------------------------------------------

KJV_DATA = "/usr/lib/bible.data"  # installed by Debian package bible-kjv-text
KJV_RANGE = "gen1:1-rev22:21"
ROPE_THETA = 10000.0


def dpkg_version(pkg: str) -> str | None:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", pkg],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        return out or None
    except (OSError, subprocess.CalledProcessError):
        return None


def load_kjv() -> tuple[str, dict]:
    """Decode the whole KJV from the bible-kjv-text data file.

    The data file is compressed in the BRS format, so it is decoded with the
    ``bible`` program from package ``bible-kjv``.  Output is normalised to::

        Genesis 1

        In the beginning God created the heaven and the earth.
        And the earth was without form, ...

    i.e. one verse per line (verse numbers dropped), a heading and a blank
    line around each chapter.
    """
    bible = shutil.which("bible")
    if bible is None or not os.path.exists(KJV_DATA):
        sys.exit(
            "error: KJV text not found. Install it with\n"
            "  apt-get install bible-kjv-text bible-kjv\n"
            "or pass plain-text files with --text FILE ..."
        )
    raw = subprocess.run(
        [bible, "-l100000", KJV_RANGE], capture_output=True, text=True, check=True
    ).stdout
    out_lines: list[str] = []
    n_verses = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        if line.startswith(" "):
            # "  12 verse text" -> "verse text"
            parts = line.strip().split(" ", 1)
            if len(parts) == 2 and parts[0].isdigit():
                out_lines.append(parts[1].strip())
                n_verses += 1
            else:
                out_lines.append(line.strip())
        else:
            # chapter heading, e.g. "Genesis 1"
            if out_lines:
                out_lines.append("")
            out_lines.append(line.strip())
            out_lines.append("")
    text = "\n".join(out_lines) + "\n"
    source = {
        "name": "King James Version of the Bible (1611 translation)",
        "license": "public domain (copyright expired); see "
                   "/usr/share/doc/bible-kjv-text/copyright",
        "debian_packages": {
            "bible-kjv-text": dpkg_version("bible-kjv-text"),
            "bible-kjv": dpkg_version("bible-kjv"),
        },
        "file": KJV_DATA,
        "decoded_with": f"bible -l100000 {KJV_RANGE}",
        "normalisation": "verse numbers dropped, one verse per line, "
                         "'Book N' heading per chapter",
        "verses": n_verses,
        "chars": len(text),
    }
    return text, source


def load_text_files(paths: list[str]) -> tuple[str, list[dict]]:
    texts, sources = [], []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            t = f.read().replace("\r\n", "\n")
        texts.append(t.rstrip("\n") + "\n")
        sources.append({"file": os.path.abspath(p), "chars": len(t)})
    return "\n".join(texts), sources


def split_heldout(text: str, frac: float, max_bytes: int) -> tuple[str, str]:
    """Split off the tail of ``text`` as held-out text.

    The cut is placed at a paragraph boundary (blank line) at or after the
    requested fraction so that the held-out text starts cleanly (for the KJV
    this is a chapter heading).  The held-out part is capped at ``max_bytes``.
    """
    n = len(text)
    target = max(int(n * (1.0 - frac)), n - max_bytes)
    cut = text.find("\n\n", target)
    if cut < 0:
        cut = text.find("\n", target)
    if cut < 0:
        cut = target
    train, held = text[:cut + 1], text[cut:].lstrip("\n")
    return train, held


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3
# The generation prompt ends at a line start: the reply then starts where the model
# starts its verses, and the prompt's last token cannot merge with the reply's first
# (which would break reusing the cached history in the next turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}:\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}"
)


def train_tokenizer(train_text: str, vocab_size: int, out_dir: str, max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = train_text.splitlines(keepends=True)
    tok.train_from_iterator((lines[i:i + 1000] for i in range(0, len(lines), 1000)),
                            trainer=trainer, length=len(lines))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", bos_id)],
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)
    # Make sure the config carries the fields the runtime / HF expect,
    # independent of the transformers version that wrote it.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>",
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    # chat_template may also have been written as a separate file; keep one copy.
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    return tok


# ---------------------------------------------------------------------------
# Model / training
# ---------------------------------------------------------------------------

DEFAULT_OUT = {"llama": "models/tiny-relu-kjv", "opt": "models/tiny-opt-kjv",
               "llama-silu": "models/tiny-swiglu-kjv"}
MODEL_CLASS = {"llama": "LlamaForCausalLM", "opt": "OPTForCausalLM"}
# the activation the L1 penalty and the sparsity statistics are about, per --arch (and
# "llama-silu" for --act silu)
ACT_EXPR = {"llama": "relu(gate_proj(x))", "opt": "relu(fc1(x) + b1)",
            "llama-silu": "silu(gate_proj(x))"}


def variant(arch: str, act: str) -> str:
    """The key of DEFAULT_OUT / ACT_EXPR for an --arch and --act."""
    return arch if act == "relu" else f"{arch}-{act}"


def model_class(arch: str):
    import transformers

    return getattr(transformers, MODEL_CLASS[arch])


def make_config(args, vocab_size: int):
    if args.arch == "opt":
        return make_opt_config(vocab_size)
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        hidden_act=args.act,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        initializer_range=0.02,
    )


def make_opt_config(vocab_size: int):
    from transformers import OPTConfig

    # Sizes as the llama model's where OPT has them (OPT has no GQA: 8 KV heads);
    # dropout off because the llama model trains without any.
    return OPTConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        word_embed_proj_dim=256,
        ffn_dim=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        max_position_embeddings=512,
        do_layer_norm_before=True,
        _remove_final_layer_norm=False,
        layer_norm_elementwise_affine=True,
        activation_function="relu",
        enable_bias=True,
        tie_word_embeddings=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        init_std=0.02,
    )


def decoder_layers(model):
    return model.model.decoder.layers if model.config.model_type == "opt" else model.model.layers


def ffn_size(config) -> int:
    return config.ffn_dim if config.model_type == "opt" else config.intermediate_size


class ActCapture:
    """Forward hooks on each layer's FFN activation module: llama's ``mlp.act_fn``
    (= relu(gate_proj(x))), OPT's ``activation_fn`` (= relu(fc1(x) + b1))."""

    def __init__(self, model):
        self.outputs: list[torch.Tensor | None] = []
        self.handles = []
        layers = decoder_layers(model)
        self.outputs = [None] * len(layers)
        for i, layer in enumerate(layers):
            act = layer.activation_fn if model.config.model_type == "opt" else layer.mlp.act_fn
            self.handles.append(act.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def fn(module, inputs, output):
            self.outputs[i] = output
        return fn

    def clear(self):
        self.outputs = [None] * len(self.outputs)

    def remove(self):
        for h in self.handles:
            h.remove()


def make_batches(ids: torch.Tensor, seq: int, bos_id: int) -> torch.Tensor:
    """Cut a token stream into rows of ``[BOS] + (seq-1) tokens``."""
    body = seq - 1
    n = ids.numel() // body
    rows = ids[: n * body].view(n, body)
    bos = torch.full((n, 1), bos_id, dtype=ids.dtype)
    return torch.cat([bos, rows], dim=1)


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def evaluate(model, val_rows: torch.Tensor, batch: int) -> dict:
    """Validation loss + FFN activation statistics (fp32 arithmetic)."""
    model.eval()
    cap = ActCapture(model)
    n_layers = len(decoder_layers(model))
    inter = ffn_size(model.config)
    zeros = [0] * n_layers
    total = [0] * n_layers
    fire = [torch.zeros(inter, dtype=torch.float64) for _ in range(n_layers)]
    mass = [torch.zeros(inter, dtype=torch.float64) for _ in range(n_layers)]
    # share of each token's |act| mass in its smallest 25% / 50% of neurons: what
    # gate-magnitude sparsity drops at those levels (a SwiGLU FFN has no exact zeros)
    low_mass = [[0.0, 0.0] for _ in range(n_layers)]
    loss_sum, tok_count = 0.0, 0
    for i in range(0, val_rows.shape[0], batch):
        x = val_rows[i:i + batch]
        out = model(input_ids=x)
        logits = out.logits[:, :-1].float()
        tgt = x[:, 1:]
        loss_sum += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"
        ).item()
        tok_count += tgt.numel()
        for l, a in enumerate(cap.outputs):
            a = a.float().reshape(-1, inter)
            nz = a != 0
            zeros[l] += int((~nz).sum())
            total[l] += a.numel()
            fire[l] += nz.sum(0).double()
            mass[l] += a.abs().sum(0).double()
            srt = a.abs().double().sort(dim=1).values
            tot = srt.sum(1).clamp_min(1e-30)
            for j, q in enumerate((0.25, 0.5)):
                low_mass[l][j] += float((srt[:, :int(q * inter)].sum(1) / tot).sum())
        cap.clear()
    cap.remove()
    n_tok = val_rows.shape[0] * val_rows.shape[1]

    def top_share(v: torch.Tensor, frac: float) -> float:
        s = v.sum().item()
        if s == 0:
            return float("nan")
        k = max(1, int(round(frac * v.numel())))
        return float(v.sort(descending=True).values[:k].sum().item() / s)

    layers = []
    for l in range(n_layers):
        freq = fire[l] / n_tok
        layers.append({
            "layer": l,
            "zero_fraction": zeros[l] / total[l],
            "mean_active_neurons_per_token": float(freq.sum().item()),
            "never_firing_neurons": int((fire[l] == 0).sum().item()),
            "neurons_firing_ge_50pct_tokens": int((freq >= 0.5).sum().item()),
            "firing_freq_max": float(freq.max().item()),
            "firing_freq_median": float(freq.median().item()),
            "top10pct_neurons_share_of_firings": top_share(fire[l], 0.10),
            "top20pct_neurons_share_of_firings": top_share(fire[l], 0.20),
            "top10pct_neurons_share_of_activation_mass": top_share(mass[l], 0.10),
            "top20pct_neurons_share_of_activation_mass": top_share(mass[l], 0.20),
            "smallest25pct_share_of_token_mass": low_mass[l][0] / n_tok,
            "smallest50pct_share_of_token_mass": low_mass[l][1] / n_tok,
        })
    val_loss = loss_sum / tok_count
    return {
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "val_tokens_scored": tok_count,
        "val_tokens_total": n_tok,
        "mean_zero_fraction": sum(d["zero_fraction"] for d in layers) / n_layers,
        "layers": layers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(MODEL_CLASS), default="llama",
                    help="llama: ReGLU LlamaForCausalLM (default); opt: ungated ReLU OPTForCausalLM")
    ap.add_argument("--act", choices=("relu", "silu"), default="relu",
                    help="llama's gate activation: relu (ReGLU, default) or silu (SwiGLU; train it "
                         "with --l1 0)")
    ap.add_argument("--out", default=None,
                    help="output folder (default models/tiny-relu-kjv; --arch opt: models/tiny-opt-kjv; "
                         "--act silu: models/tiny-swiglu-kjv)")
    ap.add_argument("--text", nargs="+", default=None,
                    help="plain-text files to train on (default: KJV from bible-kjv-text)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--l1", type=float, default=0.2,
                    help="final L1 coefficient on the FFN's relu activations (ramped 0->l1 over first half)")
    ap.add_argument("--l1-ramp", type=float, default=0.5,
                    help="fraction of training over which lambda ramps up")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--heldout-max-bytes", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--baseline-stats", default=None,
                    help="training_stats.json of an unpenalised (--l1 0) run to compare against in the model card")
    ap.add_argument("--card-only", action="store_true",
                    help="do not train: re-read <out>/training_stats.json, attach --baseline-stats "
                         "and rewrite training_stats.json + README.md")
    args = ap.parse_args()
    if args.arch == "opt" and args.act != "relu":
        ap.error("--act silu is a gated (llama) FFN; OPT's FFN is ungated ReLU")
    if args.out is None:
        args.out = DEFAULT_OUT[variant(args.arch, args.act)]
    if args.card_only:
        stats_path = os.path.join(args.out, "training_stats.json")
        with open(stats_path) as f:
            stats = json.load(f)
        # the folder's own architecture, not the flag's default (older stats lack the key)
        args.arch = stats.get("arch", "llama")
        args.act = stats.get("act", "relu")
        if args.baseline_stats:
            attach_baseline(stats, args.baseline_stats)
        with open(stats_path, "w") as f:
            json.dump(stats, f, indent=2)
            f.write("\n")
        write_model_card(args.out, stats, make_config(args, stats["tokenizer"]["vocab_size"]))
        return

    t_start = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)

    import transformers
    import tokenizers
    from transformers import AutoTokenizer

    os.makedirs(args.out, exist_ok=True)

    # ---- text -------------------------------------------------------------
    if args.text:
        text, sources = load_text_files(args.text)
    else:
        text, src = load_kjv()
        sources = [src]
    train_text, held_text = split_heldout(text, args.heldout_frac, args.heldout_max_bytes)
    assert held_text and held_text not in train_text
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(held_text)
    print(f"text: {len(text):,} chars total; train {len(train_text):,}, "
          f"held-out {len(held_text):,} (-> {args.out}/heldout.txt)")
    for s in sources:
        print("  source:", json.dumps(s))

    # ---- tokenizer --------------------------------------------------------
    t0 = time.time()
    tok = train_tokenizer(train_text, args.vocab, args.out, max_len=512)
    hf_tok = AutoTokenizer.from_pretrained(args.out)
    probe = hf_tok("In the beginning")["input_ids"]
    assert probe[0] == 1 and probe.count(1) == 1, probe
    assert hf_tok.decode(probe, skip_special_tokens=True) == "In the beginning"
    vocab_size = tok.get_vocab_size()
    print(f"tokenizer: vocab {vocab_size}, trained in {time.time() - t0:.1f}s; "
          f"'In the beginning' -> {probe}")

    bos_id = tok.token_to_id("<s>")
    train_ids = torch.tensor(tok.encode(train_text, add_special_tokens=False).ids, dtype=torch.long)
    val_ids = torch.tensor(tok.encode(held_text, add_special_tokens=False).ids, dtype=torch.long)
    train_rows = make_batches(train_ids, args.seq, bos_id)
    val_rows = make_batches(val_ids, args.seq, bos_id)
    print(f"tokens: train {train_ids.numel():,} ({train_rows.shape[0]} rows of {args.seq}), "
          f"val {val_ids.numel():,} ({val_rows.shape[0]} rows); "
          f"{len(train_text.encode()) / train_ids.numel():.2f} bytes/token")

    # ---- model ------------------------------------------------------------
    config = make_config(args, vocab_size)
    model = model_class(args.arch)(config)
    model.float().train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    cap = ActCapture(model)

    # fixed data order: a seeded permutation of rows per epoch
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.empty(0, dtype=torch.long)
    pos = 0
    epochs = 0

    t_train = time.time()
    ramp_steps = max(1, int(args.l1_ramp * args.steps))
    history = []
    last = {}
    for step in range(args.steps):
        if pos + args.batch > order.numel():
            order = torch.randperm(train_rows.shape[0], generator=gen)
            pos = 0
            epochs += 1
        x = train_rows[order[pos:pos + args.batch]]
        pos += args.batch

        lr = lr_at(step, args.steps, args.lr, args.warmup, 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        lam = args.l1 * min(1.0, step / ramp_steps)

        out = model(input_ids=x, labels=x)
        ce = out.loss
        acts = cap.outputs
        l1 = torch.stack([a.abs().mean() for a in acts]).mean()
        loss = ce + lam * l1 if lam > 0 else ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            zf = [float((a == 0).float().mean()) for a in acts]
        cap.clear()

        last = {"step": step + 1, "loss": loss.item(), "ce": ce.item(), "l1": l1.item(),
                "lambda": lam, "lr": lr, "grad_norm": float(gnorm),
                "zero_frac": sum(zf) / len(zf)}
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            el = time.time() - t_train
            tps = (step + 1) * args.batch * args.seq / el
            print(f"step {step + 1:4d}/{args.steps}  ce {last['ce']:.4f}  l1 {last['l1']:.4f}  "
                  f"lam {lam:.3f}  lr {lr:.2e}  zero {last['zero_frac']:.3f} "
                  f"[{' '.join(f'{z:.2f}' for z in zf)}]  {el:6.1f}s  {tps:,.0f} tok/s",
                  flush=True)
            history.append(dict(last, elapsed_s=round(el, 1)))
    cap.remove()
    train_time = time.time() - t_train

    # ---- save fp16 --------------------------------------------------------
    model.eval()
    model.half()
    model.save_pretrained(args.out, safe_serialization=True)
    del model
    # transformers 5 stores RoPE theta under "rope_parameters"; also write the
    # classic top-level "rope_theta" / "torch_dtype" keys for older readers.
    cfg_path = os.path.join(args.out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if args.arch == "llama":
        cfg.setdefault("rope_theta", ROPE_THETA)
    cfg.setdefault("torch_dtype", "float16")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")

    # ---- reload shipped weights & evaluate in fp32 -------------------------
    t0 = time.time()
    m = model_class(args.arch).from_pretrained(args.out, dtype=torch.float32)
    m.eval()
    ev = evaluate(m, val_rows, args.batch)
    print(f"validation (fp16 weights, fp32 math): loss {ev['val_loss']:.4f}  "
          f"ppl {ev['val_ppl']:.2f}  mean zero fraction {ev['mean_zero_fraction']:.4f}  "
          f"({time.time() - t0:.1f}s)")
    for d in ev["layers"]:
        print(f"  layer {d['layer']}: zero {d['zero_fraction']:.4f}  "
              f"dead {d['never_firing_neurons']}  "
              f"top10% firings {d['top10pct_neurons_share_of_firings']:.3f}  "
              f"top20% firings {d['top20pct_neurons_share_of_firings']:.3f}  "
              f"top10% mass {d['top10pct_neurons_share_of_activation_mass']:.3f}")

    # ---- generation sample -------------------------------------------------
    samples = {}
    for prompt in ["In the beginning", "And Jesus said unto them"]:
        enc = hf_tok(prompt, return_tensors="pt")
        with torch.no_grad():
            g = m.generate(**enc, max_new_tokens=60, do_sample=False,
                           pad_token_id=hf_tok.pad_token_id)
        samples[prompt] = hf_tok.decode(g[0], skip_special_tokens=True)
        print(f"greedy sample: {samples[prompt]!r}")

    wall = time.time() - t_start
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    stats = {
        "command": cmd,
        "arch": args.arch,
        "act": args.act,
        "final_train": last,
        "val_loss": ev["val_loss"],
        "val_ppl": ev["val_ppl"],
        "val_note": "held-out text = heldout.txt, rows of [<s>] + 255 tokens; "
                    "evaluated with the saved fp16 weights in fp32 arithmetic",
        "val_tokens_scored": ev["val_tokens_scored"],
        "ffn_zero_fraction_mean": ev["mean_zero_fraction"],
        "ffn_zero_fraction_per_layer": [d["zero_fraction"] for d in ev["layers"]],
        "ffn_layers": ev["layers"],
        "n_parameters": n_params,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "epochs_started": epochs,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "l1_lambda": args.l1,
        "l1_ramp_fraction": args.l1_ramp,
        "l1_definition": f"lambda * mean over layers of mean(|{ACT_EXPR[variant(args.arch, args.act)]}|)",
        "seed": args.seed,
        "threads": args.threads,
        "train_time_s": round(train_time, 1),
        "wall_time_s": round(wall, 1),
        "data": {
            "sources": sources,
            "total_chars": len(text),
            "train_chars": len(train_text),
            "heldout_chars": len(held_text),
            "heldout_bytes": len(held_text.encode()),
            "heldout_first_line": held_text.splitlines()[0],
            "train_tokens": int(train_ids.numel()),
            "heldout_tokens": int(val_ids.numel()),
        },
        "tokenizer": {
            "type": "byte-level BPE (HF tokenizers)",
            "vocab_size": vocab_size,
            "unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3,
            "add_bos_token": True,
        },
        "greedy_samples": samples,
        "train_log": history,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    if args.baseline_stats:
        attach_baseline(stats, args.baseline_stats)
    with open(os.path.join(args.out, "training_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
        f.write("\n")
    write_model_card(args.out, stats, config)
    print(f"done in {wall:.0f}s -> {args.out}")


def attach_baseline(stats: dict, path: str) -> None:
    with open(path) as f:
        b = json.load(f)
    stats["baseline_unpenalised"] = {
        k: b[k] for k in ("command", "val_loss", "val_ppl", "ffn_zero_fraction_mean",
                          "ffn_zero_fraction_per_layer", "steps", "l1_lambda", "threads",
                          "wall_time_s")
    }
    stats["baseline_unpenalised"]["top10pct_share_of_firings_per_layer"] = [
        d["top10pct_neurons_share_of_firings"] for d in b["ffn_layers"]]


def write_model_card(out: str, s: dict, config) -> None:
    d = s["data"]
    src = s["data"]["sources"]
    if "debian_packages" in src[0]:
        pk = src[0]["debian_packages"]
        data_line = (
            f"The King James Version of the Bible (1611), public domain, taken from the Debian "
            f"package `bible-kjv-text` {pk.get('bible-kjv-text')} (`{src[0]['file']}`) and decoded "
            f"with the `bible` program from package `bible-kjv` {pk.get('bible-kjv')} "
            f"(`{src[0]['decoded_with']}`). Normalisation: {src[0]['normalisation']}."
        )
    else:
        data_line = "Plain-text files: " + ", ".join(f"`{x['file']}`" for x in src) + "."
    rows = []
    for l in s["ffn_layers"]:
        rows.append(
            f"| {l['layer']} | {100 * l['zero_fraction']:.2f}% | "
            f"{l['mean_active_neurons_per_token']:.1f} | {l['never_firing_neurons']} | "
            f"{100 * l['top10pct_neurons_share_of_firings']:.1f}% | "
            f"{100 * l['top20pct_neurons_share_of_firings']:.1f}% | "
            f"{100 * l['top10pct_neurons_share_of_activation_mass']:.1f}% | "
            f"{100 * l['top20pct_neurons_share_of_activation_mass']:.1f}% |"
        )
    base = ""
    if "baseline_unpenalised" in s:
        b = s["baseline_unpenalised"]
        base = (
            "\n### Comparison with an unpenalised run\n\n"
            f"Same script, same seed and data, `--l1 0` (`{b['command']}`), not shipped:\n\n"
            "| run | val loss | val ppl | mean FFN zeros | per layer |\n"
            "|---|---|---|---|---|\n"
            f"| this model (λ={s['l1_lambda']}) | {s['val_loss']:.4f} | {s['val_ppl']:.2f} | "
            f"{100 * s['ffn_zero_fraction_mean']:.2f}% | "
            + " / ".join(f"{100 * z:.1f}%" for z in s["ffn_zero_fraction_per_layer"]) + " |\n"
            f"| unpenalised (λ=0) | {b['val_loss']:.4f} | {b['val_ppl']:.2f} | "
            f"{100 * b['ffn_zero_fraction_mean']:.2f}% | "
            + " / ".join(f"{100 * z:.1f}%" for z in b["ffn_zero_fraction_per_layer"]) + " |\n"
        )
    samples = "\n".join(
        f"Prompt `{p}`:\n\n```\n{t}\n```\n" for p, t in s["greedy_samples"].items()
    )
    c = config
    arch = s.get("arch", "llama")
    swiglu = s.get("act", "relu") == "silu"
    act = ACT_EXPR[variant(arch, s.get("act", "relu"))]
    if swiglu:
        rows = [
            f"| {l['layer']} | {100 * l['zero_fraction']:.2f}% | "
            f"{100 * l['smallest25pct_share_of_token_mass']:.1f}% | "
            f"{100 * l['smallest50pct_share_of_token_mass']:.1f}% | "
            f"{100 * l['top10pct_neurons_share_of_activation_mass']:.1f}% | "
            f"{100 * l['top20pct_neurons_share_of_activation_mass']:.1f}% |"
            for l in s["ffn_layers"]]
    if arch == "opt":
        intro = f"""A tiny (~{s['n_parameters'] / 1e6:.1f}M parameter) OPT-architecture causal LM with an
**ungated ReLU FFN with biases**, trained with a ProSparse-style L1 activation penalty so
that most FFN neurons are exactly zero for any given token. It exists to test
powerinfer-cpp's ungated sparse FFN path (the shape of OPT and ReluFalcon: rows of `fc1`
and of `fc2` transposed for the active neurons, biases included) together with
LayerNorm, biases everywhere and learned absolute positions; it is not useful as a
language model beyond that."""
        arch_par = f"""`OPTForCausalLM`, pre-LN (`do_layer_norm_before: true`, as OPT-125m…66B): hidden
{c.hidden_size} (`word_embed_proj_dim` = hidden, no projections), FFN {c.ffn_dim}
(`fc2(relu(fc1(x) + b1)) + b2`, ungated), {c.num_hidden_layers} layers, {c.num_attention_heads} heads
(MHA, head dim {c.hidden_size // c.num_attention_heads}; OPT has no GQA), biases on every linear layer,
LayerNorm (ε=1e-5, with bias) before attention, before the FFN and at the end, learned absolute
positions ({c.max_position_embeddings} + OPT's offset of 2 rows), vocab {c.vocab_size}, tied
input/output embeddings, no dropout. {s['n_parameters']:,} parameters, stored as fp16
safetensors."""
    else:
        intro = f"""A tiny (~{s['n_parameters'] / 1e6:.1f}M parameter) Llama-architecture causal LM with a
**ReLU-gated (ReGLU) FFN**, trained with a ProSparse-style L1 activation penalty so that
most FFN neurons are exactly zero for any given token. It exists to test
powerinfer-cpp (sparse FFN inference, hot/cold neuron split, GQA attention); it is
not useful as a language model beyond that."""
        if swiglu:
            intro = f"""A tiny (~{s['n_parameters'] / 1e6:.1f}M parameter) Llama-architecture causal LM with a
**SwiGLU FFN** (`silu`, as Llama, Qwen and Mistral), trained without any activation penalty:
its FFN activations are dense (almost never exactly zero). It is the sibling of
`tiny-relu-kjv` (same text, tokenizer procedure, sizes, schedule and seed; only the gate
activation and the penalty differ) and exists to test powerinfer-cpp's training-free
gate-magnitude sparsity (`convert --sparsity`, `--max-ppl-increase`), which thresholds
|silu(gate)| instead of relying on exact zeros; it is not useful as a language model
beyond that."""
        arch_par = f"""`LlamaForCausalLM`: hidden {c.hidden_size}, FFN {c.intermediate_size}
(`down({s.get('act', 'relu')}(gate(x)) * up(x))`), {c.num_hidden_layers} layers,
{c.num_attention_heads} query heads / {c.num_key_value_heads} KV heads (GQA, head dim
{c.hidden_size // c.num_attention_heads}), vocab {c.vocab_size}, RoPE θ={ROPE_THETA:g},
RMSNorm ε={c.rms_norm_eps}, max positions {c.max_position_embeddings}, tied input/output
embeddings. {s['n_parameters']:,} parameters, stored as fp16 safetensors."""
    if s["l1_lambda"] > 0:
        loss_line = (f"Loss = cross-entropy + λ · mean over layers of mean(|{act}|), with λ ramped\n"
                     f"linearly from 0 to {s['l1_lambda']} over the first "
                     f"{int(100 * s['l1_ramp_fraction'])}% of steps.")
    else:
        loss_line = "Loss = cross-entropy alone (`--l1 0`: no activation penalty)."
    if swiglu:
        results = f"""- mean fraction of FFN activations `{act}` that are exactly zero:
  **{100 * s['ffn_zero_fraction_mean']:.2f}%** (SwiGLU: dense)

| layer | exact zeros | smallest 25% of a token's neurons: share of its \\|act\\| mass | smallest 50%: mass | top 10% neurons: activation mass | top 20%: mass |
|---|---|---|---|---|---|
{chr(10).join(rows)}

The "smallest 25% / 50%" columns sort each token's |{act}| and give the share of its
sum that the smaller quarter / half carries (averaged over tokens): what gate-magnitude
sparsity at 25% / 50% drops (before the product with `up`). "Activation mass" of the top
neurons sums |act| per neuron over the held-out tokens; a uniform distribution would give
10% / 20%."""
    else:
        results = f"""- mean fraction of FFN activations `{act}` that are exactly zero:
  **{100 * s['ffn_zero_fraction_mean']:.2f}%**

| layer | zeros | active neurons / token (of {ffn_size(c)}) | never fire | top 10% neurons: share of firings | top 20%: firings | top 10%: activation mass | top 20%: mass |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

"Share of firings" = fraction of all non-zero activations (over validation tokens) that
come from the most frequently firing 10% / 20% of the layer's neurons; "activation mass"
uses the sum of activation values instead of counts. A uniform distribution would give
10% / 20%. "Never fire" counts neurons with no non-zero activation on the held-out text
(the L1 penalty switches some neurons off almost entirely)."""
    card = f"""# {os.path.basename(os.path.normpath(out))}

{intro}

## Architecture

{arch_par}

Tokenizer: byte-level BPE (HF `tokenizers`), vocab {s['tokenizer']['vocab_size']},
no prefix space. Special tokens: `<unk>`=0, `<s>`=1 (BOS, added automatically:
`add_bos_token: true` and a TemplateProcessing post-processor), `</s>`=2 (EOS), `<pad>`=3.

## Chat template

`tokenizer_config.json` carries a plain chat template of its own (the model was never
trained on dialogue; it exists so that the chat mode, `Llama.create_chat_completion` and
the server's `/v1/chat/completions` have something to render; `convert` stores it as
`tokenizer.chat_template`). Each message is its role, a colon and a newline, then its text
and a newline; the generation prompt is `assistant:` and a newline:

```
{CHAT_TEMPLATE}
```

so `[{{"role": "user", "content": "Who made the light?"}}]` renders as
`user:\\nWho made the light?\\nassistant:\\n`. The reply thus starts at the beginning of a
line, where the model starts its verses, and the tokens before it do not depend on the
reply (a prompt ending in a space would merge with the reply's first word and break the
reuse of the cached history in the next turn). Replies end at EOS, at `\\nuser:\\n` (the
turn separator, used as a stop string) or at `max_tokens`; the model rarely stops by itself.

## Data

{data_line}

The last ~2% of the text ({d['heldout_chars']:,} chars, {d['heldout_tokens']:,} tokens, end
text from "{s['data']['heldout_first_line']}" to the end; cut at a chapter boundary) is held out and written to
`heldout.txt`; neither the tokenizer nor the model saw it. Training text:
{d['train_chars']:,} chars, {d['train_tokens']:,} tokens.

## Training

```
{s['command']}
```

AdamW (β=0.9/0.95, weight decay {s['weight_decay']}), peak LR {s['lr']}, {s['warmup']} warmup
steps then cosine decay to 10%, gradient clipping 1.0, {s['steps']} steps × batch {s['batch']} ×
{s['seq']} tokens (each row = `<s>` + 255 tokens), seed {s['seed']}, {s['threads']} CPU threads,
fp32. {loss_line}
Training took {s['train_time_s']:.0f} s; the whole script {s['wall_time_s']:.0f} s (on a
shared 2-core CPU machine that was busy with other jobs; an idle machine is several times faster).
Versions: {', '.join(f'{k} {v}' for k, v in s['versions'].items())}.

## Results

Measured on `heldout.txt` ({s['val_tokens_scored']:,} scored tokens) with the shipped fp16
weights evaluated in fp32:

- final training cross-entropy (last batch): {s['final_train']['ce']:.4f}
- validation loss: **{s['val_loss']:.4f}**, perplexity **{s['val_ppl']:.2f}**
{results}

`heldout.txt` is intended as calibration / perplexity text for later stages (predictor
training, hot-neuron profiling, perplexity checks); it is disjoint from the training text.
{base}
## Greedy samples (reloaded fp16 model)

{samples}
## License

Weights derived from public-domain text; the training script is part of powerinfer-cpp.
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)


if __name__ == "__main__":
    main()
