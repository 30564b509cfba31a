"""A few real RL steps in each mode; asserts what flowed between the roles."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from relax_core.cli_config import build_config
from relax_core.controller import Controller

STEPS = 4


def _run(inputs, tmp_path, *flags):
    cfg = build_config(
        None,
        [
            "--prompt-data",
            inputs.prompt_path,
            "--hf-checkpoint",
            inputs.model_path,
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--rollout-max-response-len",
            "4",
            "--num-rollout",
            str(STEPS),
            "--micro-batch-size",
            "8",
            "--eval-interval",
            "2",
            "--kl-coef",
            "0.01",
            "--verify-weight-sync",
            "--torch-threads",
            "1",
            "--no-progress",
            "--output-dir",
            str(tmp_path / "out"),
            *flags,
        ],
    )
    return cfg, Controller(cfg, inputs).run()


def _check_flow(cfg, result, max_staleness):
    spr = cfg.samples_per_rollout
    trained = result.audit["trained_ids"]
    assert len(trained) == STEPS * spr == len(set(trained))
    consumed = result.audit["consumed"]
    assert set(consumed) == {"advantages", "actor_fwd", "reference", "actor_train"}
    for name, ids in consumed.items():
        assert len(ids) == len(set(ids)), f"{name} consumed a sample twice"
        assert set(trained) <= set(ids), f"{name} missed a trained sample"
    assert sorted(consumed["actor_train"]) == sorted(trained)
    # rollout batches are put in step order, so the first STEPS batches are exactly what was trained
    assert sorted(trained) == sorted(consumed["advantages"])[: STEPS * spr]
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == STEPS
    for h in steps:
        assert math.isfinite(h["train/loss"]) and math.isfinite(h["train/grad_norm"])
        # bus/* metrics (logged before the step acks its batch: it acks after its checkpoint)
        assert h["bus/consumers/actor_train/delivered"] > 0 and "bus/depth/step0" not in h
        assert 0 <= h["train/staleness_max"] <= max_staleness
    assert max(result.bus_stats["staleness_hist"]) <= max_staleness
    # the rollout engine held exactly the trainer's weights after every sync (version + checksum)
    trainer, rollout = result.audit["trainer_weights"], result.audit["rollout_weights"]
    assert sorted(trainer) == list(range(STEPS + 1))
    assert {v: rollout[v] for v in trainer} == trainer
    assert len(result.eval_curve) >= 2


@pytest.mark.integration
def test_colocate_flow(tiny_run_inputs, tmp_path):
    cfg, result = _run(tiny_run_inputs, tmp_path, "--colocate")
    assert result.mode == "colocate"
    _check_flow(cfg, result, max_staleness=0)


@pytest.mark.integration
@pytest.mark.parametrize(
    "staleness, sync",
    [(0, []), (1, []), (1, ["--weight-sync-transport", "ipc"])],
    ids=["on-policy", "staleness-1", "staleness-1-ipc"],
)
def test_fully_async_flow(tiny_run_inputs, tmp_path, staleness, sync):
    """Weights reach the roles overlapped with the next step (the default), by broadcast or, with
    ``ipc``, from the trainer's shared-memory buffers."""
    cfg, result = _run(tiny_run_inputs, tmp_path, "--fully-async", "--max-staleness", str(staleness), *sync)
    assert result.mode == "fully_async"
    _check_flow(cfg, result, max_staleness=staleness)
    if staleness == 1:
        # with one step of slack rollout really runs ahead: some trained samples are one version old
        assert any(h["train/staleness_max"] == 1 for h in result.history if "train/loss" in h)


@pytest.mark.integration
@pytest.mark.slow
def test_fully_async_with_the_megatron_backend(tiny_run_inputs, tmp_path):
    """``--train-backend megatron`` (megatron-core's model code on CPU, one process per role): the
    trainer, ActorFwd and the reference are megatron models; weights reach the rollout engine in HF names
    through DCS; step 1 trains on the same samples with the same loss as the torch backend's run."""
    pytest.importorskip("megatron.core")
    flags = ["--fully-async", "--max-staleness", "0"]
    cfg, result = _run(tiny_run_inputs, tmp_path / "megatron", *flags, "--train-backend", "megatron")
    # every sample flowed through each role once; the rollout engine held exactly the trainer's weights
    # (checksums over the HF-named tensors megatron exported) after every sync; evaluation ran
    _check_flow(cfg, result, max_staleness=0)

    _, ref = _run(tiny_run_inputs, tmp_path / "torch", *flags)
    first = next(h for h in result.history if "train/loss" in h)
    first_ref = next(h for h in ref.history if "train/loss" in h)
    # same seed and initial weights: the same prompts and rollouts, so the same loss and gradient
    assert result.audit["trained_prompts"][0] == ref.audit["trained_prompts"][0]
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/ratio_mean"):
        assert first[key] == pytest.approx(first_ref[key], rel=1e-3, abs=1e-6), key


@pytest.mark.integration
@pytest.mark.slow
def test_tensor_parallel_megatron_roles_run_as_rank_groups(tiny_run_inputs, tmp_path):
    """Two ranks per megatron role (``--actor-num-gpus-per-node 2``; CPU processes here): the trainer,
    ActorFwd and the reference each run as a rank group with TP=2 inside a fully-async run, and step 1
    matches the torch backend's."""
    pytest.importorskip("megatron.core")
    import shutil

    import transformers

    model = tmp_path / "kv2"  # TP=2 splits the KV heads: the tiny model needs two
    cfg = transformers.AutoConfig.from_pretrained(tiny_run_inputs.model_path)
    cfg.num_key_value_heads = 2
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(model)
    for f in Path(tiny_run_inputs.model_path).iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy2(f, model / f.name)
    inputs = dataclasses.replace(tiny_run_inputs, model_path=str(model))
    flags = ["--fully-async", "--max-staleness", "0"]
    tp2 = [
        "--train-backend",
        "megatron",
        "--actor-num-gpus-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
    ]
    cfg, result = _run(inputs, tmp_path / "tp2", *flags, *tp2)
    _check_flow(cfg, result, max_staleness=0)
    _, ref = _run(inputs, tmp_path / "torch", *flags)
    first = next(h for h in result.history if "train/loss" in h)
    first_ref = next(h for h in ref.history if "train/loss" in h)
    assert result.audit["trained_prompts"][0] == ref.audit["trained_prompts"][0]
    for key in ("train/loss", "train/grad_norm", "train/kl"):
        assert first[key] == pytest.approx(first_ref[key], rel=1e-3, abs=1e-6), key
