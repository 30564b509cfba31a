"""An engine that drives already-running SGLang-compatible servers over HTTP (``--rollout-backend external``).

Why: engines started elsewhere — a real SGLang server on a GPU node, or ``python -m relax_rollout.server``
in another process — join a run by URL, and the rollout manager sees the same ``RolloutEngine`` protocol
as for the in-process torch engine. Only the standard library is used (urllib), so relax-rollout gains no
HTTP dependency. A batch is split into contiguous chunks, one per server, sent concurrently; connection
errors (a server restarting) are retried with back-off, HTTP errors are raised with the server's message.
What goes on the wire, and the reading of a reply, are :mod:`relax_rollout.engines.wire`'s, shared with
the engine pool and the ``sglang`` engine.

Weights: ``update_weights`` writes the tensors as safetensors to a temporary directory and calls
``/update_weights_from_disk`` on every server (same host or shared filesystem; fine for small CPU
models). For large models, ``connect_dcs`` makes every server join the trainer's DCS broadcast through
``/init_weights_update_group`` instead.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

from relax_rollout.engines.base import GenerateOutput, SamplingParams, TokenDelta, memory_request
from relax_rollout.engines.pool import BUSY_BACKOFF_S, BUSY_TIMEOUT_S
from relax_rollout.engines.wire import (
    ServerClient,
    ServerError,
    generate_body,
    min_tokens,
    model_info,
    parse_reply,
    pause_request,
    retry_flush_refused,
    retry_while,
    sampling_dict,
    server_info,
    version_number,
)
from relax_rollout.engines.wire_weights import disk_update_request, init_group_request, save_safetensors

logger = logging.getLogger(__name__)


class ExternalEngine(ServerClient):
    def __init__(
        self,
        urls: list[str] | str | None = None,
        token: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 5,
        retry_backoff_s: float = 0.5,
        **_ignored: Any,  # model_path, dtype, eos/pad ids: the servers own their model
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("the external engine needs server URLs: set --rollout-external-urls")
        super().__init__(token, timeout_s, retries, retry_backoff_s)
        self.urls = [u.rstrip("/") for u in urls]
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self.urls)), thread_name_prefix="relax-external"
        )
        self._lock = threading.Lock()
        self._paused: str | None = None  # the pause mode the servers are in (None: generating)
        self._lock_inflight = threading.Lock()
        self._inflight = dict.fromkeys(self.urls, 0)  # prompts in flight per server
        self._grammar: bool | None = None  # every server an SGLang with a grammar backend (asked once)
        self._incremental: dict[str, bool] = {}  # per server: it streams new tokens only (asked once)

    @property
    def features(self) -> frozenset[str]:
        """:class:`ServerClient`'s, "stream" (SGLang's streamed ``/generate``, read token by token), and
        "constraint" (SGLang's ``json_schema`` / ``regex`` / ``structural_tag``)
        when every server's ``/server_info`` names a ``grammar_backend`` other than "none": a real SGLang.
        Other servers (ours, which takes only ``json_schema`` and ``regex``) would refuse part of it."""
        if self._grammar is None:
            try:
                infos = [server_info(u, self.token, self.timeout_s) for u in self.urls]
            except (ConnectionError, ServerError, TimeoutError):
                return ServerClient.FEATURES | {"stream"}  # (asked again next time)
            self._grammar = all(i.get("grammar_backend") not in (None, "none") for i in infos)
        return ServerClient.FEATURES | ({"stream", "constraint"} if self._grammar else {"stream"})

    # -- HTTP ------------------------------------------------------------------------------------
    def _all(self, path: str, body: Any = None, timeout_s: float | None = None) -> list[Any]:
        futs = [self._pool.submit(self.request, u, path, body, timeout_s) for u in self.urls]
        return [f.result() for f in futs]

    def _update_all(self, body: dict) -> None:
        """``/update_weights_from_disk`` on every server, each sent again while SGLang refuses it only for
        its cache flush (:func:`~relax_rollout.engines.wire.retry_flush_refused`)."""
        send = self.request
        futs = [
            self._pool.submit(retry_flush_refused, lambda u=u: send(u, "/update_weights_from_disk", body))
            for u in self.urls
        ]
        for f in futs:
            f.result()

    # -- RolloutEngine ---------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The lowest version any server holds (what a new request may be generated with)."""
        futs = [self._pool.submit(model_info, u, self.token, self.timeout_s) for u in self.urls]
        return min(version_number(f.result().get("weight_version")) for f in futs)

    @staticmethod
    def _sampling(p: SamplingParams, min_new: int) -> dict:
        return sampling_dict(p, min_new)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: Callable[[TokenDelta], None] | None = None,
    ) -> list[GenerateOutput]:
        """``on_token``: each response's tokens as its server streams them (numbered as ``prompts``; a
        refused-busy request is asked again before any token went out)."""
        if not prompts:
            return []
        mins = min_tokens(params, len(prompts))
        n = len(self.urls)
        size = -(-len(prompts) // n)
        with self._lock_inflight:  # the least loaded servers first (streaming sends one prompt a call)
            urls = sorted(self.urls, key=lambda u: self._inflight[u])
            chunks = [(u, i, min(i + size, len(prompts))) for u, i in zip(urls, range(0, len(prompts), size))]
            for u, lo, hi in chunks:
                self._inflight[u] += hi - lo

        def run(url: str, lo: int, hi: int) -> list[dict]:
            body = generate_body(prompts[lo:hi], params, mins[lo:hi])
            send = lambda: self.request(url, "/generate", body)  # noqa: E731
            if on_token is not None:
                send = self._streamed(url, body, lambda d: on_token(replace(d, index=d.index + lo)))
            # a server at its request bound (ServerError.busy) is asked again, as the engine pool does
            return retry_while(
                send,
                lambda e: e.busy,
                BUSY_TIMEOUT_S,
                BUSY_BACKOFF_S,
                BUSY_BACKOFF_S,
            )

        futs = [self._pool.submit(run, *c) for c in chunks[1:]]
        try:  # the first chunk in the caller's thread: concurrent callers are not queued behind the pool
            replies = [run(*chunks[0]), *(f.result() for f in futs)]
        finally:
            wait(futs)
            with self._lock_inflight:
                for u, lo, hi in chunks:
                    self._inflight[u] -= hi - lo
        return [o for (_, lo, hi), r in zip(chunks, replies) for o in parse_reply(r, prompts[lo:hi])]

    def _streamed(self, url: str, body: dict, on_token: Callable[[TokenDelta], None]) -> Callable[[], list]:
        """The streamed ``/generate`` of ``body`` to ``url``, read as that server streams (its
        ``--incremental-streaming-output``, asked once)."""
        from relax_rollout.engines.wire_stream import stream_generate, streams_incrementally

        if url not in self._incremental:
            self._incremental[url] = streams_incrementally(url, self.token, self.timeout_s)
        incremental = self._incremental[url]
        return lambda: stream_generate(url, body, on_token, self.token, self.timeout_s, incremental)

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        with self._lock, tempfile.TemporaryDirectory(prefix="relax-weights-") as d:
            save_safetensors(tensors, d)
            # requests paused in place still use SGLang's cache: it refuses to flush it then (HTTP 400)
            self._update_all(disk_update_request(d, version, flush_cache=self._paused != "in_place"))

    def weights_checksum(self) -> str:
        """The servers' checksum (a relax extension); servers must agree."""
        try:
            sums = {r["checksum"] for r in self._all("/weights_checksum")}
        except ServerError as e:
            if e.status == 404:
                raise NotImplementedError(
                    "this server has no /weights_checksum (not a relax engine server)"
                ) from e
            raise
        if len(sums) != 1:
            raise RuntimeError(f"external engines hold different weights: {sorted(sums)}")
        return sums.pop()

    # -- extras ----------------------------------------------------------------------------------
    def connect_dcs(self, init_method: str, world_size: int, rank: int, backend: str = "gloo") -> None:
        """Make server k join the trainer's DCS group as rank ``rank + k`` (returns after the rendezvous,
        so call it concurrently with the sender's ``connect()``)."""
        from urllib.parse import urlparse

        u = urlparse(init_method)
        host, port = u.hostname, u.port
        if not host or not port:
            raise ValueError(f"init_method must look like 'tcp://HOST:PORT' (got {init_method!r})")
        # protocol "relax_dcs": a relax engine server's extension, DCS rather than SGLang's group
        bodies = [
            init_group_request(host, port, rank + k, world_size, "relax_dcs", backend, "relax_dcs")
            for k in range(len(self.urls))
        ]
        futs = [
            self._pool.submit(self.request, url, "/init_weights_update_group", b)
            for url, b in zip(self.urls, bodies)
        ]
        for f in futs:
            f.result()

    def check_partial_rollout(self) -> None:
        """--partial-rollout on SGLang servers the user launched (we cannot set their flags), from their
        ``/server_info``: ``ValueError`` for a server with its prefix (radix) cache on — an update under the
        in-place pause cannot flush it, and later prompts sharing a cached prefix would be served from KV
        of the old weights under the new version (measured against SGLang 0.5.23: a log-prob 3.1 nats off);
        a warning for one with its overlap scheduler on (each update's boundary token stamped one token
        late, see :func:`relax_rollout.engine_factory.sglang_kwargs`)."""
        futs = [(u, self._pool.submit(server_info, u, self.token, self.timeout_s)) for u in self.urls]
        radix = []
        for url, fut in futs:
            info = fut.result()
            if info.get("disable_radix_cache") is False:
                radix.append(url)
            if info.get("disable_overlap_schedule") is False:
                logger.warning(
                    "--partial-rollout: the SGLang server %s runs its overlap scheduler, under which the token "
                    "in flight at each update is stamped with the new version although the old weights "
                    "sampled it; relaunch it with --disable-overlap-schedule for exact versions",
                    url,
                )
        if radix:
            raise ValueError(
                f"--partial-rollout: the SGLang servers {', '.join(radix)} run their prefix (radix) cache, "
                "which an update under the in-place pause cannot flush, so prompts would be served from KV "
                "of the old weights; relaunch them with --disable-radix-cache"
            )

    def pause(self, mode: str = "abort") -> None:
        self._all("/pause_generation", pause_request(mode))
        self._paused = mode

    def resume(self) -> None:
        self._all("/continue_generation", {})
        self._paused = None

    def release_memory(self, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` on every server (colocate: the trainer uses the GPUs next)."""
        self._all("/release_memory_occupation", memory_request(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._all("/resume_memory_occupation", memory_request(tags))

    def health(self) -> list[bool]:
        ok = []
        for u in self.urls:
            try:
                self.request(u, "/health")
                ok.append(True)
            except (ConnectionError, ServerError):
                ok.append(False)
        return ok
