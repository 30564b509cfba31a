"""What the roles share: the bus loop and the device turns.

Every bus consumer (ActorFwd, Reference, Teacher, Advantages) runs the same loop: take what is ready, compute,
write it back, acknowledge; the roles that hold a model hand their device memory to the rollout engine and
take it back (colocate ``--offload``). One copy of each, here, so a change to either reaches every role.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from relax_core.trace import Tracer

if TYPE_CHECKING:
    from relax_bus import Bus


def set_threads(n: int | None) -> None:
    """A role's torch intra-op threads (its share of the machine's cores); None keeps torch's default."""
    if n:
        import torch

        torch.set_num_threads(n)


class DeviceTurns:
    """Colocate with ``--offload``: a role's device memory goes to host memory while the rollout engine
    generates, and comes back for its turn (the backend's ``offload`` / ``onload``)."""

    backend: Any
    tracer: Tracer

    def offload(self) -> int:
        with self.tracer.span("offload") as args:
            args["bytes"] = n = self.backend.offload()
        return n

    def onload(self) -> int:
        with self.tracer.span("onload") as args:
            args["bytes"] = n = self.backend.onload()
        return n


class BusLoop:
    """Shared loop: take what is ready (partial batches), process, ack; stop when the bus closes."""

    consumer: str
    bus: Bus
    batch_size: int = 64
    phase: str
    """The span name of :meth:`handle` in the run's trace."""
    tracer: Tracer

    _beat: float = 0.0
    _receiver: Any = None

    def heartbeat(self) -> dict[str, Any]:
        """For the health manager: seconds since the loop last made progress (or polled idle)."""
        return {"pid": os.getpid(), "age_s": time.monotonic() - self._beat if self._beat else 0.0}

    def process(self, timeout: float | None = 0.0) -> int:
        self._beat = time.monotonic()
        batch = self.bus.get(self.consumer, n=self.batch_size, partial=True, timeout=timeout)
        with self.tracer.span(self.phase, n=len(batch), partitions=",".join(sorted(set(batch.partitions)))):
            self.handle(batch)
        self.bus.ack(self.consumer, batch.lease_id)
        return len(batch)

    def drain(self) -> int:
        """Process everything ready now (colocate)."""
        from relax_bus import BusTimeout

        total = 0
        while True:
            try:
                total += self.process(timeout=0.0)
            except BusTimeout:
                return total

    def run(self) -> int:
        from relax_bus import BusClosed, BusTimeout, ConsumerReset

        total = 0
        self._beat = time.monotonic()
        while True:
            try:
                total += self.process(timeout=1.0)
            except (BusTimeout, ConsumerReset):  # (reset while alive: what it held comes back; get again)
                self._beat = time.monotonic()
                continue
            except BusClosed:
                return total

    def handle(self, batch) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_spans(self) -> list[dict[str, Any]]:
        return self.tracer.get_spans()
