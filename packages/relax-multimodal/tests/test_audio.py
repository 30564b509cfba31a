import base64
import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from mm_media import write_tone

from relax_multimodal import MediaError, audio_features, process_audio
from relax_multimodal.specs import MODELS


@pytest.mark.parametrize("fmt,rate,channels", [("WAV", 16000, 1), ("FLAC", 44100, 2), ("OGG", 22050, 1)])
def test_any_format_to_mono_16k(tmp_path, fmt, rate, channels):
    p = write_tone(tmp_path / f"t.{fmt.lower()}", seconds=1.0, rate=rate, channels=channels, fmt=fmt)
    a = process_audio(p)
    assert a.rate == 16000 and a.waveform.ndim == 1 and a.waveform.dtype == np.float32
    assert a.seconds == pytest.approx(1.0, abs=0.01)
    assert a.frames == len(a.waveform) // 160
    assert a.num_tokens == MODELS["qwen2_5_omni"].audio_tokens(a.frames)


def test_input_forms(tmp_path):
    p = write_tone(tmp_path / "t.wav", seconds=0.5)
    data = Path(p).read_bytes()
    wave, sr = sf.read(p, dtype="float32")
    forms = [
        p,
        data,
        "data:audio/wav;base64," + base64.b64encode(data).decode(),
        {"array": wave, "sampling_rate": sr},
        {"bytes": data},
        wave,
    ]
    ref = process_audio(forms[0])
    for f in forms:
        a = process_audio(f, "qwen3_omni")
        assert len(a.waveform) == len(ref.waveform)
        np.testing.assert_allclose(a.waveform, ref.waveform, atol=1e-6)


def test_max_duration(tmp_path):
    p = write_tone(tmp_path / "long.wav", seconds=3.0)
    a = process_audio(p, max_seconds=1.5)
    assert a.truncated and a.seconds == pytest.approx(1.5)
    with pytest.raises(MediaError, match="over max"):
        process_audio(p, max_seconds=1.5, truncate=False)


def test_bad_audio(tmp_path):
    with pytest.raises(MediaError, match="missing"):
        process_audio(str(tmp_path / "no.wav"))
    empty = tmp_path / "empty.wav"
    sf.write(str(empty), np.zeros(0), 16000)
    with pytest.raises(MediaError, match="empty") as e:
        process_audio(str(empty))
    assert "empty.wav" in str(e.value)
    zero = tmp_path / "zero.wav"
    zero.write_bytes(b"")
    with pytest.raises(MediaError, match="empty"):
        process_audio(str(zero))
    good = Path(write_tone(tmp_path / "g.wav", seconds=1.0)).read_bytes()
    trunc = tmp_path / "trunc.wav"
    trunc.write_bytes(good[:30])
    with pytest.raises(MediaError, match="corrupt|empty"):
        process_audio(str(trunc))
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF????WAVEfmt garbage" * 20)
    with pytest.raises(MediaError, match="corrupt"):
        process_audio(str(junk))
    with pytest.raises(MediaError, match="NaN"):
        process_audio(np.array([0.0, np.nan] * 200, dtype=np.float32))
    blip = tmp_path / "blip.wav"  # 11 ms: one mel frame, but too short for the feature extractor's padding
    sf.write(str(blip), np.full(180, 0.1), 16000)
    with pytest.raises(MediaError, match="more than 200.*short_audio") as e:
        process_audio(str(blip))
    assert "blip.wav" in str(e.value)
    with pytest.raises(MediaError, match="gives 0 audio tokens"):  # 12.6 ms: features, but no token
        process_audio(np.full(201, 0.1, dtype=np.float32))


def test_features_match_whisper_extractor(tmp_path):
    pytest.importorskip("transformers")
    items = [
        process_audio(write_tone(tmp_path / f"{s}.wav", seconds=s), "qwen3_omni") for s in (0.3, 1.0, 1.01)
    ]
    out = audio_features(items, "qwen3_omni")
    assert out["input_features"].shape[:2] == (3, 128)
    assert out["feature_attention_mask"].sum(1).tolist() == [a.frames for a in items]
    assert (
        out["input_features"].shape[2]
        == out["feature_attention_mask"].shape[1]
        == max(a.frames for a in items)
    )


def test_bytes_buffer_roundtrip():
    buf = io.BytesIO()
    sf.write(buf, np.zeros(8000, dtype=np.float32) + 0.1, 8000, format="WAV")
    a = process_audio(buf.getvalue())
    assert len(a.waveform) == 16000
