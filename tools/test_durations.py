"""Seconds per test file from a pytest JUnit XML report, for how the suite is shared between workers.

    uv run pytest --junitxml=/tmp/junit.xml        # (CI: PYTEST_ADDOPTS="--junitxml=...")
    uv run python tools/test_durations.py /tmp/junit.xml [--write] [--top 25]

Prints the heaviest files and tests; ``--write`` stores the seconds per file in tests/durations.json, which
the root conftest.py reads to start the longest files first (so both workers end together).
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def per_test(report: str) -> list[tuple[float, str, str]]:
    """(seconds, file, test) for every test case: setup, call and teardown together."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        out.append((float(case.get("time", 0.0)), path, case.get("name", "")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--write", action="store_true", help="store the seconds per file in tests/durations.json")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    tests = per_test(args.report)
    files: collections.Counter[str] = collections.Counter()
    for seconds, path, _ in tests:
        files[path] += seconds
    print(f"{sum(files.values()):.0f} s in {len(tests)} tests, {len(files)} files")
    for path, seconds in files.most_common(args.top):
        print(f"{seconds:8.1f}  {path}")
    for seconds, path, name in sorted(tests, reverse=True)[: args.top]:
        print(f"{seconds:8.1f}  {path}::{name}")
    if args.write:
        DURATIONS.write_text(json.dumps({p: round(s, 1) for p, s in sorted(files.items())}, indent=0) + "\n")
        print(f"wrote {DURATIONS}")


if __name__ == "__main__":
    main()
