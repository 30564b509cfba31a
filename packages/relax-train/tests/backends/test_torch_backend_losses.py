"""TorchBackend with every policy loss, aggregation mode, KL estimator and behaviour correction: training
moves weights with finite metrics, and micro-batching leaves the gradient unchanged."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_train.backends.torch_backend import TorchBackend  # noqa: E402

from .test_torch_backend import SEQS, make_cfg, make_samples, weights  # noqa: E402

ADV = [1.0, -1.0, 0.5]


def _samples(be, seed=0):
    """ActorFwd log-probs = current weights; rollout log-probs perturbed (engine mismatch); a reference."""
    samples = make_samples(advantages=ADV)
    lp = be.compute_log_probs(samples)
    rng = np.random.default_rng(seed)
    samples["log_probs"] = lp
    samples["rollout_log_probs"] = [x + rng.normal(0, 0.3, x.shape).astype(np.float32) for x in lp]
    samples["ref_log_probs"] = [x - 0.1 for x in lp]
    return samples


@pytest.mark.parametrize(
    "algo",
    [
        {"policy_loss": "ppo"},
        {"policy_loss": "ppo", "eps_clip_c": 3.0, "eps_clip_high": 0.28},
        {
            "policy_loss": "gspo",
            "eps_clip": 3e-4,
            "eps_clip_high": 4e-4,
            "loss_agg_mode": "seq-mean-token-mean",
        },
        {"policy_loss": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05},
        {"policy_loss": "cispo", "cispo_ratio_max": 5.0},
        {"policy_loss": "ppo", "decoupled_ppo": True},
        {"policy_loss": "ppo", "tis_mode": "token_truncate", "tis_cap": 1.5},
        {"policy_loss": "gspo", "tis_mode": "sequence_mask", "tis_cap": 2.0},
        {"policy_loss": "ppo", "kl_coef": 0.1},
        {"policy_loss": "sapo", "kl_coef": 0.1, "kl_estimator": "k2", "entropy_coef": 0.01},
    ],
    ids=lambda a: "-".join(f"{k}={v}" for k, v in a.items()),
)
def test_train_step_each_loss_moves_weights_with_finite_metrics(tiny_model_dir, algo):
    be = TorchBackend(make_cfg(**algo), tiny_model_dir)
    samples = _samples(be)
    before = weights(be)
    m = be.train_step(samples)
    assert any(not torch.equal(before[n], p) for n, p in weights(be).items())
    for key in (
        "loss",
        "pg_loss",
        "grad_norm",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "rollout_kl_k3",
        "rollout_abs_logp_diff",
    ):
        assert np.isfinite(m[key]), key
    assert all(np.isfinite(v) for v in m.values()), m
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # first step: the proximal policy is current
    assert m["rollout_abs_logp_diff"] > 0.05  # the injected mismatch shows
    if algo["policy_loss"] in ("ppo", "gspo", "cispo"):
        assert "clipfrac" in m
    if algo["policy_loss"] in ("ppo", "gspo"):
        assert "clipfrac_low" in m and "clipfrac_high" in m
    if algo["policy_loss"] == "sapo":
        assert m["sapo_gate_mean"] == pytest.approx(4 / 1.0 * 0.5, rel=0.1)  # σ(0)·4/τ at ratio 1
    if algo.get("tis_mode", "none") != "none" or algo.get("decoupled_ppo"):
        assert 0 <= m["tis_weight_min"] <= m["tis_weight_mean"] <= m["tis_weight_max"]
        if "tis_cap" in algo:
            assert m["tis_weight_max"] <= algo["tis_cap"] + 1e-6
    else:
        assert "tis_weight_mean" not in m
    if algo.get("kl_coef"):
        assert m["kl"] != 0.0


def test_tis_mask_below_every_weight_blocks_the_update(tiny_model_dir):
    """token_mask with a cap below every weight zeroes every token's loss: no gradient at all."""
    be = TorchBackend(make_cfg(tis_mode="token_mask", tis_cap=1e-6), tiny_model_dir)
    samples = _samples(be)
    before = weights(be)
    m = be.train_step(samples)
    assert m["tis_zero_frac"] == 1.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in weights(be).items())


def _grads(tiny_model_dir, mbs, algo):
    be = TorchBackend(make_cfg(micro_batch_size=mbs, **algo), tiny_model_dir)
    samples = _samples(be)
    be.train_step(samples)  # gradients stay on the parameters until the next step's zero_grad
    return {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("loss", ["ppo", "gspo", "sapo", "cispo"])
def test_micro_batching_gives_the_full_batch_gradient(tiny_model_dir, mode, loss):
    algo = {"policy_loss": loss, "loss_agg_mode": mode, "kl_coef": 0.05, "tis_mode": "token_truncate"}
    full = _grads(tiny_model_dir, len(SEQS), algo)
    split = _grads(tiny_model_dir, 1, algo)
    assert full.keys() == split.keys()
    for n in full:
        torch.testing.assert_close(split[n], full[n], rtol=1e-4, atol=1e-6, msg=n)


def _distill_grads(tiny_model_dir, algo, with_teacher: bool, **replace):
    be = TorchBackend(make_cfg(**algo), tiny_model_dir)
    samples = _samples(be)
    teacher = [x - 0.2 + 0.1 * np.arange(len(x), dtype=np.float32) for x in samples["log_probs"]]
    if with_teacher:
        samples["teacher_log_probs"] = teacher
    for key, fn in replace.items():
        samples[key] = fn(samples, teacher)
    metrics = be.train_step(samples)
    return {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}, metrics


def test_distillation_in_advantage_mode_is_the_per_token_reverse_kl_reward(tiny_model_dir):
    """β_d·(log π_T − log π_old) added to each token's advantage: the same update as training without a
    teacher on those advantages."""
    algo = {"policy_loss": "ppo", "distill_mode": "advantage", "distill_coef": 0.5}
    got, m = _distill_grads(tiny_model_dir, algo, True)
    shifted = lambda s, t: [a + 0.5 * (tl - lp) for a, tl, lp in zip(s["advantages"], t, s["log_probs"])]  # noqa: E731
    want, _ = _distill_grads(tiny_model_dir, algo, False, advantages=shifted)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
    be = TorchBackend(make_cfg(**algo), tiny_model_dir)
    lp = be.compute_log_probs(make_samples())
    expect = float(np.mean(np.concatenate([0.2 - 0.1 * np.arange(len(x)) for x in lp])))  # old − teacher
    assert m["distill_kl"] == pytest.approx(expect, abs=1e-5)


def test_distillation_as_a_loss_is_a_kl_term_to_the_teacher(tiny_model_dir):
    """β_d·½(log π − log π_T)² per token in the loss (k2: its gradient on the student's samples is that of
    KL(π ‖ π_T), test_kl_gradients.py): the same update as a k2 reference-KL loss with the teacher's
    log-probs in place of the reference's, whatever --kl-estimator says."""
    got, _ = _distill_grads(
        tiny_model_dir, {"distill_mode": "loss", "distill_coef": 0.3, "kl_estimator": "k3"}, True
    )
    as_ref = {"kl_coef": 0.3, "kl_estimator": "k2", "use_kl_loss": True}
    want, _ = _distill_grads(tiny_model_dir, as_ref, False, ref_log_probs=lambda s, t: t)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_mismatch_metrics_compare_the_proximal_policy_with_the_rollout(tiny_model_dir):
    """The rollout-vs-trainer gap is π_prox (ActorFwd's log-probs, what the batch is clipped against)
    against π_rollout, not π_θ, which moves with each optimizer step of the batch: with π_prox set 0.25
    above the rollout's log-probs on every token, the gap is exactly that."""
    cfg = make_cfg()
    cfg.train.global_batch_size = cfg.train.micro_batch_size  # several optimizer steps a batch
    be = TorchBackend(cfg, tiny_model_dir)
    samples = _samples(be)
    samples["log_probs"] = [x + 0.25 for x in samples["rollout_log_probs"]]
    m = be.train_step(samples)
    assert m["rollout_abs_logp_diff"] == pytest.approx(0.25, abs=1e-6)
    assert m["rollout_ratio_min"] == pytest.approx(np.exp(0.25), rel=1e-6)


def test_the_trainer_s_logp_gap_counts_model_tokens_and_is_absent_without_any():
    from relax_train.roles.metrics import logp_absdiff

    fwd = [np.array([-1.0, -2.0, -0.5]), np.zeros(0)]  # (an empty response: no NaN)
    rollout = [np.array([-1.5, 0.0, -0.5]), np.zeros(0)]  # the second token: an environment token
    assert logp_absdiff(fwd, rollout, [np.array([1.0, 0.0, 1.0]), np.zeros(0)]) == pytest.approx(0.25)
    assert logp_absdiff([np.zeros(0)], [np.zeros(0)], [np.zeros(0)]) is None
