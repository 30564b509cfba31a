"""relax_multimodal: images, video and audio into Qwen-VL / Qwen-Omni model inputs and rollout payloads.

Standalone (no other relax-* package), and light at import: numpy and pillow only. PyAV, soundfile,
soxr, ffmpeg, transformers and torch are imported when a function needs them.

>>> from relax_multimodal import smart_resize
>>> smart_resize(1080, 1920, 28)
(1092, 1932)
"""

from importlib import metadata as _metadata

from .audio import AudioItem, audio_features, process_audio
from .errors import MediaError
from .image import ImageItem, process_image, to_rgb
from .patches import patchify
from .pool import PoolStartError, PreprocessPool
from .processor import (
    BatchResult,
    ContentCache,
    MultimodalConfig,
    MultimodalProcessor,
    ProcessedSample,
    collate,
)
from .specs import MODELS, ModelSpec, get_spec, smart_nframes, smart_resize
from .video import VideoItem, process_video, sample_indices

try:  # one source: the installed distribution's metadata, written from pyproject.toml
    __version__ = _metadata.version("relax-multimodal")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "MODELS",
    "AudioItem",
    "BatchResult",
    "ContentCache",
    "ImageItem",
    "MediaError",
    "ModelSpec",
    "MultimodalConfig",
    "MultimodalProcessor",
    "PoolStartError",
    "PreprocessPool",
    "ProcessedSample",
    "VideoItem",
    "audio_features",
    "collate",
    "get_spec",
    "patchify",
    "process_audio",
    "process_image",
    "process_video",
    "sample_indices",
    "smart_nframes",
    "smart_resize",
    "to_rgb",
]
