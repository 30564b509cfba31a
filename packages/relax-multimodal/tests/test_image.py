import base64
import io
from pathlib import Path

import numpy as np
import pytest
from mm_media import write_image
from PIL import Image

from relax_multimodal import MediaError, process_image, to_rgb
from relax_multimodal.specs import MODELS


def _png_bytes(size=(40, 30), color=(10, 200, 10), mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_every_input_form_gives_the_same_image(tmp_path):
    path = write_image(tmp_path / "a.png", color=(10, 200, 10))
    data = Path(path).read_bytes()
    b64 = base64.b64encode(data).decode()
    forms = [
        path,
        "file://" + path,
        Path(path),
        data,
        b64,
        "data:image/png;base64," + b64,
        Image.open(path),
        {"bytes": data, "path": "a.png"},
        {"path": path},
        np.asarray(Image.open(path)),
    ]
    items = [process_image(f) for f in forms]
    for it in items:
        assert it.array.shape == items[0].array.shape and (it.array == items[0].array).all()
        assert it.array.dtype == np.uint8 and it.array.shape[2] == 3


def test_resize_grid_and_token_count():
    spec = MODELS["qwen2_5_vl"]
    it = process_image(Image.new("RGB", (640, 480)), "qwen2_5_vl")
    assert it.array.shape[:2] == (476, 644)
    assert it.grid_thw == (1, 476 // 14, 644 // 14)
    assert it.num_tokens == (476 // 14) * (644 // 14) // 4
    assert it.original_size == (480, 640)
    q3 = process_image(Image.new("RGB", (640, 480)), "qwen3_vl", max_tokens=64)
    assert q3.num_tokens <= 64 and q3.array.shape[0] % 32 == 0 and q3.array.shape[1] % 32 == 0
    tiny = process_image(Image.new("RGB", (5, 5)), spec, min_pixels=16 * 28 * 28)
    assert tiny.num_tokens >= 16


def test_exif_orientation_applied(tmp_path):
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 10, 20))  # blue strip on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    p = tmp_path / "rot.jpg"
    img.save(p, exif=exif, quality=95)
    it = process_image(str(p), min_pixels=1, max_pixels=10**6)
    assert it.original_size == (40, 20)  # height, width after rotation
    assert it.array[2, 10, 2] > 150  # the blue strip is now on top
    assert process_image(write_image(tmp_path / "plain.jpg")).original_size == (30, 40)


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "CMYK", "I;16", "1", "I", "F"])
def test_any_mode_to_rgb(mode):
    img = Image.new("RGB", (8, 8), (100, 150, 200)).convert(mode)
    out = to_rgb(img)
    assert out.mode == "RGB" and out.size == (8, 8)


def test_alpha_composited_on_white():
    img = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    img.putpixel((0, 0), (255, 0, 0, 255))
    a = np.asarray(to_rgb(img))
    assert a[1, 1].tolist() == [255, 255, 255] and a[0, 0].tolist() == [255, 0, 0]
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 9, 9, 9] + [0] * 762)
    p.info["transparency"] = 0
    assert np.asarray(to_rgb(p))[0, 0].tolist() == [255, 255, 255]


def test_bad_images(tmp_path):
    with pytest.raises(MediaError, match=r"missing.*check the path") as e:
        process_image(str(tmp_path / "nope.png"))
    assert "nope.png" in str(e.value)
    data = _png_bytes((200, 200))
    trunc = tmp_path / "trunc.png"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match="corrupt") as e:
        process_image(str(trunc))
    assert "trunc.png" in str(e.value)
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"\xff\xd8 not a jpeg at all" * 10)
    with pytest.raises(MediaError, match="corrupt"):
        process_image(str(junk))
    with pytest.raises(MediaError, match="empty"):
        process_image(b"")
    with pytest.raises(MediaError, match="bad_input"):
        process_image(12345)
    with pytest.raises(MediaError, match="URLs are not fetched"):
        process_image("https://example.com/x.png")


def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    p = write_image(tmp_path / "big.png", size=(300, 300))
    with pytest.raises(MediaError, match=r"bomb.*90,000 pixels, over the 10,000-pixel limit"):
        process_image(p, max_image_pixels=10_000)
    big = Image.new("1", (12_000, 12_000))  # 144 M pixels > pillow's default limit too; tiny as PNG
    buf = io.BytesIO()
    big.save(buf, format="PNG")
    with pytest.raises(MediaError, match="bomb"):
        process_image(buf.getvalue())


def test_aspect_ratio_limit():
    with pytest.raises(MediaError, match="aspect ratio"):
        process_image(Image.new("RGB", (2010, 10)))
