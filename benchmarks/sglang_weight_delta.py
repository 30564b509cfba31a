"""Real SGLang servers taking a training run's versions, full (SGLang's weight group) vs delta (our custom
loader), side by side: bytes, update time and the engine's pause (#53). One command:

    uv run python benchmarks/sglang_weight_delta.py [--steps 20] [--lr 1e-5] [--layers 8]

One :class:`~relax_rollout.engines.sglang.SGLangEngine` of one real SGLang 0.5.23 server on this CPU (float32
parameters, torch-native kernels; the venv of ``bash tools/sglang-cpu/setup.sh``; launched for delta, its
loader registered) serves a Qwen3-architecture model built from config (sglang_weight_update.py's: hidden 512, --layers layers,
vocabulary 2000; 8 layers: 26M parameters). The trainer is the real TorchBackend (float32, AdamW, one torch
thread) training a fresh RL-like batch each step (weight_delta_sync.py's); each version goes to the server
twice, in bfloat16 as a mixed-precision trainer sends it, in alternating order: ``weight_update=
"distributed"`` (every byte, 64 MB buckets broadcast over gloo on 127.0.0.1, generation paused around it) and
``"delta"`` (each bucket's delta against the last version sent that way, ``/update_weights_from_tensor`` to
the loader, generation paused around it). One server for both: a second one, idle, takes CPU from this
2-core machine (measured: it tripled the delta's pause, whose decode is CPU work). Per update: the bytes
sent, the seconds until the server reports the version, and its pause (``/pause_generation`` to
``/continue_generation``: ``engine.pauses``). The server's own checksum of its parameters
(``/weights_checker``) after the delta must equal the one after the full update of the same version: the
delta path serves bitwise what the full one does. Version 0 (full both ways) is untimed.

Expected: delta sends a few percent of the bytes at lr 1e-5; the update and the pause shrink by what the
transfer cost, less the encode (here) and the decode and load (in the server).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from quiet import machine_state
from sglang_weight_update import build_model
from weight_delta_sync import batch

MODES = ("distributed", "delta")


def _checksum(eng) -> str:
    from relax_rollout.engines.wire import http_json

    (url,) = eng.urls
    got = http_json(url, "/weights_checker", {"action": "checksum"})
    return str(got["per_engine_checksum"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from relax_core.config import RelaxConfig
    from relax_core.roofline import cpu_model
    from relax_rollout.engines import sglang_cpu
    from relax_rollout.engines.sglang import SGLangEngine
    from relax_train.backends import build_backend

    python = sglang_cpu.python()
    if python is None:
        sys.exit(f"no SGLang venv: run `{sglang_cpu.SETUP}` first")
    print(f"# machine: {cpu_model()}, {os.cpu_count()} CPUs; before: {machine_state()}")
    rows: dict[str, dict[str, list[float]]] = {m: {"bytes": [], "update_s": [], "pause_s": []} for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        cfg = RelaxConfig.model_validate(
            {
                "run": {"output_dir": f"{tmp}/run", "trace": False, "tensorboard": False},
                "train": {"micro_batch_size": 8, "lr": args.lr},
                "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": 8},
            }
        )
        trainer = build_backend("torch", config=cfg, model_path=model)
        launch = {**sglang_cpu.engine_kwargs(python), "startup_timeout_s": 600, "gpu_ids": ["0"]}
        eng = SGLangEngine(
            model,
            num_engines=1,
            weight_update="delta",
            log_dir=f"{tmp}/logs",
            bucket_bytes=64 << 20,
            request_timeout_s=600,
            **launch,
        )
        try:
            for v in range(args.steps + 1):
                if v:
                    trainer.train_step(batch(v, 2000))
                named = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in trainer.named_weights()}
                full = sum(t.numel() * t.element_size() for t in named.values())
                sums = {}
                for m in MODES if v % 2 == 0 else MODES[::-1]:
                    eng.weight_update = m
                    eng.pauses.drain()
                    t0 = time.perf_counter()
                    eng.update_weights(dict(named), v)
                    dt = time.perf_counter() - t0
                    (_, pause), *_ = eng.pauses.drain()
                    print(f"# version {v} {m}: update {dt:.3f} s, pause {pause:.3f} s", flush=True)
                    sums[m] = _checksum(eng)
                    if v:
                        deltas = eng.weights.deltas
                        rows[m]["bytes"].append(deltas.last_sent if m == "delta" and deltas else full)
                        rows[m]["update_s"].append(dt)
                        rows[m]["pause_s"].append(pause)
                if len(set(sums.values())) != 1:
                    raise RuntimeError(f"version {v}: the server's parameters differ by the path: {sums}")
        finally:
            eng.close()
    print(f"# after: {machine_state()}")
    print(
        f"# {args.steps} versions after an untimed full one, lr {args.lr:g}, {full / 1e6:.1f} MB a version in "
        "bfloat16; the server's parameter checksum the same after either path, every version\n"
    )
    print("| update | bytes sent / full | update s | engine pause s |")
    print("|---|---|---|---|")
    for m in MODES:
        r = rows[m]
        share = [b / full for b in r["bytes"]]
        print(
            f"| {m} | {statistics.median(share):.3f} ({min(share):.3f}-{max(share):.3f}) | "
            f"{statistics.median(r['update_s']):.3f} ({min(r['update_s']):.3f}-{max(r['update_s']):.3f}) | "
            f"{statistics.median(r['pause_s']):.3f} ({min(r['pause_s']):.3f}-{max(r['pause_s']):.3f}) |"
        )
    d, f = rows["delta"], rows["distributed"]
    print(
        f"\ndelta / full: update {statistics.median(d['update_s']) / statistics.median(f['update_s']):.2f}, "
        f"pause {statistics.median(d['pause_s']) / statistics.median(f['pause_s']):.2f}"
    )


if __name__ == "__main__":
    main()
