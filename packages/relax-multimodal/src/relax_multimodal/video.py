"""Video: decode with PyAV, sample frames at a target fps, resize within per-frame and total budgets.

The frame count and indices follow qwen-vl-utils (``smart_nframes`` then a rounded float32 linspace
over the clip), so the frames we feed the model are the frames its authors fed it. Each frame is
resized with pillow's bicubic filter (qwen-vl-utils uses torchvision's bicubic with antialias on the
stacked tensor: same target size, pixel values differ slightly). ``use_audio_in_video`` decodes the
clip's audio track with ffmpeg (see :mod:`relax_multimodal.audio`).

Why PyAV and not decord: decord 0.6.0 (2021, unmaintained) publishes a wheel whose WHEEL file says
``cp36`` while its name says ``py3``, so uv reinstalls it on every ``uv run``; it also returns frames with
a wrong stride at some widths (48 px). decord2, its fork, fails at more widths (32 and 96 px: the omni
demo's clips). PyAV (FFmpeg's own decoders, wheels for every platform) reads every width, and its RGB
frames are decord's, pixel for pixel, where decord reads them right.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from .audio import AudioItem, decode_with_ffmpeg, process_audio
from .errors import MediaError
from .sources import Source, resolve
from .specs import (
    FRAME_FACTOR,
    MODEL_SEQ_LEN,
    VIDEO_MAX_TOKENS,
    VIDEO_MIN_TOKENS,
    ModelSpec,
    frame_range,
    get_spec,
    linspace_indices,
    smart_nframes,
    smart_resize,
)


@dataclass
class VideoItem:
    """Sampled, resized frames (T, H, W, 3) uint8 plus what the model and the prompt need about them."""

    frames: np.ndarray
    indices: list[int]
    timestamps: list[float]  # seconds, one per sampled frame
    video_fps: float
    sample_fps: float
    grid_thw: tuple[int, int, int]
    num_tokens: int
    second_per_grid_t: float
    source: str = "<video>"
    audio: AudioItem | None = None
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.frames.nbytes + (self.audio.nbytes if self.audio is not None else 0)

    def grid_timestamps(self, temporal_patch_size: int = 2) -> list[float]:
        """Mid-time of each temporal grid step (what Qwen3-VL writes as ``<t seconds>``)."""
        ts = list(self.timestamps)
        while len(ts) % temporal_patch_size:
            ts.append(ts[-1])
        return [(ts[i] + ts[i + temporal_patch_size - 1]) / 2 for i in range(0, len(ts), temporal_patch_size)]


def video_pixel_budget(
    spec: ModelSpec,
    nframes: int,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    total_pixels: float | None = None,
) -> tuple[float, float]:
    """Per-frame pixel bounds: the per-frame max shrinks so that all frames fit in ``total_pixels``."""
    f2 = spec.factor**2
    lo: float = VIDEO_MIN_TOKENS * f2 if min_pixels is None else min_pixels
    total = MODEL_SEQ_LEN * f2 * 0.9 if total_pixels is None else total_pixels
    hi = max(min(VIDEO_MAX_TOKENS * f2, total / nframes * FRAME_FACTOR), int(lo * 1.05))
    if max_pixels is not None:
        hi = min(max_pixels, hi)
        if min_pixels is None:  # a max below the default min lowers the min, rather than failing
            lo = min(lo, hi)
    return lo, hi


def sample_indices(
    total_frames: int,
    video_fps: float,
    *,
    fps: float | None = None,
    nframes: int | None = None,
    min_frames: int = 4,
    max_frames: int | None = None,
    start: float | None = None,
    end: float | None = None,
) -> list[int]:
    """Frame indices to decode (qwen-vl-utils' decord path): clip range, frame count, rounded linspace."""
    first, last = frame_range(total_frames, video_fps, start, end)
    n = smart_nframes(
        last - first + 1, video_fps, fps=fps, nframes=nframes, min_frames=min_frames, max_frames=max_frames
    )
    return linspace_indices(first, last, n)


def _resized(raw: np.ndarray, spec: ModelSpec, budget: tuple[float, float], name: str) -> np.ndarray:
    """Frames [T, H, W, 3] resized as the model's processor resizes them: sides multiples of its patch
    factor, the pixels within ``budget`` (min, max)."""
    h, w = raw.shape[1:3]
    try:
        rh, rw = smart_resize(h, w, spec.factor, *budget)
    except ValueError as e:
        raise MediaError("corrupt", str(e), source=name) from None
    if (rh, rw) == (h, w):
        return raw
    return np.stack([np.asarray(Image.fromarray(f).resize((rw, rh), Image.Resampling.BICUBIC)) for f in raw])


def process_video(
    item: object,
    model: str | ModelSpec = "qwen2_5_vl",
    *,
    fps: float | None = None,
    nframes: int | None = None,
    min_frames: int = 4,
    max_frames: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    total_pixels: float | None = None,
    video_start: float | None = None,
    video_end: float | None = None,
    use_audio_in_video: bool = False,
    audio_max_seconds: float | None = None,
    media_root: str | None = None,
) -> VideoItem:
    """Decode, sample and resize one video for ``model``; the token count is exact."""
    spec = get_spec(model)
    src = item if isinstance(item, Source) else resolve(item, media_root)
    if src.obj is not None:
        raise MediaError("bad_input", "videos are read from a path or bytes", source=src.name)
    if src.nbytes() == 0:
        raise MediaError("empty", "zero-length video file", source=src.name)
    try:
        import av
    except ImportError as e:  # pragma: no cover - declared dependency
        raise ImportError("video needs PyAV: pip install av") from e
    try:
        container = av.open(io.BytesIO(src.data) if src.data is not None else src.path)
    except Exception as e:
        raise MediaError("no_frames", f"cannot open video ({_first_line(e)})", source=src.name) from None
    with container:
        if not container.streams.video:
            raise MediaError("no_frames", "no video stream", source=src.name)
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1  # (preprocessing runs in a pool of processes already)
        vfps = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames or _count_frames(container, stream)
        if total <= 0 or not vfps > 0:
            raise MediaError("no_frames", f"no decodable frame (frames={total}, fps={vfps})", source=src.name)
        try:
            first, last = frame_range(total, vfps, video_start, video_end)
            n = smart_nframes(
                last - first + 1, vfps, fps=fps, nframes=nframes, min_frames=min_frames, max_frames=max_frames
            )
        except ValueError as e:
            raise MediaError("too_short", str(e), source=src.name) from None
        idx = linspace_indices(first, last, n)
        raw = _decode(container, stream, idx, total, src.name)
    if raw.ndim != 4 or raw.shape[0] != len(idx) or raw.shape[-1] != 3:
        raise MediaError("no_frames", f"decoder returned frames of shape {raw.shape}", source=src.name)
    raw = _resized(raw, spec, video_pixel_budget(spec, n, min_pixels, max_pixels, total_pixels), src.name)
    rh, rw = raw.shape[1:3]
    sample_fps = n / max(last - first + 1, 1e-6) * vfps
    tps = spec.temporal_patch_size
    grid = (-(-n // tps), rh // spec.patch_size, rw // spec.patch_size)
    audio = None
    if use_audio_in_video:
        start_s = first / vfps
        end_s = (last + 1) / vfps
        wave = decode_with_ffmpeg(src, spec.audio_rate, start_s, end_s)
        audio = process_audio(src, spec, max_seconds=audio_max_seconds, waveform=wave)
    return VideoItem(
        frames=raw,
        indices=idx,
        timestamps=[i / vfps for i in idx],
        video_fps=vfps,
        sample_fps=sample_fps,
        grid_thw=grid,
        num_tokens=spec.tokens_for_grid(*grid),
        second_per_grid_t=tps / sample_fps,
        source=src.name,
        audio=audio,
    )


def _count_frames(container, stream) -> int:
    """The video's frame count where the container does not store it (Matroska, WebM): its packets, counted
    without decoding (what decord reports as the length); the container is rewound after."""
    n = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return n


def _decode(container, stream, idx: list[int], total: int, source: str) -> np.ndarray:
    """Frames ``idx`` (ascending, repeats allowed) as (len(idx), H, W, 3) RGB uint8, decoded in order up
    to the last one asked for. Frames missing at the very end (a container whose count is one or two
    frames high) repeat the last decoded one; a file whose frames stop well before (truncated) is
    ``no_frames``, never silently padded."""
    wanted = set(idx)
    got: dict[int, np.ndarray] = {}
    decoded, error = 0, ""
    try:
        for frame in container.decode(stream):
            if decoded in wanted:
                got[decoded] = frame.to_ndarray(format="rgb24")
            decoded += 1
            if decoded > idx[-1]:
                break
    except Exception as e:  # a damaged packet: fine only past the frames asked for
        error = f": {_first_line(e)}"
    if not got or decoded < idx[-1] - 1:
        raise MediaError(
            "no_frames", f"only {decoded} of {total} frames decode (a truncated file?{error})", source=source
        )
    last = got[max(got)]
    return np.stack([got.get(i, last) for i in idx])


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"[:200]
