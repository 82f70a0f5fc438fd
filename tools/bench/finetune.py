"""`python -m tools.bench finetune`: resnet18 fine-tuned from a state dict vs from scratch.

The fine-tuning example of docs/models.md, measured. No pretrained download is possible on a
cluster's compute nodes (nor here), so the "pretrained" weights come from pretraining hpcdl's
own resnet18 on another generated task and exporting them as a PyTorch state dict (or
safetensors without PyTorch) with `python -m hpcdl.export`, exactly as a torchvision file
would be used:

1. pretrain: 8 classes of oriented colour gratings in noise (JPEG folder), --pretrain-epochs;
2. export the last checkpoint to OUT/pretrained.pth;
3. target: a 4-class JPEG folder of gratings at other orientations and another frequency; for
   each seed, 1 epoch with `--init-from OUT/pretrained.pth` (the 8-class head is re-initialised
   for 4 classes) and 1 epoch from scratch, same flags otherwise.

Prints one line per run and, with --json, a last line: the validation accuracy of every run
and the mean of each arm. Every run is `mpirun -np RANKS python -m hpcdl.train` (a plain
process for RANKS 1), as a user would run it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from hpcdl.bench import synthetic
from hpcdl.bench.launch import mpirun_command
from hpcdl.helpformat import HelpFormatter

PRETRAIN_ANGLES = tuple(np.pi * k / 8 for k in range(8))
TARGET_ANGLES = tuple(np.pi * (k / 4 + 1 / 16) for k in range(4))


def make_gratings(
    root: Path, angles: tuple[float, ...], per_class: int, size: int, freq: float, seed: int
) -> None:
    """root/c<k>/<i>.jpg: a sinusoidal grating at angles[k] with a random phase, a random
    colour tint and Gaussian noise (std 60 of 255), quality 90."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    for k, angle in enumerate(angles):
        d = root / f"c{k}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            wave = np.sin(
                2 * np.pi * freq * (xx * np.cos(angle) + yy * np.sin(angle))
                + rng.uniform(0, 2 * np.pi)
            )
            tint = rng.uniform(0.3, 1.0, 3)
            img = 127 + 100 * wave[..., None] * tint + rng.normal(0, 60, (size, size, 3))
            synthetic.save(d / f"{i:05d}.jpg", np.clip(img, 0, 255).astype(np.uint8))


def train(ranks: int, *args: object) -> float:
    """Run hpcdl.train; its final validation accuracy."""
    cmd = [sys.executable, "-m", "hpcdl.train", *map(str, args), "--progress", "none"]
    if ranks > 1:
        cmd = [*mpirun_command(ranks), *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-2000:]
        raise SystemExit(f"tools.bench finetune: {' '.join(cmd)} failed:\n{output}")
    found = re.search(r"final val_acc ([0-9.]+)", done.stdout)
    return float(found.group(1))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench finetune",
        description=__doc__,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--out", required=True, help="work directory (data, checkpoints, weights)")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks of every run")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the target runs")
    p.add_argument("--size", type=int, default=16, help="image side in pixels")
    p.add_argument("--pretrain-per-class", type=int, default=300, help="pretraining images/class")
    p.add_argument("--pretrain-epochs", type=int, default=2, help="epochs of pretraining")
    p.add_argument("--target-per-class", type=int, default=60, help="training images per class")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate of every run")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    make_data(args, out)
    weights = pretrain(args, out)
    results: dict[str, list[float]] = {"init_from": [], "scratch": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        for arm, extra in (("init_from", ("--init-from", weights)), ("scratch", ())):
            data = ("--data", out / "target/train", "--val-data", out / "target/val")
            flags = ("--epochs", 1, "--lr", args.lr, "--seed", seed, *extra)
            acc = train(args.ranks, *data, *common_flags(args), *flags)
            results[arm].append(acc)
            print(f"target: 4 classes, 1 epoch, seed {seed}, {arm}: val_acc {acc:.4f}")
    means = {arm: float(np.mean(v)) for arm, v in results.items()}
    print(f"mean val_acc: init_from {means['init_from']:.4f}, scratch {means['scratch']:.4f}")
    if args.json:
        record = {"val_acc": results, "mean": means, "ranks": args.ranks, "size": args.size}
        print(json.dumps({**record, "pretrain_epochs": args.pretrain_epochs}))
    return 0


def common_flags(args: argparse.Namespace) -> tuple:
    return ("--model", "resnet18", "--batch-size", args.batch_size)


def make_data(args: argparse.Namespace, out: Path) -> None:
    """The pretraining and target JPEG folders under out (kept between runs)."""
    data = {
        "pre/train": (PRETRAIN_ANGLES, args.pretrain_per_class, 0.15, 1),
        "pre/val": (PRETRAIN_ANGLES, 50, 0.15, 2),
        "target/train": (TARGET_ANGLES, args.target_per_class, 0.09, 3),
        "target/val": (TARGET_ANGLES, 100, 0.09, 4),
    }
    for name, (angles, per_class, freq, seed) in data.items():
        if not (out / name).exists():
            make_gratings(out / name, angles, per_class, args.size, freq, seed)


def pretrain(args: argparse.Namespace, out: Path) -> Path:
    """Pretrain resnet18 on the 8-class task and export its state dict (kept between runs):
    .pth with PyTorch installed, else .safetensors."""
    has_torch = importlib.util.find_spec("torch") is not None
    weights = out / ("pretrained.pth" if has_torch else "pretrained.safetensors")
    if weights.exists():
        return weights
    shutil.rmtree(out / "pre_ckpt", ignore_errors=True)
    data = ("--data", out / "pre/train", "--val-data", out / "pre/val")
    flags = ("--epochs", args.pretrain_epochs, "--lr", args.lr, "--seed", 100)
    acc = train(
        args.ranks, *data, *common_flags(args), *flags, "--checkpoint-dir", out / "pre_ckpt"
    )
    print(f"pretrain: 8 classes, {args.pretrain_epochs} epochs: val_acc {acc:.4f}")
    last = sorted((out / "pre_ckpt").glob("ckpt-*.h5"))[-1]
    to = "torch" if has_torch else "safetensors"
    export = [sys.executable, "-m", "hpcdl.export", str(last), "--to", to, str(weights)]
    subprocess.run(export, check=True)
    return weights
