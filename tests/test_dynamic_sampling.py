"""DAPO dynamic sampling end to end: every trained batch is full and holds only informative groups (rewards
not all equal), in colocate and in fully-async mode, with the dropped groups counted."""

from __future__ import annotations

import pytest

from relax_app.cli_config import build_config
from relax_core.controller import Controller, RunInputs

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

STEPS = 4


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode", [["--colocate"], ["--fully-async", "--max-staleness", "1"]], ids=["colocate", "async"]
)
def test_every_trained_batch_is_full_of_informative_groups(tiny_run_inputs, tmp_path, mode):
    digit_task = RunInputs(tiny_run_inputs.model_path, tiny_run_inputs.prompt_path, None)
    cfg = build_config(
        None,
        [
            "--prompt-data",
            digit_task.prompt_path,
            "--hf-checkpoint",
            digit_task.model_path,
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--rollout-max-response-len",
            "3",
            "--rollout-temperature",
            "1.5",
            "--rm-type",
            "relax_testing:parity_reward",
            "--num-rollout",
            str(STEPS),
            "--micro-batch-size",
            "16",
            "--dynamic-sampling",
            "--dynamic-sampling-max-rounds",
            "40",
            "--torch-threads",
            "1",
            "--no-progress",
            "--no-tensorboard",
            "--output-dir",
            str(tmp_path / "out"),
            *mode,
        ],
    )
    result = Controller(cfg, digit_task).run()
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == STEPS
    assert len(result.audit["trained_ids"]) == STEPS * cfg.samples_per_rollout
    for h in steps:
        assert h["perf/samples"] == cfg.samples_per_rollout
        assert h["rollout/groups"] == cfg.rollout.rollout_batch_size
        assert h["rollout/uninformative_groups"] == 0, h
        assert h["rollout/ds_unfilled_groups"] == 0
    # the filter really worked: groups were generated and dropped along the way
    assert result.rollout_stats["ds_dropped_groups"] > 0
    assert sum(h["rollout/ds_dropped_groups"] for h in steps) > 0
