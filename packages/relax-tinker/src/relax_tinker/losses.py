"""The Tinker API's loss functions, as plain functions of one datum: ``fn(logprobs, inputs, config)`` → the
datum's loss (a scalar; the call's loss is the sum over its datums, as Tinker defines it: no mean).

``logprobs``: the learner's log-probability of each ``target_tokens`` entry (this forward, with grad);
``inputs``: the datum's ``loss_fn_inputs`` as tensors (``logprobs`` there is the *sampler's*, ``advantages``,
``weights``, ...); ``config``: the call's ``loss_fn_config``. The formulas are Tinker's documented ones
(tinker-docs: losses), cross-checked in ``tests/test_losses.py``:

- ``cross_entropy``: ``-(logprobs * weights).sum()`` (weights may be any real: the SDK's client-side custom
  losses send ``-dL/dlogprobs`` as weights);
- ``importance_sampling``: ``-(exp(logprobs - sampler_logprobs) * advantages).sum()``;
- ``ppo``: ``-min(ratio * A, clip(ratio, low, high) * A).sum()`` (``clip_low_threshold`` 0.8,
  ``clip_high_threshold`` 1.2);
- ``cispo``: ``-(clip(ratio, low, high).detach() * logprobs * A).sum()``;
- ``dro``: ``-(logprobs * A - beta / 2 * (logprobs - sampler_logprobs) ** 2).sum()`` (``beta``);
- ``gspo``: PPO with one ratio per sequence: the mean log-ratio over the tokens ``sequence_ratio_mask`` marks
  (all sampled tokens where it is absent), carried by each token's gradient.

``stable_reinforce`` is refused by name: its formula is not published, and a stand-in would train something
other than what the user asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Loss = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]], torch.Tensor]


def _need(inputs: dict[str, torch.Tensor], key: str, loss: str) -> torch.Tensor:
    if key not in inputs:
        raise ValueError(f"loss_fn {loss!r} needs loss_fn_inputs[{key!r}]; this datum has {sorted(inputs)}")
    return inputs[key]


def _clip(inputs: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[Any, Any]:
    low = inputs.get("clip_low_threshold", config.get("clip_low_threshold", 0.8))
    high = inputs.get("clip_high_threshold", config.get("clip_high_threshold", 1.2))
    return low, high


def cross_entropy(
    logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, Any]
) -> torch.Tensor:
    weights = inputs.get("weights")
    if weights is None:
        weights = torch.ones_like(logprobs)
    return -(logprobs * weights).sum()


def importance_sampling(
    logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, Any]
) -> torch.Tensor:
    old, adv = (
        _need(inputs, "logprobs", "importance_sampling"),
        _need(inputs, "advantages", "importance_sampling"),
    )
    return -(torch.exp(logprobs - old) * adv).sum()


def ppo(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    old, adv = _need(inputs, "logprobs", "ppo"), _need(inputs, "advantages", "ppo")
    ratio = torch.exp(logprobs - old)
    low, high = _clip(inputs, config)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()


def cispo(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    old, adv = _need(inputs, "logprobs", "cispo"), _need(inputs, "advantages", "cispo")
    low, high = _clip(inputs, config)
    weight = torch.clamp(torch.exp(logprobs - old), low, high).detach()
    return -(weight * logprobs * adv).sum()


def dro(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    old, adv = _need(inputs, "logprobs", "dro"), _need(inputs, "advantages", "dro")
    if "beta" not in config:
        raise ValueError("loss_fn 'dro' needs loss_fn_config['beta'] (the weight of its quadratic penalty)")
    beta = float(config["beta"])
    return -(logprobs * adv - 0.5 * beta * (logprobs - old) ** 2).sum()


def gspo(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    old, adv = _need(inputs, "logprobs", "gspo"), _need(inputs, "advantages", "gspo")
    mask = inputs.get("sequence_ratio_mask")
    marked = (mask != 0) if mask is not None else (adv != 0)
    if not bool(marked.any()):
        return (logprobs * 0).sum()
    seq = (logprobs.detach() - old)[marked].mean()
    ratio = torch.exp(seq + logprobs - logprobs.detach())
    low, high = _clip(inputs, config)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()


LOSSES: dict[str, Loss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}
REFUSED = {
    "stable_reinforce": "its formula is not published, and a stand-in would train something else; pass "
    "loss_fn=importance_sampling (or ppo / cispo) instead",
    "custom": "server-side custom losses are not served; the SDK's forward_backward_custom computes them on "
    "the client (cross_entropy with its gradients as weights), which works here",
}


def loss_fn(name: str) -> Loss:
    """The loss named ``name``; an unknown or refused one raises ValueError saying what to use."""
    if name in REFUSED:
        raise ValueError(f"loss_fn {name!r} is not supported by this server: {REFUSED[name]}")
    if name not in LOSSES:
        raise ValueError(f"unknown loss_fn {name!r}; this server has {sorted(LOSSES)}")
    return LOSSES[name]
