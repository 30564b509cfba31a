"""Batching per-sample multimodal tensors for one forward pass; shared by the rollout engine and the
trainer so that both hand the model the same batch (same order, same padding), which is what makes their
log-probs agree.

A sample carries a dict of numpy arrays (what ``relax_multimodal.ProcessedSample.tensors()`` returns, plus
``mm_token_type_ids`` for its prompt). Across samples, per-item arrays (image patches, grids, audio
features, ...) are concatenated in sample order, as the Qwen-VL/Omni forwards expect; audio features of
different lengths are zero-padded along time (their ``feature_attention_mask`` marks the real frames).
"""

from __future__ import annotations

from typing import Any

import numpy as np

TOKEN_KEYS = ("mm_token_type_ids",)
"""Per-token arrays: padded to the sequence, not concatenated."""
TIME_PADDED = ("input_features", "feature_attention_mask")
"""Per-audio arrays whose last axis is time."""


def collate_mm(items: list[dict[str, Any] | None], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """Concatenate the multimodal tensors of ``items`` (None = a text-only sample) as torch tensors."""
    import torch

    keys: list[str] = []
    for it in items:
        for k in it or {}:
            if k not in keys and k not in TOKEN_KEYS and k not in drop:
                keys.append(k)
    out: dict[str, Any] = {}
    for k in keys:
        arrays = [np.asarray(it[k]) for it in items if it and k in it]
        if k in TIME_PADDED:
            width = max(a.shape[-1] for a in arrays)
            arrays = [np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])]) for a in arrays]
        out[k] = torch.from_numpy(np.ascontiguousarray(np.concatenate(arrays)))
    return out


def token_types(items: list[dict[str, Any] | None], lengths: list[int], width: int, left: bool) -> Any:
    """[B, width] ``mm_token_type_ids``: each sample's prompt types, 0 for its other tokens and padding.

    ``lengths`` are the samples' token counts in the batch; ``left`` says the batch is left-padded."""
    import torch

    out = torch.zeros((len(items), width), dtype=torch.long)
    for row, (it, n) in enumerate(zip(items, lengths)):
        if not it or "mm_token_type_ids" not in it:
            continue
        types = torch.as_tensor(np.asarray(it["mm_token_type_ids"], dtype=np.int64))
        start = width - n if left else 0
        out[row, start : start + len(types)] = types
    return out
