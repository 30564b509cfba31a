"""Test helpers (imported as ``mm_media``): media generated in tmp dirs: PIL images, mp4 via the ffmpeg inside imageio-ffmpeg, WAV via soundfile."""

import re
import subprocess

import numpy as np
import pytest
import soundfile as sf
from PIL import Image


def ffmpeg_or_skip() -> str:
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="video tests write mp4 with imageio-ffmpeg")
    return imageio_ffmpeg.get_ffmpeg_exe()


def write_video(path, n_frames=20, fps=10.0, size=(64, 48), audio_hz: float | None = None, seed=0):
    """An mp4 whose frame k shows a white square at x = 2k (so frames are distinguishable)."""
    import imageio_ffmpeg

    w, h = size
    path = str(path)
    target = path if audio_hz is None else path + ".noaudio.mp4"
    gen = imageio_ffmpeg.write_frames(
        target,
        (w, h),
        fps=fps,
        codec="libx264",
        pix_fmt_out="yuv420p",
        macro_block_size=1,
        output_params=["-g", "4"],
        ffmpeg_log_level="error",
    )
    gen.send(None)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
    for k in range(n_frames):
        f = base.copy()
        x = (2 * k) % max(1, w - 8)
        f[h // 2 - 4 : h // 2 + 4, x : x + 8] = 255
        gen.send(np.ascontiguousarray(f))
    gen.close()
    if audio_hz is not None:
        wav = path + ".wav"
        write_tone(wav, seconds=n_frames / fps, hz=audio_hz, rate=22050)
        exe = imageio_ffmpeg.get_ffmpeg_exe()
        cmd = [
            exe,
            "-y",
            "-v",
            "error",
            "-i",
            target,
            "-i",
            wav,
            "-c:v",
            "copy",
            "-c:a",
            "aac",
            "-shortest",
            path,
        ]
        subprocess.run(cmd, check=True, capture_output=True)
    return path


def write_tone(path, seconds=1.0, hz=440.0, rate=16000, channels=1, fmt=None):
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * hz * t)
    data = np.stack([wave] * channels, axis=1) if channels > 1 else wave
    sf.write(str(path), data, rate, format=fmt)
    return str(path)


def write_image(path, size=(40, 30), mode="RGB", color=(200, 30, 30), fmt=None, exif_orientation=None):
    img = Image.new("RGB", size, color).convert(mode)
    kwargs = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif
    img.save(str(path), format=fmt, **kwargs)
    return str(path)


class ToyTokenizer:
    """Characters as ids (ord + 1000), special tokens ``<|...|>`` as small ids; HF-style API."""

    SPECIAL = re.compile(r"<\|[^|]+\|>")

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return self.vocab.setdefault(token, len(self.vocab) + 1)

    def encode(self, text, add_special_tokens=False):
        ids, pos = [], 0
        for m in self.SPECIAL.finditer(text):
            ids += [ord(c) + 1000 for c in text[pos : m.start()]]
            ids.append(self.convert_tokens_to_ids(m.group()))
            pos = m.end()
        return ids + [ord(c) + 1000 for c in text[pos:]]


class CrashingTokenizer(ToyTokenizer):
    """Kills its process when asked to encode "CRASH" (stands in for a decoder segfault in a worker)."""

    def encode(self, text, add_special_tokens=False):
        if "CRASH" in text:
            import os

            os._exit(1)
        return super().encode(text, add_special_tokens)


class UnstartableTokenizer(ToyTokenizer):
    """Kills the process that unpickles it: a pool worker dies while starting, before taking any sample."""

    def __setstate__(self, state):
        import os

        os._exit(1)
