"""Relax against TRL's ``GRPOTrainer`` on the same work: samples/s and held-out accuracy, side by side.

The peer a user would otherwise run is TRL's plain ``GRPOTrainer`` (``benchmarks/peer_trl.py``: every setting
read from the same relax config, so the two cannot drift; the same reward function through relax's scorer;
the same greedy evaluation), loading the model as a TRL user does (transformers' default attention, SDPA);
``trl_eager`` is TRL given the eager attention relax picks on CPU, to show what that choice alone is worth;
``trl_one_pass`` is TRL with the whole batch in one forward/backward (relax packs micro-batches by tokens,
``--use-dynamic-batch-size``, which TRL's GRPOTrainer does not offer: this is its nearest setting). Relax runs in colocate, fully async (staleness 1, batch rollout) and streaming
(fully async, staleness 1, ``--streaming-rollout --partial-rollout``), each with its defaults. Every run is a
fresh process (no state carried between runs), the runners interleaved within each repeat so drift hits them
alike; repeat k uses seed k (its own warm start, as ``relax train --seed k``), so the accuracy column is a
median over seeds too. samples/s is over the RL loop (set-up, model loading and evaluation excluded, for
both engines).

Shapes:
  demo   — the README's demo: 100 steps x 32 prompts x 8 samples, 6 new tokens;
  long   — the same with up to 32 new tokens (the warm start stops early, so responses run long);
  large  — the demo with a model ~7x larger (hidden 256, 8 layers; its own warm start, built once).

    uv run python benchmarks/peers.py                                  # demo, 3 repeats, every runner
    uv run python benchmarks/peers.py --shapes long,large --steps 30 --repeats 1
    uv run python benchmarks/peers.py --runners colocate,colocate_lora,async,async_lora,stream,stream_lora \
        --out benchmarks/results/peers_lora.json                       # LoRA against full fine-tuning
    uv run python benchmarks/peers.py --runners colocate,colocate_ppo,async,async_ppo \
        --out benchmarks/results/peers_ppo.json                        # PPO (a critic) against GRPO
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from quiet import busy_cores, machine_state, wait_quiet

from relax_core.roofline import cpu_model

RUNNERS = {
    "trl": None,
    "trl_minimal": None,
    "trl_eager": None,
    "trl_one_pass": None,
    "colocate": {"mode": "colocate"},
    "async": {"mode": "fully_async", "max_staleness": 1},
    "stream": {"mode": "fully_async", "max_staleness": 1, "streaming_rollout": True, "partial_rollout": True},
}
LORA = {"lora_rank": 8, "lr": 1e-3}
"""LoRA RL (#37): rank 8 on every linear layer (the default all-linear), adapters synced alone; a learning rate
5x full fine-tuning's (the demo's LoRA default: relax_app.demo.defaults.DEMO_LORA_LR)."""
for _name in ("colocate", "async", "stream"):
    RUNNERS[f"{_name}_lora"] = {**RUNNERS[_name], **LORA}
PPO = {"advantage_estimator": "gae"}
"""PPO with a learned critic (#39): the Critic role at its defaults (γ = λ = 1, --critic-lr = --lr, one pass,
value clip 0.5), everything else as the GRPO runner of the same mode."""
for _name in ("colocate", "async"):
    RUNNERS[f"{_name}_ppo"] = {**RUNNERS[_name], **PPO}
TWINS = {"_lora": "full fine-tuning", "_ppo": "GRPO"}
"""A runner's suffix -> what its twin (the runner without it) is: the accuracy gain is reported against it."""
DEFAULT_RUNNERS = ("trl", "trl_eager", "trl_one_pass", "colocate", "async", "stream")
"""What a plain ``peers.py`` runs; the LoRA runners by name: ``--runners colocate,colocate_lora,...``."""
SHAPES = {
    "demo": ({}, {}),
    "long": ({"rollout_max_response_len": 32}, {}),
    "large": (
        {},
        {"hidden_size": 256, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 768},
    ),
}
"""Shape -> (relax flags over the demo's, demo-asset settings: the model's size)."""


def one(runner: str, shape: str, seed: int, steps: int, out: Path) -> dict:
    """One run in this process; its figures."""
    from relax_app.cli_config import config_from_flat
    from relax_app.demo.assets import prepare_demo
    from relax_app.demo.defaults import DEMO_DEFAULTS
    from relax_core.controller import Controller, RunInputs

    flags, settings = SHAPES[shape]
    assets = prepare_demo(os.environ.get("RELAX_CACHE_DIR", ".relax_cache"), seed=seed, **settings)
    flat = {
        **DEMO_DEFAULTS,
        **flags,
        "num_rollout": steps,
        "seed": seed,
        "eval_interval": None,
        "tensorboard": False,
        "progress": False,
        "output_dir": str(out),
        "prompt_data": str(assets.train_path),
        "hf_checkpoint": str(assets.sft_model_dir),
        "eval_data": str(assets.eval_path),
    }
    if runner == "trl_minimal":  # the check of the harness: TRL as its documentation writes it
        sys.path.insert(0, str(Path(__file__).parent))
        from trl_minimal import run_minimal

        return run_minimal(str(assets.sft_model_dir), str(assets.train_path), out, seed, steps)
    if runner.startswith("trl"):
        sys.path.insert(0, str(Path(__file__).parent))
        from peer_trl import run_trl

        if runner == "trl_one_pass":  # TRL's nearest to relax's packing by tokens: the batch in one pass
            flat["micro_batch_size"] = flat["rollout_batch_size"] * flat["n_samples_per_prompt"]
        return run_trl(flat, assets, out, "eager" if runner == "trl_eager" else None)
    cfg = config_from_flat({**flat, **RUNNERS[runner]})
    res = Controller(
        cfg, RunInputs(str(assets.sft_model_dir), str(assets.train_path), str(assets.eval_path))
    ).run()
    curve = res.eval_curve
    synced = [h["perf/weight_sync_bytes"] for h in res.history if "perf/weight_sync_bytes" in h]
    mfu = [h["perf/train_mfu"] for h in res.history if h.get("perf/train_mfu")]
    return {
        "train_mfu": statistics.median(mfu) if mfu else None,  # (the step's share of the matmul peak)
        "weight_sync_bytes": statistics.median(synced) if synced else None,
        "rl_wall_s": res.rl_wall_s,
        "samples": res.samples,
        "samples_per_s": res.samples / res.rl_wall_s,
        "accuracy": curve[-1][1],
        "accuracy_before": curve[0][1],
    }


def _gain_vs_twin(runs: dict, shape: str, runner: str) -> str:
    """A LoRA (PPO) runner's held-out accuracy gain (final − first evaluation) over its full fine-tuning
    (GRPO) twin's (:data:`TWINS`), seed by seed (the same seed: the same warm start), as the median ratio
    with its range."""
    suffix = next((s for s in TWINS if runner.endswith(s)), None)
    full = runs.get(f"{shape}/{runner.removesuffix(suffix)}") if suffix else None
    if not full:
        return "—"
    ratios = [
        (a["accuracy"] - a["accuracy_before"]) / (b["accuracy"] - b["accuracy_before"])
        for a, b in zip(runs[f"{shape}/{runner}"], full)
        if b["accuracy"] > b["accuracy_before"]
    ]
    if not ratios:
        return f"— ({TWINS[suffix]} did not gain)"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="demo")
    ap.add_argument("--runners", default=",".join(DEFAULT_RUNNERS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results/peers.json")
    ap.add_argument(
        "--condition",
        choices=("quiet", "shared"),
        default="quiet",
        help="quiet: each run waits for a quiet machine (a busy start is marked, not counted); shared: one "
        "busy process per core beside every run",
    )
    ap.add_argument("--one", nargs=3, metavar=("RUNNER", "SHAPE", "SEED"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path("runs/bench_peers")
    if args.one:  # a child: one run, its figures to --json
        runner, shape, seed = args.one
        r = one(runner, shape, int(seed), args.steps, root / f"{shape}_{runner}_{seed}")
        Path(args.json).write_text(json.dumps(r))
        return
    results: dict = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "steps": args.steps,
        "condition": args.condition,
        "runs": {},
    }
    for shape in args.shapes.split(","):
        for rep in range(args.repeats):
            for runner in args.runners.split(","):  # interleaved: drift hits every runner alike
                out = root / f"{shape}_{runner}_{rep}.json"
                argv = [
                    sys.executable,
                    __file__,
                    "--one",
                    runner,
                    shape,
                    str(rep),
                    "--steps",
                    str(args.steps),
                ]
                state = wait_quiet() if args.condition == "quiet" else machine_state()
                t = time.perf_counter()
                with busy_cores(os.cpu_count() or 1) if args.condition == "shared" else nullcontext():
                    subprocess.run([*argv, "--json", str(out)], check=True)
                r = json.loads(out.read_text())
                r["machine_before"] = state
                r["counted"] = args.condition == "shared" or state["quiet"]
                results["runs"].setdefault(f"{shape}/{runner}", []).append(r)
                print(
                    f"{shape:5s} {runner:8s} seed {rep}: {r['samples_per_s']:.0f} samples/s, accuracy "
                    f"{r.get('accuracy_before', 0):.3f} -> {r.get('accuracy', 0):.3f} "
                    f"({time.perf_counter() - t:.0f} s; load {state['load1']}, idle {state['idle']}"
                    f"{'' if r['counted'] else ', BUSY: not counted'})",
                    flush=True,
                )
    print(
        f"\n{results['cpu']}, {results['cores']} cores, {args.condition}; median (min–max) of the counted "
        f"runs of {args.repeats} seeds"
    )
    print(
        "| shape | engine | samples/s | held-out accuracy | vs TRL (samples/s) | train MFU | gain vs twin "
        "| bytes/sync | not counted |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        base = [r for r in results["runs"].get(f"{shape}/trl", []) if r["counted"]]
        base_sps = statistics.median(r["samples_per_s"] for r in base) if base else None
        for runner in args.runners.split(","):
            every = results["runs"][f"{shape}/{runner}"]
            runs = [r for r in every if r["counted"]]
            if not runs:
                print(f"| {shape} | {runner} | no run on a quiet machine | | | | | | {len(every)} |")
                continue
            sps = [r["samples_per_s"] for r in runs]
            acc = [r["accuracy"] for r in runs if "accuracy" in r]
            ratio = f"{statistics.median(sps) / base_sps:.2f}×" if base_sps else "—"
            synced = [r["weight_sync_bytes"] for r in runs if r.get("weight_sync_bytes")]
            mfu = [r["train_mfu"] for r in runs if r.get("train_mfu")]
            print(
                f"| {shape} | {runner} | {statistics.median(sps):.0f} ({min(sps):.0f}–{max(sps):.0f}) | "
                + (f"{statistics.median(acc):.3f} ({min(acc):.3f}–{max(acc):.3f})" if acc else "—")
                + f" | {ratio} | {f'{statistics.median(mfu):.2f}' if mfu else '—'} | "
                f"{_gain_vs_twin(results['runs'], shape, runner)} | "
                f"{f'{statistics.median(synced):,.0f}' if synced else '—'} | {len(every) - len(runs)} |"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
