"""The real SGLang server on a CPU: where its environment is, and the flags that make it run there.

Why: our ``sglang`` engine, its weight updates and the engine pool must be tested against SGLang itself,
not only against our engine server speaking SGLang's API as we read it (that circle hid a refused weight
update and a rendezvous that never met). SGLang 0.5.23 runs on a CPU without AMX with its torch-native
attention, norms and rotary, so the real-SGLang test tier (``pytest -m real_sglang``) and
``benchmarks/sglang_weight_update.py`` launch it here. Its CUDA-only dependencies do not install on such a
machine, so it lives in a venv of its own, built by ``tools/sglang-cpu/setup.sh`` from the versions
``uv.lock`` pins (with an import shim for ``sgl_kernel`` that says what it is).

What does not run on a CPU, and waits for a GPU: NCCL, CUDA IPC (``/update_weights_from_tensor``), memory
release (``/release_memory_occupation`` calls a CUDA synchronise and ends a CPU server), CUDA graphs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PYTHON_VAR = "RELAX_SGLANG_PYTHON"
"""Environment variable: the Python of a venv with SGLang (default: ``.venv-sglang`` at the repo root)."""
SETUP = "bash tools/sglang-cpu/setup.sh"
ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
"""What SGLang reads to pick its CPU platform."""
SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    "skip_server_warmup": True,  # its warm-up request takes minutes on a CPU
    "max_total_tokens": 4096,  # the KV cache: SGLang sizes it from host memory otherwise (GBs)
}
"""Launch flags for a CPU (``sglang_server_args``)."""


def python() -> str | None:
    """The Python with SGLang: ``$RELAX_SGLANG_PYTHON``, else the repo's ``.venv-sglang``; None if neither
    exists."""
    given = os.environ.get(PYTHON_VAR)
    if given:
        return given if Path(given).exists() else None
    for parent in Path(__file__).resolve().parents:
        candidate = parent / ".venv-sglang" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
        if (parent / "uv.lock").exists():  # the workspace root: no further up
            break
    return None


def engine_kwargs(python_path: str) -> dict[str, Any]:
    """:class:`~relax_rollout.engines.sglang.SGLangEngine` arguments that run real SGLang on this CPU."""
    return {
        "python": python_path,
        "env": dict(ENV),
        "dtype": "float32",
        "mem_fraction_static": 0.3,
        "server_args": dict(SERVER_ARGS),
        "gpu_ids": ["0"] * 8,  # engines get a CUDA_VISIBLE_DEVICES each; nothing reads it on a CPU
        "startup_timeout_s": 300.0,
    }


def require_python() -> str:
    """For tests: :func:`python`, else skip the test — or fail it when ``RELAX_REQUIRE_REAL_SGLANG=1`` (CI
    sets it, so a missing set-up never passes as a skip)."""
    import pytest

    found = python()
    if found is None:
        why = f"no SGLang venv: run `{SETUP}` (or set {PYTHON_VAR} to a Python with SGLang)"
        if os.environ.get("RELAX_REQUIRE_REAL_SGLANG") == "1":
            pytest.fail(why + "; RELAX_REQUIRE_REAL_SGLANG=1 forbids skipping the real-SGLang tier")
        pytest.skip(why)
    return found
