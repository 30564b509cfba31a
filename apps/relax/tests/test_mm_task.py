"""The omni-modal demo's tasks: deterministic rows, media that decode and agree with their labels,
rows that go through ``relax_multimodal`` with few placeholder tokens, and the MC reward on them."""

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from relax_app.demo.mm_task import (
    AUDIO_RATE,
    COLOURS,
    MM_BUDGET,
    MM_KEYS,
    REWARD,
    answer_text,
    mm_config,
    write_mm_dataset,
)
from relax_app.demo.task import read_jsonl
from relax_app.demo.tokenizer import train_tokenizer

pytest.importorskip("imageio_ffmpeg", reason="the video task writes mp4 with imageio-ffmpeg")
av = pytest.importorskip("av")

N = 4
MAX_TOKENS = {"image": 64, "video": 64, "audio": 40}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return read_jsonl(write_mm_dataset(tmp_path_factory.mktemp("mm"), n_per_task=N, seed=0))


@pytest.fixture(scope="module")
def tokenizer(rows):
    from relax_multimodal.specs import MODELS

    tok = train_tokenizer([r["prompt"] + answer_text(r["label"]) for r in rows])
    s = MODELS["qwen3_omni"]
    specials = [s.image_token, s.video_token, s.audio_token, s.vision_start, s.vision_end]
    tok.add_special_tokens({"additional_special_tokens": [*specials, s.audio_start, s.audio_end]})
    return tok


def _task(row):
    return row["metadata"]["task"]


def test_rows_interleave_tasks_and_name_their_media(rows):
    assert [_task(r) for r in rows] == ["image", "video", "audio"] * N
    for r in rows:
        task = _task(r)
        marker = f"<{task}>"
        assert r["prompt"].count(marker) == 1 and "Answer: X" in r["prompt"]
        assert r[MM_KEYS[task]].startswith("/") and r["label"] in r["metadata"]["choices"]
        assert r["metadata"]["rm_type"] == REWARD
        assert not ({"image", "video", "audio"} - {task}) & set(r)  # one media column per row


def test_deterministic_for_a_seed(tmp_path):
    a = write_mm_dataset(tmp_path / "a", n_per_task=2, seed=3)
    b = write_mm_dataset(tmp_path / "b", n_per_task=2, seed=3)
    c = write_mm_dataset(tmp_path / "c", n_per_task=2, seed=4)

    def rel(path):
        rows = read_jsonl(path)
        for r in rows:
            col = MM_KEYS[_task(r)]
            r[col] = r[col].replace(str(path.parent), "")
        return rows

    assert rel(a) == rel(b) != rel(c)
    for r_a, r_b in zip(read_jsonl(a), read_jsonl(b), strict=True):
        col = MM_KEYS[_task(r_a)]
        assert open(r_a[col], "rb").read() == open(r_b[col], "rb").read()
    only_image = read_jsonl(write_mm_dataset(tmp_path / "d", n_per_task=2, seed=3, tasks=("image",)))
    assert [r["label"] for r in only_image] == [r["label"] for r in rel(a) if _task(r) == "image"]


def _image_answer(path):
    px = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    counts = {name: int((px == rgb).all(1).sum()) for name, rgb in COLOURS.items()}
    return max(counts, key=counts.get)


def _dot_x(frame):
    xs = np.nonzero(frame.mean(-1) > 128)[1]
    return xs.mean()


def _video_answer(path):
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 8 and frames[0].shape == (32, 32, 3)
    first, last = _dot_x(frames[0]), _dot_x(frames[-1])
    return "right" if last > first else "left"


def _peak_hz(x):
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return np.fft.rfftfreq(len(x), 1 / AUDIO_RATE)[spectrum.argmax()]


def _audio_answer(path):
    wave, rate = sf.read(path)
    assert rate == AUDIO_RATE and wave.ndim == 1
    half = len(wave) // 2
    return "the first" if _peak_hz(wave[:half]) > _peak_hz(wave[half:]) else "the second"


def test_media_decode_and_labels_match_content(rows):
    read = {"image": _image_answer, "video": _video_answer, "audio": _audio_answer}
    seen = {t: set() for t in read}
    for r in rows:
        task = _task(r)
        answer = read[task](r[MM_KEYS[task]])
        assert r["metadata"]["choices"][r["label"]] == answer, r
        seen[task].add(r["label"])
    assert all(len(labels) >= 2 for labels in seen.values()), seen  # labels vary


def test_rows_process_with_few_placeholder_tokens(rows, tokenizer):
    from relax_multimodal import MultimodalProcessor

    cfg = mm_config("qwen3_omni")
    assert cfg.multimodal_keys == MM_KEYS and cfg.image_max_pixels == MM_BUDGET["image_max_pixels"]
    proc = MultimodalProcessor(cfg, tokenizer)
    counts = {}
    for i, r in enumerate(rows):
        s = proc.process(r, i)
        task = _task(r)
        n = s.num_tokens()
        assert n[task] > 0 and sum(n.values()) == n[task]
        assert n[task] <= MAX_TOKENS[task], (task, n)
        assert sum(t != 0 for t in s.mm_token_type_ids) == n[task]
        counts.setdefault(task, set()).add(n[task])
        if i < 3:  # one of each: the model tensors build
            assert s.tensors()
    assert counts == {"image": {4}, "video": {16}, "audio": {10}}


@pytest.mark.parametrize("task", ["image", "video", "audio"])
def test_mc_reward_scores_the_instructed_format(rows, task):
    from relax_rewards import get_reward

    reward = get_reward(REWARD)
    for r in (r for r in rows if _task(r) == task):
        meta, label = r["metadata"], r["label"]
        wrong = next(k for k in meta["choices"] if k != label)
        assert reward(answer_text(label), label, meta).score == 1.0
        assert reward(f"Let me look.\n{answer_text(label)}", label, meta).score == 1.0
        assert reward(label, label, meta).score == 1.0  # a bare letter is read too
        assert reward(answer_text(wrong), label, meta).score == 0.0
