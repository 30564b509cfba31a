"""Tiny Qwen-VL / Qwen3-Omni-thinker models take ``relax_multimodal``'s samples as they come.

The HF models check that image / video pad counts equal the encoder features and build M-RoPE
positions from the grids, so finite logits of the right shape show that pads, grids and token ids
line up. The Omni thinker does not check the audio count (``masked_scatter`` silently takes the first
features), so the audio tests compare the encoder's output length with the pad count themselves. A
right-padded two-sample batch scoring like its samples one by one shows that padding, M-RoPE and
multi-item concatenation (``collate``) agree.
"""

import json

import pytest
import torch

from relax_app.demo.mm_models import (
    ARCHITECTURES,
    FAMILIES,
    build_tiny_mm_model,
    extend_tokenizer,
    forward_kwargs,
    load_mm_model,
    media_tokens,
)
from relax_app.demo.tokenizer import train_tokenizer
from relax_multimodal import MultimodalConfig, MultimodalProcessor, collate
from relax_multimodal.testing import write_image, write_tone, write_video

torch.set_num_threads(1)

TEXTS = [f"look at picture {i}: what is {i} plus {3 * i}? it is {4 * i}." for i in range(300)]
KEYS = {"image": "i", "video": "v", "audio": "a"}
PROMPTS = {"image": "what is in <image>?", "video": "what moves in <video>?", "audio": "what is <audio>?"}
CASES = [(f, m) for f in FAMILIES for m in ("image", "video")] + [("qwen3_omni", "audio")]


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toks():
    return {f: extend_tokenizer(train_tokenizer(TEXTS), f) for f in FAMILIES}


@pytest.fixture(scope="module")
def models(toks):
    return {f: build_tiny_mm_model(f, toks[f]) for f in FAMILIES}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    return {
        "image": write_image(d / "a.png", size=(90, 60)),
        "image2": write_image(d / "b.png", size=(150, 50), color=(20, 90, 200)),
        "video": write_video(d / "v.mp4", n_frames=8, fps=4.0, size=(32, 32)),
        "video2": write_video(d / "w.mp4", n_frames=12, fps=4.0, size=(64, 48), seed=1),
        "audio": write_tone(d / "t.wav", seconds=1.3),
        "audio2": write_tone(d / "u.wav", seconds=0.55, hz=300.0),
    }


def processor(family, tok, modalities):
    cfg = MultimodalConfig(
        model=family,
        multimodal_keys={m: KEYS[m] for m in modalities},
        video_max_pixels=64 * 64,
        video_max_frames=8,
    )
    return MultimodalProcessor(cfg, tok)


def run(model, family, samples, pad_id):
    """Right-pad ``samples`` into one batch and run the forward; returns logits (batch, seq, vocab)."""
    n = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), n), dtype=torch.long)
    types = torch.zeros((len(samples), n), dtype=torch.long)
    for i, s in enumerate(samples):
        k = len(s.input_ids)
        ids[i, :k], mask[i, :k] = torch.tensor(s.input_ids), 1
        types[i, :k] = torch.tensor(s.mm_token_type_ids)
    kwargs = forward_kwargs(family, collate(samples, as_torch=True), mm_token_type_ids=types)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs).logits


def audio_feature_count(model, sample):
    t = sample.tensors(as_torch=True)
    with torch.no_grad():
        out = model.get_audio_features(t["input_features"], t["feature_attention_mask"])
    return out.last_hidden_state.shape[0]


# -- tokenizer and config --------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_extend_tokenizer_adds_the_family_tokens_once(family):
    tok = train_tokenizer(TEXTS)
    base = len(tok)
    names = list(media_tokens(family).values())
    assert len(extend_tokenizer(tok, family)) == base + len(names)
    assert len(names) == (7 if family == "qwen3_omni" else 4)
    ids = [tok.convert_tokens_to_ids(t) for t in names]
    assert extend_tokenizer(tok, family) is tok and len(tok) == base + len(names)  # idempotent
    assert [tok.convert_tokens_to_ids(t) for t in names] == ids
    assert set(names) <= set(map(str, tok.extra_special_tokens))
    text = "a" + "".join(names) + "b"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc[1:-1] == ids  # each one token, never split
    assert tok.decode(enc, skip_special_tokens=True) == "ab"


def _token_id_fields(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _token_id_fields(v, f"{prefix}{k}.")
        elif isinstance(k, str) and k.endswith(("token_id", "token_index")) and v is not None:
            yield prefix + k, v


@pytest.mark.parametrize("family", FAMILIES)
def test_config_takes_every_token_id_from_the_tokenizer(family, toks, models):
    tok, model = toks[family], models[family]
    cfg = model.config
    text = cfg.get_text_config()
    assert type(model).__name__ == ARCHITECTURES[family]
    assert text.vocab_size == len(tok) and model.get_input_embeddings().weight.shape[0] == len(tok)
    assert text.pad_token_id == tok.pad_token_id and text.eos_token_id == tok.eos_token_id
    names = media_tokens(family)
    want = {
        "image_token_id": names["image"],
        "video_token_id": names["video"],
        "vision_start_token_id": names["vision_start"],
        "vision_end_token_id": names["vision_end"],
    }
    if family == "qwen3_omni":
        want.update(audio_token_id=names["audio"], audio_start_token_id=names["audio_start"])
        want.update(audio_end_token_id=names["audio_end"])
    for field, token in want.items():
        assert getattr(cfg, field) == tok.convert_tokens_to_ids(token), field
    fields = dict(_token_id_fields(cfg.to_dict()))
    assert fields and all(0 <= v < len(tok) for v in fields.values()), fields
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_forward_kwargs_renames_per_family():
    t = {"pixel_values_videos": 1, "video_grid_thw": 2, "second_per_grid_ts": 3}
    assert forward_kwargs("qwen2_5_vl", t, mm_token_type_ids=4) == dict(t, mm_token_type_ids=4)
    assert forward_kwargs("qwen3_vl", t, mm_token_type_ids=4) == {
        "pixel_values_videos": 1,
        "video_grid_thw": 2,
        "mm_token_type_ids": 4,
    }
    assert forward_kwargs("qwen3_omni", t, mm_token_type_ids=4) == {
        "pixel_values_videos": 1,
        "video_grid_thw": 2,
        "video_second_per_grid": 3,
    }
    assert "second_per_grid_ts" in t  # the caller's dict is left alone
    with pytest.raises(ValueError, match="unknown family"):
        forward_kwargs("qwen2_5_omni", t)


# -- forward -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,modality", CASES)
def test_forward_takes_each_modality(family, modality, toks, models, media):
    tok, model = toks[family], models[family]
    s = processor(family, tok, [modality]).process(
        {"prompt": PROMPTS[modality], KEYS[modality]: media[modality]}
    )
    n_pads = sum(1 for t in s.mm_token_type_ids if t)
    assert n_pads == s.num_tokens()[modality] > 0
    logits = run(model, family, [s], tok.pad_token_id)
    assert logits.shape == (1, len(s.input_ids), len(tok)) and torch.isfinite(logits).all()
    if modality == "audio":  # the thinker does not check this itself
        assert audio_feature_count(model, s) == n_pads


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_takes_all_modalities_in_one_prompt(family, toks, models, media):
    tok, model = toks[family], models[family]
    mods = ["image", "video"] + (["audio"] if family == "qwen3_omni" else [])
    row = {"prompt": " then ".join(PROMPTS[m] for m in mods)} | {KEYS[m]: media[m] for m in mods}
    s = processor(family, tok, mods).process(row)
    assert all(s.num_tokens()[m] > 0 for m in mods)
    logits = run(model, family, [s], tok.pad_token_id)
    assert logits.shape == (1, len(s.input_ids), len(tok)) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "family,modality", [(f, "image") for f in FAMILIES] + [("qwen3_omni", "audio"), ("qwen3_vl", "video")]
)
def test_right_padded_batch_scores_like_single_samples(family, modality, toks, models, media):
    tok, model = toks[family], models[family]
    proc = processor(family, tok, [modality])
    samples = [
        proc.process({"prompt": PROMPTS[modality], KEYS[modality]: media[modality]}),
        proc.process({"prompt": "and " + PROMPTS[modality] + " say", KEYS[modality]: media[modality + "2"]}),
    ]
    assert len(samples[0].input_ids) != len(samples[1].input_ids)  # so one row is padded
    batch = run(model, family, samples, tok.pad_token_id)
    for i, s in enumerate(samples):
        single = run(model, family, [s], tok.pad_token_id)[0]
        k = len(s.input_ids)
        torch.testing.assert_close(batch[i, :k], single, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seconds", [0.02, 1.0, 1.3, 2.0, 8.5])
def test_qwen3_omni_audio_token_count_matches_the_encoder(seconds, toks, models, tmp_path):
    """1.0 s and 2.0 s end on a 100-frame chunk; 8.5 s spans more than one 800-frame attention window."""
    tok, model = toks["qwen3_omni"], models["qwen3_omni"]
    s = processor("qwen3_omni", tok, ["audio"]).process(
        {"prompt": "<audio>", "a": write_tone(tmp_path / "x.wav", seconds)}
    )
    assert audio_feature_count(model, s) == s.num_tokens()["audio"]
    logits = run(model, "qwen3_omni", [s], tok.pad_token_id)
    assert torch.isfinite(logits).all()


# -- checkpoint --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_reloads_with_identical_logits(family, toks, media, tmp_path):
    from transformers import AutoTokenizer

    tok = toks[family]
    model = build_tiny_mm_model(family, tok, out_dir=tmp_path, seed=1)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [ARCHITECTURES[family]]
    loaded = load_mm_model(tmp_path)
    assert type(loaded) is type(model) and loaded.dtype == torch.float32 and not loaded.training
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok2) == len(tok)
    for token in media_tokens(family).values():
        assert tok2.convert_tokens_to_ids(token) == tok.convert_tokens_to_ids(token)
    mods = ["image", "video"] + (["audio"] if family == "qwen3_omni" else [])
    row = {"prompt": " ".join(PROMPTS[m] for m in mods)} | {KEYS[m]: media[m] for m in mods}
    s = processor(family, tok2, mods).process(row)
    assert torch.equal(run(model, family, [s], tok.pad_token_id), run(loaded, family, [s], tok.pad_token_id))
