"""`bench calibrate`'s input figure: what one sample costs where the rank builds its own batch.

With `--workers 0` a rank reads, decodes and augments every sample of its batch itself, between
two steps; with loader workers that work moves to their processes (hpcdl.clustermodel.equations,
input_time). The figure is timed on the job's own data: each node's leader copies a few samples'
files of --data into a temporary directory inside --stage-dir (as staging would: the loader
then reads node-local copies, not the PFS), and every rank builds batches of them with
hpcdl.data's BatchBuilder, as the loader does in the rank, with the job's --augment, inside the
trainer-step loop of `bench calibrate` (so the ranks build at once, as they do in training).

At most --local-mb MB is copied: samples spread over the data set, else (files larger than
that in all, such as HDF5 shards) the first ones; where even that does not fit, or --data is not
a data set hpcdl.train reads, the figure is not measured (0: the model charges no loading), and
the calibration says why. The directory is removed afterwards, with any stage dir made for it
(hpcdl.bench.stage_scratch).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.bench.stage_scratch import scratch_dir

BATCHES = 4  # distinct batches cycled through: the reads are of node-local copies either way


class InputSamples:
    """A few samples of the data set, copied to a node-local directory; build() fills one batch
    (the next of BATCHES) as hpcdl.data's loader does in the rank."""

    def __init__(self, ds: Any, root: Path, indices: np.ndarray, batch: int, augment: str) -> None:
        from hpcdl.data.augment import parse_augment  # noqa: PLC0415
        from hpcdl.data.batch import BatchBuilder, output_shape  # noqa: PLC0415
        from hpcdl.data.dataset import default_locate  # noqa: PLC0415

        aug = parse_augment(augment)
        self.builder = BatchBuilder(ds, aug, seed=0, locate=default_locate(root, ds.files))
        self.batches = [indices[(k * batch + np.arange(batch)) % len(indices)]
                        for k in range(BATCHES)]  # fmt: skip
        self.images = np.empty((batch, *output_shape(ds, aug)), np.float32)
        self.labels = np.empty(batch, np.int64)
        self.count = 0

    def build(self) -> None:
        batch = self.batches[self.count % BATCHES]
        self.builder.build(batch, 0, True, self.images, self.labels)
        self.count += 1

    def close(self) -> None:
        self.builder.reader.close()


def choose(ds: Any, wanted: int, budget_bytes: int) -> np.ndarray | None:
    """Sample indices whose files fit budget_bytes: spread over the data set, else the first
    ones (one shard's worth); None when not even those fit."""
    n = len(ds)
    spread = np.unique(np.linspace(0, n - 1, min(n, wanted)).astype(np.int64))
    first = np.arange(min(n, wanted), dtype=np.int64)
    for indices in (spread, first):
        files = np.unique(ds.file_ids(indices))
        if int(np.asarray(ds.files.sizes)[files].sum()) <= budget_bytes:
            return indices
    return None


def copy_files(ds: Any, data: Path, indices: np.ndarray, into: Path) -> None:
    """The files holding these samples, from data to the same relative paths under into."""
    for file_id in np.unique(ds.file_ids(indices)).tolist():
        rel = ds.files.relpath(file_id)
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data / rel, into / rel)


@contextlib.contextmanager
def input_samples(
    world: Any, data: Path, stage_dir: Path, batch: int, augment: str, budget_mb: int
) -> Iterator[tuple[InputSamples | None, str]]:
    """(samples or None, a note of what was timed, or why not) on every rank; collective. The
    copies live in a scratch directory of stage_dir (hpcdl.bench.stage_scratch)."""
    from hpcdl.data import DataError, open_dataset  # noqa: PLC0415

    try:
        ds = open_dataset(data)
    except (DataError, OSError, ValueError) as exc:
        yield None, f"not measured: --data {data} is not a data set hpcdl.train reads ({exc})"
        return
    wanted = BATCHES * batch
    indices = choose(ds, wanted, budget_mb * 1_000_000)
    if indices is None:
        yield None, f"not measured: {wanted} samples' files of --data are over --local-mb MB"
        return
    with contextlib.ExitStack() as scratch:
        where = None
        if world.local_rank == 0:
            where = scratch.enter_context(scratch_dir(stage_dir, ".hpcdl-calibrate-input."))
            copy_files(ds, data, indices, where)
        where = world.node_comm.bcast(where, root=0)
        samples = InputSamples(ds, where, indices, batch, augment)
        try:
            yield samples, (f"{len(indices)} samples of --data, node-local copies, --augment "
                            f"{augment}")  # fmt: skip
        finally:
            samples.close()
            world.node_comm.Barrier()  # every rank on the node is done with the copies
