"""Exact π_prox: the trainer's own policy as the proximal policy of decoupled PPO.

ActorFwd scores a sample when it lands on the bus; in fully-async mode the trainer has often moved on by the
time it trains on it. This module decides, per sample, whether ActorFwd's log-probs still stand, come free
from the training forward, or must be recomputed, and reports how often each happened (``train/prox_*``).
Apart from the trainer so that it can be tested (and benchmarked, ``benchmarks/prox_designs.py``) with any
backend that computes log-probs.
"""

from __future__ import annotations

from typing import Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.sample import TrainBatch, columns, train_batch
from relax_train.backends.base import TrainBackend


def _per_sample(values: Any, n: int) -> bool:
    """Whether a batch field holds one value per sample (lists and arrays of the batch's length)."""
    return hasattr(values, "__len__") and not isinstance(values, (str, bytes, dict)) and len(values) == n


def exact_prox(cfg: RelaxConfig, backend: TrainBackend, d: TrainBatch) -> dict[str, float]:
    """Make ``log_probs`` (π_prox, what decoupled PPO and TIS correct towards and the ratio is clipped
    against) the trainer's policy at this step, as AReaL and slime have it.

    Without an ActorFwd role (:attr:`RelaxConfig.prox_from_training_forward`: each batch is one optimizer
    step) every sample's π_prox is the training forward's own log-probs, detached (``prox_from_forward``):
    that forward runs with exactly the weights before the update, so it costs nothing — unless the model
    has dropout, whose training forward is random: then π_prox is computed here in eval mode.

    With ActorFwd (several optimizer steps per batch), it computes a sample's log-probs when it lands on
    the bus, with the weights it holds then; in fully-async mode the trainer has often moved on by the time
    it trains on it (the sample's ``log_probs_version`` is behind), and π_prox could even equal the
    behaviour policy, so decoupled PPO corrected nothing. For a sample whose version differs from the
    trainer's:
    - in the batch's first optimizer step, π_prox is the training forward's own log-probs (as above);
    - in a later optimizer step, the weights have moved by then: its log-probs are recomputed here,
      with the weights before this step's update.
    The others keep ActorFwd's work. In colocate mode ActorFwd computes with the trainer's own model:
    nothing is stale. Whether π_prox is really the trainer's policy shows in ``train/prox_gap_max`` (the
    backend measures it in the first optimizer step's forward)."""
    n, now = len(d[sample.TOKENS]), backend.version
    if cfg.prox_from_training_forward:
        if backend.stochastic_forward:
            d[sample.LOG_PROBS], d[sample.LOG_PROBS_VERSION] = backend.compute_log_probs(d), [now] * n
            return {"train/prox_recomputed_frac": 1.0, "train/prox_from_forward_frac": 0.0}
        d[sample.PROX_FROM_FORWARD] = [True] * n
        return {"train/prox_recomputed_frac": 0.0, "train/prox_from_forward_frac": 1.0}
    if sample.LOG_PROBS_VERSION not in d or sample.LOG_PROBS not in d:
        return {}
    if not cfg.algo.exact_proximal_policy:
        lag = max((now - int(v) for v in d[sample.LOG_PROBS_VERSION]), default=0)
        return {"train/prox_lag_max": float(lag), "train/actor_fwd_lag_max": float(lag)}
    versions = [int(v) for v in d[sample.LOG_PROBS_VERSION]]
    stale = [i for i, v in enumerate(versions) if v != now]
    out = {
        "train/actor_fwd_lag_max": float(max((now - v for v in versions), default=0)),
        "train/prox_recomputed_frac": 0.0,
        "train/prox_from_forward_frac": 0.0,
    }
    if stale:
        first = min(cfg.effective_global_batch_size, n)  # the first optimizer step's samples
        from_forward = not backend.stochastic_forward
        later = [i for i in stale if i >= first or not from_forward]
        d[sample.LOG_PROBS], d[sample.LOG_PROBS_VERSION] = (
            list(d[sample.LOG_PROBS]),
            list(d[sample.LOG_PROBS_VERSION]),
        )
        if later:
            sub = {k: [vals[i] for i in later] for k, vals in columns(d).items() if _per_sample(vals, n)}
            for i, lp in zip(later, backend.compute_log_probs(train_batch(sub))):
                d[sample.LOG_PROBS][i] = lp
        live = set(stale) - set(later)
        d[sample.PROX_FROM_FORWARD] = [i in live for i in range(n)]
        for i in stale:
            d[sample.LOG_PROBS_VERSION][i] = now
        out["train/prox_recomputed_frac"] = len(later) / n
        out["train/prox_from_forward_frac"] = len(live) / n
    return out
