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
    return [c / (std + 1e-4) for c in centred]  # TRL's epsilon


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
    np.testing.assert_allclose([a[0] for a in out], [0.865875, -0.865875, -0.865875, 0.865875], atol=1e-5)


def test_near_tied_continuous_rewards_stay_small_and_a_lone_response_gets_zero():
    """TRL's epsilon (1e-4): rewards 1e-5 apart are noise, not a ±0.7 advantage (which 1e-6 gave)."""
    out = compute_advantages("grpo", [0, 0], [0.5, 0.5 + 1e-5], [1, 1])
    assert max(abs(float(a[0])) for a in out) < 0.05
    assert float(compute_advantages("grpo", ["solo"], [3.0], [2])[0][0]) == 0.0


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


# --- estimators TRL's GRPOTrainer lacks: float64 references written from each paper's formula ----------


def _batch(seed, n_groups=4, size=5):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=n_groups * size)
    gids = [f"g{i % n_groups}" for i in range(n_groups * size)]  # interleaved groups
    lens = rng.integers(0, 7, size=n_groups * size).tolist()
    return rewards, gids, lens


def _members(gids):
    out = {}
    for i, g in enumerate(gids):
        out.setdefault(g, []).append(i)
    return out


def reference_rloo(rewards, gids):
    """Ahmadian et al. 2024: A_i = r_i - (1/(n-1)) Σ_{j≠i} r_j."""
    out = [0.0] * len(rewards)
    for idx in _members(gids).values():
        for i in idx:
            others = [float(rewards[j]) for j in idx if j != i]
            out[i] = float(rewards[i]) - sum(others) / len(others) if others else 0.0
    return out


def reference_token_whiten(values, lens):
    """REINFORCE++ (Hu 2025) global whitening, over every token of the batch (OpenRLHF)."""
    toks = [float(v) for v, n in zip(values, lens) for _ in range(n)]
    mean = sum(toks) / len(toks)
    var = sum((t - mean) ** 2 for t in toks) / len(toks)
    return [(float(v) - mean) / max(var, 1e-8) ** 0.5 for v in values]


def reference_group_centre(rewards, gids):
    out = [0.0] * len(rewards)
    for idx in _members(gids).values():
        mean = sum(float(rewards[i]) for i in idx) / len(idx)
        for i in idx:
            out[i] = float(rewards[i]) - mean
    return out


def _scalars(name, rewards, gids, lens, normalize=True):
    out = compute_advantages(name, gids, rewards, lens, normalize_std=normalize)
    for a, n in zip(out, lens):
        assert a.dtype == np.float32 and a.shape == (n,) and np.all(a == a[0] if n else True)
    # zero-length responses carry no tokens; recover their scalar through a length-1 query
    return out


@pytest.mark.parametrize("seed", range(4))
def test_rloo_dr_grpo_rpp_match_references(seed):
    rewards, gids, lens = _batch(seed)
    ones = [1] * len(rewards)
    cases = {
        "rloo": (ones, reference_rloo(rewards, gids)),
        "dr_grpo": (ones, reference_group_centre(rewards, gids)),
        "reinforce_plus_plus": (lens, reference_token_whiten(rewards, lens)),
        "reinforce_plus_plus_baseline": (
            lens,
            reference_token_whiten(reference_group_centre(rewards, gids), lens),
        ),
    }
    for name, (ls, ref) in cases.items():
        out = _scalars(name, rewards, gids, ls)
        for a, r in zip(out, ref):
            if len(a):
                assert abs(float(a[0]) - r) <= 1e-6, name


def test_rpp_whitening_is_global_not_per_group():
    # two groups with different reward levels: per-group normalisation would erase the gap, REINFORCE++ keeps it
    out = compute_advantages("reinforce_plus_plus", [0, 0, 1, 1], [1.0, 1.0, 0.0, 0.0], [2, 2, 2, 2])
    assert [float(a[0]) for a in out] == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-6)
    base = compute_advantages("reinforce_plus_plus_baseline", [0, 0, 1, 1], [1.0, 1.0, 0.0, 0.0], [2] * 4)
    assert all(np.all(a == 0.0) for a in base)  # every group constant: no signal after the group baseline


def test_rloo_is_scaled_grpo_centring_and_singletons_are_zero():
    r = np.array([0.3, 1.0, -2.0, 0.5])
    out = compute_advantages("rloo", [0] * 4, r, [1] * 4)
    np.testing.assert_allclose([a[0] for a in out], 4 / 3 * (r - r.mean()), atol=1e-6)
    solo = compute_advantages("rloo", ["a", "b"], [1.0, 2.0], [3, 3])
    assert all(np.all(a == 0.0) for a in solo)


def test_new_estimators_are_registered_and_finite_on_edge_cases():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(
        ADVANTAGE_ESTIMATORS
    )
    for name in ADVANTAGE_ESTIMATORS:
        for normalize in (True, False):
            out = compute_advantages(name, [0, 0, 1], [1.0, 1.0, 1.0], [0, 0, 0], normalize_std=normalize)
            assert [a.shape for a in out] == [(0,), (0,), (0,)]
            out = compute_advantages(name, [0, 0, 1], [2.0, 2.0, 2.0], [3, 1, 2], normalize_std=normalize)
            assert all(np.isfinite(a).all() and np.all(a == 0.0) for a in out), name


def test_mismatched_lengths_say_what_to_fix():
    with pytest.raises(ValueError, match="one entry per sample"):
        compute_advantages("grpo", [0, 0], [1.0, 0.0], [1])


def test_reinforce_plus_plus_whitens_over_the_trained_batch_whatever_parts_it_was_scored_in():
    """Fully async, the Advantages role takes whatever part of a batch is ready; REINFORCE++'s whitening
    spans the batch trained on. Scored in two parts, finished over the whole: equal to whitening the whole
    batch at once (whitening each part gave a 0.78 deviation in the review)."""
    from relax_train.algorithms.advantages import finish_batch_advantages

    rng = np.random.default_rng(0)
    groups = [f"g{i // 4}" for i in range(16)]
    rewards = rng.normal(size=16) + np.repeat([0.0, 2.0, -1.0, 0.5], 4)
    lens = rng.integers(1, 6, size=16).tolist()
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        for std in (True, False):
            whole = compute_advantages(name, groups, rewards, lens, normalize_std=std)
            parts = [
                compute_advantages(name, groups[s], rewards[s], lens[s], std, batch_step=False)
                for s in (slice(0, 4), slice(4, 16))
            ]
            got = finish_batch_advantages(name, parts[0] + parts[1], normalize_std=std)
            for a, b in zip(got, whole):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            if std or name == "reinforce_plus_plus":  # the defect: the batch step over the part scored
                per_part = compute_advantages(name, groups[:4], rewards[:4], lens[:4], std)
                assert max(abs(float(a[0] - b[0])) for a, b in zip(per_part, whole[:4])) > 0.1


def test_batch_whitening_counts_the_models_tokens_only_as_verls_masked_whiten_does():
    """A multi-turn response's environment tokens (loss_mask 0) are no actions: REINFORCE++'s whitening
    weighed each response by its whole length, observations included (#39); veRL's ``masked_whiten`` and
    OpenRLHF whiten over the action tokens. Reference: the per-token advantages whitened over the mask's 1s
    (population variance), written out here."""
    from relax_train.algorithms.advantages import finish_batch_advantages

    rng = np.random.default_rng(1)
    masks = [np.array([1, 1, 0, 0, 0, 0, 1]), np.array([1, 1]), np.array([1, 0, 0, 0, 1, 1]), np.array([1])]
    rewards = rng.normal(size=4)
    groups = ["a", "a", "b", "b"]
    lens = [len(m) for m in masks]
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        parts = compute_advantages(name, groups, rewards, lens, batch_step=False)
        tokens = np.concatenate(parts).astype(np.float64)
        mask = np.concatenate(masks).astype(bool)
        mean, var = tokens[mask].mean(), tokens[mask].var()
        want = np.split((tokens - mean) / np.sqrt(max(var, 1e-8)), np.cumsum(lens)[:-1])
        got = finish_batch_advantages(name, parts, loss_masks=masks)
        whole = compute_advantages(name, groups, rewards, lens, loss_masks=masks)
        for g, w, c in zip(got, want, whole):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(c, w, rtol=1e-5, atol=1e-6)
