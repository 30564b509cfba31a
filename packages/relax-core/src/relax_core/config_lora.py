"""The LoRA section of the run configuration (apart from :mod:`relax_core.config_sections` for its size)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relax_core.config_sections import Section


class LoraConfig(Section):
    """LoRA RL: the trainer trains low-rank adapters over the frozen policy (through ``peft``) and sends
    only the adapters to the rollout engines (``--lora-sync-mode adapter``) or merged full weights
    (``merged``). Names as upstream Relax and veRL spell them; slime's, veRL's and TRL's spellings are
    aliases (:mod:`relax_app.cli_aliases`)."""

    lora_rank: int = Field(0, ge=0)
    """LoRA rank r of every adapter; 0 (the default) trains every weight (full fine-tuning). TRL's
    --lora-r, veRL's lora_rank. --train-backend torch only: megatron-core has no LoRA layers and
    Megatron-Bridge, which adds them, does not run here, so megatron with LoRA is refused."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scaling numerator: an adapter adds (alpha / r) · B A to its weight (veRL's default, 16)."""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on each adapter's input while training. Above 0 the training forward is random, so the
    proximal policy's log-probs come from a separate forward (ActorFwd)."""
    lora_target_modules: list[str] = ["all-linear"]
    """Module names that get adapters (suffixes, as peft matches them: q_proj v_proj ...); ``all-linear``
    (the default, veRL's) is every linear layer of the language model but the output head. A name no
    module of the model has is refused before training starts."""
    lora_target_parameters: list[str] = []
    """Parameter names that get adapters where the weight is no linear module: the fused 3-D expert
    weights of MoE models (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), through peft's
    ``target_parameters``. Empty: the experts stay frozen, attention and dense layers get adapters."""
    lora_sync_mode: Literal["adapter", "merged"] = "adapter"
    """What the trainer sends the rollout engines after each step: ``adapter`` — only the adapters' tensors,
    the engine serves base + adapter (the torch engine, SGLang's LoRA support); ``merged`` — the weights
    with the adapters merged in, for engines without LoRA (full-size transfers). slime's
    --lora-rollout-sync-mode (native_adapter is adapter)."""
    lora_save_merged: bool = False
    """Each checkpoint also gets ``model_merged/``: the policy with the adapters merged in, an HF directory
    that serves without peft. The adapter itself is always saved (``adapter/``, peft's format). slime's
    --lora-save-merged-hf."""

    @property
    def enabled(self) -> bool:
        """Whether the run trains LoRA adapters (--lora-rank > 0)."""
        return self.lora_rank > 0

    @model_validator(mode="after")
    def _check_lora(self) -> LoraConfig:
        if not self.enabled:
            set_ = sorted(f for f in self.model_fields_set if f != "lora_rank")
            changed = [f for f in set_ if getattr(self, f) != type(self).model_fields[f].default]
            if changed:
                flags = ", ".join("--" + f.replace("_", "-") for f in changed)
                raise ValueError(f"{flags} set but LoRA is off: add --lora-rank N (e.g. 8) to train adapters")
            return self
        if not self.lora_target_modules and not self.lora_target_parameters:
            raise ValueError(
                "--lora-rank with no --lora-target-modules and no --lora-target-parameters: nothing would "
                "train; name modules (q_proj v_proj) or keep the default all-linear"
            )
        return self
