"""The torch engine serving LoRA: adapter updates (wire format) from a LoRA trainer, over DCS too, give the
trainer's own log-probs; merged full weights into a plain engine do as well; the checksums agree."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.dcs import WeightReceiver, WeightSender, checksum  # noqa: E402
from relax_core.lora import peft_config_dict  # noqa: E402
from relax_core.net import free_port  # noqa: E402
from relax_rollout.engines.base import SamplingParams  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402

PROMPTS = [[3, 12, 4, 13], [7, 12, 8], [4, 13, 5, 6, 9]]


def config(mode: str, backend: str = "torch") -> RelaxConfig:
    return RelaxConfig.model_validate(
        {
            "train": {"micro_batch_size": 4, "lr": 2e-2, "weight_decay": 0.0},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": 3, "rollout_backend": backend}
            | ({"rollout_num_gpus": 1} if backend == "sglang" else {}),
            "lora": {
                "lora_rank": 4,
                "lora_target_modules": ["q_proj", "v_proj", "down_proj"],
                "lora_sync_mode": mode,
            },
        }
    )


def _samples(prompts, outs):
    return {
        "tokens": [np.asarray(p + o.token_ids) for p, o in zip(prompts, outs)],
        "prompt_len": [len(p) for p in prompts],
        "loss_mask": [np.ones(len(o.token_ids), dtype=np.float32) for o in outs],
        "advantages": [
            np.full(len(o.token_ids), a, dtype=np.float32) for o, a in zip(outs, (1.0, -1.0, 0.5))
        ],
        "rollout_log_probs": [np.asarray(o.log_probs, dtype=np.float32) for o in outs],
    }


def _trained(cfg, model_dir):
    """A LoRA trainer one step away from the base, with what a plain engine sampled (its batch)."""
    from relax_train.backends.torch_backend import TorchBackend

    be = TorchBackend(cfg, model_dir)
    base = TorchEngine(model_path=model_dir, eos_token_ids=[1], pad_token_id=0)
    outs = base.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0))
    be.train_step(_samples(PROMPTS, outs))
    return be


def _assert_engine_matches(engine, be):
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=1))
    for o, r in zip(outs, be.compute_log_probs(_samples(PROMPTS, outs))):
        np.testing.assert_allclose(o.log_probs, r, atol=1e-4)
    assert all(o.weight_version == be.version for o in outs)


def test_adapter_sync_gives_the_trainer_log_probs(tiny_model_dir):
    cfg = config("adapter")
    from relax_rollout.engine_factory import engine_kwargs

    extra = engine_kwargs(cfg)
    assert extra["lora"] == peft_config_dict(cfg.lora)
    assert engine_kwargs(config("adapter", "sglang"))["lora"] == extra["lora"]
    assert "lora" not in engine_kwargs(config("merged"))
    be = _trained(cfg, tiny_model_dir)
    engine = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0, **extra)
    named = be.named_weights()
    full = sum(p.numel() * p.element_size() for p in engine.model.get_base_model().parameters())
    assert sum(t.numel() * t.element_size() for _, t in named) < full / 10
    engine.update_weights(dict(named), be.version)
    _assert_engine_matches(engine, be)
    assert engine.weights_checksum() == checksum(be.named_weights())  # --verify-weight-sync
    bad = {**dict(named), "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}
    with pytest.raises(KeyError, match="unknown"):
        engine.update_weights(bad, be.version + 1)
    assert engine.weight_version == be.version  # refused whole: nothing loaded, the version kept


def test_adapter_update_over_dcs(tiny_model_dir):
    cfg = config("adapter")
    be = _trained(cfg, tiny_model_dir)
    engine = TorchEngine(
        model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0, lora=peft_config_dict(cfg.lora)
    )
    init = f"tcp://127.0.0.1:{free_port()}"
    recv = WeightReceiver(init, 2, 1, timeout_s=30)
    sender = WeightSender(init, 2, bucket_bytes=1 << 14, timeout_s=30)
    t = threading.Thread(target=recv.connect)
    t.start()
    sender.connect()
    t.join()
    recv.start_background(lambda v, ts: engine.update_weights(ts, v))
    sender.broadcast(be.named_weights(), version=be.version)
    sender.close()
    recv.join(timeout=30)
    recv.check()
    recv.close()
    assert engine.weights_checksum() == checksum(be.named_weights())
    _assert_engine_matches(engine, be)


def test_merged_sync_into_a_plain_engine(tiny_model_dir):
    be = _trained(config("merged"), tiny_model_dir)
    engine = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0)
    engine.update_weights(dict(be.named_weights()), be.version)
    _assert_engine_matches(engine, be)
    assert engine.weights_checksum() == checksum(be.named_weights())


def test_the_adapter_is_served_merged_and_each_update_starts_from_the_exact_base(tiny_model_dir):
    """Served merged (generation at the base model's cost): every adapted layer takes the merged path, and
    an update restores the base weights bit for bit before merging the next adapter, so no rounding adds up
    over a run: after a zero adapter the weights are exactly the checkpoint's."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from relax_core.lora import adapter_state, base_parameters
    from relax_core.models import load_model

    cfg = config("adapter")
    engine = TorchEngine(
        model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0, lora=peft_config_dict(cfg.lora)
    )
    layers = [m for m in engine.model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and all(m.merged for m in layers)
    be = _trained(cfg, tiny_model_dir)
    for _ in range(3):  # several updates: still the trainer's log-probs
        engine.update_weights(dict(be.named_weights()), be.version)
    _assert_engine_matches(engine, be)
    assert all(m.merged for m in layers)
    zero = {n: torch.zeros_like(t) for n, t in adapter_state(engine.model).items()}
    engine.update_weights(zero, be.version + 1)
    plain = dict(load_model(tiny_model_dir).named_parameters())
    assert all(torch.equal(p, plain[n]) for n, p in base_parameters(engine.model))
