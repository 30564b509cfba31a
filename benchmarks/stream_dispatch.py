"""Streaming's requests over two engine servers: where each one-prompt call goes, before and after.

    uv run python benchmarks/stream_dispatch.py [--before REV] [--reps 3] [--requests 64] [--concurrency 32]

Streaming rollout sends one prompt a call, many calls at once. Before 95de073 the engine pool sent every
such call to its first member and the ``external`` engine to its first server, through an executor of one
thread per server (two requests in flight in all here); after, each goes to the least loaded, the external
engine's first chunk in the caller's thread. Two engine servers (``python -m relax_rollout.server``, one
torch thread each, the CPU demo's warm-started tiny Qwen3) serve both trees; a driver process imports the
pool or the external engine from ``before`` (a git worktree of ``--before``) or ``after`` (this checkout)
and sends ``--requests`` one-prompt calls from ``--concurrency`` threads (16 new tokens each, sampled),
rounds interleaved. Per tree and engine: calls per second, median and min-max over rounds, and how the
calls split over the two servers (from their ``/metrics``). Writes benchmarks/results/stream_dispatch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import ROOT, start_server  # noqa: E402

BEFORE = "2a700ed"
"""The last commit before least-loaded dispatch."""
DRIVER = """
import json, random, sys, time
from concurrent.futures import ThreadPoolExecutor
from relax_rollout.engines.base import SamplingParams
kind, urls, requests, concurrency = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if kind == "pool":
    from relax_rollout.engines.pool import EnginePool
    engine = EnginePool(urls)
else:
    from relax_rollout.engines.external import ExternalEngine
    engine = ExternalEngine(urls=urls)
rng = random.Random(0)
prompts = [[rng.randrange(3, 60) for _ in range(8)] for _ in range(requests)]
sp = SamplingParams(max_new_tokens=16, min_new_tokens=16, temperature=1.0)
t0 = time.perf_counter()
with ThreadPoolExecutor(concurrency) as ex:
    outs = list(ex.map(lambda p: engine.generate([p], sp)[0], prompts))
wall = time.perf_counter() - t0
assert all(len(o.token_ids) == 16 for o in outs)
print(json.dumps({"wall_s": wall}))
"""


def served(url: str) -> int:
    """Requests the server has answered (its ``/metrics`` latency count)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return int(float(re.search(r"^sglang:e2e_request_latency_seconds_count\S* (\S+)$", text, re.M).group(1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help="git revision of the 'before' tree")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    from relax_app.demo.assets import prepare_demo

    model = str(prepare_demo(ROOT / ".relax_cache").sft_model_dir)
    work = Path(tempfile.mkdtemp(prefix="relax-dispatch-"))
    before = work / "before"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.before], check=True
    )
    trees = {"before": before, "after": ROOT}
    servers = [start_server(ROOT / "packages" / "relax-rollout" / "src", model) for _ in range(2)]
    urls = [u for _, u in servers]
    results: dict[str, list[dict]] = {}
    try:
        for rep in range(args.reps):
            for kind in ("pool", "external"):
                for name, tree in trees.items():
                    src = os.pathsep.join(str(p) for p in sorted((tree / "packages").glob("*/src")))
                    counts = [served(u) for u in urls]
                    r = subprocess.run(
                        [
                            sys.executable,
                            "-c",
                            DRIVER,
                            kind,
                            json.dumps(urls),
                            str(args.requests),
                            str(args.concurrency),
                        ],
                        capture_output=True,
                        text=True,
                        timeout=1200,
                        env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"},
                    )
                    if r.returncode != 0:
                        raise RuntimeError(
                            f"the {kind} driver of {name} failed:\n{(r.stdout + r.stderr)[-3000:]}"
                        )
                    row = json.loads(r.stdout.strip().splitlines()[-1])
                    row["per_server"] = [served(u) - c for u, c in zip(urls, counts)]
                    results.setdefault(f"{kind} {name}", []).append(row)
                    print(f"round {rep + 1}/{args.reps} {kind} {name}: {row}", flush=True)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=30)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)

    table = {}
    for case, rows in results.items():
        rates = [args.requests / r["wall_s"] for r in rows]
        table[case] = {
            "calls_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
            "per_server": [r["per_server"] for r in rows],
        }
    for kind in ("pool", "external"):
        b, a = table[f"{kind} before"], table[f"{kind} after"]
        ratio = a["calls_per_s"]["median"] / b["calls_per_s"]["median"]
        table[f"{kind} after/before"] = ratio
        for name, t in (("before", b), ("after", a)):
            c = t["calls_per_s"]
            print(
                f"{kind:8s} {name:6s} {c['median']:.2f} calls/s [{c['min']:.2f}-{c['max']:.2f}]",
                f"per server {t['per_server'][0]}",
            )
        print(f"{kind:8s} after/before {ratio:.2f}x")
    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "before": args.before,
        "reps": args.reps,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "cases": table,
    }
    path = ROOT / "benchmarks" / "results" / "stream_dispatch.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
