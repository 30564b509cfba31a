"""DCS's delta mode (#53): over a real gloo group (a sender and two receivers, threads of this process), every
version each receiver commits is bitwise the sender's while the bytes sent are a fraction of the weights; a
receiver whose base went wrong refuses the next delta, keeps its last version, asks for a full sync, and
the sender's next version repairs it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from relax_core.dcs import WeightReceiver, WeightSender, checksum  # noqa: E402
from relax_core.dcs_delta import FULL_KEY  # noqa: E402
from relax_core.net import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dcs_workers import connect_all  # noqa: E402


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g) * 0.05,
        "layer.0.weight": torch.randn(64, 64, generator=g) * 0.05,
        "norm.weight": torch.ones(64),
    }


def _step(master: dict[str, torch.Tensor], v: int, lr: float = 1e-5) -> list[tuple[str, torch.Tensor]]:
    """An Adam-like update of the fp32 master weights; what is sent: their bf16 copy."""
    g = torch.Generator().manual_seed(1000 + v)
    for t in master.values():
        t -= lr * torch.sign(torch.randn(t.shape, generator=g))
    return [(n, t.to(torch.bfloat16)) for n, t in master.items()]


@pytest.fixture
def group():
    init = f"tcp://127.0.0.1:{free_port()}"
    sender = WeightSender(init, 3, bucket_bytes=16 << 10, timeout_s=60, delta=True, full_every=1000)
    receivers = [WeightReceiver(init, 3, r, timeout_s=60) for r in (1, 2)]
    connect_all(sender, receivers)
    seen: list[list[tuple[int, str]]] = [[], []]
    for k, r in enumerate(receivers):
        r.start_background(lambda v, ts, k=k: seen[k].append((v, checksum(ts.items()))))
    yield sender, receivers, seen
    sender.close()
    for r in receivers:
        r.join(timeout=30)
        r.check()
        r.close()


def _until(done, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _wait(seen, n: int) -> None:
    _until(lambda: min(len(s) for s in seen) >= n)


def test_every_version_arrives_bitwise_and_deltas_send_a_fraction(group):
    sender, receivers, seen = group
    master, sent = _weights(), []
    for v in range(30):
        named = _step(master, v)
        stats = sender.broadcast(named, v)
        sent.append((v, checksum(named), stats.num_bytes, stats.full_bytes))
    _wait(seen, 30)
    for got in seen:
        assert got == [(v, c) for v, c, _, _ in sent]  # every version, in order, bitwise the sender's
    assert sent[0][2] >= sent[0][3]  # the first version goes full
    assert max(b / full for _, _, b, full in sent[1:]) < 0.5


def test_a_receiver_whose_base_went_wrong_refuses_keeps_its_version_and_a_full_sync_repairs_it(group):
    sender, receivers, seen = group
    master = _weights()
    versions = {}
    for v in range(3):
        versions[v] = checksum(named := _step(master, v))
        sender.broadcast(named, v)
    _wait(seen, 3)
    receivers[1]._codec.buckets[0][:8] ^= 0xFF  # (its copy of version 2 corrupted: a delta must not apply)
    versions[3] = checksum(named := _step(master, 3))
    sender.broadcast(named, 3)  # receiver 2 refuses this delta and asks for a full sync
    _wait([seen[0]], 4)
    _until(lambda: sender._ep.store.add(FULL_KEY, 0) >= 1)  # (its ask reached the store)
    versions[4] = checksum(named := _step(master, 4))
    stats = sender.broadcast(named, 4)
    assert stats.num_bytes >= stats.full_bytes  # the asked-for full sync
    _wait([seen[0]], 5)
    _wait([seen[1]], 4)
    assert seen[0] == [(v, versions[v]) for v in range(5)]
    assert seen[1] == [(v, versions[v]) for v in (0, 1, 2, 4)]  # version 3 refused, never a wrong weight


def test_where_deltas_do_not_pay_the_sender_falls_back_to_plain_full_syncs(group):
    """fp32 weights at a high lr change in every element: after 3 such deltas the sender gives up and sends
    plain full versions (no delta header, no checksums to compute), which every receiver takes bitwise."""
    sender, receivers, seen = group
    master, sent = _weights(), []
    for v in range(8):
        _step(master, v, lr=2e-4)
        named = [(n, t.clone()) for n, t in master.items()]  # (fp32: what is sent is the master itself)
        stats = sender.broadcast(named, v)
        sent.append((v, checksum(named), stats.full_bytes))
    _wait(seen, 8)
    for got in seen:
        assert got == [(v, c) for v, c, _ in sent]
    assert sender._codec.gave_up
    assert [full is None for _, _, full in sent] == [False] * 4 + [True] * 4  # plain syncs after the 4th
