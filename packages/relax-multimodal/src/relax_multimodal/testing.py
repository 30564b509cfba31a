"""Synthetic media for tests and demos, written to files: PIL images, WAV tones (soundfile) and H.264 mp4s
(through the ffmpeg binary in the ``imageio-ffmpeg`` wheel, which only the mp4 writers need).

Everything is imported inside the functions, so ``import relax_multimodal`` stays light.
"""

from __future__ import annotations


def write_mp4(path, frames, fps: float, output_params=("-g", "4")) -> None:
    """``frames`` (uint8 [n, h, w, 3]) as an H.264 mp4 (yuv420p) at ``fps``; ``output_params`` go to ffmpeg."""
    import numpy as np

    try:
        import imageio_ffmpeg
    except ImportError as e:  # pragma: no cover - a dev dependency of the workspace
        raise ImportError("writing mp4 needs imageio-ffmpeg: pip install imageio-ffmpeg") from e
    h, w = frames.shape[1:3]
    gen = imageio_ffmpeg.write_frames(
        str(path),
        (w, h),
        fps=fps,
        codec="libx264",
        pix_fmt_out="yuv420p",
        macro_block_size=1,
        output_params=list(output_params),
        ffmpeg_log_level="error",
    )
    gen.send(None)
    for f in frames:
        gen.send(np.ascontiguousarray(f))
    gen.close()


def write_video(path, n_frames=20, fps=10.0, size=(64, 48), audio_hz: float | None = None, seed=0) -> str:
    """An mp4 whose frame k shows a white square at x = 2k (so frames are distinguishable) on a random
    background; with ``audio_hz``, a tone of that pitch muxed in as AAC. Returns the path."""
    import subprocess

    import imageio_ffmpeg
    import numpy as np

    w, h = size
    path = str(path)
    target = path if audio_hz is None else path + ".noaudio.mp4"
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
    frames = np.repeat(base[None], n_frames, axis=0)
    for k, f in enumerate(frames):
        x = (2 * k) % max(1, w - 8)
        f[h // 2 - 4 : h // 2 + 4, x : x + 8] = 255
    write_mp4(target, frames, fps)
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


def write_tone(path, seconds=1.0, hz=440.0, rate=16000, channels=1, fmt=None) -> str:
    """A sine tone of ``hz`` (amplitude 0.3) as a sound file (``fmt``, or from the suffix); returns the path."""
    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * hz * t)
    data = np.stack([wave] * channels, axis=1) if channels > 1 else wave
    sf.write(str(path), data, rate, format=fmt)
    return str(path)


def write_image(path, size=(40, 30), mode="RGB", color=(200, 30, 30), fmt=None, exif_orientation=None) -> str:
    """A one-colour image (``fmt``, or from the suffix), optionally with an EXIF orientation; returns the path."""
    from PIL import Image

    img = Image.new("RGB", size, color).convert(mode)
    kwargs = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif
    img.save(str(path), format=fmt, **kwargs)
    return str(path)
