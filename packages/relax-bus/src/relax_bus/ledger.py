"""The ledger behind :class:`~relax_bus.DataBus`: its state and the mechanics on it, every method called with
the bus lock (:attr:`Ledger.cond`) held (``put_rows`` and ``add_rows`` take it themselves).

Apart from ``core.py`` so the bus's public methods read as the contract (what each call waits for, what it
changes) while the mechanics live here: waiting, readiness, leases, staleness drops, eviction. The bus holds a
ledger (composition): the ledger owns every field it reads, the bus reads them through it.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from relax_bus.config import BusConfig
from relax_bus.errors import BusClosed, BusError, BusTimeout, DuplicateIds
from relax_bus.prepare import Row
from relax_bus.samplers import SampleRef
from relax_bus.staleness import StalenessBound
from relax_bus.state import ConsumerState, Lease, Sample
from relax_bus.values import Schema

COUNTS = (
    *("puts", "samples_put", "gets", "bytes_in", "bytes_out", "dropped_stale", "leases_expired"),
    *("put_waits", "get_waits", "admit_waits"),
)
"""The bus's counters (:meth:`DataBus.stats`)."""


class Ledger:
    """The bus's state and the mechanics on it: live samples, ids, groups, consumers, leases, staleness
    drops, waiting and eviction. :class:`~relax_bus.DataBus` holds one and calls it with its condition
    (:attr:`cond`) held; the ledger owns every field it reads."""

    def __init__(
        self, config: BusConfig, clock: Callable[[], float], grouped: list[str], schema: Schema
    ) -> None:
        self.config = config
        self.schema = schema
        """Each field's kind, dtype and shape, as first written (later writes must agree)."""
        self.clock = clock
        """Times lease deadlines (a test's manual clock)."""
        self.time: Callable[[], float] = time.monotonic
        """Times waits (always real time)."""
        self.cond = threading.Condition()
        """The bus's one lock: every ledger call is made with it held, every state change notifies it."""
        self.closed = False
        self.samples: dict[int, Sample] = {}
        self.groups: dict[Hashable, list[int]] = {}
        self.depth: dict[str, int] = {}
        """Live samples per partition."""
        self.consumers = {name: ConsumerState(spec) for name, spec in config.consumers.items()}
        self.leases: dict[int, Lease] = {}
        self.next_id = 0
        self.holes: list[list[int]] = []
        """Ids below ``next_id`` that no put has used yet (a producer putting explicit ids out of order, e.g.
        prompt groups as they finish): sorted, disjoint ``[lo, hi)`` intervals, so a producer that leaves
        ranges unused for good costs one interval per range, not one entry per id."""
        self.grouped = grouped
        """The consumers that take whole groups."""
        self.staleness: StalenessBound = config.staleness
        self.counts = dict.fromkeys(COUNTS, 0)
        self.wait_s = {"put": 0.0, "get": 0.0, "admit": 0.0}
        self.waiting = {"put": 0, "get": 0, "admit": 0}

    def put_rows(
        self,
        rows: list[Row],
        partition: str = "default",
        timeout: float | None = None,
        ids: list[int] | None = None,
    ) -> list[int]:
        """:meth:`DataBus.put` of prepared rows (the Ray controller's clients prepare them); takes the lock."""
        if not isinstance(partition, str) or not partition:
            raise BusError(f"put: partition must be a non-empty str, got {partition!r}")
        cap = self.config.capacity
        if len(rows) > cap:
            raise BusError(
                f"put of {len(rows)} samples can never fit: capacity is {cap}; split the batch or raise "
                "BusConfig.capacity"
            )
        with self.cond:
            self.check_open()
            self.check_ids(ids, len(rows))
            new_sigs = self.schema.check_rows([r.sigs for r in rows], "sample {}")
            self.check_groups(rows)
            if self.wait_for(
                lambda: len(self.samples) + len(rows) <= cap, timeout, "put", f"put of {len(rows)}"
            ):  # schema, groups and ids may have changed while waiting
                new_sigs = self.schema.check_rows([r.sigs for r in rows], "sample {}")
                self.check_groups(rows)
            ids = self.check_ids(ids, len(rows))
            self.schema.commit(new_sigs)
            for sid, row in zip(ids, rows):
                f = row.fields
                s = Sample(
                    sid,
                    partition,
                    f,
                    set(self.consumers),
                    f.get("group_id"),
                    f.get("group_size"),
                    f.get("policy_version"),
                    row.lengths,
                    row.size,
                )
                self.samples[sid] = s
                if self.grouped:
                    self.groups.setdefault(s.group_id, []).append(sid)
                for st in self.consumers.values():
                    st.available.add(sid)
                self.counts["bytes_in"] += row.size
            self.mark_used(ids)
            self.depth[partition] = self.depth.get(partition, 0) + len(ids)
            self.counts["puts"] += 1
            self.counts["samples_put"] += len(ids)
            self.cond.notify_all()
            return ids

    def add_rows(self, ids: list[int], rows: list[Row]) -> None:
        """:meth:`DataBus.add_fields` of prepared rows (one per id); takes the lock."""
        with self.cond:
            self.check_open()
            limit = self.config.max_sample_bytes
            for sid, row in zip(ids, rows):
                s = self.live(sid)
                for name in row.fields:
                    if name in s.fields:
                        raise BusError(
                            f"field {name!r} is already set on sample id {sid}; fields are write-once"
                        )
                if limit is not None and s.size + row.size > limit:
                    raise BusError(
                        f"sample id {sid} would be {s.size + row.size} bytes with {sorted(row.fields)}, over "
                        f"BusConfig.max_sample_bytes={limit}"
                    )
            self.schema.commit(self.schema.check_rows([r.sigs for r in rows], "sample id {}", ids))
            for sid, row in zip(ids, rows):
                s = self.samples[sid]
                s.fields.update(row.fields)
                s.lengths.update(row.lengths)
                s.size += row.size
                self.counts["bytes_in"] += row.size
            self.cond.notify_all()

    def check_groups(self, rows: list[Row]) -> None:
        if not self.grouped:
            return
        counts: dict[Hashable, int] = {}
        sizes: dict[Hashable, int] = {}
        for index, row in enumerate(rows):
            gid = row.fields["group_id"]
            live = self.groups.get(gid, [])
            if gid not in sizes:  # a group's size is set by its first sample
                first = self.samples[live[0]].group_size if live else row.fields.get("group_size")
                sizes[gid] = first or self.config.group_size
            counts[gid] = counts.get(gid, len(live)) + 1
            if counts[gid] > sizes[gid]:
                raise BusError(
                    f"sample {index}: group_id {gid!r} would have more than group_size={sizes[gid]} samples"
                )

    def check_ids(self, ids: list[int] | None, n: int) -> list[int]:
        if ids is None:
            return list(range(self.next_id, self.next_id + n))
        ids = list(ids)
        if len(ids) != n:
            raise BusError(f"put: {len(ids)} ids for {n} samples")
        seen: set[int] = set()
        for k, sid in enumerate(ids):
            if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
                raise BusError(f"sample {k} of the put: id must be an int >= 0, got {sid!r}")
            if sid in seen:
                raise BusError(f"sample {k} of the put: duplicate id {sid} within this put")
            if sid < self.next_id and not self.unused(sid):
                raise DuplicateIds(
                    f"sample {k} of the put: id {sid} was used before on this bus (ids are never reused; "
                    "explicit ids may come in any order, each once): a producer's re-send, and nothing is "
                    "written"
                )
            seen.add(sid)
        return ids

    def unused(self, sid: int) -> bool:
        i = bisect.bisect_right(self.holes, [sid, float("inf")]) - 1
        return i >= 0 and self.holes[i][0] <= sid < self.holes[i][1]

    def mark_used(self, ids: list[int]) -> None:
        """Record ``ids`` as used: a hole below ``next_id`` shrinks or splits; an id past it opens one."""
        for sid in sorted(ids):
            if sid >= self.next_id:
                if sid > self.next_id:
                    self.holes.append([self.next_id, sid])
                self.next_id = sid + 1
                continue
            i = bisect.bisect_right(self.holes, [sid, float("inf")]) - 1
            lo, hi = self.holes[i]
            pieces = [x for x in ([lo, sid], [sid + 1, hi]) if x[0] < x[1]]
            self.holes[i : i + 1] = pieces

    def wait_for(self, pred: Callable[[], bool], timeout: float | None, kind: str, what: str) -> bool:
        """Wait (releasing the lock) until ``pred()``; True if it had to wait at all."""
        self.check_open()
        if pred():
            return False
        start = self.time()
        deadline = None if timeout is None else start + timeout
        self.waiting[kind] += 1
        self.counts[f"{kind}_waits"] += 1
        try:
            while True:
                self.check_open()
                if pred():
                    return True
                now = self.time()
                wait = None if deadline is None else deadline - now
                if wait is not None and wait <= 0:
                    raise BusTimeout(f"{what} timed out after {timeout}s")
                self.expire_leases()  # else an expired lease would wake this loop every millisecond
                lease_deadlines = [ls.deadline for ls in self.leases.values() if ls.deadline is not None]
                if lease_deadlines:  # wake up to redeliver expired leases
                    until_lease = max(min(lease_deadlines) - self.clock(), 0.0) + 1e-3
                    wait = until_lease if wait is None else min(wait, until_lease)
                self.cond.wait(wait)
        finally:
            self.waiting[kind] -= 1
            self.wait_s[kind] += self.time() - start

    def check_open(self) -> None:
        if self.closed:
            raise BusClosed("the bus is closed")

    def consumer(self, name: str) -> ConsumerState:
        try:
            return self.consumers[name]
        except (KeyError, TypeError):
            raise BusError(f"unknown consumer {name!r}; configured: {sorted(self.consumers)}") from None

    def live(self, sid: int) -> Sample:
        s = self.samples.get(sid)
        if s is None:
            state = "already evicted" if isinstance(sid, int) and 0 <= sid < self.next_id else "unknown"
            raise BusError(f"sample id {sid!r} is {state}")
        return s

    def ready_refs(
        self, st: ConsumerState, limit: int | None = None, partition: str | None = None
    ) -> list[SampleRef]:
        """Ready samples of a consumer in id order (the first ``limit`` only, when given; of ``partition``
        only, when given)."""
        req, lf = st.spec.required_fields, st.spec.length_field
        refs = []
        samples = self.samples
        for sid in sorted(st.available):
            s = samples[sid]
            if (partition is None or s.partition == partition) and all(f in s.fields for f in req):
                refs.append(SampleRef(sid, s.group_id, s.group_size, s.lengths.get(lf, 0) if lf else 0))
                if limit is not None and len(refs) >= limit:
                    break
        return refs

    def drop_stale(self, name: str, st: ConsumerState, t: int) -> None:
        """Drop this consumer's stale samples; for a grouped consumer, whole groups: a group with a stale
        member is dropped, members still to come included, until all ``group_size`` are gone. Then its id
        is forgotten, so a producer may use it again for a new group."""
        grouped = name in self.grouped
        stale = set()
        for sid in st.available:
            s = self.samples[sid]
            if self.staleness.is_stale(sample_version(s), t):
                stale.add(sid)
                if grouped and s.group_id not in st.dropped_groups:
                    st.dropped_groups[s.group_id] = s.group_size or self.config.group_size
        if grouped and st.dropped_groups:
            stale.update(sid for sid in st.available if self.samples[sid].group_id in st.dropped_groups)
        for sid in stale:
            if grouped:
                gid = self.samples[sid].group_id
                st.dropped_groups[gid] -= 1
                if st.dropped_groups[gid] <= 0:
                    del st.dropped_groups[gid]
            st.available.discard(sid)
            st.dropped_stale += 1
            self.counts["dropped_stale"] += 1
            self.release(sid, name)
        if stale:
            self.cond.notify_all()

    def columns(self, samples: list[Sample], fields: list[str] | None) -> dict[str, list[Any]]:
        if fields is None:
            names = list(dict.fromkeys(f for s in samples for f in s.fields))
            return {f: [s.fields.get(f) for s in samples] for f in names}
        for f in fields:
            for s in samples:
                if f not in s.fields:
                    raise BusError(
                        f"field {f!r} is not written on sample id {s.id}; add it to this consumer's "
                        "required_fields so get waits for it"
                    )
        return {f: [s.fields[f] for s in samples] for f in fields}

    def take_lease(self, consumer: str, lease_id: int) -> Lease:
        self.consumer(consumer)
        self.expire_leases()
        lease = self.leases.get(lease_id)
        if lease is None or lease.consumer != consumer:
            raise BusError(
                f"unknown lease {lease_id!r} for consumer {consumer!r} "
                "(already acked or nacked, or expired after lease_timeout_s and redelivered)"
            )
        del self.leases[lease_id]
        return lease

    def redeliver(self, lease: Lease) -> None:
        st = self.consumers[lease.consumer]
        st.available.update(lease.ids)
        st.redelivered += len(lease.ids)

    def expire_leases(self) -> None:
        if self.config.lease_timeout_s is None or not self.leases:
            return
        now = self.clock()
        expired = [k for k, ls in self.leases.items() if ls.deadline is not None and ls.deadline <= now]
        for k in expired:
            self.redeliver(self.leases.pop(k))
        if expired:
            self.counts["leases_expired"] += len(expired)
            self.cond.notify_all()

    def release(self, sid: int, consumer: str) -> None:
        s = self.samples[sid]
        s.waiting.discard(consumer)
        if s.waiting:
            return
        del self.samples[sid]
        self.depth[s.partition] -= 1
        if not self.depth[s.partition]:
            del self.depth[s.partition]  # partition cleared
        members = self.groups.get(s.group_id)
        if members is not None:
            members.remove(sid)
            if not members:
                del self.groups[s.group_id]


def sample_version(s: Sample) -> int:
    """The policy version of a sample where a consumer enforces staleness: put required it then
    (``prepare._check_sample``), so None here is a broken invariant, not a user error."""
    assert s.version is not None, f"sample id {s.id} has no policy_version"
    return s.version
