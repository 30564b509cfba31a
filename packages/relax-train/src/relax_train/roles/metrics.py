"""The metrics of one training step, computed from the batch's own fields.

Pure functions of the samples (no model, no bus): what the trainer logs after each step in both modes, and
what a test or a notebook can compute again from a saved batch. ``rollout/*`` describes what was generated,
``train/*`` and ``perf/*`` the step that trained on it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from relax_bus import StalenessBound
from relax_core import sample
from relax_core.sample import TrainBatch, columns


def rollout_metrics(d: TrainBatch) -> dict[str, float]:
    """``rollout/*`` of one trained batch, from its samples' fields (both modes: the trainer logs them).

    Per rollout step values (``rollout_tokens_per_s``, dynamic sampling's counters) are repeated on that
    step's samples: averaged over the batch's samples. Multi-turn samples (``turns``) add the mean
    turns per episode and how many episodes ended for each reason (``rollout/stop/env_done``, ...)."""
    out = {
        "rollout/reward_mean": float(np.mean(d[sample.REWARD])),
        "rollout/response_len_mean": float(np.mean(d[sample.RESPONSE_LEN])),
        "rollout/truncated_frac": float(np.mean([f == "length" for f in d[sample.FINISH_REASON]])),
        "rollout/reward_failures": float(sum(bool(x) for x in d[sample.REWARD_FAILURE])),
    }
    by_group: dict[str, list[float]] = {}
    for g, r in zip(d[sample.GROUP_ID], d[sample.REWARD]):
        by_group.setdefault(str(g), []).append(float(r))
    out["rollout/groups"] = float(len(by_group))
    # groups whose rewards are all equal: zero advantage, no gradient (what dynamic sampling removes)
    out["rollout/uninformative_groups"] = float(sum(max(v) == min(v) for v in by_group.values()))
    for key, name in (
        (sample.DS_DROPPED_GROUPS, None),
        (sample.DS_EXTRA_ROUNDS, None),
        (sample.DS_UNFILLED_GROUPS, None),
        (sample.ROLLOUT_TOKENS_PER_S, "tokens_per_s"),
    ):
        values = [v for v in columns(d).get(key, ()) if v is not None]
        if values:  # one value per rollout step, repeated on its samples
            out[f"rollout/{name or key}"] = float(np.mean(values))
    turns = [(t, f) for t, f in zip(d.get(sample.TURNS, ()), d[sample.FINISH_REASON]) if t is not None]
    if turns:
        out["rollout/turns_mean"] = float(np.mean([t for t, _ in turns]))
        for _, reason in turns:
            out[f"rollout/stop/{reason}"] = out.get(f"rollout/stop/{reason}", 0.0) + 1.0
        out.update(agent_metrics(d))
    if sample.AGENT in d:
        out.update(per_agent_metrics(d))
    return out


def per_agent_metrics(d: TrainBatch) -> dict[str, float]:
    """Multi-agent runs (--agents): each agent's reward, response length and turns, as
    ``rollout/agent/<name>/...``; its staleness is added by :func:`step_metrics`."""
    out: dict[str, float] = {}
    names = d[sample.AGENT]
    for name in sorted(set(names)):
        rows = [i for i, a in enumerate(names) if a == name]
        out[f"rollout/agent/{name}/reward_mean"] = float(np.mean([d[sample.REWARD][i] for i in rows]))
        out[f"rollout/agent/{name}/response_len_mean"] = float(
            np.mean([d[sample.RESPONSE_LEN][i] for i in rows])
        )
        turns = d.get(sample.TURNS)
        if turns is not None:
            out[f"rollout/agent/{name}/turns_mean"] = float(np.mean([turns[i] for i in rows]))
    return out


def agent_metrics(d: TrainBatch) -> dict[str, float]:
    """Multi-turn batches: per-turn latency percentiles (``rollout/turn_s_p50`` .. ``_p99``) and the share of
    tool calls that failed (``rollout/tool_call_error_rate``, where the environment counts them)."""
    out: dict[str, float] = {}
    per_turn = [x for v in d.get(sample.TURN_S, ()) if v is not None for x in np.asarray(v).tolist()]
    if per_turn:
        for q in (50, 90, 95, 99):
            out[f"rollout/turn_s_p{q}"] = float(np.percentile(per_turn, q))
    calls = sum(c or 0 for c in d.get(sample.TOOL_CALL_COUNT, ()))
    if calls:
        out["rollout/tool_calls_mean"] = calls / max(len(d.get(sample.TOOL_CALL_COUNT, ())), 1)
        out["rollout/tool_call_error_rate"] = sum(e or 0 for e in d.get(sample.TOOL_CALL_ERRORS, ())) / calls
    return out


def logp_absdiff(log_probs, rollout_log_probs, loss_masks=None) -> float | None:
    """Mean |ActorFwd's log-prob − the rollout's| over the batch's model tokens (loss mask 1: an environment
    token's rollout log-prob is 0, not the model's), each token weighing the same; None for a batch without
    one (all responses empty) rather than NaN. (The gap between π_prox and the rollout, policy lag
    included, is the backend's ``rollout_abs_logp_diff``.)"""
    masks = loss_masks if loss_masks is not None else [None] * len(log_probs)
    diffs = []
    for a, b, m in zip(log_probs, rollout_log_probs, masks):
        d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
        diffs.append(d if m is None else d[np.asarray(m)[: len(d)] > 0])
    flat = np.concatenate(diffs) if diffs else np.zeros(0)
    return float(flat.mean()) if flat.size else None


def step_metrics(
    d: TrainBatch,
    step: int,
    samples: int,
    *,
    wait_for_data_s: float,
    train_s: float,
    weight_sync_s: float,
    weight_sync_wait_s: float,
    taken_at: list[float] | None = None,
) -> dict[str, Any]:
    """What the trainer logs for step ``step`` besides the backend's ``train/*``: the batch's ``rollout/*``,
    its staleness (the trainer's step minus each sample's ``policy_version``), the step's timings, and the
    gap between ActorFwd's log-probs and the rollout's where ActorFwd ran.

    Streaming rollout adds how far responses went on across weight updates (from ``token_versions``:
    responses that did, their interruptions — the updates a response went on across — and the widest
    version spread) and, with ``taken_at`` (when the trainer got each sample), the time from a group's
    last response to the trainer taking it (``generated_at``; wall clocks, so across machines it carries
    their skew)."""
    staleness = [StalenessBound.lag(int(v), step) for v in d[sample.POLICY_VERSION]]
    metrics: dict[str, Any] = rollout_metrics(d)
    metrics.update(
        {
            "step": step + 1,
            "train/staleness_mean": float(np.mean(staleness)),
            "train/staleness_max": float(np.max(staleness)),
            "perf/wait_for_data_s": wait_for_data_s,
            "perf/train_s": train_s,
            "perf/weight_sync_s": weight_sync_s,
            # the time this step's optimizer waited for the previous step's overlapped broadcast
            "perf/weight_sync_wait_s": weight_sync_wait_s,
            # the longest an engine stood still for one weight update, over the batch's rollout batches
            "perf/weight_pause_s": float(
                max((p for p in columns(d).get(sample.WEIGHT_PAUSE_S, ()) if p), default=0.0)
            ),
            "perf/samples": float(samples),
            "time": time.time(),
        }
    )
    if sample.AGENT in d:  # each agent's samples' staleness (an agent whose episodes run longer lags more)
        for name in sorted(set(d[sample.AGENT])):
            lags = [x for x, a in zip(staleness, d[sample.AGENT]) if a == name]
            metrics[f"rollout/agent/{name}/staleness_mean"] = float(np.mean(lags))
    if sample.TOKEN_VERSIONS in d:  # streaming rollout: responses that went on across weight updates
        spread = [int(np.max(v)) - int(np.min(v)) if len(v) else 0 for v in d[sample.TOKEN_VERSIONS]]
        cuts = [int(np.count_nonzero(np.diff(np.asarray(v)))) for v in d[sample.TOKEN_VERSIONS]]
        metrics["rollout/responses_across_updates"] = float(sum(x > 0 for x in spread))
        metrics["rollout/token_version_spread_max"] = float(max(spread, default=0))
        metrics["rollout/interruptions_mean"] = float(np.mean(cuts)) if cuts else 0.0
        metrics["rollout/interruptions_max"] = float(max(cuts, default=0))
    done = d.get(sample.GENERATED_AT)
    if taken_at is not None and done is not None and len(done) == len(taken_at):
        lag = [t - g for t, g in zip(taken_at, done) if g is not None]
        if lag:
            metrics["rollout/group_to_train_s_mean"] = float(np.mean(lag))
            metrics["rollout/group_to_train_s_max"] = float(np.max(lag))
    if sample.VALUES in d and sample.RETURNS in d:
        metrics.update(critic_metrics(d, step))
    if sample.LOG_PROBS in d:
        diff = logp_absdiff(d[sample.LOG_PROBS], d[sample.ROLLOUT_LOG_PROBS], d.get(sample.LOSS_MASK))
        if diff is not None:
            metrics["train/rollout_vs_fwd_logp_absdiff"] = diff
    return metrics


def critic_metrics(d: TrainBatch, step: int) -> dict[str, float]:
    """``critic/*`` of a batch trained with GAE: the fit of the values its advantages came from (explained
    variance, over the model's tokens), their means and the raw (not yet whitened) advantages', how many
    versions the values lag the trainer's step, and the Critic's last update before it valued these samples
    (``critic_update``: value loss, clip fraction, gradient norm; averaged over the batch)."""
    from relax_train.algorithms.value_loss import explained_variance

    masks = [np.asarray(m)[: len(v)] > 0 for m, v in zip(d[sample.LOSS_MASK], d[sample.VALUES])]
    values = np.concatenate(
        [np.asarray(v, np.float64)[m] for v, m in zip(d[sample.VALUES], masks)] or [np.zeros(0)]
    )
    returns = np.concatenate(
        [np.asarray(r, np.float64)[m] for r, m in zip(d[sample.RETURNS], masks)] or [np.zeros(0)]
    )
    out = {
        "critic/explained_variance": explained_variance(values, returns),
        "critic/values_mean": float(values.mean()) if values.size else 0.0,
        "critic/returns_mean": float(returns.mean()) if returns.size else 0.0,
        "critic/advantages_mean": float((returns - values).mean()) if values.size else 0.0,
    }
    versions = [int(v) for v in d.get(sample.VALUES_VERSION, ())]
    if versions:
        out["critic/values_lag_max"] = float(max(step - v for v in versions))
    updates = [u for u in d.get(sample.CRITIC_UPDATE, ()) if u]
    for key in sorted({k for u in updates for k in u}):
        got = [float(u[key]) for u in updates if key in u]
        out[key] = float(np.mean(got))
    return out
