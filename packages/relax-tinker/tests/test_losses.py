"""The Tinker losses against their documented definitions, computed here by hand on numbers small enough to
check: values and gradients, summed (not averaged) over tokens; refused losses name what to use instead."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from relax_tinker.losses import loss_fn  # noqa: E402

LP = [-1.0, -0.5, -2.0]
OLD = [-1.2, -0.5, -1.0]
ADV = [1.0, -2.0, 0.5]


def _run(name: str, config=None, **extra):
    lp = torch.tensor(LP, requires_grad=True)
    inputs = {"logprobs": torch.tensor(OLD), "advantages": torch.tensor(ADV), **extra}
    loss = loss_fn(name)(lp, inputs, config or {})
    loss.backward()
    return float(loss), lp.grad.tolist()


def test_cross_entropy_is_the_weighted_sum_and_takes_any_real_weights():
    lp = torch.tensor(LP, requires_grad=True)
    loss = loss_fn("cross_entropy")(lp, {"weights": torch.tensor([1.0, 0.0, -3.0])}, {})
    loss.backward()
    assert float(loss) == pytest.approx(1.0 - 6.0) and lp.grad.tolist() == [-1.0, 0.0, 3.0]


def test_importance_sampling():
    loss, grad = _run("importance_sampling")
    ratios = [math.exp(a - b) for a, b in zip(LP, OLD)]
    assert loss == pytest.approx(-sum(r * a for r, a in zip(ratios, ADV)))
    assert grad == pytest.approx([-r * a for r, a in zip(ratios, ADV)])


def test_ppo_clips_where_the_ratio_leaves_the_band_in_the_advantages_direction():
    loss, grad = _run("ppo")
    # ratios: e^0.2 = 1.221 (A > 0: clipped at 1.2, no gradient), 1 (inside), e^-1 = 0.368 (A > 0: unclipped min)
    r0, r2 = math.exp(0.2), math.exp(-1.0)
    assert loss == pytest.approx(-(1.2 * 1.0 + 1.0 * -2.0 + r2 * 0.5))
    assert grad == pytest.approx([0.0, 2.0, -r2 * 0.5])
    loss_wide, _ = _run("ppo", {"clip_low_threshold": 0.1, "clip_high_threshold": 2.0})
    assert loss_wide == pytest.approx(-(r0 * 1.0 - 2.0 + r2 * 0.5))


def test_cispo_weights_the_log_probs_by_the_clipped_ratio_without_its_gradient():
    loss, grad = _run("cispo")
    w = [1.2, 1.0, 0.8]  # (e^0.2 and e^-1 clipped to the band, both ends)
    assert loss == pytest.approx(-sum(x * lp * a for x, lp, a in zip(w, LP, ADV)))
    assert grad == pytest.approx([-x * a for x, a in zip(w, ADV)])


def test_dro_needs_its_beta_and_penalises_the_distance_to_the_sampler():
    with pytest.raises(ValueError, match="needs loss_fn_config\\['beta'\\]"):
        _run("dro")
    loss, grad = _run("dro", {"beta": 0.1})
    d = [a - b for a, b in zip(LP, OLD)]
    assert loss == pytest.approx(-sum(lp * a - 0.05 * x * x for lp, a, x in zip(LP, ADV, d)))
    assert grad == pytest.approx([-(a - 0.1 * x) for a, x in zip(ADV, d)])


def test_gspo_uses_one_ratio_per_sequence():
    loss, grad = _run("gspo", sequence_ratio_mask=torch.tensor([1.0, 1.0, 0.0]))
    seq = math.exp((0.2 + 0.0) / 2)  # the mean log-ratio over the marked tokens
    assert seq < 1.2
    assert loss == pytest.approx(-(seq * 1.0 + seq * -2.0 + seq * 0.5))
    assert grad == pytest.approx([-seq * a for a in ADV])


@pytest.mark.parametrize(
    "name,hint", [("stable_reinforce", "importance_sampling"), ("nope", "this server has")]
)
def test_a_loss_not_served_is_refused_saying_what_to_use(name, hint):
    with pytest.raises(ValueError, match=hint):
        loss_fn(name)
