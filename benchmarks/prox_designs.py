"""Two ways to make π_prox exact in fully-async mode (issue 21), measured on the trainer's critical path.

A (built; ``--exact-proximal-policy``, the default): for the samples ActorFwd scored with older weights, the
  trainer takes π_prox from its own training forward in the batch's first optimizer step (that forward runs
  with exactly the weights before the update: free) and recomputes it for later optimizer steps.
B (the alternative the issue names): a bus readiness condition. The trainer takes only samples whose
  ``log_probs_version`` equals its version and ActorFwd re-runs the stale ones, so each step the trainer
  waits for ActorFwd to load weights v (they exist only once step v-1 ended) and score the batch with them.

B is not built into the run: it needs bus fields that can be rewritten (they are write-once) and ActorFwd
taking back samples it acked. Its critical path is measured here with the real parts instead: ActorFwd's
backend loading the trainer's weights and scoring the batch (the trainer idle meanwhile), then the trainer's
step. Both on the CPU demo's model and batch shape (256 samples: 32 prompts × 8, responses of 6 tokens),
every sample stale (what staleness ≥ 1 gives: 98.75% in the measured run), one and two optimizer steps per
batch; the weight transfer B adds to its critical path is left out (it favours B).

    uv run python benchmarks/prox_designs.py              # 12 steps per design and case, interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from relax_app.cli_config import config_from_flat
from relax_app.demo.assets import prepare_demo
from relax_app.demo.defaults import DEMO_DEFAULTS
from relax_train.backends.torch_backend import TorchBackend
from relax_train.roles.prox import exact_prox


def batch(cfg, tokenizer, prompts: list[str], seed: int) -> dict:
    """The demo's batch shape: each prompt n times, responses of the maximum length (random tokens: the
    cost depends on the shapes only), advantages ±1, ActorFwd's log-probs one version behind."""
    rng = np.random.default_rng(seed)
    n, resp = cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_max_response_len
    out: dict = {
        k: [] for k in ("tokens", "prompt_len", "loss_mask", "advantages", "rollout_log_probs", "log_probs")
    }
    for p in prompts:
        ids = tokenizer(p)["input_ids"]
        for _ in range(n):
            r = rng.integers(3, tokenizer.vocab_size, resp)
            out["tokens"].append(np.asarray([*ids, *r], dtype=np.int64))
            out["prompt_len"].append(len(ids))
            out["loss_mask"].append(np.ones(resp, np.float32))
            out["advantages"].append(np.full(resp, rng.choice([-1.0, 1.0]), np.float32))
            out["rollout_log_probs"].append(rng.uniform(-3, -1, resp).astype(np.float32))
            out["log_probs"].append(rng.uniform(-3, -1, resp).astype(np.float32))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results/prox_designs.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core per role, as the run's actors have on this machine
    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.sft_model_dir)
    rows = [json.loads(line) for line in Path(assets.train_path).read_text().splitlines()]
    results: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
        "steps": args.steps,
        "cases": {},
    }
    for opt_steps in (1, 2):
        flat = {
            **DEMO_DEFAULTS,
            "mode": "fully_async",
            "max_staleness": 2,
            "decoupled_ppo": True,
            "prompt_data": str(assets.train_path),
            "hf_checkpoint": str(assets.sft_model_dir),
            "tensorboard": False,
            "trace": False,
        }
        flat["global_batch_size"] = (
            DEMO_DEFAULTS["rollout_batch_size"] * DEMO_DEFAULTS["n_samples_per_prompt"] // opt_steps
        )
        cfg = config_from_flat(flat)
        trainers = {
            "A": TorchBackend(cfg, str(assets.sft_model_dir)),
            "B": TorchBackend(cfg, str(assets.sft_model_dir)),
        }
        actor_fwd = TorchBackend(cfg, str(assets.sft_model_dir), trainable=False)
        times: dict[str, list[float]] = {"A": [], "B": [], "B_actor_fwd": []}
        for step in range(args.steps + 1):  # step 0 warms up
            prompts = [
                rows[(step * 32 + i) % len(rows)]["prompt"] for i in range(cfg.rollout.rollout_batch_size)
            ]
            for design in ("A", "B") if step % 2 else ("B", "A"):  # interleaved, alternating order
                trainer, d = trainers[design], batch(cfg, tok, prompts, step)
                d["log_probs_version"] = [trainer.version - 1] * len(d["tokens"])
                t0 = time.perf_counter()
                if design == "A":
                    exact_prox(cfg, trainer, d)
                else:  # ActorFwd takes weights v and re-scores the batch; the trainer waits for it
                    actor_fwd.load_weights(dict(trainer.named_weights()), trainer.version)
                    d["log_probs"] = actor_fwd.compute_log_probs(d)
                    d["log_probs_version"] = [trainer.version] * len(d["tokens"])
                    t_fwd = time.perf_counter() - t0
                trainer.train_step(d)
                if step:
                    times[design].append(time.perf_counter() - t0)
                    if design == "B":
                        times["B_actor_fwd"].append(t_fwd)
        results["cases"][f"{opt_steps} optimizer step(s)"] = times
    print(
        "\n| optimizer steps per batch | design | step s (median) | spread (min–max) | of which ActorFwd | B / A |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for case, times in results["cases"].items():
        med = {k: statistics.median(v) for k, v in times.items()}
        for design in ("A", "B"):
            fwd = f"{med['B_actor_fwd']:.3f}" if design == "B" else "—"
            ratio = f"{med['B'] / med['A']:.2f}×" if design == "A" else "—"
            print(
                f"| {case.split()[0]} | {design} | {med[design]:.3f} | {min(times[design]):.3f}–{max(times[design]):.3f} "
                f"| {fwd} | {ratio} |"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
