"""The server's settings: what `python -m powerinfer_cpp.server` was started with
(__main__.py reads them from the command line), and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Settings:
    """What `python -m powerinfer_cpp.server` was started with."""

    model: str
    alias: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 1
    queue: int = 16
    n_ctx: int = 0
    threads: int = 0            # of a forward pass; 0 = every core with batching (one pass
                                # runs at a time), else the cores divided among the slots
    batching: bool = True       # continuous batching (batching.py); False: a thread per slot
    prompt_chunk: int = 256     # tokens per batched pass: decode tokens + a prompt chunk
    max_tokens: int = 0         # cap on a request's max_tokens; 0 = the context size
    max_body: int = 1 << 20     # bytes
    api_key: str | None = None
    ffn: str = "auto"
    device: str = "cpu"
    vram_budget: str | None = None
    n_cpu_moe: int = 0               # MoE: the experts of the first N layers stay on the CPU
    expert_cache: str | None = None  # MoE: each context's device cache of CPU experts
    chat_template: str | None = None
    chat_template_from_flag: bool = False  # --chat-template-file: over a limit, refuse to start
    template_timeout: float = 2.0    # s: a chat template's render deadline
    template_memory: int = 256       # MiB a template worker may grow by
    tokenize_timeout: float = 10.0   # s: a long prompt's tokenizing
    body_timeout: float = 30.0       # s: a POST body's arrival, from its headers
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    draft: str | None = None         # speculative decoding: "self" or a draft model's file
    draft_max: int | None = None     # most tokens drafted per verification (None: default)
    cache_ram: int = 1024            # MiB of evicted prompt prefixes kept (0: off, -1: no limit)
    slot_save_path: str | None = None  # the directory of POST /slots/{id}?action=save|restore

    def check(self) -> None:
        """ValueError naming the first setting out of range (before the model is loaded);
        makes slot_save_path's directory."""
        if self.parallel < 1:
            raise ValueError("--parallel must be >= 1")
        if self.queue < 0:
            raise ValueError("--queue must be >= 0")
        if self.prompt_chunk < 1:
            raise ValueError("--prompt-chunk must be >= 1")
        if self.draft is None and self.draft_max is not None:
            raise ValueError("--draft-max needs a drafter: --draft self or --model-draft FILE")
        if self.cache_ram < -1:
            raise ValueError("--cache-ram must be >= 0 MiB (0: off) or -1 (no limit)")
        if self.slot_save_path:
            d = Path(self.slot_save_path)
            if d.exists() and not d.is_dir():
                raise ValueError(f"--slot-save-path {d} is not a directory")
            d.mkdir(parents=True, exist_ok=True)

