"""The agent demo (`relax train --agent-demo`): the demo's addition task, answered by an agent written with
Anthropic's SDK (``relax_app.demo.agents``), trained fully asynchronously through the Messages API.

Why its own assets: an agent's calls go through the chat template (a user message, then the assistant's
turn), while the main demo's model was warmed up on raw prompts (``23+45=``). Here the same tiny Qwen3 is
warmed up on the chat-rendered prompts, in both agents' formats (``relax_app.demo.agents``: the problem, and
the problem with a proposed answer to check), to the same partial competence, so RL has room to show a gain.
Held-out accuracy is measured on the first turn's format (``--apply-chat-template``), greedy, as in the demo.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

from relax_app.demo.agents import FEEDBACK
from relax_app.demo.defaults import DEMO_DEFAULTS

MESSAGES_AGENT = "relax_app.demo.agents:messages_agent"
TWO_AGENTS = "relax_app.demo.agents:solver_and_checker"

AGENT_DEFAULTS: dict[str, object] = {
    **DEMO_DEFAULTS,
    "agent_path": MESSAGES_AGENT,
    "apply_chat_template": True,  # held-out evaluation in the agent's format
    "mode": "fully_async",
    "max_staleness": 1,
    "rollout_batch_size": 16,
    "num_rollout": 60,
    "eval_interval": 10,
    "output_dir": "runs/agent-demo",
}
"""The agent demo's settings (any flag overrides them; ``--agent-path`` picks the other agent)."""


def chat_rows(rows: list[dict], tokenizer, seed: int) -> list[dict]:
    """Warm-start rows in the agents' formats, chat-rendered as the server renders a user message: the
    problem (``23+45=``) and, as often, the problem with a proposed answer (right half the time) to check."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        for user in (r["prompt"], f"{r['prompt']}{_proposal(r['label'], rng)}?"):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
            out.append({"prompt": text, "label": r["label"], "id": r.get("id", "")})
    rng.shuffle(out)
    return out


def _proposal(label: str, rng: random.Random) -> str:
    return label if rng.random() < 0.5 else str(max(0, int(label) + rng.choice([-10, -2, -1, 1, 2, 10])))


def prepare_agent_demo(
    cache_dir: str | Path,
    seed: int = 0,
    max_operand: int = 99,
    sft_steps: int = 1500,
    target_accuracy: float = 0.5,
    shape: dict[str, int] | None = None,
) -> tuple[str, str, str]:
    """(checkpoint dir, train jsonl, held-out jsonl), built under ``cache_dir`` on first use. ``shape``: the
    tiny Qwen3's (``build_tiny_qwen3`` keywords), default the demo's."""
    from relax_app.demo.assets import DemoSettings
    from relax_app.demo.model import build_tiny_qwen3
    from relax_app.demo.sft import sft_warm_start
    from relax_app.demo.task import make_arithmetic_task, read_jsonl
    from relax_app.demo.tokenizer import train_tokenizer

    shape = {**DemoSettings().model_shape(), "max_position_embeddings": 128, **(shape or {}), "seed": seed}
    key = json.dumps([seed, max_operand, sft_steps, target_accuracy, sorted(shape.items())])
    root = Path(cache_dir) / f"agent-{abs(hash_text(key)):x}"
    manifest = root / "manifest.json"
    if not manifest.is_file():
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".agent-", dir=cache_dir))
        try:
            files = make_arithmetic_task(tmp / "data", seed=seed, max_operand=max_operand, n_eval=200)
            rows = read_jsonl(files.train_path)
            texts = [r["prompt"] + r["label"] + "?" for r in rows] + [FEEDBACK] * 50
            tok = train_tokenizer(texts, vocab_size=320)
            build_tiny_qwen3(tok, tmp / "base", **shape)
            sft = tmp / "data" / "sft.jsonl"
            sft.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(rows, tok, seed)))
            sft_warm_start(
                tmp / "base", sft, tmp / "sft", steps=sft_steps, seed=seed, target_accuracy=target_accuracy
            )
            shutil.rmtree(root, ignore_errors=True)
            tmp.rename(root)
            manifest.write_text(json.dumps({"seed": seed, "key": key}))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(root / "sft"), str(root / "data" / "train.jsonl"), str(root / "data" / "eval.jsonl")


def hash_text(text: str) -> int:
    """A stable hash (Python's ``hash`` of a str changes per process)."""
    import hashlib

    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)
