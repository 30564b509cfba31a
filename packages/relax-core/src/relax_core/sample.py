"""The sample schema: every field a Relax sample carries on the bus, which stage writes it, and its type.

Why one module: the rollout writes a sample, ActorFwd / Reference / Teacher / Advantages add fields to it,
the trainer and the report read it. They agreed on names only by convention (``"group_id"`` spelt at 16
places in 9 files); now a writer builds a :class:`RolloutSample` (a TypedDict, so its keys are checked
names, not strings) and every reader indexes with this module's constants (``Final``, so a type checker
reads each as its literal and checks it against the TypedDicts). ``tests/test_architecture.py``
refuses a schema field's name written as a string key anywhere else in the source.

The bus stays schema-agnostic: it stores whatever fields a writer puts (outside users embed it with their
own). Only the roles of a Relax run read this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypedDict, cast

import numpy as np

# -- written by the rollout (and by agent trajectories: relax_rollout.server.trajectories.to_bus_sample) --
TOKENS: Final = "tokens"
"""int64: the prompt's tokens, then the response's."""
PROMPT_LEN: Final = "prompt_len"
RESPONSE_LEN: Final = "response_len"
LOSS_MASK: Final = "loss_mask"
"""float32, one per response token: 0 on what an environment or the chat template added between a
multi-turn episode's model turns (and, with --mask-offpolicy-in-partial-rollout, on tokens sampled before
the response's last weight version)."""
ROLLOUT_LOG_PROBS: Final = "rollout_log_probs"
"""float32, one per response token: the engine's log-probs when it sampled them."""
ROUTED_EXPERTS: Final = "routed_experts"
"""With --routing-replay: each token's MoE experts as the engine routed them."""
MM: Final = "mm"
"""The media tensors of the prompt (multimodal rows only)."""
REWARD: Final = "reward"
REWARD_FAILURE: Final = "reward_failure"
"""Why the reward function failed (the score is then the failure score), or ""."""
POLICY_VERSION: Final = "policy_version"
"""The oldest weight version among the sample's tokens: staleness is measured against it (a field the bus
reserves: it enforces --max-staleness on it)."""
TOKEN_VERSIONS: Final = "token_versions"
"""int32, one per response token: streaming rollout only (a response may go on across weight updates)."""
GROUP_ID: Final = "group_id"
"""``"step:index"``: the n samples of one prompt (advantages are normalised within a group; a field the
bus reserves: its ``group`` sampler hands out whole groups)."""
PROMPT_ID: Final = "prompt_id"
ROLLOUT_STEP: Final = "rollout_step"
FINISH_REASON: Final = "finish_reason"
TURNS: Final = "turns"
ENV_ERROR: Final = "env_error"
TURN_S: Final = "turn_s"
"""Multi-turn: float32, one per model turn, the seconds of the generation that made it (the latency an
agent sees per turn)."""
TOOL_CALL_COUNT: Final = "tool_call_count"
"""Multi-turn with a tool environment: the tool calls the model made in the episode."""
TOOL_CALL_ERRORS: Final = "tool_call_errors"
"""... and how many of them failed (malformed, an unknown tool, bad arguments, the tool raised or timed out)."""
AGENT: Final = "agent"
"""Agent runs (--agent-path): which of the episode's agents (--agents) made this sample's turns; each agent's
samples form groups of their own."""
GENERATED_AT: Final = "generated_at"
"""Streaming rollout: when the group's last response ended (wall clock, seconds)."""
RESPONSE_TEXT: Final = "response_text"
"""The decoded response (multi-turn: the last model turn)."""
ROLLOUT_TOKENS_PER_S: Final = "rollout_tokens_per_s"
WEIGHT_PAUSE_S: Final = "weight_pause_s"
"""The longest time an engine stood still for one weight update since the rollout's previous batch was put
(seconds; 0: no update, or an engine that does not measure it), on every sample of the batch."""
DS_DROPPED_GROUPS: Final = "ds_dropped_groups"
DS_EXTRA_ROUNDS: Final = "ds_extra_rounds"
DS_UNFILLED_GROUPS: Final = "ds_unfilled_groups"

# -- written by the roles computing on a sample --------------------------------------------------------
LOG_PROBS: Final = "log_probs"
"""ActorFwd: the proximal policy's log-probs (one per response token)."""
LOG_PROBS_VERSION: Final = "log_probs_version"
"""ActorFwd: the weight version its log-probs were computed with (the trainer recomputes them when behind)."""
REF_LOG_PROBS: Final = "ref_log_probs"
"""Reference: the reference model's log-probs."""
TEACHER_LOG_PROBS: Final = "teacher_log_probs"
"""Teacher (on-policy distillation): the teacher's log-probs."""
REF_LOG_PROBS_VERSION: Final = "ref_log_probs_version"
TEACHER_LOG_PROBS_VERSION: Final = "teacher_log_probs_version"
ADVANTAGES: Final = "advantages"
"""Advantages: one per response token."""
SHAPED_REWARD: Final = "shaped_reward"
"""Advantages, with the KL in the reward: each sample's reward after the KL penalty (for the report)."""
VALUES: Final = "values"
"""Critic (PPO, --advantage-estimator gae): V(s_t) before each response token, float32, one per token."""
VALUES_VERSION: Final = "values_version"
"""Critic: its version when it computed the values (the batches it had trained on)."""
RETURNS: Final = "returns"
"""Advantages with GAE: the critic's targets, advantage + value per response token (0 off the model's)."""
PROX_FROM_FORWARD: Final = "prox_from_forward"
"""The trainer, on its own batch (never on the bus): per sample, whether π_prox is the training forward's own
log-probs (:func:`relax_train.roles.prox.exact_prox`)."""
CRITIC_UPDATE: Final = "critic_update"
"""Critic: the metrics of its last update before it computed these values (value loss, clip fraction,
gradient norm; a dict of floats), so the trainer logs the critic's training, whichever process it runs in."""


class RolloutSample(TypedDict, total=False):
    """What the rollout puts on the bus (the optional fields only where their feature is on)."""

    tokens: np.ndarray
    prompt_len: int
    response_len: int
    loss_mask: np.ndarray
    rollout_log_probs: np.ndarray
    routed_experts: Any
    mm: Any
    reward: float
    reward_failure: str
    policy_version: int
    token_versions: np.ndarray
    group_id: str
    prompt_id: Any
    rollout_step: int
    finish_reason: str
    turns: int
    env_error: str
    turn_s: np.ndarray
    tool_call_count: int
    tool_call_errors: int
    agent: str
    generated_at: float
    response_text: str
    rollout_tokens_per_s: float
    weight_pause_s: float
    ds_dropped_groups: int
    ds_extra_rounds: int
    ds_unfilled_groups: int


class ForwardFields(TypedDict, total=False):
    """What ActorFwd, Reference and Teacher add (each its own field)."""

    log_probs: np.ndarray
    log_probs_version: int
    ref_log_probs: np.ndarray
    ref_log_probs_version: int
    teacher_log_probs: np.ndarray
    teacher_log_probs_version: int


class AdvantageFields(TypedDict, total=False):
    """What the advantage estimator adds."""

    advantages: np.ndarray
    shaped_reward: float


class CriticFields(TypedDict, total=False):
    """What the Critic adds, and the returns GAE derives from its values."""

    values: np.ndarray
    values_version: int
    returns: np.ndarray
    critic_update: dict[str, float]


class TrainerFields(TypedDict, total=False):
    """What the trainer sets on its own batch before an update (not put on the bus)."""

    prox_from_forward: bool


class TrainSample(RolloutSample, ForwardFields, AdvantageFields, CriticFields, TrainerFields, total=False):
    """A sample as the trainer reads it: everything above."""


class TrainBatch(TypedDict, total=False):
    """A batch as the training side reads it: :class:`TrainSample`'s fields as columns, one entry per sample
    (``batch[TOKENS][i]``). What every backend and trainer-side role takes; built once from the bus's batch
    (:func:`train_batch`). Indexed with this module's constants, so the type checker knows each column's type."""

    tokens: list[np.ndarray]
    prompt_len: list[int]
    response_len: list[int]
    loss_mask: list[np.ndarray]
    rollout_log_probs: list[np.ndarray]
    routed_experts: list[Any]
    mm: list[Any]
    reward: list[float]
    reward_failure: list[str]
    policy_version: list[int]
    token_versions: list[np.ndarray]
    group_id: list[str]
    prompt_id: list[Any]
    rollout_step: list[int]
    finish_reason: list[str]
    turns: list[int]
    env_error: list[str]
    turn_s: list[np.ndarray]
    tool_call_count: list[int]
    tool_call_errors: list[int]
    agent: list[str]
    generated_at: list[float]
    response_text: list[str]
    rollout_tokens_per_s: list[float]
    weight_pause_s: list[float]
    ds_dropped_groups: list[int]
    ds_extra_rounds: list[int]
    ds_unfilled_groups: list[int]
    log_probs: list[np.ndarray]
    log_probs_version: list[int]
    ref_log_probs: list[np.ndarray]
    ref_log_probs_version: list[int]
    teacher_log_probs: list[np.ndarray]
    teacher_log_probs_version: list[int]
    advantages: list[np.ndarray]
    shaped_reward: list[float]
    values: list[np.ndarray]
    values_version: list[int]
    returns: list[np.ndarray]
    critic_update: list[dict[str, float]]
    prox_from_forward: list[bool]


def train_batch(columns: Mapping[str, list[Any]], need: tuple[str, ...] = (TOKENS, PROMPT_LEN)) -> TrainBatch:
    """The bus's columns (``Batch.data``) as a :class:`TrainBatch`: the same lists, no copy. A missing ``need``
    column or columns of unequal length are refused, naming them. A column of no schema field (a new role's
    own) rides along, untyped."""
    missing = [name for name in need if name not in columns]
    if missing:
        raise ValueError(
            f"batch lacks the columns {missing} (of {sorted(columns)}): a role upstream did not write them"
        )
    sizes = {name: len(col) for name, col in columns.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch columns differ in length: {sizes}")
    return cast(TrainBatch, columns)  # (the schema's fields, typed; any others ride along)


def columns(batch: TrainBatch) -> Mapping[str, list[Any]]:
    """``batch`` as plain columns, for code that goes over every field (a sub-batch, parts joined)."""
    return cast(Mapping[str, list[Any]], batch)


VERSION_OF: dict[str, str] = {
    LOG_PROBS: LOG_PROBS_VERSION,
    REF_LOG_PROBS: REF_LOG_PROBS_VERSION,
    TEACHER_LOG_PROBS: TEACHER_LOG_PROBS_VERSION,
    VALUES: VALUES_VERSION,
}
"""A field computed with a model -> the field saying which version of that model computed it."""

FIELDS: frozenset[str] = frozenset(TrainSample.__annotations__)
"""Every field name of the schema (the architecture test checks the constants above name exactly these)."""
