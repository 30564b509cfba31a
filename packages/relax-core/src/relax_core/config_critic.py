"""PPO with a learned critic: the value model's section of the run configuration (``cfg.critic``).

Why its own section: the critic is a role of its own (``relax_train.roles.critic``) with its own model,
optimizer and schedule, and GAE's γ and λ only mean something with it. It runs when
``--advantage-estimator gae``; its flags set without that are refused (:meth:`CriticConfig.check_used`).
Names as veRL and OpenRLHF users know them (``--critic-lr``, ``--critic-warmup``, ``--gamma``, ``--lambd``);
their other spellings are aliases (:mod:`relax_app.cli_aliases`: ``--lam``, ``--cliprange-value``,
``--critic-ppo-epochs``, ``--critic-learning-rate``, ``--critic-model-path``).
"""

from __future__ import annotations

from pydantic import Field

from relax_core.config_sections import Section

GAE = "gae"
"""The advantage estimator that runs the critic (``--advantage-estimator gae``)."""


class CriticConfig(Section):
    """The Critic role's model, optimizer and schedule, and GAE's discounts."""

    critic_checkpoint: str | None = None
    """The value model's HF directory: a causal LM whose trunk gets a scalar head, or a critic checkpoint's
    ``critic/`` directory (its head comes back). Default: the policy's (--hf-checkpoint), with a new head
    (veRL's critic.model.path defaults to the actor's too)."""
    critic_lr: float | None = Field(None, gt=0.0)
    """The critic's AdamW learning rate (constant); default --lr. Critics usually train faster than the
    policy (veRL's examples: 1e-5 against the actor's 1e-6)."""
    critic_warmup: int = Field(0, ge=0)
    """Steps at the start of the run in which only the critic trains: the actor takes its batches but does
    not update (its version still counts the step), so the first advantages come from a fitted value model
    (veRL's trainer.critic_warmup)."""
    critic_epochs: int = Field(1, ge=1)
    """K: passes of the critic over each batch it values (each a sweep of optimizer steps of
    --critic-global-batch-size samples) per actor update; veRL's critic.ppo_epochs, slime #2329's ask."""
    critic_global_batch_size: int | None = Field(None, ge=1)
    """Samples per critic optimizer step; default --global-batch-size (or the whole batch)."""
    value_clip: float | None = Field(0.5, gt=0.0)
    """Clipped value loss (PPO2): a new value moves at most this far from the value the batch was scored with
    before its squared error counts; the larger of the clipped and unclipped errors is taken (veRL's
    critic.cliprange_value, default 0.5). None: the plain squared error."""
    value_loss_coef: float = Field(0.5, gt=0.0)
    """The value loss's factor: loss = coef · token-mean of the squared errors (veRL's 0.5 · (v − R)²)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """GAE's discount γ, per model token (veRL's algorithm.gamma, OpenRLHF's --gamma)."""
    lambd: float = Field(1.0, ge=0.0, le=1.0)
    """GAE's λ: 1 is Monte-Carlo returns minus the value, 0 one-step TD (veRL's algorithm.lam, OpenRLHF's
    --lambd)."""

    def check_used(self, estimator: str, multimodal: bool = False) -> None:
        """Refuse critic flags set for a run without the critic (--advantage-estimator other than gae), and
        a critic on multimodal rows (its value model reads text only, for now)."""
        if estimator == GAE:
            if multimodal:
                raise ValueError(
                    "--advantage-estimator gae with --multimodal-keys: the critic's value model reads text "
                    "only for now; train multimodal runs with a group baseline (grpo, the default)"
                )
            return
        fields = type(self).model_fields
        changed = sorted(f for f in self.model_fields_set if getattr(self, f) != fields[f].default)
        if changed:
            flags = ", ".join("--" + f.replace("_", "-") for f in changed)
            raise ValueError(
                f"{flags} set but no critic runs (--advantage-estimator {estimator}): add "
                "--advantage-estimator gae for PPO with a learned critic, or drop the flags"
            )
