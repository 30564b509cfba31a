"""What the served checkpoint's ``config.json`` tells the ``sglang`` engine: the shape of its routed experts
(R3) and the prefix its weight names carry.

Why apart: SGLang loads the checkpoint itself, in another process, so the engine never holds the model;
these few facts are read from the file instead, and each decides something elsewhere (how a reply's
routed experts are reshaped, :mod:`relax_rollout.engines.wire`; what an update's tensors are called,
:mod:`relax_rollout.engines.sglang.weights`; whether SGLang serves it at all).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax_rollout.engines.wire import RoutingInfo


def checkpoint_config(model_path: str) -> dict[str, Any] | None:
    """``model_path/config.json``; None for a path that is not a local directory (a hub id)."""
    cfg_file = Path(model_path) / "config.json"
    return json.loads(cfg_file.read_text()) if cfg_file.is_file() else None


def served_prefix(cfg: dict[str, Any] | None) -> str:
    """What the served checkpoint (its ``config.json``) puts before the trainer's weight names: ``thinker.``
    for a whole Qwen3-Omni model (SGLang serves Qwen3-Omni only as the whole model,
    ``Qwen3OmniMoeForConditionalGeneration``, whose loader reads the hub's ``thinker.*`` names; the trainer
    holds the thinker alone)."""
    arch = (cfg or {}).get("architectures") or []
    return "thinker." if "Qwen3OmniMoeForConditionalGeneration" in arch else ""


def model_routing(model_path: str) -> RoutingInfo | None:
    """The MoE shape from ``model_path/config.json`` (or its ``text_config``): None for a dense model,
    unknown fields for a path that is not a local directory (a hub id)."""
    cfg = checkpoint_config(model_path)
    if cfg is None:
        return RoutingInfo(None, None)
    nested = [cfg.get("text_config") or {}, (cfg.get("thinker_config") or {}).get("text_config") or {}]
    for c in (cfg, *nested):
        k = c.get("num_experts_per_tok") or c.get("moe_topk")
        if k:
            return RoutingInfo(c.get("num_hidden_layers"), int(k))
    return None
