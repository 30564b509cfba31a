"""The receiving role's end of the weight broadcast (:class:`relax_core.weight_sync.WeightSubscriber`) over a
real gloo group: a version the role cannot load stops its receiver, and the role's heartbeat says so, naming
the version and why — the health manager then restarts the role instead of leaving it to wait for weights
forever while its loop looks alive (what a rollout did when an engine that could not take the weights joined
its pool mid-run)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from relax_core.config_sections import RunConfig  # noqa: E402
from relax_core.dcs import WeightSender  # noqa: E402
from relax_core.health import Heartbeats  # noqa: E402
from relax_core.net import free_port  # noqa: E402
from relax_core.weight_sync import WeightSubscriber  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dcs_workers import connect_all  # noqa: E402


def test_a_version_the_role_cannot_load_stops_its_receiver_and_its_heartbeat_says_so():
    init = f"tcp://127.0.0.1:{free_port()}"
    sender = WeightSender(init, 2, timeout_s=30)
    held: list[int] = []

    def apply(version: int, tensors: dict) -> None:
        if version == 2:
            raise RuntimeError("pool engines hold different weights: {'e0': 'ab', 'e1': 'cd'}")
        held.append(version)

    sub = WeightSubscriber(
        RunConfig(weight_sync_timeout_s=30), apply, lambda: held[-1] if held else -1, "rollout"
    )
    try:
        connect_all(sender, [SimpleNamespace(connect=lambda: sub.connect_dcs(init, 2, 1))])
        for v in (1, 2):
            sender.broadcast([("w", torch.full((4,), float(v)))], v)
        deadline = time.monotonic() + 30
        while sub.load_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held == [1]
        assert sub.load_error == (
            "rollout could not load weight version 2: RuntimeError: pool engines hold different weights: "
            "{'e0': 'ab', 'e1': 'cd'}"
        )
        hb = Heartbeats(interval_s=1.0, timeout_s=60.0)
        hb.sent("rollout", "ref", now=0.0)
        beat = {"pid": 1, "age_s": 0.1, "error": sub.load_error}  # (alive: its loop polls)
        assert hb.check({"ref"}, {"ref": beat}, now=1.0) == [("rollout", sub.load_error)]
    finally:
        sender.abandon()
        sub.close()
