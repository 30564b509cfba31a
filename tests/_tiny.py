"""What the end-to-end tests share: the tiny Qwen3 they train and the command line of a tiny run on it.

Imported by the tests as ``_tiny`` (conftest.py puts this folder on sys.path). A test spells out only the
flags that matter to it; the sizes every run here shares come from :data:`TINY_STEP` and :data:`QUIET`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_QWEN3: dict[str, int] = dict(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
"""The tiny Qwen3's shape (``relax_app.demo.model.build_tiny_qwen3`` keywords)."""

TINY_STEP = dict(rollout_batch_size=4, n_samples_per_prompt=4, rollout_max_response_len=4, micro_batch_size=8)
"""A step of a tiny run: 4 prompts x 4 samples of at most 4 tokens, trained as one micro-batch."""

TINY_OPTIM = dict(lr=2e-4, weight_decay=0.0, adam_beta2=0.99)
"""AdamW as the tiny runs were tuned with: the library's defaults are a pretrained model's (lr 1e-6)."""

QUIET = dict(torch_threads=1, progress=False)
"""One torch thread (the test machines' cores are shared), no progress bar."""


def tiny_qwen3(tokenizer, out_dir: str | Path, **shape):
    """``build_tiny_qwen3`` of :data:`TINY_QWEN3`, with ``shape`` changed (``num_layers=1``, ``seed=1``)."""
    from relax_app.demo.model import build_tiny_qwen3

    return build_tiny_qwen3(tokenizer, out_dir=out_dir, **{**TINY_QWEN3, **shape})


def mm_task(*media: str) -> dict[str, Any]:
    """``run_flags`` keywords of the demo's multimodal task (``relax_app.demo.mm_task``): its ``media``
    columns (all three when none are named) and their budget, the metadata column, the reward."""
    from relax_app.demo.mm_task import MM_BUDGET, MM_KEYS, REWARD

    keys = {m: MM_KEYS[m] for m in media} if media else MM_KEYS
    return dict(multimodal_keys=keys, multimodal_options=MM_BUDGET, metadata_key="metadata", rm_type=REWARD)


def mm_dataset(root: Path, tasks: tuple[str, ...], n_per_task: int = 4) -> str:
    """The demo's multimodal task (``relax_app.demo.mm_task``) for ``tasks`` under ``root``, as a jsonl path."""
    from relax_app.demo.mm_task import write_mm_dataset

    return str(write_mm_dataset(root / "-".join(tasks), n_per_task=n_per_task, seed=0, tasks=tasks))


def mm_checkpoint(root: Path, family: str) -> str:
    """A tiny random-weight ``family`` model (qwen2_5_vl, qwen3_vl, qwen3_omni) with a tokenizer trained on
    the multimodal task's words, built once under ``root``."""
    from relax_app.demo.mm_models import build_tiny_mm_model, extend_tokenizer
    from relax_app.demo.tokenizer import train_tokenizer

    out = Path(root) / f"ckpt-{family}"
    if not (out / "config.json").exists():
        texts = [
            "What colour is the shape? Which way does the dot move? Which tone is higher?",
            "Answer: A",
            "Answer: B",
            "Answer: C",
            "Answer: D",
            "red green blue yellow left right",
        ]
        tok = extend_tokenizer(train_tokenizer(texts * 20, vocab_size=300), family)
        build_tiny_mm_model(family, tok, out_dir=out, seed=0)
    return str(out)


def run_flags(inputs, output_dir: str | Path, *extra: str, **flags) -> list[str]:
    """The command line of a tiny run: ``inputs``' prompts and checkpoint (a ``RunInputs``), :data:`TINY_STEP`,
    :data:`TINY_OPTIM` and :data:`QUIET`, ``flags`` over them; then ``--output-dir output_dir`` and ``extra`` as
    given (a test's ``"--colocate"`` or parametrized mode).

    A flag is its field's name: ``num_rollout=3`` is ``--num-rollout 3``; ``True`` gives the bare flag
    (``verify_weight_sync=True``), ``False`` its ``--no-`` form (``trace=False``), ``None`` leaves it out
    (``progress=None``); a dict or list is passed as JSON. ``hf_checkpoint=...`` overrides ``inputs``'."""
    named = {
        "prompt_data": inputs.prompt_path,
        "hf_checkpoint": inputs.model_path,
        **TINY_STEP,
        **TINY_OPTIM,
        **QUIET,
    }
    argv: list[str] = []
    for name, value in {**named, **flags}.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return [*argv, "--output-dir", str(output_dir), *extra]


def stream_in_process(
    cfg, model_path: str, prompt_path: str, steps: int, between_steps=None
) -> tuple[list[dict], list[dict]]:
    """A streaming rollout (``RolloutWorker.run`` on a thread, its torch engine batching continuously) and
        a trainer's side of it played here: step k's groups taken from partition ``step<k>`` at version k
        from a real in-process bus that enforces the staleness bound (it raises on a stale sample), then
        ``between_steps(k, worker)`` (a trainer's time; it may return new weights), and those weights published to
        the rollout as version k + 1. Returns each step's samples (one dict of fields per step) and the
    rollout's trace spans. Ray, the
        other roles and the training are left out: what is tested is the dataflow between them."""
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_core.roles import TRAINER_CONSUMER
    from relax_rollout.worker import RolloutWorker
    from relax_testing import in_background

    per = cfg.samples_per_rollout
    bus = DataBus(
        BusConfig(
            consumers={TRAINER_CONSUMER: ConsumerSpec(enforce_staleness=True)},
            max_staleness=cfg.run.max_staleness,
        )
    )
    worker = RolloutWorker(cfg, bus, model_path, prompt_path)
    weights = {n: p.detach().clone() for n, p in worker.generation.engine.named_weights()}
    done = in_background(worker.run, 0)
    taken: list[dict] = []
    try:
        for k in range(steps):
            fields: dict[str, list] = {}
            while len(fields.get("tokens", [])) < per:
                batch = bus.get(
                    TRAINER_CONSUMER,
                    n=per - len(fields.get("tokens", [])),
                    partial=True,
                    trainer_version=k,
                    timeout=120,
                    partition=f"step{k}",
                )
                bus.ack(TRAINER_CONSUMER, batch.lease_id)
                for name, values in batch.data.items():
                    fields.setdefault(name, []).extend(values)
            taken.append(fields)
            new = between_steps(k, worker) if between_steps is not None else None
            weights = new if new is not None else weights
            worker.set_weights(weights, k + 1)
            bus.set_trainer_version(k + 1)
    finally:
        bus.close()
        done(timeout=120)
        worker.close()
    return taken, worker.get_spans()


class ScriptedEngine:
    """Stands in for a model that says the given lines (canonical tokens + EOS), for exact assertions."""

    weight_version = 3

    def __init__(self, tok, lines, finish="stop"):
        self.tok, self.lines, self.finish, self.calls = tok, list(lines), finish, 0

    def generate(self, prompts, params):
        from relax_rollout.engines.base import GenerateOutput

        line = self.lines[min(self.calls, len(self.lines) - 1)]
        self.calls += 1
        ids = self.tok(line, add_special_tokens=False)["input_ids"]
        ids = ids + ([self.tok.eos_token_id] if self.finish == "stop" else [])
        return [GenerateOutput(ids, [-0.5] * len(ids), self.finish, self.weight_version) for _ in prompts]
