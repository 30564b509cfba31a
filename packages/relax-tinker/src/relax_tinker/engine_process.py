"""A sampler's engine as a service of its own: Relax's engine server (``python -m relax_rollout.server``, the
torch engine with the adapter) in another process, each adapter snapshot pushed to it over DCS.

Why a process: the trainer's and the sampler's work are roles apart, as in a Relax run — a sampler that
crashes or is killed does not take the training clients with it (its requests fail, naming it), and its
generation does not hold the trainer's lock. Why DCS: it is how a Relax rollout engine takes weights (here
the adapter's tensors, a broadcast of a few hundred KB to MB per snapshot), the same path, over gloo on
CPU, as the trainer's in a fully-async run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

START_TIMEOUT_S = 300.0
LOAD_TIMEOUT_S = 120.0


class ProcessEngine:
    """The engine server for one adapter configuration (``lora``: peft's config dict; None: the base model):
    ``update_weights`` broadcasts the adapter and returns once the server holds that version; ``generate``
    is the server's, over HTTP."""

    def __init__(
        self, model_path: str, lora: dict[str, Any] | None, dtype: str = "float32", threads: int = 1
    ):
        from relax_core.dcs import WeightSender
        from relax_core.net import free_port
        from relax_rollout.engines.external import ExternalEngine

        argv = [sys.executable, "-m", "relax_rollout.server", "--model", model_path, "--port", "0"]
        argv += ["--dtype", dtype, "--torch-threads", str(threads)]
        if lora is not None:
            argv += ["--lora", json.dumps(lora)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = self._wait_url()
        self.engine = ExternalEngine([url])
        self.sender: Any = None
        self._loads = 0
        if lora is not None:  # (the base model's engine never takes weights)
            init = f"tcp://127.0.0.1:{free_port()}"
            self.sender = WeightSender(init, 2, timeout_s=LOAD_TIMEOUT_S)
            joined = threading.Thread(target=self.engine.connect_dcs, args=(init, 2, 1), daemon=True)
            joined.start()
            self.sender.connect()
            joined.join(timeout=LOAD_TIMEOUT_S)

    def _wait_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        lines: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.append(line)
            if "listening on" in line:
                threading.Thread(target=self._drain, daemon=True).start()
                return line.strip().rsplit(" ", 1)[-1]
            if time.monotonic() > deadline:
                break
        self.proc.kill()
        raise RuntimeError(f"the sampler's engine server did not start: {''.join(lines[-20:])}")

    def _drain(self) -> None:
        """Read the server's output (a full pipe would block it)."""
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Broadcast the adapter; return once the server serves it (or fail, naming why). ``version`` is the
        snapshot's; the broadcast numbers its loads itself (DCS versions only increase, and a session saved
        earlier may be sampled after a later one)."""
        self._loads += 1
        version = self._loads
        self.sender.broadcast(list(tensors.items()), version)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while self.engine.weight_version != version:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the sampler's engine server exited ({self.proc.returncode})")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the sampler's engine did not load adapter version {version} in {LOAD_TIMEOUT_S}s"
                )
            time.sleep(0.005)

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"the sampler's engine server exited ({self.proc.returncode}); start a new session"
            )
        return self.engine.generate(prompts, params)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.abandon()
        self.proc.kill()
        self.proc.wait(timeout=30)
