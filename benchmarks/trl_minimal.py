"""A minimal TRL GRPO script, written as TRL's documentation shows one, to check our TRL harness against.

``peer_trl.py`` derives every TRL setting from a relax config (so the two engines cannot drift); if that
derivation slowed TRL down, every "relax vs TRL" ratio would flatter relax. This script shares none of its
code: the demo's work typed out by hand from the README's numbers — float32 (GRPOConfig's default is bf16
autocast: 463 samples/s against the harness's 597 on seed 0, 2026-12-05), 32 prompts x 8 completions a step, 6 new
tokens, temperature 1, AdamW at lr 2e-4 (betas 0.9 / 0.99, no decay), clip 0.2 / 0.28, no KL, the "dapo"
(token-mean) loss, one optimizer step of 256 samples in micro-batches of 64 — the dataset read with
``datasets``, a plain reward function (the number after the prompt equals the label), the model loaded with
``AutoModelForCausalLM.from_pretrained``. ``peers.py --runners trl,trl_minimal`` runs both interleaved; their
samples/s must agree within 5% (BENCHMARKS.md).

    uv run python benchmarks/peers.py --runners trl,trl_minimal --repeats 3
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch


def answer_reward(completions: list[str], label: list[str], **_: Any) -> list[float]:
    """1 when the completion's first number is the label, else 0."""
    out = []
    for text, want in zip(completions, label):
        got = re.match(r"\s*(-?\d+)", text)
        out.append(1.0 if got and got.group(1) == str(want) else 0.0)
    return out


def run_minimal(model_dir: str, train_jsonl: str, out_dir: Path, seed: int, steps: int) -> dict:
    """Train ``steps`` steps of the demo's work with TRL; RL wall time and samples/s (training only)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = load_dataset("json", data_files=train_jsonl, split="train").select_columns(["prompt", "label"])
    args = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,  # (GRPOConfig's default is bf16 autocast; relax and the harness train in float32)
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=64,
        gradient_accumulation_steps=4,
        steps_per_generation=4,
        num_generations=8,
        max_completion_length=6,
        temperature=1.0,
        top_k=0,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        adam_beta2=0.99,
        weight_decay=0.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=answer_reward, args=args, train_dataset=data, processing_class=tokenizer
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    return {"rl_wall_s": wall, "samples": steps * 256, "samples_per_s": steps * 256 / wall}
