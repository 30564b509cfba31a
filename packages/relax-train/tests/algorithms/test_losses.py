"""PPO clip loss and k3 KL against hand-written float64 references."""

import math

import pytest

torch = pytest.importorskip("torch")

from relax_train.algorithms.losses import entropy_from_logits, kl_k3, ppo_clip_loss  # noqa: E402


def reference_ppo(logp, old, adv, eps, eps_high):
    ratio = math.exp(logp - old)
    clipped_ratio = min(max(ratio, 1.0 - eps), 1.0 + eps_high)
    return max(-adv * ratio, -adv * clipped_ratio), ratio


@pytest.mark.parametrize(("eps", "eps_high"), [(0.2, None), (0.2, 0.28), (0.1, 0.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_clip_matches_reference(eps, eps_high, seed):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.5
    old = logp + torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip
    adv = torch.randn(6, 7, generator=g, dtype=torch.float64)
    loss, stats = ppo_clip_loss(logp, old, adv, eps, eps_high)
    high = eps if eps_high is None else eps_high
    n_clipped = 0
    for i in range(6):
        for j in range(7):
            ref, ratio = reference_ppo(float(logp[i, j]), float(old[i, j]), float(adv[i, j]), eps, high)
            assert float(loss[i, j]) == pytest.approx(ref, rel=1e-9, abs=1e-12)
            assert float(stats["ratio"][i, j]) == pytest.approx(ratio, rel=1e-9)
            n_clipped += int(stats["clipped"][i, j])
    assert 0 < n_clipped < 42  # the random inputs exercise both branches


def test_asymmetric_clip_bounds():
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5], dtype=torch.float64))
    old = torch.zeros(4, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss, stats = ppo_clip_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.3)
    # A>0 with ratio 1.5 is capped at 1.3; A<0 with ratio 1.5 keeps the (worse) unclipped value
    # A>0 with ratio 0.5 keeps 0.5 (pessimistic); A<0 with ratio 0.5 is capped at 0.8
    torch.testing.assert_close(loss, torch.tensor([-1.3, 1.5, -0.5, 0.8], dtype=torch.float64))
    assert stats["clipped"].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_ppo_gradient_zero_when_clipped_and_signed_otherwise():
    logp = torch.tensor([math.log(2.0), 0.0], dtype=torch.float64, requires_grad=True)
    loss, _ = ppo_clip_loss(
        logp, torch.zeros(2, dtype=torch.float64), torch.tensor([1.0, 1.0], dtype=torch.float64), 0.2
    )
    loss.sum().backward()
    assert logp.grad[0] == 0.0  # ratio 2 > 1.2 with positive advantage: clipped, no gradient
    assert logp.grad[1] == pytest.approx(-1.0)  # descending the loss raises the log-prob


def test_kl_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(50, generator=g, dtype=torch.float64) * 3
    ref = torch.randn(50, generator=g, dtype=torch.float64) * 3
    kl = kl_k3(logp, ref)
    assert (kl >= 0).all()
    assert (kl > 0).all()  # strictly positive where they differ
    assert torch.equal(kl_k3(logp, logp), torch.zeros_like(logp))
    for i in range(50):  # Schulman's k3, clamped to 10 as veRL's low_var_kl is
        d = float(ref[i] - logp[i])
        assert float(kl[i]) == pytest.approx(min(math.exp(d) - d - 1.0, 10.0), rel=1e-9)
    assert float(kl.max()) == 10.0  # (some pairs here are that far apart)


def test_entropy_of_uniform_and_peaked():
    uniform = torch.zeros(2, 8)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2,), math.log(8.0)))
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert float(entropy_from_logits(peaked)[0]) == pytest.approx(0.0, abs=1e-6)
