"""Bookkeeping behind :class:`~relax_bus.DataBus`, every method called with the bus lock held.

Split from ``core.py`` so the public methods read as the contract (what each call waits for, what it changes)
while the mechanics live here: waiting, readiness, leases, staleness drops, eviction.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Hashable
from typing import Any

from relax_bus.config import BusConfig
from relax_bus.errors import BusClosed, BusError, BusTimeout, DuplicateIds
from relax_bus.prepare import Row
from relax_bus.samplers import SampleRef
from relax_bus.staleness import StalenessBound
from relax_bus.state import ConsumerState, Lease, Sample


class _Book:
    # attributes set by DataBus.__init__ / load_state_dict
    config: BusConfig
    _cond: threading.Condition
    _closed: bool
    _clock: Callable[[], float]
    _time: Callable[[], float]
    _next_id: int
    _grouped: list[str]
    _counts: dict[str, int]
    _wait_s: dict[str, float]
    _waiting: dict[str, int]
    _samples: dict[int, Sample]
    _consumers: dict[str, ConsumerState]
    _leases: dict[int, Lease]
    _groups: dict[Hashable, list[int]]
    _depth: dict[str, int]
    _staleness: StalenessBound

    def _check_groups(self, rows: list[Row]) -> None:
        if not self._grouped:
            return
        counts: dict[Hashable, int] = {}
        sizes: dict[Hashable, int] = {}
        for index, row in enumerate(rows):
            gid = row.fields["group_id"]
            live = self._groups.get(gid, [])
            if gid not in sizes:  # a group's size is set by its first sample
                first = self._samples[live[0]].group_size if live else row.fields.get("group_size")
                sizes[gid] = first or self.config.group_size
            counts[gid] = counts.get(gid, len(live)) + 1
            if counts[gid] > sizes[gid]:
                raise BusError(
                    f"sample {index}: group_id {gid!r} would have more than group_size={sizes[gid]} samples"
                )

    def _check_ids(self, ids: list[int] | None, n: int) -> list[int]:
        if ids is None:
            return list(range(self._next_id, self._next_id + n))
        ids = list(ids)
        if len(ids) != n:
            raise BusError(f"put: {len(ids)} ids for {n} samples")
        seen: set[int] = set()
        for k, sid in enumerate(ids):
            if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
                raise BusError(f"sample {k} of the put: id must be an int >= 0, got {sid!r}")
            if sid in seen:
                raise BusError(f"sample {k} of the put: duplicate id {sid} within this put")
            if sid < self._next_id and not self._unused(sid):
                raise DuplicateIds(
                    f"sample {k} of the put: id {sid} was used before on this bus (ids are never reused; "
                    "explicit ids may come in any order, each once): a producer's re-send, and nothing is "
                    "written"
                )
            seen.add(sid)
        return ids

    # ids below ``_next_id`` that no put has used yet (a producer putting explicit ids out of order, e.g.
    # prompt groups as they finish): sorted, disjoint ``[lo, hi)`` intervals, so a producer that leaves
    # ranges unused for good costs one interval per range, not one entry per id
    _holes: list[list[int]]

    def _unused(self, sid: int) -> bool:
        i = bisect.bisect_right(self._holes, [sid, float("inf")]) - 1
        return i >= 0 and self._holes[i][0] <= sid < self._holes[i][1]

    def _mark_used(self, ids: list[int]) -> None:
        """Record ``ids`` as used: a hole below ``_next_id`` shrinks or splits; an id past it opens one."""
        for sid in sorted(ids):
            if sid >= self._next_id:
                if sid > self._next_id:
                    self._holes.append([self._next_id, sid])
                self._next_id = sid + 1
                continue
            i = bisect.bisect_right(self._holes, [sid, float("inf")]) - 1
            lo, hi = self._holes[i]
            pieces = [x for x in ([lo, sid], [sid + 1, hi]) if x[0] < x[1]]
            self._holes[i : i + 1] = pieces

    def _wait_for(self, pred: Callable[[], bool], timeout: float | None, kind: str, what: str) -> bool:
        """Wait (releasing the lock) until ``pred()``; True if it had to wait at all."""
        self._check_open()
        if pred():
            return False
        start = self._time()
        deadline = None if timeout is None else start + timeout
        self._waiting[kind] += 1
        self._counts[f"{kind}_waits"] += 1
        try:
            while True:
                self._check_open()
                if pred():
                    return True
                now = self._time()
                wait = None if deadline is None else deadline - now
                if wait is not None and wait <= 0:
                    raise BusTimeout(f"{what} timed out after {timeout}s")
                self._expire_leases()  # else an expired lease would wake this loop every millisecond
                lease_deadlines = [ls.deadline for ls in self._leases.values() if ls.deadline is not None]
                if lease_deadlines:  # wake up to redeliver expired leases
                    until_lease = max(min(lease_deadlines) - self._clock(), 0.0) + 1e-3
                    wait = until_lease if wait is None else min(wait, until_lease)
                self._cond.wait(wait)
        finally:
            self._waiting[kind] -= 1
            self._wait_s[kind] += self._time() - start

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("the bus is closed")

    def _consumer(self, name: str) -> ConsumerState:
        try:
            return self._consumers[name]
        except (KeyError, TypeError):
            raise BusError(f"unknown consumer {name!r}; configured: {sorted(self._consumers)}") from None

    def _live(self, sid: int) -> Sample:
        s = self._samples.get(sid)
        if s is None:
            state = "already evicted" if isinstance(sid, int) and 0 <= sid < self._next_id else "unknown"
            raise BusError(f"sample id {sid!r} is {state}")
        return s

    def _ready_refs(
        self, st: ConsumerState, limit: int | None = None, partition: str | None = None
    ) -> list[SampleRef]:
        """Ready samples of a consumer in id order (the first ``limit`` only, when given; of ``partition``
        only, when given)."""
        req, lf = st.spec.required_fields, st.spec.length_field
        refs = []
        samples = self._samples
        for sid in sorted(st.available):
            s = samples[sid]
            if (partition is None or s.partition == partition) and all(f in s.fields for f in req):
                refs.append(SampleRef(sid, s.group_id, s.group_size, s.lengths.get(lf, 0) if lf else 0))
                if limit is not None and len(refs) >= limit:
                    break
        return refs

    def _drop_stale(self, name: str, st: ConsumerState, t: int) -> None:
        """Drop this consumer's stale samples; for a grouped consumer, whole groups: a group with a stale
        member is dropped, members still to come included, until all ``group_size`` are gone. Then its id
        is forgotten, so a producer may use it again for a new group."""
        grouped = name in self._grouped
        stale = set()
        for sid in st.available:
            s = self._samples[sid]
            if self._staleness.is_stale(_version(s), t):
                stale.add(sid)
                if grouped and s.group_id not in st.dropped_groups:
                    st.dropped_groups[s.group_id] = s.group_size or self.config.group_size
        if grouped and st.dropped_groups:
            stale.update(sid for sid in st.available if self._samples[sid].group_id in st.dropped_groups)
        for sid in stale:
            if grouped:
                gid = self._samples[sid].group_id
                st.dropped_groups[gid] -= 1
                if st.dropped_groups[gid] <= 0:
                    del st.dropped_groups[gid]
            st.available.discard(sid)
            st.dropped_stale += 1
            self._counts["dropped_stale"] += 1
            self._release(sid, name)
        if stale:
            self._cond.notify_all()

    def _columns(self, samples: list[Sample], fields: list[str] | None) -> dict[str, list[Any]]:
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

    def _take_lease(self, consumer: str, lease_id: int) -> Lease:
        self._consumer(consumer)
        self._expire_leases()
        lease = self._leases.get(lease_id)
        if lease is None or lease.consumer != consumer:
            raise BusError(
                f"unknown lease {lease_id!r} for consumer {consumer!r} "
                "(already acked or nacked, or expired after lease_timeout_s and redelivered)"
            )
        del self._leases[lease_id]
        return lease

    def _redeliver(self, lease: Lease) -> None:
        st = self._consumers[lease.consumer]
        st.available.update(lease.ids)
        st.redelivered += len(lease.ids)

    def _expire_leases(self) -> None:
        if self.config.lease_timeout_s is None or not self._leases:
            return
        now = self._clock()
        expired = [k for k, ls in self._leases.items() if ls.deadline is not None and ls.deadline <= now]
        for k in expired:
            self._redeliver(self._leases.pop(k))
        if expired:
            self._counts["leases_expired"] += len(expired)
            self._cond.notify_all()

    def _release(self, sid: int, consumer: str) -> None:
        s = self._samples[sid]
        s.waiting.discard(consumer)
        if s.waiting:
            return
        del self._samples[sid]
        self._depth[s.partition] -= 1
        if not self._depth[s.partition]:
            del self._depth[s.partition]  # partition cleared
        members = self._groups.get(s.group_id)
        if members is not None:
            members.remove(sid)
            if not members:
                del self._groups[s.group_id]


def _version(s: Sample) -> int:
    """The policy version of a sample where a consumer enforces staleness: put required it then
    (``prepare._check_sample``), so None here is a broken invariant, not a user error."""
    assert s.version is not None, f"sample id {s.id} has no policy_version"
    return s.version
