"""The one place that names what goes into our GGUF files.

Every other module (converter, runtime binding, profiler, tests) imports key
names, tensor names, architecture strings and activation kinds from here.
The meaning of each name is documented in docs/FORMAT.md, which must be kept
in sync with this module.

The dense part uses llama.cpp's standard key and tensor names, so that files
we write stay readable by every GGUF tool.  Our own additions live under the
``powerinfer.`` key prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------

#: ``general.architecture`` values (llama.cpp's strings where llama.cpp has the
#: architecture; OPT, which llama.cpp lacks, as PowerInfer's converter named it).
#: Per-architecture keys are prefixed with it. docs/FORMAT.md describes each one.
ARCH_LLAMA = "llama"    # LLaMA, Mistral, ReluLLaMA, ProSparse, Bamboo/TurboSparse, Llama-3
ARCH_QWEN2 = "qwen2"    # Qwen2, Qwen2.5
ARCH_FALCON = "falcon"  # Falcon (7B layout and the 40B/180B new_decoder_architecture)
ARCH_OPT = "opt"        # OPT (pre-LN: 125m, 1.3b ... 66b)
ARCH_PHI3 = "phi3"      # Phi-3 mini / medium (4k context)
ARCH_QWEN3 = "qwen3"    # Qwen3 (dense)
ARCH_OLMO2 = "olmo2"    # OLMo 2
ARCH_SMOLLM3 = "smollm3"  # SmolLM3 (llama's block, every 4th layer without RoPE)
ARCH_GEMMA2 = "gemma2"    # Gemma 2 (GeGLU, sandwich norms, soft-capping, sliding windows)
ARCH_GEMMA3 = "gemma3"    # Gemma 3 text (Gemma 2's block with q/k norms, 5 local : 1 global)
ARCH_QWEN2MOE = "qwen2moe"  # Qwen1.5-MoE / Qwen2-MoE (experts + a shared expert)
ARCH_QWEN3MOE = "qwen3moe"  # Qwen3-MoE
ARCH_OLMOE = "olmoe"        # OLMoE
ARCH_GPTOSS = "gpt-oss"     # gpt-oss (attention sinks, sliding windows, biased experts, MXFP4)
ARCH_GLM4MOE = "glm4moe"    # GLM-4.5 / 4.5-Air / 4.6 (DeepSeek-V3's sigmoid router, partial RoPE)
ARCH_DOTS1 = "dots1"        # dots.llm1 (DeepSeek-V3's sigmoid router, q/k norms)
# Mixtral is ARCH_LLAMA with KEY_EXPERT_COUNT > 0 (llama.cpp writes it so)

#: smollm3: layers il with (il + 1) % this == 0 have no RoPE. llama.cpp fixes it for the
#: architecture; its files carry no key for it.
SMOLLM3_NOPE_EVERY = 4

#: gemma2 / gemma3: layer il is local (sliding window) iff il % n < n - 1, where n is this
#: period, unless KEY_SLIDING_WINDOW_PATTERN says otherwise (llama.cpp's defaults).
SWA_PERIOD = {ARCH_GEMMA2: 2, ARCH_GEMMA3: 6, ARCH_GPTOSS: 2}

#: GGUF architectures this project writes / reads.
ARCHITECTURES = (ARCH_LLAMA, ARCH_QWEN2, ARCH_FALCON, ARCH_OPT, ARCH_PHI3, ARCH_QWEN3, ARCH_OLMO2,
                 ARCH_SMOLLM3, ARCH_GEMMA2, ARCH_GEMMA3, ARCH_QWEN2MOE, ARCH_QWEN3MOE, ARCH_OLMOE,
                 ARCH_GPTOSS, ARCH_GLM4MOE, ARCH_DOTS1)
#: The architectures whose FFN is always a mixture of experts (llama is one when its file
#: has KEY_EXPERT_COUNT > 0: Mixtral).
MOE_ARCHITECTURES = (ARCH_QWEN2MOE, ARCH_QWEN3MOE, ARCH_OLMOE, ARCH_GPTOSS, ARCH_GLM4MOE, ARCH_DOTS1)

# --------------------------------------------------------------------------
# Our own keys (powerinfer.*)
# --------------------------------------------------------------------------

#: Version of the powerinfer additions to GGUF (uint32).
FORMAT_VERSION = 1
KEY_FORMAT_VERSION = "powerinfer.format_version"

#: FFN activation kind (string, one of ACTIVATIONS). llama.cpp's "llama"
#: architecture has no such key and always assumes SiLU; so does our runtime
#: when the key is absent (and it says so).
KEY_FFN_ACTIVATION = "powerinfer.ffn_activation"

#: The original Hugging Face ``hidden_act`` string (informational only).
KEY_HF_HIDDEN_ACT = "powerinfer.hf_hidden_act"

#: FATReLU's threshold t (f32; written only with ACT_FATRELU): act(x) = x if x > t else 0.
KEY_FFN_ACT_THRESHOLD = "powerinfer.ffn_act_threshold"

# Activation kinds (values of KEY_FFN_ACTIVATION). A gated FFN (the file has ffn_gate) is
#   out = down( act_gate(gate(x)) * act_up(up(x)) )
# an ungated one (no ffn_gate: OPT, Falcon) is out = down( act(up(x) + b_up) ) + b_down.
ACT_SILU = "silu"    # SwiGLU: silu(gate) * up
ACT_RELU = "relu"    # ReGLU:  relu(gate) * up
ACT_DRELU = "drelu"  # dReLU:  relu(gate) * relu(up) (gated only)
ACT_GELU = "gelu"    # GeGLU:  gelu_tanh(gate) * up (tanh approximation; HF gelu_new, gelu_pytorch_tanh)
ACT_GELU_ERF = "gelu_erf"  # GeGLU with the exact erf GELU (HF "gelu")
ACT_FATRELU = "fatrelu"    # ProSparse: fatrelu(gate) * up, fatrelu(x) = x if x > t else 0
#: gpt-oss's clamped SwiGLU (gated only), limit t = KEY_SWIGLU_CLAMP_EXP:
#: (clamp(up, -t, t) + 1) * g * sigmoid(1.702 g), g = min(gate, t)
ACT_SWIGLU_OAI = "swiglu_oai"
ACTIVATIONS = (ACT_SILU, ACT_RELU, ACT_DRELU, ACT_GELU, ACT_GELU_ERF, ACT_FATRELU, ACT_SWIGLU_OAI)
#: gpt-oss's sigmoid gain in ACT_SWIGLU_OAI (swiglu_alpha; a constant of the runtime, as of
#: llama.cpp: no key carries it)
SWIGLU_OAI_ALPHA = 1.702
DEFAULT_ACTIVATION = ACT_SILU

#: Activation kinds whose FFN outputs are exactly sparse (zero for a neuron
#: whenever the activation is zero), i.e. the ones the sparse runtime can exploit.
SPARSE_ACTIVATIONS = (ACT_RELU, ACT_DRELU, ACT_FATRELU)

# --------------------------------------------------------------------------
# Standard (llama.cpp) keys
# --------------------------------------------------------------------------

KEY_GENERAL_ARCHITECTURE = "general.architecture"
KEY_GENERAL_NAME = "general.name"
KEY_GENERAL_FILE_TYPE = "general.file_type"
KEY_GENERAL_QUANTIZATION_VERSION = "general.quantization_version"
KEY_GENERAL_ALIGNMENT = "general.alignment"

# Per-architecture keys: templates, resolve with arch_key(KEY_..., arch).
KEY_CONTEXT_LENGTH = "{arch}.context_length"
KEY_EMBEDDING_LENGTH = "{arch}.embedding_length"
KEY_BLOCK_COUNT = "{arch}.block_count"
KEY_FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
KEY_VOCAB_SIZE = "{arch}.vocab_size"
KEY_HEAD_COUNT = "{arch}.attention.head_count"
KEY_HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
KEY_KEY_LENGTH = "{arch}.attention.key_length"
KEY_VALUE_LENGTH = "{arch}.attention.value_length"
KEY_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"  # RMSNorm (llama, qwen2)
KEY_LAYERNORM_EPS = "{arch}.attention.layer_norm_epsilon"  # LayerNorm with bias (falcon, opt)
KEY_SLIDING_WINDOW = "{arch}.attention.sliding_window"
#: gemma2/3: which layers are local, as a period (u32) or one bool per layer (absent: SWA_PERIOD)
KEY_SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"
#: q.k times this (f32; absent: 1/sqrt(head size)); gemma: query_pre_attn_scalar^-1/2
KEY_ATTENTION_SCALE = "{arch}.attention.scale"
#: soft-capping c of the attention scores / the final logits: x -> c tanh(x / c) (gemma2)
KEY_ATTN_LOGIT_SOFTCAPPING = "{arch}.attn_logit_softcapping"
KEY_FINAL_LOGIT_SOFTCAPPING = "{arch}.final_logit_softcapping"
KEY_ROPE_FREQ_BASE = "{arch}.rope.freq_base"
KEY_ROPE_FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"  # gemma3: the local layers' RoPE base
KEY_ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
KEY_ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
KEY_ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
#: YaRN (gpt-oss): the pre-extension context (u32, required with it) and the ramp's rotation
#: counts (f32; absent: 32 and 1)
KEY_ROPE_SCALING_ORIG_CTX = "{arch}.rope.scaling.original_context_length"
KEY_ROPE_SCALING_YARN_BETA_FAST = "{arch}.rope.scaling.yarn_beta_fast"
KEY_ROPE_SCALING_YARN_BETA_SLOW = "{arch}.rope.scaling.yarn_beta_slow"
#: the clamped SwiGLU's limit (f32, or one per layer; absent: 7), ACT_SWIGLU_OAI
KEY_SWIGLU_CLAMP_EXP = "{arch}.swiglu_clamp_exp"
# How an embedding model pools its tokens' hidden states (llama.cpp's llama_pooling_type);
# read by embeddings.py, never written by the converter (a causal LM does not say)
KEY_POOLING_TYPE = "{arch}.pooling_type"
POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}

#: The per-architecture keys the runtime's loader refuses a file without (every other key
#: has a default); the preflight (preflight.py) names all that are missing at once, and
#: tests/model/test_bad_models.py checks the loader refuses each.
REQUIRED_ARCH_KEYS = (KEY_EMBEDDING_LENGTH, KEY_BLOCK_COUNT, KEY_FEED_FORWARD_LENGTH, KEY_HEAD_COUNT)

# Mixture of experts (llama.cpp's keys; docs/FORMAT.md "Mixture of experts")
KEY_EXPERT_COUNT = "{arch}.expert_count"                  # u32: experts per layer
KEY_EXPERT_USED_COUNT = "{arch}.expert_used_count"        # u32: experts per token (top-k)
KEY_EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"  # u32: an expert's width
KEY_EXPERT_SHARED_FEED_FORWARD_LENGTH = "{arch}.expert_shared_feed_forward_length"  # u32
KEY_EXPERT_WEIGHTS_NORM = "{arch}.expert_weights_norm"    # bool: renormalise the top-k weights
KEY_EXPERT_GATING_FUNC = "{arch}.expert_gating_func"      # u32: 1 softmax, 2 sigmoid
KEY_EXPERT_WEIGHTS_SCALE = "{arch}.expert_weights_scale"  # f32: routing weights times this
EXPERT_GATING_SOFTMAX = 1
EXPERT_GATING_SIGMOID = 2
# DeepSeek-V3's mixture (glm4moe, dots1): its shared experts (expert_shared_count of the
# routed width, added unweighted), the sigmoid router's groups, the dense layers first, and
# GLM-4.5's multi-token prediction layers past the model's own (llama.cpp's keys)
KEY_EXPERT_SHARED_COUNT = "{arch}.expert_shared_count"            # u32
KEY_EXPERT_GROUP_COUNT = "{arch}.expert_group_count"              # u32 (1: no group limit)
KEY_EXPERT_GROUP_USED_COUNT = "{arch}.expert_group_used_count"    # u32: groups kept per token
KEY_LEADING_DENSE_BLOCK_COUNT = "{arch}.leading_dense_block_count"  # u32: dense-FFN layers first
KEY_NEXTN_PREDICT_LAYERS = "{arch}.nextn_predict_layers"          # u32: trailing layers unread

ROPE_SCALING_NONE = "none"
ROPE_SCALING_LINEAR = "linear"
ROPE_SCALING_YARN = "yarn"

# Tokenizer keys
KEY_TOKENIZER_MODEL = "tokenizer.ggml.model"
KEY_TOKENIZER_PRE = "tokenizer.ggml.pre"
KEY_TOKENIZER_TOKENS = "tokenizer.ggml.tokens"
KEY_TOKENIZER_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_TOKENIZER_SCORES = "tokenizer.ggml.scores"
KEY_TOKENIZER_MERGES = "tokenizer.ggml.merges"
KEY_TOKENIZER_BOS_ID = "tokenizer.ggml.bos_token_id"
KEY_TOKENIZER_EOS_ID = "tokenizer.ggml.eos_token_id"
KEY_TOKENIZER_UNK_ID = "tokenizer.ggml.unknown_token_id"
KEY_TOKENIZER_PAD_ID = "tokenizer.ggml.padding_token_id"
KEY_TOKENIZER_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_TOKENIZER_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_TOKENIZER_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
KEY_TOKENIZER_HF_JSON = "tokenizer.huggingface.json"
KEY_TOKENIZER_CHAT_TEMPLATE = "tokenizer.chat_template"

# Values of KEY_TOKENIZER_MODEL
TOKENIZER_GPT2 = "gpt2"    # byte-level BPE (tokens + merges)
TOKENIZER_LLAMA = "llama"  # SentencePiece-style BPE with byte fallback (tokens + scores)
TOKENIZER_PRE_DEFAULT = "default"
TOKENIZER_PRE_FALCON = "falcon"


@dataclass(frozen=True)
class PreTokenizer:
    """What a ``tokenizer.ggml.pre`` name stands for in a byte-level BPE (gpt2) file."""

    #: the tokenizer.json ``pre_tokenizer`` that splits text as the name says (the
    #: converter names a tokenizer.json by it; the reader rebuilds it for files without
    #: the embedded tokenizer.json)
    split: dict
    #: a pre-token found whole in the vocabulary is one token, whatever the merges say
    #: (llama.cpp's ignore_merges for the name; tokenizer.json's ``model.ignore_merges``)
    ignore_merges: bool = False
    #: BOS is prepended when the file has no tokenizer.ggml.add_bos_token (llama.cpp's
    #: default for the name)
    add_bos: bool = False


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _splits(*patterns: str, digits: bool | None = None, byte_regex: bool = False) -> dict:
    """Each regex isolates its matches in turn (llama.cpp's list of regexes for a name),
    then optionally every numeric character (``digits=True``) or run (False) stands
    alone, then the byte-level mapping, with GPT-2's own regex when ``byte_regex``."""
    steps = [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
             for p in patterns]
    if digits is not None:
        steps.append({"type": "Digits", "individual_digits": digits})
    return {"type": "Sequence", "pretokenizers": steps + [_byte_level(byte_regex)]}


def _char_class(ranges: tuple) -> str:
    return "".join(chr(r) if isinstance(r, int) else f"{chr(r[0])}-{chr(r[1])}" for r in ranges)


# The published split regexes (each model's tokenizer.json; llama.cpp's comments keep
# the originals where its own std::regex needs a rewrite), in the `tokenizers` syntax.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          + "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
          + r"|\s{1,2}(?!\S)|\s{1}")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|"
          rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?|\p{{N}}{{1,3}}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TINY_AYA = r"\d{1,3}(?=(?:\d{3})*\b)"
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
_YOUTU = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_YOUTU_CJK = r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+"
_BAILING = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
_MINICPM5 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
             r"\s+(?!\S)|\s+")
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# DeepSeek-V3's (and Hunyuan's): digit runs in threes, Han and kana runs, then a word regex
# where one ASCII punctuation mark may lead a Latin word
_DEEPSEEK3_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPARK25_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                  r" ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+")
_HAN_KANA = r"[一-龥぀-ゟ゠-ヿ]+"
# DeepSeek LLM's letter class: the cased letters (Lu, Ll, Lt) of the Unicode version its
# tokenizer was made with, as code point ranges
_DEEPSEEK_LETTERS = _char_class((
    (0x41, 0x5A), (0x61, 0x7A), 0xB5, (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), 0x376, 0x377, (0x37B, 0x37D), 0x37F, 0x386,
    (0x388, 0x38A), 0x38C, (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F),
    (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), 0x1F59, 0x1F5B, 0x1F5D,
    (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), 0x1FBE, (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), 0x2102,
    0x2107, (0x210A, 0x2113), 0x2115, (0x2119, 0x211D), 0x2124, 0x2126, 0x2128, (0x212A, 0x212D),
    (0x212F, 0x2134), 0x2139, (0x213C, 0x213F), (0x2145, 0x2149), 0x214E, 0x2183, 0x2184,
    (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), 0x2CF2, 0x2CF3, (0xA640, 0xA66D),
    (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
    (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943)))
_DEEPSEEK_CJK = r"[一-龥ࠀ-一가-퟿]+"

_GPT2 = _byte_level(True)  # GPT-2's split, applied by the byte-level step itself
_LLAMA3_SPLIT = _splits(_LLAMA3)
_QWEN2_SPLIT = _splits(_QWEN2)
_GPT4O_SPLIT = _splits(_GPT4O)
_DEEPSEEK3_SPLIT = _splits(r"\p{N}{1,3}", _HAN_KANA, _DEEPSEEK3_WORDS)
_DIGITS_GPT2 = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2]}
_BLOOM_SPLIT = _splits(r" ?[^(\s|.,!?…。，、।۔،)]+")

# Every value of KEY_TOKENIZER_PRE this project reads, from llama.cpp's list of the names
# its converter writes (src/llama-vocab.cpp), and what each stands for. Names that share
# a split are one row each, so a name never maps to two things; the converter names a
# tokenizer.json by the first row that splits as it does. Any other value is refused
# (TOKENIZER_PRE_REFUSED says why for the known ones) rather than tokenized with the
# wrong split. "falcon" is the Falcon models' published chain: punctuation runs split
# off, GPT-2's byte-level regex, then digit runs, cut into threes; the digit steps see
# the byte-level text, so the bytes that map to numeric characters (e.g. 0xBD, "½") count
# as digits, as in the `tokenizers` library.
TOKENIZER_PRE_TOKENIZERS = {
    TOKENIZER_PRE_DEFAULT: PreTokenizer(_GPT2),
    # Llama-3's split; BOS by default and whole-word lookup, as Llama-3's tokenizer.json
    **{n: PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
       for n in ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "jina-v5-nano")},
    **{n: PreTokenizer(_LLAMA3_SPLIT) for n in ("dbrx", "smaug-bpe", "chatglm-bpe", "glm4")},
    "jais-2": PreTokenizer(_splits(_JAIS2)),
    **{n: PreTokenizer(_QWEN2_SPLIT) for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez",
                                                 "stablelm2", "hunyuan", "solar-open", "grok-2")},
    "qwen35": PreTokenizer(_splits(_QWEN35)),
    "ufakzeka": PreTokenizer(_splits(_UFAKZEKA)),
    "seed-coder": PreTokenizer(_splits(_SEED_CODER)),
    "exaone-moe": PreTokenizer(_splits(_EXAONE_MOE)),
    "minicpm5": PreTokenizer(_splits(r"\p{N}{1,3}", _MINICPM5), ignore_merges=True),
    "laguna": PreTokenizer(_splits(r"[^\n]+|[\n]+", _QWEN2)),
    **{n: PreTokenizer(_splits(_BAILING)) for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "tekken": PreTokenizer(_splits(_TEKKEN), ignore_merges=True, add_bos=True),
    **{n: PreTokenizer(_GPT4O_SPLIT) for n in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    **{n: PreTokenizer(_splits(_TINY_AYA, _GPT4O)) for n in ("tiny_aya", "cohere2moe")},
    "youtu": PreTokenizer(_splits(_YOUTU_CJK, _YOUTU), ignore_merges=True),
    "deepseek-llm": PreTokenizer(_splits(r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                                         r"\s+$", _DEEPSEEK_CJK, r"\p{N}+")),
    "deepseek-coder": PreTokenizer(_splits(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")),
    **{n: PreTokenizer(_DEEPSEEK3_SPLIT) for n in ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4")},
    "spark2_5": PreTokenizer(_splits(r"\p{N}{1,3}", _HAN_KANA, _SPARK25_WORDS, r"\p{N}")),
    # StarCoder's: every digit alone, then GPT-2's split (SmolLM, Command-R, EXAONE, ...)
    **{n: PreTokenizer(_DIGITS_GPT2) for n in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                                "exaone", "minerva-7b", "mellum2")},
    # GPT-2's own split
    **{n: PreTokenizer(_GPT2) for n in ("gpt-2", "phi-2", "olmo", "mpt", "jais", "trillion", "granite-docling",
                                         "gigachat", "a.x-4.0", "mellum", "modern-bert", "exaone4", "jina-es",
                                         "jina-de", "jina-v2-es", "jina-v2-de")},
    # Bloom's: runs of anything but whitespace and a few punctuation marks
    **{n: PreTokenizer(_BLOOM_SPLIT) for n in ("bloom", "gpt3-finnish", "poro-chat")},
    "viking": PreTokenizer(_splits(r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}")),
    "chameleon": PreTokenizer(_splits(r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                                      r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]",
                                      r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"),
                              add_bos=True),
    TOKENIZER_PRE_FALCON: PreTokenizer({"type": "Sequence", "pretokenizers": [
        {"type": "Punctuation", "behavior": "Contiguous"},
        _byte_level(True),
        {"type": "Digits", "individual_digits": False},
        {"type": "Split", "pattern": {"Regex": "[0-9][0-9][0-9]"}, "behavior": "Isolated", "invert": False}]}),
}

# The names llama.cpp reads that this project refuses, and why: each needs machinery the
# byte-level BPE here lacks.
TOKENIZER_PRE_REFUSED = {
    **{n: "SentencePiece-style BPE on raw UTF-8 (spaces as U+2581, <0xXX> byte tokens), not byte-level"
       for n in ("gemma4", "granite-embed-multi-311m", "sarvam-moe")},
    "whitespace": "a whitespace split without the byte-level mapping (an embedding model's vocabulary)",
    **{n: "an encoder vocabulary: llama.cpp appends a SEP token (add_sep), which this tokenizer does not"
       for n in ("jina-v1-en", "jina-v2-code", "roberta-bpe")},
    "kimi-k2": "llama.cpp splits it with a hand-written handler (letters without Han), not a published regex",
    "afmoe": "llama.cpp groups digits with a hand-written handler, not a published regex",
    "superbpe": "its digit split is a zero-width regex (cuts between digits), which `tokenizers` cannot split by",
    "granite-embed-multi-97m": "llama.cpp's regex is its own approximation, with no published pattern to "
                               "follow",
}

# Values of KEY_TOKENIZER_TOKEN_TYPE (llama.cpp's enum)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# --------------------------------------------------------------------------
# general.file_type values (llama.cpp's LlamaFileType) per converter outtype
# --------------------------------------------------------------------------

FILE_TYPE_ALL_F32 = 0
FILE_TYPE_MOSTLY_F16 = 1
FILE_TYPE_MOSTLY_Q4_0 = 2
FILE_TYPE_MOSTLY_Q4_1 = 3
FILE_TYPE_MOSTLY_Q8_0 = 7
FILE_TYPE_MOSTLY_Q5_0 = 8
FILE_TYPE_MOSTLY_Q5_1 = 9
FILE_TYPE_MOSTLY_Q2_K = 10
FILE_TYPE_MOSTLY_Q3_K_S = 11
FILE_TYPE_MOSTLY_Q3_K_M = 12
FILE_TYPE_MOSTLY_BF16 = 32
FILE_TYPE_MOSTLY_Q4_K_S = 14
FILE_TYPE_MOSTLY_Q4_K_M = 15
FILE_TYPE_MOSTLY_Q5_K_S = 16
FILE_TYPE_MOSTLY_Q5_K_M = 17
FILE_TYPE_MOSTLY_Q6_K = 18
FILE_TYPE_MOSTLY_IQ4_NL = 25
FILE_TYPE_MOSTLY_IQ4_XS = 30

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k",
            "q4_k_m", "q5_k_m", "q2_k", "q3_k_m", "iq4_nl", "iq4_xs")
#: llama.cpp's IQ1/IQ2/IQ3 lattice types: the runtime reads them (when built with their
#: codebooks) but does not write them: llama.cpp's quantizers for them need an importance
#: matrix (llama-imatrix over calibration text) to be worth their bits.
READ_ONLY_TYPES = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")


def outtype_refusal(outtype: str) -> str:
    """Why `outtype` is not one convert writes (for an outtype not in OUTTYPES)."""
    if str(outtype).lower() in READ_ONLY_TYPES:
        return (f"outtype {outtype!r} is read but not written by this runtime: llama.cpp's "
                f"{str(outtype).upper()} quantizer needs an importance matrix; make the file with "
                f"llama.cpp's llama-imatrix and llama-quantize, then load or convert it from there "
                f"(outtypes written: {', '.join(OUTTYPES)})")
    return f"unknown outtype {outtype!r} (expected one of: {', '.join(OUTTYPES)})"


#: The outtypes that are llama.cpp's per-tensor mixes (gguf_write.storage_type has the rule);
#: q2_k is llama.cpp's Q2_K preset, itself a mix.
OUTTYPE_MIXES = ("q4_k_m", "q5_k_m", "q2_k", "q3_k_m", "iq4_nl", "iq4_xs")
OUTTYPE_FILE_TYPE = {
    "f32": FILE_TYPE_ALL_F32,
    "f16": FILE_TYPE_MOSTLY_F16,
    "bf16": FILE_TYPE_MOSTLY_BF16,
    "q8_0": FILE_TYPE_MOSTLY_Q8_0,
    "q4_0": FILE_TYPE_MOSTLY_Q4_0,
    "q4_1": FILE_TYPE_MOSTLY_Q4_1,
    "q5_0": FILE_TYPE_MOSTLY_Q5_0,
    "q5_1": FILE_TYPE_MOSTLY_Q5_1,
    # every matrix in the one K-quant (embeddings and head Q6_K): llama.cpp's _S names
    "q4_k": FILE_TYPE_MOSTLY_Q4_K_S,
    "q5_k": FILE_TYPE_MOSTLY_Q5_K_S,
    "q6_k": FILE_TYPE_MOSTLY_Q6_K,
    "q4_k_m": FILE_TYPE_MOSTLY_Q4_K_M,
    "q5_k_m": FILE_TYPE_MOSTLY_Q5_K_M,
    "q2_k": FILE_TYPE_MOSTLY_Q2_K,
    "q3_k_m": FILE_TYPE_MOSTLY_Q3_K_M,
    "iq4_nl": FILE_TYPE_MOSTLY_IQ4_NL,
    "iq4_xs": FILE_TYPE_MOSTLY_IQ4_XS,
}

#: Block size of the quantized types we write (elements per block); rows whose
#: length is not a multiple of it are stored as F16 instead.
QUANT_BLOCK = 32
#: The same for the K-quants (q4_k, q5_k, q6_k and the mixes) and IQ4_XS: ggml's QK_K;
#: their rows that are not whole K-blocks fall back as llama.cpp's do (Q4_K to Q5_0, Q5_K
#: to Q5_1, Q6_K to Q8_0, Q2_K and Q3_K to IQ4_NL (or Q5_0 where the runtime does not read
#: IQ4_NL), IQ4_XS to IQ4_NL; then F16).
QUANT_BLOCK_K = 256

# --------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------

# Global tensors
T_TOKEN_EMBD = "token_embd"
T_POSITION_EMBD = "position_embd"  # opt: learned absolute positions (row pos + 2)
T_ROPE_FREQS = "rope_freqs"        # llama-3 rope scaling: per-dimension frequency divisors
T_OUTPUT_NORM = "output_norm"
T_OUTPUT = "output"

# Per-layer tensors (blk.N.<kind>)
T_ATTN_NORM = "attn_norm"
T_ATTN_NORM_2 = "attn_norm_2"  # falcon new_decoder_architecture: ln_mlp (the FFN's input norm)
T_ATTN_QKV = "attn_qkv"        # falcon, phi3: fused q, k, v rows (all q heads, all k, all v)
T_ATTN_Q = "attn_q"
T_ATTN_K = "attn_k"
T_ATTN_V = "attn_v"
T_ATTN_OUTPUT = "attn_output"
T_ATTN_Q_NORM = "attn_q_norm"  # qwen3: RMSNorm of each q head [hd]; olmo2: of all of q [n_head·hd]
T_ATTN_K_NORM = "attn_k_norm"  # qwen3: RMSNorm of each k head [hd]; olmo2: of all of k
T_ATTN_SINKS = "attn_sinks"    # gpt-oss: [n_head] a logit per head in the softmax's denominator
T_POST_ATTN_NORM = "post_attention_norm"  # olmo2, gemma2/3: norm of the attention's output;
#                                            gpt-oss: the FFN's input norm (llama.cpp's name)
T_POST_FFW_NORM = "post_ffw_norm"         # olmo2, gemma2/3: norm of the FFN's output
T_FFN_NORM = "ffn_norm"
T_FFN_GATE = "ffn_gate"
T_FFN_UP = "ffn_up"            # phi3: fused gate and up rows (all gate, then all up)
T_FFN_DOWN = "ffn_down"
# mixture of experts (llama.cpp's names): the router, the experts as 3-D tensors
# [n_expert, rows, cols] (numpy shape; GGUF ne reversed), the shared expert and its gate
T_FFN_GATE_INP = "ffn_gate_inp"        # [n_expert, d] router, stored F32 as llama.cpp does
T_FFN_GATE_EXPS = "ffn_gate_exps"      # [n_expert, n_ff_exp, d]
T_FFN_UP_EXPS = "ffn_up_exps"          # [n_expert, n_ff_exp, d]
T_FFN_DOWN_EXPS = "ffn_down_exps"      # [n_expert, d, n_ff_exp]
# gpt-oss: ffn_gate_inp.bias [n_expert], ffn_{gate,up}_exps.bias [n_expert, n_ff_exp] and
# ffn_down_exps.bias [n_expert, d] (biases are F32 whatever their rank)
T_FFN_GATE_SHEXP = "ffn_gate_shexp"    # [n_ff_shexp, d]
T_FFN_UP_SHEXP = "ffn_up_shexp"        # [n_ff_shexp, d]
T_FFN_DOWN_SHEXP = "ffn_down_shexp"    # [d, n_ff_shexp]
T_FFN_GATE_INP_SHEXP = "ffn_gate_inp_shexp"  # [d] the shared expert's sigmoid gate, F32
T_FFN_EXP_PROBS_B = "exp_probs_b"      # [n_expert] (suffix .bias) the sigmoid router's selection
#                                        bias (e_score_correction_bias), F32
MOE_LAYER_TENSORS = (T_FFN_GATE_INP, T_FFN_GATE_EXPS, T_FFN_UP_EXPS, T_FFN_DOWN_EXPS,
                     T_FFN_GATE_INP_SHEXP, T_FFN_GATE_SHEXP, T_FFN_UP_SHEXP, T_FFN_DOWN_SHEXP,
                     T_FFN_EXP_PROBS_B)
#: Tensor kinds kept F32 in every outtype (llama.cpp's converter and quantizer keep the
#: routers so: a few KB that decide which experts run).
F32_KINDS = (T_FFN_GATE_INP, T_FFN_GATE_INP_SHEXP)

GLOBAL_TENSORS = (T_TOKEN_EMBD, T_POSITION_EMBD, T_ROPE_FREQS, T_OUTPUT_NORM, T_OUTPUT)
#: The per-layer tensors of a llama file, in file order.
LAYER_TENSORS = (T_ATTN_NORM, T_ATTN_Q, T_ATTN_K, T_ATTN_V, T_ATTN_OUTPUT,
                 T_FFN_NORM, T_FFN_GATE, T_FFN_UP, T_FFN_DOWN)
#: Every dense per-layer tensor kind of any architecture (biases are the same kinds
#: with the ".bias" suffix).
ALL_LAYER_TENSORS = (T_ATTN_NORM, T_ATTN_NORM_2, T_ATTN_QKV, T_ATTN_Q, T_ATTN_K, T_ATTN_V,
                     T_ATTN_OUTPUT, T_ATTN_Q_NORM, T_ATTN_K_NORM, T_ATTN_SINKS, T_POST_ATTN_NORM, T_FFN_NORM,
                     T_FFN_GATE, T_FFN_UP, T_FFN_DOWN, T_POST_FFW_NORM) + MOE_LAYER_TENSORS

#: Layer-tensor prefix: blk.{layer}.
LAYER_PREFIX = "blk"


def arch_key(template: str, arch: str = ARCH_LLAMA) -> str:
    """Resolve a per-architecture key template, e.g.
    ``arch_key(KEY_CONTEXT_LENGTH) == "llama.context_length"``."""
    return template.format(arch=arch)


def tensor_name(kind: str, layer: int | None = None, suffix: str | None = "weight") -> str:
    """GGUF tensor name: ``tensor_name("attn_q", 3) == "blk.3.attn_q.weight"``,
    ``tensor_name("token_embd") == "token_embd.weight"``.
    ``suffix=None`` gives a name without the ``.weight`` suffix."""
    if layer is None:
        if kind in ALL_LAYER_TENSORS:
            raise ValueError(f"tensor kind {kind!r} needs a layer index")
        base = kind
    else:
        if kind in GLOBAL_TENSORS:
            raise ValueError(f"tensor kind {kind!r} is global, not per-layer")
        if int(layer) < 0:
            raise ValueError(f"negative layer index {layer}")
        base = f"{LAYER_PREFIX}.{int(layer)}.{kind}"
    return base if not suffix else f"{base}.{suffix}"


def parse_tensor_name(name: str) -> tuple[str, int | None, str | None]:
    """Inverse of tensor_name: ``"blk.3.attn_q.weight" -> ("attn_q", 3, "weight")``."""
    parts = name.split(".")
    layer = None
    if len(parts) >= 3 and parts[0] == LAYER_PREFIX and parts[1].isdigit():
        layer = int(parts[1])
        parts = parts[2:]
    suffix = None
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        suffix = parts[-1]
        parts = parts[:-1]
    return ".".join(parts), layer, suffix


def dense_tensor_names(n_layer: int, tied: bool) -> list[str]:
    """All dense tensor names of a llama-architecture file, in file order."""
    names = [tensor_name(T_TOKEN_EMBD)]
    for il in range(n_layer):
        names += [tensor_name(k, il) for k in LAYER_TENSORS]
    names.append(tensor_name(T_OUTPUT_NORM))
    if not tied:
        names.append(tensor_name(T_OUTPUT))
    return names


# --------------------------------------------------------------------------
# Sparse extension (predictors, neuron frequencies, GPU index)
# --------------------------------------------------------------------------
#
# A *sparse* file is a dense file of the same format version (1) plus the
# keys and tensors below; it is recognised by the presence of
# KEY_SPARSE_THRESHOLD. In a sparse file every layer stores ffn_down_t
# (the down projection transposed: one contiguous row per neuron) INSTEAD of
# ffn_down, plus its predictor (fc1, fc2), neuron frequencies and GPU index.
# The format version stays 1: every sparse addition is detected by name, so a
# reader that knows version 1 knows what to look for.

#: Predictor threshold (f32): neuron j is predicted active iff
#: (fc2 · relu(fc1 · x))_j >= threshold. One global value per file.
KEY_SPARSE_THRESHOLD = "powerinfer.sparse.threshold"
#: Calibration text the profile was taken over (string, informational).
KEY_SPARSE_CALIB_SOURCE = "powerinfer.sparse.calib_source"
#: Number of calibration tokens profiled (u32).
KEY_SPARSE_CALIB_TOKENS = "powerinfer.sparse.calib_tokens"
#: Recall target the predictors were trained for (f32, fraction of the truly
#: active neurons that must be predicted active on held-out tokens).
KEY_SPARSE_RECALL_TARGET = "powerinfer.sparse.recall_target"

#: VRAM budget (u64 bytes) the GPU index was solved for; 0 = CPU only.
KEY_GPU_VRAM_BUDGET = "powerinfer.gpu.vram_budget"
#: Neurons per placement group (u32).
KEY_GPU_GROUP_SIZE = "powerinfer.gpu.group_size"
#: Context length (u32) whose KV cache was reserved in the budget.
KEY_GPU_CTX = "powerinfer.gpu.ctx"
#: Bytes (u64) of the budget reserved for dense parts (attention, predictors,
#: norms, output head, KV cache), in that priority.
KEY_GPU_DENSE_BYTES = "powerinfer.gpu.dense_bytes"
#: Bytes (u64) of the FFN neurons placed on the GPU (gate/up/down_t rows).
KEY_GPU_NEURON_BYTES = "powerinfer.gpu.neuron_bytes"
#: Share (f32, 0..1) of the profiled activation mass served by GPU neurons.
KEY_GPU_SERVED_SHARE = "powerinfer.gpu.served_share"
#: Which solver produced the index (string, one of GPU_SOLVERS).
KEY_GPU_SOLVER = "powerinfer.gpu.solver"
GPU_SOLVER_ILP = "ilp"
GPU_SOLVER_GREEDY = "greedy"
GPU_SOLVER_NONE = "none"  # budget left nothing for neurons
GPU_SOLVERS = (GPU_SOLVER_ILP, GPU_SOLVER_GREEDY, GPU_SOLVER_NONE)

#: Gate-magnitude sparsity (f32[n_layer]): in the "gate" FFN mode neuron j of layer l
#: is active iff |act(gate_j)| > threshold[l]; calibrated on the profile to the target
#: below. Its presence marks a gate-sparse file (ffn_down_t, no predictors needed).
KEY_SPARSE_GATE_THRESHOLD = "powerinfer.sparse.gate_threshold"
#: PowerInfer's own files (PWRI magic): their predictor threshold (f32). Read from PWRI
#: files only; their predictors read the residual stream.
KEY_PWRI_SPARSE_THRESHOLD = "powerinfer.sparse_threshold"
#: A GPU index side file "<model>.generated.gpuidx" (PowerInfer's layout; `place` writes
#: ours so): a GGUF of this architecture with blk.N.gpu_idx / gpu_bucket and, in ours, the
#: powerinfer.gpu.* keys plus the model file's size; it replaces the index in the model.
GPUIDX_SUFFIX = ".generated.gpuidx"
GPUIDX_ARCH = "generic.gpu_index"
KEY_GPU_MODEL_BYTES = "powerinfer.gpu.model_bytes"
#: The share of FFN neurons the gate thresholds were calibrated to zero (f32, 0..1; the
#: mean over the layers).
KEY_SPARSE_TARGET = "powerinfer.sparse.target_sparsity"
#: Per layer, the share its threshold was calibrated to zero (f32[n_layer]; the
#: allocation of the mean above).
KEY_SPARSE_LAYER_SPARSITY = "powerinfer.sparse.layer_sparsity"
#: How the mean sparsity was shared among the layers (string, one of GATE_ALLOCATIONS).
KEY_SPARSE_GATE_ALLOCATION = "powerinfer.sparse.gate_allocation"
GATE_ALLOCATIONS = ("uniform", "greedy")
#: A gate file calibrated to a quality budget: the budget (f32, relative perplexity
#: increase, e.g. 0.02) and the increase measured for the chosen level on held-out tokens.
KEY_SPARSE_MAX_PPL_INCREASE = "powerinfer.sparse.max_ppl_increase"
KEY_SPARSE_PPL_INCREASE = "powerinfer.sparse.heldout_ppl_increase"

SPARSE_KEYS = (KEY_SPARSE_THRESHOLD, KEY_SPARSE_CALIB_SOURCE, KEY_SPARSE_CALIB_TOKENS,
               KEY_SPARSE_RECALL_TARGET)
#: Keys of a gate-sparse file in place of the predictor's threshold and recall target
#: (docs/FORMAT.md "Gate-magnitude sparsity").
GATE_KEYS = (KEY_SPARSE_GATE_THRESHOLD, KEY_SPARSE_TARGET, KEY_SPARSE_LAYER_SPARSITY,
             KEY_SPARSE_GATE_ALLOCATION)
#: Written besides GATE_KEYS when the sparsity was chosen by a quality budget.
GATE_BUDGET_KEYS = (KEY_SPARSE_MAX_PPL_INCREASE, KEY_SPARSE_PPL_INCREASE)


def is_sparse(keys) -> bool:
    """Whether a file with these metadata keys is sparse (predictors or gate thresholds)."""
    return KEY_SPARSE_THRESHOLD in keys or KEY_SPARSE_GATE_THRESHOLD in keys
#: Keys of the GPU index; `python -m powerinfer_cpp.place` rewrites exactly these
#: (and the GPU_INDEX_TENSORS).
GPU_KEYS = (KEY_GPU_VRAM_BUDGET, KEY_GPU_GROUP_SIZE, KEY_GPU_CTX, KEY_GPU_DENSE_BYTES,
            KEY_GPU_NEURON_BYTES, KEY_GPU_SERVED_SHARE, KEY_GPU_SOLVER)

# Per-layer sparse tensors (blk.N.<kind>). Shapes numpy-style [rows, cols]
# (GGUF ne = reversed): ffn_down_t [n_ff, d]; fc1 [h, d]; fc2 [n_ff, h];
# ffn_freq F32 [n_ff]; gpu_idx I32 [n_ff] (0/1); gpu_bucket I32 [n_hot]
# (sorted hot neuron ids; omitted when n_hot == 0).
T_FFN_DOWN_T = "ffn_down_t"
T_FC1 = "fc1"
T_FC2 = "fc2"
T_FFN_FREQ = "ffn_freq"      # written without a suffix: blk.N.ffn_freq
T_GPU_IDX = "gpu_idx"        # blk.N.gpu_idx
T_GPU_BUCKET = "gpu_bucket"  # blk.N.gpu_bucket
SPARSE_LAYER_TENSORS = (T_FFN_DOWN_T, T_FC1, T_FC2, T_FFN_FREQ, T_GPU_IDX, T_GPU_BUCKET)
GPU_INDEX_TENSORS = (T_GPU_IDX, T_GPU_BUCKET)
#: Sparse tensors stored without the ".weight" suffix.
SPARSE_NO_SUFFIX = (T_FFN_FREQ, T_GPU_IDX, T_GPU_BUCKET)


# Expert placement of a mixture-of-experts file (docs/FORMAT.md "Expert placement"):
# per layer, each expert's selection frequency over the profiled tokens and the offline
# placement; written by `python -m powerinfer_cpp.place --profile` into the side file or a
# whole model file, like the neuron index.
T_FFN_EXP_FREQ = "ffn_exp_freq"  # blk.N.ffn_exp_freq F32 [n_expert], each in [0, 1]
T_FFN_EXP_GPU = "ffn_exp_gpu"    # blk.N.ffn_exp_gpu I32 [n_expert], 1 = on the device
EXPERT_TENSORS = (T_FFN_EXP_FREQ, T_FFN_EXP_GPU)
#: Tokens the expert frequencies were counted over (u32), and the calibration text's name.
KEY_EXPERT_PROFILE_TOKENS = "powerinfer.experts.profile_tokens"
KEY_EXPERT_PROFILE_SOURCE = "powerinfer.experts.profile_source"
#: Bytes (u64) the placement left to the experts (after attention, routers, head and the
#: expert cache) and the bytes of the experts it placed; the device budget it was solved
#: for is KEY_GPU_VRAM_BUDGET, the solver KEY_GPU_SOLVER.
KEY_EXPERT_BYTES_LEFT = "powerinfer.experts.bytes_left"
KEY_EXPERT_BYTES = "powerinfer.experts.bytes"
#: The n_cpu_moe (u32) and the expert cache bytes (u64) it was solved for.
KEY_EXPERT_N_CPU_MOE = "powerinfer.experts.n_cpu_moe"
KEY_EXPERT_CACHE = "powerinfer.experts.cache_bytes"
#: Share (f32, 0..1) of the profiled expert selections the placed experts serve.
KEY_EXPERT_SERVED_SHARE = "powerinfer.experts.served_share"
#: The shared experts (qwen2moe) the budget placed before the routed ones: their bytes (u64)
#: and how many layers' (u32; the first ones). Informational: the loader places them itself.
KEY_EXPERT_SHARED_BYTES = "powerinfer.experts.shared_bytes"
KEY_EXPERT_SHARED_LAYERS = "powerinfer.experts.shared_layers"
EXPERT_KEYS = (KEY_EXPERT_PROFILE_TOKENS, KEY_EXPERT_PROFILE_SOURCE, KEY_EXPERT_BYTES_LEFT,
               KEY_EXPERT_BYTES, KEY_EXPERT_N_CPU_MOE, KEY_EXPERT_CACHE, KEY_EXPERT_SERVED_SHARE,
               KEY_EXPERT_SHARED_BYTES, KEY_EXPERT_SHARED_LAYERS, KEY_GPU_VRAM_BUDGET, KEY_GPU_SOLVER)


# Sparse experts (docs/FORMAT.md "Sparse experts"): a mixture-of-experts layer's down
# projection transposed, in place of ffn_down_exps ([n_expert, n_ff_exp, d]: row i of expert
# e = neuron i's output vector), and each expert's gate threshold (negative: none, the
# expert runs dense), written by `convert --sparse` / `--sparsity S` of a MoE model.
T_FFN_DOWN_EXPS_T = "ffn_down_exps_t"    # blk.N.ffn_down_exps_t.weight [n_expert, n_ff_exp, d]
T_FFN_EXP_GATE_THR = "ffn_exp_gate_thr"  # blk.N.ffn_exp_gate_thr F32 [n_expert]
# each expert's predictor (ReLU-family experts, --expert-predictors): fc1 [n_expert, h, d],
# fc2 [n_expert, n_ff_exp, h], F32; the sparse FFN mode's score = fc2 . relu(fc1 . x)
T_FFN_EXP_FC1 = "ffn_exp_fc1"            # blk.N.ffn_exp_fc1.weight
T_FFN_EXP_FC2 = "ffn_exp_fc2"            # blk.N.ffn_exp_fc2.weight
SPARSE_EXPERT_TENSORS = (T_FFN_DOWN_EXPS_T, T_FFN_EXP_GATE_THR, T_FFN_EXP_FC1, T_FFN_EXP_FC2)


def sparse_expert_tensor_name(kind: str, layer: int) -> str:
    """``blk.N.ffn_down_exps_t.weight`` / ``blk.N.ffn_exp_gate_thr`` (no suffix) /
    ``blk.N.ffn_exp_fc1.weight`` / ``blk.N.ffn_exp_fc2.weight``."""
    if kind not in SPARSE_EXPERT_TENSORS:
        raise ValueError(f"not a sparse expert tensor: {kind!r}")
    return f"blk.{layer}.{kind}" + ("" if kind == T_FFN_EXP_GATE_THR else ".weight")


# Hot neurons of sparse experts on the device (docs/FORMAT.md "Hot neurons of experts"): per
# layer, each expert's count of hot neurons and their ids (ascending, experts in order), and
# the neuron frequencies inside each expert the placement was solved from; written by
# sparse/experts.py's solve_expert_neurons / expert_hot_tensors.
T_FFN_EXP_HOT_COUNT = "ffn_exp_hot_count"  # blk.N.ffn_exp_hot_count I32 [n_expert]
T_FFN_EXP_HOT = "ffn_exp_hot"              # blk.N.ffn_exp_hot I32 [sum of the counts]
T_FFN_EXP_NFREQ = "ffn_exp_nfreq"          # blk.N.ffn_exp_nfreq F32 [n_expert, n_ff_exp]
EXPERT_HOT_TENSORS = (T_FFN_EXP_HOT_COUNT, T_FFN_EXP_HOT, T_FFN_EXP_NFREQ)


def expert_hot_tensor_name(kind: str, layer: int) -> str:
    """``blk.N.ffn_exp_hot_count`` / ``blk.N.ffn_exp_hot`` / ``blk.N.ffn_exp_nfreq``."""
    if kind not in EXPERT_HOT_TENSORS:
        raise ValueError(f"not a hot-neurons-of-experts tensor: {kind!r}")
    return f"blk.{layer}.{kind}"


def expert_tensor_name(kind: str, layer: int) -> str:
    """``blk.N.ffn_exp_freq`` / ``blk.N.ffn_exp_gpu`` (no suffix)."""
    if kind not in EXPERT_TENSORS:
        raise ValueError(f"not an expert placement tensor: {kind!r}")
    return f"blk.{layer}.{kind}"


def sparse_tensor_name(kind: str, layer: int) -> str:
    """Name of a per-layer sparse tensor: ``blk.N.fc1.weight``,
    ``blk.N.ffn_freq`` (frequencies and GPU index carry no suffix)."""
    if kind not in SPARSE_LAYER_TENSORS:
        raise ValueError(f"{kind!r} is not a sparse tensor kind")
    return tensor_name(kind, layer, None if kind in SPARSE_NO_SUFFIX else "weight")


def sparse_layer_tensor_names(layer: int, n_hot: int) -> list[str]:
    """The tensors that follow ffn_up in a sparse file's layer, in file order
    (ffn_down_t replaces ffn_down; gpu_bucket only when n_hot > 0)."""
    kinds = [T_FFN_DOWN_T, T_FC1, T_FC2, T_FFN_FREQ, T_GPU_IDX] + ([T_GPU_BUCKET] if n_hot else [])
    return [sparse_tensor_name(k, layer) for k in kinds]


# --------------------------------------------------------------------------
# Input sparsity of the projections (attention q/k/v and o, the output head)
# --------------------------------------------------------------------------
#
# y = W x with most of x's entries skipped is a sum of W's columns: each projection whose
# input is sparsified is stored a second time transposed (one contiguous row per input
# channel, like ffn_down_t), next to a threshold per input channel: input i is used iff
# |x_i| > thr[i]. The row-major tensors stay (the prompt path and the dense mode read
# them). A file has every site of every layer and the head, or none
# (docs/FORMAT.md "Input sparsity").

#: blk.N.attn_qkv_t.weight [d, dq + 2 dkv]: q, k and v transposed into one matrix (row i:
#: input i's contribution to q's outputs, then k's, then v's); every architecture.
T_ATTN_QKV_T = "attn_qkv_t"
#: blk.N.attn_output_t.weight [dq, d]: attn_output transposed.
T_ATTN_OUTPUT_T = "attn_output_t"
#: output_t.weight [d, n_vocab]: the head (output, or token_embd when tied) transposed.
T_OUTPUT_T = "output_t"
#: F32 per-input-channel thresholds, no suffix: blk.N.attn_qkv_in_thr [d],
#: blk.N.attn_output_in_thr [dq], output_in_thr [d].
T_ATTN_QKV_IN_THR = "attn_qkv_in_thr"
T_ATTN_OUTPUT_IN_THR = "attn_output_in_thr"
T_OUTPUT_IN_THR = "output_in_thr"
INPUT_SPARSE_LAYER_TENSORS = (T_ATTN_QKV_T, T_ATTN_QKV_IN_THR, T_ATTN_OUTPUT_T, T_ATTN_OUTPUT_IN_THR)
INPUT_SPARSE_GLOBAL_TENSORS = (T_OUTPUT_T, T_OUTPUT_IN_THR)
#: The FFN's inputs (optional on top of the above, each group in every layer or none):
#: blk.N.ffn_gate_up_t.weight [d, 2 n_ff] (gate and up transposed side by side: row i is input
#: i's contribution to the gate's outputs, then the up's; ungated: [d, n_ff], the up rows the
#: activation reads) with blk.N.ffn_in_thr [d]; blk.N.ffn_down_in_thr [n_ff]: down_t row j is
#: read iff |act(g_j) * u_j| > thr[j].
T_FFN_GATE_UP_T = "ffn_gate_up_t"
T_FFN_IN_THR = "ffn_in_thr"
T_FFN_DOWN_IN_THR = "ffn_down_in_thr"
FFN_INPUT_SPARSE_TENSORS = (T_FFN_GATE_UP_T, T_FFN_IN_THR, T_FFN_DOWN_IN_THR)
#: The target share (f32, 0..1) of each site's inputs the thresholds were calibrated to skip.
KEY_INPUT_SPARSITY = "powerinfer.input_sparsity.target"
#: How the thresholds rank the inputs (string, one of INPUT_CRITERIA): "magnitude" (TEAL:
#: |x_i|, one threshold per site), "wina" (|x_i| times the L2 norm of W's column i, stored
#: as t / norm_i per channel); "mixed" (tools only, site_allocation.MixedSiteTable): each
#: site by one of the two. Informational: the runtime reads the thresholds only.
KEY_INPUT_CRITERION = "powerinfer.input_sparsity.criterion"
INPUT_CRITERIA = ("magnitude", "wina")
#: Only when the target was chosen by a quality budget (convert --input-sparsity auto): the
#: budget P (f32, relative), and the relative held-out perplexity increase measured with the
#: file's thresholds, FFN and input sparsity together (f32).
KEY_INPUT_MAX_PPL_INCREASE = "powerinfer.input_sparsity.max_ppl_increase"
KEY_INPUT_PPL_INCREASE = "powerinfer.input_sparsity.heldout_ppl_increase"
INPUT_KEYS = (KEY_INPUT_SPARSITY, KEY_INPUT_CRITERION, KEY_INPUT_MAX_PPL_INCREASE, KEY_INPUT_PPL_INCREASE)


def input_sparse_tensor_name(kind: str, layer: int | None = None) -> str:
    """Name of an input-sparsity tensor: ``blk.N.attn_qkv_t.weight``,
    ``blk.N.attn_qkv_in_thr``, ``output_t.weight``, ``output_in_thr``."""
    if kind in INPUT_SPARSE_LAYER_TENSORS or kind in FFN_INPUT_SPARSE_TENSORS:
        if layer is None or int(layer) < 0:
            raise ValueError(f"tensor kind {kind!r} needs a layer index")
        base = f"{LAYER_PREFIX}.{int(layer)}.{kind}"
    elif kind in INPUT_SPARSE_GLOBAL_TENSORS:
        if layer is not None:
            raise ValueError(f"tensor kind {kind!r} is global, not per-layer")
        base = kind
    else:
        raise ValueError(f"{kind!r} is not an input-sparsity tensor kind")
    return base if kind.endswith("_thr") else f"{base}.weight"
