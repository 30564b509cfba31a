"""Samples to model inputs: ``multimodal_keys``, placeholder expansion, training tensors, rollout payloads.

A dataset row holds a prompt and media columns; ``multimodal_keys`` says which column holds which
modality (``{"image": "images", "audio": "clip"}``, as upstream Relax's ``--multimodal-keys``), each
column one item or a list. The prompt marks where media go with the model's pad token (what chat
templates emit: ``<|vision_start|><|image_pad|><|vision_end|>``) or a generic ``<image>`` / ``<video>`` /
``<audio>``; with no marker at all, the blocks are prepended. Each pad is then expanded to exactly the
number of features the encoder will produce, and the token ids are assembled *around* the pads (text
tokenized, pad ids inserted), so the count holds for any tokenizer.
"""

from __future__ import annotations

import base64
import io
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .audio import AudioItem, audio_features, process_audio
from .errors import MediaError
from .image import DEFAULT_MAX_IMAGE_PIXELS, ImageItem, process_image
from .patches import patchify
from .sources import content_hash, resolve
from .specs import ModelSpec, get_spec
from .video import VideoItem, process_video

MODALITIES = ("image", "video", "audio")
GENERIC = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


@dataclass
class MultimodalConfig:
    """How to read media columns and size them for one model family (all budgets optional)."""

    model: str = "qwen2_5_vl"
    multimodal_keys: dict[str, str] = field(default_factory=lambda: {"image": "images"})
    prompt_key: str = "prompt"
    id_key: str | None = None  # column naming the sample in errors; default: its index in the batch
    media_root: str | None = None
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    image_min_tokens: int | None = None
    image_max_tokens: int | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    video_fps: float | None = None
    video_nframes: int | None = None
    video_min_frames: int = 4
    video_max_frames: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_total_pixels: float | None = None
    use_audio_in_video: bool = False
    audio_max_seconds: float | None = None
    audio_truncate: bool = True
    cache_max_bytes: int = 256 << 20

    def __post_init__(self):
        get_spec(self.model)
        for modality, column in self.multimodal_keys.items():
            if modality not in MODALITIES:
                raise MediaError(
                    "unknown_key", f"unknown modality {modality!r} in multimodal_keys (for column {column!r})"
                )
        if self.video_fps is not None and self.video_nframes is not None:
            raise ValueError("set video_fps or video_nframes, not both")
        if self.video_min_frames < 1:
            raise ValueError(f"video_min_frames must be ≥ 1 (got {self.video_min_frames})")
        if self.audio_max_seconds is not None and self.audio_max_seconds <= 0:
            raise ValueError(f"audio_max_seconds must be > 0 (got {self.audio_max_seconds})")


@dataclass
class ProcessedSample:
    """One sample's media, decoded and sized; tensors and payloads are built from it on demand."""

    index: Any
    prompt: str  # with one placeholder block per item (what SGLang expands itself)
    text: str  # placeholders expanded to the exact feature count
    images: list[ImageItem]
    videos: list[VideoItem]
    audios: list[AudioItem]  # in prompt order (a video's own track follows that video)
    model: str
    input_ids: list[int] | None = None
    mm_token_type_ids: list[int] | None = (
        None  # per token: 0 text, 1 image, 2 video, 3 audio (Qwen3-VL needs it)
    )
    row: dict | None = None

    @property
    def spec(self) -> ModelSpec:
        return get_spec(self.model)

    @property
    def nbytes(self) -> int:
        return (
            sum(i.nbytes for i in self.images)
            + sum(v.nbytes for v in self.videos)
            + sum(a.nbytes for a in self.audios)
        )

    def num_tokens(self) -> dict[str, int]:
        return {
            "image": sum(i.num_tokens for i in self.images),
            "video": sum(v.num_tokens for v in self.videos),
            "audio": sum(a.num_tokens for a in self.audios),
        }

    def tensors(self, as_torch: bool = False) -> dict[str, Any]:
        """The model's multimodal forward kwargs (numpy, or torch tensors with ``as_torch``)."""
        return _tensors([self], as_torch)

    def sglang_payload(self) -> dict[str, Any]:
        """The fields SGLang's ``/generate`` takes: text with one block per item, media as data URIs."""
        out: dict[str, Any] = {"text": self.prompt}
        if self.images:
            out["image_data"] = [_png_uri(i.array) for i in self.images]
        if self.videos:
            out["video_data"] = [v.extra.get("uri") or v.source for v in self.videos]
        standalone = [a for a in self.audios if not a.source.startswith("video:")]
        if standalone:
            out["audio_data"] = [_wav_uri(a.waveform, a.rate) for a in standalone]
        return out

    def engine_payload(self, as_torch: bool = False) -> dict[str, Any]:
        """What our torch engine takes: expanded token ids (or text), their modality types, the forward kwargs."""
        out = {"input_ids": self.input_ids, "mm_token_type_ids": self.mm_token_type_ids, "text": self.text}
        out.update(self.tensors(as_torch))
        return out


def collate(samples: list[ProcessedSample], as_torch: bool = False) -> dict[str, Any]:
    """Multimodal tensors of several samples concatenated in order (how the model batches them)."""
    return _tensors(samples, as_torch)


def _tensors(samples: list[ProcessedSample], as_torch: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not samples:
        return out
    spec = samples[0].spec
    images = [i for s in samples for i in s.images]
    videos = [v for s in samples for v in s.videos]
    audios = [a for s in samples for a in s.audios]
    if images:
        pv, grids = zip(*(patchify(i.array[None], spec) for i in images))
        out["pixel_values"] = np.concatenate(pv)
        out["image_grid_thw"] = np.asarray(grids, dtype=np.int64)
    if videos:
        pv, grids = zip(*(patchify(v.frames, spec) for v in videos))
        out["pixel_values_videos"] = np.concatenate(pv)
        out["video_grid_thw"] = np.asarray(grids, dtype=np.int64)
        out["second_per_grid_ts"] = np.asarray([v.second_per_grid_t for v in videos], dtype=np.float32)
    if audios:
        out.update(audio_features(audios, spec))
    if as_torch:
        import torch

        out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
    return out


def _png_uri(array: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_uri(wave: np.ndarray, rate: int) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="WAV", subtype="FLOAT")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


class ContentCache:
    """LRU of processed media keyed by (content hash, settings), bounded in bytes."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes, self.bytes, self.hits, self.misses = max_bytes, 0, 0, 0
        self._d: dict[tuple, Any] = {}

    def get(self, key):
        item = self._d.pop(key, None)
        if item is None:
            self.misses += 1
            return None
        self._d[key] = item  # most recent last
        self.hits += 1
        return item

    def put(self, key, item) -> None:
        size = int(getattr(item, "nbytes", 0))
        if size > self.max_bytes:
            return
        if key in self._d:
            self.bytes -= int(getattr(self._d.pop(key), "nbytes", 0))
        self._d[key] = item
        self.bytes += size
        while self.bytes > self.max_bytes and self._d:
            self.bytes -= int(getattr(self._d.pop(next(iter(self._d))), "nbytes", 0))

    def __len__(self) -> int:
        return len(self._d)


class MultimodalProcessor:
    """Turns dataset rows into :class:`ProcessedSample` for one model family and tokenizer."""

    def __init__(self, config: MultimodalConfig | None = None, tokenizer: Any = None, **overrides):
        self.config = config or MultimodalConfig(**overrides)
        self.spec = get_spec(self.config.model)
        self.tokenizer = tokenizer
        self.cache = ContentCache(self.config.cache_max_bytes)
        self._modalities = [m for m in MODALITIES if m in self.config.multimodal_keys]

    # -- media --------------------------------------------------------------------------------
    def _item(self, modality: str, raw: object) -> ImageItem | VideoItem | AudioItem:
        c, opts = self.config, {}
        if isinstance(raw, dict) and ("type" in raw or any(m in raw for m in MODALITIES)):
            kind = raw.get("type", modality)
            if kind not in MODALITIES:
                raise MediaError(
                    "unknown_key", f"unknown modality {kind!r} in a media item", modality=modality
                )
            opts = {k: v for k, v in raw.items() if k not in ("type", *MODALITIES)}
            raw = raw.get(kind, raw.get(modality))
        src = resolve(raw, c.media_root)
        digest = content_hash(src)
        key = (digest, modality, tuple(sorted(opts.items()))) if digest else None
        if key is not None and (hit := self.cache.get(key)) is not None:
            return hit
        item: ImageItem | VideoItem | AudioItem
        if modality == "image":
            item = process_image(
                src,
                self.spec,
                min_pixels=opts.get("min_pixels", c.image_min_pixels),
                max_pixels=opts.get("max_pixels", c.image_max_pixels),
                min_tokens=c.image_min_tokens,
                max_tokens=c.image_max_tokens,
                max_image_pixels=c.max_image_pixels,
            )
        elif modality == "video":
            fps, nframes = opts.get("fps", c.video_fps), opts.get("nframes", c.video_nframes)
            item = process_video(
                src,
                self.spec,
                fps=None if nframes is not None else fps,
                nframes=nframes,
                min_frames=opts.get("min_frames", c.video_min_frames),
                max_frames=opts.get("max_frames", c.video_max_frames),
                min_pixels=opts.get("min_pixels", c.video_min_pixels),
                max_pixels=opts.get("max_pixels", c.video_max_pixels),
                total_pixels=opts.get("total_pixels", c.video_total_pixels),
                video_start=opts.get("video_start"),
                video_end=opts.get("video_end"),
                use_audio_in_video=opts.get("use_audio_in_video", c.use_audio_in_video),
                audio_max_seconds=c.audio_max_seconds,
            )
            if item.audio is not None:
                item.audio.source = "video:" + item.source
        else:
            item = process_audio(src, self.spec, max_seconds=c.audio_max_seconds, truncate=c.audio_truncate)
        if key is not None:
            self.cache.put(key, item)
        return item

    def _items(self, row: dict) -> dict[str, list]:
        out: dict[str, list] = {m: [] for m in MODALITIES}
        for modality, column in self.config.multimodal_keys.items():
            value = row.get(column)
            if value is None:
                continue
            values = list(value) if isinstance(value, list | tuple) else [value]
            for raw in values:
                try:
                    out[modality].append(self._item(modality, raw))
                except MediaError as e:
                    raise e.located(key=column, modality=modality) from None
        return out

    # -- prompt -------------------------------------------------------------------------------
    def _blocks(self, prompt: str, counts: dict[str, int]) -> str:
        s = self.spec
        pads = {"image": s.image_token, "video": s.video_token, "audio": s.audio_token}
        starts = {"image": s.vision_start, "video": s.vision_start, "audio": s.audio_start}
        ends = {"image": s.vision_end, "video": s.vision_end, "audio": s.audio_end}
        prefix = ""
        for m in self._modalities:  # a modality not in multimodal_keys leaves its markers as plain text
            block = starts[m] + pads[m] + ends[m]
            prompt = prompt.replace(GENERIC[m], block)
            found = prompt.count(pads[m])
            if found == 0 and counts[m]:
                prefix += block * counts[m]
            elif found != counts[m]:
                raise MediaError(
                    "placeholders", f"prompt has {found} {m} placeholder(s) for {counts[m]} {m}(s)"
                )
        return prefix + prompt

    def _expand(self, prompt: str, items: dict[str, list]) -> tuple[list[tuple], list[AudioItem]]:
        """Parts of the expanded prompt: ("text", str) or ("pad", token, count); audios in prompt order."""
        s = self.spec
        pads = {s.image_token: "image", s.video_token: "video", s.audio_token: "audio"}
        pads = {tok: m for tok, m in pads.items() if m in self._modalities}
        if not pads:
            return [("text", prompt)], []
        pattern = re.compile("|".join(re.escape(p) for p in pads))
        queues = {m: list(items[m]) for m in MODALITIES}
        parts: list[tuple] = []
        audios: list[AudioItem] = []
        pos = 0
        for mt in pattern.finditer(prompt):
            parts.append(("text", prompt[pos : mt.start()]))
            pos = mt.end()
            m = pads[mt.group()]
            item = queues[m].pop(0)
            if m == "video" and s.video_timestamps:
                per_t = item.num_tokens // item.grid_thw[0]
                for t in item.grid_timestamps(s.temporal_patch_size):  # as transformers' Qwen3VLProcessor
                    parts.append(("text", f"<{t:.1f} seconds>{s.vision_start}"))
                    parts.append(("pad", mt.group(), per_t))
                    parts.append(("text", s.vision_end))
            else:
                parts.append(("pad", mt.group(), item.num_tokens))
            if m == "audio":
                audios.append(item)
            if m == "video" and item.audio is not None:  # the video's own track, right after it
                parts.append(("text", s.audio_start))
                parts.append(("pad", s.audio_token, item.audio.num_tokens))
                parts.append(("text", s.audio_end))
                audios.append(item.audio)
        parts.append(("text", prompt[pos:]))
        return parts, audios

    def _encode(self, parts: list[tuple]) -> tuple[list[int] | None, list[int] | None]:
        """Token ids and their modality types (0 text, 1 image, 2 video, 3 audio: ``mm_token_type_ids``)."""
        tok = self.tokenizer
        if tok is None:
            return None, None
        s = self.spec
        kinds = {s.image_token: 1, s.video_token: 2, s.audio_token: 3}
        ids: list[int] = []
        types: list[int] = []
        buf = ""
        for p in parts + [("pad", None, 0)]:
            if p[0] == "text":
                buf += p[1]
                continue
            if buf:
                text_ids = _encode_text(tok, buf)
                ids.extend(text_ids)
                types.extend([0] * len(text_ids))
                buf = ""
            if p[2]:
                ids.extend([_token_id(tok, p[1])] * p[2])
                types.extend([kinds[p[1]]] * p[2])
        return ids, types

    # -- samples ------------------------------------------------------------------------------
    def process(self, row: dict, index: Any = None) -> ProcessedSample:
        """One row → :class:`ProcessedSample`; bad media raise :class:`MediaError` naming the sample."""
        name = row.get(self.config.id_key, index) if self.config.id_key else index
        try:
            items = self._items(row)
            prompt = self._blocks(
                str(row.get(self.config.prompt_key, "") or ""), {m: len(v) for m, v in items.items()}
            )
            parts, audios = self._expand(prompt, items)
        except MediaError as e:
            raise e.located(sample=name) from None
        text = "".join(p[1] if p[0] == "text" else p[1] * p[2] for p in parts)
        ids, types = self._encode(parts)
        return ProcessedSample(
            name, prompt, text, items["image"], items["video"], audios, self.spec.name, ids, types, row
        )

    def process_batch(self, rows: list[dict], pool=None) -> BatchResult:
        """Process many rows, skipping (and counting) the bad ones; ``pool``: a :class:`PreprocessPool`."""
        result = BatchResult()
        it = pool.imap(rows) if pool is not None else (self._safe(r, i) for i, r in enumerate(rows))
        for out in it:
            if isinstance(out, MediaError):
                result.skipped.append(out)
                result.counts[out.reason] += 1
            else:
                result.samples.append(out)
        return result

    def _safe(self, row: dict, index: Any) -> ProcessedSample | MediaError:
        try:
            return self.process(row, index)
        except MediaError as e:
            return e


@dataclass
class BatchResult:
    samples: list[ProcessedSample] = field(default_factory=list)
    skipped: list[MediaError] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # reason -> number of skipped samples


def _encode_text(tok: Any, text: str) -> list[int]:
    enc = tok.encode(text, add_special_tokens=False)
    return list(getattr(enc, "ids", enc))


def _token_id(tok: Any, token: str) -> int:
    for name in ("convert_tokens_to_ids", "token_to_id"):
        fn = getattr(tok, name, None)
        if fn is not None:
            tid = fn(token)
            unk = getattr(tok, "unk_token_id", None)
            if tid is not None and (tid != unk or unk is None):
                return int(tid)
    raise ValueError(f"tokenizer has no {token!r} token; add the model's special tokens to it first")
