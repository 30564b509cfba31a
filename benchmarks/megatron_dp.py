"""Data parallelism on the megatron backend: what a second replica buys. One command:

    uv run python benchmarks/megatron_dp.py [--rounds 3] [--steps 4] [--seqs 16]

One step = what the trainer and ActorFwd do per RL step: ``compute_log_probs`` then ``train_step`` on
--seqs sequences of 128 tokens (96 response tokens), micro-batches of 2, on a Qwen3-architecture model
built from config (hidden 256, 4 layers, vocabulary 2000: ~3.4M parameters), float32, gloo on CPU.
Three layouts of the same machine's cores, each in fresh processes (megatron's parallel state is per
process), interleaved per round, one untimed step first:

* ``one rank``: one process, torch threads = every core;
* ``DP 2, replicas split the batch``: two processes, one thread each, each running every other
  micro-batch (relax-train 0.7);
* ``DP 2, every replica runs the batch``: the same two processes with every replica given every
  micro-batch, as relax-train 0.6 did (emulated by patching ``MegatronBackend._my_micro``; its gradients
  are then the sum of two full-batch gradients, which changes nothing in the time).

Expected: splitting the batch takes a DP 2 step to about half of the replicated one's time (each replica
does half of the forward and backward work; the gradient all-reduce and the gathers are small next to
it) and, on this machine, close to the one-rank step (the same cores do the same work).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from relax_testing import spawn_ranks

LAYOUTS = {
    "one rank": {"world": 1, "replicas_run_all": False},
    "DP 2, replicas split the batch": {"world": 2, "replicas_run_all": False},
    "DP 2, every replica runs the batch": {"world": 2, "replicas_run_all": True},
}
FLAGS = [
    "--micro-batch-size",
    "2",
    "--rollout-batch-size",
    "8",
    "--n-samples-per-prompt",
    "2",
    "--lr",
    "1e-5",
]


def build_model(root: Path) -> str:
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=2000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    out = root / "model"
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(out)
    return str(out)


def samples(n: int) -> dict:
    rng = np.random.default_rng(0)
    resp = 96
    return {
        "tokens": [rng.integers(0, 2000, 128) for _ in range(n)],
        "prompt_len": [32] * n,
        "advantages": [np.full(resp, 1.0 if i % 2 else -1.0, np.float32) for i in range(n)],
        "loss_mask": [np.ones(resp, np.float32) for _ in range(n)],
        "rollout_log_probs": [rng.uniform(-8.0, -7.0, resp).astype(np.float32) for _ in range(n)],
    }


def worker(spec_path: str) -> None:
    from relax_app.cli_config import build_config
    from relax_train.backends.megatron.backend import MegatronBackend

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    if spec["replicas_run_all"]:
        MegatronBackend._my_micro = lambda self, micro: [(m, True) for m in micro]
    cfg = build_config(None, ["--prompt-data", "unused", "--hf-checkpoint", spec["model"], *FLAGS])
    backend = MegatronBackend(cfg, spec["model"])
    data = samples(spec["seqs"])
    times = []
    for step in range(spec["steps"] + 1):
        t0 = time.perf_counter()
        backend.compute_log_probs(data)
        backend.train_step(data)
        if step:  # (the first is untimed)
            times.append(time.perf_counter() - t0)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(spec["out"]).write_text(json.dumps(times))
    import torch.distributed as dist

    dist.barrier()  # (leave together: a rank whose peer is gone can abort in gloo's teardown)
    dist.destroy_process_group()


def run_layout(root: Path, model: str, name: str, steps: int, seqs: int) -> list[float]:
    layout = LAYOUTS[name]
    world = layout["world"]
    spec = root / "spec.json"
    out = root / "times.json"
    spec.write_text(
        json.dumps(
            {
                "model": model,
                "steps": steps,
                "seqs": seqs,
                "out": str(out),
                "threads": max(1, os.cpu_count() // world),
                "replicas_run_all": layout["replicas_run_all"],
            }
        )
    )
    for p in spawn_ranks([sys.executable, __file__, "--worker", str(spec)], world):
        if p.wait(timeout=1800):
            raise SystemExit(f"{name}: a rank exited with {p.returncode}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    root = Path(tempfile.mkdtemp(prefix="relax_dp_bench_"))
    model = build_model(root)
    per_round: dict[str, list[float]] = {n: [] for n in LAYOUTS}
    every: dict[str, list[float]] = {n: [] for n in LAYOUTS}
    for _ in range(args.rounds):
        for name in LAYOUTS:
            times = run_layout(root, model, name, args.steps, args.seqs)
            per_round[name].append(statistics.median(times))
            every[name].extend(times)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.seqs} sequences of 128 tokens, {args.rounds} rounds x {args.steps} steps"
    )
    base = statistics.median(every["DP 2, every replica runs the batch"])
    print("| layout | s/step (median) | spread (round medians) | vs DP 2 replicated |")
    print("| --- | --- | --- | --- |")
    for name in LAYOUTS:
        med = statistics.median(every[name])
        lo, hi = min(per_round[name]), max(per_round[name])
        print(f"| {name} | {med:.3f} | {lo:.3f}–{hi:.3f} | {base / med:.2f}× |")


if __name__ == "__main__":
    main()
