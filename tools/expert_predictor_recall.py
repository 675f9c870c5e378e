"""The predictors per expert of a sparse-experts file (convert --sparse --expert-predictors)
on text: their recall, and the FFN bytes per token of each FFN mode.

    python tools/expert_predictor_recall.py MOE-SPARSE.gguf --text FILE [--start 2000] [--tokens 200]

Decodes --tokens tokens of the text from --start, one at a time, in the dense, gate, oracle
and sparse modes. Recall = the sparse mode's up rows (a predicted neuron whose gate is
nonzero) over the oracle mode's (every nonzero gate). Counts from the runtime's statistics;
nothing is timed. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from powerinfer_cpp import Model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--text", required=True)
    ap.add_argument("--start", type=int, default=2000, help="first token of the text decoded")
    ap.add_argument("--tokens", type=int, default=200)
    a = ap.parse_args(argv)
    with Model(a.model) as m:
        toks = m.tokenize(open(a.text, encoding="utf-8").read())[a.start:a.start + a.tokens]
        if not toks:
            ap.error(f"the text has no tokens past --start {a.start}")
        st = {}
        for mode in ("dense", "gate", "oracle", "sparse"):
            ctx = m.create_context(n_ctx=len(toks), cache_type="f32", ffn=mode)
            for t in toks:
                ctx.eval([t])
            st[mode] = ctx.stats()
    n = len(toks)
    print(f"{os.path.basename(a.model)}: {n} tokens from {a.start}; recall "
          f"{st['sparse']['n_up_rows'] / st['oracle']['n_up_rows']:.3f}\n")
    print("| mode | FFN KiB / token | predictor KiB / token | up rows / token |")
    print("|---|---|---|---|")
    for mode, s in st.items():
        b = s["bytes"]
        print(f"| {mode} | {b['ffn'] / n / 1024:.1f} | {b.get('predictor', 0) / n / 1024:.1f} | "
              f"{s['n_up_rows'] / n:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
