import os
import subprocess
import sys
import time

import pytest

from relax_bus import BusConfig, BusTimeout, ConsumerSpec, RayBus


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


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # workers reuse this venv as is
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


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
