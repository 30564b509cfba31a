"""Weight sync (DCS): overlapped with the next training step, and broadcast vs shared-memory (ipc)
transport. One command:

    uv run python benchmarks/weight_sync.py [--reps 9] [--receivers 2] [--layers 8] [--seqs 8] [--device cpu]

The trainer is the real ActorWorker + TorchBackend (one torch thread) on a Qwen3-architecture model built
from config (hidden 512, --layers layers, vocabulary 2000: ~26M parameters, ~105 MB in float32); the
receivers are --receivers spawned processes in one DCS group (gloo over 127.0.0.1) that copy every version
into their own tensors, as an engine loads weights. One iteration is what the fully-async trainer does per
step: publish the weights, then ``train_step`` on --seqs sequences of 64 tokens (forward + backward +
AdamW). Without overlap the publish blocks until every receiver has the weights; with overlap
(``--overlap-weight-sync``, the default) it runs in a background thread and the optimizer waits for it
before writing the weights (the fence). Modes alternate per iteration after one untimed iteration of each;
median and min-max over --reps. Also timed alone: train_step without a publish, and the broadcast (the
sender's own time). Expected: overlapped ≈ max(train, broadcast) instead of train + broadcast; on this
2-core machine the receivers' copies compete with the trainer for the CPU, so less than that.

Transports: the same weights (on --device: cpu = gloo / POSIX shared memory, cuda = NCCL / CUDA IPC)
sent by a WeightSender to --receivers receiver processes that copy them into their own tensors on that
device, with transport ``broadcast`` and ``ipc``, alternating per repetition (two groups formed once);
per send: seconds until every receiver has the weights, and GB/s = model bytes / seconds. Next to them the
device's own copy bandwidth: one ``dst.copy_(src)`` of the same number of bytes on that device.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _receiver(init: str, world: int, rank: int, transport: str = "broadcast", device: str = "cpu") -> None:
    from relax_core.dcs import WeightReceiver

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    recv = WeightReceiver(init, world, rank, backend=backend, timeout_s=600, transport=transport)
    recv.connect()
    held: dict[str, torch.Tensor] = {}

    def load(version: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            held.setdefault(name, torch.empty_like(t, device=device)).copy_(t)

    recv.start_background(load)
    recv.join()
    recv.check()
    recv.close()


def build_model(
    root: Path,
    layers: int,
    hidden: int = 512,
    intermediate: int = 1536,
    heads: int = 8,
    kv: int = 4,
    vocab: int = 2000,
) -> str:
    """A seeded Qwen3-architecture model from config under ``root`` (by default hidden 512: ~26M parameters
    at 8 layers)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(root)
    return str(root)


def samples(n: int) -> dict[str, list]:
    rng = np.random.default_rng(0)
    out: dict[str, list] = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": []}
    out["rollout_log_probs"] = []
    for k in range(n):
        out["tokens"].append(rng.integers(2, 2000, size=64).astype(np.int64))
        out["prompt_len"].append(32)
        out["loss_mask"].append(np.ones(32, dtype=np.float32))
        out["advantages"].append(np.full(32, 1.0 if k % 2 else -1.0, dtype=np.float32))
        out["rollout_log_probs"].append(np.full(32, -7.6, dtype=np.float32))
    return out


def transports(model: torch.nn.Module, receivers: int, reps: int, device: str) -> list[str]:
    from relax_core.dcs import WeightSender
    from relax_core.net import free_port

    params = [(n, p.detach().to(device)) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in params)
    ctx = mp.get_context("spawn")
    backend = "nccl" if device == "cuda" else "gloo"
    senders, procs = {}, []
    for transport in ("broadcast", "ipc"):
        init, world = f"tcp://127.0.0.1:{free_port()}", receivers + 1
        procs += [
            ctx.Process(target=_receiver, args=(init, world, r, transport, device)) for r in range(1, world)
        ]
        for p in procs[-receivers:]:
            p.start()
        senders[transport] = WeightSender(init, world, backend=backend, timeout_s=600, transport=transport)
        senders[transport].connect()
    secs: dict[str, list[float]] = {t: [] for t in senders}
    for v in range(reps + 1):
        for t in senders if v % 2 == 0 else list(senders)[::-1]:
            st = senders[t].broadcast(params, version=v)
            if v:  # (version 0: warm-up, sends the layout and the handles)
                secs[t].append(st.seconds)
    for s in senders.values():
        s.close()
    for p in procs:
        p.join(60)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    rows = [f"\n## Transports: {nbytes / 1e6:.0f} MB to {receivers} receivers on {device}\n"]
    rows += ["| | median s | min-max s | GB/s (median) |", "|---|---|---|---|"]
    for name, ts in [*secs.items(), ("device copy (one dst.copy_(src))", copies)]:
        med = statistics.median(ts)
        rows.append(f"| {name} | {med:.4f} | {min(ts):.4f}-{max(ts):.4f} | {nbytes / med / 1e9:.2f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="for the transports part")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from relax_core.config import RelaxConfig
    from relax_core.net import free_port
    from relax_train.roles.actor import ActorWorker

    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    print(
        f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, 1 torch thread per process"
    )
    print(f"# load before: {uptime()}")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        cfg = RelaxConfig.model_validate(
            {
                "run": {"output_dir": f"{tmp}/run", "trace": False, "tensorboard": False},
                "train": {"micro_batch_size": args.seqs, "lr": 1e-5},
                "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": args.seqs},
            }
        )
        worker = ActorWorker(cfg, bus=None, model_path=model)
        n_params = sum(p.numel() for p in worker.backend.model.parameters())
        init, world = f"tcp://127.0.0.1:{free_port()}", args.receivers + 1
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_receiver, args=(init, world, r)) for r in range(1, world)]
        for p in procs:
            p.start()
        worker.connect_dcs(init, world)
        batch = samples(args.seqs)
        times: dict[str, list[float]] = {"without overlap": [], "with overlap": [], "train alone": []}
        bcast: list[float] = []

        def iteration(mode: str) -> float:
            worker.weights.overlap = mode == "with overlap"
            t0 = time.perf_counter()
            if mode != "train alone":
                worker.publish_weights()
            worker.backend.train_step(batch)
            dt = time.perf_counter() - t0
            if mode == "without overlap":
                bcast.append(worker._sender.last_stats.seconds)
            return dt

        modes = list(times)
        for m in modes:  # untimed warm-up
            iteration(m)
        bcast.clear()
        for rep in range(args.reps):
            for m in modes if rep % 2 == 0 else modes[::-1]:
                times[m].append(iteration(m))
        worker.close()
        for p in procs:
            p.join(60)
        transport_rows = transports(worker.backend.model, args.receivers, args.reps, args.device)
    print(f"# load after: {uptime()}")
    print(
        f"# model: {n_params / 1e6:.1f}M parameters, {n_params * 4 / 1e6:.0f} MB float32; "
        f"{args.receivers} receivers; train_step on {args.seqs} x 64 tokens\n"
    )
    print("| per step | median s | min-max s |")
    print("|---|---|---|")
    for m, ts in [*times.items(), ("broadcast alone (sender)", bcast)]:
        print(f"| {m} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} |")
    ratio = statistics.median(times["with overlap"]) / statistics.median(times["without overlap"])
    print(f"\nstep time with / without overlap: {ratio:.2f}")
    print("\n".join(transport_rows))


if __name__ == "__main__":
    main()
