"""π_prox from the training forward (no ActorFwd when a batch is one optimizer step): the same loss,
gradients and update as the ActorFwd forward it replaces, bit for bit; eval-mode log-probs for a model with
dropout; ``train/prox_gap_max`` shows a π_prox that is not the trainer's policy."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_train.backends.torch_backend import TorchBackend  # noqa: E402
from relax_train.roles.prox import exact_prox  # noqa: E402

# prompt + response token ids of different lengths: three samples in two micro-batches (of 2 and 1)
SEQS = [([3, 12, 4, 13], [5, 6, 1]), ([7, 12, 8, 12, 9, 13], [10]), ([4, 13], [3, 3, 3, 3, 1])]


def _cfg(mode: str = "colocate", **algo) -> RelaxConfig:
    return RelaxConfig.model_validate(
        {
            "run": {"mode": mode, "max_staleness": 1 if mode == "fully_async" else 0},
            "train": {"micro_batch_size": 2, "lr": 1e-2},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": len(SEQS)},
            "algo": algo,
        }
    )


def _samples() -> dict[str, list]:
    out = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": [], "rollout_log_probs": []}
    for k, (p, r) in enumerate(SEQS):
        out["tokens"].append(np.asarray(p + r, dtype=np.int64))
        out["prompt_len"].append(len(p))
        out["loss_mask"].append(np.ones(len(r), dtype=np.float32))
        out["advantages"].append(np.full(len(r), (1.0, -1.0, 0.5)[k], dtype=np.float32))
        out["rollout_log_probs"].append(np.full(len(r), -3.0 + 0.5 * k, dtype=np.float32))  # another policy
    return out


def _prox(cfg: RelaxConfig, backend, d: dict) -> dict[str, float]:
    return exact_prox(cfg, backend, d)


@pytest.mark.parametrize("mode", ["colocate", "fully_async"])
@pytest.mark.parametrize("algo", [{}, {"decoupled_ppo": True}, {"tis_mode": "token_truncate"}])
def test_pi_prox_from_the_training_forward_is_actor_fwd_s_bit_for_bit(tiny_model_dir, mode, algo):
    """Before: ActorFwd computed every sample's log-probs with the trainer's weights (colocate: the
    trainer's own backend), then the trainer trained. Now no ActorFwd runs and the training forward's own
    log-probs, detached, are π_prox. The loss, every statistic, every gradient and the updated weights are
    the same bit for bit."""
    cfg = _cfg(mode, **algo)
    assert cfg.prox_from_training_forward
    before, after = TorchBackend(cfg, tiny_model_dir), TorchBackend(cfg, tiny_model_dir)
    old = _samples()
    old["log_probs"] = before.compute_log_probs(old)  # what ActorFwd wrote on the bus
    old["log_probs_version"] = [0] * len(SEQS)
    new = _samples()
    assert _prox(cfg, after, new) == {"train/prox_recomputed_frac": 0.0, "train/prox_from_forward_frac": 1.0}
    assert "log_probs" not in new and new["prox_from_forward"] == [True] * len(SEQS)
    m_old, m_new = before.train_step(old), after.train_step(new)
    assert m_new == m_old  # loss, pg_loss, clip fractions, TIS weights, mismatch metrics: all equal
    assert m_new["prox_gap_max"] == 0.0
    for (name, p), (_, q) in zip(before.model.named_parameters(), after.model.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert torch.equal(p, q), name


def test_a_model_with_dropout_gets_pi_prox_in_eval_mode(tiny_model_dir, tmp_path):
    """A training forward with dropout draws masks: its log-probs are not π_θ's. π_prox is computed in eval
    mode instead (one forward more, only for such models)."""
    path = tmp_path / "dropout"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    cfg = _cfg(decoupled_ppo=True)
    b = TorchBackend(cfg, str(path))
    assert b.stochastic_forward and not TorchBackend(cfg, tiny_model_dir).stochastic_forward
    d = _samples()
    assert _prox(cfg, b, d)["train/prox_recomputed_frac"] == 1.0
    assert "prox_from_forward" not in d
    for got, want in zip(d["log_probs"], b.compute_log_probs(_samples())):
        np.testing.assert_array_equal(got, want)  # eval mode: deterministic
    assert b.model.training  # (and the trainer stays in train mode)


def test_prox_gap_shows_a_pi_prox_that_is_not_the_trainer_s_policy(tiny_model_dir):
    """``train/prox_gap_max`` compares π_prox with the first optimizer step's own forward, which runs with
    π_prox's weights by definition: 0 when exact, and it shows log-probs of other weights labelled with
    the trainer's version (what ``train/prox_lag_max``, computed from the labels, cannot)."""
    cfg = _cfg("fully_async", decoupled_ppo=True, exact_proximal_policy=False)
    b = TorchBackend(cfg, tiny_model_dir)
    exact = _samples()
    exact["log_probs"], exact["log_probs_version"] = b.compute_log_probs(exact), [0] * len(SEQS)
    assert b.train_step(exact)["prox_gap_max"] < 1e-5
    wrong = _samples()  # π_prox of the weights before that update, labelled as the current version
    wrong["log_probs"], wrong["log_probs_version"] = exact["log_probs"], [1] * len(SEQS)
    assert _prox(cfg, b, wrong)["train/prox_lag_max"] == 0.0  # the labels say nothing is stale
    assert b.train_step(wrong)["prox_gap_max"] > 1e-3
