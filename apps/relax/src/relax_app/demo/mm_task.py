"""The omni-modal demo's tasks: multiple-choice questions about tiny generated images, videos and sounds.

Why these three: each has an exact answer read off the generated media (no labelling noise), each
needs its own modality (colour from pixels, direction from frame order, pitch from the waveform), and
the media are tiny (a 48x48 PNG, eight 32x32 frames, 0.8 s of 16 kHz audio), so preprocessing costs
milliseconds and a random-weight Qwen-VL / Qwen-Omni model sees only a few dozen placeholder tokens.

Rows are JSONL like the text demo's, plus one media column per row holding an absolute path:
``{"prompt": "<image>\\nWhat colour ...", "label": "B", "image": "/.../media/image_00000.png",
"metadata": {"task": "image", "choices": {"A": "red", ...}, "rm_type": "multiple_choice", ...},
"id": "image-0"}``. The prompt marks the
media with ``<image>`` / ``<video>`` / ``<audio>`` and asks for ``Answer: <letter>``, which the
``multiple_choice`` reward (``relax_rewards.choice.multiple_choice_reward``) parses; ``metadata
["choices"]`` is the key that reward reads for its option-text fallback. Read the rows through
``relax_multimodal`` with ``multimodal_keys=MM_KEYS`` and the budget in ``MM_BUDGET`` (see
:func:`mm_config`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

TASKS = ("image", "video", "audio")
MM_KEYS = {"image": "image", "video": "video", "audio": "audio"}  # relax_multimodal's multimodal_keys
REWARD = "multiple_choice"  # relax_rewards registry name (alias "mcq")

# Budgets that keep placeholder counts small (qwen3_omni: patch 16, merge 2): a 48x48 image is sized
# to 64x64 -> 4 tokens; a video's 8 frames are all sampled (4 fps) and sized to 64x64 -> 4 temporal
# steps x 4 = 16 tokens; 0.8 s of audio -> 80 mel frames -> 10 tokens.
MM_BUDGET: dict[str, Any] = {
    "image_max_pixels": 64 * 64,
    "video_fps": 4.0,
    "video_min_pixels": 64 * 64,
    "video_max_pixels": 64 * 64,
    "audio_max_seconds": 2.0,
}

INSTRUCTION = 'Reply with the letter of the correct option, as "Answer: X".'

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 40)}
BACKGROUNDS = ((255, 255, 255), (128, 128, 128), (0, 0, 0))
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 48

VIDEO_SIZE = 32
VIDEO_FRAMES = 8
VIDEO_FPS = 4.0
DOT = 6  # side of the dot, pixels
DOT_STEP = 3  # pixels per frame

AUDIO_RATE = 16000
TONE_SECONDS = 0.4
TONE_NOTES = range(-9, 16)  # semitones from A4 (440 Hz): 262 Hz .. 1047 Hz
MIN_INTERVAL = 4  # semitones between the two tones

_TASK_SEED = {
    "image": 1,
    "video": 2,
    "audio": 3,
}  # per-task streams: a task's rows don't depend on the others


def answer_text(label: str) -> str:
    """The response the prompt asks for: ``"Answer: B"`` (what an SFT warm start would target)."""
    return f"Answer: {label}"


def _prompt(marker: str, question: str, choices: dict[str, str]) -> str:
    options = "\n".join(f"{k}) {v}" for k, v in choices.items())
    return f"{marker}\n{question}\n{options}\n{INSTRUCTION}"


def _letter(choices: dict[str, str], text: str) -> str:
    return next(k for k, v in choices.items() if v == text)


# --- image: the colour of a shape -------------------------------------------------------------------


def make_image_sample(rng: random.Random, path: Path) -> tuple[str, str, dict]:
    """Draw one coloured shape on a plain background; return (prompt, label, metadata)."""
    from PIL import Image, ImageDraw

    colour = rng.choice(list(COLOURS))
    shape = rng.choice(SHAPES)
    background = rng.choice(BACKGROUNDS)
    size = rng.randint(20, 32)
    x0 = rng.randint(2, IMAGE_SIZE - size - 2)
    y0 = rng.randint(2, IMAGE_SIZE - size - 2)
    box = (x0, y0, x0 + size - 1, y0 + size - 1)
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), background)
    draw = ImageDraw.Draw(img)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + size // 2, y0), (x0, y0 + size - 1), (x0 + size - 1, y0 + size - 1)], fill=fill)
    img.save(path, format="PNG")
    choices = dict(zip("ABCD", COLOURS))
    prompt = _prompt("<image>", "What colour is the shape?", choices)
    meta = {"task": "image", "choices": choices, "colour": colour, "shape": shape}
    return prompt, _letter(choices, colour), meta


# --- video: which way a dot moves -------------------------------------------------------------------


def dot_frames(direction: str, x_start: int, y: int) -> np.ndarray:
    """``VIDEO_FRAMES`` frames (uint8, HxWx3) of a white dot moving ``DOT_STEP`` px/frame on black."""
    step = DOT_STEP if direction == "right" else -DOT_STEP
    frames = np.zeros((VIDEO_FRAMES, VIDEO_SIZE, VIDEO_SIZE, 3), np.uint8)
    for k in range(VIDEO_FRAMES):
        x = x_start + k * step
        frames[k, y : y + DOT, x : x + DOT] = 255
    return frames


def write_mp4(path: Path, frames: np.ndarray, fps: float = VIDEO_FPS) -> None:
    """H.264 mp4 (yuv420p) through the ffmpeg binary in the ``imageio-ffmpeg`` wheel, one encoder thread."""
    from relax_multimodal.testing import write_mp4

    write_mp4(path, frames, fps, output_params=["-threads", "1"])


def make_video_sample(rng: random.Random, path: Path) -> tuple[str, str, dict]:
    """Write a dot moving left or right; return (prompt, label, metadata)."""
    direction = rng.choice(("left", "right"))
    travel = (VIDEO_FRAMES - 1) * DOT_STEP
    margin = VIDEO_SIZE - DOT - travel  # room left over for the start position
    offset = rng.randint(0, margin)
    x_start = offset if direction == "right" else offset + travel
    y = rng.randint(2, VIDEO_SIZE - DOT - 2)
    write_mp4(path, dot_frames(direction, x_start, y))
    choices = {"A": "left", "B": "right"}
    prompt = _prompt("<video>", "Which way does the dot move?", choices)
    meta = {"task": "video", "choices": choices, "direction": direction}
    return prompt, _letter(choices, direction), meta


# --- audio: which of two tones is higher --------------------------------------------------------------


def two_tones(hz1: float, hz2: float, seconds: float = TONE_SECONDS, rate: int = AUDIO_RATE) -> np.ndarray:
    """Two sine tones back to back (float32, mono), each with 10 ms fades so the joins don't click."""
    n = int(seconds * rate)
    t = np.arange(n) / rate
    ramp = np.minimum(1.0, np.minimum(np.arange(n), np.arange(n)[::-1]) / (0.01 * rate))
    tones = [0.3 * np.sin(2 * np.pi * hz * t) * ramp for hz in (hz1, hz2)]
    return np.concatenate(tones).astype(np.float32)


def make_audio_sample(rng: random.Random, path: Path) -> tuple[str, str, dict]:
    """Write two tones a few semitones apart; return (prompt, label, metadata)."""
    import soundfile as sf

    while True:
        n1, n2 = rng.choice(TONE_NOTES), rng.choice(TONE_NOTES)
        if abs(n1 - n2) >= MIN_INTERVAL:
            break
    hz1, hz2 = (round(440.0 * 2 ** (n / 12), 2) for n in (n1, n2))
    sf.write(str(path), two_tones(hz1, hz2), AUDIO_RATE, subtype="PCM_16", format="WAV")
    choices = {"A": "the first", "B": "the second"}
    prompt = _prompt("<audio>", "Which tone is higher?", choices)
    meta = {"task": "audio", "choices": choices, "hz": [hz1, hz2]}
    return prompt, "A" if hz1 > hz2 else "B", meta


GENERATORS: dict[str, tuple[Callable[[random.Random, Path], tuple[str, str, dict]], str]] = {
    "image": (make_image_sample, "png"),
    "video": (make_video_sample, "mp4"),
    "audio": (make_audio_sample, "wav"),
}


def write_mm_dataset(
    out_dir: str | Path, n_per_task: int, seed: int = 0, tasks: Iterable[str] = TASKS
) -> Path:
    """Write ``n_per_task`` samples of each task: media under ``out_dir/media/``, rows to
    ``out_dir/mm.jsonl`` (returned). Rows interleave the tasks (image, video, audio, image, ...) so
    any batch mixes modalities; media columns hold absolute paths. Deterministic given ``seed``."""
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in GENERATORS]
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS} (got {tasks})")
    if n_per_task < 1:
        raise ValueError(f"n_per_task must be >= 1 (got {n_per_task})")
    out = Path(out_dir).resolve()
    media = out / "media"
    media.mkdir(parents=True, exist_ok=True)
    rngs = {t: random.Random(seed * 1000 + _TASK_SEED[t]) for t in tasks}
    path = out / "mm.jsonl"
    with path.open("w") as f:
        for i in range(n_per_task):
            for task in tasks:
                make, ext = GENERATORS[task]
                file = media / f"{task}_{i:05d}.{ext}"
                prompt, label, meta = make(rngs[task], file)
                meta["rm_type"] = REWARD  # relax_rewards.resolve_reward_type picks the reward from it
                row = {"prompt": prompt, "label": label, MM_KEYS[task]: str(file), "metadata": meta}
                row["id"] = f"{task}-{i}"
                f.write(json.dumps(row) + "\n")
    return path


def mm_config(model: str = "qwen3_omni", **overrides: Any):
    """``relax_multimodal.MultimodalConfig`` for these rows: ``MM_KEYS`` and the small ``MM_BUDGET``."""
    from relax_multimodal import MultimodalConfig

    return MultimodalConfig(model=model, multimodal_keys=dict(MM_KEYS), **{**MM_BUDGET, **overrides})
