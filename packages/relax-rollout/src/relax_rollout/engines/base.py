"""The rollout-engine protocol, its registry and factory.

Engines are looked up by name in a :class:`~relax_core.registry.Registry` of dotted paths and imported only
when built, so choosing ``torch`` never imports SGLang and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from relax_core.registry import Registry

CONSTRAINT_KINDS = ("json_schema", "regex", "tool_calls")
"""What a :class:`Constraint` may force the output to be."""


@dataclass(frozen=True)
class Constraint:
    """Constrained decoding: the response must match this (SGLang's ``json_schema`` / ``regex`` /
    ``structural_tag``). An engine masks the tokens that cannot continue a match before it samples, and
    ends the response (finish_reason "stop") once the match is complete."""

    kind: str
    """One of :data:`CONSTRAINT_KINDS`: "json_schema" (``spec`` is a JSON schema), "regex" (``spec`` is a
    regular expression the whole response must match), "tool_calls" (one or more tool calls)."""
    spec: str
    """The JSON schema text, the regex, or for "tool_calls" a JSON list of the OpenAI function tool dicts
    (``{"type": "function", "function": {"name", "parameters", ...}}``) that may be called."""
    open: str = ""
    """For "tool_calls": the text before each call's JSON object ``{"name": <one of the tools>,
    "arguments": <that tool's parameters schema>}``, e.g. ``"<tool_call>\\n"``."""
    close: str = ""
    """For "tool_calls": the text after each call's JSON object, e.g. ``"\\n</tool_call>"``."""
    required_name: str | None = None
    """For "tool_calls": only this tool may be called (OpenAI's named ``tool_choice``)."""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"Constraint.kind must be one of {list(CONSTRAINT_KINDS)} (got {self.kind!r})")
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(
                f"Constraint.spec must be a non-empty string for kind {self.kind!r} (got {self.spec!r})"
            )
        if self.required_name is not None and self.kind != "tool_calls":
            raise ValueError(
                f"Constraint.required_name is only for kind 'tool_calls' (got kind {self.kind!r})"
            )


@dataclass(frozen=True)
class SamplingParams:
    """What to sample. Log-probs are always of the distribution actually sampled from (logits / T)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    min_new_tokens: int | list[int] = 0
    """Suppress EOS until this many tokens (one int, or one per prompt)."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings (SGLang's ``stop``): a response ends with the token after which its decoded text
    (special tokens included) contains one of them. That token is kept in ``token_ids`` (the model made it;
    the trainer scores exactly the tokens generated); servers cut the returned *text* before the string."""
    top_logprobs: int = 0
    """Not a sampling choice, what to return: per generated token the log-probs of this many most likely
    tokens (:attr:`GenerateOutput.top_logprobs`)."""
    input_logprobs: bool = False
    """What to return as well: the prompt tokens' log-probs under the model (:attr:`GenerateOutput.input_logprobs`;
    with ``top_logprobs`` also the prompt positions' top log-probs), what SGLang's ``logprob_start_len``
    asks for and its frontend's ``select`` scores choices with."""
    constraint: Constraint | None = None
    """Constrained decoding (an engine listing ``"constraint"`` in its features): every prompt's response
    must match it. The log-probs returned are of the masked distribution actually sampled from (tokens
    that break the constraint have probability 0), which is what an RL trainer must score token-exactly.
    A response whose match is complete ends with finish_reason "stop"."""


@dataclass
class EpisodeResult:
    """What a multi-turn episode adds to its response (:func:`relax_rollout.multiturn.run_episodes`): the
    response is the model's turns with what the environment and the chat template put between them."""

    loss_mask: list[float]
    """1 per response token the model sampled, 0 on what the environment and the template added."""
    turns: int
    """The model's turns."""
    env_reward: float | None = None
    """The environment's own reward (it wins over --rm-type), or None."""
    env_reward_error: str | None = None
    """Why the environment's reward could not be read (a failure score is given instead), or None."""
    env_error: str = ""
    """The environment's error (a reset or step that raised), or ""."""
    turn_s: list[float] = field(default_factory=list)
    """Per model turn, the seconds of the generation that made it."""
    tool_calls: int = 0
    """Tool calls the model made (a tool environment's ``info["tool_calls"]``; 0 for others)."""
    tool_errors: int = 0
    """Of those, the ones that failed (``info["tool_errors"]``)."""
    failure: str = "bad_return"
    """The reward failure ``env_reward_error`` is counted as (an agent's: ``agent_error``, ``agent_timeout``)."""
    agent: str = ""
    """Agent runs (--agent-path): the agent whose turns these are."""


@dataclass
class GenerateOutput:
    token_ids: list[int]
    """Generated tokens, including the EOS/stop token when one was produced."""
    log_probs: list[float]
    """Per generated token, log p(token | prefix) under the sampling distribution."""
    finish_reason: str
    """"stop" (EOS/stop token), "length" (max_new_tokens reached) or "abort" (aborted by the caller,
    e.g. a server's /abort_request or /pause_generation; the tokens so far are kept)."""
    weight_version: int
    extra: dict[str, Any] = field(default_factory=dict)
    """What an engine adds (``routed_experts`` with routing replay, a server's ``rid``)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``SamplingParams.top_logprobs`` = k: per generated token, the k most likely ``(token_id,
    log-prob)`` pairs, most likely first, under the distribution ``log_probs`` are of. None: not asked for,
    or the engine cannot give them (it must not list ``"top_logprobs"`` in :attr:`RolloutEngine.features`)."""
    matched_stop: str | None = None
    """The stop string (``SamplingParams.stop``) that ended the response (finish_reason "stop"); None
    when an EOS / stop token ended it, or no stop."""
    input_logprobs: list[float | None] | None = None
    """With ``SamplingParams.input_logprobs``: per prompt token, log p(token | the tokens before it) under
    the model's own logits (temperature 1, as SGLang's input log-probs), the first token's None. None: not
    asked for, or the engine cannot give them (it must not list ``"input_logprobs"`` in its features)."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """With ``input_logprobs`` and ``top_logprobs`` = k: per prompt token, the k most likely ``(token_id,
    log-prob)`` at its position, most likely first (the first token's None)."""
    token_versions: list[int] | None = None
    """Per generated token, the weight version of the forward that sampled it: a response that went on
    across a weight update (an in-place pause) has two or more (SGLang's ``meta_info.weight_versions``
    spans). None: the engine does not say, every token is ``weight_version``'s."""

    episode: EpisodeResult | None = None
    """A multi-turn episode's mask, turns and environment outcome (None: one model turn)."""

    @property
    def oldest_version(self) -> int:
        """The oldest weight version any of its tokens was sampled with (what its staleness is)."""
        return min(self.token_versions) if self.token_versions else self.weight_version


def answered(outs: list[GenerateOutput | None]) -> list[GenerateOutput]:
    """``outs``, filled in prompt by prompt, once every prompt has its output (what ``generate`` returns)."""
    done = [o for o in outs if o is not None]
    assert len(done) == len(outs), f"{len(outs) - len(done)} of {len(outs)} prompts have no output"
    return done


OPTIONAL_FEATURES = ("top_logprobs", "stop", "input_logprobs", "constraint", "stream")
"""What an engine may implement beyond the protocol, named in its ``features``: ``SamplingParams.top_logprobs``,
``SamplingParams.stop``, ``SamplingParams.input_logprobs`` and ``SamplingParams.constraint``. A server refuses a request needing a feature its engine lacks (a 400 naming the
field), instead of answering without it. ``"stream"``: ``generate`` takes ``on_token``, a callable given a
:class:`TokenDelta` as tokens are sampled (token-by-token streaming); a server streams an engine without it
one delta per response, once the response is complete."""


@dataclass(frozen=True)
class TokenDelta:
    """Tokens one response of a ``generate`` call gained since its last delta (engines listing ``"stream"``
    call ``on_token`` with these as they sample, from their generation thread: the callable must be quick,
    e.g. a queue's ``put``). The call's outputs stay the whole truth; deltas only say early what they will
    hold."""

    index: int
    """Which prompt of the ``generate`` call (its position in ``prompts``)."""
    start: int
    """How many tokens of this response came before these (the position of ``token_ids[0]``)."""
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    """Per token, as :attr:`GenerateOutput.log_probs` will hold it."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """Per token its top log-probs, as :attr:`GenerateOutput.top_logprobs` (None when not asked for)."""


def supports(engine: RolloutEngine, feature: str) -> bool:
    """Whether ``engine`` lists ``feature`` (one of :data:`OPTIONAL_FEATURES`) in its ``features``."""
    return feature in getattr(engine, "features", ())


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout manager needs from an inference engine (and optionally ``features``, a set of
    :data:`OPTIONAL_FEATURES`)."""

    @property
    def weight_version(self) -> int:
        """The version of the weights it generates with (read-only: :meth:`update_weights` sets it; the
        servers' engines read it from their servers)."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerateOutput]: ...

    def update_weights(self, tensors: dict[str, Any], version: int) -> None: ...

    def weights_checksum(self) -> str: ...


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What an engine can give back to the device (SGLang's ``/release_memory_occupation`` tags)."""


class MemoryReleased(RuntimeError):
    """Generation was asked of an engine whose device memory is released (colocate, while training)."""


def memory_tags(tags: list[str] | None, where: str = "tags") -> list[str]:
    """``tags`` checked against :data:`MEMORY_TAGS`; None means all of them."""
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"{where}: must be a list of {list(MEMORY_TAGS)} (got {tags!r})")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"{where}: unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


def memory_request(tags: list[str] | None = None) -> dict[str, Any]:
    """The body of SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``: ``tags``,
    left out for every kind of memory."""
    return {} if tags is None else {"tags": memory_tags(tags)}


@runtime_checkable
class ReleasesMemory(Protocol):
    """An engine that can give its device memory back while the trainer uses the device (colocate)."""

    def release_memory(self, tags: list[str] | None = None) -> None: ...

    def resume_memory(self, tags: list[str] | None = None) -> None: ...


@runtime_checkable
class PausesGeneration(Protocol):
    """An engine of SGLang servers that can hold their requests in flight (``/pause_generation``; mode
    ``abort``, ``retract`` or ``in_place``) and let them go on (``/continue_generation``): partial rollout
    puts a weight update in under an in-place pause."""

    def pause(self, mode: str = "abort") -> None: ...

    def resume(self) -> None: ...


ENGINES = Registry(
    "--rollout-backend",
    "relax.rollout_engines",
    {
        "torch": "relax_rollout.engines.torch_engine:TorchEngine",
        "external": "relax_rollout.engines.external:ExternalEngine",
        "sglang": "relax_rollout.engines.sglang:SGLangEngine",
    },
)
"""The rollout engines (another package adds one under the ``relax.rollout_engines`` entry points)."""


def build_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine registered as ``name``; heavy backends are imported here, not before."""
    engine: RolloutEngine = ENGINES.load(name)(**kwargs)
    return engine
