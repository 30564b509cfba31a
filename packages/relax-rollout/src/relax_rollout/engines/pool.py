"""A rollout engine over a changing set of HTTP engine servers (the elastic rollout's engine pool).

Why: with engines in their own processes (``ray_native`` actors, or SGLang servers started elsewhere and
joined by URL) the set of engines changes during a run — one crashes, the elastic API adds or removes
some — while the rollout manager keeps seeing one ``RolloutEngine``. The pool guarantees:

- **No request is lost.** A batch is split into contiguous chunks over the *active* members, sent
  concurrently. A member that fails (connection refused or reset: its process died; an HTTP 5xx; a
  time-out) is marked ``failed``, ``on_failure(member)`` is called (the health manager restarts it) and its
  chunk is re-issued on the remaining members. A chunk that comes back aborted because its member is
  being drained (scale-in after the drain time-out) is re-issued too. ``generate`` returns one output per
  prompt, or raises :class:`NoActiveEngine` saying what happened to every member.
- **Every serving member holds the current weights.** ``update_weights`` writes the tensors once to a
  pool-owned directory (one sub-directory per version, replaced atomically, the previous one deleted
  after the push) that is *kept*: a newcomer (``membership.add``, ``.restart``) loads it through
  ``/update_weights_from_disk`` and must report the pool's version in ``/model_info`` before it gets
  any request. A member that fails the push is marked failed instead of failing the update.
- **Scale-in drains.** ``membership.remove`` stops sending to the member, waits for its in-flight requests up to
  the drain time-out, then (``force``) aborts them with ``/abort_request`` — they come back and are
  re-issued elsewhere — and only then reports it removed (``kill(handle)`` for a launched engine, then
  ``on_removed(member)``). The last active member is never removed; start-up members are ``protected``
  (the elastic API's scale-in never picks them).

Member states: ``joining`` (receiving the current weights), ``active``, ``draining``, ``removed``,
``failed``. Ids (``e0``, ``e1``, ...) are never reused. Members and how they join, drain, fail and leave
are :mod:`relax_rollout.engines.pool_members` (a part of the pool, sharing its :class:`PoolState`); sending
requests and weights over them is here.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from relax_rollout.engines.base import GenerateOutput, SamplingParams, TokenDelta, answered
from relax_rollout.engines.pauses import WeightPauses
from relax_rollout.engines.pool_members import (
    STATES,
    Member,
    NoActiveEngine,
    PoolError,
    PoolMembership,
    PoolState,
    describe,
)
from relax_rollout.engines.wire import (
    ServerClient,
    ServerError,
    generate_body,
    min_tokens,
    parse_reply,
    retry_flush_refused,
)
from relax_rollout.engines.wire_weights import disk_update_request, save_safetensors

logger = logging.getLogger(__name__)

BUSY_BACKOFF_S = 0.5
"""Pause before asking members at their request bound again (:attr:`~relax_rollout.engines.wire.ServerError.busy`)."""
BUSY_TIMEOUT_S = 600.0
"""How long refusals alone may go on before a generate fails (no member failed, none answered)."""


@dataclass
class _Round:
    """What a round of :meth:`EnginePool.generate` left to do: prompts to ask again (of them, ``aborted`` by a
    scale-in, ``busy`` refused by members at their request bound), members that ``failed``, and a request
    error no member would answer otherwise."""

    again: list[int] = field(default_factory=list)
    aborted: int = 0
    busy: int = 0
    failed: int = 0
    busy_err: BaseException | None = None
    error: BaseException | None = None


class EnginePool(ServerClient):
    """A :class:`~relax_rollout.engines.base.RolloutEngine` over HTTP engine servers.

    ``urls``: start-up engines already serving (kind ``startup``, protected); more join through
    :attr:`membership` (``add``, ``spawn`` through ``launch``, or ``start``). ``launch() -> (url, handle)`` starts one engine
    (e.g. :func:`~relax_rollout.server.served.ray_launcher`), ``launch(node)`` one on the node at that
    address (needed only for a spawn that names a node), ``kill(handle)`` ends one.
    ``on_failure(member)`` and ``on_removed(member)`` are called (from the calling thread, keep them
    short) when a member fails and after one is removed. ``weights_dir``: where the current weights are
    kept for newcomers (default: a temporary directory owned by the pool, deleted by :meth:`close`); it
    must be readable by every engine (same host or a shared filesystem)."""

    FEATURES = ServerClient.FEATURES | {"stream"}
    """The servers' features, and "stream": ``generate(..., on_token=...)`` reads their ``/generate`` as a
    stream (:mod:`~relax_rollout.engines.wire_stream`)."""

    def __init__(
        self,
        urls: list[str] | str | None = None,
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 1,
        retry_backoff_s: float = 0.1,
        join_timeout_s: float = 60.0,
        launch: Callable[..., tuple[str, Any]] | None = None,
        kill: Callable[[Any], None] | None = None,
        on_failure: Callable[[Member], None] | None = None,
        on_removed: Callable[[Member], None] | None = None,
        weights_dir: str | None = None,
        max_workers: int = 64,
        **_ignored: Any,  # model_path, dtype, eos/pad ids: the servers own their model
    ) -> None:
        super().__init__(token, timeout_s, retries, retry_backoff_s)
        self._own_dir = weights_dir is None
        self.weights_root = Path(weights_dir or tempfile.mkdtemp(prefix="relax-pool-weights-"))
        self.weights_root.mkdir(parents=True, exist_ok=True)
        self.state = PoolState()
        self.pauses = WeightPauses()
        """Each member's pause for each weight update (:mod:`relax_rollout.engines.pauses`)."""
        """The members and current weights, shared with :attr:`membership`."""
        self._exec = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="relax-pool")
        self.membership = PoolMembership(
            self.state, self, self._exec, join_timeout_s, launch, kill, on_failure, on_removed
        )
        """Who is in the pool: joins, drains, failures, restarts (:mod:`~relax_rollout.engines.pool_members`)."""
        if isinstance(urls, str):
            urls = [urls]
        for url in urls or []:
            self.membership.add(url, kind="startup", protected=True)

    def _wait_busy(self, prompts: int, since: float | None, err: BaseException) -> float:
        """Members at their request bound refused ``prompts`` prompts: pause, then they are asked again;
        after :data:`BUSY_TIMEOUT_S` of nothing but refusals, fail naming the last refusal."""
        now = time.monotonic()
        since = now if since is None else since
        if now - since > BUSY_TIMEOUT_S:
            raise PoolError(
                f"every engine refused {prompts} prompt(s) as busy for {BUSY_TIMEOUT_S:.0f} s ({err}); "
                "raise the engines' --max-queued-requests or send fewer requests at once"
            )
        with self.state.cond:
            self.state.stats["busy_retries"] += prompts
        time.sleep(BUSY_BACKOFF_S)
        return since

    # -- RolloutEngine ---------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The version every active member holds (the last update's; before any, the members' own)."""
        with self.state.cond:
            return self.state.version if self.state.version is not None else 0

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        fields: list[dict[str, Any]] | None = None,
        common: dict[str, Any] | None = None,
        parse: Callable[[list[dict], list[list[int]]], list[GenerateOutput]] | None = None,
        on_token: Callable[[TokenDelta], None] | None = None,
    ) -> list[GenerateOutput]:
        """One output per prompt. ``fields`` (one dict per prompt) and ``common`` are extra ``/generate``
        request fields (see :func:`~relax_rollout.engines.wire.generate_body`); ``parse(reply, prompts)``
        replaces :func:`~relax_rollout.engines.wire.parse_reply` (e.g. routed experts in the model's shape).
        ``on_token``: each response's tokens as its server streams them (numbered by prompt); a prompt
        re-issued after its server failed streams again from its first token (``TokenDelta.start`` 0)."""
        if not prompts:
            return []
        if fields is not None and len(fields) != len(prompts):
            raise ValueError(f"{len(fields)} per-prompt field dicts for {len(prompts)} prompts")
        mins = min_tokens(params, len(prompts))
        results: list[GenerateOutput | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        with self.state.cond:
            self.state.stats["prompts"] += len(prompts)
        rounds, busy_since = 0, None
        while todo:
            rounds += 1
            if rounds > 4 + 2 * max(
                1, self.state.next_id
            ):  # every round retires a member: cannot loop forever
                raise PoolError(f"{len(todo)} prompt(s) still unanswered after {rounds - 1} re-issues")
            chunks = self._assign(todo, len(prompts))
            futs = [
                (
                    m,
                    idx,
                    self._exec.submit(
                        self._send,
                        m,
                        [prompts[i] for i in idx],
                        params,
                        [mins[i] for i in idx],
                        None if fields is None else [fields[i] for i in idx],
                        common,
                        parse,
                        None if on_token is None else _renumbered(on_token, idx),
                    ),
                )
                for m, idx in chunks
            ]
            r = self._collect(futs, results)
            if r.error is not None:
                raise r.error
            if r.busy:
                assert r.busy_err is not None, "a member's refusal counts busy prompts"
                busy_since = self._wait_busy(r.busy, busy_since, r.busy_err)
                rounds -= 0 if r.failed else 1  # (busy members retire nothing: bounded in time instead)
            else:
                busy_since = None
            if r.again:
                with self.state.cond:
                    self.state.stats["reissued_prompts"] += len(r.again)
                    self.state.stats["aborts_reissued"] += r.aborted
                logger.info("re-issuing %d prompt(s) on the remaining engines", len(r.again))
            todo = sorted(r.again)
        return answered(results)

    def _collect(self, futs: list, results: list[GenerateOutput | None]) -> _Round:
        """One round's replies into ``results``; what is to be asked again, and why (:class:`_Round`)."""
        r = _Round()
        for m, idx, fut in futs:
            try:
                outs = fut.result()
            except ServerError as e:
                if e.busy:  # at its request bound: alive, asked again after a pause
                    r.busy, r.busy_err = r.busy + len(idx), e
                    r.again += idx
                    continue
                if e.status < 500:  # the request itself is wrong: no other member will take it
                    r.error = r.error or e
                    continue
                self.membership.fail(m, e)
                r.again, r.failed = r.again + idx, r.failed + 1
                continue
            except (OSError, ValueError, KeyError) as e:  # died, hung, or answered garbage
                self.membership.fail(m, e)
                r.again, r.failed = r.again + idx, r.failed + 1
                continue
            with self.state.cond:
                going = m.state in ("draining", "removed")
                m.served += sum(o.finish_reason != "abort" or not going for o in outs)
            for i, o in zip(idx, outs):
                if o.finish_reason == "abort" and going:  # aborted by a scale-in: serve it elsewhere
                    r.again.append(i)
                    r.aborted += 1
                else:
                    results[i] = o
        return r

    def _assign(self, todo: list[int], total: int) -> list[tuple[Member, list[int]]]:
        """Contiguous chunks of ``todo`` over the active members, the least loaded first (a call of fewer
        prompts than members — streaming sends one per response — goes to those with the fewest in
        flight; it went to the first member, always); counts them in flight at once (so a drain that
        starts now waits for them)."""
        with self.state.cond:
            live = sorted(
                (m for m in self.state.members.values() if m.state == "active"), key=lambda m: m.inflight
            )
            if not live:
                raise NoActiveEngine(
                    f"no active engine left for {len(todo)} of {total} prompt(s): {self.membership.summary()}"
                )
            size = -(-len(todo) // len(live))
            chunks = [(m, todo[i : i + size]) for m, i in zip(live, range(0, len(todo), size))]
            for m, idx in chunks:
                m.inflight += len(idx)
            self.state.stats["requests"] += len(chunks)
            return chunks

    def _send(
        self,
        m: Member,
        prompts: list[list[int]],
        params: SamplingParams,
        mins: list[int],
        fields: list[dict[str, Any]] | None = None,
        common: dict[str, Any] | None = None,
        parse: Callable[[list[dict], list[list[int]]], list[GenerateOutput]] | None = None,
        on_token: Callable[[TokenDelta], None] | None = None,
    ) -> list[GenerateOutput]:
        try:
            body = generate_body(prompts, params, mins, fields, common)
            if on_token is None:
                reply = self.request(m.url, "/generate", body)
            else:
                from relax_rollout.engines.wire_stream import stream_generate, streams_incrementally

                if m.incremental_stream is None:
                    m.incremental_stream = streams_incrementally(m.url, self.token, self.timeout_s)
                reply = stream_generate(
                    m.url, body, on_token, self.token, self.timeout_s, m.incremental_stream
                )
            outs = (parse or parse_reply)(reply, prompts)
            if len(outs) != len(prompts):
                raise ValueError(f"{m.url} answered {len(outs)} outputs for {len(prompts)} prompts")
            return outs
        finally:
            with self.state.cond:
                m.inflight -= len(prompts)
                self.state.cond.notify_all()

    def update_weights(self, tensors: dict[str, Any], version: int, flush_cache: bool = True) -> None:
        """Keep ``tensors`` as the current weights (for newcomers) and load them on every serving member.
        ``flush_cache=False`` while members hold requests paused in place (SGLang refuses the flush then);
        an update refused only because the last requests were still being cleared is sent again
        (:func:`~relax_rollout.engines.wire.retry_flush_refused`)."""
        with self.state.weights_lock:
            tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.weights_root))
            final = self.weights_root / f"v{version}-{uuid.uuid4().hex[:8]}"
            try:
                save_safetensors(tensors, str(tmp))
                tmp.rename(final)  # atomic: a reader sees the whole version or none
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            with self.state.cond:
                targets = [m for m in self.state.members.values() if m.state in ("active", "draining")]
            body = disk_update_request(str(final), version, flush_cache=flush_cache)
            load = "/update_weights_from_disk"
            futs = [
                (
                    m,
                    self._exec.submit(
                        self._paused, version, retry_flush_refused, partial(self.request, m.url, load, body)
                    ),
                )
                for m in targets
            ]
            # A member that did not load it is failed, a refusal (HTTP 400) included: SGLang refuses after a
            # partial load whose roll-back re-reads the new directory, so its weights are unknown.
            errors: list[str] = []
            for m, fut in futs:
                try:
                    fut.result()
                    with self.state.cond:
                        m.weight_version = version
                except (OSError, ValueError, ServerError) as e:
                    self.membership.fail(m, e)
                    errors.append(f"{m.id} ({m.url}): {describe(e)}")
            if targets and len(errors) == len(targets):  # none took it: the previous version stays
                shutil.rmtree(final, ignore_errors=True)
                raise PoolError(f"no engine loaded weight version {version}: {'; '.join(errors)}")
            previous, self.state.weights_path = self.state.weights_path, str(final)
            with self.state.cond:
                self.state.version = version
            self._drop_owned(previous)

    def _paused(self, version: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, one member's load, timed as that engine's pause (SGLang's scheduler loads from disk
        between two steps of its loop: it generates nothing meanwhile)."""
        with self.pauses.timed(version):
            return fn(*args)

    def _drop_owned(self, path: str | None) -> None:
        """Delete a weights directory the pool wrote (never one it was given by :meth:`adopt_weights`)."""
        if path is not None and Path(path).parent == self.weights_root:
            shutil.rmtree(path, ignore_errors=True)

    def adopt_weights(self, version: int, path: str | None = None) -> None:
        """The serving members were updated to ``version`` outside the pool (an NCCL broadcast, a checkpoint
        loaded with ``/update_weights_from_disk``): record it as the pool's version. ``path``: a directory a
        newcomer can load that version from (the pool never deletes it); None: newcomers cannot be synced,
        so they fail to join (rather than serve older weights) until the next update that leaves a path."""
        with self.state.weights_lock:
            previous, self.state.weights_path = self.state.weights_path, path
            with self.state.cond:
                self.state.version = version
                for m in self.state.members.values():
                    if m.state in ("active", "draining"):
                        m.weight_version = version
            if previous != path:
                self._drop_owned(previous)

    def weights_checksum(self) -> str:
        """The active members' checksum (a relax extension); they must agree."""
        sums: dict[str, str] = {}
        for m in self.membership.active():
            try:
                sums[m.id] = self.request(m.url, "/weights_checksum")["checksum"]
            except ServerError as e:
                if e.status == 404:
                    raise NotImplementedError(
                        f"{m.url} has no /weights_checksum (not a relax engine server)"
                    ) from e
                raise
        if not sums:
            raise NoActiveEngine(f"no active engine to ask for a checksum: {self.membership.summary()}")
        if len(set(sums.values())) != 1:
            raise RuntimeError(f"pool engines hold different weights: {sums}")
        return next(iter(sums.values()))

    @property
    def weights_path(self) -> str | None:
        """The directory a newcomer loads the current weights from (None: none)."""
        return self.state.weights_path

    # -- extras ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters: requests (chunks sent), prompts, reissued_prompts (of which aborts_reissued came back
        aborted from a drained engine), failures (members marked failed); members by state."""
        with self.state.cond:
            out: dict[str, Any] = dict(self.state.stats)
            for s in STATES:
                out[f"engines_{s}"] = sum(m.state == s for m in self.state.members.values())
            out["weight_version"] = self.state.version
            return out

    def close(self, kill: bool = False) -> None:
        """Stop the pool's threads; ``kill``: also end every launched engine. Deletes its own weights dir."""
        self._exec.shutdown(wait=False, cancel_futures=True)
        if kill:
            with self.state.cond:
                handles = [m.handle for m in self.state.members.values() if m.state != "removed"]
            for h in handles:
                self.membership.kill_engine(h)
        if self._own_dir:
            shutil.rmtree(self.weights_root, ignore_errors=True)


def _renumbered(on_token: Callable[[TokenDelta], None], idx: list[int]) -> Callable[[TokenDelta], None]:
    """``on_token`` for a request of the prompts ``idx`` of a call (its deltas numbered in the request)."""
    from dataclasses import replace

    return lambda d: on_token(replace(d, index=idx[d.index]))
