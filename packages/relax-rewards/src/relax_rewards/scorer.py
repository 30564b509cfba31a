"""Score a batch of responses concurrently, with a time limit per call and no crash on bad rewards.

Why a scorer around plain functions: a reward is user code (or model-dependent parsing) that can
raise, return garbage, or hang on a pathological response. One such sample must not stall or kill a
rollout batch of thousands. So every call runs in a worker thread with its own deadline; a call
that raises or overruns yields ``fallback_score`` and a :class:`RewardResult` whose ``failure``
says why, and :meth:`Scorer.stats` counts failures by reason for the metrics service.

Why daemon threads, not ``ThreadPoolExecutor``: a thread cannot be killed. The executor's workers
are joined at interpreter exit, so one reward stuck in an infinite loop would hang the trainer's
shutdown. A batch is scored by at most ``max_concurrency`` daemon runner threads, each taking the
batch's next sample as it finishes the last (:class:`_Runners`): a thread, a hand-off and a wake-up per
*call* cost ~20x an exact-match reward (0.7 ms against 33 µs measured here), a batch of a few hundred
samples now pays them a few times. Each call still has its own deadline: a runner whose call overruns
is abandoned (it finishes, or not, on its own; its result is dropped) and a new runner takes over the
rest of its queue, so a hung reward costs its own sample only. A reward that calls ``os._exit`` on a runner
fails its call as ``crashed`` (the scorer guards ``os._exit`` for runner threads: it used to end the
rollout, and in colocate the run, without a word); a segfault still needs process isolation.

Process isolation (``isolation="process"``): for CPU-heavy or untrusted rewards, calls run in pooled
worker processes (:mod:`relax_rewards.isolation`). A timed-out call's worker is killed at the
deadline, and a worker that dies mid-call (``os._exit``, a signal, a segfault) yields the fallback
with a ``crashed`` failure; the rest of the batch carries on either way.

Group rewards: ``group_reward=`` names a hook from :mod:`relax_rewards.group` that sees the n
responses of one prompt together (``score_groups``), e.g. majority voting.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, NoReturn

from relax_rewards.registry import call_reward, get_reward, resolve_reward_type
from relax_rewards.types import BadReturn, RewardResult, as_result

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
        breadcrumb: str | os.PathLike | None = None,
        name: str | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s})")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be ≥ 1 (got {max_concurrency})")
        self.reward = reward
        self.default_fn = get_reward(reward)  # fail fast on a typo in the config
        self.name = name
        """The registry name a callable ``reward`` stands for (a wrapped one, e.g. delayed): a sample whose
        ``metadata["rm_type"]`` names it is scored by ``reward`` too, not by the registry's plain one."""
        self.timeout_s = float(timeout_s)
        self.max_concurrency = int(max_concurrency)
        self.fallback_score = float(fallback_score)
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS} (got {isolation!r})")
        self.isolation = isolation
        self.breadcrumb = breadcrumb
        """Thread isolation: a file that exists while a batch is scored, naming the reward and this process
        (a reward that crashes the process — a segfault — leaves it behind for whoever reports the death)."""
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pool = None
        if isolation == "thread":  # a reward's os._exit fails its call, not the process (see _guarded_exit)
            os._exit = _guarded_exit
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
        if self._pool is None:
            with _Breadcrumb(self.breadcrumb, self.reward):
                self._run_in_threads(responses, labels, metas, results)
        else:
            self._run_in_processes(responses, labels, metas, results)
        with self._lock:
            self._counts["scored"] += n
            unlabeled = sum(label is None for label in labels)
            if unlabeled and self.group_reward is None:  # (label-free runs score by their group hook)
                self._counts["unlabeled"] += unlabeled
        return [r if r is not None else self._failed("missing", "no result") for r in results]

    def _run_in_threads(self, responses, labels, metas, results: list) -> None:
        """Score every sample on runner threads, each call with its own deadline (see the module)."""
        calls = []
        for i in range(len(responses)):
            fn = self._resolve(metas[i])
            if isinstance(fn, RewardResult):  # could not resolve the reward
                results[i] = fn
            else:
                calls.append((i, fn, responses[i], labels[i], metas[i]))
        if not calls:
            return
        runners = _Runners(calls, self.max_concurrency)
        for i, outcome in runners.run(self.timeout_s):
            results[i] = (
                self._failed("timeout", f"timeout after {self.timeout_s:g} s")
                if outcome is None
                else self._outcome(*outcome)
            )

    def _run_in_processes(self, responses, labels, metas, results: list) -> None:
        """Score every sample in the worker processes, at most ``max_concurrency`` at once; a call past its
        deadline has its worker killed."""
        n = len(responses)
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
        """Start one reward call in a pooled worker process and return its future."""
        # Send registered rewards by name: cheaper to pickle, and works for any registered fn.
        name = self.reward if fn is self.default_fn and isinstance(self.reward, str) else None
        assert self._pool is not None, "process calls run with isolation='process' only"
        return self._pool.submit(name or fn, response, label, metadata)

    def _abandon(self, future: Future) -> None:
        """A call ran past its time-out: kill its worker process."""
        assert self._pool is not None, "process calls run with isolation='process' only"
        self._pool.abandon(future)

    # -- internals --------------------------------------------------------------------------------

    def _resolve(self, metadata: dict | None) -> Callable | RewardResult:
        rm_type = resolve_reward_type(metadata, self.reward)
        if (
            rm_type is self.reward
            or rm_type == self.reward
            or (self.name is not None and rm_type == self.name)
        ):
            return self.default_fn
        try:
            return get_reward(rm_type)
        except (KeyError, TypeError) as exc:
            return self._failed("unknown_reward", f"unknown reward {rm_type!r}: {exc}")

    def _collect(self, fut: Future) -> RewardResult:
        exc = fut.exception()
        return self._outcome(exc is None, fut.result() if exc is None else exc)

    def _outcome(self, ok: bool, value: Any) -> RewardResult:
        """A call's result (``ok``) or the exception it raised, as a :class:`RewardResult`."""
        if not ok:
            exc = value
            from relax_rewards.isolation import RewardProcessDied, RewardRaised

            if isinstance(exc, RewardProcessDied | RewardExited):
                return self._failed("crashed", str(exc))
            if isinstance(exc, BadReturn) or (isinstance(exc, RewardRaised) and exc.type_name == "BadReturn"):
                return self._failed("bad_return", f"bad return: {exc}")
            if isinstance(exc, RewardRaised):
                return self._failed(f"raised:{exc.type_name}", f"raised {exc.type_name}: {exc}")
            return self._failed(f"raised:{type(exc).__name__}", f"raised {type(exc).__name__}: {exc}")
        return value  # (a RewardResult: as_result ran inside the guarded call)

    def fail(self, reason: str, message: str) -> RewardResult:
        """Count a failure by ``reason`` (as the scorer's own are counted) and return the fallback result:
        for scores that reach a run outside :meth:`score_batch`, e.g. an environment's own reward."""
        return self._failed(reason, message)

    def check(self, value: Any) -> RewardResult:
        """A score from elsewhere (an environment's ``info["reward"]``) through the scorer's value check: its
        :class:`RewardResult`, or the fallback with a counted ``bad_return``. Call it where the value was made,
        under that call's own time-out (converting a hostile value can block)."""
        try:
            return as_result(value)
        except BadReturn as bad:
            return self._failed("bad_return", f"bad return: {bad}")

    def _failed(self, reason: str, message: str) -> RewardResult:
        with self._lock:
            self._counts[reason] += 1
            self._counts["failed"] += 1
        return RewardResult(self.fallback_score, {}, message)


class _Breadcrumb:
    """``{"reward": name, "pid": pid}`` in ``<path>.<pid>-<thread>`` while a thread-isolated batch is scored
    (one file per scoring thread: batches may be scored at once), removed after (~0.1 ms a batch, measured).
    Left behind only if the process died meanwhile. Never fails the scoring (an OSError is ignored)."""

    def __init__(self, path: str | os.PathLike | None, reward: Any) -> None:
        self.reward = reward
        self.path = None if path is None else f"{os.fspath(path)}.{os.getpid()}-{threading.get_ident()}"

    def __enter__(self) -> None:
        if self.path is not None:
            import json

            r = self.reward
            name = (
                r
                if isinstance(r, str)
                else f"{getattr(r, '__module__', '?')}:{getattr(r, '__qualname__', r)}"
            )
            try:
                with open(self.path, "w") as f:
                    json.dump({"reward": str(name), "pid": os.getpid()}, f)
            except OSError:
                pass

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass


class RewardExited(BaseException):
    """A reward called ``os._exit`` on a runner thread (thread isolation): the call fails as ``crashed``
    instead of ending the whole process (the rollout, or in colocate the run) without a word."""


_REAL_EXIT = os._exit
_RUNNER = "relax-reward"


def _guarded_exit(status: int) -> NoReturn:
    """``os._exit`` while thread-isolated rewards may run: on a reward runner thread, the call raises
    :class:`RewardExited` (the reward's call fails, counted); on any other thread it is the real one."""
    if threading.current_thread().name == _RUNNER:
        raise RewardExited(
            f"the reward called os._exit({status}); a reward must return a score, not end its process"
        )
    _REAL_EXIT(status)


class _Runners:
    """The runner threads of one batch (thread isolation): daemon threads take the calls in order; the
    caller's thread keeps each call's deadline and the number of runners.

    One runner starts; another joins (up to ``width``) each time every runner has been inside its call for
    ``RAMP_S``: a cheap CPU-bound reward stays on one thread (two threads taking turns on the GIL doubled
    an exact-match call's cost here), a slow or waiting one (a remote judge) gets ``width`` calls at once
    within a few ramps. A runner marks the call it is in (index, start time); :meth:`run` sleeps until the
    earliest deadline or ramp among them, or until every call is accounted for. A call past its deadline is
    given up (outcome None), its runner is abandoned — whatever it returns later is dropped, and it takes
    no further call — and a new runner takes over the calls still queued."""

    RAMP_S = 0.005

    def __init__(self, calls: list[tuple], width: int) -> None:
        self.calls = calls
        self.queue = list(range(len(calls)))[::-1]  # a stack: pop() yields calls in order
        self.width = width
        self.cond = threading.Condition()
        self.outcomes: dict[int, tuple[bool, Any] | None] = {}
        self.current: dict[int, tuple[int, float]] = {}  # runner id -> (call, start)
        self.live: set[int] = set()  # runners not abandoned and not finished
        self.abandoned: set[int] = set()
        self.next_id = 0

    def run(self, timeout_s: float) -> list[tuple[int, tuple[bool, Any] | None]]:
        """Every call's (index, outcome): ``(True, value)``, ``(False, exception)`` or None (timed out)."""
        with self.cond:
            self._start()
            while len(self.outcomes) < len(self.calls):
                starts = [start for _, start in self.current.values()]
                now = time.monotonic()
                wake = min(starts, default=now) + timeout_s  # the earliest deadline
                if self.queue and len(self.live) < self.width:  # when every runner has been busy a ramp
                    wake = min(wake, max(starts, default=now) + self.RAMP_S)
                self.cond.wait(max(wake - now, 0.0005))  # (always lets the runners have the lock)
                now = time.monotonic()
                for rid, (k, start) in list(self.current.items()):
                    if now - start >= timeout_s:  # give the call up; another runner takes the queue on
                        del self.current[rid]
                        self.live.discard(rid)
                        self.abandoned.add(rid)
                        self.outcomes[k] = None
                        if self.queue:
                            self._start()
                busy = [now - start for _, start in self.current.values()]
                if self.queue and len(self.live) < self.width and busy and len(busy) == len(self.live):
                    if min(busy) >= self.RAMP_S:  # every runner is in a slow call: one more
                        self._start()
        return [(self.calls[k][0], self.outcomes[k]) for k in range(len(self.calls))]

    def _start(self) -> None:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.live.add(rid)
        threading.Thread(target=self._loop, args=(rid,), name=_RUNNER, daemon=True).start()

    def _loop(self, rid: int) -> None:
        while True:
            with self.cond:
                if rid in self.abandoned or not self.queue:
                    self.current.pop(rid, None)
                    self.live.discard(rid)
                    if len(self.outcomes) == len(self.calls):
                        self.cond.notify()
                    return
                k = self.queue.pop()
                self.current[rid] = (k, time.monotonic())
            _, fn, response, label, metadata = self.calls[k]
            try:
                # converted here, on the runner: a __float__ that blocks is the call's time-out's business
                outcome: tuple[bool, Any] = (True, as_result(call_reward(fn, response, label, metadata)))
            except BaseException as exc:  # noqa: BLE001 - reported as the call's outcome
                outcome = (False, exc)
            with self.cond:
                if rid in self.abandoned:  # past its deadline: already scored as a time-out
                    return
                del self.current[rid]
                self.outcomes[k] = outcome
                if len(self.outcomes) == len(self.calls):
                    self.cond.notify()
