"""Score a batch of responses concurrently, with a time limit per call and no crash on bad rewards.

Why a scorer around plain functions: a reward is user code (or model-dependent parsing) that can
raise, return garbage, or hang on a pathological response. One such sample must not stall or kill a
rollout batch of thousands. So every call runs in a worker thread with its own deadline; a call
that raises or overruns yields ``fallback_score`` and a :class:`RewardResult` whose ``failure``
says why, and :meth:`Scorer.stats` counts failures by reason for the metrics service.

Why daemon threads, not ``ThreadPoolExecutor``: a thread cannot be killed. The executor's workers
are joined at interpreter exit, so one reward stuck in an infinite loop would hang the trainer's
shutdown. We start one daemon thread per call (cheap next to any real reward), keep at most
``max_concurrency`` running, and on a timeout we simply stop waiting for it.

Process isolation (``isolation="process"``): for CPU-heavy or untrusted rewards, calls run in pooled
worker processes (:mod:`relax_rewards.isolation`). A timed-out call's worker is killed at the
deadline, and a worker that dies mid-call (``os._exit``, a signal, a segfault) yields the fallback
with a ``crashed`` failure; the rest of the batch carries on either way.

Group rewards: ``group_reward=`` names a hook from :mod:`relax_rewards.group` that sees the n
responses of one prompt together (``score_groups``), e.g. majority voting.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from relax_rewards.registry import call_reward, get_reward, resolve_reward_type
from relax_rewards.types import RewardResult, as_result

__all__ = ["Scorer", "call_reward"]

ISOLATIONS = ("thread", "process")


class Scorer:
    """Run one reward (or per-sample ``rm_type`` overrides) over batches, concurrently and safely.

    Args:
        reward: default reward, by registered name, dotted path, or callable.
        timeout_s: seconds one call may run before it is abandoned and scored ``fallback_score``.
        max_concurrency: calls running at once.
        fallback_score: score given to a call that raised, timed out or returned garbage.
        isolation: ``"thread"`` (default, cheapest) or ``"process"`` (killable worker processes,
            for CPU-heavy or untrusted rewards; the reward and its inputs must be picklable).
        memory_limit_mb: with ``isolation="process"``, each worker's address-space limit.
        group_reward: optional group hook (name in :data:`relax_rewards.group.GROUP_REWARDS` or a
            callable) applied by :meth:`score_groups`.

    >>> scorer = Scorer("math", timeout_s=5.0)
    >>> [r.score for r in scorer.score_batch([r"\\boxed{2}", "no idea"], ["2", "3"])]
    [1.0, 0.0]
    >>> scorer.stats()["scored"]
    2
    """

    def __init__(
        self,
        reward: str | Callable,
        timeout_s: float = 10.0,
        max_concurrency: int = 8,
        fallback_score: float = 0.0,
        *,
        isolation: str = "thread",
        memory_limit_mb: int | None = None,
        group_reward: str | Callable | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s})")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be ≥ 1 (got {max_concurrency})")
        self.reward = reward
        self.default_fn = get_reward(reward)  # fail fast on a typo in the config
        self.timeout_s = float(timeout_s)
        self.max_concurrency = int(max_concurrency)
        self.fallback_score = float(fallback_score)
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS} (got {isolation!r})")
        self.isolation = isolation
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pool = None
        if isolation == "process":
            from relax_rewards.isolation import ProcessPool

            self._pool = ProcessPool(memory_limit_mb=memory_limit_mb)
            self._pool.prestart(self.max_concurrency)
        self.group_reward = None
        if group_reward is not None:
            from relax_rewards.group import get_group_reward

            self.group_reward = get_group_reward(group_reward)

    # -- public API -------------------------------------------------------------------------------

    def score(self, response: str, label: Any, metadata: dict | None = None) -> RewardResult:
        """Score a single sample (same guarantees as :meth:`score_batch`)."""
        return self.score_batch([response], [label], [metadata])[0]

    def score_batch(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict | None] | None = None,
    ) -> list[RewardResult]:
        """One :class:`RewardResult` per response, in order. Never raises for a bad reward call.

        Each call gets ``timeout_s`` from the moment it starts; the batch returns as soon as every
        call has finished or been abandoned.
        """
        n = len(responses)
        if len(labels) != n or (metadatas is not None and len(metadatas) != n):
            raise ValueError(
                f"responses, labels and metadatas must have the same length "
                f"(got {n}, {len(labels)}, {None if metadatas is None else len(metadatas)})"
            )
        metas = list(metadatas) if metadatas is not None else [None] * n
        results: list[RewardResult | None] = [None] * n
        pending = list(range(n))[::-1]  # a stack: pop() yields samples in order
        running: dict[Future, tuple[int, float]] = {}
        while pending or running:
            while pending and len(running) < self.max_concurrency:
                i = pending.pop()
                fn = self._resolve(metas[i])
                if isinstance(fn, RewardResult):  # could not resolve the reward
                    results[i] = fn
                    continue
                running[self._submit(fn, responses[i], labels[i], metas[i])] = (i, time.monotonic())
            if not running:
                continue
            now = time.monotonic()
            next_deadline = min(start for _, start in running.values()) + self.timeout_s
            done, _ = wait(list(running), timeout=max(0.0, next_deadline - now), return_when=FIRST_COMPLETED)
            for fut in done:
                i, _ = running.pop(fut)
                results[i] = self._collect(fut)
            now = time.monotonic()
            for fut, (i, start) in list(running.items()):
                if now - start >= self.timeout_s and not fut.done():
                    del running[fut]  # abandon: the daemon thread finishes (or not) on its own
                    self._abandon(fut)
                    results[i] = self._failed("timeout", f"timeout after {self.timeout_s:g} s")
        with self._lock:
            self._counts["scored"] += n
            unlabeled = sum(label is None for label in labels)
            if unlabeled and self.group_reward is None:  # (label-free runs score by their group hook)
                self._counts["unlabeled"] += unlabeled
        return [r if r is not None else self._failed("missing", "no result") for r in results]

    async def ascore_batch(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict | None] | None = None,
    ) -> list[RewardResult]:
        """:meth:`score_batch` for asyncio callers (runs the batch off the event loop)."""
        import asyncio

        return await asyncio.to_thread(self.score_batch, responses, labels, metadatas)

    def score_groups(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict | None] | None = None,
        group_size: int = 1,
    ) -> list[RewardResult]:
        """Score per sample, then let ``group_reward`` rescore each run of ``group_size`` samples
        (the n responses of one prompt, consecutive). Without a group hook this is score_batch."""
        results = self.score_batch(responses, labels, metadatas)
        if self.group_reward is None or group_size <= 1:
            return results
        if len(results) % group_size:
            raise ValueError(f"batch of {len(results)} is not a whole number of groups of {group_size}")
        metas = list(metadatas) if metadatas is not None else [None] * len(results)
        out: list[RewardResult] = []
        for start in range(0, len(results), group_size):
            sl = slice(start, start + group_size)
            try:
                rescored = [
                    as_result(r)
                    for r in self.group_reward(list(responses[sl]), list(labels[sl]), metas[sl], results[sl])
                ]
                if len(rescored) != group_size:
                    raise ValueError(f"group reward returned {len(rescored)} results for {group_size}")
            except Exception as exc:  # noqa: BLE001 - keep the per-sample scores
                self._failed(f"group_raised:{type(exc).__name__}", str(exc))
                rescored = list(results[sl])
            out.extend(rescored)
        return out

    def close(self) -> None:
        """Stop worker processes (``isolation="process"``); a no-op for threads."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def stats(self) -> dict[str, int]:
        """Counts since creation: ``scored`` (samples) and ``failed``, plus one key per failure
        reason (``timeout``, ``raised:ValueError``, ``bad_return``, ``unknown_reward``, ``crashed``), and
        ``unlabeled``: samples scored with no label (``None``) and no group hook to stand in for one."""
        with self._lock:
            return dict(self._counts)

    # -- extension points ------------------------------------------------------------------------

    def _submit(self, fn: Callable, response: str, label: Any, metadata: dict | None) -> Future:
        """Start one reward call and return its future (a daemon thread, or a pooled process)."""
        if self._pool is not None:
            # Send registered rewards by name: cheaper to pickle, and works for any registered fn.
            name = self.reward if fn is self.default_fn and isinstance(self.reward, str) else None
            return self._pool.submit(name or fn, response, label, metadata)
        future: Future = Future()
        future.set_running_or_notify_cancel()

        def target() -> None:
            try:
                value = call_reward(fn, response, label, metadata)
            except BaseException as exc:  # noqa: BLE001 - reported through the future
                future.set_exception(exc)
            else:
                future.set_result(value)

        threading.Thread(target=target, name="relax-reward", daemon=True).start()
        return future

    def _abandon(self, future: Future) -> None:
        """A call ran past its time-out: kill its worker process (threads cannot be stopped)."""
        if self._pool is not None:
            self._pool.abandon(future)

    # -- internals --------------------------------------------------------------------------------

    def _resolve(self, metadata: dict | None) -> Callable | RewardResult:
        rm_type = resolve_reward_type(metadata, self.reward)
        if rm_type is self.reward or rm_type == self.reward:
            return self.default_fn
        try:
            return get_reward(rm_type)
        except (KeyError, TypeError) as exc:
            return self._failed("unknown_reward", f"unknown reward {rm_type!r}: {exc}")

    def _collect(self, fut: Future) -> RewardResult:
        exc = fut.exception()
        if exc is not None:
            from relax_rewards.isolation import RewardProcessDied, RewardRaised

            if isinstance(exc, RewardProcessDied):
                return self._failed("crashed", str(exc))
            if isinstance(exc, RewardRaised):
                return self._failed(f"raised:{exc.type_name}", f"raised {exc.type_name}: {exc}")
            return self._failed(f"raised:{type(exc).__name__}", f"raised {type(exc).__name__}: {exc}")
        try:
            return as_result(fut.result())
        except (TypeError, ValueError) as bad:
            return self._failed("bad_return", f"bad return: {bad}")

    def _failed(self, reason: str, message: str) -> RewardResult:
        with self._lock:
            self._counts[reason] += 1
            self._counts["failed"] += 1
        return RewardResult(self.fallback_score, {}, message)
