"""`relax plan CONFIG`: predict a run on a described cluster before spending it — step time, throughput,
idle devices, staleness, weight sync — by simulating the run's own scheduling code on a virtual clock
(:mod:`relax_app.plan.sim`) with cost models from first principles (:mod:`relax_app.plan.costs`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel


def config_help() -> str:
    """Every field of a plan, by section, with its docstring (what `relax plan --help` prints)."""
    from relax_app.plan.config import Cluster, Lengths, Media, PlanConfig, Workload
    from relax_app.plan.costs import DEVICES, Efficiency

    def fields(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, f in model.model_fields.items():
            default = "" if f.is_required() else f" (default {f.default!r})"
            out.append(f"  {prefix}{name}{default}: {' '.join((f.description or '').split())}")
        return out

    lines = ["A plan is a YAML file of these sections:", ""]
    lines += fields(PlanConfig, "")
    for title, model, prefix in (
        ("cluster", Cluster, "cluster."),
        ("workload", Workload, "workload."),
        ("workload.response", Lengths, "workload.response."),
        ("workload.media", Media, "workload.media."),
        ("efficiency (one set for every plan; change only with a measurement)", Efficiency, "efficiency."),
    ):
        lines += ["", f"{title}:"] + fields(model, prefix)
    lines += ["", "devices: " + "; ".join(f"{k} ({d.source})" for k, d in DEVICES.items())]
    from relax_app.plan.config import EXAMPLES

    names = ", ".join(sorted(f.stem for f in EXAMPLES.glob("*.yaml")))
    lines += ["", f"Shipped examples (give the name instead of a file): {names} ({EXAMPLES})"]
    return "\n".join(lines)


def plan_main(argv: list[str]) -> int:
    """`relax plan CONFIG [--out DIR] [--no-recommend] [--steps N]`."""
    ap = argparse.ArgumentParser(
        prog="relax plan",
        description=__doc__.splitlines()[0],
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("config", help="the plan's YAML file (sections below), or a shipped example's name")
    ap.add_argument("--out", default="runs/plan", help="where the timeline picture goes")
    ap.add_argument("--steps", type=int, default=None, help="steps to simulate (default: the plan's)")
    ap.add_argument("--no-recommend", action="store_true", help="skip the sweep of splits and staleness")
    args = ap.parse_args(argv)
    from relax_app.plan.config import load_plan

    try:
        plan = load_plan(args.config)
    except ValueError as e:
        print(f"relax plan: {e}", file=sys.stderr)
        return 2
    if args.steps:
        plan = plan.model_copy(update={"workload": plan.workload.model_copy(update={"steps": args.steps})})
    try:
        print(plan_report(plan, Path(args.out), recommend_too=not args.no_recommend))
    except (RuntimeError, ValueError) as e:
        print(f"relax plan: {args.config}: {e}", file=sys.stderr)
        return 1
    return 0


def plan_report(plan: Any, out: Path, recommend_too: bool = True) -> str:
    """The plan simulated, beside its colocate anchor; the timeline drawn; the recommendation."""
    from relax_app.plan.report import colocate_of, describe, draw_timeline, recommend, summarise
    from relax_app.plan.sim import Simulation

    t0 = time.perf_counter()
    outcome = Simulation(plan).run()
    mine = summarise(outcome)
    lines = [f"{plan.name}: {describe(plan)}", f"  predicted: {mine.line()}"]
    if plan.run.get("mode", "fully_async") != "colocate":
        anchor = summarise(Simulation(colocate_of(plan)).run())
        lines.append(f"  colocate on the same {plan.cluster.devices} devices: {anchor.line()}")
        lines.append(f"  speed-up over colocate: {mine.samples_per_s / anchor.samples_per_s:.2f}x")
    if plan.published:
        lines.append(f"  published: {plan.published.get('speedup')}x ({plan.published.get('source', '')})")
    picture = draw_timeline(outcome, out / f"{plan.name}-timeline.png")
    lines.append(f"  timeline: {picture}")
    if recommend_too:
        ranked, failed = recommend(plan)
        lines.append("  recommended (fastest first, 4 steps each):")
        for cand, s in ranked[:5]:
            c = cand.cluster
            lines.append(
                f"    rollout {c.rollout_gpus} / train {c.train_gpus}, max staleness {cand.run['max_staleness']}: "
                f"{s.samples_per_s:.1f} samples/s, step {s.step_s:.1f} s, idle rollout {s.rollout_idle:.0%} "
                f"train {s.train_idle:.0%}"
            )
        lines += [f"    could not run: {why}" for why in failed]
    lines.append(f"  ({outcome.events} events, {time.perf_counter() - t0:.1f} s to simulate)")
    return "\n".join(lines)
