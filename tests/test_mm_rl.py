"""Omni-modal RL on CPU: tiny random-weight Qwen2.5-VL / Qwen3-VL / Qwen3-Omni (thinker) models, a locally
trained tokenizer extended with their special tokens, and generated image / video / audio tasks.

What must line up for multimodal RL to be right: the rollout engine and the trainer see the same
placeholders, M-RoPE positions and media features for a sample. If anything differs (a placeholder count,
a grid, padding, a dropped tensor), the trainer's recomputed log-probs of the sampled tokens differ from the
engine's; so the check is that they agree to 1e-4 in float32, per model and modality, through the real
path (RolloutWorker → relax-multimodal → TorchEngine → bus → TorchBackend).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from _tiny import mm_checkpoint, mm_dataset, mm_task, run_flags

from relax_app.cli_config import build_config

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

torch = pytest.importorskip("torch")

FAMILY_TASKS = {
    "qwen2_5_vl": ("image", "video"),
    "qwen3_vl": ("image", "video"),
    "qwen3_omni": ("image", "video", "audio"),
}


@pytest.fixture(scope="module")
def mm_root(tmp_path_factory):
    return tmp_path_factory.mktemp("mm")


def _cfg(ckpt, data, out_dir, *flags):
    """3 prompts x 2 samples of the multimodal task (every medium), one micro-batch per step."""
    from relax_core.controller import RunInputs

    sizes = dict(rollout_batch_size=3, n_samples_per_prompt=2, micro_batch_size=6)
    return build_config(None, run_flags(RunInputs(ckpt, data), out_dir, *flags, **mm_task(), **sizes))


@pytest.mark.integration
@pytest.mark.parametrize(
    "family,modality", [(f, m) for f, ms in FAMILY_TASKS.items() for m in ms], ids=lambda x: str(x)
)
def test_rollout_log_probs_equal_trainer_log_probs(mm_root, tmp_path, family, modality):
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker
    from relax_train.backends.torch_backend import TorchBackend

    torch.set_num_threads(1)
    ckpt, data = mm_checkpoint(mm_root, family), mm_dataset(mm_root, (modality,))
    cfg = _cfg(ckpt, data, tmp_path)
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, ckpt, data)
    worker.produce(0)
    batch = bus.get("c", 6, timeout=5)
    assert all(m is not None and m["mm_token_type_ids"].max() > 0 for m in batch.data["mm"])
    trainer = TorchBackend(cfg, ckpt, trainable=False).compute_log_probs(batch.data)
    for k, (mine, theirs) in enumerate(zip(batch.data["rollout_log_probs"], trainer)):
        assert len(mine) == len(theirs) == batch.data["response_len"][k] > 0
        np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=0)


@pytest.mark.integration
def test_qwen3_vl_with_lora_rolls_out_and_scores_as_the_trainer(mm_root, tmp_path):
    """Qwen3-VL's M-RoPE needs ``mm_token_type_ids``; with LoRA the model is a peft wrapper whose ``forward``
    takes ``**kwargs``, and the engine and the trainer read the wrapper's signature: neither passed them and
    the rollout raised (found by `relax ui`'s browser test, #56). Both now look through the wrapper."""
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker
    from relax_train.backends.torch_backend import TorchBackend

    torch.set_num_threads(1)
    ckpt, data = mm_checkpoint(mm_root, "qwen3_vl"), mm_dataset(mm_root, ("image",))
    cfg = _cfg(ckpt, data, tmp_path, "--lora-rank", "4")
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    RolloutWorker(cfg, bus, ckpt, data).produce(0)
    batch = bus.get("c", 6, timeout=5)
    backend = TorchBackend(cfg, ckpt)
    assert backend.lora is not None and backend.takes_token_types
    for mine, theirs in zip(batch.data["rollout_log_probs"], backend.compute_log_probs(batch.data)):
        np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=0)


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode",
    [["--colocate"], ["--fully-async", "--max-staleness", "1", "--lora-rank", "4"]],
    ids=["colocate", "async-lora"],
)
def test_omni_rl_mixed_batch_runs_in_both_modes(mm_root, tmp_path, mode):
    """The Omni thinker on image, video and audio in one batch, in colocate and fully async; the async run
    trains LoRA adapters (#37: on the language model only, the towers frozen; adapters synced alone)."""
    from relax_core.controller import Controller, RunInputs

    ckpt, data = mm_checkpoint(mm_root, "qwen3_omni"), mm_dataset(mm_root, ("image", "video", "audio"))
    steps = 3
    # rows interleave image, video, audio: unshuffled, every batch of 3 prompts holds all three modalities
    cfg = _cfg(ckpt, data, tmp_path / "out", *mode, "--num-rollout", str(steps), "--no-rollout-shuffle")
    result = Controller(cfg, RunInputs(ckpt, data, None)).run()
    trained = [h for h in result.history if "train/loss" in h]
    assert len(trained) == steps
    assert all(math.isfinite(h["train/loss"]) and math.isfinite(h["train/grad_norm"]) for h in trained)
    assert len(result.audit["trained_ids"]) == steps * cfg.samples_per_rollout
    assert result.rollout_stats.get("bad_media_rows", 0) == 0
    if "--lora-rank" in mode:  # the adapters travel, a small part of the model
        from safetensors import safe_open

        with safe_open(str(Path(ckpt) / "model.safetensors"), "pt") as f:
            full = sum(f.get_tensor(k).nbytes for k in f.keys())
        assert all(0 < h["perf/weight_sync_bytes"] < full / 5 for h in trained), full


MEGATRON_SHAPES = {  # (megatron wants sequence parallelism with TP for MoE models)
    "qwen3_vl": ("image", "video"),
    "qwen3_omni": ("image", "audio"),  # an MoE decoder, the experts TP-split
}


@pytest.mark.shared_ray(False)  # (asserts the run stops the cluster it started)
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("family", list(MEGATRON_SHAPES))
def test_multimodal_model_trains_on_a_megatron_rank_group_in_colocate_mode(mm_root, tmp_path, family):
    """The multimodal recipes' shape on CPU: the model trained by megatron (HF's media encoders in front of
    megatron's decoder) with TP 2 and sequence parallelism (rank 1 a Ray actor), time-sharing the device with the rollout engine
    (``--colocate --offload``). The engine holds exactly the trainer's weights after every sync (HF names,
    the encoders' included), and step 1 equals the torch backend's."""
    pytest.importorskip("megatron.core")
    import ray

    from relax_core.controller import Controller, RunInputs

    ckpt, data = mm_checkpoint(mm_root, family), mm_dataset(mm_root, MEGATRON_SHAPES[family])
    common = ["--colocate", "--no-rollout-shuffle", "--kl-coef", "0.01", "--verify-weight-sync"]
    ref = Controller(
        _cfg(ckpt, data, tmp_path / "torch", *common, "--num-rollout", "1"), RunInputs(ckpt, data, None)
    ).run()
    megatron = [
        "--train-backend",
        "megatron",
        "--actor-num-gpus-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--offload",
    ]
    cfg = _cfg(ckpt, data, tmp_path / "megatron", *common, *megatron, "--num-rollout", "2")
    result = Controller(cfg, RunInputs(ckpt, data, None)).run()
    assert not ray.is_initialized()
    trained = [h for h in result.history if "train/loss" in h]
    assert len(trained) == 2 and len(result.audit["trained_ids"]) == 2 * cfg.samples_per_rollout
    trainer, rollout = result.audit["trainer_weights"], result.audit["rollout_weights"]
    assert sorted(trainer) == [0, 1, 2] and {v: rollout[v] for v in trainer} == trainer
    first, first_ref = trained[0], next(h for h in ref.history if "train/loss" in h)
    assert result.audit["trained_prompts"][0] == ref.audit["trained_prompts"][0]
    for key in ("train/loss", "train/grad_norm", "train/kl"):
        assert first[key] == pytest.approx(first_ref[key], rel=1e-3, abs=1e-6), key
