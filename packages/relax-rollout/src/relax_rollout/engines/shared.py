"""One in-process torch engine shared by many HTTP callers, their requests batched continuously.

Why: an engine server answers each call on a thread of its own, and the torch engine's ``generate`` runs one
call's prompts as one batch under its lock, so concurrent agents (one prompt each) would decode one after
another. Behind this wrapper their requests join a :class:`~relax_rollout.engines.continuous.ContinuousBatcher`
instead, and decode together. What the batcher does not serve (stop strings, top or prompt log-probs, media)
goes to the engine's own batch path, which takes the same lock between decode steps.

Everything else (weights' version and checksum, memory release, the model and tokenizer) is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax_rollout.engines.base import GenerateOutput, SamplingParams, TokenDelta
from relax_rollout.engines.continuous import ContinuousBatcher


class SharedTorchEngine:
    """``engine`` (a :class:`~relax_rollout.engines.torch_engine.TorchEngine`) with at most ``max_running``
    requests decoding together. ``drain``: a weight update waits for the running requests to end (every
    reply of one version) instead of going in between two decode steps."""

    def __init__(self, engine: Any, max_running: int, drain: bool = True) -> None:
        self.engine, self.drain = engine, drain
        self.batcher = ContinuousBatcher(engine, max_running=max_running)

    def __getattr__(self, name: str) -> Any:  # (only for what is not defined here: the engine's)
        return getattr(self.engine, name)

    @property
    def features(self) -> frozenset[str]:
        return frozenset(self.engine.features)

    @property
    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        mm: list[dict[str, Any] | None] | None = None,
        on_token: Callable[[TokenDelta], None] | None = None,
    ) -> list[GenerateOutput]:
        batch_only = params.stop or params.top_logprobs or params.input_logprobs or (mm and any(mm))
        if batch_only:
            return self.engine.generate(prompts, params, mm=mm, on_token=on_token)
        return self.batcher.generate(prompts, params, on_token)

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        self.batcher.update_weights(tensors, version, drain=self.drain)

    def close(self) -> None:
        """Stop the batcher (requests not finished end with an error); the engine stays the caller's."""
        self.batcher.close()
