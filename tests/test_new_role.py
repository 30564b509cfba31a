"""A role added the way the next one will be (the critic of "PPO with a learned critic"): one class and one
registry entry, no driver edits. The class below is a bus consumer that writes each sample's token count
and feeds it to the trainer; registered next to the installed roles, it is planned (the bus gets its
consumer, the trainer waits for its field), built and started by the fully-async driver, watched by its
heartbeat, and — SIGKILLed mid-run — restarted in place from its spec's restart steps, the run training
every step with every sample counted. A second, stateful toy role (a running count it saves beside the
trainer's checkpoint and loads back on --load) resumes through the same drivers, with no file of relax-core
knowing its name."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import Controller
from relax_core.role import Restart, RoleSpec
from relax_core.roles import RolePlan, RoleRegistry
from relax_testing import after_trained_steps, signal_role_after

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

NAME = "token_count"


class TokenCount:
    """Writes ``n_tokens`` (each sample's token count) for the trainer to wait for."""

    @classmethod
    def spec(cls, cfg, name: str) -> RoleSpec:
        return RoleSpec(
            name, needs=("tokens",), writes=("n_tokens",), feeds_trainer=True, restart=(Restart.LEASES,)
        )

    def __init__(self, cfg, bus) -> None:
        self.bus, self.beat, self.counted = bus, time.monotonic(), 0

    def _once(self, timeout: float) -> int:
        self.beat = time.monotonic()
        batch = self.bus.get(NAME, n=64, partial=True, timeout=timeout)
        self.bus.add_fields(batch.ids, {"n_tokens": [len(t) for t in batch.data["tokens"]]})
        self.bus.ack(NAME, batch.lease_id)
        self.counted += len(batch)
        return len(batch)

    def run(self) -> int:
        from relax_bus import BusClosed, BusTimeout, ConsumerReset

        while True:
            try:
                self._once(timeout=1.0)
            except (BusTimeout, ConsumerReset):
                continue
            except BusClosed:
                return self.counted

    def drain(self) -> int:
        from relax_bus import BusTimeout

        try:
            while True:
                self._once(timeout=0.0)
        except BusTimeout:
            return self.counted

    def heartbeat(self) -> dict:
        return {"pid": os.getpid(), "age_s": time.monotonic() - self.beat}

    def get_spans(self) -> list:
        return []

    def close(self) -> None:
        pass


class SeenCount(TokenCount):
    """A stateful toy role: counts the samples it has seen over the whole run, resumes included. Its state is
    saved beside the trainer's checkpoint (``save_state``, as the critic's is) and read back (``load_state``)
    by the drivers, which know it only by its spec's :attr:`Restart.STATE`."""

    made: list[SeenCount] = []  # (colocate builds roles in this process: the test reads them here)

    @classmethod
    def spec(cls, cfg, name: str) -> RoleSpec:
        return RoleSpec(name, needs=("tokens",), restart=(Restart.LEASES, Restart.STATE))

    def __init__(self, cfg, bus) -> None:
        super().__init__(cfg, bus)
        self.loaded_from: str | None = None
        SeenCount.made.append(self)

    def _once(self, timeout: float) -> int:
        self.beat = time.monotonic()
        batch = self.bus.get(STATEFUL, n=64, partial=True, timeout=timeout)
        self.bus.ack(STATEFUL, batch.lease_id)
        self.counted += len(batch)
        return len(batch)

    @staticmethod
    def _file(checkpoint: str) -> Path:
        ckpt = Path(checkpoint)
        return ckpt.parent / STATEFUL / f"{ckpt.name}.json"

    def save_state(self, checkpoint: str) -> str:
        path = self._file(checkpoint)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"counted": self.counted}))
        return str(path)

    def load_state(self, checkpoint: str | None) -> int:
        if checkpoint is not None:
            self.loaded_from, self.counted = (
                checkpoint,
                json.loads(self._file(checkpoint).read_text())["counted"],
            )
        return self.counted


STATEFUL = "seen_count"


@pytest.fixture
def registry():
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (Ray's workers cannot import this file)
    yield RoleRegistry.installed().with_role(NAME, TokenCount)
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _cfg(inputs, out, *extra):
    return build_config(
        None,
        run_flags(inputs, out, *extra, n_samples_per_prompt=2, num_rollout=4, eval_interval=4, trace=False),
    )


def test_the_plan_gives_the_new_role_a_consumer_and_makes_the_trainer_wait_for_it(
    tiny_run_inputs, tmp_path, registry
):
    plan = RolePlan.from_config(_cfg(tiny_run_inputs, tmp_path, "--fully-async"), registry)
    assert plan.loops == ["advantages", NAME]
    assert plan.roles["actor"].needs == ("advantages", "n_tokens")
    assert plan.bus_config().consumers[NAME].required_fields == ["tokens"]


@pytest.mark.integration
@pytest.mark.slow
def test_a_new_role_runs_in_a_fully_async_run_and_is_restarted_in_place(tiny_run_inputs, tmp_path, registry):
    c = Controller(
        _cfg(tiny_run_inputs, tmp_path, "--fully-async", "--max-staleness", "1"), tiny_run_inputs, registry
    )
    kill = signal_role_after(c, 1, NAME)
    result = c.run()
    assert "pid" in kill, "the new role was never killed (the run ended first)"
    events = [(e["role"], e["action"]) for e in result.audit["health"]]
    assert events == [(NAME, "restart")], result.audit["health"]
    assert result.audit["health"][0]["recovery_s"] is not None
    trained = result.audit["trained_ids"]
    assert len(trained) == 4 * 8 and [h["step"] for h in result.history if "train/loss" in h] == [1, 2, 3, 4]
    assert set(trained) <= set(result.audit["consumed"][NAME])  # every trained sample was counted


@pytest.mark.integration
@pytest.mark.slow
def test_a_new_role_takes_its_turn_in_a_colocate_run(tiny_run_inputs, tmp_path, registry):
    result = Controller(_cfg(tiny_run_inputs, tmp_path, "--colocate"), tiny_run_inputs, registry).run()
    assert set(result.audit["trained_ids"]) == set(result.audit["consumed"][NAME])
    assert len(result.audit["trained_ids"]) == 4 * 8


@pytest.mark.integration
def test_a_new_stateful_role_saves_its_state_at_a_stop_and_resumes_with_load(
    tiny_run_inputs, tmp_path, registry, sigterm_self
):
    """SIGTERM after the first step: the colocate driver saves the toy role's state beside the checkpoint it
    writes; --load gives it back to the new run's copy, which counts on from there."""
    reg, ckpt = registry.with_role(STATEFUL, SeenCount), tmp_path / "ckpt"
    SeenCount.made.clear()
    first = Controller(
        _cfg(tiny_run_inputs, tmp_path / "a", "--colocate", "--save", str(ckpt)), tiny_run_inputs, reg
    )
    after_trained_steps(tmp_path / "a" / "metrics.jsonl", trained_steps=1, fire=sigterm_self)
    part1 = first.run()
    assert first.interrupted_at is not None, "the signal did not stop the run early"
    (before,) = SeenCount.made
    saved = json.loads(SeenCount._file(first.interrupted_at).read_text())["counted"]
    assert saved == before.counted >= 8 * len([h for h in part1.history if "train/loss" in h])

    second = Controller(
        _cfg(tiny_run_inputs, tmp_path / "b", "--colocate", "--load", str(ckpt)), tiny_run_inputs, reg
    )
    rest = second.run()
    after = SeenCount.made[-1]
    assert after is not before and after.loaded_from == first.interrupted_at
    assert after.counted == saved + len(rest.audit["consumed"][STATEFUL])
