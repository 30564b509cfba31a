"""`relax plan` against our own measured runs on this CPU (#57's calibration): the same simulator, with this
machine's constants, predicts colocate, fully async and streaming samples/s on the demo and the long-tail
workload of `benchmarks/e2e_modes.py`; then each run is measured (modes interleaved) and the two compared.

The constants, measured here, not tuned: the matmul peak (``relax_core.roofline.matmul_peak``, 1 thread: a
core is a "device"), the memory bandwidth (a numpy copy), and from a short colocate *probe run* of the same
workload (its own ``metrics.jsonl``): the training step's MFU against that peak and a decode step's time
(the rollout's share of the step over its decode steps) — a tiny model on a CPU is bound by per-step
overheads no FLOP or byte count explains, so those two are measured as a probe, as the issue allows. The
probe run is not one of the compared runs.

    uv run python benchmarks/plan_calibration.py                 # 16 steps a run, 3 repeats, writes benchmarks/results/plan_calibration.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from e2e_modes import MODES, WORKLOADS, longtail_model, run_once

from relax_app.demo.assets import prepare_demo
from relax_app.demo.defaults import DEMO_DEFAULTS
from relax_app.plan.config import PlanConfig
from relax_app.plan.costs import Device, Efficiency
from relax_app.plan.report import summarise
from relax_app.plan.sim import Simulation
from relax_core.roofline import cpu_model, matmul_peak

COMPARED = ("colocate", "async_s1", "stream_s1")


def memory_gbps() -> float:
    """A core's copy bandwidth (read + write of 256 MB), GB/s."""
    a = np.ones(32 * 1024 * 1024)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best / 1e9


def thread_scaling(model_dir: str) -> float:
    """log2 of a torch-engine decode's 1-thread over 2-thread time (32 rows, 48 tokens, best of 3)."""
    import torch

    from relax_rollout.engines.base import SamplingParams
    from relax_rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine(model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 32
    params = SamplingParams(max_new_tokens=48, min_new_tokens=48, seed=0)
    times = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            engine.generate(prompts, params)
            best = min(best, time.perf_counter() - t)
        times[threads] = best
    return float(np.log2(times[1] / times[2]))


def probe(assets, workload: str, out: Path, steps: int) -> dict:
    """A colocate run of ``workload`` as long as the compared runs (the long tail's lengths are drawn per
    step): its training MFU, its responses' mean length and its step time."""
    shutil.rmtree(out / "probe", ignore_errors=True)
    run_once(assets, "colocate", workload, steps, out / "probe")
    rows = [
        json.loads(x)
        for x in (out / "probe" / f"{workload}_colocate" / "metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if "train/loss" in r]
    steps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    train = statistics.median(r["perf/train_s"] for r in rows[1:])
    mfu = statistics.median(r["perf/train_mfu"] for r in rows[1:] if r.get("perf/train_mfu"))
    return {
        "response_len_mean": statistics.median(r["rollout/response_len_mean"] for r in rows),
        "step_s": statistics.mean(steps),
        "train_s": train,
        "train_mfu_2_threads": mfu,
    }


def prompt_tokens(assets, model_dir: str) -> int:
    """The task's mean prompt length in the run's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(x) for x in Path(assets.train_path).read_text().splitlines()[:500]]
    return round(statistics.mean(len(tok(r["prompt"])["input_ids"]) for r in rows))


def plan_for(
    workload: str,
    mode: str,
    model_dir: str,
    device: Device,
    eff: Efficiency,
    probed: dict,
    prompt: int,
    steps: int = 16,
) -> PlanConfig:
    flat = {**DEMO_DEFAULTS, **WORKLOADS[workload]}
    model = json.loads((Path(model_dir) / "config.json").read_text())
    longtail = workload == "longtail"
    cap = flat["rollout_max_response_len"]
    response = (  # (the long tail as --long-tail-min-tokens draws it; the demo's as its probe measured)
        {"kind": "lomax", "scale": flat["long_tail_min_tokens"], "alpha": 1.5, "max": cap}
        if longtail
        else {"kind": "lognormal", "mean": probed["response_len_mean"], "sigma": 0.5, "max": cap}
    )
    colocate = MODES[mode]["mode"] == "colocate"
    # a core is a device: fully async gives the rollout one and the trainer's roles the other; colocate runs
    # each phase on both (one engine of 2 threads, training on 2)
    cluster = {"device": "custom", "custom": device, "rollout_gpus": 1, "train_gpus": 1, "engine": "torch"}
    if colocate:
        cluster.update(rollout_gpus=2, train_gpus=0, rollout_tp=2)
    return PlanConfig.model_validate(
        {
            "name": f"cpu-{workload}-{mode}",
            "cluster": cluster,
            "model": model,
            "workload": {
                "steps": steps,
                "prompts_per_step": flat["rollout_batch_size"],
                "samples_per_prompt": flat["n_samples_per_prompt"],
                "prompt_tokens": prompt,
                "response": response,
            },
            "run": {k: v for k, v in MODES[mode].items()},
            "efficiency": eff,
            "dtype_bytes": 4,
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="demo,longtail")
    ap.add_argument("--out", default="benchmarks/results/plan_calibration.json")
    args = ap.parse_args()
    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    tmp = Path("runs/bench_plan")
    peak = matmul_peak(1)
    device = Device(
        peak_tflops=peak.gflops / 1000,
        hbm_gbps=memory_gbps(),
        memory_gb=24,
        source=f"measured: {cpu_model()}",
    )
    results: dict = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cpus, {platform.python_version()}",
        "device": device.model_dump(),
        "rows": [],
    }
    for workload in args.workloads.split(","):
        p = probe(assets, workload, tmp, args.steps)
        model_dir = longtail_model(assets, tmp) if workload == "longtail" else str(assets.sft_model_dir)
        prompt = prompt_tokens(assets, model_dir)
        p["decode_row_scaling"] = min(1.0, max(0.0, thread_scaling(model_dir)))
        eff = Efficiency(
            decode_row_scaling=p["decode_row_scaling"],
            train_mfu=min(1.0, p["train_mfu_2_threads"]),
            forward_mfu=min(1.0, p["train_mfu_2_threads"]),
            decode_step_s=0.0,
            engine_update_s=0.0,
            colocate_switch_gbps=1e6,
        )
        # a response row's decode-step seconds on one core: what the probe's step spent beyond the modelled
        # work (the simulated colocate step is linear in it)
        at = functools.partial(plan_for, workload, "colocate", model_dir, device)
        s0 = summarise(Simulation(at(eff, p, prompt, args.steps)).run()).step_s
        s1 = summarise(
            Simulation(at(eff.model_copy(update={"decode_row_s": 1e-3}), p, prompt, args.steps)).run()
        ).step_s
        p["decode_row_s"] = max(0.0, (p["step_s"] - s0) / ((s1 - s0) / 1e-3))
        eff = eff.model_copy(update={"decode_row_s": p["decode_row_s"]})
        print(workload, "probe:", {k: round(v, 4) for k, v in p.items()}, flush=True)
        predicted = {}
        for mode in COMPARED:
            plan = plan_for(workload, mode, model_dir, device, eff, p, prompt, args.steps)
            o = Simulation(
                plan
            ).run()  # (whole-run samples/s, as the measured runs count them: fill included)
            predicted[mode] = len(o.step_ends) * o.samples_per_step / o.step_ends[-1]
        measured: dict[str, list[float]] = {m: [] for m in COMPARED}
        for _ in range(args.repeats):  # modes interleaved: drift hits each alike
            for mode in COMPARED:
                shutil.rmtree(tmp / f"{workload}_{mode}", ignore_errors=True)
                measured[mode].append(run_once(assets, mode, workload, args.steps, tmp)["samples_per_s"])
        for mode in COMPARED:
            med = statistics.median(measured[mode])
            row = {
                "workload": workload,
                "mode": mode,
                "predicted": predicted[mode],
                "measured_median": med,
                "measured": measured[mode],
                "error": predicted[mode] / med - 1,
            }
            results["rows"].append(row)
            print(
                f"| {workload} | {mode} | {predicted[mode]:.1f} | {med:.1f} ({min(measured[mode]):.1f}–"
                f"{max(measured[mode]):.1f}) | {row['error']:+.0%} |",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
