#!/usr/bin/env python3
"""Dense and sparse speed of this runtime vs llama.cpp (llama-cpp-python), side by side, in one run.

    GH_LIBRARY=build/libggml_hybrid.so PYTHONPATH=python python tools/bench.py \
        [--types f16,q4_0] [--threads 1,2] [--passes 3] [--ops] [--write-docs] [--plain | --layers 8 ...]

What it does, on GGUF files made by tools/make_bench_model.py (default: the issue-5 model,
a 1.1B-parameter LLaMA with ReGLU FFN whose weights are constructed to be ~93% sparse on
real text: d=2048, 22 layers, 32 heads / 4 KV heads, n_ff=5632, vocab 32000; dense GGUF per
type, and the sparse GGUF of the same weights from `convert --sparse`; --plain: the
foundation's random 542M dense model, no sparse engine; --arch qwen2 | falcon | llama3:
random dense models of those architectures at ~1B published shapes, no sparse engine;
--swiglu: random weights at the same 1.1B shape with a SwiGLU FFN, its gate-mode file
from `convert --sparsity 0.5` as the sparse one; --arch opt: the same sparse construction
OPT-shaped, where llama.cpp, which has no OPT, gets a row saying so and the sparse engine is compared with ours dense instead; or any
GGUF files with --model / --sparse-model):

* Engines: `llama.cpp` on the dense GGUF; `ours` (dense FFN) on the same dense GGUF;
  `ours-sparse` on the sparse GGUF in sparse FFN mode (gh_context_set_ffn_mode
  GH_FFN_SPARSE: predictor -> active neurons -> gate/up/down over those rows only; a
  gate-threshold file, GH_FFN_GATE: the gate dense, up/down_t over the neurons whose
  |act(gate)| passes the threshold; prompts of more than the context's sparse batch limit
  run dense, as the runtime decides).
* Tokens: real text (models/tiny-relu-kjv/heldout.txt through its tokenizer, from token 8192
  on: text the sparse model's predictors were not trained on), the same for every engine.
* pp128: one 128-token batch eval into a fresh cache (after one untimed warm-up eval
  that also faults the weights in), tokens/s.
* tg128: a short prompt (8 tokens), then 128 single-token decode steps, tokens/s.
* Ours through the low-level cffi binding (gh_model_load / gh_context_new /
  gh_eval / gh_context_truncate: no sampling, no Python tokenization in the timed
  loop; gh_model_load's default load mode reads the weights into huge pages where the
  kernel offers them; llama.cpp maps the file, its default); llama.cpp through
  llama-cpp-python's C-level ctypes functions (llama_model_load_from_file / llama_init_from_model / llama_decode on
  llama_batch_get_one / llama_memory_clear), not the Python Llama class, so no Python
  generation overhead counts against llama.cpp. Context: n_ctx=512, n_batch=n_ubatch=512,
  other llama.cpp context parameters at their defaults.
* Every measurement runs in its own fresh worker process (load, warm up, pp, tg), so the
  engines' thread pools never compete; engines ALTERNATE within every pass (the
  order flips each pass), and the table shows the median over passes with min-max.
* Memory read bandwidth of this machine is measured in the same run with tools/membw.c
  (compiled here with cc -O2 -march=native -pthread; each thread streams its own 512 MB),
  and the decode limit is bandwidth / bytes of weights read per token. Dense: all tensor
  bytes of the GGUF except token_embd (of which decode reads one row; all of it where it is
  also the head, tied) and OPT's position_embd (one row too). Sparse: measured by
  the runtime during the tg128 loop (gh_context_get_stats: attention + predictor + FFN rows
  read + head, per token) when the runtime has the stats API; else computed from the sparse
  file: attention + predictor + per layer (predicted density x gate + true density x (up +
  down_t)) + head + norms, with the predicted/true densities of the conversion report
  (pipeline.json) and the file's ffn_freq.
* Load: /proc/loadavg before and after, and for every worker the CPU time other
  processes used while it ran (from /proc/stat minus the worker's own rusage).
* --ops: our per-matmul costs, timing gh_op_matmul on the model's own weights in model
  order (so they stream from DRAM as in decode): GB/s per weight kind for 1 token and
  GFLOP/s for 128 tokens, and how much of a decode step the matmuls account for.

No test depends on these numbers; docs/BENCHMARKS.md records them (--write-docs).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
DOCS = REPO / "docs" / "BENCHMARKS.md"
sys.path.insert(0, str(TOOLS))

LLAMA_HINT = ('llama-cpp-python is not installed; to compare with llama.cpp install it from source '
              '(~10 minutes on 2 cores):\n    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python')
N_TG_PROMPT = 8
#: Tokens already in the KV cache when the timed decode starts (--depth; llama-bench's -d).
DEPTH = 0
BEGIN, END = "<!-- BENCH-BEGIN (written by tools/bench.py --write-docs) -->", "<!-- BENCH-END -->"


# ==========================================================================
# Workers (each runs in its own process)
# ==========================================================================

TEXT = REPO / "models" / "tiny-relu-kjv" / "heldout.txt"
TEXT_OFFSET = 8192   # tokens of TEXT from here on: neither profiled (the first 4096) nor construction (the last 2048)


def _tokens(n: int, seed: int) -> list[int]:
    """n tokens of real text (the shipped held-out text through the shipped tokenizer, which
    the bench models reuse; the sparse model's active sets depend on the text), taken from
    the middle of the text; random ids when it cannot be read."""
    try:
        import tokenizers
        tok = tokenizers.Tokenizer.from_file(str(TEXT.parent / "tokenizer.json"))
        ids = tok.encode(TEXT.read_text(encoding="utf-8")).ids
        start = TEXT_OFFSET + 1024 * seed
        if len(ids) >= start + n:
            return [int(i) for i in ids[start:start + n]]
    except Exception:  # noqa: BLE001 - fall back to random ids
        pass
    import random
    r = random.Random(seed)
    return [r.randrange(4, 4096) for _ in range(n)]


def _native_fn(lib, name: str):
    """A runtime function, or None when this build (or its header) lacks it."""
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


FFN_MODES = {"dense": 0, "sparse": 1, "oracle": 2, "gate": 3}


def _read_stats(ffi, lib, c, n_layer: int) -> dict | None:
    get = _native_fn(lib, "gh_context_get_stats")
    if get is None:
        return None
    from powerinfer_cpp._native import check
    st = ffi.new("gh_context_stats *")
    dens = ffi.new("double[]", max(1, n_layer))
    check(get(c, st, dens, n_layer))
    out = {k: getattr(st, k) for k in ("n_tokens", "n_sparse_tokens", "n_active", "n_up_rows", "n_down_rows",
                                       "density", "bytes_attention", "bytes_predictor", "bytes_ffn",
                                       "bytes_head", "bytes_per_token", "t_attention", "t_predictor", "t_ffn",
                                       "t_other", "t_total")}
    out["layer_density"] = [dens[i] for i in range(n_layer)]
    return out


def _n_ctx(n_tg: int) -> int:
    """Context length of a measurement: 512, or what --depth needs, rounded up to 256."""
    need = N_TG_PROMPT + DEPTH + n_tg + 1
    return max(512, -(-need // 256) * 256)


def worker_ours(model: str, threads: int, n_pp: int, n_tg: int, ffn_mode: str = "dense") -> dict:
    from powerinfer_cpp._native import check, ffi, lib
    t0 = time.perf_counter()
    mp = ffi.new("gh_model **")
    check(lib.gh_model_load(model.encode(), mp))
    m = mp[0]
    p = lib.gh_context_default_params()
    p.n_ctx, p.n_batch, p.n_threads = _n_ctx(n_tg), 512, threads
    cp = ffi.new("gh_context **")
    check(lib.gh_context_new(m, ffi.new("gh_context_params *", p), cp))
    c = cp[0]
    set_mode = _native_fn(lib, "gh_context_set_ffn_mode")
    if set_mode is not None:
        check(set_mode(c, FFN_MODES[ffn_mode]))
    elif ffn_mode != "dense":
        raise RuntimeError("this runtime has no sparse FFN (gh_context_set_ffn_mode is missing)")
    info = ffi.new("gh_model_info *")
    check(lib.gh_model_info_get(m, info))
    n_layer = info.n_layer
    load_s = time.perf_counter() - t0
    pp = ffi.new("int32_t[]", _tokens(n_pp, 1))
    n0 = N_TG_PROMPT + DEPTH
    tg = ffi.new("int32_t[]", _tokens(n0 + n_tg, 2))
    ev, trunc = lib.gh_eval, lib.gh_context_truncate

    check(ev(c, pp, n_pp, 0))                 # warm-up: faults the weights in
    check(trunc(c, 0))
    t = time.perf_counter()
    check(ev(c, pp, n_pp, 0))
    pp_s = time.perf_counter() - t
    check(trunc(c, 0))

    for i in range(0, n0, 512):
        check(ev(c, tg + i, min(512, n0 - i), 0))
    reset = _native_fn(lib, "gh_context_reset_stats")
    if reset is not None:
        check(reset(c))
    t = time.perf_counter()
    for i in range(n0, n0 + n_tg):
        st = ev(c, tg + i, 1, 0)
        if st:
            check(st)
    tg_s = time.perf_counter() - t
    stats = _read_stats(ffi, lib, c, n_layer)   # of the tg loop only
    get_mode = _native_fn(lib, "gh_context_get_ffn_mode")
    mode_now = get_mode(c) if get_mode is not None else 0
    simd = {0: "scalar", 1: "avx2", 2: "avx512"}.get(lib.gh_simd_get(), "?")
    load = "read (huge pages)" if lib.gh_model_load_mode(m) == lib.GH_LOAD_READ else "mmap"
    lib.gh_context_free(c)
    lib.gh_model_free(m)
    if ffn_mode != "dense" and mode_now != FFN_MODES[ffn_mode]:
        raise RuntimeError(f"the context is in FFN mode {mode_now}, not {ffn_mode}")
    return {"pp": n_pp / pp_s, "tg": n_tg / tg_s, "load_s": load_s, "info": f"simd={simd}, weights={load}",
            "stats": stats}


def worker_ours_sparse(model: str, threads: int, n_pp: int, n_tg: int) -> dict:
    import gguf
    # a gate-magnitude file (convert --sparsity: SwiGLU) has thresholds instead of predictors
    gate = "powerinfer.sparse.gate_threshold" in gguf.GGUFReader(model).fields
    return worker_ours(model, threads, n_pp, n_tg, "gate" if gate else "sparse")


def worker_llama(model: str, threads: int, n_pp: int, n_tg: int) -> dict:
    import ctypes
    import llama_cpp as L

    @L.llama_log_callback
    def _quiet(level, text, user_data):  # noqa: ARG001
        pass
    L.llama_log_set(_quiet, ctypes.c_void_p())
    L.llama_backend_init()
    t0 = time.perf_counter()
    mp = L.llama_model_default_params()
    mp.use_mmap = True
    m = L.llama_model_load_from_file(model.encode(), mp)
    if not m:
        raise RuntimeError(f"llama.cpp cannot load {model}")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = _n_ctx(n_tg), 512, 512
    cp.n_threads, cp.n_threads_batch = threads, threads
    cp.no_perf = True
    c = L.llama_init_from_model(m, cp)
    if not c:
        raise RuntimeError("llama.cpp: cannot create a context")
    mem = L.llama_get_memory(c)
    load_s = time.perf_counter() - t0
    pp_arr = (L.llama_token * n_pp)(*_tokens(n_pp, 1))
    n0 = N_TG_PROMPT + DEPTH
    tg_list = _tokens(n0 + n_tg, 2)
    tg_arr = (L.llama_token * len(tg_list))(*tg_list)
    tok_size = ctypes.sizeof(L.llama_token)
    base = ctypes.addressof(tg_arr)
    one = [ctypes.cast(base + i * tok_size, ctypes.POINTER(L.llama_token)) for i in range(len(tg_list))]
    dec, get_one, sync = L.llama_decode, L.llama_batch_get_one, L.llama_synchronize

    def decode(batch):
        r = dec(c, batch)
        if r != 0:
            raise RuntimeError(f"llama_decode returned {r}")

    decode(get_one(pp_arr, n_pp))             # warm-up
    sync(c)
    L.llama_memory_clear(mem, True)
    t = time.perf_counter()
    decode(get_one(pp_arr, n_pp))
    sync(c)
    pp_s = time.perf_counter() - t
    L.llama_memory_clear(mem, True)

    for i in range(0, n0, 512):
        decode(get_one(one[i], min(512, n0 - i)))
    sync(c)
    t = time.perf_counter()
    for i in range(n0, n0 + n_tg):
        decode(get_one(one[i], 1))
    sync(c)
    tg_s = time.perf_counter() - t
    L.llama_free(c)
    L.llama_model_free(m)
    return {"pp": n_pp / pp_s, "tg": n_tg / tg_s, "load_s": load_s,
            "info": f"llama-cpp-python {L.__version__}, simd={_llama_isa(L)}"}


def _llama_isa(L) -> str:
    """The widest x86 vector ISA the llama.cpp build uses, from its system info."""
    try:
        text = L.llama_print_system_info().decode()
    except Exception:
        return "?"
    feats = {k.strip(): v.strip() for k, _, v in
             (f.partition("=") for f in re.split(r"[|]", text)) if v.strip() in ("0", "1")}
    if feats.get("AVX512") == "1":
        return "avx512"
    if feats.get("AVX2") == "1":
        return "avx2"
    return "scalar/other"


# weight kinds in the GGUF (blk.N.<kind>.weight) and the output head
def _kind(name: str) -> str:
    mm = re.match(r"blk\.\d+\.(.+)\.weight$", name)
    return mm.group(1) if mm else name.replace(".weight", "")


def worker_ops(model: str, threads: int, n_pp: int, n_tg: int) -> dict:
    """Time gh_op_matmul on every 2-D weight except token_embd, in file order."""
    from powerinfer_cpp._native import check, ffi, lib
    gp = ffi.new("gh_gguf **")
    check(lib.gh_gguf_open(model.encode(), gp))
    g = gp[0]
    mats = []
    ty, nd, ne, nb, data = (ffi.new("int32_t *"), ffi.new("int32_t *"), ffi.new("int64_t[4]"),
                            ffi.new("uint64_t *"), ffi.new("void **"))
    for i in range(lib.gh_gguf_n_tensors(g)):
        name = ffi.string(lib.gh_gguf_tensor_name(g, i)).decode()
        check(lib.gh_gguf_tensor_info(g, i, ty, nd, ne, ffi.NULL, nb, data))
        if nd[0] == 2 and name != "token_embd.weight":
            mats.append((_kind(name), ty[0], ne[1], ne[0], data[0], nb[0]))  # rows = ne[1], cols = ne[0]
    maxr = max(m[2] for m in mats)
    maxc = max(m[3] for m in mats)
    import random
    r = random.Random(3)
    out = {}
    for ntok, reps in ((1, 5), (n_pp, 1)):
        x = ffi.new("float[]", [r.uniform(-1, 1) for _ in range(maxc)] * ntok)
        y = ffi.new("float[]", maxr * ntok)
        kinds: dict[str, list[float]] = {}
        for rep in range(reps + 1):          # rep 0 warms up (page faults)
            for kind, t_, rows, cols, ptr, nbytes in mats:
                t = time.perf_counter()   # x holds >= ntok*cols floats; values do not matter
                check(lib.gh_op_matmul(t_, ptr, rows, cols, x, ntok, y, threads))
                dt = time.perf_counter() - t
                if rep:
                    k = kinds.setdefault(kind, [0.0, 0, 0, 0.0, ""])
                    k[0] += dt
                    k[1] += 1
                    k[2] = nbytes
                    k[3] = 2.0 * rows * cols * ntok
                    k[4] = f"{rows} x {cols} {ffi.string(lib.gh_type_name(t_)).decode()}"
        out[str(ntok)] = {k: {"s_per_call": v[0] / v[1], "bytes": v[2], "flop": v[3], "shape": v[4],
                              "calls_per_token": v[1] // reps} for k, v in kinds.items()}
    lib.gh_gguf_close(g)
    return out


#: GGUF architectures this runtime writes that llama.cpp has no implementation of
LLAMA_CPP_LACKS = ("opt",)


def gguf_arch(path: str) -> tuple[str, bool]:
    """(general.architecture or '', whether the head is tied: no output.weight) of a GGUF."""
    from powerinfer_cpp._native import check, ffi, lib
    gp = ffi.new("gh_gguf **")
    check(lib.gh_gguf_open(path.encode(), gp))
    try:
        i = lib.gh_gguf_find_key(gp[0], b"general.architecture")
        v = lib.gh_gguf_kv_str(gp[0], i) if i >= 0 else ffi.NULL
        names = {ffi.string(lib.gh_gguf_tensor_name(gp[0], j)) for j in range(lib.gh_gguf_n_tensors(gp[0]))}
        return (ffi.string(v).decode() if v != ffi.NULL else ""), b"output.weight" not in names
    finally:
        lib.gh_gguf_close(gp[0])


WORKERS = {"ours": worker_ours, "ours-sparse": worker_ours_sparse, "llama.cpp": worker_llama, "ops": worker_ops}
ENGINES = ("llama.cpp", "ours", "ours-sparse")


# The interpreter of the llama.cpp workers (--llama-python: e.g. a venv whose llama-cpp-python
# was built for another ISA) and the GH_SIMD level of ours (--simd); set by main().
LLAMA_PYTHON = sys.executable
OUR_SIMD: str | None = None


def run_worker(engine: str, model: str, threads: int, n_pp: int, n_tg: int, timeout: float) -> dict:
    """Run one measurement in a fresh process; returns its JSON plus the foreign CPU load."""
    python = LLAMA_PYTHON if engine == "llama.cpp" else sys.executable
    env = dict(os.environ)
    if OUR_SIMD and engine != "llama.cpp":
        env["GH_SIMD"] = OUR_SIMD
    cmd = [python, str(Path(__file__).resolve()), "--worker", engine, "--model", model,
           "--worker-threads", str(threads), "--n-pp", str(n_pp), "--n-tg", str(n_tg), "--depth", str(DEPTH)]
    busy0, total0 = _cpu_jiffies()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    try:
        pr = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - w0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy1, total1 = _cpu_jiffies()
    own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    hz = os.sysconf("SC_CLK_TCK")
    foreign = max(0.0, (busy1 - busy0) / hz - own) / wall if wall > 0 else 0.0
    lines = [ln for ln in pr.stdout.splitlines() if ln.startswith("{")]
    if pr.returncode != 0 or not lines:
        tail = (pr.stderr or pr.stdout).strip().splitlines()[-3:]
        return {"error": f"worker exit {pr.returncode}: " + " | ".join(tail)}
    res = json.loads(lines[-1])
    res["foreign_cores"] = foreign
    res["wall_s"] = wall
    return res


def busy_cores(seconds: float = 2.0) -> float:
    """Cores kept busy by all processes over the next `seconds` (we are idle meanwhile)."""
    b0, _ = _cpu_jiffies()
    time.sleep(seconds)
    b1, _ = _cpu_jiffies()
    return (b1 - b0) / os.sysconf("SC_CLK_TCK") / seconds


def wait_idle(max_wait: float, threshold: float = 0.15) -> float:
    """Wait (up to max_wait seconds) until other processes use < threshold cores;
    returns the last busy reading."""
    t_end = time.time() + max_wait
    b = busy_cores()
    while b >= threshold and time.time() < t_end:
        b = busy_cores(5.0)
    return b


def _cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    total = sum(v[:8])
    return total - idle, total


# ==========================================================================
# Bandwidth, model sizes, environment
# ==========================================================================

def membw(threads: list[int], cache: Path) -> dict[int, dict]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        print("warning: no C compiler; memory bandwidth not measured", file=sys.stderr)
        return {}
    exe = cache / "membw"
    src = TOOLS / "membw.c"
    if not exe.is_file() or exe.stat().st_mtime < src.stat().st_mtime:
        subprocess.run([cc, "-O2", "-march=native", "-pthread", str(src), "-o", str(exe)], check=True)
    out = {}
    for t in threads:
        pr = subprocess.run([str(exe), str(t), "512", "5"], capture_output=True, text=True, check=True)
        kv = dict(x.split("=") for x in pr.stdout.split())
        out[t] = {"best": float(kv["best_gbps"]), "median": float(kv["median_gbps"])}
    return out


def weight_bytes(path: str) -> tuple[int, int]:
    """(bytes read per decoded token, total tensor bytes) of a GGUF. token_embd counts only
    when it is also the head (tied: no output.weight), since then every step reads all of it;
    learned positions (position_embd) are one row per step, like the embedding."""
    from powerinfer_cpp._native import check, ffi, lib
    gp = ffi.new("gh_gguf **")
    check(lib.gh_gguf_open(path.encode(), gp))
    nb = ffi.new("uint64_t *")
    total = per_tok = embd = 0
    names = set()
    for i in range(lib.gh_gguf_n_tensors(gp[0])):
        check(lib.gh_gguf_tensor_info(gp[0], i, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, nb, ffi.NULL))
        name = ffi.string(lib.gh_gguf_tensor_name(gp[0], i)).decode()
        names.add(name)
        total += nb[0]
        if name == "token_embd.weight":
            embd = nb[0]
        elif name != "position_embd.weight":
            per_tok += nb[0]
    lib.gh_gguf_close(gp[0])
    if "output.weight" not in names:
        per_tok += embd
    return per_tok, total


def tensor_table(path: str) -> dict[str, tuple[int, object]]:
    """name -> (bytes, float32 numpy array for F32 1-D tensors else None) of a GGUF."""
    import numpy as np
    from powerinfer_cpp._native import check, ffi, lib
    gp = ffi.new("gh_gguf **")
    check(lib.gh_gguf_open(path.encode(), gp))
    ty, nd, ne, nb, data = (ffi.new("int32_t *"), ffi.new("int32_t *"), ffi.new("int64_t[4]"),
                            ffi.new("uint64_t *"), ffi.new("void **"))
    out = {}
    try:
        for i in range(lib.gh_gguf_n_tensors(gp[0])):
            name = ffi.string(lib.gh_gguf_tensor_name(gp[0], i)).decode()
            check(lib.gh_gguf_tensor_info(gp[0], i, ty, nd, ne, ffi.NULL, nb, data))
            arr = None
            if ty[0] == 0 and nd[0] == 1:   # F32 vector (norms, ffn_freq)
                arr = np.frombuffer(ffi.buffer(data[0], nb[0]), dtype=np.float32).copy()
            out[name] = (int(nb[0]), arr)
    finally:
        lib.gh_gguf_close(gp[0])
    return out


def predictor_types(path: str) -> str:
    """Storage type(s) of a sparse GGUF's predictors (fc1/fc2), e.g. 'Q8_0'."""
    import gguf
    r = gguf.GGUFReader(path)
    kinds = sorted({t.tensor_type.name for t in r.tensors if re.match(r"blk\.\d+\.fc[12]\.weight$", t.name)})
    return "/".join(kinds) or "none"


SPARSE_SIDE_TENSORS = ("ffn_freq", "gpu_idx", "gpu_bucket")   # never read per token


def sparse_file_bytes(path: str, pred_density: list[float] | None) -> dict:
    """Weight bytes one sparse decode step reads, computed from the sparse GGUF: attention,
    predictor (fc1 + fc2), per layer pd x gate + td x (up + down_t) with pd the predicted
    density (conversion report; the true one when absent) and td the true density (the
    file's ffn_freq), the output head and the norms; token_embd: one row (not counted)."""
    tt = tensor_table(path)
    out = {"attention": 0.0, "predictor": 0.0, "ffn": 0.0, "ffn_dense": 0.0, "head": 0.0, "other": 0.0}
    true_d, pred_d = [], []
    layers: dict[int, dict] = {}
    tied = "output.weight" not in tt
    for name, (nb, arr) in tt.items():
        m = re.match(r"blk\.(\d+)\.(.+?)(\.weight)?$", name)
        if not m:
            if (name.startswith("output.") and name != "output_norm.weight") or (tied and name == "token_embd.weight"):
                out["head"] += nb
            elif name not in ("token_embd.weight", "position_embd.weight"):
                out["other"] += nb
            continue
        il, kind = int(m.group(1)), m.group(2)
        L = layers.setdefault(il, {})
        if kind in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output"):
            out["attention"] += nb
        elif kind in ("fc1", "fc2"):
            out["predictor"] += nb
        elif kind in ("ffn_gate", "ffn_up", "ffn_down", "ffn_down_t"):
            L[kind] = nb
            out["ffn_dense"] += nb
        elif kind == "ffn_freq":
            L["freq"] = arr
        elif kind in SPARSE_SIDE_TENSORS:
            pass
        else:
            out["other"] += nb
    gate_mode = out["predictor"] == 0   # no predictors: gate thresholds, the gate read whole
    for il in sorted(layers):
        L = layers[il]
        td = float(L["freq"].mean()) if L.get("freq") is not None else 1.0
        pd = 1.0 if gate_mode else pred_density[il] if pred_density and il < len(pred_density) else td
        true_d.append(td)
        pred_d.append(pd)
        down = L.get("ffn_down_t", L.get("ffn_down", 0))
        if "ffn_gate" in L:
            out["ffn"] += pd * L["ffn_gate"] + td * (L.get("ffn_up", 0) + down)
        else:   # ungated: up takes the gate's place, computed for every predicted neuron
            out["ffn"] += pd * L.get("ffn_up", 0) + td * down
    out["total"] = out["attention"] + out["predictor"] + out["ffn"] + out["head"] + out["other"]
    out["true_density"] = true_d
    out["pred_density"] = pred_d
    return out


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        d = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
        name = d.get("Model name", "?").strip()
        cores = d.get("CPU(s)", "?").strip()
        l3 = d.get("L3 cache", "").strip()
        flags = d.get("Flags", "")
        isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
        return f"{name}, {cores} CPUs, {isa}" + (f", L3 {l3}" if l3 else "")
    except (OSError, ValueError):
        return platform.processor() or "?"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def top_procs(n: int = 5) -> str:
    try:
        out = subprocess.run(["top", "-bn1", "-w", "200"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = out.splitlines()
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith("PID"):
            rows = []
            for row in lines[i + 1:]:
                f = row.split()
                if len(f) >= 12 and float(f[8].replace(",", ".")) >= 5.0:
                    rows.append(f"{f[11]} {f[8]}%")
            return ", ".join(rows[:n])
    return ""


def llama_version() -> str | None:
    """llama-cpp-python's version in the --llama-python interpreter, or None."""
    try:
        pr = subprocess.run([LLAMA_PYTHON, "-c", "from importlib.metadata import version; "
                             "print(version('llama_cpp_python'))"], capture_output=True, text=True,
                            timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return pr.stdout.strip() or None if pr.returncode == 0 else None


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (plus uncommitted changes)" if dirty else "")
    except OSError:
        return "?"


# ==========================================================================
# Report
# ==========================================================================

def _med(v: list[float]) -> str:
    if not v:
        return "—"
    if len(v) == 1:
        return f"{v[0]:.1f}"
    return f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})"


def engine_bytes(results, engine: str, ty: str, t: int, per_tok: dict) -> tuple[float, str]:
    """(bytes read per decoded token, source) for a row: the runtime's measured stats of the
    tg loop (median over passes) when present, else the file-based figure."""
    r = results.get((engine, ty, t), {})
    meas = [x["bytes_per_token"] for x in r.get("stats", []) if x and x.get("bytes_per_token")]
    if meas:
        return statistics.median(meas), "measured"
    b = per_tok.get((engine, ty), 0)
    return b, "file" if b else ""


def make_table(results, types, threads, engines, bw, per_tok, n_pp=128, n_tg=128,
               skipped: dict[str, str] | None = None) -> str:
    """One row per engine, type and thread count; engines in `skipped` (engine -> reason)
    get a row giving the reason; with ours-sparse and ours both run, a last column
    compares the sparse decode with ours dense (the reference where llama.cpp lacks the
    architecture)."""
    skipped = skipped or {}
    vs_dense = "ours-sparse" in engines and "ours" in engines
    rows = [f"| engine | type | threads | pp{n_pp} t/s | tg{n_tg} t/s | MB read per token | "
            f"decode limit t/s | tg{n_tg} % of limit | pp vs llama.cpp | tg vs llama.cpp |"
            + (" tg vs ours dense |" if vs_dense else ""),
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if vs_dense else "")]
    for ty in types:
        for t in threads:
            ref = results.get(("llama.cpp", ty, t), {})
            dense = results.get(("ours", ty, t), {})
            for e, why in skipped.items():
                rows.append(f"| {e} (not run: {why}) | {ty.upper()} | {t} | — | — | — | — | — | — | — |"
                            + (" — |" if vs_dense else ""))
            for e in engines:
                r = results.get((e, ty, t), {})
                pp, tg = r.get("pp", []), r.get("tg", [])
                nb, src = engine_bytes(results, e, ty, t, per_tok)
                lim = bw.get(t, {}).get("best", 0) * 1e9 / nb if nb and bw.get(t) else 0
                pct = f"{100 * statistics.median(tg) / lim:.0f}%" if tg and lim else "—"
                if e == "llama.cpp" or not ref.get("tg"):
                    rp = rt = "—"
                else:
                    rp = f"{statistics.median(pp) / statistics.median(ref['pp']):.2f}x" if pp else "—"
                    rt = f"{statistics.median(tg) / statistics.median(ref['tg']):.2f}x" if tg else "—"
                err = " (failed)" if r.get("errors") and not tg else ""
                mb = f"{nb / 1e6:.0f}" + (" (file)" if src == "file" and e == "ours-sparse" else "") if nb else "—"
                rd = ""
                if vs_dense:
                    rd = (f" {statistics.median(tg) / statistics.median(dense['tg']):.2f}x |"
                          if e == "ours-sparse" and tg and dense.get("tg") else " — |")
                rows.append(f"| {e}{err} | {ty.upper()} | {t} | {_med(pp)} | {_med(tg)} | {mb} | "
                            f"{lim:.1f} | {pct} | {rp} | {rt} |{rd}" if lim else
                            f"| {e}{err} | {ty.upper()} | {t} | {_med(pp)} | {_med(tg)} | {mb} | — | {pct} | "
                            f"{rp} | {rt} |{rd}")
    return "\n".join(rows)


def sparse_stats_md(results, types, threads) -> str:
    """Per-row runtime statistics of the sparse engine's tg loop (medians over passes)."""
    out = []
    for ty in types:
        for t in threads:
            st = [x for x in results.get(("ours-sparse", ty, t), {}).get("stats", []) if x]
            if not st:
                continue

            def med(k):
                return statistics.median(x[k] for x in st)
            n = med("n_tokens") or 1
            tt = med("t_total") or 1e-30
            out.append(f"| {ty.upper()} | {t} | {100 * med('density'):.1f}% | "
                       f"{med('bytes_attention') / n / 1e6:.0f} | {med('bytes_predictor') / n / 1e6:.0f} | "
                       f"{med('bytes_ffn') / n / 1e6:.0f} | {med('bytes_head') / n / 1e6:.0f} | "
                       + " | ".join(f"{100 * med(k) / tt:.0f}%" for k in ("t_attention", "t_predictor", "t_ffn",
                                                                       "t_other")) + " |")
    if not out:
        return ""
    return "\n".join(["| type | threads | predicted density | MB/token attention | predictor | FFN | head | "
                      "time: attention | predictor | FFN | other |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"] + out)


def ops_table(ops: dict, threads: list[int], bw: dict, tg_ours: dict) -> str:
    """ops[(type, t)] = worker_ops output."""
    out = []
    for (ty, t), o in ops.items():
        one, many = o.get("1", {}), {k: v for k, v in o.items() if k != "1"}
        many = next(iter(many.values()), {})
        out.append(f"\n**{ty.upper()}, {t} thread(s)** (bandwidth {bw.get(t, {}).get('best', 0):.1f} GB/s)\n")
        out.append("| weight | rows x cols | MB | 1 token: µs | GB/s | 128 tokens: ms | GFLOP/s |")
        out.append("|---|---|---|---|---|---|---|")
        total_1 = total_n = 0.0
        for k, v in one.items():
            v2 = many.get(k, {})
            total_1 += v["s_per_call"] * v["calls_per_token"]
            total_n += v2.get("s_per_call", 0) * v2.get("calls_per_token", 0)
            out.append(f"| {k} | {v.get('shape', '')} | {v['bytes'] / 1e6:.1f} | {v['s_per_call'] * 1e6:.0f} | "
                       f"{v['bytes'] / v['s_per_call'] / 1e9:.1f} | "
                       f"{v2.get('s_per_call', 0) * 1e3:.1f} | "
                       f"{v2.get('flop', 0) / v2['s_per_call'] / 1e9 if v2.get('s_per_call') else 0:.0f} |")
        tg = tg_ours.get((ty, t))
        step = f"; measured decode step {1e3 / tg:.1f} ms" if tg else ""
        out.append(f"\nAll matmuls of one token: {total_1 * 1e3:.1f} ms (= {1 / total_1:.1f} tokens/s if "
                   f"nothing else cost time){step}. All matmuls of a 128-token batch: {total_n * 1e3:.0f} ms "
                   f"(= {128 / total_n:.0f} tokens/s)." if total_1 and total_n else "")
    return "\n".join(out)


def write_docs(block: str, name: str | None = None) -> None:
    """Replace the results block (`name`: its own named block, so that the runs of several
    models each keep theirs; a new one goes right after the main block)."""
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    if name:
        begin_key, end = f"<!-- BENCH-BEGIN {name} ", f"<!-- BENCH-END {name} -->"
        begin = f"{begin_key}(written by tools/bench.py --write-docs --docs-block {name}) -->"
    else:
        begin_key, begin, end = BEGIN, BEGIN, END
    body = f"{begin}\n{block.rstrip()}\n{end}\n"
    if DOCS.is_file():
        text = DOCS.read_text()
        if begin_key in text and end in text:
            pre, rest = text.split(begin_key, 1)
            post = rest.split(end, 1)[1]
            DOCS.write_text(pre + body + post.lstrip("\n"))
            return
        if name:
            if END in text:
                pre, post = text.split(END, 1)
                DOCS.write_text(pre + END + "\n" + body + post.lstrip("\n"))
            else:
                DOCS.write_text(text.rstrip("\n") + "\n\n" + body)
            return
    DOCS.write_text("# Benchmarks\n\nDense speed of powerinfer-cpp vs llama.cpp on the same GGUF files, "
                    "measured with `tools/bench.py`\n(method in its docstring). Regenerate the block below with "
                    "`--write-docs`; text outside it is kept.\n\n" + body)


# ==========================================================================
# Main
# ==========================================================================

def main(argv=None) -> int:
    from make_bench_model import (add_shape_args, ensure_models, ensure_sparse_models, finish_shape_args,
                                  model_root)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="f16,q4_0", help="GGUF types (default f16,q4_0)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--passes", type=int, default=3, help="passes, engines alternating (default 3)")
    ap.add_argument("--n-pp", type=int, default=128, help="prompt batch (default 128)")
    ap.add_argument("--n-tg", type=int, default=128, help="decode steps (default 128)")
    ap.add_argument("--depth", type=int, default=0, metavar="D",
                    help="tokens in the KV cache before the timed decode steps (llama-bench -d; default 0)")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="llama.cpp,ours,ours-sparse (default all three; --plain: no ours-sparse)")
    ap.add_argument("--model", action="append", default=[], metavar="TYPE=PATH",
                    help="use this dense GGUF for TYPE instead of making the bench model (repeatable)")
    ap.add_argument("--sparse-model", action="append", default=[], metavar="TYPE=PATH",
                    help="use this sparse GGUF for TYPE (ours-sparse) instead of making it (repeatable)")
    ap.add_argument("--ops", action="store_true", help="also time our matmuls per weight kind")
    ap.add_argument("--no-membw", action="store_true", help="skip the bandwidth measurement")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="before each measurement wait up to S seconds for the machine to go idle "
                         "(other processes < 0.15 cores); default 0 = do not wait")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per worker (default 300)")
    ap.add_argument("--simd", choices=("auto", "avx2", "avx512"), default="auto",
                    help="SIMD level of our engine (GH_SIMD); pair avx2 with --llama-python of an "
                         "AVX2 build of llama.cpp to compare the AVX2 paths on an AVX-512 machine")
    ap.add_argument("--llama-python", default=sys.executable, metavar="PYTHON",
                    help="interpreter whose llama-cpp-python runs the llama.cpp workers (default: "
                         "this one); the table says which ISA each engine ran")
    ap.add_argument("--write-docs", action="store_true", help=f"write the results into {DOCS.relative_to(REPO)}")
    ap.add_argument("--docs-block", metavar="NAME",
                    help="with --write-docs: write into the block NAME (made after the main block when new) "
                         "instead of the main one")
    ap.add_argument("--json", help="also save raw results to this file")
    add_shape_args(ap)
    # worker mode (internal)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    global DEPTH
    if a.depth < 0:
        sys.exit("error: --depth must be >= 0")
    DEPTH = a.depth
    if a.worker:
        res = WORKERS[a.worker](a.model[0], a.worker_threads, a.n_pp, a.n_tg)
        print(json.dumps(res))
        return 0

    global LLAMA_PYTHON, OUR_SIMD
    LLAMA_PYTHON = a.llama_python
    OUR_SIMD = None if a.simd == "auto" else a.simd
    finish_shape_args(a)
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    threads = [int(t) for t in a.threads.split(",")]
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            sys.exit(f"error: unknown engine {e!r}")
    if a.kind == "plain" and "ours-sparse" in engines and not a.sparse_model:
        engines = [e for e in engines if e != "ours-sparse"]
    lver = llama_version()
    skipped: dict[str, str] = {}    # engine -> why it has no measurement (a row says so)
    if "llama.cpp" in engines and lver is None:
        print(LLAMA_HINT, file=sys.stderr)
        print("Running our side only.\n", file=sys.stderr)
        engines = [e for e in engines if e != "llama.cpp"]
        skipped["llama.cpp"] = "llama-cpp-python not installed"

    # models
    given = dict(m.split("=", 1) for m in a.model)
    a.types = [t for t in types if t not in given]
    a.progress = False
    paths = {t: str(p) for t, p in ensure_models(a).items()} if a.types else {}
    paths.update(given)
    archs, tied = {}, {}
    for t in types:
        archs[t], tied[t] = gguf_arch(paths[t])
    lacks = sorted({x for x in archs.values() if x in LLAMA_CPP_LACKS})
    if ("llama.cpp" in engines or "llama.cpp" in skipped) and lacks:
        print(f"llama.cpp has no {', '.join(lacks)} architecture: no llama.cpp rows; the sparse engine is "
              "compared with ours dense", file=sys.stderr)
        engines = [e for e in engines if e != "llama.cpp"]
        skipped["llama.cpp"] = f"llama.cpp has no {', '.join(lacks)} architecture"
    sgiven = dict(m.split("=", 1) for m in a.sparse_model)
    spaths: dict[str, str] = {}
    if "ours-sparse" in engines:
        a.types = [t for t in types if t not in sgiven]
        spaths = {t: str(p) for t, p in ensure_sparse_models(a).items()} if a.types else {}
        spaths.update(sgiven)
    pipeline = {}
    try:
        pipeline = json.loads((model_root(a) / "pipeline.json").read_text())
    except (OSError, ValueError):
        pass
    per_tok, total_bytes, sparse_bytes = {}, {}, {}
    for t in types:
        per_tok[t], total_bytes[t] = weight_bytes(paths[t])
        per_tok[("llama.cpp", t)] = per_tok[("ours", t)] = per_tok[t]
        if t in spaths:
            preds = pipeline.get("sparse", {}).get(t, {}).get("predictors") if not sgiven.get(t) else None
            sparse_bytes[t] = sparse_file_bytes(spaths[t], [x["pred_density"] for x in preds] if preds else None)
            per_tok[("ours-sparse", t)] = sparse_bytes[t]["total"]
    model_of = {"llama.cpp": paths, "ours": paths, "ours-sparse": spaths}

    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    load_before, top_before = loadavg(), top_procs()
    print(f"load average before: {load_before}" + (f"; busy: {top_before}" if top_before else ""),
          file=sys.stderr)
    started = _dt.datetime.now().astimezone()
    t_start = time.time()
    bw = {} if a.no_membw else membw(threads, cache)
    for t, b in bw.items():
        print(f"memory read bandwidth, {t} thread(s): {b['best']:.1f} GB/s (median {b['median']:.1f})",
              file=sys.stderr)

    results: dict = {}
    foreign: list[float] = []
    for p in range(a.passes):
        order = engines if p % 2 == 0 else engines[::-1]
        for ty in types:
            for t in threads:
                for e in order:
                    if a.wait_idle > 0:
                        wait_idle(a.wait_idle)
                    r = run_worker(e, model_of[e][ty], t, a.n_pp, a.n_tg, a.timeout)
                    slot = results.setdefault((e, ty, t), {"pp": [], "tg": [], "errors": [], "foreign": [],
                                                           "stats": []})
                    if "error" in r:
                        slot["errors"].append(r["error"])
                        print(f"pass {p + 1} {e:9s} {ty:5s} t={t}: ERROR {r['error']}", file=sys.stderr)
                        continue
                    slot["pp"].append(r["pp"])
                    slot["tg"].append(r["tg"])
                    slot["foreign"].append(r["foreign_cores"])
                    slot["stats"].append(r.get("stats"))
                    slot["info"] = r.get("info", "")
                    foreign.append(r["foreign_cores"])
                    print(f"pass {p + 1} {e:9s} {ty:5s} t={t}: pp {r['pp']:7.1f}  tg {r['tg']:6.1f} tokens/s"
                          f"  (load {r['load_s']:.1f} s, other processes {r['foreign_cores']:.2f} cores)",
                          file=sys.stderr)

    ops = {}
    if a.ops:
        for ty in types:
            for t in threads:
                r = run_worker("ops", paths[ty], t, a.n_pp, a.n_tg, a.timeout)
                if "error" in r:
                    print(f"ops {ty} t={t}: ERROR {r['error']}", file=sys.stderr)
                    continue
                r.pop("foreign_cores", None)
                r.pop("wall_s", None)
                ops[(ty, t)] = r
    elapsed = time.time() - t_start
    load_after = loadavg()

    table = make_table(results, types, threads, engines, bw, per_tok, a.n_pp, a.n_tg, skipped)
    tg_ours = {(ty, t): statistics.median(results[("ours", ty, t)]["tg"])
               for ty in types for t in threads if results.get(("ours", ty, t), {}).get("tg")}
    ops_md = ops_table(ops, threads, bw, tg_ours) if ops else ""
    cmd = "GH_LIBRARY=... PYTHONPATH=python python tools/bench.py " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    fmax = max(foreign) if foreign else 0.0
    fmean = statistics.mean(foreign) if foreign else 0.0
    load_note = (f"load average (1/5/15 min) {load_before} before, {load_after} after; other processes used "
                 f"{fmean:.2f} cores on average (max {fmax:.2f}) while workers ran"
                 + (f"; busiest before: {top_before}" if top_before else ""))
    quiet = fmax < 0.15
    if not quiet:
        print("warning: other processes were busy during the run; the numbers are noisy", file=sys.stderr)
    bw_line = ", ".join(f"{t} thread(s) {b['best']:.1f} GB/s" for t, b in bw.items()) or "not measured"
    sizes = "; ".join(f"{ty.upper()}: {total_bytes[ty] / 1e6:.0f} MB of tensors, {per_tok[ty] / 1e6:.0f} MB read "
                      f"per token dense" + (f", {sparse_bytes[ty]['total'] / 1e6:.0f} MB sparse (file-based: "
                                            f"attention {sparse_bytes[ty]['attention'] / 1e6:.0f}, predictor "
                                            f"{sparse_bytes[ty]['predictor'] / 1e6:.0f}, FFN "
                                            f"{sparse_bytes[ty]['ffn'] / 1e6:.0f} of "
                                            f"{sparse_bytes[ty]['ffn_dense'] / 1e6:.0f}, head "
                                            f"{sparse_bytes[ty]['head'] / 1e6:.0f})"
                                            if ty in sparse_bytes else "") for ty in types)
    limits = "; ".join(f"{ty.upper()} {t}t: {bw[t]['best'] * 1e9 / per_tok[ty]:.0f}"
                       + (f" / {bw[t]['best'] * 1e9 / engine_bytes(results, 'ours-sparse', ty, t, per_tok)[0]:.0f}"
                          if engine_bytes(results, 'ours-sparse', ty, t, per_tok)[0] else "")
                       for ty in types for t in threads if t in bw)
    infos = sorted({f"{e}: {r['info']}" for (e, _, _), r in results.items() if r.get("info")})
    errors = [f"{e} {ty} t={t}: {x}" for (e, ty, t), r in results.items() for x in r["errors"]]
    lib = os.environ.get("GH_LIBRARY", "(default search)")

    sparse_eng = "ours-sparse" in engines
    constructed = a.kind == "sparse" and (not given or all("-sc" in Path(p).name for p in given.values()))
    arch_txt = "/".join(sorted(set(archs.values()))) or "?"
    if constructed and a.arch == "opt":
        kind_txt = ("synthetic pre-LN OPT (ungated ReLU FFN with biases, LayerNorm, learned positions, MHA), "
                    "weights constructed for activation sparsity (tools/make_bench_model.py --arch opt; see "
                    "\"The sparse benchmark model\")")
    elif constructed:
        kind_txt = ("synthetic LLaMA with ReGLU FFN, weights constructed for activation sparsity "
                    "(tools/make_bench_model.py; see \"The sparse benchmark model\")")
    elif a.kind == "swiglu" and not given:
        kind_txt = (f"synthetic LLaMA with SwiGLU FFN, random weights; ours-sparse runs the gate mode of "
                    f"`convert --sparsity {a.sparsity:g}` (tools/make_bench_model.py --swiglu)")
    elif given:
        kind_txt = f"GGUF architecture {arch_txt}, files given with --model"
    else:
        kind_txt = {"llama": "synthetic LLaMA, random weights",
                    "qwen2": "synthetic Qwen2 (Qwen2.5-1.5B's shape, vocab 32000), random weights",
                    "falcon": "synthetic Falcon (new_decoder_architecture: GQA, ln_attn + ln_mlp, parallel "
                              "block, fused QKV, GELU FFN of 4d), random weights",
                    "llama3": "synthetic Llama-3 (Llama-3.2-1B's shape and llama3 rope scaling, vocab 32000), "
                              "random weights"}.get(a.arch, f"synthetic {a.arch}, random weights")
        kind_txt += f" (tools/make_bench_model.py --plain --arch {a.arch}; GGUF architecture {arch_txt})"
    md = [f"### {'Dense and sparse' if sparse_eng else 'Dense'} decode and prompt speed, "
          f"{started:%Y-%m-%d %H:%M %Z}", "",
          f"- Command: `{cmd}` (library: `{lib}`)",
          f"- Tree: {git_rev()}",
          f"- CPU: {cpu_model()}; kernel {platform.release()}",
          f"- llama-cpp-python: {lver or 'not installed'} (llama.cpp bundled with it, driven through its C API"
          + (f"; not run: {skipped['llama.cpp']}" if "llama.cpp" in skipped else "") + "); "
          + "; ".join(i for i in infos if not i.startswith("llama.cpp:")),
          f"- Model: {Path(paths[types[0]]).name.rsplit('-', 1)[0]} ({kind_txt}); {sizes}. "
          f"Q4_0 files keep token_embd and output in Q8_0 (the converter's choice), for both engines"
          + ("; the head is tied (token_embd, read whole every step)" if any(tied.values()) else "")
          + ("; sparse files store the predictors in " + ", ".join(
              f"{predictor_types(spaths[t])} ({t.upper()} file)" for t in types if t in spaths) + "."
             if sparse_eng and a.kind != "swiglu" else
             "; the gate-mode files hold per-layer gate thresholds, no predictors." if sparse_eng else "."),
          f"- Memory read bandwidth (tools/membw.c, best of 5): {bw_line}. "
          f"Decode limit = bandwidth / bytes read per token"
          + (" (dense / sparse)" if sparse_eng else "") + f": {limits or '—'} tokens/s."
          + (" Sparse bytes per token: measured by the runtime (gh_context_get_stats) over the tg loop, "
             "or, where marked (file), computed from the sparse file and the conversion report."
             if sparse_eng else ""),
          f"- Load: {load_note}." + ("" if quiet else " **The machine was not idle: treat these numbers as "
                                                    "noisy and re-run on a quiet machine.**"),
          f"- {a.passes} passes, engines alternating, each measurement in a fresh process; median (min–max) "
          f"tokens/s; pp{a.n_pp} = one {a.n_pp}-token batch into an empty cache, tg{a.n_tg} = {a.n_tg} "
          f"single-token steps after an {N_TG_PROMPT + DEPTH}-token prompt"
          + (f" (decode at a depth of {DEPTH} tokens of context; both engines keep an F16 KV cache)" if DEPTH else "")
          + f". Run time {elapsed / 60:.1f} min.",
          "", table, ""]
    sst = sparse_stats_md(results, types, threads) if sparse_eng else ""
    if sst:
        md += ["Sparse engine, runtime statistics of the tg loop (medians over passes):", "", sst, ""]
    if errors:
        md += ["Errors:", ""] + [f"- {x}" for x in errors] + [""]
    if ops_md:
        md += ["#### Our matmuls, per weight kind (gh_op_matmul on the model's weights, in model order)", "",
               ops_md, ""]
    report = "\n".join(md)
    print(report)
    if a.json:
        Path(a.json).write_text(json.dumps({"results": {"|".join(map(str, k)): v for k, v in results.items()},
                                            "bw": bw, "per_tok": {"|".join(map(str, k)) if isinstance(k, tuple)
                                                                  else k: v for k, v in per_tok.items()},
                                            "sparse_bytes": sparse_bytes,
                                            "ops": {f"{k[0]}|{k[1]}": v for k, v in ops.items()},
                                            "load": load_note}, indent=1))
    if a.write_docs:
        write_docs(report, a.docs_block)
        print(f"wrote {DOCS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
