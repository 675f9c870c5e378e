"""`Llama`: the high-level API llama-cpp-python users know, over one Model and Context.

    from powerinfer_cpp import Llama        # instead of: from llama_cpp import Llama

    llm = Llama("model.gguf", n_ctx=512, verbose=False)
    out = llm("And God said", max_tokens=32, stop=["\\n"])       # OpenAI-shaped dict
    print(out["choices"][0]["text"], out["usage"])
    for chunk in llm.create_chat_completion(
            [{"role": "user", "content": "Who made the light?"}], stream=True):
        print(chunk["choices"][0]["delta"].get("content", ""), end="")

Arguments llama-cpp-python has and this engine does not support are accepted only at
llama-cpp-python's default value (so code that spells the defaults out still runs);
any other value raises `UnsupportedArgumentError` naming them. Names neither library
knows raise TypeError. docs/API.md has the table.

The response shapes (protocol.py) and the generation arguments' reading (arguments.py) are
the server's too (`powerinfer_cpp.server`), so both give the same dicts for the same request.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import warnings
from collections import deque
from typing import Any, Iterator, Sequence

import numpy as np

from . import arguments as A
from . import embeddings as E
from . import format as F
from . import speculative, structured
from .chat import ChatTemplate, normalize_messages
from .context import ContextState
from .generation import Completion, Sampler
from .model import Model, gpu_device
from .protocol import chat_chunk, chat_response, completion_chunk, completion_response, \
    embedding_response, new_id
from .structured import LlamaGrammar
from .tools import ToolPlan

__all__ = ["Llama", "UnsupportedArgumentError", "UnsupportedFeatureError", "LLAMA_DEFAULT_SEED"]

# llama.cpp's "pick a random seed" value, as llama-cpp-python's Llama(seed=...) default
LLAMA_DEFAULT_SEED = 0xFFFFFFFF


class UnsupportedArgumentError(ValueError):
    """A llama-cpp-python argument this engine does not implement was given a value
    other than its default."""


class UnsupportedFeatureError(UnsupportedArgumentError, NotImplementedError):
    """A llama-cpp-python method this engine does not implement. Both an
    UnsupportedArgumentError (one `except` catches every "not supported") and a
    NotImplementedError (what Python code expects of a missing feature)."""


def _not_supported(method: str, why: str):
    raise UnsupportedFeatureError(f"Llama.{method}(): not supported by powerinfer-cpp: {why} "
                                  "(see docs/API.md)")


_NO_STATE_CACHE = ("a cache object of several saved KV cache states (LlamaRAMCache, "
                   "LlamaDiskCache) is not implemented; save_state() / load_state() save and "
                   "restore one, the context keeps the longest common prefix of the tokens "
                   "between calls by itself, and the server has --cache-ram")


# llama-cpp-python's Llama() arguments we do not implement, with their defaults there.
_INIT_UNSUPPORTED = {
    "split_mode": 1, "main_gpu": 0, "tensor_split": None, "rpc_servers": None,
    "vocab_only": False, "use_mlock": False, "kv_overrides": None, "n_ubatch": 512,
    "rope_scaling_type": -1, "rope_freq_base": 0.0,
    "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0,
    "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0, "logits_all": False,
    "offload_kqv": True, "flash_attn": False, "no_perf": False,
    "lora_base": None, "lora_scale": 1.0, "lora_path": None, "numa": False,
    "chat_handler": None, "tokenizer": None, "type_k": None,
    "type_v": None, "spm_infill": False,
}
# create_completion / create_chat_completion arguments we do not implement
_GEN_UNSUPPORTED = {
    "suffix": None, "logprobs": None, "top_logprobs": None, "typical_p": 1.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "tfs_z": 1.0, "mirostat_mode": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "grammar": None,
}
_CHAT_UNSUPPORTED = {
    **{k: v for k, v in _GEN_UNSUPPORTED.items() if k != "suffix"},
    "functions": None, "function_call": None,
}

# chat_format names understood besides None (= the file's tokenizer.chat_template)
_CHAT_FORMATS = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
               "{% endif %}"),
}


def _draft_arg(model, draft_model, draft_max):
    """Llama(draft_model=...): None, "self" (the file's sparse mode drafts) or a draft model
    (a path or a Model; a llama-cpp-python LlamaDraftModel object is refused), checked now."""
    if draft_model is None:
        if draft_max is not None:
            raise ValueError("Llama(): draft_max needs a draft_model ('self' or a GGUF file)")
        return None
    if isinstance(draft_model, (str, os.PathLike, speculative.SelfDraft)):
        return speculative.resolve_draft(model, draft_model)
    if isinstance(draft_model, Model):
        speculative.check_vocab(model, draft_model)
        return draft_model
    raise UnsupportedArgumentError(
        f"Llama(): draft_model must be 'self', a GGUF file path or a powerinfer_cpp Model, not "
        f"{type(draft_model).__name__} (llama-cpp-python's draft objects such as prompt "
        "lookup decoding are not supported)")


def check_unsupported(where: str, given: dict, table: dict) -> None:
    """Raise UnsupportedArgumentError naming the arguments of `given` that are in `table`
    with a non-default value; TypeError for names not in `table`."""
    unknown = [k for k in given if k not in table]
    if unknown:
        raise TypeError(f"{where} got unexpected keyword argument(s): {', '.join(unknown)}")
    bad = [f"{k}={v!r}" for k, v in given.items() if not _same(v, table[k])]
    if bad:
        raise UnsupportedArgumentError(
            f"{where}: not supported by powerinfer-cpp: {', '.join(bad)} (leave them at "
            "llama-cpp-python's defaults; see docs/API.md)")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b or (isinstance(a, (list, dict)) and not a)
    try:
        return bool(a == b)
    except Exception:
        return False


class _OwnerLock:
    """A lock held for a whole call or stream. A stream may be finished on another
    thread than the one that started it, so this is a plain Lock plus the owner's id
    (which turns a same-thread re-entry into a clear error instead of a deadlock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self) -> None:
        if self.owner == threading.get_ident():
            raise RuntimeError(
                "this Llama is still busy with an unfinished stream started in this thread; "
                "read it to the end or call its close() first")
        self._lock.acquire()
        self.owner = threading.get_ident()

    def release(self) -> None:
        self.owner = None
        self._lock.release()


class Llama:
    """A model and one context behind llama-cpp-python's `Llama` interface.

    Calls are serialised: one Llama used from several threads runs one completion at a
    time (a stream holds it until it ends or is closed). `n_gpu_layers` != 0 asks for the
    GPU: with a GPU backend built and a GPU visible (the first of the library's registry,
    e.g. "cuda") the model is placed there under the VRAM
    budget placement (all of the device's free memory minus 256 MiB, or `vram_budget`),
    whatever the number; otherwise a RuntimeWarning says so and it runs on the CPU.
    A mixture-of-experts model takes `n_cpu_moe` (the experts of the first N layers stay
    on the CPU, llama.cpp's --n-cpu-moe) and `expert_cache` (device bytes of a cache of
    recently used CPU experts), as `Model` does.
    """

    def __init__(self, model_path: str | os.PathLike, *, n_gpu_layers: int = 0,
                 seed: int = LLAMA_DEFAULT_SEED, n_ctx: int = 512, n_batch: int = 512,
                 n_threads: int | None = None, n_threads_batch: int | None = None,
                 use_mmap: bool = True, last_n_tokens_size: int = 64,
                 chat_format: str | None = None, verbose: bool = True,
                 chat_template: str | None = None, ffn: str = "auto",
                 device: str | None = None, vram_budget: int | str | None = None,
                 embedding: bool = False, pooling_type: int = -1, draft_model=None,
                 draft_max: int | None = None, n_cpu_moe: int = 0,
                 expert_cache: int | str | None = None, **kwargs):
        check_unsupported("Llama()", kwargs, _INIT_UNSUPPORTED)
        # what __getstate__ pickles: a Llama is rebuilt from its arguments, as in llama-cpp-python
        self._init_args = dict(
            model_path=model_path, n_gpu_layers=n_gpu_layers, seed=seed, n_ctx=n_ctx,
            n_batch=n_batch, n_threads=n_threads, n_threads_batch=n_threads_batch,
            use_mmap=use_mmap, last_n_tokens_size=last_n_tokens_size, chat_format=chat_format,
            verbose=verbose, chat_template=chat_template, ffn=ffn, device=device,
            vram_budget=vram_budget, embedding=embedding, pooling_type=pooling_type,
            draft_model=draft_model, draft_max=draft_max, n_cpu_moe=n_cpu_moe,
            expert_cache=expert_cache, **kwargs)
        self._last_logits: np.ndarray | None = None  # of the last eval(), for sample()

        if n_threads_batch is not None and n_threads_batch != n_threads:
            raise UnsupportedArgumentError(
                "Llama(): n_threads_batch must equal n_threads (one thread count is used for "
                "prompts and decoding)")
        if chat_format is not None and chat_format not in _CHAT_FORMATS:
            raise UnsupportedArgumentError(
                f"Llama(): chat_format={chat_format!r} is not supported; use None (the "
                f"file's tokenizer.chat_template), {', '.join(map(repr, _CHAT_FORMATS))}, or "
                "chat_template='<jinja>'")
        # llama.cpp's pooling_type values; -1 (unspecified) = the file's. Every model
        # embeds (embedding=True is accepted and changes nothing)
        pooling_names = {v: k for k, v in F.POOLING_TYPES.items()}
        if pooling_type != -1 and (pooling_type not in pooling_names or pooling_type == 4):
            raise UnsupportedArgumentError(
                f"Llama(): pooling_type={pooling_type!r} is not supported (-1 the file's, 0 "
                "none, 1 mean, 2 cls, 3 last)")
        self._pooling_arg = None if pooling_type == -1 else pooling_names[pooling_type]
        self.verbose = bool(verbose)
        self.model_path = os.fspath(model_path)
        if device is None:
            device = "cpu"
            if n_gpu_layers:
                gpu, why = gpu_device()
                if gpu:
                    device = gpu
                else:
                    warnings.warn(f"n_gpu_layers={n_gpu_layers}: no GPU device ({why}); "
                                  "running on the CPU", RuntimeWarning, stacklevel=2)
        self._seed_rng = random.Random(None if seed in (None, -1, LLAMA_DEFAULT_SEED)
                                       else int(seed))
        self._repeat_last_n = int(last_n_tokens_size)
        self._lock = _OwnerLock()
        self._model = Model(self.model_path, n_ctx=n_ctx, n_threads=n_threads or 0,
                            n_batch=n_batch, ffn=ffn, device=device, vram_budget=vram_budget,
                            load="auto" if use_mmap else "read", n_cpu_moe=n_cpu_moe,
                            expert_cache=expert_cache)
        try:
            self._ctx = self._model.context
            self._draft = _draft_arg(self._model, draft_model, draft_max)
            self._draft_max = draft_max
            if speculative.serves_dense(self._draft, ffn):
                self._ctx.set_ffn_mode("dense")
            if chat_format is not None and chat_template is None:
                chat_template = _CHAT_FORMATS[chat_format]
            self._chat_template_src = chat_template
            self._template: ChatTemplate | None = None
        except BaseException:
            self._model.close()
            raise
        if self.verbose:
            info = self._model.info
            print(f"powerinfer_cpp: loaded {self.model_path} ({info.arch}, "
                  f"{info.n_params / 1e6:.1f}M params, {info.weight_type}, n_ctx "
                  f"{self._ctx.n_ctx}, device {device}) in {self._model.load_time:.2f} s",
                  file=sys.stderr)

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Free the model (after a call in flight on another thread); later use raises."""
        model = getattr(self, "_model", None)
        if model is None:
            return
        if self._lock.owner == threading.get_ident():
            # a stream of this thread is paused (not in native code): it raises when resumed
            self._model = None
            model.close()
            return
        self._lock.acquire()
        try:
            self._model = None
            model.close()
        finally:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if getattr(self, "_model", None) is not None:
                self._model.close()
        except Exception:
            pass

    # -- the parts users reach for -------------------------------------------------------

    @property
    def model(self):
        """The underlying powerinfer_cpp.Model."""
        return self._live()

    @property
    def context(self):
        """The underlying powerinfer_cpp.Context."""
        self._live()
        return self._ctx

    def _live(self):
        if getattr(self, "_model", None) is None:
            raise RuntimeError("this Llama has been closed")
        return self._model

    def n_ctx(self) -> int:
        """The context size in tokens."""
        self._live()
        return self._ctx.n_ctx

    def n_vocab(self) -> int:
        """The vocabulary size."""
        return self._live().n_vocab

    def token_bos(self) -> int:
        """The BOS token id (-1 if none)."""
        b = self._live().tokenizer.bos_id
        return -1 if b is None else b

    def token_eos(self) -> int:
        """The EOS token id."""
        return self._live().eos_id

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of UTF-8 `text` (bytes, as llama-cpp-python takes it); BOS first when
        add_bos and the model has one."""
        if isinstance(text, str):
            raise TypeError("tokenize() takes bytes (text.encode('utf-8')), as llama-cpp-python "
                            "does")
        tok = self._live().tokenizer
        s = bytes(text).decode("utf-8", errors="replace")
        return tok.encode(s, add_bos=bool(add_bos) and tok.bos_id is not None,
                          special=bool(special))

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of `tokens` (special tokens' text only when `special`); prev_tokens is
        accepted for llama-cpp-python's signature and does not change the bytes."""
        tok = self._live().tokenizer
        return b"".join(tok.token_to_bytes(int(t), special=bool(special)) for t in tokens)

    def reset(self) -> None:
        """Forget the cached tokens."""
        def work():
            self._ctx.reset()
            self._last_logits = None

        self._call(work)

    def n_embd(self) -> int:
        """The width of the hidden state."""
        return self._live().info.n_embd

    def token_nl(self) -> int:
        """The newline token: the last token of "\\n" encoded alone (a SentencePiece
        vocabulary puts a space marker first), -1 if none."""
        ids = self._live().tokenizer.encode("\n", add_bos=False)
        return ids[-1] if ids else -1

    def tokenizer(self) -> "LlamaTokenizer":
        """The model's tokenizer behind llama-cpp-python's LlamaTokenizer interface."""
        self._live()
        return LlamaTokenizer(self)

    def set_seed(self, seed: int) -> None:
        """Restart the seeds of the calls that pass none from `seed` (-1: random)."""
        self._seed_rng = random.Random(None if seed in (None, -1, LLAMA_DEFAULT_SEED)
                                       else int(seed))

    def set_cache(self, cache) -> None:
        """None (no cache object) is accepted; the context keeps the longest common prefix
        of its tokens between calls by itself. A LlamaRAMCache / LlamaDiskCache of
        several saved states is not supported."""
        if cache is not None:
            _not_supported("set_cache", _NO_STATE_CACHE)

    # -- tokens in, logits out: llama-cpp-python's low-level loop ----------------------

    @property
    def n_tokens(self) -> int:
        """How many tokens the context holds."""
        self._live()
        return self._ctx.n_past

    @property
    def input_ids(self) -> np.ndarray:
        """The ids of the tokens the context holds (np.intc; exactly n_tokens long, not
        n_ctx as in llama-cpp-python)."""
        self._live()
        return np.asarray(self._ctx.cached_tokens, dtype=np.intc)

    @property
    def eval_tokens(self) -> deque:
        """The tokens the context holds, as a deque."""
        return deque(self.input_ids.tolist(), maxlen=self.n_ctx())

    @property
    def eval_logits(self) -> deque:
        """The logits of the last evaluated token (a deque of one row, as
        llama-cpp-python keeps without logits_all; empty before the first eval)."""
        rows = [] if self._last_logits is None else [self._last_logits.tolist()]
        return deque(rows, maxlen=1)

    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate `tokens` after the ones the context holds (n_tokens grows by their
        number); sample() then picks the next token from the last one's logits."""
        ids = [int(t) for t in tokens]

        def work():
            self._last_logits = self._ctx.eval(ids)

        self._call(work)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
               typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0,
               frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
               tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None,
               grammar=None, idx: int | None = None, *, seed: int | None = None) -> int:
        """A token sampled from the logits of the last eval() (the repeat penalty looks
        at the last last_n_tokens_size tokens the context holds)."""
        check_unsupported("Llama.sample()", dict(
            typical_p=typical_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
            mirostat_eta=mirostat_eta, mirostat_tau=mirostat_tau, grammar=grammar),
            _GEN_UNSUPPORTED)
        if idx is not None and idx != self.n_tokens - 1:
            _not_supported("sample", "idx other than the last token (only its logits are kept)")
        if self._last_logits is None:
            raise RuntimeError("Llama.sample(): call eval() first (there are no logits yet)")
        proc = A.make_logits_processor(self.token_eos(), logits_processor)
        sampler = self._sampler(temp, top_k, top_p, min_p, repeat_penalty, seed)
        history = self.input_ids.tolist()
        for t in A.repeat_window(history, self._repeat_last_n):
            sampler.accept(t)
        logits = self._last_logits
        if proc is not None:
            logits = proc(history, logits.copy())
        return sampler.sample(logits)

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, typical_p: float = 1.0, temp: float = 0.80,
                 repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                 mirostat_eta: float = 0.1, penalize_nl: bool = True, logits_processor=None,
                 stopping_criteria=None, grammar=None, *,
                 seed: int | None = None) -> Iterator[int]:
        """Yield token ids after `tokens`, without end: the caller stops (at token_eos(),
        a count, ...); it also ends when the context is full or a stopping_criteria
        says so. With reset (the default) the context keeps the longest common prefix of
        what it holds and `tokens`; without it `tokens` go after what it holds.
        `send(more_tokens)` evaluates more tokens after the one just yielded."""
        check_unsupported("Llama.generate()", dict(
            typical_p=typical_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
            mirostat_eta=mirostat_eta, mirostat_tau=mirostat_tau, grammar=grammar),
            _GEN_UNSUPPORTED)
        ids = [int(t) for t in tokens]
        if not ids:
            raise ValueError("Llama.generate(): tokens is empty")
        proc = A.make_logits_processor(self.token_eos(), logits_processor)
        crits = A.callables("stopping_criteria", stopping_criteria)
        sampler = self._sampler(temp, top_k, top_p, min_p, repeat_penalty, seed)
        return self._generate(ids, bool(reset), sampler, proc, crits)

    def _generate(self, ids, reset, sampler, proc, crits) -> Iterator[int]:
        if reset:
            # at least the last token is evaluated again: its logits start the reply
            keep = self.longest_token_prefix(self.input_ids.tolist(), ids[:-1])
            self._call(lambda: self._ctx.reset(keep))
            ids = ids[keep:]
        history = self.input_ids.tolist()
        for t in A.repeat_window(history, self._repeat_last_n):
            sampler.accept(t)
        while True:
            if self.n_tokens + len(ids) > self.n_ctx():
                return  # the context is full
            self.eval(ids)
            for t in ids:  # the repeat penalty's window: what the context now holds
                sampler.accept(t)
            history.extend(ids)
            logits = self._last_logits
            if proc is not None:
                logits = proc(history, logits.copy())
            if crits and any(bool(c(np.asarray(history, dtype=np.intc), logits))
                             for c in crits):
                return
            token = sampler.sample(logits)
            more = yield token
            ids = [token] + [int(t) for t in (more or ())]

    def _seed(self, seed) -> int:
        """A call's seed: its own, or (None, -1) the next of the Llama's seed generator."""
        return self._seed_rng.getrandbits(64) if seed is None or seed == -1 else seed

    def _sampler(self, temp, top_k, top_p, min_p, repeat_penalty, seed):
        return Sampler(self.n_vocab(), temperature=temp, top_k=top_k, top_p=top_p,
                       min_p=min_p, repeat_penalty=repeat_penalty,
                       repeat_last_n=self._repeat_last_n, seed=self._seed(seed))

    # -- embeddings (embeddings.py) ------------------------------------------------------

    def _pooling(self) -> str:
        return self._pooling_arg or self._live().pooling

    def pooling_type(self) -> int:
        """llama.cpp's value of the pooling embed() uses (0 none, 1 mean, 2 cls, 3 last):
        Llama(pooling_type=...) or the file's {arch}.pooling_type, mean when it has none."""
        return F.POOLING_TYPES[self._pooling()]

    def embed(self, input, normalize: bool = True, truncate: bool = True,
              return_count: bool = False):
        """Embedding of `input` (a str, or a list of str; token id lists work too): a list
        of n_embd floats per input (one list for a str), or with pooling "none" a list of
        per-token lists. The final hidden states pooled as pooling_type() says; L2-normalised
        unless normalize=False (llama-cpp-python's default is False; OpenAI and llama-server
        normalise). An input longer than the context is cut to it with truncate, else
        raises ValueError. With return_count, (embeddings, total tokens)."""
        m = self._live()
        pooling = self._pooling()
        items, single = E.inputs_list(input)
        n_ctx = self._ctx.n_ctx
        ids = [E.input_ids(m, x, n_ctx, bool(truncate), "input" if single else f"input[{i}]")
               for i, x in enumerate(items)]

        def work():
            self._last_logits = None  # the cache now holds the input: sample() needs an eval()
            return [E.embed_ids(self._ctx, x, pooling, bool(normalize)) for x in ids]

        out = [v.tolist() for v in self._call(work)]
        res = out[0] if single else out
        return (res, sum(len(x) for x in ids)) if return_count else res

    def create_embedding(self, input, model: str | None = None) -> dict:
        """create_embedding: OpenAI's embeddings list of `input` (a str or a list of str),
        normalised vectors."""
        if self._pooling() == "none":
            raise UnsupportedArgumentError(
                "create_embedding(): the pooling is none (one vector per token), which is not "
                "an OpenAI embedding; use embed(), or Llama(pooling_type=1) for mean pooling")
        vecs, n = self.embed(input, return_count=True)
        if isinstance(input, str) or (input and not isinstance(input[0], (str, list, tuple))):
            vecs = [vecs]
        return embedding_response(vecs, model or self.model_path, n)

    # -- saved states ----------------------------------------------------------------

    def save_state(self) -> "LlamaState":
        """The context's state as llama-cpp-python's LlamaState: the token ids it holds,
        the logits of the last eval() (one row, or none), and the KV cache
        (`llama_state`, ContextState.to_bytes()); load_state() restores it into this Llama or
        another of the same model file and cache type."""
        def work():
            st = self._ctx.save_state()
            scores = (np.zeros((0, self.n_vocab()), dtype=np.single) if self._last_logits is None
                      else np.asarray(self._last_logits, dtype=np.single).reshape(1, -1).copy())
            blob = st.to_bytes()
            return LlamaState(np.asarray(st.tokens, dtype=np.intc), scores, st.n_tokens, blob,
                              len(blob), self._init_args["seed"], self._seed_rng.getstate())

        return self._call(work)

    def load_state(self, state: "LlamaState") -> None:
        """Restore a save_state(): the tokens, the logits sample() starts from and the KV
        cache. A state of another model, cache type or a context too small for it, or a
        corrupt one, raises (ValueError or NativeError naming the problem) and changes
        nothing."""
        if not isinstance(state, LlamaState):
            raise TypeError(f"load_state() takes the LlamaState of save_state(), not "
                            f"{type(state).__name__}")
        st = ContextState.from_bytes(state.llama_state)
        if st.tokens != [int(t) for t in np.asarray(state.input_ids).ravel()] or \
                st.n_tokens != state.n_tokens:
            raise ValueError("the LlamaState's input_ids / n_tokens do not match its "
                             "llama_state")
        scores = np.asarray(state.scores, dtype=np.single)
        if scores.size and scores.reshape(-1, scores.shape[-1]).shape[-1] != self.n_vocab():
            raise ValueError(f"the LlamaState's scores have {scores.shape[-1]} columns, this "
                             f"model's vocabulary {self.n_vocab()}")

        def work():
            self._ctx.load_state(st)
            self._last_logits = (scores.reshape(-1, scores.shape[-1])[-1].copy()
                                 if scores.size and st.n_tokens else None)
            if state.rng_state is not None:
                self._seed_rng.setstate(state.rng_state)

        self._call(work)

    # -- what this engine does not do (yet) ----------------------------------------------

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None = None, **kwargs):
        """Not supported: downloading from the Hugging Face Hub."""
        _not_supported("from_pretrained", "this engine does not download models; download the "
                       ".gguf file (e.g. `huggingface-cli download REPO FILE`) and pass its "
                       "path to Llama(...)")

    # -- helpers llama-cpp-python has as static methods ---------------------------------

    @staticmethod
    def logits_to_logprobs(logits, axis: int = -1) -> np.ndarray:
        """log(softmax(logits)) along `axis`, in float32; a row whose largest logit is
        not finite is shifted by 0 instead (no NaN from inf - inf)."""
        x = np.asarray(logits, dtype=np.float32)
        top = np.max(x, axis=axis, keepdims=True)
        top = np.where(np.isfinite(top), top, np.float32(0))
        shifted = x - top
        with np.errstate(divide="ignore"):
            return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))

    @staticmethod
    def longest_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
        """How many leading tokens `a` and `b` share."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    # -- pickling: rebuilt from the constructor's arguments ----------------------------

    def __getstate__(self) -> dict:
        return dict(self._init_args)

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def chat_template(self) -> ChatTemplate:
        """The chat template in use (the file's unless chat_format/chat_template was given)."""
        if self._template is None:
            self._template = ChatTemplate.from_model(self._live(), self._chat_template_src)
        return self._template

    # -- completions ---------------------------------------------------------------------

    def __call__(self, prompt, **kwargs):
        """create_completion."""
        return self.create_completion(prompt, **kwargs)

    # The arguments after prompt/messages are keywords: a positional call raises TypeError
    # instead of binding a value to the wrong name where our order differs from theirs.
    def create_completion(self, prompt: str | Sequence[int], *, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          echo: bool = False, stop: str | list[str] | None = None,
                          repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False,
                          seed: int | None = None, model: str | None = None,
                          stopping_criteria=None, logits_processor=None, logit_bias=None,
                          grammar=None, **kwargs) -> dict | Iterator[dict]:
        """Complete `prompt`: a text_completion dict, or with stream=True an iterator of
        chunks (the last carries finish_reason). `grammar` (a LlamaGrammar, or GBNF text)
        constrains the text to its language (structured.py)."""
        check_unsupported("create_completion()", kwargs, _GEN_UNSUPPORTED)
        constraint = self._constraint(grammar=grammar)
        m = self._live()
        if isinstance(prompt, str):
            ids = m.tokenize(prompt)
            prompt_text = prompt
        elif isinstance(prompt, (bytes, bytearray)):
            raise TypeError("prompt must be a str or a list of token ids, not bytes")
        else:
            ids = [int(t) for t in prompt]
            prompt_text = m.detokenize(ids)
        gen = self._prepare(ids, max_tokens, temperature, top_p, min_p, top_k, repeat_penalty,
                            A.stop_list(stop), seed, stopping_criteria, logits_processor,
                            logit_bias, constraint)
        cid, created, name = new_id("cmpl"), int(time.time()), model or self.model_path
        head = prompt_text if echo else ""
        if stream:
            first = [completion_chunk(cid, created, name, head)] if head else []
            return self._stream_chunks(gen, lambda text, fin: completion_chunk(
                cid, created, name, text, fin), first)
        text, result = self._run(gen)
        return completion_response(cid, created, name, head + text, result.finish_reason,
                                   result)

    def create_chat_completion_openai_v1(self, *args, **kwargs):
        """create_chat_completion, returned as the `openai` package's ChatCompletion (or
        an iterator of ChatCompletionChunk with stream=True)."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError:
            raise ImportError("create_chat_completion_openai_v1() needs the openai package "
                              "(pip install openai)") from None
        out = self.create_chat_completion(*args, **kwargs)
        if kwargs.get("stream"):
            return (ChatCompletionChunk(**chunk) for chunk in out)
        return ChatCompletion(**out)

    def create_chat_completion(self, messages: list[dict], *, temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               stream: bool = False, stop: str | list[str] | None = None,
                               seed: int | None = None, response_format: dict | None = None,
                               max_tokens: int | None = None, repeat_penalty: float = 1.0,
                               model: str | None = None, logits_processor=None,
                               logit_bias=None, grammar=None, tools: list | None = None,
                               tool_choice=None, parallel_tool_calls: bool = True,
                               **kwargs) -> dict | Iterator[dict]:
        """Reply to OpenAI-style `messages` through the chat template: a chat.completion
        dict, or with stream=True an iterator of chat.completion.chunk dicts.
        `response_format` ({"type": "json_object"}, or {"type": "json_schema",
        "json_schema": {"schema": ...}}) or `grammar` (a LlamaGrammar, or GBNF text)
        constrains the reply (structured.py). `tools` / `tool_choice` /
        `parallel_tool_calls` as OpenAI's: a reply that calls tools has message.tool_calls
        and finish_reason "tool_calls" (tools.py: in the template's own call syntax where it
        has one; streamed, as OpenAI's tool-call deltas)."""
        check_unsupported("create_chat_completion()", kwargs, _CHAT_UNSUPPORTED)
        plan = None
        if tools:
            plan = ToolPlan(tools, tool_choice, parallel_tool_calls,
                            template_source=self.chat_template.source)
            messages = plan.messages(normalize_messages(messages))
            if plan.active:
                if grammar is not None or response_format not in (None, {"type": "text"}):
                    raise ValueError("tools cannot be combined with response_format or grammar")
                grammar = LlamaGrammar(plan.grammar(self._live().tokenizer), "tools")
            else:
                plan = None
        elif tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice={tool_choice!r} needs tools")
        constraint = self._constraint(grammar=grammar, response_format=response_format)
        tmpl = self.chat_template
        prompt = tmpl.render(messages, add_generation_prompt=True,
                             **(plan.template_vars() if plan is not None else {}))
        ids = tmpl.tokenize(self._live(), prompt)
        stops = A.stop_list(stop)
        stops += [s for s in tmpl.stop_strings() if s not in stops]
        gen = self._prepare(ids, max_tokens, temperature, top_p, min_p, top_k, repeat_penalty,
                            stops, seed, None, logits_processor, logit_bias, constraint)
        cid, created, name = new_id("chatcmpl"), int(time.time()), model or self.model_path
        if stream:
            first = [chat_chunk(cid, created, name, {"role": "assistant", "content": ""})]
            if plan is None:
                return self._stream_chunks(gen, lambda text, fin: chat_chunk(
                    cid, created, name, {"content": text} if fin is None else {}, fin), first)
            tool_stream = plan.stream()

            def tool_chunk(text, fin):
                if fin is None:
                    delta = tool_stream.feed(text)
                    return None if delta is None else chat_chunk(cid, created, name, delta)
                delta, fin = tool_stream.finish(fin)
                return chat_chunk(cid, created, name, delta, fin)

            return self._stream_chunks(gen, tool_chunk, first)
        text, result = self._run(gen)
        out = chat_response(cid, created, name, text, result.finish_reason, result)
        if plan is not None:
            msg, fin = plan.parse(text, result.finish_reason)
            out["choices"][0].update(message=msg, finish_reason=fin)
        return out

    # -- the shared machinery ------------------------------------------------------------

    def _constraint(self, grammar=None, response_format=None):
        """The compiled grammar a call asks for (None: none); GrammarError (a ValueError)
        naming what is wrong with it."""
        rf = structured.grammar_for_response_format(response_format)
        g = structured.grammar_arg(grammar)
        if rf is not None and g is not None:
            raise ValueError("give response_format or grammar, not both")
        g = rf if g is None else g
        return None if g is None else structured.compile_grammar(self._live(), g)

    def _prepare(self, ids, max_tokens, temperature, top_p, min_p, top_k, repeat_penalty,
                 stops, seed, stopping_criteria, logits_processor, logit_bias,
                 constraint=None):
        """Check everything before the lock is taken; returns the arguments of ctx.stream.
        The constraint's mask applies first, so a logits_processor or stopping_criteria
        still has the last word."""
        n_ctx = self._ctx.n_ctx
        if len(ids) >= n_ctx:
            raise ValueError(f"Requested tokens ({len(ids)}) exceed context window of {n_ctx}")
        kw = A.stream_kwargs(max_tokens, len(ids), n_ctx, temperature=temperature, top_p=top_p,
                             min_p=min_p, top_k=top_k, repeat_penalty=repeat_penalty,
                             seed=seed, repeat_last_n=self._repeat_last_n, stop=stops)
        kw["seed"] = self._seed(seed)  # after max_tokens' check: a refused call draws none
        if self._draft is not None and constraint is None:
            # speculative decoding: the same tokens, sooner (a grammar's matcher only moves
            # forward, so a constrained reply decodes plainly)
            kw.update(draft=self._draft, draft_max=self._draft_max)
        proc = A.make_logits_processor(self._model.eos_id, logits_processor, logit_bias,
                                       stopping_criteria)
        if constraint is not None:
            proc = A.chain_processors(constraint.processor(), proc)
        if proc is not None:
            kw["logits_processor"] = proc
        self._last_logits = None  # the completion changes the cache: sample() needs an eval()
        return ids, kw

    def _call(self, fn):
        self._lock.acquire()
        try:
            self._live()
            return fn()
        finally:
            self._lock.release()

    def _run(self, gen) -> tuple[str, Any]:
        ids, kw = gen

        def work():
            result = Completion("", [], "length", 0)
            for _ in self._ctx.stream(ids, stats=result, **kw):
                pass
            return result

        result = self._call(work)
        self._report(result)
        return result.text, result

    def _stream_chunks(self, gen, make_chunk, first: list[dict]) -> Iterator[dict]:
        ids, kw = gen
        # Arguments are checked now (ctx.stream checks eagerly), the lock taken at the first
        # next(): llama-cpp-python's streams also do nothing until iterated.
        self._ctx.stream(ids, **kw).close()

        def chunks():
            self._lock.acquire()
            try:
                self._live()
                result = Completion("", [], "length", 0)
                pieces = self._ctx.stream(ids, stats=result, **kw)
                try:
                    yield from first
                    for piece in pieces:
                        chunk = make_chunk(piece, None)
                        if chunk is not None:  # None: held back (may be a tool call)
                            yield chunk
                finally:
                    pieces.close()
                yield make_chunk("", result.finish_reason)
                self._report(result)
            finally:
                self._lock.release()

        return chunks()

    def _report(self, result) -> None:
        if self.verbose:
            t = result.timings
            print(f"powerinfer_cpp: prompt {t.get('prompt_tokens', 0)} tokens "
                  f"({getattr(result, 'n_cached_tokens', 0)} cached) in "
                  f"{t.get('prompt_s', 0) * 1e3:.1f} ms, decode {t.get('decode_tokens', 0)} "
                  f"tokens at {t.get('decode_tok_per_s', 0):.1f} tokens/s", file=sys.stderr)


class LlamaState:
    """A Llama's saved state (Llama.save_state), with llama-cpp-python's fields:
    input_ids (np.intc, the tokens the context holds), scores (the last eval()'s logits,
    [1, n_vocab], or [0, n_vocab] when there are none), n_tokens, llama_state (bytes: the
    KV cache, ContextState.to_bytes()), llama_state_size and seed; rng_state: the state of
    the generator that seeds calls passing no seed."""

    def __init__(self, input_ids, scores, n_tokens: int, llama_state: bytes,
                 llama_state_size: int, seed: int, rng_state=None):
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed
        self.rng_state = rng_state


class LlamaTokenizer:
    """llama-cpp-python's LlamaTokenizer over a Llama: encode/decode on str,
    tokenize/detokenize on bytes."""

    def __init__(self, llama: Llama):
        self.llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        return self.llama.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos,
                             special=special)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")
