"""How long an engine stood still for each weight update (#53): the pause rollout pays for a sync.

Why measured at the engine: a sync's bytes and time are the trainer's to see, but what the run loses is the
time the engines stop generating, and only the engine knows it. The torch engine's pause is the time its
lock is held for the load (no decode or prefill step runs meanwhile: from the last token before the update
to the first after, less the batcher's loop overhead); SGLang's, the time from ``/pause_generation`` to
``/continue_generation`` around the update's session. The rollout drains the pauses with every batch it
puts and stamps the longest on its samples (``relax_core.sample.WEIGHT_PAUSE_S``), so the trainer logs it
as ``perf/weight_pause_s`` beside the sync's bytes and seconds, and ``relax watch`` shows it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


class WeightPauses:
    """The pauses not yet taken, as (weight version, seconds); bounded (the oldest dropped) so an engine
    whose rollout never drains them does not grow."""

    def __init__(self, keep: int = 1000) -> None:
        self._recent: deque[tuple[int, float]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, version: int, seconds: float) -> None:
        with self._lock:
            self._recent.append((version, seconds))

    @contextlib.contextmanager
    def timed(self, version: int) -> Iterator[None]:
        """Count the block's wall time as the pause of the update to ``version`` (failed or not: the
        engine stood still either way)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(version, time.perf_counter() - t0)

    def drain(self) -> list[tuple[int, float]]:
        """The pauses since the last drain, oldest first."""
        with self._lock:
            out = list(self._recent)
            self._recent.clear()
        return out


@runtime_checkable
class RecordsPauses(Protocol):
    """An engine that measures its weight-update pauses (the torch and SGLang engines)."""

    pauses: WeightPauses


def longest_pause(engine: Any) -> float:
    """The longest of ``engine``'s pauses since the last call (drained); 0.0 when none, or for an engine that
    does not measure them."""
    if not isinstance(engine, RecordsPauses):
        return 0.0
    return max((seconds for _, seconds in engine.pauses.drain()), default=0.0)
