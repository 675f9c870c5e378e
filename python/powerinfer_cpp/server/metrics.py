"""Counters behind /metrics, rendered in Prometheus' text exposition format."""

from __future__ import annotations

import collections
import threading

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health",
           "/metrics", "/")


class Metrics:
    """Request, token and speed counters of one server (updated from the event loop and
    the workers, hence the lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (route, status) -> n
        self.rejected = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.decode_seconds = 0.0
        self.prompt_seconds = 0.0
        self.generations = 0
        self.cancelled = 0      # generations stopped because the client went away
        self.last_tok_per_s = 0.0
        self.last_density: float | None = None
        self.sparse_tokens = 0
        self.active_sum = 0.0   # density x sparse tokens, summed: the mean over all replies

    def count(self, path: str, status: int) -> None:
        """One HTTP request answered with `status`."""
        route = path if path in _ROUTES else ("/static" if path.startswith("/static/")
                                              else "other")
        with self._lock:
            self.requests[(route, status)] += 1

    def record(self, result, stats: dict) -> None:
        """A finished generation: its Completion and the context's stats()."""
        t = result.timings or {}
        with self._lock:
            self.generations += 1
            self.cancelled += result.finish_reason == "cancelled"
            self.prompt_tokens += result.n_prompt_tokens
            self.cached_tokens += getattr(result, "n_cached_tokens", 0)
            self.completion_tokens += len(result.tokens)
            self.decode_seconds += t.get("decode_s", 0.0)
            self.prompt_seconds += t.get("prompt_s", 0.0)
            self.last_tok_per_s = t.get("decode_tok_per_s", 0.0)
            n_sparse = stats.get("n_sparse_tokens", 0) if stats else 0
            if n_sparse:
                self.last_density = stats["density"]
                self.sparse_tokens += n_sparse
                self.active_sum += stats["density"] * n_sparse

    def render(self, busy: int, waiting: int, n_slots: int,
               batched: tuple[int, int] = (0, 0)) -> str:
        """The text /metrics answers; batched: the batching scheduler's forward passes of
        two or more slots' tokens, and the tokens they evaluated."""
        with self._lock:
            lines = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP powerinfer_{name} {help_}")
                lines.append(f"# TYPE powerinfer_{name} {kind}")
                for labels, value in samples:
                    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                    lines.append(f"powerinfer_{name}{{{lab}}} {value}" if lab
                                 else f"powerinfer_{name} {value}")

            metric("requests_total", "counter", "HTTP requests answered, by route and status",
                   [({"route": r, "status": s}, n) for (r, s), n in sorted(self.requests.items())]
                   or [({}, 0)])
            metric("requests_rejected_total", "counter",
                   "requests refused with 503 because the slots and the queue were full",
                   [({}, self.rejected)])
            metric("generations_total", "counter", "generations finished", [({}, self.generations)])
            metric("generations_cancelled_total", "counter",
                   "generations stopped early because their client disconnected",
                   [({}, self.cancelled)])
            metric("prompt_tokens_total", "counter", "prompt tokens of finished generations",
                   [({}, self.prompt_tokens)])
            metric("prompt_tokens_cached_total", "counter",
                   "prompt tokens reused from a slot's KV cache", [({}, self.cached_tokens)])
            metric("completion_tokens_total", "counter", "tokens generated",
                   [({}, self.completion_tokens)])
            metric("prompt_seconds_total", "counter", "seconds spent evaluating prompts",
                   [({}, round(self.prompt_seconds, 6))])
            metric("decode_seconds_total", "counter", "seconds spent decoding",
                   [({}, round(self.decode_seconds, 6))])
            rate = self.completion_tokens / self.decode_seconds if self.decode_seconds else 0.0
            metric("decode_tokens_per_second", "gauge",
                   "decode speed over all generations (completion tokens / decode seconds)",
                   [({}, round(rate, 3))])
            metric("last_decode_tokens_per_second", "gauge", "decode speed of the last generation",
                   [({}, round(self.last_tok_per_s, 3))])
            mean = self.active_sum / self.sparse_tokens if self.sparse_tokens else 0.0
            metric("ffn_density", "gauge",
                   "fraction of FFN neurons computed per sparse decode token, over all generations",
                   [({}, round(mean, 6))])
            metric("last_ffn_density", "gauge", "FFN density of the last generation",
                   [({}, round(self.last_density or 0.0, 6))])
            metric("slots", "gauge", "generation slots", [({}, n_slots)])
            metric("slots_busy", "gauge", "slots generating now", [({}, busy)])
            metric("queue_length", "gauge", "requests waiting for a slot", [({}, waiting)])
            metric("batched_steps_total", "counter",
                   "forward passes that evaluated the next tokens of two or more slots at once",
                   [({}, batched[0])])
            metric("batched_tokens_total", "counter", "tokens those batched passes evaluated",
                   [({}, batched[1])])
            return "\n".join(lines) + "\n"
