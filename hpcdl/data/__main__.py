"""`python -m hpcdl.data convert ...` and `python -m hpcdl.data inspect PATH`.

convert digits OUT [--val-fraction 0.2] [--shard-size N] [--seed S]
convert folder SRC OUT [--resize S] [--val-fraction F] [--shard-size N] [--seed S]
convert folder SRC OUT --encoded [--shard-size N|256MB] [--val-fraction F] [--seed S]
                                            (HDF5 shards of the image files' bytes)
convert folder SRC OUT --to tar [--shard-size N|256MB]  (WebDataset tar shards, classes.json)
convert cifar SRC OUT [--shard-size N]      (CIFAR-10/100 python pickle batches)
convert npz SRC.npz OUT [--val-fraction F] [--shard-size N] [--seed S]
inspect PATH                                (HDF5 file or shards, tar shards, image folder)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from hpcdl.data import convert, convert_files, convert_npz
from hpcdl.data.dataset import DataError
from hpcdl.data.kinds import open_dataset
from hpcdl.helpformat import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdl.data",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "convert",
        help="write HDF5 shards (OUT/train, OUT/val) or tar shards",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    c.add_argument(
        "kind",
        choices=("digits", "folder", "cifar", "npz"),
        help="digits: scikit-learn's digits (no SRC); folder: an image folder SRC/<class>/; "
        "cifar: a directory SRC of CIFAR-10/100 python pickles; npz: a .npz SRC with images, "
        "labels",
    )
    c.add_argument(
        "paths", nargs="+", metavar="[SRC] OUT", help="source (except for digits) and output dir"
    )
    c.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="fraction of the samples held out for OUT/val; each split keeps at least one "
        "(default: digits 0.2, others 0)",
    )
    c.add_argument(
        "--shard-size",
        default=str(convert.DEFAULT_SHARD_SIZE),
        help="samples per shard file (1000), or bytes per shard (256MB, 1GiB)",
    )
    add_file_bytes_options(c)
    c.add_argument("--seed", type=int, default=0, help="seed of the train/val split, >= 0")
    c.add_argument(
        "--resize",
        type=int,
        default=None,
        help="folder: resize every image to S x S pixels, S >= 1 (needed for mixed sizes) "
        "(default: keep the size)",
    )
    i = sub.add_parser(
        "inspect",
        help="print counts, shapes, classes and bytes",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    i.add_argument(
        "path",
        help="an HDF5 file, a directory of HDF5 or tar shards, a shard pattern "
        "shard-{000000..000099}.tar, or an image folder",
    )
    return p


def add_file_bytes_options(c: argparse.ArgumentParser) -> None:
    """convert folder's options for shards that keep each image file's bytes."""
    c.add_argument(
        "--encoded",
        action="store_true",
        help="folder: HDF5 shards of each image file's original bytes, decoded at load "
        "(no decode, no resize now)",
    )
    c.add_argument(
        "--to",
        choices=("hdf5", "tar"),
        default="hdf5",
        help="folder: tar writes WebDataset tar shards OUT/shard-NNNNNN.tar (KEY.jpg + KEY.cls) "
        "and OUT/classes.json, keeping each file's bytes",
    )


def run_convert(args) -> list[Path]:
    want = 1 if args.kind == "digits" else 2
    if len(args.paths) != want:
        usage = "OUT" if want == 1 else "SRC OUT"
        raise DataError(f"convert {args.kind} takes {usage}, got {' '.join(args.paths)}")
    out = Path(args.paths[-1])
    size = convert_files.parse_shard_size(args.shard_size)
    if args.seed < 0:
        raise DataError(f"--seed must be >= 0, got {args.seed}")
    if args.resize is not None and args.resize < 1:
        raise DataError(f"--resize must be >= 1 (pixels a side), got {args.resize}")
    default_val = 0.2 if args.kind == "digits" else 0.0
    val_fraction = default_val if args.val_fraction is None else args.val_fraction
    if args.encoded or args.to == "tar":
        return convert_file_bytes(args, size, val_fraction)
    if args.kind == "cifar":
        splits, classes = convert.cifar_arrays(args.paths[0])
        return convert.write_dataset(out, splits, classes, _rows(size, splits))
    if args.kind == "npz":
        splits, classes = convert_npz.npz_arrays(args.paths[0])
        if "val" in splits or not val_fraction:
            return convert.write_dataset(out, splits, classes, _rows(size, splits))
        images, labels = splits["train"]
    elif args.kind == "digits":
        images, labels, classes = convert.digits_arrays()
    else:
        folder = convert_files.folder_files(args.paths[0], out)  # refuses OUT inside it
        images = convert.folder_arrays(folder.root, folder.relpaths, args.resize)
        labels, classes = folder.labels, folder.classes
    train, val = convert.split(images, labels, val_fraction, args.seed)
    splits = {"train": train} if val is None else {"train": train, "val": val}
    return convert.write_dataset(out, splits, classes, _rows(size, splits))


def _rows(size: convert_files.ShardSize, splits: dict) -> int:
    """Samples per shard of decoded pixels."""
    return size.rows(splits["train"][0][0].nbytes)


def convert_file_bytes(args, size: convert_files.ShardSize, val_fraction: float) -> list[Path]:
    """--encoded and --to tar: shards of an image folder's file bytes."""
    what = "--to tar" if args.to == "tar" else "--encoded"
    if args.kind != "folder":
        raise DataError(
            f"{what} converts an image folder (convert folder SRC OUT), not {args.kind}"
        )
    if args.resize:
        raise DataError(f"{what} keeps each image file's bytes; --resize needs decoded shards")
    folder = convert_files.folder_files(args.paths[0], args.paths[1])
    if args.to == "hdf5":
        return convert_files.write_encoded(folder, args.paths[1], size, val_fraction, args.seed)
    if val_fraction:
        raise DataError(
            "--to tar writes one split; make a folder per split and convert each, instead of "
            "--val-fraction"
        )
    return convert_files.write_tar(folder, args.paths[1], size)


def describe(path: str | Path) -> str:
    ds = open_dataset(path)
    readable = ds.readable if ds.kind == "tar" else np.ones(len(ds), bool)  # tar: the flawless
    counts = np.bincount(ds.labels[readable], minlength=ds.num_classes)
    names = ", ".join(f"{c}: {n}" for c, n in zip(ds.classes[:20], counts[:20]))
    more = f", ... ({ds.num_classes - 20} more)" if ds.num_classes > 20 else ""
    total = int(ds.files.sizes.sum())
    lines = [
        f"{path}: {ds.kind} data set",
        f"  samples:      {len(ds)} in {len(ds.files)} file(s), {total} bytes "
        f"({total / (1 << 20):.1f} MiB)",
        f"  sample shape: {tuple(ds.sample_shape)} (C, H, W) model input",
        f"  stored as:    {_stored_as(ds)}",
        f"  classes:      {ds.num_classes} ({names}{more})",
    ]
    beyond = ds.labels_beyond() if ds.kind == "tar" else ""
    if beyond:
        lines.append(f"  not classes:  {beyond}; training stops at its start until they are named")
    flawed = int((~readable).sum()) - (ds.index.meta["beyond"].get("count", 0) if beyond else 0)
    if flawed:
        lines.append(f"  unreadable:   {flawed} samples (a flaw each: bad samples when read)")
    if ds.kind == "folder" and not np.all(ds.heights > 0):
        bad = np.flatnonzero(ds.heights <= 0)
        lines.append(
            f"  unreadable:   {len(bad)} image(s) whose header cannot be read or that are too "
            f"large, the first {ds.files.relpath(int(bad[0]))} (bad samples when read)"
        )
    lines.append(
        f"  mean / std:   {np.round(ds.mean, 3).tolist()} / {np.round(ds.std, 3).tolist()}"
    )
    return "\n".join(lines)


def _stored_as(ds) -> str:
    """How the samples are kept: encoded image bytes (decoded on read) or pixel arrays."""
    if ds.kind == "tar":
        return "image members (JPEG, PNG or WebP bytes), decoded on read to uint8 HWC"
    if ds.kind == "folder":
        return "image files (JPEG, PNG), decoded on read to uint8 HWC"
    if getattr(ds, "encoded", False):
        return "image files (encoded), decoded at load"
    shape = f" {tuple(ds.stored_shape)}" if hasattr(ds, "stored_shape") else ""
    return f"{np.dtype(ds.dtype).name} {ds.layout}{shape}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            print(describe(args.path))
        else:
            written = run_convert(args)
            if args.to == "tar":
                print(
                    f"wrote {len(written)} tar shard(s) {written[0].name} ... {written[-1].name} "
                    f"and {convert_files.CLASSES_NAME} in {args.paths[-1]}"
                )
            for d in [] if args.to == "tar" else written:
                print(f"wrote {d}")
                print(describe(d))
    except DataError as exc:
        print(f"hpcdl.data: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
