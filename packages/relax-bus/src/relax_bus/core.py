"""The in-process data bus: columns of per-sample fields, named consumers, staleness control.

Why it is shaped this way:

- One lock and one ``threading.Condition``: every blocking call (put on a full bus, get on too few ready
  samples, admit ahead of the trainer) waits on the condition, which releases the lock, so a blocked reader
  never stalls writers or other readers. Every state change calls ``notify_all``; waiters re-check their own
  predicate. Simple and correct at the scale of one process (thousands of live samples).
- Exactly once per consumer: each consumer keeps the set of live ids it has not taken. ``get`` moves ids into
  a lease; ``ack`` retires them, ``nack`` or lease expiry puts them back. A sample is evicted (capacity freed)
  when every consumer has acked or dropped it.
- Readiness is per consumer: a sample is ready when the consumer's ``required_fields`` are written, so roles
  (ActorFwd, Reference, Advantages) can fill columns incrementally with ``add_fields``.
- Staleness is a bus guarantee, not a trainer convention: see ``BusConfig.max_staleness``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from relax_bus.config import BusConfig
from relax_bus.errors import BusClosed, BusError, BusTimeout, StaleSampleError
from relax_bus.samplers import GROUPED_SAMPLERS, SAMPLERS, SampleRef
from relax_bus.state import Batch, ConsumerState, Lease, Sample
from relax_bus.values import nbytes, to_value

RESERVED_FIELDS = ("group_id", "policy_version", "group_size")


class DataBus:
    """Thread-safe in-process bus. See the package README for the full contract."""

    def __init__(self, config: BusConfig | dict[str, Any]) -> None:
        self.config = config if isinstance(config, BusConfig) else BusConfig.model_validate(config)
        cfg = self.config
        self._cond = threading.Condition()
        self._closed = False
        self._samples: dict[int, Sample] = {}
        self._groups: dict[Hashable, list[int]] = {}  # live members of each group
        self._depth: dict[str, int] = {}
        self._consumers = {name: ConsumerState(spec) for name, spec in cfg.consumers.items()}
        self._leases: dict[int, Lease] = {}
        self._next_id = 0
        self._next_lease = 0
        self._trainer_version = 0
        self._grouped = [n for n, s in cfg.consumers.items() if s.sampler in GROUPED_SAMPLERS]
        self._versioned = [n for n, s in cfg.consumers.items() if s.enforce_staleness]
        self._counts = {"puts": 0, "samples_put": 0, "gets": 0, "bytes_in": 0, "dropped_stale": 0}
        self._wait_s = {"put": 0.0, "get": 0.0, "admit": 0.0}
        self._waiting = {"put": 0, "get": 0, "admit": 0}
        self._staleness_hist: dict[int, int] = {}

    # ------------------------------------------------------------------ producers
    def put(
        self, samples: list[dict[str, Any]], partition: str = "default", timeout: float | None = None
    ) -> list[int]:
        """Append samples; returns their global ids (monotonic). Blocks while the bus is full."""
        rows = [self._validate_sample(i, s) for i, s in enumerate(samples)]
        if len(rows) > self.config.capacity:
            raise BusError(
                f"put of {len(rows)} samples can never fit: capacity is {self.config.capacity}; "
                "split the batch or raise BusConfig.capacity"
            )
        with self._cond:
            self._check_open()
            self._check_groups(rows)
            cap = self.config.capacity
            self._wait_for(
                lambda: len(self._samples) + len(rows) <= cap, timeout, "put", f"put of {len(rows)}"
            )
            self._check_groups(rows)  # groups may have changed while waiting
            ids = []
            for fields, size in rows:
                sid = self._next_id
                self._next_id += 1
                s = Sample(
                    sid,
                    partition,
                    fields,
                    set(self._consumers),
                    fields.get("group_id"),
                    fields.get("group_size"),
                    fields.get("policy_version"),
                )
                self._samples[sid] = s
                if self._grouped:
                    self._groups.setdefault(s.group_id, []).append(sid)
                for st in self._consumers.values():
                    st.available.add(sid)
                self._counts["bytes_in"] += size
                ids.append(sid)
            self._depth[partition] = self._depth.get(partition, 0) + len(ids)
            self._counts["puts"] += 1
            self._counts["samples_put"] += len(ids)
            self._cond.notify_all()
            return ids

    def add_fields(self, ids: list[int], fields: dict[str, list[Any]]) -> None:
        """Write new fields on live samples (e.g. ``log_probs``); wakes consumers waiting for them."""
        for name, values in fields.items():
            if name in RESERVED_FIELDS:
                raise BusError(f"field {name!r} is reserved and can only be set by put")
            if len(values) != len(ids):
                raise BusError(f"add_fields: field {name!r} has {len(values)} values for {len(ids)} ids")
        if len(set(ids)) != len(ids):
            raise BusError("add_fields: ids contain duplicates")
        converted = {
            n: [to_value(v, n, f"sample id {i}") for i, v in zip(ids, vals)] for n, vals in fields.items()
        }
        with self._cond:
            self._check_open()
            for sid in ids:
                s = self._live(sid)
                for name in converted:
                    if name in s.fields:
                        raise BusError(
                            f"field {name!r} is already set on sample id {sid}; fields are write-once"
                        )
            for name, vals in converted.items():
                for sid, v in zip(ids, vals):
                    self._samples[sid].fields[name] = v
                    self._counts["bytes_in"] += nbytes(v)
            self._cond.notify_all()

    def admit(self, step: int, timeout: float | None = None) -> int:
        """Staleness gate for the producer of rollout step ``step`` (0-based; the trainer consumes step k at version k).

        Blocks until ``step - trainer_version <= max_staleness`` and returns the trainer version then. Stamp the
        samples of that step with a ``policy_version`` >= the returned value (the weights you generate with) and
        have the trainer take step k's samples at version k: then every delivered sample has staleness
        ``k - policy_version <= max_staleness``. No-op with ``max_staleness=None`` or ``staleness_policy="drop"``.
        """
        if step < 0:
            raise BusError(f"admit: step must be >= 0 (got {step})")
        s = self.config.max_staleness
        with self._cond:
            self._check_open()
            if s is not None and self.config.staleness_policy == "wait":
                self._wait_for(lambda: step - self._trainer_version <= s, timeout, "admit", f"admit({step})")
            return self._trainer_version

    # ------------------------------------------------------------------ trainer
    def set_trainer_version(self, version: int) -> None:
        """Report that the trainer finished ``version`` updates; wakes ``admit`` waiters. Monotonic."""
        with self._cond:
            self._check_open()
            if version < self._trainer_version:
                raise BusError(
                    f"trainer version must not decrease (is {self._trainer_version}, got {version})"
                )
            self._trainer_version = version
            self._cond.notify_all()

    @property
    def trainer_version(self) -> int:
        """Updates the trainer has finished (0 before the first one)."""
        with self._cond:
            return self._trainer_version

    # ------------------------------------------------------------------ consumers
    def get(
        self,
        consumer: str,
        n: int,
        fields: list[str] | None = None,
        timeout: float | None = None,
        partial: bool = False,
        trainer_version: int | None = None,
    ) -> Batch:
        """Take ``n`` ready samples this consumer has not taken yet (see README for blocking and staleness)."""
        if n < 1:
            raise BusError(f"get: n must be >= 1 (got {n})")
        with self._cond:
            self._check_open()
            st = self._consumer(consumer)
            sampler = SAMPLERS[st.spec.sampler]
            enforce = st.spec.enforce_staleness and self.config.max_staleness is not None
            chosen: list[int] = []

            def satisfied() -> bool:
                nonlocal chosen
                self._expire_leases()
                t = self._trainer_version if trainer_version is None else trainer_version
                if enforce and self.config.staleness_policy == "drop":
                    self._drop_stale(consumer, st, t)
                chosen = sampler(self._ready_refs(st), n, partial, self.config.group_size)
                return bool(chosen)

            self._wait_for(satisfied, timeout, "get", f"get({consumer!r}, n={n})")
            t = self._trainer_version if trainer_version is None else trainer_version
            samples = [self._samples[i] for i in chosen]
            if enforce:
                stale = [s.id for s in samples if t - s.version > self.config.max_staleness]
                if stale:
                    raise StaleSampleError(
                        f"samples {stale[:8]} are older than max_staleness={self.config.max_staleness} at "
                        f"trainer version {t}; producers must call admit(step) before generating"
                    )
            data = self._columns(samples, fields)
            lease_id = self._next_lease
            self._next_lease += 1
            timeout_s = self.config.lease_timeout_s
            self._leases[lease_id] = Lease(
                consumer, chosen, None if timeout_s is None else time.monotonic() + timeout_s
            )
            st.available.difference_update(chosen)
            st.delivered += len(chosen)
            st.gets += 1
            self._counts["gets"] += 1
            if enforce:
                for s in samples:
                    self._staleness_hist[t - s.version] = self._staleness_hist.get(t - s.version, 0) + 1
            return Batch(
                chosen, data, lease_id, consumer, [s.partition for s in samples], t if enforce else None
            )

    def ack(self, consumer: str, lease_id: int) -> None:
        """Acknowledge a batch; samples every consumer has acked are evicted (freeing capacity)."""
        with self._cond:
            self._check_open()
            lease = self._take_lease(consumer, lease_id)
            st = self._consumers[consumer]
            st.acked += len(lease.ids)
            st.acked_ids.extend(lease.ids)
            for sid in lease.ids:
                self._release(sid, consumer)
            self._cond.notify_all()

    def nack(self, consumer: str, lease_id: int) -> None:
        """Give a batch back; its samples are delivered again to this consumer."""
        with self._cond:
            self._check_open()
            lease = self._take_lease(consumer, lease_id)
            self._redeliver(lease)
            self._cond.notify_all()

    # ------------------------------------------------------------------ lifecycle and introspection
    def close(self) -> None:
        """Wake every waiter with BusClosed; later calls raise BusClosed (stats stay readable). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def consumed_ids(self, consumer: str) -> list[int]:
        """Ids acked by ``consumer``, in ack order (for tests and audits)."""
        with self._cond:
            return list(self._consumer(consumer).acked_ids)

    def stats(self) -> dict[str, Any]:
        """A snapshot of counters; cheap enough to poll for metrics."""
        with self._cond:
            self._expire_leases()
            consumers = {
                name: {
                    "delivered": st.delivered,
                    "acked": st.acked,
                    "redelivered": st.redelivered,
                    "dropped_stale": st.dropped_stale,
                    "gets": st.gets,
                    "available": len(st.available),
                    "in_flight": sum(len(ls.ids) for ls in self._leases.values() if ls.consumer == name),
                }
                for name, st in self._consumers.items()
            }
            return {
                "live": len(self._samples),
                "capacity": self.config.capacity,
                "depth": dict(self._depth),
                "consumers": consumers,
                "trainer_version": self._trainer_version,
                "closed": self._closed,
                **self._counts,
                "put_wait_s": self._wait_s["put"],
                "get_wait_s": self._wait_s["get"],
                "admit_wait_s": self._wait_s["admit"],
                "waiting": dict(self._waiting),
                "staleness_hist": dict(sorted(self._staleness_hist.items())),
            }

    # ------------------------------------------------------------------ internals (lock held)
    def _validate_sample(self, index: int, sample: dict[str, Any]) -> tuple[dict[str, Any], int]:
        if not isinstance(sample, dict):
            raise BusError(f"sample {index}: expected a dict of field -> value, got {type(sample).__name__}")
        if self._grouped and "group_id" not in sample:
            raise BusError(
                f"sample {index} has no 'group_id' (required: consumer {self._grouped[0]!r} uses the group sampler)"
            )
        if "group_id" in sample and not isinstance(sample["group_id"], Hashable):
            raise BusError(
                f"sample {index}: 'group_id' must be hashable, got {type(sample['group_id']).__name__}"
            )
        if self._versioned and "policy_version" not in sample:
            raise BusError(
                f"sample {index} has no 'policy_version' (required: consumer {self._versioned[0]!r} enforces staleness)"
            )
        for key in ("policy_version", "group_size"):
            v = sample.get(key)
            if v is not None and (
                not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "group_size" else 0)
            ):
                raise BusError(
                    f"sample {index}: {key!r} must be an int >= {1 if key == 'group_size' else 0}, got {v!r}"
                )
        fields = {}
        for name, value in sample.items():
            if not isinstance(name, str):
                raise BusError(f"sample {index}: field names must be str, got {name!r}")
            fields[name] = to_value(value, name, f"sample {index}")
        return fields, sum(nbytes(v) for v in fields.values())

    def _check_groups(self, rows: list[tuple[dict[str, Any], int]]) -> None:
        if not self._grouped:
            return
        counts: dict[Hashable, int] = {}
        sizes: dict[Hashable, int] = {}
        for index, (fields, _) in enumerate(rows):
            gid = fields["group_id"]
            live = self._groups.get(gid, [])
            if gid not in sizes:  # a group's size is set by its first sample
                first = self._samples[live[0]].group_size if live else fields.get("group_size")
                sizes[gid] = first or self.config.group_size
            size = sizes[gid]
            counts[gid] = counts.get(gid, len(live)) + 1
            if counts[gid] > size:
                raise BusError(
                    f"sample {index}: group_id {gid!r} would have more than group_size={size} samples"
                )

    def _wait_for(self, pred: Callable[[], bool], timeout: float | None, kind: str, what: str) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        self._waiting[kind] += 1
        try:
            while True:
                self._check_open()
                if pred():
                    return
                now = time.monotonic()
                wait = None if deadline is None else deadline - now
                if wait is not None and wait <= 0:
                    raise BusTimeout(f"{what} timed out after {timeout}s")
                lease_deadlines = [ls.deadline for ls in self._leases.values() if ls.deadline is not None]
                if lease_deadlines:  # wake up to redeliver expired leases
                    until_lease = max(min(lease_deadlines) - now, 0.0) + 1e-3
                    wait = until_lease if wait is None else min(wait, until_lease)
                self._cond.wait(wait)
        finally:
            self._waiting[kind] -= 1
            self._wait_s[kind] += time.monotonic() - start

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("the bus is closed")

    def _consumer(self, name: str) -> ConsumerState:
        try:
            return self._consumers[name]
        except KeyError:
            raise BusError(f"unknown consumer {name!r}; configured: {sorted(self._consumers)}") from None

    def _live(self, sid: int) -> Sample:
        s = self._samples.get(sid)
        if s is None:
            state = "already evicted" if isinstance(sid, int) and 0 <= sid < self._next_id else "unknown"
            raise BusError(f"sample id {sid!r} is {state}")
        return s

    def _ready_refs(self, st: ConsumerState) -> list[SampleRef]:
        req = st.spec.required_fields
        refs = []
        for sid in sorted(st.available):
            s = self._samples[sid]
            if all(f in s.fields for f in req):
                refs.append(SampleRef(sid, s.group_id, s.group_size))
        return refs

    def _drop_stale(self, name: str, st: ConsumerState, t: int) -> None:
        limit = self.config.max_staleness
        grouped = st.spec.sampler in GROUPED_SAMPLERS
        stale = set()
        for sid in st.available:
            s = self._samples[sid]
            if t - s.version > limit:
                stale.add(sid)
                if grouped:
                    st.dropped_groups.add(s.group_id)
        if grouped and st.dropped_groups:
            stale.update(sid for sid in st.available if self._samples[sid].group_id in st.dropped_groups)
        for sid in stale:
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
        now = time.monotonic()
        expired = [k for k, ls in self._leases.items() if ls.deadline is not None and ls.deadline <= now]
        for k in expired:
            self._redeliver(self._leases.pop(k))
        if expired:
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
