"""Assets of the CPU demo that ``relax train`` runs with no config.

A synthetic addition task (JSONL), a byte-level BPE tokenizer trained locally, a tiny Qwen3 model
built from a config, and a short supervised warm start — all written as ordinary data files and HF
checkpoints, so the RL run loads them exactly as it would load a user's. Heavy imports (torch,
transformers) happen inside the functions, so importing this package stays cheap.
"""

from relax_app.demo.assets import CODE_VERSION, DemoAssets, DemoSettings, prepare_demo
from relax_app.demo.task import TaskFiles, make_arithmetic_task, read_jsonl

__all__ = [
    "CODE_VERSION",
    "DemoAssets",
    "DemoSettings",
    "TaskFiles",
    "make_arithmetic_task",
    "prepare_demo",
    "read_jsonl",
]
