"""The sglang engine's two ways to hand new weights to real SGLang servers: through disk, or broadcast on
SGLang's weight group; each with the weights in float32 or bfloat16 on the wire. One command:

    uv run python benchmarks/sglang_weight_update.py [--reps 5] [--engines 2] [--layers 8] [--server sglang|ours]

An :class:`~relax_rollout.engines.sglang.SGLangEngine` launches --engines servers: the real SGLang 0.5.23 on
this CPU (``--server sglang``, the default: its venv from ``bash tools/sglang-cpu/setup.sh``; float32,
torch-native kernels) or our engine server (``--server ours``, one torch thread). The model is a
Qwen3-architecture one built from config (hidden 512, --layers layers, vocabulary 2000: ~26M parameters,
~105 MB in float32). One update is ``update_weights(tensors, version)`` until every engine reports the
version: ``disk`` writes safetensors once and every server loads them (``/update_weights_from_disk``);
``distributed`` broadcasts 64 MB buckets over gloo on 127.0.0.1 (``/begin_weight_update``, then
``/update_weights_from_distributed`` with ``flattened_bucket`` per bucket, generation paused, then
``/end_weight_update``). The wire dtype is the dtype of the tensors sent (SGLang casts into its float32
parameters). The four variants alternate per repetition after one untimed update each; median and min-max
of the seconds, bytes sent per version, and MB/s = bytes / seconds.

Expected: bfloat16 halves the bytes and, on one machine, about halves the time of both paths; distributed
slower than disk here (the safetensors file stays in the page cache; the broadcast crosses a loopback
socket once per server). Measured: BENCHMARKS.md.
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

    from relax_testing import build_tiny_checkpoint

    build_tiny_checkpoint(root)  # its tokenizer; the model is replaced by the larger one
    return qwen3(root, layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--server", choices=("sglang", "ours"), default="sglang")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from relax_rollout.engines import sglang_cpu
    from relax_rollout.engines.processes import server_command
    from relax_rollout.engines.sglang import SGLangEngine

    if args.server == "sglang":
        python = sglang_cpu.python()
        if python is None:
            sys.exit(f"no SGLang venv: run `{sglang_cpu.SETUP}` first (or --server ours)")
        launch = {**sglang_cpu.engine_kwargs(python), "startup_timeout_s": 600}
    else:
        launch = {
            "launch_cmd": server_command("--torch-threads", "1"),
            "gpu_ids": list(range(args.engines)),
        }
    variants = [(m, d) for m in ("disk", "distributed") for d in (torch.float32, torch.bfloat16)]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        from safetensors.torch import load_file

        weights = load_file(os.path.join(model, "model.safetensors"))
        eng = SGLangEngine(
            model,
            num_engines=args.engines,
            log_dir=str(Path(tmp) / "logs"),
            bucket_bytes=64 << 20,
            request_timeout_s=600,
            **launch,
        )
        times: dict[tuple, list[float]] = {v: [] for v in variants}
        sent: dict[tuple, int] = {}
        version = 0
        try:
            for rep in range(args.reps + 1):
                for mode, dtype in variants if rep % 2 == 0 else variants[::-1]:
                    version += 1
                    tensors = {k: (v * (1.0 + 1e-3 * version)).to(dtype) for k, v in weights.items()}
                    sent[(mode, dtype)] = sum(t.numel() * t.element_size() for t in tensors.values())
                    eng.weight_update = mode
                    t0 = time.perf_counter()
                    eng.update_weights(tensors, version)
                    dt = time.perf_counter() - t0
                    if rep > 0:  # the first of each: untimed (the group forms, files open)
                        times[(mode, dtype)].append(dt)
        finally:
            eng.close()
    print(
        f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}; {args.engines} {args.server} servers, "
        f"{args.reps} reps"
    )
    print("| weight update | wire dtype | MB per version | median s | min-max s | MB/s (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (mode, dtype), ts in times.items():
        med, mb = statistics.median(ts), sent[(mode, dtype)] / 1e6
        print(
            f"| {mode} | {str(dtype).removeprefix('torch.')} | {mb:.0f} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} "
            f"| {mb / med:.0f} |"
        )
    med = {v: statistics.median(ts) for v, ts in times.items()}
    f32, b16 = torch.float32, torch.bfloat16
    print(
        f"distributed / disk time (float32): {med[('distributed', f32)] / med[('disk', f32)]:.2f}; "
        f"bfloat16 / float32 time: disk {med[('disk', b16)] / med[('disk', f32)]:.2f}, "
        f"distributed {med[('distributed', b16)] / med[('distributed', f32)]:.2f}"
    )


if __name__ == "__main__":
    main()
