"""PyTorch's DataLoader reading an image folder directly: the peer users run today.

    python -m tools.bench.torch_folder --data DIR --workers K --batch-size B --epochs E \
        --crop H,W [--json]

An ImageFolder-style data set (classes = sorted directory names, files listed with scandir,
nothing opened up front, as torchvision's ImageFolder does) whose `__getitem__` does the work
hpcdl's loader does with `--augment none`: open the file, decode it with Pillow, convert to RGB,
centre-crop to H x W, normalise with ImageNet's mean/std into float32 (C, H, W). DataLoader with
`num_workers=K`, `batch_size=B`, `shuffle=True`, `drop_last=True`, `persistent_workers=True`
(workers live across epochs, as hpcdl's do), default prefetch. No model step: the time is the
input pipeline alone, which favours the DataLoader against a training run. Prints the seconds
of each epoch; `--json` adds one JSON object last. Needs `torch` (the `bench` extra); hpcdl
never imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from hpcdl.data.imagefolder import IMAGE_SUFFIXES, IMAGENET_MEAN, IMAGENET_STD
from hpcdl.helpformat import HelpFormatter


def list_folder(root: Path) -> tuple[list[str], list[int]]:
    """(paths, labels) of root/<class>/<image>, sorted; listings only, no file opened."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name[0] != ".")
    paths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(
            e.name
            for e in os.scandir(root / name)
            if os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
        )
        paths += [str(root / name / f) for f in files]
        labels += [label] * len(files)
    return paths, labels


class CentreCropFolder:
    """Map-style data set: sample i = (float32 (3, H, W) tensor, label)."""

    def __init__(self, root: Path, crop: tuple[int, int]) -> None:
        self.paths, self.labels = list_folder(root)
        self.crop = crop
        self.scale = (1.0 / np.array(IMAGENET_STD, np.float32))[:, None, None]
        self.bias = (-np.array(IMAGENET_MEAN, np.float32))[:, None, None] * self.scale

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import torch  # noqa: PLC0415
        from PIL import Image  # noqa: PLC0415

        h, w = self.crop
        with Image.open(self.paths[i]) as im:
            if im.mode != "RGB":
                im = im.convert("RGB")
            top, left = (im.height - h) // 2, (im.width - w) // 2
            x = np.asarray(im.crop((left, top, left + w, top + h)))
        out = np.empty((3, h, w), np.float32)
        np.multiply(x.transpose(2, 0, 1), self.scale, out=out, dtype=np.float32)
        out += self.bias
        return torch.from_numpy(out), self.labels[i]


def run(root: Path, workers: int, batch: int, epochs: int, crop: tuple[int, int]) -> dict:
    import torch  # noqa: PLC0415
    from torch.utils.data import DataLoader  # noqa: PLC0415

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ds = CentreCropFolder(root, crop)
    loader = DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )
    seconds = []
    for _ in range(epochs):
        start = time.perf_counter()
        images = sum(len(y) for _, y in loader)
        seconds.append(time.perf_counter() - start)
    return {
        "images_per_epoch": images,
        "epoch_seconds": seconds,
        "total_s": time.perf_counter() - t0,
        "torch": torch.__version__,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.torch_folder",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--data", required=True, help="image folder root/<class>/<file> (required)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--batch-size", type=int, default=32, help="images per batch")
    ap.add_argument("--epochs", type=int, default=3, help="passes over the folder")
    ap.add_argument("--crop", required=True, help="H,W in pixels of the centre crop (required)")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        import torch  # noqa: F401, PLC0415
    except ImportError:
        print(
            "tools.bench.torch_folder: torch is not installed (pip install torch)", file=sys.stderr
        )
        return 2
    h, w = (int(v) for v in a.crop.split(","))
    result = run(Path(a.data), a.workers, a.batch_size, a.epochs, (h, w))
    for epoch, s in enumerate(result["epoch_seconds"]):
        print(f"epoch {epoch}: {s:.2f} s, {result['images_per_epoch'] / s:.0f} images/s")
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
