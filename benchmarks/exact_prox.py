"""The throughput cost of the exact proximal policy (issue 21): fully async with decoupled PPO at staleness 1
and 2, π_prox as ActorFwd left it (``--no-exact-proximal-policy``, the old behaviour) against the trainer
recomputing the samples ActorFwd scored with older weights (the default). The CPU demo; RL-loop time only.

    uv run python benchmarks/exact_prox.py                       # 10 steps, 3 repeats, interleaved
    uv run python benchmarks/exact_prox.py --steps 3 --repeats 1 # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from e2e_modes import MODES, run_once  # noqa: E402

from relax_app.demo.assets import prepare_demo  # noqa: E402

VARIANTS = {"actor_fwd_as_is": False, "exact": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/exact_prox.json")
    args = ap.parse_args()
    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    tmp = Path("runs/bench_exact_prox")
    results: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
        "steps": args.steps,
        "repeats": args.repeats,
        "runs": {},
    }
    for rep in range(args.repeats):  # interleaved, so drift hits every variant alike
        for mode in ("async_s1", "async_s2"):
            for name, exact in VARIANTS.items():
                t = time.perf_counter()
                extra = {"decoupled_ppo": True, "exact_proximal_policy": exact}
                r = run_once(assets, mode, "demo", args.steps, tmp, extra=extra)
                results["runs"].setdefault(f"{mode}/{name}", []).append(r)
                print(
                    f"{mode} {name:16s} rep {rep}: {r['rl_wall_s']:.1f} s RL, {r['samples_per_s']:.1f} samples/s "
                    f"(incl. setup {time.perf_counter() - t:.1f} s)",
                    flush=True,
                )
    print("\n| staleness | π_prox | RL wall s (median) | spread (min–max) | samples/s (median) | vs as-is |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in ("async_s1", "async_s2"):
        base = statistics.median(r["rl_wall_s"] for r in results["runs"][f"{mode}/actor_fwd_as_is"])
        for name in VARIANTS:
            walls = [r["rl_wall_s"] for r in results["runs"][f"{mode}/{name}"]]
            sps = statistics.median(r["samples_per_s"] for r in results["runs"][f"{mode}/{name}"])
            med = statistics.median(walls)
            print(
                f"| {MODES[mode]['max_staleness']} | {name} | {med:.1f} | {min(walls):.1f}–{max(walls):.1f} | "
                f"{sps:.1f} | {base / med:.2f}× |"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
