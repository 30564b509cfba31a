"""`relax status` / `relax watch` read a run's status.json: what they show, and what they say of a run whose
process is gone or a directory that holds no run."""

from __future__ import annotations

import subprocess
import sys

from relax_app.watch import render, status_main, watch_main
from relax_core.live import RoleStatus, RunStatus, status_path, write_json_atomically


def _write(run_dir, **fields) -> RunStatus:
    s = RunStatus(mode="fully_async", max_staleness=1, output_dir=str(run_dir), num_steps=10, **fields)
    run_dir.mkdir(exist_ok=True)
    write_json_atomically(status_path(run_dir), s.model_dump_json())
    return s


def test_status_of_a_running_run_shows_roles_versions_and_rates(tmp_path, capsys):
    roles = {
        "rollout": RoleStatus(state="running", version=4, pid=11, idle_s=0.2),
        "reference": RoleStatus(state="restarting", restarts=1),
    }
    _write(tmp_path, state="running", step=4, samples_per_s=12.5, reward_mean=0.625, roles=roles)
    assert status_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "state running  step 4/10" in out and "samples/s 12.50" in out and "reward 0.625" in out
    assert "rollout     running               v4      0.2         0  11" in out
    assert "reference   restarting             -        -         1  -" in out


def test_a_run_whose_process_is_gone_is_said_to_be_and_watch_stops(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s = _write(tmp_path, state="running", step=3, pid=dead.pid)
    assert f"state running? (its process {dead.pid} is gone" in render(s)
    assert watch_main([str(tmp_path), "--interval", "0.01"]) == 0  # returns instead of waiting for ever
    assert "is gone" in capsys.readouterr().out


def test_watch_ends_with_the_run_and_status_refuses_a_directory_without_one(tmp_path, capsys):
    _write(tmp_path, state="failed", step=3, message="RunFailed: role 'rollout' failed")
    assert watch_main([str(tmp_path), "--interval", "0.01"]) == 1
    assert "RunFailed: role 'rollout' failed" in capsys.readouterr().out
    assert status_main([str(tmp_path / "nothing")]) == 2
    assert "status.json: no status file" in capsys.readouterr().err


def test_a_damaged_status_file_is_said_to_be_and_watch_stops(tmp_path, capsys, monkeypatch):
    """Before (#49): `relax watch` on a damaged status.json waited for ever (and `relax status` printed
    pydantic's many lines)."""
    import relax_app.watch as watch

    tmp_path.joinpath("status.json").write_text('{"state": "running", "step": ')
    monkeypatch.setattr(watch, "DAMAGED_FOR_S", 0.05, raising=False)
    assert watch_main([str(tmp_path), "--interval", "0.01", "--timeout", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"relax: {tmp_path / 'status.json'}: damaged or of another relax version (")
    assert "\n" not in err and f"relax summary {tmp_path}" in err
    assert status_main([str(tmp_path)]) == 2
    assert "\n" not in capsys.readouterr().err.strip()


def test_a_finished_run_s_clock_stops_and_a_waiting_sample_past_the_bound_is_said_to_be_dropped(tmp_path):
    """A finished run's "up" went on counting, and "staleness 2" beside "max staleness 1" read as a broken
    bound (it is a waiting sample's, which the bus drops rather than train)."""
    from relax_core.live import BusStatus

    bus = BusStatus(depth=4, oldest_version=3, staleness=2)
    done = _write(tmp_path, state="done", step=10, started_at=1000.0, updated_at=1100.0, bus=bus)
    text = render(done, now=5000.0)
    assert "ran 100s, ended 3900s ago" in text and "up " not in text
    assert "oldest waiting v3 (2 behind the trainer; past --max-staleness 1: dropped, not trained)" in text
    running = _write(tmp_path, state="running", step=5, started_at=1000.0, updated_at=1100.0, bus=bus)
    assert "up 101s  updated 1.0s ago" in render(running, now=1101.0)
    ok = BusStatus(depth=4, oldest_version=4, staleness=1)
    assert "oldest waiting v4 (1 behind the trainer)  dropped" in render(
        running.model_copy(update={"bus": ok})
    )


def test_the_last_weight_sync_shows_its_bytes_on_the_wire_its_time_and_the_engines_pause(tmp_path):
    """#53: the trainer's ``perf/weight_*`` of its last step (metrics.jsonl) reach status.json and the view:
    with delta sync the bytes sent beside the version's, the broadcast's seconds, the longest engine pause."""
    import json
    from types import SimpleNamespace

    from relax_core.live import LiveStatus, read_status

    run = SimpleNamespace(output_dir=str(tmp_path), mode="fully_async", max_staleness=1, trace=False)
    live = LiveStatus(SimpleNamespace(run=run, train=SimpleNamespace(num_rollout=4)))
    rows = [
        {"step": 1, "rollout/reward_mean": 0.1, "perf/weight_sync_bytes": 3.28e6, "perf/weight_sync_s": 0.2},
        {
            "step": 2,
            "rollout/reward_mean": 0.2,
            "perf/weight_sync_bytes": 3.28e6,
            "perf/weight_sync_s": 0.001,
            "perf/weight_sync_sent_bytes": 1.2e5,
            "perf/weight_sync_broadcast_s": 0.05,
            "perf/weight_pause_s": 0.004,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    live.update(force=True)
    sync = read_status(tmp_path).weight_sync
    assert sync is not None and (sync.step, sync.sent_bytes, sync.seconds, sync.pause_s) == (
        2,
        1.2e5,
        0.05,
        0.004,
    )
    assert "weight sync v2: 0.120 MB of 3.28 MB (3.7%) in 0.050s, engine pause 0.004s" in render(
        read_status(tmp_path)
    )
