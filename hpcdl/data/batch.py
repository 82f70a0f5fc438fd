"""Build one minibatch into caller-owned arrays: read, crop/flip, normalise to (B, C, H, W) float32.

The same code runs in the training process (workers=0) and in loader workers, which write into a
shared-memory slot; so a batch is bitwise identical whoever builds it.
"""

from __future__ import annotations

import numpy as np

from hpcdl.data.augment import (
    Augment,
    crop_boxes,
    crop_one,
    eval_resize_crop,
    eval_resize_hw,
    gather_crops,
    normalise_into,
    resize_to,
)
from hpcdl.data.dataset import BadSample, DataError, Locate


def output_shape(ds, aug: Augment) -> tuple[int, int, int]:
    """(C, H, W) of the samples a Loader with this augmentation yields for ds.

    The shape contract: training and validation batches of ds both have it, and the model's
    input shape, the start-up checks and the benchmarks all read it from here."""
    c, h, w = ds.sample_shape
    oh, ow = aug.output_hw((h, w))
    return (c, oh, ow)


def check_augment(ds, aug: Augment) -> None:
    """Reject augmentations the data cannot take (resizing float32 pixels)."""
    if getattr(ds, "dtype", np.uint8) != np.uint8:
        _, h, w = ds.sample_shape
        if aug.rrc or aug.crop > min(h, w):
            raise ValueError(
                f"--augment rrc/rcrop larger than the image needs uint8 images; {ds.source} "
                "holds float32 pixels (use cropP, rcropS with S <= image size, flip)"
            )


class BatchBuilder:
    """Reads and transforms minibatches for one process; owns that process's file handles."""

    def __init__(
        self, ds, aug: Augment, seed: int, locate: Locate | None = None, skip_bad: bool = False
    ) -> None:
        self.ds, self.aug, self.seed, self.skip_bad = ds, aug, seed, skip_bad
        self.reader = ds.reader(locate)
        self.base_hw = tuple(ds.sample_shape[1:])
        self.shape = output_shape(ds, aug)
        self.mean = np.asarray(ds.mean, np.float32)
        self.std = np.asarray(ds.std, np.float32)

    @property
    def counts(self):
        return self.reader.counts

    def build(
        self, indices: np.ndarray, epoch: int, train: bool, images: np.ndarray, labels: np.ndarray
    ) -> None:
        """Fill images[:n] (n, C, H, W) float32 and labels[:n] (n,) int64 for n = len(indices)."""
        indices = np.asarray(indices, np.int64)
        n = len(indices)
        if not train and self.aug.rrc:
            y = self._eval_resized(indices, images)
        elif self.ds.kind == "hdf5":
            crops, y = self._fixed_size(indices, epoch, train)
            normalise_into(images[:n], crops, self.mean, self.std)
        else:
            y = self._decoded(indices, epoch, train, images)
        labels[:n] = y

    def _fixed_size(self, indices: np.ndarray, epoch: int, train: bool):
        """Same-size stored samples (HDF5): one gather for crop+flip when no resize is needed."""
        x, y = self._read_all(indices)
        if self.ds.layout == "CHW":
            x = x.transpose(0, 2, 3, 1)  # (n, H, W, C) view
        n, h, w = x.shape[:3]
        boxes = crop_boxes(
            self.aug, np.full(n, h), np.full(n, w), self.base_hw, self.seed, epoch, indices, train
        )
        if boxes.needs_resize:
            return np.stack([crop_one(x[i], boxes, i) for i in range(n)]).transpose(0, 3, 1, 2), y
        return gather_crops(x, boxes), y

    def _read_all(self, indices: np.ndarray):
        try:
            return self.reader.read(indices)
        except BadSample:
            if not self.skip_bad:
                raise
        parts = [self._read_or_none(i) for i in indices]
        good = _substitutes([p is not None for p in parts], indices)
        x = np.stack([parts[j][0][0] for j in good])
        y = np.array([parts[j][1][0] for j in good], np.int64)
        return x, y

    def _read_or_none(self, index: np.int64):
        try:
            return self.reader.read(np.array([index]))
        except BadSample:
            self.reader.counts.bad += 1
            return None

    def _decoded(self, indices: np.ndarray, epoch: int, train: bool, images: np.ndarray):
        """Image files of any size: decode each (reduced-size JPEG decode where it suffices),
        crop in Pillow before the copy to NumPy, normalise straight into images[i]."""
        ds = self.ds
        hs, ws = ds.heights[indices], ds.widths[indices]
        boxes = crop_boxes(self.aug, hs, ws, self.base_hw, self.seed, epoch, indices, train)
        oh, ow = boxes.out_hw
        ok = []
        for i, index in enumerate(indices):
            draft, box = None, None
            if not boxes.pad and boxes.w[i] > 0 and boxes.h[i] > 0:
                # decode size that keeps the crop box at >= the output size
                draft = (
                    -(-int(ws[i]) * ow // int(boxes.w[i])),
                    -(-int(hs[i]) * oh // int(boxes.h[i])),
                )
                box = (int(boxes.y0[i]), int(boxes.x0[i]), int(boxes.h[i]), int(boxes.w[i]))
            decoded = self._decode_or_none(index, draft, box)
            ok.append(decoded is not None)
            if decoded is None:
                continue
            img, scale = decoded
            if box is None:
                region = crop_one(img, boxes, i, scale)
            else:
                region = resize_to(img, (oh, ow))
                if boxes.flip[i]:
                    region = region[:, ::-1]
            normalise_into(images[i : i + 1], region.transpose(2, 0, 1)[None], self.mean, self.std)
        return self._substituted(ok, indices, images, ds.labels[indices])

    def _eval_resized(self, indices: np.ndarray, images: np.ndarray) -> np.ndarray:
        """Validation of rrcS: each image resized (shorter side int(S / 0.875)), centre S x S.

        Image files decode one at a time and in full: a JPEG draft decode (DCT scaling) of a
        large image would differ from torchvision's eval transform by up to ~17 grey levels."""
        size = self.aug.rrc
        samples, y = self._eval_samples(indices)
        ok = []
        for i, sample in enumerate(samples):
            ok.append(sample is not None)
            if sample is not None:
                img, hw = sample  # (h, w, C) uint8, the indexed (H, W) the resize is taken from
                region = eval_resize_crop(img, eval_resize_hw(*hw, size), size)
                chw = region.transpose(2, 0, 1)[None]
                normalise_into(images[i : i + 1], chw, self.mean, self.std)
        return self._substituted(ok, indices, images, y)

    def _eval_samples(self, indices: np.ndarray):
        """(iterator of (image, indexed (H, W)) or None for a skipped bad sample, labels)."""
        if self.ds.kind == "hdf5":
            x, y = self._read_all(indices)  # bad samples already substituted
            if self.ds.layout == "CHW":
                x = x.transpose(0, 2, 3, 1)  # (n, H, W, C) view
            return ((x[i], x.shape[1:3]) for i in range(len(x))), y

        def decode_each():
            for index in indices:
                decoded = self._decode_or_none(index, None, None)
                hw = int(self.ds.heights[index]), int(self.ds.widths[index])
                yield None if decoded is None else (decoded[0], hw)

        return decode_each(), self.ds.labels[indices]

    def _decode_or_none(self, index: np.int64, draft, box):
        """reader.decode's (image, scale), or None for a bad sample skipped under skip_bad."""
        try:
            return self.reader.decode(int(index), draft, box)
        except BadSample:
            if not self.skip_bad:
                raise
            self.reader.counts.bad += 1
            return None

    @staticmethod
    def _substituted(ok: list[bool], indices: np.ndarray, images: np.ndarray, y: np.ndarray):
        """Labels y, with good samples standing in for the bad ones (in images too)."""
        if not all(ok):
            take = _substitutes(ok, indices)
            images[: len(take)] = images[take]
            y = y[take]
        return y


def _substitutes(ok: list[bool], indices: np.ndarray) -> list[int]:
    """For each position the position whose sample stands in: itself, else the nearest good one
    before it (after it for leading bad ones). All bad -> DataError."""
    good = [i for i, g in enumerate(ok) if g]
    if not good:
        raise DataError(
            f"every sample of a minibatch is unreadable (indices {indices[:8].tolist()}...); "
            "check the data set with `python -m hpcdl.data inspect`"
        )
    take, last = [], good[0]
    for i, g in enumerate(ok):
        last = i if g else last
        take.append(last)
    return take
