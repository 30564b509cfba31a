"""The omni-modal CPU demo (`relax train --omni-demo`): multimodal RL end to end on a laptop.

A tiny random-weight Qwen3-Omni thinker (``mm_models``), the locally trained tokenizer extended with its
media tokens, and generated image / video / audio multiple-choice questions (``mm_task``), mixed in every
rollout batch, through the same roles and bus as the text demo (either mode). What it shows is the path —
media into placeholders and features, engine and trainer agreeing on log-probs, the bus carrying media
tensors between processes — not learning: random weights on a 300-token vocabulary need far more than a
few steps to answer these questions. Assets are cached under ``.relax_cache/omni-<settings>/``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from relax_app.demo.mm_task import MM_BUDGET, MM_KEYS, REWARD

OMNI_DEFAULTS: dict[str, object] = {
    "multimodal_keys": MM_KEYS,
    "multimodal_options": MM_BUDGET,
    "metadata_key": "metadata",
    "rm_type": REWARD,
    "rollout_batch_size": 6,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 6,
    "num_rollout": 5,
    "micro_batch_size": 12,
    "lr": 1e-3,
    "weight_decay": 0.0,  # (the library's defaults are a real run's: the demo sets what it relies on)
    "adam_beta2": 0.99,
    "output_dir": "runs/omni-demo",
}


def prepare_omni_demo(cache_dir: str | Path, seed: int = 0, n_per_task: int = 16) -> tuple[str, str]:
    """(checkpoint dir, prompt jsonl), built under ``cache_dir`` on first use."""
    from relax_app.demo.mm_models import build_tiny_mm_model, extend_tokenizer
    from relax_app.demo.mm_task import write_mm_dataset
    from relax_app.demo.tokenizer import train_tokenizer

    root = Path(cache_dir) / f"omni-s{seed}-n{n_per_task}"
    manifest = root / "manifest.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        return m["model"], m["data"]
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".omni-", dir=cache_dir))
    try:
        data = write_mm_dataset(root / "task", n_per_task=n_per_task, seed=seed)
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        texts = [r["prompt"] + " Answer: " + r["label"] for r in rows]
        tok = extend_tokenizer(train_tokenizer(texts * 4, vocab_size=320), "qwen3_omni")
        build_tiny_mm_model("qwen3_omni", tok, out_dir=tmp / "model", seed=seed)
        shutil.move(str(tmp / "model"), str(root / "model"))
        manifest.write_text(
            json.dumps({"model": str((root / "model").resolve()), "data": str(data.resolve())})
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    m = json.loads(manifest.read_text())
    return m["model"], m["data"]
