"""Shared fixtures for cross-package tests: a tiny task, tokenizer and Qwen3 model built locally. The
tiny model's shape and a tiny run's flags live in ``_tiny.py`` (imported by the tests through sys.path)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _tiny import tiny_qwen3  # noqa: E402

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    """A small arithmetic task and an untrained tiny Qwen3 checkpoint (enough to exercise every path)."""
    from relax_app.demo.task import make_arithmetic_task, read_jsonl
    from relax_app.demo.tokenizer import train_tokenizer
    from relax_core.controller import RunInputs

    root = tmp_path_factory.mktemp("tiny")
    files = make_arithmetic_task(root / "task", max_operand=20, n_eval=20)
    rows = read_jsonl(files.train_path)
    tok = train_tokenizer([r["prompt"] + r["label"] for r in rows], root / "model")
    tiny_qwen3(tok, root / "model")
    return RunInputs(str(root / "model"), str(files.train_path), str(files.eval_path))


@pytest.fixture
def sigterm_self():
    """``fire()`` sends this process SIGTERM, but only while a run's own graceful-stop handler is
    installed. Any other handler would end pytest, and the CI with it (exit 143): ``ray.init`` leaves
    one behind that exits, and a test's watcher thread can outlive the run it was meant to stop."""
    from relax_core.run import StopOnSignal

    def fire() -> bool:
        handler = signal.getsignal(signal.SIGTERM)
        if isinstance(getattr(handler, "__self__", None), StopOnSignal):
            os.kill(os.getpid(), signal.SIGTERM)
            return True
        return False

    return fire
