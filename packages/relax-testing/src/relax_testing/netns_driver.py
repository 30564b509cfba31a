"""A run's driver on a namespace node (#40): ``python -m relax_testing.netns_driver RESULT.json FLAGS...``
runs ``relax train FLAGS...`` (the same config and Controller) and writes what a test checks to RESULT.json:
the history, the eval curve, the trained prompts and ids, the health events and where each role ran.

Why a module and not ``relax train``: the test started in the root namespace reads the run's audit (which
prompts were trained, on which node each role was), which the command line does not print. :func:`drive`
starts it inside the head's namespace (``--ray-address`` the head's) while a fault runs in a thread of the
caller; :func:`after_step` is how a fault waits for its moment, :func:`stop` how a scenario ends a run that
would outlast it (after its current step, with a checkpoint, as SIGTERM would; a file the driver watches,
since the handler ``ray.init`` leaves behind exits on SIGTERM). Shared by ``tests/test_netns_runs.py`` and
``benchmarks/recovery_nodes.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def drive(
    cluster: Any,
    out: Path,
    flags: list[str],
    during: Callable[[Path], None] | None = None,
    timeout_s: float = 600.0,
) -> dict:
    """Run ``relax train FLAGS`` (``--output-dir out`` among them) with its driver on ``cluster``'s head,
    ``during(out)`` meanwhile in a thread of this process (a fault); the driver's record. Its output goes
    to ``<out>.log``; a failed run raises with the log's tail."""
    record, log_path = out / "record.json", out.parent / f"{out.name}.log"
    argv = [sys.executable, "-m", "relax_testing.netns_driver", str(record), *flags]
    argv += ["--ray-address", cluster.address]
    worker = threading.Thread(target=during, args=(out,), daemon=True) if during else None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cluster.head.exec_argv(argv), env=cluster.env(), stdout=log, stderr=log)
        if worker:
            worker.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
    if worker:
        worker.join(timeout=120)
    if rc != 0:
        raise RuntimeError(f"the run's driver exited {rc}:\n{log_path.read_text()[-4000:]}")
    return json.loads(record.read_text())


def last_step(out: Path) -> int:
    """The last training step the run in ``out`` logged (its metrics.jsonl); 0 before the first."""
    log = out / "metrics.jsonl"
    records = log.read_text().splitlines() if log.is_file() else []
    return max((json.loads(x).get("step", 0) for x in records if '"train/loss"' in x), default=0)


def after_step(out: Path, step: int, timeout_s: float = 300.0) -> float:
    """Wait until the run in ``out`` logged training step ``step`` (its metrics.jsonl; ``0``: its first
    record, the evaluation before training); the time then."""
    deadline = time.monotonic() + timeout_s
    log = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if (step == 0 and log.is_file() and log.stat().st_size) or (step > 0 and last_step(out) >= step):
            return time.time()
        time.sleep(0.2)
    raise TimeoutError(f"the run in {out} did not reach step {step} in {timeout_s:.0f} s")


def stop(out: Path) -> None:
    """Ask the run in ``out`` to stop after its current step, with a checkpoint."""
    (out / STOP).touch()


STOP = "stop"
"""The file in the run's output directory that :func:`main` watches for (:func:`stop`)."""


def _watch_stop(controller: Any, path: Path, done: threading.Event) -> None:
    while not done.wait(0.2):
        if path.exists():
            controller.request_stop()
            return


def main(argv: list[str]) -> int:
    from relax_app.cli_config import build_config
    from relax_core.controller import Controller, RunInputs

    out, flags = argv[0], argv[1:]
    cfg = build_config(None, flags)
    model, prompts = cfg.model.hf_checkpoint, cfg.data.prompt_data
    assert model is not None and prompts is not None, "the driver runs on a model and prompts of its flags"
    inputs = RunInputs(model, prompts, cfg.data.eval_data)
    controller, done = Controller(cfg, inputs), threading.Event()
    stop_file = Path(cfg.run.output_dir) / STOP
    threading.Thread(target=_watch_stop, args=(controller, stop_file, done), daemon=True).start()
    try:
        result = controller.run()
    finally:
        done.set()
    keep = ("trained_prompts", "trained_ids", "health", "placement", "engines")
    record = {
        "history": result.history,
        "eval_curve": result.eval_curve,
        "wall_s": result.wall_s,
        "audit": {k: result.audit.get(k) for k in keep},
    }
    with open(out, "w") as f:
        json.dump(record, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
