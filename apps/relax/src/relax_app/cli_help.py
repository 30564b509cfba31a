"""``relax train --help``: every flag, grouped by what it is about and wrapped to the terminal.

Why not the config's own sections: those follow the code (``run`` holds logging, staleness, fault tolerance
and the CPU count; ``train`` the optimizer, checkpoints and the GPU layout), and 160 flags in six lists were
hard to scan (162 unwrapped lines, 113 over 100 characters). Here each flag sits in the section a user looks
for it in (rollout, rewards, training, algorithm, checkpoints, cluster, logging, ...); a field no section
names falls into the one of its config section, so a new field is never left out. Each flag shows its
default, and the value the demo sets instead where it differs: the library's defaults are a real run's.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from typing import Any

from relax_app import cli_aliases as aliases

SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("hf_checkpoint", "ref_checkpoint", "teacher_checkpoint", "dtype"),
    "data": (
        "prompt_data",
        "input_key",
        "label_key",
        "metadata_key",
        "apply_chat_template",
        "rollout_shuffle",
        "multimodal_keys",
        "multimodal_options",
    ),
    "rollout": (
        "rollout_batch_size",
        "n_samples_per_prompt",
        "rollout_max_response_len",
        "rollout_temperature",
        "rollout_top_p",
        "rollout_stop",
        "rollout_stop_token_ids",
        "dynamic_sampling",
        "dynamic_sampling_max_rounds",
        "long_tail_min_tokens",
        "long_tail_exact",
    ),
    "rewards": (
        "rm_type",
        "reward_timeout_s",
        "reward_concurrency",
        "reward_isolation",
        "reward_memory_limit_mb",
        "reward_delay_s",
    ),
    "multi-turn (agentic RL)": ("env_path", "max_turns", "max_total_tokens", "env_step_timeout_s"),
    "inference engines": (
        "rollout_backend",
        "rollout_external_urls",
        "rollout_num_gpus",
        "rollout_num_gpus_per_engine",
        "sglang_mem_fraction_static",
        "sglang_server_args",
        "sglang_model_path",
        "sglang_python",
        "sglang_env",
        "sglang_weight_update",
        "rollout_engines",
        "elastic_port",
        "elastic_host",
        "elastic_token",
        "elastic_max_engines",
        "drain_timeout_s",
    ),
    "training": (
        "train_backend",
        "num_rollout",
        "global_batch_size",
        "micro_batch_size",
        "use_dynamic_batch_size",
        "max_tokens_per_gpu",
        "lr",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "clip_grad",
        "seed",
    ),
    "LoRA (adapters, not full fine-tuning)": (
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "lora_target_parameters",
        "lora_sync_mode",
        "lora_save_merged",
    ),
    "algorithm": (),  # (every algo field: the config section's own order)
    "PPO with a critic (gae)": (
        "critic_checkpoint",
        "critic_lr",
        "critic_warmup",
        "critic_epochs",
        "critic_global_batch_size",
        "value_clip",
        "value_loss_coef",
        "gamma",
        "lambd",
    ),
    "asynchrony and staleness": (
        "mode",
        "max_staleness",
        "staleness_policy",
        "bus_capacity",
        "streaming_rollout",
        "max_inflight_groups",
        "max_inflight_requests",
        "partial_rollout",
        "mask_offpolicy_in_partial_rollout",
        "weight_sync_transport",
        "weight_sync_delta",
        "weight_sync_full_every",
        "weight_sync_backend",
        "overlap_weight_sync",
        "verify_weight_sync",
    ),
    "evaluation": ("eval_data", "eval_max_samples", "eval_interval", "eval_rm_type"),
    "checkpoints": ("save", "save_interval", "load", "trust_unverified", "overwrite", "allow_data_change"),
    "cluster and parallelism": (
        "actor_num_nodes",
        "actor_num_gpus_per_node",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "sequence_parallel",
        "use_distributed_optimizer",
        "num_cpus",
        "torch_threads",
        "offload",
    ),
    "logging": (
        "output_dir",
        "tensorboard",
        "progress",
        "trace",
        "wandb_project",
        "wandb_mode",
        "clearml_project",
        "clearml_offline",
        "notify_urls",
    ),
    "fault tolerance": (
        "health",
        "heartbeat_interval_s",
        "heartbeat_timeout_s",
        "stall_timeout_s",
        "max_restarts_per_role",
        "max_global_restarts",
    ),
}
"""Help section -> its flags (leaf names), in the order shown."""

FALLBACK = {
    "model": "model",
    "data": "data",
    "rollout": "rollout",
    "train": "training",
    "algo": "algorithm",
    "run": "other run settings",
    "agent": "your own agents (--agent-path)",
}
"""Config section -> the help section of its fields that :data:`SECTIONS` does not name."""

DATA_LAYOUTS = (
    "Datasets: .jsonl, .json, .parquet, .arrow, or a folder the datasets library saved. A prompt is text or "
    "chat messages (the chat template renders them, each turn with its role); column names may be nested "
    "paths. veRL's parquet: --input-key prompt --label-key reward_model.ground_truth --metadata-key "
    "extra_info. slime's jsonl: --input-key prompt (or messages) --label-key label --apply-chat-template."
)
"""The data section's opening lines: the layouts veRL and slime users bring, by name."""

COMMAND_LINE = (
    "Config files (CONFIG.yaml, --config FILE) go anywhere on the command line, later ones and flags over "
    "earlier ones; key=value sets a field by its name (lr=1e-6, train.lr=1e-6) or by veRL's path "
    "(actor_rollout_ref.actor.optim.lr=1e-6). Every problem is listed at once."
)
"""The help's opening lines on how a command line is read."""

MIN_WIDTH = 40
"""Narrower terminals get 40 columns (a flag name alone takes up to 36)."""


def terminal_width() -> int:
    """The terminal's width (``COLUMNS`` first), 100 when there is no terminal."""
    return shutil.get_terminal_size((100, 24)).columns


def grouped(config_cls: Any) -> dict[str, list[tuple[str, Any]]]:
    """Help section -> [(leaf, pydantic field)] for every leaf of ``config_cls`` (a RelaxConfig), each once."""
    fields: dict[str, tuple[str, Any]] = {}
    for section, info in config_cls.model_fields.items():
        for name, f in info.annotation.model_fields.items():
            fields[name] = (section, f)
    out: dict[str, list[tuple[str, Any]]] = {title: [] for title in SECTIONS}
    placed = set()
    for title, names in SECTIONS.items():
        for name in names:
            if name in fields:
                out[title].append((name, fields[name][1]))
                placed.add(name)
    for name, (section, f) in fields.items():
        if name not in placed:
            out.setdefault(FALLBACK.get(section, section), []).append((name, f))
    return {title: rows for title, rows in out.items() if rows}


def render(
    config_cls: Any,
    default_of: Any,
    width: int | None = None,
    demos: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The flag list of --help, every line at most ``width`` (default: the terminal's) columns.

    ``default_of(field)`` is the default as shown ("default 0.2"); ``demos`` maps a label ("demo") to the
    values that run sets over the defaults, shown next to each default they change."""
    width = max(MIN_WIDTH, width or terminal_width())
    demos = demos or {}
    lines: list[str] = []

    def para(text: str, first: str, rest: str) -> None:
        lines.extend(
            textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)
        )

    intro = "Defaults are a real run's (slime's and veRL's values where they have one)."
    if demos:
        labels = ", ".join(f"'{label}: X'" for label in demos)
        intro += f" {labels} beside a default: the value that demo sets instead."
    para(intro, "", "")
    para(COMMAND_LINE, "", "")
    for title, rows in grouped(config_cls).items():
        lines += ["", f"{title}:"]
        if title == "data":
            para(DATA_LAYOUTS, "  ", "  ")
        if title == "asynchrony and staleness":
            para(
                "--colocate / --fully-async: shorthand for --mode colocate / --mode fully_async",
                "  ",
                "      ",
            )
        for name, f in rows:
            also = [a for a, ours in aliases.ALIASES.items() if ours == name]
            also += [s for s, (field, _) in aliases.SWITCHES.items() if field == name]
            names = " / ".join("--" + n.replace("_", "-") for n in (name, *also))
            default = default_of(f)
            for label, values in demos.items():
                if name in values and f"default {values[name]!r}" != default:
                    default += f"; {label}: {values[name]!r}"
            para(f"{names} ({default})", "  ", "      ")
            doc = " ".join((f.description or "").split())
            if name in aliases.OTHER_MEANING:
                doc += f" NOTE for slime / veRL users: {aliases.OTHER_MEANING[name]}."
            if doc:
                para(doc, "      ", "      ")
    lines += ["", "slime / veRL names:"]
    for names, meaning in aliases.help_rows():
        para(f"{names} {meaning}", "  ", "      ")
    return "\n".join(lines)


def wrap_columns(text: str, width: int | None = None) -> str:
    """A two-column usage text (``"  relax eval CKPT     what it does"``, continued under its second column)
    wrapped to ``width`` (default: the terminal's): an entry that fits keeps its own line breaks, one that
    does not is re-flowed under its second column; other lines are wrapped as they are."""
    width = max(MIN_WIDTH, width or terminal_width())
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _ENTRY.match(lines[i])
        if m and len(m.group(1)) <= width - 20:
            prefix, body, j = m.group(1), [m.group(2)], i + 1
            while (
                j < len(lines)
                and lines[j].startswith(" " * len(prefix))
                and lines[j][len(prefix) :][:1].strip()
            ):
                body.append(lines[j].strip())
                j += 1
            if any(len(line) > width for line in lines[i:j]):
                out += textwrap.wrap(
                    " ".join(body),
                    width,
                    initial_indent=prefix,
                    subsequent_indent=" " * len(prefix),
                    break_on_hyphens=False,
                )
            else:
                out += lines[i:j]
            i = j
            continue
        line = lines[i]
        indent = line[: len(line) - len(line.lstrip())]
        if len(line) <= width or len(indent) > width - 20:
            out += [line] if len(line) <= width else textwrap.wrap(line, width, break_on_hyphens=False)
        else:
            out += textwrap.wrap(line, width, subsequent_indent=indent + "  ", break_on_hyphens=False)
        i += 1
    return "\n".join(out)


_ENTRY = re.compile(r"^(\s*\S.*?\s{2,})(\S.*)$")
"""A usage entry: the command, two or more spaces, what it does."""
