import subprocess
import sys
import time

import numpy as np
import pytest

from relax_bus import BusConfig, BusError, BusTimeout, ConsumerSpec, DataBus, RayBus


def test_missing_ray_names_install_command():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from relax_bus import RayBus, BusConfig, ConsumerSpec\n"
        "try:\n"
        "    RayBus.create(BusConfig(consumers={'c': ConsumerSpec()}))\n"
        "except ImportError as e:\n"
        "    assert \"pip install 'relax-bus[ray]'\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _wait_until(pred, limit_s=60.0):
    end = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.01)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_producer_and_consumer_through_ray(ray_session):
    ray = ray_session
    cfg = BusConfig(
        consumers={"trainer": ConsumerSpec(required_fields=["reward"], sampler="group")}, group_size=4
    )
    bus = RayBus.create(cfg, name="relax-bus-test")

    @ray.remote(num_cpus=0)
    def consume(bus: RayBus, n: int) -> list[int]:
        batch = bus.get("trainer", n, fields=["reward", "group_id"], timeout=120)
        bus.ack("trainer", batch.lease_id)
        return batch.ids

    @ray.remote(num_cpus=0)
    class Producer:
        def run(self, groups: int) -> list[int]:
            found = RayBus.from_name("relax-bus-test")
            ids = []
            for g in range(groups):
                ids += found.put([{"group_id": g, "reward": float(i)} for i in range(4)])
            return ids

    pending = consume.remote(bus, 8)  # blocks in the actor until the producer has put two groups
    _wait_until(lambda: bus.stats()["waiting"]["get"] == 1)
    ids = ray.get(Producer.remote().run.remote(2))
    assert ray.get(pending) == ids == list(range(8))

    stats = bus.stats()
    assert stats["consumers"]["trainer"]["delivered"] == 8 and stats["consumers"]["trainer"]["acked"] == 8
    assert stats["live"] == 0 and stats["samples_put"] == 8
    assert bus.consumed_ids("trainer") == ids
    with pytest.raises(BusTimeout):  # errors arrive as the bus's own types
        bus.get("trainer", 4, timeout=0.01)
    bus.set_trainer_version(1)
    assert bus.trainer_version == 1
    bus.close()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_killed_consumers_waiting_get_takes_nothing_after_its_reset(ray_session):
    """Kill a consumer actor while its ``get`` waits in the bus controller; the call lives on there. After the
    supervisor's ``reset_consumer`` the samples put next go to the restarted consumer (before the fix the
    dead call took them: a lease nobody acks, and the run went on without them)."""
    ray = ray_session
    bus = RayBus.create(BusConfig(consumers={"adv": ConsumerSpec()}), name="relax-bus-kill-test")

    @ray.remote(num_cpus=0)
    class Consumer:
        def take(self, bus: RayBus, n: int, timeout: float) -> list[int]:
            return bus.get("adv", n, timeout=timeout).ids

    doomed = Consumer.remote()
    doomed.take.remote(bus, 2, 60.0)
    _wait_until(lambda: bus.stats()["waiting"]["get"] == 1)
    ray.kill(doomed)
    time.sleep(0.5)
    assert bus.stats()["waiting"]["get"] == 1  # the dead caller's call still waits in the controller
    bus.reset_consumer("adv")
    bus.put([{"x": i} for i in range(2)])
    _wait_until(lambda: bus.stats()["waiting"]["get"] == 0)
    assert bus.leases("adv") == {}
    assert ray.get(Consumer.remote().take.remote(bus, 2, 30.0)) == [0, 1]
    bus.close()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_large_payloads_go_through_object_store_and_snapshot(ray_session, tmp_path):
    cfg = BusConfig(consumers={"fwd": ConsumerSpec(), "train": ConsumerSpec(required_fields=["log_probs"])})
    bus = RayBus.create(cfg, num_storage_units=2)
    toks = [np.arange(4096, dtype=np.int64) + i for i in range(16)]  # 512 KiB: above inline_bytes
    ids = bus.put([{"input_ids": t, "reward": float(i)} for i, t in enumerate(toks)])
    b = bus.get("fwd", 16, fields=["input_ids"])
    assert all(np.array_equal(x, t) for x, t in zip(b.data["input_ids"], toks))
    bus.add_fields(b.ids, {"log_probs": [np.zeros(4096, np.float32)] * 16})
    bus.ack("fwd", b.lease_id)
    with pytest.raises(BusError, match="dtype mismatch"):  # checked in the caller, nothing shipped
        bus.put([{"input_ids": np.zeros(3, np.float32), "reward": 0.0}])
    taken = bus.get("train", 4)  # in flight at snapshot time: delivered again after restore
    bus.snapshot(tmp_path / "snap")
    local = DataBus.restore(tmp_path / "snap")  # the format is shared by both backends
    again = RayBus.restore(tmp_path / "snap")
    for other in (local, again):
        got = other.get("train", 16)
        assert got.ids == ids and np.array_equal(got.data["input_ids"][3], toks[3])
        other.ack("train", got.lease_id)
        assert other.stats()["live"] == 0
    bus.ack("train", taken.lease_id)
    assert bus.stats()["bytes_out"] > 16 * 4096 * 8
    assert isinstance(again.link.controller, ray_session.actor.ActorHandle)  # (fault tests kill it)
    again.kill()
    bus.kill()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_same_node_fast_path_and_ray_path_see_one_bus(ray_session):
    """A handle on the controller's node uses the socket + shared-memory path; another handle forced onto
    actor calls + the object store reads what the first wrote and the other way round; files go with the
    samples and with the bus."""
    import os

    from relax_bus import local

    cfg = BusConfig(consumers={"fwd": ConsumerSpec(), "train": ConsumerSpec(required_fields=["log_probs"])})
    fast = RayBus.create(cfg, name="relax-bus-transports")
    slow = RayBus.from_name("relax-bus-transports", fast_local=False)
    assert (fast.link.transport, slow.link.transport) == ("local", "ray")
    shm = fast.link.local_info["shm_dir"]
    toks = [np.arange(4096, dtype=np.int64) + i for i in range(16)]  # 512 KiB: above inline_bytes
    ids = fast.put([{"input_ids": t, "meta": {"k": i}} for i, t in enumerate(toks[:8])])
    ids += slow.put([{"input_ids": t, "meta": {"k": i + 8}} for i, t in enumerate(toks[8:])])
    assert len(os.listdir(shm)) == 1  # one file for the fast put; the slow one sits in the object store
    got = slow.get("fwd", 8)  # written as a file, read through the object store
    mine = fast.get("fwd", 8)  # written as an object, read as a file
    for b in (got, mine):
        assert [m["k"] for m in b.data["meta"]] == [ids.index(i) for i in b.ids]
        assert all(np.array_equal(x, toks[ids.index(i)]) for i, x in zip(b.ids, b.data["input_ids"]))
        assert not b.data["input_ids"][0].flags.writeable  # zero-copy views are read-only
    fast.add_fields(got.ids, {"log_probs": [np.full(4096, 1.0, np.float32)] * 8})
    slow.add_fields(mine.ids, {"log_probs": [np.full(4096, 2.0, np.float32)] * 8})
    fast.ack("fwd", got.lease_id)
    slow.ack("fwd", mine.lease_id)
    train = fast.get("train", 16)
    assert sorted(train.ids) == sorted(ids)
    assert {float(lp[0]) for lp in train.data["log_probs"]} == {1.0, 2.0}
    fast.ack("train", train.lease_id)
    _wait_until(lambda: os.listdir(shm) == [])  # every sample acked by every consumer: files unlinked
    assert np.array_equal(train.data["input_ids"][0], toks[ids.index(train.ids[0])])  # still mapped: valid
    address = fast.link.local_info["address"]
    fast.kill()
    assert not os.path.exists(shm) and not os.path.exists(address)
    assert local.remove_leftovers() == 0


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_fast_path_on_a_node_without_tmpfs(ray_session, monkeypatch):
    """A controller node with no usable /dev/shm: same-node handles still use the socket, payloads take the
    object store both ways (a fast get used to ask the controller for block files it had nowhere to write)."""
    from relax_bus import ray_actors, ray_backend

    class NoShmController(ray_actors.Controller):
        def __init__(self, *args, **kwargs):
            from relax_bus import local

            local.make_shm_dir = lambda: None  # (in the controller's own process)
            super().__init__(*args, **kwargs)

    ray_backend._actor("unit")  # fill the class cache, then swap the controller class for this test
    remote = ray_session.remote(max_concurrency=256)(NoShmController)
    monkeypatch.setitem(ray_backend._CLASSES, "controller", remote)
    bus = RayBus.create(BusConfig(consumers={"c": ConsumerSpec()}))
    assert bus.link.transport == "local" and bus.link.local_info["shm_dir"] is None
    toks = [np.arange(4096, dtype=np.int64) + i for i in range(8)]  # 256 KiB: above inline_bytes
    ids = bus.put([{"input_ids": t} for t in toks])
    got = bus.get("c", 8)
    assert all(np.array_equal(x, toks[ids.index(i)]) for i, x in zip(got.ids, got.data["input_ids"]))
    bus.ack("c", got.lease_id)
    bus.kill()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_fast_path_socket_needs_the_bus_secret(ray_session):
    import os
    import stat
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    bus = RayBus.create(BusConfig(consumers={"c": ConsumerSpec()}))
    address = bus.link.local_info["address"]
    assert stat.S_IMODE(os.stat(address).st_mode) == 0o600
    with pytest.raises(AuthenticationError):
        Client(address, family="AF_UNIX", authkey=b"not the secret")
    bus.put([{"x": 1.0}])  # the server still serves its real clients
    assert bus.get("c", 1).data["x"] == [1.0]
    bus.kill()


def test_leftovers_of_dead_controllers_are_removed(tmp_path, monkeypatch):
    import os

    from relax_bus import local

    monkeypatch.setattr(local, "SHM_ROOT", tmp_path)
    monkeypatch.setattr(local.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone = tmp_path / f"relax-bus-{int(dead.stdout)}-abc"
    (gone / "sub").mkdir(parents=True)
    sock = tmp_path / f"relax-bus-{int(dead.stdout)}-abc.sock"
    sock.write_text("")
    alive = local.make_shm_dir()
    assert local.remove_leftovers() == 2
    assert not gone.exists() and not sock.exists() and alive.exists()
    assert alive.name.startswith(f"relax-bus-{os.getpid()}-")
