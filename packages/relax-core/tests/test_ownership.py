"""The run locks of :mod:`relax_core.ownership` against processes the run forks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from relax_core.ownership import RunLocks

FORK_UNDER_LOCK = """
import os, sys, time
from relax_core.ownership import RunLocks
with RunLocks([("--output-dir", sys.argv[1])]):
    if os.fork() == 0:  # a helper that outlives the run (a reward worker, a data loader); it says it
        print(os.getpid(), flush=True)  # runs once its fork is complete
        time.sleep(600)
        os._exit(0)
    time.sleep(600)
"""


def test_a_forked_child_that_outlives_the_run_does_not_hold_its_lock(tmp_path):
    """A flock belongs to the open file, which a fork shares: before (#49), a run killed with -9 left its
    directory locked for as long as any process it had forked lived."""
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-c", FORK_UNDER_LOCK, str(out)], stdout=subprocess.PIPE, text=True
    )
    child = int(run.stdout.readline())
    try:
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        os.kill(child, 0)  # (still alive)
        with RunLocks([("--output-dir", str(out))]):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
