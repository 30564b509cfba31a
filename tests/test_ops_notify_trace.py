"""Operations on real runs: Apprise notifications, the Chrome-trace timeline, TensorBoard metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import Controller, RunInputs
from relax_testing import dead_json_url, json_webhook

pytest.importorskip("apprise")

STEPS = 3


@pytest.fixture
def hook():
    with json_webhook() as (url, received):
        yield url + "/hook", received


_dead_url = dead_json_url


def _config(inputs, out: Path, *flags):
    # two optimizer steps per batch: ActorFwd runs (its phases are checked)
    argv = run_flags(
        inputs, out, *flags, num_rollout=STEPS, eval_interval=2, kl_coef=0.01, global_batch_size=8
    )
    return build_config(None, argv)


def _spans(result) -> tuple[dict[int, str], list[dict]]:
    """(role of each pid, complete events) of the run's trace.json, checked against the format."""
    assert result.trace_path == str(Path(result.trace_path))
    trace = json.loads(Path(result.trace_path).read_text())
    events = trace["traceEvents"]
    roles = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    x = [e for e in events if e["ph"] == "X"]
    for e in x:
        assert e["pid"] in roles and isinstance(e["tid"], int)
        assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["name"], str) and isinstance(e["args"], dict)
    for a in x:  # events on one row never cross (the viewers need this)
        for b in x:
            if a is not b and (a["pid"], a["tid"]) == (b["pid"], b["tid"]):
                assert a["ts"] + a["dur"] <= b["ts"] or b["ts"] + b["dur"] <= a["ts"]
    return roles, x


def _phases(roles, x) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in x:
        out.setdefault(roles[e["pid"]], set()).add(e["name"])
    return out


def _check_tensorboard(out: Path, history: list[dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert files, "no TensorBoard event file"
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    trained = [h for h in history if "train/loss" in h]
    assert len(trained) == STEPS
    for tag in ("train/loss", "train/grad_norm", "rollout/reward_mean", "perf/train_s", "eval/accuracy"):
        assert tag in tags, tag
    for tag in ("train/loss", "rollout/reward_mean"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [h["step"] for h in trained] == list(range(1, STEPS + 1))
        for e, h in zip(events, trained):
            assert e.value == pytest.approx(h[tag], rel=1e-5, abs=1e-6)
    evals = [h for h in history if "eval/accuracy" in h]
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [h["step"] for h in evals]


@pytest.mark.integration
def test_colocate_notifies_traces_and_logs(tiny_run_inputs, tmp_path, hook):
    url, calls = hook
    out = tmp_path / "colo"
    cfg = _config(tiny_run_inputs, out, "--colocate", "--notify-urls", json.dumps([url, _dead_url()]))
    result = Controller(cfg, tiny_run_inputs).run()  # the dead URL does not break the run
    received = [body for _, body in calls]
    assert [r["title"] for r in received] == ["Relax run colo started", "Relax run colo finished"]
    start, finish = received
    assert "mode: colocate" in start["message"] and f"steps: {STEPS}" in start["message"]
    body = finish["message"].splitlines()
    assert f"steps: {STEPS}" in body and f"samples: {result.samples}" in body
    rewards = [h["rollout/reward_mean"] for h in result.history if "rollout/reward_mean" in h]
    assert f"final_reward: {round(rewards[-1], 4)}" in body
    assert f"final_eval_accuracy: {round(result.eval_curve[-1][1], 4)}" in body
    assert f"trace: {out / 'trace.json'}" in body

    roles, x = _spans(result)
    phases = _phases(roles, x)
    assert set(phases) == {"rollout", "actor_fwd", "reference", "advantages", "actor"}
    assert phases["rollout"] == {"generate", "reward"}
    assert phases["actor_fwd"] == phases["reference"] == {"forward"}
    assert {"train", "weight_sync", "eval", "wait_for_data"} <= phases["actor"]
    trains = sorted((e for e in x if e["name"] == "train"), key=lambda e: e["ts"])
    assert [e["args"]["step"] for e in trains] == list(range(STEPS))
    gens = sorted((e for e in x if e["name"] == "generate"), key=lambda e: e["ts"])
    # colocate takes turns: generation of step k+1 starts after training step k ends
    for k in range(STEPS - 1):
        assert gens[k + 1]["ts"] >= trains[k]["ts"] + trains[k]["dur"]
    _check_tensorboard(out, result.history)


@pytest.mark.integration
def test_a_failing_run_sends_the_failure_and_raises(tiny_run_inputs, tmp_path, hook):
    url, calls = hook
    bad = RunInputs(str(tmp_path / "no-such-model"), tiny_run_inputs.prompt_path)
    cfg = _config(bad, tmp_path / "bad", "--colocate", "--notify-urls", url)
    with pytest.raises(Exception) as e:
        Controller(cfg, bad).run()
    received = [body for _, body in calls]
    assert [r["title"] for r in received] == ["Relax run bad started", "Relax run bad failed"]
    assert received[1]["message"].startswith(f"{type(e.value).__name__}: {e.value}")
    assert not (tmp_path / "bad" / "trace.json").exists()
