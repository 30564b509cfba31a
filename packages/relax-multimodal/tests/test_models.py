"""Our tensors and expanded token ids go through tiny random-weight Qwen models built from config.

The HF models check that the number of placeholder tokens equals the number of encoder features (and
compute M-RoPE positions from the grids), so a forward pass with finite logits shows that pads,
grids and features line up for each family and modality. Marked slow: importing the model code costs
seconds.
"""

import pytest
from mm_media import ToyTokenizer, ffmpeg_or_skip, write_image, write_tone, write_video

from relax_multimodal import MultimodalConfig, MultimodalProcessor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = dict(
    vocab_size=1300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def _ids(tok, names):
    return {n: tok.convert_tokens_to_ids(n) for n in names}


def qwen2_5_vl(tok):
    ids = _ids(tok, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>"])
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 4]}),
        vision_config=dict(VISION, fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def qwen3_vl(tok):
    ids = _ids(tok, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            TEXT,
            head_dim=16,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        vision_config=dict(VISION, deepstack_visual_indexes=[0], num_position_embeddings=64),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return transformers.Qwen3VLForConditionalGeneration(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tiny_vl_forward_accepts_our_inputs(tmp_path, family):
    ffmpeg_or_skip()
    tok = ToyTokenizer()
    model = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}[family](tok).eval()
    cfg = MultimodalConfig(
        model=family, multimodal_keys={"image": "i", "video": "v"}, video_max_pixels=64 * 32 * 32
    )
    proc = MultimodalProcessor(cfg, tok)
    row = {
        "prompt": "<image> then <video>?",
        "i": write_image(tmp_path / "a.png", size=(90, 60)),
        "v": write_video(tmp_path / "v.mp4", n_frames=20, fps=10.0),
    }
    s = proc.process(row)
    tensors = s.tensors(as_torch=True)
    if family == "qwen3_vl":
        tensors.pop("second_per_grid_ts")  # Qwen3-VL takes time from the <t seconds> text instead
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([s.input_ids]),
            mm_token_type_ids=torch.tensor([s.mm_token_type_ids]),
            **tensors,
        )
    assert sum(t > 0 for t in s.mm_token_type_ids) == sum(s.num_tokens().values())
    assert out.logits.shape == (1, len(s.input_ids), 1300) and torch.isfinite(out.logits).all()


def qwen2_5_omni(tok):
    names = ["<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>", "<|vision_bos|>", "<|audio_bos|>", "<|audio_eos|>"]
    ids = _ids(tok, names)
    cfg = transformers.Qwen2_5OmniThinkerConfig(
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=64,
        ),
        vision_config=dict(VISION, fullatt_block_indexes=[0]),
        text_config=dict(TEXT, rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 4]}),
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_token_index=ids["<|AUDIO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
    )
    return transformers.Qwen2_5OmniThinkerForConditionalGeneration(cfg)


@pytest.mark.slow
def test_tiny_omni_thinker_forward_accepts_audio_and_image(tmp_path):
    tok = ToyTokenizer()
    model = qwen2_5_omni(tok).eval()
    cfg = MultimodalConfig(model="qwen2_5_omni", multimodal_keys={"image": "i", "audio": "a"})
    row = {
        "prompt": "<audio> and <image>?",
        "i": write_image(tmp_path / "a.png", size=(60, 60)),
        "a": write_tone(tmp_path / "t.wav", seconds=1.3),
    }
    s = MultimodalProcessor(cfg, tok).process(row)
    tensors = s.tensors(as_torch=True)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([s.input_ids]),
            mm_token_type_ids=torch.tensor([s.mm_token_type_ids]),
            **tensors,
        )
    assert out.logits.shape[:2] == (1, len(s.input_ids)) and torch.isfinite(out.logits).all()
