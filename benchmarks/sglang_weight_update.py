"""The sglang engine's two ways to hand new weights to its servers: through disk, or broadcast on SGLang's
weight group. One command:

    uv run python benchmarks/sglang_weight_update.py [--reps 7] [--engines 2] [--layers 8]

An :class:`~relax_rollout.engines.sglang.SGLangEngine` drives --engines of our engine servers (one torch
thread each; SGLang needs a GPU, our server speaks its API and builds its weight group as SGLang does) on
a Qwen3-architecture model built from config (hidden 512, --layers layers, vocabulary 2000: ~26M
parameters, ~105 MB in float32). One update is ``update_weights(tensors, version)`` until every engine
reports the version: ``disk`` writes safetensors once and every server loads them
(``/update_weights_from_disk``); ``distributed`` broadcasts 64 MB buckets over gloo on 127.0.0.1
(``/update_weights_from_distributed``, ``flattened_bucket``). The modes alternate per repetition after one
untimed update each; median and min-max of the seconds, and MB/s = model bytes / seconds.

Expected: about the same time on one machine (both copy the weights once per server). Measured (BENCHMARKS.md):
``distributed`` 3.45× slower here (the safetensors file stays in the page cache; the broadcast goes through a
loopback socket once per server). What ``distributed`` saves is the disk (one full copy per version, ~60 GB
for a 30B model in bf16) and, on several nodes, the shared directory; on GPUs it is an NCCL broadcast.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_model(root: Path, layers: int) -> str:
    """weight_sync.py's model, with a tokenizer (the engine servers load one)."""
    from weight_sync import build_model as qwen3  # this folder is on sys.path when run as a script

    from relax_core.testing import build_tiny_checkpoint

    build_tiny_checkpoint(root)  # its tokenizer; the model is replaced by the larger one
    return qwen3(root, layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from relax_rollout.engines.sglang import SGLangEngine

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        from safetensors.torch import load_file

        weights = load_file(os.path.join(model, "model.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        cmd = [sys.executable, "-m", "relax_rollout.server", "--model", "{model_path}", "--port", "{port}",
               "--torch-threads", "1"]  # fmt: skip
        eng = SGLangEngine(model, num_engines=args.engines, launch_cmd=cmd, gpu_ids=list(range(args.engines)),
                           log_dir=str(Path(tmp) / "logs"), startup_timeout_s=600, bucket_bytes=64 << 20)  # fmt: skip
        times: dict[str, list[float]] = {"disk": [], "distributed": []}
        version = 0
        try:
            for rep in range(args.reps + 1):
                for mode in ("disk", "distributed") if rep % 2 == 0 else ("distributed", "disk"):
                    version += 1
                    tensors = {k: v * (1.0 + 1e-3 * version) for k, v in weights.items()}
                    eng.weight_update = mode
                    t0 = time.perf_counter()
                    eng.update_weights(tensors, version)
                    dt = time.perf_counter() - t0
                    if rep > 0:  # the first of each: untimed (the group forms, files open)
                        times[mode].append(dt)
        finally:
            eng.close()
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, torch {torch.__version__}; {args.engines} engine servers, "
          f"{nbytes / 1e6:.0f} MB of weights, {args.reps} reps")  # fmt: skip
    print("| weight update | median s | min-max s | MB/s (median) |")
    print("| --- | --- | --- | --- |")
    for mode, ts in times.items():
        med = statistics.median(ts)
        print(f"| {mode} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} | {nbytes / 1e6 / med:.0f} |")
    d, b = statistics.median(times["disk"]), statistics.median(times["distributed"])
    print(f"distributed / disk time: {b / d:.2f}")


if __name__ == "__main__":
    main()
