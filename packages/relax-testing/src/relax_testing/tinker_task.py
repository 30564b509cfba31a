"""The tinker-cookbook ``math_rl`` recipe's ``arithmetic`` task for a tiny model, offline: its prompt format
(``role_colon`` with the few-shot prefix), a tiny Qwen3 with a tokenizer trained on it, and a short supervised
warm start. For relax-tinker's tests and its README example:

    uv run python -m relax_testing.tinker_task OUT_DIR     # builds the warmed-up tiny model in OUT_DIR
"""

from __future__ import annotations

import random
import sys

PROMPT = "User: What is 4 + 5?\n\nAssistant: 9\n\nUser: What is {a} + {b}?\n\nAssistant:"
"""The cookbook's arithmetic prompt with its few-shot prefix, in its ``role_colon`` format."""


def arithmetic_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 100), rng.randint(0, 100)
        out.append(PROMPT.format(a=a, b=b) + f" {a + b}\n\nUser:")
    return out


def build_tiny_model(out_dir: str, num_layers: int = 2) -> str:
    """A fresh tiny Qwen3 (the demo's builder) with a tokenizer trained on the task's texts, saved at ``out_dir``."""
    from relax_app.demo.model import build_tiny_qwen3
    from relax_app.demo.tokenizer import train_tokenizer

    tok = train_tokenizer(arithmetic_texts(2000), out_dir)
    build_tiny_qwen3(tok, out_dir=out_dir, max_position_embeddings=128, num_layers=num_layers)
    return out_dir


def warm_start(model_dir: str, out_dir: str, steps: int = 300, stop_share: float = 0.5, seed: int = 0) -> str:
    """A supervised warm start (the whole model, AdamW) on the cookbook's arithmetic format, so that RL has
    something to improve: the answer after ``Assistant:``, ended by the format's stop sequence
    (``\\n\\nUser:``) in ``stop_share`` of the examples and by EOS in the rest. The recipe's reward counts an
    answer without the stop sequence as badly formatted (-0.1), so the warm model's reward can rise by RL
    learning the format, and by more right answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        rows = []
        for _ in range(32):
            a, b = rng.randint(0, 100), rng.randint(0, 100)
            prompt = tok.encode(PROMPT.format(a=a, b=b))
            end = tok.encode("\n\nUser:") if rng.random() < stop_share else [tok.eos_token_id]
            rows.append((prompt, prompt + tok.encode(f" {a + b}") + end))
        width = max(len(full) for _, full in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        for i, (prompt, full) in enumerate(rows):
            ids[i, : len(full)] = torch.tensor(full)
            labels[i, len(prompt) : len(full)] = torch.tensor(full[len(prompt) :])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    import tempfile

    with tempfile.TemporaryDirectory() as fresh:
        warm_start(build_tiny_model(fresh), argv[0])
    print(f"a tiny Qwen3 warmed up on the arithmetic format: {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
