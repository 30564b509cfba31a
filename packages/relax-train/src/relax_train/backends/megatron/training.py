"""The megatron backend's training step: gradients summed over the data-, context-, tensor- and
expert-parallel groups, the whole model's gradient norm and clipping, AdamW (sharded over the data-parallel
replicas with ``--use-distributed-optimizer``) and the step's statistics over every replica. A part of
:class:`~relax_train.backends.megatron.backend.MegatronBackend`, apart so the forward and the checkpoints read
on their own; the gradient reductions and clipping (:func:`clip_and_step`) are the critic's too.

The loop over a batch's optimizer steps and the loss are the torch backend's too, held as components (a
:class:`~relax_train.backends.step.StepRunner` given this module's reductions, and a
:class:`~relax_train.backends.loss.PolicyLoss`), so both backends optimise the same objective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from relax_core.sample import TrainBatch
from relax_train.backends.loss import PolicyLoss, step_metrics
from relax_train.backends.megatron.forward import MegatronForward
from relax_train.backends.megatron.net import MegatronNet
from relax_train.backends.step import FROZEN, StepRunner, build_adamw, set_trainable, update_if_finite


class MegatronTraining:
    """``train_step``'s megatron parts over a :class:`MegatronNet`: gradient reductions, clipping, the
    optimizer (a :class:`StepRunner` drives them, with the :class:`MegatronForward` part's schedule)."""

    def __init__(
        self,
        net: MegatronNet,
        forward: MegatronForward,
        loss: PolicyLoss,
        trainable: bool,
        stepped: Callable[[], None],
    ) -> None:
        """``stepped``: called after each optimizer step (the backend counts its version up)."""
        self.net, self.forward, self.loss = net, forward, loss
        self.before_update: Callable[[], object] | None = None
        """Called just before the optimizer writes the weights (the trainer's fence for a weight broadcast)."""
        set_trainable(net.model, trainable)
        self.owned: list[tuple[torch.nn.Parameter, Any, int]] = []
        """--use-distributed-optimizer: (param, its replica group, its owner's global rank)."""
        self.optimizer: torch.optim.Optimizer | None = None
        """AdamW (None when frozen); the backend's offload moves it."""
        self.steps: StepRunner | None = None
        if not trainable:
            return
        shared = net.cfg.train.use_distributed_optimizer
        self.optimizer = build_adamw(self._own_shares() if shared else net.model.parameters(), net.cfg.train)
        self.steps = StepRunner(
            net.cfg,
            net.model,
            self.optimizer,
            loss,
            forward_backward=self._forward_backward,
            clip_and_step=self.clip_and_step,
            replay_metrics=self._replay_metrics,
            stepped=stepped,
            metrics=self._step_metrics,
        )

    def train_step(self, samples: TrainBatch) -> dict[str, float]:
        if self.steps is None:
            raise RuntimeError(FROZEN)
        # the loss and its statistics exist on the last stage (the norm on all)
        return self.forward.from_last_stage(self.steps.train_step(samples))

    def _step_metrics(self, sums, counts, keep, loss_total, grad_norm, n_opt) -> dict[str, float]:
        """The step's statistics over every data-parallel replica's micro-batches."""
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        if dp > 1:
            parts: list[Any] = [None] * dp
            dist.all_gather_object(
                parts, (sums, counts, keep, loss_total), group=ps.get_data_parallel_group()
            )
            sums = {k: sum(p[0][k] for p in parts) for k in sums}
            counts = {k: sum(p[1].get(k, 0.0) for p in parts) for k in {k for p in parts for k in p[1]}}
            keep = {k: [t for p in parts for t in p[2][k]] for k in keep}
            loss_total = sum(p[3] for p in parts)
        return step_metrics(sums, counts, keep, loss_total, grad_norm, n_opt)

    def _replay_metrics(self) -> dict[str, float]:
        """Routing replay's counts over the ranks that routed disjoint tokens: context-parallel ranks (each
        its chunks), tensor-parallel ranks under sequence parallelism (each its share of the sequence), the
        pipeline stages (each its own MoE layers) and the data-parallel replicas (each its micro-batches)."""
        from megatron.core import parallel_state as ps

        c = self.net.r3
        split = [ps.get_context_parallel_group()] if self.net.cp > 1 else []
        if self.net.mcfg.sequence_parallel and self.net.tp > 1:
            split.append(ps.get_tensor_model_parallel_group())
        if self.net.pp > 1:
            split.append(ps.get_pipeline_model_parallel_group())
        for group in split:
            both = torch.tensor([c.replayed, c.differ], dtype=torch.float64)
            dist.all_reduce(both, group=group)
            c.replayed, c.differ = (float(v) for v in both)
        if ps.get_data_parallel_world_size() > 1:
            every = torch.tensor([c.replayed, c.differ, c.expected], dtype=torch.float64)
            dist.all_reduce(every, group=ps.get_data_parallel_group())
            c.replayed, c.differ, c.expected = (float(v) for v in every)
        return c.take_metrics()

    def _forward_backward(self, samples: TrainBatch, micro, total_tokens, n_seqs, acc) -> float:
        total = [0.0]

        def loss(idx, logp, valid, rlens, ent):
            value = self.loss.micro_loss(samples, idx, logp, valid, ent, total_tokens, n_seqs, acc)
            total[0] += float(value.detach())
            return value

        self.forward.schedule(
            self.forward.step_fn(samples, acc.with_entropy, loss), micro, forward_only=False
        )
        return total[0]

    def clip_and_step(self) -> float:
        """:func:`clip_and_step` with this part's optimizer, fence and distributed-optimizer shares."""
        return clip_and_step(self.net, self.adamw(), self.before_update, self.owned)

    # -- the optimizer ------------------------------------------------------------------------------
    def adamw(self) -> torch.optim.Optimizer:
        """The optimizer, for what only a trainable backend does (steps, its state in checkpoints)."""
        if self.optimizer is None:
            raise RuntimeError(FROZEN)
        return self.optimizer

    def _own_shares(self) -> list[torch.nn.Parameter]:
        """--use-distributed-optimizer: the parameters this data-parallel replica owns (ZeRO-1), AdamW's
        to step. Each parameter is owned by one member of its replica group (the expert data-parallel group
        for experts), assigned greedily by size in the model's parameter order, which every member shares;
        after each step the owners send their parameters to the others (``owned``)."""
        from megatron.core import parallel_state as ps

        dense = ps.get_data_parallel_group(with_context_parallel=True)
        expert = ps.get_expert_data_parallel_group()
        loads = {id(dense): [0] * dist.get_world_size(dense), id(expert): [0] * dist.get_world_size(expert)}
        mine = []
        for p in self.net.model.parameters():
            group = dense if getattr(p, "allreduce", True) else expert
            load = loads[id(group)]
            owner = min(range(len(load)), key=lambda r: (load[r], r))
            load[owner] += p.numel()
            if len(load) > 1:
                self.owned.append((p, group, dist.get_global_rank(group, owner)))
            if owner == dist.get_rank(group):
                mine.append(p)
        return mine


def _fill_missing_grads(net: MegatronNet) -> None:
    """Zero gradients where this data-parallel replica has none but another has one: its micro-batches
    never reached the parameter (a media encoder on text-only rows), and every replica must join the
    same gradient reductions. A parameter no replica reached keeps none (AdamW skips it, as it would
    on one rank)."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return
    params = [p for p in net.model.parameters() if p.requires_grad]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=net.device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)  # (the replicas' parameter lists align)
    for p, anywhere in zip(params, has.tolist()):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)


def clip_and_step(
    net: MegatronNet,
    optimizer: torch.optim.Optimizer,
    before_update: Callable[[], object] | None = None,
    owned: list[tuple[torch.nn.Parameter, Any, int]] | None = None,
) -> float:
    """Megatron's gradient finalisation, then clip by the whole model's norm and step: QK-norm (and
    sequence-parallel norm) gradients are partial per TP rank and summed over TP; gradients are summed
    over the data-parallel replicas (each back-propagated its share of the batch: the expert-data-parallel
    group for experts, whose all-to-all already brought them the rest of their expert-parallel group's
    tokens); in the norm, TP-sharded and expert tensors are summed over their groups and replicated ones
    counted once. ``owned`` (--use-distributed-optimizer): each parameter from the replica that
    stepped it, afterwards."""
    from megatron.core import parallel_state as ps

    _fill_missing_grads(net)
    if net.layout.tie_word_embeddings and net.pp > 1 and (net.pre or net.post):
        # tied embeddings under PP: the first stage's table and the last stage's output layer are one
        # weight; each copy gets the sum of both gradients (megatron's embedding group)
        shared = net.model.shared_embedding_or_output_weight()
        if shared.grad is None:
            shared.grad = torch.zeros_like(shared)
        dist.all_reduce(shared.grad, group=ps.get_embedding_group())
    named = [(n, p) for n, p in net.model.named_parameters() if p.grad is not None]
    if net.tp > 1:
        for name, p in named:
            seq_par = net.mcfg.sequence_parallel and getattr(p, "sequence_parallel", False)
            if seq_par or "q_layernorm" in name or "k_layernorm" in name:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    # context-parallel ranks hold parts of one gradient (their tokens), data-parallel replicas parts of
    # the batch's (their micro-batches, normalised by the whole batch): both summed
    dense = ps.get_data_parallel_group(with_context_parallel=True)
    for _, p in named:
        group = ps.get_expert_data_parallel_group() if not getattr(p, "allreduce", True) else dense
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
    dev = named[0][1].grad.device if named else None
    sq = {k: torch.zeros(1, dtype=torch.float64, device=dev) for k in ("tp", "rep", "expert")}
    for _, p in named:
        if getattr(p, "shared", False) and not net.pre:  # the tied weight's second copy: counted once
            continue
        kind = (
            "expert"
            if not getattr(p, "allreduce", True)
            else "tp"
            if getattr(p, "tensor_model_parallel", False)
            else "rep"
        )
        sq[kind] += p.grad.detach().double().pow(2).sum()
    if net.tp > 1:
        dist.all_reduce(sq["tp"], group=ps.get_tensor_model_parallel_group())
    if net.tp * net.ep > 1:
        dist.all_reduce(sq["expert"], group=ps.get_expert_tensor_and_model_parallel_group())
    total = sq["tp"] + sq["rep"] + sq["expert"]
    if net.pp > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    coef = net.cfg.train.clip_grad / (norm + 1e-6)
    if coef < 1.0:
        for _, p in named:
            p.grad.mul_(coef)
    # (the norm is the same on every rank: all skip, or none)
    if update_if_finite(optimizer, norm, before_update):
        _share_owned(owned or [])
    return norm


def _share_owned(owned: list[tuple[torch.nn.Parameter, Any, int]]) -> None:
    """After a distributed-optimizer step: every parameter from the replica that stepped it; gradients
    dropped (the optimizer's zero_grad reaches only the parameters it owns)."""
    for p, group, src in owned:
        dist.broadcast(p.data, src=src, group=group)
        p.grad = None
