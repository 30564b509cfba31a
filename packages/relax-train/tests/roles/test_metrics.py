"""ActorWorker's metrics go through relax_core.metrics.MetricsService: with the default config, the same
metrics.jsonl and TensorBoard scalars as before; a failing exporter never breaks the trainer's log()."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_train.roles.actor import ActorWorker  # noqa: E402


class Broken:
    def log(self, metrics, step):
        raise RuntimeError("exporter down")

    def close(self):
        pass


def test_actor_worker_logs_through_the_metrics_service(tiny_model_dir, tmp_path, caplog):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    cfg = RelaxConfig.model_validate({"run": {"output_dir": str(out), "trace": False}})
    worker = ActorWorker(cfg, bus=None, model_path=tiny_model_dir)
    assert worker.metrics.names == ["jsonl", "tensorboard"]  # the default config
    worker.metrics.sinks["broken"] = Broken()
    rows = [
        {"step": 0, "eval/accuracy": 0.25, "time": 1.0},
        {"step": 1, "train/loss": 0.75, "rollout/reward_mean": 0.5, "time": 2.0},
    ]
    for row in rows:
        worker.log(row)
    assert worker.metrics.names == ["jsonl", "tensorboard"]  # the broken one dropped, the run goes on
    worker.close()

    assert worker.record.history == rows
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == rows
    assert "metrics sink 'broken' failed" in caplog.text
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["eval/accuracy", "rollout/reward_mean", "train/loss"]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(0, 0.25)]


def test_resuming_reads_the_history_past_a_torn_last_line(tiny_model_dir, tmp_path, caplog):
    """A kill mid-write tears metrics.jsonl's last line; --load stopped at it with a JSONDecodeError."""
    out = tmp_path / "run"
    cfg = RelaxConfig.model_validate(
        {
            "run": {"output_dir": str(out), "trace": False, "tensorboard": False},
            "train": {"save": str(tmp_path / "ckpt")},
        }
    )
    worker = ActorWorker(cfg, bus=None, model_path=tiny_model_dir)
    rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 0, "train/loss": 0.5, "rollout/reward_mean": 0.5}]
    for row in rows:
        worker.log(row)
    saved = worker.save()
    worker.close()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "train/lo')  # the row being written when the process died
    again = ActorWorker(cfg, bus=None, model_path=tiny_model_dir)
    assert again.load(saved)["version"] == 0
    assert again.record.history == rows
    assert "metrics.jsonl line 3 is not JSON" in caplog.text
    again.close()


def test_rollout_metrics_of_a_multi_turn_batch():
    """Generation speed (one value per rollout step, on its samples), turns per episode and the episodes'
    end reasons; a single-turn batch has neither of the last two."""
    from relax_train.roles.metrics import rollout_metrics

    d = {
        "reward": [1.0, 0.0, 0.0, 1.0],
        "response_len": [4, 8, 8, 2],
        "finish_reason": ["env_done", "max_turns", "max_turns", "token_budget"],
        "reward_failure": ["", "", "", ""],
        "group_id": ["0:0", "0:0", "1:0", "1:0"],
        "rollout_step": [0, 0, 1, 1],
        "rollout_tokens_per_s": [100.0, 100.0, 300.0, 300.0],
        "turns": [1, 3, 3, 2],
    }
    m = rollout_metrics(d)
    assert m["rollout/tokens_per_s"] == 200.0
    assert m["rollout/turns_mean"] == 2.25
    assert {k: v for k, v in m.items() if k.startswith("rollout/stop/")} == {
        "rollout/stop/env_done": 1.0,
        "rollout/stop/max_turns": 2.0,
        "rollout/stop/token_budget": 1.0,
    }
    assert m["rollout/reward_mean"] == 0.5 and m["rollout/groups"] == 2.0
    single = {k: v for k, v in d.items() if k != "turns"} | {"finish_reason": ["stop"] * 4}
    assert not any(k.startswith(("rollout/stop/", "rollout/turns")) for k in rollout_metrics(single))


def test_agent_metrics_give_turn_latency_percentiles_and_the_tool_call_error_rate():
    """#55: per-turn latency over every turn of the batch, and failed tool calls over all tool calls."""
    import numpy as np

    from relax_train.roles.metrics import rollout_metrics

    d = {
        "reward": [1.0, 0.0],
        "response_len": [4, 8],
        "finish_reason": ["env_done", "max_turns"],
        "reward_failure": ["", ""],
        "group_id": ["0:0", "0:0"],
        "rollout_step": [0, 0],
        "turns": [1, 3],
        "turn_s": [np.array([0.1], np.float32), np.array([0.2, 0.3, 0.4], np.float32)],
        "tool_call_count": [0, 4],
        "tool_call_errors": [0, 1],
    }
    m = rollout_metrics(d)
    turns = [0.1, 0.2, 0.3, 0.4]
    for q in (50, 90, 95, 99):
        assert m[f"rollout/turn_s_p{q}"] == pytest.approx(float(np.percentile(turns, q)))
    assert m["rollout/tool_call_error_rate"] == 0.25 and m["rollout/tool_calls_mean"] == 2.0
    no_tools = rollout_metrics({**d, "tool_call_count": [0, 0], "tool_call_errors": [0, 0]})
    assert "rollout/tool_call_error_rate" not in no_tools  # (no calls: no rate, not 0)


def test_streaming_metrics_count_interruptions_and_the_time_from_a_groups_end_to_training():
    """From ``token_versions``: responses that went on across updates, their interruptions (version
    changes inside a response, a skipped version counting once) and the widest spread; from
    ``generated_at`` and when the trainer took each sample, the group-to-training latency. A batch
    without those fields logs none of them."""
    from relax_train.roles.metrics import step_metrics

    d = {
        "reward": [1.0, 0.0, 0.0, 1.0],
        "response_len": [3, 4, 2, 5],
        "finish_reason": ["stop"] * 4,
        "reward_failure": [""] * 4,
        "group_id": ["4:0", "4:0", "4:1", "4:1"],
        "policy_version": [3, 2, 4, 2],
        "token_versions": [[3, 3, 3], [2, 2, 3, 4], [4, 4], [2, 4, 4, 4, 4]],
        "generated_at": [100.0, 100.0, 101.5, 101.5],
    }
    timings = dict(wait_for_data_s=0.0, train_s=0.0, weight_sync_s=0.0, weight_sync_wait_s=0.0)
    m = step_metrics(d, 4, 4, taken_at=[100.5, 100.5, 103.5, 103.5], **timings)
    assert m["rollout/responses_across_updates"] == 2.0
    assert m["rollout/interruptions_mean"] == 0.75 and m["rollout/interruptions_max"] == 2.0
    assert m["rollout/token_version_spread_max"] == 2.0
    assert m["rollout/group_to_train_s_mean"] == 1.25 and m["rollout/group_to_train_s_max"] == 2.0
    plain = {k: v for k, v in d.items() if k not in ("token_versions", "generated_at")}
    m = step_metrics(plain, 4, 4, taken_at=[100.5] * 4, **timings)
    assert not any("interruptions" in k or "group_to_train" in k or "across" in k for k in m)
