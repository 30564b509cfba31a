import numpy as np
import pytest
from PIL import Image

from relax_multimodal import patchify, process_image
from relax_multimodal.specs import MODELS


def test_patch_layout_matches_transformers_image_processor():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)  # already on the grid: no resize on either side
    item = process_image(Image.fromarray(arr), "qwen2_5_vl")
    ours, grid = patchify(item.array[None], MODELS["qwen2_5_vl"])
    hf = Qwen2VLImageProcessorPil()  # defaults: 4..1280 tokens of 28x28
    out = hf(images=[Image.fromarray(arr)], return_tensors="np")
    assert tuple(out["image_grid_thw"][0]) == grid == item.grid_thw
    np.testing.assert_allclose(ours, out["pixel_values"], atol=1e-5)


def test_video_patches_pad_odd_frame_count():
    spec = MODELS["qwen3_vl"]
    frames = np.zeros((3, 64, 32, 3), dtype=np.uint8)
    pv, grid = patchify(frames, spec)
    assert grid == (2, 4, 2) and pv.shape == (16, 3 * 2 * 16 * 16)
