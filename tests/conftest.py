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


_shared_ray = {"started": False}


def _use_shared_ray(node) -> None:
    """Connect to the session's cluster (starting it) where ``node`` is marked ``shared_ray``; elsewhere
    stop it, so that no other test finds a cluster connected."""
    marker = node.get_closest_marker("shared_ray")
    ray = sys.modules.get("ray")
    if marker is not None and (not marker.args or marker.args[0]):
        import ray

        if not ray.is_initialized():
            ray.init(
                address="local",
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=False,
            )
            _shared_ray["started"] = True
    elif ray is not None and _shared_ray["started"] and ray.is_initialized():
        ray.shutdown()
        _shared_ray["started"] = False


@pytest.fixture(scope="module", autouse=True)
def _ray_of_the_module(request):
    """One local Ray cluster for the tests marked ``shared_ray``: their runs find this process connected,
    so they neither start nor stop one (``relax_core.run.start_ray``), and their roles get workers Ray has
    already started. Measured on 2 cores: a tiny fully-async run took 25 s with a cluster of its own and
    13-16 s on one kept running. A run kills its roles and bus at its end (``AsyncRun.teardown``). Module
    scope: before the module's own fixtures (an uninterrupted run), and a module not marked (its own
    clusters, Ray in network namespaces) starts with none connected."""
    _use_shared_ray(request.node)
    yield


@pytest.fixture(autouse=True)
def _ray_of_the_test(request):
    """A test marked ``shared_ray(False)`` (it checks that a run stops the cluster it started) runs with
    none connected; the next test of its module connects again. (A run's roles do not outlive it on a
    cluster it did not start: it kills them, and Ray ends an actor whose handles are all gone.)"""
    _use_shared_ray(request.node)
    yield
