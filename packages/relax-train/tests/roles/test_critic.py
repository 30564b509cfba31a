"""The Critic role (#39) on a real bus and a real value model: it writes values with its version before it
trains, trains once per rollout batch's worth of samples, saves its state at checkpoint steps, and loads the
state saved beside a trainer checkpoint (or the newest before it), optimizer included, exactly."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from relax_bus import DataBus  # noqa: E402
from relax_core import sample  # noqa: E402
from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.roles import RolePlan  # noqa: E402
from relax_train.roles.critic import CriticWorker  # noqa: E402

SEQS = [([3, 12, 4, 13], [5, 6, 1]), ([7, 12, 8, 12, 9, 13], [10, 4])]


def _cfg(tmp_path, prompts: int = 1, **critic) -> RelaxConfig:
    return RelaxConfig.model_validate(
        {
            "run": {"output_dir": str(tmp_path / "out"), "trace": False, "tensorboard": False},
            "train": {"micro_batch_size": 2, "lr": 1e-2, "save": str(tmp_path / "ckpt"), "save_interval": 2},
            "rollout": {"rollout_batch_size": prompts, "n_samples_per_prompt": len(SEQS)},
            "algo": {"advantage_estimator": "gae"},
            "critic": {"critic_epochs": 2, **critic},
        }
    )


def _put(bus, step: int, reward: float = 1.0) -> list[int]:
    rows = []
    for k, (p, r) in enumerate(SEQS):
        rows.append(
            {
                sample.TOKENS: np.asarray(p + r, dtype=np.int64),
                sample.PROMPT_LEN: len(p),
                sample.RESPONSE_LEN: len(r),
                sample.LOSS_MASK: np.ones(len(r), dtype=np.float32),
                sample.ROLLOUT_LOG_PROBS: np.full(len(r), -2.0, dtype=np.float32),
                sample.REWARD: reward if k == 0 else 0.0,
                sample.GROUP_ID: f"{step}:0",
                sample.POLICY_VERSION: step,
            }
        )
    return bus.put(rows, partition=f"step{step}")


def _values_on_bus(bus) -> dict:
    """What the Advantages role gets: the critic's fields (it needs ``values``)."""
    got = bus.get("advantages", n=len(SEQS), timeout=5.0)
    bus.ack("advantages", got.lease_id)
    return got.data


@pytest.fixture
def run(tmp_path, tiny_model_dir):
    cfg = _cfg(tmp_path)
    bus = DataBus(RolePlan.from_config(cfg).bus_config())
    return cfg, bus, CriticWorker(cfg, bus, "critic", tiny_model_dir)


def test_values_go_on_the_bus_before_the_critic_trains_on_them(run, tmp_path):
    cfg, bus, critic = run
    _put(bus, 0)
    assert critic.drain() == len(SEQS)
    d = _values_on_bus(bus)
    assert [len(v) for v in d[sample.VALUES]] == [len(r) for _, r in SEQS]
    assert all(np.all(v == 0) for v in d[sample.VALUES])  # a fresh (zero) head: the values before training
    assert d[sample.VALUES_VERSION] == [0, 0] and d[sample.CRITIC_UPDATE] == [{}, {}]
    assert critic.backend.version == 1  # then it trained on the batch
    _put(bus, 1)
    critic.drain()
    d = _values_on_bus(bus)
    assert d[sample.VALUES_VERSION] == [1, 1] and any(np.any(v != 0) for v in d[sample.VALUES])
    update = d[sample.CRITIC_UPDATE][0]
    assert update["critic/version"] == 1 and np.isfinite(update["critic/value_loss"])
    assert update["critic/optimizer_steps"] == cfg.critic.critic_epochs  # K passes of one optimizer step
    # a checkpoint step (--save-interval 2): its state beside the trainer's step_000002
    assert (tmp_path / "ckpt" / "critic" / "step_000002" / "meta.json").is_file()
    assert not (tmp_path / "ckpt" / "critic" / "step_000001").exists()


def test_a_part_of_a_batch_is_valued_at_once_and_trained_with_the_rest(tmp_path, tiny_model_dir):
    """Fully async hands out whatever groups are ready: each is valued as it comes, but the critic trains
    on a whole rollout batch's worth (here two groups), so its version counts rollout steps as the
    trainer's does."""
    cfg = _cfg(tmp_path, prompts=2)
    bus = DataBus(RolePlan.from_config(cfg).bus_config())
    critic = CriticWorker(cfg, bus, "critic", tiny_model_dir)
    critic.batch_size = len(SEQS)  # (one group at a time)
    _put(bus, 0)
    critic.drain()
    assert critic.backend.version == 0 and len(critic._pending) == 2  # half a batch: valued, not trained
    assert len(_values_on_bus(bus)[sample.VALUES]) == 2
    _put(bus, 1)
    critic.drain()
    assert critic.backend.version == 1 and not critic._pending


def test_load_state_takes_the_step_of_the_checkpoint_or_the_newest_before(
    run, tmp_path, tiny_model_dir, caplog
):
    cfg, bus, critic = run
    for step in range(3):
        _put(bus, step, reward=float(step))
        critic.drain()
        _values_on_bus(bus)
        if step == 1:  # (saved at step 2: its state now)
            saved_opt = {k: v.clone() for k, v in _flat_optimizer(critic.backend).items()}
            saved_w = {k: v.clone() for k, v in critic.backend.model.state_dict().items()}
    fresh = CriticWorker(cfg, DataBus(RolePlan.from_config(cfg).bus_config()), "critic", tiny_model_dir)
    assert fresh.load_state(str(tmp_path / "ckpt" / "step_000002")) == 2
    got = _flat_optimizer(fresh.backend)
    assert set(got) == set(saved_opt) and all(torch.equal(got[k], saved_opt[k]) for k in got)
    w = fresh.backend.model.state_dict()
    assert all(torch.equal(w[k], saved_w[k]) for k in saved_w)
    with caplog.at_level(logging.WARNING, logger="relax_train.roles.critic"):
        assert fresh.load_state(str(tmp_path / "ckpt" / "step_000005")) == 2  # stopped between two saves
    assert "no state saved for step 5" in caplog.text
    # a stop by signal writes the trainer's checkpoint off schedule: the critic's state goes beside it
    critic.save_state(str(tmp_path / "ckpt" / "step_000003"))
    assert fresh.load_state(None) == 3  # a restart in place: the newest


def _flat_optimizer(backend) -> dict:
    out = {}
    for i, st in backend.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"{i}.{k}"] = v
    return out
