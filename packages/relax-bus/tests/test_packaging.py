"""relax-bus[ray] from the wheel in a clean venv: the extra brings ray and RayBus works there. (The wheel alone,
without torch or ray, with the in-process bus and its loader: .ci/check_wheels.sh, before pytest.)"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _wheel_and_venv(tmp_path):
    """Build the relax-bus wheel and an empty venv; returns (uv, wheel, venv python)."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv not on PATH")
    subprocess.run(
        [uv, "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("relax_bus-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    return uv, wheel, venv / "bin" / "python"


RAY_SMOKE = """
import sys
import numpy as np
import ray
from relax_bus import BusConfig, ConsumerSpec, RayBus
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
bus = RayBus.create(BusConfig(consumers={"c": ConsumerSpec()}), num_storage_units=1)
ids = bus.put([{"x": np.arange(20000) + i, "r": float(i)} for i in range(4)])  # 640 KB: through a block
ids += bus.put([{"x": np.arange(3), "r": 9.0}])  # small: inline
b = bus.get("c", 5)
assert b.ids == ids and b.data["x"][3][0] == 3 and b.data["r"] == [0.0, 1.0, 2.0, 3.0, 9.0], b.data["r"]
bus.ack("c", b.lease_id)
assert bus.stats()["live"] == 0
bus.kill()
ray.shutdown()
assert "torch" not in sys.modules
print("ok")
"""


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_extra_in_clean_venv(tmp_path):
    """relax-bus[ray] from the wheel: the extra pulls in ray (from the uv cache when it can) and RayBus works."""
    uv, wheel, py = _wheel_and_venv(tmp_path)
    req = f"relax-bus[ray] @ {wheel.resolve().as_uri()}"
    install = [uv, "pip", "install", "-q", "--python", str(py), req]
    if subprocess.run([*install, "--offline"], capture_output=True).returncode != 0:
        subprocess.run(install, check=True, capture_output=True, timeout=240)  # not cached: from the index
    frozen = subprocess.run([uv, "pip", "freeze", "--python", str(py)], capture_output=True, text=True).stdout
    assert "ray==" in frozen and "torch" not in frozen
    venv = py.parent.parent
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(Path.home()),
        "VIRTUAL_ENV": str(venv),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    out = subprocess.run([str(py), "-c", RAY_SMOKE], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
