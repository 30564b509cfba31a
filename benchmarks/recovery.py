"""Recovery times of the health manager: a role's process is SIGKILLed mid-run (fully async, CPU demo).

    uv run python benchmarks/recovery.py [--reps 3] [--roles actor_fwd,rollout,actor,engine] [--steps 8]

For each role and repetition, a fresh fully-async run of the CPU demo (warm-started tiny Qwen3,
arithmetic task; --max-staleness 1, --save-interval 1 so the trainer can restart in place, and for
"engine" --rollout-engines 2: engines in their own processes) has that role's process killed after 2
trained steps. Reported per role (median and min-max over --reps):

- detect: signal → the health manager's decision (a dead actor's loop fails at once; an engine is seen by
  the pool's next request and reported with the next heartbeat, every --heartbeat-interval-s);
- restart: decision → the role running again (new process, its state — checkpoint, bus leases, journal —
  and the current weights; for an engine: new process + current weights);
- total: signal → running again.

Every run must still train exactly the demo's prompts (checked: nothing lost, nothing twice). The machine
and its load are printed; results go to benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

from relax_app.cli_config import config_from_flat
from relax_app.demo.assets import prepare_demo
from relax_app.demo.defaults import DEMO_DEFAULTS
from relax_core.controller import Controller, RunInputs
from relax_testing import signal_role_after


def run_once(assets, role: str, steps: int, out: Path) -> dict:
    flat = {
        **DEMO_DEFAULTS,
        "mode": "fully_async",
        "max_staleness": 1,
        "num_rollout": steps,
        "eval_interval": None,
        "tensorboard": False,
        "progress": False,
        "trace": False,
        "output_dir": str(out),
        "save": str(out / "ckpt"),
        "save_interval": 1,
        "prompt_data": str(assets.train_path),
        "hf_checkpoint": str(assets.sft_model_dir),
        **({"rollout_engines": 2} if role == "engine" else {}),
    }
    c = Controller(config_from_flat(flat), RunInputs(str(assets.sft_model_dir), str(assets.train_path)))
    kill = signal_role_after(c, 2, role)
    res = c.run()
    ev = [e for e in res.audit["health"] if e["action"] == "restart"]
    if "at" not in kill or len(ev) != 1 or ev[0]["recovery_s"] is None:
        raise RuntimeError(
            f"{role}: expected one completed restart, got {res.audit['health']} (kill: {kill})"
        )
    ids = res.audit["trained_ids"]
    if len(ids) != len(set(ids)) or len(res.audit["trained_prompts"]) != steps:
        raise RuntimeError(f"{role}: trained samples lost or repeated")
    detect = ev[0]["at"] - kill["at"]
    return {"detect_s": detect, "restart_s": ev[0]["recovery_s"], "total_s": detect + ev[0]["recovery_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--roles", default="actor_fwd,rollout,actor,engine")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for role in args.roles.split(","):
            runs = [run_once(assets, role, args.steps, Path(tmp) / f"{role}{r}") for r in range(args.reps)]
            results[role] = {k: [r[k] for r in runs] for k in runs[0]}
            cells = [
                f"{k} {statistics.median(v):.2f} s [{min(v):.2f}-{max(v):.2f}]"
                for k, v in results[role].items()
            ]
            print(f"{role:10s} " + "  ".join(cells), flush=True)
    out = Path(__file__).parent / "results" / "recovery.json"
    out.write_text(
        json.dumps(
            {"reps": args.reps, "steps": args.steps, "results": results, "load": os.getloadavg()}, indent=1
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
