"""Routing replay (R3) for mixture-of-experts policies.

Why: an MoE layer's top-k expert choice is a discontinuous function of the hidden state. The rollout
engine and the trainer never compute exactly the same hidden states (other kernels and batch shapes, and
in asynchronous runs other weights), so some tokens are sent to different experts in training than the
ones that generated them: the trainer then scores the sample under a different network, and the
importance ratio of those tokens is noise. Routing replay records the engine's expert ids per token and
MoE layer, and makes the trainer's forward use exactly those ids. The mixing weights still come from the
trainer's own router (its softmax gathered at the replayed ids, renormalised as the router does), so the
router keeps its gradient.

Only each sparse MoE block's ``forward`` is replaced, on the instance: parameters, buffers and their names
are untouched, so checkpoints and weight sync are unaffected. Outside :meth:`Routing.record` and
:meth:`Routing.replay` the original forward runs. Supported blocks have the Qwen3-MoE layout (also used by
Qwen3-VL-MoE and the Qwen3-Omni thinker): exactly two children, ``gate`` (a top-k router with ``weight``,
``top_k``, ``norm_topk_prob``, returning ``(logits, weights, ids)``) and ``experts(hidden, ids, weights)``;
blocks with shared experts or other routers are left alone. The replayed ids are fixed when the forward
runs, so backward needs no replay state (but activation checkpointing that re-runs the forward would).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (torch is imported where it runs: this module imports without it)
    import torch


def _is_sparse_moe_block(module: torch.nn.Module) -> bool:
    import torch

    gate = getattr(module, "gate", None)
    return (
        {name for name, _ in module.named_children()} == {"gate", "experts"}
        and isinstance(getattr(gate, "weight", None), torch.Tensor)
        and isinstance(getattr(gate, "top_k", None), int)
        and hasattr(gate, "norm_topk_prob")
    )


@dataclass
class Recording:
    """Expert ids chosen inside one :meth:`Routing.record` block: ``forwards[f][layer]`` is an integer
    tensor [tokens of forward f (batch × sequence, flattened), k], in call order."""

    dtype: torch.dtype
    forwards: list[list[torch.Tensor]] = field(default_factory=list)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        if layer == 0:  # the first MoE block runs first in every forward
            self.forwards.append([])
        self.forwards[-1].append(ids.detach().to(self.dtype))

    def stacked(self, f: int) -> torch.Tensor:
        """Forward ``f``'s ids as one tensor [tokens, n_moe_layers, k]."""
        import torch

        return torch.stack(self.forwards[f], dim=1)


@dataclass
class ReplayStats:
    """Counts over the forwards of one :meth:`Routing.replay` block (token-layer pairs); ``replayed`` and
    ``differ`` stay 0-d tensors until read, so counting never waits for the device."""

    total: int = 0
    """Token-layer pairs that went through an MoE block."""
    replayed: int | torch.Tensor = 0
    """Pairs routed to the given ids (the rest had no record, entries < 0, and routed normally)."""
    differ: int | torch.Tensor = 0
    """Replayed pairs whose natural top-k set (this model's own router) differs from the replayed set."""

    def as_dict(self) -> dict[str, float]:
        total, replayed, differ = float(self.total), float(self.replayed), float(self.differ)
        return {
            "total": total,
            "replayed": replayed,
            "differ": differ,
            "replayed_frac": replayed / total if total else 0.0,
            "differ_frac": differ / replayed if replayed else 0.0,
        }


class Routing:
    """Record or replay the experts of a model's sparse MoE blocks (see :func:`install_routing`)."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        self.blocks = blocks
        # the router, by duck type (:func:`_is_sparse_moe_block`); Module.__getattr__ types it Tensor | Module
        gate: Any = blocks[0].gate
        self.top_k = int(gate.top_k)
        self.num_experts = int(gate.weight.shape[0])
        self._recording: Recording | None = None
        self._experts: torch.Tensor | None = None
        self._stats = ReplayStats()
        for layer, block in enumerate(blocks):
            original = block.forward
            block.forward = types.MethodType(self._wrap(layer, original), block)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def new_recording(self) -> Recording:
        """An empty :class:`Recording` (int16 ids, int32 past 32767 experts)."""
        import torch

        return Recording(torch.int16 if self.num_experts <= torch.iinfo(torch.int16).max else torch.int32)

    @contextlib.contextmanager
    def record(self, into: Recording | None = None) -> Iterator[Recording]:
        """Collect the expert ids of every forward run inside the block (the ids actually used: the
        replayed ones inside :meth:`replay`); ``into`` continues an earlier block's :class:`Recording`."""
        previous, self._recording = self._recording, into if into is not None else self.new_recording()
        try:
            yield self._recording
        finally:
            self._recording = previous

    @contextlib.contextmanager
    def replay(self, experts: torch.Tensor) -> Iterator[ReplayStats]:
        """Route every forward inside the block to ``experts``: [B, L, n_moe_layers, k] ids aligned with
        the forward's ``input_ids`` [B, L]; a token-layer entry with any id < 0 routes normally. Yields
        the block's :class:`ReplayStats` (also :meth:`stats` afterwards)."""
        import torch

        experts = torch.as_tensor(experts).long()
        want = (experts.dim(), *experts.shape[2:])
        if want != (4, self.num_layers, self.top_k):
            raise ValueError(
                f"replay expects experts of shape [B, L, {self.num_layers}, {self.top_k}] "
                f"(batch, tokens, MoE layers, top-k); got {list(experts.shape)}"
            )
        if experts.numel() and int(experts.max()) >= self.num_experts:
            raise ValueError(f"replayed expert id {int(experts.max())} >= num_experts {self.num_experts}")
        previous, self._experts = self._experts, experts
        self._stats = ReplayStats()
        try:
            yield self._stats
        finally:
            self._experts = previous

    def stats(self) -> dict[str, float]:
        """Counts and fractions of the last :meth:`replay` block: ``replayed_frac`` (of all token-layer
        pairs) and ``differ_frac`` (of the replayed pairs, those whose natural top-k set differs)."""
        return self._stats.as_dict()

    # -- the wrapped forward -------------------------------------------------------------------
    def _wrap(self, layer: int, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Block ``layer``'s new forward (bound to the block; this :class:`Routing` is the closure's
        ``self``)."""

        # ``block``: a sparse MoE block, whose ``gate`` and ``experts`` are called by duck type
        def forward(block: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if self._recording is None and self._experts is None:
                return original(hidden_states, *args, **kwargs)
            *lead, hidden_dim = hidden_states.shape
            flat = hidden_states.reshape(-1, hidden_dim)
            logits, weights, ids = block.gate(flat)
            if self._experts is not None:
                ids, weights = self._replayed(layer, block.gate, logits, ids, tuple(lead))
            if self._recording is not None:
                self._recording.add(layer, ids)
            out: torch.Tensor = block.experts(flat, ids, weights)
            return out.reshape(*lead, hidden_dim)

        return forward

    def _replayed(
        self, layer: int, gate: Any, logits: torch.Tensor, natural: torch.Tensor, lead: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        experts = self._experts
        assert experts is not None, "called by the wrapped forward inside replay() only"
        import torch

        if tuple(experts.shape[:2]) != lead:
            raise ValueError(
                f"replayed experts cover [B, L] = {list(experts.shape[:2])} but the MoE block got {list(lead)} "
                "tokens: replay needs a forward over the whole sequence the ids are aligned with"
            )
        want = experts[:, :, layer, :].reshape(-1, self.top_k).to(natural.device)
        has = (want >= 0).all(dim=-1)
        ids = torch.where(has.unsqueeze(-1), want, natural)
        # the router's own weights at these ids, computed as the router computes its top-k values
        probs = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(-1, ids)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        with torch.no_grad():
            differ = (natural.sort(dim=-1).values != ids.sort(dim=-1).values).any(dim=-1) & has
            self._stats.total += has.numel()
            self._stats.replayed = self._stats.replayed + has.sum()  # tensors: no device sync per layer
            self._stats.differ = self._stats.differ + differ.sum()
        return ids, weights.to(logits.dtype)


def install_routing(model: torch.nn.Module) -> Routing | None:
    """Wrap the sparse MoE blocks of ``model`` (in module order) for record/replay; None when it has none.
    Installing twice returns the first :class:`Routing`."""
    existing: Routing | None = getattr(model, "_relax_routing", None)
    if existing is not None:
        return existing
    blocks = [m for m in model.modules() if _is_sparse_moe_block(m)]
    if not blocks:
        return None
    routing = Routing(blocks)
    object.__setattr__(model, "_relax_routing", routing)  # not a submodule: state_dict is unchanged
    return routing
