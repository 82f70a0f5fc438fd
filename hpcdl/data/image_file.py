"""One image file opened and decoded by Pillow: the one place hpcdl does either.

NOTE [image files]. Every reader and converter of image files (the image-folder index and
reader, encoded HDF5 rows, tar members, `convert folder`, the GPU path's Pillow fallback) opens
images through open_image and turns them into 8-bit pixels through to_mode, so the same bytes
give the same pixels, and the same refusal, whoever holds them.

- Size. An image of more than MAX_IMAGE_PIXELS (Pillow's default limit against decompression
  bombs, 89,478,485 pixels: about 9,459 x 9,459) is refused with ImageTooLarge, an OSError that
  names the pixel count: the index takes it as an image whose header cannot be read (height 0),
  reading it is a bad sample, a conversion stops on it. hpcdl does not raise the limit: image
  classification data (ImageNet's photos: a few megapixels) holds no such images, and a sample
  at the limit is 270 MB of RGB pixels (89 M x 3 bytes) decoded every time it is read. Pillow
  itself only warns up to twice its limit and refuses above; hpcdl refuses at the limit, with
  one line of its own, so Pillow's DecompressionBombWarning says nothing new and is ignored (a
  filter installed when an image is opened; it holds for the whole process).
- Depth. A 16-bit greyscale PNG (Pillow modes I;16 and I) becomes 8 bits by keeping each
  value's high byte (value >> 8), as Pillow's PNG decoder does for 16-bit colour PNGs and as
  torchvision's to_dtype(uint8, scale=True) does for uint16 images. Pillow's own convert("L")
  would clip every value above 255 to 255.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.data.dataset import BadSample

GREY_MODES = ("L", "1", "I;16")  # Pillow modes of one channel: a folder of them has C = 1
MAX_IMAGE_PIXELS = 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_PIXELS = re.compile(r"\((\d+) pixels\)")


class ImageTooLarge(OSError):
    """An image over MAX_IMAGE_PIXELS; the message names its pixel count."""

    def __init__(self, pixels: int | None) -> None:
        count = "an unknown number of" if pixels is None else str(pixels)
        super().__init__(
            f"the image has {count} pixels, more than the {MAX_IMAGE_PIXELS} hpcdl decodes "
            "(Pillow's limit against decompression bombs); shrink it (to 8192 x 8192 at most, "
            "say)"
        )


def _pillow() -> Any:
    """PIL.Image, with its DecompressionBombWarning silenced (NOTE [image files]; put back
    where something reset the filters, as pytest does for each test)."""
    from PIL import Image  # noqa: PLC0415

    if ("ignore", None, Image.DecompressionBombWarning, None, 0) not in warnings.filters:
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    return Image


def open_image(f: Any) -> Any:
    """Pillow's image of the file f (a path or a binary file object), its header parsed;
    ImageTooLarge over MAX_IMAGE_PIXELS, Pillow's errors (OSError, ...) otherwise."""
    image_module = _pillow()
    bomb = (image_module.DecompressionBombError, image_module.DecompressionBombWarning)
    try:
        im = image_module.open(f)
    except bomb as exc:
        found = _PIXELS.search(str(exc))
        raise ImageTooLarge(int(found.group(1)) if found else None) from None
    if im.width * im.height > MAX_IMAGE_PIXELS:
        im.close()
        raise ImageTooLarge(im.width * im.height)
    return im


def check_pixels(height: int, width: int) -> None:
    """ImageTooLarge when an image of height x width is over MAX_IMAGE_PIXELS (for headers
    parsed without Pillow)."""
    if height * width > MAX_IMAGE_PIXELS:
        raise ImageTooLarge(height * width)


def to_mode(im: Any, mode: str) -> Any:
    """im as mode ("L" or "RGB"); 16-bit greyscale scaled to 8 bits (NOTE [image files])."""
    if im.mode in _SIXTEEN_BIT_MODES:
        values = np.clip(np.asarray(im), 0, 65535).astype(np.uint16) >> 8
        im = _pillow().fromarray(values.astype(np.uint8))
    return im if im.mode == mode else im.convert(mode)


def image_header(f: Any) -> tuple[int, int, bool]:
    """(height, width, greyscale) parsed from the header of the image file open as f;
    (0, 0, True) when it is unreadable or too large (reading the image then raises BadSample)."""
    try:
        with open_image(f) as im:  # parses the header only
            return im.height, im.width, im.mode in GREY_MODES
    except (OSError, SyntaxError, ValueError):
        return 0, 0, True


@dataclass(frozen=True)
class BadSampleAt:
    """Where a sample is read from, for its BadSample: the file, the sample index and, in a
    file of many samples, a prefix for the reason (which row)."""

    path: Path
    index: int
    prefix: str = ""

    def error(self, reason: str) -> BadSample:
        return BadSample(self.path, self.index, self.prefix + reason)


def decode_image(
    f: Any,
    mode: str,
    indexed_hw: tuple[int, int],
    draft: tuple[int, int] | None,
    box: tuple[int, int, int, int] | None,
    where: BadSampleAt,
) -> tuple[np.ndarray, tuple[float, float]]:
    """(image (h, w, C) uint8, (h / indexed h, w / indexed w)) of the image file open as f.

    The one decode of image files, whoever holds their bytes (a folder's file, a row of an
    encoded HDF5 shard, a tar member): the same bytes give the same pixels. mode: "L" or "RGB";
    draft = (w, h) the decoder may shrink a JPEG to (Pillow draft mode: DCT scaling by 1/2,
    1/4, 1/8); box = (y0, x0, h, w) in indexed pixels: return only that region (cropped by
    Pillow before the copy to NumPy). BadSample (where.error) when the bytes do not decode."""
    from PIL import UnidentifiedImageError  # noqa: PLC0415

    h, w = indexed_hw
    try:
        with open_image(f) as im:
            if draft and im.format == "JPEG":
                im.draft(mode, draft)
            im = to_mode(im, mode)
            if h <= 0:
                raise OSError("image header was unreadable when the index was built")
            scale = (im.height / h, im.width / w)
            if box is not None:
                y0, x0, bh, bw = box
                top, left = int(y0 * scale[0]), int(x0 * scale[1])
                bottom = top + max(1, round(bh * scale[0]))
                right = left + max(1, round(bw * scale[1]))
                im = im.crop((left, top, right, bottom))
            arr = np.asarray(im)
    except UnidentifiedImageError:  # its text names the file object: <_io.BytesIO at 0x...>
        raise where.error("the bytes are not a readable image file (JPEG, PNG)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise where.error(str(exc)) from None
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return arr, scale
