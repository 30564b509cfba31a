"""A tiny Qwen3 (built from config, its tokenizer trained here on the cookbook's arithmetic format) and our
Tinker server on 127.0.0.1, in this process; the clients are the real ``tinker`` SDK's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
sys.path.insert(0, str(Path(__file__).parent))
from tinker_tasks import Server  # noqa: E402

from relax_testing.tinker_task import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tinker") / "model"))


@pytest.fixture(autouse=True, scope="session")
def tinker_env():
    """The SDK wants a key starting ``tml-`` (our server on loopback takes any); no telemetry."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_API_KEY", "tml-relax-tests")
    mp.setenv("TINKER_TELEMETRY", "0")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = Server(tiny_model, tmp_path_factory.mktemp("ckpt"))
    yield s
    s.close()
