"""Property tests: random interleavings of producers, consumers, acks, nacks, lease expiries, consumer deaths,
trainer steps and snapshot/restore, on both backends, checked against a model after every step.

Invariants: capacity never exceeded; groups never split; a delivered sample to the training consumer is never
staler than max_staleness (wait: never raised either, because producers go through admit; drop: stale ones
are dropped); at the end, after draining, every consumer acknowledged every put sample exactly once unless it
was dropped as stale — whether or not the bus was snapshot and restored mid-stream.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from relax_bus import BusConfig, BusTimeout, ConsumerSpec, DataBus, ManualClock, RayBus

G = 2  # group size
OP = st.tuples(
    st.sampled_from(["put", "fwd", "train", "ack", "nack", "expire", "die", "step", "snapshot"]),
    st.integers(0, 7),
)
OPS = st.lists(OP, max_size=40)
# Ray: every op is an actor call and every snapshot starts new actors, so fewer and shorter sequences, and no
# shrinking (a failure is reported as found; shrinking would replay dozens of slow examples)
RAY_OPS = st.lists(OP, min_size=8, max_size=20).filter(
    lambda ops: sum(op == "snapshot" for op, _ in ops) <= 2
)


def make_cfg(policy: str) -> BusConfig:
    return BusConfig(
        consumers={
            "fwd": ConsumerSpec(required_fields=["x"], sampler="in_order"),
            "train": ConsumerSpec(required_fields=["lp"], sampler="group", enforce_staleness=True),
        },
        capacity=8,
        max_staleness=1,
        staleness_policy=policy,
        group_size=G,
        lease_timeout_s=5.0,
    )


def run_ops(make_bus, restore, ops, policy, tmp_path, advance):
    bus = make_bus()
    step = version = gid = 0
    leases: dict[str, list] = {"fwd": [], "train": []}
    acked = collections.Counter()
    put_ids: list[int] = []

    def check_batch(consumer, b, t):
        # payload integrity (on Ray it travels in object-store blocks): tok is filled with the group id
        assert all(int(v[0]) == g for v, g in zip(b.data["tok"], b.data["group_id"])), "payload mixed up"
        if consumer == "train":
            groups = collections.Counter(b.data["group_id"])
            assert all(c == G for c in groups.values()), f"group split: {groups}"
            assert all(t - v <= 1 for v in b.data["policy_version"]), "stale sample delivered"

    for op, arg in ops:
        if op == "put":
            try:
                v = bus.admit(step, timeout=0)
                ids = bus.put(
                    [
                        {"group_id": gid, "policy_version": v, "x": i, "tok": np.full(2 + i, gid)}
                        for i in range(G)
                    ],
                    timeout=0,
                )
            except BusTimeout:
                continue
            put_ids += ids
            gid += 1
            step += 1
        elif op in ("fwd", "train"):
            try:
                b = bus.get(
                    op,
                    1 + arg % 4 if op == "fwd" else G * (1 + arg % 2),
                    timeout=0,
                    partial=True,
                    trainer_version=version,
                )
            except BusTimeout:
                continue
            check_batch(op, b, version)
            if op == "fwd":
                fresh = [i for i, lp in zip(b.ids, b.data.get("lp", [None] * len(b))) if lp is None]
                if fresh:
                    bus.add_fields(fresh, {"lp": [0.5] * len(fresh)})
            leases[op].append(b)
        elif op in ("ack", "nack") and leases["fwd" if arg % 2 else "train"]:
            c = "fwd" if arg % 2 else "train"
            b = leases[c].pop(0)
            getattr(bus, op)(c, b.lease_id)
            if op == "ack":
                acked.update((c, i) for i in b.ids)
        elif op == "expire":
            advance(bus, 6.0)
            leases = {"fwd": [], "train": []}
        elif op == "die":
            c = "fwd" if arg % 2 else "train"
            bus.reset_consumer(c)
            leases[c] = []
        elif op == "step":
            # wait policy: the trainer only moves on when no live sample would become stale (the protocol)
            oldest = bus.stats()["oldest_policy_version"]
            if policy == "drop" or oldest is None or version + 1 - oldest <= 1:
                version += 1
                bus.set_trainer_version(version)
        elif op == "snapshot":
            bus.snapshot(tmp_path / "snap")
            bus = restore(tmp_path / "snap")
            leases = {"fwd": [], "train": []}
        assert bus.stats()["live"] <= 8, "capacity exceeded"
    # drain: everything left is delivered exactly once more
    for lst in leases.values():
        lst.clear()
    bus.reset_consumer("fwd")
    bus.reset_consumer("train")
    for c in ("fwd", "train"):
        for _ in range(len(put_ids) + 1):  # each get takes >= 1 sample: a longer drain means redelivery
            try:
                b = bus.get(c, G, timeout=0, partial=True, trainer_version=version)
            except BusTimeout:
                break
            check_batch(c, b, version)
            if c == "fwd":
                fresh = [i for i, lp in zip(b.ids, b.data.get("lp", [None] * len(b))) if lp is None]
                if fresh:
                    bus.add_fields(fresh, {"lp": [0.5] * len(fresh)})
            bus.ack(c, b.lease_id)
            acked.update((c, i) for i in b.ids)
        else:
            raise AssertionError(f"{c}: the drain never ends (samples delivered again after ack)")
    s = bus.stats()
    assert sorted(bus.consumed_ids("fwd")) == sorted(put_ids)
    assert all(acked[("fwd", i)] == 1 for i in put_ids), "fwd: not exactly once"
    dropped = s["consumers"]["train"]["dropped_stale"]
    trained = [i for i in put_ids if acked[("train", i)]]
    assert all(acked[("train", i)] == 1 for i in put_ids if acked[("train", i)]), "train: acked twice"
    if policy == "wait":
        assert s["dropped_stale"] == 0 and trained == put_ids
    else:
        assert len(trained) + dropped == len(put_ids)
    assert s["live"] == 0
    return bus


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["wait", "drop"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_in_process_interleavings(policy, ops, tmp_path):
    clock = ManualClock()  # (the bus's, and that of each bus restored from it)
    run_ops(
        lambda: DataBus(make_cfg(policy), clock=clock),
        lambda p: DataBus.restore(p, clock=clock),
        ops,
        policy,
        tmp_path,
        lambda bus, dt: clock.advance(dt),
    )


@pytest.mark.integration
# method="thread": hypothesis treats pytest-timeout's default (an exception) as a test failure and replays
# the example, so a hang there would stall CI; the thread method dumps every stack and ends the run instead
@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("policy", ["wait", "drop"])
@pytest.mark.parametrize("fast_local", [True, False], ids=["socket+shm", "actor-calls+object-store"])
@settings(
    max_examples=3,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(ops=RAY_OPS)
def test_ray_interleavings(ray_session, policy, fast_local, ops, tmp_path):
    made = []
    # inline_bytes=0: every payload goes through a block (a shared-memory file, or an object)
    opts = {"manual_clock": True, "num_storage_units": 1, "inline_bytes": 0, "fast_local": fast_local}

    def make(path=None):
        bus = RayBus.create(make_cfg(policy), **opts) if path is None else RayBus.restore(path, **opts)
        made.append(bus)
        return bus

    try:
        run_ops(make, make, ops, policy, tmp_path, lambda bus, dt: bus.link.advance_clock(dt))
    finally:
        for b in made:
            b.kill()
