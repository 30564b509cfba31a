"""``import relax_multimodal`` stays light. (The wheel in a clean venv, without librosa or torch, processing an
image and an audio clip: .ci/check_wheels.sh, before pytest.)"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
HEAVY = ("torch", "transformers", "ray", "av", "librosa")
CHECK = f"""
import sys
import relax_multimodal
heavy = [m for m in {HEAVY!r} if m in sys.modules]
assert not heavy, heavy
print("ok")
"""


def test_import_leaves_heavy_modules_out():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
