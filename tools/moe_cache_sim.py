"""When does a static expert placement, a run-time expert cache, or both win? A simulated
device over a real selection trace.

    python tools/moe_cache_sim.py MOE.gguf --text FILE [--profile-tokens 2048] [--tokens 512]
        [--slots 4,8,16] [--pcie 25e9] [--dev-bw 2e12] [--cpu-bw 50e9]

1. Profile: the expert frequencies over the first --profile-tokens tokens of the text
   (sparse/experts.py profile_experts, the CPU runtime's selection counts).
2. Trace: the experts each of the next --tokens tokens chose in each layer, decoding one
   token at a time (selection_trace) — held out from the profile.
3. For device room of S experts (each --slots value), replay a decode over the trace
   (replay_cache, the runtime's rule): the static plan (the S most frequent experts), an
   LRU cache of S experts (the runtime's), an LFU cache, and static + LRU splits.
4. Cost per token, per layer as the runtime overlaps them (moe.c: the cache's uploads are
   synchronous and come first, then the device's experts run while the CPU's do):
       t = sum_layers  uploads * B / pcie  +  max(dev_runs * B / dev_bw, cpu_runs * B / cpu_bw)
   with B the bytes of one expert. Attention, routers and head are the same in every
   configuration and left out; so is the device's per-call latency.
5. A model with a shared expert (qwen2moe; S bytes a layer, every token runs it): each
   room and configuration twice, the shared experts on the CPU (the room all to routed
   experts) and on the device (the runtime's order: they take their bytes of the room
   first, layer by layer while they fit, the routed experts the rest); S joins the side
   it runs on,
       t = sum_layers  uploads * B / pcie  +  max(dev_runs * B (+ S) / dev_bw, cpu_runs * B (+ S) / cpu_bw)
   and the table adds the bytes each side reads per token and the bytes uploaded.

Defaults: PCIe 4.0 x16 at ~25 GB/s effective, a device reading its memory at ~2 TB/s
(an H100's HBM3 less overhead) and a desktop CPU reading ~50 GB/s. Prints a Markdown table.
The expert bytes B are the file's; the tiny random test models' routing is not a real
model's: their numbers show the mechanics, not what to expect from Qwen3-30B-A3B.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.sparse.experts import profile_experts, replay_cache, selection_trace  # noqa: E402


def side_bytes(rep, b: float, sh: float = 0.0, sh_dev=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes per token and layer [n_tokens, n_layer] the device reads, the CPU reads and
    the link uploads; a shared expert of sh bytes in every layer, on the device in the
    layers where sh_dev [n_layer] is True, else on the CPU."""
    pt = rep.per_token.astype(np.float64)
    on = np.zeros(pt.shape[1], dtype=bool) if sh_dev is None else np.asarray(sh_dev, dtype=bool)
    return pt[:, :, 0] * b + sh * on, pt[:, :, 1] * b + sh * ~on, pt[:, :, 2] * b


def cost(rep, b: float, pcie: float, dev_bw: float, cpu_bw: float, sh: float = 0.0, sh_dev=None) -> float:
    """Seconds per token of the experts, uploads first (the runtime's rule; module doc)."""
    dev, cpu, up = side_bytes(rep, b, sh, sh_dev)
    t = up / pcie + np.maximum(dev / dev_bw, cpu / cpu_bw)
    return float(t.sum(axis=1).mean())


def cost_overlapped(rep, b: float, pcie: float, dev_bw: float, cpu_bw: float, sh: float = 0.0,
                    sh_dev=None) -> float:
    """The same if a miss ran on the CPU while its upload went on beside it (for the next
    use): per layer max(device, CPU with the misses, uploads over PCIe). Not what the
    runtime does today; it says what an asynchronous refill would buy."""
    dev, cpu, up = side_bytes(rep, b, sh, sh_dev)
    t = np.maximum(np.maximum((dev - up) / dev_bw, (cpu + up) / cpu_bw), up / pcie)
    return float(t.sum(axis=1).mean())


def static_plan(freq: np.ndarray, n: int) -> np.ndarray:
    """The n most frequent experts (ties: lower layer, lower id; the runtime's greedy
    order, optimal when every expert has the same size)."""
    order = sorted(((-freq[l, e], l, e) for l in range(freq.shape[0]) for e in range(freq.shape[1])))
    on = np.zeros(freq.shape, dtype=bool)
    for _, l, e in order[:n]:
        on[l, e] = True
    return on


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--text", required=True, help="calibration / evaluation text (UTF-8)")
    ap.add_argument("--profile-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=512, help="held-out tokens to trace")
    ap.add_argument("--slots", default="4,8,16", help="device room in experts, comma-separated")
    ap.add_argument("--n-ctx", type=int, default=128, help="window of the profile and trace")
    ap.add_argument("--pcie", type=float, default=25e9, help="bytes/s host -> device")
    ap.add_argument("--dev-bw", type=float, default=2e12, help="device memory bytes/s")
    ap.add_argument("--cpu-bw", type=float, default=50e9, help="CPU memory bytes/s")
    a = ap.parse_args(argv)

    with Model(a.model, n_ctx=a.n_ctx) as m:
        ids = m.tokenize(open(a.text, encoding="utf-8").read())
        info = m.info
    need = a.profile_tokens + a.tokens
    if len(ids) < need:
        ap.error(f"the text holds {len(ids)} tokens, fewer than --profile-tokens + --tokens = {need}")
    freq, _ = profile_experts(a.model, ids[:a.profile_tokens], n_ctx=a.n_ctx)
    trace = selection_trace(a.model, ids[a.profile_tokens:need], n_ctx=a.n_ctx)
    with Model(a.model, device="host-device") as m:
        ex = m.device_info()["experts"]
        b = ex["bytes"] / max(ex["device"], 1)
        sh = ex["shared_bytes"] / ex["shared_device"] if ex["shared_device"] else 0.0
    if sh:
        return shared_tables(a, info, freq, trace, b, sh)
    n_all = info.n_layer * info.n_expert
    # skew of the routing: the share of selections the top 10% of experts take
    top = np.sort(freq.ravel())[::-1]
    print(f"model {os.path.basename(a.model)}: {info.n_layer} layers x {info.n_expert} experts, top-"
          f"{info.n_expert_used}, one expert {b / 1024:.1f} KiB; profile {a.profile_tokens} tokens, "
          f"trace {a.tokens} held-out tokens; top 10% of experts take "
          f"{top[:max(1, n_all // 10)].sum() / top.sum():.1%} of the selections")
    print(f"cost model: PCIe {a.pcie / 1e9:g} GB/s, device {a.dev_bw / 1e9:g} GB/s, CPU "
          f"{a.cpu_bw / 1e9:g} GB/s\n")
    cpu = replay_cache(trace, None, 0)
    t_cpu = cost(cpu, b, a.pcie, a.dev_bw, a.cpu_bw)
    print("| room (experts) | configuration | device share of expert runs | cache hit rate | "
          "uploads / token | simulated µs / token | vs CPU | with overlapped refills |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| 0 | CPU only | 0.0% | - | 0 | {t_cpu * 1e6:.2f} | 1.00x | 1.00x |")
    for s in (int(v) for v in a.slots.split(",")):
        s = min(s, n_all)
        configs = [("static (most frequent)", static_plan(freq, s), 0, "lru"),
                   ("LRU cache", None, s, "lru"), ("LFU cache", None, s, "lfu")]
        for share in (0.5, 0.75):
            k = int(round(s * share))
            if 0 < k < s:
                configs.append((f"static {k} + LRU {s - k}", static_plan(freq, k), s - k, "lru"))
        for name, on, slots, pol in configs:
            r = replay_cache(trace, on, slots, pol)
            t = cost(r, b, a.pcie, a.dev_bw, a.cpu_bw)
            t2 = cost_overlapped(r, b, a.pcie, a.dev_bw, a.cpu_bw)
            runs = r.runs_device + r.runs_cpu
            hit = f"{r.hit_rate:.1%}" if slots else "-"
            print(f"| {s} | {name} | {r.runs_device / runs:.1%} | {hit} | "
                  f"{r.uploads / len(trace):.2f} | {t * 1e6:.2f} | {t_cpu / t:.2f}x | {t_cpu / t2:.2f}x |")
    return 0


def shared_tables(a, info, freq, trace, b: float, sh: float) -> int:
    """Step 5 of the module doc: every configuration with the shared experts on the CPU and
    on the device, and the bytes each side reads per token."""
    nl, n_all = info.n_layer, info.n_layer * info.n_expert
    print(f"model {os.path.basename(a.model)}: {nl} layers x {info.n_expert} experts, top-"
          f"{info.n_expert_used}, one expert {b / 1024:.1f} KiB, a shared expert {sh / 1024:.1f} KiB "
          f"({sh / b:.2f} experts) a layer; profile {a.profile_tokens} tokens, trace {a.tokens} "
          f"held-out tokens")
    print(f"cost model: PCIe {a.pcie / 1e9:g} GB/s, device {a.dev_bw / 1e9:g} GB/s, CPU "
          f"{a.cpu_bw / 1e9:g} GB/s\n")
    print("| room (experts) | shared experts | configuration | routed runs on the device | cache hit rate | "
          "CPU KiB / token | device KiB / token | uploaded KiB / token | simulated µs / token | vs CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cpu = replay_cache(trace, None, 0)
    t_cpu = cost(cpu, b, a.pcie, a.dev_bw, a.cpu_bw, sh)

    def row(room, where, name, r, slots, sh_dev):
        dev, cpu_b, up = (v.sum(axis=1).mean() / 1024 for v in side_bytes(r, b, sh, sh_dev))
        t = cost(r, b, a.pcie, a.dev_bw, a.cpu_bw, sh, sh_dev)
        runs = r.runs_device + r.runs_cpu
        hit = f"{r.hit_rate:.1%}" if slots else "-"
        print(f"| {room} | {where} | {name} | {r.runs_device / runs:.1%} | {hit} | {cpu_b:.1f} | "
              f"{dev:.1f} | {up:.1f} | {t * 1e6:.2f} | {t_cpu / t:.2f}x |")

    row(0, "CPU", "CPU only", cpu, 0, None)
    for room in (int(v) for v in a.slots.split(",")):
        room_bytes = room * b
        k = min(nl, int(room_bytes // sh))  # layers whose shared expert fits, in layer order
        for where, sh_dev, left in (("CPU", None, room), (f"device ({k}/{nl} layers)", np.arange(nl) < k,
                                                          int((room_bytes - k * sh) // b))):
            left = min(left, n_all)
            configs = [("static (most frequent)", static_plan(freq, left), 0),
                       ("LRU cache", None, left)] if left > 0 else [("no room left for routed experts", None, 0)]
            for name, on, slots in configs:
                label = f"{name}, {left} experts" if left > 0 else name
                row(room, where, label, replay_cache(trace, on, slots), slots, sh_dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
