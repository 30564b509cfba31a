"""``remote``: ask a reward server over HTTP.

Why: some rewards live elsewhere — a reward model served on GPUs, a proprietary checker, a
sandbox farm. The contract is deliberately small: we POST

    {"response": ..., "label": ..., "metadata": {...}}

and accept either a bare number or ``{"score": x, ...}`` (other keys become ``details``). Transient
failures (refused connection, 408/429/5xx, time-outs) are retried with exponential back-off; when
every attempt fails the call raises, which the :class:`~relax_rewards.scorer.Scorer` turns into the
fallback score with the reason.

The URL comes from ``metadata["remote_url"]``, else ``$RELAX_REMOTE_RM_URL``. For a fixed server use
:class:`RemoteReward` directly: ``Scorer(RemoteReward("http://rm:8000/score", retries=5))``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from relax_rewards._http import AsyncBatchMixin, post_json
from relax_rewards.registry import register
from relax_rewards.types import RewardResult

__all__ = ["RemoteReward", "remote_reward"]


@dataclass
class RemoteReward(AsyncBatchMixin):
    """A reward that POSTs each sample to ``url``; picklable, so it also runs with process isolation."""

    url: str
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.5
    headers: dict | None = None

    def __call__(self, response: str, label: Any, metadata: dict | None = None) -> RewardResult:
        reply = post_json(
            self.url,
            {"response": response, "label": label, "metadata": _jsonable(metadata or {})},
            timeout_s=self.timeout_s,
            retries=self.retries,
            backoff_s=self.backoff_s,
            headers=self.headers,
        )
        if isinstance(reply, dict):
            if "score" not in reply:
                raise ValueError(f"reward server {self.url} replied without a 'score': {str(reply)[:200]}")
            details = {k: v for k, v in reply.items() if k != "score"}
            return RewardResult(float(reply["score"]), details)
        return RewardResult(float(reply))


@register("remote", "remote_rm")
def remote_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """POST to ``metadata["remote_url"]`` (or ``$RELAX_REMOTE_RM_URL``); see the module docstring."""
    meta = metadata or {}
    url = meta.get("remote_url") or os.environ.get("RELAX_REMOTE_RM_URL")
    if not url:
        raise ValueError("remote reward needs metadata['remote_url'] or $RELAX_REMOTE_RM_URL")
    return RemoteReward(
        url,
        timeout_s=float(meta.get("remote_timeout_s", 30.0)),
        retries=int(meta.get("remote_retries", 3)),
        backoff_s=float(meta.get("remote_backoff_s", 0.5)),
    )(response, label, {k: v for k, v in meta.items() if not k.startswith("remote_")})


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)
