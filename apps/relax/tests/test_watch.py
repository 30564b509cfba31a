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
