"""Elastic rollout: generation throughput before and after a scale-out, and how long scaling takes.

    uv run python benchmarks/elastic.py [--reps 5] [--batch 64] [--new-tokens 32] [--max-engines 2]

The CPU demo's warm-started tiny Qwen3 served by ray_native engines (each its own process on a local Ray
cluster, one torch thread), behind the engine pool the rollout role uses and the elastic REST API. Per
engine count (1 .. --max-engines, grown by POST /elastic/scale_out): --reps batches of --batch demo
prompts, --new-tokens sampled tokens each (EOS suppressed so every batch does the same work); throughput
= generated tokens / wall time per batch, median and min-max. Also timed: each scale-out (request →
operation succeeded: process start, model load, current weights) and a scale-in back to one engine issued
while a batch is generating (drain + re-issue). CPU-bound: on a 2-core machine two engines can at most
double throughput, minus what the driver and HTTP take. Writes benchmarks/results/elastic.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _wait(base: str, op_id: str) -> dict:
    while True:
        with urllib.request.urlopen(f"{base}/elastic/operations/{op_id}", timeout=60) as r:
            op = json.loads(r.read())
        if op["state"] in ("succeeded", "failed", "cancelled"):
            return op
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-engines", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray
    from transformers import AutoTokenizer

    from relax_app.demo.assets import prepare_demo
    from relax_app.demo.task import read_jsonl
    from relax_rollout.elastic import ElasticService, make_elastic_server
    from relax_rollout.engines import SamplingParams
    from relax_rollout.engines.pool import EnginePool
    from relax_rollout.server.served import ray_launcher

    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    model = str(assets.sft_model_dir)
    tok = AutoTokenizer.from_pretrained(model)
    rows = read_jsonl(assets.train_path)[: args.batch]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    params = SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, temperature=1.0)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False, log_to_driver=False)
    launch, kill = ray_launcher(model, torch_threads=1)
    pool = EnginePool(launch=launch, kill=kill)
    pool.membership.start(1)
    httpd = make_elastic_server(ElasticService(pool, drain_timeout_s=5.0))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = "http://{}:{}".format(*httpd.server_address[:2])

    def measure() -> list[float]:
        pool.generate(prompts[:8], params)  # warm-up
        rates = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            outs = pool.generate(prompts, params)
            rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        return rates

    result: dict = {"throughput_tok_s": {}, "scale_out_s": {}}
    result["throughput_tok_s"][1] = measure()
    for n in range(2, args.max_engines + 1):
        t0 = time.perf_counter()
        op = _wait(base, _post(base, "/elastic/scale_out", {"num_replicas": n})["id"])
        assert op["state"] == "succeeded", op
        result["scale_out_s"][n] = time.perf_counter() - t0
        result["throughput_tok_s"][n] = measure()
    # scale in while a long batch (8x) is being generated: its requests on the removed engine drain
    gen = threading.Thread(target=pool.generate, args=(prompts * 8, params))
    gen.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    op = _wait(base, _post(base, "/elastic/scale_in", {"num_replicas": 1})["id"])
    result["scale_in_s"] = time.perf_counter() - t0
    gen.join()
    result["batch_s_during_scale_in"] = time.perf_counter() - t0
    result["pool"] = pool.stats()
    base1 = statistics.median(result["throughput_tok_s"][1])
    for n, rates in result["throughput_tok_s"].items():
        med = statistics.median(rates)
        print(
            f"{n} engine(s): {med:.0f} tokens/s [{min(rates):.0f}-{max(rates):.0f}] ({med / base1:.2f}x)"
            + (f"; scale-out took {result['scale_out_s'][n]:.1f} s" if n in result["scale_out_s"] else "")
        )
    print(
        f"scale-in to 1 while generating: {result['scale_in_s']:.1f} s ({op['state']}); pool: {result['pool']}"
    )
    result["load"] = os.getloadavg()
    out = Path(__file__).parent / "results" / "elastic.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    httpd.shutdown()
    pool.close(kill=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
