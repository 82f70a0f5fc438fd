"""`--decode gpu` on the CPU (issue 48 item 3; hpcdl.data.gpu_decode NOTE [GPU decode]): the
workers move file bytes only, the crop boxes are the CPU path's, an image the decoder refuses is
decoded by Pillow and counted, a corrupt file follows the bad-sample rules. The decoder is
Pillow's stand-in here; the GPU-marked tests at the end run nvImageCodec and CuPy."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpcdl.backend import gpu_available
from hpcdl.data import Loader, open_dataset
from hpcdl.data.augment import crop_boxes, parse_augment
from hpcdl.data.batch import BatchBuilder
from hpcdl.data.dataset import DataError
from hpcdl.data.file_bytes import FileBytesReader, byte_capacity
from hpcdl.data.gpu_decode import GpuBatchDecoder, PillowDecoder, gpu_decode_available

SEED, AUG, SIDE, OUT = 3, "rrc48+flip", 80, 48
# Largest difference in grey levels between the two paths' pixels on smooth images: JPEG
# decoded in full (here) or at a reduced DCT size (CPU path), and bilinear resampling without
# (here) or with (Pillow) a widened filter when shrinking.
TOLERANCE = 6


def smooth(label: int, k: int) -> np.ndarray:
    """A smooth colour ramp (no noise): resampling filters agree on it, flips show."""
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    r = 255 * xx / SIDE
    g = 255 * yy / SIDE
    b = np.full_like(r, 40.0 * label + 3 * k)
    return np.stack([r, g, b], -1).astype(np.uint8)


def jpeg(pixels: np.ndarray, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, "JPEG", quality=95)
    return out.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu-decode") / "data"
    for label in range(3):
        (root / f"c{label}").mkdir(parents=True)
        for k in range(16):
            (root / f"c{label}" / f"{k:02d}.jpg").write_bytes(jpeg(smooth(label, k)))
    return root


def cpu_path(ds, indices: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    builder = BatchBuilder(ds, parse_augment(AUG), SEED)
    images = np.empty((len(indices), 3, OUT, OUT), np.float32)
    labels = np.empty(len(indices), np.int64)
    builder.build(indices, epoch, True, images, labels)
    return images, labels


def read_bytes(ds, indices: np.ndarray, skip_bad: bool = False):
    reader = FileBytesReader(ds, skip_bad=skip_bad)
    offsets = np.empty(len(indices) + 1, np.int64)
    data = np.empty(byte_capacity(ds, len(indices)), np.uint8)
    labels = np.empty(len(indices), np.int64)
    reader.read(indices, labels, offsets, data)
    return offsets, data, labels


def grey_levels(x: np.ndarray, ds) -> np.ndarray:
    """Normalised (n, C, H, W) back to 0..255."""
    return x * np.asarray(ds.std, np.float32)[:, None, None] + np.asarray(ds.mean)[:, None, None]


def test_both_paths_draw_the_same_boxes_and_flips(folder):
    ds = open_dataset(folder)
    indices = np.arange(len(ds))
    decoder = GpuBatchDecoder(ds, parse_augment(AUG), SEED, np, PillowDecoder())
    for epoch in (0, 1):
        gpu = decoder.boxes(indices, epoch)
        cpu = crop_boxes(parse_augment(AUG), ds.heights[indices], ds.widths[indices],
                         (SIDE, SIDE), SEED, epoch, indices, True)  # fmt: skip
        for field in ("y0", "x0", "h", "w", "flip"):
            assert np.array_equal(getattr(gpu, field), getattr(cpu, field)), field
        assert 0 < gpu.flip.sum() < len(ds)  # both flips drawn
        assert len(set(gpu.h.tolist())) > 5  # random sizes, not one fixed crop
    other = GpuBatchDecoder(ds, parse_augment(AUG), SEED + 1, np, PillowDecoder())
    assert not np.array_equal(other.boxes(indices, 0).y0, decoder.boxes(indices, 0).y0)


def test_the_pixels_match_the_cpu_path_within_the_resampling_tolerance(folder):
    ds = open_dataset(folder)
    indices = np.arange(0, len(ds), 3)
    offsets, data, labels = read_bytes(ds, indices)
    decoder = GpuBatchDecoder(ds, parse_augment(AUG), SEED, np, PillowDecoder())
    got, got_labels = decoder.build(indices, offsets, data, labels, 0)
    want, want_labels = cpu_path(ds, indices, 0)
    assert got.shape == want.shape == (len(indices), 3, OUT, OUT) and got.dtype == np.float32
    assert np.array_equal(got_labels, want_labels)
    diff = np.abs(grey_levels(got, ds) - grey_levels(want, ds))
    assert diff.max() <= TOLERANCE, diff.max()
    # a flip would move the red ramp by up to 255 levels: the flips are where the CPU's are
    flipped = grey_levels(got[:, :, :, ::-1], ds) - grey_levels(want, ds)
    assert np.abs(flipped).max() > 4 * TOLERANCE


def ramp(h: int, w: int, k: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    return np.stack([255 * xx / w, 255 * yy / h, np.full_like(xx, 7.0 * k)], -1).astype(np.uint8)


def test_a_batch_of_images_of_many_sizes_is_cropped_in_one_pass_as_on_the_cpu(tmp_path):
    """crop_normalise_batch packs images of any sizes into one buffer: each sample's pixels
    come from its own image, box and flip, and the grey levels match the CPU path's."""
    root = tmp_path / "data" / "c0"
    root.mkdir(parents=True)
    sizes = [(80, 80), (64, 96), (100, 72), (56, 120), (90, 60), (72, 72)]
    for k, (h, w) in enumerate(sizes):
        (root / f"{k:02d}.jpg").write_bytes(jpeg(ramp(h, w, k)))
    ds = open_dataset(tmp_path / "data")
    indices = np.arange(len(ds))[::-1].copy()
    offsets, data, labels = read_bytes(ds, indices)
    decoder = GpuBatchDecoder(ds, parse_augment(AUG), SEED, np, PillowDecoder())
    for epoch in (0, 1, 2):
        got, _ = decoder.build(indices, offsets, data, labels, epoch)
        want, _ = cpu_path(ds, indices, epoch)
        diff = np.abs(grey_levels(got, ds) - grey_levels(want, ds))
        assert diff.max() <= TOLERANCE, (epoch, diff.max())
    blue = grey_levels(got, ds)[:, 2].mean(axis=(1, 2))  # 7 * k: each sample its own image
    k = [int((ds.root / ds.files.relpath(int(i))).stem) for i in indices]
    np.testing.assert_allclose(blue, 7.0 * np.array(k), atol=TOLERANCE)


def test_workers_move_the_files_bytes_only(folder):
    ds = open_dataset(folder)
    indices = np.array([5, 0, 40, 17])
    offsets, data, labels = read_bytes(ds, indices)
    for i, index in enumerate(indices):
        path = ds.root / ds.files.relpath(int(index))
        assert bytes(data[offsets[i] : offsets[i + 1]]) == path.read_bytes()
    assert np.array_equal(labels, ds.labels[indices])


def test_the_loader_with_byte_only_workers_yields_what_it_decodes_in_process(folder):
    ds = open_dataset(folder)
    order = [np.arange(k, k + 8) for k in range(0, 40, 8)]
    with Loader(ds, 8, workers=0, seed=SEED, augment=AUG, decode="gpu") as here:
        want = [(x.copy(), y.copy()) for x, y in here.iterate(order, 1)]
    with Loader(ds, 8, workers=2, seed=SEED, augment=AUG, decode="gpu") as loader:
        assert loader._pool.layout.byte_capacity == byte_capacity(ds, 8)
        assert loader.slots == 4  # byte slots are small: the default is 2 per worker, >= 4
        got = [(x.copy(), y.copy()) for x, y in loader.iterate(order, 1)]
        assert loader.stats()["decode_cpu_fallbacks"] == 0
    assert len(got) == len(want) == 5
    for (x, y), (wx, wy) in zip(got, want):
        assert np.array_equal(x, wx) and np.array_equal(y, wy)
    with pytest.raises(ValueError, match="decode must be cpu or gpu"):
        Loader(ds, 8, decode="nvjpeg")


class RefusesCmyk(PillowDecoder):
    """A decoder that cannot decode CMYK JPEGs, as nvJPEG cannot: the stand-in for the GPU."""

    name = "refuses-cmyk"

    def decode(self, blobs, stream=None):
        return [None if Image.open(io.BytesIO(b)).mode == "CMYK" else self.one(b) for b in blobs]

    def one(self, blob):
        return super().decode([blob])[0]


def test_byte_slots_built_ahead_for_the_next_epoch_are_used_not_dropped(folder):
    """hpcdl.data.pool NOTE [the next epoch] with decode gpu: the decoding thread runs the
    pool's iteration to its end, so the next epoch's byte slots built ahead are taken, none
    read twice (one TASK and one REPLY per batch read, one READY per worker)."""
    from hpcdl.data.pool import Upcoming

    ds = open_dataset(folder)
    epochs = [[np.arange(k, k + 8) + e for k in range(0, 32, 8)] for e in (0, 1)]
    with Loader(ds, 8, workers=2, prefetch=4, seed=SEED, augment=AUG, decode="gpu") as loader:
        first = list(loader.iterate(epochs[0], 0, then=Upcoming(epochs[1], 1, True)))
        second = list(loader.iterate(epochs[1], 1))
        assert loader.stats()["control_messages"] == 2 * 8 + 2
    assert len(first) == len(second) == 4


def test_an_image_the_decoder_refuses_is_decoded_on_the_cpu_and_counted(tmp_path):
    root = tmp_path / "data"
    (root / "c0").mkdir(parents=True)
    for k in range(6):
        mode = "CMYK" if k in (1, 4) else "RGB"
        (root / "c0" / f"{k}.jpg").write_bytes(jpeg(smooth(0, k), mode))
    ds = open_dataset(root)
    indices = np.arange(6)
    offsets, data, labels = read_bytes(ds, indices)
    decoder = GpuBatchDecoder(ds, parse_augment(AUG), SEED, np, RefusesCmyk())
    got, _ = decoder.build(indices, offsets, data, labels, 0)
    assert decoder.cpu_fallbacks == 2 and decoder.bad == 0
    reference = GpuBatchDecoder(ds, parse_augment(AUG), SEED, np, PillowDecoder())
    want, _ = reference.build(indices, offsets, data, labels, 0)
    assert np.array_equal(got, want)  # the fallback samples are Pillow's decode
    assert reference.cpu_fallbacks == 0  # Pillow itself falls back to nothing


def test_a_corrupt_file_follows_the_bad_sample_rules(tmp_path):
    root = tmp_path / "data"
    for label in range(2):
        (root / f"c{label}").mkdir(parents=True)
        for k in range(4):
            (root / f"c{label}" / f"{k}.jpg").write_bytes(jpeg(smooth(label, k)))
    good = (root / "c1" / "2.jpg").read_bytes()
    (root / "c1" / "2.jpg").write_bytes(good[: len(good) // 3])  # truncated
    (root / "c0" / "3.jpg").write_bytes(b"not a jpeg at all")
    ds = open_dataset(root)
    indices = np.arange(len(ds))
    bad = [i for i in indices if ds.files.relpath(int(i)) in ("c1/2.jpg", "c0/3.jpg")]
    offsets, data, labels = read_bytes(ds, indices)
    strict = GpuBatchDecoder(ds, parse_augment(AUG), SEED, np, PillowDecoder())
    with pytest.raises(DataError, match=r"c0/3\.jpg cannot be read.*--skip-bad-samples"):
        strict.build(indices, offsets, data, labels, 0)
    lenient = GpuBatchDecoder(ds, parse_augment(AUG), SEED, np, PillowDecoder(), skip_bad=True)
    got, got_labels = lenient.build(indices, offsets, data, labels, 0)
    assert lenient.bad == 2 and got.shape[0] == len(indices)
    for i in bad:  # the nearest good sample before it stands in
        assert np.array_equal(got[i], got[i - 1]) and got_labels[i] == got_labels[i - 1]
    # through the loader: the error of the decode thread reaches the consumer at its batch
    with Loader(ds, 4, workers=1, seed=SEED, augment=AUG, decode="gpu") as loader:
        order = [indices[k : k + 4] for k in range(0, len(indices), 4)]
        first_bad = min(bad) // 4
        got_batches = []
        with pytest.raises(DataError, match="cannot be read"):
            for x, _ in loader.iterate(order, 0):
                got_batches.append(x)
        assert len(got_batches) == first_bad
    assert not [t for t in threading.enumerate() if t.name == "hpcdl-decode"]


# ------------------------------------------------------------------ on a GPU (skipped in CI)

on_gpu = pytest.mark.skipif(
    not (gpu_available() and gpu_decode_available()[0]), reason="needs CuPy, a GPU, nvImageCodec"
)


@pytest.mark.gpu
@on_gpu
def test_gpu_decoded_crops_match_the_cpu_path(folder):
    import cupy as cp

    from hpcdl.data.gpu_decode import NvImageCodecDecoder

    ds = open_dataset(folder)
    indices = np.arange(len(ds))
    offsets, data, labels = read_bytes(ds, indices)
    dec = GpuBatchDecoder(ds, parse_augment(AUG), SEED, cp, NvImageCodecDecoder())
    got, _ = dec.build(indices, offsets, data, labels, 0)
    assert isinstance(got, cp.ndarray)
    want, _ = cpu_path(ds, indices, 0)
    diff = np.abs(grey_levels(cp.asnumpy(got), ds) - grey_levels(want, ds))
    assert diff.max() <= TOLERANCE, diff.max()
    assert dec.cpu_fallbacks == 0


@pytest.mark.gpu
@on_gpu
def test_on_the_gpu_cmyk_and_truncated_files_fall_back_or_count_as_bad(tmp_path):
    import cupy as cp

    from hpcdl.data.gpu_decode import NvImageCodecDecoder

    root = tmp_path / "data"
    (root / "c0").mkdir(parents=True)
    for k in range(6):
        (root / "c0" / f"{k}.jpg").write_bytes(jpeg(smooth(0, k), "CMYK" if k == 2 else "RGB"))
    good = (root / "c0" / "4.jpg").read_bytes()
    (root / "c0" / "4.jpg").write_bytes(good[:40])
    ds = open_dataset(root)
    indices = np.arange(6)
    offsets, data, labels = read_bytes(ds, indices)
    dec = GpuBatchDecoder(ds, parse_augment(AUG), SEED, cp, NvImageCodecDecoder(), skip_bad=True)
    got, _ = dec.build(indices, offsets, data, labels, 0)
    assert dec.bad == 1 and dec.cpu_fallbacks <= 1  # CMYK: nvJPEG may decode it, else Pillow
    assert cp.array_equal(got[4], got[3])


def test_hpcdl_torch_loader_hands_out_the_decoded_batches_as_tensors(folder):
    import torch

    from hpcdl.data.sampler import DistributedSampler
    from hpcdl.torch import Loader as TorchLoader

    ds = open_dataset(folder)
    order = DistributedSampler(len(ds), seed=SEED).batches(0, 8)
    with Loader(ds, 8, workers=0, seed=SEED, augment=AUG, decode="gpu") as here:
        want = [(x.copy(), y.copy()) for x, y in here.iterate(order, 0)]
    with TorchLoader(folder, 8, epochs=1, workers=2, seed=SEED, augment=AUG, decode="gpu",
                     handle_signals=False) as loader:  # fmt: skip
        got = [(x.clone(), y.clone()) for x, y in loader]
    assert len(got) == len(want) == len(ds) // 8
    for (x, y), (wx, wy) in zip(got, want):
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert np.array_equal(x.numpy(), wx) and np.array_equal(y.numpy(), wy)


def test_hpcdl_train_with_decode_gpu_trains_and_says_how_it_decodes(folder, tmp_path):
    import json
    import subprocess
    import sys

    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--data", str(folder), "--augment", AUG,
         "--model", "mlp", "--epochs", "1", "--batch-size", "8", "--workers", "2",
         "--decode", "gpu", "--metrics", str(metrics), "--progress", "none"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "2 worker(s) per rank, 4 batch slots (auto), files decoded in the rank (pillow)" in (
        proc.stdout
    )
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (summary,) = [r for r in records if r.get("event") == "summary"]
    assert summary["steps"] == 48 // 8 and np.isfinite(summary["train_loss"])
