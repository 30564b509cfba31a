"""The megatron training backend (``--train-backend megatron``; ``pip install 'relax-train[megatron]'``).

A megatron-core ``GPTModel`` built from the HF Qwen3 / Qwen3-MoE config, with tensor, pipeline, context
and expert parallelism from the run config, loaded from and exported to HF weights with our converter
(:mod:`relax_train.backends.megatron.convert`). Losses, log-probs, statistics and the optimizer-step loop are
the torch backend's own, held as the same components (:class:`~relax_train.backends.loss.PolicyLoss`,
:class:`~relax_train.backends.logprobs.TokenScorer`, :class:`~relax_train.backends.step.StepRunner`), so both
backends optimise the same objective; only the model, the forward and the gradient reductions differ. It
trains a batch whole: no streamed steps (``supports_streamed_step`` is False).

One process per rank: ``torch.distributed`` is initialised from ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT`` (a single process on its own when they are unset), NCCL on GPU, gloo on
CPU. Parameters are kept in float32 and the forward runs under ``torch.autocast`` in ``--dtype``
(bf16 mixed precision with float32 master weights); AdamW steps each rank's shard; the gradient norm is
reduced over the model-parallel groups (replicated parameters counted once).

Data parallelism: every rank is handed the whole batch; each data-parallel replica runs its share of the
micro-batches (:meth:`~relax_train.backends.megatron.forward.MegatronForward.schedule`), with the loss normalised by the whole optimizer batch's
token and sequence counts, so the gradients summed over the replicas are the full-batch gradient; the
log-probs and the step's statistics are gathered over them.

The micro-batches go through Megatron's forward-backward schedule (1F1B with pipeline parallelism), on GPU
and on CPU. megatron-core assumes CUDA in a few places; on a machine without it (our CI) this module runs
the same code over gloo, with the CUDA assumptions met on that path patched (see :mod:`relax_train.backends.megatron.shims`).

Routing replay (R3) goes through megatron-core's own router replay (:mod:`relax_train.backends.megatron.routing`).

Inside a run, a role with several ranks is a :class:`~relax_train.backends.megatron.group.MegatronRankGroup`.

Context parallelism without Transformer Engine: :mod:`relax_train.backends.megatron.context_parallel`. Qwen3-VL
and Qwen3-Omni's thinker: HF's media encoders in front of the megatron decoder
(:mod:`relax_train.backends.megatron.multimodal`).

``--use-distributed-optimizer``: AdamW's moments sharded over the data-parallel replicas (ZeRO-1, ours:
:class:`~relax_train.backends.megatron.training.MegatronTraining`); weights and gradients stay whole on every replica.

The class is a face over parts that each receive the state they read (it subclasses no other backend): the
model on this rank (:class:`~relax_train.backends.megatron.net.MegatronNet`, built by
:func:`~relax_train.backends.megatron.net.build_net`; start-up: :mod:`~relax_train.backends.megatron.startup`,
CPU / no-TE patches: :mod:`~relax_train.backends.megatron.shims`), weights in HF names
(:class:`~relax_train.backends.megatron.weights.MegatronWeights`), the forward
(:class:`~relax_train.backends.megatron.forward.MegatronForward`), the training step
(:class:`~relax_train.backends.megatron.training.MegatronTraining`) and the checkpoints
(:class:`~relax_train.backends.megatron.checkpoints.MegatronCheckpoints`).

Not yet: Qwen3-VL-MoE.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax_core.config import RelaxConfig
from relax_core.offload import onloaded
from relax_core.sample import TrainBatch
from relax_train.backends.loss import PolicyLoss
from relax_train.backends.megatron.checkpoints import MegatronCheckpoints
from relax_train.backends.megatron.forward import MegatronForward
from relax_train.backends.megatron.net import build_net
from relax_train.backends.megatron.startup import load_hf_state
from relax_train.backends.megatron.training import MegatronTraining
from relax_train.backends.megatron.weights import MegatronWeights
from relax_train.backends.state import HostTurns


class MegatronBackend(HostTurns):
    """The :class:`~relax_train.backends.TrainBackend` protocol (``compute_log_probs``, ``train_step``,
    ``named_weights`` in HF names, ``load_weights``, checkpoints) over a megatron-core model on this rank."""

    stochastic_forward: bool = False
    """Megatron runs without dropout: the training forward's log-probs are π_θ's."""
    supports_streamed_step: bool = False
    """A batch is trained whole (:meth:`streamed_step` refuses)."""

    def __init__(self, config: RelaxConfig, model_path: str, trainable: bool = True) -> None:
        self.cfg, self.model_path, self.trainable = config, model_path, trainable
        self.net = build_net(config, model_path)
        self.model = self.net.model
        self.weights = MegatronWeights(self.net)
        hf_state = load_hf_state(model_path)
        if self.net.layout.tie_word_embeddings:  # as transformers loads it: the embedding is the output layer
            hf_state.pop("lm_head.weight", None)
        self.weights.load_weights(hf_state)
        self.version = 0
        """The policy version of the weights held (counted up by each optimizer step)."""
        self.forward = MegatronForward(self.net)
        self.loss = PolicyLoss(config)
        self.training = MegatronTraining(self.net, self.forward, self.loss, trainable, self._stepped)
        self.optimizer = self.training.optimizer
        """AdamW (None when frozen): what offload moves beside the model."""
        self.checkpoints = MegatronCheckpoints(self.net, self.weights, self.training)

    @property
    def routing(self) -> Any:
        """Routing replay (R3) through megatron's router, or None; a role sets it None to turn replay off."""
        return self.net.routing

    @routing.setter
    def routing(self, value: Any) -> None:
        self.net.routing = value

    @property
    def before_update(self) -> Callable[[], object] | None:
        """Called just before the optimizer writes the weights (the trainer's fence for a weight broadcast)."""
        return self.training.before_update

    @before_update.setter
    def before_update(self, value: Callable[[], object] | None) -> None:
        self.training.before_update = value

    def _stepped(self) -> None:
        self.version += 1

    # -- the protocol, each call handed to the part that does it ----------------------------------
    @torch.no_grad()
    @onloaded
    def compute_log_probs(self, samples: TrainBatch) -> list[np.ndarray]:
        return self.forward.compute_log_probs(samples)

    @onloaded
    def train_step(self, samples: TrainBatch) -> dict[str, float]:
        return self.training.train_step(samples)

    def streamed_step(self, n_seqs: int):
        """Not here: megatron trains a batch whole (``supports_streamed_step`` is False, so the trainer
        takes a streamed batch whole too)."""
        raise NotImplementedError(
            "the megatron backend trains a batch whole: streamed training (--streaming-rollout, part by part "
            "as the batch arrives) runs on --train-backend torch"
        )

    @onloaded
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return self.weights.named_weights()

    @onloaded
    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        self.weights.load_weights(tensors)
        self.version = version

    @onloaded
    def eval_model(self):
        return self.weights.eval_model()

    @onloaded
    def export_hf(self, out_dir: str | Path) -> Path:
        """HF safetensors + the source config and tokenizer files (what rollout engines load)."""
        return self.weights.export_hf(out_dir)

    @onloaded
    def save_checkpoint(self, path: str | Path) -> None:
        self.checkpoints.save(path, self.version)

    @onloaded
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        meta = self.checkpoints.load(path)
        self.version = int(meta["version"])
        return meta
