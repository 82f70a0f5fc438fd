"""webdataset's own loaders over tar shards: the peers of hpcdl's tar-shard loader.

    python -m tools.bench.wds_loaders --data DIR --loader {webloader,wids} --workers K \
        --batch-size B --crop H,W [--json]

`webloader`: `webdataset.WebDataset` (shards shuffled, split by worker, a 1,000-sample shuffle
buffer) batched and read by `webdataset.WebLoader` (streaming). `wids`: `wids.ShardListDataset`
(random access through its index of each tar) sampled by `wids.ShardedSampler` (shards
permuted, then samples within a shard) and read by torch's DataLoader. Both do per sample what
tools.bench.torch_folder does (hpcdl's `--augment none`): decode the `.jpg` member with Pillow,
convert to RGB, centre-crop to H x W, normalise into float32 (C, H, W); `.cls` is the label.
One epoch; images/s counts from the end of the first batch (worker start-up excluded), as
`python -m hpcdl.bench train --measure-load` does. Needs `webdataset` and `wids` (the `bench`
extra); hpcdl never imports this module.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcdl.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from hpcdl.helpformat import HelpFormatter

SHUFFLE_BUFFER = 1000


class CentreCrop:
    """JPEG bytes -> float32 (3, H, W) tensor: decode, RGB, centre crop, normalise."""

    def __init__(self, crop: tuple[int, int]) -> None:
        self.crop = crop
        self.scale = (1.0 / np.array(IMAGENET_STD, np.float32))[:, None, None]
        self.bias = (-np.array(IMAGENET_MEAN, np.float32))[:, None, None] * self.scale

    def __call__(self, data: bytes):
        import torch  # noqa: PLC0415
        from PIL import Image  # noqa: PLC0415

        h, w = self.crop
        with Image.open(io.BytesIO(data)) as im:
            if im.mode != "RGB":
                im = im.convert("RGB")
            top, left = (im.height - h) // 2, (im.width - w) // 2
            x = np.asarray(im.crop((left, top, left + w, top + h)))
        out = np.empty((3, h, w), np.float32)
        np.multiply(x.transpose(2, 0, 1), self.scale, out=out, dtype=np.float32)
        out += self.bias
        return torch.from_numpy(out)


def shard_paths(root: Path) -> list[Path]:
    return sorted(root.glob("*.tar"))


def webloader(root: Path, workers: int, batch: int, crop: tuple[int, int]):
    """WebDataset + WebLoader, streaming; an iterable of (images, labels) batches."""
    import webdataset as wds  # noqa: PLC0415

    transform = CentreCrop(crop)
    urls = [str(p) for p in shard_paths(root)]

    def sample(s: dict) -> tuple:
        return transform(s["jpg"]), int(s["cls"])

    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=0, nodesplitter=None, empty_check=False)
        .shuffle(SHUFFLE_BUFFER)
        .map(sample)
        .batched(batch, partial=False)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def wids_loader(root: Path, workers: int, batch: int, crop: tuple[int, int], cache: Path):
    """wids.ShardListDataset + ShardedSampler + torch DataLoader, random access."""
    import torch  # noqa: PLC0415
    import wids  # noqa: PLC0415
    from torch.utils.data import DataLoader  # noqa: PLC0415

    transform = CentreCrop(crop)
    shards = []
    for path in shard_paths(root):
        with tarfile.open(path) as tar:
            count = sum(1 for m in tar if m.name.endswith(".jpg"))
        shards.append({"url": str(path), "nsamples": count})

    def sample(s: dict) -> tuple:
        return transform(s[".jpg"].read() if hasattr(s[".jpg"], "read") else s[".jpg"]), int(
            s[".cls"].read() if hasattr(s[".cls"], "read") else s[".cls"]
        )

    ds = wids.ShardListDataset(shards, cache_dir=str(cache), transformations=[sample])
    return DataLoader(
        ds,
        batch_size=batch,
        sampler=wids.ShardedSampler(ds),
        num_workers=workers,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )


def run(a: argparse.Namespace) -> dict:
    """One epoch of the chosen loader: images, seconds after the first batch, images/s."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    crop = tuple(int(v) for v in a.crop.split(","))
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-wids-") as cache:
        if a.loader == "webloader":
            loader = webloader(Path(a.data), a.workers, a.batch_size, crop)
        else:
            loader = wids_loader(Path(a.data), a.workers, a.batch_size, crop, Path(cache))
        t0 = time.perf_counter()
        count, start, first = 0, 0.0, 0
        for _, labels in loader:
            count += len(labels)
            if not first:
                first, start = count, time.perf_counter()
        seconds = time.perf_counter() - start
    return {
        "loader": a.loader,
        "images": count,
        "seconds": seconds,
        "total_s": time.perf_counter() - t0,
        "images_per_s": (count - first) / seconds if seconds > 0 else None,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.wds_loaders",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--data", required=True, help="directory of *.tar shards (required)")
    ap.add_argument("--loader", choices=("webloader", "wids"), required=True, help="which one")
    ap.add_argument("--workers", type=int, default=2, help="loader worker processes")
    ap.add_argument("--batch-size", type=int, default=32, help="images per batch")
    ap.add_argument("--crop", required=True, help="H,W in pixels of the centre crop (required)")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        import torch  # noqa: F401, PLC0415
        import webdataset  # noqa: F401, PLC0415
        import wids  # noqa: F401, PLC0415
    except ImportError as exc:
        print(f"tools.bench.wds_loaders: {exc.name} is not installed (pip install "
              "webdataset wids torch: the bench extra)", file=sys.stderr)  # fmt: skip
        return 2
    result = run(a)
    print(f"{a.loader}: {result['images']} images, {result['images_per_s']:.0f} images/s")
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
