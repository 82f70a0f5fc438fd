"""Issue 48's loader A/B (docs/PERFORMANCE.md, "The loader bench, quiet VM, same day"):
hpcdl.data.Loader over a JPEG folder, 2 workers, 4 slots, rcrop224+flip, 3 epochs; per epoch
the images/s of the 63 batches after its first and the loader workers' CPU per image; then
one process building 24 batches alone (BatchBuilder.build), 3 repeats.

    python docs/bench-scripts/issue48/loader_ab.py LABEL DATA   # DATA: bench loader's 2048 JPEGs

Run it alternately with each side's interpreter, from a directory that holds no hpcdl tree (the
workers start with `python -m`, which puts the current directory first); see PERFORMANCE.md for
the old side's venv. Each line names the hpcdl it ran.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

import hpcdl
from hpcdl.data import open_dataset
from hpcdl.data.augment import parse_augment
from hpcdl.data.batch import BatchBuilder, output_shape
from hpcdl.data.loader import Loader
from hpcdl.data.sampler import DistributedSampler

TICK = os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """User + system seconds of this process's children (the loader workers), from /proc."""
    me, total = os.getpid(), 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def main(label: str, data: str) -> None:
    ds = open_dataset(data)
    out = []
    with Loader(ds, 32, workers=2, prefetch=4, seed=0, augment="rcrop224+flip") as loader:
        for epoch in range(3):
            it = loader.iterate(DistributedSampler(len(ds), seed=0).batches(epoch, 32), epoch)
            next(it)  # the clock starts after the epoch's first batch
            c0, t0 = children_cpu_s(), time.perf_counter()
            count = sum(len(y) for _, y in it)
            wall, cpu = time.perf_counter() - t0, children_cpu_s() - c0
            out.append(f"{count / wall:.0f} images/s, workers {1000 * cpu / count:.3f} ms/image")
    print(label, " | ".join(out), f"({Path(hpcdl.__file__).parent})")
    print(label, "one process:", " ".join(f"{r:.0f}" for r in build_rates(ds)), "images/s")


def build_rates(ds) -> list[float]:
    aug = parse_augment("rcrop224+flip")
    builder = BatchBuilder(ds, aug, 0)
    x, y = np.empty((32, *output_shape(ds, aug)), np.float32), np.empty(32, np.int64)
    batches = DistributedSampler(len(ds), seed=0).batches(0, 32)[:24]
    builder.build(batches[0], 0, True, x, y)
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        for indices in batches:
            builder.build(indices, 0, True, x, y)
        rates.append(len(batches) * 32 / (time.perf_counter() - t0))
    return rates


if __name__ == "__main__":
    main(*sys.argv[1:3])
