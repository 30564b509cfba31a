"""The torch engine's continuous batching vs its batch path, on heavy-tailed response lengths.

The rollout's long tail: 32 prompts whose responses are Pareto-distributed in length (4..256 tokens). The
batch path (``TorchEngine.generate``, one call) runs as many decode steps as the longest response with
every row in the batch; the continuous batcher (``engines/continuous.py``) lets each sequence leave when it
is done, so the rows shrink as the tail thins. Both produce the same useful tokens (each response of its
drawn length); reported: useful tokens per second, median and spread of --repeats, and the ratio. Also
transformers' own continuous batching (``init_continuous_batching``, paged attention) where it runs here.

The model: a Qwen3 of 4 layers, hidden 256, vocabulary 2048 (random weights, float32): large enough that a
decode step is not noise on a CPU core, small enough for CI-class machines.

    uv run python benchmarks/continuous_batching.py               # 3 repeats
    uv run python benchmarks/continuous_batching.py --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_rollout.engines import SamplingParams
from relax_rollout.engines.continuous import ContinuousBatcher
from relax_rollout.engines.torch_engine import TorchEngine

EOS = 1


def model(device: str) -> Qwen3ForCausalLM:
    from relax_testing import tiny_qwen3_config

    torch.manual_seed(0)
    shape = dict(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8
    )
    cfg = Qwen3Config(
        **tiny_qwen3_config(**shape, num_key_value_heads=4, head_dim=32),
        max_position_embeddings=1024,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return Qwen3ForCausalLM(cfg).to(device).eval()


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 2048, int(rng.integers(16, 48))).tolist() for _ in range(n)]
    lengths = np.clip((rng.pareto(1.5, n) + 1) * 8, 4, 256).astype(int).tolist()
    lengths[0] = 256  # (the tail reaches the bound once, as a long reasoning response does)
    return prompts, lengths


def batch_path(eng: TorchEngine, prompts, lengths) -> float:
    # one call: decode steps to the longest response for every row (an earlier end saves nothing: the
    # finished rows stay in the batch until the call returns)
    longest = max(lengths)
    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_new_tokens=longest, min_new_tokens=longest, seed=1))
    return time.perf_counter() - t0


def continuous(eng: TorchEngine, prompts, lengths, running: int) -> float:
    b = ContinuousBatcher(eng, max_running=running)
    try:
        t0 = time.perf_counter()
        futures = [
            b.submit(p, SamplingParams(max_new_tokens=n, min_new_tokens=n, seed=1 + i))
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        outs = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    finally:
        b.close()
    assert [len(o.token_ids) for o in outs] == lengths
    return wall


def transformers_cb(m, prompts, lengths) -> float:
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=True, max_new_tokens=max(lengths), eos_token_id=-1, pad_token_id=0)
    manager = m.init_continuous_batching(generation_config=gc)
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
        left = set(ids)
        while left:
            out = manager.get_result(timeout=60)
            if out is None:
                raise TimeoutError("transformers' continuous batching returned nothing for 60 s")
            if out.is_finished():
                left.discard(out.request_id)
        return time.perf_counter() - t0
    finally:
        manager.stop(block=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/continuous_batching.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = model(args.device)
    eng = TorchEngine(model=m, eos_token_ids=[EOS], pad_token_id=0, device=args.device)
    prompts, lengths = workload(args.prompts)
    useful = sum(lengths)
    print(
        f"{len(prompts)} prompts, response lengths median {int(np.median(lengths))}, max {max(lengths)}, "
        f"sum {useful} (the batch path computes {len(prompts) * max(lengths)} rows x steps)"
    )
    runs: dict[str, list[float]] = {"batch": [], "continuous": [], "transformers_cb": []}
    notes = {}
    continuous(eng, prompts[:2], [4, 4], 2)  # warm-up
    for _ in range(args.repeats):  # alternating, so drift hits both alike
        runs["batch"].append(batch_path(eng, prompts, lengths))
        runs["continuous"].append(continuous(eng, prompts, lengths, running=len(prompts)))
        if "transformers_cb" not in notes:
            try:
                runs["transformers_cb"].append(transformers_cb(m, prompts, lengths))
            except Exception as e:  # noqa: BLE001 - recorded: whether it serves this machine is the question
                notes["transformers_cb"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    result = {
        "machine": f"{platform.machine()}, {args.threads} torch threads, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
        "useful_tokens": useful,
        "notes": notes,
    }
    for k, walls in runs.items():
        if walls:
            tps = [useful / w for w in walls]
            result[k] = {
                "median_tok_s": statistics.median(tps),
                "min": min(tps),
                "max": max(tps),
                "n": len(tps),
            }
            print(
                f"{k:16s} {statistics.median(tps):9.1f} tok/s  (min {min(tps):.1f}, max {max(tps):.1f}, n {len(tps)})"
            )
    if result.get("continuous") and result.get("batch"):
        result["continuous_over_batch"] = (
            result["continuous"]["median_tok_s"] / result["batch"]["median_tok_s"]
        )
        print(f"continuous / batch: {result['continuous_over_batch']:.2f}x")
    for k, v in notes.items():
        print(f"{k}: not measured ({v})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
