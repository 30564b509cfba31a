"""The rules of a run configuration that span its sections (batch sizes against
samples, modes against placement, parallel sizes against GPUs, streaming against what it serves), each
refusal saying what to change.

Why apart from :mod:`relax_core.config`: that module declares the fields, one docstring each; the rules
between them read better together here, and each module stays short.
"""

from __future__ import annotations

from typing import Protocol

from relax_core.config_agents import DEFAULT_AGENT, AgentConfig
from relax_core.config_lora import LoraConfig
from relax_core.config_sections import (
    DataConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)


class Sections(Protocol):
    """What the rules read: a :class:`~relax_core.config.RelaxConfig` (named by its shape, so this module
    does not import the one that calls it)."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    train: TrainConfig
    run: RunConfig
    lora: LoraConfig
    agent: AgentConfig


def check(cfg: Sections) -> None:
    """Raise ``ValueError`` naming the flags to change when ``cfg``'s sections disagree."""
    _check_rollout_shape(cfg)
    _check_lora(cfg)
    _check_training(cfg)
    _check_placement(cfg)
    _check_agent(cfg)
    if (cfg.data.prompt_data is None) != (cfg.model.hf_checkpoint is None):
        raise ValueError(
            "--prompt-data and --hf-checkpoint go together: give both for your own run, or neither "
            "for the built-in CPU demo"
        )


def _check_rollout_shape(cfg: Sections) -> None:
    """Batch sizes, dynamic sampling, staleness and offload against the mode."""
    per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    gbs = cfg.train.global_batch_size
    if gbs is not None and per_rollout % gbs != 0:
        raise ValueError(
            f"--global-batch-size ({gbs}) must divide --rollout-batch-size × --n-samples-per-prompt "
            f"({cfg.rollout.rollout_batch_size} × {cfg.rollout.n_samples_per_prompt} = {per_rollout})"
        )
    if cfg.rollout.dynamic_sampling and cfg.rollout.n_samples_per_prompt < 2:
        raise ValueError(
            "--dynamic-sampling needs --n-samples-per-prompt >= 2: a group of one response never has "
            f"differing rewards (got {cfg.rollout.n_samples_per_prompt})"
        )
    if cfg.run.mode == "colocate" and cfg.run.max_staleness > 0:
        raise ValueError(
            f"--max-staleness {cfg.run.max_staleness} needs --fully-async: colocate mode is strictly "
            "on-policy (staleness 0)"
        )
    if cfg.run.offload and cfg.run.mode != "colocate":
        raise ValueError(
            "--offload time-shares the devices between rollout and training in colocate mode; with "
            "--fully-async every role has devices of its own: drop --offload"
        )


def _check_training(cfg: Sections) -> None:
    """The megatron backend's parallel sizes against the GPUs, and the options that need its backend."""
    t = cfg.train
    if t.train_backend == "megatron":
        world = t.actor_num_nodes * t.actor_num_gpus_per_node
        sizes = (
            t.tensor_model_parallel_size,
            t.pipeline_model_parallel_size,
            t.context_parallel_size,
            t.expert_model_parallel_size,
            t.expert_tensor_parallel_size or 1,
        )
        if world == 0 and max(sizes) > 1:
            raise ValueError(
                "--train-backend megatron with model parallelism runs on GPUs: set "
                "--actor-num-gpus-per-node (≥ 1); without GPUs each role is one CPU process (all "
                "parallel sizes 1)"
            )
        world = world or 1
        mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
        if world % mp:
            raise ValueError(
                f"--actor-num-nodes × --actor-num-gpus-per-node ({world} GPUs) must be a multiple of TP × PP × "
                f"CP ({t.tensor_model_parallel_size} × {t.pipeline_model_parallel_size} × "
                f"{t.context_parallel_size} = {mp}); the rest is data parallelism"
            )
        etp = t.expert_tensor_parallel_size or t.tensor_model_parallel_size
        if (world // t.pipeline_model_parallel_size) % (t.expert_model_parallel_size * etp):
            raise ValueError(
                f"expert parallelism: EP × expert TP ({t.expert_model_parallel_size} × {etp}) must divide the "
                f"GPUs of one pipeline stage ({world // t.pipeline_model_parallel_size})"
            )
    if t.use_distributed_optimizer and t.train_backend != "megatron":
        raise ValueError(
            "--use-distributed-optimizer shards the optimizer over the megatron backend's data-parallel "
            "replicas: add --train-backend megatron, or drop it"
        )
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        raise ValueError(
            "--use-dynamic-batch-size packs micro-batches up to --max-tokens-per-gpu padded tokens: set it "
            "(e.g. --max-tokens-per-gpu 4096), or drop --use-dynamic-batch-size to batch by --micro-batch-size"
        )


def _check_placement(cfg: Sections) -> None:
    """Engines, the elastic API, role nodes and streaming against the mode; the elastic token."""
    r = cfg.rollout
    if r.rollout_backend == "sglang" and (
        r.rollout_num_gpus == 0 or r.rollout_num_gpus % r.rollout_num_gpus_per_engine
    ):
        raise ValueError(
            f"--rollout-backend sglang: --rollout-num-gpus ({r.rollout_num_gpus}) must be a positive multiple of "
            f"--rollout-num-gpus-per-engine ({r.rollout_num_gpus_per_engine})"
        )
    if (r.rollout_engines or r.elastic_port is not None) and cfg.run.mode != "fully_async":
        raise ValueError(
            "--rollout-engines / --elastic-port need --fully-async: engine processes and the elastic API "
            "live on the Ray cluster"
        )
    if cfg.run.role_nodes and cfg.run.mode != "fully_async":
        raise ValueError(
            "--role-nodes places fully-async roles on nodes; colocate runs every role in the driver's process "
            "(a megatron trainer's ranks follow --actor-num-nodes): add --fully-async or drop --role-nodes"
        )
    if (
        r.elastic_port is not None
        and r.elastic_host not in ("127.0.0.1", "localhost", "::1")
        and not (r.elastic_token)
    ):
        raise ValueError(
            f"--elastic-host {r.elastic_host} is not loopback: give --elastic-token (scaling changes the run)"
        )
    if r.elastic_token is not None and (
        not r.elastic_token.strip() or r.elastic_token != r.elastic_token.strip()
    ):
        raise ValueError(  # (" " passed here and failed 31 s later with a traceback)
            "--elastic-token must be a non-blank token without leading or trailing spaces (e.g. from "
            "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`), or unset"
        )
    if r.streaming_rollout or r.partial_rollout or r.mask_offpolicy_in_partial_rollout:
        _check_streaming(cfg)


def _check_streaming(cfg: Sections) -> None:
    """--streaming-rollout / --partial-rollout: what they serve today, refused otherwise with the reason."""
    r = cfg.rollout
    if r.partial_rollout and not r.streaming_rollout:
        raise ValueError(
            "--partial-rollout continues responses across weight updates: add --streaming-rollout"
        )
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        raise ValueError("--mask-offpolicy-in-partial-rollout masks what --partial-rollout continues: add it")
    if r.partial_rollout and r.sglang_server_args.get("disable_radix_cache") is False:
        raise ValueError(
            "--partial-rollout with SGLang's radix cache (--sglang-server-args disable_radix_cache: false): "
            "an update under an in-place pause cannot flush that cache, so prompts sharing a cached prefix "
            "would be served from KV of the old weights under the new version; drop disable_radix_cache "
            "from --sglang-server-args (partial rollout turns the cache off)"
        )
    off = [
        flag
        for flag, on in (
            ("--dynamic-sampling", r.dynamic_sampling),
            ("--env-path", r.env_path is not None),
            ("--agent-path", cfg.agent.agent_path is not None),
            ("--multimodal-keys", bool(cfg.data.multimodal_keys)),
        )
        if on
    ]
    if cfg.run.mode != "fully_async" or off:
        raise ValueError(
            "--streaming-rollout streams single-turn text groups in --fully-async runs"
            + (f"; it does not combine with {', '.join(off)} yet" if off else ": add --fully-async")
        )


def _check_agent(cfg: Sections) -> None:
    """--agent-path: the agent's own calls are the rollout, so what drives generation itself is refused."""
    a, r = cfg.agent, cfg.rollout
    if a.agent_path is None:
        if a.agents != [DEFAULT_AGENT]:
            raise ValueError("--agents names the agents of --agent-path's episodes: add --agent-path")
        return
    clash = [
        flag
        for flag, on in (
            ("--env-path", r.env_path is not None),
            ("--dynamic-sampling", r.dynamic_sampling),
            ("--multimodal-keys", bool(cfg.data.multimodal_keys)),
        )
        if on
    ]
    if clash:
        raise ValueError(
            f"--agent-path runs your agent's own episodes; it does not combine with {', '.join(clash)}"
        )


def _check_lora(cfg: Sections) -> None:
    """LoRA against what trains and serves it (the per-field rules are :class:`LoraConfig`'s)."""
    lora = cfg.lora
    if not lora.enabled:
        return
    if cfg.train.train_backend == "megatron":
        raise ValueError(
            "--lora-rank with --train-backend megatron: megatron-core (0.16) has no LoRA layers and "
            "Megatron-Bridge, which adds them, does not run here; train LoRA with --train-backend torch"
        )
    if lora.lora_sync_mode == "adapter" and cfg.rollout.rollout_backend == "external":
        raise ValueError(
            "--lora-sync-mode adapter with --rollout-backend external: relax does not load adapters into "
            "engines it did not start; use --lora-sync-mode merged (full weights after each step)"
        )
