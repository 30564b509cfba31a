"""Routing replay (R3) through megatron-core's own router replay.

megatron-core (``moe_enable_routing_replay``) gives each MoE router a ``RouterReplay`` that, in
``REPLAY_FORWARD``, routes the router's tokens to given top-k ids and weights them with the router's own
scores at those ids (so the router keeps its gradient) — the semantics of
:mod:`relax_core.routing` for HF models. This module drives those objects with the rollout engine's
records, behind the interface :func:`relax_train.backends.replay.routing_replay` drives for both backends
(``num_layers``, ``top_k``, ``replay(experts)`` yielding :class:`~relax_core.routing.ReplayStats`).

It drives this model's routers only (megatron's static helpers act on every router of the process, and a
colocated run holds several models). Token order inside megatron is sequence-major: the router of a
micro-batch [B, S] sees ``S * B`` tokens, token ``s * B + b``. Positions without a record (each
sequence's last token, right padding) get ids ``0..k-1``: causal attention means nothing scored
attends to them, so they cannot change a trained log-prob; they are not counted as replayed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from relax_core.routing import ReplayStats


class MegatronRouting:
    def __init__(self, model: torch.nn.Module, moe_layers: tuple[int, ...], top_k: int) -> None:
        # megatron-core's TopKRouters (untyped: as nn.Modules, their attributes would read as Tensor | Module)
        routers: list[Any] = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
        has_moe = any(hasattr(m, "router") for m in model.modules())  # (a pipeline stage may have none)
        if has_moe and not routers:
            raise ValueError(
                "routing replay: the megatron model has no router with moe_enable_routing_replay"
            )
        order = {layer: i for i, layer in enumerate(moe_layers)}
        # (global MoE-layer ordinal, RouterReplay) for the routers of this pipeline stage (megatron's
        # layer_number is global and 1-based)
        self._replays = [(order[r.layer_number - 1], r.router_replay) for r in routers]
        self.num_layers, self.top_k = len(moe_layers), top_k
        self._stats: ReplayStats | None = None
        self._has: dict[int, torch.Tensor] = {}
        """Per RouterReplay (by id), which of its tokens have a record, in megatron's token order."""
        for _, rr in self._replays:
            rr.get_replay_topk = types.MethodType(self._counting(rr.get_replay_topk), rr)

    def _counting(self, original):
        """Wrap one RouterReplay's top-k: in replay, also compute the router's natural top-k to count the
        token-layer pairs whose expert set the replay changed."""

        def get_replay_topk(rr, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, ids = original(scores, topk, num_groups, group_topk, default_compute_topk)
            st = self._stats
            if st is not None and rr.target_topk_idx is not None:
                with torch.no_grad():
                    _, natural = default_compute_topk(
                        scores, topk, num_groups=num_groups, group_topk=group_topk
                    )
                    has = self._has[id(rr)].to(ids.device)
                    differ = (natural.sort(-1).values != ids.sort(-1).values).any(-1) & has
                    st.total += has.numel()
                    st.replayed = st.replayed + has.sum()
                    st.differ = st.differ + differ.sum()
            return probs, ids

        return get_replay_topk

    @contextlib.contextmanager
    def replay(self, experts: torch.Tensor) -> Iterator[ReplayStats]:
        """``experts``: [B, S, n_moe_layers, k] ids aligned with the micro-batch's input ids (< 0: none)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        experts = torch.as_tensor(experts).long()
        if experts.dim() != 4 or tuple(experts.shape[2:]) != (self.num_layers, self.top_k):
            raise ValueError(
                f"replay expects experts of shape [B, S, {self.num_layers}, {self.top_k}]; got {list(experts.shape)}"
            )
        self._stats = ReplayStats()
        fill = torch.arange(self.top_k).expand(*experts.shape[:2], self.top_k)
        try:
            for layer, rr in self._replays:
                ids = experts[:, :, layer, :]
                has = (ids >= 0).all(-1)
                ids = torch.where(has.unsqueeze(-1), ids, fill)
                self._has[id(rr)] = has.transpose(0, 1).reshape(-1)  # sequence-major, like megatron's tokens
                rr.clear_indices()
                rr.set_target_indices(ids.transpose(0, 1).reshape(-1, self.top_k))
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            yield self._stats
        finally:
            for _, rr in self._replays:
                rr.clear_router_replay_action()
                rr.clear_indices()
            self._stats = None
            self._has.clear()
