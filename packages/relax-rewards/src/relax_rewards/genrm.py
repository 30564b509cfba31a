r"""``genrm``: an LLM as the judge, through any OpenAI-compatible or SGLang endpoint.

Why configurable rather than one prompt: judges differ in what they are asked (is the answer
correct? how good is it, 1–10?), and in how their servers speak. :class:`GenRM` fills a prompt
template with ``{question}``, ``{response}`` and ``{label}``, sends it

- ``api="openai"``: ``POST {base_url}/v1/chat/completions`` with ``messages`` (vLLM, SGLang's
  OpenAI server, OpenAI itself; ``api_key`` becomes a Bearer header), or
- ``api="sglang"``: ``POST {base_url}/generate`` with ``{"text": prompt, "sampling_params": ...}``,

and parses the verdict from the reply with ``verdict_pattern``: a regex whose first group is either
a word in ``positive`` / ``negative`` (→ 1.0 / 0.0) or a number, divided by ``score_scale``. A reply
with no verdict raises (the Scorer records the failure and gives the fallback score), unless
``unparsed_score`` is set. Retries as in :mod:`relax_rewards._http`.

The registered ``genrm`` reward reads its settings from ``metadata["genrm"]`` (a dict of
:class:`GenRM` fields) or ``$RELAX_GENRM_URL``; for a fixed judge pass ``Scorer(GenRM(...))``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from relax_rewards._http import AsyncBatchMixin, post_json
from relax_rewards.registry import register
from relax_rewards.types import RewardResult

__all__ = ["DEFAULT_TEMPLATE", "GenRM", "genrm_reward"]

DEFAULT_TEMPLATE = """You are grading a student's answer against the reference answer.

Question: {question}

Reference answer: {label}

Student response: {response}

Is the student's final answer correct? Think briefly, then end with a line of the form
"Verdict: CORRECT" or "Verdict: INCORRECT"."""


@dataclass
class GenRM(AsyncBatchMixin):
    """A configurable LLM judge; call it like any reward ``(response, label, metadata)``."""

    base_url: str
    api: str = "openai"  # or "sglang"
    model: str = "default"
    template: str = DEFAULT_TEMPLATE
    system_prompt: str | None = None
    verdict_pattern: str = r"(?i)verdict\s*[:：]\s*\**\s*([A-Za-z]+|[-+]?\d+(?:\.\d+)?)"
    positive: tuple[str, ...] = ("correct", "yes", "true", "right")
    negative: tuple[str, ...] = ("incorrect", "no", "false", "wrong")
    score_scale: float = 1.0
    unparsed_score: float | None = None
    max_tokens: int = 512
    temperature: float = 0.0
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 0.5
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api not in ("openai", "sglang"):
            raise ValueError(f"GenRM api must be 'openai' or 'sglang' (got {self.api!r})")
        self.base_url = self.base_url.rstrip("/")

    def prompt(self, response: str, label: Any, metadata: dict | None) -> str:
        meta = metadata or {}
        question = meta.get("question") or meta.get("prompt") or ""
        return self.template.format(question=question, response=response, label=label)

    def request(self, prompt: str) -> str:
        """Send one prompt and return the judge's text."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        if self.api == "openai":
            messages = [{"role": "user", "content": prompt}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            url = (
                self.base_url
                if self.base_url.endswith("/chat/completions")
                else self.base_url
                + ("/chat/completions" if self.base_url.endswith("/v1") else "/v1/chat/completions")
            )
            payload = {
                "model": self.model,
                "messages": messages,
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                **self.extra_body,
            }
            reply = post_json(
                url,
                payload,
                timeout_s=self.timeout_s,
                retries=self.retries,
                backoff_s=self.backoff_s,
                headers=headers,
            )
            try:
                return reply["choices"][0]["message"]["content"] or ""
            except (KeyError, IndexError, TypeError) as exc:
                raise ValueError(f"not an OpenAI chat completion reply: {str(reply)[:200]}") from exc
        url = self.base_url if self.base_url.endswith("/generate") else self.base_url + "/generate"
        payload = {
            "text": prompt,
            "sampling_params": {"max_new_tokens": self.max_tokens, "temperature": self.temperature},
            **self.extra_body,
        }
        reply = post_json(
            url,
            payload,
            timeout_s=self.timeout_s,
            retries=self.retries,
            backoff_s=self.backoff_s,
            headers=headers,
        )
        if isinstance(reply, list):
            reply = reply[0] if reply else {}
        if not isinstance(reply, dict) or "text" not in reply:
            raise ValueError(f"not an SGLang /generate reply: {str(reply)[:200]}")
        return reply["text"]

    def parse(self, text: str) -> float | None:
        """The verdict's score, or ``None`` when the text has none (last match wins).

        >>> GenRM("http://x").parse("blah\\nVerdict: CORRECT")
        1.0
        >>> GenRM("http://x", score_scale=10).parse("Verdict: 7")
        0.7
        """
        matches = re.findall(self.verdict_pattern, text)
        if not matches:
            return None
        word = matches[-1].strip().lower()
        if word in self.positive:
            return 1.0
        if word in self.negative:
            return 0.0
        try:
            return float(word) / self.score_scale
        except ValueError:
            return None

    def __call__(self, response: str, label: Any, metadata: dict | None = None) -> RewardResult:
        text = self.request(self.prompt(response, label, metadata))
        score = self.parse(text)
        if score is None:
            if self.unparsed_score is None:
                raise ValueError(f"judge reply has no verdict: {text[-200:]!r}")
            return RewardResult(self.unparsed_score, {"judge": text, "verdict_found": False})
        return RewardResult(score, {"judge": text, "verdict_found": True})


_FIELDS = {f.name for f in fields(GenRM)}


@register("genrm")
def genrm_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """Judge with the :class:`GenRM` configured by ``metadata["genrm"]`` or ``$RELAX_GENRM_URL``."""
    config = dict((metadata or {}).get("genrm") or {})
    config.setdefault("base_url", os.environ.get("RELAX_GENRM_URL"))
    if not config["base_url"]:
        raise ValueError("genrm needs metadata['genrm']['base_url'] or $RELAX_GENRM_URL")
    unknown = set(config) - _FIELDS
    if unknown:
        raise ValueError(f"unknown genrm settings {sorted(unknown)}; valid: {sorted(_FIELDS)}")
    for key in ("positive", "negative"):
        if key in config:
            config[key] = tuple(config[key])
    return GenRM(**config)(response, label, metadata)
