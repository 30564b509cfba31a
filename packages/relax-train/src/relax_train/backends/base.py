"""The training-backend protocol, its registry and factory (dotted paths, imported only when built)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


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
    before_update: Callable[[], None] | None
    """Called before the optimizer changes the weights (the trainer waits there for a weight send)."""

    def compute_log_probs(self, samples: dict[str, list]) -> list[np.ndarray]:
        """Each sample's per-response-token log-probs under the current weights (no gradient)."""

    def train_step(self, samples: dict[str, list]) -> dict[str, float]:
        """One optimizer step (or several: ``--num-steps-per-rollout``) on the batch; the step's metrics."""

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


BACKENDS: dict[str, str] = {
    "torch": "relax_train.backends.torch_backend:TorchBackend",
    "megatron": "relax_train.backends.megatron.group:build_megatron",
}


def build_backend(name: str, **kwargs: Any) -> TrainBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown --train-backend {name!r}; available: {sorted(BACKENDS)}")
    module, _, attr = BACKENDS[name].partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        if name == "megatron" and (e.name or "").startswith("megatron"):
            raise ImportError(
                "--train-backend megatron needs megatron-core: pip install 'relax-train[megatron]'"
            ) from e
        raise
    return cls(**kwargs)
