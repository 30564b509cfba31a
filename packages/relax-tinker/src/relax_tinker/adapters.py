"""Training clients' LoRA adapters on one base model: forward, forward-backward and the Adam step of the
Tinker API, and their save and load in peft's own format.

Why one base model with named adapters (peft's multi-adapter model) rather than a model per client: the base
weights are most of the memory and are frozen; each training client is an adapter of its own, made active
for its calls only (peft then gives only that adapter's parameters a gradient), with its own optimizer. The
calls of all clients take one lock: one model computes one thing at a time.

Gradients accumulate over ``forward_backward`` calls until ``optim_step`` (the API's contract); the Adam
parameters come with each step (its ``learning_rate``, betas, eps, decoupled weight decay, gradient clip).
"""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax_tinker.losses import loss_fn
from relax_tinker.wire import Datum

LORA_ALPHA = 32
"""peft's ``lora_alpha`` for every adapter (the API gives the rank only; Tinker's docs use 32)."""
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
MICRO_BATCH = 8
"""Datums per forward (and backward) pass: the activations of a long call stay bounded."""


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


def lora_config(
    rank: int, train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True
) -> Any:
    """peft's config for an adapter of ``rank`` on the chosen blocks (the API's ``lora_config`` fields)."""
    import peft

    targets = [
        *(_ATTN if train_attn else ()),
        *(_MLP if train_mlp else ()),
        *(("lm_head",) if train_unembed else ()),
    ]
    if not targets:
        raise ValueError("lora_config trains nothing: set one of train_attn, train_mlp, train_unembed")
    return peft.LoraConfig(
        r=rank, lora_alpha=LORA_ALPHA, target_modules=targets, lora_dropout=0.0, bias="none"
    )


class Adapters:
    """The base model at ``model_path`` and one named adapter per training client."""

    def __init__(self, model_path: str, dtype: str = "float32") -> None:
        from relax_core.models import load_model

        self.model_path = model_path
        self.model: Any = load_model(model_path, dtype)
        self._peft = False
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.lock = threading.Lock()

    def add(self, name: str, config: Any, seed: int | None = None) -> None:
        """A new adapter ``name`` (B = 0: it computes what the base computes until trained)."""
        import peft

        with self.lock:
            torch.manual_seed(
                seed if seed is not None else zlib.crc32(name.encode())
            )  # (str hashes vary by process)
            if not self._peft:
                self.model = peft.get_peft_model(self.model, config, adapter_name=name)
                self._peft = True
            else:
                self.model.add_adapter(name, config)
            self.model.set_adapter(name)
            params = [p for n, p in self.model.named_parameters() if f".{name}." in n]
            self.optimizers[name] = torch.optim.AdamW(params, lr=1e-4)

    def remove(self, name: str) -> None:
        with self.lock:
            self.model.delete_adapter(name)
            del self.optimizers[name]

    def config(self, name: str) -> Any:
        return self.model.peft_config[name]

    # -- compute --------------------------------------------------------------------------------
    def _logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """Per datum, log p(target_tokens[i] | tokens[: i + 1]) ((N,) or (N, K) for top-K targets)."""
        width = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), width, dtype=torch.long)
        mask = torch.zeros(len(data), width, dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : len(d.tokens)] = torch.tensor(d.tokens)
            mask[i, : len(d.tokens)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        out = []
        for i, d in enumerate(data):
            targets = torch.as_tensor(d.inputs["target_tokens"], dtype=torch.long)
            if targets.shape[0] != len(d.tokens):
                raise ValueError(
                    f"datum {i}: {targets.shape[0]} target_tokens for {len(d.tokens)} input tokens (one each)"
                )
            logp = torch.log_softmax(logits[i, : len(d.tokens)], dim=-1)
            if targets.dim() == 1:
                out.append(logp.gather(1, targets[:, None])[:, 0])
            else:
                out.append(logp.gather(1, targets))
        return out

    def forward(
        self, name: str, data: list[Datum], loss: str, config: dict[str, Any], backward: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """The loss ``loss`` on ``data`` with adapter ``name`` (its gradient added with ``backward``):
        per datum its target log-probs, and the metrics (``loss:sum``)."""
        fn = loss_fn(loss)
        for i, d in enumerate(data):
            if "target_tokens" not in d.inputs:
                raise ValueError(f"datum {i}: loss_fn_inputs has no 'target_tokens'")
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        with self.lock:
            self.model.set_adapter(name)
            for start in range(0, len(data), MICRO_BATCH):
                part = data[start : start + MICRO_BATCH]
                with torch.set_grad_enabled(backward):
                    logps = self._logprobs(part)
                    losses = []
                    for lp, d in zip(logps, part):
                        inputs = {k: torch.as_tensor(v) for k, v in d.inputs.items() if k != "target_tokens"}
                        losses.append(fn(lp, {k: v.to(lp.dtype) for k, v in inputs.items()}, config))
                    part_loss = torch.stack(losses).sum()
                if backward:
                    part_loss.backward()
                total += float(part_loss.detach())
                outputs += [{"logprobs": lp.detach().numpy()} for lp in logps]
        return outputs, {"loss:sum": total}

    def step(self, name: str, adam: AdamParams) -> dict[str, float]:
        """One AdamW step of adapter ``name`` with ``adam``'s parameters; its gradients are then cleared."""
        with self.lock:
            opt = self.optimizers[name]
            for group in opt.param_groups:
                group.update(
                    lr=adam.learning_rate,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            params = [p for g in opt.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm or float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"optim/grad_norm:mean": float(norm)}

    # -- weights ------------------------------------------------------------------------------------
    def state(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s tensors under peft's saved names (no adapter name in them), copied."""
        from peft import get_peft_model_state_dict

        with self.lock:
            sd = get_peft_model_state_dict(self.model, adapter_name=name)
            return {k: v.detach().clone() for k, v in sd.items()}

    def save(self, name: str, path: Path, optimizer: bool) -> None:
        """Adapter ``name`` in peft's format at ``path`` (``PeftModel.from_pretrained(base, path)`` loads
        it), with ``optimizer.pt`` when asked (the training state)."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.state(name).items()}, str(path / "adapter_model.safetensors")
        )
        config = self.config(name).to_dict()
        config["base_model_name_or_path"] = self.model_path
        config["target_modules"] = sorted(config["target_modules"])
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        if optimizer:
            torch.save(self.optimizers[name].state_dict(), path / "optimizer.pt")

    def load(self, name: str, path: Path, optimizer: bool) -> None:
        """Adapter ``name`` from what :meth:`save` wrote (its optimizer state too when asked and there)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        sd = load_file(str(path / "adapter_model.safetensors"))
        with self.lock:
            result = set_peft_model_state_dict(self.model, sd, adapter_name=name)
            missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
            if missing:
                raise ValueError(f"{path}: tensors this adapter does not have: {missing[:3]}")
            if optimizer:
                opt_path = path / "optimizer.pt"
                if not opt_path.is_file():
                    raise ValueError(f"{path} holds no optimizer state: load it with optimizer=False")
                self.optimizers[name].load_state_dict(torch.load(opt_path))

    @staticmethod
    def read_config(path: Path) -> Any:
        """The peft config saved at ``path`` (to create the adapter a load fills)."""
        import peft

        return peft.LoraConfig.from_pretrained(str(path))
