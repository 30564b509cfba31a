"""A rollout step's way from admission to the bus: admitted (the bus's staleness bound, then weights fresh
enough), begun (journaled with where its prompts start), generated, scored and put on the bus (journaled),
counted. A part of :class:`~relax_rollout.worker.RolloutWorker`, given the parts it drives; the streaming
loop (:class:`~relax_rollout.streaming.GroupStream`) drives the same one group by group.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from relax_bus import Bus
from relax_bus.staleness import StalenessBound
from relax_core.config import RelaxConfig
from relax_core.resume import Journal, JournalEntry
from relax_core.trace import Tracer
from relax_core.weight_sync import WeightSubscriber
from relax_rollout.engines.base import RolloutEngine
from relax_rollout.generation import Generated, Generation
from relax_rollout.prompts import Prompts
from relax_rollout.samples import SampleWriter


class RolloutSteps:
    """Admission, generation and the bus write of each rollout step, journaled, with their counts."""

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Bus,
        journal: Journal,
        prompts: Prompts,
        generation: Generation,
        samples: SampleWriter,
        tracer: Tracer,
        weights: WeightSubscriber,
        stats: dict[str, Any],
    ) -> None:
        """``stats``: the role's counters, shared with the prompts and the generation (samples put, seconds
        generating, scoring and waiting for admission)."""
        self.cfg, self.bus, self.journal, self.tracer = cfg, bus, journal, tracer
        self.prompts, self.generation, self.samples, self.weights = prompts, generation, samples, weights
        self.stats = stats
        self.loaded = threading.Condition()
        """Notified when the engine takes new weights (:meth:`admit` waits on it)."""
        self.beat = 0.0
        """When the loop last made progress or polled idle (``time.monotonic()``; 0: not yet)."""

    @property
    def engine(self) -> RolloutEngine:
        """The engine generating (the generation's)."""
        return self.generation.engine

    def alive(self) -> None:
        """Mark progress (or an idle poll) for the role's heartbeat."""
        self.beat = time.monotonic()

    def admit(self, step: int) -> None:
        """Wait until step ``step`` may begin: the bus admits it (the staleness bound) and, with the
        ``wait`` policy, the engine holds weights of version ``step - max_staleness`` or newer. Polls, so
        the heartbeat shows a live loop while back-pressure holds it; the seconds count as ``wait_s``."""
        from relax_bus import BusTimeout

        t0 = time.perf_counter()
        while True:
            self.alive()
            try:
                self.bus.admit(step, timeout=1.0)
                break
            except BusTimeout:
                continue
        run = self.cfg.run
        need = StalenessBound(run.max_staleness, run.staleness_policy).admit_version(step)
        with self.loaded:
            while self.engine.weight_version < need:
                self.alive()
                if not run.health:  # (under the health manager a broken group is re-formed)
                    self.weights.check()
                self.loaded.wait(0.5)
        self.stats["wait_s"] += time.perf_counter() - t0

    def collect(self, step: int) -> Generated:
        """One batch generated (and, with dynamic sampling, scored and filtered)."""
        self.journal.log(JournalEntry.begin(step, self.prompts.begin(step)))
        out = self.generation.batch(step)
        # where the next step begins: a process killed before it began restarts from here
        self.journal.log(JournalEntry.drawn(step, self.prompts.iterator.state_dict()))
        return out

    def finish(self, gen: Generated) -> dict[str, float]:
        """Score a generated batch (unless dynamic sampling already did), put it on the bus and log it."""
        n, reward_s = self.samples.put(gen)
        self.prompts.prompt_log.append((gen.step, [row.row_id for row in gen.rows]))
        self.journal.log(JournalEntry.put(gen.step, [row.row_id for row in gen.rows]))
        self.stats["samples"] += n
        self.stats["reward_s"] += reward_s
        return {"generate_s": gen.generate_s, "reward_s": reward_s}
