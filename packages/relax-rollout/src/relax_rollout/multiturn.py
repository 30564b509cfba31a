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
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Any

from relax_core.env import as_messages, resolve
from relax_rollout.engines.base import SamplingParams
from relax_rollout.turns import turn_suffix_ids


@dataclass
class Episode:
    env: Any
    history: list[dict[str, Any]]
    tokens: list[int]
    prompt_len: int
    mask: list[float] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    stop_reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    weight_version: int = 0
    model_text: list[str] = field(default_factory=list)

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def _call(pool: cf.ThreadPoolExecutor, timeout_s: float, fn: Any, *args: Any) -> Any:
    """Run an environment method with a time-out (a hung method's thread is abandoned, not joined)."""
    return pool.submit(lambda: resolve(fn(*args))).result(timeout=timeout_s)


def _fail(ep: Episode, reason: str, exc: BaseException | str) -> None:
    ep.stop_reason = reason
    ep.info["error"] = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"


def run_episodes(
    engine: Any,
    tokenizer: Any,
    episodes: list[Episode],
    params: SamplingParams,
    max_turns: int,
    max_total_tokens: int,
    step_timeout_s: float,
) -> list[Episode]:
    """Drive ``episodes`` (already reset, ``tokens`` = their first prompt) to an end; returns them."""
    eos = tokenizer.eos_token_id
    pools = {id(ep): cf.ThreadPoolExecutor(1, thread_name_prefix="relax-env") for ep in episodes}
    try:
        active = list(episodes)
        while active:
            outs = engine.generate([ep.tokens for ep in active], params)
            for ep, out in zip(active, outs):
                _take_turn(
                    ep, out, tokenizer, eos, max_turns, max_total_tokens, pools[id(ep)], step_timeout_s
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


def _take_turn(ep, out, tokenizer, eos, max_turns, max_total_tokens, pool, timeout_s) -> None:
    ids = list(out.token_ids)[: max(0, max_total_tokens - ep.response_len)]
    ep.tokens += ids
    ep.mask += [1.0] * len(ids)
    ep.log_probs += list(out.log_probs[: len(ids)])
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
        result = _call(pool, timeout_s, ep.env.step, text)
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
    suffix = turn_suffix_ids(tokenizer, ep.history, messages, model_ended=bool(ids) and ids[-1] == eos)
    ep.history += messages
    room = max_total_tokens - ep.response_len
    ep.tokens += suffix[:room]
    ep.mask += [0.0] * len(suffix[:room])
    ep.log_probs += [0.0] * len(suffix[:room])
    if len(suffix) >= room:
        ep.stop_reason = "token_budget"
