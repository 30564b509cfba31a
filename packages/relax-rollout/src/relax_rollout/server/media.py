"""Images in chat calls (OpenAI's ``image_url`` content parts), for a Qwen-VL / Qwen-Omni model, so an agent
can show the policy a screenshot.

Why through relax-multimodal, as the rollout worker does (``media_prompts.EpisodeMedia``): the number of
placeholder tokens must equal the features the vision encoder makes, and the trainer later recomputes the
same sequence; one code path decides both. The messages are rendered by the chat template with
relax-multimodal's ``<image>`` marker where each part was; the processor turns each marker into the model's
vision block, expanded to the image's exact token count, and makes the media tensors the engine generates
with (``mm``).

Accepted: ``data:`` URLs with a base64 payload (``data:image/png;base64,...``: what the official client
sends for a local image), any format pillow decodes. Refused with a 400 naming the part: http(s) URLs (the
server does not reach the network for a client) and file paths (a client must not make the server read its
files), and an image that cannot be decoded.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import threading
from typing import Any

from relax_rollout.engines.base import RolloutEngine
from relax_rollout.server.protocol import BadRequest, ImagePart

logger = logging.getLogger(__name__)

ACCEPTED = "send the image inline as a data: URL ('data:image/png;base64,...')"


class ChatMedia:
    """Encodes a chat prompt with images for one model family (relax-multimodal's default image budget)."""

    def __init__(self, family: str, tokenizer: Any) -> None:
        from relax_rollout.media_prompts import EpisodeMedia

        self.family, self.tokenizer = family, tokenizer
        self._media = EpisodeMedia(family, tokenizer)
        self._lock = threading.Lock()  # the processor's content cache is not thread-safe

    def prompt(
        self, messages: list[dict], images: list[ImagePart], template_kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """(prompt ids with each image's placeholders expanded, the engine's ``mm`` for it);
        ``template_kwargs``: more arguments of the chat template (``tools``, ``chat_template_kwargs``)."""
        from relax_multimodal import MediaError

        raw = [{"bytes": _decode(p), "path": p.where} for p in images]  # "path" names the part in errors
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
        try:
            with self._lock:
                return self._media.encode(text, {"image": raw}, index="request")
        except MediaError as e:
            known = {p.where for p in images}
            where = e.source if e.source in known else "messages"
            raise BadRequest(where, f"cannot use the image: {e.detail} [{e.reason}]") from None


def _decode(part: ImagePart) -> bytes:
    """The bytes of a ``data:`` URL; a 400 naming the part for anything else."""
    from relax_multimodal import MediaError
    from relax_multimodal.sources import resolve

    url = part.url
    if not url.startswith("data:"):
        remote = url.startswith(("http://", "https://"))
        kind = "http(s) URLs are not fetched" if remote else "only data: URLs are read"
        raise BadRequest(f"{part.where}.image_url.url", f"{kind} ({url[:40]!r}): {ACCEPTED}")
    try:
        return resolve(url).read()
    except MediaError as e:
        raise BadRequest(f"{part.where}.image_url.url", f"{e.detail} [{e.reason}]: {ACCEPTED}") from None


def build(
    engine: RolloutEngine, tokenizer: Any, model_path: str, config: Any
) -> tuple[ChatMedia | None, str]:
    """What serves images for this model, or (None, why images are refused): a text-only model, an engine
    that takes no media tensors, or relax-multimodal not installed. ``config``: the engine's model config
    (an in-process engine), else the checkpoint's ``config.json`` at ``model_path`` is read."""
    from relax_core.models import MM_FAMILIES, mm_family

    family = MM_FAMILIES.get(getattr(config, "model_type", "")) if config is not None else None
    if family is None and config is None and model_path:
        try:
            family = mm_family(model_path)
        except (OSError, ValueError):
            family = None
    if family is None:
        return None, "the served model is text-only: it takes no images"
    try:
        takes_mm = "mm" in inspect.signature(engine.generate).parameters
    except (AttributeError, TypeError, ValueError):
        takes_mm = False
    if not takes_mm:
        engine_name = type(engine).__name__
        return None, f"this server's engine ({engine_name}) takes no media: the served model takes no images"
    if importlib.util.find_spec("relax_multimodal") is None:
        return None, "images need relax-multimodal on the server: pip install 'relax-rollout[multimodal]'"
    return ChatMedia(family, tokenizer), ""
