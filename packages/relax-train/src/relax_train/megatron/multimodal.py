"""Qwen3-VL on the megatron backend: HF's vision tower in front of megatron-core's text decoder.

Why this split: the vision tower is a small part of the model (about 0.4B of Qwen3-VL-4B's parameters)
and runs once per micro-batch before the decoder, so it stays the HF module, replicated on every rank
(each tensor / context-parallel rank encodes the micro-batch's media itself); the decoder, where the
parameters and the time are, is megatron's ``GPTModel`` with the same TP / SP / CP / EP and weight
converter as the Qwen3 text models. What Qwen3-VL adds to a Qwen3 decoder, and where it goes here:

* media features replace the embeddings of the placeholder tokens: the input embeddings are computed
  here (``decoder_input``), on the full rows, then cut to this rank's chunks (CP) and sequence shard (SP);
* interleaved M-RoPE: three position ids per token (time, height, width; HF's ``get_rope_index``) and
  rotary frequencies drawn from them in turn (:class:`InterleavedMRope`, in place of megatron's M-RoPE,
  which splits the frequencies into contiguous sections as Qwen2-VL does);
* DeepStack: features of early vision layers are added to the hidden states after the first decoder
  layers, at the media positions (forward hooks on those layers).

Gradients: the vision tower's parameters are replicated, so :meth:`MegatronBackend._clip_and_step`
treats them like the norms: summed over CP ranks (each back-propagates its own tokens), averaged over
data-parallel ranks, counted once in the gradient norm. Not yet: pipeline parallelism (the tower and the
DeepStack layers would all have to sit on the first stage), Qwen3-VL-MoE and Qwen3-Omni (their expert
layout and audio tower).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

FAMILIES = ("qwen3_vl",)
"""HF ``model_type`` of the multimodal models this module puts on megatron."""
TEXT_PREFIX = "model.language_model."
"""Where the HF checkpoint keeps the text decoder (the converter reads Qwen3's ``model.`` names)."""
VISUAL_PREFIX = "model.visual."
VISUAL = "visual."
"""The vision tower's name inside the megatron model (a submodule of the ``GPTModel``)."""


def is_multimodal(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") in FAMILIES


def check_supported(hf_config: Any, model_path: str, pipeline_size: int) -> None:
    kind = getattr(hf_config, "model_type", "")
    if kind not in FAMILIES and hasattr(hf_config, "vision_config"):
        raise ValueError(
            f"{model_path}: {kind!r} models are not on the megatron backend yet (it covers Qwen3, "
            f"Qwen3-MoE and Qwen3-VL); use --train-backend torch"
        )
    if kind in FAMILIES and pipeline_size > 1:
        raise ValueError(
            f"{model_path}: Qwen3-VL on the megatron backend needs --pipeline-model-parallel-size 1 (the "
            "vision tower and the DeepStack layers would have to sit on the first stage); use tensor, "
            "context or data parallelism"
        )


def to_text_names(hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """HF Qwen3-VL weights -> (the decoder's in Qwen3 names, the vision tower's under its module names)."""
    text, visual = {}, {}
    for k, v in hf.items():
        if k.startswith(VISUAL_PREFIX):
            visual[VISUAL + k[len(VISUAL_PREFIX) :]] = v
        elif k.startswith(TEXT_PREFIX):
            text["model." + k[len(TEXT_PREFIX) :]] = v
        else:
            text[k] = v
    return text, visual


def to_hf_names(text: dict[str, torch.Tensor], visual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_text_names`."""
    out = {(TEXT_PREFIX + k[len("model.") :] if k.startswith("model.") else k): v for k, v in text.items()}
    out.update({VISUAL_PREFIX + k[len(VISUAL) :]: v for k, v in visual.items()})
    return out


def mrope_section(text_config: Any) -> list[int]:
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    section = params.get("mrope_section")
    if not section:
        raise ValueError("Qwen3-VL text config without rope_parameters.mrope_section: not a Qwen3-VL checkpoint?")
    return [int(s) for s in section]


class InterleavedMRope(torch.nn.Module):
    """Qwen3-VL's rotary angles in megatron's format ([S, B, 1, head_dim], rotate-half layout).

    Frequency ``j`` of the head turns with the time position when ``j % 3 == 0``, with the height when
    ``j % 3 == 1`` and the width when ``j % 3 == 2``, up to ``3 * section[axis]``; the rest with time.
    Called by ``GPTModel`` as megatron's own M-RoPE module is: ``(position_ids [3, B, S], section)``."""

    def __init__(self, head_dim: int, theta: float, section: list[int]) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for a in (1, 2):
            axis[a : 3 * section[a] : 3] = a
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, position_ids: torch.Tensor, section: Any = None, cp_group: Any = None) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # [3, B, S, D/2]
        pick = self.axis.to(position_ids.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
        freqs = freqs.gather(0, pick)[0]  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.transpose(0, 1)[:, :, None, :].contiguous()


class VisionFront:
    """Builds a micro-batch's decoder inputs for a Qwen3-VL megatron model: embeddings with the media
    features in place, 3-D positions and the DeepStack additions (set on the hooked layers)."""

    def __init__(self, hf_config: Any, model: torch.nn.Module, tp: int) -> None:
        from transformers import AutoModel

        self.hf_config, self.model, self.tp = hf_config, model, tp
        vision = hf_config.vision_config
        self.merge = int(vision.spatial_merge_size)
        self.image_id, self.video_id = int(hf_config.image_token_id), int(hf_config.video_token_id)
        model.visual = AutoModel.from_config(vision)  # a submodule: optimizer, offload, checkpoints see it
        model.visual.float()
        text = hf_config.get_text_config()
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        theta = float((getattr(text, "rope_parameters", None) or {}).get("rope_theta") or text.rope_theta)
        model.rotary_pos_emb = InterleavedMRope(head_dim, theta, mrope_section(text))
        self.n_deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or [])
        self.additions: list[torch.Tensor] | None = None
        for i in range(self.n_deepstack):
            model.decoder.layers[i].register_forward_hook(self._deepstack_hook(i))

    # -- pieces --------------------------------------------------------------------------------------
    def _deepstack_hook(self, i: int):
        def hook(module, args, output):
            if self.additions is None:
                return output
            hidden, *rest = output
            return (hidden + self.additions[i].to(hidden.dtype), *rest)

        return hook

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, W] token ids -> [B, W, H] word embeddings, whole on every TP rank (the vocab-parallel table's
        rows this rank holds, summed over the TP group)."""
        table = self.model.embedding.word_embeddings
        if self.tp == 1:
            return F.embedding(ids, table.weight)
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        lo, hi = table.vocab_start_index, table.vocab_end_index
        outside = (ids < lo) | (ids >= hi)
        local = F.embedding((ids - lo).masked_fill(outside, 0), table.weight)
        return reduce_from_tensor_model_parallel_region(local.masked_fill(outside[..., None], 0.0))

    def _encode(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The vision tower on some images or video frames: merged features [N, H] and DeepStack's."""
        visual = self.model.visual
        out = visual(pixels.to(next(visual.parameters()).dtype), grid_thw=grid)
        if isinstance(out, tuple):  # transformers 4.x: (features, deepstack features)
            return out[0], list(out[1])
        return out.pooler_output, list(out.deepstack_features)

    def positions(self, ids: torch.Tensor, types: torch.Tensor, lengths: list[int], media: dict) -> torch.Tensor:
        """[3, B, W] M-RoPE position ids (HF's ``Qwen3VLModel.get_rope_index`` on right-padded rows)."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        shim = object.__new__(Qwen3VLModel)  # get_rope_index reads only self.config
        shim.__dict__["config"] = self.hf_config
        kwargs = dict(
            mm_token_type_ids=types,
            image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"),
            attention_mask=mask,
        )
        accepted = inspect.signature(Qwen3VLModel.get_rope_index).parameters
        pos, _ = shim.get_rope_index(ids, **{k: v for k, v in kwargs.items() if k in accepted})
        return pos

    def inputs(
        self, ids: torch.Tensor, media: dict[str, torch.Tensor], types: torch.Tensor, lengths: list[int], dev
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Full rows [B, W] -> (embeddings [B, W, H], positions [3, B, W], DeepStack additions, each
        [B, W, H] with zeros outside the media positions)."""
        ids = ids.to(dev)
        emb = self._embed(ids)
        pos = self.positions(ids.cpu(), types, lengths, media).to(dev)
        additions = [torch.zeros_like(emb) for _ in range(self.n_deepstack)]
        for pixels, grid, token in (
            ("pixel_values", "image_grid_thw", self.image_id),
            ("pixel_values_videos", "video_grid_thw", self.video_id),
        ):
            if media.get(pixels) is None:
                continue
            feats, deep = self._encode(media[pixels].to(dev), media[grid].to(dev))
            where = (ids == token)[..., None]
            if int(where.sum()) != feats.shape[0]:
                raise ValueError(
                    f"{int(where.sum())} {pixels.replace('pixel_values', 'media')} placeholder tokens but "
                    f"{feats.shape[0]} features: the sample's tokens and its {grid} disagree"
                )
            emb = emb.masked_scatter(where, feats.to(emb.dtype))
            additions = [a.masked_scatter(where, d.to(a.dtype)) for a, d in zip(additions, deep)]
        return emb, pos, additions

    def decoder_input(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """[B, S, H] -> megatron's [S, B, H] (this TP rank's sequence shard under SP)."""
        x = x.transpose(0, 1).contiguous()
        if sequence_parallel and self.tp > 1:
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            x = scatter_to_sequence_parallel_region(x)
        return x
