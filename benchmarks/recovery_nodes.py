"""Recovery times when a whole node is lost: killed, or cut off the network (#40). Needs root (CI's).

    uv run python benchmarks/recovery_nodes.py [--reps 3] [--steps 5] [--heartbeat-timeout-s 6]

Three Ray nodes, each a Linux network namespace with its own address (``relax_testing.netns``, the real
``ray start``); a fully-async run of the CPU demo's warm-started tiny Qwen3 (8 prompts x 4 samples a step,
--max-staleness 1, checkpointed every step) with ``--role-nodes``: the rollout on node 1, the trainer on
node 2, the forward roles, the bus and the driver on the head. After step 2, one fault per run, the two
kinds alternating:

- **kill**: every process of the trainer's node SIGKILLed (its raylet with them); the node's Ray is
  started again afterwards, as an operator would;
- **cut**: the rollout's node's link taken down for 2 x --heartbeat-timeout-s, then up again.

Per fault (median and min-max over --reps): ``detect``, the fault → the health manager's decision (a
killed node: its actors' calls fail; a cut one: the heartbeat goes unanswered for --heartbeat-timeout-s);
``restart``, the decision → the role serving again on the driver's node (a new process, its model, its
state: the trainer's checkpoint or the rollout's journal, the current weights); ``total``. Every run must
train exactly the prompts of the first uninterrupted run (checked). Machine and load are printed.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from relax_app.demo.assets import prepare_demo
from relax_testing import netns
from relax_testing.netns_driver import after_step, drive

ROLES = {"rollout": "10.77.0.2", "actor": "10.77.0.3", "reference": "10.77.0.1", "actor_fwd": "10.77.0.1"}


def flags(assets, out: Path, steps: int, timeout_s: float) -> list[str]:
    pairs = {
        "prompt-data": assets.train_path,
        "hf-checkpoint": assets.sft_model_dir,
        "num-rollout": steps,
        "rollout-batch-size": 8,
        "n-samples-per-prompt": 4,
        "global-batch-size": 16,  # (two optimizer steps a batch: ActorFwd runs)
        "rollout-max-response-len": 6,
        "micro-batch-size": 64,
        "lr": 2e-4,
        "kl-coef": 0.01,  # (the reference runs)
        "max-staleness": 1,
        "eval-interval": "none",
        "torch-threads": 1,
        "save": out / "ckpt",
        "save-interval": 1,
        "heartbeat-timeout-s": timeout_s,
        "role-nodes": ",".join(f"{r}={a}" for r, a in ROLES.items()),
        "output-dir": out,
    }
    argv = ["--fully-async", "--no-progress", "--no-trace", "--no-tensorboard"]
    for k, v in pairs.items():
        argv += [f"--{k}", str(v)]
    return argv


def prompts(record: dict) -> collections.Counter:
    return collections.Counter(p for step in record["audit"]["trained_prompts"] for p in step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--heartbeat-timeout-s", type=float, default=6.0)
    args = ap.parse_args()
    if why := netns.available():
        raise SystemExit(f"recovery_nodes.py needs network namespaces: {why}")
    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"machine: {cpu}, {os.cpu_count()} cores, {platform.python_version()}; load {os.getloadavg()}")
    results: dict[str, dict[str, list[float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        netns.NetnsCluster(3, ray_args={k: ["--num-cpus=2"] for k in range(3)}) as cluster,
    ):
        base = drive(cluster, Path(tmp) / "base", flags(assets, Path(tmp) / "base", args.steps, 6.0))
        trainer_node, rollout_node = cluster.nodes[2], cluster.nodes[1]
        for rep in range(args.reps):
            for kind in ("kill", "cut") if rep % 2 == 0 else ("cut", "kill"):
                out = Path(tmp) / f"{kind}{rep}"
                fault_at: list[float] = []

                def fault(out: Path, kind=kind, fault_at=fault_at) -> None:
                    after_step(out, 2)
                    fault_at.append(time.time())
                    if kind == "kill":
                        trainer_node.kill()
                        return
                    rollout_node.link(up=False)
                    time.sleep(2 * args.heartbeat_timeout_s)
                    rollout_node.link(up=True)

                record = drive(cluster, out, flags(assets, out, args.steps, args.heartbeat_timeout_s), fault)
                events = record["audit"]["health"]
                role = "actor" if kind == "kill" else "rollout"
                if [(e["role"], e["action"]) for e in events] != [(role, "restart")]:
                    raise RuntimeError(f"{kind}: expected one restart of the {role}, got {events}")
                if prompts(record) != prompts(base) or len(set(record["audit"]["trained_ids"])) != len(
                    record["audit"]["trained_ids"]
                ):
                    raise RuntimeError(f"{kind}: trained samples lost or repeated")
                detect = float(events[0]["at"]) - fault_at[0]
                restart = float(events[0]["recovery_s"])
                row = results.setdefault(kind, collections.defaultdict(list))
                for k, v in (("detect_s", detect), ("restart_s", restart), ("total_s", detect + restart)):
                    row[k].append(v)
                print(f"{kind} rep {rep}: detect {detect:.1f} s, restart {restart:.1f} s", flush=True)
                for node in (trainer_node, rollout_node):  # (back in the cluster for the next run)
                    if node.ip not in cluster.alive_addresses():
                        node.kill()
                        cluster.ray_start(node)
                cluster.wait_for_nodes(3)
    for kind, row in results.items():
        cells = [f"{k} {statistics.median(v):.1f} s [{min(v):.1f}-{max(v):.1f}]" for k, v in row.items()]
        print(f"{kind:5s} " + "  ".join(cells))
    print(
        f"load after: {os.getloadavg()}; {subprocess.run(['uptime'], capture_output=True, text=True).stdout}"
    )


if __name__ == "__main__":
    main()
