"""Delta weight sync's codec (#53, first part): bytes per sync, full vs delta, on real training steps.

    uv run python benchmarks/weight_delta.py [--layers 4] [--steps 30] [--lrs 1e-6,1e-5,2e-4]

The trainer is the real TorchBackend (AdamW, one torch thread) on a Qwen3-architecture model built from
config (hidden 512, --layers layers, vocabulary 2000; 4 layers: ~15M parameters); each step trains 8
sequences of 64 tokens (weight_sync.py's batch). After each step its weights, as they are sent (HF names,
in bf16 — the default --dtype — and in fp32), go through relax_core.weight_delta: one bucket per tensor, the
first version full, every later one against the last. Per lr and dtype: the median (min-max) over the steps
of the delta's bytes as a share of the full bytes, of the elements changed, and of the encode and decode
seconds; every decoded version is checked bitwise against the trainer's. Expected: bf16 at lr <= 1e-5
changes a few percent of elements (AdamW moves every weight by ~lr, below bf16's resolution for most), so
the delta is a few percent of the bytes; fp32 at any lr changes nearly every element and does not pay.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from weight_sync import build_model, samples  # (the same model and batch as the weight-sync benchmark)


def _buckets(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> list[np.ndarray]:
    return [t.detach().to(dtype).contiguous().view(torch.uint8).reshape(-1).numpy().copy() for _, t in named]


def _spread(xs: list[float], fmt: str = "{:.4f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def run(model: str, lr: float, steps: int, tmp: str) -> dict[str, dict[str, list[float]]]:
    from relax_core.config import RelaxConfig
    from relax_core.weight_delta import DeltaReceiver, DeltaSender
    from relax_train.backends import build_backend

    cfg = RelaxConfig.model_validate(
        {
            "run": {"output_dir": f"{tmp}/run", "trace": False, "tensorboard": False},
            "train": {"micro_batch_size": 8, "lr": lr},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": 8},
        }
    )
    backend = build_backend("torch", config=cfg, model_path=model)
    batch = samples(8)
    codecs = {
        "bf16": (torch.bfloat16, DeltaSender(full_every=10**9), DeltaReceiver()),
        "fp32": (torch.float32, DeltaSender(full_every=10**9), DeltaReceiver()),
    }
    out: dict[str, dict[str, list[float]]] = {k: {} for k in codecs}
    for v in range(steps + 1):
        if v:
            backend.train_step(batch)
        named = [(n, t) for n, t in backend.model.named_parameters()]
        for kind, (dtype, sender, receiver) in codecs.items():
            buckets = _buckets(named, dtype)
            itemsize = torch.tensor([], dtype=dtype).element_size()
            prev = [b.copy() for b in receiver.buckets]
            t0 = time.perf_counter()
            deltas = sender.encode(v, buckets, [itemsize] * len(buckets))
            t1 = time.perf_counter()
            for d in deltas:
                receiver.apply(d)
            t2 = time.perf_counter()
            assert all(np.array_equal(a, b) for a, b in zip(receiver.buckets, buckets)), (kind, v)
            if v == 0:
                continue
            full = sum(b.nbytes for b in buckets)
            changed = sum(
                int(np.count_nonzero(a.view(f"u{itemsize}") != b.view(f"u{itemsize}")))
                for a, b in zip(prev, buckets)
            )
            rows = out[kind]
            rows.setdefault("bytes_share", []).append(sum(len(d.payload) for d in deltas) / full)
            rows.setdefault("changed_share", []).append(changed / (full / itemsize))
            rows.setdefault("encode_s", []).append(t1 - t0)
            rows.setdefault("decode_s", []).append(t2 - t1)
            rows.setdefault("full_mb", []).append(full / 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lrs", default="1e-6,1e-5,2e-4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from quiet import machine_state

    from relax_core.roofline import cpu_model

    print(
        f"# machine: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}"
    )
    print(f"# before: {machine_state()}")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        for lr in [float(x) for x in args.lrs.split(",")]:
            res = run(model, lr, args.steps, tmp)
            for kind, rows in res.items():
                print(
                    f"lr {lr:g} {kind}: full {rows['full_mb'][0]:.1f} MB; delta bytes share {_spread(rows['bytes_share'])}; "
                    f"elements changed {_spread(rows['changed_share'])}; encode s {_spread(rows['encode_s'], '{:.3f}')}; "
                    f"decode s {_spread(rows['decode_s'], '{:.3f}')}; every version bitwise equal"
                )
    print(f"# after: {machine_state()}")


if __name__ == "__main__":
    main()
