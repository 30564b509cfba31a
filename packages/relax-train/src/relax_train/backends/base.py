"""Training-backend registry and factory (dotted paths, imported only when built)."""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    "torch": "relax_train.backends.torch_backend:TorchBackend",
    "megatron": "relax_train.megatron.group:build_megatron",
}


def build_backend(name: str, **kwargs: Any):
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
