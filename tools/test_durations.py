"""Where the test suite spends its time: seconds per test file and per test, from a pytest JUnit XML report.

    uv run pytest --junitxml=/tmp/junit.xml        # (CI: PYTEST_ADDOPTS="--junitxml=...")
    uv run python tools/test_durations.py /tmp/junit.xml [--top 25]

Prints the total, the heaviest files and the heaviest tests (docs/test-durations.md keeps a measured table).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


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


if __name__ == "__main__":
    main()
