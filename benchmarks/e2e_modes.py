"""Colocate vs fully async (staleness 1 and 2, batch-synchronous or streaming with partial rollout): the same
RL steps, wall time and samples/s.

Three workloads on the CPU demo's task:
  (a) demo     — the warm-started tiny Qwen3 as it is: compute-bound on 2 cores, where overlap has little
                 to win;
  (b) judge    — a reward that waits 50 ms per sample (a remote judge) and long-tail response lengths
                 (EOS suppressed up to a Pareto-distributed minimum), where rollout idles and async overlaps;
  (c) longtail — generation dominates: a larger Qwen3 (hidden 256, 4 layers, random weights) whose
                 responses end at Pareto-distributed lengths up to 256 tokens (--long-tail-exact), 8
                 prompts x 4 a step, where a batch waits for its longest response.
Modes: colocate; async_s1/async_s2 (fully async, batch-synchronous rollout); stream_s1/stream_s2 (fully
async, --streaming-rollout --partial-rollout).
Each configuration runs --repeats times (median and spread reported); RL-loop time only (Ray start-up and
model loading excluded, the same for every mode's count of steps).

    uv run python benchmarks/e2e_modes.py            # full: 3 repeats, writes benchmarks/results/e2e_modes.json
    uv run python benchmarks/e2e_modes.py --steps 3 --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from relax_app.cli_config import config_from_flat
from relax_app.demo.assets import prepare_demo
from relax_app.demo.defaults import DEMO_DEFAULTS
from relax_core.controller import Controller, RunInputs

MODES = {
    "colocate": {"mode": "colocate"},
    "async_s1": {"mode": "fully_async", "max_staleness": 1},
    "async_s2": {"mode": "fully_async", "max_staleness": 2},
    "stream_s1": {
        "mode": "fully_async",
        "max_staleness": 1,
        "streaming_rollout": True,
        "partial_rollout": True,
    },
    "stream_s2": {
        "mode": "fully_async",
        "max_staleness": 2,
        "streaming_rollout": True,
        "partial_rollout": True,
    },
}
WORKLOADS = {
    "demo": {},
    "judge": {"reward_delay_s": 0.05, "long_tail_min_tokens": 4, "rollout_max_response_len": 32},
    "longtail": {
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 4,
        "micro_batch_size": 32,
        "long_tail_min_tokens": 16,
        "long_tail_exact": True,
        "rollout_max_response_len": 256,
    },
}
LONGTAIL_MODEL = dict(hidden_size=256, num_layers=4, intermediate_size=768, max_position_embeddings=320)


def longtail_model(assets, root: Path) -> str:
    """The long-tail workload's policy: the demo's tokenizer, a larger Qwen3 (random weights), made once."""
    out = root / "longtail_model"
    if not (out / "config.json").is_file():
        from transformers import AutoTokenizer

        from relax_app.demo.model import build_tiny_qwen3

        build_tiny_qwen3(AutoTokenizer.from_pretrained(assets.sft_model_dir), out_dir=out, **LONGTAIL_MODEL)
    return str(out)


def run_once(assets, mode: str, workload: str, steps: int, out: Path, extra: dict | None = None) -> dict:
    flat = {
        **DEMO_DEFAULTS,
        **MODES[mode],
        **WORKLOADS[workload],
        **(extra or {}),
        "num_rollout": steps,
        "eval_interval": None,
        "tensorboard": False,
        "progress": False,
        "output_dir": str(out / f"{workload}_{mode}"),
        "prompt_data": str(assets.train_path),
        "hf_checkpoint": str(assets.sft_model_dir),
    }
    if workload == "longtail":
        flat["hf_checkpoint"] = longtail_model(assets, out)
    cfg = config_from_flat(flat)
    res = Controller(cfg, RunInputs(flat["hf_checkpoint"], str(assets.train_path))).run()
    return {
        "rl_wall_s": res.rl_wall_s,
        "samples_per_s": res.samples / res.rl_wall_s,
        "samples": res.samples,
        "rollout": {k: v for k, v in res.rollout_stats.items() if isinstance(v, (int, float))},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="demo,judge")
    ap.add_argument("--modes", default="colocate,async_s1,async_s2")
    ap.add_argument("--out", default="benchmarks/results/e2e_modes.json")
    args = ap.parse_args()
    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    tmp = Path("runs/bench_e2e")
    results: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
        "steps": args.steps,
        "repeats": args.repeats,
        "runs": {},
    }
    for workload in args.workloads.split(","):
        for rep in range(args.repeats):  # interleave modes so drift hits every mode alike
            for mode in args.modes.split(","):
                t = time.perf_counter()
                r = run_once(assets, mode, workload, args.steps, tmp)
                results["runs"].setdefault(f"{workload}/{mode}", []).append(r)
                print(
                    f"{workload:6s} {mode:9s} rep {rep}: {r['rl_wall_s']:.1f} s RL, {r['samples_per_s']:.1f} "
                    f"samples/s (incl. setup {time.perf_counter() - t:.1f} s)",
                    flush=True,
                )
    print("\n| workload | mode | RL wall s (median) | spread (min–max) | samples/s (median) | vs colocate |")
    print("| --- | --- | --- | --- | --- | --- |")
    for workload in args.workloads.split(","):
        base = (
            statistics.median(r["rl_wall_s"] for r in results["runs"][f"{workload}/colocate"])
            if "colocate" in args.modes
            else None
        )
        for mode in args.modes.split(","):
            runs = results["runs"][f"{workload}/{mode}"]
            walls = [r["rl_wall_s"] for r in runs]
            med = statistics.median(walls)
            sps = statistics.median(r["samples_per_s"] for r in runs)
            ratio = f"{base / med:.2f}×" if base else "—"
            print(
                f"| {workload} | {mode} | {med:.1f} | {min(walls):.1f}–{max(walls):.1f} | {sps:.1f} | {ratio} |"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
