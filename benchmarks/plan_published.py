"""`relax plan` against published speed-ups (#57): each shipped example plan (a publication's setup, with its
unpublished parts assumed and said so in the file) simulated in its mode and in colocate on the same devices,
the predicted speed-up beside the published one; then, for the plans whose response lengths were not
published, how the prediction moves with the assumed mean length (a sensitivity, not a fit).

    uv run python benchmarks/plan_published.py      # ~2 min; writes benchmarks/results/plan_published.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from relax_app.plan.config import load_plan
from relax_app.plan.report import compare

EXAMPLES = Path(__file__).resolve().parents[1] / "apps" / "relax" / "src" / "relax_app" / "plan" / "examples"
SENSITIVITY = (1000, 1500, 2000, 3000, 4000)


def predict(plan) -> dict:
    mine, anchor, speedup = compare(plan)
    return {
        "speedup": speedup,
        "step_s": mine.step_s,
        "colocate_step_s": anchor.step_s,
        "rollout_idle": mine.rollout_idle,
        "train_idle": mine.train_idle,
    }


def main() -> None:
    out: dict = {"rows": [], "sensitivity": []}
    print(
        "| setup | predicted | published | error | step s (pred. async / colocate) | idle rollout / train |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for path in sorted(EXAMPLES.glob("*.yaml")):
        plan = load_plan(path)
        if not plan.published:
            continue
        t = time.perf_counter()
        p = predict(plan)
        pub = float(plan.published["speedup"])
        out["rows"].append({"plan": plan.name, **p, "published": pub, "seconds": time.perf_counter() - t})
        print(
            f"| {plan.name} | {p['speedup']:.2f}x | {pub:.2f}x | {p['speedup'] / pub - 1:+.0%} | "
            f"{p['step_s']:.1f} / {p['colocate_step_s']:.1f} | {p['rollout_idle']:.0%} / {p['train_idle']:.0%} |",
            flush=True,
        )
    print("\nsensitivity to the assumed mean response length (lognormal, sigma as in the plan):")
    for path in sorted(EXAMPLES.glob("*.yaml")):
        plan = load_plan(path)
        if not plan.published:
            continue
        for mean in SENSITIVITY:
            if mean >= plan.workload.response.max:
                continue
            w = plan.workload.model_copy(
                update={"response": plan.workload.response.model_copy(update={"mean": mean})}
            )
            p = predict(plan.model_copy(update={"workload": w}))
            out["sensitivity"].append({"plan": plan.name, "mean": mean, **p})
            print(
                f"  {plan.name} mean {mean}: {p['speedup']:.2f}x, step {p['step_s']:.1f} s vs colocate "
                f"{p['colocate_step_s']:.1f} s",
                flush=True,
            )
    target = Path(__file__).parent / "results" / "plan_published.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
