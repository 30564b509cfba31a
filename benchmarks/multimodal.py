"""Preprocessing throughput: relax-multimodal vs qwen-vl-utils on the same generated files.

    uv run --frozen python benchmarks/multimodal.py                  # 64 images, 8 videos, 8 audio clips
    uv run --frozen python benchmarks/multimodal.py --images 200 --videos 20

Measures, in one process, one run, side by side:
  1. images/s: decode + orient + RGB + smart-resize (``process_image`` vs ``qwen_vl_utils.fetch_image``),
  2. video frames/s: decode (PyAV) + sample at 2 fps + resize (``process_video`` vs ``fetch_video``),
  3. audio seconds/s: decode + mono + resample to 16 kHz (``process_audio``), no reference.
qwen-vl-utils imports torch and torchvision; when it is not importable its column says why. Files are
generated in a temp dir from a fixed seed (JPEG photos-like noise of mixed sizes, mp4 via imageio-ffmpeg,
44.1 kHz stereo FLAC).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time

import numpy as np
from PIL import Image


def make_files(d: str, n_img: int, n_vid: int, n_aud: int, seed: int = 0):
    import soundfile as sf

    rng = np.random.default_rng(seed)
    imgs, vids, auds = [], [], []
    for i in range(n_img):
        w, h = int(rng.integers(200, 2000)), int(rng.integers(200, 1500))
        small = rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        p = os.path.join(d, f"img{i}.jpg")
        Image.fromarray(small).resize((w, h)).save(p, quality=90)
        imgs.append(p)
    if n_vid:
        import imageio_ffmpeg

        for i in range(n_vid):
            p = os.path.join(d, f"vid{i}.mp4")
            gen = imageio_ffmpeg.write_frames(
                p, (640, 360), fps=30, macro_block_size=1, ffmpeg_log_level="error"
            )
            gen.send(None)
            base = rng.integers(0, 255, (45, 80, 3), dtype=np.uint8)
            for k in range(150):  # 5 s
                gen.send(
                    np.ascontiguousarray(np.roll(np.kron(base, np.ones((8, 8, 1), np.uint8)), 4 * k, axis=1))
                )
            gen.close()
            vids.append(p)
    for i in range(n_aud):
        p = os.path.join(d, f"aud{i}.flac")
        t = np.arange(44100 * 10) / 44100
        sf.write(p, np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], 1) * 0.3, 44100)
        auds.append(p)
    return imgs, vids, auds


def timed(fn, items):
    t = time.perf_counter()
    outs = [fn(x) for x in items]
    return time.perf_counter() - t, outs


def fmt(vals: list[float]) -> str:
    vals = sorted(vals)
    return f"{vals[len(vals) // 2]:.1f} ({vals[0]:.1f}-{vals[-1]:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--audio", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the table shows median (min-max)")
    args = ap.parse_args()

    from relax_multimodal import process_audio, process_image, process_video

    try:
        from qwen_vl_utils import fetch_image, fetch_video

        qvu_err = None
    except Exception as e:  # torch / torchvision missing
        fetch_image = fetch_video = None
        qvu_err = f"{type(e).__name__}: {e}"

    load = lambda: os.getloadavg()  # noqa: E731
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"# load before: {load()}")
    rates: dict[str, list[float]] = {}
    notes: list[str] = []

    def add(key: str, value: float) -> None:
        rates.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory() as d:
        imgs, vids, auds = make_files(d, args.images, args.videos, args.audio)
        for _ in range(args.reps):
            dt, outs = timed(lambda p: process_image(p, "qwen2_5_vl"), imgs)
            add("img", len(imgs) / dt)
            if fetch_image:
                dt2, outs2 = timed(lambda p: fetch_image({"image": p}), imgs)
                add("img_ref", len(imgs) / dt2)
                same = sum(o.array.shape[1::-1] == r.size for o, r in zip(outs, outs2))
                notes.append(f"images of the same size: {same}/{len(imgs)}")
            if vids:
                dt, outs = timed(lambda p: process_video(p, "qwen2_5_vl", fps=2.0), vids)
                add("vid", sum(len(v.indices) for v in outs) / dt)
                if fetch_video:
                    dt2, outs2 = timed(lambda p: fetch_video({"video": p, "fps": 2.0}), vids)
                    add("vid_ref", sum(int(v.shape[0]) for v in outs2) / dt2)
            dt, outs = timed(lambda p: process_audio(p, "qwen2_5_omni"), auds)
            add("aud", sum(a.seconds for a in outs) / dt)
    print(f"# load after: {load()}")
    print(f"# {args.reps} repetitions: median (min-max); {sorted(set(notes))}")
    print("\n| metric | relax-multimodal | qwen-vl-utils | ratio |\n|---|---:|---:|---:|")
    for name, key in (("images/s (decode+resize)", "img"), ("video frames/s (decode+sample+resize)", "vid")):
        if key not in rates:
            continue
        ref = rates.get(key + "_ref")
        ratio = (
            f"{sorted(rates[key])[len(rates[key]) // 2] / sorted(ref)[len(ref) // 2]:.2f}x" if ref else "-"
        )
        print(f"| {name} | {fmt(rates[key])} | {fmt(ref) if ref else 'n/a'} | {ratio} |")
    print(f"| audio seconds/s (decode+mono+16 kHz) | {fmt(rates['aud'])} | - | - |")
    if qvu_err:
        print(f"\nqwen-vl-utils not importable ({qvu_err}); `uv pip install qwen-vl-utils torchvision`")
    subprocess.run(["uptime"], check=False)


if __name__ == "__main__":
    main()
