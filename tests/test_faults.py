"""Fault injection on a running fully-async job (real local Ray cluster): a role's process is killed
with SIGKILL mid-run; the health manager restarts it and the run finishes having trained on exactly the
prompts an uninterrupted run with the same seed trains on — nothing lost, nothing twice."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from relax_core.cli_config import build_config
from relax_core.controller import Controller

STEPS = 8


def _cfg(inputs, out, *extra):
    return build_config(
        None,
        ["--prompt-data", inputs.prompt_path, "--hf-checkpoint", inputs.model_path,
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
         "--num-rollout", str(STEPS), "--micro-batch-size", "8", "--torch-threads", "1", "--no-progress",
         "--no-trace", "--eval-interval", "4", "--output-dir", str(out), "--fully-async", "--max-staleness", "1",
         "--save", str(Path(out) / "ckpt"), "--save-interval", "1", *extra],
    )  # fmt: skip


def _kill_after(controller: Controller, metrics: Path, trained_steps: int, role: str) -> dict:
    """SIGKILL the process of ``role`` once ``trained_steps`` steps are in metrics.jsonl."""
    out: dict = {}

    def watch():
        import ray

        while True:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if sum('"train/loss"' in line for line in lines) >= trained_steps:
                break
            time.sleep(0.01)
        if role == "engine":  # one of the rollout role's engine processes
            pids = ray.get(controller.async_run.roles["rollout"].engine_pids.remote())
            out["engine"], pid = sorted(pids.items())[0]
        else:
            pid = ray.get(controller.async_run.roles[role].heartbeat.remote())["pid"]
        assert pid != os.getpid()
        os.kill(pid, signal.SIGKILL)
        out["pid"], out["at"] = pid, time.monotonic()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    out["thread"] = t
    return out


def _trained_prompts(result) -> collections.Counter:
    return collections.Counter(p for step in result.audit["trained_prompts"] for p in step)


@pytest.fixture(scope="module")
def uninterrupted(tiny_run_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return Controller(_cfg(tiny_run_inputs, out), tiny_run_inputs).run()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("role", ["actor_fwd", "rollout", "actor"])
def test_killed_role_is_restarted_and_trains_the_same_prompts(tiny_run_inputs, tmp_path, uninterrupted, role):
    c = Controller(_cfg(tiny_run_inputs, tmp_path / role), tiny_run_inputs)
    kill = _kill_after(c, tmp_path / role / "metrics.jsonl", 2, role)
    result = c.run()
    assert "pid" in kill, "the role was never killed (the run ended first)"
    events = result.audit["health"]
    assert [(e["role"], e["action"]) for e in events] == [(role, "restart")], events
    assert events[0]["recovery_s"] is not None
    # nothing lost, nothing twice: the same prompts, as often, as the uninterrupted run
    assert _trained_prompts(result) == _trained_prompts(uninterrupted)
    assert len(result.audit["trained_ids"]) == len(set(result.audit["trained_ids"])) == STEPS * 8
    steps = [h["step"] for h in result.history if "train/loss" in h]
    assert steps == list(range(1, STEPS + 1))


@pytest.mark.integration
@pytest.mark.slow
def test_killed_engine_process_requests_are_reissued_and_it_restarts(
    tiny_run_inputs, tmp_path, uninterrupted
):
    """Two engines in their own processes (ray_native); one is SIGKILLed mid-run: its requests go to the
    other, it is restarted with the current weights, and the trained prompts are the uninterrupted run's."""
    c = Controller(_cfg(tiny_run_inputs, tmp_path / "eng", "--rollout-engines", "2"), tiny_run_inputs)
    kill = _kill_after(c, tmp_path / "eng" / "metrics.jsonl", 1, "engine")
    result = c.run()
    assert "pid" in kill, "no engine was killed (the run ended first)"
    events = [e for e in result.audit["health"] if e["role"].startswith("engine")]
    assert [(e["role"], e["action"]) for e in events] == [(f"engine {kill['engine']}", "restart")], events
    assert events[0]["recovery_s"] is not None, "the engine's restart did not finish before the run"
    assert not [e for e in result.audit["health"] if not e["role"].startswith("engine")]
    engines = {e["id"]: e for e in result.audit["engines"]}
    dead = engines[kill["engine"]]
    new = engines[dead["replaced_by"]]  # a new process, holding the final weights
    assert dead["state"] == "removed" and new["state"] == "active" and new["weight_version"] == STEPS
    assert _trained_prompts(result) == _trained_prompts(uninterrupted)
    assert len(result.audit["trained_ids"]) == len(set(result.audit["trained_ids"])) == STEPS * 8
