"""Plain records behind :class:`~relax_bus.DataBus`: a sample, a consumer's view, a lease, a batch, and the
whole saved state (:class:`BusState`).

Kept apart from the bus logic so the Ray backend and snapshot/restore reuse and serialise them; they hold no
locks and no behaviour beyond bookkeeping.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from relax_bus.config import BusConfig, ConsumerSpec


@dataclass(slots=True)
class Sample:
    """One live sample: its fields and the consumers that have not acknowledged (or dropped) it yet."""

    id: int
    partition: str
    fields: dict[str, Any]
    waiting: set[str]
    group_id: Hashable | None = None
    group_size: int | None = None
    version: int | None = None
    lengths: dict[str, int] = field(default_factory=dict)
    size: int = 0


@dataclass(slots=True)
class ConsumerState:
    """Per-consumer bookkeeping; ``available`` holds live ids this consumer has not taken yet."""

    spec: ConsumerSpec
    available: set[int] = field(default_factory=set)
    dropped_groups: dict[Hashable, int] = field(default_factory=dict)
    """Groups dropped as stale -> how many of their members are still to be dropped (then forgotten)."""
    acked_ids: list[int] = field(default_factory=list)
    delivered: int = 0
    acked: int = 0
    redelivered: int = 0
    dropped_stale: int = 0
    gets: int = 0
    resets: int = 0
    """How often ``reset_consumer`` ran: a ``get`` that began before a reset takes nothing."""


@dataclass(slots=True)
class Lease:
    """Samples handed to ``consumer`` and not yet acked; ``deadline`` is a time.monotonic() value or None."""

    consumer: str
    ids: list[int]
    deadline: float | None


class ManualClock:
    """A clock for tests: lease deadlines move only when :meth:`advance` is called."""

    def __init__(self) -> None:
        self.now = 0.0
        self.watchers: list[threading.Condition] = []
        """Conditions to notify when it moves: a bus's waiters re-check lease deadlines (:meth:`watch`)."""

    def __call__(self) -> float:
        return self.now

    def watch(self, cond: threading.Condition) -> None:
        """Notify ``cond`` at every :meth:`advance` (a bus built on this clock watches it)."""
        self.watchers.append(cond)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for cond in self.watchers:
            with cond:
                cond.notify_all()


@dataclass
class Batch:
    """What ``get`` returns.

    ``data[field][i]`` belongs to sample ``ids[i]``, which lives in partition ``partitions[i]``. Values are the
    bus's own objects (not copies): treat them as read-only. Pass ``lease_id`` to ``ack`` (done) or ``nack``
    (give back).
    """

    ids: list[int]
    data: dict[str, list[Any]]
    lease_id: int
    consumer: str
    partitions: list[str]
    trainer_version: int | None = None
    """The trainer version staleness was checked against (consumers with enforce_staleness), else None."""

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class SavedSample:
    """A live sample as saved: its fields and which consumers have not acknowledged (or dropped) it."""

    id: int
    partition: str
    fields: dict[str, Any]
    waiting: list[str]
    lengths: dict[str, int]
    size: int


@dataclass(slots=True)
class SavedConsumer:
    """One consumer's progress as saved. ``available`` includes what it held in flight (not delivered)."""

    available: list[int]
    dropped_groups: dict[Hashable, int]
    acked_ids: list[int]
    delivered: int = 0
    acked: int = 0
    redelivered: int = 0
    dropped_stale: int = 0
    gets: int = 0


@dataclass(slots=True)
class BusState:
    """Everything a bus must carry over a restart: :meth:`DataBus.state_dict` returns it,
    :meth:`DataBus.load_state_dict` loads it into a fresh bus of the same consumers, ``snapshot.py`` writes it.

    Leases in flight are not part of it: their samples count as not delivered (``SavedConsumer.available``),
    since the consumer that held them is gone after a restart and its work was not acknowledged.
    """

    config: BusConfig
    samples: list[SavedSample]
    consumers: dict[str, SavedConsumer]
    next_id: int
    unused_ids: list[list[int]]
    """Ids below ``next_id`` no put has used yet: sorted, disjoint ``[lo, hi)`` ranges."""
    next_lease: int
    trainer_version: int
    schema: dict[str, Any]
    """Field name -> the signature (type, dtype, rank) its first write fixed."""
    counts: dict[str, int]
    staleness_hist: dict[int, int]
