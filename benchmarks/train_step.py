"""One training step of the demo's shape against the machine's limit (#51): its time, its model-FLOPs
utilisation (``relax_core.roofline``: FLOPs counted from the model's config over the measured matmul peak),
and what the step's options change — the logits path (``--log-probs-chunk-size 0``) against scoring from
hidden states in chunks (the default), and ``--torch-compile`` (its compile time apart). The demo's SFT model,
256 samples of the demo's lengths (three batches of other lengths in turn, as a run's steps differ), packed
micro-batches as the demo trains them, 2 torch threads; plans interleaved, median of the steps.

    uv run python benchmarks/train_step.py                   # 4 rounds x 5 steps per plan
    uv run python benchmarks/train_step.py --no-compile      # without the torch.compile plan
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from micro_batches import _samples

PLANS = {
    "default (chunked log-probs)": {},
    "logits path": {"log_probs_chunk_size": 0},
    "torch.compile": {"torch_compile": True},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/train_step.json")
    args = ap.parse_args()
    import torch

    from relax_app.cli_config import config_from_flat
    from relax_app.demo.assets import prepare_demo
    from relax_app.demo.defaults import DEMO_DEFAULTS
    from relax_core.roofline import ModelShape, matmul_peak, train_flops
    from relax_core.roofline import cpu_model as cpu
    from relax_train.backends.torch_backend import TorchBackend

    torch.set_num_threads(2)
    model = str(prepare_demo(os.environ.get("RELAX_CACHE_DIR", ".relax_cache")).sft_model_dir)
    peak = matmul_peak(2)
    shape = ModelShape.from_checkpoint(model)
    assert shape is not None
    plans = {k: v for k, v in PLANS.items() if not (args.no_compile and v.get("torch_compile"))}
    batches = [_samples(seed=s) for s in range(3)]
    flops = [train_flops(shape, [len(t) for t in b["tokens"]]) for b in batches]
    backends, warm_s = {}, {}
    for name, plan in plans.items():
        flat = {**DEMO_DEFAULTS, "output_dir": "runs/bench_train_step"}
        cfg = config_from_flat(flat)
        for key, value in plan.items():
            section = "model" if key == "torch_compile" else "train"
            setattr(getattr(cfg, section), key, value)
        backends[name] = TorchBackend(cfg, model)
        t = time.perf_counter()
        for b in batches:  # (warm-up: a compiled plan compiles here, each batch's shapes once)
            backends[name].train_step(b)
        warm_s[name] = time.perf_counter() - t
    times: dict[str, list[float]] = {name: [] for name in plans}
    mfu: dict[str, list[float]] = {name: [] for name in plans}
    for r in range(args.rounds):  # interleaved: drift hits every plan alike
        for name, backend in backends.items():
            for s in range(args.steps):
                k = (r * args.steps + s) % len(batches)
                t = time.perf_counter()
                backend.train_step(batches[k])
                dt = time.perf_counter() - t
                times[name].append(dt)
                mfu[name].append(flops[k] / dt / (peak.gflops * 1e9))
    load = os.getloadavg()[0]
    print(f"{cpu()}, {os.cpu_count()} cpus, torch {torch.__version__}, load {load:.2f} at the end")
    print(
        f"matmul peak {peak.gflops} GFLOP/s on 2 threads ({peak.shapes}); a step is {flops[0] / 1e9:.1f} GFLOP"
    )
    print("| plan | train step s, median (min–max) | MFU, median | warm-up s (3 steps) |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        print(
            f"| {name} | {statistics.median(ts):.3f} ({min(ts):.3f}–{max(ts):.3f}) | "
            f"{statistics.median(mfu[name]):.2f} | {warm_s[name]:.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "cpu": cpu(),
                "peak": peak.__dict__,
                "load_end": load,
                "times": times,
                "mfu": mfu,
                "warm_s": warm_s,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
