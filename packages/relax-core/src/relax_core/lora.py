"""LoRA RL, the part every side shares: the adapter's configuration and the names its tensors travel under.

Why in relax-core: the trainer (relax-train) trains the adapter, the rollout engines (relax-rollout: the
torch engine, SGLang) serve it, and both must build the same adapter from the same ``--lora-*`` flags and
agree on what a weight update holds. peft is imported only inside the functions that need it.

The wire format of an adapter update (``--lora-sync-mode adapter``): the tensors of
``peft.get_peft_model_state_dict`` under their names in peft's saved format
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, no adapter name in them), i.e. exactly
what ``adapter_model.safetensors`` holds, with :func:`peft_config_dict` as its ``adapter_config.json``. The
torch engine, SGLang's ``/load_lora_adapter_from_tensors`` and ``PeftModel.from_pretrained`` all read that.
"""

from __future__ import annotations

from typing import Any

from relax_core.config_sections import LoraConfig

ADAPTER_NAME = "relax_policy_lora"
"""The adapter's name in an engine (upstream Relax's); SGLang gets ``{ADAPTER_NAME}_v{version}`` per version,
since it refuses to reload a name it holds."""


def peft_config_dict(lora: LoraConfig) -> dict[str, Any]:
    """``adapter_config.json``'s fields for ``lora`` (what ``peft.LoraConfig(**d)`` takes, and SGLang's
    ``config_dict``). ``all-linear`` stays peft's string shortcut."""
    modules = lora.lora_target_modules
    target: str | list[str] = "all-linear" if modules == ["all-linear"] else list(modules)
    out: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.lora_rank,
        "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.lora_dropout,
        "target_modules": target,
        "bias": "none",
    }
    if lora.lora_target_parameters:
        out["target_parameters"] = list(lora.lora_target_parameters)
    return out
