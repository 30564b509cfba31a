#!/usr/bin/env bash
# Install each standalone package from its built wheel into its own clean venv and import it there:
# torch and ray must not be imported (DESIGN.md §5), and the in-process bus must work without them.
set -euo pipefail
dist=$(cd "$1" && pwd)
for mod in relax_bus relax_core relax_rewards relax_multimodal; do
  pkg=${mod//_/-}
  venv=$(mktemp -d)/venv
  uv venv --quiet --python python3 "$venv"
  uv pip install --quiet --python "$venv/bin/python" --find-links "$dist" "$pkg"
  "$venv/bin/python" - "$mod" <<'PY'
import importlib, sys
mod = sys.argv[1]
m = importlib.import_module(mod)
heavy = [name for name in ("torch", "ray", "transformers") if name in sys.modules]
assert not heavy, f"import {mod} pulled in {heavy}"
if mod == "relax_bus":
    import numpy as np
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec(required_fields=["x"])}, capacity=8))
    ids = bus.put([{"x": np.arange(3)}, {"x": np.arange(2)}])
    batch = bus.get("c", n=2, timeout=1)
    bus.ack("c", batch.lease_id)
    assert batch.ids == ids and "torch" not in sys.modules
if mod == "relax_rewards":
    from relax_rewards import get_reward
    assert get_reward("math")("so the answer is \\boxed{42}", "42").score == 1.0
print(f"ok: {mod} {getattr(m, '__version__', '?')} imports alone without torch/ray")
PY
  rm -rf "$(dirname "$venv")"
done
