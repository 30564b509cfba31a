from pathlib import Path

import numpy as np
import pytest
from mm_media import ffmpeg_or_skip, write_tone, write_video

from relax_multimodal import MediaError, process_video, sample_indices
from relax_multimodal.specs import MODELS


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    ffmpeg_or_skip()
    return write_video(tmp_path_factory.mktemp("v") / "clip.mp4", n_frames=40, fps=10.0, size=(64, 48))


def test_sampling_at_target_fps(video):
    v = process_video(video, "qwen2_5_vl", fps=2.0)
    assert v.video_fps == pytest.approx(10.0)
    assert len(v.indices) == 8  # 4 s at 2 fps
    assert v.indices == sample_indices(40, 10.0, fps=2.0)
    assert v.timestamps == pytest.approx([i / 10.0 for i in v.indices])
    assert v.frames.shape[0] == 8 and v.frames.dtype == np.uint8
    h, w = v.frames.shape[1:3]
    assert h % 28 == 0 and w % 28 == 0
    assert v.grid_thw == (4, h // 14, w // 14)
    assert v.num_tokens == 4 * (h // 14) * (w // 14) // 4
    assert v.sample_fps == pytest.approx(2.0)
    assert v.second_per_grid_t == pytest.approx(1.0)


def test_min_max_frames_nframes_and_clip(video):
    assert len(process_video(video, fps=0.1).indices) == 4  # min_frames
    assert len(process_video(video, fps=10.0, max_frames=6).indices) == 6
    assert len(process_video(video, nframes=7).indices) == 8  # rounded to the frame factor
    assert len(process_video(video, nframes=5).indices) == 4  # round half to even, as qwen-vl-utils
    clip = process_video(video, fps=2.0, video_start=1.0, video_end=3.0)
    assert clip.indices[0] >= 10 and clip.indices[-1] <= 30
    assert clip.timestamps[0] >= 1.0 and clip.timestamps[-1] <= 3.0
    with pytest.raises(MediaError, match="too_short"):
        process_video(video, video_start=3.0, video_end=1.0)


def test_pixel_budgets(video):
    spec = MODELS["qwen2_5_vl"]
    small = process_video(video, fps=2.0, min_pixels=4 * 28 * 28, max_pixels=4 * 28 * 28)
    assert small.frames.shape[1] * small.frames.shape[2] <= 4 * 28 * 28
    total = process_video(video, fps=2.0, min_pixels=28 * 28, total_pixels=8 * 28 * 28 * 2)
    # the total budget spread over 8 frames, times the frame factor 2: ≤ 4 merged patches per frame
    assert total.frames.shape[1] * total.frames.shape[2] <= 8 * 28 * 28 * 2 / 8 * 2
    q3 = process_video(video, "qwen3_vl", fps=2.0)
    assert q3.frames.shape[1] % 32 == 0 and q3.grid_thw[1] == q3.frames.shape[1] // 16
    assert spec.factor == 28


def test_bytes_input_and_grid_timestamps(video):
    v = process_video(Path(video).read_bytes(), fps=2.0)
    assert len(v.indices) == 8
    assert v.grid_timestamps() == pytest.approx(
        [(a + b) / 2 for a, b in zip(v.timestamps[::2], v.timestamps[1::2])]
    )


def test_use_audio_in_video(tmp_path):
    ffmpeg_or_skip()
    p = write_video(tmp_path / "av.mp4", n_frames=20, fps=10.0, audio_hz=440.0)
    v = process_video(p, "qwen2_5_omni", fps=2.0, use_audio_in_video=True)
    assert v.audio is not None and v.audio.rate == 16000
    assert v.audio.seconds == pytest.approx(2.0, abs=0.1)
    assert v.audio.num_tokens == MODELS["qwen2_5_omni"].audio_tokens(v.audio.frames)
    silent = write_video(tmp_path / "silent.mp4", n_frames=20)
    with pytest.raises(MediaError, match="empty"):
        process_video(silent, "qwen2_5_omni", use_audio_in_video=True)


def test_bad_videos(tmp_path, video):
    with pytest.raises(MediaError, match="missing"):
        process_video(str(tmp_path / "none.mp4"))
    data = Path(video).read_bytes()
    trunc = tmp_path / "trunc.mp4"
    trunc.write_bytes(data[: len(data) // 3])
    with pytest.raises(MediaError, match="no_frames") as e:
        process_video(str(trunc))
    assert "trunc.mp4" in str(e.value)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 500)
    with pytest.raises(MediaError, match="no_frames"):
        process_video(str(junk))
    audio_only = write_tone(tmp_path / "tone.wav", seconds=0.5)
    with pytest.raises(MediaError, match="no_frames"):
        process_video(audio_only)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(MediaError, match="empty"):
        process_video(str(empty))
    one = write_video(tmp_path / "one.mp4", n_frames=1)
    with pytest.raises(MediaError, match="too_short"):
        process_video(one)


def test_audio_track_without_ffmpeg_says_what_to_install(tmp_path, monkeypatch):
    ffmpeg_or_skip()
    p = write_video(tmp_path / "av.mp4", n_frames=20, fps=10.0, audio_hz=440.0)
    monkeypatch.setattr("relax_multimodal.audio.ffmpeg_exe", lambda: None)
    with pytest.raises(MediaError, match=r"no_decoder.*pip install imageio-ffmpeg"):
        process_video(p, "qwen2_5_omni", use_audio_in_video=True)


def test_widths_decord_could_not_decode_read_right(tmp_path):
    """A 48-px-wide mp4 (decord returned its frames with a wrong stride; decord2 fails at 32 and 96 px
    too) decodes to real frames in which the bright square moves right (frame k has it at x = 2k)."""
    ffmpeg_or_skip()
    odd = process_video(
        write_video(tmp_path / "w48.mp4", n_frames=12, fps=6.0, size=(48, 32)),
        fps=6.0,
        min_pixels=48 * 32,
        max_pixels=56 * 56,
    )
    assert odd.frames.shape[0] == len(odd.indices) >= 4 and odd.frames.shape[-1] == 3
    assert odd.frames.mean() > 5  # real pixels, not zeros
    cols = np.arange(odd.frames.shape[2])
    centre = [float((f.mean(axis=(0, 2)) * cols).sum() / f.mean(axis=(0, 2)).sum()) for f in odd.frames]
    assert centre[-1] > centre[0] + 1  # the bright square moves right over the clip


def _frames(n: int, size=(64, 48)) -> np.ndarray:
    """``n`` frames whose frame k has a white column band at x = 2k (as ``write_video``'s square moves)."""
    w, h = size
    out = np.zeros((n, h, w, 3), dtype=np.uint8)
    for k in range(n):
        out[k, :, 2 * k : 2 * k + 8] = 255
    return out


def test_a_container_without_a_frame_count_is_counted(tmp_path):
    """Matroska stores no frame count (PyAV says 0): the frames are counted from the packets, and the
    sampling is the same as for the mp4 of the same frames."""
    ffmpeg_or_skip()
    from relax_multimodal.testing import write_mp4

    frames = _frames(20)
    write_mp4(tmp_path / "clip.mkv", frames, 10.0)
    write_mp4(tmp_path / "clip.mp4", frames, 10.0)
    mkv, mp4 = (
        process_video(str(tmp_path / "clip.mkv"), fps=2.0),
        process_video(str(tmp_path / "clip.mp4"), fps=2.0),
    )
    assert mkv.indices == mp4.indices == sample_indices(20, 10.0, fps=2.0)
    assert np.abs(mkv.frames.astype(int) - mp4.frames.astype(int)).max() <= 1


def test_a_truncated_file_whose_index_survives_is_no_frames_never_padded(tmp_path):
    """An mp4 written for streaming (its index first) and cut short opens and names 30 frames, but
    decodes far fewer: an error naming how many decode, not the last frame repeated to fill the clip."""
    ffmpeg_or_skip()
    from relax_multimodal.testing import write_mp4

    path = tmp_path / "cut.mp4"
    write_mp4(path, _frames(30), 10.0, output_params=["-g", "4", "-movflags", "+faststart"])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 9 // 10])
    with pytest.raises(MediaError, match=r"only \d+ of 30 frames decode.*\[no_frames\]") as e:
        process_video(str(path), fps=2.0)
    assert "cut.mp4" in str(e.value)
