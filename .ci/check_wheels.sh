#!/usr/bin/env bash
# Install each standalone package from its built wheel into its own clean venv and use it there: every module
# of the wheel imports, and torch and ray must not be imported (DESIGN.md §5), nor installed where the package
# leaves them optional:
# - relax-bus: the in-process bus and its StreamingDataLoader work without torch or ray, RayBus names its extra;
# - relax-core: installs without ray (an extra); with its `tensorboard` extra the TensorBoard sink writes
#   event files that TensorBoard reads back, without torch;
# - relax-rewards: a math reward scores, in this process and in a worker process;
# - relax-multimodal: installs without librosa, resamples audio (soxr), and its processor turns an image and
#   an audio clip into a Qwen-Omni prompt's placeholders.
# (The packages' own tests no longer build these wheels a second time.)
# Then installs relax-bus and relax-core the way their READMEs say, from the repository's paths.
# Usage: .ci/check_wheels.sh DIST (a folder holding the four wheels: uv build --package X --wheel).
set -euo pipefail
dist=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

check() {  # check VENV MODULE [STAGE]: the Python checks below, run in VENV
  "$1/bin/python" - "$2" "${3:-}" <<'PY'
import importlib, importlib.util, pkgutil, sys, tempfile
mod, stage = sys.argv[1], sys.argv[2]
m = importlib.import_module(mod)
modules = [mod] + [i.name for i in pkgutil.walk_packages(m.__path__, mod + ".")]
for name in modules:  # every module of the wheel, not only its top package (#52)
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise AssertionError(f"{name} does not import where {mod}'s wheel alone is installed: {e}") from e
heavy = [name for name in ("torch", "ray", "transformers", "librosa") if name in sys.modules]
assert not heavy, f"importing {mod}'s {len(modules)} modules pulled in {heavy}"
if mod == "relax_bus":
    import numpy as np
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec(required_fields=["x"])}, capacity=8))
    ids = bus.put([{"x": np.arange(3)}, {"x": np.arange(2)}])
    batch = bus.get("c", n=2, timeout=1)
    bus.ack("c", batch.lease_id)
    assert batch.ids == ids and "torch" not in sys.modules
    from relax_bus import RayBus, StreamingDataLoader
    bus.put([{"x": np.arange(3)}])
    (mb,) = StreamingDataLoader(bus, "c", 1, total=1)
    assert mb["x"].tolist() == [[0, 1, 2]], mb
    if importlib.util.find_spec("ray") is None:  # (the wheel alone: RayBus names its extra)
        try:
            RayBus.create(BusConfig(consumers={"c": ConsumerSpec()}))
            raise AssertionError("RayBus.create() without ray did not raise")
        except ImportError as e:
            assert "pip install 'relax-bus[ray]'" in str(e), e
    assert "torch" not in sys.modules and "ray" not in sys.modules
if mod == "relax_core":
    assert importlib.util.find_spec("ray") is None, "relax-core installed ray (it is the [ray] extra)"
    assert importlib.util.find_spec("torch") is None, "relax-core installed torch"
    from relax_core.optional import import_ray
    try:
        import_ray("--fully-async")
        raise AssertionError("import_ray() without ray did not raise")
    except ImportError as e:
        assert 'pip install "relax-core[ray]"' in str(e), e
    if stage == "tensorboard":
        from pathlib import Path
        from relax_core.config import RelaxConfig
        from relax_core.metrics import MetricsService
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        out = Path(tempfile.mkdtemp())
        cfg = RelaxConfig.model_validate({"run": {"output_dir": str(out), "tensorboard": True}})
        with MetricsService.from_config(cfg, out) as service:
            for step in range(3):
                service.log({"step": step, "train/loss": 1.0 / (step + 1)}, step)
        acc = EventAccumulator(str(out / "tensorboard"))
        acc.Reload()
        got = {e.step: e.value for e in acc.Scalars("train/loss")}
        assert sorted(got) == [0, 1, 2] and all(abs(v - 1 / (k + 1)) < 1e-6 for k, v in got.items()), got
        assert not any(name in sys.modules for name in ("torch", "tensorflow")), "the sink imported torch / TF"
        print("ok: relax_core's TensorBoard sink wrote", [p.name for p in (out / "tensorboard").iterdir()])
if mod == "relax_rewards":
    from relax_rewards import get_reward
    assert get_reward("math")("so the answer is \\boxed{42}", "42").score == 1.0
    from relax_rewards import Scorer, list_rewards
    scorer = Scorer("math", isolation="process", max_concurrency=1)  # (a worker process, symbolic equality)
    assert scorer.score(r"\boxed{2\sqrt2}", r"\sqrt8").score == 1.0 and len(list_rewards()) > 5
    scorer.close()
if mod == "relax_multimodal":
    import io
    import numpy as np
    import soundfile as sf
    from relax_multimodal import process_audio
    assert importlib.util.find_spec("librosa") is None, "relax-multimodal installed librosa"
    wav = io.BytesIO()
    sf.write(wav, np.sin(np.arange(22050, dtype=np.float32) / 10), 22050, format="WAV")
    item = process_audio(wav.getvalue())
    assert item.rate == 16000 and item.waveform.shape == (16000,), (item.rate, item.waveform.shape)
    from PIL import Image
    from relax_multimodal import MultimodalConfig, MultimodalProcessor
    png = io.BytesIO()
    Image.new("RGB", (64, 48), "red").save(png, format="PNG")
    cfg = MultimodalConfig(model="qwen2_5_omni", multimodal_keys={"image": "i", "audio": "a"})
    s = MultimodalProcessor(cfg).process({"prompt": "<image><audio>", "i": png.getvalue(), "a": wav.getvalue()})
    assert s.text.count("<|IMAGE|>") == s.images[0].num_tokens > 0
    assert s.text.count("<|AUDIO|>") == s.audios[0].num_tokens > 0
    assert "librosa" not in sys.modules and "torch" not in sys.modules and "transformers" not in sys.modules
print(f"ok: {mod} {getattr(m, '__version__', '?')}: its {len(modules)} modules import alone without torch/ray")
PY
}

for mod in relax_bus relax_core relax_rewards relax_multimodal; do
  pkg=${mod//_/-}
  venv=$tmp/$pkg
  uv venv --quiet --python python3 "$venv"
  # (--refresh-package: the wheel just built, not one of the same version in uv's cache from an earlier build)
  uv pip install --quiet --python "$venv/bin/python" --refresh-package "$pkg" --find-links "$dist" "$pkg"
  check "$venv" "$mod"
  if [[ $pkg == relax-core ]]; then
    uv pip install --quiet --python "$venv/bin/python" --find-links "$dist" "relax-core[tensorboard]"
    check "$venv" "$mod" tensorboard
  fi
done

# The READMEs' install from a clone, `pip install ./packages/relax-bus ./packages/relax-core` (with uv's pip:
# the same requirements, built from the paths, in a second instead of ten).
venv=$tmp/from-paths
uv venv --quiet --python python3 "$venv"
(cd "$root" && uv pip install --quiet --python "$venv/bin/python" \
  --refresh-package relax-bus --refresh-package relax-core ./packages/relax-bus ./packages/relax-core)
check "$venv" relax_bus
check "$venv" relax_core
