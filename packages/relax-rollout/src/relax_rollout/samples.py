"""The rollout role's samples: a generated batch scored and made into the bus's samples, and put.

Why a room of its own: this is where the rollout's samples are assembled — a
:class:`~relax_core.sample.RolloutSample` per response, the schema every reader (the trainer, the advantage
estimator, the report) imports from :mod:`relax_core.sample`, so a field is added or renamed there.

``relax_rollout.server.trajectories.to_bus_sample`` writes the same schema for agent trajectories.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from relax_bus import Bus, DuplicateIds
from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.sample import RolloutSample
from relax_rollout.generation import Generated

logger = logging.getLogger(__name__)


class SampleWriter:
    """Scores generated batches with ``scorer`` and puts their samples on ``bus``. ``journaled``: under the
    health manager, samples get ids fixed by their step, so a batch re-sent after a restart is refused.
    ``pause()``: the longest weight-update pause of the engine since its last call (0.0: none)."""

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Bus,
        tokenizer: Any,
        scorer: Any,
        tracer: Any,
        journaled: bool,
        pause: Callable[[], float] = lambda: 0.0,
    ):
        self.cfg, self.bus, self.tokenizer, self.scorer = cfg, bus, tokenizer, scorer
        self.tracer, self.journaled, self.pause = tracer, journaled, pause

    def score(self, gen: Generated) -> tuple[list, float]:
        """Rewards of a generated batch (and its decoded texts, kept in ``gen.texts``), and the seconds spent."""
        rows, outs = gen.rows, gen.outs
        n = self.cfg.rollout.n_samples_per_prompt
        t1 = time.perf_counter()
        if gen.texts is None:  # (multi-turn: the last model turn, set by Generation.episodes)
            gen.texts = [self.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        texts = gen.texts
        labels = [row.label for row in rows for _ in range(n)]
        metas = [row.metadata for row in rows for _ in range(n)]
        with self.tracer.span("reward", step=gen.step):
            results = self.scorer.score_batch(texts, labels, metas)
        from relax_rewards import RewardResult

        for i, o in enumerate(outs):  # an environment's own reward wins over --rm-type
            if o.episode is None:
                continue
            if o.episode.env_reward_error:  # (checked on the environment's time-limited thread)
                results[i] = self.scorer.fail(o.episode.failure, o.episode.env_reward_error)
            elif o.episode.env_reward is not None:
                results[i] = RewardResult(float(o.episode.env_reward))
        return results, time.perf_counter() - t1

    def samples(self, gen: Generated, results: list) -> list[RolloutSample]:
        """The bus samples of a scored batch (:class:`~relax_core.sample.RolloutSample`)."""
        step, rows, prompts, outs = gen.step, gen.rows, gen.prompts, gen.outs
        n = self.cfg.rollout.n_samples_per_prompt
        texts = gen.texts  # (set by score, or by multi-turn generation)
        assert texts is not None, "a batch is scored (its texts decoded) before its samples are built"
        # generation speed of the whole batch (dropped dynamic-sampling groups included), on every sample
        tokens_per_s = gen.generated_tokens / max(gen.generate_s, 1e-9)
        pause = self.pause()  # (the engine's, since the last batch: on each of this one's samples)
        media = gen.media or [None] * len(outs)
        samples: list[RolloutSample] = []
        for i, (o, res) in enumerate(zip(outs, results)):
            row = rows[i // n]
            p = prompts[i]
            s = RolloutSample(
                tokens=np.asarray(p + o.token_ids, dtype=np.int64),
                prompt_len=len(p),
                response_len=len(o.token_ids),
                loss_mask=self._loss_mask(o),
                rollout_log_probs=np.asarray(o.log_probs, dtype=np.float32),
                reward=float(res.score),
                reward_failure=res.failure or "",
                policy_version=int(o.oldest_version),
                group_id=f"{step}:{gen.first_group + i // n}",
                prompt_id=row.row_id,
                rollout_step=step,
                finish_reason=o.finish_reason,
                response_text=texts[i],
            )
            if media[i] is not None:
                s[sample.MM] = media[i]
            if self.cfg.algo.routing_replay:
                s[sample.ROUTED_EXPERTS] = o.extra[sample.ROUTED_EXPERTS]
            if self.cfg.rollout.streaming_rollout:
                s[sample.TOKEN_VERSIONS] = np.asarray(o.token_versions or [], dtype=np.int32)
            if o.episode is not None:
                s[sample.TURNS], s[sample.ENV_ERROR] = o.episode.turns, o.episode.env_error
                s[sample.TURN_S] = np.asarray(o.episode.turn_s, dtype=np.float32)
                s[sample.TOOL_CALL_COUNT], s[sample.TOOL_CALL_ERRORS] = (
                    o.episode.tool_calls,
                    o.episode.tool_errors,
                )
                if o.episode.agent:
                    s[sample.AGENT] = o.episode.agent
            s.update(gen.extra)  # (dynamic sampling's counters; streaming's generated_at)
            s[sample.ROLLOUT_TOKENS_PER_S] = tokens_per_s
            s[sample.WEIGHT_PAUSE_S] = pause
            samples.append(s)
        return samples

    def _loss_mask(self, o: Any) -> np.ndarray:
        """1 per response token the loss trains on: 0 on what an environment added, and with
        --mask-offpolicy-in-partial-rollout on the tokens sampled before the response's last version."""
        mask = np.asarray(o.episode.loss_mask if o.episode else [1.0] * len(o.token_ids), dtype=np.float32)
        if self.cfg.rollout.mask_offpolicy_in_partial_rollout and o.token_versions:
            versions = np.asarray(o.token_versions)
            mask = mask * (versions == versions.max()).astype(np.float32)
        return mask

    def put(self, gen: Generated) -> tuple[int, float]:
        """Score ``gen`` (unless dynamic sampling already did) and put its samples on the bus, partition
        ``step<k>``; returns (samples put, seconds spent scoring)."""
        step = gen.step
        if gen.results is not None:
            results, reward_s = gen.results, gen.reward_s
        else:
            results, reward_s = self.score(gen)
        # (the bus takes plain dicts, as a RolloutSample is at runtime; mypy keeps a TypedDict apart from
        # dict[str, Any], the type of Bus.put's samples)
        samples = cast("list[dict[str, Any]]", self.samples(gen, results))
        if not self.journaled:
            self.bus.put(samples, partition=f"step{step}")
        else:
            per = self.cfg.samples_per_rollout
            first = gen.first_group * self.cfg.rollout.n_samples_per_prompt
            if first + len(samples) > per:
                raise RuntimeError(
                    f"rollout step {step} made {first + len(samples)} samples, more than {per}"
                )
            try:
                self.bus.put(
                    samples,
                    partition=f"step{step}",
                    ids=[step * per + first + i for i in range(len(samples))],
                )
            except DuplicateIds:
                # this step (group) landed before the previous rollout process died: keep that one
                logger.warning(
                    "rollout step %d%s was already on the bus (sent before a restart); skipped",
                    step,
                    f" group {gen.first_group}" if self.cfg.rollout.streaming_rollout else "",
                )
        return len(samples), reward_s
