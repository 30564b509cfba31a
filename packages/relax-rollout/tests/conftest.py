"""Shared fixtures: a tiny Qwen3 policy and a character-level tokenizer saved as an HF checkpoint."""

import pytest

from relax_testing import build_tiny_checkpoint, single_thread_torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    import torch

    torch.set_num_threads(1)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """The tiny checkpoint in transformers, float32, in this process: what a served model's log-probs must be
    (a module's own: the real-SGLang tests load weights into it)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


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


class _FlushRefusingSGLang:
    """A stand-in for one SGLang 0.5.23 answer that cannot be made to happen on demand (read from its
    ``scheduler_components/weight_updater.py`` and ``entrypoints/http_server.py``): a disk update that lands
    while the scheduler still holds the requests that just ended loads the weights, refuses the cache flush
    and answers HTTP 400 with the message below, its reported version staying the old one. The first
    ``refusals`` updates with ``flush_cache`` true are answered so; every update body is kept in ``bodies``.
    (Real SGLang met it in 39 of 100 updates on a loaded CPU, not reliably enough for a test.)"""

    MESSAGE = (
        "Weights were updated, but the cache was not flushed because requests are still running or "
        "queued. Retract or finish them, then call /flush_cache."
    )

    def __init__(self, refusals: int) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.refusals, self.bodies, self.version = refusals, [], "0"
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path in ("/model_info", "/get_model_info"):
                    return self._answer(200, {"weight_version": stand_in.version})
                if self.path == "/server_info":  # (launched with --disable-radix-cache, overlap on)
                    return self._answer(200, {"disable_radix_cache": True, "disable_overlap_schedule": False})
                self._answer(200, {})  # /health

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/update_weights_from_disk":
                    return self._answer(200, {})  # /pause_generation, /continue_generation
                stand_in.bodies.append(body)
                if body.get("flush_cache", True) and stand_in.refusals > 0:
                    stand_in.refusals -= 1
                    return self._answer(400, {"success": False, "message": stand_in.MESSAGE})
                stand_in.version = body["weight_version"]
                self._answer(200, {"success": True, "message": "Succeeded to update model weights."})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def flush_refusing_sglang():
    """``start(refusals) -> _FlushRefusingSGLang`` (closed after the test)."""
    started = []

    def start(refusals: int) -> _FlushRefusingSGLang:
        started.append(_FlushRefusingSGLang(refusals))
        return started[-1]

    yield start
    for s in started:
        s.close()
