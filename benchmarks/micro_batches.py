"""One training step of the demo's shape, micro-batches by count (``--micro-batch-size``) against packed by
tokens (``--use-dynamic-batch-size --max-tokens-per-gpu N``): the same samples and gradient, a different
number of passes and of padded tokens. The demo's SFT model, 256 samples of 4-6 prompt tokens and 2-6
response tokens (the demo's lengths), 2 torch threads; the plans interleaved, median of the repeats.

    uv run python benchmarks/micro_batches.py                 # 5 rounds x 5 steps per plan
    uv run python benchmarks/micro_batches.py --rounds 2      # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

PLANS = {
    "by count 64": {"micro_batch_size": 64},
    "by count 256": {"micro_batch_size": 256},
    "tokens 1024": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 1024},
    "tokens 2048": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 2048},
    "tokens 4096": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 4096},
}


def _samples(n: int = 256, seed: int = 0) -> dict[str, list]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out: dict[str, list] = {
        k: [] for k in ("tokens", "prompt_len", "loss_mask", "advantages", "rollout_log_probs")
    }
    for _ in range(n):
        p, r = int(rng.integers(4, 7)), int(rng.integers(2, 7))
        out["tokens"].append(rng.integers(3, 250, size=p + r).astype(np.int64))
        out["prompt_len"].append(p)
        out["loss_mask"].append(np.ones(r, np.float32))
        out["advantages"].append(rng.standard_normal(r).astype(np.float32))
        out["rollout_log_probs"].append(np.full(r, -3.0, np.float32))
    out["prox_from_forward"] = [True] * n  # (the demo's default: π_prox from the training forward)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/micro_batches.json")
    args = ap.parse_args()
    import torch

    from relax_app.demo.assets import prepare_demo
    from relax_core.config import RelaxConfig
    from relax_train.backends.torch_backend import TorchBackend

    torch.set_num_threads(2)
    model = str(prepare_demo(os.environ.get("RELAX_CACHE_DIR", ".relax_cache")).sft_model_dir)
    batch = {"rollout_batch_size": 32, "n_samples_per_prompt": 8}
    backends = {
        name: TorchBackend(RelaxConfig.model_validate({"train": plan, "rollout": batch}), model)
        for name, plan in PLANS.items()
    }
    samples = _samples()
    times: dict[str, list[float]] = {name: [] for name in PLANS}
    for b in backends.values():
        b.train_step(samples)  # (warm-up)
    for _ in range(args.rounds):  # interleaved: drift hits every plan alike
        for name, b in backends.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                b.train_step(samples)
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["by count 64"])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}")
    print("| micro-batches | train step s, median (min–max) | vs by count 64 |")
    print("| --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} ({min(ts):.3f}–{max(ts):.3f}) | {base / med:.2f}× |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpus": os.cpu_count(), "times": times}, indent=1))


if __name__ == "__main__":
    main()
