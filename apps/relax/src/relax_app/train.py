"""The launch script: read like pseudocode, all mechanics live in the packages."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from relax_core.config import RelaxConfig
from relax_core.controller import Controller, RunInputs


def prepare_inputs(cfg: RelaxConfig) -> tuple[RunInputs, dict]:
    """A user's files as given, or the demo's, built (and cached) on first use."""
    if not cfg.is_demo:
        model, prompts = cfg.model.hf_checkpoint, cfg.data.prompt_data
        assert model is not None and prompts is not None, "config checks: both given, or neither (the demo)"
        return RunInputs(
            model,
            prompts,
            cfg.data.eval_data,
            cfg.model.ref_checkpoint,
            cfg.model.teacher_checkpoint,
        ), {}
    from relax_app.demo.assets import prepare_demo

    assets = prepare_demo(cache_dir=os.environ.get("RELAX_CACHE_DIR", ".relax_cache"), seed=cfg.train.seed)
    info = {
        "warm_start_accuracy": assets.sft_accuracy,
        "warm_start_cached": assets.cached,
        "model": str(assets.sft_model_dir),
        "train_data": str(assets.train_path),
        "eval_data": str(assets.eval_path),
    }
    inputs = RunInputs(
        str(assets.sft_model_dir),
        str(assets.train_path),
        str(assets.eval_path),
        teacher_model_path=cfg.model.teacher_checkpoint,
    )
    return inputs, info


def _check_response_fits(model: str | None, response_len: int) -> None:
    """A response length the model's context cannot hold beside any prompt refused at start (with the
    library's default of 512 and a small model, every row was skipped, then the rollout failed)."""
    if not model or not (Path(model) / "config.json").is_file():
        return
    from transformers import AutoConfig

    from relax_core.models import context_length

    try:
        context = context_length(AutoConfig.from_pretrained(model))
    except (OSError, ValueError):  # (a config transformers cannot read: the roles will say why)
        return
    if context is not None and response_len >= context:
        raise ValueError(
            f"--rollout-max-response-len {response_len} leaves no room for a prompt in the context of "
            f"{context} tokens of --hf-checkpoint {model} (its max_position_embeddings): give a "
            f"--rollout-max-response-len below {context}"
        )


def check_inputs(cfg: RelaxConfig) -> list[str]:
    """What a run reads, checked before anything heavy starts (Ray, model loading: 40-134 s before a bad
    file showed, as a traceback): the model directories and the datasets, read as the roles will read
    them. Raises ``ValueError`` / ``FileNotFoundError`` naming the flag, the file and what to do; returns
    one console line per dataset with skipped rows (each skip is also counted in the run's summary)."""
    from relax_core.data import load_prompts, prompt_text

    for flag, path in (
        ("--hf-checkpoint", cfg.model.hf_checkpoint),
        ("--ref-checkpoint", cfg.model.ref_checkpoint),
        ("--teacher-checkpoint", cfg.model.teacher_checkpoint),
    ):
        hub_id = path is not None and re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not Path(path).exists()
        if path is not None and not hub_id and not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"{flag} {path}: no model there (config.json missing); give an HF model directory"
            )
    from relax_core.checkpoints import check_writable, checkpoint_bytes
    from relax_rewards import check_reward

    model = cfg.model.hf_checkpoint
    if cfg.lora.enabled and model and Path(model).is_dir():  # a target module the model lacks: one line
        from relax_core.lora import check_targets

        check_targets(model, cfg.lora)
    need = checkpoint_bytes(model) if model and Path(model).is_dir() else 0
    check_writable("--output-dir", cfg.run.output_dir)
    if cfg.train.save:  # (a read-only or full --save failed at the first save, after the training)
        check_writable("--save", cfg.train.save, need)

    r = cfg.rollout
    for flag, name in (("--rm-type", r.rm_type), ("--eval-rm-type", r.eval_rm_type)):
        if name is not None:
            check_reward(name, flag)  # unknown, not importable, not callable, wrong signature: one line
    notes = []
    d = cfg.data
    templated = False
    for flag, path in (("--prompt-data", d.prompt_data), ("--eval-data", d.eval_data)):
        if path is None:
            continue
        try:
            ds = load_prompts(path, d.input_key, d.label_key, d.metadata_key, d.multimodal_keys)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(str(e).replace("--prompt-data", flag, 1)) from None
        if ds.skipped:
            notes.append(
                f"{flag} {path}: {len(ds.skipped)} of {len(ds.skipped) + len(ds.rows)} rows skipped "
                f"(first: {ds.skipped[0]})"
            )
        if flag == "--prompt-data" and ds.rows:
            notes += _try_reward(cfg, ds.rows[0])
        if not templated and (d.apply_chat_template or any(isinstance(r.prompt, list) for r in ds.rows)):
            _check_chat_template(model, flag, path, d.apply_chat_template)
            templated = True  # (one tokenizer load for both datasets)
        marked = sum(any(m in prompt_text(r.prompt) for m in MEDIA_MARKERS) for r in ds.rows)
        if marked and not d.multimodal_keys:
            notes.append(
                f"{flag} {path}: {marked} prompts mark media ({', '.join(MEDIA_MARKERS)}) but the run has no "
                "--multimodal-keys: they train as text; name the media columns, e.g. "
                "--multimodal-keys '{image: images}'"
            )
    _check_response_fits(model, r.rollout_max_response_len)  # (after the data: what a file lacks first)
    return notes + _few_cores_note(cfg)


def _few_cores_note(cfg: RelaxConfig) -> list[str]:
    """Fully async on CPU with fewer cores than roles that run a model: said at start, with why. Each role
    gets one thread and they take turns on the cores, so the overlap fully async exists for has little
    core to run on, and the trainer on one thread is the critical path (BENCHMARKS.md: 0.87-0.90x
    colocate's samples/s on a 2-core AMD EPYC, 1.04x on a 2-core Intel Xeon)."""
    if cfg.run.mode != "fully_async" or cfg.rollout.rollout_backend != "torch":
        return []
    from relax_core.roles import RolePlan

    cores = cfg.run.num_cpus or os.cpu_count() or 1
    roles = [name for name, spec in RolePlan.from_config(cfg).roles.items() if spec.model is not None]
    if cores >= len(roles):
        return []
    import torch

    if torch.cuda.is_available():  # (roles on GPUs do not share the CPU cores this way)
        return []
    return [
        f"fully async on {cores} CPU cores with {len(roles)} roles running a model ({', '.join(roles)}): each "
        "gets one thread and they take turns on the cores, so rollout and training barely overlap and the "
        "trainer on one thread sets the pace; on such a machine it runs at about --colocate's speed "
        "(0.87-1.04x its samples/s on 2-core machines: BENCHMARKS.md). Fully async pays off where rollout "
        "and training have devices of their own"
    ]


MEDIA_MARKERS = ("<image>", "<video>", "<audio>")


def _check_chat_template(model: str | None, flag: str, path: str, flagged: bool) -> None:
    """Chat messages, or --apply-chat-template, need the tokenizer's chat template: a model without one is
    refused here (it failed the first rollout batch, a role fault the health manager retried)."""
    if not model or not Path(model).is_dir():  # (a hub id: its tokenizer is not here to read)
        return
    from transformers import AutoTokenizer

    if getattr(AutoTokenizer.from_pretrained(model), "chat_template", None) is None:
        why = "--apply-chat-template is on" if flagged else f"{flag} {path} holds chat messages"
        raise ValueError(
            f"{why} and the tokenizer of --hf-checkpoint {model} has no chat template: use a chat model, or "
            "give the prompts as text without --apply-chat-template"
        )


def _try_reward(cfg: RelaxConfig, row: Any) -> list[str]:
    """The reward called once, with the run's time-out, on an empty response to the first row: a reward that
    fails there is named now, not as a count after the models load. Not fatal (a reward may refuse an empty
    answer): every such sample scores the fallback and is counted. In a worker process whatever the run's
    isolation: a reward that crashes its process must not take this one with it."""
    from relax_rewards import Scorer

    r = cfg.rollout
    with Scorer(r.rm_type, timeout_s=r.reward_timeout_s, max_concurrency=1, isolation="process") as s:
        got = s.score("", row.label, row.metadata)
    if got.ok:
        return []
    return [
        f"WARNING: --rm-type {r.rm_type} on an empty response to the first row ({row.row_id}): {got.failure}; "
        "every sample it fails on scores 0 and is counted in reward_failures"
    ]


def train(cfg: RelaxConfig) -> dict:
    """The run (its ``config.json`` and every other file of it written by the Controller once it holds the
    run's locks: a run refused by them changes nothing of the run that holds them)."""
    inputs, demo_info = prepare_inputs(cfg)
    if demo_info:
        print(
            f"[relax] demo assets ready (warm-start held-out accuracy {demo_info['warm_start_accuracy']:.3f}, "
            f"{'cached' if demo_info['warm_start_cached'] else 'built now'})"
        )
    result = Controller(cfg, inputs).run()
    from relax_app.report import console_lines, write_report

    summary = write_report(cfg, result, demo_info)
    print(json.dumps(summary, indent=1))
    for line in console_lines(summary):
        print(f"[relax] {line}")
    return summary
