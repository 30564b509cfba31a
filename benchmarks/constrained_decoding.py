"""What constrained decoding (``SamplingParams.constraint``, llguidance) costs the torch engine per token, on
the demo-sized model (Qwen3 shape of ``relax_app.demo``: hidden 128, 4 layers, a 320-token byte-level BPE).
One command:

    uv run --frozen python benchmarks/constrained_decoding.py [--new 64] [--reps 5] [--batch 1 8]

Every case generates exactly ``--new`` tokens per row (plain: EOS suppressed with ``min_new_tokens``;
constrained: a regex / JSON string longer than ``--new`` tokens can reach, so no row ends early), so the
times compare like for like: median wall time per decode step and per generated token, plain vs regex vs
JSON schema, on the batch path (``TorchEngine.generate``) and the continuous batcher. On a shared machine
the wall-time difference is noisy; ``in-guide`` is the time spent inside the constrained-decoding calls
themselves (mask computation and application, matcher advance) per generated token, which is the cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager

SPENT = [0.0]  # seconds inside the constrained-decoding calls


@contextmanager
def timed_guide():
    """Time :meth:`Guide.mask_logits` and :meth:`GuidedRow.advance` into ``SPENT`` while inside."""
    from relax_rollout.engines import constrained

    originals = constrained.Guide.mask_logits, constrained.GuidedRow.advance

    def wrap(fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                SPENT[0] += time.perf_counter() - t0

        return timed

    constrained.Guide.mask_logits, constrained.GuidedRow.advance = map(wrap, originals)
    try:
        yield
    finally:
        constrained.Guide.mask_logits, constrained.GuidedRow.advance = originals


CASES = {
    "plain": None,
    "regex": ("regex", "[a-z]{400}"),
    "json_schema": (
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 400}},
                "required": ["text"],
            }
        ),
    ),
}


def build_engine():
    import torch

    from relax_app.demo.model import build_tiny_qwen3
    from relax_app.demo.tokenizer import train_tokenizer
    from relax_rollout.engines.torch_engine import TorchEngine

    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="relax-constrained-bench-")
    corpus = [f"{a}+{b}={a + b}" for a in range(100) for b in range(0, 100, 7)]
    tok = train_tokenizer(corpus, out, vocab_size=320)
    build_tiny_qwen3(tok, out_dir=out, max_position_embeddings=512)  # the demo's shape otherwise
    return TorchEngine(model_path=out), tok


def run(engine, tok, kind, batch: int, new: int, reps: int, continuous: bool) -> tuple[float, float]:
    """(median seconds per decode step of ``batch`` rows, seconds in the guide per generated token)."""
    from relax_rollout.engines.base import Constraint, SamplingParams
    from relax_rollout.engines.continuous import ContinuousBatcher

    constraint = Constraint(*CASES[kind]) if CASES[kind] else None
    p = SamplingParams(max_new_tokens=new, min_new_tokens=new, seed=0, constraint=constraint)
    prompts = [tok.encode(f"{i}+{i}=") for i in range(batch)]
    batcher = ContinuousBatcher(engine, max_running=batch) if continuous else None
    gen = batcher.generate if batcher else engine.generate
    try:
        gen(prompts, p)  # warm-up (and the grammar compiled once)
        times = []
        SPENT[0] = 0.0
        with timed_guide():
            for _ in range(reps):
                t0 = time.perf_counter()
                outs = gen(prompts, p)
                times.append(time.perf_counter() - t0)
                assert all(len(o.token_ids) == new for o in outs), [len(o.token_ids) for o in outs]
    finally:
        if batcher:
            batcher.close()
    return statistics.median(times) / new, SPENT[0] / (reps * new * batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    engine, tok = build_engine()
    print(f"demo-sized model, {len(tok)} tokens, {args.new} new tokens per row, median of {args.reps}")
    print(
        f"{'path':<11} {'batch':>5} {'case':<12} {'ms/step':>8} {'ms/token':>9} {'wall diff/token':>15} {'in-guide/token':>15}"
    )
    for continuous in (False, True):
        for batch in args.batch:
            base = None
            for kind in CASES:
                step, guide = run(engine, tok, kind, batch, args.new, args.reps, continuous)
                base = step if base is None else base
                diff = "" if kind == "plain" else f"{(step - base) / batch * 1e3:+.3f} ms"
                inside = "" if kind == "plain" else f"{guide * 1e3:.3f} ms"
                path = "continuous" if continuous else "batch"
                print(
                    f"{path:<11} {batch:>5} {kind:<12} {step * 1e3:>8.2f} {step / batch * 1e3:>9.3f} "
                    f"{diff:>15} {inside:>15}"
                )


if __name__ == "__main__":
    main()
