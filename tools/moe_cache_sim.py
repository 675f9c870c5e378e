"""When does a static expert placement, a run-time expert cache, or both win? A simulated
device over a real selection trace.

    python tools/moe_cache_sim.py MOE.gguf --text FILE [--profile-tokens 2048] [--tokens 512]
        [--slots 4,8,16] [--pcie 25e9] [--dev-bw 2e12] [--cpu-bw 50e9] [--per-layer]
        [--configs static,lru,lfu,split] [--route-on DENSE.gguf]

1. Profile: the expert frequencies over the first --profile-tokens tokens of the text
   (sparse/experts.py profile_experts, the CPU runtime's selection counts).
2. Trace: the experts each of the next --tokens tokens chose in each layer, decoding one
   token at a time (selection_trace) — held out from the profile.
3. For device room of S experts (each --slots value), replay a decode over the trace
   (replay_cache, the runtime's rule): the static plan (the S most frequent experts), an
   LRU cache of S experts (the runtime's), an LFU cache, and static + LRU splits (--configs
   picks among them); --per-layer adds an LRU with S / n_layer slots per layer (not the
   runtime's rule: what a per-layer share would keep), with the layers' spread of hit rates.
   --route-on DENSE.gguf takes the choices from the model's routers over DENSE's FFN inputs
   (routed_on; for a tools/moefy.py file, whose own hidden states drift from the dense
   model's when top-k drops much of the FFN) instead of steps 1-2's runs of the MoE.
   The header gives the routing's skew (the top 10% of experts' share of the selections)
   and temporal locality (the share of choices the previous token made too).
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
model's: their numbers show the mechanics, not what to expect from Qwen3-30B-A3B. A MoE
with routing fitted to a real model's activations: tools/moefy.py (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.sparse.experts import CacheReplay, profile_experts, replay_cache, selection_trace  # noqa: E402


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


def replay_per_layer(trace: np.ndarray, per_layer: int) -> tuple[CacheReplay, np.ndarray]:
    """replay_cache's LRU rule with the slots split evenly between the layers: each layer
    replayed alone with per_layer slots of its own. Not what the runtime does (its slots
    are shared by all layers); it says what a per-layer share would keep. Returns the
    replay and each layer's hit rate."""
    n_tok, n_layer, _ = trace.shape
    r = CacheReplay(per_token=np.zeros((n_tok, n_layer, 3), dtype=np.int64))
    rates = np.zeros(n_layer)
    for l in range(n_layer):
        one = replay_cache(trace[:, l:l + 1], None, per_layer)
        r.per_token[:, l] = one.per_token[:, 0]
        for f in ("runs_device", "runs_cpu", "hits", "misses", "uploads"):
            setattr(r, f, getattr(r, f) + getattr(one, f))
        rates[l] = one.hit_rate
    return r, rates


def locality(trace: np.ndarray) -> float:
    """The share of a token's expert choices (after the first token) that the previous token
    made in the same layer: the temporal locality an LRU cache lives on."""
    both = (trace[1:] & trace[:-1]).sum()
    return float(both / max(trace[1:].sum(), 1))


def routed_on(moe: str, hidden: str, tokens, n_ctx: int) -> np.ndarray:
    """bool [n_tokens, n_layer, n_expert]: the top k of moe's routers (ffn_gate_inp, its
    bias if any; k its expert_used_count) over the FFN inputs of the model ``hidden``
    (the runtime's profile of that file, windows of n_ctx tokens). With hidden the dense
    model a MoE was made from (tools/moefy.py), these are the choices its routers make on
    the dense model's hidden states: what a MoE that routes so without losing quality
    would choose."""
    import gguf

    from powerinfer_cpp.sparse.profile import profile_model

    r = gguf.GGUFReader(moe)
    arch = str(r.fields["general.architecture"].contents())
    k = int(r.fields[f"{arch}.expert_used_count"].contents())
    t = {x.name: x for x in r.tensors}
    prof = profile_model(hidden, list(tokens), n_ctx=n_ctx, progress=False)
    n_expert = int(t["blk.0.ffn_gate_inp.weight"].shape[1])
    out = np.zeros((prof.n_tokens, prof.n_layer, n_expert), dtype=bool)
    for l in range(prof.n_layer):
        w = t.get(f"blk.{l}.ffn_gate_inp.weight")
        if w is None:
            raise ValueError(f"{moe}: no router blk.{l}.ffn_gate_inp.weight for layer {l} of {hidden}")
        s = prof.x[l].astype(np.float64) @ np.asarray(w.data, np.float64).reshape(n_expert, -1).T
        if f"blk.{l}.ffn_gate_inp.bias" in t:
            s += np.asarray(t[f"blk.{l}.ffn_gate_inp.bias"].data, np.float64).reshape(-1)
        np.put_along_axis(out[:, l], np.argsort(-s, axis=1, kind="stable")[:, :k], True, 1)
    return out


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
    ap.add_argument("--route-on", metavar="GGUF",
                    help="route by the model's routers over this file's FFN inputs (the dense model "
                         "a MoEfied file was made from) instead of running the MoE itself")
    ap.add_argument("--per-layer", action="store_true",
                    help="also an LRU cache with the room split evenly between the layers")
    ap.add_argument("--configs", default="static,lru,lfu,split",
                    help="which of the runtime-rule configurations to replay (static, lru, lfu, split)")
    a = ap.parse_args(argv)

    with Model(a.model, n_ctx=a.n_ctx) as m:
        ids = m.tokenize(open(a.text, encoding="utf-8").read())
        info = m.info
    need = a.profile_tokens + a.tokens
    if len(ids) < need:
        ap.error(f"the text holds {len(ids)} tokens, fewer than --profile-tokens + --tokens = {need}")
    if a.route_on:
        freq = routed_on(a.model, a.route_on, ids[:a.profile_tokens], a.n_ctx).mean(axis=0)
        trace = routed_on(a.model, a.route_on, ids[a.profile_tokens:need], a.n_ctx)
    else:
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
          f"{top[:max(1, n_all // 10)].sum() / top.sum():.1%} of the selections; "
          f"{locality(trace):.1%} of a token's choices repeat the previous token's (a uniform random "
          f"router: {info.n_expert_used / info.n_expert:.1%})")
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
        want = set(a.configs.split(","))
        configs = [c for c, w in ((("static (most frequent)", static_plan(freq, s), 0, "lru"), "static"),
                                  (("LRU cache", None, s, "lru"), "lru"), (("LFU cache", None, s, "lfu"), "lfu"))
                   if w in want]
        for share in (0.5, 0.75) if "split" in want else ():
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
        if a.per_layer and s // info.n_layer > 0:
            pl = s // info.n_layer
            r, by_layer = replay_per_layer(trace, pl)
            t = cost(r, b, a.pcie, a.dev_bw, a.cpu_bw)
            t2 = cost_overlapped(r, b, a.pcie, a.dev_bw, a.cpu_bw)
            runs = r.runs_device + r.runs_cpu
            print(f"| {s} | per-layer LRU, {pl} a layer | {r.runs_device / runs:.1%} | {r.hit_rate:.1%} "
                  f"(layers {by_layer.min():.0%}-{by_layer.max():.0%}) | {r.uploads / len(trace):.2f} | "
                  f"{t * 1e6:.2f} | {t_cpu / t:.2f}x | {t_cpu / t2:.2f}x |")
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
