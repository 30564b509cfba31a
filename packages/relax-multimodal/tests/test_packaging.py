"""``import relax_multimodal`` stays light; the wheel installs and works in a clean venv."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
HEAVY = ("torch", "transformers", "ray", "av", "librosa")
CHECK = f"""
import sys
import relax_multimodal
heavy = [m for m in {HEAVY!r} if m in sys.modules]
assert not heavy, heavy
print("ok")
"""
SMOKE = """
import io, sys
from PIL import Image
import numpy as np, soundfile as sf
from relax_multimodal import MultimodalConfig, MultimodalProcessor
buf = io.BytesIO(); Image.new("RGB", (64, 48), "red").save(buf, format="PNG")
wav = io.BytesIO()  # 22.05 kHz: resampled to the model's 16 kHz (soxr, no librosa)
sf.write(wav, np.sin(np.arange(22050, dtype=np.float32) / 10), 22050, format="WAV")
cfg = MultimodalConfig(model="qwen2_5_omni", multimodal_keys={"image": "i", "audio": "a"})
s = MultimodalProcessor(cfg).process({"prompt": "<image><audio>", "i": buf.getvalue(), "a": wav.getvalue()})
assert s.text.count("<|IMAGE|>") == s.images[0].num_tokens > 0
assert s.text.count("<|AUDIO|>") == s.audios[0].num_tokens > 0
assert s.audios[0].rate == 16000 and s.audios[0].waveform.shape == (16000,)
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("ok")
"""


def test_import_leaves_heavy_modules_out():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_in_clean_venv(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv not on PATH")
    subprocess.run(
        [uv, "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("relax_multimodal-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([uv, "pip", "install", "-q", "--python", str(py), str(wheel)], check=True)
    out = subprocess.run([str(py), "-c", SMOKE], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    frozen = subprocess.run([uv, "pip", "freeze", "--python", str(py)], capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in frozen.splitlines()}
    assert not names & {"torch", "transformers", "ray", "librosa"}, names
