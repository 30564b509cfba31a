"""Several producer and consumer processes on the Ray backend: counts match exactly, nothing repeats."""

import collections
import time

import numpy as np
import pytest

from relax_bus import BusClosed, BusConfig, BusTimeout, ConsumerSpec, RayBus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_many_producers_and_consumers_processes(ray_session):
    ray = ray_session
    cfg = BusConfig(
        consumers={"train": ConsumerSpec(required_fields=["lp"], sampler="group"), "fwd": ConsumerSpec()},
        capacity=64,
        group_size=4,
    )
    bus = RayBus.create(cfg, name="stress-bus", num_storage_units=2)
    P, GROUPS = 3, 8  # 96 samples, half of them in object-store blocks; capacity 64 makes producers wait

    @ray.remote(num_cpus=0)
    class Producer:  # an actor: producer 0 owns its payloads, which must outlive the call that put them
        def run(self, p: int) -> list[int]:
            b = RayBus.from_name("stress-bus", payload_owner="producer" if p == 0 else "unit")
            ids = []
            for g in range(GROUPS):  # every other put is large: it goes through the object store
                size = 8192 if g % 2 else 4
                ids += b.put(
                    [
                        {"group_id": (p, g), "input_ids": np.full(size, p * 1000 + g, np.int64)}
                        for _ in range(4)
                    ]
                )
            return ids

    @ray.remote(num_cpus=0)
    def consume(b: RayBus, consumer: str, n: int) -> list[int]:
        got = []
        while True:
            try:
                batch = b.get(consumer, n, timeout=0.5, partial=True)
            except BusTimeout:
                continue
            except BusClosed:
                return got
            for x, (p, g) in zip(batch.data["input_ids"], batch.data["group_id"]):  # the right payload
                assert (x == p * 1000 + g).all() and len(x) == (8192 if g % 2 else 4)
            if consumer == "fwd":
                b.add_fields(batch.ids, {"lp": [0.0] * len(batch)})
            b.ack(consumer, batch.lease_id)
            got += batch.ids

    consumers = [
        consume.remote(bus, "fwd", 6),
        consume.remote(bus, "fwd", 5),
        consume.remote(bus, "train", 8),
        consume.remote(bus, "train", 4),
    ]
    producers = [Producer.remote() for _ in range(P)]
    produced = sum(ray.get([pr.run.remote(p) for p, pr in enumerate(producers)]), [])
    end = P * GROUPS * 4
    deadline = time.monotonic() + 60
    while bus.stats()["live"] and time.monotonic() < deadline:
        time.sleep(0.1)
    bus.close()
    fwd_a, fwd_b, tr_a, tr_b = ray.get(consumers)
    assert len(produced) == len(set(produced)) == end
    for got in (fwd_a + fwd_b, tr_a + tr_b):
        assert collections.Counter(got) == collections.Counter(produced)
    s = bus.stats()
    assert (
        s["live"] == 0 and s["consumers"]["train"]["acked"] == end and s["consumers"]["fwd"]["acked"] == end
    )
    bus.kill()
    for pr in producers:
        ray.kill(pr)
