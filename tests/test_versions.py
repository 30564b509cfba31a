"""Each package's ``__version__`` is the version its wheel is built with (pyproject), so a user who
reports ``relax_bus.__version__`` reports what they installed."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "dist", ["relax-bus", "relax-core", "relax-rollout", "relax-train", "relax-multimodal", "relax-rewards"]
)
def test_version_attribute_matches_pyproject(dist):
    meta = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
    module = importlib.import_module(dist.replace("-", "_"))
    assert module.__version__ == meta["project"]["version"]
