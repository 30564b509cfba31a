"""The torch training backend: an HF causal LM, AdamW, micro-batches, the policy losses of
:mod:`relax_train.algorithms` chosen by config.

The same class serves three roles: ``actor`` (trains), ``actor_fwd`` (recomputes log-probs with the
latest trainer weights) and ``reference`` (frozen). Log-probs are computed on right-padded
prompt+response sequences at the rollout temperature, so they match the rollout engine's.

What it shares with the megatron backend it holds as components, not as a base class: the log-prob
computation (:mod:`.logprobs`), routing replay (:mod:`.replay`), the loss (:mod:`.loss`), the optimizer-step
loop (:mod:`.step`, streamed steps included: :mod:`.streamed`) and the checkpoint and offload state
(:mod:`.state`). Only this module knows the HF model's forward. LoRA (``--lora-rank``): the model is wrapped in
peft's adapters and only those train, travel and are saved (:mod:`.lora`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.offload import onloaded
from relax_core.sample import TrainBatch
from relax_train.backends import lora
from relax_train.backends.logprobs import TokenScorer, pad_rows
from relax_train.backends.loss import PolicyLoss, StepStats
from relax_train.backends.micro import plan_micro_batches, sample_lengths
from relax_train.backends.replay import ReplayCounts, routing_replay
from relax_train.backends.state import HostTurns, restore_trainer_state, trainer_state
from relax_train.backends.step import FROZEN, StepRunner, build_adamw, set_trainable, update_if_finite
from relax_train.backends.streamed import StreamedStep

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

_DROPOUT_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
)


def _has_dropout(model: Any) -> bool:
    """Whether ``model`` in train mode is random (a dropout rate > 0 in its text config or a module): its
    training forward then is not π_θ's log-probs, so π_prox cannot come from it."""
    cfg = model.config.get_text_config()
    rates = [getattr(cfg, k, 0.0) for k in _DROPOUT_FIELDS]
    if any(isinstance(r, (int, float)) and r > 0 for r in rates):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


class TorchBackend(HostTurns):
    """An HF model on this process: the whole :class:`~relax_train.backends.TrainBackend`, streamed steps
    included."""

    stochastic_forward: bool = False
    """The training forward draws dropout masks (see :func:`_has_dropout`)."""
    supports_streamed_step: bool = True
    """:meth:`streamed_step` trains a batch part by part into its whole-batch update."""
    before_update: Callable[[], object] | None = None
    """Called just before the optimizer writes the weights: the trainer's fence for a weight broadcast
    still reading them (:class:`~relax_train.roles.actor.ActorWorker` with ``overlap_weight_sync``)."""
    model: PreTrainedModel | PeftModel
    """The HF model; with LoRA, peft's model of it with the adapters."""

    def __init__(
        self, config: RelaxConfig, model_path: str, trainable: bool = True, adapter: bool | None = None
    ) -> None:
        """``adapter`` (LoRA runs, a frozen backend): whether it wraps its model in the adapters to take
        adapter updates; None decides by the model (:func:`relax_train.backends.lora.wraps`)."""
        from relax_core.models import forward_takes, load_model, media_token_ids
        from relax_core.routing import install_routing

        self.cfg = config
        self.model_path = model_path  # (its tokenizer and configs go into every checkpoint's model/)
        torch.manual_seed(config.train.seed)
        self.model = load_model(model_path, config.model.dtype)  # causal LM, or a Qwen-VL/Omni model
        self.lora = config.lora if lora.wraps(config, model_path, trainable, adapter) else None
        """The run's LoRA config where this backend's model carries the adapters (a peft model), else None."""
        if self.lora is not None:
            from relax_core.lora import wrap

            self.model = wrap(self.model, self.lora)  # (only the adapters require grad from here on)
        from relax_core.compiled import Compiled

        self._trunk = _trunk_and_head(self.model, config.train.log_probs_chunk_size)
        """(decoder, LM head) where response tokens are scored from hidden states in chunks, else None."""
        forward = self._trunk[0] if self._trunk else self.model
        self._forward = Compiled(forward, "the trainer's forward", config.model.torch_compile)
        self.takes_token_types = forward_takes(self.model, "mm_token_type_ids")
        self.routing = install_routing(self.model)  # MoE blocks: routing replay (R3); None for dense models
        self._r3 = ReplayCounts()
        cfg = self.model.config  # multimodal configs keep text settings in text_config
        self.pad_token_id = (
            getattr(cfg, "pad_token_id", None) or getattr(cfg.get_text_config(), "pad_token_id", 0) or 0
        )
        self.scorer = TokenScorer(config.rollout.rollout_temperature, media_token_ids(self.model))
        self.stochastic_forward = _has_dropout(self.model)
        self.loss = PolicyLoss(config)
        self.trainable, self.version = trainable, 0
        set_trainable(self.model, trainable)
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps: StepRunner | None = None
        if trainable:
            self.optimizer = build_adamw(lora.trainable_parameters(self.model), config.train)
            self.steps = StepRunner(
                config,
                self.model,
                self.optimizer,
                self.loss,
                forward_backward=self._forward_backward,
                clip_and_step=self._clip_and_step,
                replay_metrics=self._r3.take_metrics,
                stepped=self._stepped,
            )

    # -- forward -------------------------------------------------------------------------------
    def _media(self, samples: TrainBatch, idx: list[int], ids: torch.Tensor) -> dict[str, Any]:
        """Multimodal inputs of a micro-batch (``mm`` field: media tensors + prompt token types), batched
        as the rollout engine batches them (``relax_core.mm``); {} for text."""
        items = [samples[sample.MM][i] for i in idx] if sample.MM in samples else []
        if not any(items):
            return {}
        from relax_core.mm import collate_mm, token_types

        extra = collate_mm(items)
        if self.takes_token_types:
            lengths = [len(samples[sample.TOKENS][i]) for i in idx]
            extra["mm_token_type_ids"] = token_types(items, lengths, ids.shape[1], left=False)
        return extra

    def _response_logp(self, samples: TrainBatch, idx: list[int], with_entropy: bool = False):
        """Padded [B, Rmax] log-probs of each response token (and entropies), plus response lengths."""
        ids, mask, plens, rlens = pad_rows(samples, idx, self.pad_token_id)
        counts = self._r3 if self.model.training else None  # (train_step's metrics: r3_*)
        replay = routing_replay(
            self.routing, self.cfg.algo.routing_replay, samples, idx, ids.shape[1], counts
        )
        media = self._media(samples, idx, ids)
        with replay:
            if self._trunk is not None and not media:  # (text: hidden states, scored chunk by chunk)
                hidden = self._forward(input_ids=ids, attention_mask=mask).last_hidden_state
                chunk, head = self.cfg.train.log_probs_chunk_size, self._trunk[1].weight
                return self.scorer.response_logp_from_hidden(
                    hidden, head, ids, plens, rlens, chunk, with_entropy
                )
            logits = self._forward(input_ids=ids, attention_mask=mask, **media).logits
        return self.scorer.response_logp(logits, ids, plens, rlens, with_entropy)

    @torch.no_grad()
    @onloaded
    def compute_log_probs(self, samples: TrainBatch) -> list[np.ndarray]:
        """Per-sample float32 log-probs of the response tokens under the current weights."""
        was_training = self.model.training
        self.model.eval()
        out: dict[int, np.ndarray] = {}
        n = len(samples[sample.TOKENS])
        for idx in plan_micro_batches(sample_lengths(samples), list(range(n)), self.cfg.train):
            logp, _, rlens, _ = self._response_logp(samples, idx)
            for k, (i, r) in enumerate(zip(idx, rlens)):
                out[i] = logp[k, :r].cpu().numpy().astype(np.float32)
        self.model.train(was_training)
        return [out[i] for i in range(n)]

    # -- training ------------------------------------------------------------------------------
    @onloaded
    def train_step(self, samples: TrainBatch) -> dict[str, float]:
        """One rollout batch: one or more optimizer steps of --global-batch-size samples each, with the
        losses of :class:`~relax_train.backends.loss.PolicyLoss` (:class:`~relax_train.backends.step.StepRunner`)."""
        if self.steps is None:
            raise RuntimeError(FROZEN)
        return self.steps.train_step(samples)

    @onloaded
    def streamed_step(self, n_seqs: int) -> StreamedStep:
        """An optimizer step of ``n_seqs`` samples fed part by part as they arrive (``add(part)``, then
        ``finish()``: its metrics), the same update as :meth:`train_step` on the whole batch
        (:mod:`relax_train.backends.streamed`)."""
        if self.steps is None:
            raise RuntimeError(FROZEN)
        return StreamedStep(self.steps, n_seqs)

    def _stepped(self) -> None:
        self.version += 1

    def _forward_backward(
        self, samples, micro: list[list[int]], total_tokens: float, n_seqs: int, stats: StepStats
    ) -> float:
        """Forward and backward every micro-batch of one optimizer step (gradients accumulate); the summed
        loss. The megatron backend runs the same :class:`PolicyLoss` through Megatron's schedule instead."""
        total = 0.0
        for idx in micro:
            logp, valid, _, ent = self._response_logp(samples, idx, with_entropy=stats.with_entropy)
            loss = self.loss.micro_loss(samples, idx, logp, valid, ent, total_tokens, n_seqs, stats)
            loss.backward()
            total += float(loss.detach())
        return total

    def _clip_and_step(self) -> float:
        """Clip the accumulated gradients to --clip-grad, step the optimizer; the pre-clip gradient norm."""
        gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad))
        if self.optimizer is None:  # (a StepRunner steps, and only a trainable backend has one)
            raise RuntimeError(FROZEN)
        update_if_finite(self.optimizer, gn, self.before_update)
        return gn

    # -- weights and checkpoints ---------------------------------------------------------------
    @onloaded
    def eval_model(self):
        """The HF model the evaluator generates with (this backend's own)."""
        return self.model

    def base_view(self) -> lora.BaseView:
        """The base model under this backend's weights with the adapters off (LoRA only): the Reference
        role's model in colocate, with no second copy of the base (:class:`~relax_train.backends.lora.BaseView`)."""
        if self.lora is None:
            raise ValueError("base_view needs a LoRA backend (--lora-rank N): this model has no adapters")
        return lora.BaseView(self)

    @onloaded
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight under its HF name; with LoRA what the engines get: the adapter's tensors (wire
        format, :mod:`relax_core.lora`) in --lora-sync-mode adapter, the merged weights in merged."""
        if self.lora is not None:
            return lora.named_weights(self.model, self.lora.lora_sync_mode)
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    @onloaded
    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        """HF-named tensors into the model; a LoRA-wrapped model (ActorFwd in adapter mode) takes an
        adapter update (wire format) instead, whole or refused."""
        if self.lora is not None:
            from relax_core.lora import load_adapter_state

            load_adapter_state(self.model, tensors)
            self.version = version
            return
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in tensors.items():
                params[name].copy_(torch.as_tensor(value))
        self.version = version

    @onloaded
    def save_checkpoint(self, path: str | Path) -> None:
        """``model/`` (an HF directory that serves: weights, config, and the tokenizer, processor and generation
        config of the checkpoint trained from), the optimizer and RNG states, meta.json. With LoRA
        ``adapter/`` instead of ``model/`` (and ``model_merged/`` with --lora-save-merged:
        :func:`relax_train.backends.lora.save`); the optimizer state is then the adapters' alone."""
        from relax_core.hf_files import copy_serving_files

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            lora.save(self.model, path, self.model_path, self.lora)
        else:
            self.model.save_pretrained(str(path / "model"))
            copy_serving_files(
                self.model_path, path / "model", getattr(self.model, "generation_config", None)
            )
        torch.save(trainer_state(self.optimizer), path / "trainer_state.pt")
        (path / "meta.json").write_text(json.dumps(lora.meta(self.version, self.lora), indent=1))

    @onloaded
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"--load {path}: no checkpoint there (meta.json missing)")
        if self.lora is not None:
            lora.load(self.model, path)
        else:
            lora.refuse_lora_checkpoint(path)
            self._load_full(path)
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        meta = restore_trainer_state(state, self.optimizer, path, self.cfg.train)
        self.version = int(meta["version"])
        return meta

    def _load_full(self, path: Path) -> None:
        """``model/``'s weights into the model, refusing a checkpoint that lacks some."""
        from safetensors.torch import load_file

        weights = load_file(str(path / "model" / "model.safetensors"))
        missing = self.model.load_state_dict(weights, strict=False).missing_keys
        loaded = {t.data_ptr() for name, t in self.model.state_dict().items() if name in weights}
        state = self.model.state_dict()  # (a tied weight saved once under its other name is not missing)
        missing = [name for name in missing if state[name].data_ptr() not in loaded]
        if missing:
            raise ValueError(
                f"--load {path}: the checkpoint lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
                f"{', …' if len(missing) > 3 else ''}): it is damaged or of another model; load another one"
            )


def _trunk_and_head(model: Any, chunk: int) -> tuple[Any, Any] | None:
    """The decoder (hidden states out) and the LM head of a text causal LM (peft's too), for scoring from
    hidden states (``--log-probs-chunk-size``); None where that is off or the model is not one (multimodal
    models: their forward builds the decoder's inputs from the media)."""
    if chunk <= 0:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config.get_text_config() is not base.config:
        return None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or getattr(head, "bias", None) is not None:
        return None
    if hasattr(head, "base_layer"):  # (an adapter on the head: its base weight alone would leave it out)
        return None
    return decoder, head
