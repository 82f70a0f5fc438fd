"""`python -m hpcdl.bench loader`: hpcdl loader vs torch DataLoader vs the single-process ceiling.

    python -m hpcdl.bench loader --data DIR [--make-jpegs N] --workers K --batch-size B
                                 [--max-images N] [--json]

On a JPEG folder: decode + random 224 crop + horizontal flip + normalise to float32 CHW, by
(1) hpcdl.data.Loader, (2) torch.utils.data.DataLoader doing the same per-sample work with the same
K and B (when torch imports), (3) one process doing that work, times K (the ceiling). Then HDF5
uint8 32x32 images/s per rank, and an overlap check: a step with a synthetic compute phase
(sleep, like a GPU kernel) should take <= 1.05 x max(compute, load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.bench import synthetic
from hpcdl.data import Loader, default_workers, open_dataset
from hpcdl.data.sampler import DistributedSampler
from hpcdl.helpformat import HelpFormatter

CROP = 224


def make_jpegs(root: Path, n: int, size: int = 256, classes: int = 10) -> None:
    """n smooth-plus-noise size x size JPEGs (quality 90) in root/c<class>/."""
    pixels = synthetic.smooth_noise(np.random.default_rng(0))
    synthetic.image_folder(root, n, pixels, side=size, classes=classes, fmt="jpg",
                           class_dir="c{label}")  # fmt: skip


def _batches(n: int, batch: int, epoch: int = 0):
    return DistributedSampler(n, seed=0).batches(epoch, batch)


def hpcdl_rate(ds, workers: int, batch: int, augment: str, n: int, prefetch: int = 4) -> float:
    images, seconds = timed_pass(ds, workers, batch, augment, n, prefetch)
    return images / seconds


def timed_pass(
    ds, workers: int, batch: int, augment: str, n: int, prefetch: int = 4
) -> tuple[int, float]:
    """(images, seconds) of one pass over n samples, timed from the first batch's request to
    the last batch, with the workers already started. Starting the clock after the first batch
    would miss the work the other workers did meanwhile (up to `workers` batches)."""
    with Loader(
        ds, batch, workers=workers, prefetch=max(prefetch, 2 * workers), seed=0, augment=augment
    ) as loader:
        t0 = time.perf_counter()
        count = sum(len(y) for _, y in loader.iterate(_batches(n, batch), 0))
        return count, time.perf_counter() - t0


class _Sample:
    """One image through the same per-sample work the hpcdl loader does (for torch / ceiling)."""

    def __init__(self, ds) -> None:
        self.ds = ds
        self.scale = (1.0 / ds.std).astype(np.float32)
        self.bias = (-ds.mean / ds.std).astype(np.float32)

    def __call__(self, i: int, rng: np.random.Generator):
        from PIL import Image  # noqa: PLC0415

        with Image.open(self.ds.root / self.ds.files[i].relpath) as im:
            if im.mode != "RGB":
                im = im.convert("RGB")
            y0, x0 = rng.integers(0, im.height - CROP + 1), rng.integers(0, im.width - CROP + 1)
            x = np.asarray(im.crop((x0, y0, x0 + CROP, y0 + CROP)))
        if rng.random() < 0.5:
            x = x[:, ::-1]
        out = np.empty((3, CROP, CROP), np.float32)
        np.multiply(x.transpose(2, 0, 1), self.scale[:, None, None], out=out, dtype=np.float32)
        out += self.bias[:, None, None]
        return out, int(self.ds.labels[i])


def ceiling_rate(ds, n: int) -> tuple[float, float]:
    """(decode+crop+flip+normalise, decode only) images/s of one process."""
    from PIL import Image  # noqa: PLC0415

    work, rng = _Sample(ds), np.random.default_rng(0)
    t0 = time.perf_counter()
    for i in range(n):
        work(i % len(ds), rng)
    full = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(n):
        with Image.open(ds.root / ds.files[i % len(ds)].relpath) as im:
            np.asarray(im.convert("RGB"))
    return full, n / (time.perf_counter() - t0)


def torch_rate(ds, workers: int, batch: int, n: int) -> float | None:
    try:
        import torch  # noqa: PLC0415
        from torch.utils.data import DataLoader, Dataset  # noqa: PLC0415
    except ImportError:
        return None
    torch.set_num_threads(1)
    work = _Sample(ds)

    class Folder(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            x, y = work(i % len(ds), np.random.default_rng(i))
            return torch.from_numpy(x), y

    loader = DataLoader(
        Folder(),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=False,
    )
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    count = sum(len(y) for _, y in it)
    return count / (time.perf_counter() - t0)


def hdf5_rate(workers: int, batch: int, n: int = 50000) -> tuple[float, float, str]:
    """(images/s with augment none, with crop4+flip) on uint8 32x32x3 shards; and the dir."""
    from hpcdl.data.convert import write_dataset  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="hpcdl-bench-"))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    write_dataset(
        tmp, {"train": (x, rng.integers(0, 10, n))}, [str(i) for i in range(10)], shard_size=10000
    )
    ds = open_dataset(tmp / "train")
    plain = hpcdl_rate(ds, workers, batch, "none", n)
    aug = hpcdl_rate(ds, workers, batch, "crop4+flip", n)
    return plain, aug, str(tmp)


def overlap(data: str, workers: int, batch: int, steps: int = 40) -> list[dict]:
    """Step time with a compute phase (sleep) of 0.5, 1 and 2 x the load time per batch."""
    ds = open_dataset(Path(data) / "train")
    load_s = batch / hpcdl_rate(ds, workers, batch, "crop4+flip", len(ds))
    rows = []
    for factor in (0.5, 1.0, 2.0):
        compute_s = factor * load_s
        with Loader(
            ds, batch, workers=workers, prefetch=max(4, 2 * workers), seed=0, augment="crop4+flip"
        ) as loader:
            batches = (_batches(len(ds), batch) * 4)[: steps + 1]
            it = loader.iterate(batches, 0)
            next(it)
            t0 = time.perf_counter()
            for _ in it:
                time.sleep(compute_s)
            step = (time.perf_counter() - t0) / steps
        rows.append(
            {
                "compute_over_load": factor,
                "load_s": load_s,
                "compute_s": compute_s,
                "step_s": step,
                "step_over_max": step / max(compute_s, load_s),
            }
        )
    return rows


def h2d_overlap(workers: int, batch: int = 256, steps: int = 30, n: int = 4096) -> dict:
    """GPU: step time with a device compute phase, host batches uploaded synchronously
    (cupy.asarray from the loader's slot) vs by DevicePrefetcher (pinned, own stream).

    Images are uint8 3x64x64 (a 12 MiB float32 batch at B = 256), so the upload is visible;
    the compute phase is sized to about twice one synchronous upload."""
    import cupy as cp  # noqa: PLC0415

    from hpcdl.data.device import DevicePrefetcher  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="hpcdl-bench-h2d-"))
    ds = _h2d_dataset(tmp, n)
    batches = (_batches(n, batch) * (steps // (n // batch) + 2))[: steps + 1]
    a = cp.random.standard_normal((1024, 1024), dtype=cp.float32)
    sync = cp.cuda.get_current_stream().synchronize

    def compute(images, reps: int) -> None:
        images.sum()  # the step reads its batch
        for _ in range(reps):
            a @ a

    def timed(fn) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    host = np.ones((batch, 3, 64, 64), np.float32)
    copy_s = min(timed(lambda: cp.asarray(host)) for _ in range(5))
    per_rep = timed(lambda: compute(cp.asarray(host), 50)) / 50
    reps = max(1, int(2 * copy_s / per_rep))
    compute_s = min(timed(lambda: compute(cp.asarray(host), reps)) for _ in range(3)) - copy_s
    result = {"batch_bytes": host.nbytes, "upload_s": copy_s, "compute_s": compute_s}
    with Loader(ds, batch, workers=workers, prefetch=max(4, 2 * workers), seed=0) as loader:
        for name, step in (
            ("load", lambda images: None),
            ("sync", lambda images: compute(cp.asarray(images), reps)),
            ("prefetch", lambda images: compute(images, reps)),
        ):
            it = loader.iterate(batches, 0)
            it = iter(DevicePrefetcher(it, cp)) if name == "prefetch" else it
            next(it)
            t0 = time.perf_counter()
            for images, _ in it:
                step(images)
                sync()
            result[f"{name}_s" if name == "load" else f"{name}_step_s"] = (
                time.perf_counter() - t0
            ) / steps
    bound = max(result["compute_s"], result["load_s"])
    result["sync_step_over_max"] = result["sync_step_s"] / bound
    result["prefetch_step_over_max"] = result["prefetch_step_s"] / bound
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def _h2d_dataset(tmp: Path, n: int) -> Any:
    """n random uint8 64x64 RGB images, 10 classes, as HDF5 shards in tmp; the train split."""
    from hpcdl.data.convert import write_dataset  # noqa: PLC0415

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
    write_dataset(tmp, {"train": (x, rng.integers(0, 10, n))}, [str(i) for i in range(10)])
    return open_dataset(tmp / "train")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdl.bench loader",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--data", required=True, help="JPEG folder root/<class>/<file> (required)")
    p.add_argument(
        "--make-jpegs", type=int, default=0, help="first write N 256x256 JPEGs (0: none)"
    )
    p.add_argument("--workers", type=int, default=2, help="loader worker processes")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch")
    p.add_argument("--max-images", type=int, default=2048, help="images read per measurement")
    p.add_argument(
        "--augment",
        default=f"rcrop{CROP}+flip",
        help="per-sample work of the JPEG measurement (hpcdl.data.augment; e.g. rrc224+flip, "
        "ImageNet-style random-resized crops) (default: rcrop224+flip)",
    )
    p.add_argument("--skip-hdf5", action="store_true", help="skip the HDF5 and overlap parts")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "gpu"),
        help="gpu: also measure the host-to-device overlap of DevicePrefetcher (needs CuPy)",
    )
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    return p


KINDS = {"hdf5": "HDF5 shards", "hdf5-encoded": "HDF5 shards", "tar": "tar shards"}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name, least in (("workers", 0), ("batch_size", 1), ("max_images", 1), ("make_jpegs", 0)):
        if getattr(args, name) < least:
            ap.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    root = Path(args.data)
    if args.make_jpegs and not (root.exists() and any(root.iterdir())):
        make_jpegs(root, args.make_jpegs)
    ds = open_dataset(root)
    if ds.kind != "folder":  # the torch and ceiling rows open the folder's files themselves
        ap.error(
            f"--data {root} holds {KINDS.get(ds.kind, ds.kind)}; this benchmark times JPEG "
            "decoding and takes an image folder root/<class>/<file>.jpg (--make-jpegs N "
            "writes one into an empty or new --data)"
        )
    n = min(args.max_images, len(ds))
    k, b = args.workers, args.batch_size
    result: dict = {"workers": k, "batch_size": b, "images": n, "cores": os.cpu_count()}
    result["hpcdl_images_per_s"] = hpcdl_rate(ds, k, b, args.augment, n)
    result["augment"] = args.augment
    result["torch_images_per_s"] = torch_rate(ds, k, b, n)
    full, decode = ceiling_rate(ds, min(n, 256))
    result["single_process_images_per_s"] = full
    result["decode_only_images_per_s"] = decode
    result["ceiling_images_per_s"] = full * k
    if result["torch_images_per_s"]:
        result["vs_torch"] = result["hpcdl_images_per_s"] / result["torch_images_per_s"]
    result["vs_ceiling"] = result["hpcdl_images_per_s"] / result["ceiling_images_per_s"]
    if not args.skip_hdf5:
        plain, aug, h5dir = hdf5_rate(k, 256)
        result["hdf5_32x32_images_per_s"] = plain
        result["hdf5_32x32_crop4_flip_images_per_s"] = aug
        # the trainer needs a core of its own: overlap runs with the default worker count
        result["overlap_workers"] = default_workers()
        result["overlap"] = overlap(h5dir, default_workers(), 256)
        import shutil  # noqa: PLC0415

        shutil.rmtree(h5dir, ignore_errors=True)
    if args.device == "gpu":
        result["h2d"] = h2d_overlap(default_workers())
    for key, value in result.items():
        print(f"{key:36s} {value:.3f}" if isinstance(value, float) else f"{key:36s} {value}")
    if args.json:
        print(json.dumps(result))
    return 0
