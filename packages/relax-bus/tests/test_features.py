"""Samplers by tokens, bad input, async API, streaming loader, snapshot/restore, metrics (in-process)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from relax_bus import (
    AsyncBus,
    BusConfig,
    BusError,
    BusTimeout,
    ConsumerSpec,
    DataBus,
    DuplicateIds,
    ManualClock,
    SampleRef,
    StreamingDataLoader,
)
from relax_bus.samplers import seq_balanced, token_budget

pytestmark = pytest.mark.timeout(60)


def test_token_budget_sampler():
    ready = [SampleRef(i, None, None, n) for i, n in enumerate([3, 4, 5, 9])]
    assert token_budget(ready, 10, False, 1, max_tokens=8) == [0, 1]  # 3+4, next would overflow
    assert token_budget(ready[3:], 10, False, 1, max_tokens=8) == [3]  # oversized alone, never stuck
    assert token_budget(ready[:1], 10, False, 1, max_tokens=8) == []  # could still grow
    assert token_budget(ready[:1], 10, True, 1, max_tokens=8) == [0]
    grouped = [SampleRef(i, i // 2, None, 2) for i in range(6)]
    assert token_budget(grouped, 10, False, 2, max_tokens=8, grouped=True) == [0, 1, 2, 3]


def test_seq_balanced_sampler():
    ready = [SampleRef(i, None, None, n) for i, n in enumerate([10, 1, 1, 10, 5, 5, 2, 2])]
    ids = seq_balanced(ready, 8, False, 1, dp_size=2)
    length = {r.id: r.length for r in ready}
    assert sorted(ids) == list(range(8))
    loads = [sum(length[i] for i in ids[:4]), sum(length[i] for i in ids[4:])]
    assert abs(loads[0] - loads[1]) <= 2, loads


def test_token_budget_consumer_on_bus():
    bus = DataBus(
        BusConfig(
            consumers={
                "t": ConsumerSpec(
                    sampler="token_budget", length_field="input_ids", sampler_options={"max_tokens": 10}
                )
            }
        )
    )
    bus.put([{"input_ids": np.zeros(n, np.int64)} for n in (4, 4, 4, 9)])
    assert bus.get("t", 100).ids == [0, 1]
    assert bus.get("t", 100).ids == [2]
    with pytest.raises(ValueError, match="length_field"):
        ConsumerSpec(sampler="seq_balanced")


def test_bad_input_names_field_and_sample_and_changes_nothing():
    bus = DataBus(
        BusConfig(consumers={"c": ConsumerSpec()}, fields=["input_ids", "reward"], max_sample_bytes=1000)
    )
    bus.put([{"input_ids": np.zeros(4, np.int64), "reward": 1.0}])
    before = bus.stats()
    cases = [
        ([{"input_ids": np.zeros(4, np.float32)}], "field 'input_ids' of sample 0: dtype mismatch"),
        ([{"input_ids": np.zeros((4, 2), np.int64)}], "field 'input_ids' of sample 0: shape mismatch"),
        ([{"input_ids": np.zeros(4, np.int64), "reward": "high"}], "field 'reward' of sample 0"),
        ([{"input_ids": np.zeros(4, np.int64), "oops": 1}], "unknown field 'oops' on sample 0"),
        (
            [{"input_ids": np.zeros(400, np.int64)}],
            "sample 0 would be 3200 bytes, over BusConfig.max_sample_bytes",
        ),
        ([{"input_ids": np.zeros(1, np.int64)}, {"input_ids": np.zeros(1, np.int32)}], "sample 1: dtype"),
    ]
    for samples, msg in cases:
        with pytest.raises(BusError, match=msg):
            bus.put(samples)
    with pytest.raises(DuplicateIds, match="id 0 was used before on this bus"):  # a re-send
        bus.put([{"reward": 0.0}], ids=[0])
    with pytest.raises(BusError, match="duplicate id 7"):
        bus.put([{"reward": 0.0}] * 2, ids=[7, 7])
    with pytest.raises(BusError, match="duplicate sample id 0"):
        bus.add_fields([0, 0], {"reward": [1.0, 2.0]})
    assert bus.stats() == before
    assert bus.put([{"reward": 0.0}], ids=[9]) == [9] and bus.put([{"reward": 0.0}]) == [10]


def test_async_api_and_cancel_gives_back():
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}))
    abus = AsyncBus(bus, slice_s=0.02)

    async def main():
        waiter = asyncio.create_task(abus.get("c", 2))
        await asyncio.sleep(0.05)
        assert await abus.put([{"x": 1}, {"x": 2}]) == [0, 1]
        b = await waiter
        await abus.ack("c", b.lease_id)
        cancelled = asyncio.create_task(abus.get("c", 1))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        await abus.put([{"x": 3}])
        with pytest.raises(BusTimeout):
            await abus.get("c", 5, timeout=0.05)
        await asyncio.sleep(0.05)
        again = await abus.get("c", 1, timeout=2)
        return b.ids, again.ids

    assert asyncio.run(main()) == ([0, 1], [2])


def test_streaming_loader_pads_and_acks():
    bus = DataBus(BusConfig(consumers={"t": ConsumerSpec()}))
    bus.put([{"input_ids": np.arange(n), "reward": float(n)} for n in (1, 3, 2, 2)])
    mbs = list(StreamingDataLoader(bus, "t", micro_batch_size=2, total=4, to_torch=False))
    assert [m["ids"] for m in mbs] == [[0, 1], [2, 3]]
    assert mbs[0]["input_ids"].tolist() == [[0, 0, 0], [0, 1, 2]] and mbs[0][
        "input_ids_lengths"
    ].tolist() == [1, 3]
    assert mbs[0]["reward"].tolist() == [1.0, 3.0]
    assert bus.stats()["consumers"]["t"]["acked"] == 4
    bus.put([{"input_ids": np.arange(2)}] * 2)
    (packed,) = StreamingDataLoader(bus, "t", 2, total=2, collate_mode="pack", to_torch=False)
    assert packed["input_ids"].tolist() == [0, 1, 0, 1] and packed["input_ids_cu_seqlens"].tolist() == [
        0,
        2,
        4,
    ]


def test_streaming_loader_torch_tensors():
    torch = pytest.importorskip("torch")
    bus = DataBus(BusConfig(consumers={"t": ConsumerSpec()}))
    bus.put([{"input_ids": np.arange(3)}])
    (mb,) = StreamingDataLoader(bus, "t", 1, total=1)
    assert isinstance(mb["input_ids"], torch.Tensor) and mb["input_ids"].shape == (1, 3)


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r["samples"].append("not a sample"),
        lambda r: r["consumers"].update(a={"available": []}),
        lambda r: r.update(config={"capacity": "many"}),
    ],
    ids=["a-sample", "a-consumer", "the-config"],
)
def test_a_snapshot_whole_outside_and_damaged_inside_is_a_bus_error_naming_it(tmp_path, damage):
    """#49: a snapshot with every key but entries of another shape (listed, whole, in its checkpoint's
    manifest) was a traceback from deep inside the restore."""
    import pickle

    from relax_bus import BusError

    bus = DataBus(BusConfig(consumers={"a": ConsumerSpec()}))
    bus.put([{"x": np.arange(2)}])
    path = bus.snapshot(tmp_path / "s")
    record = pickle.loads((path / "state.pkl").read_bytes())
    damage(record)
    (path / "state.pkl").write_bytes(pickle.dumps(record))
    with pytest.raises(
        BusError, match=r"state.pkl is not a bus state inside \(.*\): the snapshot is damaged"
    ):
        DataBus.restore(path)


def test_snapshot_restore_redelivers_in_flight_only(tmp_path):
    clock = ManualClock()
    bus = DataBus(
        BusConfig(consumers={"a": ConsumerSpec(), "b": ConsumerSpec()}, lease_timeout_s=1), clock=clock
    )
    bus.put([{"x": np.full(2, i)} for i in range(6)], partition="p0")
    done = bus.get("a", 2)
    bus.ack("a", done.lease_id)
    bus.get("a", 2)  # in flight when the snapshot is taken
    bus.set_trainer_version(3)
    bus.snapshot(tmp_path / "s")
    bus.snapshot(tmp_path / "s")  # overwriting is atomic and fine
    r = DataBus.restore(tmp_path / "s")
    assert r.trainer_version == 3 and r.consumed_ids("a") == [0, 1]
    assert r.get("a", 4).ids == [2, 3, 4, 5] and r.get("b", 6).ids == list(range(6))
    assert r.stats()["depth"] == {"p0": 6}
    with pytest.raises(BusError, match="no bus snapshot"):
        DataBus.restore(tmp_path / "nothing")


def test_state_dict_round_trip_carries_everything_but_leases():
    """``load_state_dict(state_dict())`` into a fresh bus: the same samples, progress, counters and versions;
    a batch in flight counts as not delivered, so it comes again."""
    bus = DataBus(BusConfig(consumers={"a": ConsumerSpec(), "b": ConsumerSpec(required_fields=["y"])}))
    bus.put([{"x": np.full(2, i)} for i in range(5)], partition="p0", ids=[0, 1, 2, 3, 7])
    bus.ack("a", bus.get("a", 2).lease_id)
    bus.get("a", 1)  # in flight
    bus.add_fields([0, 1], {"y": [0.5, 1.5]})
    bus.set_trainer_version(2)
    state = bus.state_dict()
    assert state.next_id == 8 and state.unused_ids == [[4, 7]] and state.trainer_version == 2
    assert state.consumers["a"].available == [2, 3, 7] and state.consumers["a"].acked_ids == [0, 1]
    assert [s.id for s in state.samples] == [0, 1, 2, 3, 7] and state.samples[0].waiting == ["b"]

    r = DataBus(state.config)
    r.load_state_dict(state)
    assert r.state_dict() == state
    assert r.trainer_version == 2 and r.consumed_ids("a") == [0, 1]
    before, after = bus.stats(), r.stats()
    for k in ("live", "depth", "samples_put", "bytes_in", "staleness_hist"):
        assert before[k] == after[k], k
    assert r.get("a", 3).ids == [2, 3, 7] and r.get("b", 5, partial=True).ids == [0, 1]
    r.put([{"x": np.full(2, 9)}], ids=[5])  # an unused id stays usable
    with pytest.raises(BusError, match="dtype mismatch"):  # and the schema came along
        r.put([{"x": np.zeros(2, np.float32)}])


def test_load_state_dict_needs_a_fresh_bus_with_the_same_consumers():
    bus = DataBus(BusConfig(consumers={"a": ConsumerSpec()}))
    bus.put([{"x": 1}])
    with pytest.raises(BusError, match="fresh bus"):
        bus.load_state_dict(bus.state_dict())
    other = DataBus(BusConfig(consumers={"other": ConsumerSpec()}))
    with pytest.raises(BusError, match=r"consumers \['a'\], this bus \['other'\]"):
        other.load_state_dict(bus.state_dict())


def test_metrics_flatten():
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}))
    bus.put([{"x": np.zeros(4, np.float32)}], partition="s0")
    b = bus.get("c", 1)
    m = bus.metrics()
    assert m["bus/depth/s0"] == 1 and m["bus/bytes_in"] == 16 and m["bus/bytes_out"] == 16
    assert m["bus/consumers/c/in_flight"] == 1 and "bus/get_wait_s" in m
    bus.ack("c", b.lease_id)


def test_lease_expiry_and_consumer_death_redeliver():
    clock = ManualClock()
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, lease_timeout_s=10), clock=clock)
    bus.put([{"x": i} for i in range(4)])
    first = bus.get("c", 2)
    second = bus.get("c", 2)
    clock.advance(11)
    assert bus.get("c", 4).ids == [0, 1, 2, 3] and bus.stats()["leases_expired"] == 2
    with pytest.raises(BusError, match="unknown lease"):
        bus.ack("c", first.lease_id)
    assert bus.reset_consumer("c") == 4 and second.lease_id != first.lease_id
    assert bus.get("c", 4).ids == [0, 1, 2, 3]


def test_leases_tell_a_supervisor_what_a_dead_consumer_held():
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec(), "d": ConsumerSpec()}))
    bus.put([{"x": i} for i in range(4)])
    a, b = bus.get("c", 2), bus.get("c", 2)
    assert bus.leases("c") == {a.lease_id: [0, 1], b.lease_id: [2, 3]} and bus.leases("d") == {}
    bus.ack("c", a.lease_id)  # covered by the dead consumer's checkpoint
    assert bus.leases("c") == {b.lease_id: [2, 3]}
    assert bus.reset_consumer("c") == 2 and bus.leases("c") == {}
    assert bus.get("c", 4, partial=True).ids == [2, 3]
    with pytest.raises(BusError, match="unknown consumer"):
        bus.leases("nobody")


def test_reset_consumer_keeps_what_the_dead_consumer_already_wrote():
    bus = DataBus(BusConfig(consumers={"fwd": ConsumerSpec(), "train": ConsumerSpec(required_fields=["lp"])}))
    bus.put([{"x": i} for i in range(4)])
    held = bus.get("fwd", 4)
    bus.add_fields([0, 1], {"lp": [0.5, 0.25]})  # written, then the process died before acking
    assert bus.reset_consumer("fwd", done_if_written=["lp"]) == 2
    assert bus.consumed_ids("fwd") == [0, 1] and held.lease_id not in bus.leases("fwd")
    assert bus.get("fwd", 4, partial=True).ids == [2, 3]  # only the unwritten ones come back
    assert bus.get("train", 4, partial=True).ids == [0, 1]


def test_a_get_waiting_when_its_consumer_is_reset_takes_nothing():
    """The consumer's process died while its ``get`` waited for data (in the bus, or the bus actor, the call
    waits on). Samples written after the reset must go to the restarted consumer, not to the dead caller's
    call, which would hold them in a lease nobody acks while the run moved on without them."""
    import threading

    from relax_bus import ConsumerReset

    bus = DataBus(BusConfig(consumers={"adv": ConsumerSpec()}))
    outcome: list = []

    def dead_callers_get():
        try:
            outcome.append(bus.get("adv", 2, timeout=10))
        except BusError as e:
            outcome.append(e)

    t = threading.Thread(target=dead_callers_get)
    t.start()
    while not bus.stats()["waiting"]["get"]:  # the call is waiting inside the bus
        threading.Event().wait(0.01)
    bus.reset_consumer("adv")  # what the health manager does once it saw the process die
    bus.put([{"x": i} for i in range(2)])
    t.join(10)
    assert isinstance(outcome[0], ConsumerReset) and "reset" in str(outcome[0])
    assert bus.leases("adv") == {}
    assert bus.get("adv", 2, timeout=1).ids == [0, 1]  # the restarted consumer gets them


def test_reset_consumer_after_restore_acks_written_samples(tmp_path):
    """A snapshot saves leases as not delivered: after restore, samples whose output was written before
    the snapshot must not be handed to the consumer again (its field is write-once)."""
    bus = DataBus(BusConfig(consumers={"fwd": ConsumerSpec(), "train": ConsumerSpec(required_fields=["lp"])}))
    bus.put([{"x": i} for i in range(3)])
    bus.get("fwd", 3)
    bus.add_fields([0], {"lp": [0.5]})
    restored = DataBus.restore(bus.snapshot(tmp_path / "snap"))
    assert restored.reset_consumer("fwd", done_if_written=["lp"]) == 0
    assert restored.consumed_ids("fwd") == [0]
    assert restored.get("fwd", 3, partial=True).ids == [1, 2]


def test_example_runs():
    from pathlib import Path

    ex = Path(__file__).parents[1] / "examples" / "plain_torch_rl.py"
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, str(ex), "--steps", "3"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "step 2" in out.stdout


def test_explicit_ids_come_in_any_order_each_once_and_the_unused_survive_a_snapshot(tmp_path):
    """A producer streaming prompt groups puts them as they finish, ids fixed by their place in the run:
    a later group's ids before an earlier one's. Each id is taken once; a re-send of any is refused; ids
    skipped over stay usable, after a snapshot too (a resumed run fills in the groups it still owes)."""
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}))
    x = [{"x": np.zeros(2)}] * 2
    bus.put(x, ids=[8, 9])
    bus.put(x, ids=[2, 3])  # below the highest used: unused, so taken
    for ids in ([8, 9], [3, 4], [9, 10]):
        with pytest.raises(DuplicateIds, match=f"id {ids[0]} was used before"):
            bus.put(x, ids=ids)
    assert bus.stats()["depth"]["default"] == 4  # (the refused puts wrote nothing, not even id 4 or 10)
    bus.snapshot(tmp_path / "s")
    r = DataBus.restore(tmp_path / "s")
    r.put(x, ids=[0, 1])
    r.put(x, ids=[6, 7])
    r.put(x, ids=[4, 5])
    with pytest.raises(DuplicateIds, match="id 5 was used before"):
        r.put(x[:1], ids=[5])
    assert r.put(x) == [10, 11]  # bus-assigned ids go on past the highest used
    assert r.state_dict().unused_ids == []


def test_get_takes_one_partition_only_when_asked():
    """A trainer takes rollout step k's samples at version k while step k+1's groups stream in."""
    bus = DataBus(BusConfig(consumers={"t": ConsumerSpec(sampler="group")}, group_size=2))
    g = lambda step, i: [{"group_id": f"{step}:{i}", "x": np.zeros(1)}] * 2  # noqa: E731
    bus.put(g(1, 0), partition="step1", ids=[4, 5])
    bus.put(g(0, 0), partition="step0", ids=[0, 1])
    with pytest.raises(BusTimeout):
        bus.get("t", 4, timeout=0.05, partition="step0")  # step 0's second group is not there yet
    bus.put(g(1, 1), partition="step1", ids=[6, 7])
    assert bus.get("t", 4, partition="step1").ids == [4, 5, 6, 7]
    bus.put(g(0, 1), partition="step0", ids=[2, 3])
    assert bus.get("t", 4, partition="step0").ids == [0, 1, 2, 3]
