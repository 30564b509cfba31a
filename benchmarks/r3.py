"""Routing replay (R3): what it costs the trainer and what it removes, on a tiny Qwen3-MoE on CPU. One command:

    uv run python benchmarks/r3.py [--reps 15] [--noise 0,0.0001,0.001] [--init-range 0.1]

Model: Qwen3-MoE architecture from a config (random weights; hidden 128, 4 layers, 16 experts, top-4,
vocabulary 300 from a tokenizer trained locally on the demo's arithmetic prompts). Weights are drawn with
std --init-range 0.1: with HF's default 0.02 the random router is nearly uniform, so which experts a token
gets barely moves its log-probs (and the tiniest noise flips most choices); 0.1 gives a router whose
choices matter, as in a trained MoE. Data: one rollout batch of 64 sequences (16 prompts × 4 samples, 32
new tokens, ~38 tokens each) through the real path: RolloutWorker (TorchEngine recording each token's
experts) → DataBus → TorchBackend.

(1) Cost: TorchBackend.train_step on that batch (one micro-batch of 64: forward + backward + AdamW step),
with and without --routing-replay, interleaved (one of each per repetition, in alternating order, after
one untimed step of each), median and min-max of --reps repetitions; overhead = median with / median
without - 1.
(2) Effect: the trainer's weights are perturbed (Gaussian noise of std --noise on every parameter, a
stand-in for the policy moving on between rollout and training); then per noise level, without and with
R3: the fraction of token-layer pairs (every token but each sequence's last, every MoE layer) whose experts
in the trainer's forward differ from the rollout's, and the train-vs-rollout log-prob mismatch, mean
|Δ log p| over response tokens. Noise 0 shows the engine-vs-trainer numerics alone (KV cache and left
padding vs one right-padded forward). torch runs on one thread; the machine and its load (uptime) are
printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from relax_testing import experts_used

LAYERS, EXPERTS, TOP_K = 4, 16, 4


def build_inputs(root: Path, init_range: float) -> tuple[str, str]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from relax_app.demo.task import make_arithmetic_task, read_jsonl
    from relax_app.demo.tokenizer import train_tokenizer

    files = make_arithmetic_task(root / "task", max_operand=30, n_eval=20)
    rows = read_jsonl(files.train_path)
    tok = train_tokenizer([r["prompt"] + r["label"] for r in rows], root / "model", vocab_size=300)
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        initializer_range=init_range,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(root / "model")
    return str(root / "model"), str(files.train_path)


def rollout_batch(cfg, ckpt: str, data_path: str) -> dict:
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker

    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=1000))
    RolloutWorker(cfg, bus, ckpt, data_path).produce(0)
    data = bus.get("c", cfg.samples_per_rollout, timeout=30).data
    data["advantages"] = [
        np.full(len(lp), 1.0 - 2 * (k % 2), np.float32) for k, lp in enumerate(data["rollout_log_probs"])
    ]
    return data


def time_steps(cfg, ckpt: str, data: dict, reps: int) -> dict[str, list[float]]:
    from relax_train.backends.torch_backend import TorchBackend

    trainer = TorchBackend(cfg, ckpt)
    times: dict[str, list[float]] = {"without": [], "with": []}
    for rep in range(reps + 1):  # rep 0: warm-up, untimed
        for mode in ("without", "with") if rep % 2 else ("with", "without"):  # alternate the order
            trainer.cfg.algo.routing_replay = mode == "with"
            t0 = time.perf_counter()
            metrics = trainer.train_step(data)
            if rep:
                times[mode].append(time.perf_counter() - t0)
            assert ("r3_replayed_frac" in metrics) == (mode == "with")
    return times


def mismatch(cfg, ckpt: str, data: dict, noise: float) -> dict[str, dict[str, float]]:
    from relax_train.backends.torch_backend import TorchBackend

    trainer = TorchBackend(cfg, ckpt, trainable=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    pairs = sum(r.shape[0] * LAYERS for r in data["routed_experts"])
    rollout = np.concatenate(data["rollout_log_probs"])
    out = {}
    for mode in ("without", "with"):
        trainer.cfg.algo.routing_replay = mode == "with"
        used, logp = experts_used(trainer, data)
        differ = sum(int((u != r).any(-1).sum()) for u, r in zip(used, data["routed_experts"]))
        out[mode] = {
            "differ_frac": differ / pairs,
            "mean_abs_dlogp": float(np.mean(np.abs(np.concatenate(logp) - rollout))),
        }
    return out


def main() -> None:
    from relax_app.cli_config import build_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--noise", default="0,0.0001,0.001")
    ap.add_argument("--init-range", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    print(
        f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, 1 torch thread; init std {args.init_range}"
    )
    print(f"# load before: {uptime()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt, data_path = build_inputs(root, args.init_range)
        flags = [
            "--prompt-data",
            data_path,
            "--hf-checkpoint",
            ckpt,
            "--routing-replay",
            "--rollout-batch-size",
            "16",
            "--n-samples-per-prompt",
            "4",
            "--rollout-max-response-len",
            "32",
            "--micro-batch-size",
            "64",
            "--torch-threads",
            "1",
            "--no-progress",
            "--output-dir",
            str(root / "out"),
        ]
        data = rollout_batch(build_config(None, flags), ckpt, data_path)
        lens = [len(t) for t in data["tokens"]]
        print(f"# batch: {len(lens)} sequences, {min(lens)}-{max(lens)} tokens (mean {np.mean(lens):.1f})")
        times = time_steps(build_config(None, flags), ckpt, data, args.reps)
        effects = {
            float(s): mismatch(build_config(None, flags), ckpt, data, float(s)) for s in args.noise.split(",")
        }
    print(f"# load after: {uptime()}\n")

    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"## Trainer step (train_step: forward + backward + AdamW, 64 sequences), {args.reps} reps each\n")
    print("| routing replay | median s | min-max s |")
    print("|---|---|---|")
    for m in ("without", "with"):
        print(f"| {m} | {med[m]:.3f} | {min(times[m]):.3f}-{max(times[m]):.3f} |")
    print(f"\nR3 overhead: {100 * (med['with'] / med['without'] - 1):+.1f}% (median vs median)\n")
    print("## Train-vs-rollout mismatch after perturbing the trainer's weights\n")
    print("| noise std | R3 | token-layer pairs with other experts | mean abs Δ log p (response tokens) |")
    print("|---|---|---|---|")
    for s, eff in effects.items():
        for m in ("without", "with"):
            e = eff[m]
            print(f"| {s:g} | {m} | {100 * e['differ_frac']:.1f}% | {e['mean_abs_dlogp']:.2e} |")


if __name__ == "__main__":
    main()
