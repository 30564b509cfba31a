"""Variants TRL lacks — dual-clip PPO, k1/k2 KL, KL reward shaping, truncated IS weights, aggregation with
global denominators — against float64 references written here from each paper's formula."""

import math

import pytest

torch = pytest.importorskip("torch")

from relax_train.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, entropy_bonus  # noqa: E402
from relax_train.algorithms.correction import mismatch_metrics, truncated_is_weights  # noqa: E402
from relax_train.algorithms.losses import (  # noqa: E402
    POLICY_LOSSES,
    LossParams,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    ppo_clip_loss,
)

F64 = torch.float64


def _rand(seed, b=5, t=7):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, t + 1, (b,), generator=g)
    lens[0] = t
    mask = (torch.arange(t)[None] < lens[:, None]).to(F64)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 2
    other = logp + torch.randn(b, t, generator=g, dtype=F64) * 0.8
    adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t)
    return mask, logp, other, adv, lens


@pytest.mark.parametrize("seed", range(3))
def test_dual_clip_matches_ye_et_al(seed):
    """Ye et al. 2020 Eq. 5: for A<0, L = min(max(-rA, -clip(r)A), -cA); for A≥0 the usual PPO loss."""
    mask, logp, old, adv, _ = _rand(seed)
    old = logp + (old - logp) * 2.0  # ratios up to e^±3 so the dual clip binds
    loss, stats = ppo_clip_loss(logp, old, adv, 0.2, 0.28, clip_ratio_c=3.0)
    n_dual = 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            a, r = float(adv[i, j]), math.exp(float(logp[i, j] - old[i, j]))
            ppo = max(-a * r, -a * min(max(r, 0.8), 1.28))
            ref = min(ppo, -a * 3.0) if a < 0 else ppo
            assert abs(float(loss[i, j]) - ref) <= 1e-12
            n_dual += int(stats["dual_clipped"][i, j])
    assert n_dual > 0
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_clip_loss(logp, old, adv, 0.2, clip_ratio_c=0.5)


def test_dual_clip_gradient_is_zero_where_it_binds():
    logp = torch.tensor([math.log(5.0)], dtype=F64, requires_grad=True)
    loss, _ = ppo_clip_loss(
        logp, torch.zeros(1, dtype=F64), torch.tensor([-1.0], dtype=F64), 0.2, clip_ratio_c=3.0
    )
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(3.0) and float(logp.grad) == 0.0


def test_kl_estimators_match_schulman():
    """k1 = log r, k2 = ½ (log r)², k3 = (1/r) - 1 + log r with r = π/π_ref (Schulman 2020)."""
    _, logp, ref, _, _ = _rand(0)
    for i in range(logp.numel()):
        lr = float(logp.flatten()[i] - ref.flatten()[i])
        assert float(kl_k1(logp, ref).flatten()[i]) == pytest.approx(lr, abs=1e-12)
        assert float(kl_k2(logp, ref).flatten()[i]) == pytest.approx(0.5 * lr * lr, abs=1e-12)
        assert float(kl_k3(logp, ref).flatten()[i]) == pytest.approx(math.exp(-lr) - 1 + lr, abs=1e-12)
    assert torch.equal(kl_penalty(logp, ref, "low_var_kl"), kl_k3(logp, ref))
    with pytest.raises(ValueError, match="--kl-estimator"):
        kl_penalty(logp, ref, "k4")


def test_kl_estimators_are_unbiased_or_not_as_documented():
    # samples from p, exact KL(p||q) for two categoricals: k1 and k3 are unbiased, k2 is close but biased
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=F64)
    exact = float((p * (p / q).log()).sum())
    lp, lq = p.log(), q.log()
    for fn in (kl_k1, kl_k3):
        assert float((p * fn(lp, lq)).sum()) == pytest.approx(exact, abs=1e-12)
    assert float((p * kl_k2(lp, lq)).sum()) == pytest.approx(exact, rel=0.1)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_truncated_is_weights_match_formula(level, mode):
    """TIS (Yao et al. 2025): w = π_old/π_rollout, token or sequence (product) level, truncated or masked."""
    mask, old, rollout, _, lens = _rand(2)
    rollout = old + (rollout - old) * 0.3
    w = truncated_is_weights(old, rollout, mask, level=level, mode=mode, clip_min=0.7, clip_max=1.4)
    assert not w.requires_grad
    assert w.shape == ((5, 7) if level == "token" else (5, 1))
    seen = set()
    for i in range(5):
        cols = range(7) if level == "token" else [None]
        for j in cols:
            if j is None:
                raw = math.exp(sum(float(old[i, k] - rollout[i, k]) for k in range(int(lens[i]))))
                got = float(w[i, 0])
            else:
                raw = math.exp(float(old[i, j] - rollout[i, j])) if j < lens[i] else 1.0
                got = float(w[i, j])
            inside = 0.7 <= raw <= 1.4
            ref = (min(max(raw, 0.7), 1.4)) if mode == "truncate" else (raw if inside else 0.0)
            seen.add(inside)
            assert got == pytest.approx(ref, rel=1e-12, abs=1e-12)
    assert seen == {True, False}  # both branches exercised
    with pytest.raises(ValueError, match="--tis-level"):
        truncated_is_weights(old, rollout, mask, level="batch")


def test_mismatch_metrics_zero_when_equal():
    mask, logp, other, _, _ = _rand(3)
    m = mismatch_metrics(logp, logp, mask)
    assert m["mismatch/kl_k3"] == 0.0 and m["mismatch/ratio_max"] == 1.0
    assert mismatch_metrics(logp, other, mask)["mismatch/kl_k3"] > 0
    assert mismatch_metrics(logp, other, torch.zeros_like(mask)) == {}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_matches_reference_and_accumulates_exactly(mode):
    mask, loss, _, _, lens = _rand(4, b=8, t=6)
    b, t = loss.shape
    tok = [[float(loss[i, j]) for j in range(int(lens[i]))] for i in range(b)]
    ref = {
        "token-mean": sum(map(sum, tok)) / sum(map(len, tok)),
        "seq-mean-token-mean": sum(sum(x) / max(len(x), 1) for x in tok) / b,
        "seq-mean-token-sum": sum(map(sum, tok)) / b,
        "seq-mean-token-sum-norm": sum(map(sum, tok)) / (b * t),
    }[mode]
    full = aggregate_loss(loss, mask, mode, max_len=t)
    assert float(full) == pytest.approx(ref, abs=1e-12)
    # two micro-batches with global denominators sum to the full-batch loss
    parts = [
        aggregate_loss(loss[s], mask[s], mode, global_tokens=mask.sum(), global_seqs=b, max_len=t)
        for s in (slice(0, 3), slice(3, b))
    ]
    assert float(sum(parts)) == pytest.approx(ref, abs=1e-12)


def test_aggregation_errors_say_what_to_fix():
    mask, loss, _, _, _ = _rand(5)
    with pytest.raises(ValueError, match="--loss-agg-mode"):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


def test_entropy_bonus_lowers_loss_and_raises_entropy_gradient():
    ent = torch.tensor([[1.0, 2.0, 9.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    bonus = entropy_bonus(ent, mask, 0.1)
    assert float(bonus.detach()) == pytest.approx(-0.15)
    bonus.backward()
    assert ent.grad.tolist() == [[-0.05, -0.05, 0.0]]


def test_registry_losses_share_one_signature_and_cispo_stops_the_weight_gradient():
    mask, logp, old, adv, _ = _rand(6)
    for name, fn in POLICY_LOSSES.items():
        lp = logp.clone().requires_grad_(True)
        loss, stats = fn(lp, old, adv, mask, LossParams())
        assert loss.shape == logp.shape and "ratio" in stats, name
        aggregate_loss(loss, mask).backward()
        assert torch.isfinite(lp.grad).all(), name
    # CISPO gradient is -sg(w)·A per token: the weight itself gets no gradient
    lp = logp.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES["cispo"](lp, old, adv, mask, LossParams(cispo_ratio_max=1.5))
    loss.sum().backward()
    w = (logp - old).exp().clamp(max=1.5)
    torch.testing.assert_close(lp.grad, -w * adv, rtol=1e-12, atol=1e-12)
