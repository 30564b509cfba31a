"""Delta weight sync in a live DCS run (#53): bytes, sync time and engine pause per sync, full vs delta side by
side, on one node and across network-namespace nodes. One command, as root (it makes network namespaces):

    uv run python benchmarks/weight_delta_sync.py --shape 52m --steps 30 --lr 1e-5 --dtypes bf16,fp32 [--nic-gbit 2]

The trainer is the real TorchBackend (float32 weights, AdamW, one torch thread) on a Qwen3-architecture model
built from config (``--shape demo``: the CPU demo's, 0.8M parameters; ``52m``: hidden 1024, 4 layers,
vocabulary 2000), trained on a fresh batch of 8 random sequences of 64 tokens each step (an RL batch changes
every step; one fixed batch would make AdamW move every weight the same way each step, which no RL run
does). After each step it casts the weights to the synced dtype, as a mixed-precision trainer sends them,
and sends the version twice, on two DCS groups: ``full`` (``WeightSender``) and ``delta``
(``WeightSender(delta=True)``), in alternating order. Each group has one receiver: a real ``TorchEngine``
holding the model in that dtype, which loads every version with ``update_weights`` (its lock held: the pause).

Per sync and mode: the bytes put on the wire, the seconds from the sender's ``broadcast`` to the engine having
loaded the version (CLOCK_MONOTONIC, one clock for every namespace), and the engine's pause. Every version
each engine loads is checked bitwise against the trainer's (sha256 over every tensor's bytes): the run stops
on the first difference. Paths: ``loopback`` (trainer and engines in node 0, rendezvous at 127.0.0.1) and
``network`` (trainer on node 0, engines on node 1: the bytes cross two veths and a bridge; ``--nic-gbit``
caps every node's egress like a NIC, ``tc tbf``). Expected: delta sends a few percent of the bytes in bf16
at lr <= 1e-5; its encode and decode cost CPU, so it pays in time where bytes are time (a capped link), not
on loopback; the pause is the engine's copy either way (the decode runs on the receiver's thread, while
the engine generates).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from weight_sync_nodes import BRIDGE, PREFIX, SUBNET, Driver, _now, _say, cap_egress, machine, preflight

SHAPES = {
    "demo": {
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 384,
        "layers": 4,
        "heads": 4,
        "kv": 2,
    },
    "52m": {
        "vocab_size": 2000,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "layers": 4,
        "heads": 16,
        "kv": 8,
    },
}
MODES = ("full", "delta")


def build_model(root: Path, shape: str) -> str:
    """A Qwen3-architecture model of ``shape`` (:data:`SHAPES`), seeded, saved under ``root``."""
    from weight_sync import build_model as qwen3

    s = SHAPES[shape]
    return qwen3(
        root, s["layers"], s["hidden_size"], s["intermediate_size"], s["heads"], s["kv"], s["vocab_size"]
    )


def batch(step: int, vocab: int) -> dict[str, list]:
    """Step ``step``'s RL-like batch: 8 random sequences (32 prompt + 32 response tokens), advantages +-1."""
    import numpy as np

    rng = np.random.default_rng(step)
    out: dict[str, list] = {
        k: [] for k in ("tokens", "prompt_len", "loss_mask", "advantages", "rollout_log_probs")
    }
    for _ in range(8):
        out["tokens"].append(rng.integers(2, vocab, size=64).astype(np.int64))
        out["prompt_len"].append(32)
        out["loss_mask"].append(np.ones(32, dtype=np.float32))
        out["advantages"].append(np.full(32, float(rng.choice([-1.0, 1.0])), dtype=np.float32))
        out["rollout_log_probs"].append(np.full(32, -np.log(vocab), dtype=np.float32))
    return out


def digest(named) -> str:
    """sha256 over every tensor's name and bytes, by name."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ---- workers, each started inside its node ----


def run_trainer(spec: dict) -> None:
    """Trains a step per ``step V ORDER`` line, then sends the version on both groups in ORDER."""
    import torch

    from relax_core.config import RelaxConfig
    from relax_core.dcs import WeightSender
    from relax_train.backends import build_backend

    dtype = getattr(torch, spec["dtype"])
    cfg = RelaxConfig.model_validate(
        {
            "run": {"output_dir": spec["out"], "trace": False, "tensorboard": False},
            "train": {"micro_batch_size": 8, "lr": spec["lr"]},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": 8},
        }
    )
    backend = build_backend("torch", config=cfg, model_path=spec["model"])
    senders = {
        m: WeightSender(
            g["init"], 2, group_name=f"delta-bench-{m}", timeout_s=600, delta=m == "delta", full_every=10**9
        )
        for m, g in spec["groups"].items()
    }
    for m in MODES:  # (the receivers connect in this order too)
        senders[m].connect()
    _say("ready")
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "quit":
            break
        version, order = int(cmd[1]), cmd[2].split(",")
        if version:
            backend.train_step(batch(version, spec["vocab"]))
        named = [(n, t.detach().to(dtype).contiguous()) for n, t in backend.named_weights()]
        want = digest(named)
        for m in order:
            t0 = _now()
            st = senders[m].broadcast(named, version)
            _say("sent", m, version, t0, _now(), st.num_bytes, st.full_bytes or st.num_bytes, want)
    for s in senders.values():
        s.close()


def run_engine(spec: dict) -> None:
    """A real TorchEngine in ``spec['dtype']``, loading every version its group brings."""
    from relax_core.dcs import WeightReceiver
    from relax_rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine(model_path=spec["model"], dtype=spec["dtype"], eos_token_ids=[1], pad_token_id=0)
    g = spec["groups"][spec["mode"]]
    mine = WeightReceiver(g["init"], 2, 1, group_name=f"delta-bench-{spec['mode']}", timeout_s=600)
    mine.connect()

    def load(version: int, tensors: dict) -> None:
        engine.update_weights(tensors, version)
        (_, pause), *_ = engine.pauses.drain()
        got = digest([(n, p) for n, p in engine.named_weights() if n in tensors])
        _say("got", spec["mode"], version, _now(), pause, got)

    mine.start_background(load)
    mine.join()
    mine.check()
    mine.close()


def worker_main(spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    (run_trainer if spec["role"] == "trainer" else run_engine)(spec)


# ---- the driver ----


def measure(driver: Driver, steps: int) -> dict[str, dict[str, list[float]]]:
    """Versions 0 (full for both) .. ``steps``; per mode the bytes, full bytes, sync and pause seconds of
    versions 1..steps. Raises on a version an engine holds differently from the trainer."""
    out: dict[str, dict[str, list[float]]] = {
        m: {"sent": [], "full": [], "sync_s": [], "pause_s": []} for m in MODES
    }
    for v in range(steps + 1):
        order = MODES if v % 2 == 0 else MODES[::-1]
        driver.procs["trainer"].popen.stdin.write(f"step {v} {','.join(order)}\n")
        driver.procs["trainer"].popen.stdin.flush()
        sent, got = {}, {}
        while len(sent) < 2 or len(got) < 2:
            _, f = driver.next_line(f"version {v}")
            if f[0] == "sent" and int(f[2]) == v:
                sent[f[1]] = (float(f[3]), int(f[5]), int(f[6]), f[7])
            elif f[0] == "got" and int(f[2]) == v:
                got[f[1]] = (float(f[3]), float(f[4]), f[5])
        for m in MODES:
            t0, nbytes, full, want = sent[m]
            at, pause, have = got[m]
            if have != want:
                raise RuntimeError(f"version {v}: the {m} engine holds {have}, the trainer sent {want}")
            if v:
                rows = out[m]
                rows["sent"].append(nbytes)
                rows["full"].append(full)
                rows["sync_s"].append(at - t0)
                rows["pause_s"].append(pause)
    return out


def one_run(cluster, tmp: Path, model: str, args, dtype: str, path: str, port: int) -> dict:
    """Trainer on node 0, both engines on node 1 (``network``) or 0 (``loopback``); groups at ``port``, +1."""
    node = 1 if path == "network" else 0
    host = f"{SUBNET}.1" if path == "network" else "127.0.0.1"
    groups = {m: {"init": f"tcp://{host}:{port + k}"} for k, m in enumerate(MODES)}
    driver = Driver(cluster, tmp, 0, args.timeout_s, script=Path(__file__))
    common = {"model": model, "dtype": dtype, "groups": groups}
    try:
        driver.start(
            "trainer",
            0,
            {
                "role": "trainer",
                "lr": args.lr,
                "out": str(tmp / f"run-{dtype}-{path}"),
                "vocab": SHAPES[args.shape]["vocab_size"],
                **common,
            },
        )
        for m in MODES:
            driver.start(f"engine-{m}", node, {"role": "engine", "mode": m, **common})
        driver.wait_ready(["trainer"])
        return measure(driver, args.steps)
    finally:
        driver.stop()


def spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="52m")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--paths", default="loopback,network")
    ap.add_argument("--nic-gbit", type=float, default=0, help="cap every node's egress (0: uncapped)")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    preflight(args.nic_gbit)
    from relax_testing.netns import NetnsCluster

    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"# command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"# machine: {machine()}")
    print(f"# date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load before: {uptime()}")
    names = {"bf16": "bfloat16", "fp32": "float32"}
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        NetnsCluster(
            2, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET, temp_dir=f"{tmp}/none", start_ray=False
        ) as cluster,
    ):
        model = build_model(Path(tmp) / "model", args.shape)
        if args.nic_gbit:
            cap_egress(cluster, args.nic_gbit)
        for path in args.paths.split(","):
            for d in args.dtypes.split(","):
                port = 29700 + 2 * len(rows)  # (a pair of fresh ports per run)
                res = one_run(cluster, Path(tmp), model, args, names[d], path, port)
                full_mb = res["full"]["full"][0] / 1e6
                for m in MODES:
                    r = res[m]
                    share = [s / f for s, f in zip(r["sent"], r["full"])]
                    rows.append(
                        f"| {path} | {d} | {m} | {full_mb:.1f} | {spread(share, '.3f')} | "
                        f"{spread(r['sync_s'], '.3f')} | {spread(r['pause_s'], '.4f')} |"
                    )
                sync = statistics.median(res["delta"]["sync_s"]) / statistics.median(res["full"]["sync_s"])
                pause = statistics.median(res["delta"]["pause_s"]) / statistics.median(res["full"]["pause_s"])
                rows.append(f"| {path} | {d} | delta / full | | | {sync:.2f} | {pause:.2f} |")
    print(f"# load after: {uptime()}")
    cap = f"each node's egress capped at {args.nic_gbit:g} Gbit/s" if args.nic_gbit else "uncapped veths"
    print(
        f"# shape {args.shape}, lr {args.lr:g}, versions 1..{args.steps} after a full version 0 (each engine's "
        f"weights checked bitwise against the trainer's after every version: all equal); {cap}\n"
    )
    print("| path | dtype | mode | MB a version | bytes sent / full | sync s | engine pause s |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
