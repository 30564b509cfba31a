"""Run settings of the CPU demo (`relax train` with no config); any flag still overrides them."""

DEMO_DEFAULTS: dict[str, object] = {
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "rollout_max_response_len": 6,
    "rollout_temperature": 1.0,
    "num_rollout": 100,
    "micro_batch_size": 64,
    "use_dynamic_batch_size": True,  # micro-batches packed by tokens: ~20% off a training step (BENCHMARKS)
    "max_tokens_per_gpu": 2048,
    "lr": 2e-4,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "eval_interval": 10,
    "eval_rm_type": "math",  # held-out accuracy is the task's, whatever --rm-type trains on
    "output_dir": "runs/demo",
}
