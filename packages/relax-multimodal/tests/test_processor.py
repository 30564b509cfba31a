import base64

import numpy as np
import pytest
from mm_media import ffmpeg_or_skip, write_image, write_tone, write_video
from PIL import Image

from relax_multimodal import MediaError, MultimodalConfig, MultimodalProcessor, collate


@pytest.fixture
def media(tmp_path):
    return {
        "img1": write_image(tmp_path / "a.png", size=(64, 48)),
        "img2": write_image(tmp_path / "b.jpg", size=(100, 30), color=(0, 0, 255)),
        "wav": write_tone(tmp_path / "t.wav", seconds=1.0),
        "dir": tmp_path,
    }


def test_images_expand_and_tokens_line_up(media, toy_tokenizer):
    proc = MultimodalProcessor(
        MultimodalConfig(model="qwen2_5_vl", multimodal_keys={"image": "imgs"}), toy_tokenizer
    )
    s = proc.process({"prompt": "Compare <image> and <image>.", "imgs": [media["img1"], media["img2"]]}, 0)
    n1, n2 = (i.num_tokens for i in s.images)
    assert s.text.count("<|image_pad|>") == n1 + n2
    assert s.prompt.count("<|image_pad|>") == 2  # SGLang payload keeps one pad per image
    pad = toy_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert s.input_ids.count(pad) == n1 + n2
    t = s.tensors()
    assert t["image_grid_thw"].tolist() == [list(i.grid_thw) for i in s.images]
    assert t["pixel_values"].shape == (int(t["image_grid_thw"].prod(1).sum()), 3 * 2 * 14 * 14)
    assert t["pixel_values"].dtype == np.float32
    assert t["image_grid_thw"].prod(1).sum() // 4 == n1 + n2
    pl = s.sglang_payload()
    assert len(pl["image_data"]) == 2 and pl["image_data"][0].startswith("data:image/png;base64,")
    decoded = Image.open(__import__("io").BytesIO(base64.b64decode(pl["image_data"][0].split(",", 1)[1])))
    assert decoded.size == s.images[0].array.shape[1::-1]  # resized already: SGLang's resize is a no-op
    eng = s.engine_payload()
    assert eng["input_ids"] == s.input_ids and "pixel_values" in eng


def test_chat_template_pads_and_prepending(media, toy_tokenizer):
    proc = MultimodalProcessor(model="qwen3_vl", multimodal_keys={"image": "image"}, tokenizer=None)
    s = proc.process({"prompt": "<|vision_start|><|image_pad|><|vision_end|>What?", "image": media["img1"]})
    assert s.text.startswith("<|vision_start|><|image_pad|>") and s.text.endswith("<|vision_end|>What?")
    s2 = proc.process({"prompt": "What colour?", "image": media["img1"]})
    assert s2.prompt == "<|vision_start|><|image_pad|><|vision_end|>What colour?"
    with pytest.raises(MediaError, match=r"sample 7.*2 image placeholder\(s\) for 1 image"):
        proc.process({"prompt": "<image><image>", "image": media["img1"]}, 7)


def test_audio_and_omni(media, toy_tokenizer):
    pytest.importorskip("transformers")
    cfg = MultimodalConfig(model="qwen3_omni", multimodal_keys={"image": "img", "audio": "clip"})
    proc = MultimodalProcessor(cfg, toy_tokenizer)
    s = proc.process({"prompt": "<audio> then <image>", "clip": media["wav"], "img": media["img1"]})
    assert s.text.count("<|audio_pad|>") == s.audios[0].num_tokens
    pad = toy_tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert s.input_ids.count(pad) == s.audios[0].num_tokens
    t = s.tensors()
    assert t["input_features"].shape[:2] == (1, 128)
    assert t["feature_attention_mask"].sum() == s.audios[0].frames
    assert "audio_data" in s.sglang_payload()


def test_video_in_prompt_qwen3_timestamps(tmp_path, toy_tokenizer):
    ffmpeg_or_skip()
    p = write_video(tmp_path / "v.mp4", n_frames=20, fps=10.0)
    proc = MultimodalProcessor(
        MultimodalConfig(model="qwen3_vl", multimodal_keys={"video": "video"}), toy_tokenizer
    )
    s = proc.process({"prompt": "<video>Where does it move?", "video": {"video": p, "fps": 2.0}})
    v = s.videos[0]
    assert s.text.count("<|video_pad|>") == v.num_tokens
    assert s.text.count(" seconds>") == v.grid_thw[0]
    t = s.tensors()
    assert t["video_grid_thw"].tolist() == [list(v.grid_thw)]
    assert t["pixel_values_videos"].shape[0] == int(np.prod(v.grid_thw))
    assert t["second_per_grid_ts"].tolist() == pytest.approx([1.0])
    assert s.sglang_payload()["video_data"] == [p]


def test_process_batch_skips_and_counts(media, tmp_path):
    trunc = tmp_path / "trunc.png"
    trunc.write_bytes(open(media["img1"], "rb").read()[:40])
    proc = MultimodalProcessor(MultimodalConfig(multimodal_keys={"image": "img"}, id_key="uid"))
    rows = [
        {"uid": "ok-1", "prompt": "a", "img": media["img1"]},
        {"uid": "gone", "prompt": "b", "img": str(tmp_path / "missing.png")},
        {"uid": "cut", "prompt": "c", "img": str(trunc)},
        {"uid": "weird", "prompt": "d", "img": {"type": "pointcloud", "pointcloud": "x.ply"}},
        {"uid": "none", "prompt": "e"},
        {"uid": "ok-2", "prompt": "f", "img": [media["img1"], media["img2"]]},
    ]
    res = proc.process_batch(rows)
    assert [s.index for s in res.samples] == ["ok-1", "none", "ok-2"]
    assert res.counts == {"missing": 1, "corrupt": 1, "unknown_key": 1}
    msgs = {e.sample: str(e) for e in res.skipped}
    assert "missing.png" in msgs["gone"] and "column 'img'" in msgs["gone"]
    assert "trunc.png" in msgs["cut"] and "sample 'cut'" in msgs["cut"]
    assert "pointcloud" in msgs["weird"]
    batch = collate(res.samples)
    assert batch["image_grid_thw"].shape == (3, 3)


def test_unknown_modality_key_in_config():
    with pytest.raises(MediaError, match=r"unknown modality 'pointcloud'.*column 'pc'"):
        MultimodalConfig(multimodal_keys={"pointcloud": "pc"})
    with pytest.raises(ValueError, match="unknown model family"):
        MultimodalConfig(model="llava")


def test_content_cache_hits_on_same_bytes(media, tmp_path):
    copy = tmp_path / "copy.png"
    copy.write_bytes(open(media["img1"], "rb").read())
    proc = MultimodalProcessor(MultimodalConfig(multimodal_keys={"image": "img"}))
    a = proc.process({"img": media["img1"]})
    b = proc.process({"img": str(copy)})
    assert proc.cache.hits == 1 and proc.cache.misses == 1 and b.images[0] is a.images[0]
    proc.cache.max_bytes = 1  # too small to hold anything: no caching, no error
    proc.cache.put(("k",), a.images[0])
    assert len(proc.cache) == 1  # the earlier entry remains until evicted by a fitting one


def test_torch_tensors(media):
    torch = pytest.importorskip("torch")
    proc = MultimodalProcessor(MultimodalConfig(multimodal_keys={"image": "img"}))
    t = proc.process({"img": media["img1"]}).tensors(as_torch=True)
    assert isinstance(t["pixel_values"], torch.Tensor) and t["image_grid_thw"].dtype == torch.int64


def test_use_audio_in_video_sample(tmp_path, toy_tokenizer):
    ffmpeg_or_skip()
    pytest.importorskip("transformers")
    p = write_video(tmp_path / "av.mp4", n_frames=20, fps=10.0, audio_hz=300.0)
    cfg = MultimodalConfig(model="qwen2_5_omni", multimodal_keys={"video": "v"}, use_audio_in_video=True)
    s = MultimodalProcessor(cfg, toy_tokenizer).process({"prompt": "<video>Which tone?", "v": p})
    v, (a,) = s.videos[0], s.audios
    assert (
        a is v.audio
        and s.text.count("<|VIDEO|>") == v.num_tokens
        and s.text.count("<|AUDIO|>") == a.num_tokens
    )
    assert s.text.index("<|audio_bos|>") > s.text.rindex("<|VIDEO|>")
    t = s.tensors()
    assert t["feature_attention_mask"].sum() == a.frames and t["video_grid_thw"].shape == (1, 3)
    assert "audio_data" not in s.sglang_payload()  # SGLang takes the track from the video file
