"""Held-out accuracy of a demo model: greedy (what RL should raise) and sampled (what RL sees).

Why both: GRPO learns only from prompts where some of its samples are right and some wrong, so a
good starting point has modest greedy accuracy but a much higher pass@k at temperature 1.0.
An answer is correct when the text before the first EOS, stripped, equals the label.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relax_app.demo.task import read_jsonl


@dataclass(frozen=True)
class SampledAccuracy:
    """Mean accuracy over all samples, and the share of prompts with at least one correct sample."""

    mean: float
    pass_at_k: float
    k: int


def answer_text(tokenizer, ids: list[int]) -> str:
    """Decode generated ids up to (not including) the first EOS; pad ids are dropped."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode([i for i in ids if i != pad])


def generate_answers(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 6,
    batch_size: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[str]:
    """Answer each prompt once (greedy when ``temperature == 0``), left-padded batches."""
    import torch

    tokenizer.padding_side = "left"
    sample = temperature > 0
    kwargs = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {}
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    answers: list[str] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True)
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                do_sample=sample,
                **kwargs,
            )
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                answers.append(answer_text(tokenizer, row))
    model.train(was_training)
    return answers


def greedy_accuracy(
    model, tokenizer, eval_path: str | Path, max_new_tokens: int = 6, batch_size: int = 256
) -> float:
    """Share of held-out problems answered exactly by greedy decoding."""
    rows = read_jsonl(eval_path)
    answers = generate_answers(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, batch_size)
    return sum(a.strip() == r["label"] for a, r in zip(answers, rows)) / len(rows)


def sampled_accuracy(
    model,
    tokenizer,
    eval_path: str | Path,
    n_samples: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    batch_size: int = 512,
    seed: int = 0,
) -> SampledAccuracy:
    """Mean accuracy of ``n_samples`` samples per prompt at ``temperature``, and pass@n_samples."""
    rows = read_jsonl(eval_path)
    prompts = [r["prompt"] for r in rows for _ in range(n_samples)]
    answers = generate_answers(model, tokenizer, prompts, max_new_tokens, batch_size, temperature, seed)
    hits = [a.strip() == rows[i // n_samples]["label"] for i, a in enumerate(answers)]
    per_prompt = [any(hits[i * n_samples : (i + 1) * n_samples]) for i in range(len(rows))]
    return SampledAccuracy(mean=sum(hits) / len(hits), pass_at_k=sum(per_prompt) / len(rows), k=n_samples)
