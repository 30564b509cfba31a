"""`relax plan`'s config: the cluster, the model, the workload, and the run's own relax settings.

A YAML file of five sections (every field documented below; ``relax plan --help`` prints them):

.. code-block:: yaml

    cluster: {device: H100-SXM, rollout_gpus: 64, train_gpus: 64, rollout_tp: 1, link_gbps: 400}
    model: {hidden_size: 4096, num_hidden_layers: 36, ...}   # the model's config.json fields
    workload: {prompts_per_step: 512, samples_per_prompt: 16, prompt_tokens: 512,
               response: {kind: lognormal, mean: 3000, max: 16384, sigma: 0.9}, steps: 8}
    run: {mode: fully_async, max_staleness: 1, streaming_rollout: true, partial_rollout: true}
    efficiency: {train_mfu: 0.35}   # optional: the shares of peak (relax_app.plan.costs.Efficiency)

``run`` holds `relax train` settings by their flag names (``max_staleness``, ``streaming_rollout``,
``lora_rank``, ``weight_sync_delta``, ``kl_coef``...): the simulator builds the run's own
:class:`~relax_core.config.RelaxConfig` from them, so its roles, bus and policies are the real run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax_app.plan.costs import DEVICES, Device, Efficiency


class Cluster(BaseModel):
    """The machines: which device, how many for rollout and for training, and the link between them."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    device: str = "H100-SXM"
    """A device of :data:`relax_app.plan.costs.DEVICES` (H100-SXM, H800, H20, A100-80GB) or ``custom``."""
    custom: Device | None = None
    """The device's figures, with ``device: custom``."""
    rollout_gpus: int = Field(8, ge=1)
    """Devices generating (fully async); colocate runs everything on rollout_gpus + train_gpus."""
    train_gpus: int = Field(8, ge=0)
    """Devices training (fully async), ActorFwd and the reference share them (colocate may give 0: all on
    rollout_gpus)."""
    role_gpus: dict[str, int] = {}
    """Devices of their own for consumer roles (``actor_fwd``, ``reference``), fully async; a role not named
    takes turns with the trainer on ``train_gpus``."""
    rollout_tp: int = Field(1, ge=1)
    """Devices per rollout engine (tensor parallel): rollout_gpus / rollout_tp engines."""
    engine: Literal["sglang", "torch"] = "sglang"
    """The rollout engine: ``sglang`` batches continuously; ``torch`` (relax's CPU engine) generates a batch
    statically (its rows computed until the longest ends) and batches continuously only under streaming."""
    link_gbps: float = Field(400.0, gt=0)
    """The trainer-to-engines link per device, Gbit/s (InfiniBand NDR: 400)."""
    link_latency_s: float = Field(0.05, ge=0)
    """A weight sync's fixed cost: NCCL group set-up per bucket, the version's handshake."""

    @property
    def devices(self) -> int:
        """Every device of the plan (colocate runs all its roles on all of them)."""
        return self.rollout_gpus + self.train_gpus + sum(self.role_gpus.values())

    def spec(self) -> Device:
        if self.device == "custom":
            if self.custom is None:
                raise ValueError(
                    "cluster.device is custom: give cluster.custom (peak_tflops, hbm_gbps, memory_gb)"
                )
            return self.custom
        if self.device not in DEVICES:
            raise ValueError(f"cluster.device {self.device!r} is not one of {sorted(DEVICES)} (or custom)")
        return DEVICES[self.device]


class Lengths(BaseModel):
    """How long responses are: ``fixed``, ``lognormal`` (``mean``, ``sigma``), ``pareto`` (a long tail:
    ``mean``, shape ``alpha``) or ``lomax`` (``scale`` times numpy's Pareto II of shape ``alpha``: what
    ``--long-tail-min-tokens scale`` draws), each cut at ``max``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    kind: Literal["fixed", "lognormal", "pareto", "lomax"] = "lognormal"
    mean: float = Field(1000.0, gt=0)
    """Mean tokens before the cut at ``max``."""
    max: int = Field(8192, ge=1)
    sigma: float = Field(1.0, gt=0)
    """Lognormal's sigma (of the log): 1.0 is a wide spread, RL on reasoning tasks."""
    alpha: float = Field(1.5, gt=1)
    """Pareto's and Lomax's shape: lower is a heavier tail."""
    scale: float = Field(16.0, gt=0)
    """Lomax's scale (tokens)."""


class Media(BaseModel):
    """A prompt's images and audio, counted in tokens as the run's own preprocessing counts them
    (:mod:`relax_multimodal.specs`: the model family's patch grid, its audio encoder's rate)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    model: str = "qwen3_omni"
    """A model family of ``relax_multimodal.specs.MODELS`` (qwen2_5_vl, qwen3_vl, qwen2_5_omni, qwen3_omni)."""
    images: list[tuple[int, int]] = []
    """Each image of a prompt: (width, height) in pixels."""
    audio_s: list[float] = []
    """Each audio clip of a prompt, in seconds."""

    @model_validator(mode="after")
    def _check(self) -> Media:
        self.tokens()  # (an unknown family or an image it cannot take says so at load)
        return self

    def tokens(self) -> int:
        """Tokens the media add to a prompt, their start and end markers included."""
        from relax_multimodal.specs import get_spec, smart_resize, whisper_frames

        spec = get_spec(self.model)
        n = 0
        for width, height in self.images:
            h, w = smart_resize(height, width, spec.factor)
            n += spec.tokens_for_grid(1, h // spec.patch_size, w // spec.patch_size) + 2
        for seconds in self.audio_s:
            n += spec.audio_tokens(whisper_frames(int(seconds * spec.audio_rate), spec.hop_length)) + 2
        return n


class Workload(BaseModel):
    """What each step generates and trains on."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    prompts_per_step: int = Field(64, ge=1)
    samples_per_prompt: int = Field(8, ge=1)
    prompt_tokens: int = Field(512, ge=1)
    """A prompt's text tokens (its template and system prompt included)."""
    media: Media | None = None
    """A prompt's images and audio (multimodal runs): their tokens are added to ``prompt_tokens``."""
    response: Lengths = Lengths()
    steps: int = Field(6, ge=2)
    """Steps simulated (the first ones fill the pipeline; the report counts from the second)."""
    reward_s: float = Field(0.0, ge=0)
    """Seconds a sample's reward takes (a remote judge), ``reward_concurrency`` at once."""
    delta_share: float = Field(0.07, gt=0, le=1)
    """With ``weight_sync_delta``: the bytes of a delta version against a full one (BENCHMARKS.md, #53: 6.6%
    of bf16 elements change a step at lr 1e-5, their indices and values zstd-compressed ≈ 7%)."""
    seed: int = 0

    @property
    def prompt_total(self) -> int:
        """A prompt's tokens: its text and its media's."""
        return self.prompt_tokens + (self.media.tokens() if self.media else 0)


class PlanConfig(BaseModel):
    """A whole plan (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    name: str = "plan"
    cluster: Cluster = Cluster()
    model: dict[str, Any]
    """The model's Hugging Face ``config.json`` fields (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, vocab_size; an MoE's num_experts, num_experts_per_tok,
    moe_intermediate_size), plus ``tie_word_embeddings``."""
    workload: Workload = Workload()
    run: dict[str, Any] = {}
    """`relax train` settings by flag name (``mode``: colocate or fully_async; ``max_staleness``...)."""
    baseline_run: dict[str, Any] = {}
    """Settings of the colocate run a speed-up is measured against, where it ran differently from ``run``
    (a publication's baseline: veRL's colocate recomputes old log-probs, ``use_actor_fwd: true``, where its
    fully-async run takes the engines' own); applied over ``run`` for the colocate anchor."""
    efficiency: Efficiency = Efficiency()
    dtype_bytes: int = Field(2, ge=1)
    """Bytes a weight and a KV-cache element take (bf16: 2; the CPU runs' fp32: 4)."""
    published: dict[str, Any] | None = None
    """A shipped example's published figure (``speedup``, ``source``) to print beside the prediction."""

    @model_validator(mode="after")
    def _check(self) -> PlanConfig:
        self.cluster.spec()
        if self.run.get("mode", "fully_async") != "colocate" and self.cluster.train_gpus < 1:
            raise ValueError("cluster.train_gpus must be at least 1 when the roles run apart (fully async)")
        if self.cluster.rollout_gpus % self.cluster.rollout_tp:
            raise ValueError(
                f"cluster.rollout_gpus {self.cluster.rollout_gpus} is not a multiple of rollout_tp "
                f"{self.cluster.rollout_tp}"
            )
        return self


EXAMPLES = Path(__file__).parent / "examples"
"""The shipped plans (published setups; in the wheel too): `relax plan NAME` runs ``NAME.yaml`` of them."""


def load_plan(path: str | Path) -> PlanConfig:
    """A plan from its YAML file, or a shipped example by name; a ValueError naming the file and the field
    when it is not one."""
    if not Path(path).exists() and (EXAMPLES / f"{path}.yaml").is_file():
        path = EXAMPLES / f"{path}.yaml"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot be read as YAML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a plan is a mapping of sections (cluster, model, workload, run)")
    try:
        return PlanConfig.model_validate(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
