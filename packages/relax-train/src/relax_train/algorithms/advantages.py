"""Advantage estimators: plain numpy functions in a name → function registry.

They run in the Advantages role, which needs no accelerator, so nothing here imports torch.
Every estimator sees the whole batch — ``rewards`` (one scalar per response), ``groups`` (index arrays,
one per prompt) and ``lens`` (each response's count of the model's own tokens, :func:`model_tokens`) —
because REINFORCE++ whitens over the global batch rather than within a group. It returns one scalar advantage per response;
:func:`compute_advantages` broadcasts it over that response's tokens.

Why these and not more: they are the outcome-reward estimators the field trains with today (GRPO and its
unbiased Dr.GRPO form, RLOO, REINFORCE++ with and without a group baseline). Token-level returns with the
KL folded into the reward (REINFORCE++'s full form) come later; with outcome rewards only, the token-level
return equals the sequence reward at every token, which is what these produce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# (rewards [N], groups: index arrays, model tokens [N], normalize_std) -> advantages [N]
Estimator = Callable[[np.ndarray, list[np.ndarray], np.ndarray, bool], np.ndarray]


def grpo(rewards: np.ndarray, normalize_std: bool = True) -> np.ndarray:
    """Group-relative advantage of one group: (r - mean) / (std + 1e-4), std unbiased as in TRL; centring
    only when ``normalize_std`` is False. A group of one gets 0, as in TRL (veRL keeps its raw reward): a
    lone response has nothing to be relative to, and the raw reward's scale is not an advantage's.

    Source: Shao et al. 2024, *DeepSeekMath* (arXiv:2402.03300) §4.1.2, outcome supervision
    Â_i = (r_i - mean(r)) / std(r); the +1e-4 and the unbiased std follow TRL's GRPOTrainer (a smaller
    epsilon blows near-tied continuous rewards' differences up to unit-size advantages).

    >>> grpo(np.array([1.0, 0.0, 0.0, 1.0])).round(3).tolist()
    [0.866, -0.866, -0.866, 0.866]
    """
    centred = rewards - rewards.mean()
    if not normalize_std:
        return centred
    std = rewards.std(ddof=1) if len(rewards) > 1 else 0.0
    return centred / (std + 1e-4)


def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO advantage of one group: r - mean(r), never divided by the std (which biases towards
    groups whose rewards barely differ).

    Source: Liu et al. 2025, *Understanding R1-Zero-Like Training: A Critical Perspective*
    (arXiv:2503.20783) §3.1, Eq. 3.

    >>> dr_grpo(np.array([3.0, 0.0, 0.0])).tolist()
    [2.0, -1.0, -1.0]
    """
    return rewards - rewards.mean()


def rloo(rewards: np.ndarray) -> np.ndarray:
    """REINFORCE leave-one-out advantage of one group: r_i - mean_{j≠i} r_j = n/(n-1) · (r_i - mean(r));
    zero for a group of one (there is no other sample to form a baseline from).

    Source: Ahmadian et al. 2024, *Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs* (arXiv:2402.14740) §3.2; Kool et al. 2019, *Buy 4 REINFORCE Samples, Get a
    Baseline for Free!*.

    >>> rloo(np.array([1.0, 0.0, 0.0, 1.0])).round(4).tolist()
    [0.6667, -0.6667, -0.6667, 0.6667]
    """
    n = len(rewards)
    if n < 2:
        return np.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (n - 1)


def whiten_over_tokens(values: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Global batch whitening of per-response values, weighting each response by its count of the model's
    own tokens (each carries the value; ``lens``: those counts, see :func:`model_tokens`), as OpenRLHF
    whitens REINFORCE++ returns over the action tokens and veRL's ``masked_whiten`` over the response mask:
    (x - mean) / sqrt(max(var, 1e-8)), population variance.

    >>> whiten_over_tokens(np.array([1.0, 0.0]), np.array([3, 1])).round(4).tolist()
    [0.5774, -1.7321]
    """
    w = lens.astype(np.float64)
    total = w.sum()
    if total == 0:
        return np.zeros_like(values)
    mean = (values * w).sum() / total
    var = (((values - mean) ** 2) * w).sum() / total
    return (values - mean) / np.sqrt(max(var, 1e-8))


def whiten_tokens(
    advantages: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray] | None, normalize_std: bool = True
) -> list[np.ndarray]:
    """Per-token advantages (GAE's) whitened over the batch's model tokens (``loss_masks`` 1; every token
    without masks): (A − mean) / sqrt(var + 1e-8), the unbiased variance, as veRL's ``masked_whiten`` after
    GAE; ``normalize_std`` False only centres. The environment's tokens get 0 (they carry no action).

    >>> [[round(float(x), 4) for x in a] for a in whiten_tokens([np.array([1.0, 3.0, 9.0])], [np.array([1, 1, 0])])]
    [[-0.7071, 0.7071, 0.0]]
    """
    masks = [
        (np.asarray(m)[: len(a)] > 0) if loss_masks is not None else np.ones(len(a), bool)
        for a, m in zip(advantages, loss_masks if loss_masks is not None else [None] * len(advantages))
    ]
    flat = np.concatenate([np.asarray(a, np.float64)[m] for a, m in zip(advantages, masks)] or [np.zeros(0)])
    if len(flat) == 0:
        return [np.zeros(len(a), np.float32) for a in advantages]
    mean = flat.mean()
    scale = 1.0
    if normalize_std:
        var = flat.var(ddof=1) if len(flat) > 1 else 0.0
        scale = 1.0 / np.sqrt(var + 1e-8)
    return [
        np.where(m, (np.asarray(a, np.float64) - mean) * scale, 0.0).astype(np.float32)
        for a, m in zip(advantages, masks)
    ]


def _reinforce_plus_plus(rewards, groups, lens, normalize_std):
    """REINFORCE++: the return (here the outcome reward at every token) whitened over the global batch.

    Source: Hu 2025, *REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward
    Models* (arXiv:2501.03262) §3, "advantage normalization" A_norm = (A - mean_batch) / std_batch;
    the token weighting and the 1e-8 floor follow OpenRLHF. ``normalize_std`` False only centres.
    """
    if not normalize_std:
        w = lens.astype(np.float64)
        return rewards - ((rewards * w).sum() / w.sum() if w.sum() else 0.0)
    return whiten_over_tokens(rewards, lens)


def _reinforce_plus_plus_baseline(rewards, groups, lens, normalize_std):
    """REINFORCE++-baseline: subtract each group's mean reward, then whiten over the global batch.

    Source: Hu 2025 (arXiv:2501.03262, v3+) §3, "REINFORCE++-Baseline" for reasoning tasks; as in
    OpenRLHF's ``reinforce_baseline``. ``normalize_std`` False skips the global whitening.
    """
    centred = rewards.copy()
    for idx in groups:
        centred[idx] = dr_grpo(rewards[idx])
    return whiten_over_tokens(centred, lens) if normalize_std else centred


def model_tokens(
    response_lens: Sequence[int] | np.ndarray, loss_masks: Sequence[np.ndarray] | None
) -> np.ndarray:
    """Each response's count of the model's own tokens: what a batch-wide step weighs it by. A multi-turn
    response's environment tokens (``loss_mask`` 0) are no actions: counting them (the response length, as
    before) weighted a response by the observations it was shown."""
    if loss_masks is None:
        return np.asarray(response_lens, dtype=np.int64).reshape(-1)
    return np.asarray([int(np.count_nonzero(m)) for m in loss_masks], dtype=np.int64)


def _per_group(fn: Callable[..., np.ndarray], pass_std: bool) -> Estimator:
    def estimator(rewards, groups, lens, normalize_std):
        out = np.zeros_like(rewards)
        for idx in groups:
            out[idx] = fn(rewards[idx], normalize_std) if pass_std else fn(rewards[idx])
        return out

    estimator.__doc__ = fn.__doc__
    return estimator


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": _per_group(grpo, pass_std=True),
    "dr_grpo": _per_group(dr_grpo, pass_std=False),
    "rloo": _per_group(rloo, pass_std=False),
    "reinforce_plus_plus": _reinforce_plus_plus,
    "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
}


BATCH_NORMALISED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
"""Estimators whose last step (whitening, or centring without ``normalize_std``) spans the whole trained
batch, not a group (GAE's per-token whitening too: it is not in :data:`ADVANTAGE_ESTIMATORS`, the Advantages
role computes GAE from the Critic's values): in fully-async mode the Advantages role sees whatever part of a batch is ready, so it
leaves that step out (``batch_step=False``) and the trainer applies it to the batch it trains on
(:func:`finish_batch_advantages`)."""


def compute_advantages(
    name: str,
    group_ids: Sequence[object],
    rewards: Sequence[float],
    response_lens: Sequence[int],
    normalize_std: bool = True,
    batch_step: bool = True,
    loss_masks: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Per-sample token advantages (float32, one per response token), grouping by ``group_ids``. With
    ``batch_step`` False the :data:`BATCH_NORMALISED` estimators stop before their batch-wide step (the
    return for REINFORCE++, the group-centred return for its baseline variant). ``loss_masks``: the
    batch-wide step weighs each response by its model tokens (:func:`model_tokens`).

    >>> [a.tolist() for a in compute_advantages("rloo", ["p", "p", "q"], [1.0, 0.0, 5.0], [2, 1, 1])]
    [[1.0, 1.0], [-1.0], [0.0]]
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown --advantage-estimator {name!r}; available: {sorted(ADVANTAGE_ESTIMATORS)}")
    r = np.asarray(rewards, dtype=np.float64)
    lens = np.asarray(response_lens, dtype=np.int64).reshape(-1)
    if len(lens) != len(r) or len(group_ids) != len(r):
        raise ValueError(
            f"rewards, group_ids and response_lens must have one entry per sample "
            f"(got {len(r)}, {len(group_ids)}, {len(lens)})"
        )
    by_group: dict[object, list[int]] = {}
    for i, g in enumerate(group_ids):
        by_group.setdefault(g, []).append(i)
    groups = [np.asarray(idx, dtype=np.int64) for idx in by_group.values()]
    weights = model_tokens(lens, loss_masks)
    if name in BATCH_NORMALISED and not batch_step:
        scalar = (
            r if name == "reinforce_plus_plus" else _reinforce_plus_plus_baseline(r, groups, weights, False)
        )
    else:
        scalar = ADVANTAGE_ESTIMATORS[name](r, groups, weights, normalize_std)
    return [np.full(int(n), scalar[i], dtype=np.float32) for i, n in enumerate(lens)]


def finish_batch_advantages(
    name: str,
    advantages: Sequence[np.ndarray],
    normalize_std: bool = True,
    loss_masks: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """The batch-wide step of the :data:`BATCH_NORMALISED` estimator ``name`` over the batch being trained
    on, for the per-response values :func:`compute_advantages` left with ``batch_step=False``: whitening
    over its model tokens (``loss_masks``; :func:`model_tokens`); without ``normalize_std``, REINFORCE++
    centres over them and its baseline variant (already group-centred) does nothing.

    >>> [a.tolist() for a in finish_batch_advantages("reinforce_plus_plus", [np.ones(3), np.zeros(1)])]
    [[0.5773502588272095, 0.5773502588272095, 0.5773502588272095], [-1.7320507764816284]]
    """
    if name not in BATCH_NORMALISED:
        raise ValueError(f"{name!r} has no batch-wide step (those that have: {BATCH_NORMALISED})")
    if name == "gae":  # per-token advantages (the Advantages role's GAE): whitened token by token
        return whiten_tokens(advantages, loss_masks, normalize_std)
    lens = np.asarray([len(a) for a in advantages], dtype=np.int64)
    weights = model_tokens(lens, loss_masks)
    values = np.asarray([float(a[0]) if len(a) else 0.0 for a in advantages], dtype=np.float64)
    if normalize_std:
        out = whiten_over_tokens(values, weights)
    elif name == "reinforce_plus_plus_baseline":
        out = values
    else:
        w = weights.astype(np.float64)
        out = values - ((values * w).sum() / w.sum() if w.sum() else 0.0)
    return [np.full(int(n), out[i], dtype=np.float32) for i, n in enumerate(lens)]
