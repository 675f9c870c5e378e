"""Structured output: token-level constrained sampling with llguidance.

A request's `response_format` ({"type": "json_object"}, {"type": "json_schema",
"json_schema": {"schema": ...}}) or `grammar` (llama.cpp's GBNF, or Lark) becomes an
llguidance grammar. Each generation gets its own matcher: before every token it gives the
mask of the tokens that keep the reply a prefix of the grammar's language, and the logits
of all others are set to -inf before sampling; once the grammar is complete only EOS is
left. So a finished reply is in the language whatever the model (one cut by max_tokens is
a prefix of it).

Why llguidance (the library llama.cpp uses), not xgrammar or outlines-core: measured on
SmolLM2's 49,152-token vocabulary (tools/bench_constrained.py, docs/BENCHMARKS.md
"Constrained decoding") the mask costs 0.005-0.017 ms per token (median; xgrammar
0.006-0.013, outlines-core 0.003-0.060), a schema compiles in 1-10 ms (xgrammar ~30 ms,
outlines-core 5-23 s: it indexes the whole vocabulary per schema), it reads llama.cpp's
GBNF grammars as well as JSON schemas and Lark, and it needs nothing else (xgrammar
requires torch, transformers and triton). Per token the processor below costs ~0.2 ms in
all (mask, numpy, advance): a few percent of a 135M model's decode step, less for bigger
models. It is an optional dependency (the `structured` extra); without it a request for
structured output is refused with the install line.

The vocabulary handed to the library is the model's own tokenizer's (tokenizer.py): each
id's exact bytes, special tokens marked, and its encoder for the library's
canonical-tokenization checks. JSON is generated compact (no whitespace between tokens)
unless the schema's "x-guidance" says otherwise: a model cannot then spend its tokens on
whitespace, and the text is what json.loads reads either way.
"""

from __future__ import annotations

import collections
import json
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["GrammarError", "StructuredOutputUnavailable", "LlamaGrammar", "available",
           "grammar_for_response_format", "json_schema_grammar", "text_grammar",
           "grammar_arg", "compile_grammar", "Constraint"]

INSTALL = "pip install 'powerinfer-cpp[structured]' (or: pip install llguidance)"
# llguidance's JSON options applied before the schema's own "x-guidance" ones
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema, grammar or response_format that cannot be used; the message names why."""


class StructuredOutputUnavailable(RuntimeError):
    """Structured output was asked for but llguidance is not installed."""


def _llg():
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputUnavailable(
            f"structured output (response_format, grammar) needs the llguidance package: "
            f"{INSTALL}") from None
    return llguidance


def available() -> tuple[bool, str]:
    """(True, "") when structured output can run here, else (False, why)."""
    try:
        _llg()
    except StructuredOutputUnavailable as e:
        return False, str(e)
    return True, ""


# -- grammars from what a request says --------------------------------------------------


def json_schema_grammar(schema: Any, where: str = "schema") -> str:
    """The llguidance grammar of a JSON schema (a dict, or True for any JSON value)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON schema object, not "
                           f"{type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{where} is not JSON: {e}") from None
    try:
        return _llg().LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    except ValueError as e:
        raise GrammarError(f"{where}: {e}") from None


def text_grammar(text: str, where: str = "grammar") -> str:
    """The llguidance grammar of a GBNF (llama.cpp's grammars) or Lark grammar."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{where} must be a non-empty string (GBNF or Lark)")
    llg = _llg()
    try:
        return llg.grammar_from("grammar", text)
    except Exception as e:  # the GBNF converter raises whatever it meets
        raise GrammarError(f"{where}: {e}") from None


def grammar_for_response_format(rf: Any, where: str = "response_format") -> str | None:
    """The llguidance grammar an OpenAI response_format asks for; None for plain text.

    {"type": "text"}; {"type": "json_object"} (a JSON object; llama-server's extra "schema"
    key constrains it further); {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise GrammarError(f"{where} must be an object like {{\"type\": \"json_object\"}}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema", {"type": "object"})
        return json_schema_grammar(schema, f"{where}.schema")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarError(f"{where}.json_schema must be an object with a \"schema\"")
        if "schema" not in js:
            raise GrammarError(f"{where}.json_schema.schema is missing")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError(f"{where}.json_schema.name must be a string")
        return json_schema_grammar(js["schema"], f"{where}.json_schema.schema")
    raise GrammarError(f"{where}.type must be one of text, json_object, json_schema; got "
                       f"{kind!r}")


class LlamaGrammar:
    """A grammar for Llama's `grammar=` argument, made as llama-cpp-python's LlamaGrammar
    is: from_string (GBNF, or Lark), from_json_schema, from_file."""

    def __init__(self, grammar: str, source: str = ""):
        self.grammar = grammar   # the llguidance grammar
        self.source = source     # what it was made from

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        return cls(text_grammar(grammar), grammar)

    @classmethod
    def from_file(cls, file: str, verbose: bool = True) -> "LlamaGrammar":
        with open(file, encoding="utf-8") as f:
            return cls.from_string(f.read())

    @classmethod
    def from_json_schema(cls, json_schema: str | dict, verbose: bool = True) -> "LlamaGrammar":
        schema = json_schema
        if isinstance(json_schema, str):
            try:
                schema = json.loads(json_schema)
            except ValueError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        return cls(json_schema_grammar(schema, "json_schema"), json.dumps(schema))

    def __repr__(self) -> str:
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"LlamaGrammar({src!r})"


def grammar_arg(grammar: Any, where: str = "grammar") -> str | None:
    """The llguidance grammar of a `grammar` argument: None, a LlamaGrammar, or the
    text of a GBNF / Lark grammar."""
    if grammar is None:
        return None
    if isinstance(grammar, LlamaGrammar):
        return grammar.grammar
    if isinstance(grammar, str):
        return text_grammar(grammar, where)
    raise GrammarError(f"{where} must be a LlamaGrammar or the text of a GBNF grammar, not "
                       f"{type(grammar).__name__}")


# -- the vocabulary and compiled grammars, per model -------------------------------------


class _Encoder:
    """What llguidance's TokenizerWrapper reads: the vocabulary as bytes, the special ids,
    EOS, and an encoder (str -> ids, no BOS) for its canonical-tokenization checks."""

    def __init__(self, tok, n_vocab: int, eos: list[int]):
        self._tok = tok
        self.eos_token_id = eos[0]
        self.bos_token_id = tok.bos_id
        n_tok = tok.n_vocab
        # ids past the tokenizer's (padding rows of the embedding) stand for no text
        self.tokens = [tok.token_to_bytes(i, special=True) if i < n_tok else b""
                       for i in range(n_vocab)]
        self.special_token_ids = [i for i in range(min(n_tok, n_vocab)) if tok.is_special(i)]

    def __call__(self, s):
        if isinstance(s, (bytes, bytearray)):
            s = bytes(s).decode("utf-8", errors="replace")
        return self._tok.encode(s, add_bos=False, special=False)


def ll_tokenizer_from(tok, n_vocab: int, eos: list[int]):
    """An llguidance tokenizer of a powerinfer_cpp Tokenizer with n_vocab logits."""
    llg = _llg()
    return llg.LLTokenizer(llg.TokenizerWrapper(_Encoder(tok, n_vocab, eos)), n_vocab=n_vocab,
                           eos_token=list(eos))


_MODELS: "weakref.WeakKeyDictionary[Any, _ModelGrammars]" = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()


class _ModelGrammars:
    """One model's llguidance tokenizer (built once: ~0.1-1 s for a large vocabulary) and
    its recently compiled grammars (a matcher in its start state per grammar, copied for
    each generation)."""

    CACHE = 32

    def __init__(self, model):
        self.n_vocab = model.n_vocab
        self.eos = [model.eos_id]
        self.tok = ll_tokenizer_from(model.tokenizer, self.n_vocab, self.eos)
        self.lock = threading.Lock()
        self.cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def matcher(self, grammar: str):
        with self.lock:
            m = self.cache.get(grammar)
            if m is not None:
                self.cache.move_to_end(grammar)
                return m.deep_copy()
        m = _llg().LLMatcher(self.tok, grammar, log_level=0)  # drops the GIL while it builds
        if m.is_error():
            raise GrammarError(f"the grammar cannot be used: {m.get_error()}")
        with self.lock:
            self.cache[grammar] = m
            while len(self.cache) > self.CACHE:
                self.cache.popitem(last=False)
            return m.deep_copy()


def _grammars(model) -> _ModelGrammars:
    with _MODELS_LOCK:
        g = _MODELS.get(model)
    if g is None:
        g = _ModelGrammars(model)  # outside the lock: slow, and racing builds are equal
        with _MODELS_LOCK:
            g = _MODELS.setdefault(model, g)
    return g


def compile_grammar(model, grammar: str) -> "Constraint":
    """A grammar checked against the model's vocabulary (GrammarError if it cannot be
    used), ready to constrain generations."""
    g = _grammars(model)
    g.matcher(grammar)  # compiles (and caches) it, or raises
    return Constraint(g, grammar)


class Constraint:
    """A compiled grammar for one model. processor() gives a fresh logits processor for
    one generation (Context.stream's logits_processor); each generation, each slot of a
    server, has its own."""

    def __init__(self, grammars: _ModelGrammars, grammar: str):
        self._g, self.grammar = grammars, grammar

    def processor(self) -> "GrammarProcessor":
        return GrammarProcessor(self._g.matcher(self.grammar), self._g.n_vocab)


class GrammarProcessor:
    """(input_ids, logits) -> logits: advances the matcher over the tokens sampled since
    the last call (the first call sees the prompt and only remembers its length), then
    sets the logits of the tokens the grammar does not allow next to -inf."""

    def __init__(self, matcher, n_vocab: int):
        self._m = matcher
        self._n_vocab = n_vocab
        self._seen: int | None = None
        self._mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def __call__(self, input_ids, logits):
        n = len(input_ids)
        if self._seen is None:
            self._seen = n
        elif n > self._seen:
            new = [int(t) for t in input_ids[self._seen:n]]
            self._seen = n
            if not self._m.consume_tokens(new):
                raise RuntimeError(f"constrained decoding: token(s) {new} do not follow the "
                                   f"grammar: {self._m.get_error()}")
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self._m.is_error():
            raise RuntimeError(f"constrained decoding failed: {self._m.get_error()}")
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little",
                                count=self._n_vocab).view(bool)
        return np.where(allowed, np.asarray(logits, dtype=np.float32), np.float32(-np.inf))

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar."""
        return self._m.is_accepting()
