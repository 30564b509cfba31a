"""Multi-turn rollout: model turn → environment step → observation appended → next turn, token in, token out.

Every active episode of a batch generates its next turn in one engine call (left-padded like single-turn
prompts). A trajectory keeps the model's tokens exactly as sampled and appends only the template's new
tokens for each observation (``turns.turn_suffix_ids``), so the trainer sees the sequence the engine saw:
``loss_mask`` is 1 on the model's tokens and 0 on everything the environment or the template added, and
rollout log-probs exist only on the model's tokens. An episode ends, with its reason recorded, when:

- ``env_done``: the environment said so;
- ``max_turns``: --max-turns model turns were taken;
- ``token_budget``: the response (everything after the first prompt) reached --max-total-tokens;
- ``engine_length`` / ``engine_abort``: the engine stopped a turn without an end-of-turn token;
- ``env_error`` / ``env_timeout`` / ``env_invalid``: the environment raised, took longer than
  --env-step-timeout-s, or returned something malformed (details in ``info["error"]``). The sample ends
  there; the batch and the run go on.

Multimodal episodes (Qwen-VL/Omni models): the first prompt may hold the row's media, and an observation
may bring new images / videos / audio: a message ``{"role": "user", "content": "<image> zoomed", "images":
[PIL image | path | HxWx3 array]}`` (also ``"videos"``, ``"audio"``; a message with media but no marker gets
its markers prepended). The template's new text is then expanded by relax-multimodal (:class:`EpisodeMedia`,
the worker's model family and budgets) and the episode accumulates its media tensors and
``mm_token_type_ids`` turn by turn (0 on the model's tokens and on text), so ``Episode.mm`` always lines up
with ``Episode.tokens``: every engine call gets all media so far, and the trainer gets the whole trajectory's.
An observation whose media do not fit in the token budget is dropped whole (never cut through a
placeholder run), ending the episode with ``token_budget``. Text-only observations take the text path.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_core.env import as_messages, resolve
from relax_rollout.engines.base import RolloutEngine, SamplingParams
from relax_rollout.media_prompts import EpisodeMedia, split_media
from relax_rollout.turns import turn_suffix_ids, turn_suffix_text


@dataclass
class Episode:
    env: Any
    history: list[dict[str, Any]]
    tokens: list[int]
    prompt_len: int
    mask: list[float] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    turn_s: list[float] = field(default_factory=list)
    """Per model turn, the seconds of the generation that made it (a batch's, shared by its episodes)."""
    stop_reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    weight_version: int = 0
    model_text: list[str] = field(default_factory=list)
    mm: dict[str, Any] | None = None
    """Multimodal episodes: all media tensors so far + ``mm_token_type_ids`` over ``tokens`` (None: text)."""

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def _append(
    ep: Episode, ids: list[int], mask: float, log_probs: list[float], new: dict | None = None
) -> None:
    """Extend the trajectory; a multimodal episode's ``mm`` grows with it (``new``: the ids' media)."""
    if new is not None or ep.mm is not None:
        old = ep.mm or {"mm_token_type_ids": np.zeros(len(ep.tokens), dtype=np.int64)}
        types = new["mm_token_type_ids"] if new is not None else np.zeros(len(ids), dtype=np.int64)
        merged = dict(old)
        if new is not None and len(new) > 1:
            from relax_core.mm import collate_mm

            merged.update({k: v.numpy() for k, v in collate_mm([old, new]).items()})
        merged["mm_token_type_ids"] = np.concatenate([old["mm_token_type_ids"], types])
        ep.mm = merged
    ep.tokens += ids
    ep.mask += [mask] * len(ids)
    ep.log_probs += log_probs


def _call(pool: cf.ThreadPoolExecutor, timeout_s: float, fn: Any, *args: Any) -> Any:
    """Run an environment method with a time-out (a hung method's thread is abandoned, not joined)."""
    return pool.submit(lambda: resolve(fn(*args))).result(timeout=timeout_s)


def _checked_step(env: Any, text: str) -> Any:
    """``env.step(text)`` with its ``info["reward"]`` converted as the scorer converts a reward's return
    (on the time-limited thread: a hostile ``__float__`` can block). A value that is no finite score is
    moved to ``info["reward_error"]``: the sample is then counted as a ``bad_return``, not trained on ±inf."""
    from relax_rewards.types import BadReturn, as_result

    result = resolve(env.step(text))
    if (
        isinstance(result, tuple)
        and len(result) == 3
        and isinstance(result[2], dict)
        and "reward" in result[2]
    ):
        info = dict(result[2])
        try:
            info["reward"] = as_result(info["reward"]).score
        except BadReturn as bad:
            info["reward_error"] = f"the environment's info['reward']: {bad}"
            del info["reward"]
        result = (result[0], result[1], info)
    return result


def _fail(ep: Episode, reason: str, exc: BaseException | str) -> None:
    ep.stop_reason = reason
    ep.info["error"] = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"


def run_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    episodes: list[Episode],
    params: SamplingParams,
    max_turns: int,
    max_total_tokens: int,
    step_timeout_s: float,
    media: EpisodeMedia | None = None,
) -> list[Episode]:
    """Drive ``episodes`` (already reset, ``tokens`` = their first prompt, ``mm`` its media) to an end;
    returns them. ``media``: how observations' media are expanded (None: a text-only model)."""
    eos = tokenizer.eos_token_id
    pools = {id(ep): cf.ThreadPoolExecutor(1, thread_name_prefix="relax-env") for ep in episodes}
    try:
        active = list(episodes)
        while active:
            mm = [ep.mm for ep in active]
            extra = {"mm": mm} if any(m is not None for m in mm) else {}
            t0 = time.perf_counter()
            outs = engine.generate([ep.tokens for ep in active], params, **extra)
            took = time.perf_counter() - t0
            for ep, out in zip(active, outs):
                ep.turn_s.append(took)
                _take_turn(
                    ep, out, tokenizer, eos, max_turns, max_total_tokens, pools[id(ep)], step_timeout_s, media
                )
            active = [ep for ep in active if ep.stop_reason is None]
    finally:
        for ep in episodes:
            if ep.stop_reason == "env_timeout":  # its thread is still stuck in the hung call
                pools[id(ep)].shutdown(wait=False, cancel_futures=True)
                pools[id(ep)] = cf.ThreadPoolExecutor(1, thread_name_prefix="relax-env")
            try:
                _call(pools[id(ep)], step_timeout_s, ep.env.close)
            except BaseException as e:  # noqa: BLE001 - a failed close is recorded, not raised
                ep.info.setdefault("close_error", f"{type(e).__name__}: {e}")
            pools[id(ep)].shutdown(wait=False, cancel_futures=True)
    return episodes


def _take_turn(ep, out, tokenizer, eos, max_turns, max_total_tokens, pool, timeout_s, media=None) -> None:
    ids = list(out.token_ids)[: max(0, max_total_tokens - ep.response_len)]
    _append(ep, ids, 1.0, list(out.log_probs[: len(ids)]))
    ep.turns += 1
    ep.weight_version = out.weight_version
    text = tokenizer.decode(ids, skip_special_tokens=True)
    ep.model_text.append(text)
    ep.history.append({"role": "assistant", "content": text})
    if "reset_error" in ep.info:  # reset failed: the model answered the bare prompt; the episode ends here
        return _fail(ep, "env_error", ep.info["reset_error"])
    if ep.response_len >= max_total_tokens:
        ep.stop_reason = "token_budget"
        return
    if out.finish_reason in ("length", "abort"):
        ep.stop_reason = f"engine_{out.finish_reason}"
        return
    try:
        result = _call(pool, timeout_s, _checked_step, ep.env, text)
    except cf.TimeoutError:
        return _fail(ep, "env_timeout", f"step took longer than {timeout_s}s")
    except Exception as e:  # noqa: BLE001 - the environment's bug ends this sample only
        return _fail(ep, "env_error", e)
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], bool)):
        return _fail(
            ep, "env_invalid", f"step returned {result!r:.200}; expected (observation, done: bool, info)"
        )
    obs, done, info = result
    if isinstance(info, dict):
        ep.info.update(info)
    if done:
        ep.stop_reason = "env_done"
        return
    if ep.turns >= max_turns:
        ep.stop_reason = "max_turns"
        return
    try:
        messages = as_messages(_call(pool, timeout_s, ep.env.format_observation, obs))
    except cf.TimeoutError:
        return _fail(ep, "env_timeout", f"format_observation took longer than {timeout_s}s")
    except Exception as e:  # noqa: BLE001
        return _fail(ep, "env_invalid" if isinstance(e, TypeError) else "env_error", e)
    ended = bool(ids) and ids[-1] == eos
    messages, new_media = split_media(messages)
    mm = None
    if not new_media:
        suffix = turn_suffix_ids(tokenizer, ep.history, messages, model_ended=ended)
    elif media is None:
        return _fail(
            ep, "env_invalid", f"the observation carries {sorted(new_media)} but the model is text-only"
        )
    else:
        text = turn_suffix_text(tokenizer, ep.history, messages, model_ended=ended)
        try:
            suffix, mm = media.encode(text, new_media, index=f"turn {ep.turns} observation")
        except Exception as e:  # noqa: BLE001 - unreadable media, markers that don't match the media
            return _fail(ep, "env_invalid", e)
    ep.history += messages
    room = max_total_tokens - ep.response_len
    if mm is not None and len(suffix) > room:  # never cut through a placeholder run: drop the observation
        ep.stop_reason = "token_budget"
        return
    _append(ep, suffix[:room], 0.0, [0.0] * len(suffix[:room]), mm)
    if len(suffix) >= room:
        ep.stop_reason = "token_budget"
