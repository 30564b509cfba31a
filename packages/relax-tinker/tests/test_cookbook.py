"""tinker-cookbook's ``math_rl`` recipe, unmodified, against our server: ``python -m
tinker_cookbook.recipes.math_rl.train`` with only its own command-line arguments (``base_url``, the local
model as ``model_name``, sizes, a loss we serve) trains LoRA RL on its ``arithmetic`` environment for 30 steps,
and its reward rises. The model is a tiny Qwen3 warmed up on the task's format (answer, then the format's
stop sequence in a quarter of the examples): the recipe's reward marks an answer without that stop -0.1, and
RL learns to end with it. (With half, the format started near 0.6 and the rise it left, ~0.03, was within
two standard deviations of the correctness's noise over 8 steps: CI saw 0.009 -> 0.013 once; a quarter
measured -0.055 -> 0.018 and -0.045 -> 0.016 here, -0.010 -> 0.009 in a loaded CI.) The sampler is Relax's engine server in a process of its own, each adapter snapshot
broadcast to it over DCS; the recipe's own per-step comparison of the sampler's and the trainer's log-probs
of the same tokens shows they agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tinker_cookbook")
from tinker_tasks import Server  # noqa: E402

from relax_testing.tinker_task import warm_start  # noqa: E402

STEPS = 30


@pytest.mark.slow
@pytest.mark.integration
def test_the_cookbooks_math_rl_recipe_runs_unmodified_and_its_reward_rises(tiny_model, tmp_path):
    model = warm_start(tiny_model, str(tmp_path / "warm"), stop_share=0.25)
    server = Server(model, tmp_path / "checkpoints", sampler="process")  # (adapters go to it over DCS)
    log = tmp_path / "math_rl"
    args = [
        f"base_url={server.url}",
        f"model_name={model}",
        "renderer_name=role_colon",  # (a local model is in no catalogue: the recipe asks for its renderer)
        "env=arithmetic",
        "groups_per_batch=8",
        "group_size=4",
        "max_tokens=10",
        "lora_rank=8",
        "learning_rate=1e-3",
        f"max_steps={STEPS}",
        "save_every=10",
        "loss_fn=importance_sampling",  # (its default, stable_reinforce, has no published formula: refused)
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
    ]
    env = {**os.environ, "TINKER_API_KEY": "tml-relax-tests", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        server.close()
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == STEPS
    reward = [r["env/all/reward/total"] for r in steps]
    fmt = [r["env/all/format"] for r in steps]
    first, last = sum(reward[:8]) / 8, sum(reward[-8:]) / 8
    print(f"reward {first:.3f} -> {last:.3f}; format {sum(fmt[:8]) / 8:.2f} -> {sum(fmt[-8:]) / 8:.2f}")
    # the reward rises (its format part by ~0.06; the correctness's noise over 8 steps is ~0.015 either way:
    # CI measured +0.018 once under load, locally +0.07 and +0.06), the format strongly
    assert last > first and sum(fmt[-8:]) > sum(fmt[:8]) + 1.0, (reward, fmt)
    # the sampler and the trainer score the same tokens alike (the recipe's own per-step comparison)
    kl = [abs(r["optim/kl_sample_train_v1"]) for r in steps]
    assert max(kl) < 1e-4, kl
    # the recipe's own checkpoints went through save_weights / save_weights_for_sampler to our disk
    saved = [json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines()]
    assert saved and all(c["state_path"].startswith("tinker://") for c in saved)
