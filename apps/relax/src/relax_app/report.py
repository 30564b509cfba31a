"""The end-of-run summary (JSON + console) and the reward / held-out accuracy plot, titled by the run."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from relax_core.config import RelaxConfig
from relax_core.controller import RunResult
from relax_core.resume import Journal


def write_report(cfg: RelaxConfig, result: RunResult, extra: dict | None = None) -> dict:
    out = Path(cfg.run.output_dir)
    curve = result.eval_curve
    rewards = [(h["step"], h["rollout/reward_mean"]) for h in result.history if "rollout/reward_mean" in h]
    summary = {
        "mode": result.mode,
        "max_staleness": result.max_staleness,
        # what was trained: the trainer's last step (a run stopped by a signal after step k says k)
        "steps": max((int(s) for s, _ in rewards), default=0),
        "steps_planned": cfg.train.num_rollout,
        "interrupted_at": result.interrupted_at,  # stopped by a signal: the checkpoint to --load; else None
        "samples_trained": result.samples,
        "rl_wall_s": round(result.rl_wall_s, 2),
        "total_wall_s": round(result.wall_s, 2),
        "samples_per_s": round(result.samples / max(result.rl_wall_s, 1e-9), 2),
        "heldout_accuracy_before": curve[0][1] if curve else None,
        "heldout_accuracy_after": curve[-1][1] if curve else None,
        "reward_first": rewards[0][1] if rewards else None,
        "reward_last": rewards[-1][1] if rewards else None,
        "staleness_max": max((h.get("train/staleness_max", 0) for h in result.history), default=0),
        "bus_dropped_stale": result.bus_stats.get("dropped_stale", 0),
        # by reason (timeout, raised:ValueError, bad_return, crashed, ...): each such sample scored the fallback
        "reward_failures": reward_failures(result.rollout_stats.get("reward", {})),
        "reward_unlabeled": result.rollout_stats.get("reward", {}).get("unlabeled", 0),
        "skipped_rows": result.rollout_stats.get("skipped_rows", 0),
        "bad_media_rows": result.rollout_stats.get("bad_media_rows", 0),
        "long_prompt_rows": result.rollout_stats.get("long_prompt_rows", 0),
        "skipped_examples": result.rollout_stats.get("skipped_examples", []),  # the first of each kind
        "journal_torn_lines": Journal.for_run(cfg).torn_lines(),  # (a kill mid-write; skipped on resume)
        "output_dir": str(out),
        **(extra or {}),
    }
    if result.trace_path:  # the share of the machine's core-seconds the roles kept busy (relax_core.trace)
        from relax_core.trace import core_busy_share

        trace = json.loads(Path(result.trace_path).read_text())
        summary["core_busy_share"] = round(
            core_busy_share(trace, cfg.run.num_cpus or os.cpu_count() or 1)["share"], 3
        )
    if any("perf/train_mfu" in h for h in result.history):  # (the trainer measured against a CPU peak)
        from relax_core.roofline import matmul_peak, run_roofline

        peak = matmul_peak(cfg.run.num_cpus or os.cpu_count() or 1)  # (the trainer's probe, cached)
        summary["roofline"] = run_roofline(result.history, result.rl_wall_s, peak)
    summary = _finite(summary)  # (strict JSON: a NaN or ±inf figure is written as null, never Infinity)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    staleness = f", max_staleness={result.max_staleness}" if result.mode == "fully_async" else ""
    title = f"{out.name} ({result.mode}{staleness}, {summary['steps']}/{cfg.train.num_rollout} steps)"
    _plot(out / "curves.png", rewards, curve, title)
    summary["plot"] = str(out / "curves.png")
    return summary


def console_lines(summary: dict) -> list[str]:
    """One line per reason something was skipped or failed in the run (nothing when all went through)."""
    lines = []
    if summary["skipped_rows"]:
        lines.append(f"{summary['skipped_rows']} dataset rows skipped (malformed; see skipped_examples)")
    if summary["bad_media_rows"]:
        lines.append(f"{summary['bad_media_rows']} rows skipped for unreadable media (see skipped_examples)")
    if summary["long_prompt_rows"]:
        lines.append(f"{summary['long_prompt_rows']} prompts skipped: longer than the model's context allows")
    for reason, n in sorted(summary["reward_failures"].items()):
        lines.append(f"{n} rewards failed ({reason}) and scored the fallback")
    if summary.get("journal_torn_lines"):
        lines.append(
            f"{summary['journal_torn_lines']} torn lines in the rollout journal skipped (a kill mid-write)"
        )
    if summary["reward_unlabeled"]:
        lines.append(f"{summary['reward_unlabeled']} samples scored without a label")
    return lines


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (nested in dicts and lists) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def reward_failures(stats: dict[str, int]) -> dict[str, int]:
    """The failure reasons of the rollout's reward scorer (``Scorer.stats()`` less its totals)."""
    return {k: v for k, v in stats.items() if k not in ("scored", "failed", "unlabeled")}


def curves_figure(rewards, curve, title: str):
    """The reward and held-out accuracy curves (a matplotlib Figure), titled ``title``, the y axis fitted
    to the figures plotted (a reward may be negative or above 1; a run's curves may span 0.40-0.45)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if rewards:
        ax.plot(*zip(*rewards), label="rollout reward (mean)", color="tab:blue")
    if curve:
        ax.plot(*zip(*curve), "o-", label="held-out greedy accuracy", color="tab:orange")
    ys = [float(y) for _, y in [*rewards, *curve] if y is not None and math.isfinite(y)]
    if ys:
        lo, hi = min(ys), max(ys)
        pad = max((hi - lo) * 0.08, 0.02 * max(abs(lo), abs(hi), 1.0))
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("RL step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if rewards or curve:
        ax.legend(loc="best")
    fig.tight_layout()
    return fig


def _plot(path: Path, rewards, curve, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = curves_figure(rewards, curve, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
