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
micro-batches (:meth:`~relax_train.backends.megatron.forward.MegatronForward._my_micro`), with the loss normalised by the whole optimizer batch's
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
:meth:`~relax_train.backends.megatron.training.MegatronTraining._set_trainable`); weights and gradients stay whole on every replica.

The class is assembled from its own mixins, one concern each (it subclasses no other backend): start-up (process groups, ``TransformerConfig``:
:mod:`~relax_train.backends.megatron.startup`, CPU / no-TE patches: :mod:`~relax_train.backends.megatron.shims`),
weights in HF names (:mod:`~relax_train.backends.megatron.weights`), the forward
(:mod:`~relax_train.backends.megatron.forward`) and the training step
(:mod:`~relax_train.backends.megatron.training`); the model build and the checkpoints are here.

Not yet: Qwen3-VL-MoE.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_core.config import RelaxConfig
from relax_core.models import media_token_ids
from relax_core.offload import onloaded
from relax_train.backends.logprobs import TokenScorer
from relax_train.backends.loss import PolicyLoss
from relax_train.backends.megatron import multimodal as mm
from relax_train.backends.megatron.convert import MegatronLayout
from relax_train.backends.megatron.forward import MegatronForward
from relax_train.backends.megatron.norms import use_sequence_parallel_norms
from relax_train.backends.megatron.shims import host_tensors_stay
from relax_train.backends.megatron.startup import (
    init_parallel,
    load_hf_state,
    rope_theta_of,
    transformer_config,
)
from relax_train.backends.megatron.training import MegatronTraining
from relax_train.backends.megatron.weights import MegatronWeights
from relax_train.backends.replay import ReplayCounts
from relax_train.backends.state import HostTurns, restore_trainer_state, trainer_state


class MegatronBackend(MegatronWeights, MegatronForward, MegatronTraining, HostTurns):
    """The :class:`~relax_train.backends.TrainBackend` protocol (``compute_log_probs``, ``train_step``,
    ``named_weights`` in HF names, ``load_weights``, checkpoints) over a megatron-core model on this rank."""

    stochastic_forward: bool = False
    """Megatron runs without dropout: the training forward's log-probs are π_θ's."""
    supports_streamed_step: bool = False
    """A batch is trained whole (:meth:`~relax_train.backends.megatron.training.MegatronTraining.streamed_step`)."""
    before_update: Callable[[], object] | None = None
    """Called just before the optimizer writes the weights (the trainer's fence for a weight broadcast)."""

    def __init__(
        self,
        config: RelaxConfig,
        model_path: str,
        trainable: bool = True,
        hf_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``hf_state``: the HF-named weights to start from instead of ``model_path``'s safetensors (the
        megatron critic's trunk, :mod:`~relax_train.backends.megatron.value`); its config stays
        ``model_path``'s."""
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from transformers import AutoConfig

        t = config.train
        self.cp = t.context_parallel_size
        init_parallel(config)
        torch.manual_seed(config.train.seed)
        self.cfg, self.model_path = config, model_path
        self.hf_config = AutoConfig.from_pretrained(model_path)
        text = self.hf_config.get_text_config()
        mm.check_supported(self.hf_config, model_path)
        self.layout = MegatronLayout.from_hf_config(text)
        multimodal = mm.is_multimodal(self.hf_config)
        if multimodal:  # Qwen3-VL / Omni keep tie_word_embeddings at the top of their config
            tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
            self.layout = dataclasses.replace(self.layout, tie_word_embeddings=tied)
        self.tp, self.ep = t.tensor_model_parallel_size, t.expert_model_parallel_size
        if t.expert_tensor_parallel_size not in (None, self.tp):
            raise ValueError(
                "--expert-tensor-parallel-size other than --tensor-model-parallel-size is not supported by "
                "the weight converter yet; leave it unset"
            )
        self.pp = t.pipeline_model_parallel_size
        self.mcfg = transformer_config(self.hf_config, self.layout, config)
        if multimodal:
            self.mcfg.mrope_section = mm.mrope_section(text)
        self.pre, self.post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        spec = get_gpt_decoder_block_spec(self.mcfg, use_transformer_engine=False, normalization="RMSNorm")
        use_sequence_parallel_norms(spec)  # (torch's own norms refuse --sequence-parallel)
        if self.cp > 1:  # megatron's own CP needs Transformer Engine: ours gathers keys and values
            from relax_train.backends.megatron.context_parallel import use_context_parallel_attention

            use_context_parallel_attention(spec)
        with host_tensors_stay():  # (tied embeddings under PP: megatron syncs the two copies on CUDA)
            self.model = GPTModel(
                self.mcfg,
                transformer_layer_spec=spec,
                vocab_size=self.layout.padded_vocab_size(self.tp),
                max_sequence_length=int(getattr(text, "max_position_embeddings", 4096)),
                pre_process=self.pre,
                post_process=self.post,
                share_embeddings_and_output_weights=self.layout.tie_word_embeddings,
                position_embedding_type="mrope" if multimodal else "rope",
                rotary_base=rope_theta_of(text),
            )
        # Qwen3-VL / Omni: the media encoders, interleaved M-RoPE and DeepStack hooks go onto the model
        self.front = mm.MediaFront(self.hf_config, self.model, self.tp, self.pre) if multimodal else None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.device is not None:
            self.model.cuda()
        self._layer_offset = self._offset()
        hf_state = load_hf_state(model_path) if hf_state is None else dict(hf_state)
        if self.layout.tie_word_embeddings:  # as transformers loads it: the embedding is the output layer
            hf_state.pop("lm_head.weight", None)
        self.load_weights(hf_state, version=0)
        masked = media_token_ids(self.hf_config) if multimodal else []
        self.scorer = TokenScorer(config.rollout.rollout_temperature, masked)
        self.routing = None
        if config.algo.routing_replay and self.layout.is_moe:
            from relax_train.backends.megatron.routing import MegatronRouting

            self.routing = MegatronRouting(self.model, self.layout.moe_layers, int(text.num_experts_per_tok))
        self._r3 = ReplayCounts()
        self.pad_token_id = getattr(text, "pad_token_id", None) or 0
        self.loss = PolicyLoss(config)
        self._set_trainable(trainable)

    # -- checkpoints --------------------------------------------------------------------------------
    def _optimizer_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self._adamw().param_groups for p in group["params"]]

    def _sharded_state(self) -> dict[str, Any]:
        """Model and AdamW moments as megatron ``ShardedTensor``s: each rank's shard with its place in the
        global tensor, so a checkpoint reloads under other TP / PP / EP sizes. The moments take their
        parameter's sharding (megatron's own helpers for non-distributed optimizers); AdamW's per-parameter
        step count is kept aside (one number: every parameter steps together)."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        model = self.model.sharded_state_dict()
        state: dict[str, Any] = {"model": model}
        if self.trainable:
            adamw = self._adamw()
            for p in self._optimizer_params():  # (before the first step: the zero moments AdamW starts from)
                if not adamw.state[p]:
                    adamw.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
            optim = adamw.state_dict()
            ids = get_param_id_to_sharded_param_map(model, self._optimizer_params())
            optim_state_to_sharding_state(optim, ids, exclude_keys=("step",))
            if self._owned:  # ZeRO-1: the owner's moments are the only copy (the DP part of their replica id)
                for moments in optim["state"].values():
                    for key, sh in moments.items():
                        rid = sh.replica_id
                        moments[key] = dataclasses.replace(
                            sh, replica_id=(*rid[:-1], 0) if isinstance(rid, tuple) else 0
                        )
            state["optimizer"] = optim
        return state

    def _adam_step(self) -> float:
        steps = [float(st["step"]) for st in self._adamw().state.values() if "step" in st]
        return max(steps, default=0.0)

    @onloaded
    def save_checkpoint(self, path: str | Path) -> None:
        """A megatron distributed checkpoint under ``dist/`` (model and optimizer, sharded: loads under other
        parallel sizes), each rank's RNG states, the HF weights under ``model/`` and meta.json from rank 0."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / "dist").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(), str(path / "dist"))
        rank_state = {k: v for k, v in trainer_state(None).items() if k != "optimizer"}
        rank_state["adam_step"] = self._adam_step() if self.trainable else 0.0
        torch.save(rank_state, path / f"rng_rank{dist.get_rank():05d}.pt")
        self.export_hf(path / "model")
        if dist.get_rank() == 0:
            (path / "meta.json").write_text(json.dumps({"version": self.version}, indent=1))
        dist.barrier()

    @onloaded
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"--load {path}: no checkpoint there (meta.json missing)")
        if not (path / "dist").is_dir():
            return self._load_per_rank_checkpoint(path)
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded_state(), str(path / "dist"))
        self.model.load_state_dict(
            {k: v for k, v in loaded["model"].items() if not k.endswith("._extra_state")}, strict=False
        )
        mine = path / f"rng_rank{dist.get_rank():05d}.pt"
        # a rank the writing run did not have (other parallel sizes) takes rank 0's RNG states
        rank_state = torch.load(mine if mine.is_file() else path / "rng_rank00000.pt", weights_only=False)
        if self.trainable:
            params, adamw = self._optimizer_params(), self._adamw()
            step = torch.tensor(float(rank_state["adam_step"]))
            for pid, st in loaded["optimizer"]["state"].items():
                state = adamw.state[params[pid]]
                state["exp_avg"].copy_(st["exp_avg"])
                state["exp_avg_sq"].copy_(st["exp_avg_sq"])
                state["step"] = step.clone()
        rank_state["optimizer"] = None  # (restored above)
        return self._restored(rank_state, path)

    def _load_per_rank_checkpoint(self, path: Path) -> dict[str, Any]:
        """Checkpoints of relax-train 0.5.0: one file per rank, same parallel sizes to reload."""
        mine = path / f"megatron_rank{dist.get_rank():05d}.pt"
        if not mine.is_file():
            raise FileNotFoundError(f"--load {path}: no megatron checkpoint for rank {dist.get_rank()} there")
        state = torch.load(mine, weights_only=False)
        if state["world_size"] != dist.get_world_size():
            raise ValueError(
                f"--load {path}: written by {state['world_size']} ranks, loading with {dist.get_world_size()}; "
                f"use the same parallel sizes (or load its HF weights from {path / 'model'})"
            )
        self.model.load_state_dict(state["model"], strict=False)
        return self._restored(state, path)

    def _restored(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """Put back a checkpoint's optimizer (where saved) and RNG states and take its version; its meta."""
        meta = restore_trainer_state(state, self.optimizer, path, self.cfg.train)
        self.version = int(meta["version"])
        return meta
