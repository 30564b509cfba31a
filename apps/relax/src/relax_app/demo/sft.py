"""Supervised warm start: teach the tiny model the answer format and part of the skill.

Why a warm start at all: GRPO's advantage is zero on prompts where all samples agree, so a model
that never answers right (random init) gives RL nothing to learn from. A short SFT leaves the model
partially competent — some greedy answers right, many more right among 8 samples — which is the
regime where RL visibly raises held-out accuracy within minutes on CPU.

Why stop on a target accuracy rather than after a fixed step count: addition is learned in a sharp
transition whose step varies a lot with the seed (seed 0 reaches 26% held-out greedy accuracy after
800 steps, seed 1 reaches 95%). Checking greedy accuracy on a small probe of *training* problems every
``check_every`` steps, and stopping once it reaches ``target_accuracy``, lands every seed in the
partially-competent band; the held-out split is never looked at.

The loss covers only answer + EOS tokens (the prompt is given, not predicted), as in the RL run,
where the policy produces only the response.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from relax_app.demo.evaluate import generate_answers, greedy_accuracy
from relax_app.demo.model import save_checkpoint
from relax_app.demo.task import read_jsonl

__all__ = ["SFTLog", "encode_examples", "greedy_accuracy", "sft_warm_start", "train_sft"]


@dataclass
class SFTLog:
    """What a warm start did: loss per step, and (step, probe greedy accuracy) at each check."""

    losses: list[float] = field(default_factory=list)
    probe_accuracy: list[tuple[int, float]] = field(default_factory=list)
    stopped_early: bool = False

    @property
    def steps(self) -> int:
        return len(self.losses)


def encode_examples(tokenizer, rows: list[dict], max_answer_tokens: int = 8):
    """Right-padded ``(input_ids, loss_mask)`` tensors for prompt + answer + EOS.

    Prompt and answer are tokenized separately and concatenated, so training sees the same
    token boundary that generation does (prompt tokens, then generated tokens).
    """
    import torch

    seqs, masks = [], []
    for row in rows:
        p = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        a = tokenizer(row["label"], add_special_tokens=False)["input_ids"][:max_answer_tokens]
        a = a + [tokenizer.eos_token_id]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def _lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warmup, then constant (so where training stops does not change the schedule)."""
    return lr * min(1.0, (step + 1) / warmup)


def _probe_accuracy(model, tokenizer, rows: list[dict]) -> float:
    answers = generate_answers(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=6)
    return sum(a.strip() == r["label"] for a, r in zip(answers, rows)) / len(rows)


def _print_progress(line: str) -> None:
    print(f"[relax] demo warm start: {line}", flush=True)


def train_sft(
    model,
    tokenizer,
    rows: list[dict],
    steps: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    max_answer_tokens: int = 8,
    weight_decay: float = 0.01,
    target_accuracy: float | None = None,
    check_every: int = 25,
    probe_size: int = 256,
    report: Callable[[str], None] | None = None,
    report_every_s: float = 3.0,
) -> SFTLog:
    """Train ``model`` in place for at most ``steps`` AdamW steps.

    With ``target_accuracy``, stop at the first check where greedy accuracy on ``probe_size``
    training problems reaches it. ``report`` gets a progress line ("step 120/1500, loss 0.412") after the
    first step, then at most every ``report_every_s`` seconds, at each check and at the last step.
    """
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.manual_seed(seed)
    ids, mask = encode_examples(tokenizer, rows, max_answer_tokens)
    attn = (ids != tokenizer.pad_token_id).long()
    gen = torch.Generator().manual_seed(seed)
    order, cursor = torch.randperm(len(ids), generator=gen), 0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    warmup = max(1, min(50, steps // 10))
    probe = [rows[i] for i in torch.randperm(len(rows), generator=gen)[:probe_size].tolist()]
    model.train()
    log = SFTLog()
    last_report = time.monotonic()
    for step in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(ids), generator=gen), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, lr, warmup)
        logits = model(input_ids=ids[idx], attention_mask=attn[idx]).logits[:, :-1]
        target, m = ids[idx][:, 1:], mask[idx][:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        loss = (nll * m.reshape(-1)).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.losses.append(loss.item())
        line = f"step {step + 1}/{steps}, loss {log.losses[-1]:.3f}"
        if target_accuracy is not None and (step + 1) % check_every == 0:
            acc = _probe_accuracy(model, tokenizer, probe)
            log.probe_accuracy.append((step + 1, acc))
            line += f", probe accuracy {acc:.2f} (stops at {target_accuracy:.2f})"
            if acc >= target_accuracy:
                log.stopped_early = True
                if report is not None:
                    report(line + ": reached")
                break
            model.train()
            due = True
        else:
            due = step == 0 or step + 1 == steps or time.monotonic() - last_report >= report_every_s
        if report is not None and due:
            report(line)
            last_report = time.monotonic()
    model.eval()
    return log


def sft_warm_start(
    model_dir: str | Path,
    train_path: str | Path,
    out_dir: str | Path,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    max_answer_tokens: int = 8,
    target_accuracy: float | None = None,
    report: Callable[[str], None] | None = None,
) -> Path:
    """Fine-tune the checkpoint in ``model_dir`` on ``train_path`` (at most ``steps`` steps, fewer
    when ``target_accuracy`` is reached); save an HF checkpoint to ``out_dir`` (model + tokenizer,
    plus ``sft_log.json`` with losses, probe accuracies and wall time). Progress goes to ``report``, by
    default the console (the warm start takes tens of seconds)."""
    from transformers import AutoTokenizer

    from relax_core.models import load_model

    model = load_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    start = time.perf_counter()
    log = train_sft(
        model,
        tokenizer,
        read_jsonl(train_path),
        steps,
        batch_size,
        lr,
        seed,
        max_answer_tokens,
        target_accuracy=target_accuracy,
        report=report or _print_progress,
    )
    seconds = time.perf_counter() - start
    out = save_checkpoint(model, tokenizer, out_dir)
    record = {
        "max_steps": steps,
        "steps": log.steps,
        "stopped_early": log.stopped_early,
        "target_accuracy": target_accuracy,
        "batch_size": batch_size,
        "lr": lr,
        "seconds": round(seconds, 2),
        "probe_accuracy": log.probe_accuracy,
        "losses": log.losses,
    }
    (out / "sft_log.json").write_text(json.dumps(record))
    return out
