"""`relax plan` against published speed-ups (#57): each shipped example plan (a publication's setup, with its
unpublished parts derived or assumed and said so in the file) simulated in its mode and in colocate on the same
devices, the predicted speed-up beside the published one; then, where a publication gives its step's phases
(veRL), the phases side by side and what its own table says about the work each run did; then how each
prediction moves with the lengths the publications leave out (a sensitivity, not a fit).

    uv run python benchmarks/plan_published.py      # ~4 min; writes benchmarks/results/plan_published.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from relax_app.plan.config import PlanConfig, load_plan
from relax_app.plan.report import colocate_of, compare, phases, summarise
from relax_app.plan.sim import Simulation

EXAMPLES = Path(__file__).resolve().parents[1] / "apps" / "relax" / "src" / "relax_app" / "plan" / "examples"
SENSITIVITY = {"mean": (300, 500, 1000, 2000, 3000, 4000), "prompt_tokens": (300, 550, 1000, 1500)}

VERL_TABLE = {  # veRL docs/advance/fully_async.md, "Asynchronous Training on 7B Model" (H20, s a step)
    32: {"colocate": (790.10, 313.81), "async": (294.77, 269.80)},  # (step, update_actor)
    64: {"colocate": (365.28, 133.41), "async": (189.26, 156.98)},
    128: {"colocate": (356.30, 113.81), "async": (150.63, 113.16)},
}
"""GPUs in all: colocate trains on all of them, fully async on half (16:16, 32:32, 64:64)."""


def predict(plan: PlanConfig) -> dict:
    mine, anchor, speedup = compare(plan)
    return {
        "speedup": speedup,
        "step_s": mine.step_s,
        "colocate_step_s": anchor.step_s,
        "rollout_idle": mine.rollout_idle,
        "train_idle": mine.train_idle,
    }


def with_workload(plan: PlanConfig, **changes: float) -> PlanConfig:
    w = plan.workload
    response = w.response.model_copy(update={k: v for k, v in changes.items() if k == "mean"})
    rest = {k: v for k, v in changes.items() if k != "mean"}
    return plan.model_copy(update={"workload": w.model_copy(update={"response": response, **rest})})


def calibrated_mean(plan: PlanConfig, colocate_step_s: float) -> float:
    """The mean response length at which the plan's colocate step takes the published colocate step's time
    (bisection; the colocate step grows with the mean): the one unpublished quantity of the workload, set by
    the baseline, so that the fully-async step is what is predicted."""
    lo, hi = 200.0, float(plan.workload.response.max) / 2
    for _ in range(9):
        mid = (lo + hi) / 2
        step = summarise(Simulation(colocate_of(with_workload(plan, mean=mid))).run()).step_s
        lo, hi = (mid, hi) if step < colocate_step_s else (lo, mid)
    return (lo + hi) / 2


def phase_table(plan: PlanConfig) -> dict:
    """Predicted seconds a step per phase, both modes, beside the publication's."""
    out = {}
    for mode, p in (("colocate", colocate_of(plan)), ("async", plan)):
        out[mode] = {k: round(v, 1) for k, v in phases(Simulation(p).run()).items()}
    return out


def verl_work() -> list[dict]:
    """veRL's own table: the GPU-seconds its trainer spent on a step's update, colocate (all GPUs) against
    fully async (half of them), at each scale; and the speed-up the same update work would allow at best —
    the async trainer, on half the devices at the colocate trainer's per-device rate, needs twice the colocate
    update's time a step."""
    rows = []
    for gpus, t in VERL_TABLE.items():
        (c_step, c_upd), (a_step, a_upd) = t["colocate"], t["async"]
        rows.append(
            {
                "gpus": gpus,
                "update_gpu_s_colocate": c_upd * gpus,
                "update_gpu_s_async": a_upd * gpus / 2,
                "ratio": c_upd * gpus / (a_upd * gpus / 2),
                "published_speedup": c_step / a_step,
                "same_work_bound": c_step / (2 * c_upd),
            }
        )
    return rows


def main() -> None:
    out: dict = {"rows": [], "phases": {}, "verl_work": verl_work(), "sensitivity": []}
    plans = [p for p in map(load_plan, sorted(EXAMPLES.glob("*.yaml"))) if p.published]
    print("| setup | predicted | published | error | step s (async / colocate) | idle rollout / train |")
    print("| --- | --- | --- | --- | --- | --- |")
    for plan in plans:
        t = time.perf_counter()
        p = predict(plan)
        pub = float(plan.published["speedup"])
        out["rows"].append({"plan": plan.name, **p, "published": pub, "seconds": time.perf_counter() - t})
        print(
            f"| {plan.name} | {p['speedup']:.2f}x | {pub:.2f}x | {p['speedup'] / pub - 1:+.0%} | "
            f"{p['step_s']:.1f} / {p['colocate_step_s']:.1f} | {p['rollout_idle']:.0%} / {p['train_idle']:.0%} |",
            flush=True,
        )
    for plan in plans:
        published_steps = plan.published.get("step_s", {})
        if "colocate" not in published_steps:
            continue
        mean = calibrated_mean(plan, float(published_steps["colocate"]))
        table = phase_table(with_workload(plan, mean=mean))
        out["phases"][plan.name] = {"calibrated_mean": mean, "predicted": table, **plan.published}
        print(f"\n{plan.name}: the mean length whose colocate step is the published one: {mean:.0f} tokens")
        print(f"  predicted phases (s a step): {table}")
        print(f"  published phases: {plan.published.get('phases')}")
    print("\nveRL's table: update_actor GPU-seconds a step, colocate vs fully async (half the GPUs)")
    for r in out["verl_work"]:
        print(
            f"  {r['gpus']} GPUs: {r['update_gpu_s_colocate']:.0f} vs {r['update_gpu_s_async']:.0f} "
            f"({r['ratio']:.2f}x less in async); published {r['published_speedup']:.2f}x, "
            f"same work at best {r['same_work_bound']:.2f}x"
        )
    print("\nsensitivity to what the publications leave out (the plan otherwise as shipped):")
    for plan in plans:
        for field, values in SENSITIVITY.items():
            for v in values:
                if field == "mean" and v >= plan.workload.response.max:
                    continue
                p = predict(with_workload(plan, **{field: v}))
                out["sensitivity"].append({"plan": plan.name, field: v, **p})
                print(f"  {plan.name} {field} {v}: {p['speedup']:.2f}x", flush=True)
    target = Path(__file__).parent / "results" / "plan_published.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
