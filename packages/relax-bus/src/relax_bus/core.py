"""The in-process data bus: columns of per-sample fields, named consumers, staleness control.

Why it is shaped this way:

- One lock and one ``threading.Condition``: every blocking call (put on a full bus, get on too few ready
  samples, admit ahead of the trainer) waits on the condition, which releases the lock, so a blocked reader
  never stalls writers or other readers. Every state change calls ``notify_all``; waiters re-check their own
  predicate. Simple and correct at the scale of one process (thousands of live samples).
- Zero copy: values are stored as given and handed to consumers as is (read-only by contract), so a put or a
  get costs bookkeeping only, whatever the payload size.
- Exactly once per consumer: each consumer keeps the set of live ids it has not taken. ``get`` moves ids into
  a lease; ``ack`` retires them, ``nack``, lease expiry or ``reset_consumer`` (its process died) put them
  back. A sample is evicted (capacity freed) when every consumer has acked or dropped it.
- Readiness is per consumer: a sample is ready when the consumer's ``required_fields`` are written, so roles
  (ActorFwd, Reference, Advantages) can fill columns incrementally with ``add_fields``.
- Staleness is a bus guarantee, not a trainer convention: see ``BusConfig.max_staleness``; the rule itself
  (who is stale, who waits for which version) is :class:`~relax_bus.staleness.StalenessBound`.
- The whole state goes out and comes back through :meth:`DataBus.state_dict` / :meth:`load_state_dict` (a
  :class:`~relax_bus.state.BusState`), so snapshots and the Ray controller never reach into the bus.
- Validation happens before the lock (``prepare.py``) and before any write, so a bad call changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_bus import snapshot as _snapshot
from relax_bus.config import BusConfig
from relax_bus.errors import BusError, ConsumerReset, StaleSampleError
from relax_bus.ledger import Ledger, sample_version
from relax_bus.prepare import grouped_consumers, prepare_fields, prepare_samples, versioned_consumers
from relax_bus.samplers import SAMPLERS, in_order
from relax_bus.state import Batch, BusState, Lease, ManualClock, Sample, SavedConsumer, SavedSample
from relax_bus.values import Schema

RESERVED_FIELDS = ("group_id", "policy_version", "group_size")


class DataBus:
    """Thread-safe in-process bus. See the package README for the full contract.

    ``clock`` (default ``time.monotonic``) times lease deadlines; tests pass a :class:`ManualClock`.
    """

    def __init__(self, config: BusConfig | dict[str, Any], clock: Callable[[], float] | None = None) -> None:
        self.config = cfg = config if isinstance(config, BusConfig) else BusConfig.model_validate(config)
        self.ledger = Ledger(
            cfg, clock or time.monotonic, grouped_consumers(cfg), Schema(cfg.fields, RESERVED_FIELDS)
        )
        """Its state and the mechanics on it; the Ray controller hands it rows its clients prepared."""
        self._cond = self.ledger.cond  # (the ledger's: the bus's one lock, held for every ledger call)
        if isinstance(clock, ManualClock):  # (a test's clock that jumps wakes the waiters to re-check)
            clock.watch(self._cond)
        self._next_lease = 0
        self._trainer_version = 0
        self._versioned = versioned_consumers(cfg)
        self._staleness_hist: dict[int, int] = {}

    # ------------------------------------------------------------------ producers
    def put(
        self,
        samples: list[dict[str, Any]],
        partition: str = "default",
        timeout: float | None = None,
        ids: list[int] | None = None,
    ) -> list[int]:
        """Append samples; returns their global ids. Blocks while the bus is full (back-pressure).

        Ids are assigned in increasing order unless ``ids`` gives them (unique, never used on this bus).
        """
        return self.ledger.put_rows(prepare_samples(self.config, samples), partition, timeout, ids)

    def add_fields(self, ids: list[int], fields: dict[str, list[Any]]) -> None:
        """Write new fields on live samples (e.g. ``log_probs``); wakes consumers waiting for them. Write-once."""
        self.ledger.add_rows(list(ids), prepare_fields(ids, fields))

    def admit(self, step: int, timeout: float | None = None) -> int:
        """Staleness gate for the producer of rollout step ``step`` (0-based; the trainer consumes step k at version k).

        Blocks until ``step - trainer_version <= max_staleness`` and returns the trainer version then. Stamp the
        samples of that step with a ``policy_version`` >= the returned value (the weights you generate with) and
        have the trainer take step k's samples at version k: then every delivered sample has staleness
        ``k - policy_version <= max_staleness``. No-op with ``max_staleness=None`` or ``staleness_policy="drop"``.
        """
        if not isinstance(step, int) or step < 0:
            raise BusError(f"admit: step must be an int >= 0 (got {step!r})")
        need = self.ledger.staleness.admit_version(step)
        with self._cond:
            self.ledger.check_open()
            if self.ledger.staleness.gates_producers:
                self.ledger.wait_for(
                    lambda: self._trainer_version >= need, timeout, "admit", f"admit({step})"
                )
            return self._trainer_version

    # ------------------------------------------------------------------ trainer
    def set_trainer_version(self, version: int) -> None:
        """Report that the trainer finished ``version`` updates; wakes ``admit`` waiters. Monotonic."""
        with self._cond:
            self.ledger.check_open()
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
        partition: str | None = None,
    ) -> Batch:
        """Take ``n`` ready samples this consumer has not taken yet (see README for blocking and staleness);
        with ``partition``, only samples put under that partition (a trainer that takes rollout step k's
        samples at version k while the producer streams later steps' groups)."""
        if not isinstance(n, int) or n < 1:
            raise BusError(f"get: n must be an int >= 1 (got {n!r})")
        with self._cond:
            self.ledger.check_open()
            st = self.ledger.consumer(consumer)
            sampler = SAMPLERS[st.spec.sampler]
            options = st.spec.sampler_options
            bound = self.ledger.staleness
            enforce = st.spec.enforce_staleness and bound.bounded
            chosen: list[int] = []
            resets = st.resets

            def satisfied() -> bool:
                nonlocal chosen
                if (
                    st.resets != resets
                ):  # the caller's process died while this call waited (see reset_consumer)
                    raise ConsumerReset(
                        f"get({consumer!r}) was waiting when {consumer!r} was reset (its process died): it takes "
                        "nothing, its samples go to the restarted consumer; a live caller gets again"
                    )
                self.ledger.expire_leases()
                t = self._trainer_version if trainer_version is None else trainer_version
                if enforce and bound.drops:
                    self.ledger.drop_stale(consumer, st, t)
                limit = n if sampler is in_order else None  # in id order: stop scanning at n
                refs = self.ledger.ready_refs(st, limit, partition)
                chosen = sampler(refs, n, partial, self.config.group_size, **options)
                return bool(chosen)

            self.ledger.wait_for(satisfied, timeout, "get", f"get({consumer!r}, n={n})")
            t = self._trainer_version if trainer_version is None else trainer_version
            samples = [self.ledger.samples[i] for i in chosen]
            if enforce:
                stale = [s.id for s in samples if bound.is_stale(sample_version(s), t)]
                if stale:
                    raise StaleSampleError(
                        f"samples {stale[:8]} are older than max_staleness={self.config.max_staleness} at "
                        f"trainer version {t}; producers must call admit(step) before generating"
                    )
            data = self.ledger.columns(samples, fields)
            lease_id = self._next_lease
            self._next_lease += 1
            timeout_s = self.config.lease_timeout_s
            deadline = None if timeout_s is None else self.ledger.clock() + timeout_s
            self.ledger.leases[lease_id] = Lease(consumer, chosen, deadline)
            st.available.difference_update(chosen)
            st.delivered += len(chosen)
            st.gets += 1
            self.ledger.counts["gets"] += 1
            self.ledger.counts["bytes_out"] += sum(s.size for s in samples)
            if enforce:
                for s in samples:
                    lag = bound.lag(sample_version(s), t)
                    self._staleness_hist[lag] = self._staleness_hist.get(lag, 0) + 1
            return Batch(
                chosen, data, lease_id, consumer, [s.partition for s in samples], t if enforce else None
            )

    def ack(self, consumer: str, lease_id: int) -> None:
        """Acknowledge a batch; samples every consumer has acked are evicted (freeing capacity)."""
        with self._cond:
            self.ledger.check_open()
            lease = self.ledger.take_lease(consumer, lease_id)
            st = self.ledger.consumers[consumer]
            st.acked += len(lease.ids)
            st.acked_ids.extend(lease.ids)
            for sid in lease.ids:
                self.ledger.release(sid, consumer)
            self._cond.notify_all()

    def nack(self, consumer: str, lease_id: int) -> None:
        """Give a batch back; its samples are delivered again to this consumer."""
        with self._cond:
            self.ledger.check_open()
            self.ledger.redeliver(self.ledger.take_lease(consumer, lease_id))
            self._cond.notify_all()

    def reset_consumer(self, consumer: str, done_if_written: list[str] | None = None) -> int:
        """The consumer's process died: every batch it holds is delivered again. Returns how many samples.

        ``done_if_written``: the fields this consumer writes. A held or waiting sample on which they are all
        written already (the process died between writing and acking; or a bus restored from a snapshot,
        which saves leases as not delivered) counts as acked instead of coming back, so a restarted
        consumer never computes it twice (fields are write-once).

        A ``get`` of the dead process still waiting here (in the bus, or in the bus actor the call reached)
        raises :class:`ConsumerReset` instead of taking samples: they would sit in a lease nobody acks."""
        with self._cond:
            self.ledger.check_open()
            st = self.ledger.consumer(consumer)
            st.resets += 1
            mine = [
                self.ledger.leases.pop(k)
                for k, ls in list(self.ledger.leases.items())
                if ls.consumer == consumer
            ]
            again = 0
            need = done_if_written or []
            for lease in mine:
                written = [
                    bool(need) and all(f in self.ledger.samples[i].fields for f in need) for i in lease.ids
                ]
                done = [i for i, w in zip(lease.ids, written) if w]
                redo = [i for i, w in zip(lease.ids, written) if not w]
                st.acked += len(done)
                st.acked_ids.extend(done)
                for sid in done:
                    self.ledger.release(sid, consumer)
                self.ledger.redeliver(Lease(consumer, redo, None))
                again += len(redo)
            if done_if_written:  # also samples waiting for it (a bus restored from a snapshot saves
                # leases as not delivered): written ones count as acked, never computed twice
                done = [
                    i
                    for i in st.available
                    if all(f in self.ledger.samples[i].fields for f in done_if_written)
                ]
                for sid in done:
                    st.available.discard(sid)
                    st.acked += 1
                    st.acked_ids.append(sid)
                    self.ledger.release(sid, consumer)
            self._cond.notify_all()
            return again

    def leases(self, consumer: str) -> dict[int, list[int]]:
        """Batches ``consumer`` holds and has not acked: ``{lease_id: sample ids}``. After the consumer's
        process died, a supervisor acks those its last checkpoint covers and resets the rest."""
        with self._cond:
            self.ledger.consumer(consumer)
            return {k: list(ls.ids) for k, ls in self.ledger.leases.items() if ls.consumer == consumer}

    # ------------------------------------------------------------------ lifecycle and introspection
    def close(self) -> None:
        """Wake every waiter with BusClosed; later calls raise BusClosed (stats stay readable). Idempotent."""
        with self._cond:
            self.ledger.closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self.ledger.closed

    def consumed_ids(self, consumer: str) -> list[int]:
        """Ids acked by ``consumer``, in ack order (for tests and audits)."""
        with self._cond:
            return list(self.ledger.consumer(consumer).acked_ids)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges; cheap enough to poll. ``metrics()`` flattens them for a logger."""
        with self._cond:
            self.ledger.expire_leases()
            consumers = {
                name: {
                    "delivered": st.delivered,
                    "acked": st.acked,
                    "redelivered": st.redelivered,
                    "dropped_stale": st.dropped_stale,
                    "gets": st.gets,
                    "available": len(st.available),
                    "in_flight": sum(
                        len(ls.ids) for ls in self.ledger.leases.values() if ls.consumer == name
                    ),
                }
                for name, st in self.ledger.consumers.items()
            }
            return {
                "live": len(self.ledger.samples),
                "capacity": self.config.capacity,
                "depth": dict(self.ledger.depth),
                "consumers": consumers,
                "trainer_version": self._trainer_version,
                "closed": self.ledger.closed,
                **self.ledger.counts,
                "redelivered": sum(c["redelivered"] for c in consumers.values()),
                "put_wait_s": self.ledger.wait_s["put"],
                "get_wait_s": self.ledger.wait_s["get"],
                "admit_wait_s": self.ledger.wait_s["admit"],
                "waiting": dict(self.ledger.waiting),
                "staleness_hist": dict(sorted(self._staleness_hist.items())),
                "oldest_policy_version": min(
                    (s.version for s in self.ledger.samples.values() if s.version is not None), default=None
                ),
            }

    def metrics(self, prefix: str = "bus/") -> dict[str, float]:
        """``stats()`` flattened to ``{name: number}`` for TensorBoard / W&B style loggers."""
        return _snapshot.flatten(self.stats(), prefix)

    # ------------------------------------------------------------------ state, snapshot, restore
    def state_dict(self) -> BusState:
        """Everything a restart must carry over (see :class:`BusState`), taken under the lock. Batches in
        flight count as not delivered. Field values are the bus's own objects, not copies."""
        with self._cond:
            consumers = {}
            for name, st in self.ledger.consumers.items():
                available = set(st.available)
                for ls in self.ledger.leases.values():
                    if ls.consumer == name:
                        available.update(ls.ids)  # in flight = not delivered
                consumers[name] = SavedConsumer(
                    sorted(available),
                    dict(st.dropped_groups),
                    list(st.acked_ids),
                    st.delivered,
                    st.acked,
                    st.redelivered,
                    st.dropped_stale,
                    st.gets,
                )
            samples = [
                SavedSample(s.id, s.partition, dict(s.fields), sorted(s.waiting), dict(s.lengths), s.size)
                for s in sorted(self.ledger.samples.values(), key=lambda s: s.id)
            ]
            return BusState(
                config=self.config,
                samples=samples,
                consumers=consumers,
                next_id=self.ledger.next_id,
                unused_ids=[list(h) for h in self.ledger.holes],
                next_lease=self._next_lease,
                trainer_version=self._trainer_version,
                schema=dict(self.ledger.schema.sigs),
                counts=dict(self.ledger.counts),
                staleness_hist=dict(self._staleness_hist),
            )

    def load_state_dict(self, state: BusState) -> None:
        """Carry on from ``state`` (of :meth:`state_dict` or a snapshot). This bus must be fresh (no put or
        get yet) and have the state's consumers: build it with ``DataBus(state.config)``."""
        with self._cond:
            self.ledger.check_open()
            if self.ledger.counts["puts"] or self.ledger.counts["gets"]:
                raise BusError(
                    "load_state_dict needs a fresh bus (no put or get yet): build DataBus(state.config)"
                )
            if set(state.consumers) != set(self.ledger.consumers):
                raise BusError(
                    f"the state has consumers {sorted(state.consumers)}, this bus {sorted(self.ledger.consumers)}: "
                    "build the bus with DataBus(state.config)"
                )
            for d in state.samples:
                f = d.fields
                s = Sample(
                    d.id,
                    d.partition,
                    f,
                    set(d.waiting),
                    f.get("group_id"),
                    f.get("group_size"),
                    f.get("policy_version"),
                    dict(d.lengths),
                    d.size,
                )
                self.ledger.samples[s.id] = s
                self.ledger.depth[s.partition] = self.ledger.depth.get(s.partition, 0) + 1
                if self.ledger.grouped:
                    self.ledger.groups.setdefault(s.group_id, []).append(s.id)
            for name, c in state.consumers.items():
                st = self.ledger.consumers[name]
                st.available = set(c.available)
                st.dropped_groups = dict(c.dropped_groups)
                st.acked_ids = list(c.acked_ids)
                st.delivered, st.acked, st.redelivered = c.delivered, c.acked, c.redelivered
                st.dropped_stale, st.gets = c.dropped_stale, c.gets
            self.ledger.next_id = state.next_id
            self.ledger.holes = [list(h) for h in state.unused_ids]
            self._next_lease = state.next_lease
            self._trainer_version = state.trainer_version
            self.ledger.schema.sigs.update(state.schema)
            self.ledger.counts.update(state.counts)
            self._staleness_hist.update(state.staleness_hist)
            self._cond.notify_all()

    def snapshot(self, path: str | Path) -> Path:
        """Write :meth:`state_dict` (data, versions, consumption) to directory ``path``, atomically.

        In-flight leases are saved as not delivered: after :meth:`restore` those samples are delivered again,
        so a run resumed from a checkpoint loses nothing and repeats nothing that was acknowledged.
        """
        return _snapshot.write(path, self.state_dict())

    @classmethod
    def restore(cls, path: str | Path, clock: Callable[[], float] | None = None) -> DataBus:
        """A new bus with the state saved by :meth:`snapshot` (config included)."""
        state = _snapshot.read(path)
        bus = cls(state.config, clock=clock)
        bus.load_state_dict(state)
        return bus
