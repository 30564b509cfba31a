"""What a backend holds besides its weights, shared by both backends: the tensors colocate's offload moves
off the device, and the optimizer and RNG states a checkpoint keeps.

Why apart: the torch and megatron backends hold these alike (a model, an AdamW or none, the process's RNGs)
and save or move them alike; each calls these functions with its own model and optimizer instead of one
backend inheriting the other's methods.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax_core.config_sections import TrainConfig
from relax_train.backends.step import apply_adamw_settings


def device_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """What a role holds on its device: weights, gradients (megatron's ``main_grad`` too), the optimizer's
    moments (``optimizer``: None for a frozen model)."""
    for p in model.parameters():
        yield p
        for g in (p.grad, getattr(p, "main_grad", None)):
            if g is not None:
                yield g
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


def trainer_state(optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Optimizer and RNG states: what a checkpoint holds besides the weights."""
    return {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "np_rng": np.random.get_state(),
    }


def restore_trainer_state(
    state: dict[str, Any], optimizer: torch.optim.Optimizer | None, path: Path, train: TrainConfig
) -> dict[str, Any]:
    """Put back :func:`trainer_state`'s states (the optimizer's where both it and the saved state exist,
    with ``train``'s learning rate, betas and weight decay: the settings given win); the checkpoint's
    ``meta.json`` under ``path`` (its ``version`` is the backend's to take)."""
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if optimizer is not None:
        apply_adamw_settings(optimizer, train)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    np.random.set_state(state["np_rng"])
    return json.loads((path / "meta.json").read_text())


class HostTurns:
    """``offload`` / ``onload`` of a backend's model and optimizer (colocate ``--offload``: the rollout
    engine uses the devices in between), for a backend with ``model`` and ``optimizer`` attributes; mixed
    into the torch policy and value backends."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    _host: Any = None
    """Its :class:`~relax_core.offload.HostOffload` once it offloaded (``@onloaded`` reads it)."""

    def offload(self) -> int:
        """Move weights, gradients and optimizer state to host memory, freeing the device (the tensor objects
        stay; :meth:`onload` refills them). Returns bytes freed."""
        from relax_core.offload import HostOffload

        if self._host is None:
            self._host = HostOffload(type(self).__name__)
        return self._host.offload(device_tensors(self.model, self.optimizer))

    def onload(self) -> int:
        """Bring back what :meth:`offload` moved (a no-op when nothing is offloaded). Returns bytes."""
        return self._host.onload() if self._host is not None else 0
