"""Delta weight sync's codec (#53): bytes per sync, full vs delta, on real training steps.

    uv run python benchmarks/weight_delta.py [--shapes demo,52m] [--steps 100] [--lrs 1e-6,1e-5,2e-4]

The trainer is the real TorchBackend (float32 weights, AdamW, one torch thread) on a Qwen3-architecture model
built from config (weight_delta_sync.py's shapes: ``demo``, the CPU demo's, 0.8M parameters; ``52m``, hidden
1024, 4 layers); each step trains a fresh batch of 8 random sequences of 64 tokens (weight_delta_sync.py's:
an RL batch changes every step). After each step its weights, as they are sent (HF names, cast to bf16 as a
mixed-precision trainer sends them, and in fp32), go through relax_core.weight_delta: one bucket per tensor,
the first version full, every later one against the last. Per lr and dtype: the median (min-max) over the steps
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
from weight_delta_sync import SHAPES, batch, build_model  # (the same models and batches as the live one)

from relax_core.weight_delta import DeltaSender


def _buckets(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> list[np.ndarray]:
    return [t.detach().to(dtype).contiguous().view(torch.uint8).reshape(-1).numpy().copy() for _, t in named]


def _spread(xs: list[float], fmt: str = "{:.4f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _falls_back(shares: list[float]) -> bool:
    """Whether a run's sender would give up on deltas (DeltaSender's default: 3 in a row over half)."""
    over = [x > DeltaSender.gives_up_above for x in shares]
    return any(all(over[i : i + DeltaSender.gives_up_after]) for i in range(len(over) - 2))


def run(model: str, vocab: int, lr: float, steps: int, tmp: str) -> dict[str, dict[str, list[float]]]:
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
    codecs = {
        "bf16": (torch.bfloat16, DeltaSender(full_every=10**9, gives_up_after=10**9), DeltaReceiver()),
        "fp32": (torch.float32, DeltaSender(full_every=10**9, gives_up_after=10**9), DeltaReceiver()),
    }
    out: dict[str, dict[str, list[float]]] = {k: {} for k in codecs}
    for v in range(steps + 1):
        if v:
            backend.train_step(batch(v, vocab))
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
    ap.add_argument("--shapes", default="demo,52m")
    ap.add_argument("--steps", type=int, default=100)
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
        for shape in args.shapes.split(","):
            model = build_model(Path(tmp) / shape, shape)
            for lr in [float(x) for x in args.lrs.split(",")]:
                res = run(model, SHAPES[shape]["vocab_size"], lr, args.steps, tmp)
                for kind, rows in res.items():
                    print(
                        f"{shape} lr {lr:g} {kind}: full {rows['full_mb'][0]:.1f} MB; delta bytes share "
                        f"{_spread(rows['bytes_share'])}; elements changed {_spread(rows['changed_share'])}; "
                        f"encode s {_spread(rows['encode_s'], '{:.3f}')}; decode s {_spread(rows['decode_s'], '{:.3f}')}; "
                        f"every version bitwise equal; a run falls back to full: {_falls_back(rows['bytes_share'])}",
                        flush=True,
                    )
    print(f"# after: {machine_state()}")


if __name__ == "__main__":
    main()
