"""Streaming rollout (``--streaming-rollout``, fully async): prompt groups flow to the bus one at a time.

Why: a batch generated in one engine call waits for its longest response, and the roles downstream start
only when the slowest sample is done; with heavy-tailed response lengths that tail is the largest cost of
RL. Here the rollout keeps up to ``--max-inflight-groups`` prompt groups generating, each response its own
request (the torch engine batches them continuously, :mod:`relax_rollout.engines.continuous`; engine
processes and servers get concurrent requests, which SGLang batches), scores a group the moment its last
response ends (rewards run beside generation, on their own threads) and puts it on the bus: partition
``step<k>``, ids fixed by (step, group, sample), so a group re-sent by a restarted process is refused.

Steps stay the unit of admission (the staleness bound), of drawing prompts and of the journal: step k
begins when the bus admits it and its groups fit in flight; its ``put`` entry is written when its last
group lands. The trainer takes step k's groups at version k (``get(partition=...)``), so a sample's
staleness is exactly bounded as in batch mode, now measured on its oldest token. With ``--partial-rollout``
responses in flight go on under new weights (each token stamped with its version); without it an update
waits until they end and none starts meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from relax_bus import BusClosed
from relax_core import sample
from relax_core.resume import Journal, JournalEntry
from relax_rollout.engines.base import PausesGeneration, RolloutEngine
from relax_rollout.engines.continuous import ContinuousBatcher
from relax_rollout.generation import Generated, model_tokens

SEED_STRIDE = 65_537
"""Request seeds: a step's sampling seed × this + the sample's index in its step (fewer samples a step)."""


def inflight_limit(cfg: Any) -> int:
    """Prompt groups generating at once (``--max-inflight-groups``; by default a step's for each version
    the staleness bound lets run ahead); ValueError when a step's groups could not fit together."""
    r = cfg.rollout
    limit = cfg.inflight_groups
    if limit < r.rollout_batch_size:
        raise ValueError(
            f"--max-inflight-groups {limit} is below --rollout-batch-size {r.rollout_batch_size}: a "
            "step's groups must fit in flight together"
        )
    return limit


def room_for_step(inflight: int, groups: int, limit: int) -> bool:
    """A step (admitted by the staleness bound) begins only when all its ``groups`` fit in flight."""
    return inflight + groups <= limit


def update_waits_for_responses(cfg: Any) -> bool:
    """Without ``--partial-rollout`` a weight update waits until the responses in flight end (and none
    starts meanwhile); with it they go on under the new weights, each token stamped with its version."""
    return not cfg.rollout.partial_rollout


@dataclass
class _Group:
    step: int
    index: int
    row: Any
    prompt: list[int]
    futures: list[Future]
    t0: float
    start_ns: int
    end_ns: int = 0
    """When its last response ended (wall clock, ns): the samples' ``generated_at``, its trace span's end."""


class StreamOwner(Protocol):
    """What the stream drives: the rollout role's steps (:class:`~relax_rollout.steps.RolloutSteps`), whose
    parts it uses; the journal and the heartbeat are handed to :class:`GroupStream` apart."""

    cfg: Any
    stats: dict[str, Any]
    prompts: Any
    """:class:`~relax_rollout.prompts.Prompts`: draws each step's prompts, keeps the prompt log."""
    generation: Any
    """:class:`~relax_rollout.generation.Generation`: each step's sampling parameters."""
    samples: Any
    """:class:`~relax_rollout.samples.SampleWriter`: scores a group and puts it on the bus."""
    tracer: Any

    @property
    def engine(self) -> RolloutEngine: ...

    def admit(self, step: int) -> None: ...


class GroupStream:
    """The streaming loop of one rollout role (``worker``: its engine, prompts, sample writer and stats),
    writing ``journal`` and calling ``beat()`` whenever it makes progress or polls idle (the role's
    heartbeat for the health manager)."""

    def __init__(self, worker: StreamOwner, journal: Journal, beat: Callable[[], None]) -> None:
        from relax_rollout.engines.torch_engine import TorchEngine

        self.w, self.journal, self.beat = worker, journal, beat
        cfg = worker.cfg
        r = cfg.rollout
        self.n = r.n_samples_per_prompt
        self.limit = inflight_limit(cfg)
        engine = worker.engine
        check = getattr(engine, "check_partial_rollout", None)
        if r.partial_rollout and callable(check):  # servers launched by the user: their flags, checked first
            check()
        self.batcher = (
            ContinuousBatcher(engine, max_running=self.limit * self.n)
            if isinstance(engine, TorchEngine)
            else None
        )
        # engines in processes or servers: concurrent requests, batched by the server (at most
        # --max-inflight-requests at once: every group's responses can be hundreds of threads)
        threads = min(self.limit * self.n, r.max_inflight_requests)
        self.requests = None if self.batcher else ThreadPoolExecutor(threads, "rollout-request")
        # groups scored side by side, their reward calls together within --reward-concurrency (the bound
        # is per scoring call: batch mode scores one batch at a time)
        self.scoring = ThreadPoolExecutor(max(1, r.reward_concurrency // self.n), "rollout-score")
        self._cond = threading.Condition()
        self.inflight = 0
        self.steps: dict[int, tuple[list[Any], set[int]]] = {}  # step -> (its prompt ids, groups not put yet)
        self.failure: list[BaseException] = []
        self._closing = False  # (requests ended by the close at the run's end are not failures)

    # -- weights (from the worker's subscriber thread) ---------------------------------------------
    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        partial = not update_waits_for_responses(self.w.cfg)
        if self.batcher is not None:  # between two decode steps; without partial rollout once they end
            self.batcher.update_weights(tensors, version, drain=not partial)
            return
        # SGLang servers (sglang, external): with partial rollout the requests in flight are held in
        # place (``pause_generation`` in_place), the update goes in, and they go on under it, each reply
        # saying which tokens came from which version; without it SGLang's update waits for them
        engine = self.w.engine
        if not (partial and isinstance(engine, PausesGeneration)):
            engine.update_weights(tensors, version)
            return
        engine.pause("in_place")
        try:
            engine.update_weights(tensors, version)
        finally:
            engine.resume()

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, start_step: int) -> None:
        w = self.w
        groups = w.cfg.rollout.rollout_batch_size
        step = start_step
        try:
            while not self.failure:
                w.admit(step)  # the staleness bound and fresh-enough weights
                t0 = time.perf_counter()
                with self._cond:  # room for the step's groups
                    while not room_for_step(self.inflight, groups, self.limit) and not self.failure:
                        self.beat()
                        self._cond.wait(0.5)
                w.stats["wait_s"] += time.perf_counter() - t0
                if self.failure:
                    break
                self._begin(step)
                step += 1
        except BusClosed:
            pass
        finally:
            failed = list(self.failure)  # (what went wrong before the close, not the close itself)
            self.close()
        if failed:
            raise failed[0]

    def _begin(self, step: int) -> None:
        """Draw step ``step``'s prompts (journaled) and submit every response of its groups."""
        w = self.w
        self.journal.log(JournalEntry.begin(step, w.prompts.begin(step)))
        rows, enc = w.prompts.batch()
        self.journal.log(JournalEntry.drawn(step, w.prompts.iterator.state_dict()))
        params = w.generation.sampling(step, len(rows) * self.n)
        mins = params.min_new_tokens
        cfg_exact = w.cfg.rollout.long_tail_exact and isinstance(mins, list)
        with self._cond:
            self.steps[step] = ([row.row_id for row in rows], set(range(len(rows))))
            self.inflight += len(rows)
        for g, (row, (ids, _)) in enumerate(zip(rows, enc)):
            futures = []
            for j in range(self.n):
                i = g * self.n + j
                m = mins[i] if isinstance(mins, list) else mins
                one = replace(params, seed=params.seed * SEED_STRIDE + i, min_new_tokens=m)
                if cfg_exact:  # (--long-tail-exact: the request ends at its drawn length)
                    one = replace(one, max_new_tokens=m)
                futures.append(self._submit(ids, one))
            group = _Group(step, g, row, list(ids), futures, time.perf_counter(), time.time_ns())
            _when_all(futures, lambda group=group: self._score(group))

    def _submit(self, prompt: list[int], params: Any) -> Future:
        if self.batcher is not None:
            return self.batcher.submit(prompt, params)
        assert self.requests is not None, "an engine without a batcher gets request threads"
        return self.requests.submit(lambda: self.w.engine.generate([prompt], params)[0])

    def _score(self, group: _Group) -> None:
        """Hand a finished group to the scoring threads (unless the run is closing)."""
        group.end_ns = time.time_ns()
        if self._closing:
            return
        try:
            self.scoring.submit(self._finish, group)
        except RuntimeError:  # shut down meanwhile: the run is over
            pass

    def _finish(self, group: _Group) -> None:
        """Score one finished group and put it on the bus; the step's ``put`` once its last group is in."""
        w = self.w
        try:
            outs = [f.result() for f in group.futures]
            secs = time.perf_counter() - group.t0
            w.tracer.add(
                "generate", group.start_ns, group.end_ns, "generate", step=group.step, group=group.index
            )
            gen = Generated(
                group.step,
                [group.row],
                [group.prompt] * self.n,
                outs,
                secs,
                model_tokens(outs),
                extra={sample.GENERATED_AT: group.end_ns / 1e9},
                first_group=group.index,
            )
            n, reward_s = w.samples.put(gen)
        except BusClosed:  # the run is over: groups still in flight are not wanted
            return
        except BaseException as e:  # noqa: BLE001 - the loop raises it; the health manager restarts the role
            if self._closing:
                return
            with self._cond:
                self.failure.append(e)
                self._cond.notify_all()
            return
        with self._cond:
            st = w.stats  # (how far responses went on across updates: the trainer's rollout/* metrics)
            st["streamed_groups"] = st.get("streamed_groups", 0) + 1
            st["inflight_groups_peak"] = max(st.get("inflight_groups_peak", 0), self.inflight)
            w.stats["samples"] += n
            w.stats["reward_s"] += reward_s
            w.stats["generate_s"] += secs
            self.journal.log(JournalEntry.put_group(group.step, group.index))
            prompts, todo = self.steps[group.step]
            todo.discard(group.index)
            if not todo:
                del self.steps[group.step]
                w.prompts.prompt_log.append((group.step, prompts))
                self.journal.log(JournalEntry.put(group.step, prompts))
            self.inflight -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """The run is over (the bus closed) or the loop failed: requests still in flight are dropped."""
        self._closing = True
        self.scoring.shutdown(wait=False, cancel_futures=True)
        if self.batcher is not None:
            self.batcher.close()
        if self.requests is not None:
            self.requests.shutdown(wait=False, cancel_futures=True)


def _when_all(futures: list[Future], then) -> None:
    """Call ``then()`` once every future is done (from the thread finishing the last)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one)
