"""The live status file: what the driver writes as the run goes, read back as it is being written."""

from __future__ import annotations

import json
import threading

from relax_core.config import RelaxConfig
from relax_core.live import LiveStatus, MetricsTail, read_status


def _cfg(tmp_path, **run) -> RelaxConfig:
    return RelaxConfig.model_validate(
        {
            "run": {"output_dir": str(tmp_path), "mode": "fully_async", "max_staleness": 1, **run},
            "train": {"num_rollout": 9},
        }
    )


def test_metrics_tail_reads_only_whole_new_lines_and_starts_over_on_a_new_file(tmp_path):
    log = tmp_path / "metrics.jsonl"
    tail = MetricsTail(log)
    tail.read()  # (no file yet)
    log.write_text(
        json.dumps({"step": 0, "eval/accuracy": 0.25, "time": 100.0})
        + "\n"
        + json.dumps({"step": 1, "rollout/reward_mean": 0.5, "perf/samples": 8.0, "time": 101.0})
        + '\n{"step": 2, "rollout/rew'  # being written
    )
    tail.read()
    assert tail.reward == 0.5 and tail.eval == (0, 0.25) and len(tail.steps) == 1
    with open(log, "a") as f:
        f.write('ard_mean": 0.75, "perf/samples": 8.0, "time": 103.0}\n')
    tail.read()
    assert tail.reward == 0.75 and tail.recent_rate() == 8.0 / 2.0
    log.write_text(
        json.dumps({"step": 1, "rollout/reward_mean": 0.1, "time": 200.0}) + "\n"
    )  # a global restart
    tail.read()
    assert tail.reward == 0.1 and len(tail.steps) == 1


def test_status_file_is_whole_at_every_moment_and_carries_roles_bus_and_rates(tmp_path):
    live = LiveStatus(_cfg(tmp_path), min_interval_s=0.0)
    live.update(force=True)
    assert read_status(tmp_path).state == "starting"
    stop = threading.Event()
    bad: list[str] = []

    def reader():  # the file is replaced, never rewritten in place: every read parses
        while not stop.is_set():
            try:
                read_status(tmp_path)
            except ValueError as e:
                bad.append(str(e))

    t = threading.Thread(target=reader)
    t.start()
    live.training(0)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        for k in range(200):
            f.write(
                json.dumps({"step": k + 1, "rollout/reward_mean": 0.5, "perf/samples": 4.0, "time": 1e9 + k})
                + "\n"
            )
            f.flush()
            live.role("rollout", state="running", version=k)
            live.role("actor", state="running", version=k + 1)
            live.bus(
                {
                    "live": 12,
                    "trainer_version": k + 1,
                    "oldest_policy_version": k,
                    "samples_put": 4 * k,
                    "consumers": {"actor": {"available": 3, "dropped_stale": 1}},
                }
            )
            live.update(step=k + 1)
    stop.set()
    t.join()
    assert not bad
    s = read_status(tmp_path)
    assert s.state == "running" and s.step == 200 and s.num_steps == 9 and s.mode == "fully_async"
    assert s.roles["rollout"].version == 199 and s.roles["actor"].version == 200
    assert (
        s.bus.depth == 12
        and s.bus.staleness == 1
        and s.bus.available == {"actor": 3}
        and s.bus.dropped_stale == 1
    )
    assert s.samples_trained == 800 and s.reward_mean == 0.5 and s.samples_per_s_recent == 4.0
    live.finish("stopped", "stopped by signal; resume with --load x")
    s = read_status(tmp_path)
    assert s.state == "stopped" and s.message.endswith("--load x") and s.roles["actor"].state == "done"


def test_trace_is_flushed_whole_and_a_failing_flush_keeps_the_last_one(tmp_path):
    live = LiveStatus(_cfg(tmp_path, trace=True), trace_interval_s=0.0)
    span = {
        "name": "generate",
        "role": "rollout",
        "thread": "t",
        "start_ns": 10**18,
        "dur_ns": 1000,
        "args": {},
    }
    live.flush_trace(lambda: [[span]], force=True)
    first = json.loads((tmp_path / "trace.json").read_text())
    assert [e["name"] for e in first["traceEvents"] if e["ph"] == "X"] == ["generate"]

    def broken():
        raise RuntimeError("a role is restarting")

    live.flush_trace(broken, force=True)
    assert json.loads((tmp_path / "trace.json").read_text()) == first
    assert not list(tmp_path.glob(".trace.json.writing-*"))
