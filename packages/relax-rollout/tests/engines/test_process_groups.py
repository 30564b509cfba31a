"""Engine processes as process groups: the engine's token never reaches their logs (SGLang logs its
``server_args``, its ``--api-key`` among them, in plain text), and a stopped group leaves no process."""

import os
import signal
import sys
import time

from relax_rollout.engines.process_groups import group_alive, group_members, spawn, stop_processes


def test_an_engines_token_is_written_as_stars_in_its_log(tmp_path):
    log = tmp_path / "engine0.log"
    said = "print(\"server_args=ServerArgs(api_key='s3cret-tok', port=1)\"); print('serving s3cret-tok')"
    proc = spawn([sys.executable, "-c", said], {}, log, "=== header\n", secret="s3cret-tok")
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10  # (the copying thread ends at the pipe's end)
    while "serving" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = log.read_text()
    assert "s3cret-tok" not in text
    assert text.splitlines() == ["=== header", "server_args=ServerArgs(api_key='***', port=1)", "serving ***"]


def test_a_killed_engines_orphans_are_reaped_when_its_group_is_stopped(tmp_path):
    """An engine whose leader dies before its children (SGLang's scheduler and detokenizer): the orphans
    are adopted by the process that started it and reaped when its group is stopped, so nothing of the
    group is left (they went to PID 1 before, which does not reap in a container without an init)."""
    forks = (
        "import subprocess, time; subprocess.Popen(['sleep', '60']); print('up', flush=True); time.sleep(60)"
    )
    proc = spawn([sys.executable, "-c", forks], {}, tmp_path / "e.log", "")
    deadline = time.monotonic() + 30
    while "up" not in (tmp_path / "e.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the leader dies, its child lives on: an orphan
    proc.wait(timeout=30)
    (orphan,) = [m for m in group_members([proc.pid])[proc.pid] if m.pid != proc.pid]
    assert orphan.ppid == os.getpid()  # adopted here, not by PID 1
    stop_processes([proc], grace_s=1.0)
    assert not group_alive(proc.pid)
