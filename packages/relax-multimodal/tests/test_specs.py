"""Sizing rules against qwen-vl-utils: 200 random image sizes, 50 random videos, plus the audio lengths.

qwen-vl-utils imports torch and torchvision at module import, so it is not a dev dependency. When it is
importable (``PYTHONPATH`` pointing at an unpacked wheel is enough: torchvision is stubbed here since
only its pure-python sizing functions are called) the test compares with it; otherwise with
``reference_*`` below, a transcription of the rules qwen-vl-utils 0.0.14 documents (``smart_resize``,
``smart_nframes``, ``calculate_video_frame_range``, ``torch.linspace(...).round()``).
"""

import importlib.util
import math
import random
import sys
import types

import numpy as np
import pytest

from relax_multimodal.specs import (
    MODELS,
    frame_range,
    linspace_indices,
    smart_nframes,
    smart_resize,
    whisper_frames,
)


def _qwen_vl_utils():
    if importlib.util.find_spec("qwen_vl_utils") is None:
        return None
    if importlib.util.find_spec("torch") is None:
        return None
    stubbed = {}
    if importlib.util.find_spec("torchvision") is None:  # stub it: the sizing functions never touch it
        tv = types.ModuleType("torchvision")
        tv.__version__ = "0.0"
        tv.io = types.ModuleType("torchvision.io")
        tv.transforms = types.ModuleType("torchvision.transforms")
        tv.transforms.InterpolationMode = types.SimpleNamespace(BICUBIC=3)
        stubbed = {"torchvision": tv, "torchvision.io": tv.io, "torchvision.transforms": tv.transforms}
        sys.modules.update(stubbed)
    try:
        from qwen_vl_utils import vision_process
    except Exception:
        return None
    finally:  # never leave the stub behind: transformers probes torchvision's spec
        for name in stubbed:
            sys.modules.pop(name, None)
    return vision_process


QVU = _qwen_vl_utils()


def reference_resize(h, w, factor, min_pixels, max_pixels):
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def reference_indices(total, vfps, fps, min_frames, max_frames, start, end):
    if start is None and end is None:
        first, last = 0, total - 1
    else:
        dur = total / vfps
        first = math.ceil(max(0.0, min(start, dur)) * vfps) if start is not None else 0
        last = min(math.floor(max(0.0, min(end, dur)) * vfps), total - 1) if end is not None else total - 1
    n_total = last - first + 1
    lo = math.ceil(min_frames / 2) * 2
    hi = math.floor((max_frames if max_frames is not None else min(768, n_total)) / 2) * 2
    n = math.floor(min(min(max(n_total / vfps * fps, lo), hi), n_total) / 2) * 2
    try:
        import torch

        return torch.linspace(first, last, n).round().long().tolist()
    except ImportError:  # float64 linspace: an exact .5 tie may round the other way than torch's float32
        return np.round(np.linspace(first, last, n)).astype(int).tolist()


def test_smart_resize_200_random_sizes():
    rng = random.Random(0)
    for _ in range(200):
        spec = MODELS[rng.choice(list(MODELS))]
        h, w = rng.randint(1, 5000), rng.randint(1, 5000)
        if max(h, w) / min(h, w) > 200:
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(h, w, spec.factor)
            continue
        f2 = spec.factor**2
        lo = rng.choice([4, 16, 64, 256]) * f2
        hi = rng.choice([256, 1280, 16384]) * f2
        got = smart_resize(h, w, spec.factor, lo, hi)
        want = (
            QVU.smart_resize(h, w, spec.factor, lo, hi)
            if QVU
            else reference_resize(h, w, spec.factor, lo, hi)
        )
        assert got == want, (h, w, spec.name)
        assert got[0] % spec.factor == 0 and got[1] % spec.factor == 0


def test_frame_indices_50_random_videos():
    rng = random.Random(1)
    torch = pytest.importorskip("torch") if QVU else None
    for _ in range(50):
        total = rng.randint(8, 3000)
        vfps = rng.choice([8.0, 23.976, 24.0, 25.0, 29.97, 30.0, 60.0])
        fps = rng.choice([0.5, 1.0, 2.0, 4.0])
        min_frames = rng.choice([2, 4, 8])
        max_frames = rng.choice([None, 16, 64, 768])
        clip = rng.random() < 0.5
        dur = total / vfps
        start = round(rng.uniform(0, dur / 2), 2) if clip else None
        end = round(rng.uniform(dur / 2 + 1 / vfps * 4, dur + 1), 2) if clip else None
        first, last = frame_range(total, vfps, start, end)
        n = smart_nframes(last - first + 1, vfps, fps=fps, min_frames=min_frames, max_frames=max_frames)
        got = linspace_indices(first, last, n)
        if QVU:
            ele = {"fps": fps, "min_frames": min_frames, "video_start": start, "video_end": end}
            if max_frames is not None:
                ele["max_frames"] = max_frames
            f2, l2, n_total = QVU.calculate_video_frame_range(ele, total, vfps)
            n2 = QVU.smart_nframes(ele, total_frames=n_total, video_fps=vfps)
            want = torch.linspace(f2, l2, n2).round().long().tolist()
        else:
            want = reference_indices(total, vfps, fps, min_frames, max_frames, start, end)
        assert got == want, (total, vfps, fps, min_frames, max_frames, start, end)
        assert len(got) % 2 == 0 and got == sorted(got) and first <= got[0] and got[-1] <= last


def test_linspace_matches_torch_on_ties():
    torch = pytest.importorskip("torch")
    rng = random.Random(2)
    cases = [(0, 5, 7), (0, 1, 3), (3, 8, 4), (0, 15, 7)] + [
        (a, a + rng.randint(1, 500), rng.randint(2, 200)) for a in (rng.randint(0, 100) for _ in range(300))
    ]
    for a, b, n in cases:
        assert linspace_indices(a, b, n) == torch.linspace(a, b, n).round().long().tolist(), (a, b, n)


def test_nframes_fixed_and_errors():
    assert smart_nframes(100, 25.0, nframes=7) == 8
    assert smart_nframes(300, 30.0) == 20
    assert smart_nframes(300, 30.0, fps=0.1) == 4  # min_frames wins
    assert smart_nframes(3000, 30.0, fps=30.0, max_frames=64) == 64
    with pytest.raises(ValueError, match="at least 2"):
        smart_nframes(1, 30.0)
    with pytest.raises(ValueError, match="either"):
        smart_nframes(10, 30.0, fps=1, nframes=4)
    with pytest.raises(ValueError, match="empty clip"):
        frame_range(100, 10.0, 5.0, 4.0)


def test_resize_bounds():
    assert smart_resize(28, 28, 28) == (56, 56)  # up to min 4 tokens
    h, w = smart_resize(10000, 10000, 28)
    assert h * w <= 16384 * 28 * 28
    with pytest.raises(ValueError, match="max_pixels must be"):
        smart_resize(100, 100, 28, min_pixels=1000, max_pixels=10)


def test_audio_token_lengths_match_transformers():
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    for frames in [1, 2, 3, 99, 100, 101, 250, 1000, 2999, 3000, 4567]:
        assert MODELS["qwen3_omni"].audio_tokens(frames) == int(
            _get_feat_extract_output_lengths(torch.tensor(frames))
        )
        after = (frames - 1) // 2 + 1
        assert MODELS["qwen2_5_omni"].audio_tokens(frames) == (after - 2) // 2 + 1
    assert whisper_frames(16000) == 100
    with pytest.raises(ValueError, match="takes no audio"):
        MODELS["qwen2_5_vl"].audio_tokens(100)
