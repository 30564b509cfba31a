"""TRL 1.16's plain ``GRPOTrainer`` on the same work as a relax run: the peer of relax's benchmarks.

Every setting comes from the relax config that ``flat`` builds (``config_from_flat``), so the two cannot drift.
Matched: per step rollout_batch_size prompts x n_samples_per_prompt generations (num_generations), one
generation batch of rollout_batch_size x n, optimizer steps of --global-batch-size (micro-batches of
--micro-batch-size accumulated), num_rollout steps, max_completion_length = rollout_max_response_len,
temperature, top_p (top_k off), AdamW lr (constant, no warm-up), betas, eps 1e-8, weight decay, grad-norm clip,
epsilon / epsilon_high, beta = kl_coef (TRL's KL is relax's default k3 loss term), num_iterations 1, the loss
aggregation (token-mean = TRL "dapo": the optimizer batch's token count; seq-mean-token-mean = "grpo";
seq-mean-token-sum-norm = "dr_grpo"), the advantage ((r - mean) / (std + 1e-4), unbiased std, as TRL's
scale_rewards="group"; none without --normalize-advantages-std or for dr_grpo), the data (relax's load_prompts,
prompt text as-is or with relax's chat template, no special tokens added), the policy loaded by relax's own
AutoModelForCausalLM in --dtype, transformers' default attention (no autocast: bf16/fp16 off), the seed, CPU with relax's colocate thread count, no vLLM,
no gradient checkpointing, no saving, no external logging. The reward is relax's own scorer (build_scorer:
the --rm-type reward with relax's concurrency, time-out and --reward-delay-s), and both runs are judged by
relax's GreedyEvaluator on the held-out set.

Not matched exactly:
- the prompt order: TRL's RepeatSampler shuffles with its own generator (same seed, another permutation), and
  sampling draws from another RNG stream, so runs are alike in distribution, not token for token;
- TRL computes the per-token entropy in every training forward (hard-wired, for its logs): extra work relax
  skips unless --entropy-coef > 0;
- the HF Trainer exempts biases and norm weights from weight decay (relax decays all; same at the default 0);
- with --global-batch-size below rollout_batch_size x n, TRL's "dapo" divides by the mean token count of the
  optimizer steps of a generation batch, relax by each step's own;
- TRL's GRPOTrainer is synchronous: --fully-async / --max-staleness have no counterpart (the same work, on
  policy); rollout or train backends (sglang, megatron) do not apply on this CPU peer.
Settings with no TRL counterpart are refused (ValueError), never silently dropped.

No async peer: TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer`` generates only through a vLLM
server (its AsyncRolloutWorker posts to ``/v1/completions`` at ``vllm_server_base_url``) and syncs weights with
vLLM's NCCL weight-transfer engine (WeightTransferClient); neither vLLM nor NCCL is available on this CPU.

    uv run --frozen python benchmarks/peer_trl.py --steps 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch

from relax_core.config import RelaxConfig

LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def refuse_unmatched(cfg: RelaxConfig) -> None:
    """ValueError naming each setting TRL's GRPOTrainer cannot reproduce."""
    a, r = cfg.algo, cfg.rollout
    bad = {
        "--advantage-estimator": a.advantage_estimator not in ("grpo", "dr_grpo"),
        "--policy-loss": a.policy_loss not in ("ppo", "gspo"),
        "--loss-agg-mode": a.loss_agg_mode not in LOSS_TYPES,
        "--eps-clip-c": a.eps_clip_c is not None,
        "--entropy-coef": a.entropy_coef > 0,
        "--kl-in-reward / --kl-estimator k2": a.kl_coef > 0
        and (a.kl_in_reward or a.kl_loss_estimator != "k3"),
        "--ref-checkpoint": cfg.model.ref_checkpoint not in (None, cfg.model.hf_checkpoint),
        "--teacher-checkpoint": cfg.uses_teacher,
        "--dynamic-sampling": r.dynamic_sampling,
        "--long-tail-min-tokens": r.long_tail_min_tokens > 0,
        "--env-path": r.env_path is not None,
        "--multimodal-keys": bool(cfg.data.multimodal_keys),
        "--metadata-key": cfg.data.metadata_key is not None,
    }
    if any(bad.values()):
        raise ValueError(f"no TRL GRPOTrainer counterpart for {', '.join(k for k, v in bad.items() if v)}")


def grpo_args(cfg: RelaxConfig, out_dir: pathlib.Path) -> Any:
    """The GRPOConfig of the same work (see the module docstring)."""
    from trl import GRPOConfig

    t, a, r = cfg.train, cfg.algo, cfg.rollout
    gbs, per_rollout = cfg.effective_global_batch_size, cfg.samples_per_rollout
    micro = math.gcd(t.micro_batch_size, gbs)  # per-device batch; x grad-accum = one optimizer step
    return GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        logging_steps=10,
        seed=t.seed,
        max_steps=t.num_rollout * (per_rollout // gbs),  # optimizer steps
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=gbs // micro,
        steps_per_generation=per_rollout // micro,  # generation batch = rollout_batch_size x n
        num_iterations=1,
        num_generations=r.n_samples_per_prompt,
        max_completion_length=r.rollout_max_response_len,
        temperature=r.rollout_temperature,
        top_p=r.rollout_top_p,
        top_k=0,
        use_vllm=False,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=1e-8,
        weight_decay=t.weight_decay,
        max_grad_norm=t.clip_grad,
        gradient_checkpointing=False,
        beta=a.kl_coef if a.uses_reference else 0.0,
        epsilon=a.eps_clip,
        epsilon_high=a.eps_clip_high if a.eps_clip_high is not None else a.eps_clip,
        loss_type=LOSS_TYPES[a.loss_agg_mode],
        importance_sampling_level="sequence" if a.policy_loss == "gspo" else "token",
        scale_rewards="group" if a.advantage_estimator == "grpo" and a.normalize_advantages_std else "none",
        mask_truncated_completions=False,
        shuffle_dataset=cfg.data.rollout_shuffle,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        log_completions=False,
    )


def prompt_dataset(cfg: RelaxConfig, path: str, tokenizer: Any) -> Any:
    """Rows as relax reads them: columns "prompt" (the text relax tokenizes) and "label"."""
    from datasets import Dataset

    from relax_core.data import load_prompts

    rows = load_prompts(path, cfg.data.input_key, cfg.data.label_key).rows
    texts = [row.prompt for row in rows]
    if cfg.data.apply_chat_template:
        chat = [[{"role": "user", "content": p}] for p in texts]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat]
    probe = texts[0]  # TRL tokenizes with the tokenizer's special tokens, relax without: they must agree
    if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
        raise ValueError("this tokenizer adds special tokens to a prompt; TRL would, relax does not")
    return Dataset.from_dict({"prompt": texts, "label": [row.label for row in rows]})


def relax_reward(cfg: RelaxConfig) -> Callable[..., list[float]]:
    """A TRL reward function scoring each completion with relax's own scorer (as relax's rollout does)."""
    from relax_rollout.rewards import build_scorer

    scorer = build_scorer(cfg)

    def reward(completions: list[str], label: list[Any], **_: Any) -> list[float]:
        return [res.score for res in scorer.score_batch(completions, label)]

    reward.__name__ = f"relax_{cfg.rollout.rm_type}"
    return reward


def run_trl(flat: dict, assets: Any, out_dir: pathlib.Path, attn_implementation: str | None = None) -> dict:
    """Train TRL's GRPOTrainer on the work ``flat`` configures; RL wall time, samples/s and held-out accuracy.

    The policy is loaded as a TRL user loads it, ``AutoModelForCausalLM.from_pretrained`` with transformers'
    default attention (SDPA), unless ``attn_implementation`` names another (``eager``: the kernel relax picks
    on CPU, to separate that choice from the rest of the comparison)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from relax_app.cli_config import config_from_flat
    from relax_rollout.evaluate import GreedyEvaluator

    cfg = config_from_flat(flat)
    refuse_unmatched(cfg)
    torch.set_num_threads(cfg.run.torch_threads or min(2, os.cpu_count() or 1))
    model_path = cfg.model.hf_checkpoint or str(assets.sft_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")  # TRL left-pads prompts
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.model.dtype), **extra)
    if model.config.pad_token_id != tokenizer.pad_token_id:  # TRL writes the tokenizer's into the model
        raise ValueError(f"pad id: model {model.config.pad_token_id}, tokenizer {tokenizer.pad_token_id}")
    evaluate = GreedyEvaluator(cfg, model_path, cfg.data.eval_data or str(assets.eval_path))
    accuracy_before = evaluate(model)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=relax_reward(cfg),
        args=grpo_args(cfg, out_dir),
        train_dataset=prompt_dataset(cfg, cfg.data.prompt_data or str(assets.train_path), tokenizer),
        processing_class=tokenizer,
    )
    t0 = time.perf_counter()
    trainer.train()
    rl_wall_s = time.perf_counter() - t0

    accuracy = evaluate(trainer.accelerator.unwrap_model(trainer.model))
    samples = cfg.train.num_rollout * cfg.samples_per_rollout
    return {
        "rl_wall_s": rl_wall_s,
        "samples": samples,
        "samples_per_s": samples / rl_wall_s,
        "accuracy": accuracy,
        "accuracy_before": accuracy_before,
    }


def main() -> None:
    from relax_app.demo.assets import prepare_demo
    from relax_app.demo.defaults import DEMO_DEFAULTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/peer_trl")
    args = ap.parse_args()
    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    flat = {
        **DEMO_DEFAULTS,
        "num_rollout": args.steps,
        "prompt_data": str(assets.train_path),
        "hf_checkpoint": str(assets.sft_model_dir),
        "output_dir": args.out,
        "seed": 0,
    }
    print(json.dumps(run_trl(flat, assets, pathlib.Path(args.out)), indent=2))


if __name__ == "__main__":
    main()
