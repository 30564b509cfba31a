"""The Rollout role: n samples per prompt from the current policy, scored, written to the bus.

The same class runs in-process (colocate: the controller calls :meth:`produce` step by step) and as a
Ray actor (fully async: :meth:`run` loops, gated by the bus's staleness admission, while weights arrive
in the background over DCS). Every sample carries the policy version that generated it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from relax_bus import DuplicateIds
from relax_core.config import RelaxConfig
from relax_core.data import PromptIterator, load_prompts
from relax_core.trace import Tracer
from relax_rollout.engine_service import EngineService, uses_pool
from relax_rollout.engines import SamplingParams, build_engine
from relax_rollout.engines.base import GenerateOutput
from relax_rollout.rewards import build_scorer

logger = logging.getLogger(__name__)


def _reserve_engine_gpus(cfg: RelaxConfig, extra: dict[str, Any]) -> Any:
    """Fully async on a Ray cluster with GPUs: reserve the SGLang engines' GPUs through Ray (they are
    processes this role starts, outside Ray's accounting otherwise) and hand the engines those ids, so no
    other role is given them (:mod:`relax_core.placement`). Returns the placement group, or None where
    nothing is reserved: colocate mode (the roles time-share the GPUs), no Ray or no GPUs in it, ids set
    by hand (``gpu_ids``), or engines spread over nodes (``gpus_per_node``: those place themselves)."""
    if cfg.run.mode != "fully_async" or "gpu_ids" in extra or "gpus_per_node" in extra:
        return None
    import ray

    if not ray.is_initialized() or ray.cluster_resources().get("GPU", 0) <= 0:
        return None
    from relax_core.placement import reserve_gpus

    pg, extra["gpu_ids"] = reserve_gpus(cfg.rollout.rollout_num_gpus, "rollout")
    return pg


class RolloutWorker:
    role = "rollout"

    def __init__(
        self, cfg: RelaxConfig, bus: Any, model_path: str, prompt_path: str, torch_threads: int | None = None
    ):
        import torch
        from transformers import AutoTokenizer

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.cfg, self.bus = cfg, bus
        self.tracer = Tracer("rollout", cfg.run.trace)  # phases for trace.json
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        extra = (
            {"urls": cfg.rollout.rollout_external_urls} if cfg.rollout.rollout_backend == "external" else {}
        )
        self._gpus = None
        if cfg.rollout.rollout_backend == "sglang":  # engines, GPUs per engine, SGLang's launch flags
            from relax_rollout.engines.sglang import engine_kwargs

            extra = engine_kwargs(cfg)
            self._gpus = _reserve_engine_gpus(cfg, extra)
        if cfg.algo.routing_replay:  # R3: the engine records each token's MoE experts for the trainer
            if cfg.rollout.rollout_backend not in ("torch", "sglang"):
                raise ValueError(
                    f"--routing-replay needs --rollout-backend torch or sglang (their engines record the experts "
                    f"each token was routed to); got --rollout-backend {cfg.rollout.rollout_backend}"
                )
            extra["record_routing"] = True
        self.engine_service = None
        if uses_pool(cfg):  # engines in their own processes, restarted when they crash, elastic
            self.engine_service = EngineService(cfg, model_path)
            self.engine = self.engine_service.pool
        else:
            self.engine = build_engine(
                cfg.rollout.rollout_backend,
                model_path=extra.pop("model_path", model_path),  # (--sglang-model-path)
                dtype=cfg.model.dtype,
                eos_token_ids=[self.tokenizer.eos_token_id],
                pad_token_id=self.tokenizer.pad_token_id,
                **extra,
            )
        if cfg.algo.routing_replay and self.engine.routing is None:
            raise ValueError(f"--routing-replay needs an MoE model; {model_path} has no sparse MoE blocks")
        ds = load_prompts(prompt_path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key,
                          cfg.data.multimodal_keys)  # fmt: skip
        self.skipped_rows = ds.skipped
        self.prompts = PromptIterator(
            ds.rows, cfg.rollout.rollout_batch_size, cfg.data.rollout_shuffle, cfg.train.seed
        )
        self.scorer = build_scorer(cfg)
        self._cond = threading.Condition()
        self._receiver = None
        self.weight_log: dict[int, str] = {}
        self.stats = {"samples": 0, "generate_s": 0.0, "reward_s": 0.0, "wait_s": 0.0}
        self._token_cache: dict[str, list[int]] = {}
        self.mm = self._media(model_path) if cfg.data.multimodal_keys else None
        self._mm_cache: dict[str, tuple[list[int], dict[str, Any]]] = {}
        self.bad_media: list[str] = []
        self.context_len = _context_len(model_path)
        self.step_states: dict[int, dict[str, int]] = {}
        self.prompt_log: list[tuple[int, list[str]]] = []
        self.episode_media = (self.mm or self._episode_media(model_path)) if cfg.rollout.env_path else None
        self._beat = 0.0
        # Under the health manager, every batch's start (prompt position) and landing on the bus are
        # journaled, so a restarted rollout role continues with exactly the prompts that were not put yet,
        # and samples get ids fixed by their step, so a batch re-sent after a crash is refused (DuplicateIds).
        self.journal = None
        if cfg.run.mode == "fully_async" and cfg.run.health:
            self.journal = Path(cfg.run.output_dir) / "rollout_journal.jsonl"

    def _media(self, model_path: str) -> Any:
        """--multimodal-keys: the encoder of prompts with media (``multiturn.EpisodeMedia``, one for both
        single-turn rows and episodes); the checkpoint must be a Qwen-VL/Omni model."""
        from relax_core.models import mm_family

        family = mm_family(model_path)
        if family is None:
            raise ValueError(
                f"--multimodal-keys is set but {model_path} is a text-only model; use a Qwen-VL/Omni checkpoint"
            )
        try:
            import relax_multimodal  # noqa: F401 - only to say what to install
        except ImportError as e:
            raise ImportError(
                "--multimodal-keys needs relax-multimodal: pip install 'relax-rollout[multimodal]'"
            ) from e
        from relax_rollout.multiturn import EpisodeMedia

        return EpisodeMedia(family, self.tokenizer, self.cfg.data.multimodal_options)

    def _episode_media(self, model_path: str) -> Any:
        """Multi-turn on a Qwen-VL/Omni model: what expands the media of prompts and observations (None for a
        text-only model, or without relax-multimodal: an observation with media then ends its episode)."""
        import importlib.util

        from relax_core.models import mm_family
        from relax_rollout.multiturn import EpisodeMedia

        try:
            family = mm_family(model_path)
        except (OSError, ValueError):
            return None
        if family is None or importlib.util.find_spec("relax_multimodal") is None:
            return None
        return EpisodeMedia(family, self.tokenizer, self.cfg.data.multimodal_options)

    def _row_media(self, row: Any) -> dict[str, list]:
        """The row's media (--multimodal-keys columns) by modality, each a list."""
        out: dict[str, list] = {}
        if self.mm is None:
            return out
        for modality, column in self.cfg.data.multimodal_keys.items():
            if column in row.media:
                v = row.media[column]
                out[modality] = list(v) if isinstance(v, list | tuple) else [v]
        return out

    # -- weights -------------------------------------------------------------------------------
    def set_weights(self, tensors: dict[str, Any], version: int) -> None:
        self.engine.update_weights(tensors, version)
        if self.cfg.run.verify_weight_sync:
            self.weight_log[version] = self.engine.weights_checksum()
        with self._cond:
            self._cond.notify_all()

    # -- device memory (colocate with offload) ----------------------------------------------------
    _released: frozenset[str] = frozenset()

    def release_memory(self) -> None:
        """Give the engine's device memory (weights, KV cache, graphs) back while the trainer runs."""
        from relax_rollout.engines.base import MEMORY_TAGS, ReleasesMemory

        if not isinstance(self.engine, ReleasesMemory):
            raise ValueError(
                f"--offload: the {self.cfg.rollout.rollout_backend} rollout engine cannot release its device "
                "memory; use --no-offload (or the torch / sglang engine)"
            )
        with self.tracer.span("release_memory"):
            self.engine.release_memory(None)
        self._released = frozenset(MEMORY_TAGS)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory` gave (``tags``: part of it; default the rest)."""
        from relax_rollout.engines.base import memory_tags

        todo = [t for t in memory_tags(tags) if t in self._released]
        if todo:
            with self.tracer.span("resume_memory", tags=",".join(todo)):
                self.engine.resume_memory(todo)
            self._released = self._released - set(todo)

    def connect_dcs(self, init_method: str, world_size: int, rank: int) -> None:
        """Join the trainer's weight broadcast; called again when the health manager re-forms the group."""
        from relax_core.dcs import WeightReceiver

        if self._receiver is not None:  # the old group lost a member: leave it
            self._receiver.close(timeout_s=5.0)
        self._receiver = WeightReceiver.for_run(self.cfg.run, init_method, world_size, rank)
        self._receiver.connect()
        self._receiver.start_background(lambda v, t: self.set_weights(t, v))

    def wait_weights(self, version: int, timeout_s: float = 300.0) -> int:
        """Block until the engine holds weights of ``version`` or newer (a restarted role)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.engine.weight_version < version:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rollout: weights of version {version} did not arrive in {timeout_s}s"
                    )
                self._cond.wait(0.1)
        return self.engine.weight_version

    def heartbeat(self) -> dict[str, Any]:
        """For the health manager: seconds since the loop last made progress (or polled idle)."""
        age = time.monotonic() - self._beat if self._beat else 0.0
        failed = self.engine_service.failed() if self.engine_service is not None else []
        return {"pid": os.getpid(), "age_s": age, "failed_engines": failed}

    def restart_engine(self, member_id: str) -> dict[str, Any]:
        """Health manager: replace a failed engine process (it gets the current weights first)."""
        return self.engine_service.restart(member_id)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def weights_checksum(self) -> str:
        return self.engine.weights_checksum()

    def get_weight_log(self) -> dict[int, str]:
        return dict(self.weight_log)

    # -- producing -----------------------------------------------------------------------------
    def _encode(self, prompt: str) -> list[int]:
        if prompt not in self._token_cache:
            text = prompt
            if self.cfg.data.apply_chat_template:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
            self._token_cache[prompt] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._token_cache[prompt]

    def _encode_mm(self, row: Any) -> tuple[list[int], dict[str, Any] | None]:
        """Prompt ids with media placeholders expanded, and the media tensors (cached per row).

        Bad media raise ``MediaError`` naming the row and file; :meth:`_batch` skips and counts the row."""
        if self.mm is None or not row.media:
            return self._encode(row.prompt), None
        if row.row_id not in self._mm_cache:
            text = row.prompt
            if self.cfg.data.apply_chat_template:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": row.prompt}], tokenize=False, add_generation_prompt=True
                )
            keys = tuple(self.cfg.data.multimodal_keys)
            self._mm_cache[row.row_id] = self.mm.encode(text, self._row_media(row), keys, f"row {row.row_id}")
        return self._mm_cache[row.row_id]

    def _batch(self) -> tuple[list[Any], list[tuple[list[int], dict[str, Any] | None]]]:
        """The next --rollout-batch-size usable rows and their encodings. A row whose media cannot be read
        is skipped, counted (``bad_media_rows``) and replaced by the next one, as is a prompt the model's
        context cannot hold with a response (``long_prompt_rows``); the run goes on."""
        skip: tuple[type[Exception], ...] = (PromptTooLong,)
        if self.mm is not None:
            from relax_multimodal import MediaError

            skip = (MediaError, PromptTooLong)
        rows, enc = [], []
        budget = 10 * self.cfg.rollout.rollout_batch_size + 10
        while len(rows) < self.cfg.rollout.rollout_batch_size:
            for row in self.prompts.next_batch(self.cfg.rollout.rollout_batch_size - len(rows)):
                try:
                    encoded = self._encode_mm(row)
                    self._check_fits(row, len(encoded[0]))
                    enc.append(encoded)
                    rows.append(row)
                except skip as e:
                    kind = "long_prompt_rows" if isinstance(e, PromptTooLong) else "bad_media_rows"
                    self.bad_media.append(str(e))
                    self.stats[kind] = self.stats.get(kind, 0) + 1
                    budget -= 1
                    if budget <= 0:
                        raise RuntimeError(f"too many unusable rows in a row; last: {e}") from e
        return rows, enc

    def _check_fits(self, row: Any, prompt_tokens: int) -> None:
        """A prompt that leaves no room for a whole response in the model's context is skipped and counted
        (a 100k-character prompt was OOM-killed without a message)."""
        need = prompt_tokens + self.cfg.rollout.rollout_max_response_len
        if self.context_len is not None and need > self.context_len:
            raise PromptTooLong(
                f"row {row.row_id}: {prompt_tokens} prompt tokens + --rollout-max-response-len "
                f"{self.cfg.rollout.rollout_max_response_len} exceed the model's context of {self.context_len} "
                "tokens: skipped (shorten it, or filter long prompts out of the dataset)"
            )

    def produce(self, step: int) -> dict[str, float]:
        """Generate, score and put one rollout batch (step ``step``); returns timing stats."""
        return self._finish(self._collect(step))

    def data_state(self, step: int) -> dict[str, int]:
        """Where the prompt iterator stood when step ``step`` began (now, if it has not begun): what a
        checkpoint of trainer version ``step`` stores so a resumed run draws the same prompts."""
        return dict(self.step_states.get(step, self.prompts.state_dict()))

    def load_data_state(self, state: dict[str, int]) -> None:
        self.prompts.load_state_dict(state)

    def get_prompt_log(self) -> list[tuple[int, list[str]]]:
        """(step, prompt row ids) of every batch put on the bus, in order."""
        return list(self.prompt_log)

    def _collect(self, step: int) -> dict[str, Any]:
        """One batch generated (and, with dynamic sampling, scored and filtered)."""
        self.step_states[step] = self.prompts.state_dict()
        self._log_journal({"begin": step, "state": self.step_states[step]})
        out = self._generate_filtered(step) if self.cfg.rollout.dynamic_sampling else self._generate(step)
        # where the next step begins: a process killed before it began restarts from here
        self._log_journal({"drawn": step, "state": self.prompts.state_dict()})
        return out

    def _generate_filtered(self, step: int) -> dict[str, Any]:
        """DAPO dynamic sampling: keep only groups whose rewards differ, generating further rounds of
        --rollout-batch-size prompts until --rollout-batch-size such groups are found or
        --dynamic-sampling-max-rounds extra rounds are spent; a batch still short is topped up with
        uninformative groups (counted) rather than stalling training. Scoring runs inline here because the
        filter needs the rewards; the bus write still overlaps the next batch's generation."""
        r = self.cfg.rollout
        n, want = r.n_samples_per_prompt, r.rollout_batch_size
        kept: list[tuple] = []  # (row, prompts, outs, results, texts) per informative group
        spare: list[tuple] = []
        dropped, rounds, gen_s, reward_s, tokens = 0, 0, 0.0, 0.0, 0
        while len(kept) < want and rounds <= r.dynamic_sampling_max_rounds:
            pending = self._generate(step, round_=rounds)
            results, secs = self._score(pending)
            gen_s, reward_s, rounds = gen_s + pending["generate_s"], reward_s + secs, rounds + 1
            tokens += pending["generated_tokens"]
            for g, row in enumerate(pending["rows"]):
                sl = slice(g * n, (g + 1) * n)
                media = pending["media"][sl] if pending["media"] is not None else [None] * n
                group = (
                    row,
                    pending["prompts"][sl],
                    pending["outs"][sl],
                    results[sl],
                    pending["texts"][sl],
                    media,
                )
                if len({float(x.score) for x in group[3]}) > 1:
                    kept.append(group)
                else:
                    dropped += 1
                    spare.append(group)
        unfilled = max(0, want - len(kept))
        groups = kept[:want] + spare[:unfilled]
        counters = {
            "ds_dropped_groups": dropped,
            "ds_extra_rounds": rounds - 1,
            "ds_unfilled_groups": unfilled,
        }
        for k, v in counters.items():
            self.stats[k] = self.stats.get(k, 0) + v
        return {
            "step": step,
            "rows": [g[0] for g in groups],
            "prompts": [p for g in groups for p in g[1]],
            "outs": [o for g in groups for o in g[2]],
            "results": [x for g in groups for x in g[3]],
            "texts": [t for g in groups for t in g[4]],
            "media": [m for g in groups for m in g[5]],
            "generate_s": gen_s,
            "generated_tokens": tokens,
            "reward_s": reward_s,
            "extra": counters,
        }

    def _generate(self, step: int, round_: int = 0) -> dict[str, Any]:
        r = self.cfg.rollout
        n = r.n_samples_per_prompt
        if r.env_path:
            return self._generate_episodes(step, round_)
        rows, enc = self._batch()
        prompts = [ids for ids, _ in enc for _ in range(n)]
        media = [mm for _, mm in enc for _ in range(n)] if self.mm is not None else None
        mins: int | list[int] = 0
        if r.long_tail_min_tokens:
            base = self.cfg.train.seed * 7919 + step
            rng = np.random.default_rng(base if round_ == 0 else (base, round_))
            draw = (rng.pareto(1.5, size=len(prompts)) * r.long_tail_min_tokens).astype(int)
            mins = [int(min(d, r.rollout_max_response_len)) for d in draw]
        params = SamplingParams(
            max_new_tokens=r.rollout_max_response_len,
            temperature=r.rollout_temperature,
            top_p=r.rollout_top_p,
            min_new_tokens=mins,
            seed=self.cfg.train.seed * 1_000_003 + step + 7_919_993 * round_,
        )
        t0 = time.perf_counter()
        with self.tracer.span("generate", step=step):
            outs = self.engine.generate(prompts, params, **({"mm": media} if media is not None else {}))
        gen_s = time.perf_counter() - t0
        self.stats["generate_s"] += gen_s
        return {"step": step, "rows": rows, "prompts": prompts, "outs": outs, "generate_s": gen_s,
                "generated_tokens": _model_tokens(outs), "media": media}  # fmt: skip

    def _generate_episodes(self, step: int, round_: int = 0) -> dict[str, Any]:
        """One batch of multi-turn episodes (``multiturn.py``): n per prompt, each with its own environment.
        Multimodal rows: the first prompt holds the row's media, and the environment gets them as
        ``metadata["media"]`` (by modality, e.g. ``{"image": [path]}``)."""
        from relax_core.env import BrokenEnv, as_messages, build_env, env_factory, resolve
        from relax_rollout.multiturn import Episode, run_episodes, split_media

        r = self.cfg.rollout
        env_factory(r.env_path)  # a wrong --env-path stops the run here, before any sample
        rows = self._batch()[0]
        episodes = []
        for row in rows:
            row_media = self._row_media(row)
            meta = {**row.metadata, "media": row_media} if row_media else row.metadata
            for _ in range(r.n_samples_per_prompt):
                try:
                    env = build_env(r.env_path, row.prompt, row.label, meta)
                except Exception as e:  # noqa: BLE001 - this sample's environment is broken: recorded below
                    env = BrokenEnv(f"constructing the environment failed: {type(e).__name__}: {e}")
                base, info = [{"role": "user", "content": row.prompt}], {}
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
                    ids, mm = self._episode_prompt(row, history, media)
                except Exception as e:  # noqa: BLE001 - the reset's media: recorded, the row's prompt alone
                    info.setdefault("reset_error", f"{type(e).__name__}: {e}")
                    history = list(base)
                    ids, mm = self._episode_prompt(row, history, row_media)
                episodes.append(Episode(env, history, list(ids), len(ids), info=info, mm=mm))
        params = SamplingParams(
            max_new_tokens=r.rollout_max_response_len,
            temperature=r.rollout_temperature,
            top_p=r.rollout_top_p,
            seed=self.cfg.train.seed * 1_000_003 + step + 7_919_993 * round_,
        )
        t0 = time.perf_counter()
        with self.tracer.span("generate", step=step):
            run_episodes(self.engine, self.tokenizer, episodes, params, r.max_turns, r.max_total_tokens,
                         r.env_step_timeout_s, self.episode_media)  # fmt: skip
        gen_s = time.perf_counter() - t0
        self.stats["generate_s"] += gen_s
        outs = []
        for ep in episodes:
            self.stats[f"stop/{ep.stop_reason}"] = self.stats.get(f"stop/{ep.stop_reason}", 0) + 1
            extra = {"loss_mask": ep.mask, "turns": ep.turns, "env_reward": ep.info.get("reward"),
                     "env_error": str(ep.info.get("error", ep.info.get("reset_error", "")))}  # fmt: skip
            outs.append(
                GenerateOutput(
                    ep.tokens[ep.prompt_len :], ep.log_probs, ep.stop_reason, ep.weight_version, extra
                )
            )
        media = [ep.mm for ep in episodes]
        return {"step": step, "rows": rows, "prompts": [ep.tokens[: ep.prompt_len] for ep in episodes],
                "outs": outs, "generate_s": gen_s, "generated_tokens": _model_tokens(outs),
                "media": media if any(m is not None for m in media) else None,
                "texts": [ep.model_text[-1] if ep.model_text else "" for ep in episodes]}  # fmt: skip

    def _episode_prompt(
        self, row: Any, history: list[dict[str, Any]], media: dict[str, list]
    ) -> tuple[list[int], dict[str, Any] | None]:
        """An episode's first prompt: the chat template over ``history``, its media expanded (ids, mm).

        Without --apply-chat-template a text prompt is used raw, as in single-turn rollout (a model
        warm-started on raw prompts answers its first turn as it learned to); later turns still follow the
        template (``turns.py``)."""
        if not self.cfg.data.apply_chat_template and len(history) == 1 and not any(media.values()):
            return list(self._encode(row.prompt)), None
        text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        if not any(media.values()):
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        if self.episode_media is None:
            raise ValueError(f"the prompt carries {sorted(media)} but the model is text-only")
        keys = tuple(self.cfg.data.multimodal_keys) if self.mm is not None else ()
        return self.episode_media.encode(text, media, keys=keys, index=f"row {row.row_id}")

    def _score(self, pending: dict[str, Any]) -> tuple[list, float]:
        """Rewards of a generated batch (and its decoded texts, kept in ``pending``), and the seconds spent."""
        rows, outs = pending["rows"], pending["outs"]
        n = self.cfg.rollout.n_samples_per_prompt
        t1 = time.perf_counter()
        if "texts" not in pending:  # (multi-turn: the last model turn, set by _generate_episodes)
            pending["texts"] = [self.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        texts = pending["texts"]
        labels = [row.label for row in rows for _ in range(n)]
        metas = [row.metadata for row in rows for _ in range(n)]
        with self.tracer.span("reward", step=pending["step"]):
            results = self.scorer.score_batch(texts, labels, metas)
        from relax_rewards import RewardResult

        for i, o in enumerate(outs):  # an environment's own reward wins over --rm-type
            if o.extra.get("env_reward") is not None:
                results[i] = RewardResult(float(o.extra["env_reward"]))
        return results, time.perf_counter() - t1

    def _finish(self, pending: dict[str, Any]) -> dict[str, float]:
        """Score a generated batch (unless dynamic sampling already did) and put it on the bus."""
        step, rows, prompts, outs = pending["step"], pending["rows"], pending["prompts"], pending["outs"]
        n = self.cfg.rollout.n_samples_per_prompt
        if "results" in pending:
            results, reward_s = pending["results"], pending["reward_s"]
        else:
            results, reward_s = self._score(pending)
        texts = pending["texts"]
        # generation speed of the whole batch (dropped dynamic-sampling groups included), on every sample
        tokens_per_s = pending["generated_tokens"] / max(pending["generate_s"], 1e-9)
        extra = {**pending.get("extra", {}), "rollout_tokens_per_s": tokens_per_s}
        media = pending.get("media") or [None] * len(outs)
        samples = []
        for i, (o, res) in enumerate(zip(outs, results)):
            row = rows[i // n]
            p = prompts[i]
            samples.append(
                {
                    **({"mm": media[i]} if media[i] is not None else {}),
                    "tokens": np.asarray(p + o.token_ids, dtype=np.int64),
                    "prompt_len": len(p),
                    "response_len": len(o.token_ids),
                    "loss_mask": np.asarray(
                        o.extra.get("loss_mask", [1.0] * len(o.token_ids)), dtype=np.float32
                    ),
                    "rollout_log_probs": np.asarray(o.log_probs, dtype=np.float32),
                    **({"routed_experts": o.extra["routed_experts"]} if self.cfg.algo.routing_replay else {}),
                    "reward": float(res.score),
                    "reward_failure": res.failure or "",
                    "policy_version": int(o.weight_version),
                    "group_id": f"{step}:{i // n}",
                    "prompt_id": row.row_id,
                    "rollout_step": step,
                    "finish_reason": o.finish_reason,
                    **(
                        {"turns": o.extra["turns"], "env_error": o.extra["env_error"]}
                        if "turns" in o.extra
                        else {}
                    ),
                    "response_text": texts[i],
                    **extra,
                }
            )
        if self.journal is None:
            self.bus.put(samples, partition=f"step{step}")
        else:
            per = self.cfg.samples_per_rollout
            if len(samples) > per:
                raise RuntimeError(f"rollout step {step} made {len(samples)} samples, more than {per}")
            try:
                self.bus.put(
                    samples, partition=f"step{step}", ids=[step * per + i for i in range(len(samples))]
                )
            except DuplicateIds:  # this step landed before the previous rollout process died: keep that one
                logger.warning(
                    "rollout step %d was already on the bus (sent before a restart); skipped", step
                )
        self.prompt_log.append((step, [row.row_id for row in rows]))
        self._log_journal({"put": step, "prompts": [row.row_id for row in rows]})
        self.stats["samples"] += len(samples)
        self.stats["reward_s"] += reward_s
        return {"generate_s": pending["generate_s"], "reward_s": reward_s}

    def run(self, start_step: int = 0) -> dict[str, float]:
        """Fully-async loop until the bus closes: admission by staleness, wait for fresh-enough
        weights, generate; scoring and the bus write of batch k run in a background thread while batch
        k+1 generates, so a slow (remote) reward overlaps generation instead of idling the engine. The
        staleness bound is unaffected: each batch is admitted, and tagged with its version, before it
        is generated."""
        import queue

        from relax_bus import BusClosed, BusTimeout

        s = self.cfg.run.max_staleness
        wait_policy = self.cfg.run.staleness_policy == "wait"
        handoff: queue.Queue = queue.Queue(maxsize=1)
        failure: list[BaseException] = []

        def finisher() -> None:
            while (pending := handoff.get()) is not None:
                try:
                    self._finish(pending)
                except BusClosed:
                    return
                except BaseException as exc:  # surfaced by the generating loop
                    failure.append(exc)
                    return

        thread = threading.Thread(target=finisher, name="rollout-finisher", daemon=True)
        thread.start()
        step = start_step
        try:
            while not failure:
                t0 = time.perf_counter()
                while True:  # poll, so the heartbeat shows a live loop while back-pressure holds it
                    self._beat = time.monotonic()
                    try:
                        self.bus.admit(step, timeout=1.0)
                        break
                    except BusTimeout:
                        continue
                need = max(0, step - s) if wait_policy else 0
                with self._cond:
                    while self.engine.weight_version < need:
                        self._beat = time.monotonic()
                        if self._receiver is not None and not self.cfg.run.health:
                            self._receiver.check()  # (under the health manager a broken group is re-formed)
                        self._cond.wait(0.5)
                self.stats["wait_s"] += time.perf_counter() - t0
                pending = self._collect(step)
                while thread.is_alive():
                    self._beat = time.monotonic()  # (waiting for the previous batch's scoring and put)
                    try:
                        handoff.put(pending, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BusClosed:
            pass
        finally:
            try:
                handoff.put_nowait(None)
            except queue.Full:
                pass
        if failure:
            raise failure[0]
        return self.get_stats()

    # -- journal (restart in place) ---------------------------------------------------------------
    def _log_journal(self, entry: dict[str, Any]) -> None:
        if self.journal is not None:
            with open(self.journal, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def reset_journal(self) -> None:
        """A fresh run (or a global restart from a checkpoint): forget the previous process's batches."""
        if self.journal is not None:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            self.journal.write_text("")

    def seed_journal(self, begun: dict[str, dict], next_step: int) -> None:
        """Resumed from a checkpoint with a bus snapshot: the steps before ``next_step`` are on the bus
        already (put by the previous run); record where each began, for later checkpoints and restarts."""
        for step in sorted(int(k) for k in begun):
            self._log_journal({"begin": step, "state": begun[str(step)]})
            if step < next_step:
                self._log_journal({"put": step, "prompts": [], "restored": True})
        if next_step > 0:  # (the data position was loaded: it is where next_step begins)
            self._log_journal({"drawn": next_step - 1, "state": self.prompts.state_dict()})

    def recover(self) -> int:
        """After the previous rollout process died: load the journal and return the first step that is
        not on the bus yet (its prompts come next, as they would have)."""
        if self.journal is None or not self.journal.is_file():
            raise RuntimeError("rollout recover(): no journal (needs --fully-async with the health manager)")
        begun: dict[int, dict] = {}
        drawn: dict[int, dict] = {}
        put: list[tuple[int, list[str], bool]] = []
        for line in self.journal.read_text().splitlines():
            if not line.strip():
                continue
            e = json.loads(line)
            if "begin" in e:
                begun[int(e["begin"])] = e["state"]
            elif "drawn" in e:
                drawn[int(e["drawn"])] = e["state"]
            elif "put" in e:
                put.append((int(e["put"]), list(e["prompts"]), bool(e.get("restored"))))
        done = {s for s, _, _ in put}
        pending = sorted(s for s in begun if s not in done)
        start = pending[0] if pending else (max(done) + 1 if done else 0)
        if start in begun:
            self.prompts.load_state_dict(begun[start])
        elif start - 1 in drawn:  # died between two steps: the next one begins where the last one ended
            self.prompts.load_state_dict(drawn[start - 1])
        elif start > 0:
            raise RuntimeError(
                f"rollout journal {self.journal} has no data position for step {start}: cannot restart in "
                "place without drawing other prompts (the run restarts from its last checkpoint)"
            )
        self.prompt_log = sorted((s, p) for s, p, restored in put if not restored)
        self.step_states = {s: st for s, st in begun.items() if s < start}
        return start

    def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "skipped_rows": len(self.skipped_rows), "reward": self.scorer.stats(),
                "skipped_examples": self.skipped_rows[:5] + self.bad_media[:5]}  # fmt: skip

    def get_bad_media(self) -> list[str]:
        """One message per skipped media row (sample, file, reason, what to do)."""
        return list(self.bad_media)

    def get_spans(self) -> list[dict[str, Any]]:
        return self.tracer.get_spans()

    def engines(self) -> list[dict[str, Any]]:
        return self.engine_service.pool.members(include_removed=True) if self.engine_service else []

    def engine_pids(self) -> dict[str, int]:
        return self.engine_service.pids() if self.engine_service is not None else {}

    def elastic_url(self) -> str | None:
        return self.engine_service.elastic_url if self.engine_service is not None else None

    def close(self) -> None:
        self.scorer.close()  # (--reward-isolation process: its worker processes)
        if self._receiver is not None:
            self._receiver.close()
        if self.engine_service is not None:
            self.engine_service.close()
        elif callable(getattr(self.engine, "close", None)):  # an engine owning processes (sglang)
            self.engine.close()
        if getattr(self, "_gpus", None) is not None:  # the engines' GPUs, now free for another run
            import ray

            ray.util.remove_placement_group(self._gpus)
            self._gpus = None


def _model_tokens(outs: list[GenerateOutput]) -> int:
    """Tokens the engine generated for ``outs``: a multi-turn episode's model tokens (its loss mask), not
    what the environment and the chat template added."""
    return int(sum(sum(o.extra["loss_mask"]) if "loss_mask" in o.extra else len(o.token_ids) for o in outs))


class PromptTooLong(ValueError):
    """A dataset prompt that leaves no room for a response in the model's context."""


def _context_len(model_path: str) -> int | None:
    """The context of the model at ``model_path``, if its config says."""
    from transformers import AutoConfig

    from relax_core.models import context_length

    try:
        return context_length(AutoConfig.from_pretrained(model_path))
    except (OSError, ValueError):  # (a model the engine serves by another name)
        return None
