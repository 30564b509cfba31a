"""The engine server's Prometheus metrics (``GET /metrics``), under SGLang's names.

Why SGLang's names: operators scale engines on SGLang's metrics (upstream Relax drives KEDA with
``sglang:num_running_reqs`` and ``sglang:num_queue_reqs``); a scaler written for an SGLang engine works on
ours unchanged. Counted around every generation the server runs (``/generate``, chat, completions):
requests waiting (held while generation is paused for a weight update) and running, prompt and generated
tokens, end-to-end latency as a histogram, the weight version, and the requests refused with 503 by
admission control (``--max-queued-requests``; ``relax:num_refused_requests_total``, a relax name: SGLang
counts no such refusals). Rendered by hand in Prometheus' text
format 0.0.4 (a few lines; no client library needed).
"""

from __future__ import annotations

import math
import threading

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf)
"""Upper bounds (seconds) of the latency histogram's buckets."""


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queued = self.running = 0
        self.requests = self.prompt_tokens = self.generation_tokens = 0
        self.refused = 0
        self.latency_sum = 0.0
        self.latency_buckets = [0] * len(BUCKETS)

    def queue(self, n: int) -> None:
        with self._lock:
            self.queued += n

    def start(self, n: int, prompt_tokens: int) -> None:
        with self._lock:
            self.queued -= n
            self.running += n
            self.prompt_tokens += prompt_tokens

    def refuse(self) -> None:
        """A request refused with 503: the server held its limit of requests (``--max-queued-requests``)."""
        with self._lock:
            self.refused += 1

    def finish(self, n: int, generation_tokens: int, seconds: float, started: bool = True) -> None:
        """``n`` requests ended after ``seconds`` (``started``: they ran; else they left the queue unrun)."""
        with self._lock:
            if started:
                self.running -= n
            else:
                self.queued -= n
            self.requests += n
            self.generation_tokens += generation_tokens
            self.latency_sum += seconds * n
            for i, bound in enumerate(BUCKETS):  # the first bucket that holds it (rendered cumulatively)
                if seconds <= bound:
                    self.latency_buckets[i] += n
                    break

    def render(self, model: str, weight_version: str) -> str:
        lab = f'model_name="{model}"'
        with self._lock:
            lines = [
                *_metric("num_running_reqs", "gauge", "Requests generating now.", lab, self.running),
                *_metric(
                    "num_queue_reqs", "gauge", "Requests waiting (generation paused).", lab, self.queued
                ),
                *_metric(
                    "prompt_tokens_total",
                    "counter",
                    "Prompt tokens of the requests run.",
                    lab,
                    self.prompt_tokens,
                ),
                *_metric(
                    "generation_tokens_total", "counter", "Tokens generated.", lab, self.generation_tokens
                ),
                *_metric("num_requests_total", "counter", "Requests finished.", lab, self.requests),
                "# HELP sglang:e2e_request_latency_seconds End-to-end request latency.",
                "# TYPE sglang:e2e_request_latency_seconds histogram",
            ]
            for bound, count in zip(BUCKETS, self._cumulative()):
                le = "+Inf" if math.isinf(bound) else f"{bound:g}"
                lines.append(f'sglang:e2e_request_latency_seconds_bucket{{{lab},le="{le}"}} {count}')
            lines.append(f"sglang:e2e_request_latency_seconds_sum{{{lab}}} {self.latency_sum:.6f}")
            lines.append(f"sglang:e2e_request_latency_seconds_count{{{lab}}} {self.requests}")
            refused = self.refused
        lines += [
            "# HELP relax:num_refused_requests_total Generation requests refused with 503 "
            "(over --max-queued-requests).",
            "# TYPE relax:num_refused_requests_total counter",
            f"relax:num_refused_requests_total{{{lab}}} {refused}",
            "# HELP relax:weight_version The policy version of the weights served.",
            "# TYPE relax:weight_version gauge",
            f"relax:weight_version{{{lab}}} {_number(weight_version)}",
        ]
        return "\n".join(lines) + "\n"

    def _cumulative(self) -> list[int]:
        out, total = [], 0
        for count in self.latency_buckets:
            total += count
            out.append(total)
        return out


def _metric(name: str, kind: str, help_: str, labels: str, value: float) -> list[str]:
    return [
        f"# HELP sglang:{name} {help_}",
        f"# TYPE sglang:{name} {kind}",
        f"sglang:{name}{{{labels}}} {value}",
    ]


def _number(version: str) -> str:
    try:
        return str(int(version))
    except ValueError:
        return "NaN"
