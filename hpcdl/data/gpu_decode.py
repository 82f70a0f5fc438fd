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
  kernels on a GPU, NumPy on the CPU, one code path, a fixed number of calls per batch
  (crop_normalise_batch; done per image, about 40 CuPy calls each, thousands a batch).
- A thread decodes one batch ahead of the step (GpuBatchDecoder.ahead, hpcdl.data.ahead), on a
  side stream on a GPU, with an event each way (see GpuBatchDecoder.__init__).
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
from hpcdl.data.image_file import MAX_IMAGE_PIXELS, open_image, to_mode

UNREAD = (
    f"its header could not be read when the data set was indexed, or it has more than "
    f"{MAX_IMAGE_PIXELS} pixels (Pillow's limit against decompression bombs)"
)


class Decoder(Protocol):
    """Decodes a batch of compressed images: (h, w, 3) uint8 arrays, None where it cannot.

    stream: the CuPy stream the decoded arrays must be ready on (None: the current one)."""

    name: str

    def decode(self, blobs: list[np.ndarray], stream: Any = None) -> list[Any]: ...


class PillowDecoder:
    """The stand-in decoder: Pillow in this process, NumPy arrays (CPU tests, fallback)."""

    name = "pillow"

    def decode(self, blobs: list[np.ndarray], stream: Any = None) -> list[np.ndarray | None]:
        return [pillow_decode(b) for b in blobs]


class NvImageCodecDecoder:
    """nvImageCodec's batched decoder (nvJPEG): CuPy arrays on the current GPU."""

    name = "nvimgcodec"

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415
        from nvidia import nvimgcodec  # noqa: PLC0415

        self._cp, self._nv = cupy, nvimgcodec
        self._decoder = nvimgcodec.Decoder()

    def decode(self, blobs: list[np.ndarray], stream: Any = None) -> list[Any]:
        # bytes(): a copy the decoder owns, so the slot can go back to the workers at once
        streams = [self._code_stream(bytes(b)) if len(b) else None for b in blobs]
        todo = [k for k, c in enumerate(streams) if c is not None]
        ptr = stream.ptr if stream is not None else self._cp.cuda.get_current_stream().ptr
        decoded = self._decoder.decode([streams[k] for k in todo], cuda_stream=ptr) if todo else []
        out: list[Any] = [None] * len(blobs)
        for k, image in zip(todo, decoded):
            out[k] = None if image is None else self._cp.asarray(image)
        return out

    def _code_stream(self, data: bytes) -> Any:
        """nvImageCodec's parsed stream, or None where it cannot parse the header."""
        try:
            return self._nv.CodeStream(data)
        except Exception:  # not an image it knows: Pillow gets a try (NOTE [GPU decode])
            return None


def pillow_decode(blob: np.ndarray) -> np.ndarray | None:
    """(h, w, 3) uint8 of one compressed image, or None where Pillow cannot decode it."""
    try:
        with open_image(io.BytesIO(memoryview(blob))) as im:
            return np.asarray(to_mode(im, "RGB"))
    except (OSError, SyntaxError, ValueError):  # ImageTooLarge is an OSError
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
        # decode one batch ahead on a side stream (CuPy): build() queues there; the compute
        # stream waits for `ready`, and the side stream for `taken`, recorded on the compute
        # stream as the step takes a batch: memory freed by batches the step is done with is
        # reused only after the step's work on them.
        self._side = None if xp is np else xp.cuda.Stream(non_blocking=True)
        self._taken = None if xp is np else xp.cuda.Event(disable_timing=True)
        self._device = None if xp is np else xp.cuda.Device().id

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
        ok = [img is not None for img in images]
        good = [i for i in range(n) if ok[i]]
        if not good:
            _substitutes(ok, indices)  # raises: every sample of the batch is bad
        indexed_hw = np.stack([self.ds.heights[indices], self.ds.widths[indices]], 1)
        out = crop_normalise_batch(
            xp, [images[i] for i in good], _select(boxes, good), indexed_hw[good],
            self.mean, self.std,
        )  # fmt: skip
        labels = np.array(labels[:n], np.int64)
        if len(good) < n:  # bad samples: the nearest good one stands in (hpcdl.data.batch)
            take = _substitutes(ok, indices)
            out = out[xp.asarray([good.index(t) for t in take])]
            labels = labels[take]
        return out, xp.asarray(labels)

    def ahead(self, batches: list, host, epoch: int, train: bool):
        """Iterate build() over host's byte slots in a thread, one batch ahead, on the side
        stream on a GPU (see __init__); yields (images, labels) as build() does."""
        from hpcdl.data.ahead import Ahead  # noqa: PLC0415

        # host first: zip then runs host to its end, where the pool keeps what it built ahead
        # for the next epoch (hpcdl.data.pool NOTE [the next epoch]); batches first would
        # leave host at its last batch, and closing it there drops them
        items = zip(host, batches)
        if self._side is None:

            def work(item):
                ((offsets, data), labels), b = item
                return self.build(b, offsets, data, labels, epoch, train)

            return Ahead(items, work, 1, "hpcdl-decode")

        def work_on_side(item):
            ((offsets, data), labels), b = item
            self.xp.cuda.Device(self._device).use()  # the current device is per thread
            with self._side:
                self._side.wait_event(self._taken)
                images, labels = self.build(b, offsets, data, labels, epoch, train)
                ready = self.xp.cuda.Event(disable_timing=True)
                ready.record(self._side)
            return images, labels, ready

        def take(result):
            images, labels, ready = result
            compute = self.xp.cuda.get_current_stream()
            compute.wait_event(ready)
            self._taken.record(compute)
            return images, labels

        return Ahead(items, work_on_side, 1, "hpcdl-decode", take)

    def _decoded(self, indices: np.ndarray, blobs: list[np.ndarray]) -> list[Any]:
        """Each image decoded: by the decoder, else by Pillow (counted), else None (bad). On
        the current stream, where the crops that follow run: the side stream inside ahead()."""
        # indexed with height 0 (a header Pillow could not read, or an image over
        # MAX_IMAGE_PIXELS): a bad sample, as on the CPU, whatever this decoder could decode
        unread = self.ds.heights[indices] <= 0
        images = self.decoder.decode([b[:0] if u else b for b, u in zip(blobs, unread)])
        for i, img in enumerate(images):
            if img is not None:
                continue
            if len(blobs[i]) and not unread[i]:
                img = pillow_decode(blobs[i])
            if img is None:
                if not self.skip_bad:
                    fid = int(self.ds.file_ids(indices[i : i + 1])[0])
                    path = self.ds.root / self.ds.files.relpath(fid)
                    why = UNREAD if unread[i] else "not a decodable image"
                    raise BadSample(path, int(indices[i]), why)
                self.bad += 1
                continue
            if self.decoder.name != "pillow":
                self.cpu_fallbacks += 1
            images[i] = self.xp.asarray(img)
        return images


def crop_normalise_batch(xp: Any, images: list, boxes: Boxes, indexed_hw: np.ndarray, mean, std):
    """Each image's box resized (bilinear) to the output size, flipped where drawn, normalised:
    (n, C, oh, ow) float32 on xp, in a fixed number of array calls whatever n (issue 48: done
    per image, a batch of 128 took thousands of CuPy calls).

    images: n decoded (h_i, w_i, C) uint8 arrays on xp, any sizes; boxes: theirs, in indexed
    coordinates; indexed_hw: (n, 2) the sizes the boxes were drawn on (a decoder may return a
    reduced size). The images are packed into one flat buffer; the taps of every output pixel
    become indices into it, so the crop, resize and flip are four gathers and a blend."""
    if boxes.pad:
        p = boxes.pad
        images = [xp.pad(img, ((p, p), (p, p), (0, 0))) for img in images]
        indexed_hw = indexed_hw + 2 * p
    oh, ow = boxes.out_hw
    c = images[0].shape[2]
    hw = np.array([img.shape[:2] for img in images], np.int64)  # (n, 2) decoded sizes
    scale = hw / indexed_hw
    ys = _taps(boxes.y0 * scale[:, 0], boxes.h * scale[:, 0], oh, hw[:, 0])
    xs = _taps(boxes.x0 * scale[:, 1], boxes.w * scale[:, 1], ow, hw[:, 1])
    flip = np.asarray(boxes.flip, bool)
    xs = tuple(np.where(flip[:, None], t[:, ::-1], t) for t in xs)
    (y_lo, y_hi, wy), (x_lo, x_hi, wx) = ys, xs
    sizes = hw[:, 0] * hw[:, 1] * c
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # where image i starts in `flat`
    flat = xp.concatenate([img.reshape(-1) for img in images])
    row = c * hw[:, 1:2]  # (n, 1) elements per image row: C x its width
    # int32 indices where they fit (a batch of 128 at 448x448 is 77 M elements): half the bytes
    # of the four (n, oh, ow, C) index arrays
    itype = np.int32 if flat.size < 2**31 else np.int64

    def index(y: np.ndarray, x: np.ndarray):  # (n, oh, ow, C) into flat
        rows = xp.asarray((base[:, None] + y * row).astype(itype))[:, :, None, None]
        cols = xp.asarray((c * x).astype(itype))[:, None, :, None]
        return rows + cols + xp.arange(c, dtype=itype)[None, None, None, :]

    def pixels(y: np.ndarray, x: np.ndarray):
        return flat[index(y, x)].astype(xp.float32)

    wx = xp.asarray(wx)[:, None, :, None]
    wy = xp.asarray(wy)[:, :, None, None]
    top = pixels(y_lo, x_lo) * (1 - wx) + pixels(y_lo, x_hi) * wx
    bottom = pixels(y_hi, x_lo) * (1 - wx) + pixels(y_hi, x_hi) * wx
    region = top * (1 - wy) + bottom * wy  # (n, oh, ow, C)
    return xp.ascontiguousarray(((region - mean) / std).transpose(0, 3, 1, 2))


def _select(boxes: Boxes, keep: list[int]) -> Boxes:
    """The boxes of the samples `keep`."""
    return Boxes(boxes.y0[keep], boxes.x0[keep], boxes.h[keep], boxes.w[keep],
                 boxes.flip[keep], boxes.out_hw, boxes.pad)  # fmt: skip


def _taps(start: np.ndarray, length: np.ndarray, out: int, size: np.ndarray):
    """Bilinear source taps along one axis, per image (half-pixel centres): (low index, high
    index, weight of high), each (n, out). start, length, size: (n,) per image. On the host:
    n x out numbers, small next to the pixels."""
    step = (np.asarray(length, np.float64) / out)[:, None]
    centres = np.asarray(start, np.float64)[:, None] + (np.arange(out) + 0.5) * step - 0.5
    centres = np.clip(centres, 0, (size - 1)[:, None])
    lo = np.floor(centres).astype(np.int64)
    hi = np.minimum(lo + 1, (size - 1)[:, None])
    return lo, hi, (centres - lo).astype(np.float32)
