"""Agent trajectories recorded from ``/v1/chat/completions``, so Relax can train agents it does not own.

Why: an external agent (any framework) speaks plain OpenAI chat and resends the whole conversation on
every call. Rendering and tokenising that conversation again each turn would change the model's own tokens
(a sampled BPE split is often not the canonical one, see :mod:`relax_rollout.turns`), and the trainer would
then score tokens the model never produced. So per session the recorder keeps the exact ids served so far;
when a call's messages extend them (the same history, our reply verbatim, then new messages) the prompt is
those ids plus the chat template's suffix for the new messages only (``turn_suffix_ids``): token in, token
out. The trajectory is then exactly what the model saw and produced, with a loss mask of 1 on the sampled
tokens only and the engine's log-probs there, ready for the trainer (:func:`to_bus_sample`).

Tool conversations are recorded the same way: a turn that calls tools is the model's tokens as generated
(the calls' text included), and the tool results arrive in the next call's suffix, rendered with the same
``tools`` (and ``chat_template_kwargs``) the trajectory started with.

Sessions are named by the ``X-Relax-Session`` header, else the body's ``user``; no name, no recording. A
session is one conversation, so its calls are served one at a time. A call whose messages do not extend the
trajectory (the agent edited or dropped turns) closes it with stop reason ``history_rewritten`` and starts
the session's next trajectory (index + 1) from that call's own rendering; earlier ones stay readable.
The routes that read and close them (``/relax/trajectories``) are in :mod:`.trajectory_routes`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_core import sample
from relax_core.sample import RolloutSample
from relax_rollout.server.protocol import BadRequest, NotFound
from relax_rollout.turns import turn_suffix_ids

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Relax-Session"
# Stands in for our reply when turn_suffix_ids locates the end of the assistant turn by searching its text:
# a reply can be empty or a substring of the end-of-turn marker ("d" in "<|im_end|>"); an untrained policy
# says such things. The suffix after the turn does not depend on the reply for templates that do not branch
# on the reply's text.
_PLACEHOLDER = "RELAXREPLYPLACEHOLDER"
RETIRED_KEPT = 100_000
"""Names of sessions taken for training (:meth:`TrajectoryRecorder.take`) remembered to refuse late calls."""


def render_prompt(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The chat template's rendering of ``messages`` plus the generation prompt, tokenised;
    ``template_kwargs``: more arguments of the template (``tools``, ``chat_template_kwargs``)."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return tokenizer.encode(text, add_special_tokens=False)


def session_name(header: str | None, body: dict) -> str | None:
    """The session a chat call belongs to: the header, else the OpenAI ``user`` field; None = unrecorded."""
    for where, v in ((SESSION_HEADER, header), ("user", body.get("user"))):
        if v is None:
            continue
        if not isinstance(v, str) or not v or len(v) > 256 or not v.isprintable():
            raise BadRequest(where, f"a session name must be 1-256 printable characters (got {v!r})")
        return v
    return None


def parse_close(body: Any) -> float | None:
    """The body of ``POST /relax/trajectories/<session>/close``: ``{"reward": <number>}`` or empty."""
    if not isinstance(body, dict):
        raise BadRequest("body", 'must be a JSON object such as {"reward": 1.0}')
    for key in body:
        if key != "reward":
            raise BadRequest(key, "unknown field: the close body takes only 'reward' (a number)")
    r = body.get("reward")
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
        raise BadRequest("reward", f"must be a finite number (got {r!r})")
    return None if r is None else float(r)


def parse_index(query: dict[str, str]) -> int | None:
    """``?index=N`` of ``GET /relax/trajectories/<session>``: which of the session's trajectories."""
    v = query.get("index")
    if v is None:
        return None
    if not (v.isascii() and v.isdigit()):
        raise BadRequest("index", f"must be a non-negative integer (got {v!r})")
    return int(v)


def _canon(m: dict) -> dict:
    """A message as history matching compares it: unset optional fields dropped (clients re-serialise them
    as None or []), ``reasoning_content`` dropped (clients may or may not send it back), tool calls by name
    and arguments only (their ids and the arguments' JSON spacing are the client's)."""
    out = {
        k: v
        for k, v in m.items()
        if k != "reasoning_content" and (k in ("role", "content") or v not in (None, [], {}, ""))
    }
    if out.get("content") is None:
        out["content"] = ""
    if "tool_calls" in out:
        out["tool_calls"] = [
            (c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
            for c in out["tool_calls"]
        ]
    return out


def _same_template_kwargs(call: dict, recorded: dict) -> bool:
    """Whether a call may extend a trajectory rendered with ``recorded``: the same template arguments, except
    that a call offering no tools (``tool_choice`` none, or none sent) continues one whose context shows them
    (its tokens cannot unsee them; the suffix is rendered as before)."""
    if "tools" not in call:
        return {k: v for k, v in recorded.items() if k != "tools"} == call
    return call == recorded


@dataclass
class Trajectory:
    """One recorded conversation. ``loss_mask`` and ``rollout_log_probs`` cover ``tokens[prompt_len:]``."""

    session: str
    index: int
    tokens: list[int]
    prompt_len: int
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """The conversation so far, ending with our last reply (what the next call must repeat)."""
    finish_reasons: list[str] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    completion_spans: list[list[int]] = field(default_factory=list)
    """Per call, [start, end) of its completion in ``tokens``."""
    call_s: list[float] = field(default_factory=list)
    """Per call, the seconds from its arrival to its reply (the latency the agent saw, queueing included)."""
    model_ended: bool = False
    """The last completion ends with the end-of-turn token (else the template's suffix supplies it)."""
    template_kwargs: dict = field(default_factory=dict)
    """What the chat template was given besides the messages (``tools``, ``chat_template_kwargs``): the
    suffix of every later call is rendered with the same, as the tokens so far were."""
    stop_reason: str | None = None
    reward: float | None = None

    def add_call(
        self,
        gap: list[int],
        completion: list[int],
        log_probs: list[float],
        finish: str,
        version: int,
        eos_id: int | None,
    ) -> None:
        """Append template tokens (``gap``, mask 0) then the model's completion (mask 1, its log-probs)."""
        self.tokens += gap
        self.loss_mask += [0] * len(gap)
        self.rollout_log_probs += [0.0] * len(gap)
        start = len(self.tokens)
        self.tokens += completion
        self.loss_mask += [1] * len(completion)
        self.rollout_log_probs += [float(x) for x in log_probs]
        self.completion_spans.append([start, len(self.tokens)])
        self.finish_reasons.append(finish)
        self.weight_versions.append(int(version))
        self.model_ended = bool(completion) and completion[-1] == eos_id
        assert len(self.loss_mask) == len(self.rollout_log_probs) == len(self.tokens) - self.prompt_len

    def summary(self) -> dict:
        """The trajectory's JSON without its tokens; the fields a sample also has carry the sample schema's
        names (:mod:`relax_core.sample`), so that :func:`to_bus_sample` takes either."""
        return {
            "session": self.session,
            "index": self.index,
            "num_calls": len(self.finish_reasons),
            "num_tokens": len(self.tokens),
            sample.PROMPT_LEN: self.prompt_len,
            "completion_tokens": sum(self.loss_mask),
            "finish_reasons": list(self.finish_reasons),
            "closed": self.stop_reason is not None,
            "stop_reason": self.stop_reason,
            "reward": self.reward,
        }

    def to_json(self) -> dict:
        return {
            **self.summary(),
            sample.TOKENS: list(self.tokens),
            sample.LOSS_MASK: list(self.loss_mask),
            sample.ROLLOUT_LOG_PROBS: list(self.rollout_log_probs),
            "weight_versions": list(self.weight_versions),
            "completion_spans": [list(s) for s in self.completion_spans],
            "call_s": list(self.call_s),
            "messages": [dict(m) for m in self.messages],
        }


@dataclass
class _Session:
    lock: threading.Lock = field(default_factory=threading.Lock)  # serialises the session's calls
    trajectories: dict[int, Trajectory] = field(default_factory=dict)
    next_index: int = 0

    def latest(self) -> Trajectory | None:
        return self.trajectories.get(self.next_index - 1)

    def open(self) -> Trajectory | None:
        t = self.latest()
        return t if t is not None and t.stop_reason is None else None


class TrajectoryRecorder:
    """Thread-safe store of per-session trajectories, fed by the chat endpoint.

    ``max_context``: a call whose prompt would reach it closes the trajectory with stop reason ``length``
    (and is refused). ``keep_closed``: only that many closed trajectories are kept, oldest dropped first, so
    a long-running server does not grow without bound.
    """

    def __init__(self, tokenizer: Any, max_context: int | None = None, keep_closed: int = 10_000):
        self.tokenizer, self.max_context, self.keep_closed = tokenizer, max_context, keep_closed
        self.eos_id = tokenizer.eos_token_id
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._closed: deque[tuple[str, int]] = deque()
        self._retired: dict[str, None] = {}  # (insertion-ordered: the oldest names are forgotten first)

    def turn(self, session: str, messages: list[dict], template_kwargs: dict | None = None) -> Turn:
        """``with recorder.turn(name, messages) as t:`` generate from ``t.prompt_ids``, then ``t.record``.
        ``template_kwargs``: the call's arguments of the chat template (``tools``, ...)."""
        with self._lock:
            if session in self._retired:
                raise BadRequest(
                    SESSION_HEADER,
                    f"session {session!r} has ended (its episode finished or timed out and was trained on): "
                    "an agent must not call the model for an episode after it returned",
                )
            sess = self._sessions.setdefault(session, _Session())
        return Turn(self, sess, session, messages, template_kwargs or {}, self._lock, self._close)

    def suffix(self, traj: Trajectory, new: list[dict]) -> list[int]:
        """Template ids between the trajectory's last completion and the next one, for ``new`` messages."""
        hist = traj.messages[:-1] + [{**traj.messages[-1], "content": _PLACEHOLDER}]
        return turn_suffix_ids(self.tokenizer, hist, new, traj.model_ended, traj.template_kwargs)

    def _close(self, traj: Trajectory, reason: str) -> None:  # caller holds self._lock
        traj.stop_reason = reason
        self._closed.append((traj.session, traj.index))
        while len(self._closed) > self.keep_closed:
            name, i = self._closed.popleft()
            if (sess := self._sessions.get(name)) is not None:  # (a session taken is gone already)
                sess.trajectories.pop(i, None)

    def _session(self, session: str) -> _Session:
        with self._lock:
            sess = self._sessions.get(session)
            known = sess is not None and bool(sess.trajectories)
        if sess is not None and sess.next_index and not known:
            raise NotFound(
                f"session {session!r}: its trajectories were dropped, only the last {self.keep_closed} closed "
                "ones are kept; fetch trajectories sooner after closing them"
            )
        if sess is None or not known:
            raise NotFound(
                f"no trajectory recorded for session {session!r}: a session is named by the {SESSION_HEADER} "
                "header (or the 'user' field) of a /v1/chat/completions call; GET /relax/trajectories lists them"
            )
        return sess

    def get(self, session: str, index: int | None = None) -> dict:
        """The session's latest trajectory (or the one numbered ``index``) as JSON."""
        sess = self._session(session)
        with self._lock:
            i = sess.next_index - 1 if index is None else index
            t = sess.trajectories.get(i)
            if t is None:
                raise NotFound(
                    f"session {session!r} has no trajectory {i} (kept: {sorted(sess.trajectories)}; only the "
                    f"last {self.keep_closed} closed trajectories are kept)"
                )
            return t.to_json()

    def close(self, session: str, reward: float | None = None) -> dict:
        """End the session's latest trajectory (``closed_by_client``, unless already closed) and store a
        reward; waits for a call of the session in flight, so its tokens are included."""
        sess = self._session(session)
        with sess.lock, self._lock:
            t = sess.latest()
            if t is None:
                raise NotFound(f"session {session!r}: its trajectories were dropped (keep_closed)")
            if t.stop_reason is None:
                self._close(t, "closed_by_client")
            if reward is not None:
                t.reward = reward
            return t.summary()

    def take(self, session: str, wait_s: float = 30.0) -> list[dict]:
        """Every trajectory of ``session`` (JSON, oldest first; the open one closed ``closed_by_client``), and
        the session retired: it is forgotten and later calls naming it are refused. Waits up to ``wait_s``
        for a call in flight (then takes what is recorded). An unknown session has none: ``[]``."""
        with self._lock:
            sess = self._sessions.get(session)
            self._retired[session] = None
            while len(self._retired) > RETIRED_KEPT:
                del self._retired[next(iter(self._retired))]
        if sess is None:
            return []
        locked = sess.lock.acquire(timeout=wait_s)
        try:
            with self._lock:
                if (t := sess.open()) is not None:
                    self._close(t, "closed_by_client")
                self._sessions.pop(session, None)
                return [t.to_json() for _, t in sorted(sess.trajectories.items())]
        finally:
            if locked:
                sess.lock.release()

    def sessions(self) -> list[dict]:
        with self._lock:
            return [
                {"session": name, "trajectories": [t.summary() for t in s.trajectories.values()]}
                for name, s in self._sessions.items()
                if s.trajectories
            ]


class Turn:
    """One recorded call: holds its session's lock from choosing the prompt to recording the reply. Made by
    :meth:`TrajectoryRecorder.turn`, which hands it the recorder's lock (``rec_lock``, over every session)
    and ``close(trajectory, reason)`` (called with that lock held)."""

    def __init__(
        self,
        rec: TrajectoryRecorder,
        sess: _Session,
        name: str,
        messages: list[dict],
        template_kwargs: dict,
        rec_lock: threading.Lock,
        close: Callable[[Trajectory, str], None],
    ):
        self._rec, self._sess, self.name, self.messages = rec, sess, name, messages
        self._rec_lock, self._close = rec_lock, close
        self.template_kwargs = template_kwargs
        self.prompt_ids: list[int] = []

    def __enter__(self) -> Turn:
        self.t0 = time.perf_counter()
        self._sess.lock.acquire()
        try:
            self._plan()
        except BaseException:
            self._sess.lock.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sess.lock.release()

    def _plan(self) -> None:
        rec, cur = self._rec, self._sess.open()
        self.extends, self.suffix, self.reason = None, [], None
        if cur is not None:
            n = len(cur.messages)
            if (
                len(self.messages) >= n
                and all(_canon(a) == _canon(b) for a, b in zip(self.messages, cur.messages))
                and _same_template_kwargs(self.template_kwargs, cur.template_kwargs)
            ):
                try:
                    self.suffix, self.extends = rec.suffix(cur, self.messages[n:]), cur
                except ValueError as e:
                    logger.warning("session %r: starting a new trajectory: %s", self.name, e)
                    self.reason = "template_not_append_only"
            else:
                self.reason = "history_rewritten"
        if self.extends is not None:
            self.prompt_ids = self.extends.tokens + self.suffix
        else:
            self.prompt_ids = render_prompt(rec.tokenizer, self.messages, self.template_kwargs)
        if rec.max_context and len(self.prompt_ids) >= rec.max_context:
            if self.extends is not None:
                with self._rec_lock:
                    self._close(self.extends, "length")
            raise BadRequest(
                "messages",
                f"the conversation is {len(self.prompt_ids)} tokens and the model's context is "
                f"{rec.max_context}: start a new session (the trajectory so far is closed, stop reason length)",
            )

    def record(self, out: Any, reply: str | dict) -> dict:
        """Add the engine's output (a ``GenerateOutput``) and our reply (its text, or the assistant message
        as the template takes it, tool calls included); returns the summary."""
        rec = self._rec
        with self._rec_lock:
            t = self.extends
            if t is None:
                old = self._sess.open()
                if old is not None:
                    self._close(old, self.reason or "history_rewritten")
                t = Trajectory(self.name, self._sess.next_index, list(self.prompt_ids), len(self.prompt_ids))
                t.template_kwargs = dict(self.template_kwargs)
                self._sess.trajectories[t.index] = t
                self._sess.next_index += 1
            gap = self.suffix if self.extends is not None else []
            t.add_call(
                gap, list(out.token_ids), out.log_probs, out.finish_reason, out.oldest_version, rec.eos_id
            )
            t.call_s.append(time.perf_counter() - self.t0)
            message = {"role": "assistant", "content": reply} if isinstance(reply, str) else dict(reply)
            t.messages = [dict(m) for m in self.messages] + [message]
            return t.summary()


def to_bus_sample(
    trajectory: Trajectory | dict,
    reward: float | None,
    group_id: Any,
    policy_version: int | None = None,
    rollout_step: int | None = None,
) -> RolloutSample:
    """A recorded trajectory (the object, or the JSON of ``GET /relax/trajectories/<session>``) as the sample
    dict ``RolloutWorker`` puts on the bus, so agent trajectories train like rollout samples.

    ``reward``: None takes the one given at close. ``group_id``: the samples the advantage is normalised
    over (e.g. several sessions of one task); a group of one has zero GRPO advantage. ``policy_version``:
    None takes the oldest weight version among the calls (conservative for staleness; each token's
    rollout log-prob is under the version that sampled it). ``response_text`` is the last reply.
    """
    t = trajectory.to_json() if isinstance(trajectory, Trajectory) else trajectory
    reward = t.get("reward") if reward is None else reward
    if reward is None or isinstance(reward, bool) or not math.isfinite(float(reward)):
        raise ValueError(
            f"trajectory {t['session']!r}#{t['index']} has no finite reward (got {reward!r}): "
            'pass reward=..., or close the session with {"reward": x}'
        )
    if not t["finish_reasons"]:
        raise ValueError(f"trajectory {t['session']!r}#{t['index']} has no calls")
    tokens, plen = np.asarray(t[sample.TOKENS], dtype=np.int64), int(t[sample.PROMPT_LEN])
    mask = np.asarray(t[sample.LOSS_MASK], dtype=np.float32)
    logp = np.asarray(t[sample.ROLLOUT_LOG_PROBS], dtype=np.float32)
    if not len(mask) == len(logp) == len(tokens) - plen:
        raise ValueError(
            f"inconsistent trajectory: {len(tokens)} tokens, prompt_len {plen}, "
            f"{len(mask)} loss_mask and {len(logp)} log-prob entries"
        )
    version = min(t["weight_versions"]) if policy_version is None else int(policy_version)
    finish = "length" if t.get("stop_reason") == "length" else t["finish_reasons"][-1]
    replies = [m["content"] for m in t.get("messages", []) if m.get("role") == "assistant"]
    return RolloutSample(
        tokens=tokens,
        prompt_len=plen,
        response_len=len(tokens) - plen,
        loss_mask=mask,
        rollout_log_probs=logp,
        reward=float(reward),
        reward_failure="",
        policy_version=version,
        group_id=group_id,
        prompt_id=f"{t['session']}#{t['index']}",
        rollout_step=version if rollout_step is None else int(rollout_step),
        finish_reason=finish,
        response_text=replies[-1] if replies else "",
    )
