"""LoRA in the torch backend (``--lora-rank``): which backends wrap their model, what they send and load, what a
checkpoint holds, and the reference's view of the base model.

Why apart from :mod:`.torch_backend`: the backend's forward and step stay the same with LoRA (peft's model
computes base + adapter, and only the adapters require grad); what changes is which tensors travel and which
are saved, and that is decided here from the run's :class:`~relax_core.config_lora.LoraConfig`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax_core import lora as core
from relax_core.config import RelaxConfig
from relax_core.sample import TrainBatch


def wraps(cfg: RelaxConfig, model_path: str, trainable: bool, adapter: bool | None) -> bool:
    """Whether a backend wraps its model in peft's adapters. The trainer always (with --lora-rank); a frozen
    backend only in ``--lora-sync-mode adapter`` and only on the policy's checkpoint (``adapter``: None
    decides by path): ActorFwd then takes adapter updates (B = 0 until the first one: it starts at the base).
    In ``merged`` mode it stays plain and takes merged full weights; a reference or teacher on another
    checkpoint never gets adapters."""
    lora = cfg.lora
    if not lora.enabled:
        return False
    if trainable:
        return True
    if lora.lora_sync_mode != "adapter":
        return False
    if adapter is not None:
        return adapter
    policy = cfg.model.hf_checkpoint
    return policy is not None and Path(policy).resolve() == Path(model_path).resolve()


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer gets: the parameters that require grad (with LoRA only the adapters', so AdamW's
    state, 2 × the adapter's size, is all a checkpoint's ``trainer_state.pt`` holds of the optimizer)."""
    return [p for p in model.parameters() if p.requires_grad]


def named_weights(model: Any, sync_mode: str) -> list[tuple[str, torch.Tensor]]:
    """What a wrapped backend sends: the adapter (wire format) in ``adapter`` mode, the merged full weights
    under HF names in ``merged`` mode."""
    if sync_mode == "adapter":
        return list(core.adapter_state(model).items())
    return core.merged_weights(model)


def save(model: Any, path: Path, model_path: str, lora_cfg: Any) -> None:
    """``adapter/`` (peft's format: ``PeftModel.from_pretrained(base, path / "adapter")`` loads it), and with
    --lora-save-merged ``model_merged/``: an HF directory of the merged weights that serves without peft."""
    from relax_core.hf_files import copy_serving_files

    model.save_pretrained(path / "adapter")
    if lora_cfg.lora_save_merged:
        from safetensors.torch import save_file

        out = path / "model_merged"
        out.mkdir(parents=True, exist_ok=True)
        merged = {n: t.contiguous() for n, t in core.merged_weights(model)}
        save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
        base = model.get_base_model()
        base.config.save_pretrained(out)
        copy_serving_files(model_path, out, getattr(base, "generation_config", None))


def load(model: Any, path: Path) -> None:
    """Put the adapter of a checkpoint written by :func:`save` back (refused: a checkpoint without one, or
    an adapter of other --lora-* flags)."""
    from safetensors.torch import load_file

    file = path / "adapter" / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(
            f"--load {path}: no adapter/ in it (a full fine-tuning checkpoint?); load it without --lora-rank, "
            "or load a checkpoint of a LoRA run"
        )
    core.load_adapter_state(model, load_file(str(file)))


def meta(version: int, lora_cfg: Any) -> dict[str, Any]:
    """A checkpoint's ``meta.json``: its version, and with LoRA the adapter's config (``lora``)."""
    out: dict[str, Any] = {"version": version}
    if lora_cfg is not None:
        out["lora"] = {**core.peft_config_dict(lora_cfg), "sync_mode": lora_cfg.lora_sync_mode}
    return out


def refuse_lora_checkpoint(path: Path) -> None:
    """A checkpoint of a LoRA run loaded by a backend without adapters: say which flags it needs."""
    file = path / "meta.json"
    info = json.loads(file.read_text()).get("lora") if file.is_file() else None
    if info is not None and not (path / "model").is_dir():
        raise ValueError(
            f"--load {path}: a LoRA checkpoint (adapter/ of rank {info.get('r')}); add --lora-rank "
            f"{info.get('r')} (and its other --lora-* flags) to resume it, or serve its model_merged/"
        )


class BaseView:
    """The base model of a LoRA backend, computed with the backend's own weights under peft's
    ``disable_adapter()``: the Reference role's log-probs in colocate without a second copy of the base
    (:meth:`TorchBackend.base_view <relax_train.backends.torch_backend.TorchBackend.base_view>`). Frozen:
    version 0 always, and nothing to train, load or offload (the trainer owns the tensors)."""

    version: int = 0
    stochastic_forward: bool = False
    supports_streamed_step: bool = False
    before_update = None

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    @property
    def routing(self) -> Any:
        """The trainer's routing replay (R3): the base computes under the same recorded experts."""
        return self.backend.routing

    def compute_log_probs(self, samples: TrainBatch) -> list[np.ndarray]:
        """Each sample's response log-probs under the base model (the adapters off for this call only)."""
        with self.backend.model.disable_adapter():
            return self.backend.compute_log_probs(samples)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The base model's weights under HF names (a weights checksum of the reference)."""
        return [(n, p.detach()) for n, p in core.base_parameters(self.backend.model)]

    def offload(self) -> int:
        return 0

    def onload(self) -> int:
        return 0
