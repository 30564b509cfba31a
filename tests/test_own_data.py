"""A run on data as veRL and slime users bring it (#50): veRL's parquet (a chat-message prompt, the label at
``reward_model.ground_truth``, ``extra_info``) and slime's jsonl (``messages`` with a system turn,
``--apply-chat-template``) train end to end with ``relax train`` and their own flags, each prompt rendered
by the chat template with its roles (the ids the rollout encodes are checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_app.cli import main

pytestmark = pytest.mark.shared_ray

SYSTEM = "Add."


def _verl(rows: list[dict], path: Path) -> list[str]:
    """``rows`` in veRL's layout (examples/data_preprocess/gsm8k.py), and the flags that read it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["label"]},
            "extra_info": {"split": "train", "index": i},
        }
        for i, r in enumerate(rows)
    ]
    pq.write_table(pa.Table.from_pylist(table), path)
    return ["--label-key", "reward_model.ground_truth", "--metadata-key", "extra_info"]


def _slime(rows: list[dict], path: Path) -> list[str]:
    """``rows`` as a slime chat jsonl (``messages``, ``label``), and slime's flags for it."""
    lines = [
        {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}],
            "label": r["label"],
        }
        for r in rows
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ["--input-key", "messages", "--label-key", "label", "--apply-chat-template"]


@pytest.mark.integration
@pytest.mark.parametrize("layout", [_verl, _slime], ids=["verl-parquet", "slime-jsonl"])
def test_a_chat_message_dataset_trains_with_its_roles_in_the_template(tiny_run_inputs, tmp_path, layout):
    from transformers import AutoTokenizer

    from relax_app.cli_config import build_config
    from relax_app.demo.task import read_jsonl
    from relax_rollout.prompts import Prompts

    rows = read_jsonl(tiny_run_inputs.prompt_path)
    data = tmp_path / ("train.parquet" if layout is _verl else "train.jsonl")
    own = layout(rows, data)
    argv = [
        *run_flags(tiny_run_inputs, tmp_path / "out", num_rollout=2, prompt_data=str(data)),
        *own,
        "--colocate",
    ]
    assert main(["train", *argv]) == 0
    logged = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in logged if "train/loss" in r]) == 2
    # the ids the rollout draws for a row: the chat template over its system and user turns
    tok = AutoTokenizer.from_pretrained(tiny_run_inputs.model_path)
    prompts = Prompts(build_config(None, argv), tok, tiny_run_inputs.model_path, str(data), {})
    first = prompts.iterator.rows[0]
    want = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{rows[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(prompts.encode(first.prompt)) == want
