"""The training-backend protocol, its registry (:class:`~relax_core.registry.Registry`: imported only when
built) and factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from relax_core.registry import Registry
from relax_core.sample import TrainBatch

MEGATRON_HINT = "megatron-core: pip install 'relax-train[megatron]'"
"""What a megatron backend needs where megatron-core is not installed."""


class StreamedUpdate(Protocol):
    """One optimizer step fed part by part as a batch arrives (:mod:`relax_train.backends.streamed`)."""

    def add(self, part: TrainBatch) -> None:
        """Forward and backward of ``part`` (samples as ``train_step`` takes them); gradients accumulate."""

    def finish(self) -> dict[str, float]:
        """The optimizer step once every sample was added; its metrics (as ``train_step``'s)."""


@runtime_checkable
class TrainBackend(Protocol):
    """What the train roles (Actor, ActorFwd, Reference, a teacher) call on a model: the torch backend
    (one process), the megatron backend (one rank) and a megatron rank group (every rank in lockstep)
    satisfy it; ``tests/backends/test_contract.py`` holds both backends to it.

    ``samples`` is the bus's column dict (``tokens``, ``prompt_len``, ``response_len``, ``loss_mask``,
    ``advantages``, ... one entry per sample)."""

    version: int
    """The policy version of the weights held (bumped by ``train_step``; set by ``load_weights``)."""
    routing: Any
    """Routing replay (R3) state of a MoE model, or None; a role sets it None to turn replay off."""
    before_update: Callable[[], object] | None
    """Called before the optimizer changes the weights (the trainer waits there for a weight send; what it
    returns, the wait, is not used)."""
    stochastic_forward: bool
    """The training forward is random (dropout): its log-probs are not π_θ's, so π_prox is computed apart
    (:func:`relax_train.roles.prox.exact_prox`)."""
    supports_streamed_step: bool
    """Whether :meth:`streamed_step` works here: the trainer trains a streamed batch part by part as it
    arrives only then (:func:`relax_train.roles.stream.streams_training`), else it takes the batch whole."""

    def compute_log_probs(self, samples: TrainBatch) -> list[np.ndarray]:
        """Each sample's per-response-token log-probs under the current weights (no gradient)."""

    def train_step(self, samples: TrainBatch) -> dict[str, float]:
        """One optimizer step (or several: ``--num-steps-per-rollout``) on the batch; the step's metrics."""

    def streamed_step(self, n_seqs: int) -> StreamedUpdate:
        """An optimizer step of ``n_seqs`` samples fed part by part, the same update as ``train_step`` on
        the whole batch; refused (an error naming the flags) where ``supports_streamed_step`` is False or
        the run's loss settings make it inexact."""

    def eval_model(self) -> Any:
        """An HF model the evaluator can generate with (weights equal to this backend's)."""

    def named_weights(self) -> list[tuple[str, Any]]:
        """Every weight under its HF name, whole (gathered across ranks where sharded)."""

    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Copy HF-named tensors into the model and take ``version``."""

    def save_checkpoint(self, path: str | Path) -> None:
        """Model, optimizer and RNG state into the directory ``path``, and ``meta.json`` with the version:
        only this backend's own state (the run's lies beside it: :class:`relax_core.resume.CheckpointDir`)."""

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns its ``meta.json``. Refuses a damaged one."""

    def offload(self) -> int:
        """Move weights, gradients and optimizer state to host memory; bytes freed on the device."""

    def onload(self) -> int:
        """Bring back what ``offload`` moved (a no-op when nothing is offloaded); bytes moved."""


BACKENDS = Registry(
    "--train-backend",
    "relax.train_backends",
    {
        "torch": "relax_train.backends.torch_backend:TorchBackend",
        "megatron": "relax_train.backends.megatron.group:build_megatron",
    },
    hints={"megatron": MEGATRON_HINT},
)
"""The training backends (another package adds one under the ``relax.train_backends`` entry points)."""


def build_backend(
    name: str, before_update: Callable[[], object] | None = None, **kwargs: Any
) -> TrainBackend:
    """The ``name`` backend built with ``kwargs``; ``before_update``: its :attr:`TrainBackend.before_update`
    (the trainer's fence), handed over here so that no role sets it on a backend afterwards."""
    backend = BACKENDS.load(name)(**kwargs)
    if before_update is not None:
        backend.before_update = before_update
    return backend
