import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_app.demo.evaluate import answer_text, sampled_accuracy
from relax_app.demo.model import build_tiny_qwen3
from relax_app.demo.sft import encode_examples, greedy_accuracy, sft_warm_start, train_sft
from relax_app.demo.task import read_jsonl


def test_loss_mask_covers_answer_and_eos_only(tokenizer):
    ids, mask = encode_examples(
        tokenizer, [{"prompt": "12+3=", "label": "15"}, {"prompt": "1+1=", "label": "2"}]
    )
    first = ids[0][mask[0].bool()].tolist()
    assert tokenizer.decode(first) == "15<|im_end|>"
    assert tokenizer.decode(ids[1][mask[1].bool()].tolist()) == "2<|im_end|>"


def test_few_sft_steps_lower_the_loss(tokenizer, tiny_task, tiny_model):
    model = build_tiny_qwen3(tokenizer, **tiny_model)
    losses = train_sft(
        model, tokenizer, read_jsonl(tiny_task.train_path), steps=30, batch_size=16, lr=3e-3
    ).losses
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_sft_warm_start_writes_loadable_checkpoint(tokenizer, tiny_task, tmp_path, tiny_model):
    build_tiny_qwen3(tokenizer, tmp_path / "base", **tiny_model)
    out = sft_warm_start(
        tmp_path / "base", tiny_task.train_path, tmp_path / "sft", steps=3, batch_size=8, lr=1e-3, seed=0
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(json.loads((out / "sft_log.json").read_text())["losses"]) == 3
    acc = greedy_accuracy(model, tok, tiny_task.eval_path, batch_size=8)
    assert 0.0 <= acc <= 1.0
    s = sampled_accuracy(model, tok, tiny_task.eval_path, n_samples=2, batch_size=16)
    assert 0.0 <= s.mean <= s.pass_at_k <= 1.0 and s.k == 2


def test_answer_text_stops_at_eos(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = tokenizer("42", add_special_tokens=False)["input_ids"] + [eos, pad] + tokenizer("9")["input_ids"]
    assert answer_text(tokenizer, ids) == "42"


def test_target_accuracy_stops_at_first_check_that_reaches_it(tokenizer, tiny_task, tiny_model):
    model = build_tiny_qwen3(tokenizer, **tiny_model)
    rows = read_jsonl(tiny_task.train_path)
    log = train_sft(
        model, tokenizer, rows, steps=50, batch_size=8, target_accuracy=0.0, check_every=4, probe_size=8
    )
    assert log.stopped_early and log.steps == 4 and log.probe_accuracy[0][0] == 4
    log = train_sft(
        model, tokenizer, rows, steps=6, batch_size=8, target_accuracy=1.01, check_every=3, probe_size=8
    )
    assert not log.stopped_early and log.steps == 6 and [s for s, _ in log.probe_accuracy] == [3, 6]


def test_progress_is_reported_with_step_total_and_loss(tokenizer, tiny_task, tiny_model):
    model = build_tiny_qwen3(tokenizer, **tiny_model)
    rows = read_jsonl(tiny_task.train_path)
    lines: list[str] = []
    log = train_sft(model, tokenizer, rows, steps=5, batch_size=8, report=lines.append, report_every_s=1e9)
    # throttled: the first step, then the last (every report_every_s seconds in between)
    assert lines == [f"step 1/5, loss {log.losses[0]:.3f}", f"step 5/5, loss {log.losses[-1]:.3f}"]
    lines.clear()
    train_sft(
        model,
        tokenizer,
        rows,
        steps=4,
        batch_size=8,
        report=lines.append,
        report_every_s=0.0,
        target_accuracy=1.01,
        check_every=2,
        probe_size=8,
    )
    assert [line.split(",")[0] for line in lines] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]
    assert "probe accuracy" in lines[1] and "probe accuracy" in lines[3]


def test_warm_start_prints_its_progress_on_the_console(tokenizer, tiny_task, tmp_path, tiny_model, capsys):
    build_tiny_qwen3(tokenizer, tmp_path / "base", **tiny_model)
    sft_warm_start(tmp_path / "base", tiny_task.train_path, tmp_path / "sft", steps=3, batch_size=8, lr=1e-3)
    out = capsys.readouterr().out
    assert "[relax] demo warm start: step 1/3, loss " in out and "step 3/3, loss " in out
