"""Damaged multimodal rows are skipped and counted (``bad_media_rows``), each named, never trained as if they
were whole (issue 36): a truncated WAV (libsndfile read the part that is there without a word), an image
given as a dict that names no data, and a prompt marking ``<image>`` whose image column is empty (the
marker trained as plain text). The real path: the rollout's prompt source and relax-multimodal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _tiny import mm_task, run_flags

pytest.importorskip("relax_multimodal")


def test_three_damaged_media_rows_are_counted_and_named(tmp_path):
    from transformers import AutoTokenizer

    from relax_app.cli_config import build_config
    from relax_app.demo.mm_models import build_tiny_mm_model, extend_tokenizer
    from relax_app.demo.mm_task import write_mm_dataset
    from relax_app.demo.tokenizer import train_tokenizer
    from relax_core.controller import RunInputs
    from relax_rollout.prompts import Prompts

    ckpt = tmp_path / "ckpt"
    tok = extend_tokenizer(
        train_tokenizer(["What colour is the shape? Answer: A red"] * 20, vocab_size=300), "qwen3_omni"
    )
    build_tiny_mm_model("qwen3_omni", tok, out_dir=ckpt, seed=0)
    rows = [json.loads(line) for line in open(write_mm_dataset(tmp_path / "data", n_per_task=1, seed=0))]
    image = next(r for r in rows if r.get("image"))
    audio = next(r for r in rows if r.get("audio"))
    wav = Path(audio["audio"]).read_bytes()
    (tmp_path / "cut.wav").write_bytes(wav[: len(wav) // 3])
    data = tmp_path / "bad.jsonl"
    bad = [
        {**audio, "id": "cut-wav", "audio": str(tmp_path / "cut.wav")},
        {**image, "id": "dict-image", "image": {"url": image["image"]}},
        {**image, "id": "no-image", "image": None},
        {**image, "id": "whole"},
    ]
    data.write_text("\n".join(json.dumps(r) for r in bad) + "\n")
    flags = run_flags(RunInputs(str(ckpt), str(data)), tmp_path / "out", **mm_task())
    cfg = build_config(None, [*flags, "--rollout-batch-size", "1", "--n-samples-per-prompt", "1"])
    stats: dict = {}
    prompts = Prompts(cfg, AutoTokenizer.from_pretrained(str(ckpt)), str(ckpt), str(data), stats)
    got = [prompts.batch()[0][0].row_id for _ in range(2)]
    assert got == ["whole", "whole"]  # (shuffled epochs: every damaged row met and passed over)
    named = {m.split("'")[1] for m in prompts.bad_media}
    assert named == {"row cut-wav", "row dict-image", "row no-image"} and stats["bad_media_rows"] >= 3
    text = "\n".join(prompts.bad_media)
    assert "truncated WAV: its header declares" in text
    assert "the prompt marks <image> but the row's 'image' column is empty" in text
