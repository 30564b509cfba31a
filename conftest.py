"""How the suite is shared between pytest-xdist's workers (``-n auto --dist loadgroup`` in pyproject.toml).

A test file is the unit of work: its module fixtures (an uninterrupted run that several tests compare
against, a served engine) are made once, on one worker. Files that drive Linux network namespaces share one
unit, ``netns``: they bring up the same namespace nodes at the same addresses, so two at once would collide.
Units run longest first (the seconds measured per file in ``tests/durations.json``, refreshed by
``tools/test_durations.py``), so the two workers end together instead of one finishing a long file alone;
a file not yet measured counts as a short one. With ``-n 0`` (one process, e.g. to debug) the order is the same and no worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parent
DURATIONS = ROOT / "tests" / "durations.json"

SERIAL_GROUPS = {
    "netns": ("tests/test_netns_runs.py", "tests/test_launchers.py"),
}
"""Files that must not run at the same time as each other, by the unit they share."""


def _unit(path: str) -> str:
    for group, files in SERIAL_GROUPS.items():
        if path in files:
            return group
    return path


def _seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except FileNotFoundError:
        return {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("dist", "no") != "loadgroup":
        return
    seconds = _seconds()
    cost: dict[str, float] = {}
    for item in items:
        path = Path(str(item.path)).resolve().relative_to(ROOT).as_posix()
        unit = _unit(path)
        item.add_marker(pytest.mark.xdist_group(unit))
        cost[unit] = cost.get(unit, 0.0) + seconds.get(path, 0.0)
    # longest first; a stable sort keeps the collection order within a unit and among equals
    order = {unit: i for i, unit in enumerate(sorted(cost, key=lambda u: -cost[u]))}
    items.sort(key=lambda item: order[item.get_closest_marker("xdist_group").args[0]])
