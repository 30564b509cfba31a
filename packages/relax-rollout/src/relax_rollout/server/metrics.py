"""The engine server's Prometheus metrics (``GET /metrics``), under SGLang 0.5.23's names, labels and buckets.

Why SGLang's names: operators scale and watch engines on SGLang's metrics (upstream Relax drives KEDA with
``sglang:num_running_reqs`` and ``sglang:num_queue_reqs``; Grafana boards plot
``sglang:time_to_first_token_seconds`` and ``sglang:inter_token_latency_seconds``); a scaler or a board
written for an SGLang engine works on ours unchanged. The names, labels and histogram buckets are those of
SGLang's ``observability/metrics_collector.py``: the request-side ones (token counters, requests, TTFT,
ITL, end-to-end latency) labelled ``model_name`` and ``engine_type`` (plus ``is_streaming`` where SGLang
splits them), the scheduler-side gauges also ``tp_rank``, ``pp_rank`` and ``moe_ep_rank`` (one rank here).

What is served is what this server measures: requests waiting (generation paused for a weight update, or
behind admission) and running, queue time, prompt and generated tokens, time to the first token and
between tokens (token by token from engines that stream, :data:`~relax_rollout.engines.base.OPTIONAL_FEATURES`),
end-to-end latency, aborted requests, the generation throughput over the last
:data:`THROUGHPUT_WINDOW_S` seconds, and ``sglang:cache_hit_rate`` 0 (no prefix cache here). Two relax
names: ``relax:num_refused_requests_total`` (503s of admission control, ``--max-queued-requests``) and
``relax:weight_version``.

Rendered by ``prometheus_client`` from a registry of this server's own (several servers in one process do
not share counters): Prometheus' text format 0.0.4 by default, OpenMetrics when the scraper's ``Accept``
asks for it (as Prometheus does), label values escaped either way. It was hand-written text before, which
OpenMetrics parsers refused.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
"""``sglang:time_to_first_token_seconds`` buckets (SGLang's defaults)."""
# fmt: off
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
    0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)
"""``sglang:inter_token_latency_seconds`` buckets (SGLang's defaults)."""
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
"""``sglang:e2e_request_latency_seconds`` buckets (SGLang's defaults)."""
QUEUE_BUCKETS = (
    0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80,
    90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)
# fmt: on
"""``sglang:queue_time_seconds`` buckets (SGLang's)."""
THROUGHPUT_WINDOW_S = 10.0
"""``sglang:gen_throughput`` is the tokens generated over this many last seconds, per second (SGLang's is
over its last log interval)."""

REQUEST_LABELS = ("model_name", "engine_type")
"""SGLang's tokenizer-side labels (``engine_type`` "unified": no prefill/decode disaggregation here)."""
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
"""SGLang's scheduler-side labels (one rank of each here)."""


class ServerMetrics:
    """The counters of one engine server, in a registry of its own (``self.registry``). Call
    :meth:`bind` with the served model's name before the first request."""

    def __init__(self, model_name: str = "default") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self.queued = self.running = 0
        self.requests = self.refused = 0
        """Requests ended and requests refused so far (plain counts, for whoever embeds the server)."""
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated then): the throughput
        self._started = time.monotonic()
        self._weight_version: Callable[[], float] = lambda: float("nan")
        r = self.registry
        sched = list(SCHEDULER_LABELS)
        self._running = Gauge("sglang:num_running_reqs", "The number of running requests.", sched, registry=r)
        self._queue = Gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue (held while generation is paused, or behind others).",
            sched,
            registry=r,
        )
        self._throughput = Gauge(
            "sglang:gen_throughput",
            f"The generation throughput (token/s) over the last {THROUGHPUT_WINDOW_S:g} s.",
            sched,
            registry=r,
        )
        self._cache_hit = Gauge(
            "sglang:cache_hit_rate", "The prefix cache hit rate (no prefix cache here: 0).", sched, registry=r
        )
        self._queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            sched,
            registry=r,
            buckets=QUEUE_BUCKETS,
        )
        self._request_series(r)
        self._refused = Counter(
            "relax:num_refused_requests_total",
            "Generation requests refused with 503 (over --max-queued-requests).",
            ["model_name"],
            registry=r,
        )
        self._version = Gauge(
            "relax:weight_version", "The policy version of the weights served.", ["model_name"], registry=r
        )
        # fmt: off
        self._all = [
            self._running, self._queue, self._throughput, self._cache_hit, self._queue_time,
            self._prompt_tokens, self._generation_tokens, self._requests, self._aborted, self._ttft, self._itl,
            self._e2e, self._refused, self._version,
        ]
        # fmt: on
        self.bind(model_name)

    def _request_series(self, r: CollectorRegistry) -> None:
        """The tokenizer-side series of SGLang: tokens, requests, aborts and latencies (in registry ``r``)."""
        from prometheus_client import Counter, Histogram

        req, req_s = list(REQUEST_LABELS), [*REQUEST_LABELS, "is_streaming"]
        self._prompt_tokens = Counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", req_s, registry=r
        )
        self._generation_tokens = Counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", req_s, registry=r
        )
        self._requests = Counter(
            "sglang:num_requests_total", "Number of requests processed.", req_s, registry=r
        )
        self._aborted = Counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", req, registry=r
        )
        self._ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            req_s,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self._itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            req,
            registry=r,
            buckets=ITL_BUCKETS,
        )
        self._e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            req_s,
            registry=r,
            buckets=E2E_BUCKETS,
        )

    def bind(self, model_name: str, weight_version: Callable[[], float] | None = None) -> None:
        """Label every series with ``model_name`` (SGLang's ``--served-model-name``); ``weight_version()``
        is read at each scrape."""
        if weight_version is not None:
            self._weight_version = weight_version
        for metric in self._all:  # (a fresh server's: the series labelled with the previous name go)
            metric.clear()
        self.model_name = model_name
        self._req = {"model_name": model_name, "engine_type": "unified"}
        self._sched = {**self._req, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        self._running.labels(**self._sched).set_function(lambda: self.running)
        self._queue.labels(**self._sched).set_function(lambda: self.queued)
        self._throughput.labels(**self._sched).set_function(self.throughput)
        self._cache_hit.labels(**self._sched).set(0.0)
        self._refused.labels(model_name=model_name)
        self._version.labels(model_name=model_name).set_function(lambda: self._weight_version())

    def _s(self, streaming: bool) -> dict[str, str]:
        return {**self._req, "is_streaming": "true" if streaming else "false"}

    # -- events ------------------------------------------------------------------------------------------
    def queue(self, n: int) -> None:
        """``n`` requests arrived; they wait until :meth:`start` (or :meth:`finish` unrun)."""
        with self._lock:
            self.queued += n

    def start(self, n: int, prompt_tokens: int, queued_s: float = 0.0, streaming: bool = False) -> None:
        """``n`` requests of ``prompt_tokens`` prompt tokens in all leave the queue after ``queued_s``."""
        with self._lock:
            self.queued -= n
            self.running += n
        self._prompt_tokens.labels(**self._s(streaming)).inc(prompt_tokens)
        for _ in range(n):
            self._queue_time.labels(**self._sched).observe(queued_s)

    def first_token(self, seconds: float, streaming: bool = False) -> None:
        """A response's first token came ``seconds`` after its request arrived."""
        self._ttft.labels(**self._s(streaming)).observe(seconds)

    def tokens(self, n: int, interval_s: float | None = None) -> None:
        """A response gained ``n`` tokens; ``interval_s`` after its previous ones (None: its first), each
        token's inter-token latency being ``interval_s / n`` (as SGLang observes them)."""
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
        if interval_s is not None and n > 0:
            for _ in range(n):
                self._itl.labels(**self._req).observe(interval_s / n)

    def refuse(self) -> None:
        """A request refused with 503: the server held its limit of requests (``--max-queued-requests``)."""
        with self._lock:
            self.refused += 1
        self._refused.labels(model_name=self.model_name).inc()

    def finish(
        self,
        n: int,
        generation_tokens: int,
        seconds: float,
        started: bool = True,
        streaming: bool = False,
        aborted: int = 0,
    ) -> None:
        """``n`` requests ended after ``seconds`` (``started``: they ran; else they left the queue unrun),
        ``aborted`` of them aborted."""
        with self._lock:
            if started:
                self.running -= n
            else:
                self.queued -= n
            self.requests += n
        labels = self._s(streaming)
        self._generation_tokens.labels(**labels).inc(generation_tokens)
        self._requests.labels(**labels).inc(n)
        for _ in range(n):
            self._e2e.labels(**labels).observe(seconds)
        if aborted:
            self._aborted.labels(**self._req).inc(aborted)

    def throughput(self) -> float:
        """Tokens generated per second over the last :data:`THROUGHPUT_WINDOW_S` seconds (or since start)."""
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
                self._recent.popleft()
            made = sum(n for _, n in self._recent)
        return made / max(min(THROUGHPUT_WINDOW_S, now - self._started), 1e-3)

    # -- exposition --------------------------------------------------------------------------------------
    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type): OpenMetrics when ``accept`` (the scraper's ``Accept`` header) asks for it,
        else Prometheus' text format 0.0.4, as ``prometheus_client``'s own exporters answer."""
        from prometheus_client.exposition import choose_encoder
        from prometheus_client.openmetrics import exposition as openmetrics

        encoder, content_type = choose_encoder(accept or "")
        if content_type.startswith("application/openmetrics-text"):
            # prometheus_client 0.26 escapes a sample's ``sglang:`` to ``sglang_`` but not its family's
            # HELP / TYPE lines (client_python#1177), which OpenMetrics parsers refuse; every name here is a
            # valid legacy metric name (colons included), which no escaping scheme changes
            return openmetrics.generate_latest(
                self.registry, openmetrics.ALLOWUTF8
            ), openmetrics.CONTENT_TYPE_LATEST
        return encoder(self.registry), content_type
