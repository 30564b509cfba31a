"""Build (once) and cache everything the CPU demo's RL run starts from.

Why a cache keyed by a hash of every setting plus ``CODE_VERSION``: the warm start costs about a
minute on 2 cores, and ``relax train`` with no config should start RL at once the second time.
Changing any setting, or bumping ``CODE_VERSION`` when this package's output changes, gives a new
directory instead of silently reusing stale assets.

Everything is written as ordinary files — JSONL prompt data and HF checkpoint directories — so the
RL run loads them through the same ``--prompt-data`` / ``--hf-checkpoint`` paths a user's run takes.
Each cache entry is built in a temporary directory and renamed into place, so an interrupted build
never looks cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CODE_VERSION = "relax-demo-assets-v3"  # v3: warm start with eager attention on CPU
MANIFEST = "manifest.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoSettings:
    """Every knob that changes the demo's assets (all of them enter the cache key)."""

    seed: int = 0
    max_operand: int = 99
    n_eval: int = 500
    vocab_size: int = 320
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 64
    sft_steps: int = 1500
    """At most this many warm-start steps (fewer once ``sft_target_accuracy`` is reached)."""
    sft_target_accuracy: float | None = 0.3
    """Stop the warm start once greedy accuracy on a probe of training problems reaches this."""
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    max_answer_tokens: int = 8
    eval_samples: int = 8

    MODEL_SHAPE = (
        "hidden_size num_layers num_heads num_kv_heads head_dim intermediate_size max_position_embeddings seed"
    ).split()
    """The fields that are :func:`~relax_app.demo.model.build_tiny_qwen3`'s arguments."""

    def model_shape(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.MODEL_SHAPE}

    def key(self) -> str:
        """Short hash of the settings and ``CODE_VERSION``: the cache directory's name."""
        blob = json.dumps({"code": CODE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DemoAssets:
    """Paths the RL run needs, and the warm start's measured held-out accuracy."""

    train_path: Path
    eval_path: Path
    base_model_dir: Path
    sft_model_dir: Path
    sft_accuracy: float
    cached: bool
    manifest: dict = field(default_factory=dict, compare=False)


def _assets_from(root: Path, manifest: dict, cached: bool) -> DemoAssets:
    return DemoAssets(
        train_path=root / "data" / "train.jsonl",
        eval_path=root / "data" / "eval.jsonl",
        base_model_dir=root / "base",
        sft_model_dir=root / "sft",
        sft_accuracy=manifest["sft_greedy_accuracy"],
        cached=cached,
        manifest=manifest,
    )


def _build(root: Path, s: DemoSettings) -> dict:
    """Write task, tokenizer + base model, and SFT checkpoint under ``root``; return the manifest."""
    import torch
    from transformers import AutoTokenizer

    from relax_app.demo.evaluate import greedy_accuracy, sampled_accuracy
    from relax_app.demo.model import build_tiny_qwen3, count_parameters
    from relax_app.demo.sft import sft_warm_start
    from relax_app.demo.task import make_arithmetic_task, read_jsonl
    from relax_app.demo.tokenizer import train_tokenizer
    from relax_core.models import load_model

    torch.set_num_threads(min(2, torch.get_num_threads()))
    files = make_arithmetic_task(root / "data", seed=s.seed, max_operand=s.max_operand, n_eval=s.n_eval)
    rows = read_jsonl(files.train_path)
    tokenizer = train_tokenizer((r["prompt"] + r["label"] for r in rows), vocab_size=s.vocab_size)
    model = build_tiny_qwen3(tokenizer, root / "base", **s.model_shape())
    log.info("demo: warm start, at most %d SFT steps on %d problems", s.sft_steps, len(rows))
    start = time.perf_counter()
    sft_dir = sft_warm_start(
        root / "base",
        files.train_path,
        root / "sft",
        steps=s.sft_steps,
        batch_size=s.sft_batch_size,
        lr=s.sft_lr,
        seed=s.seed,
        max_answer_tokens=s.max_answer_tokens,
        target_accuracy=s.sft_target_accuracy,
    )
    sft_log = json.loads((sft_dir / "sft_log.json").read_text())
    sft_seconds = time.perf_counter() - start
    sft = load_model(sft_dir)
    tok = AutoTokenizer.from_pretrained(str(sft_dir))
    greedy = greedy_accuracy(sft, tok, files.eval_path)
    sampled = sampled_accuracy(sft, tok, files.eval_path, n_samples=s.eval_samples, seed=s.seed)
    log.info("demo: warm start done in %.0fs, held-out greedy accuracy %.1f%%", sft_seconds, 100 * greedy)
    return {
        "code_version": CODE_VERSION,
        "key": s.key(),
        "settings": asdict(s),
        "num_parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "num_train": len(rows),
        "num_eval": s.n_eval,
        "sft_seconds": round(sft_seconds, 2),
        "sft_steps_taken": sft_log["steps"],
        "sft_greedy_accuracy": greedy,
        "sft_sampled_accuracy": sampled.mean,
        f"sft_pass_at_{sampled.k}": sampled.pass_at_k,
    }


def prepare_demo(cache_dir: str | Path, seed: int = 0, **settings) -> DemoAssets:
    """Return the demo's assets, building them under ``cache_dir/<key>/`` unless already there.

    ``settings`` are the fields of :class:`DemoSettings` (e.g. ``sft_steps=1500``, ``max_operand=99``).
    """
    unknown = set(settings) - set(DemoSettings.__dataclass_fields__)
    if unknown:
        raise TypeError(f"prepare_demo got unknown settings {sorted(unknown)}; see DemoSettings")
    s = DemoSettings(seed=seed, **settings)
    cache = Path(cache_dir)
    root = cache / s.key()
    if (root / MANIFEST).is_file():
        return _assets_from(root, json.loads((root / MANIFEST).read_text()), cached=True)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{s.key()}-", dir=cache))
    try:
        manifest = _build(tmp, s)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished the same build first: use theirs
            if not (root / MANIFEST).is_file():
                raise
            return _assets_from(root, json.loads((root / MANIFEST).read_text()), cached=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _assets_from(root, manifest, cached=False)
