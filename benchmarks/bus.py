"""relax-bus vs TransferQueue vs ray.util.queue vs memcpy, side by side, same payloads. One command:

    uv run --group bench python benchmarks/bus.py [--reps 5] [--iters 20] [--skip tq]

Payloads: batches of 64 samples with input_ids int64[1024], log_probs float32[1024], scalar reward
(~0.79 MB); a large-tensor case of 4 samples with float32[2M] (32 MB). Put and get throughput (MB/s and
samples/s, median of --reps repetitions with min-max spread) and a one-sample round trip (put + get + ack).
TransferQueue runs in polling mode with one storage unit (its defaults hang on 2 CPUs). relax-bus Ray runs
twice: the default same-node fast path (Unix socket + shared-memory files), and with ``fast_local=False``
(actor calls + the object store, the path a process on another node takes). Each backend gets one untimed
put + get first (connection and actor start-up are not throughput).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import numpy as np

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def batch(kind: str, start: int = 0) -> list[dict]:
    if kind == "small":
        return [
            {
                "input_ids": np.arange(1024, dtype=np.int64) + i,
                "log_probs": np.zeros(1024, np.float32),
                "reward": float(i),
            }
            for i in range(start, start + 64)
        ]
    return [{"pixels": np.full(2 * 1024 * 1024, i, np.float32)} for i in range(start, start + 4)]


def nbytes(samples: list[dict]) -> int:
    return sum(v.nbytes if isinstance(v, np.ndarray) else 8 for s in samples for v in s.values())


class Memcpy:
    name = "memcpy (limit)"

    def setup(self, kind):
        self.dst = self.out = None

    def put(self, samples):
        if self.dst is None:
            self.dst = [
                {k: np.empty_like(v) for k, v in s.items() if isinstance(v, np.ndarray)} for s in samples
            ]
        for s, d in zip(samples, self.dst):
            for k, a in d.items():
                np.copyto(a, s[k])

    def get(self, n):  # read the bytes back out: one more copy of every array
        if getattr(self, "out", None) is None:
            self.out = [{k: np.empty_like(a) for k, a in d.items()} for d in self.dst]
        for d, o in zip(self.dst, self.out):
            for k, a in d.items():
                np.copyto(o[k], a)
        return n

    def roundtrip(self, s):
        self.put(s)

    def close(self):
        pass


class RelaxBus:
    def __init__(self, ray_backend: bool, fast_local: bool = True):
        self.ray, self.fast_local = ray_backend, fast_local
        self.name = "relax-bus in-process"
        if ray_backend:
            how = "same node: socket + shm" if fast_local else "actor calls + object store"
            self.name = f"relax-bus Ray ({how})"

    def setup(self, kind):
        from relax_bus import BusConfig, ConsumerSpec, DataBus, RayBus

        cfg = BusConfig(consumers={"c": ConsumerSpec()}, capacity=100_000)
        self.bus = (
            RayBus.create(cfg, num_storage_units=2, fast_local=self.fast_local) if self.ray else DataBus(cfg)
        )

    def put(self, samples):
        self.bus.put(samples)

    def get(self, n):
        b = self.bus.get("c", n, timeout=60)
        for v in b.data.values():  # touch the data like a consumer would
            v[-1]
        self.bus.ack("c", b.lease_id)
        return len(b)

    def roundtrip(self, s):
        self.bus.put(s)
        self.get(1)

    def close(self):
        if self.ray:
            self.bus.kill()


class RayQueue:
    name = "ray.util.queue.Queue"

    def setup(self, kind):
        from ray.util.queue import Queue

        self.q = Queue()

    def put(self, samples):
        self.q.put(samples)

    def get(self, n):
        got = 0
        while got < n:
            got += len(self.q.get(timeout=60))
        return got

    def roundtrip(self, s):
        self.q.put(s)
        self.q.get(timeout=60)

    def close(self):
        self.q.shutdown()


class TQ:
    name = "TransferQueue (polling, 1 unit)"

    def setup(self, kind):
        import torch
        import transfer_queue as tq
        from omegaconf import OmegaConf

        if not hasattr(TQ, "client"):
            tq.init(
                OmegaConf.create(
                    {
                        "controller": {"polling_mode": True},
                        "backend": {"SimpleStorage": {"num_data_storage_units": 1}},
                    }
                )
            )
            TQ.client = tq.get_client()
        self.torch, self.part, self.k = torch, f"p{time.monotonic_ns()}", 0
        self.fields = ["input_ids", "log_probs", "reward"] if kind == "small" else ["pixels"]

    def put(self, samples):
        from tensordict import TensorDict

        td = {f: self.torch.from_numpy(np.stack([np.asarray(s[f]) for s in samples])) for f in self.fields}
        self.client.put(TensorDict(td, batch_size=len(samples)), partition_id=self.part)

    def get(self, n):
        got = 0
        while got < n:
            meta = self.client.get_meta(self.fields, n - got, self.part, task_name="bench")
            if meta.size == 0 if hasattr(meta, "size") else len(meta) == 0:
                time.sleep(0.001)
                continue
            data = self.client.get_data(meta)
            got += data.batch_size[0]
        return got

    def roundtrip(self, s):
        self.put(s)
        self.get(1)

    def close(self):
        self.client.clear_partition(self.part)


def measure(backend, kind: str, iters: int, reps: int) -> dict:
    per = batch(kind)
    mb = nbytes(per) / 1e6
    puts, gets, rts = [], [], []
    for _ in range(reps):
        backend.setup(kind)
        backend.put(batch(kind, -len(per)))  # warm-up (first-call set-up is not throughput), not timed
        backend.get(len(per))
        data = [batch(kind, i * len(per)) for i in range(iters)]
        t = time.perf_counter()
        for d in data:
            backend.put(d)
        puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in data:
            backend.get(len(per))
        gets.append(time.perf_counter() - t)
        if kind == "small":
            one = batch("small")[:1]
            backend.roundtrip(one)  # warm
            lat = []
            for _ in range(50):
                t = time.perf_counter()
                backend.roundtrip(one)
                lat.append(time.perf_counter() - t)
            rts.append(statistics.median(lat) * 1e3)
        backend.close()
    put_mbs = [iters * mb / s for s in puts]
    get_mbs = [iters * mb / s for s in gets]
    row = {
        "put": put_mbs,
        "get": get_mbs,
        "sps_put": [v / mb * len(per) for v in put_mbs],
        "sps_get": [v / mb * len(per) for v in get_mbs],
        "rt": rts,
    }
    return row


def fmt(vals: list[float], digits: int = 0) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip", nargs="*", default=[])
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    backends = [Memcpy(), RelaxBus(False), RelaxBus(True), RelaxBus(True, fast_local=False), RayQueue()]
    if "tq" not in args.skip:
        backends.append(TQ())
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    print(f"# reps={args.reps} iters={args.iters}; median (min-max)")
    print("| backend | case | put MB/s | get MB/s | put samples/s | get samples/s | 1-sample round trip ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("small", "large"):
        for b in backends:
            try:
                r = measure(b, kind, args.iters if kind == "small" else max(args.iters // 4, 3), args.reps)
            except Exception as e:  # noqa: BLE001 - report and keep going
                print(
                    f"| {b.name} | {kind} | failed: {type(e).__name__}: {str(e)[:80]} | | | | |", flush=True
                )
                continue
            print(
                f"| {b.name} | {'64 x 12 KB' if kind == 'small' else '4 x 8 MB'} | {fmt(r['put'])} | "
                f"{fmt(r['get'])} | {fmt(r['sps_put'])} | {fmt(r['sps_get'])} | {fmt(r['rt'], 2)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
