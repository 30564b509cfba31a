"""Audio: any format soundfile (or ffmpeg) reads, to mono float32 at the model's rate (16 kHz).

soundfile reads WAV/FLAC/OGG/MP3 from paths and bytes without a subprocess; anything else (m4a, the
audio track of a video) goes through an ffmpeg binary — from PATH, or the one inside the
``imageio-ffmpeg`` wheel — and the error says so when neither exists. Resampling is soxr's HQ (what
librosa calls by default; librosa itself is not needed).
Log-mel features come from transformers' ``WhisperFeatureExtractor``, imported only when asked for, so
the token count (mel frames → encoder frames) is known without transformers installed.
"""

from __future__ import annotations

import io
import shutil
import subprocess
from dataclasses import dataclass

import numpy as np

from .errors import MediaError
from .sources import Source, resolve
from .specs import ModelSpec, get_spec, whisper_frames


@dataclass
class AudioItem:
    """Mono float32 waveform at ``rate``; ``frames`` mel frames; ``num_tokens`` audio placeholders."""

    waveform: np.ndarray
    rate: int
    frames: int
    num_tokens: int
    source: str = "<audio>"
    truncated: bool = False

    @property
    def seconds(self) -> float:
        return len(self.waveform) / self.rate

    @property
    def nbytes(self) -> int:
        return self.waveform.nbytes


def ffmpeg_exe() -> str | None:
    """An ffmpeg binary: PATH first, then the one bundled with ``imageio-ffmpeg`` if installed."""
    exe = shutil.which("ffmpeg")
    if exe:
        return exe
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except Exception:  # not installed, or its binary is missing for this platform
        return None


def decode_with_ffmpeg(
    src: Source, rate: int, start: float | None = None, end: float | None = None
) -> np.ndarray:
    """Decode the (first) audio stream of any container to mono float32 at ``rate`` with ffmpeg."""
    exe = ffmpeg_exe()
    if exe is None:
        raise MediaError("no_decoder", "this format needs ffmpeg, and none was found", source=src.name)
    cmd = [exe, "-nostdin", "-v", "error"]
    if start:
        cmd += ["-ss", f"{start:.6f}"]
    if end is not None:
        cmd += ["-to", f"{end:.6f}"]
    cmd += [
        "-i",
        src.local_path() if src.data is None else "pipe:0",
        "-map",
        "0:a:0",
        "-ac",
        "1",
        "-ar",
        str(rate),
    ]
    cmd += ["-f", "f32le", "pipe:1"]
    proc = subprocess.run(cmd, input=src.data, capture_output=True, timeout=600)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        detail = err.splitlines()[-1] if err else f"ffmpeg exit code {proc.returncode}"
        if "matches no streams" in err or "does not contain any stream" in err:
            raise MediaError("empty", "no audio track", source=src.name)
        raise MediaError("corrupt", f"cannot decode audio ({detail})", source=src.name)
    return np.frombuffer(proc.stdout, dtype=np.float32).copy()


def _read(src: Source, rate: int) -> np.ndarray:
    if src.obj is not None:
        obj = src.obj
        if isinstance(obj, dict):  # HF datasets Audio feature: {"array": ..., "sampling_rate": ...}
            wave, sr = np.asarray(obj["array"], dtype=np.float32), int(obj.get("sampling_rate") or rate)
        else:
            wave, sr = np.asarray(obj, dtype=np.float32), rate
        return _to_mono_rate(wave, sr, rate, channels_last=wave.ndim == 2 and wave.shape[0] > wave.shape[1])
    import soundfile as sf

    if (short := _truncated_wav(src)) is not None:  # (libsndfile reads what is there, without a word)
        raise MediaError("corrupt", short, source=src.name)
    try:
        wave, sr = sf.read(io.BytesIO(src.data) if src.data is not None else src.path, dtype="float32")
    except FileNotFoundError:
        raise MediaError("missing", "file not found", source=src.name) from None
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        if src.nbytes() == 0:
            raise MediaError("empty", "zero-length audio file", source=src.name) from None
        if "unknown format" in str(e).lower() or "format not recognised" in str(e).lower():
            if ffmpeg_exe() is not None:
                return decode_with_ffmpeg(src, rate)
        raise MediaError("corrupt", f"cannot decode audio ({e})", source=src.name) from None
    return _to_mono_rate(wave, sr, rate, channels_last=True)


def _truncated_wav(src: Source) -> str | None:
    """Why a RIFF/WAVE file is cut short (its header declares more bytes than the file holds), or None."""
    try:
        if src.data is not None:
            head = src.data[:12]
        else:
            with open(src.local_path(), "rb") as f:
                head = f.read(12)
    except (OSError, TypeError):
        return None  # (sf.read says what is wrong with an unreadable path)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    declared = int.from_bytes(head[4:8], "little") + 8
    actual = src.nbytes()
    if actual < declared:
        return f"truncated WAV: its header declares {declared} bytes, the file holds {actual}"
    return None


def _to_mono_rate(wave: np.ndarray, sr: int, rate: int, channels_last: bool) -> np.ndarray:
    if wave.ndim == 2:
        wave = wave.mean(axis=1 if channels_last else 0)
    wave = np.ascontiguousarray(wave, dtype=np.float32)
    if sr != rate and wave.size:
        wave = resample(wave, sr, rate)
    return wave


def resample(wave: np.ndarray, sr: int, rate: int) -> np.ndarray:
    """soxr's HQ resampler: what librosa's default (``soxr_hq``) calls, without librosa (~400 MB with
    numba and scipy, and ~20 s to compile its core on first use on a small machine)."""
    import soxr

    return soxr.resample(wave, sr, rate, quality="HQ").astype(np.float32)


N_FFT = 400  # Whisper's STFT window (the Qwen-Omni audio feature extractor)


def process_audio(
    item: object,
    model: str | ModelSpec = "qwen2_5_omni",
    *,
    max_seconds: float | None = None,
    truncate: bool = True,
    media_root: str | None = None,
    waveform: np.ndarray | None = None,
) -> AudioItem:
    """Load one audio item as mono at the model's rate, cut to ``max_seconds``; token count is exact.

    With ``truncate=False`` an over-long clip is an error instead of being cut.
    """
    spec = get_spec(model)
    rate = spec.audio_rate
    src = item if isinstance(item, Source) else resolve(item, media_root)
    wave = _read(src, rate) if waveform is None else waveform
    if wave.size == 0:
        raise MediaError("empty", "zero-length audio", source=src.name)
    if not np.isfinite(wave).all():
        raise MediaError("corrupt", "audio holds NaN or infinite samples", source=src.name)
    cut = False
    if max_seconds is not None and len(wave) > int(max_seconds * rate):
        if not truncate:
            raise MediaError(
                "corrupt", f"audio is {len(wave) / rate:.1f}s, over max {max_seconds}s", source=src.name
            )
        wave, cut = wave[: int(max_seconds * rate)], True
    frames = whisper_frames(len(wave), spec.hop_length)
    if frames < 1:
        raise MediaError("empty", f"audio is shorter than one {spec.hop_length}-sample hop", source=src.name)
    tokens = spec.audio_tokens(frames) if spec.audio != "none" else frames
    if len(wave) <= N_FFT // 2 or tokens < 1:  # the feature extractor reflect-pads by n_fft/2
        raise MediaError(
            "short_audio",
            f"audio has {len(wave)} samples ({len(wave) / rate * 1000:.1f} ms), which gives {tokens} audio "
            f"tokens; the feature extractor needs more than {N_FFT // 2} samples and the model at least one token",
            source=src.name,
        )
    return AudioItem(wave, rate, frames, spec.audio_tokens(frames), src.name, cut)


def audio_features(items: list[AudioItem], model: str | ModelSpec = "qwen2_5_omni") -> dict[str, np.ndarray]:
    """``input_features`` (n, n_mels, frames) and ``feature_attention_mask`` (n, frames), padded to longest.

    Needs transformers (``pip install 'relax-multimodal[torch]'``); imported here, not at package import.
    """
    spec = get_spec(model)
    try:
        from transformers import WhisperFeatureExtractor
    except ImportError as e:
        raise ImportError(
            "audio features need transformers: pip install 'relax-multimodal[torch]' (or `uv add transformers`)"
        ) from e
    fe = _extractor(WhisperFeatureExtractor, spec.n_mels, spec.audio_rate, spec.hop_length)
    out = fe(
        [a.waveform for a in items],
        sampling_rate=spec.audio_rate,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="np",
    )
    mask = out["attention_mask"].astype(np.int64)
    for a, m in zip(items, mask):
        if int(m.sum()) != a.frames:  # the token count was promised from `frames`: keep that promise
            raise RuntimeError(
                f"feature extractor gave {int(m.sum())} frames, expected {a.frames} ({a.source})"
            )
    return {"input_features": out["input_features"].astype(np.float32), "feature_attention_mask": mask}


_EXTRACTORS: dict = {}


def _extractor(cls, n_mels: int, rate: int, hop: int):
    key = (n_mels, rate, hop)
    if key not in _EXTRACTORS:
        _EXTRACTORS[key] = cls(
            feature_size=n_mels, sampling_rate=rate, hop_length=hop, chunk_length=30, n_fft=400
        )
    return _EXTRACTORS[key]
