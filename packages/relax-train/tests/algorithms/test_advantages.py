"""Advantage estimators against a float64 reference written here, independently of the source."""

import numpy as np
import pytest

from relax_train.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages


def reference_grpo(rewards, normalize_std=True):
    r = [float(x) for x in rewards]
    mean = sum(r) / len(r)
    centred = [x - mean for x in r]
    if not normalize_std:
        return centred
    std = (sum(c * c for c in centred) / (len(r) - 1)) ** 0.5 if len(r) > 1 else 0.0
    return [c / (std + 1e-6) for c in centred]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_matches_reference(seed, normalize):
    rng = np.random.default_rng(seed)
    n_groups, size = 4, 5
    rewards = rng.normal(size=n_groups * size)
    group_ids = [f"g{i // size}" for i in range(n_groups * size)]
    lens = rng.integers(1, 6, size=n_groups * size).tolist()
    out = compute_advantages("grpo", group_ids, rewards, lens, normalize_std=normalize)
    for g in range(n_groups):
        ref = reference_grpo(rewards[g * size : (g + 1) * size], normalize)
        for j in range(size):
            i = g * size + j
            assert out[i].dtype == np.float32
            assert out[i].shape == (lens[i],)
            np.testing.assert_allclose(out[i], ref[j], rtol=1e-5, atol=1e-6)


def test_binary_rewards_known_values():
    out = compute_advantages("grpo", [0, 0, 0, 0], [1, 0, 0, 1], [1, 1, 1, 1])
    np.testing.assert_allclose([a[0] for a in out], [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-5)


def test_dr_grpo_centres_only():
    out = compute_advantages("grpo", [0, 0, 0], [3.0, 0.0, 0.0], [2, 2, 2], normalize_std=False)
    np.testing.assert_allclose([a[0] for a in out], [2.0, -1.0, -1.0], atol=1e-6)
    assert sum(float(a[0]) for a in out) == pytest.approx(0.0, abs=1e-6)


def test_groups_are_independent_and_may_interleave():
    rewards = [1.0, 5.0, 0.0, 7.0, 2.0, 9.0]
    gids = ["a", "b", "a", "b", "a", "b"]
    out = compute_advantages("grpo", gids, rewards, [1] * 6)
    ref_a = reference_grpo([1.0, 0.0, 2.0])
    ref_b = reference_grpo([5.0, 7.0, 9.0])
    np.testing.assert_allclose([out[i][0] for i in (0, 2, 4)], ref_a, rtol=1e-5)
    np.testing.assert_allclose([out[i][0] for i in (1, 3, 5)], ref_b, rtol=1e-5)
    # changing group b does not move group a
    out2 = compute_advantages("grpo", gids, [1.0, 50.0, 0.0, -7.0, 2.0, 0.0], [1] * 6)
    np.testing.assert_allclose([out2[i][0] for i in (0, 2, 4)], [out[i][0] for i in (0, 2, 4)])


def test_constant_group_gives_zero():
    out = compute_advantages("grpo", [0, 0, 0], [1.0, 1.0, 1.0], [3, 3, 3])
    assert all(np.all(a == 0.0) for a in out)


def test_single_sample_group_is_zero_and_finite():
    for normalize in (True, False):
        out = compute_advantages(
            "grpo", ["solo", "x", "x"], [1.0, 0.0, 1.0], [4, 1, 1], normalize_std=normalize
        )
        assert out[0].tolist() == [0.0] * 4
        assert all(np.isfinite(a).all() for a in out)


def test_zero_length_response():
    out = compute_advantages("grpo", [0, 0], [1.0, 0.0], [0, 2])
    assert out[0].shape == (0,) and out[1].shape == (2,)


def test_unknown_estimator_lists_available():
    with pytest.raises(ValueError, match="--advantage-estimator") as exc:
        compute_advantages("reinforce++", [0], [1.0], [1])
    assert "'reinforce++'" in str(exc.value)
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(exc.value)
