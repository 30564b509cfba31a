"""The megatron backend's forward: micro-batches through megatron's forward-backward schedule (1F1B under
pipeline parallelism), with context / sequence parallelism, media inputs and routing replay, and the
log-probs computed from its logits. A part of :class:`~relax_train.backends.megatron.backend.MegatronBackend`,
apart so the weights, the optimizer step and the checkpoints read on their own. Rows, log-probs and routing
replay are computed by the functions the torch backend uses too (:mod:`relax_train.backends.logprobs`,
:mod:`relax_train.backends.replay`), on megatron's logits.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from relax_core import sample
from relax_core.sample import TrainBatch
from relax_train.backends.logprobs import pad_rows, response_positions
from relax_train.backends.megatron.net import MegatronNet
from relax_train.backends.megatron.startup import compute_dtype
from relax_train.backends.micro import plan_micro_batches, sample_lengths
from relax_train.backends.replay import routing_replay


def _contributes_nothing(idx, logp, *rest) -> torch.Tensor:
    return logp.sum() * 0.0


class MegatronForward:
    """The forward step, the schedule and ``compute_log_probs`` over a :class:`MegatronNet` (the policy
    backend's part; the critic's value backend runs its rows through :meth:`forward_rows` and
    :meth:`schedule` too)."""

    def __init__(self, net: MegatronNet) -> None:
        self.net = net

    # -- forward ------------------------------------------------------------------------------------
    def _autocast(self):
        dtype = compute_dtype(self.net.cfg)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if self.net.device is not None else "cpu", dtype=dtype)

    def _replay(self, samples: TrainBatch, idx: list[int], width: int, cols: torch.Tensor):
        """Routing replay around a micro-batch's forward (:func:`routing_replay`), counted in training."""
        counts = self.net.r3 if self.net.model.training else None
        return routing_replay(
            self.net.routing, self.net.cfg.algo.routing_replay, samples, idx, width, counts, cols
        )

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, S, V/tp] vocab-parallel logits -> [B, S, vocab] (all ranks of the TP group, padding cut)."""
        if self.net.tp > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[..., : self.net.layout.vocab_size]

    def step_fn(self, samples: TrainBatch, with_entropy: bool, on_logp):
        """Megatron's ``forward_step_func``: one micro-batch (a list of sample indices) through the model;
        its loss function turns the logits into response log-probs and hands them to ``on_logp``, which
        returns the micro-batch's loss."""

        def step(data_iterator, model):
            idx, real = next(data_iterator)
            # a stand-in (see _my_micro) goes through the model and back, contributing nothing
            use = on_logp if real else _contributes_nothing
            ids, _, plens, rlens = pad_rows(samples, idx, self.net.pad_token_id)
            dev = self.net.device or torch.device("cpu")
            if self.net.cp > 1:
                return self._cp_step(model, samples, idx, ids, plens, rlens, with_entropy, use, dev, real)
            out, ids = self.forward_rows(model, samples, idx, ids, dev, real)

            def loss_func(output):
                logp, valid, _, ent = self.net.scorer.response_logp(
                    self._full_vocab(output), ids, plens, rlens, with_entropy
                )
                loss = use(idx, logp, valid, rlens, ent)
                return loss, torch.ones((), dtype=torch.int, device=dev), {}

            return out, loss_func

        return step

    def forward_rows(
        self,
        model,
        samples: TrainBatch,
        idx: list[int],
        ids: torch.Tensor,
        dev: torch.device,
        real: bool,
    ) -> tuple[Any, torch.Tensor]:
        """Right-padded rows ``ids`` of samples ``idx`` through the model, causal, without context parallelism
        (media inputs and routing replay included): the model's output and the rows as fed (padded to a
        multiple of TP under sequence parallelism). Also the megatron critic's forward
        (:mod:`~relax_train.backends.megatron.value`)."""
        if self.net.mcfg.sequence_parallel and ids.shape[1] % self.net.tp:  # SP splits the sequence over TP
            ids = self._pad_to(ids, -(-ids.shape[1] // self.net.tp) * self.net.tp)
        width = ids.shape[1]
        pos = torch.arange(width, device=dev).unsqueeze(0).expand(len(idx), -1)
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=dev), 1)[None, None]
        cols = self._sp_shard(torch.arange(width))
        replay = self._replay(samples, idx, width, cols) if real else contextlib.nullcontext()
        with self._autocast(), replay:
            if self.net.front is not None:
                return self._mm_forward(model, samples, idx, ids, None, causal, dev), ids
            return model(input_ids=ids.to(dev), position_ids=pos, attention_mask=causal), ids

    def _pad_to(self, ids: torch.Tensor, width: int) -> torch.Tensor:
        padded = torch.full((ids.shape[0], width), self.net.pad_token_id, dtype=ids.dtype)
        padded[:, : ids.shape[1]] = ids
        return padded

    def _mm_forward(self, model, samples: TrainBatch, idx, ids, loc, mask, dev):
        """Qwen3-VL / Omni: the decoder on embeddings with the media features in place, 3-D positions and the
        DeepStack additions, built on the full (padded) rows ``ids`` and cut to this CP rank's positions
        ``loc`` (None: all of them)."""
        from relax_core.mm import collate_mm, token_types

        front = self.net.front
        assert front is not None, "a media forward runs on a multimodal model only"
        items = [samples[sample.MM][i] for i in idx] if sample.MM in samples else [None] * len(idx)
        lengths = [len(samples[sample.TOKENS][i]) for i in idx]
        media = collate_mm(items) if any(items) else {}
        types = token_types(items, lengths, ids.shape[1], left=False)
        if self.net.pre:
            emb, pos, additions = front.inputs(ids, media, types, lengths, dev)
        else:  # a later pipeline stage: hidden states come from the previous one
            emb, additions = None, []
            pos = front.positions(ids, types, lengths, media).to(dev)
        if loc is not None:
            cut = loc.to(dev)
            pos, additions = pos[:, :, cut], [a[:, cut] for a in additions]
            emb = emb[:, cut] if emb is not None else None
        sp = self.net.mcfg.sequence_parallel
        front.additions = [front.decoder_input(a, sp) for a in additions]
        try:
            return model(
                input_ids=(ids if loc is None else ids[:, loc]).to(dev),
                position_ids=pos,
                attention_mask=mask,
                decoder_input=front.decoder_input(emb, sp) if emb is not None else None,
            )
        finally:
            front.additions = None

    def _sp_shard(self, cols: torch.Tensor) -> torch.Tensor:
        """The positions (of ``cols``, the rows' positions this rank feeds the model) whose tokens this rank's
        MoE routers see: under sequence parallelism its contiguous share of them, else all. What routing
        replay's records are cut to."""
        if not (self.net.mcfg.sequence_parallel and self.net.tp > 1):
            return cols
        from megatron.core import parallel_state as ps

        n = len(cols) // self.net.tp
        r = ps.get_tensor_model_parallel_rank()
        return cols[r * n : (r + 1) * n]

    def _cp_step(
        self, model, samples: TrainBatch, idx, ids, plens, rlens, with_entropy, on_logp, dev, real=True
    ):
        """One micro-batch under context parallelism: this rank's two chunks of every (padded) row go
        through the model, attending to the keys of the whole CP group; its per-token log-probs (and
        entropies) are gathered into whole rows, from which every CP rank computes the same loss."""
        from megatron.core import parallel_state as ps

        from relax_train.backends.megatron.context_parallel import (
            gather_token_values,
            gathered_positions,
            local_positions,
        )

        group = ps.get_context_parallel_group()
        multiple = 2 * self.net.cp * (self.net.tp if self.net.mcfg.sequence_parallel else 1)
        width = -(-ids.shape[1] // multiple) * multiple
        padded = self._pad_to(ids, width)
        loc = local_positions(width, self.net.cp, ps.get_context_parallel_rank())
        order = gathered_positions(width, self.net.cp)
        masked = (order[None, :] > loc[:, None])[None, None].to(dev)  # causal, in global positions
        pos = loc.to(dev).unsqueeze(0).expand(len(idx), -1)
        replay = self._replay(samples, idx, width, self._sp_shard(loc)) if real else contextlib.nullcontext()
        with self._autocast(), replay:
            if self.net.front is not None:
                out = self._mm_forward(model, samples, idx, padded, loc, masked, dev)
            else:
                out = model(input_ids=padded[:, loc].to(dev), position_ids=pos, attention_mask=masked)

        def loss_func(output):
            # the token each position predicts (the last one predicts padding: never a response token)
            targets = torch.cat([padded[:, 1:], padded[:, -1:]], dim=1)[:, loc].to(dev)
            logp, ent = self.net.scorer.token_logp(self._full_vocab(output), targets, with_entropy)
            logp = gather_token_values(logp, order, group)
            ent = gather_token_values(ent, order, group) if ent is not None else None
            rows, cols, valid = response_positions(plens, rlens, width, logp.device)
            resp_ent = ent[rows, cols] if ent is not None else None
            loss = on_logp(idx, logp[rows, cols], valid, rlens, resp_ent)
            return loss, torch.ones((), dtype=torch.int, device=dev), {}

        return out, loss_func

    def _my_micro(self, micro: list[list[int]]) -> list[tuple[list[int], bool]]:
        """This data-parallel replica's micro-batches of one batch: every ``dp``-th, from its rank on, each
        as ``(indices, real)``. Every replica runs the same number (at least one): with expert parallelism
        the replicas exchange tokens inside each MoE layer, so they must step together; a replica short of
        one runs a stand-in (a real micro-batch, ``real=False``) whose loss is zero."""
        from megatron.core import parallel_state as ps

        if not micro:
            return []
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = [(m, True) for m in micro[rank::dp]]
        return mine + [(micro[0], False)] * (-(-len(micro) // dp) - len(mine))

    def schedule(self, step, micro: list[list[int]], forward_only: bool) -> None:
        """Megatron's forward-backward schedule over this replica's share of ``micro``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mine = self._my_micro(micro)
        if not mine:
            return
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mine),
            model=[self.net.model],
            num_microbatches=len(mine),
            seq_length=0,  # variable_seq_lengths: shapes travel with each micro-batch
            micro_batch_size=max(len(m) for m, _ in mine),
            forward_only=forward_only,
        )

    @torch.no_grad()
    def compute_log_probs(self, samples: TrainBatch) -> list[np.ndarray]:
        from megatron.core import parallel_state as ps

        was_training = self.net.model.training
        self.net.model.eval()
        n = len(samples[sample.TOKENS])
        micro = plan_micro_batches(sample_lengths(samples), list(range(n)), self.net.cfg.train)
        out: dict[int, np.ndarray] = {}

        def keep(idx, logp, valid, rlens, ent):
            for k, (i, r) in enumerate(zip(idx, rlens)):
                out[i] = logp[k, :r].float().cpu().numpy().astype(np.float32)
            return logp.sum() * 0.0

        self.schedule(self.step_fn(samples, False, keep), micro, forward_only=True)
        self.net.model.train(was_training)
        if ps.get_data_parallel_world_size() > 1:  # each replica computed its micro-batches
            parts: list[Any] = [None] * ps.get_data_parallel_world_size()
            dist.all_gather_object(parts, out, group=ps.get_data_parallel_group())
            out = {i: v for part in parts for i, v in part.items()}
        out = self.from_last_stage(out)  # (the last stage computed them)
        return [out[i] for i in range(n)]

    def from_last_stage(self, value: Any) -> Any:
        """Under pipeline parallelism, the last stage's ``value`` on every stage."""
        if self.net.pp == 1:
            return value
        from megatron.core import parallel_state as ps

        box = [value]
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, self.net.pp - 1), group=group)
        return box[0]
