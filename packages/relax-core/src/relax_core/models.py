"""Loading a checkpoint as the right torch model, text-only or multimodal.

Why not ``AutoModelForCausalLM`` everywhere: Qwen-VL and Qwen-Omni checkpoints are not causal-LM classes
(``Qwen3VLForConditionalGeneration``, the Omni *thinker* ``Qwen3OmniMoeThinkerForConditionalGeneration``),
and the Omni thinker is in no Auto mapping. The class named in ``config.json`` (``architectures[0]``) is the
one that wrote the checkpoint, so the rollout engine and every trainer role load that same class.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

MM_FAMILIES = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen3_omni_moe_thinker": "qwen3_omni",
}
"""HF ``model_type`` -> relax-multimodal model family (placeholder tokens, patch size, audio rules)."""


def _config(path: str | Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    return config


def architecture(path: str | Path) -> str:
    cfg = _config(path)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}/config.json names no 'architectures'; save the model with save_pretrained")
    arch: str = archs[0]
    return arch


LOAD_LOCK = threading.Lock()
"""transformers' ``from_pretrained`` is not thread-safe: it swaps ``PreTrainedModel.tie_weights`` and
torch's init functions for no-ops and puts them back on exit, so two loads interleaved in threads (engine
servers in one process) can leave the no-ops in place for good — every later model of the process then
comes out untied, its lm_head on the meta device. Loads in this process take turns."""


EAGER_MAX_CONTEXT = 1024
"""Causal LMs of at most this context run eager attention on a machine without CUDA (see :func:`load_model`)."""


def attention_for(arch: str, context: int | None) -> str | None:
    """The attention implementation :func:`load_model` asks for: ``eager`` for a causal LM of a context up to
    :data:`EAGER_MAX_CONTEXT` when CUDA is not available, else None (transformers' default, SDPA). Measured
    on this project's 2-core CPU (the demo's Qwen3, a training step of 256 samples): eager 0.215 s against
    SDPA 0.279 s with micro-batches of 256, 0.256 against 0.282 of 64, and faster still at 200-token
    responses (4.27 s against 4.69 s); torch's CPU flash-attention kernel costs more than it saves on
    sequences this short. Every role loads through here, so the rollout engine and the trainer compute with
    the same kernels."""
    import torch

    if torch.cuda.is_available() or not arch.endswith("ForCausalLM"):
        return None
    return "eager" if context is not None and context <= EAGER_MAX_CONTEXT else None


def load_model(path: str | Path, dtype: str = "float32") -> Any:
    """The model class that saved ``path`` (causal LMs through ``AutoModelForCausalLM``), with the attention
    implementation of :func:`attention_for`."""
    import torch
    import transformers

    arch = architecture(path)
    attn = attention_for(arch, _config(path).get("max_position_embeddings"))
    extra = {"attn_implementation": attn} if attn else {}
    cls: Any  # an Auto class or the architecture's own: transformers types them apart
    if arch.endswith("ForCausalLM"):
        cls = transformers.AutoModelForCausalLM
    else:
        cls = getattr(transformers, arch, None)
        if cls is None:
            raise ValueError(
                f"{path}: architecture {arch!r} is not in transformers {transformers.__version__}"
            )
    with LOAD_LOCK:
        model = cls.from_pretrained(str(path), dtype=getattr(torch, dtype), **extra)
    return ensure_tied(model, str(path))


def context_length(config: Any) -> int | None:
    """The model's context (its language model's ``max_position_embeddings``: also for VL and Omni
    configs, through ``get_text_config``), or None where the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None)
    return n if isinstance(n, int) else None


def ensure_tied(model: Any, where: str = "model") -> Any:
    """Tie the output embedding to the input one when the config says so, and refuse parameters left on
    the meta device. transformers normally does both, but in some long test processes it did not (an
    untied lm_head was saved; a tied one was left on meta and failed in backward): what the config says
    is what every backend and engine must see."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(text, "tie_word_embeddings", False) and out is not None and inp is not None:
        if out.weight is not inp.weight:
            out.weight = inp.weight
    meta = [n for n, t in model.named_parameters() if t.is_meta]
    if meta:
        raise ValueError(f"{where}: parameters {meta[:5]} were not loaded (still on the meta device)")
    return model


def mm_family(path: str | Path) -> str | None:
    """The relax-multimodal family of the checkpoint at ``path``, or None for a text-only model."""
    return MM_FAMILIES.get(_config(path).get("model_type", ""))


MEDIA_RENAMES: dict[str, dict[str, str | None]] = {
    "qwen3_vl": {"second_per_grid_ts": None},  # time comes from the "<t seconds>" text instead
    "qwen3_omni": {"second_per_grid_ts": "video_second_per_grid"},
}
"""Per family: relax-multimodal tensor name -> the model's forward argument (None: not passed)."""


def adapt_media(family: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """relax-multimodal's tensors under the names ``family``'s forward takes."""
    renames = MEDIA_RENAMES.get(family, {})
    out = {}
    for k, v in tensors.items():
        name = renames.get(k, k)
        if name is not None:
            out[name] = v
    return out


_MEDIA_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "image_token_index",
    "video_token_index",
    "audio_token_index",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
)
MASKED_LOGIT = -1e9
"""What a never-sampled token's logit is set to (finite, so entropies stay finite; its probability is 0)."""


def forward_takes(model: Any, name: str) -> bool:
    """Whether ``model``'s forward has the parameter ``name`` (e.g. Qwen3-VL's ``mm_token_type_ids``, which
    its M-RoPE needs), looking through a peft wrapper: a LoRA model's ``forward`` takes ``**kwargs`` and passes
    them on, so its own signature does not say what the model under it takes."""
    import inspect

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return name in inspect.signature(base.forward).parameters


def media_token_ids(model: Any) -> list[int]:
    """Token ids a multimodal model must never generate: media placeholders and their delimiters.

    Why: a sampled ``<|vision_start|>`` with no media after it makes the next forward's M-RoPE indexing
    fail (random-weight and early-training policies do sample them). The rollout engine and every trainer
    role mask the same ids (``MASKED_LOGIT``), so the distribution sampled from and the one trained on stay
    identical. Empty for text-only models."""
    cfg = getattr(model, "config", model)
    ids = {getattr(cfg, f, None) for f in _MEDIA_TOKEN_FIELDS}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)
