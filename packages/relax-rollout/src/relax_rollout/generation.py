"""The rollout role's generation of one batch: n responses per prompt from the engine, as one result.

Why a room of its own: a batch is generated four ways — single-turn (:meth:`Generation.generate`),
DAPO dynamic sampling (:meth:`Generation.filtered`, rounds of generation scored inline and filtered
by group), agentic multi-turn episodes (:meth:`Generation.episodes`, one environment per sample), the
user's own agents (:meth:`Generation.agent_episodes`, ``agents.py``) — and all four hand the same :class:`Generated` to sample assembly (``samples.py``), which does not need to
know which way it came. The sampling seeds and the long-tail draw are functions of (seed, step, round)
only, so a resumed or restarted rollout generates a step exactly as the lost one would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_rollout.engines import SamplingParams
from relax_rollout.engines.base import EpisodeResult, GenerateOutput, RolloutEngine
from relax_rollout.prompts import Prompts, messages_of

if TYPE_CHECKING:
    from relax_core.data import PromptRow
    from relax_rollout.agents import AgentHost
    from relax_rollout.multiturn import Episode


@dataclass
class Generated:
    """One generated batch of rollout step ``step``: ``len(rows) * n`` samples, the n of a prompt adjacent."""

    step: int
    rows: list[Any]
    """The prompt rows (``relax_core.data.PromptRow``), one per group."""
    prompts: list[list[int]]
    """Each sample's prompt ids (for an episode: its first prompt)."""
    outs: list[GenerateOutput]
    """Each sample's response (for an episode: everything after the first prompt, ``loss_mask`` in extra)."""
    generate_s: float
    """Seconds spent generating (all rounds, dropped groups included)."""
    generated_tokens: int
    """Tokens the engine generated (all rounds; an episode's model tokens only)."""
    media: list[dict[str, Any] | None] | None = None
    """Each sample's media tensors for the trainer, or None where no sample has any."""
    texts: list[str] | None = None
    """Each sample's decoded response; multi-turn sets it (the last model turn), else scoring does."""
    results: list[Any] | None = None
    """Rewards (``relax_rewards.RewardResult``) when already scored (dynamic sampling), else None."""
    reward_s: float = 0.0
    """Seconds spent scoring, with ``results``."""
    extra: sample.RolloutSample = field(default_factory=sample.RolloutSample)
    """Fields put on every sample as they are (dynamic sampling's counters)."""
    first_group: int = 0
    """The step's group index of ``rows[0]`` (streaming rollout puts one group at a time): it fixes the
    samples' ``group_id`` and bus ids."""


class Generation:
    """Generates a step's batch with ``engine`` (replaceable: the worker's ``engine`` is this one's) from
    ``prompts``; counts seconds and stop reasons in the shared ``stats``; ``score`` rates a batch for the
    dynamic-sampling filter."""

    def __init__(
        self,
        cfg: RelaxConfig,
        engine: RolloutEngine,
        tokenizer: Any,
        prompts: Prompts,
        tracer: Any,
        stats: dict[str, Any],
        score: Callable[[Generated], tuple[list, float]],
        agents: AgentHost | None = None,
    ):
        self.cfg, self.engine, self.tokenizer, self.prompts = cfg, engine, tokenizer, prompts
        self.tracer, self.stats, self.score, self.agents = tracer, stats, score, agents
        self.alive: Callable[[], None] = lambda: None
        """Called while a long batch runs (agent episodes), so the health manager sees the role alive."""

    def batch(self, step: int) -> Generated:
        """Step ``step``'s batch, filtered by dynamic sampling when it is on."""
        return self.filtered(step) if self.cfg.rollout.dynamic_sampling else self.generate(step)

    def filtered(self, step: int) -> Generated:
        """DAPO dynamic sampling: keep only groups whose rewards differ, generating further rounds of
        --rollout-batch-size prompts until --rollout-batch-size such groups are found or
        --dynamic-sampling-max-rounds extra rounds are spent; a batch still short is topped up with
        uninformative groups (counted) rather than stalling training. Scoring runs inline here because the
        filter needs the rewards; the bus write still overlaps the next batch's generation."""
        r = self.cfg.rollout
        n, want = r.n_samples_per_prompt, r.rollout_batch_size
        kept: list[tuple] = []  # (row, prompts, outs, results, texts, media) per informative group
        spare: list[tuple] = []
        dropped, rounds, gen_s, reward_s, tokens = 0, 0, 0.0, 0.0, 0
        while len(kept) < want and rounds <= r.dynamic_sampling_max_rounds:
            got = self.generate(step, round_=rounds)
            results, secs = self.score(got)  # (sets got.texts)
            assert got.texts is not None, "score sets the texts"
            gen_s, reward_s, rounds = gen_s + got.generate_s, reward_s + secs, rounds + 1
            tokens += got.generated_tokens
            for g, row in enumerate(got.rows):
                sl = slice(g * n, (g + 1) * n)
                media = got.media[sl] if got.media is not None else [None] * n
                group = (row, got.prompts[sl], got.outs[sl], results[sl], got.texts[sl], media)
                if len({float(x.score) for x in group[3]}) > 1:
                    kept.append(group)
                else:
                    dropped += 1
                    spare.append(group)
        unfilled = max(0, want - len(kept))
        groups = kept[:want] + spare[:unfilled]
        counters: sample.RolloutSample = {
            sample.DS_DROPPED_GROUPS: dropped,
            sample.DS_EXTRA_ROUNDS: rounds - 1,
            sample.DS_UNFILLED_GROUPS: unfilled,
        }
        for k, v in counters.items():
            self.stats[k] = self.stats.get(k, 0) + v
        return Generated(
            step,
            rows=[g[0] for g in groups],
            prompts=[p for g in groups for p in g[1]],
            outs=[o for g in groups for o in g[2]],
            generate_s=gen_s,
            generated_tokens=tokens,
            media=[m for g in groups for m in g[5]],
            texts=[t for g in groups for t in g[4]],
            results=[x for g in groups for x in g[3]],
            reward_s=reward_s,
            extra=counters,
        )

    def generate(self, step: int, round_: int = 0) -> Generated:
        """One batch of --rollout-batch-size prompts, n responses each (episodes with --env-path)."""
        r = self.cfg.rollout
        n = r.n_samples_per_prompt
        if r.env_path:
            return self.episodes(step, round_)
        if self.agents is not None:
            return self.agent_episodes(step)
        rows, enc = self.prompts.batch()
        prompts = [ids for ids, _ in enc for _ in range(n)]
        media = [mm for _, mm in enc for _ in range(n)] if self.prompts.mm is not None else None
        params = self.sampling(step, len(prompts), round_)
        t0 = time.perf_counter()
        with self.tracer.span("generate", step=step):
            outs = self.engine.generate(prompts, params, **({"mm": media} if media is not None else {}))
        gen_s = time.perf_counter() - t0
        self.stats["generate_s"] += gen_s
        if r.long_tail_exact and isinstance(params.min_new_tokens, list):  # (the batch ran to the longest)
            outs = [_truncated(o, m) for o, m in zip(outs, params.min_new_tokens)]
        return Generated(step, rows, prompts, outs, gen_s, model_tokens(outs), media=media)

    def sampling(self, step: int, count: int, round_: int = 0) -> SamplingParams:
        """Step ``step``'s sampling parameters for ``count`` responses: the seed, --rollout-stop's strings and
        token ids, and with --long-tail-min-tokens each response's drawn minimum length (a list)."""
        r = self.cfg.rollout
        mins: int | list[int] = 0
        if r.long_tail_min_tokens:
            base = self.cfg.train.seed * 7919 + step
            rng = np.random.default_rng(base if round_ == 0 else (base, round_))
            draw = (rng.pareto(1.5, size=count) * r.long_tail_min_tokens).astype(int)
            mins = [int(min(d, r.rollout_max_response_len)) for d in draw]
        longest = r.rollout_max_response_len
        if r.long_tail_exact and isinstance(mins, list):  # each response exactly its draw: a request
            mins = [max(1, m) for m in mins]  # ends there, a batch runs to the longest and is cut
            longest = max(mins)
        return SamplingParams(
            max_new_tokens=longest,
            temperature=r.rollout_temperature,
            top_p=r.rollout_top_p,
            min_new_tokens=mins,
            stop=tuple(r.rollout_stop),
            stop_token_ids=tuple(r.rollout_stop_token_ids),
            seed=self.cfg.train.seed * 1_000_003 + step + 7_919_993 * round_,
        )

    def episodes(self, step: int, round_: int = 0) -> Generated:
        """One batch of multi-turn episodes (``multiturn.py``): n per prompt, each with its own environment.
        Multimodal rows: the first prompt holds the row's media, and the environment gets them as
        ``metadata["media"]`` (by modality, e.g. ``{"image": [path]}``)."""
        from relax_core.env import env_factory
        from relax_rollout.multiturn import run_episodes

        r = self.cfg.rollout
        env_path = r.env_path
        assert env_path is not None, "batches are episodes only with --env-path"
        env_factory(env_path)  # a wrong --env-path stops the run here, before any sample
        rows = self.prompts.batch()[0]
        episodes = []
        for row in rows:
            row_media = self.prompts.row_media(row)
            meta = {**row.metadata, "media": row_media} if row_media else row.metadata
            for _ in range(r.n_samples_per_prompt):
                episodes.append(self._start_episode(env_path, row, meta, row_media))
        params = SamplingParams(
            max_new_tokens=r.rollout_max_response_len,
            temperature=r.rollout_temperature,
            top_p=r.rollout_top_p,
            stop=tuple(r.rollout_stop),
            stop_token_ids=tuple(r.rollout_stop_token_ids),
            seed=self.cfg.train.seed * 1_000_003 + step + 7_919_993 * round_,
        )
        t0 = time.perf_counter()
        with self.tracer.span("generate", step=step):
            run_episodes(
                self.engine,
                self.tokenizer,
                episodes,
                params,
                r.max_turns,
                r.max_total_tokens,
                r.env_step_timeout_s,
                self.prompts.episode_media,
            )
        gen_s = time.perf_counter() - t0
        self.stats["generate_s"] += gen_s
        outs = []
        for ep in episodes:
            assert ep.stop_reason is not None, "run_episodes ends every episode with a reason"
            self.stats[f"stop/{ep.stop_reason}"] = self.stats.get(f"stop/{ep.stop_reason}", 0) + 1
            result = EpisodeResult(
                loss_mask=ep.mask,
                turns=ep.turns,
                env_reward=ep.info.get("reward"),
                env_reward_error=ep.info.get("reward_error"),
                env_error=str(ep.info.get("error", ep.info.get("reset_error", ""))),
                turn_s=ep.turn_s,
                tool_calls=int(ep.info.get("tool_calls") or 0),
                tool_errors=int(ep.info.get("tool_errors") or 0),
            )
            outs.append(
                GenerateOutput(
                    ep.tokens[ep.prompt_len :],
                    ep.log_probs,
                    ep.stop_reason,
                    ep.weight_version,
                    episode=result,
                )
            )
        mms = [ep.mm for ep in episodes]
        return Generated(
            step,
            rows,
            [ep.tokens[: ep.prompt_len] for ep in episodes],
            outs,
            gen_s,
            model_tokens(outs),
            media=mms if any(m is not None for m in mms) else None,
            texts=[ep.model_text[-1] if ep.model_text else "" for ep in episodes],
        )

    def agent_episodes(self, step: int) -> Generated:
        """One batch of --agent-path episodes (``agents.py``): n per prompt, each agent's samples a group of
        their own, so the batch's ``rows`` repeat each row once per agent (what ``samples.py`` reads)."""
        assert self.agents is not None, "agent episodes need --agent-path"
        rows = self.prompts.batch()[0]
        t0 = time.perf_counter()
        with self.tracer.span("generate", step=step):
            got = self.agents.run(step, rows, self.alive)
        gen_s = time.perf_counter() - t0
        self.stats["generate_s"] += gen_s
        outs = [a.out for a in got]
        return Generated(
            step,
            [row for row in rows for _ in self.agents.agents],
            [a.prompt for a in got],
            outs,
            gen_s,
            model_tokens(outs),
            texts=[a.text for a in got],
        )

    def _start_episode(
        self, env_path: str, row: PromptRow, meta: dict[str, Any], row_media: dict[str, list]
    ) -> Episode:
        """A sample's :class:`~relax_rollout.multiturn.Episode` at its first turn: its environment built and
        reset, the first observation in the prompt. A broken environment or reset is recorded in the
        episode's ``info`` (the sample ends, counted), never raised."""
        from relax_core.env import BrokenEnv, as_messages, build_env, resolve
        from relax_rollout.media_prompts import split_media
        from relax_rollout.multiturn import Episode

        try:
            env = build_env(env_path, row.prompt, row.label, meta)
        except Exception as e:  # noqa: BLE001 - this sample's environment is broken: recorded below
            env = BrokenEnv(f"constructing the environment failed: {type(e).__name__}: {e}")
        base, info = messages_of(row.prompt), {}
        history, media = list(base), {k: list(v) for k, v in row_media.items()}
        try:
            first = resolve(env.reset())
            if first is not None:
                msgs, first_media = split_media(as_messages(resolve(env.format_observation(first))))
                history += msgs
                for k, v in first_media.items():
                    media.setdefault(k, []).extend(v)
        except Exception as e:  # noqa: BLE001 - this sample ends after its first turn, recorded
            info["reset_error"] = f"{type(e).__name__}: {e}"
        try:
            ids, mm = self.episode_prompt(row, history, media)
        except Exception as e:  # noqa: BLE001 - the reset's media: recorded, the row's prompt alone
            info.setdefault("reset_error", f"{type(e).__name__}: {e}")
            history = list(base)
            ids, mm = self.episode_prompt(row, history, row_media)
        return Episode(env, history, list(ids), len(ids), info=info, mm=mm)

    def episode_prompt(
        self, row: Any, history: list[dict[str, Any]], media: dict[str, list]
    ) -> tuple[list[int], dict[str, Any] | None]:
        """An episode's first prompt: the chat template over ``history``, its media expanded (ids, mm).

        Without --apply-chat-template a text prompt is used raw, as in single-turn rollout (a model
        warm-started on raw prompts answers its first turn as it learned to); later turns still follow the
        template (``turns.py``)."""
        if isinstance(row.prompt, str) and len(history) == 1 and not any(media.values()):
            return list(
                self.prompts.encode(row.prompt)
            ), None  # (the template, or raw: --apply-chat-template)
        text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        if not any(media.values()):
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        if self.prompts.episode_media is None:
            raise ValueError(f"the prompt carries {sorted(media)} but the model is text-only")
        keys = tuple(self.prompts.media_keys)  # (empty for a text-only run)
        return self.prompts.episode_media.encode(text, media, keys=keys, index=f"row {row.row_id}")


def _truncated(out: GenerateOutput, n: int) -> GenerateOutput:
    """``out`` ended after ``n`` tokens (--long-tail-exact)."""
    if len(out.token_ids) <= n:
        return out
    return replace(
        out,
        token_ids=out.token_ids[:n],
        log_probs=out.log_probs[:n],
        token_versions=out.token_versions[:n] if out.token_versions else out.token_versions,
        finish_reason="length",
    )


def model_tokens(outs: list[GenerateOutput]) -> int:
    """Tokens the engine generated for ``outs``: a multi-turn episode's model tokens (its loss mask), not
    what the environment and the chat template added."""
    return int(sum(sum(o.episode.loss_mask) if o.episode else len(o.token_ids) for o in outs))
