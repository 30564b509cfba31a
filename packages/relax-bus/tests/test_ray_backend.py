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
    again.kill()
    bus.kill()
