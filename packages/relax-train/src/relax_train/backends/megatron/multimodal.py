"""Qwen3-VL and Qwen3-Omni (thinker) on the megatron backend: HF's media encoders in front of
megatron-core's text decoder.

Why this split: the vision and audio towers are a small part of the model (about 0.4B of Qwen3-VL-4B's
parameters, 1B of Qwen3-Omni-30B-A3B's) and run once per micro-batch before the decoder, so they stay the
HF modules, replicated on every rank (each tensor / context-parallel rank encodes the micro-batch's media
itself); the decoder, where the parameters and the time are, is megatron's ``GPTModel`` with the same TP /
SP / CP / EP and weight converter as the Qwen3 and Qwen3-MoE text models. What these models add to a Qwen3
decoder, and where it goes here:

* media features (images, video frames, audio) replace the embeddings of the placeholder tokens: the
  input embeddings are computed here (``decoder_input``), on the full rows, then cut to this rank's
  chunks (CP) and sequence shard (SP);
* interleaved M-RoPE: three position ids per token (time, height, width; HF's ``get_rope_index``) and
  rotary frequencies drawn from them in turn (:class:`InterleavedMRope`, in place of megatron's M-RoPE,
  which splits the frequencies into contiguous sections as Qwen2-VL does);
* DeepStack: features of early vision layers are added to the hidden states after the first decoder
  layers, at the media positions (forward hooks on those layers).

Gradients: the vision tower's parameters are replicated, so :func:`~relax_train.backends.megatron.training.clip_and_step`
treats them like the norms: summed over CP ranks (each back-propagates its own tokens) and over
data-parallel replicas (each its micro-batches; one whose rows have no media adds zeros), counted once in
the gradient norm.

Pipeline parallelism: the towers and the DeepStack hooks live on the first stage (whose first layers must
include every DeepStack layer: true of the real models, 3 of 36 or 48 layers); every stage computes the
M-RoPE positions (its rotary angles). Not yet: Qwen3-VL-MoE (its fused expert layout), Qwen3-Omni's talker
(it only speaks; RL trains the thinker).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@dataclass(frozen=True)
class Family:
    text_prefix: str
    """Where the HF checkpoint keeps the text decoder (the converter reads Qwen3's ``model.`` names)."""
    towers: dict[str, str]
    """Media encoders: their module name on the megatron model (a submodule of the ``GPTModel``) -> their
    prefix in the HF checkpoint."""


FAMILIES = {
    "qwen3_vl": Family("model.language_model.", {"visual": "model.visual."}),
    "qwen3_omni_moe_thinker": Family("model.", {"visual": "visual.", "audio_tower": "audio_tower."}),
}
"""HF ``model_type`` of the multimodal models this module puts on megatron."""


def family(hf_config: Any) -> Family | None:
    return FAMILIES.get(getattr(hf_config, "model_type", ""))


def is_multimodal(hf_config: Any) -> bool:
    return family(hf_config) is not None


TOWERS = {t for f in FAMILIES.values() for t in f.towers}


def is_tower(name: str) -> bool:
    """Whether a megatron-model parameter name belongs to a media encoder."""
    return name.split(".", 1)[0] in TOWERS


def check_supported(hf_config: Any, model_path: str) -> None:
    kind = getattr(hf_config, "model_type", "")
    if kind == "qwen3_omni_moe":
        raise ValueError(
            f"{model_path}: a whole Qwen3-Omni checkpoint (thinker + talker); RL trains the thinker: save "
            "model.thinker on its own (save_pretrained) and point --hf-checkpoint there"
        )
    if kind not in FAMILIES and hasattr(hf_config, "vision_config"):
        raise ValueError(
            f"{model_path}: {kind!r} models are not on the megatron backend yet (it covers Qwen3, "
            f"Qwen3-MoE, Qwen3-VL and Qwen3-Omni's thinker); use --train-backend torch"
        )


def to_text_names(
    hf: dict[str, torch.Tensor], fam: Family
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """HF weights -> (the decoder's in Qwen3 names, the media encoders' under their module names)."""
    text, towers = {}, {}
    for k, v in hf.items():
        tower = next((t for t, prefix in fam.towers.items() if k.startswith(prefix)), None)
        if tower is not None:
            towers[f"{tower}.{k[len(fam.towers[tower]) :]}"] = v
        elif k.startswith(fam.text_prefix):
            text["model." + k[len(fam.text_prefix) :]] = v
        else:
            text[k] = v
    return text, towers


def to_hf_names(
    text: dict[str, torch.Tensor], towers: dict[str, torch.Tensor], fam: Family
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_text_names`."""
    out = {
        (fam.text_prefix + k[len("model.") :] if k.startswith("model.") else k): v for k, v in text.items()
    }
    for k, v in towers.items():
        tower, rest = k.split(".", 1)
        out[fam.towers[tower] + rest] = v
    return out


def mrope_section(text_config: Any) -> list[int]:
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    section = params.get("mrope_section")
    if not section:
        raise ValueError(
            "multimodal text config without rope_parameters.mrope_section: not a Qwen3-VL / Omni checkpoint?"
        )
    return [int(s) for s in section]


class InterleavedMRope(torch.nn.Module):
    """Qwen3-VL's and Qwen3-Omni's rotary angles in megatron's format ([S, B, 1, head_dim], rotate-half layout).

    Frequency ``j`` of the head turns with the time position when ``j % 3 == 0``, with the height when
    ``j % 3 == 1`` and the width when ``j % 3 == 2``, up to ``3 * section[axis]``; the rest with time.
    Called by ``GPTModel`` as megatron's own M-RoPE module is: ``(position_ids [3, B, S], section)``."""

    inv_freq: torch.Tensor
    axis: torch.Tensor

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


def _build_towers(hf_config: Any, fam: Family, model: torch.nn.Module) -> None:
    """The media encoders as HF builds them for this family, attached to the megatron model."""
    if hf_config.model_type == "qwen3_vl":
        from transformers import AutoModel

        model.visual = AutoModel.from_config(hf_config.vision_config)
    else:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni

        model.visual = omni.Qwen3OmniMoeVisionEncoder._from_config(hf_config.vision_config)
        model.audio_tower = omni.Qwen3OmniMoeAudioEncoder._from_config(hf_config.audio_config)
    for name in fam.towers:
        getattr(model, name).float()


class MediaFront:
    """Builds a micro-batch's decoder inputs for a multimodal megatron model: embeddings with the media
    features in place, 3-D positions and the DeepStack additions (set on the hooked layers)."""

    def __init__(self, hf_config: Any, model: GPTModel, tp: int, first_stage: bool = True) -> None:
        self.hf_config, self.model, self.tp = hf_config, model, tp
        fam = family(hf_config)
        if fam is None:
            raise ValueError(f"{hf_config.model_type!r} is none of the multimodal models {sorted(FAMILIES)}")
        self.family = fam
        self.omni = "audio_tower" in self.family.towers
        self.first_stage = first_stage
        vision = hf_config.vision_config
        self.image_id, self.video_id = int(hf_config.image_token_id), int(hf_config.video_token_id)
        self.audio_id = int(hf_config.audio_token_id) if self.omni else None
        text = hf_config.get_text_config()
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        theta = float((getattr(text, "rope_parameters", None) or {}).get("rope_theta") or text.rope_theta)
        model.rotary_pos_emb = InterleavedMRope(head_dim, theta, mrope_section(text))  # (every stage)
        self.n_deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or [])
        self.additions: list[torch.Tensor] | None = None
        if not first_stage:  # later pipeline stages take hidden states; they need only the positions
            return
        if len(model.decoder.layers) < self.n_deepstack:
            raise ValueError(
                f"DeepStack adds vision features after decoder layers 0..{self.n_deepstack - 1}, which must all "
                f"be on the first pipeline stage, but it holds {len(model.decoder.layers)}: use a smaller "
                "--pipeline-model-parallel-size"
            )
        # submodules of the model: the optimizer, offload and checkpoints see them
        _build_towers(hf_config, self.family, model)
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
        rows this rank holds, summed over the TP group). Not the table's own forward: under SP it
        reduce-scatters over the sequence, before the media features could be put in place."""
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

    def positions(
        self, ids: torch.Tensor, types: torch.Tensor, lengths: list[int], media: dict
    ) -> torch.Tensor:
        """[3, B, W] M-RoPE position ids of right-padded rows (HF's ``get_rope_index``, which reads only the
        config from its model: it runs here on a bare instance). As HF gives them: Qwen3-Omni's are floats
        (a video's frames sit ``second_per_grid × position_id_per_seconds`` apart, often fractional, and
        the text after it starts from there), Qwen3-VL's integers."""
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        # (Any: the two models' get_rope_index take other arguments; those it accepts are passed below)
        cls: Any
        if self.omni:
            from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
                Qwen3OmniMoeThinkerForConditionalGeneration as cls,
            )

            audio = media.get("feature_attention_mask")
            kwargs = dict(
                image_grid_thw=media.get("image_grid_thw"),
                video_grid_thw=media.get("video_grid_thw"),
                attention_mask=mask,
                use_audio_in_video=False,
                audio_seqlens=audio.sum(-1) if audio is not None else None,
                second_per_grids=media.get("video_second_per_grid"),
            )
        else:
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as cls

            kwargs = dict(
                mm_token_type_ids=types,
                image_grid_thw=media.get("image_grid_thw"),
                video_grid_thw=media.get("video_grid_thw"),
                attention_mask=mask,
            )
        shim = object.__new__(cls)
        shim.__dict__.update(
            config=self.hf_config, spatial_merge_size=self.hf_config.vision_config.spatial_merge_size
        )
        accepted = inspect.signature(cls.get_rope_index).parameters
        pos, _ = shim.get_rope_index(ids, **{k: v for k, v in kwargs.items() if k in accepted})
        return pos

    def _audio(self, media: dict[str, torch.Tensor], dev) -> torch.Tensor:
        """The audio tower on the micro-batch's clips (padded along time; the mask marks real frames)."""
        feats, mask = media["input_features"].to(dev), media["feature_attention_mask"].to(dev)
        flat = feats.permute(0, 2, 1)[mask.bool()].permute(1, 0)  # [mels, all real frames], as HF does
        tower = self.model.audio_tower
        out = tower(flat.to(next(tower.parameters()).dtype), feature_lens=mask.sum(-1))
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def inputs(
        self, ids: torch.Tensor, media: dict[str, torch.Tensor], types: torch.Tensor, lengths: list[int], dev
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Full rows [B, W] -> (embeddings [B, W, H], positions [3, B, W], DeepStack additions, each
        [B, W, H] with zeros outside the media positions)."""
        ids = ids.to(dev)
        emb = self._embed(ids)
        pos = self.positions(ids.cpu(), types, lengths, media).to(dev)
        additions = [torch.zeros_like(emb) for _ in range(self.n_deepstack)]
        if self.audio_id is not None and media.get("input_features") is not None:  # (Omni's alone)
            emb = self._scatter(emb, ids, self.audio_id, self._audio(media, dev), "input_features")
        for pixels, grid, token in (
            ("pixel_values", "image_grid_thw", self.image_id),
            ("pixel_values_videos", "video_grid_thw", self.video_id),
        ):
            if media.get(pixels) is None:
                continue
            feats, deep = self._encode(media[pixels].to(dev), media[grid].to(dev))
            emb = self._scatter(emb, ids, token, feats, grid)
            additions = [self._scatter(a, ids, token, d, grid) for a, d in zip(additions, deep)]
        return emb, pos, additions

    @staticmethod
    def _scatter(
        x: torch.Tensor, ids: torch.Tensor, token: int, feats: torch.Tensor, field: str
    ) -> torch.Tensor:
        """``x`` [B, W, H] with the rows of ``feats`` at the positions of ``token``, in order."""
        where = (ids == token)[..., None]
        if int(where.sum()) != feats.shape[0]:
            raise ValueError(
                f"{int(where.sum())} placeholder tokens (id {token}) but {feats.shape[0]} encoded features: "
                f"the micro-batch's tokens and its {field} disagree (was the sample processed for another model?)"
            )
        return x.masked_scatter(where, feats.to(x.dtype))

    def decoder_input(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """[B, S, H] -> megatron's [S, B, H] (this TP rank's sequence shard under SP)."""
        x = x.transpose(0, 1).contiguous()
        if sequence_parallel and self.tp > 1:
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            x = scatter_to_sequence_parallel_region(x)
        return x
