"""The rollout role's prompt side: the dataset, where the run stands in it, and prompts made into ids.

Why a room of its own: the data position is part of a checkpoint and of an in-place restart (a resumed or
restarted rollout must draw exactly the prompts the lost one would have), and a prompt that cannot be used
(unreadable media, longer than the model's context) must be skipped and counted before it reaches the
engine. Both concern rows, not generation, so :class:`Prompts` owns them: the :class:`PromptIterator`,
the ids of each prompt (chat template, media placeholders expanded by relax-multimodal), the data position
at which each step began, and the log of which rows each step put on the bus. The media helpers here build
what expands the media of a row (``--multimodal-keys``) or of a multi-turn episode.
"""

from __future__ import annotations

import json
from typing import Any

from relax_core.config import RelaxConfig
from relax_core.data import Message, PromptIterator, load_prompts, prompt_text


class PromptTooLong(ValueError):
    """A dataset prompt that leaves no room for a response in the model's context."""


def messages_of(prompt: str | list[Message]) -> list[Message]:
    """A prompt as chat messages: its own, or the text as one user turn."""
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def render(tokenizer: Any, prompt: str | list[Message], apply_chat_template: bool) -> str:
    """The text a prompt is tokenized from, in training, evaluation and everywhere else alike: chat
    messages through the chat template, each turn with its role (a list has no other text form, so with or
    without --apply-chat-template; a last assistant turn is continued, not closed); text as is, or as one
    user turn with --apply-chat-template."""
    if isinstance(prompt, str) and not apply_chat_template:
        return prompt
    messages = messages_of(prompt)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the prompt is chat messages (or --apply-chat-template is on) and the tokenizer has no chat "
            "template: use a chat model's tokenizer, or give the prompts as text without --apply-chat-template"
        )
    prefill = messages[-1]["role"] == "assistant"
    text: str = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill
    )
    return text


class Prompts:
    """The rollout's prompts: ``iterator`` (its position is the data state), the encodings, the skips
    (``skipped_rows`` at load, ``bad_media`` while drawing, counted in the shared ``stats``) and the rows
    each step put (``prompt_log``); where each step began is in the rollout journal."""

    def __init__(
        self, cfg: RelaxConfig, tokenizer: Any, model_path: str, prompt_path: str, stats: dict[str, Any]
    ):
        self.cfg, self.tokenizer, self.stats = cfg, tokenizer, stats
        ds = load_prompts(
            prompt_path,
            cfg.data.input_key,
            cfg.data.label_key,
            cfg.data.metadata_key,
            cfg.data.multimodal_keys,
        )
        self.skipped_rows = ds.skipped
        self.iterator = PromptIterator(
            ds.rows, cfg.rollout.rollout_batch_size, cfg.data.rollout_shuffle, cfg.train.seed
        )
        self._token_cache: dict[str, list[int]] = {}
        self.media_keys: dict[str, str] = cfg.data.multimodal_keys or {}
        """``--multimodal-keys`` (modality → column); {} for a text-only run (``mm`` is None)."""
        self.mm = prompt_media(cfg, tokenizer, model_path) if cfg.data.multimodal_keys else None
        self._mm_cache: dict[str, tuple[list[int], dict[str, Any]]] = {}
        self.bad_media: list[str] = []
        self.context_len = _context_len(model_path)
        self.prompt_log: list[tuple[int, list[str]]] = []
        self.episode_media = (
            (self.mm or episode_media(cfg, tokenizer, model_path)) if cfg.rollout.env_path else None
        )

    # -- the data position ----------------------------------------------------------------------
    def begin(self, step: int) -> dict[str, int]:
        """Step ``step`` begins here: the data position it starts from (journaled by the rollout role)."""
        return self.iterator.state_dict()

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[Message]) -> list[int]:
        key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
        if key not in self._token_cache:
            text = render(self.tokenizer, prompt, self.cfg.data.apply_chat_template)
            self._token_cache[key] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._token_cache[key]

    def encode_mm(self, row: Any) -> tuple[list[int], dict[str, Any] | None]:
        """Prompt ids with media placeholders expanded, and the media tensors (cached per row).

        Bad media raise ``MediaError`` naming the row and file; :meth:`batch` skips and counts the row."""
        if self.mm is None or not row.media:
            if self.mm is not None:
                _check_marked_media(row, self.media_keys)
            return self.encode(row.prompt), None
        if row.row_id not in self._mm_cache:
            text = render(self.tokenizer, row.prompt, self.cfg.data.apply_chat_template)
            keys = tuple(self.media_keys)
            self._mm_cache[row.row_id] = self.mm.encode(text, self.row_media(row), keys, f"row {row.row_id}")
        return self._mm_cache[row.row_id]

    def row_media(self, row: Any) -> dict[str, list]:
        """The row's media (--multimodal-keys columns) by modality, each a list."""
        out: dict[str, list] = {}
        if self.mm is None:
            return out
        for modality, column in self.media_keys.items():
            if column in row.media:
                v = row.media[column]
                out[modality] = list(v) if isinstance(v, list | tuple) else [v]
        return out

    def batch(self) -> tuple[list[Any], list[tuple[list[int], dict[str, Any] | None]]]:
        """The next --rollout-batch-size usable rows and their encodings. A row whose media cannot be read
        is skipped, counted (``bad_media_rows``) and replaced by the next one, as is a prompt the model's
        context cannot hold with a response (``long_prompt_rows``); the run goes on."""
        skip: tuple[type[Exception], ...] = (PromptTooLong,)
        if self.mm is not None:
            from relax_multimodal import MediaError

            skip = (MediaError, PromptTooLong)
        rows: list[Any] = []
        enc: list[tuple[list[int], dict[str, Any] | None]] = []
        budget = 10 * self.cfg.rollout.rollout_batch_size + 10
        while len(rows) < self.cfg.rollout.rollout_batch_size:
            for row in self.iterator.next_batch(self.cfg.rollout.rollout_batch_size - len(rows)):
                try:
                    encoded = self.encode_mm(row)
                    self.check_fits(row, len(encoded[0]))
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

    def check_fits(self, row: Any, prompt_tokens: int) -> None:
        """A prompt that leaves no room for a whole response in the model's context is skipped and counted
        (a 100k-character prompt was OOM-killed without a message)."""
        need = prompt_tokens + self.cfg.rollout.rollout_max_response_len
        if self.context_len is not None and need > self.context_len:
            raise PromptTooLong(
                f"row {row.row_id}: {prompt_tokens} prompt tokens + --rollout-max-response-len "
                f"{self.cfg.rollout.rollout_max_response_len} exceed the model's context of {self.context_len} "
                "tokens: skipped (shorten it, or filter long prompts out of the dataset)"
            )


# -- media ------------------------------------------------------------------------------------------
def _check_marked_media(row: Any, keys: dict[str, str]) -> None:
    """A row whose prompt marks media (``<image>``) of a modality the run reads, with that column empty: the
    marker would train as plain text. ``MediaError`` (the row is skipped and counted as bad media)."""
    from relax_multimodal import MediaError

    for modality, column in keys.items():
        if f"<{modality}>" in prompt_text(row.prompt):
            raise MediaError(
                "missing",
                f"the prompt marks <{modality}> but the row's {column!r} column is empty",
                sample=f"row {row.row_id}",
                key=column,
                modality=modality,
            )


def prompt_media(cfg: RelaxConfig, tokenizer: Any, model_path: str) -> Any:
    """--multimodal-keys: the encoder of prompts with media (``media_prompts.EpisodeMedia``, one for both
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
    from relax_rollout.media_prompts import EpisodeMedia

    return EpisodeMedia(family, tokenizer, cfg.data.multimodal_options)


def episode_media(cfg: RelaxConfig, tokenizer: Any, model_path: str) -> Any:
    """Multi-turn on a Qwen-VL/Omni model: what expands the media of prompts and observations (None for a
    text-only model, or without relax-multimodal: an observation with media then ends its episode)."""
    import importlib.util

    from relax_core.models import mm_family
    from relax_rollout.media_prompts import EpisodeMedia

    try:
        family = mm_family(model_path)
    except (OSError, ValueError):
        return None
    if family is None or importlib.util.find_spec("relax_multimodal") is None:
        return None
    return EpisodeMedia(family, tokenizer, cfg.data.multimodal_options)


def _context_len(model_path: str) -> int | None:
    """The context of the model at ``model_path``, if its config says."""
    from transformers import AutoConfig

    from relax_core.models import context_length

    try:
        return context_length(AutoConfig.from_pretrained(model_path))
    except (OSError, ValueError):  # (a model the engine serves by another name)
        return None
