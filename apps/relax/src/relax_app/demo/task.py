"""The demo's task: two-number addition, written as ordinary JSONL prompt data.

Why addition: the reward is exact (string match), problems are cheap to generate, and a tiny model
learns it only partially in a short warm start, which leaves room for RL to show a gain in minutes.

Why a split by *unordered* pair: a model that saw ``45+23=68`` has effectively seen ``23+45=``.
Holding out ``{a, b}`` removes both orders from training, so held-out accuracy measures the skill,
not recall. Files are plain JSONL rows ``{"prompt", "label", "id"}`` so the RL run reads them
through the same ``--prompt-data f.jsonl --input-key prompt --label-key label`` path a user's does.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TaskFiles:
    """Paths of the generated split (JSONL, one problem per line)."""

    train_path: Path
    eval_path: Path


def problem_row(a: int, b: int) -> dict[str, str]:
    """One problem as a data row: ``{"prompt": "23+45=", "label": "68", "id": "23+45"}``."""
    return {"prompt": f"{a}+{b}=", "label": str(a + b), "id": f"{a}+{b}"}


def split_pairs(
    max_operand: int, n_eval: int, seed: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Return (train, eval) ordered problems, disjoint by unordered pair.

    Eval holds ``n_eval`` unordered pairs, each asked in one random order; train holds every ordered
    problem whose unordered pair is not held out. Deterministic given ``seed``.
    """
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1 (got {max_operand})")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(a, max_operand + 1)]
    if not 0 < n_eval < len(pairs):
        raise ValueError(
            f"n_eval must be in [1, {len(pairs) - 1}] for max_operand={max_operand} (got {n_eval})"
        )
    rng = random.Random(seed)
    rng.shuffle(pairs)
    held, kept = pairs[:n_eval], set(pairs[n_eval:])
    eval_problems = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in held]
    train = [
        (a, b)
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if (min(a, b), max(a, b)) in kept
    ]
    rng.shuffle(train)
    return train, eval_problems


def _write_jsonl(path: Path, problems: list[tuple[int, int]]) -> None:
    with path.open("w") as f:
        for a, b in problems:
            f.write(json.dumps(problem_row(a, b)) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """Read JSONL rows (the format written here and accepted by ``--prompt-data``)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def make_arithmetic_task(
    out_dir: str | Path, seed: int = 0, max_operand: int = 99, n_eval: int = 500
) -> TaskFiles:
    """Write ``train.jsonl`` and ``eval.jsonl`` for "a+b=" problems with a, b in [0, max_operand]."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, eval_problems = split_pairs(max_operand, n_eval, seed)
    files = TaskFiles(train_path=out / "train.jsonl", eval_path=out / "eval.jsonl")
    _write_jsonl(files.train_path, train)
    _write_jsonl(files.eval_path, eval_problems)
    return files
