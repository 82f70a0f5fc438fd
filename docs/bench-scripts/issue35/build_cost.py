"""ms per sample of hpcdl.data's BatchBuilder, batches of 8 from node-local copies of 960 PNGs:
calibrate's way (4 batches of 32 samples, cycled) against a job's (all 960, permuted). On one
core, no MPI (docs/PERFORMANCE.md, issue 35, "Where the step goes"). Usage: build_cost.py"""

import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[3])]  # the repository root

import numpy as np  # noqa: E402

from hpcdl.data import open_dataset  # noqa: E402
from hpcdl.data.augment import parse_augment  # noqa: E402
from hpcdl.data.batch import BatchBuilder, output_shape  # noqa: E402
from hpcdl.data.dataset import default_locate  # noqa: E402
from tools.bench.validate import make_images  # noqa: E402

with tempfile.TemporaryDirectory() as scratch:
    scratch = Path(scratch)
    root = make_images(scratch / "pfs", 960)
    ds = open_dataset(root)
    local = scratch / "local"
    shutil.copytree(root, local)
    aug = parse_augment("none")
    perm = np.random.default_rng(0).permutation(960)
    ways = {"calibrate: 4 batches of 32 samples": lambda k: (k % 4) * 8 + np.arange(8),
            "a job: all 960, permuted": lambda k: perm[k * 8:(k + 1) * 8]}  # fmt: skip
    for name, batch in ways.items():
        builder = BatchBuilder(ds, aug, seed=0, locate=default_locate(local, ds.files))
        images = np.empty((8, *output_shape(ds, aug)), np.float32)
        labels = np.empty(8, np.int64)
        for _ in range(3):
            began = time.perf_counter()
            for k in range(120):
                builder.build(batch(k), 0, True, images, labels)
            print(f"{name}: {(time.perf_counter() - began) / 960 * 1e3:.3f} ms per sample")
