"""Weight sync (DCS) across nodes: network-namespace nodes on this one machine, against loopback (#40).
One command, as root (it makes network namespaces):

    uv run python benchmarks/weight_sync_nodes.py --reps 5 --model-mb 160 --buckets-mb 16,64,256 --shard-bucket-mb 64

(and the same with ``--nic-gbit 2`` for nodes whose sending is capped like a NIC's).

Nodes: three Linux network namespaces ``wsn0..2`` at ``10.79.0.1..3`` on the bridge ``wsbr0``
(:class:`relax_testing.netns.NetnsCluster`'s network, without its Ray: nothing here needs Ray). Every
sender and receiver is its own process started inside its node (``ip netns exec``), one torch thread each;
a group's rendezvous is the sending rank's node address, so its gloo group binds that node's address and
the bytes cross the veths and the bridge. The loopback rows run the same processes all on node 0 with the
rendezvous at 127.0.0.1. The weights are random float32 tensors shaped like the decoder layers of the
model ``benchmarks/weight_sync.py`` builds (Qwen3 architecture, hidden 512, intermediate 1536: 12.6 MB a
layer), as many layers as come closest to --model-mb.

What is measured, per sync: the bytes each receiver gets, the seconds from the first sender starting
``WeightSender.broadcast`` until the last receiver has copied every tensor into its own (what an engine
does on a weight load), and GB/s = bytes / seconds. Sender and receivers stamp CLOCK_MONOTONIC, one clock
for every namespace of the machine.

(a) one sender on node 0 → one receiver on node 1 and one on node 2, at each of --buckets-mb
    (``bucket_bytes``). Expected: larger buckets cost fewer collectives and the sender's concatenation of
    the bucket more; over the bridge each packet also crosses two veths and the bridge, more kernel work
    per byte than loopback on the same CPUs, so the network rows are slower. With two receivers gloo's
    broadcast root sends each its own copy, so with --nic-gbit a sync takes about 2 × bytes / cap.
(b) one sender vs parallel senders, the lesson of veRL #7167 (a sync bound by one sender's NIC): the same
    bytes sent by 1 sender on node 0, or by 2 trainer ranks (nodes 0 and 1) each sending the half of the
    layers it owns on a group of its own, to --b-receivers receiver processes on node 2 that each join both
    groups; timed until every receiver has all the bytes. Expected: with --nic-gbit (each node's egress
    capped by a token bucket, ``tc tbf``) two senders take about half the time of one; uncapped, the veths
    are bound by the CPUs, not a NIC, and on a 2-core machine the second sender gains little or nothing.

Modes alternate per repetition (the order reversed every other one) after one untimed sync of each (it
carries the layout and warms gloo's connections); median and min–max over --reps. Everything it made (the
processes, the namespaces, the bridge) is removed at the end, on error or Ctrl-C too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX, BRIDGE, SUBNET = "wsn", "wsbr0", "10.79.0"
"""This benchmark's namespaces, bridge and subnet: apart from the tests' (``relaxn*``, relaxbr0, 10.77.0)."""
TAG = "@@ "
"""Workers' report lines start with this; anything else on their stdout is ignored."""
LAYER_SHAPES = {
    "input_layernorm.weight": (512,),
    "self_attn.q_proj.weight": (512, 512),
    "self_attn.k_proj.weight": (256, 512),
    "self_attn.v_proj.weight": (256, 512),
    "self_attn.o_proj.weight": (512, 512),
    "self_attn.q_norm.weight": (64,),
    "self_attn.k_norm.weight": (64,),
    "post_attention_layernorm.weight": (512,),
    "mlp.gate_proj.weight": (1536, 512),
    "mlp.up_proj.weight": (1536, 512),
    "mlp.down_proj.weight": (512, 1536),
}
"""One Qwen3 decoder layer at hidden 512, 8 heads of 64, 4 KV heads (``benchmarks/weight_sync.py``'s)."""


def layer_bytes() -> int:
    return sum(4 * _numel(s) for s in LAYER_SHAPES.values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_tensors(layers: int) -> list[tuple[str, object]]:
    """The layer stack, random float32 (seed 0: every sender holds the same weights)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [
        (f"model.layers.{i}.{name}", torch.randn(shape, generator=g))
        for i in range(layers)
        for name, shape in LAYER_SHAPES.items()
    ]


def split_half(items: list) -> tuple[list, list]:
    """The tensors in order, cut where the bytes before the cut first reach half (one trainer rank's
    shard each)."""
    total = sum(t.numel() * t.element_size() for _, t in items)
    acc = 0
    for k, (_, t) in enumerate(items):
        acc += t.numel() * t.element_size()
        if acc * 2 >= total:
            return items[: k + 1], items[k + 1 :]
    return items, []


def _say(*fields: object) -> None:
    sys.stdout.write(TAG + " ".join(str(f) for f in fields) + "\n")
    sys.stdout.flush()


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # (one clock for all namespaces of the machine)


# ---- workers: one process per sender or receiver, started inside its node ----


def run_sender(spec: dict) -> None:
    """Rank 0 of one group: holds the model, sends ``all`` / ``first`` / ``second`` half on command."""
    from relax_core.dcs import WeightSender

    items = model_tensors(spec["layers"])
    first, second = split_half(items)
    parts = {"all": items, "first": first, "second": second}
    sender = WeightSender(spec["init"], spec["world"], group_name=spec["group"], timeout_s=600)
    sender.connect()
    _say("ready")
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "quit":
            break
        version, bucket, part = int(cmd[1]), int(cmd[2]), cmd[3]
        sender.bucket_bytes = bucket
        t0 = _now()
        st = sender.broadcast(parts[part], version)
        _say("sent", version, t0, _now(), st.num_bytes)
    sender.close()


def run_receiver(spec: dict) -> None:
    """One engine-like process in one or more groups (one per sending rank): copies every version into
    its own tensors and reports when it has."""
    import torch

    from relax_core.dcs import WeightReceiver

    held: dict[str, torch.Tensor] = {}
    lock = threading.Lock()
    receivers = [
        WeightReceiver(g["init"], g["world"], g["rank"], group_name=g["group"], timeout_s=600)
        for g in spec["groups"]
    ]
    for r in receivers:  # (the same order in every receiver: each connect is its group's rendezvous)
        r.connect()

    def loader(group: str):
        def load(version: int, tensors: dict[str, torch.Tensor]) -> None:
            n = 0
            for name, t in tensors.items():
                with lock:
                    dst = held.setdefault(name, torch.empty_like(t))
                dst.copy_(t)
                n += t.numel() * t.element_size()
            with lock:
                _say("got", group, version, _now(), n)

        return load

    for g, r in zip(spec["groups"], receivers):
        r.start_background(loader(g["group"]))
    for r in receivers:
        r.join()
    for r in receivers:
        r.check()
        r.close()


def worker_main(spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    (run_sender if spec["role"] == "sender" else run_receiver)(spec)


# ---- the driver, in the root namespace ----


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class Mode:
    """One kind of sync: which senders send which part, which (receiver, group) must report it."""

    label: str
    path: str
    """``network`` or ``loopback``."""
    bucket: int
    sends: list[tuple[str, str]]
    """(sender process, part)."""
    expect: list[tuple[str, str]]
    """(receiver process, group)."""
    secs: list[float] = field(default_factory=list)
    nbytes: int = 0


class Driver:
    """Starts workers inside nodes and talks to them over their stdin/stdout."""

    def __init__(
        self, cluster, logdir: Path, layers: int, timeout_s: float, script: Path = Path(__file__)
    ) -> None:
        """``script``: what the workers run (``script --worker SPEC``; weight_delta_sync.py's are its own)."""
        self.cluster, self.logdir, self.layers, self.timeout_s = cluster, logdir, layers, timeout_s
        self.script = script.resolve()
        self.procs: dict[str, Proc] = {}
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.version = 0

    def start(self, name: str, node: int, spec: dict) -> None:
        log = self.logdir / f"{name}.log"
        argv = [sys.executable, str(self.script), "--worker", json.dumps(spec)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen(
            self.cluster.nodes[node].exec_argv(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            bufsize=1,
            env=env,
        )
        self.procs[name] = Proc(name, p, log)

        lines = self.lines  # (this part's queue: stop() gives the next part a new one)

        def read() -> None:
            for line in p.stdout:
                if line.startswith(TAG):
                    lines.put((name, line[len(TAG) :].strip()))
            lines.put((name, None))

        threading.Thread(target=read, daemon=True).start()

    def sender(self, name: str, node: int, group: str, init: str, world: int) -> None:
        self.start(
            name,
            node,
            {"role": "sender", "group": group, "init": init, "world": world, "layers": self.layers},
        )

    def receiver(self, name: str, node: int, groups: list[dict]) -> None:
        self.start(name, node, {"role": "receiver", "groups": groups})

    def next_line(self, what: str) -> tuple[str, list[str]]:
        try:
            name, line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"no word from the workers in {self.timeout_s:.0f} s while waiting for {what}"
            ) from None
        if line is None:
            proc = self.procs[name]
            tail = proc.log.read_text()[-3000:] if proc.log.exists() else ""
            raise RuntimeError(f"worker {name} exited while waiting for {what}; its log ends:\n{tail}")
        return name, line.split()

    def wait_ready(self, senders: list[str]) -> None:
        left = set(senders)
        while left:
            name, f = self.next_line(f"the groups to form ({sorted(left)} not connected)")
            if f[0] == "ready":
                left.discard(name)

    def sync(self, mode: Mode) -> tuple[float, int]:
        """One sync: (seconds from the first send to the last receiver's copy, bytes each receiver got)."""
        self.version += 1
        v = self.version
        for sender, part in mode.sends:
            self.procs[sender].popen.stdin.write(f"send {v} {mode.bucket} {part}\n")
            self.procs[sender].popen.stdin.flush()
        starts, done, got = [], {}, {}
        while len(starts) < len(mode.sends) or len(done) < len(mode.expect):
            name, f = self.next_line(f"version {v} ({mode.label}, {mode.path})")
            if f[0] == "sent" and int(f[1]) == v:
                starts.append(float(f[2]))
            elif f[0] == "got" and int(f[2]) == v:
                done[(name, f[1])] = float(f[3])
                got[name] = got.get(name, 0) + int(f[4])
        if set(done) != set(mode.expect):
            raise RuntimeError(f"version {v}: reports from {sorted(done)}, expected {sorted(mode.expect)}")
        sizes = set(got.values())
        if len(sizes) != 1:
            raise RuntimeError(f"version {v}: the receivers got different byte counts {got}")
        return max(done.values()) - min(starts), sizes.pop()

    def stop(self) -> None:
        """Senders close (the shutdown handshake), receivers then leave; each waited for."""
        for p in self.procs.values():
            if p.popen.poll() is None and p.popen.stdin:
                try:
                    p.popen.stdin.write("quit\n")
                    p.popen.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs.values():
            try:
                p.popen.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        self.procs = {}
        self.lines = (
            queue.Queue()
        )  # (their last lines and end-of-output marks: the next part's readers start afresh)


def measure(driver: Driver, modes: list[Mode], reps: int) -> None:
    for m in modes:  # untimed: carries the layout, opens gloo's connections
        driver.sync(m)
    for rep in range(reps):
        for m in modes if rep % 2 == 0 else modes[::-1]:
            s, n = driver.sync(m)
            m.secs.append(s)
            m.nbytes = n


def part_a(driver: Driver, buckets: list[int], reps: int) -> list[Mode]:
    """One sender on node 0 → receivers on nodes 1 and 2; and the same on node 0 over loopback."""
    ip = driver.cluster.nodes[0].ip
    for path, host, port, nodes in (("network", ip, 29500, (1, 2)), ("loopback", "127.0.0.1", 29501, (0, 0))):
        group, init = f"a_{path}", f"tcp://{host}:{port}"
        driver.sender(f"{group}_s", 0, group, init, 3)
        for rank, node in enumerate(nodes, start=1):
            driver.receiver(
                f"{group}_r{rank}", node, [{"group": group, "init": init, "world": 3, "rank": rank}]
            )
    driver.wait_ready(["a_network_s", "a_loopback_s"])
    modes = [
        Mode(
            "1 sender (node 0) → nodes 1, 2"
            if path == "network"
            else "1 sender → 2 receivers, all on node 0",
            path,
            b,
            [(f"a_{path}_s", "all")],
            [(f"a_{path}_r1", f"a_{path}"), (f"a_{path}_r2", f"a_{path}")],
        )
        for b in buckets
        for path in ("network", "loopback")
    ]
    measure(driver, modes, reps)
    driver.stop()
    return modes


def part_b(driver: Driver, bucket: int, receivers: int, reps: int) -> list[Mode]:
    """The same bytes from 1 sender (node 0) or 2 senders (nodes 0, 1, half each, a group each) to
    receivers on node 2 that join both groups; and the same all on node 0 over loopback."""
    nodes = driver.cluster.nodes
    world = receivers + 1
    modes: list[Mode] = []
    senders: list[str] = []
    for path, port in (("network", 29510), ("loopback", 29520)):
        hosts = (nodes[0].ip, nodes[1].ip) if path == "network" else ("127.0.0.1", "127.0.0.1")
        sender_nodes, recv_node = ((0, 1), 2) if path == "network" else ((0, 0), 0)
        groups = []
        for k, (host, node) in enumerate(zip(hosts, sender_nodes)):
            group, init = f"b_{path}_{'AB'[k]}", f"tcp://{host}:{port + k}"
            driver.sender(f"{group}_s", node, group, init, world)
            senders.append(f"{group}_s")
            groups.append({"group": group, "init": init, "world": world})
        recvs = [f"b_{path}_r{r}" for r in range(1, world)]
        for r, name in enumerate(recvs, start=1):
            driver.receiver(name, recv_node, [{**g, "rank": r} for g in groups])
        a, b = f"b_{path}_A", f"b_{path}_B"
        where = "node 2" if path == "network" else "node 0"
        modes.append(
            Mode(
                f"1 sender → {receivers} receivers on {where}",
                path,
                bucket,
                [(f"{a}_s", "all")],
                [(n, a) for n in recvs],
            )
        )
        modes.append(
            Mode(
                f"2 senders, half each → {receivers} receivers on {where}",
                path,
                bucket,
                [(f"{a}_s", "first"), (f"{b}_s", "second")],
                [(n, g) for n in recvs for g in (a, b)],
            )
        )
    driver.wait_ready(senders)
    measure(driver, modes, reps)
    driver.stop()
    return modes


def cap_egress(cluster, gbit: float) -> None:
    """Every node's sending capped at ``gbit`` Gbit/s (a token bucket on its veth), like a NIC's."""
    for node in cluster.nodes:
        argv = [
            "tc",
            "qdisc",
            "add",
            "dev",
            node.veth,
            "root",
            "tbf",
            "rate",
            f"{gbit}gbit",
            "burst",
            "4mb",
            "latency",
            "100ms",
        ]
        out = subprocess.run(node.exec_argv(argv), capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {node.name} failed: {out.stderr.strip()}")


def table(rows: list[Mode]) -> list[str]:
    out = ["| sync | path | bucket MB | MB per receiver | median s | min–max s | GB/s (median) |"]
    out.append("|---|---|---|---|---|---|---|")
    for m in rows:
        med = statistics.median(m.secs)
        out.append(
            f"| {m.label} | {m.path} | {m.bucket / 1e6:.0f} | {m.nbytes / 1e6:.1f} | {med:.3f} | "
            f"{min(m.secs):.3f}–{max(m.secs):.3f} | {m.nbytes / med / 1e9:.2f} |"
        )
    return out


def machine() -> str:
    cpu = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    import torch

    return (
        f"{cpu}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, 1 torch thread per process"
    )


def preflight(nic_gbit: float) -> None:
    if os.geteuid() != 0:
        raise SystemExit(
            "weight_sync_nodes.py makes network namespaces and a bridge: run it as root "
            "(e.g. `sudo -E .venv/bin/python benchmarks/weight_sync_nodes.py ...`)"
        )
    for tool in ["ip", *(["tc"] if nic_gbit else [])]:
        if shutil.which(tool) is None:
            raise SystemExit(
                f"weight_sync_nodes.py needs `{tool}` (iproute2): install it, e.g. apt-get install iproute2"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model-mb", type=float, default=160, help="float32 layer stack of about this size")
    ap.add_argument("--buckets-mb", default="16,64,256", help="bucket sizes for part (a), comma-separated")
    ap.add_argument("--shard-bucket-mb", type=float, default=64, help="bucket size for part (b)")
    ap.add_argument("--b-receivers", type=int, default=2, help="receiver processes on node 2 in part (b)")
    ap.add_argument("--nic-gbit", type=float, default=0, help="cap every node's egress (0: uncapped)")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    preflight(args.nic_gbit)
    from relax_testing.netns import NetnsCluster

    layers = max(1, round(args.model_mb * 1e6 / layer_bytes()))
    buckets = [int(float(b) * 1e6) for b in args.buckets_mb.split(",")]
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (so the teardown below runs)
    print(f"# command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"# machine: {machine()}")
    print(f"# date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load before: {uptime()}")
    with (
        tempfile.TemporaryDirectory() as tmp,
        NetnsCluster(
            3, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET, temp_dir=f"{tmp}/none", start_ray=False
        ) as cluster,
    ):
        driver = Driver(cluster, Path(tmp), layers, args.timeout_s)
        try:
            if args.nic_gbit:
                cap_egress(cluster, args.nic_gbit)
            a = part_a(driver, buckets, args.reps)
            b = part_b(driver, int(args.shard_bucket_mb * 1e6), args.b_receivers, args.reps)
        finally:
            for p in driver.procs.values():  # (on error: the namespaces' teardown kills what is left)
                if p.popen.poll() is None:
                    p.popen.kill()
                    p.popen.wait()
    print(f"# load after: {uptime()}")
    cap = (
        f"each node's egress capped at {args.nic_gbit:g} Gbit/s (tc tbf)"
        if args.nic_gbit
        else "uncapped veths"
    )
    print(
        f"# model: {layers} Qwen3 layers (hidden 512), {layers * layer_bytes() / 1e6:.1f} MB float32; "
        f"nodes {', '.join(n for n in (f'{SUBNET}.{k}' for k in (1, 2, 3)))} on {BRIDGE}, {cap}; "
        f"{args.reps} reps\n"
    )
    print("## (a) one sender → receivers on two other nodes, by bucket size\n")
    print("\n".join(table(a)))
    for bk in buckets:
        net, lo = (
            statistics.median(m.secs)
            for p in ("network", "loopback")
            for m in a
            if m.bucket == bk and m.path == p
        )
        print(f"\n{bk / 1e6:.0f} MB buckets: network / loopback time {net / lo:.2f}", end="")
    print("\n\n## (b) one sender vs two senders (half each), the same bytes\n")
    print("\n".join(table(b)))
    for path in ("network", "loopback"):
        one, two = (statistics.median(m.secs) for m in b if m.path == path)
        print(f"\n{path}: 1 sender / 2 senders time {one / two:.2f}", end="")
    print()


if __name__ == "__main__":
    main()
