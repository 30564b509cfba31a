import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from relax_bus import (
    BusClosed,
    BusConfig,
    BusError,
    BusTimeout,
    ConsumerSpec,
    DataBus,
    StaleSampleError,
)

pytestmark = pytest.mark.timeout(60)  # a hang is a bug: fail instead of stalling CI


def wait_until(pred, limit_s: float = 10.0) -> None:
    """Poll ``pred`` until true (a sync helper, not a timing assertion)."""
    end = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.002)


def run_thread(fn, *args, **kwargs):
    """Run fn in a daemon thread; returns (thread, result dict with 'value' or 'error')."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def rl_bus(**kw) -> DataBus:
    cfg = dict(
        consumers={
            "advantages": ConsumerSpec(required_fields=["reward"], sampler="group"),
            "actor_train": ConsumerSpec(
                required_fields=["advantages"], sampler="group", enforce_staleness=True
            ),
        },
        group_size=2,
    )
    cfg.update(kw)
    return DataBus(BusConfig(**cfg))


def group_samples(gids, version=0, **fields):
    """Two samples (a whole group for rl_bus) per group id."""
    return [
        {"group_id": g, "policy_version": version, "tokens": np.arange(3), **fields}
        for g in gids
        for _ in "ab"
    ]


def test_import_pulls_neither_torch_nor_ray():
    code = "import sys, relax_bus; from relax_bus import RayBus; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exactly_once_per_consumer(simple_bus):
    ids = simple_bus.put([{"i": i} for i in range(6)])
    assert ids == list(range(6))
    first = simple_bus.get("a", 4)
    second = simple_bus.get("a", 4, partial=True)
    assert first.ids == [0, 1, 2, 3] and second.ids == [4, 5] and len(second) == 2
    assert first.data["i"] == [0, 1, 2, 3] and first.partitions == ["default"] * 4
    for b in (first, second):
        simple_bus.ack("a", b.lease_id)
    assert simple_bus.consumed_ids("a") == list(range(6))
    with pytest.raises(BusTimeout):
        simple_bus.get("a", 1, timeout=0.01, partial=True)
    assert simple_bus.stats()["live"] == 6  # b has not acked yet


def test_readiness_waits_for_required_fields(simple_bus):
    ids = simple_bus.put([{"i": 0}, {"i": 1}])
    with pytest.raises(BusTimeout):
        simple_bus.get("b", 1, timeout=0.01)
    t, out = run_thread(simple_bus.get, "b", 2)
    wait_until(lambda: simple_bus.stats()["waiting"]["get"] == 1)
    simple_bus.add_fields(ids, {"x": [np.ones(2), np.zeros(2)]})
    t.join(10)
    batch = out["value"]
    assert batch.ids == ids and set(batch.data) == {"i", "x"}
    assert simple_bus.get("a", 2, fields=["i"]).data == {"i": [0, 1]}


def test_eviction_after_every_consumer_and_partitions_cleared(simple_bus):
    ids = simple_bus.put([{"i": 0, "x": 1}], partition="p1")
    simple_bus.put([{"i": 1, "x": 1}], partition="p2")
    assert simple_bus.stats()["depth"] == {"p1": 1, "p2": 1}
    for c in ("a", "b"):
        simple_bus.ack(c, simple_bus.get(c, 1).lease_id)
    s = simple_bus.stats()
    assert s["live"] == 1 and s["depth"] == {"p2": 1}
    with pytest.raises(BusError, match=f"sample id {ids[0]} is already evicted"):
        simple_bus.add_fields(ids, {"y": [1]})


def test_groups_never_split():
    bus = rl_bus()
    bus.put([{"group_id": "a", "policy_version": 0, "reward": 1.0}])
    bus.put([{"group_id": "b", "policy_version": 0, "reward": 1.0}] * 2)
    batch = bus.get("advantages", 2)  # group a is incomplete, b is complete
    assert batch.data["group_id"] == ["b", "b"]
    with pytest.raises(BusTimeout):
        bus.get("advantages", 2, timeout=0.01, partial=True)
    bus.put([{"group_id": "a", "policy_version": 0, "reward": 2.0}])
    assert bus.get("advantages", 2).ids == [0, 3]
    bus.put([{"group_id": "c", "policy_version": 0, "reward": 1.0}] * 2)
    with pytest.raises(BusError, match="never split"):
        bus.get("advantages", 1)
    with pytest.raises(BusError, match="more than group_size=2"):
        bus.put(group_samples(["b"]))  # b already has 2 live samples


def test_per_sample_group_size():
    bus = rl_bus()
    bus.put([{"group_id": "g", "group_size": 3, "policy_version": 0, "reward": 0.0}] * 3)
    assert len(bus.get("advantages", 3)) == 3


def test_full_pipeline_with_add_fields():
    bus = rl_bus()
    bus.put(group_samples(range(4), reward=1.0))
    adv = bus.get("advantages", 8, fields=["reward"])
    bus.add_fields(adv.ids, {"advantages": [0.5] * 8})
    bus.ack("advantages", adv.lease_id)
    train = bus.get("actor_train", 8, fields=["advantages", "tokens"])
    assert train.ids == list(range(8)) and train.trainer_version == 0
    bus.ack("actor_train", train.lease_id)
    s = bus.stats()
    assert s["live"] == 0 and s["staleness_hist"] == {0: 8}
    assert s["bytes_in"] == 8 * np.arange(3).nbytes


def test_back_pressure_blocks_put_until_ack(simple_bus):
    simple_bus.put([{"i": i, "x": 0} for i in range(8)])
    t, out = run_thread(simple_bus.put, [{"i": 8, "x": 0}])
    wait_until(lambda: simple_bus.stats()["waiting"]["put"] == 1)
    assert "value" not in out
    with pytest.raises(BusTimeout):
        simple_bus.put([{"i": 9}], timeout=0.01)
    simple_bus.ack("a", simple_bus.get("a", 1).lease_id)
    assert simple_bus.stats()["live"] == 8  # b still holds sample 0
    simple_bus.ack("b", simple_bus.get("b", 1).lease_id)
    t.join(10)
    assert out["value"] == [8]
    assert simple_bus.stats()["live"] == 8


def test_blocked_get_does_not_block_put(simple_bus):
    t, out = run_thread(simple_bus.get, "a", 3)
    wait_until(lambda: simple_bus.stats()["waiting"]["get"] == 1)
    simple_bus.put([{"i": 0}])
    simple_bus.put([{"i": 1}, {"i": 2}])
    t.join(10)
    assert out["value"].ids == [0, 1, 2]


def test_admit_blocks_until_trainer_catches_up():
    bus = rl_bus(max_staleness=1)
    assert bus.admit(0) == 0 and bus.admit(1) == 0
    with pytest.raises(BusTimeout):
        bus.admit(2, timeout=0.01)
    t, out = run_thread(bus.admit, 2)
    wait_until(lambda: bus.stats()["waiting"]["admit"] == 1)
    bus.set_trainer_version(1)
    t.join(10)
    assert out["value"] == 1
    with pytest.raises(BusError, match="must not decrease"):
        bus.set_trainer_version(0)
    assert rl_bus(max_staleness=None).admit(100) == 0
    assert rl_bus(staleness_policy="drop").admit(100) == 0


def test_admit_makes_wait_policy_safe():
    """Producer admits each step and stamps its version; trainer takes step k at version k."""
    bus = rl_bus(max_staleness=1, consumers={"t": ConsumerSpec(sampler="group", enforce_staleness=True)})
    steps = 6

    def producer():
        for k in range(steps):
            v = bus.admit(k)
            bus.put(group_samples([k], version=v))

    t, out = run_thread(producer)
    for k in range(steps):
        batch = bus.get("t", 2)
        assert batch.trainer_version == k
        bus.ack("t", batch.lease_id)
        bus.set_trainer_version(k + 1)
    t.join(10)
    assert "error" not in out
    hist = bus.stats()["staleness_hist"]
    assert sum(hist.values()) == 2 * steps and max(hist) <= 1


def test_wait_policy_raises_on_stale_sample():
    bus = rl_bus(max_staleness=0, consumers={"t": ConsumerSpec(enforce_staleness=True)})
    bus.put([{"policy_version": 0}])
    with pytest.raises(StaleSampleError, match="admit"):
        bus.get("t", 1, trainer_version=1)
    assert bus.get("t", 1, trainer_version=0).ids == [0]  # nothing was taken by the failed get


def test_enforced_staleness_refuses_policy_version_none_at_put():
    """A consumer that enforces staleness needs a version on every sample: None was let through by put and
    made the trainer's get fail with a TypeError (``trainer_version - None``) inside the bus."""
    bus = rl_bus(max_staleness=1, consumers={"t": ConsumerSpec(enforce_staleness=True)})
    with pytest.raises(BusError, match="has no 'policy_version'"):
        bus.put([{"x": 1, "policy_version": None}])
    assert bus.stats()["live"] == 0
    bus.put([{"x": 1, "policy_version": 0}])
    assert bus.get("t", 1).ids == [0]


def test_drop_policy_drops_stale_whole_groups():
    bus = rl_bus(max_staleness=1, staleness_policy="drop")
    bus.put(group_samples(["old"], version=0, advantages=0.0, reward=0.0))
    bus.put(group_samples(["new"], version=2, advantages=0.0, reward=0.0))
    bus.put([{"group_id": "mixed", "policy_version": 2, "advantages": 0.0, "reward": 0.0}])
    bus.put([{"group_id": "mixed", "policy_version": 0, "advantages": 0.0, "reward": 0.0}])
    bus.set_trainer_version(2)
    batch = bus.get("actor_train", 4, partial=True)
    assert batch.data["group_id"] == ["new", "new"]
    bus.ack("actor_train", batch.lease_id)
    s = bus.stats()
    assert s["dropped_stale"] == 4 and s["consumers"]["actor_train"]["dropped_stale"] == 4
    assert s["staleness_hist"] == {0: 2}
    # dropped samples still go to the other consumer, and are evicted after it acks
    adv = bus.get("advantages", 6, partial=True, fields=["group_id"])
    assert len(adv) == 6
    bus.ack("advantages", adv.lease_id)
    assert bus.stats()["live"] == 0


def test_a_group_id_used_again_after_its_group_was_dropped_is_a_new_group(tmp_path):
    """A dropped group's id stayed dropped for good: a producer that reuses group ids (one per prompt slot)
    had every later group of that id thrown away. Forgotten once all of its members were dropped."""
    bus = rl_bus(max_staleness=1, staleness_policy="drop")
    bus.put(group_samples(["slot0"], version=0, advantages=0.0, reward=0.0))
    bus.set_trainer_version(2)
    with pytest.raises(BusTimeout):
        bus.get("actor_train", 2, timeout=0.01)  # both members dropped as stale
    assert bus.stats()["dropped_stale"] == 2
    adv = bus.get("advantages", 2)  # the other consumer is done with them too: the group is gone
    bus.ack("advantages", adv.lease_id)
    assert bus.stats()["live"] == 0
    restored = DataBus.restore(bus.snapshot(tmp_path / "snap"))  # (and after a restore)
    for b in (bus, restored):
        b.put(group_samples(["slot0"], version=2, advantages=0.0, reward=0.0))  # the same id, fresh samples
        assert b.get("actor_train", 2, fields=["group_id"], timeout=5).data["group_id"] == ["slot0", "slot0"]


def test_nack_and_lease_expiry_redeliver():
    bus = DataBus(BusConfig(consumers={"a": ConsumerSpec()}, lease_timeout_s=0.05))
    bus.put([{"i": 0}, {"i": 1}])
    first = bus.get("a", 2)
    second = bus.get("a", 2, timeout=30)  # blocks until the first lease expires
    assert second.ids == first.ids and second.lease_id != first.lease_id
    with pytest.raises(BusError, match="unknown lease"):
        bus.ack("a", first.lease_id)
    bus2 = DataBus(BusConfig(consumers={"a": ConsumerSpec()}))
    bus2.put([{"i": 0}])
    b = bus2.get("a", 1)
    bus2.nack("a", b.lease_id)
    again = bus2.get("a", 1)
    assert again.ids == b.ids
    bus2.ack("a", again.lease_id)
    c = bus2.stats()["consumers"]["a"]
    assert (c["delivered"], c["acked"], c["redelivered"]) == (2, 1, 1)
    assert bus2.consumed_ids("a") == [0]


def test_close_wakes_every_waiter(simple_bus):
    simple_bus.put([{"i": i} for i in range(8)])
    getter, gout = run_thread(simple_bus.get, "b", 1)
    putter, pout = run_thread(simple_bus.put, [{"i": 9}])
    admitter, aout = run_thread(simple_bus.admit, 5)
    wait_until(lambda: sum(simple_bus.stats()["waiting"].values()) == 3)
    simple_bus.close()
    for t in (getter, putter, admitter):
        t.join(10)
    for out in (gout, pout, aout):
        assert isinstance(out["error"], BusClosed)
    with pytest.raises(BusClosed):
        simple_bus.put([{"i": 0}])
    assert simple_bus.stats()["closed"]


def test_bad_inputs_leave_bus_consistent():
    bus = rl_bus()
    bus.put(group_samples(["g"]))
    before = bus.stats()
    with pytest.raises(BusError, match="sample 1 has no 'group_id'"):
        bus.put([{"group_id": "h", "policy_version": 0}, {"policy_version": 0}])
    with pytest.raises(BusError, match="sample 0 has no 'policy_version'"):
        bus.put([{"group_id": "h"}])
    with pytest.raises(BusError, match="can never fit"):
        bus.put(group_samples(range(5000)))
    with pytest.raises(BusError, match="field 'tokens' of sample 0: unsupported type object"):
        bus.put([{"group_id": "h", "policy_version": 0, "tokens": object()}])
    with pytest.raises(BusError, match="sample id 99 is unknown"):
        bus.add_fields([0, 99], {"reward": [1.0, 2.0]})
    with pytest.raises(BusError, match="field 'tokens' is already set on sample id 0"):
        bus.add_fields([0, 1], {"log_probs": [1.0, 2.0], "tokens": [1, 2]})
    with pytest.raises(BusError, match="unknown consumer 'nope'"):
        bus.get("nope", 1)
    with pytest.raises(BusError, match="reserved"):
        bus.add_fields([0], {"group_id": ["x"]})
    after = bus.stats()
    assert (after["live"], after["samples_put"], after["bytes_in"]) == (before["live"], 2, before["bytes_in"])
    bus.add_fields([0, 1], {"reward": [1.0, 2.0]})  # nothing partial was written earlier
    batch = bus.get("advantages", 2)
    assert batch.data["reward"] == [1.0, 2.0] and "log_probs" not in batch.data


def test_requested_field_not_written_is_an_error(simple_bus):
    simple_bus.put([{"i": 0}])
    with pytest.raises(BusError, match="add it to this consumer's required_fields"):
        simple_bus.get("a", 1, fields=["x"])
    assert simple_bus.get("a", 1).ids == [0]


def test_torch_tensor_converted_only_when_torch_imported(simple_bus):
    torch = pytest.importorskip("torch")
    simple_bus.put([{"i": torch.arange(4)}])
    value = simple_bus.get("a", 1).data["i"][0]
    assert isinstance(value, np.ndarray) and value.tolist() == [0, 1, 2, 3]


def test_concurrent_producers_and_consumers_exactly_once():
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=16))
    total, per = 200, 10
    seen: list[int] = []
    lock = threading.Lock()

    def consume():
        while True:
            try:
                b = bus.get("c", 7, partial=True)
            except BusClosed:
                return
            with lock:
                seen.extend(b.data["i"])
            bus.ack("c", b.lease_id)

    consumers = [run_thread(consume)[0] for _ in range(2)]
    producers = [
        run_thread(
            lambda p=p: [
                bus.put([{"i": p * 100 + j + k} for k in range(per // 2)]) for j in range(0, 100, per // 2)
            ]
        )[0]
        for p in range(2)
    ]
    for t in producers:
        t.join(30)
    wait_until(lambda: bus.stats()["consumers"]["c"]["acked"] == total)
    bus.close()
    for t in consumers:
        t.join(10)
    assert sorted(seen) == list(range(total))
