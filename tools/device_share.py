"""How much of the FFN work a device would take at given VRAM budgets.

    PYTHONPATH=python python tools/device_share.py MODEL.gguf --budgets 0.8G,1.2G,2G \
        [--device host-device] [--tokens 64] [--text FILE]

For each budget it loads the sparse model on the device (default: the simulated
`host-device`, so this runs on any machine; `--device cuda` on a GPU machine), decodes
`--tokens` tokens of held-out text one at a time in sparse mode, and prints what the
runtime placed (dense parts, hot neurons) and the share of the active neurons it computed
on the device — the figure PowerInfer reports as the GPU's share of the neuron load. The
numbers are counts, not times, so they do not depend on the device's speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "models" / "tiny-relu-kjv" / "heldout.txt"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--budgets", required=True, help="comma-separated sizes, e.g. 0.8G,1.2G")
    ap.add_argument("--device", default="host-device")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--text", default=str(DEFAULT_TEXT),
                    help="text to decode; the last part is used (default: the shipped held-out text)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from powerinfer_cpp import Model, parse_size

    budgets = [parse_size(b.strip(), "budget") for b in args.budgets.split(",") if b.strip()]
    text = Path(args.text).read_text(encoding="utf-8")
    mib = 1 << 20
    print("| budget MiB | dense MiB (attention layers / predictors / head) | hot neurons | hot MiB "
          "| index | active neurons on the device |")
    print("|---|---|---|---|---|---|")
    for b in budgets:
        with Model(args.model, device=args.device, vram_budget=b, ffn="sparse") as m:
            toks = m.tokenize(text)[-args.tokens:]
            info = m.device_info()
            ctx = m.create_context(n_ctx=args.tokens + 8, n_threads=args.threads)
            for t in toks:
                ctx.eval([t])
            dv = ctx.stats()["device"]
            print(f"| {b / mib:.0f} | {info['dense_bytes'] / mib:.0f} ({info['attention_layers']} / "
                  f"{info['predictor_layers']} / {'yes' if info['head_on_device'] else 'no'}) | "
                  f"{info['n_hot']} ({info['hot_share']:.1%}) | {info['hot_bytes'] / mib:.0f} | "
                  f"{info['index_source']} | {dv['device_share']:.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
