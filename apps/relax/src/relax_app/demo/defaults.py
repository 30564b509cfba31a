"""Run settings of the CPU demo (`relax train` with no config); any flag still overrides them.

Every value the demo relies on is set here, also where it equals the library's default today: the library's
defaults are for real runs (a pretrained model, slime's and veRL's values) and may change; the demo's results
must not (``apps/relax/tests/demo/test_demo_config.py`` pins the whole config it builds)."""

DEMO_DEFAULTS: dict[str, object] = {
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "rollout_max_response_len": 6,  # answers are a few digits (the library's 512 is for real tasks)
    "rollout_temperature": 1.0,
    "num_rollout": 100,
    "micro_batch_size": 64,
    "use_dynamic_batch_size": True,  # micro-batches packed by tokens: ~20% off a training step (BENCHMARKS)
    "max_tokens_per_gpu": 2048,
    "lr": 2e-4,  # a tiny model trained from a warm start in minutes (the library's 1e-6 is for a pretrained one)
    "weight_decay": 0.0,
    "adam_beta2": 0.99,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "eval_interval": 10,
    "eval_rm_type": "math",  # held-out accuracy is the task's, whatever --rm-type trains on
    "output_dir": "runs/demo",
}

DEMO_LORA_LR = 1e-3
"""The demo's learning rate with ``--lora-rank`` (and no ``--lr``): LoRA's adapters start at zero (B = 0) and
take larger steps than full fine-tuning's 2e-4, as LoRA runs use. Measured on the demo (rank 8, one seed):
held-out 0.444 -> 0.658 at 2e-4, -> 0.708 at 1e-3 (full fine-tuning: -> 0.728); BENCHMARKS.md (#37)."""
