"""The engine server under SGLang's own ``bench_serving``: one HTTP layer against another, side by side.

    uv run python benchmarks/serving.py [--before REV] [--reps 3] [--prompts 64] [--concurrency 16]

Serves the CPU demo's warm-started tiny Qwen3 (``python -m relax_rollout.server``, one torch thread) from
two source trees — ``before``: a git worktree of ``--before`` (default: the last commit whose servers ran
on ``http.server``), ``after``: this checkout — and drives each, interleaved round by round, with SGLang
0.5.23's ``bench_serving`` (the real-SGLang venv, ``bash tools/sglang-cpu/setup.sh``), unmodified:
``sglang`` (``/generate``) and ``sglang-oai-chat`` (``/v1/chat/completions``), streaming on (its
default), ``--concurrency`` requests in flight, random token-id prompts of 8 tokens (the demo model's context is 64). Two output
lengths: 16 tokens (rollout-like: the engine's time dominates) and 1 token (the HTTP layer's own cost
shows most). Per tree, backend and length: request throughput, median and p99 end-to-end latency —
median over rounds and min-max. Writes benchmarks/results/serving.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "5756b18"
"""The last commit with both servers on ``http.server`` (the ASGI layer came after it)."""
BACKENDS = ("sglang", "sglang-oai-chat")
DRIVER = """
import json, sys
from sglang.benchmark.serving import cli_main
out, runs = sys.argv[1], json.loads(sys.argv[2])
for backend, output_len, flags in runs:
    sys.argv = ["bench_serving", "--backend", backend, "--random-output-len", str(output_len), *flags,
                "--output-file", out]
    cli_main()
"""


def start_server(src: Path, model: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relax_rollout.server",
            "--model",
            model,
            "--port",
            "0",
            "--torch-threads",
            "1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "listening on " in line:
            return proc, line.split("listening on ")[1].strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the engine server from {src} did not start within 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help="git revision of the 'before' tree")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    from relax_app.demo.assets import prepare_demo
    from relax_rollout.engines.sglang_cpu import require_python

    sglang_python = require_python()
    model = str(prepare_demo(ROOT / ".relax_cache").sft_model_dir)
    work = Path(tempfile.mkdtemp(prefix="relax-serving-"))
    before = work / "before"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.before], check=True
    )
    trees = {"before": before, "after": ROOT}
    flags = [
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        "8",
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(args.prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--seed",
        "1",
        "--tokenizer",
        model,
        "--model",
        model,
        "--disable-tqdm",
    ]
    runs = [(b, n, flags) for n in (16, 1) for b in BACKENDS]
    results: dict[str, dict[str, list[dict]]] = {t: {} for t in trees}
    try:
        for rep in range(args.reps):
            for name, tree in trees.items():
                proc, url = start_server(tree / "packages" / "relax-rollout" / "src", model)
                out = work / f"{name}-{rep}.jsonl"
                try:
                    r = subprocess.run(
                        [
                            sglang_python,
                            "-c",
                            DRIVER,
                            str(out),
                            json.dumps([(b, n, [*f, "--base-url", url]) for b, n, f in runs]),
                        ],
                        capture_output=True,
                        text=True,
                        timeout=1800,
                        env={**os.environ, "HF_HUB_OFFLINE": "1"},
                        cwd=work,
                    )
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
                if r.returncode != 0:
                    raise RuntimeError(
                        f"bench_serving failed against {name}:\n{(r.stdout + r.stderr)[-3000:]}"
                    )
                for (backend, n, _), line in zip(runs, out.read_text().splitlines()):
                    row = json.loads(line)
                    assert row["completed"] == args.prompts, row
                    results[name].setdefault(f"{backend} out={n}", []).append(row)
                print(f"round {rep + 1}/{args.reps} {name}: done", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)

    def stat(rows: list[dict], key: str) -> dict:
        xs = [r[key] for r in rows]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    table = {}
    for case in results["after"]:
        table[case] = {}
        for name in trees:
            rows = results[name][case]
            table[case][name] = {
                k: stat(rows, k)
                for k in ("request_throughput", "median_e2e_latency_ms", "p99_e2e_latency_ms")
            }
        b, a = table[case]["before"], table[case]["after"]
        table[case]["after/before throughput"] = (
            a["request_throughput"]["median"] / b["request_throughput"]["median"]
        )
        print(
            f"{case:24s}",
            "  ".join(
                f"{name}: {t['request_throughput']['median']:.2f} req/s "
                f"[{t['request_throughput']['min']:.2f}-{t['request_throughput']['max']:.2f}] "
                f"p50 {t['median_e2e_latency_ms']['median']:.0f} ms p99 {t['p99_e2e_latency_ms']['median']:.0f} ms"
                for name, t in ((n, table[case][n]) for n in trees)
            ),
            f" after/before {table[case]['after/before throughput']:.3f}",
        )
    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "before": args.before,
        "reps": args.reps,
        "prompts": args.prompts,
        "concurrency": args.concurrency,
        "cases": table,
    }
    path = ROOT / "benchmarks" / "results" / "serving.json"
    path.parent.mkdir(parents=True, exist_ok=True)  # (ignored by git: a fresh clone has no such folder)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
