"""Prompts with media: markers in text, media by modality, encoded with relax-multimodal.

Shared by the rollout role (single-turn prompts and multi-turn episodes, whose observations bring media
mid-conversation) and the engine server (chat messages with ``image_url`` parts): the number of placeholder
tokens a medium expands to is the model processor's, so every path that turns a medium into tokens goes
through the same encoder (:class:`EpisodeMedia`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MEDIA_FIELDS = {
    "images": "image",
    "image": "image",
    "videos": "video",
    "video": "video",
    "audio": "audio",
    "audios": "audio",
}
"""Message keys that carry an observation's media, and their modality."""
MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


def split_media(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """The messages without their media fields (markers prepended to a message that has media but none),
    and the media by modality, in message order ({} for text-only messages)."""
    clean: list[dict[str, Any]] = []
    media: dict[str, list] = {}
    for m in messages:
        found: dict[str, list] = {}
        for key, modality in MEDIA_FIELDS.items():
            if m.get(key) is not None:
                v = m[key]
                found.setdefault(modality, []).extend(list(v) if isinstance(v, list | tuple) else [v])
        if not found:
            clean.append(m)
            continue
        content = m["content"]
        head = "".join(MARKERS[k] * len(v) for k, v in found.items() if MARKERS[k] not in content)
        clean.append({**{k: v for k, v in m.items() if k not in MEDIA_FIELDS}, "content": head + content})
        for k, v in found.items():
            media.setdefault(k, []).extend(v)
    return clean, media


class EpisodeMedia:
    """Expands the media markers of an episode's text with relax-multimodal (``MultimodalProcessor``, the
    worker's model family and ``--multimodal-options`` budgets) into ids, the model's media tensors
    (``relax_core.models.adapt_media``) and ``mm_token_type_ids``, as the worker's single-turn path does."""

    def __init__(self, family: str, tokenizer: Any, options: dict[str, Any] | None = None) -> None:
        self.family, self.tokenizer = family, tokenizer
        skip = ("model", "multimodal_keys", "prompt_key")
        self.options = {k: v for k, v in (options or {}).items() if k not in skip}
        self._processors: dict[tuple[str, ...], Any] = {}

    def encode(
        self, text: str, media: dict[str, list], keys: tuple[str, ...] = (), index: Any = None
    ) -> tuple[list[int], dict[str, Any]]:
        """``text`` with ``media`` (by modality) expanded: (ids, tensors + ``mm_token_type_ids``). Markers of
        a modality neither in ``media`` nor in ``keys`` stay plain text. Bad media raise ``MediaError``."""
        from relax_core.models import adapt_media

        modalities = tuple(m for m in MARKERS if m in keys or media.get(m))
        proc = self._processors.get(modalities)
        if proc is None:
            from relax_multimodal import MultimodalConfig, MultimodalProcessor

            cfg = MultimodalConfig(
                model=self.family, multimodal_keys={m: m for m in modalities}, **self.options
            )
            proc = self._processors[modalities] = MultimodalProcessor(cfg, self.tokenizer)
        s = proc.process({"prompt": text, **{m: list(media.get(m) or []) for m in modalities}}, index=index)
        assert s.input_ids is not None, "a processor given a tokenizer encodes the ids"
        tensors = adapt_media(self.family, s.tensors())
        tensors["mm_token_type_ids"] = np.asarray(s.mm_token_type_ids, dtype=np.int64)
        return list(s.input_ids), tensors
