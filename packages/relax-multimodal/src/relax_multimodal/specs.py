"""Model specs and the sizing arithmetic shared by every Qwen-VL / Qwen-Omni model.

Why this is its own module: the number of placeholder tokens in a prompt must equal the number of
features the vision / audio encoder produces, and both are decided *here*, from image sizes and frame
counts alone, before a pixel is decoded. The rules follow ``qwen-vl-utils`` (``smart_resize``,
``smart_nframes``, ``calculate_video_frame_range``) and transformers' Qwen processors; the behaviour
was read from their documentation and source, the code is our own. Where we differ, the package README
lists it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_RATIO = 200
FRAME_FACTOR = 2
IMAGE_MIN_TOKENS = 4
IMAGE_MAX_TOKENS = 16384
VIDEO_MIN_TOKENS = 128
VIDEO_MAX_TOKENS = 768
VIDEO_FPS = 2.0
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 768
MODEL_SEQ_LEN = 128000

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


def round_by_factor(x: float, factor: int) -> int:
    return round(x / factor) * factor


def ceil_by_factor(x: float, factor: int) -> int:
    return math.ceil(x / factor) * factor


def floor_by_factor(x: float, factor: int) -> int:
    return math.floor(x / factor) * factor


def smart_resize(
    height: int, width: int, factor: int, min_pixels: float | None = None, max_pixels: float | None = None
) -> tuple[int, int]:
    """Target (height, width): both multiples of ``factor``, area within [min_pixels, max_pixels], aspect kept.

    >>> smart_resize(480, 640, 28)
    (476, 644)
    >>> smart_resize(10, 10, 28)
    (56, 56)
    """
    max_pixels = IMAGE_MAX_TOKENS * factor**2 if max_pixels is None else max_pixels
    min_pixels = IMAGE_MIN_TOKENS * factor**2 if min_pixels is None else min_pixels
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels must be ≥ min_pixels (got {max_pixels} < {min_pixels})")
    if min(height, width) <= 0:
        raise ValueError(f"image size must be positive (got {height}x{width})")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"aspect ratio must be ≤ {MAX_RATIO} (got {height}x{width}, "
            f"{max(height, width) / min(height, width):.1f}); crop or pad the image"
        )
    h = max(factor, round_by_factor(height, factor))
    w = max(factor, round_by_factor(width, factor))
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = floor_by_factor(height / beta, factor)
        w = floor_by_factor(width / beta, factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = ceil_by_factor(height * beta, factor)
        w = ceil_by_factor(width * beta, factor)
    return h, w


def smart_nframes(
    total_frames: int,
    video_fps: float,
    *,
    fps: float | None = None,
    nframes: int | None = None,
    min_frames: int = VIDEO_MIN_FRAMES,
    max_frames: int | None = None,
) -> int:
    """How many frames to sample: ``fps`` per second of video (or exactly ``nframes``), clamped, even.

    >>> smart_nframes(300, 30.0)   # 10 s at 2 fps
    20
    """
    if fps is not None and nframes is not None:
        raise ValueError("give either fps or nframes, not both")
    if nframes is not None:
        n = round_by_factor(nframes, FRAME_FACTOR)
    else:
        fps = VIDEO_FPS if fps is None else fps
        lo = ceil_by_factor(min_frames, FRAME_FACTOR)
        hi = floor_by_factor(
            min(VIDEO_MAX_FRAMES, total_frames) if max_frames is None else max_frames, FRAME_FACTOR
        )
        target = total_frames / video_fps * fps
        n = floor_by_factor(min(min(max(target, lo), hi), total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= total_frames:
        raise ValueError(
            f"the video has {total_frames} frames in range; need at least {FRAME_FACTOR} (got {n})"
        )
    return int(n)


def frame_range(
    total_frames: int, video_fps: float, start: float | None, end: float | None
) -> tuple[int, int]:
    """First and last frame index (inclusive) of the clip [start, end] seconds."""
    if video_fps <= 0 or total_frames <= 0:
        raise ValueError(f"video has no frames (frames={total_frames}, fps={video_fps})")
    if start is None and end is None:
        return 0, total_frames - 1
    duration = total_frames / video_fps
    first = math.ceil(max(0.0, min(start, duration)) * video_fps) if start is not None else 0
    last = total_frames - 1
    if end is not None:
        last = min(math.floor(max(0.0, min(end, duration)) * video_fps), total_frames - 1)
    if first >= last:
        raise ValueError(f"empty clip: start={start}s end={end}s of a {duration:.2f}s video")
    return first, last


def linspace_indices(first: int, last: int, n: int) -> list[int]:
    """``torch.linspace(first, last, n).round()`` (float32, round half to even), without torch.

    torch fills the first half as ``start + i*step`` and the second half as ``end - (n-1-i)*step`` in
    float32; reproducing that keeps the frame indices bit-identical to qwen-vl-utils' on ties.
    """
    if n == 1:
        return [first]
    f32 = np.float32
    start, end = f32(first), f32(last)
    step = (end - start) / f32(n - 1)
    i = np.arange(n)
    half = n // 2
    lo = start + step * i[:half].astype(np.float32)
    hi = end - step * (n - 1 - i[half:]).astype(np.float32)
    return np.round(np.concatenate([lo, hi]).astype(np.float32)).astype(np.int64).tolist()


def whisper_frames(n_samples: int, hop_length: int = 160) -> int:
    """Mel frames the Whisper feature extractor keeps for ``n_samples`` (unpadded)."""
    return n_samples // hop_length


def _qwen2_audio_tokens(frames: int) -> int:
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def _qwen3_omni_audio_tokens(frames: int, n_window: int = 50) -> int:
    chunk = n_window * 2
    rest = (frames % chunk - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13


@dataclass(frozen=True)
class ModelSpec:
    """What a model family needs from preprocessing: patch grid, normalisation and its special tokens."""

    name: str
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    image_token: str = "<|image_pad|>"
    video_token: str = "<|video_pad|>"
    audio_token: str = "<|audio_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    audio_start: str = "<|audio_start|>"
    audio_end: str = "<|audio_end|>"
    audio_rate: int = 16000
    n_mels: int = 128
    hop_length: int = 160
    audio: str = "none"  # "none" | "qwen2" | "qwen3_omni": how mel frames become audio tokens
    video_timestamps: bool = False  # Qwen3-VL writes "<t seconds>" before each temporal grid step
    extra: dict = field(default_factory=dict)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def tokens_for_grid(self, t: int, h: int, w: int) -> int:
        return t * h * w // (self.merge_size**2)

    def audio_tokens(self, frames: int) -> int:
        if self.audio == "qwen2":
            return _qwen2_audio_tokens(frames)
        if self.audio == "qwen3_omni":
            return _qwen3_omni_audio_tokens(frames)
        raise ValueError(
            f"model {self.name!r} takes no audio; use a Qwen-Omni spec (one of {sorted(MODELS)})"
        )


MODELS: dict[str, ModelSpec] = {
    "qwen2_5_vl": ModelSpec("qwen2_5_vl"),
    "qwen3_vl": ModelSpec("qwen3_vl", patch_size=16, image_mean=HALF, image_std=HALF, video_timestamps=True),
    "qwen2_5_omni": ModelSpec(
        "qwen2_5_omni",
        image_token="<|IMAGE|>",
        video_token="<|VIDEO|>",
        audio_token="<|AUDIO|>",
        vision_start="<|vision_bos|>",
        vision_end="<|vision_eos|>",
        audio_start="<|audio_bos|>",
        audio_end="<|audio_eos|>",
        audio="qwen2",
    ),
    "qwen3_omni": ModelSpec("qwen3_omni", patch_size=16, image_mean=HALF, image_std=HALF, audio="qwen3_omni"),
}


def get_spec(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    try:
        return MODELS[model]
    except KeyError:
        raise ValueError(f"unknown model family {model!r}; choose one of {sorted(MODELS)}") from None
