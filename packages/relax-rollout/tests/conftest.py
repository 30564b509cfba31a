"""Shared fixtures: a tiny Qwen3 policy and a character-level tokenizer saved as an HF checkpoint."""

import pytest

from relax_core.testing import build_tiny_checkpoint, single_thread_torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    import torch

    torch.set_num_threads(1)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    """A TorchEngine on the tiny checkpoint, in this process: what a served engine must answer like."""
    from relax_rollout.engines.torch_engine import TorchEngine

    return TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0)  # 1: <|im_end|>


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The Python of the real-SGLang venv (skips, or fails under RELAX_REQUIRE_REAL_SGLANG=1, without it)."""
    from relax_rollout.engines.sglang_cpu import require_python

    return require_python()


@pytest.fixture(autouse=True)
def _single_thread_torch():
    single_thread_torch()


def http(url: str, path: str, body=None, token: str | None = None, timeout: float = 60.0):
    """(status, parsed JSON or None) — HTTP errors are returned, not raised."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, headers=headers, method="GET" if body is None else "POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, code = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, code = e.read(), e.code
    return code, (json.loads(raw) if raw else None)


def start_server(model_dir: str, *extra: str):
    """Start ``python -m relax_rollout.server`` on a free port; returns (process, base URL) once healthy."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relax_rollout.server",
            "--model",
            model_dir,
            "--port",
            "0",
            "--torch-threads",
            "1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    url = None
    while url is None:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"engine server exited with {proc.returncode}")
        if "listening on" in line:
            url = line.strip().rsplit(" ", 1)[-1]
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("engine server did not start")
    while http(url, "/health")[0] != 200:
        time.sleep(0.05)
    return proc, url


@pytest.fixture(scope="session")
def engine_server(tiny_model_dir):
    """One served TorchEngine shared by the server and external-engine tests (they restore its weights)."""
    proc, url = start_server(tiny_model_dir)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def call():
    """The ``http`` helper as a fixture (test modules cannot import conftest)."""
    return http


@pytest.fixture(scope="session")
def launch():
    """``start_server`` as a fixture."""
    return start_server
