"""Held-out evaluation renders its prompts as training does (it tokenized the raw text, so a run with
--apply-chat-template or chat-message data was evaluated on prompts it never trained on)."""

import json

from relax_app.cli_config import build_config
from relax_rollout.evaluate import GreedyEvaluator
from relax_rollout.prompts import render

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_eval_prompts_are_rendered_as_training_renders_them(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    data = tmp_path / "eval.jsonl"
    rows = [
        {"prompt": "1+2=", "label": "3"},
        {"prompt": [{"role": "system", "content": "9"}, {"role": "user", "content": "4+4="}], "label": "8"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for flags in ([], ["--apply-chat-template"]):
        cfg = build_config(None, ["--prompt-data", str(data), "--hf-checkpoint", tiny_model_dir, *flags])
        ev = GreedyEvaluator(cfg, str(tmp_path / "tok"), str(data))
        want = [render(tok, r["prompt"], bool(flags)) for r in rows]
        assert ev.prompts == [tok(t, add_special_tokens=False)["input_ids"] for t in want]
    assert want[0].startswith("<|im_start|>user\n1+2=") and want[1].startswith("<|im_start|>system\n9")
