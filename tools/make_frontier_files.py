#!/usr/bin/env python3
"""Sparse files of one GGUF model at several levels of every training-free method that
exists (not a test): the inputs of tools/eval_sparsity.py's frontier.

One calibration per method, reused across its levels (a file per level is a copy whose
thresholds are patched in place, as sparse/gate_eval.py and input_eval.py do):

    gate-{uniform,greedy}-S.gguf   gate-magnitude FFN sparsity S (greedy: per-layer levels
                                   from each layer's measured KL, --greedy-tokens)
    input-{magnitude,wina}-S.gguf  the attention's and head's inputs at S, refit in the sparse
                                   mode; the FFN runs the gate mode at 0 (every neuron)
    auto-P.gguf                    convert's quality budget P with --input-sparsity auto
    sites-C-uniform-S.gguf         TEAL on every projection: attention, head and the FFN's
                                   inputs (gate/up's and down's), every site at S (dense-mode fit)
    sites-C-greedy-K.gguf          the same sites at per-site levels from each site's measured KL
                                   curve, greedy by KL per byte up to a summed KL of K
                                   (sparse/site_allocation.py; --site-tokens, --site-grid)
    sites-mixed-greedy-proxy-K.gguf
                                   per-site levels from proxy curves (--site-proxy A: numpy output
                                   errors at 5..90% under magnitude and wina, scaled by a runtime
                                   KL at level A per --anchor-layers group, or --anchor-costs /
                                   --proxy-scale without new runs), each site by the criterion
                                   whose predicted KL is lower (--sites-criterion mixed)

Every calibration reads --calib only; evaluate on text disjoint from it.

    PYTHONPATH=python python tools/make_frontier_files.py DENSE.gguf --calib CAL.txt --out DIR
        [--gate 0.1,0.2,0.3,0.4] [--input 0.1,0.2,0.3] [--criteria magnitude,wina]
        [--auto 0.02,0.05] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import time

import numpy as np

from powerinfer_cpp import Model
from powerinfer_cpp import format as F
from powerinfer_cpp.convert.from_gguf import convert_from_gguf
from powerinfer_cpp.sparse.gate_eval import patch_gate_thresholds
from powerinfer_cpp.sparse.input_eval import patch_calibration, refit, refit_tokens
from powerinfer_cpp.sparse.input_sparsity import calibrate_input_levels
from powerinfer_cpp.sparse.pipeline import SparseOptions
from powerinfer_cpp.sparse.profile import profile_model
from powerinfer_cpp.sparse.thresholds import greedy_allocation, uniform_allocation


def floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v.strip()]


def say(m: str) -> None:
    print(time.strftime("%H:%M:%S"), m, flush=True)


def gate_files(args, levels) -> dict:
    """One greedy calibration (it also measures the layers' KL curves), patched per level."""
    rep: list = []
    base = os.path.join(args.out, "gate-cal.gguf")
    allocs = args.allocations.split(",")
    greedy = "greedy" in allocs  # measures n_layer x 9 KL curves points: the costly part
    convert_from_gguf(args.model, base, progress=False, report=rep, sparse_options=SparseOptions(
        calib=args.calib, sparsity=0.5, allocation="greedy" if greedy else "uniform",
        greedy_tokens=args.greedy_tokens, keep_calibration=True, n_threads=args.threads))
    r = rep[0]
    out = {"n_calib_tokens": r.n_calib_tokens, "files": {},
           "layer_kl": np.asarray(r.gate_costs).tolist() if greedy else None}
    for alloc in allocs:
        for s in levels:
            lv = (greedy_allocation(r.gate_costs, s) if alloc == "greedy"
                  else uniform_allocation(r.gate_table.n_layer, s))
            p = os.path.join(args.out, f"gate-{alloc}-{s:g}.gguf")
            shutil.copyfile(base, p)
            patch_gate_thresholds(p, r.gate_table.thresholds(lv))
            out["files"][p] = {"method": f"gate {alloc}", "level": s, "layer_levels": list(lv)}
            say(f"{p}: per layer " + " ".join(f"{v:.0%}" for v in lv))
    os.remove(base)
    return out


def input_files(args, crit: str, levels) -> dict:
    """One conversion with the input tensors, one profile, a calibration and a refit per level."""
    rep: list = []
    base = os.path.join(args.out, f"input-{crit}-cal.gguf")
    convert_from_gguf(args.model, base, progress=False, report=rep, sparse_options=SparseOptions(
        calib=args.calib, sparsity=0.0, input_sparsity=0.5, input_criterion=crit, input_refit=False,
        n_threads=args.threads))
    n_cal = rep[0].n_calib_tokens
    with Model(base, n_ctx=16) as m:
        ids = m.tokenize(open(args.calib, encoding="utf-8").read())[:n_cal]
    prof = profile_model(base, ids, n_ctx=512, n_threads=args.threads, progress=False, inputs=4096)
    import gguf
    from powerinfer_cpp.gguf_write import decode_matrix
    rd = gguf.GGUFReader(base)
    tw = {t.name: t for t in rd.tensors}

    def weights_t(site, layer):
        kind = {"qkv": F.T_ATTN_QKV_T, "o": F.T_ATTN_OUTPUT_T, "head": F.T_OUTPUT_T}[site]
        t = tw[F.input_sparse_tensor_name(kind, layer)]
        return decode_matrix(np.asarray(t.data), t.tensor_type, tuple(int(v) for v in reversed(t.shape)))

    cals = calibrate_input_levels(prof, levels, crit, weights_t)
    del rd, tw
    out = {"n_calib_tokens": n_cal, "files": {}}
    for s, cal in zip(levels, cals):
        p = os.path.join(args.out, f"input-{crit}-{s:g}.gguf")
        shutil.copyfile(base, p)
        refit(p, cal, refit_tokens(prof.input_ids, cal.n_fit, 512, args.refit_tokens), 512, args.threads, say=say)
        patch_calibration(p, cal)
        out["files"][p] = {"method": f"input {crit}", "level": s}
    os.remove(base)
    return out


def site_files(args) -> dict:
    """One conversion with every site's input tensors (FFN's included, gate mode at 0), one
    profile, calibrations at 0, 0.05, ..., 0.9 per criterion (magnitude, wina; "mixed": both,
    each site at each level by the one the proxy predicts lower); uniform levels patched in,
    and the greedy on measured curves (--site-grid) or on proxy curves (--site-proxy A: numpy
    output errors at every level, scaled by one runtime KL per site at level A)."""
    from powerinfer_cpp.sparse.gate_eval import GateEvaluator
    from powerinfer_cpp.sparse.input_sparsity import _per_channel, down_inputs
    from powerinfer_cpp.sparse.site_allocation import (MixedSiteTable, SiteTable, allocate_sites, group_sites,
                                                       output_errors, predicted_bytes, proxy_curves, refine_curves,
                                                       site_bytes, site_costs)
    crit = args.sites_criterion
    crits = list(F.INPUT_CRITERIA) if crit == "mixed" else [crit]
    rep: list = []
    base = os.path.join(args.out, "sites-cal.gguf")
    if not os.path.exists(base + ".json"):  # kept: a later step's failure need not redo it
        convert_from_gguf(args.model, base, progress=False, report=rep, sparse_options=SparseOptions(
            calib=args.calib, calib_tokens=args.sites_calib_tokens, sparsity=0.0, input_sparsity=0.5,
            input_criterion=crits[0], input_refit=False, input_ffn=True, n_threads=args.threads))
        json.dump({"n_calib_tokens": rep[0].n_calib_tokens}, open(base + ".json", "w"))
    n_cal = json.load(open(base + ".json"))["n_calib_tokens"]
    with Model(base, n_ctx=16) as m:
        ids = m.tokenize(open(args.calib, encoding="utf-8").read())
    ids = ids[:n_cal]
    prof_path = base + ".profile.pkl"
    if os.path.exists(prof_path):
        prof = pickle.load(open(prof_path, "rb"))
    else:
        prof = profile_model(base, ids, n_ctx=512, n_threads=args.threads, progress=False, inputs=4096)
        pickle.dump(prof, open(prof_path, "wb"), protocol=4)
    import gguf
    from powerinfer_cpp.gguf_write import decode_matrix
    rd = gguf.GGUFReader(base)
    tw = {t.name: t for t in rd.tensors}
    kinds = {"qkv": F.T_ATTN_QKV_T, "o": F.T_ATTN_OUTPUT_T, "head": F.T_OUTPUT_T, "ffn": F.T_FFN_GATE_UP_T}

    def weights_t(site, layer):
        name = (F.sparse_tensor_name(F.T_FFN_DOWN_T, layer) if site == "down"
                else F.input_sparse_tensor_name(kinds[site], layer))
        t = tw[name]
        return decode_matrix(np.asarray(t.data), t.tensor_type, tuple(int(v) for v in reversed(t.shape)))

    levels = [round(0.05 * i, 2) for i in range(19)]
    tables = {}
    for c in crits:
        cals = calibrate_input_levels(prof, levels, c, weights_t, ffn=True)
        say(f"site calibration ({c}): " + cals[levels.index(0.5)].summary())
        tables[c] = SiteTable(cals)
    table = tables[crits[0]]
    out = {"n_calib_tokens": n_cal, "files": {}}
    for spec in filter(None, args.sites_uniform.split(",")):
        # "S": every site at S; "ffn+down:S": only those site kinds (the others dense)
        kinds_, _, lvl = spec.rpartition(":")
        s = float(lvl)
        only_kinds = set(kinds_.split("+")) if kinds_ else None
        tag = f"{kinds_}-" if kinds_ else ""
        for c in crits:
            p = os.path.join(args.out, f"sites-{c}-uniform-{tag}{s:g}.gguf")
            shutil.copyfile(base, p)
            patch_calibration(p, tables[c].calibration(
                {k: s for k in table.keys if only_kinds is None or k[0] in only_kinds}))
            out["files"][p] = {"method": f"sites uniform{' ' + kinds_ if kinds_ else ''} ({c})", "level": s}
    budgets = floats(args.sites_kl)
    if budgets:
        weights = site_bytes(base)
        keys = group_sites(table.keys, args.site_layers)
        ev = None
        mid = len(ids) // 2  # calibration text, away from its first (short-context) tokens
        tok = ids[mid:mid + args.site_tokens + 1]

        def measure(cal):
            nonlocal ev
            if ev is None:
                ev_path = os.path.join(args.out, "sites-eval.gguf")
                shutil.copyfile(base, ev_path)
                ev = GateEvaluator(ev_path, window=args.site_tokens, n_threads=args.threads)
            return ev.measure(tok, None, inputs=cal)["kl"]

        choice = None
        if args.site_proxy:
            grid = levels[1:]
            a = float(args.site_proxy)
            anchor = grid.index(round(a, 2))
            # the runtime's KL at level a of the anchor groups (--anchor-layers consecutive layers of one
            # kind: fewer runs), from --anchor-costs (a site-costs json of earlier measured curves) or measured
            akeys = group_sites(table.keys, args.anchor_layers)
            cache = args.anchor_costs or os.path.join(
                args.out, f"site-anchors-{crits[0]}-{a:g}-{args.site_tokens}-{args.anchor_layers}.json")
            if args.proxy_scale:
                group_kl = None
            elif os.path.exists(cache):
                c = json.load(open(cache))
                group_kl = np.asarray(c["costs"])[:, [round(v, 2) for v in c["grid"]].index(round(a, 2))]
                assert [[list(k) for k in g] for g in akeys] == [[list(k) for k in g] for g in c["keys"]]
            else:
                group_kl = site_costs(measure, table, akeys, [a], progress=False, say=say)[:, 0]
                json.dump({"grid": [a], "keys": [[list(k) for k in g] for g in akeys],
                           "costs": group_kl[:, None].tolist()}, open(cache, "w"))
            n0 = prof.n_input_tokens - max(1, int(round(prof.n_input_tokens * 0.2)))  # the fit's held-out tokens
            sl = slice(n0, n0 + args.proxy_tokens)
            errs = {c: np.zeros((len(keys), len(grid))) for c in crits}
            t0 = time.time()
            for i, g in enumerate(keys):
                for key in g:
                    site, l = key
                    w = weights_t(site, l)
                    x = {"qkv": lambda: prof.attn_in[l], "o": lambda: prof.attn_out_in[l], "ffn": lambda: prof.x[l],
                         "head": lambda: prof.head_in}.get(site, lambda: None)()
                    if site == "down":
                        gu = weights_t("ffn", l)
                        x = down_inputs(prof.x[l][sl], gu, prof.ffn_act, gu.shape[1] == 2 * w.shape[0])
                    else:
                        x = x[sl]
                    for c in crits:
                        tb = tables[c]
                        errs[c][i] += output_errors(x, w, [_per_channel(tb.threshold(key, s), tb.base.gain.get(key),
                                                                        x.shape[1]) for s in grid])
            say(f"proxy output errors of {len(keys)} sites x {len(grid)} levels x {len(crits)} criteria: "
                f"{time.time() - t0:.0f} s")
            scale = None
            if args.proxy_scale:  # KL per unit of output error from another run's proxy (same sites)
                ps = json.load(open(args.proxy_scale))
                assert ps["keys"] == [[list(k) for k in g] for g in keys] and ps["grid"] == grid
                e0 = np.asarray(ps["errors"][crits[0]])[:, anchor]
                scale = np.asarray(ps["anchor_kl"]) / np.maximum(e0, 1e-30)
            # a group's KL shared among its units in proportion to their output errors at the anchor level:
            # every unit of a group gets the group's KL per unit of error
            unit = {k: i for i, g in enumerate(keys) for k in g}
            e_ref = errs[crits[0]][:, anchor]
            anchor_kl = np.zeros(len(keys)) if scale is None else scale * e_ref
            for kl_g, g in zip(group_kl if scale is None else [], akeys):
                units = sorted({unit[k] for k in g})
                tot = float(sum(e_ref[u] for u in units))
                for u in units:
                    anchor_kl[u] = kl_g * (e_ref[u] / tot if tot > 0 else 1.0 / len(units))
            costs, choice_g = proxy_curves(errs, anchor, anchor_kl, ref=crits[0])
            choice = {k: ["magnitude" if crit == "mixed" else crit] + row for g, row in zip(keys, choice_g) for k in g}
            json.dump({"grid": grid, "keys": [[list(k) for k in g] for g in keys], "anchor_kl": anchor_kl.tolist(),
                       "errors": {c: e.tolist() for c, e in errs.items()}, "costs": costs.tolist(),
                       "choice": choice_g},
                      open(os.path.join(args.out, f"site-proxy-{crit}-{a:g}.json"), "w"))
            sel = MixedSiteTable(tables, choice)
            tag = "proxy"
        else:
            grid = floats(args.site_grid)
            cache = os.path.join(args.out, f"site-costs-{crit}-{args.site_tokens}-{args.site_layers}.json")
            if os.path.exists(cache):
                c = json.load(open(cache))
                costs = np.asarray(c["costs"])
                assert c["grid"] == grid and len(costs) == len(keys)
            else:
                costs = site_costs(measure, table, keys, grid, progress=False, say=say)
                json.dump({"grid": grid, "keys": [[list(k) for k in g] for g in keys], "costs": costs.tolist()},
                          open(cache, "w"))
            if args.site_refine:  # a coarse grid: power law below its first level (refine_curves)
                costs, grid = refine_curves(costs, grid)
            sel = table
            tag = "refined" if args.site_refine else ""
        dense_sites = float(sum(weights.values()))
        for kl in budgets:
            lv = allocate_sites(costs, keys, weights, kl, grid)
            p = os.path.join(args.out, f"sites-{crit}-greedy{'-' + tag if tag else ''}-{kl:g}.gguf")
            shutil.copyfile(base, p)
            cal = sel.calibration(lv)
            patch_calibration(p, cal)
            by: dict = {}
            for (site, _), v in lv.items():
                by.setdefault(site, []).append(v)
            mean = {site: float(np.mean(v)) for site, v in by.items()}
            saved = dense_sites - predicted_bytes(lv, weights)
            info = {"method": f"sites greedy{' ' + tag if tag else ''} ({crit})", "level": kl,
                    "site_mean_levels": mean, "predicted_saved_bytes": saved,
                    "levels": {f"{k[0]}.{'' if k[1] is None else k[1]}": v for k, v in lv.items()}}
            if choice is not None:
                used = {f"{k[0]}.{'' if k[1] is None else k[1]}": sel.criterion(k, v) for k, v in lv.items() if v > 0}
                info["criteria"] = used
                info["wina_share_of_sparse_sites"] = (sum(v == "wina" for v in used.values()) / len(used)
                                                      if used else 0.0)
            out["files"][p] = info
            say(f"{p}: predicted KL {kl}, saves {saved / 1e6:.1f} MB/token; mean level per site kind: "
                + ", ".join(f"{k} {v:.0%}" for k, v in mean.items()))
        if ev is not None:
            os.remove(ev.path)
    del rd, tw
    return out


def combined_file(args, gate_path: str, input_path: str) -> dict:
    """An input-sparse file with a gate file's thresholds patched in: the two methods at fixed
    levels (the input thresholds were refit with the FFN exact, so o sees slightly different
    inputs than under the gate; convert's budget refits at the gate level instead)."""
    import gguf

    r = gguf.GGUFReader(gate_path)
    f = r.fields[F.KEY_SPARSE_GATE_THRESHOLD]
    thr = [float(f.parts[i][0]) for i in f.data]
    del r
    man = json.load(open(os.path.join(args.out, "manifest.json")))["files"]
    g, i = man[gate_path], man[input_path]
    p = os.path.join(args.out, f"combined-{os.path.basename(gate_path)[:-5]}+{os.path.basename(input_path)}")
    shutil.copyfile(input_path, p)
    patch_gate_thresholds(p, thr)
    return {"files": {p: {"method": f"{g['method']} {g['level']:g} + {i['method']}", "level": i["level"],
                          "gate_level": g["level"]}}}


def auto_file(args, budget: float) -> dict:
    rep: list = []
    p = os.path.join(args.out, f"auto-{budget:g}.gguf")
    convert_from_gguf(args.model, p, progress=False, report=rep, sparse_options=SparseOptions(
        calib=args.calib, max_ppl_increase=budget, input_sparsity="auto", budget_tokens=args.budget_tokens,
        n_threads=args.threads))
    r = rep[0]
    cal = r.input_calibration
    return {"files": {p: {"method": "auto (gate + input)", "level": budget, "gate_sparsity": r.gate_sparsity,
                          "input_sparsity": None if cal is None else cal.sparsity,
                          "input_criterion": None if cal is None else cal.criterion}}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="dense GGUF (its types are kept)")
    ap.add_argument("--calib", required=True, help="calibration text (keep it disjoint from the evaluation's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gate", default="0.1,0.2,0.3,0.4")
    ap.add_argument("--allocations", default="uniform,greedy", help="gate: per-layer allocations")
    ap.add_argument("--greedy-tokens", type=int, default=512)
    ap.add_argument("--input", default="0.1,0.2,0.3")
    ap.add_argument("--criteria", default=",".join(F.INPUT_CRITERIA))
    ap.add_argument("--refit-tokens", type=int, default=1024)
    ap.add_argument("--auto", default="0.02,0.05", help="quality budgets of convert --input-sparsity auto")
    ap.add_argument("--budget-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="gate,input,auto", help="parts: gate, input, auto, sites")
    ap.add_argument("--sites-uniform", default="0.2,0.3,0.4",
                    help="sites: uniform levels over every site (S), or over some kinds only (ffn+down:S; kinds: "
                         "qkv, o, ffn, down, head)")
    ap.add_argument("--sites-kl", default="0.01,0.02,0.04", help="sites: summed-KL budgets of the greedy")
    ap.add_argument("--sites-criterion", default="magnitude", choices=F.INPUT_CRITERIA + ("mixed",),
                    help="sites: the selection score; mixed: per site and level the one the proxy predicts lower")
    ap.add_argument("--site-proxy", type=float, default=None, metavar="A",
                    help="sites: greedy on proxy curves (numpy output errors at 0.05, ..., 0.9, scaled by one "
                         "runtime KL per site at level A) instead of measured --site-grid curves")
    ap.add_argument("--anchor-layers", type=int, default=1,
                    help="sites, --site-proxy: consecutive layers of one kind measured together for the anchor KL")
    ap.add_argument("--anchor-costs", default=None, metavar="JSON",
                    help="sites, --site-proxy: the anchor KLs from an earlier site-costs json (same groups, its grid "
                         "holding the anchor level) instead of measuring them")
    ap.add_argument("--proxy-scale", default=None, metavar="JSON",
                    help="sites, --site-proxy: each site's KL per unit of output error from another run's "
                         "site-proxy json (the same model rotated: o and down are unchanged, and a site's output "
                         "space is the same), no runtime measurement")
    ap.add_argument("--proxy-tokens", type=int, default=512, help="sites: profiled tokens the output errors use")
    ap.add_argument("--site-tokens", type=int, default=64, help="sites: calibration tokens per KL measurement")
    ap.add_argument("--site-refine", action="store_true",
                    help="sites: read the measured curves as power laws below the first grid level "
                         "(site_allocation.refine_curves) instead of linearly from 0")
    ap.add_argument("--site-layers", type=int, default=1,
                    help="sites: consecutive layers of one site kind sharing a level (fewer curves to measure)")
    ap.add_argument("--sites-calib-tokens", type=int, default=4096,
                    help="sites: calibration tokens profiled (the thresholds are fitted on the first 4096's inputs)")
    ap.add_argument("--site-grid", default="0.25,0.5,0.75", help="sites: levels each site's KL is measured at")
    ap.add_argument("--combine", default="", metavar="G+I,...",
                    help="also copy input file I (a name in --out) with gate file G's thresholds")
    args = ap.parse_args()
    if args.proxy_scale and not os.path.isfile(args.proxy_scale):
        ap.error(f"--proxy-scale {args.proxy_scale}: no such file (a site-proxy json of an earlier run)")
    os.makedirs(args.out, exist_ok=True)
    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    manifest.setdefault("files", {})
    only = args.only.split(",")

    def save(part: dict, name: str):
        manifest["files"].update(part.pop("files"))
        manifest[name] = part
        json.dump(manifest, open(manifest_path, "w"), indent=1)

    if "gate" in only and floats(args.gate):
        save(gate_files(args, floats(args.gate)), "gate")
    if "input" in only and floats(args.input):
        for crit in args.criteria.split(","):
            save(input_files(args, crit, floats(args.input)), f"input-{crit}")
    for spec in filter(None, args.combine.split(",")):
        gate_path, input_path = (os.path.join(args.out, v) for v in spec.split("+"))
        save(combined_file(args, gate_path, input_path), f"combined-{spec}")
    if "sites" in only:
        save(site_files(args), f"sites-{args.sites_criterion}")
    if "auto" in only:
        for b in floats(args.auto):
            save(auto_file(args, b), f"auto-{b:g}")
            say(f"auto {b}: {manifest['files'][os.path.join(args.out, f'auto-{b:g}.gguf')]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
