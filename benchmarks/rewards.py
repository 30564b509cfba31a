"""Math reward throughput: relax-rewards vs math-verify on the same 10k responses.

    uv run --frozen python benchmarks/rewards.py            # 10k responses, 3 repeats
    uv run --frozen python benchmarks/rewards.py --n 2000 --repeats 5

Measures samples/s of
  1. ``relax_rewards.math.math_reward`` called in a plain loop (sequential),
  2. ``Scorer("math", isolation="thread", max_concurrency=8)`` (the default scorer),
  3. ``Scorer("math", isolation="process", max_concurrency=<cores>)`` (killable workers),
  4. math-verify alone: ``verify(parse(gold), parse(response))`` in a loop,
and reports the median of the repeats with the min–max spread, agreement between the two graders,
and the machine (cores, load average from ``uptime`` before and after). The responses are generated
from a fixed seed: a realistic mix of boxed integers, fractions, decimals, LaTeX, symbolic forms,
"Answer:" lines, wrong answers and a few unboxed ones.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import time


def make_inputs(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, labels = [], []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(2, 99)
        kind = i % 10
        wrong = rng.random() < 0.4
        if kind <= 2:  # integers
            label, pred = str(a), str(a + (1 if wrong else 0))
        elif kind == 3:  # fractions vs decimals
            label, pred = (
                rf"\frac{{{a}}}{{{b}}}",
                (
                    str(round(a / b + (1 if wrong else 0), 8))
                    if b in (2, 4, 5, 8, 10, 20, 25, 50)
                    else rf"\dfrac{{{a + wrong}}}{{{b}}}"
                ),
            )
        elif kind == 4:  # surds
            label, pred = rf"{a}\sqrt{{2}}", rf"\sqrt{{{2 * a * a + (1 if wrong else 0)}}}"
        elif kind == 5:  # polynomial forms
            label, pred = f"(x+{b})^2", f"x^2+{2 * b + (1 if wrong else 0)}x+{b * b}"
        elif kind == 6:  # thousands separators / units
            label, pred = str(a * 1000), rf"{a},{0 if not wrong else 1:03d} \text{{ dollars}}"
        elif kind == 7:  # tuples
            label, pred = f"({a}, {b})", f"({a},{b + (1 if wrong else 0)})"
        elif kind == 8:  # pi
            label, pred = (
                rf"\frac{{{a}\pi}}{{{b}}}",
                rf"\frac{{{a}}}{{{b}}}\pi" if not wrong else rf"\frac{{{a}}}{{{b + 1}}}\pi",
            )
        else:  # percentages
            label, pred = f"{a}", rf"{a + (1 if wrong else 0)}\%"
        filler = "Let me think step by step. " * rng.randint(5, 40)
        if i % 17 == 0:
            response = f"{filler}\nAnswer: ${pred}$"
        else:
            response = rf"{filler}So the final answer is $\boxed{{{pred}}}$."
        responses.append(response)
        labels.append(label)
    return responses, labels


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except OSError:
        return "uptime unavailable: loadavg {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def timed(fn, repeats: int, n: int) -> tuple[list[float], object]:
    rates, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        rates.append(n / (time.perf_counter() - start))
    return rates, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--skip-math-verify", action="store_true")
    args = parser.parse_args()

    from relax_rewards import Scorer
    from relax_rewards.math import math_reward

    responses, labels = make_inputs(args.n)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cores={os.cpu_count()} python={platform.python_version()}"
    )
    print(f"load before: {load()}")
    math_reward(r"\boxed{\sqrt{8}}", r"2\sqrt{2}")  # import sympy outside the timings

    rows = []
    seq_rates, ours = timed(
        lambda: [math_reward(r, g).score for r, g in zip(responses, labels)], args.repeats, args.n
    )
    rows.append(("relax-rewards math, sequential", seq_rates))
    thread_scorer = Scorer("math", timeout_s=10.0, max_concurrency=8)
    rates, _ = timed(lambda: thread_scorer.score_batch(responses, labels), args.repeats, args.n)
    rows.append(("relax-rewards Scorer, 8 threads", rates))
    with Scorer("math", timeout_s=10.0, max_concurrency=args.workers, isolation="process") as proc_scorer:
        rates, proc_out = timed(lambda: proc_scorer.score_batch(responses, labels), args.repeats, args.n)
    rows.append((f"relax-rewards Scorer, {args.workers} processes", rates))
    assert [r.score for r in proc_out] == ours, "process scorer disagrees with sequential"

    agreement = None
    if not args.skip_math_verify:
        from math_verify import parse, verify

        def run_mv():
            return [float(bool(verify(parse("$" + g + "$"), parse(r)))) for r, g in zip(responses, labels)]

        rates, theirs = timed(run_mv, args.repeats, args.n)
        rows.append(("math-verify, sequential", rates))
        agreement = sum(a == b for a, b in zip(ours, theirs)) / args.n

    print(f"load after: {load()}")
    print(
        f"\n{args.n} responses, {args.repeats} repeats, {sum(ours) / args.n:.1%} scored correct by relax-rewards"
    )
    print(f"| {'grader':<38} | median samples/s | min–max |")
    print(f"|{'-' * 40}|-----------------:|--------:|")
    for name, r in rows:
        print(f"| {name:<38} | {statistics.median(r):>16,.0f} | {min(r):,.0f}–{max(r):,.0f} |")
    if agreement is not None:
        print(f"\nagreement relax-rewards vs math-verify on these inputs: {agreement:.2%}")


if __name__ == "__main__":
    main()
