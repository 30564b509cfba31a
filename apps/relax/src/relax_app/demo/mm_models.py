"""Tiny random-weight Qwen vision / omni models built from config (no download), for the demo and tests.

Why real architectures and not a toy net: the multimodal path (placeholder pads expanded by
``relax_multimodal``, patch tensors, M-RoPE positions computed from grids, audio chunked through the
Whisper-style encoder) only fails in the model code itself: a pad count one off, a missing
``mm_token_type_ids``, a renamed kwarg. A tiny ``Qwen2_5_VLForConditionalGeneration``,
``Qwen3VLForConditionalGeneration`` or Qwen3-Omni *thinker* runs exactly those code paths on CPU in
a fraction of a second; only the sizes differ from ``Qwen/Qwen2.5-VL-7B-Instruct`` and friends.

The tokenizer is the locally trained one (``tokenizer.train_tokenizer``) plus the family's media
tokens (``extend_tokenizer``); every token id in the model config comes from it, so the checkpoint
directory is self-consistent and reloads with ``load_mm_model``.

What each family's ``forward`` takes differs from :meth:`relax_multimodal.ProcessedSample.tensors`
in a few names; :func:`forward_kwargs` maps one to the other:

* ``qwen2_5_vl``: the tensors as they are, plus ``mm_token_type_ids`` (M-RoPE needs it).
* ``qwen3_vl``: without ``second_per_grid_ts`` (time comes from the ``<t seconds>`` text), plus
  ``mm_token_type_ids``.
* ``qwen3_omni`` (thinker): ``second_per_grid_ts`` is named ``video_second_per_grid``; audio goes in as
  ``input_features`` + ``feature_attention_mask``; it takes no ``mm_token_type_ids`` and finds media
  by their token ids instead, and it computes M-RoPE positions only when ``attention_mask`` is
  passed (without it every token gets plain 1-D positions, silently), so always pass it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_omni")

ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_omni": "Qwen3OmniMoeThinkerForConditionalGeneration",
}


class _VisionIds(TypedDict):
    """The vision token ids every family's config takes (typed: each is checked against its field)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def _spec(family: str):
    from relax_multimodal.specs import MODELS

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {list(FAMILIES)}")
    return MODELS[family]


def media_tokens(family: str) -> dict[str, str]:
    """The family's media special tokens by role (audio ones only for families that take audio)."""
    s = _spec(family)
    out = {
        "image": s.image_token,
        "video": s.video_token,
        "vision_start": s.vision_start,
        "vision_end": s.vision_end,
    }
    if s.audio != "none":
        out.update(audio=s.audio_token, audio_start=s.audio_start, audio_end=s.audio_end)
    return out


def extend_tokenizer(tokenizer, family: str):
    """Add ``family``'s media tokens as extra special tokens (never split, skipped on decode); idempotent.

    Returns the same tokenizer. Tokens already in the vocabulary keep their ids, so calling it for
    ``qwen3_vl`` and then ``qwen3_omni`` gives both families the same vision ids.
    """
    names = list(media_tokens(family).values())
    have = set(tokenizer.get_vocab())
    present = set(map(str, tokenizer.extra_special_tokens))
    missing = [t for t in names if t not in have or t not in present]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    return tokenizer


def token_ids(tokenizer, family: str) -> dict[str, int]:
    """Ids of the family's media tokens; an error names the ones the tokenizer lacks."""
    out, missing = {}, []
    for role, tok in media_tokens(family).items():
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or tid == tokenizer.unk_token_id or tok not in tokenizer.get_vocab():
            missing.append(tok)
        out[role] = tid
    if missing:
        raise ValueError(f"tokenizer lacks {missing}; call extend_tokenizer(tokenizer, {family!r}) first")
    return out


def build_tiny_mm_model(
    family: str,
    tokenizer,
    out_dir: str | Path | None = None,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vision_hidden_size: int = 32,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
):
    """A freshly initialised float32 model of ``family`` sized for ``tokenizer`` (must be extended).

    ``qwen2_5_vl`` → ``Qwen2_5_VLForConditionalGeneration``, ``qwen3_vl`` →
    ``Qwen3VLForConditionalGeneration``, ``qwen3_omni`` → ``Qwen3OmniMoeThinkerForConditionalGeneration``
    (the thinker: audio + vision encoders and an MoE text model with ``num_experts`` experts, top
    ``num_experts_per_tok``; no talker, it only makes text). Patch size, merge size and mel bins are
    the real ones, so ``relax_multimodal``'s tensors fit unchanged. When ``out_dir`` is given, save
    model (safetensors) and tokenizer there; :func:`load_mm_model` reloads it.
    """
    import torch
    import transformers

    ids = token_ids(tokenizer, family)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    head_dim = hidden_size // num_heads
    # M-RoPE splits the head_dim/2 rotary frequencies into (t, h, w) sections
    half = head_dim // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16 → [2, 3, 3]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        pad_token_id=pad_id,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
    )
    vision = dict(
        depth=1,
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_heads=2,
        out_hidden_size=hidden_size,
    )
    vision_ids = _VisionIds(
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )
    cls: type[PreTrainedModel]
    if family == "qwen3_omni":
        cls = transformers.Qwen3OmniMoeThinkerForConditionalGeneration
        config = _omni_thinker_config(
            tokenizer, ids, text, vision, vision_ids, section, num_experts, num_experts_per_tok
        )
    else:
        config, cls = _vl_config(family, text, vision, vision_ids, section, head_dim)
    torch.manual_seed(seed)
    # transformers: PreTrainedModel.to is @wraps(nn.Module.to), and typeshed's _Wrapped is no descriptor:
    # mypy does not bind it as a method and takes the dtype for `self`
    model = cls(config).to(torch.float32).eval()  # type: ignore[arg-type]
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = pad_id
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
    return model


def _vl_config(
    family: str, text: dict, vision: dict, vision_ids: _VisionIds, section: list[int], head_dim: int
) -> tuple[PreTrainedConfig, type[PreTrainedModel]]:
    """The config and model class of a Qwen-VL ``family`` from the shared text and vision settings."""
    import transformers

    config: PreTrainedConfig
    cls: type[PreTrainedModel]
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(
                text,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
            ),
            # window attention on the one block would need images ≥ 4 merged patches a side
            vision_config=dict(vision, fullatt_block_indexes=[0], tokens_per_second=2),
            **vision_ids,
        )
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl":
        config = transformers.Qwen3VLConfig(
            text_config=dict(
                text,
                head_dim=head_dim,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 5e6,
                    "mrope_section": section,
                    "mrope_interleaved": True,
                },
            ),
            vision_config=dict(vision, deepstack_visual_indexes=[0], num_position_embeddings=64),
            **vision_ids,
        )
        cls = transformers.Qwen3VLForConditionalGeneration
    else:  # pragma: no cover - token_ids already rejected it
        raise ValueError(family)
    return config, cls


def _omni_thinker_config(
    tokenizer,
    ids: dict,
    text: dict,
    vision: dict,
    vision_ids: _VisionIds,
    section: list[int],
    num_experts: int,
    num_experts_per_tok: int,
) -> PreTrainedConfig:
    """A Qwen3-Omni thinker's config: audio and vision encoders, an MoE text model."""
    import transformers

    # type: ignore: transformers' dataclass_transform lists the fields only, though PreTrainedConfig's
    # @strict(accept_kwargs=True) takes other keywords (__post_init__ sets them as attributes): the
    # three extra token ids below
    return transformers.Qwen3OmniMoeThinkerConfig(  # type: ignore[call-arg]
        audio_config=dict(
            num_mel_bins=_spec("qwen3_omni").n_mels,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=2 * vision["hidden_size"],
            d_model=vision["hidden_size"],
            downsample_hidden_size=16,
            output_dim=text["hidden_size"],
        ),
        vision_config=dict(vision, deepstack_visual_indexes=[0], num_position_embeddings=64),
        text_config=dict(
            text,
            moe_intermediate_size=text["hidden_size"] // 2,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": section,
                "interleaved": True,
                "mrope_interleaved": False,
            },
        ),
        audio_token_id=ids["audio"],
        audio_start_token_id=ids["audio_start"],
        # the thinker never reads user_token_id (the talker finds user turns with it)
        user_token_id=_single_token_id(tokenizer, "user", fallback=text["pad_token_id"]),
        position_id_per_seconds=13,  # the real checkpoint's value (transformers' default 25 is Qwen2.5-Omni's)
        image_token_id=vision_ids["image_token_id"],
        video_token_id=vision_ids["video_token_id"],
        # not fields of the thinker config, but get_rope_index reads vision_start_token_id (and the
        # real checkpoint's thinker_config carries all three)
        audio_end_token_id=ids["audio_end"],
        vision_start_token_id=vision_ids["vision_start_token_id"],
        vision_end_token_id=vision_ids["vision_end_token_id"],
    )


def _single_token_id(tokenizer, text: str, fallback: int) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else int(fallback)


def load_mm_model(path: str | Path, dtype: str = "float32"):
    """Reload a checkpoint saved by :func:`build_tiny_mm_model` (the class named in ``config.json``), in
    eval mode: the same loader the rollout engine and the trainer use."""
    from relax_core.models import load_model

    return load_model(path, dtype).eval()


def forward_kwargs(family: str, processed_tensors: dict, mm_token_type_ids=None) -> dict:
    """Map ``ProcessedSample.tensors()`` / ``collate()`` names to what ``family``'s ``forward`` takes
    (``relax_core.models.adapt_media``, as the rollout worker does).

    Pass ``mm_token_type_ids`` (batch, seq) and it is kept for the families that use it (the VL
    models need it for M-RoPE) and dropped for the Omni thinker (which takes none). ``input_ids`` and
    ``attention_mask`` are the caller's; the Omni thinker needs ``attention_mask`` for M-RoPE.
    """
    from relax_core.models import adapt_media

    _spec(family)
    out = adapt_media(family, processed_tensors)
    if mm_token_type_ids is not None and family != "qwen3_omni":
        out["mm_token_type_ids"] = mm_token_type_ids
    return out
