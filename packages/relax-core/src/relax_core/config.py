"""Typed run configuration.

One pydantic model per concern (model, data, rollout, train, algorithm, run), every field documented,
bounded and validated before anything starts, so a bad value fails in a second instead of after an hour
of cluster start-up. The sections live in :mod:`relax_core.config_sections`; this module assembles them
and runs the rules across them (:mod:`relax_core.config_checks`). Field names match the flags users of upstream Relax and slime know: every leaf field
``foo_bar`` is also the command-line flag ``--foo-bar`` (see :mod:`relax_app.cli_config`).
"""

from __future__ import annotations

from pydantic import model_validator

from relax_core.config_agents import AgentConfig
from relax_core.config_checks import check
from relax_core.config_critic import GAE, CriticConfig
from relax_core.config_lora import LoraConfig
from relax_core.config_sections import (
    AlgoConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    Section,
    TrainConfig,
)


class RelaxConfig(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    algo: AlgoConfig = AlgoConfig()
    lora: LoraConfig = LoraConfig()
    critic: CriticConfig = CriticConfig()
    agent: AgentConfig = AgentConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _check(self) -> RelaxConfig:
        a = self.algo
        if a.decoupled_ppo is None:  # the default: on where trained samples may come from older policies
            stale = self.run.mode == "fully_async" and self.run.max_staleness >= 1
            a.__dict__["decoupled_ppo"] = stale and a.use_actor_fwd
        self.critic.check_used(a.advantage_estimator, bool(self.data.multimodal_keys))
        check(self)  # the rules across sections (relax_core.config_checks)
        return self

    @property
    def samples_per_rollout(self) -> int:
        """Samples of one rollout step: a prompt's n responses, or with --agent-path n episodes of each agent."""
        per_prompt = self.rollout.n_samples_per_prompt
        if self.agent.agent_path:
            per_prompt *= len(self.agent.agents)
        return self.rollout.rollout_batch_size * per_prompt

    @property
    def inflight_groups(self) -> int:
        """Streaming rollout's prompt groups generating at once (``--max-inflight-groups``; by default a
        step's for each version the staleness bound lets run ahead)."""
        r = self.rollout
        return int(r.max_inflight_groups or r.rollout_batch_size * (self.run.max_staleness + 1))

    @property
    def bus_samples(self) -> int:
        """The bus's capacity: ``--bus-capacity``, raised to a step's samples and, under streaming rollout,
        to every group in flight — a smaller bus fills with later steps' groups while step k's last ones
        wait to be put, and the trainer, waiting for step k whole, never frees it (a deadlock)."""
        need = self.samples_per_rollout
        if self.rollout.streaming_rollout:
            need = max(
                need, self.inflight_groups * self.samples_per_rollout // self.rollout.rollout_batch_size
            )
        return max(self.run.bus_capacity, need)

    @property
    def effective_global_batch_size(self) -> int:
        return self.train.global_batch_size or self.samples_per_rollout

    @property
    def prox_from_training_forward(self) -> bool:
        """Whether π_prox (--use-actor-fwd's log-probs) comes from the trainer's own training forward, so no
        ActorFwd role runs. True when π_prox is exact (--exact-proximal-policy; colocate is exact always) and
        every rollout batch is one optimizer step (--global-batch-size = the batch, the default): the training
        forward then runs with exactly π_prox's weights, and its log-probs, detached, are π_prox bit for bit
        (TRL and AReaL skip this forward too). With several optimizer steps per batch the later steps' π_prox
        needs the weights before the first update: ActorFwd runs."""
        a = self.algo
        exact = a.exact_proximal_policy or self.run.mode == "colocate"
        return a.use_actor_fwd and exact and self.effective_global_batch_size >= self.samples_per_rollout

    @property
    def uses_critic(self) -> bool:
        """Whether the Critic role runs (PPO with a learned value model: --advantage-estimator gae)."""
        return self.algo.advantage_estimator == GAE

    @property
    def critic_lr(self) -> float:
        """The critic's learning rate: --critic-lr, else --lr."""
        return self.critic.critic_lr or self.train.lr

    @property
    def critic_global_batch_size(self) -> int:
        """Samples per critic optimizer step: --critic-global-batch-size, else the trainer's."""
        return self.critic.critic_global_batch_size or self.effective_global_batch_size

    @property
    def is_demo(self) -> bool:
        return self.data.prompt_data is None

    @property
    def uses_teacher(self) -> bool:
        """Whether the Teacher role runs (on-policy distillation)."""
        return self.model.teacher_checkpoint is not None
