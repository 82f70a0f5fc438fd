"""Decode a byte slot's files on the rank (`--decode gpu`), crop, flip and normalise them there.

NOTE [GPU decode]
One CPU core decodes and crops about 340 ImageNet-sized JPEGs a second; a resnet50 step on an
H100 eats 3,600 (issue 48). So with `--decode gpu` the loader workers only read the files
(hpcdl.data.file_bytes) and the rank decodes each batch:
- The decoder is a seam (`Decoder`: decode(list of bytes) -> list of HWC uint8 arrays or None):
  nvImageCodec (nvJPEG, the H100's hardware decoders) on a GPU, imported lazily; Pillow in
  the rank elsewhere (the stand-in that CPU tests use, and the fallback where nvImageCodec is
  absent, said once).
- An image the decoder cannot decode (CMYK, some progressive JPEGs, not a JPEG) is decoded by
  Pillow on the CPU for that sample and counted (`cpu_fallbacks`). A file Pillow cannot decode
  either is a bad sample: BadSample, or under skip_bad the nearest good sample of the batch
  stands in, as on the CPU path (hpcdl.data.batch).
- The crop boxes and flips come from hpcdl.data.augment.crop_boxes, the one function the CPU
  path draws them with: the same seed gives the same boxes on both paths. The crop, a bilinear
  resize to the output size (half-pixel centres, no antialiasing: Pillow's BILINEAR filter
  widens when it shrinks, so pixels differ from the CPU path's by a resampling tolerance), the
  flip and the normalisation are array code on the array module of the decoded images: CuPy
  kernels on a GPU, NumPy on the CPU, one code path.
Validation batches (train=False) are not decoded here: hpcdl.train's validation loader decodes
on the CPU.
"""

from __future__ import annotations

import io
from typing import Any, Protocol

import numpy as np

from hpcdl import messages
from hpcdl.data.augment import Augment, Boxes, crop_boxes
from hpcdl.data.batch import _substitutes, output_shape
from hpcdl.data.dataset import BadSample


class Decoder(Protocol):
    """Decodes a batch of compressed images: (h, w, 3) uint8 arrays, None where it cannot."""

    name: str

    def decode(self, blobs: list[np.ndarray]) -> list[Any]: ...


class PillowDecoder:
    """The stand-in decoder: Pillow in this process, NumPy arrays (CPU tests, fallback)."""

    name = "pillow"

    def decode(self, blobs: list[np.ndarray]) -> list[np.ndarray | None]:
        return [pillow_decode(b) for b in blobs]


class NvImageCodecDecoder:
    """nvImageCodec's batched decoder (nvJPEG): CuPy arrays on the current GPU."""

    name = "nvimgcodec"

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415
        from nvidia import nvimgcodec  # noqa: PLC0415

        self._cp = cupy
        self._decoder = nvimgcodec.Decoder()

    def decode(self, blobs: list[np.ndarray]) -> list[Any]:
        images = self._decoder.decode(blobs)
        return [None if im is None else self._cp.asarray(im) for im in images]


def pillow_decode(blob: np.ndarray) -> np.ndarray | None:
    """(h, w, 3) uint8 of one compressed image, or None where Pillow cannot decode it."""
    from PIL import Image  # noqa: PLC0415

    try:
        with Image.open(io.BytesIO(memoryview(blob))) as im:
            return np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None


def gpu_decode_available() -> tuple[bool, str]:
    """(whether --decode gpu decodes on the GPU here, why not / with what)."""
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False, "no GPU visible to CuPy"
    except Exception as exc:  # not installed, or no driver
        return False, f"CuPy unusable ({type(exc).__name__}: {exc})"
    try:
        from nvidia import nvimgcodec  # noqa: PLC0415
    except ImportError as exc:
        return False, f"nvImageCodec not installed ({exc}); pip install 'hpcdl[gpu]'"
    return True, f"nvImageCodec {getattr(nvimgcodec, '__version__', '')}".strip()


def make_decoder(xp: Any) -> Decoder:
    """nvImageCodec for CuPy where it is available; Pillow otherwise (said once on CuPy)."""
    if xp is not np:
        ok, why = gpu_decode_available()
        if ok:
            return NvImageCodecDecoder()
        messages.warn(f"--decode gpu: {why}; the rank decodes with Pillow on its CPU instead")
    return PillowDecoder()


class GpuBatchDecoder:
    """Turns byte slots into batches: images (n, C, oh, ow) float32 and labels (n,) int64 on xp.

    cpu_fallbacks and bad counts are cumulative; see NOTE [GPU decode]."""

    def __init__(self, ds, aug: Augment, seed: int, xp: Any, decoder: Decoder | None = None,
                 skip_bad: bool = False) -> None:  # fmt: skip
        self.ds, self.aug, self.seed, self.xp, self.skip_bad = ds, aug, seed, xp, skip_bad
        self.decoder = decoder if decoder is not None else make_decoder(xp)
        self.shape = output_shape(ds, aug)
        self.base_hw = tuple(ds.sample_shape[1:])
        self.mean = xp.asarray(np.asarray(ds.mean, np.float32))
        self.std = xp.asarray(np.asarray(ds.std, np.float32))
        self.cpu_fallbacks = 0
        self.bad = 0

    def boxes(self, indices: np.ndarray, epoch: int) -> Boxes:
        """The training crop boxes and flips of these samples: crop_boxes, as on the CPU."""
        ds = self.ds
        return crop_boxes(
            self.aug, ds.heights[indices], ds.widths[indices], self.base_hw, self.seed, epoch,
            indices, True,
        )  # fmt: skip

    def build(self, indices, offsets: np.ndarray, data: np.ndarray, labels: np.ndarray,
              epoch: int, train: bool = True):  # fmt: skip
        """Decode, crop, flip and normalise one byte slot's batch (NOTE [GPU decode])."""
        if not train:
            raise ValueError("--decode gpu decodes training batches; validation decodes on the CPU")
        indices = np.asarray(indices, np.int64)
        n = len(indices)
        blobs = [data[offsets[i] : offsets[i + 1]] for i in range(n)]
        images = self._decoded(indices, blobs)
        boxes = self.boxes(indices, epoch)
        xp = self.xp
        out = xp.empty((n, *self.shape), xp.float32)
        ok = [img is not None for img in images]
        for i, img in enumerate(images):
            if img is not None:
                scale = (img.shape[0] / self.ds.heights[indices[i]],
                         img.shape[1] / self.ds.widths[indices[i]])  # fmt: skip
                out[i] = crop_normalise(xp, img, boxes, i, scale, self.mean, self.std)
        labels = np.array(labels[:n], np.int64)
        if not all(ok):
            take = _substitutes(ok, indices)
            out = out[xp.asarray(take)]
            labels = labels[take]
        return out, xp.asarray(labels)

    def _decoded(self, indices: np.ndarray, blobs: list[np.ndarray]) -> list[Any]:
        """Each image decoded: by the decoder, else by Pillow (counted), else None (bad)."""
        images = self.decoder.decode(blobs)
        for i, img in enumerate(images):
            if img is not None:
                continue
            if len(blobs[i]):
                img = pillow_decode(blobs[i])
            if img is None:
                if not self.skip_bad:
                    path = self.ds.root / self.ds.files.relpath(int(indices[i]))
                    raise BadSample(path, int(indices[i]), "not a decodable image")
                self.bad += 1
                continue
            if self.decoder.name != "pillow":
                self.cpu_fallbacks += 1
            images[i] = self.xp.asarray(img)
        return images


def crop_normalise(xp: Any, img, boxes: Boxes, i: int, scale: tuple[float, float], mean, std):
    """Sample i's box of img (h, w, C) uint8 resized (bilinear) to the output size, flipped
    where drawn, normalised: (C, oh, ow) float32 on xp. scale: decoded / indexed size."""
    if boxes.pad:
        p = boxes.pad
        img = xp.pad(img, ((p, p), (p, p), (0, 0)))
    oh, ow = boxes.out_hw
    sy, sx = scale
    y0, x0 = float(boxes.y0[i]) * sy, float(boxes.x0[i]) * sx
    h, w = float(boxes.h[i]) * sy, float(boxes.w[i]) * sx
    ys = _taps(xp, y0, h, oh, img.shape[0])
    xs = _taps(xp, x0, w, ow, img.shape[1])
    if boxes.flip[i]:
        xs = tuple(t[::-1] for t in xs)
    (y_lo, y_hi, wy), (x_lo, x_hi, wx) = ys, xs
    f = img.astype(xp.float32)
    wx = wx[None, :, None]
    top = f[y_lo][:, x_lo] * (1 - wx) + f[y_lo][:, x_hi] * wx
    bottom = f[y_hi][:, x_lo] * (1 - wx) + f[y_hi][:, x_hi] * wx
    region = top * (1 - wy[:, None, None]) + bottom * wy[:, None, None]  # (oh, ow, C)
    return ((region - mean) / std).transpose(2, 0, 1)


def _taps(xp: Any, start: float, length: float, out: int, size: int):
    """Bilinear source taps along one axis: (low index, high index, weight of high) (out,)."""
    centres = start + (xp.arange(out, dtype=xp.float32) + 0.5) * (length / out) - 0.5
    centres = xp.clip(centres, 0, size - 1)
    lo = xp.floor(centres).astype(xp.int64)
    hi = xp.minimum(lo + 1, size - 1)
    return lo, hi, (centres - lo).astype(xp.float32)
