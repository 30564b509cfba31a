"""Context parallelism for megatron-core's local layer spec (no Transformer Engine needed).

megatron-core runs context parallelism only inside Transformer Engine's attention; its own
``DotProductAttention`` refuses it. Here each of the CP ranks holds two chunks of every sequence —
chunks ``r`` and ``2·CP-1-r`` of ``2·CP``, megatron's load-balanced layout, which its rotary embedding
already slices to (``get_pos_emb_on_this_cp_rank``) — and its attention gathers the keys and values of
all ranks (the all-gather form of CP, as in Llama 3's training) under a mask of global positions. The
per-token log-probs (a few numbers per token, not the logits) are gathered too, so every CP rank computes
the whole loss; each back-propagates through its own tokens only, and the gradients are summed over the
CP group. Memory per rank: activations of its 1/CP of the tokens, plus the keys and values of all.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def local_positions(width: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions CP rank ``rank`` holds of a sequence padded to ``width`` (a multiple of
    2·CP): chunk ``rank`` and chunk ``2·CP-1-rank``, in that order."""
    chunk = width // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def gathered_positions(width: int, cp: int) -> torch.Tensor:
    """The global position of each entry of an all-gather over the CP group (rank 0's tokens first)."""
    return torch.cat([local_positions(width, cp, r) for r in range(cp)])


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _local_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=dim)[r].contiguous()


class _GatherKeysValues(torch.autograd.Function):
    """All-gather along the sequence (dim 0); backward: every rank's queries read every key, so each
    key's gradient is the sum over ranks of the local ones (all-reduce, then this rank's slice; gloo has
    no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _local_slice(grad, 0, ctx.group), None


class _GatherTokenValues(torch.autograd.Function):
    """[B, S/CP] per-token values of this rank -> [B, S] in global order. Every CP rank then computes
    the same loss from them, so the backward keeps this rank's positions of the (identical) gradient
    without summing: each rank back-propagates through its own tokens once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.order = group, order
        gathered = _all_gather(x, 1, group)
        out = torch.empty_like(gathered)
        out[:, order.to(x.device)] = gathered
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        in_gather_order = grad[:, ctx.order.to(grad.device)]
        return _local_slice(in_gather_order, 1, ctx.group), None, None


def gather_keys_values(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherKeysValues.apply(x, group)


def gather_token_values(x: torch.Tensor, order: torch.Tensor, group) -> torch.Tensor:
    return _GatherTokenValues.apply(x, order, group)


class ContextParallelAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` over the keys and values of the whole CP group. The mask
    the model is given is [1, 1, local queries, gathered keys] in global positions (True: masked), so
    the causal structure of the load-balanced chunks is exact."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs) -> None:
        from megatron.core import parallel_state as ps

        # the parent refuses CP > 1 (its own CP needs TE); the gathering here makes it CP-agnostic. The
        # mask is explicit and not square, so it is "arbitrary", never the fused upper-triangular kernel.
        local = dataclasses.replace(config, context_parallel_size=1)
        super().__init__(local, layer_number, AttnMaskType.arbitrary, attention_type, *args, **kwargs)
        self.cp_group = ps.get_context_parallel_group()

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        key = gather_keys_values(key, self.cp_group)
        value = gather_keys_values(value, self.cp_group)
        return super().forward(
            query, key, value, attention_mask, AttnMaskType.arbitrary, attention_bias, packed_seq_params
        )


def use_context_parallel_attention(block_spec) -> None:
    """Swap the core attention of every layer of a local (non-TE) decoder block spec."""
    for layer in block_spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = ContextParallelAttention


def cpu_rotary_shim() -> None:
    """megatron's per-CP-rank slicing of the rotary table moves its index to CUDA; without CUDA it
    stays on the CPU (the same chunks)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    def on_this_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
        cp, rank = cp_group.size(), cp_group.rank()
        chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
        picked = chunks.index_select(seq_dim, torch.tensor([rank, 2 * cp - rank - 1]))
        return picked.reshape(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 1 :])

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = on_this_rank
