"""Training-backend registry and factory (dotted paths, imported only when built)."""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    "torch": "relax_train.backends.torch_backend:TorchBackend",
}


def build_backend(name: str, **kwargs: Any):
    if name not in BACKENDS:
        hint = " (needs `pip install 'relax-train[megatron]'` and a GPU)" if name == "megatron" else ""
        raise ValueError(f"unknown --train-backend {name!r}; available: {sorted(BACKENDS)}{hint}")
    module, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)
