"""RMSNorm for megatron's local (non-Transformer-Engine) layer spec that allows sequence parallelism.

Why: without Transformer Engine or Apex, megatron-core builds its norms with ``WrappedTorchNorm``, which
refuses ``sequence_parallel`` — so ``--sequence-parallel`` (the VL recipe sets it) failed on any machine
without those libraries. Under sequence parallelism a norm sees only this TP rank's share of the tokens,
so its weight's gradient is partial: the norm here is ``torch.nn.RMSNorm`` with its weight marked
``sequence_parallel`` (as Apex's and TE's norms mark theirs), and the backend sums such gradients over the
tensor-parallel group before the step (:func:`~relax_train.backends.megatron.training.clip_and_step`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built as megatron builds norms (``config, hidden_size, eps``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization={config.normalization!r}: this norm is RMSNorm only")
        super().__init__(hidden_size, eps=eps)
        # megatron-core's convention: flags set on the parameter, which torch's Parameter type does not declare
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def use_sequence_parallel_norms(spec: Any) -> None:
    """Swap ``WrappedTorchNorm`` for :class:`SequenceParallelRMSNorm` everywhere in a decoder block spec
    (layer norms, QK norms, the final norm); Apex's or TE's norms, where present, are left alone."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen: set[int] = set()

    def walk(node: Any) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, ModuleSpec):
            if node.module is WrappedTorchNorm:
                node.module = SequenceParallelRMSNorm
            walk(node.submodules)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                if value is WrappedTorchNorm:
                    setattr(node, field.name, SequenceParallelRMSNorm)
                else:
                    walk(value)

    walk(spec)
