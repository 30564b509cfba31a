"""The rollout role's config turned into an engine: which backend, with which arguments.

Why here and not under ``engines/``: an engine takes plain arguments (a model path, GPU counts, launch
flags) and is built the same way by a test, a benchmark or a served engine process; only the rollout role
has a ``RelaxConfig``, and reading it is this module's job alone, so nothing under ``engines/`` depends on
the config's shape. The worker calls :func:`engine_kwargs`, places what it must (GPUs), then
:func:`build_from_config`; an engine pool (``--rollout-engines``) is built by
:mod:`relax_rollout.engine_service` instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_core.config import RelaxConfig
from relax_rollout.engines import build_engine
from relax_rollout.engines.base import RolloutEngine


def sglang_kwargs(cfg: RelaxConfig) -> dict[str, Any]:
    """The :class:`~relax_rollout.engines.sglang.SGLangEngine` arguments a ``RelaxConfig`` sets besides the
    model and its dtype (``--rollout-num-gpus``, ``--rollout-num-gpus-per-engine``,
    ``--sglang-mem-fraction-static``, ``--sglang-server-args``, ``--sglang-model-path``,
    ``--sglang-weight-update``, ``--sglang-python``, ``--sglang-env``; on several nodes, ``gpus_per_node``
    from ``--actor-num-gpus-per-node``). Colocate with offload adds SGLang's memory saver, --partial-rollout
    turns its overlap scheduler and its prefix (radix) cache off, unless ``--sglang-server-args`` says
    otherwise (the config refuses the radix cache with --partial-rollout)."""
    r = cfg.rollout
    server_args = dict(r.sglang_server_args)
    if cfg.run.mode == "colocate" and cfg.run.offload is not False:  # SGLang on GPUs: offload by default
        server_args.setdefault("enable_memory_saver", True)  # what /release_memory_occupation needs
    if r.partial_rollout:
        # exact per-token versions: under SGLang's overlap scheduler an in-place pause leaves the last
        # decode step's result queued (its loop `continue`s before processing it), so the version change
        # counts each running request's output without that token, and the reply stamps a token of the old
        # weights with the new version (measured against SGLang 0.5.23: tests/engines/test_sglang_real.py).
        # Keep overlap with {"disable_overlap_schedule": false}: the boundary is then one token late.
        server_args.setdefault("disable_overlap_schedule", True)
        # no prefix cache: an update under an in-place pause cannot flush it (the paused requests use it),
        # and a later prompt sharing a cached prefix would be served from KV of the old weights under the
        # new version's label (measured against SGLang 0.5.23: a log-prob off by 3.1 nats; AReaL turns it
        # off for the same reason). Costs the prompt's prefill once per response instead of once per group.
        server_args.setdefault("disable_radix_cache", True)
    out = {
        "num_engines": max(1, r.rollout_num_gpus // r.rollout_num_gpus_per_engine),
        "tp_size": r.rollout_num_gpus_per_engine,
        "mem_fraction_static": r.sglang_mem_fraction_static,
        "server_args": server_args,
        "weight_update": r.sglang_weight_update,
        "python": r.sglang_python,
        "env": dict(r.sglang_env),
    }
    t = cfg.train
    if t.actor_num_nodes > 1 and t.actor_num_gpus_per_node and r.rollout_num_gpus > t.actor_num_gpus_per_node:
        # more engines than the rollout's node holds: the rest on the cluster's other nodes, which load each
        # weight version from the run's output directory (on a filesystem every node sees)
        out["gpus_per_node"] = t.actor_num_gpus_per_node
        if r.sglang_weight_update == "disk":
            out["weights_dir"] = str(Path(cfg.run.output_dir).absolute() / "engine_weights")
    if r.sglang_model_path:  # (Qwen3-Omni: the whole model; the trainer's --hf-checkpoint is its thinker)
        out["model_path"] = r.sglang_model_path
    return out


def engine_kwargs(cfg: RelaxConfig) -> dict[str, Any]:
    """The engine arguments of ``--rollout-backend`` beyond the model, its dtype and tokens: the server URLs
    (``external``), :func:`sglang_kwargs` (``sglang``), and ``record_routing`` with ``--routing-replay``
    (which only the ``torch`` and ``sglang`` engines can record), and with LoRA in ``--lora-sync-mode
    adapter`` ``lora`` (the adapter's :func:`~relax_core.lora.peft_config_dict`: those engines serve base +
    adapter and take adapter updates)."""
    backend = cfg.rollout.rollout_backend
    extra: dict[str, Any] = {"urls": cfg.rollout.rollout_external_urls} if backend == "external" else {}
    if backend == "sglang":  # engines, GPUs per engine, SGLang's launch flags
        extra = sglang_kwargs(cfg)
    if cfg.algo.routing_replay:  # R3: the engine records each token's MoE experts for the trainer
        if backend not in ("torch", "sglang"):
            raise ValueError(
                f"--routing-replay needs --rollout-backend torch or sglang (their engines record the experts "
                f"each token was routed to); got --rollout-backend {backend}"
            )
        extra["record_routing"] = True
    if cfg.lora.enabled and cfg.lora.lora_sync_mode == "adapter" and backend in ("torch", "sglang"):
        from relax_core.lora import peft_config_dict

        extra["lora"] = peft_config_dict(cfg.lora)
    if cfg.model.torch_compile and backend == "torch":  # (SGLang compiles on its own terms: its server args)
        extra["compile"] = True
    return extra


def build_from_config(
    cfg: RelaxConfig, model_path: str, tokenizer: Any, extra: dict[str, Any]
) -> RolloutEngine:
    """The ``--rollout-backend`` engine on ``model_path`` (``--sglang-model-path`` where given), with the
    tokenizer's EOS and pad ids and ``extra`` (:func:`engine_kwargs`, plus what the caller placed)."""
    extra = dict(extra)
    return build_engine(
        cfg.rollout.rollout_backend,
        model_path=extra.pop("model_path", model_path),  # (--sglang-model-path)
        dtype=cfg.model.dtype,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
