"""`relax --version` (every relax package's version and the libraries a bug report needs) and `relax summary
RUN_DIR` (a run's outcome in a few lines, from its summary.json; from metrics.jsonl and status.json while
it runs or after it was killed)."""

from __future__ import annotations

import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

PACKAGES = (
    "relax-app",
    "relax-core",
    "relax-bus",
    "relax-rollout",
    "relax-train",
    "relax-rewards",
    "relax-multimodal",
)
"""The relax distributions, each versioned on its own."""

LIBRARIES = ("torch", "transformers", "ray", "sglang", "megatron-core")
"""What a bug report needs besides: the versions relax ran on (absent ones are said to be)."""


def versions() -> dict[str, str | None]:
    """Distribution -> installed version (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in (*PACKAGES, *LIBRARIES):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def version_main(argv: list[str]) -> int:
    v = versions()
    print(f"relax {v['relax-app'] or 'not installed'}")
    for name in (*PACKAGES[1:], *LIBRARIES):
        print(f"  {name:<17}{v[name] or '-'}")
    print(f"  {'python':<17}{platform.python_version()} ({sys.executable})")
    return 0


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # (a line torn by a kill)
    return rows


def _fmt(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_lines(run_dir: str | Path) -> list[str]:
    """A few lines on the run in ``run_dir``; ``FileNotFoundError`` when it holds no run."""
    out = Path(run_dir)
    summary_file, metrics = out / "summary.json", out / "metrics.jsonl"
    if summary_file.is_file():
        s = json.loads(summary_file.read_text())
        planned = s.get("steps_planned")
        lines = [
            f"run {out}: {s.get('mode')}"
            + (f", max staleness {s['max_staleness']}" if s.get("mode") == "fully_async" else ""),
            f"steps {s.get('steps')}"
            + (f" of {planned}" if planned is not None else "")
            + f", {s.get('samples_trained')} samples in {_fmt(s.get('rl_wall_s'), '.0f')} s"
            f" ({_fmt(s.get('samples_per_s'), '.2f')} samples/s; {_fmt(s.get('total_wall_s'), '.0f')} s in all)",
            f"reward {_fmt(s.get('reward_first'))} -> {_fmt(s.get('reward_last'))}; held-out accuracy "
            f"{_fmt(s.get('heldout_accuracy_before'))} -> {_fmt(s.get('heldout_accuracy_after'))}",
            f"staleness max {_fmt(s.get('staleness_max'), 'g')}, samples dropped stale {s.get('bus_dropped_stale', 0)}",
        ]
        if s.get("interrupted_at"):
            lines.append(f"stopped by a signal: resume with --load {s['interrupted_at']}")
        from relax_app.report import console_lines

        try:
            lines += console_lines(s)
        except KeyError:  # a summary written by an older relax
            pass
        if (out / "curves.png").is_file():
            lines.append(f"curves: {out / 'curves.png'}")
        return lines
    rows = _rows(metrics)
    if not rows and not (out / "status.json").is_file():
        raise FileNotFoundError(
            f"{out}: no summary.json, metrics.jsonl or status.json: not a run's --output-dir"
        )
    steps = [r for r in rows if "rollout/reward_mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    state = "no summary.json yet"
    if (out / "status.json").is_file():
        from relax_app.watch import run_state
        from relax_core.live import read_status

        st = read_status(out)
        state = f"{run_state(st)} (step {st.step} of {st.num_steps}; no summary.json yet)"
    lines = [f"run {out}: {state}", f"steps logged {steps[-1]['step'] if steps else 0}"]
    if steps:
        lines.append(
            f"reward {_fmt(steps[0]['rollout/reward_mean'])} -> {_fmt(steps[-1]['rollout/reward_mean'])}"
        )
    if evals:
        lines.append(
            f"held-out accuracy {_fmt(evals[0]['eval/accuracy'])} (step {evals[0]['step']}) -> "
            f"{_fmt(evals[-1]['eval/accuracy'])} (step {evals[-1]['step']})"
        )
    return lines


def summary_main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: relax summary RUN_DIR   (a run's --output-dir)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        print("\n".join(summary_lines(argv[0])))
    except (FileNotFoundError, ValueError) as e:
        print(f"relax: {e}", file=sys.stderr)
        return 2
    return 0
