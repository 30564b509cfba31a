"""Qwen3-VL / Qwen3-Omni pieces of the megatron backend that need no process group: the interleaved M-RoPE angles
against HF's, the HF <-> megatron name split, and which models and layouts are refused. The whole model
against the torch backend (and under TP / SP / CP) is in ``test_backend.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from relax_train.backends.megatron import multimodal as mm  # noqa: E402


def _text_config(section=(2, 3, 3)):
    return transformers.Qwen3VLTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        num_hidden_layers=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": list(section),
            "mrope_interleaved": True,
        },
    )


@pytest.mark.parametrize("section", [(2, 3, 3), (4, 2, 2)])
def test_interleaved_mrope_angles_give_hfs_cos_and_sin(section):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = _text_config(section)
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 50, (3, 2, 7), generator=gen)  # distinct t, h, w positions
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)  # [B, S, D]
    ours = mm.InterleavedMRope(16, 5e6, list(section))(pos, list(section))  # [S, B, 1, D]
    assert ours.shape == (7, 2, 1, 16)
    angles = ours[:, :, 0].transpose(0, 1)
    torch.testing.assert_close(angles.cos(), cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(angles.sin(), sin, rtol=0, atol=1e-6)
    # and it is not the contiguous-section M-RoPE of Qwen2-VL (megatron's own)
    chunked = torch.cat([pos[a, ..., None].expand(-1, -1, s) for a, s in enumerate(section)], -1).float()
    inv = 1.0 / (5e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert not torch.allclose(torch.cat([chunked * inv] * 2, -1).cos(), cos, atol=1e-3)


def test_weight_names_split_into_decoder_and_media_encoders_and_back():
    vl = {
        "model.language_model.layers.0.self_attn.q_proj.weight": torch.zeros(1),
        "model.language_model.embed_tokens.weight": torch.zeros(1),
        "model.language_model.norm.weight": torch.zeros(1),
        "lm_head.weight": torch.zeros(1),
        "model.visual.blocks.0.attn.qkv.weight": torch.zeros(1),
        "model.visual.merger.linear_fc1.bias": torch.zeros(1),
    }
    fam = mm.FAMILIES["qwen3_vl"]
    text, towers = mm.to_text_names(vl, fam)
    assert set(text) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    assert set(towers) == {"visual.blocks.0.attn.qkv.weight", "visual.merger.linear_fc1.bias"}
    assert set(mm.to_hf_names(text, towers, fam)) == set(vl)
    # Qwen3-Omni's thinker: the decoder already has Qwen3(-MoE) names; two encoders
    omni = {
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(1),
        "lm_head.weight": torch.zeros(1),
        "visual.patch_embed.proj.weight": torch.zeros(1),
        "audio_tower.conv2d1.weight": torch.zeros(1),
    }
    fam = mm.FAMILIES["qwen3_omni_moe_thinker"]
    text, towers = mm.to_text_names(omni, fam)
    assert set(text) == {"model.layers.0.mlp.experts.0.up_proj.weight", "lm_head.weight"}
    assert set(towers) == {"visual.patch_embed.proj.weight", "audio_tower.conv2d1.weight"}
    assert all(mm.is_tower(n) for n in towers) and not any(mm.is_tower(n) for n in text)
    assert set(mm.to_hf_names(text, towers, fam)) == set(omni)


def test_models_not_on_megatron_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="--train-backend torch"):
        mm.check_supported(transformers.Qwen2_5_VLConfig(), "/m/qwen2.5-vl")
    with pytest.raises(ValueError, match="save model.thinker"):
        mm.check_supported(transformers.Qwen3OmniMoeConfig(), "/m/omni")
    for cfg in (
        transformers.Qwen3VLConfig(),
        transformers.Qwen3OmniMoeThinkerConfig(),
        transformers.Qwen3Config(),
    ):
        mm.check_supported(cfg, "/m/ok")


def test_a_first_pipeline_stage_without_every_deepstack_layer_is_refused():
    """DeepStack's additions are made on the first stage (the vision tower's features do not travel down
    the pipeline): a split that puts a DeepStack layer on a later stage is refused, naming the fix."""
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=2, deepstack_visual_indexes=[0, 1]),
    )
    stage = torch.nn.Module()
    stage.decoder = torch.nn.Module()
    stage.decoder.layers = torch.nn.ModuleList([torch.nn.Identity()])  # one of the two layers
    with pytest.raises(ValueError, match=r"layers 0\.\.1.*smaller --pipeline-model-parallel-size"):
        mm.MediaFront(cfg, stage, tp=1, first_stage=True)
    later = mm.MediaFront(cfg, stage, tp=1, first_stage=False)  # later stages: positions only, no towers
    assert not hasattr(stage, "visual") and isinstance(stage.rotary_pos_emb, mm.InterleavedMRope)
    assert later.first_stage is False


def test_placeholders_and_encoded_features_that_disagree_are_a_clear_error():
    """A row whose placeholder tokens do not match its media (processed for another model, say) is named
    by the field and the token, instead of a shape error deep in the decoder."""
    ids = torch.tensor([[5, 9, 9, 9, 6]])
    x = torch.zeros(1, 5, 4)
    placed = mm.MediaFront._scatter(x, ids, 9, torch.ones(3, 4), "image_grid_thw")
    assert placed[0, 1:4].eq(1).all() and placed[0, [0, 4]].eq(0).all()
    with pytest.raises(
        ValueError, match=r"3 placeholder tokens \(id 9\) but 2 encoded features.*image_grid_thw"
    ):
        mm.MediaFront._scatter(x, ids, 9, torch.ones(2, 4), "image_grid_thw")
