"""Pixels to the flat patch layout Qwen-VL vision towers take (``pixel_values``), in numpy.

One row per patch, patches ordered so that each ``merge_size × merge_size`` block is contiguous (the
merger concatenates them), each row laid out (channel, time, y, x). This is the layout of transformers'
``Qwen2VLImageProcessor.patchify``; a still image is repeated ``temporal_patch_size`` times.
"""

from __future__ import annotations

import numpy as np

from .specs import ModelSpec


def normalize(frames: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """(T, H, W, 3) uint8 → (T, 3, H, W) float32, rescaled to [0, 1] and normalised with the model's mean/std."""
    x = frames.astype(np.float32) * np.float32(1 / 255)
    mean = np.asarray(spec.image_mean, dtype=np.float32)
    std = np.asarray(spec.image_std, dtype=np.float32)
    x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def patchify(frames: np.ndarray, spec: ModelSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(T, H, W, 3) uint8 → (grid_t·grid_h·grid_w, 3·tps·p·p) float32 and (grid_t, grid_h, grid_w)."""
    x = normalize(frames, spec)
    tps, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if x.shape[0] % tps:
        x = np.concatenate([x, np.repeat(x[-1:], tps - x.shape[0] % tps, axis=0)])
    t, c, h, w = x.shape
    gt, gh, gw = t // tps, h // p, w // p
    x = x.reshape(gt, tps, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tps * p * p)), (gt, gh, gw)
