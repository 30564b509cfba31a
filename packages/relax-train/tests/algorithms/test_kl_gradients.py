"""What each KL estimator *optimises*, checked against the exact KL on a tiny vocabulary.

A sample's estimate is only ever seen through its gradient: as a loss term (``--use-kl-loss``,
``--distill-mode loss``) its path-wise gradient, as a reward (``--kl-in-reward``) the score-function
gradient of the policy loss it shapes. With samples ``y ~ π`` (the sampling distribution held fixed, as a
rollout batch is), the expected gradient is ``Σ_y π(y) ∇(…)``, computed here exactly by enumerating the
vocabulary, and compared with ``∇ KL`` of the two categorical distributions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax_core.config_sections import AlgoConfig
from relax_train.algorithms.kl_reward import kl_shaped_sequence_rewards
from relax_train.algorithms.losses import kl_penalty, loss_kl_estimator

F64 = torch.float64


def _policy(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(6, generator=g, dtype=F64).requires_grad_()
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=F64), -1)
    return theta, ref


def _exact_grad(theta: torch.Tensor, ref: torch.Tensor, reverse: bool) -> torch.Tensor:
    """∇θ KL(π‖ref) (``reverse``) or ∇θ KL(ref‖π), π = softmax(θ)."""
    logp = torch.log_softmax(theta, -1)
    kl = (logp.exp() * (logp - ref)).sum() if reverse else (ref.exp() * (ref - logp)).sum()
    (g,) = torch.autograd.grad(kl, theta)
    return g


def _loss_grad(theta: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """E_{y~π}[∇θ k(log π(y), log ref(y))] with π's sampling weights held fixed."""
    logp = torch.log_softmax(theta, -1)
    weights = logp.exp().detach()
    (g,) = torch.autograd.grad((weights * kl_penalty(logp, ref, estimator)).sum(), theta)
    return g


def test_as_a_loss_k2_is_the_reverse_kl_k3_the_forward_and_k1_nothing():
    theta, ref = _policy()
    reverse, forward = _exact_grad(theta, ref, True), _exact_grad(theta, ref, False)
    torch.testing.assert_close(_loss_grad(theta, ref, "k2"), reverse)
    torch.testing.assert_close(_loss_grad(theta, ref, "k3"), forward)  # (GRPO's, TRL's: KL(ref‖π))
    torch.testing.assert_close(_loss_grad(theta, ref, "k1"), torch.zeros_like(theta))  # the trap


def test_the_loss_estimators_the_config_picks_optimise_what_help_says():
    # --use-kl-loss: k3 by default (GRPO's), k2 when asked; k1 refused (its expected gradient is zero)
    assert loss_kl_estimator(AlgoConfig(kl_coef=0.1)) == "k3"
    assert loss_kl_estimator(AlgoConfig(kl_coef=0.1, kl_estimator="k2")) == "k2"
    with pytest.raises(ValueError, match="k1.*expected gradient.*zero"):
        AlgoConfig(kl_coef=0.1, kl_estimator="k1")
    # --distill-mode loss: KL(π‖teacher) as documented, whatever --kl-estimator says
    assert loss_kl_estimator(AlgoConfig(distill_mode="loss"), distill=True) == "k2"
    theta, teacher = _policy(1)
    torch.testing.assert_close(
        _loss_grad(theta, teacher, loss_kl_estimator(AlgoConfig(distill_mode="loss"), distill=True)),
        _exact_grad(theta, teacher, True),
    )


def _reward_grad(theta: torch.Tensor, ref: torch.Tensor, estimator: str, beta: float) -> torch.Tensor:
    """The score-function gradient E_{y~π}[r(y) ∇ log π(y)] of one-token responses whose reward is the
    KL-shaped 0 − β·kl(y) (as the Advantages role computes it, from the rollout's log-probs)."""
    logp = torch.log_softmax(theta, -1)
    lp = logp.detach().numpy()
    shaped = kl_shaped_sequence_rewards(
        [0.0] * 6,
        [lp[[y]] for y in range(6)],
        [ref.numpy()[[y]] for y in range(6)],
        beta,
        estimator,
        [np.ones(1)] * 6,
    )
    r = torch.as_tensor(shaped, dtype=F64)
    (g,) = torch.autograd.grad((logp.exp().detach() * r * logp).sum(), theta)
    return g


def test_in_the_reward_k1_gives_the_reverse_kl_gradient_and_is_the_default():
    theta, ref = _policy(2)
    want = -0.5 * _exact_grad(theta, ref, True)  # maximising r − β·KL(π‖ref)
    a = AlgoConfig(kl_coef=0.5, kl_in_reward=True, use_kl_loss=False)
    assert a.kl_reward_estimator == "k1"
    torch.testing.assert_close(_reward_grad(theta, ref, a.kl_reward_estimator, 0.5), want)
    k3 = _reward_grad(theta, ref, "k3", 0.5)
    assert not torch.allclose(k3, want, rtol=0.1)  # k3 in a reward optimises something else
    for est in ("k2", "k3"):
        with pytest.raises(ValueError, match=f"--kl-in-reward.*{est}.*k1"):
            AlgoConfig(kl_coef=0.5, kl_in_reward=True, use_kl_loss=False, kl_estimator=est)


def test_kl_in_the_reward_counts_only_the_model_s_tokens():
    """Multi-turn: environment tokens have rollout log-prob 0 (the model did not sample them); summed in,
    5 of them turned a reward of 1.0 into −13.98 (k1). Only tokens with loss mask 1 count."""
    model, env = np.array([-1.0, -2.0]), np.zeros(5)
    logp = np.concatenate([model, env])
    ref = np.concatenate([model, np.full(5, -2.996)])  # the reference's log-probs of the observation
    mask = np.concatenate([np.ones(2), np.zeros(5)])
    assert kl_shaped_sequence_rewards([1.0], [logp], [ref], 1.0, "k1", [mask])[0] == pytest.approx(1.0)
