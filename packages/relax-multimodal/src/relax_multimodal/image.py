"""Images: decode (pillow), orient, flatten to RGB, resize onto the model's patch grid.

Decoding is defensive: the pixel count is checked from the header *before* pixels are decoded (our
``max_image_pixels``; pillow's process-wide limit still applies on top), truncated files are not silently
padded, and EXIF orientation is applied so that a phone photo is the right way up.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from .errors import MediaError
from .sources import Source, resolve
from .specs import IMAGE_MAX_TOKENS, IMAGE_MIN_TOKENS, ModelSpec, get_spec, smart_resize

DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # pillow's own default limit (≈ 0.25 GiB of RGBA)


@dataclass
class ImageItem:
    """One image, resized and ready: ``array`` is HxWx3 uint8; ``grid_thw`` is in patches."""

    array: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int
    original_size: tuple[int, int]  # (height, width) before resize
    source: str = "<image>"

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


def to_rgb(img: Image.Image) -> Image.Image:
    """Any mode to RGB; transparency (alpha, LA, P with a transparent index) is composited on white."""
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "F"):  # high bit depth greyscale: scale to 8 bits
        a = np.asarray(img, dtype=np.float64)
        hi = a.max() if a.size and a.max() > 255 else 255.0
        return Image.fromarray(np.clip(a * (255.0 / hi), 0, 255).astype(np.uint8)).convert("RGB")
    return img.convert("RGB")


def open_image(src: Source, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode one image fully (RGB, EXIF-oriented); errors are :class:`MediaError`."""
    if src.obj is not None:
        if not isinstance(src.obj, Image.Image):
            arr = np.asarray(src.obj)
            if arr.ndim not in (2, 3) or arr.size == 0:
                raise MediaError("bad_input", f"image array must be HxW or HxWxC (got shape {arr.shape})")
            img = Image.fromarray(arr.astype(np.uint8) if arr.dtype != np.uint8 else arr)
        else:
            img = src.obj
        _check_bomb(img.size, max_pixels, src.name)
        return to_rgb(ImageOps.exif_transpose(img) or img)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            fp = io.BytesIO(src.data) if src.data is not None else src.local_path()
            with Image.open(fp) as img:
                _check_bomb(img.size, max_pixels, src.name)
                img.load()
                # transpose only when needed: exif_transpose copies the image even when upright
                if img.getexif().get(0x0112, 1) not in (0, 1):
                    img = ImageOps.exif_transpose(img)
                return to_rgb(img)  # loaded: usable after the file is closed
    except MediaError:
        raise
    except Image.DecompressionBombError as e:
        raise MediaError("bomb", str(e), source=src.name) from None
    except FileNotFoundError:
        raise MediaError("missing", "file not found", source=src.name) from None
    except Exception as e:  # pillow raises OSError, SyntaxError, ValueError, struct.error ... on bad data
        if src.data is not None and len(src.data) == 0:
            raise MediaError("empty", "zero-length image", source=src.name) from None
        raise MediaError(
            "corrupt", f"cannot decode image ({type(e).__name__}: {e})", source=src.name
        ) from None


def _check_bomb(size: tuple[int, int], max_pixels: int, name: str) -> None:
    w, h = size
    if w * h > max_pixels:
        raise MediaError(
            "bomb", f"image is {w}x{h} = {w * h:,} pixels, over the {max_pixels:,}-pixel limit", source=name
        )
    if w * h == 0:
        raise MediaError("empty", f"image is {w}x{h}", source=name)


def image_budget(
    spec: ModelSpec, min_pixels: int | None, max_pixels: int | None, min_tokens=None, max_tokens=None
):
    """Pixel bounds from pixels or tokens (one token = one merged patch = factor² pixels)."""
    f2 = spec.factor**2
    lo = min_pixels if min_pixels is not None else (min_tokens or IMAGE_MIN_TOKENS) * f2
    hi = max_pixels if max_pixels is not None else (max_tokens or IMAGE_MAX_TOKENS) * f2
    if min_pixels is None and min_tokens is None:  # a max below the default min lowers the min
        lo = min(lo, hi)
    return lo, hi


def process_image(
    item: object,
    model: str | ModelSpec = "qwen2_5_vl",
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    media_root: str | None = None,
) -> ImageItem:
    """Load, orient, convert and resize one image for ``model``; the token count is exact."""
    spec = get_spec(model)
    src = item if isinstance(item, Source) else resolve(item, media_root)
    img = open_image(src, max_image_pixels)
    w, h = img.size
    lo, hi = image_budget(spec, min_pixels, max_pixels, min_tokens, max_tokens)
    try:
        rh, rw = smart_resize(h, w, spec.factor, lo, hi)
    except ValueError as e:
        raise MediaError("corrupt", str(e), source=src.name) from None
    if (rw, rh) != (w, h):
        img = img.resize((rw, rh), Image.Resampling.BICUBIC)
    grid = (1, rh // spec.patch_size, rw // spec.patch_size)
    return ImageItem(np.asarray(img), grid, spec.tokens_for_grid(*grid), (h, w), src.name)
