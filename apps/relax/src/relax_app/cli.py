"""The `relax` command: `relax train [CONFIG.yaml] [--flag value ...]`, `relax prepare-data FORMAT SRC OUT`,
`relax prepare-model omni-thinker SRC DST`; around a run: `relax status|watch|summary RUN_DIR`,
`relax eval CKPT`, `relax export CKPT OUT`, `relax --version` (:data:`COMMANDS`).

With no config and no --prompt-data, `relax train` runs the CPU demo (a real RL run in minutes).
"""

from __future__ import annotations

import sys

from relax_core.registry import Registry

USAGE = """usage: relax train [CONFIG.yaml ...] [--flag value | key=value ...]
       relax status RUN_DIR | relax watch RUN_DIR | relax summary RUN_DIR | relax ui RUN_DIR
       relax eval CKPT [--data FILE.jsonl] | relax export CKPT OUT
       relax prepare-data FORMAT SRC OUT.jsonl
       relax prepare-model omni-thinker SRC DST
       relax --version

  relax train                       run the CPU demo (tiny Qwen3 model, arithmetic task, GRPO)
  relax train --omni-demo           the omni-modal CPU demo (tiny Qwen3-Omni thinker; image, video and
                                    audio multiple-choice questions mixed in every batch)
  relax train --agent-demo          an agent written with Anthropic's SDK (the Messages API) trained
                                    fully async through Relax's engine server (--agent-path)
  relax train my_run.yaml --lr 1e-6 your own run: YAML config plus command-line overrides
  relax train --lora-rank 8         LoRA RL: adapters trained and synced alone (TRL's --use_peft
                                    --lora_r 8, veRL's model.lora_rank, slime's --use-lora;
                                    section "LoRA" below)
  relax train --help                every flag with its default and meaning
  relax watch runs/demo             a running job live: each role's state and weight version, the bus's
                                    depth and staleness, samples/s, reward (`relax status`: one snapshot)
  relax summary runs/demo           a run's outcome in a few lines (while it runs: so far)
  relax ui runs/demo                the run in a browser, live or finished: curves, each step's samples
                                    token by token (policy version, mismatch), the roles' timeline
  relax eval CKPT                   a checkpoint's held-out accuracy (the run's eval data, or --data)
  relax export CKPT OUT             a checkpoint as an HF model directory that serves (with its tokenizer)
  relax prepare-data avqa SRC OUT   a public dataset's own file to the jsonl `relax train` reads
                                    (formats dapo-math, openr1-mm, avqa; see `relax prepare-data --help`
                                    and the GPU recipes in apps/relax/recipes/)
  relax prepare-model omni-thinker SRC DST
                                    a whole Qwen3-Omni checkpoint's thinker saved alone (what the
                                    trainer takes; SGLang serves SRC: the Omni recipe)
"""


COMMANDS = Registry(
    "command",
    "relax.commands",
    {
        "--version": "relax_app.info:version_main",
        "status": "relax_app.watch:status_main",
        "watch": "relax_app.watch:watch_main",
        "ui": "relax_app.ui:ui_main",
        "plan": "relax_app.plan:plan_main",
        "summary": "relax_app.info:summary_main",
        "eval": "relax_app.checkpoint_tools:eval_main",
        "export": "relax_app.checkpoint_tools:export_main",
    },
)
"""Command -> ``"module:function"`` taking the rest of the command line, returning the exit code (another
package adds a command under the ``relax.commands`` entry points)."""


def error_kinds() -> list[tuple[tuple[type[BaseException], ...], int, str]]:
    """The one error boundary of every `relax` command (:func:`main`): (kinds, exit code, how the line
    starts). 2: what was given cannot be used (a config, a directory in use, data or settings that differ
    from the checkpoint's, a checkpoint that is not whole): nothing was lost, fix it and run again. 1: a run
    stopped (restarts exhausted, a fault no restart fixes, a checkpoint it could not write): the
    checkpoints before are kept. Anything else is a bug, shown with its traceback."""
    from relax_app.cli_config import ConfigError
    from relax_core.checkpoints import CheckpointNotFound, CheckpointWriteError
    from relax_core.health import RunFailed, Unfixable
    from relax_core.ownership import DirectoryInUse

    return [
        ((RunFailed, CheckpointWriteError), 1, "the run stopped: "),
        ((ConfigError, DirectoryInUse, Unfixable, CheckpointNotFound), 2, ""),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run one `relax` command; what :func:`error_kinds` lists ends it with one line and its exit code."""
    try:
        return _command(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("relax: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        for kinds, code, start in error_kinds():
            if isinstance(exc, kinds):
                text = str(exc).strip().splitlines()
                print(f"relax: {start}{text[0] if text else type(exc).__name__}", file=sys.stderr)
                return code
        raise


def _command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:  # (each imports what it needs: `relax status` loads no torch)
        return int(COMMANDS.load(command)(rest))
    if command == "prepare-data":
        from relax_app.recipes.loaders import main as prepare_data

        return prepare_data(rest)
    if command == "prepare-model":
        from relax_app.recipes.thinker import main as prepare_model

        return prepare_model(rest)
    if command != "train":
        print(f"relax: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in rest):
        from relax_app.cli_config import help_text
        from relax_app.cli_help import wrap_columns
        from relax_app.demo.agent_demo import AGENT_DEFAULTS
        from relax_app.demo.defaults import DEMO_DEFAULTS
        from relax_app.demo.omni import OMNI_DEFAULTS

        demos = {"demo": DEMO_DEFAULTS, "omni demo": OMNI_DEFAULTS, "agent demo": AGENT_DEFAULTS}
        print(wrap_columns(USAGE) + "\n" + help_text(demos=demos))  # (to the terminal's width)
        return 0
    from relax_app.cli_config import ConfigError, build_config, config_files
    from relax_app.recipes import shipped_configs

    yaml_path = None  # (config files are read where they stand: bare *.yaml arguments and --config FILE)
    overrides = shipped_configs([a for a in rest if a not in ("--omni-demo", "--agent-demo")])
    omni = "--omni-demo" in rest
    try:
        defaults = _built_demo("--agent-demo" in rest, omni)
        if (
            defaults is None
            and not config_files(overrides)
            and not any(a.startswith("--prompt-data") for a in overrides)
        ):
            from relax_app.demo.defaults import DEMO_DEFAULTS

            defaults = DEMO_DEFAULTS
        notes: list[str] = []
        cfg = build_config(yaml_path, overrides, defaults=defaults, notes=notes)
        if cfg.is_demo and defaults is None:  # a YAML with no --prompt-data runs the demo: with its settings
            from relax_app.demo.defaults import DEMO_DEFAULTS

            notes.clear()
            defaults = DEMO_DEFAULTS
            cfg = build_config(yaml_path, overrides, defaults=defaults, notes=notes)
        if cfg.is_demo and not omni and cfg.lora.enabled:  # LoRA's own step size (a given --lr still wins)
            from relax_app.demo.defaults import DEMO_LORA_LR

            assert defaults is not None, "a demo config is built from the demo's defaults (set above)"
            notes.clear()
            cfg = build_config(yaml_path, overrides, defaults={**defaults, "lr": DEMO_LORA_LR}, notes=notes)
    except ConfigError as exc:
        print(f"relax: {exc}", file=sys.stderr)
        return 2
    for note in notes:  # a slime / veRL name that means something else here
        print(f"relax: WARNING: {note}", file=sys.stderr)
    from relax_app.train import check_inputs, train

    try:
        for note in check_inputs(cfg):
            print(f"relax: {note}", file=sys.stderr)
    except (ValueError, OSError) as exc:  # before anything heavy starts
        print(f"relax: {exc}", file=sys.stderr)
        return 2
    train(cfg)  # (what stops it is said in one line by main's error boundary)
    return 0


def _built_demo(agent: bool, omni: bool) -> dict[str, object] | None:
    """The settings of `--agent-demo` / `--omni-demo`, their assets built (and cached) first; else None."""
    import os

    cache = os.environ.get("RELAX_CACHE_DIR", ".relax_cache")
    if agent:
        from relax_app.demo.agent_demo import AGENT_DEFAULTS, prepare_agent_demo

        model, data, held_out = prepare_agent_demo(cache)
        return {**AGENT_DEFAULTS, "prompt_data": data, "eval_data": held_out, "hf_checkpoint": model}
    if omni:
        from relax_app.demo.omni import OMNI_DEFAULTS, prepare_omni_demo

        model, data = prepare_omni_demo(cache)
        return {**OMNI_DEFAULTS, "prompt_data": data, "hf_checkpoint": model}
    return None


if __name__ == "__main__":
    raise SystemExit(main())
